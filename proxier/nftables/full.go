package nftables

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// fullSync is one full sync in the making: a reconcile against what the
// table has, or a rebuild.
type fullSync struct {
	b     *Backend
	l     *layout
	state *proxy.NodeState
	npIPs map[netip.Addr]bool
	st    *SyncStats
	// prev are the endpoint slots of the last state (nil: none).
	prev slotsOf
	// pw writes endpoint slots ahead of the main transaction.
	pw *preWriter
	// renders are the service ports' renders; refused those set aside
	// (their render failed, or nft refused their changes) and kept what
	// each of those keeps: what the table has for it (nil: nothing).
	renders map[proxy.ServicePortName]*renderedService
	refused map[proxy.ServicePortName]error
	kept    map[proxy.ServicePortName]*renderedService
	// k is what the sync read of the table; listed: k.small and k.dests
	// hold the listing of its small maps and sets.
	k      *kernelState
	listed bool
	// ke indexes the listing; epLists are the endpoints maps listed (by
	// map, key text to value), for what refused service ports keep.
	ke      *kernelElems
	epLists map[string]map[string][]string
}

func (f *fullSync) rebuild() bool { return f.st.Mode == modeRebuild }

// syncFull renders every service port and writes what the table lacks
// (docs/design.md, "nftables backend": Syncs). Service ports that cannot
// be rendered, or whose elements nft refuses, are set aside: they keep
// what the table has for them, and the rest is written in the same sync.
// It returns the new state.
func (b *Backend) syncFull(ctx context.Context, l *layout, state *proxy.NodeState, npIPs map[netip.Addr]bool, st *SyncStats) (*tableState, error) {
	f := &fullSync{b: b, l: l, state: state, npIPs: npIPs, st: st,
		refused: map[proxy.ServicePortName]error{}, kept: map[proxy.ServicePortName]*renderedService{}}
	// A full sync renders everything again: the old state goes first, so
	// that the two are never held together (a failed sync drops it
	// anyway), but for its endpoint slots, which the new renders keep.
	f.prev = b.state.slotsOnly()
	b.state = nil
	f.renderAll()
	next := f.build(nil)
	if err := f.read(ctx, next); err != nil {
		return nil, err
	}
	if len(f.refused) > 0 {
		if err := f.keep(ctx, slices.Collect(maps.Keys(f.refused))); err != nil {
			return nil, err
		}
		next = f.build(nil)
	}
	isMap := l.isMapOf()
	for {
		p := f.plan(next)
		if err := f.writeAhead(ctx, p); err != nil {
			return nil, fmt.Errorf("nftables %s sync: %w", st.Mode, err)
		}
		if f.pw != nil {
			err := f.pw.wait(st)
			maps.Copy(f.k.dests, f.pw.written)
			if err != nil {
				return nil, fmt.Errorf("nftables %s sync: %w", st.Mode, err)
			}
			var more []proxy.ServicePortName
			for name, e := range f.pw.refused {
				if _, known := f.refused[name]; !known {
					f.refused[name] = setAsideError(e)
					more = append(more, name)
				}
			}
			if len(more) > 0 {
				if err := f.keep(ctx, more); err != nil {
					return nil, err
				}
				next = f.build(nil)
				continue
			}
		}
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
		if tableChanged(runErr) && !f.rebuild() {
			// The table is not what was read: rebuild it, in this sync.
			klog.FromContext(ctx).Info("kproxy's nftables table changed while it was reconciled; rebuilding it", "family", b.opts.Family, "err", runErr)
			if err := f.toRebuild(ctx); err != nil {
				return nil, err
			}
			continue
		}
		if err := f.refusedMain(ctx, runErr, p, tx.NumOperations(), next); err != nil {
			return nil, fmt.Errorf("nftables %s sync: %w", st.Mode, err)
		}
		next = f.build(nil)
	}
	b.setAside, b.refused = maps.Clone(f.refused), f.refused
	return next, nil
}

// renderAll renders every service port. One that cannot be rendered is
// refused.
func (f *fullSync) renderAll() {
	f.renders = make(map[proxy.ServicePortName]*renderedService, len(f.state.Services))
	for name, svc := range f.state.Services {
		rs, err := f.l.render(svc, f.prev)
		if err != nil {
			f.refused[name] = renderError(err)
			continue
		}
		f.renders[name] = rs
	}
}

// build is the state of every render but the refused ones' (and skip's),
// which have what they keep instead.
func (f *fullSync) build(skip map[proxy.ServicePortName]bool) *tableState {
	next := newTableState()
	all := f.renders
	if len(f.refused)+len(skip) > 0 {
		all = make(map[proxy.ServicePortName]*renderedService, len(f.renders)+len(f.kept))
		for name, rs := range f.renders {
			if _, out := f.refused[name]; !out && !skip[name] {
				all[name] = rs
			}
		}
		for name, rs := range f.kept {
			if rs != nil {
				all[name] = rs
			}
		}
	}
	next.update(all, f.l)
	next.setNodePortIPs(f.npIPs)
	return next
}

// read reads the table: a reconcile lists it (readKernel), a rebuild only
// names its objects. A table that cannot be reconciled is rebuilt.
func (f *fullSync) read(ctx context.Context, next *tableState) error {
	logger := klog.FromContext(ctx)
	b, l := f.b, f.l
	start := b.clock.Now()
	defer func() { f.st.ReadTime += b.clock.Since(start) }()
	var err error
	chains := append(l.staticChains(), next.sortedChains()...)
	if !f.rebuild() {
		f.k, err = b.readKernel(ctx, l, chains, next)
		if err != nil {
			logger.Info("Cannot reconcile kproxy's nftables table; rebuilding it", "family", b.opts.Family, "err", err)
			f.st.Mode = modeRebuild
		}
	}
	if f.rebuild() {
		if f.k, err = b.readNames(ctx); err != nil {
			logger.Info("Cannot list kproxy's nftables table; rewriting it", "family", b.opts.Family, "err", err)
			f.k = newKernelState()
		}
	}
	f.listed = !f.rebuild() && f.k.exists && !f.k.trusted
	if !f.rebuild() && !f.k.trusted {
		next.adoptSlots(f.k.dests)
	}
	return nil
}

// toRebuild turns a reconcile into a rebuild: the table's objects are
// named again; what was listed stays, for what set-aside service ports
// keep.
func (f *fullSync) toRebuild(ctx context.Context) error {
	f.st.Mode = modeRebuild
	names, err := f.b.readNames(ctx)
	if err != nil {
		return fmt.Errorf("nftables %s sync: %w", f.st.Mode, err)
	}
	f.k.exists, f.k.chains, f.k.sets = names.exists, names.chains, names.sets
	f.k.trusted = false
	return nil
}

// writeAhead hands the endpoint slots of destinations the table does not
// dispatch to yet to the preWriter, in transactions of their own: nothing
// leads to them until the main transaction adds their dispatch elements,
// so traffic still sees one change, and no transaction (nor its text)
// holds them all.
func (f *fullSync) writeAhead(ctx context.Context, p *plan) error {
	if len(p.preEndpoints) == 0 {
		return nil
	}
	if f.pw == nil {
		var header []knftables.Object
		if p.addTable {
			header = append(header, &knftables.Table{Comment: knftables.PtrTo("rules for kproxy")})
		}
		for _, sd := range p.addSets {
			if sd.big {
				header = append(header, sd.object())
			}
		}
		f.pw = newPreWriter(ctx, f.b, header)
	}
	for _, dr := range p.preEndpoints {
		if err := f.pw.add(dr); err != nil {
			return err
		}
	}
	p.preEndpoints = nil
	return nil
}

// plan plans the transaction that makes the table next: a reconcile
// against what read found, or a rebuild.
func (f *fullSync) plan(next *tableState) *plan {
	l, k, rebuild := f.l, f.k, f.rebuild()
	chains := append(l.staticChains(), next.sortedChains()...)
	p := &plan{l: l, addTable: rebuild || !k.exists}
	sets := l.sets()
	wantSet := map[string]bool{}
	for _, sd := range sets {
		wantSet[sd.name] = true
		if rebuild || !k.sets[sd.name] {
			p.addSets = append(p.addSets, sd)
		}
		if rebuild && !sd.dynamic {
			p.flushSets = append(p.flushSets, sd)
		}
	}
	// Chains of the same layout hold what their names say (readKernel
	// checked their rule counts).
	sameLayout := !rebuild && k.layout == l.hash()
	wantChain := map[string]bool{}
	for _, c := range chains {
		wantChain[c.name] = true
		switch {
		case !k.chains[c.name]:
			p.createChains = append(p.createChains, c)
		case !sameLayout:
			p.rewriteChains = append(p.rewriteChains, c)
		}
	}
	for c := range k.chains {
		if !wantChain[c] {
			p.staleChains = append(p.staleChains, c)
		}
	}
	slices.Sort(p.staleChains)
	for s := range k.sets {
		if !wantSet[s] {
			p.staleSets = append(p.staleSets, s)
		}
	}
	slices.Sort(p.staleSets)

	if k.trusted {
		// Same layout, same digest: the elements are those wanted.
		return p
	}
	// Small maps and sets: against what was listed (nothing on a rebuild,
	// whose flushes empty them).
	var kernelSmall []elem
	if !rebuild {
		for _, id := range sortedKeys(k.small) {
			kernelSmall = append(kernelSmall, k.small[id])
		}
	}
	wantSmall := next.smallElems(l)
	if !rebuild {
		// Canaries of maps that exist are there (readKernel checked);
		// sync-state's records the layout and the digest.
		wantSmall = slices.DeleteFunc(wantSmall, func(e elem) bool { return strings.HasPrefix(e.comment, canaryComment) && k.sets[e.set] })
		if c := l.stateCanary(next.digest); k.sets[setSyncState] && k.stateComment != c.comment {
			p.deletes = append(p.deletes, c)
			p.adds = append(p.adds, c)
		}
	}
	diffElems(kernelSmall, wantSmall, &p.deletes, &p.adds)

	// Endpoints maps: by destination, trusting the endpoint-slots comments.
	for _, sd := range sets {
		if sd.big && (rebuild || !k.sets[sd.name]) {
			p.adds = append(p.adds, sd.canary)
		}
	}
	for _, dk := range next.sortedDests() {
		dr := next.owners[dk]
		if !rebuild {
			if ki, ok := k.dests[dk]; ok {
				if ki.hash == dr.hash && ki.counts == dr.counts() {
					continue
				}
				for _, key := range dk.endpointKeys(ki.counts) {
					p.deletes = append(p.deletes, elem{set: dk.endpointsMap(), key: key})
				}
			}
		}
		if _, ok := k.dests[dk]; !ok && !rebuild {
			p.preEndpoints = append(p.preEndpoints, dr)
		} else {
			p.addEndpoints = append(p.addEndpoints, dr)
		}
	}
	// Few enough for the main transaction: one transaction.
	pre := 0
	for _, dr := range p.preEndpoints {
		pre += len(dr.eps[0]) + len(dr.eps[1])
	}
	if pre <= f.b.endpointChunk() {
		p.addEndpoints = append(p.preEndpoints, p.addEndpoints...)
		p.preEndpoints = nil
	}
	if !rebuild {
		for _, dk := range sortedDestKeys(k.dests) {
			if _, ok := next.owners[dk]; ok {
				continue
			}
			for _, key := range dk.endpointKeys(k.dests[dk].counts) {
				p.deletes = append(p.deletes, elem{set: dk.endpointsMap(), key: key})
			}
		}
	}
	return p
}

// refusedMain sets aside the service ports whose elements nft refused in
// the main transaction (err, of p's ops operations, for next): from the
// lines err names or, when it names none, by bisection. A refused element
// of what a set-aside service port keeps leaves it nothing. A refusal of
// a shared object is the error.
func (f *fullSync) refusedMain(ctx context.Context, err error, p *plan, ops int, next *tableState) error {
	if notARefusal(ctx, err) {
		return err
	}
	// Only owners write a destination's elements.
	ti := newTouchIndex()
	for dk, dr := range next.owners {
		if _, out := f.refused[dr.owner]; out {
			continue
		}
		ti.dests[dk] = []proxy.ServicePortName{dr.owner}
		for _, c := range dr.chains {
			ti.chains[c] = addName(ti.chains[c], dr.owner)
		}
	}
	for name, rs := range f.renders {
		if _, out := f.refused[name]; !out {
			for _, a := range rs.hairpin {
				ti.hairpin[a] = addName(ti.hairpin[a], name)
			}
			if rs.healthCheck != 0 {
				ti.health[rs.healthCheck] = addName(ti.health[rs.healthCheck], name)
			}
		}
	}
	// What a set-aside service port keeps was refused (the table lost it,
	// and nft no longer takes it back): it keeps nothing.
	dropped := false
	for _, n := range refusedLines(err) {
		if n < 1 || n > ops {
			continue
		}
		r := p.locate(n - 1)
		if o := next.owners[r.dest]; r.kind == refDest && o != nil && f.kept[o.owner] != nil {
			if _, out := f.refused[o.owner]; out {
				f.kept[o.owner] = nil
				dropped = true
			}
		}
	}
	if dropped {
		return nil
	}
	active := func(name proxy.ServicePortName) bool {
		_, out := f.refused[name]
		return !out && f.renders[name] != nil
	}
	refused, shared, ok := hintedRefusals(err, ops, p.locate, ti, active)
	switch {
	case shared:
		return err
	case !ok:
		// The service ports the transaction writes something of.
		var units []proxy.ServicePortName
		seen := map[proxy.ServicePortName]bool{}
		p.refs(func(r opRef) {
			for _, name := range ti.of(r) {
				if !seen[name] {
					seen[name] = true
					units = append(units, name)
				}
			}
		})
		slices.SortFunc(units, proxy.ServicePortName.Compare)
		isMap := f.l.isMapOf()
		var berr error
		refused, berr = bisectRefused(ctx, f.b.nft, units, err, func(accepted []proxy.ServicePortName) *knftables.Transaction {
			skip := make(map[proxy.ServicePortName]bool, len(units))
			for _, name := range units {
				skip[name] = true
			}
			for _, name := range accepted {
				delete(skip, name)
			}
			p := f.plan(f.build(skip))
			p.addEndpoints = append(p.preEndpoints, p.addEndpoints...)
			p.preEndpoints = nil
			return p.transaction(f.b.nft, isMap, &SyncStats{})
		})
		if berr != nil {
			return berr
		}
	}
	var names []proxy.ServicePortName
	for name, e := range refused {
		f.refused[name] = setAsideError(e)
		names = append(names, name)
	}
	return f.keep(ctx, names)
}

// keep finds what each refused service port of names keeps: what the
// table has for it.
func (f *fullSync) keep(ctx context.Context, names []proxy.ServicePortName) error {
	slices.SortFunc(names, proxy.ServicePortName.Compare)
	if f.k.exists && !f.listed {
		// A trusted table, or a rebuild: list the table now.
		start := f.b.clock.Now()
		err := f.b.listSmall(ctx, f.l, f.k)
		f.st.ReadTime += f.b.clock.Since(start)
		f.listed, f.k.trusted = true, false
		if err != nil {
			if !f.rebuild() {
				return fmt.Errorf("nftables %s sync: %w", f.st.Mode, err)
			}
			// A rebuild writes everything anyway: the refused ones keep
			// nothing.
			clear(f.k.small)
			clear(f.k.dests)
		}
	}
	if f.ke == nil {
		f.ke = indexKernel(f.k)
	}
	for _, name := range names {
		f.kept[name] = f.adopt(ctx, name)
		klog.FromContext(ctx).V(2).Info("Setting a service port aside: nft refused its elements", "family", f.b.opts.Family,
			"servicePort", name, "keeps", len(f.kept[name].destsOrNil()), "err", f.refused[name])
	}
	return nil
}

func (rs *renderedService) destsOrNil() []*destRender {
	if rs == nil {
		return nil
	}
	return rs.dests
}

// adopt is the render of what the table has for name (nil: nothing).
func (f *fullSync) adopt(ctx context.Context, name proxy.ServicePortName) *renderedService {
	rs := &renderedService{name: name}
	for _, dk := range f.ke.destsOf(name) {
		cands := []func() *[2][]netip.AddrPort{
			func() *[2][]netip.AddrPort {
				if f.prev == nil {
					return nil
				}
				return f.prev(dk)
			},
			func() *[2][]netip.AddrPort { return f.listedSlots(ctx, dk) },
		}
		if dr := f.l.adoptDest(name, dk, f.ke.byDest[dk], cands); dr != nil {
			rs.dests = append(rs.dests, dr)
		}
	}
	if nr := f.renders[name]; nr != nil {
		for _, a := range nr.hairpin {
			if f.ke.hairpin[a] {
				rs.hairpin = append(rs.hairpin, a)
			}
		}
		if nr.healthCheck != 0 && f.ke.health[nr.healthCheck] {
			rs.healthCheck = nr.healthCheck
		}
	}
	if len(rs.dests) == 0 && len(rs.hairpin) == 0 && rs.healthCheck == 0 {
		return nil
	}
	return rs
}

// listedSlots are a destination's endpoint slots as its endpoints map
// lists them (nil when they cannot be read), the counts its dispatch
// element records.
func (f *fullSync) listedSlots(ctx context.Context, dk destKey) *[2][]netip.AddrPort {
	ki, ok := f.k.dests[dk]
	if !ok {
		return nil
	}
	set := dk.endpointsMap()
	m, ok := f.epLists[set]
	if !ok {
		m = map[string][]string{}
		err := f.b.listSet(ctx, &setDef{name: set, isMap: true}, func(e elem) error {
			m[strings.Join(e.key, " . ")] = e.value
			return nil
		})
		if err != nil {
			m = nil
		}
		if f.epLists == nil {
			f.epLists = map[string]map[string][]string{}
		}
		f.epLists[set] = m
	}
	if m == nil {
		return nil
	}
	var eps [2][]netip.AddrPort
	for i, n := range ki.counts {
		base := 0
		if i == 1 {
			base = localSlotBase
		}
		for slot := range n {
			v := m[strings.Join(dk.endpointKey(base+slot), " . ")]
			if len(v) != 2 {
				return nil
			}
			a, err1 := netip.ParseAddr(v[0])
			port, err2 := strconv.Atoi(v[1])
			if err1 != nil || err2 != nil {
				return nil
			}
			eps[i] = append(eps[i], netip.AddrPortFrom(a, uint16(port)))
		}
	}
	return &eps
}
