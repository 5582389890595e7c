package nftables

import (
	"context"
	"fmt"
	"net/netip"
	"slices"

	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// sync runs one sync of mode and, on success, makes its state the
// backend's.
func (b *Backend) sync(ctx context.Context, state *proxy.NodeState, mode string, st *SyncStats) error {
	l := b.layoutFor(state)
	npIPs, err := b.nodePortIPs()
	if err != nil {
		return err
	}
	var next *tableState
	if mode == modePartial {
		next, err = b.syncPartial(ctx, l, state, npIPs, st)
	} else {
		next, err = b.syncFull(ctx, l, state, npIPs, st)
	}
	if err != nil {
		return err
	}
	b.state, b.layout = next, l
	nat, filter := l.staticRules()
	st.NATRules, st.FilterRules = nat+next.rules["nat"], filter+next.rules["filter"]
	return nil
}

// isMapOf tells maps from sets, by name.
func (l *layout) isMapOf() map[string]bool {
	if l.isMap == nil {
		l.isMap = map[string]bool{}
		for _, s := range l.sets() {
			l.isMap[s.name] = s.isMap
		}
	}
	return l.isMap
}

// runTx runs a transaction, counting it in st.
func (b *Backend) runTx(ctx context.Context, tx *knftables.Transaction, st *SyncStats) error {
	start := b.clock.Now()
	err := b.nft.Run(ctx, tx)
	st.KernelTime += b.clock.Since(start)
	st.Transactions++
	if err != nil {
		klog.FromContext(ctx).V(4).Info("Failed nftables transaction", "transaction", tx.String())
	}
	return err
}

// addPlan adds what a plan's transaction wrote (plan.transaction's counts,
// in ps) to st.
func (st *SyncStats) addPlan(ps *SyncStats, ops int) {
	st.Operations += ops
	st.ElementsAdded += ps.ElementsAdded
	st.ElementsDeleted += ps.ElementsDeleted
	st.ChainsWritten += ps.ChainsWritten
	st.ChainsDeleted += ps.ChainsDeleted
	if st.RulesWritten == nil {
		st.RulesWritten = map[string]int{}
	}
	for t, n := range ps.RulesWritten {
		st.RulesWritten[t] += n
	}
}

// syncPartial renders the service ports of state.Changed and writes the
// difference to what b.state says the table has. Service ports that
// cannot be rendered, or whose changes nft refuses, are set aside: they
// keep what the table has for them (their render in b.state), and every
// other change is written in the same sync. It returns b.state, updated.
func (b *Backend) syncPartial(ctx context.Context, l *layout, state *proxy.NodeState, npIPs map[netip.Addr]bool, st *SyncStats) (*tableState, error) {
	s := b.state
	next, refused, err := b.renderChanged(l, state)
	if err != nil {
		return nil, err
	}
	isMap := l.isMapOf()
	for {
		apply := make(map[proxy.ServicePortName]*renderedService, len(next))
		for name, rs := range next {
			if _, out := refused[name]; !out {
				apply[name] = rs
			}
		}
		p, undo := b.applyPartial(l, apply, npIPs)
		var ps SyncStats
		tx := p.transaction(b.nft, isMap, &ps)
		if tx.NumOperations() == 0 {
			break
		}
		runErr := b.runTx(ctx, tx, st)
		if runErr == nil {
			st.addPlan(&ps, tx.NumOperations())
			break
		}
		undo()
		more, err := b.refusedPartial(ctx, runErr, p, tx.NumOperations(), apply, l, npIPs)
		if err != nil {
			return nil, fmt.Errorf("nftables %s sync: %w", st.Mode, err)
		}
		for name, e := range more {
			refused[name] = e
		}
	}
	b.refused = refused
	for name := range next {
		if e, out := refused[name]; out {
			b.setAside[name] = e
		} else {
			delete(b.setAside, name)
		}
	}
	for name := range b.setAside {
		if _, ok := state.Services[name]; !ok {
			// Deleted while set aside (and never in the table).
			delete(b.setAside, name)
		}
	}
	return s, nil
}

// renderChanged renders the service ports of the changed services: next
// holds their renders (nil: deleted), refused those that cannot be
// rendered.
func (b *Backend) renderChanged(l *layout, state *proxy.NodeState) (next map[proxy.ServicePortName]*renderedService, refused map[proxy.ServicePortName]error, err error) {
	s := b.state
	// The work is proportional to the changed services: their known ports
	// are looked up by name; the state is scanned for ports never seen
	// only when it has more than the known ones that stay.
	next = map[proxy.ServicePortName]*renderedService{}
	refused = map[proxy.ServicePortName]error{}
	render := func(name proxy.ServicePortName, svc *proxy.ServiceState) {
		rs, err := l.render(svc, s.slots)
		if err != nil {
			// It keeps what the table has (set aside).
			refused[name] = renderError(err)
		}
		next[name] = rs
	}
	after := len(s.services)
	for nn := range state.Changed {
		for _, name := range s.byName[nn] {
			svc, ok := state.Services[name]
			if !ok {
				next[name] = nil
				after--
				continue
			}
			render(name, svc)
		}
	}
	// Set-aside service ports that the table does not have are not in
	// the state either: they are new again.
	if after < len(state.Services) {
		// New service ports, of changed services (one that is neither
		// known nor changed, and not set aside, means that the state's
		// Changed missed it).
		for name, svc := range state.Services {
			if _, known := s.services[name]; known {
				continue
			}
			if !state.Changed.Has(name.NamespacedName) {
				if _, aside := b.setAside[name]; aside {
					after++
					continue
				}
				return nil, nil, errUnknownServices
			}
			render(name, svc)
			after++
		}
	}
	// Every service port the state has must be known after the update.
	if after != len(state.Services) {
		return nil, nil, errUnknownServices
	}
	return next, refused, nil
}

// applyPartial updates b.state with apply (nil renders: deleted service
// ports) and the node port addresses, and plans the difference; undo puts
// the state back as it was.
func (b *Backend) applyPartial(l *layout, apply map[proxy.ServicePortName]*renderedService, npIPs map[netip.Addr]bool) (p *plan, undo func()) {
	s := b.state
	old := make(map[proxy.ServicePortName]*renderedService, len(apply))
	for name := range apply {
		old[name] = s.services[name]
	}
	oldNP := s.nodePortIPs
	oldDigest := s.digest
	cs := s.update(apply, l)
	undo = func() {
		s.update(old, l)
		s.setNodePortIPs(oldNP)
	}
	p = &plan{l: l}
	for _, c := range cs.chainsAdded {
		p.createChains = append(p.createChains, s.chains[c])
	}
	dests := make([]destKey, 0, len(cs.oldOwners))
	for k := range cs.oldOwners {
		dests = append(dests, k)
	}
	slices.SortFunc(dests, destKey.compare)
	for _, k := range dests {
		o, n := cs.oldOwners[k], s.owners[k]
		var oldSmall, nowSmall []elem
		if o != nil {
			oldSmall = o.small
		}
		if n != nil {
			nowSmall = n.small
		}
		diffElems(oldSmall, nowSmall, &p.deletes, &p.adds)
		diffSlots(o, n, &p.deletes, &p.adds)
	}
	for _, a := range sortedAddrs(cs.oldHairpin) {
		was, is := cs.oldHairpin[a] > 0, s.hairpin[a] > 0
		switch {
		case was && !is:
			p.deletes = append(p.deletes, hairpinElem(a))
		case !was && is:
			p.adds = append(p.adds, hairpinElem(a))
		}
	}
	ports := make([]int, 0, len(cs.oldHealth))
	for port := range cs.oldHealth {
		ports = append(ports, port)
	}
	slices.Sort(ports)
	for _, port := range ports {
		was, is := cs.oldHealth[port] > 0, s.health[port] > 0
		switch {
		case was && !is:
			p.deletes = append(p.deletes, healthElem(port))
		case !was && is:
			p.adds = append(p.adds, healthElem(port))
		}
	}
	var oldNPElems, newNPElems []elem
	for _, a := range sortedAddrs(s.nodePortIPs) {
		oldNPElems = append(oldNPElems, nodePortIPElem(a))
	}
	for _, a := range sortedAddrs(npIPs) {
		newNPElems = append(newNPElems, nodePortIPElem(a))
	}
	diffElems(oldNPElems, newNPElems, &p.deletes, &p.adds)
	s.setNodePortIPs(npIPs)
	if s.digest != oldDigest {
		p.deletes = append(p.deletes, l.stateCanary(oldDigest))
		p.adds = append(p.adds, l.stateCanary(s.digest))
	}
	p.staleChains = cs.chainsGone
	return p, undo
}

// refusedPartial finds the service ports of apply whose changes nft
// refused (err, the refusal of p's transaction of ops operations), from
// the lines err names or, when it names none, by bisection. b.state is as
// before apply. A refusal of a shared object is an error.
func (b *Backend) refusedPartial(ctx context.Context, err error, p *plan, ops int, apply map[proxy.ServicePortName]*renderedService,
	l *layout, npIPs map[netip.Addr]bool) (map[proxy.ServicePortName]error, error) {
	if notARefusal(ctx, err) {
		return nil, err
	}
	s := b.state
	ti := newTouchIndex()
	for name, rs := range apply {
		ti.add(name, rs)
		ti.add(name, s.services[name])
	}
	inApply := func(name proxy.ServicePortName) bool { _, ok := apply[name]; return ok }
	refused, shared, ok := hintedRefusals(err, ops, p.locate, ti, inApply)
	switch {
	case shared:
		return nil, err
	case ok:
		return wrapRefusals(refused), nil
	}
	units := proxy.SortedServicePortNames(apply)
	isMap := l.isMapOf()
	refused, err = bisectRefused(ctx, b.nft, units, err, func(accepted []proxy.ServicePortName) *knftables.Transaction {
		sub := make(map[proxy.ServicePortName]*renderedService, len(accepted))
		for _, name := range accepted {
			sub[name] = apply[name]
		}
		p, undo := b.applyPartial(l, sub, npIPs)
		defer undo()
		return p.transaction(b.nft, isMap, &SyncStats{})
	})
	if err != nil {
		return nil, err
	}
	return wrapRefusals(refused), nil
}

// renderError is the error a service port that cannot be rendered is set
// aside with.
func renderError(err error) error {
	return fmt.Errorf("cannot render its nftables elements: %w", err)
}

func wrapRefusals(m map[proxy.ServicePortName]error) map[proxy.ServicePortName]error {
	for name, e := range m {
		m[name] = setAsideError(e)
	}
	return m
}
