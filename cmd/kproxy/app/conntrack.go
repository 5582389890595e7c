package app

import (
	"context"
	"fmt"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/conntrack"
)

// addConntrackFlags registers kube-proxy's --conntrack-* flags.
func (o *Options) addConntrackFlags(fs *pflag.FlagSet) {
	fs.IntVar(&o.Conntrack.MaxPerCore, "conntrack-max-per-core", o.Conntrack.MaxPerCore, "Maximum number of NAT connections to track per CPU core (0 to leave the limit as-is and ignore --conntrack-min). nf_conntrack_max is only ever raised.")
	fs.IntVar(&o.Conntrack.Min, "conntrack-min", o.Conntrack.Min, "Minimum number of conntrack entries to allocate, regardless of --conntrack-max-per-core (set --conntrack-max-per-core=0 to leave the limit as-is).")
	fs.DurationVar(&o.Conntrack.TCPEstablishedTimeout, "conntrack-tcp-timeout-established", o.Conntrack.TCPEstablishedTimeout, "Idle timeout for established TCP connections (0 to leave as-is).")
	fs.DurationVar(&o.Conntrack.TCPCloseWaitTimeout, "conntrack-tcp-timeout-close-wait", o.Conntrack.TCPCloseWaitTimeout, "NAT timeout for TCP connections in the CLOSE_WAIT state (0 to leave as-is).")
	fs.BoolVar(&o.Conntrack.TCPBeLiberal, "conntrack-tcp-be-liberal", o.Conntrack.TCPBeLiberal, "Enable liberal mode for tracking TCP packets by setting nf_conntrack_tcp_be_liberal to 1.")
	fs.DurationVar(&o.Conntrack.UDPTimeout, "conntrack-udp-timeout", o.Conntrack.UDPTimeout, "Idle timeout for UNREPLIED UDP connections (0 to leave as-is).")
	fs.DurationVar(&o.Conntrack.UDPStreamTimeout, "conntrack-udp-timeout-stream", o.Conntrack.UDPStreamTimeout, "Idle timeout for ASSURED UDP connections (0 to leave as-is).")
}

// startConntrack applies the conntrack sysctls once and returns the
// conntrack table the engines clean stale UDP entries from, with its
// closer. Without a usable netfilter netlink socket kproxy runs on without
// the cleaning (nil): the rules still work, stale UDP entries then only
// time out.
func startConntrack(ctx context.Context, o *Options, deps runDeps) (conntrack.Interface, func(), error) {
	logger := klog.FromContext(ctx)
	sys, params := deps.sysctl, deps.moduleParams
	if sys == nil {
		sys = conntrack.FileSysctl{Root: conntrack.ProcSysRoot}
	}
	if params == nil {
		params = conntrack.FileSysctl{Root: conntrack.ModuleParamsRoot}
	}
	if err := conntrack.ConfigureSysctls(ctx, conntrack.SysctlOptions{Config: o.Conntrack, Sysctl: sys, ModuleParams: params}); err != nil {
		return nil, nil, fmt.Errorf("setting conntrack parameters: %w", err)
	}
	if deps.conntrack != nil {
		return deps.conntrack, func() {}, nil
	}
	ct, err := conntrack.New(conntrack.Options{Timeout: o.KernelCallTimeout})
	if err != nil {
		logger.Error(err, "Cannot delete stale UDP conntrack entries; continuing without")
		return nil, func() {}, nil
	}
	return ct, func() { ct.Close() }, nil
}
