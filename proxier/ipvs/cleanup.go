package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	iptbackend "github.com/kproxy/kproxy/proxier/iptables"
)

// CleanupOptions names one IP family's kernel interfaces for Cleanup.
// IPTables is required (it also gives the family); a nil IPVS, IPSet or
// Netlink is skipped, for a kernel that lacks it (and so cannot hold
// anything of kproxy's there).
type CleanupOptions struct {
	IPTables ipt.Interface
	IPVS     ipvs.Interface
	IPSet    ipset.Interface
	Netlink  netlink.Interface
	// DummyDevice: default DefaultDummyDevice.
	DummyDevice string

	// ours are virtual servers known to be kproxy's (a Backend's record).
	ours map[vsKey]bool
}

// Cleanup removes what kproxy left for one family, in an order that never
// leaves a reference dangling: the iptables jumps and chains of both proxy
// modes first, then IPVS mode's ipsets (nothing references them any more),
// then kproxy's IPVS virtual servers (by the ownership rule of the package
// documentation, read before the sets go), then the family's addresses on
// the dummy device, and the device itself once it holds no address. Foreign
// virtual servers, sets, chains and devices stay. Running it again changes
// nothing.
func Cleanup(ctx context.Context, opts CleanupOptions) error {
	if opts.IPTables == nil {
		return errors.New("ipvs cleanup: IPTables is required")
	}
	if opts.DummyDevice == "" {
		opts.DummyDevice = DefaultDummyDevice
	}
	logger := klog.FromContext(ctx)
	ipv6 := opts.IPTables.Protocol() == ipt.ProtocolIPv6
	var errs []error

	if err := iptbackend.CleanupChains(ctx, opts.IPTables, iptbackend.IsKProxyChain); err != nil {
		errs = append(errs, fmt.Errorf("removing iptables chains: %w", err))
	}

	// Ownership evidence, before the sets and addresses go.
	bound := map[netip.Addr]bool{}
	if opts.Netlink != nil {
		addrs, err := opts.Netlink.ListBoundAddresses(ctx, opts.DummyDevice)
		switch {
		case errors.Is(err, netlink.ErrNotExist):
		case err != nil:
			errs = append(errs, fmt.Errorf("listing addresses of %s: %w", opts.DummyDevice, err))
		default:
			for _, a := range addrs {
				if a.Is6() == ipv6 {
					bound[a] = true
				}
			}
		}
	}
	recorded := map[vsKey]bool{}
	if opts.IPSet != nil {
		var err error
		if recorded, err = recordedVS(ctx, opts.IPSet, ipv6); err != nil {
			errs = append(errs, err)
		}
		for _, name := range SetNames(ipv6) {
			if err := opts.IPSet.DestroySet(ctx, name); err != nil {
				errs = append(errs, fmt.Errorf("destroying ipset %s: %w", name, err))
			}
		}
	}

	if opts.IPVS != nil {
		svcs, err := opts.IPVS.Services(ctx)
		if err != nil {
			errs = append(errs, err)
		}
		deleted := 0
		for _, s := range svcs {
			k := keyOf(s)
			if s.Address.Is6() != ipv6 || !(recorded[k] || opts.ours[k]) {
				continue
			}
			if err := opts.IPVS.DeleteService(ctx, s); err != nil && !errors.Is(err, ipvs.ErrNotExist) {
				errs = append(errs, err)
				continue
			}
			deleted++
		}
		logger.V(2).Info("Deleted kproxy's IPVS virtual servers", "count", deleted, "ipv6", ipv6)
	}

	if opts.Netlink != nil {
		for a := range bound {
			if err := opts.Netlink.UnbindAddress(ctx, a, opts.DummyDevice); err != nil {
				errs = append(errs, fmt.Errorf("unbinding %s: %w", a, err))
			}
		}
		left, err := opts.Netlink.ListBoundAddresses(ctx, opts.DummyDevice)
		switch {
		case errors.Is(err, netlink.ErrNotExist):
		case err != nil:
			errs = append(errs, fmt.Errorf("listing addresses of %s: %w", opts.DummyDevice, err))
		case len(left) == 0:
			if err := opts.Netlink.DeleteDummyDevice(ctx, opts.DummyDevice); err != nil {
				errs = append(errs, fmt.Errorf("deleting %s: %w", opts.DummyDevice, err))
			}
		default:
			logger.V(2).Info("Keeping the dummy device: it holds addresses of the other family", "device", opts.DummyDevice, "addresses", len(left))
		}
	}
	return errors.Join(errs...)
}

// Cleanup implements proxier.Backend: see the package function Cleanup.
// The backend's own record of virtual servers counts as ownership too.
func (b *Backend) Cleanup(ctx context.Context) error {
	ours := make(map[vsKey]bool, len(b.ours))
	for k := range b.ours {
		ours[k] = true
	}
	err := Cleanup(ctx, CleanupOptions{
		IPTables: b.ipt, IPVS: b.ipvs, IPSet: b.ipset, Netlink: b.nl, DummyDevice: b.device, ours: ours,
	})
	b.ours = map[vsKey]bool{}
	b.terminating = map[vsKey]*termVS{}
	b.reset()
	b.nodePortAddrs, b.localAddrs = nil, nil
	return err
}
