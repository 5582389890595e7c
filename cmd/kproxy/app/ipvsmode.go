package app

import (
	"context"
	"fmt"
	"os"

	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	ipvsbackend "github.com/kproxy/kproxy/proxier/ipvs"
)

// ipvsKernel holds the real kernel interfaces of IPVS mode, shared by both
// families; a nil member is one the kernel lacks (cleanup only).
type ipvsKernel struct {
	ipvs  *ipvs.Real
	nl    *netlink.Real
	ipset *ipset.Real
}

func (k *ipvsKernel) close() {
	if k.ipvs != nil {
		_ = k.ipvs.Close()
	}
	if k.nl != nil {
		_ = k.nl.Close()
	}
	if k.ipset != nil {
		_ = k.ipset.Close()
	}
}

// ipvsLoaded reports whether the kernel's IPVS is loaded: without it no
// IPVS virtual server can exist.
func ipvsLoaded() bool {
	_, err := os.Stat("/proc/net/ip_vs")
	return err == nil
}

// openIPVSKernel opens the kernel interfaces of IPVS mode. For running
// (required) every one must work and the scheduler must exist: the error
// names what is missing. For cleanup, what the kernel lacks is left nil and
// IPVS is not loaded just to look into it.
func openIPVSKernel(ctx context.Context, o *Options, required bool) (*ipvsKernel, error) {
	k := &ipvsKernel{}
	fail := func(err error) (*ipvsKernel, error) {
		k.close()
		return nil, err
	}
	if required {
		if err := ipvs.CheckScheduler(o.IPVSScheduler); err != nil {
			return fail(fmt.Errorf("--proxy-mode=ipvs needs the kernel's IPVS with scheduler %q: %w", o.IPVSScheduler, err))
		}
	}
	if required || ipvsLoaded() {
		r, err := ipvs.New(ipvs.Options{Timeout: o.KernelCallTimeout})
		if err != nil {
			if required {
				return fail(fmt.Errorf("--proxy-mode=ipvs: %w", err))
			}
			klog.FromContext(ctx).V(2).Info("IPVS not usable; not cleaning IPVS virtual servers", "err", err)
		} else {
			k.ipvs = r
		}
	}
	nl, err := netlink.New(netlink.Options{Timeout: o.KernelCallTimeout})
	if err != nil {
		return fail(fmt.Errorf("netlink (for the dummy device %s): %w", ipvsbackend.DefaultDummyDevice, err))
	}
	k.nl = nl
	sets, err := ipset.New(ipset.Options{Timeout: o.KernelCallTimeout})
	if err == nil {
		if _, err = sets.ListSets(ctx); err != nil {
			_ = sets.Close()
		}
	}
	switch {
	case err == nil:
		k.ipset = sets
	case required:
		return fail(fmt.Errorf("--proxy-mode=ipvs needs the kernel's ipsets (kernel module ip_set and its hash:ip,port types): %w", err))
	default:
		klog.FromContext(ctx).V(2).Info("ipsets not usable; not cleaning ipsets", "err", err)
	}
	return k, nil
}

// newIPVSBackend builds the IPVS backend of one family.
func newIPVSBackend(o *Options, k *ipvsKernel, i ipt.Interface, nodePortAddresses *proxy.NodePortAddresses) (proxier.Backend, error) {
	exclude, err := o.ipvsExcludeCIDRs()
	if err != nil {
		return nil, err
	}
	bit := o.MasqueradeBit
	return ipvsbackend.New(ipvsbackend.Options{
		IPVS: k.ipvs, Netlink: k.nl, IPSet: k.ipset, IPTables: i, Sysctl: ipvsbackend.ProcSysctl{},
		Scheduler: o.IPVSScheduler, StrictARP: o.IPVSStrictARP,
		Timeouts:     ipvs.Timeouts{TCP: o.IPVSTCPTimeout, TCPFin: o.IPVSTCPFinTimeout, UDP: o.IPVSUDPTimeout},
		ExcludeCIDRs: exclude, MasqueradeBit: &bit, NodePortAddresses: nodePortAddresses,
		CanaryInterval: o.SyncPeriod,
	})
}
