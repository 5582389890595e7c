package ipvs

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/ipset"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// A sync applies its service ports' plans in two phases (docs/design.md,
// "IPVS mode under faults"). The growing phase makes every addition and
// update: set entries, addresses, virtual servers and real servers, the
// rules. A kernel refusal of one of them sets the service ports that want
// the refused object aside: their plans go back, in the bookkeeping, to
// what they were before the sync (tx.old). The shrinking phase then
// removes what nobody wants any more: what the other ports dropped, and
// what this sync added for a port it set aside. Nothing a port had is
// deleted before the sync knows that the port keeps its new plan.

// syncTxn is one sync's work on the bookkeeping: the service ports it
// changes, what each had before, what it added to the kernel, and the
// refusals met.
type syncTxn struct {
	b       *Backend
	full    bool
	addrs   *refCounts[netip.Addr]
	entries *refCounts[setEntry]
	// changed are the service ports this sync gives a new plan (every port
	// of a full sync), sorted; old holds each one's plan before the sync
	// (nil: none). A port set aside goes back to its old plan.
	changed []proxy.ServicePortName
	old     map[proxy.ServicePortName]*servicePlan
	// refused are the service ports set aside in this sync, with the
	// refusal.
	refused map[proxy.ServicePortName]error
	// added and bound are the set entries and addresses this sync added.
	added map[setEntry]bool
	bound map[netip.Addr]bool
	// grown are the virtual servers this sync created or changed.
	grown map[vsKey]*grownVS
	// moved are the virtual servers that changed owner when a port was
	// set aside.
	moved map[vsKey]bool
	// rulesWritten: the rules were written in this sync; rulesStale: a
	// port set aside since then had other rules in its new plan than in
	// its old one.
	rulesWritten, rulesStale bool
}

// grownVS is a virtual server as the growing phase made it, with the real
// servers to delete if it keeps that plan.
type grownVS struct {
	v    *virtualServer
	dels []*ipvs.Destination
}

func (b *Backend) newTxn(full bool) *syncTxn {
	return &syncTxn{
		b: b, full: full,
		addrs:   &refCounts[netip.Addr]{refs: b.addrRefs, before: map[netip.Addr]int{}},
		entries: &refCounts[setEntry]{refs: b.entryRefs, before: map[setEntry]int{}},
		old:     map[proxy.ServicePortName]*servicePlan{},
		refused: map[proxy.ServicePortName]error{},
		added:   map[setEntry]bool{},
		bound:   map[netip.Addr]bool{},
		grown:   map[vsKey]*grownVS{},
		moved:   map[vsKey]bool{},
	}
}

// nodeWide reports whether err is a failure of the node rather than a
// refusal of one service port's object: a deadline or cancellation, IPVS
// or a scheduler missing, a set or the dummy device gone, a virtual server
// gone while the sync worked on it. Such a failure fails the sync (the
// next one is full and recreates what went) instead of setting every
// service port that met it aside.
func nodeWide(err error) bool {
	for _, target := range []error{
		context.Canceled, context.DeadlineExceeded,
		ipvs.ErrUnavailable, ipvs.ErrSchedulerUnavailable, ipvs.ErrNotExist,
		ipset.ErrNotExist, netlink.ErrNotExist, netlink.ErrNotDummy,
	} {
		if errors.Is(err, target) {
			return true
		}
	}
	return false
}

// setAside puts name back to its plan before the sync, in the
// bookkeeping: what the new plan alone wanted is removed by the shrinking
// phase, what the old plan had stays.
func (tx *syncTxn) setAside(ctx context.Context, name proxy.ServicePortName, err error) {
	if _, done := tx.refused[name]; done {
		return
	}
	tx.refused[name] = err
	b := tx.b
	keys := map[vsKey]bool{}
	cur, old := b.plans[name], tx.old[name]
	if cur != nil {
		for _, v := range cur.vs {
			keys[keyOf(&v.svc)] = true
		}
		b.removePlan(name, cur, tx.addrs, tx.entries)
		delete(b.plans, name)
	}
	if old != nil {
		for _, v := range old.vs {
			keys[keyOf(&v.svc)] = true
		}
		b.addPlan(ctx, name, old, tx.addrs, tx.entries)
		b.plans[name] = old
	}
	for _, v := range b.resolveContested(keys) {
		tx.moved[keyOf(&v.svc)] = true
	}
	if tx.rulesWritten && !sameRules(cur, old) {
		tx.rulesStale = true
	}
	klog.FromContext(ctx).V(2).Info("Setting service port aside: the kernel refused part of its new state; it keeps its last good state",
		"servicePort", name.String(), "hadState", old != nil, "err", err)
}

// sameRules reports whether two plans (nil: none) give the same rules.
func sameRules(a, b *servicePlan) bool {
	var as, bs []string
	var ac, bc map[string][]string
	if a != nil {
		as, ac = a.shortcut, a.chains
	}
	if b != nil {
		bs, bc = b.shortcut, b.chains
	}
	return slices.Equal(as, bs) && maps.EqualFunc(ac, bc, slices.Equal)
}

// current lists the changed service ports not set aside, with their plans.
func (tx *syncTxn) current(yield func(proxy.ServicePortName, *servicePlan) bool) {
	for _, name := range tx.changed {
		if _, out := tx.refused[name]; out {
			continue
		}
		if p := tx.b.plans[name]; p != nil && !yield(name, p) {
			return
		}
	}
}

// attribute sets aside every changed service port whose plan wants one of
// the failed objects (wants lists a plan's objects of that kind); it
// returns, as node-wide errors, the failures no such port wants.
func attribute[K comparable](ctx context.Context, tx *syncTxn, failed map[K]error, wants func(*servicePlan) []K) []error {
	if len(failed) == 0 {
		return nil
	}
	claimed := map[K]bool{}
	for name, p := range tx.current {
		for _, k := range wants(p) {
			if err, ok := failed[k]; ok {
				claimed[k] = true
				tx.setAside(ctx, name, err)
				break
			}
		}
	}
	var errs []error
	for k, err := range failed {
		if !claimed[k] {
			errs = append(errs, err)
		}
	}
	return errs
}

// addEntries adds the set entries of want that some plan still wants.
func (tx *syncTxn) addEntries(ctx context.Context, want []setEntry, st *SyncStats) []error {
	var errs []error
	failed := map[setEntry]error{}
	for _, e := range want {
		if tx.entries.refs[e] == 0 {
			continue // wanted only by ports set aside meanwhile
		}
		if err := tx.b.ipset.AddEntry(ctx, e.set, e.entry); err != nil {
			err = fmt.Errorf("adding %s to %s: %w", e.entry, e.set, err)
			if nodeWide(err) {
				errs = append(errs, err)
			} else {
				failed[e] = err
			}
			continue
		}
		tx.added[e] = true
		st.EntriesAdded++
	}
	return append(errs, attribute(ctx, tx, failed, func(p *servicePlan) []setEntry { return p.entries })...)
}

// bindAddresses binds the addresses of want that some plan still wants.
func (tx *syncTxn) bindAddresses(ctx context.Context, want []netip.Addr, st *SyncStats) []error {
	var errs []error
	failed := map[netip.Addr]error{}
	for _, a := range want {
		if tx.addrs.refs[a] == 0 {
			continue
		}
		if _, err := tx.b.nl.EnsureAddressBound(ctx, a, tx.b.device); err != nil {
			err = fmt.Errorf("binding %s: %w", a, err)
			if nodeWide(err) {
				errs = append(errs, err)
			} else {
				failed[a] = err
			}
			continue
		}
		tx.bound[a] = true
		st.AddressesBound++
	}
	return append(errs, attribute(ctx, tx, failed, func(p *servicePlan) []netip.Addr { return p.addrs })...)
}

// grow brings the virtual server k towards v without deleting anything
// (growVS); a refusal sets its owner aside.
func (tx *syncTxn) grow(ctx context.Context, k vsKey, v *virtualServer, have *ipvs.Service, st *SyncStats) error {
	owner := tx.b.vsOwner[k]
	dels, err := tx.b.growVS(ctx, v, have, st)
	tx.grown[k] = &grownVS{v: v, dels: dels}
	if err == nil {
		return nil
	}
	err = fmt.Errorf("service port %s: %w", owner, err)
	if _, changed := tx.old[owner]; !changed || nodeWide(err) {
		return err
	}
	tx.setAside(ctx, owner, err)
	return nil
}

// maxRuleWrites bounds the restores spent finding the service ports whose
// rules the kernel refuses.
const maxRuleWrites = 64

// writeRules writes the rules of the current plans: every chain on a full
// sync's first write, else the chains that changed, and nothing when no
// changed port's rules differ from its old ones. When the kernel refuses
// them it finds the changed ports responsible (bisectRules) and sets them
// aside.
func (tx *syncTxn) writeRules(ctx context.Context, st *SyncStats) error {
	b := tx.b
	var cands []proxy.ServicePortName
	for _, name := range tx.changed {
		if _, out := tx.refused[name]; !out && !sameRules(b.plans[name], tx.old[name]) {
			cands = append(cands, name)
		}
	}
	full := tx.full && !tx.rulesWritten
	if !full && !tx.rulesStale && (tx.rulesWritten || len(cands) == 0) {
		return nil
	}
	err := b.writeRules(ctx, b.renderRules(nil), full, st)
	tx.rulesWritten, tx.rulesStale = true, false
	if err == nil {
		return nil
	}
	if nodeWide(err) || len(cands) == 0 {
		return err
	}
	refused, err := tx.bisectRules(ctx, cands, err, st)
	if err != nil {
		return err
	}
	for _, name := range cands {
		if rerr, ok := refused[name]; ok {
			tx.setAside(ctx, name, fmt.Errorf("writing its iptables rules: %w", rerr))
		}
	}
	tx.rulesStale = false // bisectRules wrote them as they now are
	return nil
}

// bisectRules finds the candidates (changed service ports) whose rules the
// kernel refuses: with every candidate's old rules, then with halves of
// them new, down to single ports. It leaves the kernel with the new rules
// of every other candidate and returns the refused ones with their
// errors. It fails when the rules fail even with every candidate's old
// rules (then no service port is to blame), or after maxRuleWrites
// restores.
func (tx *syncTxn) bisectRules(ctx context.Context, cands []proxy.ServicePortName, first error, st *SyncStats) (map[proxy.ServicePortName]error, error) {
	b := tx.b
	accepted := map[proxy.ServicePortName]bool{}
	writes := 0
	write := func(with []proxy.ServicePortName) error {
		if writes++; writes > maxRuleWrites {
			return fmt.Errorf("%w (more than %d restores spent looking for the service ports whose rules it refuses)", first, maxRuleWrites)
		}
		on := maps.Clone(accepted)
		for _, n := range with {
			on[n] = true
		}
		override := map[proxy.ServicePortName]*servicePlan{}
		for _, n := range cands {
			if !on[n] {
				override[n] = tx.old[n]
			}
		}
		return b.writeRules(ctx, b.renderRules(override), true, st)
	}
	if err := write(nil); err != nil {
		return nil, fmt.Errorf("%w; and without the new rules of the %d service ports that changed: %w", first, len(cands), err)
	}
	refused := map[proxy.ServicePortName]error{}
	// find looks for the refused ports in set, whose new rules fail with
	// known (nil: not tried).
	var find func(set []proxy.ServicePortName, known error) error
	find = func(set []proxy.ServicePortName, known error) error {
		if known == nil {
			err := write(set)
			if err == nil {
				for _, n := range set {
					accepted[n] = true
				}
				return nil
			}
			if nodeWide(err) || writes > maxRuleWrites {
				return err
			}
			known = err
		}
		if len(set) == 1 {
			refused[set[0]] = known
			return nil
		}
		mid := len(set) / 2
		before := len(refused)
		if err := find(set[:mid], nil); err != nil {
			return err
		}
		if len(refused) == before {
			// The first half is fine: the second fails as the whole did.
			return find(set[mid:], known)
		}
		return find(set[mid:], nil)
	}
	if err := find(cands, first); err != nil {
		return nil, err
	}
	if err := write(nil); err != nil {
		return nil, err
	}
	return refused, nil
}

// shrinkVS finishes the virtual servers this sync grew or moved: one that
// keeps the plan it grew for loses the real servers that plan dropped;
// one wanted by another plan now (its port was set aside, or it moved) is
// reconciled with that plan; one nobody wants any more is deleted.
func (tx *syncTxn) shrinkVS(ctx context.Context, st *SyncStats) []error {
	b := tx.b
	keys := slices.Collect(maps.Keys(tx.grown))
	for k := range tx.moved {
		if tx.grown[k] == nil {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, compareKeys)
	var errs []error
	for _, k := range keys {
		final, g := b.vsWanted[k], tx.grown[k]
		switch {
		case g != nil && final == g.v:
			if err := b.deleteDests(ctx, &g.v.svc, g.dels, st); err != nil {
				errs = append(errs, err)
			}
		case final != nil:
			if err := b.ensureVS(ctx, final, b.previous(k), st); err != nil {
				errs = append(errs, fmt.Errorf("service port %s: %w", b.vsOwner[k], err))
			}
		default:
			svc := &ipvs.Service{Address: k.addr, Protocol: k.proto, Port: k.port, Scheduler: b.opts.Scheduler}
			if err := b.deleteVS(ctx, svc, st); err != nil && !errors.Is(err, ipvs.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errs
}

// unbindUnwanted unbinds the addresses of have (the bound ones this sync
// may remove) and those it bound that no plan wants any more.
func (tx *syncTxn) unbindUnwanted(ctx context.Context, have map[netip.Addr]bool, st *SyncStats) []error {
	cand := maps.Clone(have)
	maps.Copy(cand, tx.bound)
	var errs []error
	for _, a := range slices.SortedFunc(maps.Keys(cand), netip.Addr.Compare) {
		if tx.addrs.refs[a] > 0 {
			continue
		}
		if err := tx.b.nl.UnbindAddress(ctx, a, tx.b.device); err != nil {
			errs = append(errs, fmt.Errorf("unbinding %s: %w", a, err))
			continue
		}
		st.AddressesUnbound++
	}
	return errs
}

// deleteUnwanted deletes the set entries of have (the present ones this
// sync may remove) and those it added that no plan wants any more.
func (tx *syncTxn) deleteUnwanted(ctx context.Context, have map[setEntry]bool, st *SyncStats) []error {
	var gone []setEntry
	for e := range have {
		if tx.entries.refs[e] == 0 {
			gone = append(gone, e)
		}
	}
	for e := range tx.added {
		if tx.entries.refs[e] == 0 && !have[e] {
			gone = append(gone, e)
		}
	}
	return tx.b.applyEntries(ctx, nil, gone, st)
}

// setAsideResult is what a sync reports of the ports it set aside: nil
// when none.
func (tx *syncTxn) setAsideResult() map[proxy.ServicePortName]error {
	if len(tx.refused) == 0 {
		return nil
	}
	return tx.refused
}
