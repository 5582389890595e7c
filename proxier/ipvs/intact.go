package ipvs

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// checkIntact looks, before a partial sync and at a cost that does not
// grow with the number of services, for what an external tool may have
// removed since the last sync (docs/design.md, "IPVS mode under faults"):
//   - a set destroyed: one listing of the set names;
//   - every set flushed (ipset flush): the canary set's one entry;
//   - every virtual server deleted (ipvsadm -C): one virtual server of
//     kproxy's, any of them, looked up by its real servers;
//   - the dummy device's addresses flushed or the device deleted: one of
//     its addresses, any of them, bound again (the kernel says whether it
//     was there).
//
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

// checkSets finds a set destroyed, or every set flushed.
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
	entries, err := b.ipset.Entries(ctx, canary.set)
	if err != nil {
		return fmt.Sprintf("listing ipset %s failed: %v", canary.set, err)
	}
	if !slices.Contains(entries, canary.entry) {
		return "ipset " + canary.set + " was flushed"
	}
	return ""
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

// checkAddresses finds the dummy device's addresses flushed, or the device
// deleted: it binds one of kproxy's addresses again, whichever the map
// yields first, and the kernel says whether the device had it.
func (b *Backend) checkAddresses(ctx context.Context) string {
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
