package app

// kproxy trace: the path the first packet of a connection takes through
// this node's live kproxy rules (package proxier/trace), read-only.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier/trace"
)

// traceOptions are kproxy trace's flags.
type traceOptions struct {
	src, dst  string
	dport     int
	proto     string
	from      string
	output    string
	proxyMode string
	timeout   time.Duration
}

// traceSource opens the node's state for one family; close releases it.
type traceSource func(ctx context.Context, family v1.IPFamily, timeout time.Duration) (src trace.Source, close func())

// newTraceCommand builds `kproxy trace`; open reads the node (nil: the
// real kernel's).
func newTraceCommand(stdout io.Writer, open traceSource) *cobra.Command {
	if open == nil {
		open = openLiveTraceSource
	}
	o := &traceOptions{proto: "tcp", output: "text", timeout: 30 * time.Second}
	cmd := &cobra.Command{
		Use:   "trace --src IP --dst IP --dport PORT [--proto tcp|udp|sctp] [--from pod|node|external] [-o text|json]",
		Short: "Show where this node's kproxy rules send the first packet of a connection",
		Long: `kproxy trace reads kproxy's rules as this node's kernel holds them now
(iptables-save in iptables mode, kproxy's nftables table in nftables mode,
the IPVS virtual servers and real servers, kproxy's ipsets and its iptables
chains in IPVS mode), walks them for the first packet of a connection and prints the rules it
meets, the Service they belong to, and the outcome: DNAT to which endpoints
with what probability, masquerade, session affinity, or drop or reject and
why. It only reads, whether or not the kproxy agent runs.

--from says where the packet comes from: a pod or another host (both arrive
on one of the node's interfaces), or the node itself. By default it is
"node" when --src is one of the node's addresses, else "external".

In IPVS mode the kernel does not name Services: the report names one by its
virtual server ("ClusterIP TCP 10.96.0.10:80") unless a rule's comment
names it, and a real server's probability is its share of the weights
(round robin: its share of new connections over time).`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := o.request()
			if err != nil {
				return err
			}
			if o.output != "text" && o.output != "json" {
				return fmt.Errorf("-o %q: want text or json", o.output)
			}
			family := v1.IPv4Protocol
			if req.Destination.Is6() {
				family = v1.IPv6Protocol
			}
			ctx, cancel := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			src, closeSrc := open(ctx, family, o.timeout)
			defer closeSrc()
			rep, err := trace.Run(ctx, req, src)
			if err != nil {
				return err
			}
			if o.output == "json" {
				return rep.WriteJSON(stdout)
			}
			return rep.WriteText(stdout)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&o.src, "src", "", "Source IP address of the packet (required)")
	fs.StringVar(&o.dst, "dst", "", "Destination IP address of the packet (required): a ClusterIP, node address, external IP or load-balancer IP")
	fs.IntVar(&o.dport, "dport", 0, "Destination port (required)")
	fs.StringVar(&o.proto, "proto", o.proto, "Protocol: tcp, udp or sctp")
	fs.StringVar(&o.from, "from", "", "Where the packet comes from: pod, node or external (default: node for one of the node's addresses, else external)")
	fs.StringVarP(&o.output, "output", "o", o.output, "Output format: text or json")
	fs.StringVar(&o.proxyMode, "proxy-mode", "", "Read this mode's state: iptables, nftables or ipvs (default: the mode whose state the node holds)")
	fs.DurationVar(&o.timeout, "timeout", o.timeout, "Bound on each iptables-save or nft run and each IPVS or ipset request")
	return cmd
}

// request parses the flags into a trace request.
func (o *traceOptions) request() (trace.Request, error) {
	var errs []error
	addr := func(flag, v string) netip.Addr {
		if v == "" {
			errs = append(errs, fmt.Errorf("--%s is required", flag))
			return netip.Addr{}
		}
		a, err := netip.ParseAddr(v)
		if err != nil || a.Zone() != "" {
			errs = append(errs, fmt.Errorf("--%s %q is not an IP address", flag, v))
			return netip.Addr{}
		}
		return a.Unmap()
	}
	req := trace.Request{Source: addr("src", o.src), Destination: addr("dst", o.dst), Protocol: o.proto,
		DestinationPort: o.dport, From: o.from, Mode: o.proxyMode}
	if len(errs) > 0 {
		return req, errors.Join(errs...)
	}
	return req, req.Validate()
}

// openLiveTraceSource reads this node: iptables of family, the nft command,
// IPVS and ipsets (when the kernel has IPVS loaded: never loads it) and
// the interfaces' addresses.
func openLiveTraceSource(ctx context.Context, family v1.IPFamily, timeout time.Duration) (trace.Source, func()) {
	src := trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{}, LocalAddresses: netlink.HostAddresses}
	var closers []func()
	closeFn := func() {
		for _, c := range closers {
			c()
		}
	}
	if _, err := os.Stat("/proc/net/ip_vs"); err == nil {
		if i, err := ipvs.New(ipvs.Options{Timeout: timeout}); err == nil {
			src.IPVS = i
			closers = append(closers, func() { _ = i.Close() })
		}
		if s, err := ipset.New(ipset.Options{Timeout: timeout}); err == nil {
			src.IPSet = s
			closers = append(closers, func() { _ = s.Close() })
		}
	}
	proto := ipt.ProtocolIPv4
	if family == v1.IPv6Protocol {
		proto = ipt.ProtocolIPv6
	}
	if i, err := ipt.New(ctx, ipt.Options{Protocol: proto, Timeout: timeout, RestoreTimeout: timeout}); err == nil {
		src.IPTables[family] = i
		if r, ok := i.(*ipt.Real); ok {
			closers = append(closers, func() { _ = r.Close() })
		}
	}
	if path, err := exec.LookPath("nft"); err == nil {
		src.NFT = func(ctx context.Context, args ...string) ([]byte, error) {
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			var stderr bytes.Buffer
			cmd := exec.CommandContext(ctx, path, args...)
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				return nil, fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
			}
			return out, nil
		}
	}
	return src, closeFn
}
