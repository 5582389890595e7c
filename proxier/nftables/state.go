package nftables

import (
	"net/netip"
	"slices"
	"strconv"

	"k8s.io/apimachinery/pkg/types"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// tableState is what kproxy wrote into its table (after a successful
// transaction), or wants to write (while a sync plans one): every service
// port's render, who owns each destination, and the reference counts of
// the elements and chains that several destinations share.
type tableState struct {
	services map[proxy.ServicePortName]*renderedService
	// byName lists the service ports of each service.
	byName map[types.NamespacedName][]proxy.ServicePortName
	// claims lists, per destination, the service ports that have it, in
	// name order; the first one owns it (two Services may claim one
	// external IP and port: the first by name wins, whatever the order
	// they came in).
	claims map[destKey][]proxy.ServicePortName
	// owners is the owner's render of each destination.
	owners map[destKey]*destRender
	// hairpin and health count the service ports that want each hairpin
	// endpoint and health-check node port.
	hairpin map[netip.Addr]int
	health  map[int]int
	// chainRefs counts the owned destinations that use each shape and pick
	// chain; chains holds their definitions.
	chainRefs map[string]int
	chains    map[string]*chainDef
	// nodePortIPs are the elements of setNodePortIPs.
	nodePortIPs map[netip.Addr]bool
	// rules counts the rules of the chains, by table ("nat", "filter").
	rules map[string]int
	// digest is the XOR of elemDigest over every element but the
	// canaries (and the dynamic sets' entries): a restart whose desired
	// table has the digest the table's sync-state canary records has
	// nothing to write.
	digest uint64
}

func newTableState() *tableState {
	return &tableState{
		services:    map[proxy.ServicePortName]*renderedService{},
		byName:      map[types.NamespacedName][]proxy.ServicePortName{},
		claims:      map[destKey][]proxy.ServicePortName{},
		owners:      map[destKey]*destRender{},
		hairpin:     map[netip.Addr]int{},
		health:      map[int]int{},
		chainRefs:   map[string]int{},
		chains:      map[string]*chainDef{},
		nodePortIPs: map[netip.Addr]bool{},
		rules:       map[string]int{},
	}
}

// slots returns a destination's endpoint slots in the table (slotsOf).
func (s *tableState) slots(k destKey) *[2][]netip.AddrPort {
	if o := s.owners[k]; o != nil {
		return &o.eps
	}
	return nil
}

// slotsOnly strips the state, which the caller drops, down to the endpoint
// slots of its destinations, for a full sync's renders to keep: the rest of
// the renders can go before the new ones are made. Nil for a nil state.
func (s *tableState) slotsOnly() slotsOf {
	if s == nil {
		return nil
	}
	owners := s.owners
	for _, dr := range owners {
		dr.small, dr.chains, dr.hash = nil, nil, ""
	}
	*s = tableState{}
	return func(k destKey) *[2][]netip.AddrPort {
		if o := owners[k]; o != nil {
			return &o.eps
		}
		return nil
	}
}

// adoptSlots gives the destinations that the table holds with the same
// endpoints in another order (a table written by another process, whose
// endpoint-slots comments record the order) that order, so that nothing is
// rewritten and clients keep their slots.
func (s *tableState) adoptSlots(kernel map[destKey]destInfo) {
	for k, ki := range kernel {
		dr := s.owners[k]
		if dr == nil || ki.counts != dr.counts() || ki.hash == dr.hash || ki.counts == [2]int{} {
			continue
		}
		var sorted [2][]netip.AddrPort
		for i, eps := range dr.eps {
			sorted[i] = slices.Clone(eps)
			slices.SortFunc(sorted[i], compareAddrPort)
		}
		cand := &sorted
		if ki.perm != "" {
			if cand = applyPerm(ki.perm, sorted); cand == nil {
				continue
			}
		}
		old := dr.eps
		s.digest ^= dr.reorder(*cand)
		if dr.hash != ki.hash {
			// Other endpoints: the destination is rewritten, in the
			// order it had.
			s.digest ^= dr.reorder(old)
		}
	}
}

// changeSet is what an update of a tableState touched, with the state
// before it, so that a partial sync writes exactly the difference.
type changeSet struct {
	oldOwners   map[destKey]*destRender
	oldHairpin  map[netip.Addr]int
	oldHealth   map[int]int
	chainsAdded []string // refcount went from 0 to >0
	chainsGone  []string // refcount went from >0 to 0
}

// update replaces the renders of the service ports in next (nil: deleted)
// and recomputes the owners of their destinations.
func (s *tableState) update(next map[proxy.ServicePortName]*renderedService, l *layout) *changeSet {
	cs := &changeSet{oldOwners: map[destKey]*destRender{}, oldHairpin: map[netip.Addr]int{}, oldHealth: map[int]int{}}
	names := proxy.SortedServicePortNames(next)
	touch := func(k destKey) {
		if _, ok := cs.oldOwners[k]; !ok {
			cs.oldOwners[k] = s.owners[k]
		}
	}
	touchHairpin := func(a netip.Addr) {
		if _, ok := cs.oldHairpin[a]; !ok {
			cs.oldHairpin[a] = s.hairpin[a]
		}
	}
	touchHealth := func(p int) {
		if _, ok := cs.oldHealth[p]; !ok {
			cs.oldHealth[p] = s.health[p]
		}
	}
	for _, name := range names {
		if old := s.services[name]; old != nil {
			for _, dr := range old.dests {
				touch(dr.key)
				s.claims[dr.key] = slices.DeleteFunc(s.claims[dr.key], func(n proxy.ServicePortName) bool { return n == name })
				if len(s.claims[dr.key]) == 0 {
					delete(s.claims, dr.key)
				}
			}
			for _, a := range old.hairpin {
				touchHairpin(a)
				if s.hairpin[a]--; s.hairpin[a] <= 0 {
					delete(s.hairpin, a)
				}
			}
			if p := old.healthCheck; p != 0 {
				touchHealth(p)
				if s.health[p]--; s.health[p] <= 0 {
					delete(s.health, p)
				}
			}
			delete(s.services, name)
			nn := name.NamespacedName
			s.byName[nn] = slices.DeleteFunc(s.byName[nn], func(n proxy.ServicePortName) bool { return n == name })
			if len(s.byName[nn]) == 0 {
				delete(s.byName, nn)
			}
		}
		rs := next[name]
		if rs == nil {
			continue
		}
		s.services[name] = rs
		s.byName[name.NamespacedName] = append(s.byName[name.NamespacedName], name)
		for _, dr := range rs.dests {
			touch(dr.key)
			c := s.claims[dr.key]
			i, _ := slices.BinarySearchFunc(c, name, proxy.ServicePortName.Compare)
			s.claims[dr.key] = slices.Insert(c, i, name)
		}
		for _, a := range rs.hairpin {
			touchHairpin(a)
			s.hairpin[a]++
		}
		if p := rs.healthCheck; p != 0 {
			touchHealth(p)
			s.health[p]++
		}
	}
	for k, old := range cs.oldOwners {
		var now *destRender
		if c := s.claims[k]; len(c) > 0 {
			for _, dr := range s.services[c[0]].dests {
				if dr.key == k {
					now = dr
					break
				}
			}
		}
		if now == old {
			continue
		}
		if old != nil {
			s.digest ^= old.digest
		}
		if now != nil {
			s.digest ^= now.digest
		}
		if now == nil {
			delete(s.owners, k)
		} else {
			s.owners[k] = now
		}
		if old != nil {
			for _, c := range old.chains {
				if s.chainRefs[c]--; s.chainRefs[c] <= 0 {
					delete(s.chainRefs, c)
					cs.chainsGone = append(cs.chainsGone, c)
				}
			}
		}
		if now != nil {
			for _, c := range now.chains {
				if s.chainRefs[c]++; s.chainRefs[c] == 1 {
					if l.chains[c] == nil {
						panic("nftables backend: chain " + c + " was never rendered")
					}
					s.chains[c] = l.chains[c]
					cs.chainsAdded = append(cs.chainsAdded, c)
				}
			}
		}
	}
	for a, n := range cs.oldHairpin {
		if (n > 0) != (s.hairpin[a] > 0) {
			e := hairpinElem(a)
			s.digest ^= elemDigest(&e)
		}
	}
	for p, n := range cs.oldHealth {
		if (n > 0) != (s.health[p] > 0) {
			e := healthElem(p)
			s.digest ^= elemDigest(&e)
		}
	}
	// A chain both dropped and re-added by this update stays.
	added := map[string]bool{}
	for _, c := range cs.chainsAdded {
		added[c] = true
	}
	gone := cs.chainsGone[:0]
	for _, c := range cs.chainsGone {
		if added[c] {
			delete(added, c)
			continue
		}
		if s.chainRefs[c] == 0 {
			if def := s.chains[c]; def != nil {
				s.rules[def.table] -= len(def.rules)
			}
			delete(s.chains, c)
			gone = append(gone, c)
		}
	}
	cs.chainsGone = gone
	cs.chainsAdded = cs.chainsAdded[:0]
	for c := range added {
		cs.chainsAdded = append(cs.chainsAdded, c)
		def := s.chains[c]
		s.rules[def.table] += len(def.rules)
	}
	slices.Sort(cs.chainsAdded)
	slices.Sort(cs.chainsGone)
	return cs
}

// setNodePortIPs replaces the node port addresses.
func (s *tableState) setNodePortIPs(ips map[netip.Addr]bool) {
	for a := range s.nodePortIPs {
		if !ips[a] {
			e := nodePortIPElem(a)
			s.digest ^= elemDigest(&e)
		}
	}
	for a := range ips {
		if !s.nodePortIPs[a] {
			e := nodePortIPElem(a)
			s.digest ^= elemDigest(&e)
		}
	}
	s.nodePortIPs = ips
}

func hairpinElem(a netip.Addr) elem {
	return elem{set: setHairpin, key: []string{hostString(a), hostString(a)}}
}

func healthElem(port int) elem {
	return elem{set: setHealthCheck, key: []string{strconv.Itoa(port)}}
}

func nodePortIPElem(a netip.Addr) elem {
	return elem{set: setNodePortIPs, key: []string{hostString(a)}}
}

// smallElems lists every element of the maps and sets a full sync lists
// (canaries included).
func (s *tableState) smallElems(l *layout) []elem {
	var out []elem
	for _, sd := range l.sets() {
		switch {
		case sd.name == setSyncState:
			out = append(out, l.stateCanary(s.digest))
		case !sd.dynamic && !sd.big:
			out = append(out, sd.canary)
		}
	}
	keys := make([]destKey, 0, len(s.owners))
	for k := range s.owners {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, destKey.compare)
	for _, k := range keys {
		out = append(out, s.owners[k].small...)
	}
	for _, a := range sortedAddrs(s.hairpin) {
		out = append(out, hairpinElem(a))
	}
	ports := make([]int, 0, len(s.health))
	for p := range s.health {
		ports = append(ports, p)
	}
	slices.Sort(ports)
	for _, p := range ports {
		out = append(out, healthElem(p))
	}
	for _, a := range sortedAddrs(s.nodePortIPs) {
		out = append(out, nodePortIPElem(a))
	}
	return out
}

// sortedDests lists the owned destinations in order.
func (s *tableState) sortedDests() []destKey {
	keys := make([]destKey, 0, len(s.owners))
	for k := range s.owners {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, destKey.compare)
	return keys
}

// sortedChains lists the shape and pick chains in use.
func (s *tableState) sortedChains() []*chainDef {
	names := make([]string, 0, len(s.chains))
	for n := range s.chains {
		names = append(names, n)
	}
	slices.Sort(names)
	out := make([]*chainDef, 0, len(names))
	for _, n := range names {
		out = append(out, s.chains[n])
	}
	return out
}

func sortedAddrs[V any](m map[netip.Addr]V) []netip.Addr {
	out := make([]netip.Addr, 0, len(m))
	for a := range m {
		out = append(out, a)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}
