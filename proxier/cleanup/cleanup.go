// Package cleanup names what kproxy owns in the kernel, in every proxy
// mode, and removes it: one path for --cleanup, for each backend's Cleanup
// and for a mode starting up over the other mode's leftovers.
//
// kproxy owns, per IP family:
//   - iptables chains (nat and filter) starting with ChainPrefix, and every
//     rule of another chain that jumps or goes to one of them (the hooks);
//     IPVS mode's chains start with IPVSChainPrefix;
//   - IPVS mode's ipsets (IPVSSetNames);
//   - IPVS virtual servers recorded in those sets (RecordedVirtualServers)
//     or known to a running backend;
//   - IPVS mode's dummy device (DefaultDummyDevice) and its addresses;
//   - nftables mode's table (NFTablesTable: "ip kproxy", "ip6 kproxy") and
//     everything in it; never another table (kube-proxy's "kube-proxy"
//     tables, iptables-nft's tables).
//
// A new mode adds what it owns here and its removal to Cleanup.
package cleanup

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
	"sigs.k8s.io/knftables"
)

// Options names one IP family's kernel interfaces. IPTables is required
// (it also gives the family); a nil IPVS, IPSet, Netlink or NFTables is
// skipped, for a kernel that lacks it (and so cannot hold anything of
// kproxy's there).
type Options struct {
	IPTables ipt.Interface
	IPVS     ipvs.Interface
	IPSet    ipset.Interface
	Netlink  netlink.Interface
	// NFTables is an nftables interface bound to no table (OpenNFTables);
	// only kproxy's table of the family is deleted through it.
	NFTables knftables.Interface
	// DummyDevice: default DefaultDummyDevice.
	DummyDevice string
	// OwnedVirtualServers are virtual servers known to be kproxy's besides
	// those its sets record (an IPVS backend's own record).
	OwnedVirtualServers map[VirtualServer]bool
}

// RemoveChains removes, in the nat and filter tables, every chain for
// which owned is true together with every rule of another chain that
// jumps or goes to one of them: one iptables-restore per table, so the
// table never holds a jump to a missing chain. Chains and rules of anyone
// else stay; running it again changes nothing. A mode starting up passes
// the other mode's chains (IsIPVSChain, IsIPTablesChain) to clear its
// leftovers.
func RemoveChains(ctx context.Context, iface ipt.Interface, owned func(chain string) bool) error {
	tables := []ipt.Table{ipt.TableNAT, ipt.TableFilter, ipt.TableMangle}
	_, err := ipt.RemoveChains(ctx, iface, tables, func(_ ipt.Table, chain string) bool { return owned(chain) })
	return err
}

// Cleanup removes what kproxy left for one family, in every mode, in an
// order that never leaves a reference dangling: nftables mode's table
// (nothing outside it refers to it), the iptables hooks and chains of the
// other modes, then IPVS mode's ipsets (nothing references
// them any more), then kproxy's IPVS virtual servers (by the ownership
// rule of the package documentation, read before the sets go), then the
// family's addresses on the dummy device, and the device itself once it
// holds no address. Foreign virtual servers, sets, chains and devices
// stay. It goes on after an error and returns them all. Running it again
// changes nothing.
func Cleanup(ctx context.Context, opts Options) error {
	if opts.IPTables == nil {
		return errors.New("cleanup: IPTables is required")
	}
	if opts.DummyDevice == "" {
		opts.DummyDevice = DefaultDummyDevice
	}
	logger := klog.FromContext(ctx)
	ipv6 := opts.IPTables.Protocol() == ipt.ProtocolIPv6
	var errs []error

	if opts.NFTables != nil {
		if err := RemoveNFTablesTable(ctx, opts.NFTables, ipv6); err != nil {
			errs = append(errs, err)
		}
	}

	if err := RemoveChains(ctx, opts.IPTables, IsChain); err != nil {
		errs = append(errs, fmt.Errorf("removing iptables chains: %w", err))
	}

	// IPVS mode. Ownership evidence first, before the sets and addresses
	// go.
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
	recorded := map[VirtualServer]bool{}
	if opts.IPSet != nil {
		var err error
		if recorded, err = RecordedVirtualServers(ctx, opts.IPSet, ipv6); err != nil {
			errs = append(errs, err)
		}
		for _, name := range IPVSSetNames(ipv6) {
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
			k := VirtualServerOf(s)
			if s.Address.Is6() != ipv6 || !(recorded[k] || opts.OwnedVirtualServers[k]) {
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
