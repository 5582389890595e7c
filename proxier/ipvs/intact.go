package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// checkIntact looks, before a partial sync, for what an external tool may
// have removed since the last sync (docs/design.md, "IPVS mode under
// faults"):
//   - a set destroyed: one listing of the set names;
//   - a set flushed (ipset flush, of every set or of one by name): one
//     wanted entry of each of kproxy's sets, any of them, tested (the
//     canary's for a flush of every set);
//   - every virtual server deleted (ipvsadm -C): one virtual server of
//     kproxy's, any of them, looked up by its real servers;
//   - addresses removed from the dummy device (ip addr del or flush, a
//     network manager) or the device deleted: one listing of the device's
//     addresses, compared with those wanted, when the last listing is at
//     least half of Options.CanaryInterval old; else one of kproxy's
//     addresses, any of them, bound again (the kernel says whether it was
//     there), which finds them all flushed or the device deleted.
//
// The kernel requests do not grow with the number of services, except the
// listing of the device's addresses, at most every half canary interval.
// It returns what it found ("" when nothing): the sync is then made full,
// which reconciles everything with the kernel. A failure to look counts as
// a finding.
func (b *Backend) checkIntact(ctx context.Context) string {
	for _, check := range []func(context.Context) string{b.checkSets, b.checkVirtualServers, b.checkAddresses} {
		if found := check(ctx); found != "" {
			return found
		}
	}
	return ""
}

// checkSets finds a set destroyed, or flushed.
func (b *Backend) checkSets(ctx context.Context) string {
	names, err := b.ipset.ListSets(ctx)
	if err != nil {
		return fmt.Sprintf("listing ipsets failed: %v", err)
	}
	for _, want := range cleanup.IPVSSetNames(b.ipv6) {
		if _, ok := slices.BinarySearch(names, want); !ok {
			return "ipset " + want + " is gone"
		}
	}
	canary := canaryEntry(b.ipv6)
	samples := []setEntry{canary}
	for _, e := range b.setSamples() {
		if e.set != canary.set {
			samples = append(samples, e)
		}
	}
	for _, e := range samples {
		ok, err := b.ipset.HasEntry(ctx, e.set, e.entry)
		switch {
		case err != nil:
			return fmt.Sprintf("testing ipset %s for %s failed: %v", e.set, e.entry, err)
		case !ok:
			return fmt.Sprintf("ipset %s was flushed (it lost %s)", e.set, e.entry)
		}
	}
	return ""
}

// setSamples returns one wanted entry of each of kproxy's sets that has
// any, sorted by set: whichever the map yields first, so that over many
// syncs the check samples all of them. It walks the wanted entries in
// memory once at most (no kernel request), and stops as soon as every set
// has its sample.
func (b *Backend) setSamples() []setEntry {
	sets := len(cleanup.IPVSSets())
	found := make(map[string]setEntry, sets)
	for e := range b.entryRefs {
		if _, ok := found[e.set]; !ok {
			found[e.set] = e
			if len(found) == sets {
				break
			}
		}
	}
	out := make([]setEntry, 0, len(found))
	for _, e := range found {
		out = append(out, e)
	}
	slices.SortFunc(out, compareSetEntries)
	return out
}

// checkVirtualServers finds every virtual server deleted: it looks up one
// of kproxy's, whichever the map yields first.
func (b *Backend) checkVirtualServers(ctx context.Context) string {
	for k := range b.applied {
		_, err := b.ipvs.Destinations(ctx, &ipvs.Service{Address: k.addr, Protocol: k.proto, Port: k.port, Scheduler: b.opts.Scheduler})
		switch {
		case errors.Is(err, ipvs.ErrNotExist):
			return "IPVS virtual server " + k.String() + " is gone"
		case err != nil:
			return fmt.Sprintf("looking up IPVS virtual server %s failed: %v", k, err)
		}
		break
	}
	return ""
}

// checkAddresses finds addresses removed from the dummy device, or the
// device deleted: by listing the device's addresses and looking for every
// wanted one when the last listing is at least half a canary interval old,
// else by probing one address (probeAddress).
func (b *Backend) checkAddresses(ctx context.Context) string {
	if len(b.addrRefs) == 0 {
		return ""
	}
	now := b.clock.Now()
	if now.Sub(b.addrsListed) < b.opts.CanaryInterval/2 {
		return b.probeAddress(ctx)
	}
	bound, err := b.nl.ListBoundAddresses(ctx, b.device)
	switch {
	case errors.Is(err, netlink.ErrNotExist):
		return "device " + b.device + " is gone"
	case err != nil:
		return fmt.Sprintf("listing the addresses of %s failed: %v", b.device, err)
	}
	b.addrsListed = now
	var missing []netip.Addr
	for a := range b.addrRefs {
		if _, ok := slices.BinarySearchFunc(bound, a, netip.Addr.Compare); !ok {
			missing = append(missing, a)
		}
	}
	if len(missing) == 0 {
		return ""
	}
	slices.SortFunc(missing, netip.Addr.Compare)
	if len(missing) == 1 {
		return "address " + missing[0].String() + " was missing from " + b.device
	}
	return fmt.Sprintf("address %s (and %d more) was missing from %s", missing[0], len(missing)-1, b.device)
}

// probeAddress finds the dummy device's addresses flushed, or the device
// deleted: it binds one of kproxy's addresses again, whichever the map
// yields first, and the kernel says whether the device had it.
func (b *Backend) probeAddress(ctx context.Context) string {
	for a := range b.addrRefs {
		existed, err := b.nl.EnsureAddressBound(ctx, a, b.device)
		switch {
		case errors.Is(err, netlink.ErrNotExist):
			return "device " + b.device + " is gone"
		case err != nil:
			return fmt.Sprintf("binding %s to %s failed: %v", a, b.device, err)
		case !existed:
			return "address " + a.String() + " was missing from " + b.device
		}
		break
	}
	return ""
}
