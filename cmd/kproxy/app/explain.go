package app

// kproxy explain: what this node's kproxy decides for a Service, and why,
// from the shared model (package proxier/explain), and whether the node's
// live rules agree (a trace of the same flows, package proxier/trace).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier/explain"
	"github.com/kproxy/kproxy/proxier/trace"
)

// Exit codes of kproxy explain beyond 0 (the rules agree, or there are none
// to compare with) and 1 (an error: bad input, the API server, the rules
// could not be read).
const (
	// exitMismatch: the node's live rules disagree with the decisions.
	exitMismatch = 2
)

// exitError is an error with its own exit code (Main).
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// ExitCode is the process exit code.
func (e *exitError) ExitCode() int { return e.code }

// explainAgentFlags are the agent's flags that kproxy explain reads, with
// the agent's meaning (and --config, whose file fills in the others).
var explainAgentFlags = []string{
	"kubeconfig", "master", "hostname-override", "cluster-cidr", "masquerade-all", "bind-address",
	"nodeport-addresses", "service-proxy-name", "kube-api-content-type", "config",
}

// explainDeps are kproxy explain's connections; nil fields mean the real
// ones.
type explainDeps struct {
	client kubernetes.Interface
	// open reads the node's rules of a family (trace.go).
	open           traceSource
	localAddresses func() ([]netip.Addr, error)
}

// newExplainCommand builds `kproxy explain`.
func newExplainCommand(stdout io.Writer, deps explainDeps) *cobra.Command {
	if deps.open == nil {
		deps.open = openLiveTraceSource
	}
	if deps.localAddresses == nil {
		deps.localAddresses = netlink.HostAddresses
	}
	o := NewOptions()
	output, timeout := "text", 30*time.Second
	cmd := &cobra.Command{
		Use:   "explain NAMESPACE/NAME[:PORT] [-o text|json]",
		Short: "Explain what this node's kproxy does with a Service's traffic, and check the live rules agree",
		Long: `kproxy explain reads a Service, its EndpointSlices and this node's Node (and
the other Nodes' labels when the Service has topologyKeys) once from the API
server, and computes what kproxy decides for it on this node, with the
agent's own code: for each kind of destination (ClusterIP, NodePort,
ExternalIP, LoadBalancer IP) and each source (a pod, the node itself,
anyone else), the endpoints a new connection may go to and why (ready or
terminating fallback, internal and external traffic policy, topology hints
of trafficDistribution, topologyKeys with the label values that matched),
or why it is dropped or rejected, masquerade, session affinity and
loadBalancerSourceRanges.

It then traces each of these connections through this node's live rules
(as kproxy trace does) and reports whether they agree. A mismatch means the
rules are stale (the agent has not synced, or is stuck) or were changed by
someone else.

Give it the agent's flags (--kubeconfig, --hostname-override,
--cluster-cidr, --nodeport-addresses, ... or --config with the agent's
file) so that it decides as the agent does. PORT selects one port by name
or number.

Exit status: 0 when the live rules agree, or when this node holds no kproxy
rules of the mode (the comparison is skipped and says so; IPVS mode cannot
be traced yet); 2 when the live rules disagree; 1 on any error.`,
		Args:          cobra.ExactArgs(1),
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			nn, port, err := explain.ParseServiceArg(args[0])
			if err != nil {
				return err
			}
			if output != "text" && output != "json" {
				return fmt.Errorf("-o %q: want text or json", output)
			}
			logger := klog.Background()
			if err := o.applyConfigFile(cmd.Flags(), logger); err != nil {
				return err
			}
			if err := o.validateForExplain(); err != nil {
				return err
			}
			name, err := nodeName(o)
			if err != nil {
				return err
			}
			ctx, cancel := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			client := deps.client
			if client == nil {
				if client, err = explainClient(o); err != nil {
					return err
				}
			}
			cidrs, _ := o.clusterCIDRs()
			x, err := explain.Explain(ctx, explain.Options{
				Client: client, NodeName: name, Service: nn, Port: port,
				ServiceProxyName: o.ServiceProxyName, MasqueradeAll: o.MasqueradeAll, ClusterCIDRs: cidrs,
				NodeIPs: func(node *v1.Node) map[v1.IPFamily]netip.Addr { return primaryNodeIPs(node, o.BindAddress) },
				NodePortAddresses: func(fam v1.IPFamily, ip netip.Addr) (*proxy.NodePortAddresses, error) {
					return o.nodePortAddresses(fam, ip)
				},
				LocalAddresses: deps.localAddresses, Logger: logger,
			})
			if err != nil {
				return err
			}
			tracer, closeAll := liveTracer(deps.open, timeout)
			defer closeAll()
			x.Compare(ctx, o.ProxyMode, tracer)
			if output == "json" {
				err = x.WriteJSON(stdout)
			} else {
				err = x.WriteText(stdout)
			}
			if err != nil {
				return err
			}
			switch x.Live.Result {
			case explain.Mismatch:
				return &exitError{code: exitMismatch, err: fmt.Errorf("the live %s rules of this node disagree with kproxy's decisions for %s on %d flow(s): they are stale or were changed by someone else",
					x.Live.Mode, nn, x.Live.Mismatch)}
			case explain.Failed:
				return fmt.Errorf("comparing with the live rules: %s", x.Live.Detail)
			}
			return nil
		},
	}
	// The agent's flags, as the agent parses them.
	agent := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	o.AddFlags(agent)
	for _, f := range explainAgentFlags {
		cmd.Flags().AddFlag(agent.Lookup(f))
	}
	o.ProxyMode = ""
	fs := cmd.Flags()
	fs.StringVar(&o.ProxyMode, "proxy-mode", o.ProxyMode, "The agent's proxy mode, whose rules are compared: iptables, nftables or ipvs (default: the mode whose state the node holds; --config's mode when it has one)")
	fs.StringVarP(&output, "output", "o", output, "Output format: text or json")
	fs.DurationVar(&timeout, "timeout", timeout, "Bound on each iptables-save or nft run")
	return cmd
}

// validateForExplain checks the agent's settings that kproxy explain reads.
func (o *Options) validateForExplain() error {
	var errs []error
	switch o.ProxyMode {
	case "", ModeIPTables, ModeIPVS, ModeNFTables:
	default:
		errs = append(errs, fmt.Errorf("--proxy-mode=%q is not a proxy mode; use %s", o.ProxyMode, modeList))
	}
	if _, err := o.clusterCIDRs(); err != nil {
		errs = append(errs, err)
	}
	for _, err := range proxy.ValidateNodePortAddresses(o.NodePortAddresses) {
		errs = append(errs, fmt.Errorf("--nodeport-addresses: %w", err))
	}
	if o.BindAddress != "" && !parseIPSloppy(o.BindAddress).IsValid() {
		errs = append(errs, fmt.Errorf("--bind-address=%q is not an IP address", o.BindAddress))
	}
	return errors.Join(errs...)
}

// explainClient is an API client as the agent builds it, without the
// informers' retrying transport: explain reads once and fails fast.
func explainClient(o *Options) (kubernetes.Interface, error) {
	restCfg, err := clientcmd.BuildConfigFromFlags(o.Master, o.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("building API client config: %w", err)
	}
	restCfg.UserAgent = "kproxy-explain/" + Version
	restCfg.ContentType = o.KubeAPIContentType
	restCfg.Timeout = 30 * time.Second
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, fmt.Errorf("building API client: %w", err)
	}
	return client, nil
}

// liveTracer traces over the node's rules, opening each family's state
// once and reading each table once for every flow.
func liveTracer(open traceSource, timeout time.Duration) (explain.Tracer, func()) {
	var mu sync.Mutex
	sources := map[v1.IPFamily]trace.Source{}
	var closers []func()
	tr := func(ctx context.Context, r trace.Request) (*trace.Report, error) {
		fam := v1.IPv4Protocol
		if r.Destination.Is6() {
			fam = v1.IPv6Protocol
		}
		mu.Lock()
		src, ok := sources[fam]
		if !ok {
			var closeSrc func()
			src, closeSrc = open(ctx, fam, timeout)
			closers = append(closers, closeSrc)
			src = cachedSource(src)
			sources[fam] = src
		}
		mu.Unlock()
		return trace.Run(ctx, r, src)
	}
	return tr, func() {
		for _, c := range closers {
			c()
		}
	}
}

// cachedSource reads each table of src once.
func cachedSource(src trace.Source) trace.Source {
	out := src
	out.IPTables = map[v1.IPFamily]ipt.Interface{}
	for fam, i := range src.IPTables {
		out.IPTables[fam] = &savedOnce{Interface: i, saved: map[ipt.Table]saveResult{}}
	}
	if src.NFT != nil {
		var mu sync.Mutex
		listed := map[string]saveResult{}
		out.NFT = func(ctx context.Context, args ...string) ([]byte, error) {
			mu.Lock()
			defer mu.Unlock()
			key := strings.Join(args, " ")
			if r, ok := listed[key]; ok {
				return r.out, r.err
			}
			b, err := src.NFT(ctx, args...)
			listed[key] = saveResult{b, err}
			return b, err
		}
	}
	return out
}

type saveResult struct {
	out []byte
	err error
}

// savedOnce is an iptables whose SaveInto runs once per table.
type savedOnce struct {
	ipt.Interface
	mu    sync.Mutex
	saved map[ipt.Table]saveResult
}

func (s *savedOnce) SaveInto(ctx context.Context, table ipt.Table) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.saved[table]; ok {
		return r.out, r.err
	}
	b, err := s.Interface.SaveInto(ctx, table)
	s.saved[table] = saveResult{b, err}
	return b, err
}
