// Package app holds kproxy's command line: flags, validation and wiring.
package app

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
)

// Version is set at build time with -ldflags "-X .../app.Version=...".
var Version = "v0.0.0-dev"

// Proxy modes.
const (
	ModeIPTables = "iptables"
	ModeIPVS     = "ipvs"
)

// Options are kproxy's flags, with kube-proxy's names and defaults where
// kube-proxy has them.
type Options struct {
	Kubeconfig         string
	Master             string
	HostnameOverride   string
	ProxyMode          string
	Cleanup            bool
	ClusterCIDR        string
	MasqueradeAll      bool
	MasqueradeBit      int
	SyncPeriod         time.Duration
	MinSyncPeriod      time.Duration
	NodePortAddresses  []string
	ConfigSyncPeriod   time.Duration
	ServiceProxyName   string
	ShowVersion        bool
	IPTablesBatchChain int
	// HealthzBindAddress and MetricsBindAddress are "ip:port"; empty
	// disables the server.
	HealthzBindAddress string
	MetricsBindAddress string
}

// NewOptions returns the defaults.
func NewOptions() *Options {
	return &Options{
		ProxyMode:          ModeIPTables,
		MasqueradeBit:      14,
		SyncPeriod:         30 * time.Second,
		MinSyncPeriod:      time.Second,
		ConfigSyncPeriod:   15 * time.Minute,
		IPTablesBatchChain: 1000,
		HealthzBindAddress: "0.0.0.0:10256",
		MetricsBindAddress: "127.0.0.1:10249",
	}
}

// AddFlags registers the flags on fs.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Kubeconfig, "kubeconfig", o.Kubeconfig, "Path to a kubeconfig file with authorization information (the in-cluster config is used when empty).")
	fs.StringVar(&o.Master, "master", o.Master, "The address of the Kubernetes API server (overrides any value in kubeconfig).")
	fs.StringVar(&o.HostnameOverride, "hostname-override", o.HostnameOverride, "If non-empty, use this string as the node name instead of the hostname.")
	fs.StringVar(&o.ProxyMode, "proxy-mode", o.ProxyMode, "Which proxy mode to use: 'iptables' ('ipvs' is not available yet).")
	fs.BoolVar(&o.Cleanup, "cleanup", o.Cleanup, "If true, remove every rule kproxy created, for both IP families, and exit.")
	fs.StringVar(&o.ClusterCIDR, "cluster-cidr", o.ClusterCIDR, "The CIDR range of pods in the cluster (comma-separated, one per family for dual-stack). Traffic to a ClusterIP from outside it is masqueraded.")
	fs.BoolVar(&o.MasqueradeAll, "masquerade-all", o.MasqueradeAll, "SNAT all traffic sent via Service cluster IPs.")
	fs.IntVar(&o.MasqueradeBit, "iptables-masquerade-bit", o.MasqueradeBit, "The bit of the fwmark space that marks packets requiring SNAT. Must be within [0, 31].")
	fs.DurationVar(&o.SyncPeriod, "iptables-sync-period", o.SyncPeriod, "The maximum interval between rule syncs (e.g. '5s', '1m'). Must be greater than 0.")
	fs.DurationVar(&o.MinSyncPeriod, "iptables-min-sync-period", o.MinSyncPeriod, "The minimum interval between rule syncs as endpoints and services change (e.g. '5s', '1m'). 0 syncs at once.")
	fs.StringSliceVar(&o.NodePortAddresses, "nodeport-addresses", o.NodePortAddresses, "A list of CIDR ranges (e.g. '10.0.0.0/8,1.2.3.0/24') selecting the node addresses that accept NodePort traffic. Empty: every local address.")
	fs.DurationVar(&o.ConfigSyncPeriod, "config-sync-period", o.ConfigSyncPeriod, "How often informers resync from the API server. Must be greater than 0.")
	fs.StringVar(&o.ServiceProxyName, "service-proxy-name", o.ServiceProxyName, "Handle only Services labelled service.kubernetes.io/service-proxy-name=<name>. Empty: only Services without that label, like kube-proxy.")
	fs.BoolVar(&o.ShowVersion, "version", o.ShowVersion, "Print the version and exit.")
	fs.IntVar(&o.IPTablesBatchChain, "iptables-restore-batch-chains", o.IPTablesBatchChain, "Service chains per iptables-restore in a full sync (iptables-nft restore time grows with the square of a batch).")
	fs.StringVar(&o.HealthzBindAddress, "healthz-bind-address", o.HealthzBindAddress, "The IP address with port for the health check server (/healthz, /livez) to serve on (set to '0.0.0.0:10256' for all IPv4 interfaces and '[::]:10256' for all IPv6 interfaces). Set empty to disable.")
	fs.StringVar(&o.MetricsBindAddress, "metrics-bind-address", o.MetricsBindAddress, "The IP address with port for the metrics server (/metrics, /proxyMode) to serve on (set to '0.0.0.0:10249' for all IPv4 interfaces and '[::]:10249' for all IPv6 interfaces). Set empty to disable.")
}

// Validate reports every invalid flag at once.
func (o *Options) Validate() error {
	var errs []error
	switch o.ProxyMode {
	case ModeIPTables, "":
	case ModeIPVS:
		errs = append(errs, errors.New("--proxy-mode=ipvs is not available yet in this kproxy build; use --proxy-mode=iptables"))
	default:
		errs = append(errs, fmt.Errorf("--proxy-mode=%q is not a proxy mode; use iptables", o.ProxyMode))
	}
	if o.MasqueradeBit < 0 || o.MasqueradeBit > 31 {
		errs = append(errs, fmt.Errorf("--iptables-masquerade-bit=%d must be within [0, 31]", o.MasqueradeBit))
	}
	if o.SyncPeriod <= 0 {
		errs = append(errs, fmt.Errorf("--iptables-sync-period=%v must be greater than 0", o.SyncPeriod))
	}
	if o.MinSyncPeriod < 0 {
		errs = append(errs, fmt.Errorf("--iptables-min-sync-period=%v must not be negative", o.MinSyncPeriod))
	}
	if o.SyncPeriod > 0 && o.MinSyncPeriod > o.SyncPeriod {
		errs = append(errs, fmt.Errorf("--iptables-min-sync-period=%v must not exceed --iptables-sync-period=%v", o.MinSyncPeriod, o.SyncPeriod))
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
	if _, err := o.nodePortPrefixes(); err != nil {
		errs = append(errs, err)
	}
	if err := validateBindAddress("--healthz-bind-address", o.HealthzBindAddress); err != nil {
		errs = append(errs, err)
	}
	if err := validateBindAddress("--metrics-bind-address", o.MetricsBindAddress); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
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

// nodePortPrefixes parses --nodeport-addresses.
func (o *Options) nodePortPrefixes() (map[v1.IPFamily][]netip.Prefix, error) {
	out := map[v1.IPFamily][]netip.Prefix{}
	for _, s := range o.NodePortAddresses {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("--nodeport-addresses: %q is not a CIDR: %w", s, err)
		}
		fam := familyOf(p.Addr())
		out[fam] = append(out[fam], p.Masked())
	}
	return out, nil
}

func familyOf(a netip.Addr) v1.IPFamily {
	if a.Is4() || a.Is4In6() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}
