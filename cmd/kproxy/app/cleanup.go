package app

// Cleanup: --cleanup removes what every mode left; a mode starting up
// removes what the other modes left (a node switching modes without
// --cleanup), since their rules would otherwise go on handling service
// traffic. Only kproxy's own state goes (proxier/cleanup names it), never
// kube-proxy's.

import (
	"context"
	"errors"
	"fmt"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/metrics"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier/cleanup"
	ipvsbackend "github.com/kproxy/kproxy/proxier/ipvs"
)

// kernelCleanup holds the kernel interfaces beyond iptables that a cleanup
// reaches. A nil one is skipped: the kernel (or the node) lacks it, so
// nothing of kproxy's can be there.
type kernelCleanup struct {
	ipvs  ipvs.Interface
	ipset ipset.Interface
	nl    netlink.Interface
	// nft is bound to no table (cleanup.OpenNFTables).
	nft knftables.Interface
}

// openKernelCleanup opens the real interfaces of a cleanup: IPVS mode's
// (ipvs), where the kernel has them, and nftables (nft), where the nft
// command exists. What it could open is returned even with an error, so
// that the cleanup goes as far as it can. close releases them.
func openKernelCleanup(ctx context.Context, o *Options, ipvsToo, nft bool) (kc *kernelCleanup, closeFn func(), err error) {
	kc, closeFn = &kernelCleanup{}, func() {}
	var errs []error
	if ipvsToo {
		k, err := openIPVSKernel(ctx, o, false)
		if err != nil {
			errs = append(errs, err)
		} else {
			closeFn = k.close
			// Only the members the kernel has: a nil pointer in an
			// interface would not read as absent.
			if k.ipvs != nil {
				kc.ipvs = k.ipvs
			}
			if k.ipset != nil {
				kc.ipset = k.ipset
			}
			if k.nl != nil {
				kc.nl = k.nl
			}
		}
	}
	if nft {
		i, err := cleanup.OpenNFTables(ctx)
		if err != nil {
			errs = append(errs, err)
		} else if i != nil {
			kc.nft = i
		}
	}
	return kc, closeFn, errors.Join(errs...)
}

// cleanupAll removes what every mode left, for both families, with
// cleanup.Cleanup: nftables mode's table (when kc.nft is set), iptables
// chains and jumps, then IPVS mode's ipsets, virtual servers and dummy
// device (where the kernel has them). A family without iptables still
// loses its nftables table. It goes on after an error and returns them all.
func cleanupAll(ctx context.Context, ipts map[v1.IPFamily]ipt.Interface, kc *kernelCleanup) error {
	logger := klog.FromContext(ctx)
	var errs []error
	for _, fam := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
		i, ok := ipts[fam]
		if !ok {
			if kc.nft != nil {
				if err := cleanup.RemoveNFTablesTable(ctx, kc.nft, fam == v1.IPv6Protocol); err != nil {
					errs = append(errs, fmt.Errorf("%s cleanup: %w", fam, err))
				}
			}
			continue
		}
		opts := cleanup.Options{IPTables: i, IPVS: kc.ipvs, IPSet: kc.ipset, Netlink: kc.nl, NFTables: kc.nft}
		if err := cleanup.Cleanup(ctx, opts); err != nil {
			errs = append(errs, fmt.Errorf("%s cleanup: %w", fam, err))
			continue
		}
		logger.Info("Removed kproxy's rules", "family", fam)
	}
	if kc.nl != nil {
		if err := kc.nl.DeleteDummyDevice(ctx, ipvsbackend.DefaultDummyDevice); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// RunCleanup removes every rule kproxy created, in every mode and for both
// families, and returns. Without a usable iptables it still removes the
// rest, and reports it.
func RunCleanup(ctx context.Context, o *Options) error {
	ipts, iptErr := iptablesFor(ctx, o)
	if iptErr != nil {
		ipts = nil
	}
	kc, closeKC, kcErr := openKernelCleanup(ctx, o, true, true)
	defer closeKC()
	return errors.Join(iptErr, kcErr, cleanupAll(ctx, ipts, kc))
}

// cleanupOtherModes removes, as mode starts, what the other modes left:
//   - nftables mode: every iptables chain of kproxy's (both other modes')
//     and IPVS mode's ipsets, virtual servers and dummy device; its own
//     table stays (its backend keeps what it may);
//   - iptables and IPVS modes: the other one's iptables chains (their
//     hooks reference them) and nftables mode's tables.
//
// kc (nil: the real kernel's) supplies the interfaces beyond iptables.
// Failures are logged, and failures to remove nftables tables counted:
// kproxy runs on.
func cleanupOtherModes(ctx context.Context, o *Options, mode string, ipts map[v1.IPFamily]ipt.Interface, kc *kernelCleanup, m *metrics.Metrics) {
	logger := klog.FromContext(ctx)
	if mode == ModeNFTables {
		if kc == nil {
			var closeKC func()
			var err error
			kc, closeKC, err = openKernelCleanup(ctx, o, true, false)
			defer closeKC()
			if err != nil {
				logger.Error(err, "Opening the kernel's IPVS interfaces failed; IPVS mode's leftovers may stay")
			}
		}
		noNFT := *kc
		noNFT.nft = nil
		if len(ipts) == 0 {
			logger.Info("No usable iptables: not looking for iptables and IPVS modes' chains")
		}
		if err := cleanupAll(ctx, ipts, &noNFT); err != nil {
			logger.Error(err, "Removing the other proxy modes' state failed")
		}
		return
	}
	other := cleanup.IsIPVSChain
	if mode == ModeIPVS {
		other = cleanup.IsIPTablesChain
	}
	for fam, i := range ipts {
		if err := cleanup.RemoveChains(ctx, i, other); err != nil {
			logger.Error(err, "Removing the other proxy mode's iptables chains failed", "family", fam)
		}
	}
	var nft knftables.Interface
	if kc != nil {
		nft = kc.nft
	} else {
		i, err := cleanup.OpenNFTables(ctx)
		if err != nil {
			logger.Info("nftables is not usable; not looking for nftables mode's tables", "err", err)
		} else if i != nil {
			nft = i
		}
	}
	if nft == nil {
		return
	}
	for _, fam := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
		if err := cleanup.RemoveNFTablesTable(ctx, nft, fam == v1.IPv6Protocol); err != nil {
			logger.Error(err, "Removing nftables mode's table failed", "family", fam)
			m.NFTablesCleanupFailed(fam)
		}
	}
}
