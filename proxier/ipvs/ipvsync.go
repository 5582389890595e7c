package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/ipset"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// kernelServices lists this family's virtual servers.
func (b *Backend) kernelServices(ctx context.Context) (map[vsKey]*ipvs.Service, error) {
	all, err := b.ipvs.Services(ctx)
	if err != nil {
		return nil, err
	}
	out := make(map[vsKey]*ipvs.Service, len(all))
	for _, s := range all {
		if s.Address.Is6() == b.ipv6 {
			out[keyOf(s)] = s
		}
	}
	return out, nil
}

// boundAddresses lists this family's addresses on the dummy device (none
// when it does not exist).
func (b *Backend) boundAddresses(ctx context.Context) (map[netip.Addr]bool, error) {
	addrs, err := b.nl.ListBoundAddresses(ctx, b.device)
	if errors.Is(err, netlink.ErrNotExist) {
		return map[netip.Addr]bool{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing addresses of %s: %w", b.device, err)
	}
	out := make(map[netip.Addr]bool, len(addrs))
	for _, a := range addrs {
		if a.Is6() == b.ipv6 {
			out[a] = true
		}
	}
	return out, nil
}

// recordedVS reads the virtual servers kproxy last recorded in its sets
// (cleanup.RecordedVirtualServers): they are kproxy's.
func recordedVS(ctx context.Context, sets ipset.Interface, ipv6 bool) (map[vsKey]bool, error) {
	recorded, err := cleanup.RecordedVirtualServers(ctx, sets, ipv6)
	if err != nil {
		return nil, err
	}
	out := make(map[vsKey]bool, len(recorded))
	for v := range recorded {
		out[vsKey{v.Address, v.Protocol, v.Port}] = true
	}
	return out, nil
}

// ensureVS makes the kernel's virtual server match v: created when have is
// nil, its scheduler and persistence updated, its real servers reconciled
// with graceful termination.
func (b *Backend) ensureVS(ctx context.Context, v *virtualServer, have *ipvs.Service, st *SyncStats) error {
	dels, err := b.growVS(ctx, v, have, st)
	return errors.Join(err, b.deleteDests(ctx, &v.svc, dels, st))
}

// growVS is ensureVS without deletions: it creates the virtual server or
// updates its scheduler and persistence, adds the missing real servers,
// gives the wanted ones weight 1 and quiesces the others; it returns the
// real servers to delete (those without connections left, or waiting too
// long, and every UDP one), even when it fails.
func (b *Backend) growVS(ctx context.Context, v *virtualServer, have *ipvs.Service, st *SyncStats) ([]*ipvs.Destination, error) {
	k := keyOf(&v.svc)
	if have == nil {
		err := b.ipvs.AddService(ctx, &v.svc)
		if err == nil {
			b.ours[k] = true
			b.applied[k] = v.svc
			st.ServicesAdded++
			var errs []error
			for _, d := range v.dests {
				if err := b.ipvs.AddDestination(ctx, &v.svc, &ipvs.Destination{Address: d.addr, Port: d.port, Weight: 1}); err != nil {
					errs = append(errs, err)
					continue
				}
				st.DestinationsAdded++
			}
			return nil, errors.Join(errs...)
		}
		if !errors.Is(err, ipvs.ErrExist) {
			return nil, err
		}
		have = &ipvs.Service{} // exists already: adopt it, settings unknown
	}
	// A kernel service of the same address, protocol and port that kproxy
	// wants is kproxy's: adopt it.
	b.ours[k] = true
	if !v.sameProps(have) {
		if err := b.ipvs.UpdateService(ctx, &v.svc); err != nil {
			if !errors.Is(err, ipvs.ErrNotExist) {
				return nil, err
			}
			delete(b.applied, k)
			return b.growVS(ctx, v, nil, st) // deleted behind kproxy's back
		}
		st.ServicesUpdated++
	}
	b.applied[k] = v.svc
	dests, err := b.ipvs.Destinations(ctx, &v.svc)
	if errors.Is(err, ipvs.ErrNotExist) {
		delete(b.applied, k)
		return b.growVS(ctx, v, nil, st)
	}
	if err != nil {
		return nil, err
	}
	return b.reconcileDests(ctx, v, dests, st)
}

// reconcileDests adds v's missing real servers, gives the wanted ones
// weight 1 and terminates the others gracefully; it returns those to
// delete. The others are terminated only once every wanted one is in
// place: when an addition fails (refused, or a call that timed out) the
// old real servers keep carrying the virtual server's connections, as
// they did before the sync, instead of leaving it with none at weight 1
// (docs/design.md, "IPVS mode under faults").
func (b *Backend) reconcileDests(ctx context.Context, v *virtualServer, have []*ipvs.Destination, st *SyncStats) ([]*ipvs.Destination, error) {
	k := keyOf(&v.svc)
	want := make(map[destKey]bool, len(v.dests))
	for _, d := range v.dests {
		want[d] = true
	}
	var errs []error
	var unwanted []*ipvs.Destination
	seen := make(map[destKey]bool, len(have))
	for _, d := range have {
		dk := destKey{d.Address, d.Port}
		seen[dk] = true
		if !want[dk] {
			unwanted = append(unwanted, d)
			continue
		}
		b.clearTerminating(k, dk)
		if d.Weight != 1 {
			if err := b.ipvs.UpdateDestination(ctx, &v.svc, &ipvs.Destination{Address: d.Address, Port: d.Port, Weight: 1}); err != nil {
				errs = append(errs, err)
				continue
			}
			st.DestinationsUpdated++
		}
	}
	for _, dk := range v.dests {
		if seen[dk] {
			continue
		}
		if err := b.ipvs.AddDestination(ctx, &v.svc, &ipvs.Destination{Address: dk.addr, Port: dk.port, Weight: 1}); err != nil {
			errs = append(errs, err)
			continue
		}
		st.DestinationsAdded++
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	var dels []*ipvs.Destination
	for _, d := range unwanted {
		del, err := b.terminate(ctx, &v.svc, d, st)
		if err != nil {
			errs = append(errs, err)
		}
		if del {
			dels = append(dels, d)
		}
	}
	return dels, errors.Join(errs...)
}

// terminate handles a real server kproxy no longer wants: a UDP one is to
// be deleted at once; a TCP or SCTP one gets weight 0 (no new connections)
// and is to be deleted when its active and inactive connections are gone,
// or when it has waited GracefulTerminationTimeout. It reports whether to
// delete it (deleteDests does).
func (b *Backend) terminate(ctx context.Context, svc *ipvs.Service, d *ipvs.Destination, st *SyncStats) (bool, error) {
	if svc.Protocol == ipvs.ProtocolUDP {
		return true, nil
	}
	k, dk := keyOf(svc), destKey{d.Address, d.Port}
	now := b.clock.Now()
	t := b.terminating[k]
	if t == nil {
		t = &termVS{svc: *svc, since: map[destKey]time.Time{}}
		b.terminating[k] = t
	}
	since, ok := t.since[dk]
	if !ok {
		since = now
		t.since[dk] = now
	}
	if d.ActiveConnections+d.InactiveConnections == 0 {
		return true, nil
	}
	if d.Weight != 0 {
		if err := b.ipvs.UpdateDestination(ctx, svc, &ipvs.Destination{Address: d.Address, Port: d.Port, Weight: 0}); err != nil {
			return false, err
		}
		st.DestinationsUpdated++
		klog.FromContext(ctx).V(3).Info("Quiesced IPVS real server", "virtualServer", k, "realServer", dk,
			"activeConnections", d.ActiveConnections, "inactiveConnections", d.InactiveConnections)
	}
	return now.Sub(since) >= b.opts.GracefulTerminationTimeout, nil
}

// deleteDests deletes real servers terminate gave up on.
func (b *Backend) deleteDests(ctx context.Context, svc *ipvs.Service, dels []*ipvs.Destination, st *SyncStats) error {
	logger := klog.FromContext(ctx)
	k := keyOf(svc)
	var errs []error
	for _, d := range dels {
		if err := b.ipvs.DeleteDestination(ctx, svc, d); err != nil && !errors.Is(err, ipvs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		st.DestinationsDeleted++
		dk := destKey{d.Address, d.Port}
		b.clearTerminating(k, dk)
		logger.V(3).Info("Deleted IPVS real server", "virtualServer", k, "realServer", dk,
			"activeConnections", d.ActiveConnections, "inactiveConnections", d.InactiveConnections)
	}
	return errors.Join(errs...)
}

func (b *Backend) clearTerminating(k vsKey, dk destKey) {
	if t := b.terminating[k]; t != nil {
		delete(t.since, dk)
		if len(t.since) == 0 {
			delete(b.terminating, k)
		}
	}
}

// processTerminating looks again at the real servers waiting at weight 0
// in virtual servers this sync did not touch.
func (b *Backend) processTerminating(ctx context.Context, skip map[vsKey]bool, st *SyncStats) []error {
	var errs []error
	for k, t := range b.terminating {
		if skip[k] {
			continue
		}
		dests, err := b.ipvs.Destinations(ctx, &t.svc)
		if errors.Is(err, ipvs.ErrNotExist) {
			delete(b.terminating, k)
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		want := map[destKey]bool{}
		if v := b.vsWanted[k]; v != nil {
			for _, d := range v.dests {
				want[d] = true
			}
		}
		byKey := make(map[destKey]*ipvs.Destination, len(dests))
		for _, d := range dests {
			byKey[destKey{d.Address, d.Port}] = d
		}
		for dk := range t.since {
			d, ok := byKey[dk]
			switch {
			case !ok:
				b.clearTerminating(k, dk)
			case want[dk]:
				// Wanted again: reconciled by the sync that touches it.
			default:
				del, err := b.terminate(ctx, &t.svc, d, st)
				if err == nil && del {
					err = b.deleteDests(ctx, &t.svc, []*ipvs.Destination{d}, st)
				}
				if err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	return errs
}

// deleteVS deletes a virtual server of kproxy's.
func (b *Backend) deleteVS(ctx context.Context, svc *ipvs.Service, st *SyncStats) error {
	k := keyOf(svc)
	err := b.ipvs.DeleteService(ctx, svc)
	if err != nil && !errors.Is(err, ipvs.ErrNotExist) {
		return err
	}
	delete(b.ours, k)
	delete(b.applied, k)
	delete(b.terminating, k)
	if err == nil {
		st.ServicesDeleted++
	}
	return err
}

// kernelEntries lists the entries of every set of this family (full
// sync).
func (b *Backend) kernelEntries(ctx context.Context) (map[setEntry]bool, error) {
	out := map[setEntry]bool{}
	for _, name := range cleanup.IPVSSetNames(b.ipv6) {
		have, err := b.ipset.Entries(ctx, name)
		if err != nil {
			return nil, err
		}
		for _, e := range have {
			out[setEntry{name, e}] = true
		}
	}
	return out, nil
}

func compareSetEntries(a, b setEntry) int {
	if c := strings.Compare(a.set, b.set); c != 0 {
		return c
	}
	x, y := a.entry, b.entry
	if c := x.IP.Compare(y.IP); c != 0 {
		return c
	}
	if c := strings.Compare(x.Protocol, y.Protocol); c != 0 {
		return c
	}
	if x.Port != y.Port {
		return int(x.Port) - int(y.Port)
	}
	if c := x.IP2.Compare(y.IP2); c != 0 {
		return c
	}
	if c := x.Net.Addr().Compare(y.Net.Addr()); c != 0 {
		return c
	}
	return x.Net.Bits() - y.Net.Bits()
}

// applyEntries adds and deletes set entries.
func (b *Backend) applyEntries(ctx context.Context, added, removed []setEntry, st *SyncStats) []error {
	var errs []error
	for _, e := range added {
		if err := b.ipset.AddEntry(ctx, e.set, e.entry); err != nil {
			errs = append(errs, fmt.Errorf("adding %s to %s: %w", e.entry, e.set, err))
			continue
		}
		st.EntriesAdded++
	}
	for _, e := range removed {
		if err := b.ipset.DelEntry(ctx, e.set, e.entry); err != nil {
			errs = append(errs, fmt.Errorf("deleting %s from %s: %w", e.entry, e.set, err))
			continue
		}
		st.EntriesDeleted++
	}
	return errs
}
