package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/config"
	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/pkg/healthcheck"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/metrics"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/pkg/rawio"
	"github.com/kproxy/kproxy/proxier"
	iptbackend "github.com/kproxy/kproxy/proxier/iptables"
)

// Main runs kproxy with args and returns the process exit code.
func Main(args []string, stdout, stderr io.Writer) int {
	cmd := NewCommand(stdout)
	cmd.SetArgs(args)
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	if err := cmd.Execute(); err != nil {
		fmt.Fprintln(stderr, "kproxy:", err)
		return exitCode(err)
	}
	return 0
}

// exitCode is 1 for an error, or the error's own exit status (kproxy
// explain's mismatch).
func exitCode(err error) int {
	var coded interface{ ExitCode() int }
	if errors.As(err, &coded) {
		return coded.ExitCode()
	}
	return 1
}

// NewCommand builds the cobra command.
func NewCommand(stdout io.Writer) *cobra.Command {
	o := NewOptions()
	cmd := &cobra.Command{
		Use:   "kproxy",
		Short: "kproxy: a Kubernetes node dataplane agent that replaces kube-proxy",
		Long: `kproxy watches Services, EndpointSlices and Nodes and programs this node's
kernel (iptables, IPVS or nftables) so that every Service works: ClusterIP,
NodePort, ExternalIPs, LoadBalancer, traffic policies, session affinity and
topology-aware routing.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args:          cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.ShowVersion {
				fmt.Fprintln(stdout, "kproxy", Version)
				return nil
			}
			// Config file (config.go): the file's settings under the
			// flags given on the command line.
			if err := o.applyConfigFile(cmd.Flags(), klog.Background()); err != nil {
				return err
			}
			if err := o.Validate(); err != nil {
				if o.ConfigFile != "" {
					return fmt.Errorf("invalid configuration (flags and config file %s):\n%w", o.ConfigFile, err)
				}
				return fmt.Errorf("invalid flags:\n%w", err)
			}
			if o.WriteConfigTo != "" {
				return o.writeConfig(cmd.Flags(), klog.Background())
			}
			ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			ctx = klog.NewContext(ctx, klog.Background())
			if o.Cleanup {
				return RunCleanup(ctx, o)
			}
			gc := setGCDefaults(klog.FromContext(ctx), os.LookupEnv, nil)
			return run(ctx, o, runDeps{gc: gc})
		},
	}
	o.AddFlags(cmd.Flags())
	cmd.AddCommand(newTraceCommand(stdout, nil))
	cmd.AddCommand(newExplainCommand(stdout, explainDeps{}))
	klogFlags := goFlagSet()
	cmd.Flags().AddGoFlagSet(klogFlags)
	return cmd
}

// iptablesFor returns a real iptables interface for each usable family;
// IPv6 is optional (a node without ip6tables or IPv6 runs IPv4 only).
func iptablesFor(ctx context.Context, o *Options) (map[v1.IPFamily]ipt.Interface, error) {
	logger := klog.FromContext(ctx)
	out := map[v1.IPFamily]ipt.Interface{}
	timeout := o.KernelCallTimeout
	v4, err := ipt.New(ctx, ipt.Options{Protocol: ipt.ProtocolIPv4, Timeout: timeout, RestoreTimeout: timeout})
	if err != nil {
		return nil, fmt.Errorf("iptables (IPv4) is not usable: %w", err)
	}
	out[v1.IPv4Protocol] = v4
	v6, err := ipt.New(ctx, ipt.Options{Protocol: ipt.ProtocolIPv6, Timeout: timeout, RestoreTimeout: timeout})
	if err != nil {
		logger.Info("IPv6 iptables is not usable; running IPv4 only", "err", err)
	} else {
		out[v1.IPv6Protocol] = v6
	}
	return out, nil
}

// nodeName is --hostname-override or the hostname, lowercased as the
// kubelet registers it.
func nodeName(o *Options) (string, error) {
	name := o.HostnameOverride
	if name == "" {
		h, err := os.Hostname()
		if err != nil {
			return "", fmt.Errorf("getting hostname: %w", err)
		}
		name = h
	}
	name = strings.ToLower(strings.TrimSpace(name))
	if name == "" {
		return "", errors.New("empty node name")
	}
	return name, nil
}

// Run is kproxy's main loop: it returns when ctx is done.
func Run(ctx context.Context, o *Options) error { return run(ctx, o, runDeps{}) }

// runDeps are Run's connections to the API server and the kernel; a nil
// field means the real one. Tests replace them.
type runDeps struct {
	// gc, when set, holds the collector's start-up target until every
	// engine's first sync (gc.go); nil leaves the collector alone.
	gc                   *gcTuner
	client               kubernetes.Interface
	metadataClient       metadata.Interface // other nodes' labels; set it with client
	iptables             map[v1.IPFamily]ipt.Interface
	sysctl, moduleParams conntrack.Sysctl
	conntrack            conntrack.Interface
	// nodeIPTimeout bounds the wait for this node's Node object and its
	// addresses; zero means defaultNodeIPTimeout.
	nodeIPTimeout time.Duration
	// localAddresses lists the host's addresses for the iptables and
	// nftables backends.
	localAddresses func() ([]netip.Addr, error)
	// nftables are nftables mode's interfaces, bound to kproxy's table of
	// each family (nftablesmode.go).
	nftables map[v1.IPFamily]knftables.Interface
	// cleanupKernel stands for the kernel's IPVS and nftables state that a
	// mode starting up removes (cleanup.go).
	cleanupKernel *kernelCleanup
}

// run is Run with deps.
func run(ctx context.Context, o *Options, deps runDeps) error {
	logger := klog.FromContext(ctx)
	name, err := nodeName(o)
	if err != nil {
		return err
	}
	mode := o.ProxyMode
	if mode == "" {
		mode = ModeIPTables
	}
	syncPeriod, minSyncPeriod := o.syncPeriods()
	// IPVS mode's start-up checks come first: without IPVS kproxy fails
	// with what is missing; it never falls back to iptables.
	var ipvsK *ipvsKernel
	if mode == ModeIPVS {
		if ipvsK, err = openIPVSKernel(ctx, o, true); err != nil {
			return err
		}
		defer ipvsK.close()
	}
	// Likewise nftables mode's (nftablesmode.go): the nft command and the
	// kernel's nf_tables.
	var nfts map[v1.IPFamily]knftables.Interface
	if mode == ModeNFTables {
		if nfts, err = nftablesFor(ctx, o, deps); err != nil {
			return err
		}
	}
	client, metadataClient := deps.client, deps.metadataClient
	if client == nil {
		restCfg, err := clientcmd.BuildConfigFromFlags(o.Master, o.Kubeconfig)
		if err != nil {
			return fmt.Errorf("building API client config: %w", err)
		}
		restCfg.UserAgent = "kproxy/" + Version
		// Protobuf by default, as kube-proxy: at 10,000 Services the
		// initial lists decode with about half the garbage of JSON.
		restCfg.ContentType = o.KubeAPIContentType
		// Go's transport asks for gzip unless told not to, and the API
		// server (its WatchListCompression) then compresses the informers'
		// watch streams, lists and every later event alike: each event
		// arrives as a gzip member to inflate. Off unless
		// --kube-api-compression; a kubeconfig's disable-compression
		// still wins.
		restCfg.DisableCompression = restCfg.DisableCompression || !o.KubeAPICompression
		// The informers' lists and watches wait for an API server that is
		// down or starting instead of backing off up to 30 s after it
		// returns (config.NewRetryingTransport).
		// The API server's connection is read and written with raw
		// system calls (pkg/rawio): a watch event then does not wake the
		// runtime's sysmon thread, which would poll every 20 µs for as
		// long as the change is processed.
		dialer := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
		restCfg.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
			c, err := dialer.DialContext(ctx, network, address)
			if err != nil {
				return nil, err
			}
			return rawio.WrapConn(c), nil
		}
		restCfg.Wrap(func(rt http.RoundTripper) http.RoundTripper {
			return config.NewRetryingTransport(rt, config.RetryOptions{Logger: klog.FromContext(ctx)})
		})
		// One transport (one connection) for both clients: client-go
		// does not share the transports of a config with its own Dial.
		httpClient, err := rest.HTTPClientFor(restCfg)
		if err != nil {
			return fmt.Errorf("building API transport: %w", err)
		}
		if client, err = kubernetes.NewForConfigAndClient(restCfg, httpClient); err != nil {
			return fmt.Errorf("building API client: %w", err)
		}
		if metadataClient, err = metadata.NewForConfigAndClient(restCfg, httpClient); err != nil {
			return fmt.Errorf("building API metadata client: %w", err)
		}
	}
	ipts := deps.iptables
	if ipts == nil {
		if ipts, err = iptablesFor(ctx, o); err != nil {
			if mode != ModeNFTables {
				return err
			}
			// nftables mode needs iptables only to remove the other
			// modes' chains.
			logger.Info("iptables is not usable; nftables mode runs without it", "err", err)
			ipts = nil
		}
	}
	// The families served: those with a usable iptables, or nftables in
	// nftables mode.
	families := sets.KeySet(ipts)
	if mode == ModeNFTables {
		families = sets.KeySet(nfts)
	}
	// Conntrack (conntrack.go): the sysctls once, and the table the
	// engines delete stale UDP entries from.
	ct, closeConntrack, err := startConntrack(ctx, o, deps)
	if err != nil {
		return err
	}
	defer closeConntrack()
	// Kubernetes Events (events.go): "Starting" on this Node now,
	// Warnings on Services from the engine.
	recorder, stopEvents := startEvents(ctx, client, name)
	defer stopEvents()
	cidrs, _ := o.clusterCIDRs()
	// This node's primary IPs (nodeip.go), for the engines and for
	// --nodeport-addresses=primary.
	nodeIPTimeout := deps.nodeIPTimeout
	if nodeIPTimeout == 0 {
		nodeIPTimeout = defaultNodeIPTimeout
	}
	primaryIPs := detectNodeIPs(ctx, client, name, o.BindAddress, nodeIPTimeout)
	npAddrs := map[v1.IPFamily]*proxy.NodePortAddresses{}
	for _, fam := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
		if npAddrs[fam], err = o.nodePortAddresses(fam, primaryIPs[fam]); err != nil {
			return err
		}
		if families.Has(fam) {
			logNodePortAddresses(logger, npAddrs[fam])
		}
	}
	// route_localnet (localnet.go): kproxy never sets it, but guards
	// against it when someone did.
	routeLocalnet := checkRouteLocalnet(ctx, procSysctl(deps), mode)

	var allEngines []*proxier.Engine
	m, err := metrics.New(metrics.Options{
		Mode: mode, Version: Version, Profiling: o.Profiling,
		PendingChanges: func() (services, endpoints int) { return pendingChanges(allEngines) },
	})
	if err != nil {
		return err
	}
	// The other modes' leftovers (cleanup.go).
	cleanupOtherModes(ctx, o, mode, ipts, deps.cleanupKernel, m)
	health, err := healthcheck.NewProxyHealthServer(healthcheck.ProxyHealthOptions{
		BindAddress: o.HealthzBindAddress, HealthTimeout: 2 * syncPeriod, NodeName: name, Recorder: m,
	})
	if err != nil {
		return err
	}
	// Health check node ports listen where node ports are served (every
	// address when both families match all).
	var hcPrefixes []netip.Prefix
	if !npAddrs[v1.IPv4Protocol].MatchAll() || !npAddrs[v1.IPv6Protocol].MatchAll() {
		for _, fam := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
			hcPrefixes = append(hcPrefixes, npAddrs[fam].Prefixes()...)
		}
	}
	// The node's addresses, read by every sync of the node ports and the
	// health-check listeners, are dumped again only when the kernel
	// announces a change (netlink.HostAddressCache).
	if deps.localAddresses == nil {
		hostAddrs := &netlink.HostAddressCache{}
		defer func() { _ = hostAddrs.Close() }()
		deps.localAddresses = hostAddrs.Addresses
	}
	svcHealth := healthcheck.NewServiceHealthServer(healthcheck.ServiceHealthOptions{
		NodePortAddresses: hcPrefixes, ProxyHealth: health, Logger: logger, LocalAddresses: deps.localAddresses,
	})
	defer svcHealth.Close()

	factories, err := config.NewInformerFactories(config.InformerOptions{
		Client: client, NodeName: name, ResyncPeriod: o.ConfigSyncPeriod, ServiceProxyName: o.ServiceProxyName,
	})
	if err != nil {
		return err
	}
	// The engines find the Service of a set-aside port in the informer's
	// cache, so that its Warning event carries the Service's UID.
	svcLister := factories.Services.Core().V1().Services().Lister()

	engines := map[v1.IPFamily]proxier.Proxier{}
	for _, fam := range sets.List(families) {
		i, np := ipts[fam], npAddrs[fam]
		var backend proxier.Backend
		switch mode {
		case ModeIPVS:
			if backend, err = newIPVSBackend(o, ipvsK, i, np); err != nil {
				return err
			}
		case ModeNFTables:
			if backend, err = newNFTablesBackend(o, fam, nfts[fam], np, deps.localAddresses); err != nil {
				return err
			}
		default:
			bit := o.MasqueradeBit
			b, err := iptbackend.New(iptbackend.Options{
				IPTables: i, MasqueradeBit: &bit, NodePortAddresses: np, BatchChains: o.IPTablesBatchChain,
				CanaryInterval: o.SyncPeriod, RouteLocalnet: fam == v1.IPv4Protocol && routeLocalnet,
				LocalAddresses: deps.localAddresses,
			})
			if err != nil {
				return err
			}
			backend = b
		}
		e, err := proxier.NewEngine(proxier.EngineOptions{
			Family: fam, NodeName: name, NodeIP: primaryIPs[fam], Backend: backend,
			MinSyncPeriod: minSyncPeriod, SyncPeriod: syncPeriod, Logger: logger, WaitForNodes: true,
			MasqueradeAll: o.MasqueradeAll, ClusterCIDR: cidrs[fam],
			OnQueued: func(at time.Time) {
				health.QueuedUpdate(fam)
				m.SyncQueued(fam, at)
			},
			OnSync: func(r proxier.SyncResult) {
				afterSync(r, m, health, svcHealth)
				deps.gc.synced(r)
			},
			// A sync loop stuck in a sync makes health fail.
			OnLoopRan: func(time.Time) { health.SyncLoopRan(fam) },
			// Stale UDP conntrack entries and Service events; the events
			// of one family's state (set-aside ports, skipped endpoints)
			// come from each engine.
			Conntrack: ct, EventRecorder: serviceEventRecorder(fam, recorder),
			FamilyEventRecorder: recorder, ServiceLister: svcLister,
		})
		if err != nil {
			return err
		}
		engines[fam] = e
		allEngines = append(allEngines, e)
	}
	deps.gc.await(sets.KeySet(engines))
	var p proxier.Proxier = engines[v1.IPv4Protocol]
	if v6, ok := engines[v1.IPv6Protocol]; ok {
		p = proxier.NewMetaProxier(engines[v1.IPv4Protocol], v6)
	}

	svcCfg, err := config.NewServiceConfig(ctx, factories.Services.Core().V1().Services(), o.ConfigSyncPeriod)
	if err != nil {
		return err
	}
	// The other nodes' labels, watched only while a Service uses
	// topologyKeys; registered before p so that p holds its syncs back
	// before it sees such a Service.
	otherNodesCfg, err := config.NewOtherNodesConfig(ctx, config.OtherNodesOptions{
		Client: metadataClient, NodeName: name, ResyncPeriod: o.ConfigSyncPeriod,
	})
	if err != nil {
		return err
	}
	svcCfg.RegisterEventHandler(otherNodesCfg)
	otherNodesCfg.RegisterEventHandler(p)
	svcCfg.RegisterEventHandler(p)
	epCfg, err := config.NewEndpointSliceConfig(ctx, factories.EndpointSlices.Discovery().V1().EndpointSlices())
	if err != nil {
		return err
	}
	epCfg.RegisterEventHandler(p)
	nodeCfg, err := config.NewNodeConfig(ctx, factories.Nodes.Core().V1().Nodes(), o.ConfigSyncPeriod)
	if err != nil {
		return err
	}
	nodeCfg.RegisterEventHandler(p)
	// The health server follows this node's deletion and taints.
	nodeCfg.RegisterEventHandler(health)

	logger.Info("Starting kproxy", "version", Version, "node", name, "mode", mode, "families", len(engines))
	factories.Start(ctx.Done())
	go svcCfg.Run(ctx)
	go epCfg.Run(ctx)
	go nodeCfg.Run(ctx)
	var otherNodes sync.WaitGroup
	otherNodes.Go(func() { otherNodesCfg.Run(ctx) })
	var servers sync.WaitGroup
	if o.HealthzBindAddress != "" {
		servers.Go(func() { serveUntilDone(ctx, "proxy health", health.Run) })
	}
	if o.MetricsBindAddress != "" {
		servers.Go(func() {
			serveUntilDone(ctx, "metrics", func(ctx context.Context) error { return m.Run(ctx, o.MetricsBindAddress) })
		})
	}
	// As kube-proxy does, the sync loop's start counts as a queued sync:
	// the informers are delivering the initial state.
	for fam := range engines {
		m.SyncQueued(fam, time.Now())
	}
	p.SyncLoop(ctx)
	servers.Wait()
	otherNodes.Wait()
	factories.Shutdown()
	logger.Info("kproxy stopped; rules stay in place until the next kproxy or --cleanup")
	return nil
}

// afterSync feeds one sync result to the metrics, the proxy health and the
// service health checks. A failed sync leaves the node's rules out of date:
// it counts as a queued update, so that failing syncs make the proxy
// unhealthy after the health timeout.
func afterSync(r proxier.SyncResult, m *metrics.Metrics, health *healthcheck.ProxyHealthServer, svcHealth *healthcheck.ServiceHealthServer) {
	m.SyncDone(r)
	if r.Err != nil {
		health.QueuedUpdate(r.Family)
		return
	}
	health.Updated(r.Family, r.Start)
	services := make(map[types.NamespacedName]healthcheck.ServiceHealth, len(r.HealthCheckServices))
	for nn, hc := range r.HealthCheckServices {
		services[nn] = healthcheck.ServiceHealth{Port: hc.Port, LocalEndpoints: hc.LocalEndpoints}
	}
	svcHealth.Sync(r.Family, services)
}

// pendingChanges counts the services with Service, respectively
// EndpointSlice, changes that some engine has not applied yet.
func pendingChanges(engines []*proxier.Engine) (services, endpoints int) {
	svcs, eps := sets.New[string](), sets.New[string]()
	for _, e := range engines {
		s, ep := e.PendingChanges()
		svcs = svcs.Union(s)
		eps = eps.Union(ep)
	}
	return svcs.Len(), eps.Len()
}

// serveUntilDone runs serve until ctx is done; when it fails (say the port
// is taken) the error is logged and serve is retried after a pause, as
// kube-proxy does: kproxy keeps programming rules without the server.
func serveUntilDone(ctx context.Context, what string, serve func(context.Context) error) {
	logger := klog.FromContext(ctx)
	for {
		err := serve(ctx)
		if ctx.Err() != nil {
			return
		}
		logger.Error(err, "Server failed; retrying", "server", what, "retryAfter", serverRetryPeriod)
		select {
		case <-ctx.Done():
			return
		case <-time.After(serverRetryPeriod):
		}
	}
}

// serverRetryPeriod is the pause before restarting a failed HTTP server.
const serverRetryPeriod = 5 * time.Second
