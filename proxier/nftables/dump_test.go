package nftables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"
)

// canonicalDump is the fake's table as the property test compares it:
// slot assignments depend on the history of syncs (an endpoint keeps its
// slot), so each destination's endpoint slots are written as the sorted
// list of its endpoints, and the endpoint-slots comments' slot hash and
// assignment and sync-state's digest are left out. What they must say is
// checked against the table instead: each endpoint-slots element's hash,
// counts and assignment against its slots, the digest against every
// element; a mismatch is a line of the dump ("inconsistent: ..."), which a
// fully synced table never has.
func canonicalDump(fake *knftables.Fake) string {
	fake.RLock()
	defer fake.RUnlock()
	var head, elems, bad []string
	for _, l := range strings.Split(fake.Dump(), "\n") {
		if l != "" && !strings.HasPrefix(l, "add element ") {
			head = append(head, l)
		}
	}
	t := fake.Table
	if t == nil {
		return strings.Join(head, "\n") + "\n"
	}
	type slotKey struct {
		set  string
		dest string // the key without the slot
	}
	slots := map[slotKey]map[int]netip.AddrPort{}
	var digest uint64
	var stateComment string
	// shapes are the dispatch elements' shape chains, by destination: the
	// maps come before the sets.
	shapes := map[destKey]string{}
	each := func(set string, es []*knftables.Element) {
		for _, ke := range es {
			e := elem{set: set, key: ke.Key, value: ke.Value}
			if ke.Comment != nil {
				e.comment = *ke.Comment
			}
			if strings.HasPrefix(e.comment, canaryComment) {
				if set == setSyncState {
					stateComment = e.comment
				}
				elems = append(elems, "element "+e.id()+" "+e.val())
				continue
			}
			if strings.HasPrefix(set, setAffinityPrefix) {
				continue
			}
			digest ^= elemDigest(&e)
			switch {
			case strings.HasPrefix(set, mapEndpointsPrefix) || strings.HasPrefix(set, mapNodePortEndpointsPrefix):
				n := len(e.key) - 1
				slot, err := strconv.Atoi(e.key[n])
				ep, err2 := endpointValue(e.value)
				if err != nil || err2 != nil {
					bad = append(bad, "inconsistent: unreadable slot "+e.id())
					continue
				}
				k := slotKey{set, strings.Join(e.key[:n], " . ")}
				if slots[k] == nil {
					slots[k] = map[int]netip.AddrPort{}
				}
				slots[k][slot] = ep
			case set == mapServiceIPs || set == mapServiceNodePorts:
				dk, _ := parseDispatchKey(set == mapServiceNodePorts, e.key)
				shapes[dk] = strings.TrimPrefix(e.value[0], "goto ")
				elems = append(elems, "element "+e.id()+" "+e.val())
			case set == setEndpointSlots || set == setNodePortEndpointSlots:
				hash, counts, perm, ok := parseSlotsComment(e.comment)
				if !ok {
					bad = append(bad, "inconsistent: endpoint-slots comment "+e.id()+" "+e.comment)
				}
				dk, _ := parseDispatchKey(set == setNodePortEndpointSlots, e.key)
				shape, ok := shapes[dk]
				if !ok {
					bad = append(bad, "inconsistent: endpoint-slots element without a dispatch element "+e.id())
				}
				var dr destRender
				dr.key = dk
				for li, base := range []int{0, localSlotBase} {
					m := slots[slotKey{dk.endpointsMap(), strings.Join(dk.endpointKey(0)[:len(dk.endpointKey(0))-1], " . ")}]
					for s := 0; s < counts[li]; s++ {
						ep, ok := m[base+s]
						if !ok {
							bad = append(bad, fmt.Sprintf("inconsistent: %s has no slot %d", dk, base+s))
						}
						dr.eps[li] = append(dr.eps[li], ep)
					}
				}
				h, _ := dr.hashEndpoints(shape)
				if h != hash {
					bad = append(bad, fmt.Sprintf("inconsistent: %s hash %s, its slots hash to %s", dk, hash, h))
				}
				want := permToken(dr.eps)
				if len(fmt.Sprintf("%s %d %d %s", h, counts[0], counts[1], want)) > 128 {
					want = ""
				}
				if want != perm {
					bad = append(bad, fmt.Sprintf("inconsistent: %s records assignment %q, has %q", dk, perm, want))
				}
				f := strings.Fields(e.comment)
				rest := f[min(3, len(f)):]
				if len(rest) > 0 && strings.HasPrefix(rest[0], "p=") {
					rest = rest[1:]
				}
				e.comment = fmt.Sprintf("%d %d %s", counts[0], counts[1], strings.Join(rest, " "))
				elems = append(elems, "element "+e.id()+" "+e.val())
			default:
				elems = append(elems, "element "+e.id()+" "+e.val())
			}
		}
	}
	// The endpoints maps first, then the other maps: the endpoint-slots
	// elements are checked against both.
	isEndpoints := func(name string) bool {
		return strings.HasPrefix(name, mapEndpointsPrefix) || strings.HasPrefix(name, mapNodePortEndpointsPrefix)
	}
	for _, first := range []bool{true, false} {
		for name, m := range t.Maps {
			if isEndpoints(name) == first {
				each(name, m.Elements)
			}
		}
	}
	for name, s := range t.Sets {
		each(name, s.Elements)
	}
	for k, m := range slots {
		for li, base := range []int{0, localSlotBase} {
			var eps []string
			for s := base; ; s++ {
				ep, ok := m[s]
				if !ok {
					break
				}
				eps = append(eps, ep.String())
			}
			n := 0
			for s := range m {
				if (s >= localSlotBase) == (li == 1) {
					n++
				}
			}
			if n != len(eps) {
				bad = append(bad, fmt.Sprintf("inconsistent: %s %s slots not dense", k.set, k.dest))
			}
			if len(eps) > 0 {
				slices.Sort(eps)
				elems = append(elems, fmt.Sprintf("slots %s { %s } list %d: %s", k.set, k.dest, li, strings.Join(eps, " ")))
			}
		}
	}
	if stateComment != "" {
		if _, d := parseStateCanary(stateComment); d != fmt.Sprintf("%016x", digest) {
			bad = append(bad, fmt.Sprintf("inconsistent: sync-state digest %s, the elements' is %016x", d, digest))
		}
	}
	slices.Sort(elems)
	slices.Sort(bad)
	// The digest itself differs with the assignment.
	for i, l := range elems {
		if strings.HasPrefix(l, "element "+setSyncState+" ") {
			elems[i] = l[:strings.Index(l, "digest=")]
		}
	}
	out := append(append(head, elems...), bad...)
	return strings.Join(out, "\n") + "\n"
}

// endpointValue reads an endpoints map value (address, port).
func endpointValue(v []string) (netip.AddrPort, error) {
	if len(v) != 2 {
		return netip.AddrPort{}, fmt.Errorf("value %q", v)
	}
	a, err := netip.ParseAddr(v[0])
	if err != nil {
		return netip.AddrPort{}, err
	}
	p, err := strconv.ParseUint(v[1], 10, 16)
	return netip.AddrPortFrom(a, uint16(p)), err
}
