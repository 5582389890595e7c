package nftables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// destKey is one destination of a service port: an address, protocol and
// port (ClusterIP, external IP, load-balancer IP), or a protocol and node
// port. It is the key of the destination's elements in every map.
type destKey struct {
	nodePort bool
	addr     netip.Addr // invalid for node ports
	proto    string
	port     int
}

func (k destKey) String() string {
	if k.nodePort {
		return "nodeport " + k.proto + "/" + strconv.Itoa(k.port)
	}
	return netip.AddrPortFrom(k.addr, uint16(k.port)).String() + "/" + k.proto
}

func (k destKey) compare(o destKey) int {
	switch {
	case k.nodePort != o.nodePort:
		if k.nodePort {
			return 1
		}
		return -1
	case k.addr != o.addr:
		return k.addr.Compare(o.addr)
	case k.proto != o.proto:
		return strings.Compare(k.proto, o.proto)
	}
	return k.port - o.port
}

// dispatchKey is the destination's key in the dispatch and no-endpoint
// maps.
func (k destKey) dispatchKey() []string {
	if k.nodePort {
		return []string{k.proto, strconv.Itoa(k.port)}
	}
	return []string{hostString(k.addr), k.proto, strconv.Itoa(k.port)}
}

// endpointKey is the key of slot in the destination's endpoints map.
func (k destKey) endpointKey(slot int) []string {
	if k.nodePort {
		return []string{strconv.Itoa(k.port), strconv.Itoa(slot)}
	}
	return []string{hostString(k.addr), strconv.Itoa(k.port), strconv.Itoa(slot)}
}

func (k destKey) endpointsMap() string {
	if k.nodePort {
		return nodePortEndpointsMap(k.proto)
	}
	return endpointsMap(k.proto)
}

func (k destKey) dispatchMap() string {
	if k.nodePort {
		return mapServiceNodePorts
	}
	return mapServiceIPs
}

// slotsSet is the set whose element for the destination records its
// endpoint slots (slotsComment).
func (k destKey) slotsSet() string {
	if k.nodePort {
		return setNodePortEndpointSlots
	}
	return setEndpointSlots
}

func (k destKey) noEndpointMap() string {
	if k.nodePort {
		return mapNoEndpointNodePorts
	}
	return mapNoEndpointServices
}

// endpointKeys are the keys of a destination's endpoint slots: counts
// cluster slots from 0 and local ones from localSlotBase.
func (k destKey) endpointKeys(counts [2]int) [][]string {
	var out [][]string
	for i := 0; i < counts[0]; i++ {
		out = append(out, k.endpointKey(i))
	}
	for i := 0; i < counts[1]; i++ {
		out = append(out, k.endpointKey(localSlotBase+i))
	}
	return out
}

// destRender is everything one destination puts in the table.
type destRender struct {
	key   destKey
	owner proxy.ServicePortName
	// small are the elements of the maps a full sync lists: the dispatch
	// element (service-ips, service-nodeports) and, right after it, the
	// destination's endpoint-slots element, the no-endpoint verdict and
	// the source ranges.
	small []elem
	// eps are the endpoints of the cluster and local slots: the elements
	// of the endpoints maps (bigElems), which a full sync never lists (the
	// endpoint-slots element's comment carries their hash and counts). They are
	// kept this small because every service's render stays in memory.
	eps  [2][]netip.AddrPort
	hash string
	// digest hashes every element of the destination (tableState.digest);
	// bigDigest the endpoint slots alone.
	digest, bigDigest uint64
	// chains are the shape and pick chains the dispatch element leads to.
	chains []string
}

// counts are the numbers of cluster and local slots.
func (dr *destRender) counts() [2]int { return [2]int{len(dr.eps[0]), len(dr.eps[1])} }

// bigElems are the destination's endpoint slots.
func (dr *destRender) bigElems() []elem {
	out := make([]elem, 0, len(dr.eps[0])+len(dr.eps[1]))
	for i, eps := range dr.eps {
		for slot := range eps {
			out = append(out, dr.slotElem(i, slot))
		}
	}
	return out
}

// slotElem is the element of the destination's endpoint slot (of
// bigElems), for a slot of its cluster (i 0) or local (i 1) slots.
func (dr *destRender) slotElem(i, slot int) elem {
	base := 0
	if i == 1 {
		base = localSlotBase
	}
	ep := dr.eps[i][slot]
	return elem{set: dr.key.endpointsMap(), key: dr.key.endpointKey(base + slot),
		value: []string{hostString(ep.Addr()), strconv.Itoa(int(ep.Port()))}}
}

// diffSlots adds to del and add what diffElems would of the endpoint
// slots (bigElems) of one destination's old and new render (either may be
// nil), making elements only for the slots that differ: a one-endpoint
// change of a destination with many endpoints touches one slot.
func diffSlots(old, now *destRender, del, add *[]elem) {
	var oe, ne [2][]netip.AddrPort
	if old != nil {
		oe = old.eps
	}
	if now != nil {
		ne = now.eps
	}
	for i := range oe {
		for slot, ep := range oe[i] {
			if slot >= len(ne[i]) || ne[i][slot] != ep {
				*del = append(*del, old.slotElem(i, slot))
			}
		}
	}
	for i := range ne {
		for slot, ep := range ne[i] {
			if slot >= len(oe[i]) || oe[i][slot] != ep {
				*add = append(*add, now.slotElem(i, slot))
			}
		}
	}
}

// endpointText appends the text of the element of slot (the id() and
// val() of bigElems' element, without allocating one): the endpoints hash
// and the digest are written from it.
func (dr *destRender) endpointText(buf []byte, set string, slot int, ep netip.AddrPort) []byte {
	buf = append(buf, set...)
	buf = append(buf, " { "...)
	if !dr.key.nodePort {
		buf = dr.key.addr.Unmap().AppendTo(buf)
		buf = append(buf, " . "...)
	}
	buf = strconv.AppendInt(buf, int64(dr.key.port), 10)
	buf = append(buf, " . "...)
	buf = strconv.AppendInt(buf, int64(slot), 10)
	buf = append(buf, " }"...)
	buf = ep.Addr().Unmap().AppendTo(buf)
	buf = append(buf, " . "...)
	buf = strconv.AppendUint(buf, uint64(ep.Port()), 10)
	return append(buf, " # "...)
}

// hashEndpoints returns the hash of the shape chain's name and the
// endpoint slots (as the endpoint-slots comment carries it) and the slots' share
// of the digest.
func (dr *destRender) hashEndpoints(shape string) (string, uint64) {
	h := fnvAdd(fnvAdd(fnvOffset, shape), "\n")
	set := dr.key.endpointsMap()
	var digest uint64
	buf := make([]byte, 0, 128)
	for i, eps := range dr.eps {
		base := 0
		if i == 1 {
			base = localSlotBase
		}
		for slot, ep := range eps {
			buf = dr.endpointText(buf[:0], set, base+slot, ep)
			digest ^= fnvAdd(fnvOffset, buf)
			h = fnvAdd(fnvAdd(h, buf), "\n")
		}
	}
	var hb [16]byte
	hex := strconv.AppendUint(hb[:0], h, 16)
	return strings.Repeat("0", 16-len(hex)) + string(hex), digest
}

// endpointObjects are the destination's endpoint slots as knftables
// elements, allocated together, their strings shared where they can be
// (a full sync writes about a hundred thousand of them).
func (dr *destRender) endpointObjects(strs *stringCache) []knftables.Element {
	n := len(dr.eps[0]) + len(dr.eps[1])
	if n == 0 {
		return nil
	}
	set := strs.endpointsMap(dr.key)
	klen := 3
	if dr.key.nodePort {
		klen = 2
	}
	objs := make([]knftables.Element, 0, n)
	keys := make([]string, 0, n*klen)
	vals := make([]string, 0, n*2)
	var addr string
	if !dr.key.nodePort {
		addr = hostString(dr.key.addr)
	}
	port := strs.itoa(dr.key.port)
	for i, eps := range dr.eps {
		base := 0
		if i == 1 {
			base = localSlotBase
		}
		for slot, ep := range eps {
			k := len(keys)
			if !dr.key.nodePort {
				keys = append(keys, addr)
			}
			keys = append(keys, port, strs.itoa(base+slot))
			v := len(vals)
			vals = append(vals, hostString(ep.Addr()), strs.itoa(int(ep.Port())))
			objs = append(objs, knftables.Element{Map: set, Key: keys[k:len(keys):len(keys)], Value: vals[v:len(vals):len(vals)]})
		}
	}
	return objs
}

// appendEndpointElements appends the destination's endpoint slots to b as
// the elements of one nft element command, in endpointObjects' order and
// as knftables writes each ("k1 . k2 . slot : addr . port"), separated by
// ", ".
func (dr *destRender) appendEndpointElements(b []byte) []byte {
	first := true
	for i, eps := range dr.eps {
		base := 0
		if i == 1 {
			base = localSlotBase
		}
		for slot, ep := range eps {
			if !first {
				b = append(b, ", "...)
			}
			first = false
			if !dr.key.nodePort {
				b = dr.key.addr.Unmap().AppendTo(b)
				b = append(b, " . "...)
			}
			b = strconv.AppendInt(b, int64(dr.key.port), 10)
			b = append(b, " . "...)
			b = strconv.AppendInt(b, int64(base+slot), 10)
			b = append(b, " : "...)
			b = ep.Addr().Unmap().AppendTo(b)
			b = append(b, " . "...)
			b = strconv.AppendInt(b, int64(ep.Port()), 10)
		}
	}
	return b
}

// stringCache shares the strings of numbers and map names among the
// elements of one transaction.
type stringCache struct {
	nums map[int]string
	maps map[destKey]string
}

func (c *stringCache) itoa(n int) string {
	if n >= 0 && n < 100 {
		return strconv.Itoa(n) // static, no allocation
	}
	if s, ok := c.nums[n]; ok {
		return s
	}
	if c.nums == nil {
		c.nums = map[int]string{}
	}
	s := strconv.Itoa(n)
	c.nums[n] = s
	return s
}

func (c *stringCache) endpointsMap(k destKey) string {
	k = destKey{nodePort: k.nodePort, proto: k.proto}
	if s, ok := c.maps[k]; ok {
		return s
	}
	if c.maps == nil {
		c.maps = map[destKey]string{}
	}
	s := k.endpointsMap()
	c.maps[k] = s
	return s
}

// renderedService is what one service port puts in the table.
type renderedService struct {
	name  proxy.ServicePortName
	dests []*destRender // distinct keys, in render order
	// hairpin are the endpoints that may reach themselves.
	hairpin     []netip.Addr
	healthCheck int
}

// slotsComment is the comment of a destination's endpoint-slots element
// (setEndpointSlots; the dispatch element's in layout 1): the hash of its
// endpoint slots, the cluster and local slot counts, the slot
// assignment (permToken, when not in address order and short enough), the
// service port.
func slotsComment(hash string, counts [2]int, perm string, name proxy.ServicePortName) string {
	c := fmt.Sprintf("%s %d %d", hash, counts[0], counts[1])
	if perm != "" && len(c)+1+len(perm) <= 128 {
		c += " " + perm
	}
	c += " " + name.String()
	if len(c) > 128 {
		c = c[:128]
	}
	return c
}

// parseSlotsComment reads slotsComment's hash, counts and slot
// assignment ("" for address order).
func parseSlotsComment(c string) (hash string, counts [2]int, perm string, ok bool) {
	f := strings.Fields(c)
	if len(f) < 3 || len(f[0]) != 16 {
		return "", counts, "", false
	}
	var err1, err2 error
	counts[0], err1 = strconv.Atoi(f[1])
	counts[1], err2 = strconv.Atoi(f[2])
	if err1 != nil || err2 != nil || counts[0] < 0 || counts[1] < 0 || counts[0] > localSlotBase || counts[1] > localSlotBase {
		return "", counts, "", false
	}
	if len(f) > 3 && strings.HasPrefix(f[3], "p=") {
		perm = f[3]
	}
	return f[0], counts, perm, true
}

func shortComment(name proxy.ServicePortName) string {
	c := name.String()
	if len(c) > 128 {
		c = c[:128]
	}
	return c
}

// Policies a no-endpoint element's comment names before the service port.
const (
	CommentInternalLocal = "internalTrafficPolicy=Local"
	CommentExternalLocal = "externalTrafficPolicy=Local"
)

// noEndpointComment is the comment of a destination's no-endpoint element:
// the service port and, for a drop, first the traffic policy that leaves
// no endpoint here (internal for the ClusterIP, external for the others:
// the model drops nothing else), so that kproxy trace can say which. The
// service port stays the last field (commentOwner); a name too long for
// both goes alone.
func noEndpointComment(verdict string, kind proxy.DestinationKind, name proxy.ServicePortName) string {
	c := shortComment(name)
	if verdict != "drop" {
		return c
	}
	policy := CommentExternalLocal
	if kind == proxy.DestClusterIP {
		policy = CommentInternalLocal
	}
	if len(policy)+1+len(c) < 128 {
		c = policy + " " + c
	}
	return c
}

// filterVerdict is the verdict the filter chains give connections to a
// destination that the nat chains did not DNAT: the non-delivering verdict
// of its decisions (the model never gives one destination two), or "".
func filterVerdict(d *proxy.ServiceDecisions, kind proxy.DestinationKind) string {
	for _, c := range []proxy.SourceClass{proxy.SourceOther, proxy.SourceNode, proxy.SourcePod} {
		switch d.For(kind, c).Verdict {
		case proxy.VerdictDrop:
			return "drop"
		case proxy.VerdictReject:
			return "goto " + chainReject
		}
	}
	return ""
}

// slotsOf returns the endpoint slots a destination has in the table (nil
// when unknown): render keeps them for the endpoints that stay.
type slotsOf func(destKey) *[2][]netip.AddrPort

// render draws one service port's decisions: every destination's shape and
// elements. It holds no Service semantics: which list, masquerade or
// verdict each class gets comes from the decision table. prev (may be nil)
// gives the destinations' current slots.
func (l *layout) render(st *proxy.ServiceState, prev slotsOf) (*renderedService, error) {
	d := &st.Decisions
	proto := strings.ToLower(string(st.Protocol))
	rs := &renderedService{name: st.Name, healthCheck: st.HealthCheckNodePort}
	seen := map[destKey]bool{}
	add := func(kind proxy.DestinationKind, key destKey) (*destRender, error) {
		if seen[key] {
			// The same address twice (an external IP that is also a
			// load-balancer IP): the first kind has it.
			return nil, nil
		}
		seen[key] = true
		var was *[2][]netip.AddrPort
		if prev != nil {
			was = prev(key)
		}
		dr, err := l.renderDest(st, kind, key, was)
		if err != nil {
			return nil, fmt.Errorf("service port %s, %s: %w", st.Name, key, err)
		}
		rs.dests = append(rs.dests, dr)
		return dr, nil
	}
	valid := func(a netip.Addr) bool { return a.IsValid() && a.Is6() == l.fam.ipv6 && !a.Is4In6() }
	if d.Has(proxy.DestClusterIP) && valid(st.ClusterIP) {
		if _, err := add(proxy.DestClusterIP, destKey{addr: st.ClusterIP, proto: proto, port: st.Port}); err != nil {
			return nil, err
		}
	}
	if d.Has(proxy.DestNodePort) && st.NodePort > 0 {
		if _, err := add(proxy.DestNodePort, destKey{nodePort: true, proto: proto, port: st.NodePort}); err != nil {
			return nil, err
		}
	}
	if d.Has(proxy.DestExternalIP) {
		for _, ip := range st.ExternalIPs {
			if !valid(ip) {
				continue
			}
			if _, err := add(proxy.DestExternalIP, destKey{addr: ip, proto: proto, port: st.Port}); err != nil {
				return nil, err
			}
		}
	}
	if d.Has(proxy.DestLoadBalancerIP) {
		for _, ip := range st.LoadBalancerVIPs {
			if !valid(ip) {
				continue
			}
			dr, err := add(proxy.DestLoadBalancerIP, destKey{addr: ip, proto: proto, port: st.Port})
			if err != nil {
				return nil, err
			}
			if dr != nil && d.Firewall != nil {
				dr.small = append(dr.small, l.firewallElems(dr.key, d.Firewall)...)
			}
		}
	}
	for _, ep := range d.Hairpin {
		if valid(ep.IP) {
			rs.hairpin = append(rs.hairpin, ep.IP)
		}
	}
	for _, dr := range rs.dests {
		dr.computeDigest()
	}
	return rs, nil
}

// renderDest renders one destination of kind; prev (may be nil) are its
// slots in the table.
func (l *layout) renderDest(st *proxy.ServiceState, kind proxy.DestinationKind, key destKey, prev *[2][]netip.AddrPort) (*destRender, error) {
	d := &st.Decisions
	dr := &destRender{key: key, owner: st.Name}
	shape := shapeKey{nodePort: key.nodePort, proto: key.proto, affinity: d.AffinitySeconds}
	for _, c := range proxy.SourceClasses {
		dec := d.For(kind, c)
		if dec.Verdict != proxy.VerdictDeliver {
			continue
		}
		n := len(st.Endpoints(dec.Endpoints))
		if n == 0 || dec.Endpoints == proxy.SelectNone {
			return nil, fmt.Errorf("%s class is delivered over an empty %s list", c, dec.Endpoints)
		}
		shape.classes[c] = classAction{deliver: true, sel: dec.Endpoints, count: n, masq: dec.Masquerade}
	}
	if shape.delivers() {
		sc, err := l.chain(shape.name(), func() (*chainDef, error) { return l.shapeChain(shape) })
		if err != nil {
			return nil, err
		}
		dr.chains = append(dr.chains, sc)
		var sels [3]bool
		for _, a := range shape.classes {
			if !a.deliver {
				continue
			}
			sels[a.sel] = true
			p := shape.pick(a)
			if pc, _ := l.chain(p.name(), func() (*chainDef, error) { return l.pickChain(p), nil }); !slices.Contains(dr.chains, pc) {
				dr.chains = append(dr.chains, pc)
			}
		}
		for i, sel := range []proxy.EndpointSelection{proxy.SelectCluster, proxy.SelectLocal} {
			if !sels[sel] {
				continue
			}
			var was []netip.AddrPort
			if prev != nil {
				was = prev[i]
			}
			dr.eps[i] = slotOrder(was, st.Endpoints(sel))
		}
		dr.hash, dr.bigDigest = dr.hashEndpoints(shape.name())
		// The dispatch element changes only with the shape (the endpoint
		// counts among it); the slots element with any endpoint.
		dk := key.dispatchKey()
		dr.small = append(dr.small,
			elem{set: key.dispatchMap(), key: dk, value: []string{"goto " + shape.name()}, comment: shortComment(st.Name)},
			elem{set: key.slotsSet(), key: dk, comment: slotsComment(dr.hash, dr.counts(), permToken(dr.eps), st.Name)})
	}
	if v := filterVerdict(d, kind); v != "" {
		dr.small = append(dr.small, elem{set: key.noEndpointMap(), key: key.dispatchKey(), value: []string{v}, comment: noEndpointComment(v, kind, st.Name)})
	}
	return dr, nil
}

// elemDigest is an element's share of a table digest.
func elemDigest(e *elem) uint64 {
	h := fnvOffset
	h = fnvAdd(h, e.set)
	h = fnvAdd(h, " { ")
	for i, k := range e.key {
		if i > 0 {
			h = fnvAdd(h, " . ")
		}
		h = fnvAdd(h, k)
	}
	h = fnvAdd(h, " }")
	for i, v := range e.value {
		if i > 0 {
			h = fnvAdd(h, " . ")
		}
		h = fnvAdd(h, v)
	}
	h = fnvAdd(h, " # ")
	return fnvAdd(h, e.comment)
}

// FNV-1a (64 bits) over strings and byte slices without allocating:
// hash/fnv's Write takes a []byte through an interface.
const (
	fnvOffset uint64 = 14695981039346656037
	fnvPrime  uint64 = 1099511628211
)

func fnvAdd[T string | []byte](h uint64, s T) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= fnvPrime
	}
	return h
}

// reorder gives the destination the slots eps (the same endpoints in
// another order) and returns the change of its digest.
func (dr *destRender) reorder(eps [2][]netip.AddrPort) uint64 {
	old := dr.digest
	// The dispatch and endpoint-slots elements: eps is not empty.
	shape := strings.TrimPrefix(dr.small[0].value[0], "goto ")
	s := &dr.small[1]
	_, counts, _, _ := parseSlotsComment(s.comment)
	dr.eps = eps
	dr.hash, dr.bigDigest = dr.hashEndpoints(shape)
	s.comment = slotsComment(dr.hash, counts, permToken(eps), dr.owner)
	dr.computeDigest()
	return old ^ dr.digest
}

// computeDigest sets dr.digest from all its elements (called once the
// render is complete).
func (dr *destRender) computeDigest() {
	dr.digest = dr.bigDigest
	for i := range dr.small {
		dr.digest ^= elemDigest(&dr.small[i])
	}
}

// chain returns the chain of that name, rendering it the first time this
// layout is asked for it: destinations of one shape share its chains.
func (l *layout) chain(name string, render func() (*chainDef, error)) (string, error) {
	if _, ok := l.chains[name]; ok {
		return name, nil
	}
	c, err := render()
	if err != nil {
		return "", err
	}
	if l.chains == nil {
		l.chains = map[string]*chainDef{}
	}
	l.chains[name] = c
	return name, nil
}

// firewallElems are a load-balancer IP's source ranges: the destination in
// firewall-ips, and (destination, range) in firewall-allow for each range
// not inside another (an interval set refuses overlapping elements), plus
// the VIP itself with AllowVIPSource.
func (l *layout) firewallElems(key destKey, f *proxy.SourceFilter) []elem {
	dk := key.dispatchKey()
	out := []elem{{set: setFirewallIPs, key: dk}}
	var ranges []netip.Prefix
	for _, p := range f.Allowed {
		if p.IsValid() && p.Addr().Is6() == l.fam.ipv6 {
			ranges = append(ranges, p.Masked())
		}
	}
	if f.AllowVIPSource {
		ranges = append(ranges, netip.PrefixFrom(key.addr, key.addr.BitLen()))
	}
	slices.SortFunc(ranges, func(a, b netip.Prefix) int {
		if c := a.Bits() - b.Bits(); c != 0 {
			return c
		}
		return a.Addr().Compare(b.Addr())
	})
	var kept []netip.Prefix
	for _, p := range ranges {
		inside := false
		for _, k := range kept {
			if k.Bits() <= p.Bits() && k.Contains(p.Addr()) {
				inside = true
				break
			}
		}
		if !inside {
			kept = append(kept, p)
		}
	}
	slices.SortFunc(kept, func(a, b netip.Prefix) int {
		if c := a.Addr().Compare(b.Addr()); c != 0 {
			return c
		}
		return a.Bits() - b.Bits()
	})
	for _, p := range kept {
		s := p.String()
		if p.IsSingleIP() {
			s = hostString(p.Addr())
		}
		out = append(out, elem{set: setFirewallAllow, key: append(slices.Clone(dk), s)})
	}
	return out
}
