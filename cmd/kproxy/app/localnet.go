package app

import (
	"context"

	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/conntrack"
)

// sysctlRouteLocalnet, under /proc/sys, lets IPv4 packets to 127.0.0.0/8
// be routed from other interfaces when 1. kproxy never sets it (it never
// serves node ports on loopback); kube-proxy sets it in iptables mode and
// leaves it set.
const sysctlRouteLocalnet = "net/ipv4/conf/all/route_localnet"

// procSysctl is /proc/sys, or the test's fake.
func procSysctl(deps runDeps) conntrack.Sysctl {
	if deps.sysctl != nil {
		return deps.sysctl
	}
	return conntrack.FileSysctl{Root: conntrack.ProcSysRoot}
}

// checkRouteLocalnet reads route_localnet once at start-up and reports
// whether it is set, with a warning: in iptables mode the backend then
// drops packets from other sources to 127.0.0.0/8 (kube-proxy's rule); IPVS
// and nftables modes do not, and only warn. A sysctl that cannot be read
// counts as unset.
func checkRouteLocalnet(ctx context.Context, sys conntrack.Sysctl, mode string) bool {
	logger := klog.FromContext(ctx)
	v, err := sys.Get(sysctlRouteLocalnet)
	if err != nil {
		logger.V(2).Info("Cannot read route_localnet; assuming 0", "sysctl", sysctlRouteLocalnet, "err", err)
		return false
	}
	if v == 0 {
		return false
	}
	if mode == ModeIPVS || mode == ModeNFTables {
		logger.Info("Warning: route_localnet is set (kube-proxy leaves it behind): other hosts may reach services listening on 127.0.0.1; "+
			"kproxy's "+mode+" mode does not block them: set it to 0 unless something on the node needs it",
			"sysctl", sysctlRouteLocalnet, "value", v, "mode", mode)
		return true
	}
	logger.Info("Warning: route_localnet is set (kube-proxy leaves it behind): kproxy drops packets to 127.0.0.0/8 from other sources, "+
		"as kube-proxy does; set it to 0 unless something on the node needs it",
		"sysctl", sysctlRouteLocalnet, "value", v)
	return true
}
