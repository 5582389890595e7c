// Package app holds kproxy's command line: flags, validation and wiring.
package app

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// Version is set at build time with -ldflags "-X .../app.Version=...".
var Version = "v0.0.0-dev"

// Proxy modes.
const (
	ModeIPTables = "iptables"
	ModeIPVS     = "ipvs"
	ModeNFTables = "nftables"
)

// modeList names the proxy modes, for errors.
const modeList = ModeIPTables + ", " + ModeIPVS + " or " + ModeNFTables

// Options are kproxy's flags, with kube-proxy's names and defaults where
// kube-proxy has them.
type Options struct {
	Kubeconfig       string
	Master           string
	HostnameOverride string
	ProxyMode        string
	Cleanup          bool
	ClusterCIDR      string
	// BindAddress is kube-proxy's --bind-address: this node's primary IP
	// when it is a specific address (0.0.0.0 or ::: none).
	BindAddress   string
	MasqueradeAll bool
	MasqueradeBit int
	SyncPeriod    time.Duration
	MinSyncPeriod time.Duration
	// KernelCallTimeout bounds every kernel call (an iptables or nft
	// run, a netlink request); zero keeps each interface's default.
	KernelCallTimeout  time.Duration
	NodePortAddresses  []string
	ConfigSyncPeriod   time.Duration
	ServiceProxyName   string
	ShowVersion        bool
	IPTablesBatchChain int
	// KubeAPIContentType is the encoding asked of the API server
	// (kube-proxy's --kube-api-content-type); Profiling serves
	// /debug/pprof/ on the metrics server (kube-proxy's --profiling).
	KubeAPIContentType string
	Profiling          bool
	// KubeAPICompression lets the API server gzip its responses (lists
	// and watch events); off by default (see the flag).
	KubeAPICompression bool
	// HealthzBindAddress and MetricsBindAddress are "ip:port"; empty
	// disables the server.
	HealthzBindAddress string
	MetricsBindAddress string

	// Conntrack (conntrack.go): kube-proxy's --conntrack-* tuning, applied
	// once at start.
	Conntrack conntrack.Config

	// Config file (config.go): ConfigFile is a kube-proxy
	// KubeProxyConfiguration read under the flags given on the command
	// line; WriteConfigTo, when set, receives the effective configuration
	// and kproxy exits.
	ConfigFile    string
	WriteConfigTo string

	// IPVS mode (--proxy-mode=ipvs), with kube-proxy's flag names.
	IPVSScheduler     string
	IPVSStrictARP     bool
	IPVSTCPTimeout    time.Duration
	IPVSTCPFinTimeout time.Duration
	IPVSUDPTimeout    time.Duration
	IPVSExcludeCIDRs  []string
	IPVSSyncPeriod    time.Duration
	IPVSMinSyncPeriod time.Duration
}

// NewOptions returns the defaults.
func NewOptions() *Options {
	return &Options{
		ProxyMode:          ModeIPTables,
		BindAddress:        "0.0.0.0",
		MasqueradeBit:      14,
		SyncPeriod:         30 * time.Second,
		MinSyncPeriod:      time.Second,
		ConfigSyncPeriod:   15 * time.Minute,
		IPTablesBatchChain: 1000,
		KubeAPIContentType: kubeProxyDefaultContentType,
		HealthzBindAddress: "0.0.0.0:10256",
		MetricsBindAddress: "127.0.0.1:10249",
		Conntrack:          conntrack.DefaultConfig(),
		IPVSScheduler:      ipvs.DefaultScheduler,
		IPVSSyncPeriod:     30 * time.Second,
	}
}

// AddFlags registers the flags on fs.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "Path to a kubeconfig file with authorization information (the in-cluster config is used when empty).")
	fs.StringVar(&o.Master, "master", o.Master, "The address of the Kubernetes API server (overrides any value in kubeconfig).")
	fs.StringVar(&o.HostnameOverride, "hostname-override", o.HostnameOverride, "If non-empty, use this string as the node name instead of the hostname.")
	fs.StringVar(&o.ProxyMode, "proxy-mode", o.ProxyMode, "Which proxy mode to use: 'iptables', 'ipvs' (needs the kernel's IPVS, ip_vs modules) or 'nftables' (needs the nft command, v1.0.1 or later, and the kernel's nf_tables). kproxy never falls back to another mode.")
	fs.BoolVar(&o.Cleanup, "cleanup", o.Cleanup, "If true, remove every rule kproxy created, for both IP families, and exit.")
	fs.StringVar(&o.ClusterCIDR, "cluster-cidr", o.ClusterCIDR, "The CIDR range of pods in the cluster (comma-separated, one per family for dual-stack). Traffic to a ClusterIP from outside it is masqueraded.")
	fs.BoolVar(&o.MasqueradeAll, "masquerade-all", o.MasqueradeAll, "SNAT all traffic sent via Service cluster IPs.")
	fs.IntVar(&o.MasqueradeBit, "iptables-masquerade-bit", o.MasqueradeBit, "The bit of the fwmark space that marks packets requiring SNAT, in every mode (a config file sets it in its iptables block, or its nftables block in nftables mode). Must be within [0, 31].")
	fs.DurationVar(&o.SyncPeriod, "iptables-sync-period", o.SyncPeriod, "The maximum interval between rule syncs in iptables and nftables modes (e.g. '5s', '1m'). Must be greater than 0.")
	fs.DurationVar(&o.MinSyncPeriod, "iptables-min-sync-period", o.MinSyncPeriod, "The minimum interval between rule syncs in iptables and nftables modes as endpoints and services change (e.g. '5s', '1m'). 0 syncs at once.")
	fs.StringVar(&o.BindAddress, "bind-address", o.BindAddress, "Overrides kproxy's idea of this node's primary IP (for its family; kproxy binds nothing to it, the name is kube-proxy's). '0.0.0.0' or '::': the Node object's first InternalIP (else ExternalIP) of each family.")
	fs.StringSliceVar(&o.NodePortAddresses, "nodeport-addresses", o.NodePortAddresses, "A list of CIDR ranges and/or keywords selecting the node addresses that accept NodePort traffic (e.g. '10.0.0.0/8,fd00::/64' or 'primary'). Keywords: 'primary' (this node's primary IP of each family, see --bind-address), 'localhost' (127.0.0.0/8 and ::1/128) and 'all' (0.0.0.0/0 and ::/0). Each IP family reads only its own values: a family with none (the flag unset, or naming only the other family) serves NodePorts on every address. Unset in nftables mode means 'primary', as in kube-proxy. Loopback addresses never serve NodePorts, even when listed. NodePorts without endpoints are rejected on every local address.")
	fs.DurationVar(&o.KernelCallTimeout, "kernel-call-timeout", o.KernelCallTimeout, "The deadline of every kernel call: an iptables, iptables-restore or nft run is killed after it, a netlink request abandoned, and the sync fails and is retried. 0 uses the defaults: 30s for single iptables commands and netlink requests, 60s for iptables-restore, nft transactions and conntrack cleanup.")
	fs.DurationVar(&o.ConfigSyncPeriod, "config-sync-period", o.ConfigSyncPeriod, "How often informers resync from the API server. Must be greater than 0.")
	fs.StringVar(&o.ServiceProxyName, "service-proxy-name", o.ServiceProxyName, "Handle only Services labelled service.kubernetes.io/service-proxy-name=<name>. Empty: only Services without that label, like kube-proxy.")
	fs.BoolVar(&o.ShowVersion, "version", o.ShowVersion, "Print the version and exit.")
	fs.IntVar(&o.IPTablesBatchChain, "iptables-restore-batch-chains", o.IPTablesBatchChain, "Service chains per iptables-restore in a full sync (iptables-nft restore time grows with the square of a batch).")
	fs.StringVar(&o.KubeAPIContentType, "kube-api-content-type", o.KubeAPIContentType, "The content type of requests to the API server: 'application/vnd.kubernetes.protobuf' (smaller and cheaper to decode) or 'application/json'.")
	fs.BoolVar(&o.KubeAPICompression, "kube-api-compression", o.KubeAPICompression, "Ask the API server for gzip-compressed responses, watch streams included. Off by default: on a node's network the bytes saved cost the API server and kproxy CPU for every event; turn it on where the API server is behind a slow link. A kubeconfig's disable-compression turns it off.")
	fs.BoolVar(&o.Profiling, "profiling", o.Profiling, "Serve Go's profiles under /debug/pprof/ on the metrics server (--metrics-bind-address).")
	fs.StringVar(&o.HealthzBindAddress, "healthz-bind-address", o.HealthzBindAddress, "The IP address with port for the health check server (/healthz, /livez) to serve on (set to '0.0.0.0:10256' for all IPv4 interfaces and '[::]:10256' for all IPv6 interfaces). Set empty to disable.")
	fs.StringVar(&o.MetricsBindAddress, "metrics-bind-address", o.MetricsBindAddress, "The IP address with port for the metrics server (/metrics, /proxyMode) to serve on (set to '0.0.0.0:10249' for all IPv4 interfaces and '[::]:10249' for all IPv6 interfaces). Set empty to disable.")
	o.addConntrackFlags(fs)

	// Config file (config.go).
	fs.StringVar(&o.ConfigFile, "config", o.ConfigFile, "The path of a kube-proxy configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1). Flags given on the command line override its settings.")
	fs.StringVar(&o.WriteConfigTo, "write-config-to", o.WriteConfigTo, "If set, write the effective configuration (defaults, --config file and flags) to this file as a KubeProxyConfiguration, and exit.")

	// IPVS mode.
	fs.StringVar(&o.IPVSScheduler, "ipvs-scheduler", o.IPVSScheduler, "The IPVS scheduler of every virtual server in ipvs mode: one of "+strings.Join(ipvs.AllSchedulers, ", ")+" (the kernel needs its module ip_vs_<name>).")
	fs.BoolVar(&o.IPVSStrictARP, "ipvs-strict-arp", o.IPVSStrictARP, "Enable strict ARP in ipvs mode (arp_ignore=1, arp_announce=2), so that the node does not answer ARP for the service addresses on its dummy device.")
	fs.DurationVar(&o.IPVSTCPTimeout, "ipvs-tcp-timeout", o.IPVSTCPTimeout, "The timeout for idle IPVS TCP connections, in whole seconds (e.g. '900s'). 0 leaves the kernel's value.")
	fs.DurationVar(&o.IPVSTCPFinTimeout, "ipvs-tcpfin-timeout", o.IPVSTCPFinTimeout, "The timeout for IPVS TCP connections after receiving a FIN, in whole seconds (e.g. '120s'). 0 leaves the kernel's value.")
	fs.DurationVar(&o.IPVSUDPTimeout, "ipvs-udp-timeout", o.IPVSUDPTimeout, "The timeout for IPVS UDP packets, in whole seconds (e.g. '300s'). 0 leaves the kernel's value.")
	fs.StringSliceVar(&o.IPVSExcludeCIDRs, "ipvs-exclude-cidrs", o.IPVSExcludeCIDRs, "A comma-separated list of CIDRs: ipvs mode never deletes an IPVS virtual server inside them when it cleans up stale ones.")
	fs.DurationVar(&o.IPVSSyncPeriod, "ipvs-sync-period", o.IPVSSyncPeriod, "The maximum interval between IPVS rule syncs in ipvs mode (e.g. '5s', '1m'). Must be greater than 0.")
	fs.DurationVar(&o.IPVSMinSyncPeriod, "ipvs-min-sync-period", o.IPVSMinSyncPeriod, "The minimum interval between IPVS rule syncs in ipvs mode as endpoints and services change (e.g. '5s', '1m'). 0 syncs at once.")
}

// Validate reports every invalid flag at once.
func (o *Options) Validate() error {
	var errs []error
	switch o.ProxyMode {
	case ModeIPTables, "":
	case ModeIPVS, ModeNFTables:
	default:
		errs = append(errs, fmt.Errorf("--proxy-mode=%q is not a proxy mode; use %s", o.ProxyMode, modeList))
	}
	errs = append(errs, o.validateIPVS()...)
	if o.MasqueradeBit < 0 || o.MasqueradeBit > 31 {
		errs = append(errs, fmt.Errorf("--iptables-masquerade-bit=%d must be within [0, 31]", o.MasqueradeBit))
	}
	if o.SyncPeriod <= 0 {
		errs = append(errs, fmt.Errorf("--iptables-sync-period=%v must be greater than 0", o.SyncPeriod))
	}
	if o.KernelCallTimeout < 0 {
		errs = append(errs, fmt.Errorf("--kernel-call-timeout=%v must not be negative", o.KernelCallTimeout))
	}
	if o.MinSyncPeriod < 0 {
		errs = append(errs, fmt.Errorf("--iptables-min-sync-period=%v must not be negative", o.MinSyncPeriod))
	}
	if o.SyncPeriod > 0 && o.MinSyncPeriod > o.SyncPeriod {
		errs = append(errs, fmt.Errorf("--iptables-min-sync-period=%v must not exceed --iptables-sync-period=%v", o.MinSyncPeriod, o.SyncPeriod))
	}
	if o.KubeAPIContentType != kubeProxyDefaultContentType && o.KubeAPIContentType != "application/json" {
		errs = append(errs, fmt.Errorf("--kube-api-content-type=%q must be %q or %q", o.KubeAPIContentType, kubeProxyDefaultContentType, "application/json"))
	}
	if o.ConfigSyncPeriod <= 0 {
		errs = append(errs, fmt.Errorf("--config-sync-period=%v must be greater than 0", o.ConfigSyncPeriod))
	}
	if o.IPTablesBatchChain <= 0 {
		errs = append(errs, fmt.Errorf("--iptables-restore-batch-chains=%d must be greater than 0", o.IPTablesBatchChain))
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
	if err := validateBindAddress("--healthz-bind-address", o.HealthzBindAddress); err != nil {
		errs = append(errs, err)
	}
	if err := validateBindAddress("--metrics-bind-address", o.MetricsBindAddress); err != nil {
		errs = append(errs, err)
	}
	if err := o.Conntrack.Validate(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// validateIPVS checks the IPVS flags (whatever the mode, as kube-proxy
// does).
func (o *Options) validateIPVS() []error {
	var errs []error
	if !slices.Contains(ipvs.AllSchedulers, o.IPVSScheduler) {
		errs = append(errs, fmt.Errorf("--ipvs-scheduler=%q is not an IPVS scheduler; use one of %s", o.IPVSScheduler, strings.Join(ipvs.AllSchedulers, ", ")))
	}
	for _, t := range []struct {
		flag string
		v    time.Duration
	}{{"--ipvs-tcp-timeout", o.IPVSTCPTimeout}, {"--ipvs-tcpfin-timeout", o.IPVSTCPFinTimeout}, {"--ipvs-udp-timeout", o.IPVSUDPTimeout}} {
		if t.v < 0 || t.v%time.Second != 0 {
			errs = append(errs, fmt.Errorf("%s=%v must be a non-negative whole number of seconds", t.flag, t.v))
		}
	}
	if o.IPVSSyncPeriod <= 0 {
		errs = append(errs, fmt.Errorf("--ipvs-sync-period=%v must be greater than 0", o.IPVSSyncPeriod))
	}
	if o.IPVSMinSyncPeriod < 0 {
		errs = append(errs, fmt.Errorf("--ipvs-min-sync-period=%v must not be negative", o.IPVSMinSyncPeriod))
	}
	if o.IPVSSyncPeriod > 0 && o.IPVSMinSyncPeriod > o.IPVSSyncPeriod {
		errs = append(errs, fmt.Errorf("--ipvs-min-sync-period=%v must not exceed --ipvs-sync-period=%v", o.IPVSMinSyncPeriod, o.IPVSSyncPeriod))
	}
	if _, err := o.ipvsExcludeCIDRs(); err != nil {
		errs = append(errs, err)
	}
	return errs
}

// ipvsExcludeCIDRs parses --ipvs-exclude-cidrs.
func (o *Options) ipvsExcludeCIDRs() ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range o.IPVSExcludeCIDRs {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("--ipvs-exclude-cidrs: %q is not a CIDR: %w", s, err)
		}
		out = append(out, p.Masked())
	}
	return out, nil
}

// syncPeriods are the engine's maximum and minimum sync intervals in the
// chosen mode: the --ipvs-* flags in IPVS mode, the --iptables-* ones in
// iptables and nftables modes (as kube-proxy reads them).
func (o *Options) syncPeriods() (sync, min time.Duration) {
	if o.ProxyMode == ModeIPVS {
		return o.IPVSSyncPeriod, o.IPVSMinSyncPeriod
	}
	return o.SyncPeriod, o.MinSyncPeriod
}

// validateBindAddress accepts "" (disabled) or an IP address with a port,
// as kube-proxy does.
func validateBindAddress(flag, value string) error {
	if value == "" {
		return nil
	}
	host, port, err := net.SplitHostPort(value)
	if err != nil {
		return fmt.Errorf("%s=%q must be an IP address with a port: %w", flag, value, err)
	}
	if _, err := netip.ParseAddr(host); err != nil {
		return fmt.Errorf("%s=%q: %q is not an IP address", flag, value, host)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || strconv.FormatUint(n, 10) != port {
		return fmt.Errorf("%s=%q: %q is not a port number (0-65535)", flag, value, port)
	}
	return nil
}

// clusterCIDRs parses --cluster-cidr into at most one prefix per family.
func (o *Options) clusterCIDRs() (map[v1.IPFamily]netip.Prefix, error) {
	out := map[v1.IPFamily]netip.Prefix{}
	if strings.TrimSpace(o.ClusterCIDR) == "" {
		return out, nil
	}
	for _, s := range strings.Split(o.ClusterCIDR, ",") {
		p, err := netip.ParsePrefix(strings.TrimSpace(s))
		if err != nil {
			return nil, fmt.Errorf("--cluster-cidr: %q is not a CIDR: %w", s, err)
		}
		fam := familyOf(p.Addr())
		if _, dup := out[fam]; dup {
			return nil, fmt.Errorf("--cluster-cidr: more than one %s CIDR in %q", fam, o.ClusterCIDR)
		}
		out[fam] = p.Masked()
	}
	return out, nil
}

// nodePortAddresses reads --nodeport-addresses for family, with this
// node's primary IP of that family (zero when unknown).
func (o *Options) nodePortAddresses(family v1.IPFamily, nodeIP netip.Addr) (*proxy.NodePortAddresses, error) {
	values := o.NodePortAddresses
	if len(values) == 0 && o.ProxyMode == ModeNFTables {
		// As kube-proxy's nftables mode: node ports default to the node's
		// primary IPs (every address when a family's is unknown).
		values = []string{proxy.NodePortAddressesPrimary}
	}
	npa, err := proxy.NewNodePortAddresses(family, values, nodeIP)
	if err != nil {
		return nil, fmt.Errorf("--nodeport-addresses: %w", err)
	}
	return npa, nil
}

func familyOf(a netip.Addr) v1.IPFamily {
	if a.Is4() || a.Is4In6() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}
