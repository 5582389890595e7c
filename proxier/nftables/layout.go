package nftables

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Names of the objects of kproxy's table. Where kube-proxy's nftables mode
// has an object with the same role, it has the same name.
const (
	// Base chains.
	chainFilterPreroutingPreDNAT = "filter-prerouting-pre-dnat"
	chainFilterOutputPreDNAT     = "filter-output-pre-dnat"
	chainFilterInput             = "filter-input"
	chainFilterForward           = "filter-forward"
	chainFilterOutput            = "filter-output"
	chainNATPrerouting           = "nat-prerouting"
	chainNATOutput               = "nat-output"
	chainNATPostrouting          = "nat-postrouting"

	// Regular chains whose rules never change with the services.
	chainServices               = "services"
	chainMasquerading           = "masquerading"
	chainFirewallCheck          = "firewall-check"
	chainServiceEndpointsCheck  = "service-endpoints-check"
	chainNodePortEndpointsCheck = "nodeport-endpoints-check"
	chainReject                 = "reject-chain"

	// Prefixes of the chains shared by every destination of one shape
	// (shapeKey) and of the endpoint-picking chains (pickKey).
	shapeChainPrefix = "svc-"
	pickChainPrefix  = "pick-"

	// Maps and sets.
	mapServiceIPs          = "service-ips"
	mapServiceNodePorts    = "service-nodeports"
	mapNoEndpointServices  = "no-endpoint-services"
	mapNoEndpointNodePorts = "no-endpoint-nodeports"
	setFirewallIPs         = "firewall-ips"
	setFirewallAllow       = "firewall-allow"
	setHairpin             = "hairpin-endpoints"
	setHealthCheck         = "health-check-nodeports"
	setNodePortIPs         = "nodeport-ips"
	// setEndpointSlots and setNodePortEndpointSlots hold one element per
	// destination that delivers, keyed as its dispatch element, whose
	// comment records its endpoint slots (slotsComment): a full sync
	// learns what the endpoints maps hold from them without listing those.
	// They are plain sets, so that a change of a destination's endpoints
	// (a new comment here, new slots there) adds no verdict element: a
	// transaction that adds a jump or goto makes the kernel validate every
	// chain the table's verdict maps lead to (1.5 ms of nft's CPU at
	// 10,000 Services, against 0.4 ms without).
	setEndpointSlots         = "endpoint-slots"
	setNodePortEndpointSlots = "nodeport-endpoint-slots"
	// setSyncState holds only its canary, whose comment says which layout
	// the table has and the digest of its elements (stateCanary).
	setSyncState = "sync-state"
	// Per protocol: "endpoints-tcp", "nodeport-endpoints-tcp", "affinity-tcp".
	mapEndpointsPrefix         = "endpoints-"
	mapNodePortEndpointsPrefix = "nodeport-endpoints-"
	setAffinityPrefix          = "affinity-"

	// localSlotBase is added to the slot numbers of the local endpoints, so
	// that one endpoints map holds both lists of a destination (the cluster
	// ones at slots 0..n-1, the local ones from here).
	localSlotBase = 1 << 20

	// affinitySetSize bounds each affinity set (client, destination, slot
	// entries of every affinity service of one protocol).
	affinitySetSize = 1 << 20

	// canaryComment marks the canary element of every map and set.
	canaryComment = "kproxy canary"

	// layoutVersion changes whenever the rules written for the same
	// layout change, so that a new kproxy rewrites the chains an older
	// one left.
	layoutVersion = "2"
)

// protocols are the transport protocols of service ports, lower case as nft
// writes them.
var protocols = []string{"tcp", "udp", "sctp"}

// family is what differs between the ip and ip6 tables.
type family struct {
	ipv6     bool
	ip       string // "ip" or "ip6"
	addrType string // "ipv4_addr" or "ipv6_addr"
	loopback string // the loopback range node ports never accept
	zero     string // the unspecified address (canary elements)
}

func newFamily(ipv6 bool) family {
	if ipv6 {
		return family{ipv6: true, ip: "ip6", addrType: "ipv6_addr", loopback: "::1", zero: "::"}
	}
	return family{ip: "ip", addrType: "ipv4_addr", loopback: "127.0.0.0/8", zero: "0.0.0.0"}
}

// layout renders the objects of the table that do not depend on the
// services, and the shared chains that do, for one family and one set of
// node-wide options.
type layout struct {
	fam         family
	masqMark    string // e.g. 0x4000
	clusterCIDR netip.Prefix
	// nodePortIPs: node ports are accepted on the addresses of setNodePortIPs
	// rather than on every local address.
	nodePortIPs bool
	hashCache   string
	// staticNAT and staticFilter count the rules of the static chains
	// (staticRules), once staticCounted.
	staticNAT, staticFilter int
	staticCounted           bool
	// chains are the shape and pick chains rendered so far.
	chains map[string]*chainDef
	// setDefs and isMap are sets' and isMapOf's answers, made once: a
	// layout's sets do not change (a partial sync asks for them).
	setDefs []*setDef
	isMap   map[string]bool
}

// hash identifies everything the chains' rules depend on besides their
// names: the static chains, the map and set types, how shape and pick
// chains are written, the options. Two tables of the same layout hash have
// the same rules in chains of the same name; the sync-state canary carries
// it, so that a full sync can trust the chains it finds without listing
// their rules (nft reads every set element to list a chain).
func (l *layout) hash() string {
	if l.hashCache != "" {
		return l.hashCache
	}
	h := sha256.New()
	fmt.Fprintf(h, "version %s\n", layoutVersion)
	chains := l.staticChains()
	for _, nodePort := range []bool{false, true} {
		for _, sel := range []proxy.EndpointSelection{proxy.SelectCluster, proxy.SelectLocal} {
			for _, aff := range []int{0, 30} {
				chains = append(chains, l.pickChain(pickKey{nodePort: nodePort, proto: "tcp", sel: sel, count: 2, affinity: aff}))
			}
		}
		c := classAction{deliver: true, sel: proxy.SelectCluster, count: 2}
		s := shapeKey{nodePort: nodePort, proto: "udp", classes: [3]classAction{c, c, {}}}
		s.classes[proxy.SourceNode].masq = true
		if l.clusterCIDR.IsValid() {
			s.classes[proxy.SourcePod].sel, s.classes[proxy.SourcePod].count = proxy.SelectLocal, 3
		}
		if sc, err := l.shapeChain(s); err == nil {
			chains = append(chains, sc)
		}
	}
	for _, c := range chains {
		fmt.Fprintf(h, "chain %s\n", c.name)
		if c.hook != nil {
			fmt.Fprintf(h, "%s %s %s\n", *c.chainType, *c.hook, *c.priority)
		}
		for _, r := range c.rules {
			fmt.Fprintf(h, "%s\n", r)
		}
	}
	for _, sd := range l.sets() {
		fmt.Fprintf(h, "set %s %s %s %v %v\n", sd.name, sd.typ, sd.typeOf, sd.flags, sd.isMap)
	}
	l.hashCache = hex.EncodeToString(h.Sum(nil)[:8])
	return l.hashCache
}

// chainDef is one chain with its rules (rule text without comments).
type chainDef struct {
	name string
	// base chains: type, hook and priority.
	chainType *knftables.BaseChainType
	hook      *knftables.BaseChainHook
	priority  *knftables.BaseChainPriority
	// table is "nat" or "filter": which kind of work the chain does, for
	// the rule counts (the metric is by table, as in iptables mode).
	table string
	rules []string
}

func (c *chainDef) chain() *knftables.Chain {
	return &knftables.Chain{Name: c.name, Type: c.chainType, Hook: c.hook, Priority: c.priority}
}

func baseChain(name string, t knftables.BaseChainType, hook knftables.BaseChainHook, prio int, table string, rules ...string) *chainDef {
	p := knftables.BaseChainPriority(strconv.Itoa(prio))
	return &chainDef{name: name, chainType: &t, hook: &hook, priority: &p, table: table, rules: rules}
}

// staticRules counts the rules of the static chains by table.
func (l *layout) staticRules() (nat, filter int) {
	if !l.staticCounted {
		for _, c := range l.staticChains() {
			if c.table == "nat" {
				l.staticNAT += len(c.rules)
			} else {
				l.staticFilter += len(c.rules)
			}
		}
		l.staticCounted = true
	}
	return l.staticNAT, l.staticFilter
}

// staticChains are the chains every sync has, in the order they are
// created.
func (l *layout) staticChains() []*chainDef {
	ip := l.fam.ip
	dest := ip + " daddr . meta l4proto . th dport"
	nodePorts := "fib daddr type local " + ip + " daddr != " + l.fam.loopback
	if l.nodePortIPs {
		nodePorts = ip + " daddr @" + setNodePortIPs
	}
	newJump := func(chain string) string { return "ct state new jump " + chain }
	return []*chainDef{
		{name: chainServices, table: "nat", rules: []string{
			dest + " vmap @" + mapServiceIPs,
			nodePorts + " meta l4proto . th dport vmap @" + mapServiceNodePorts,
		}},
		{name: chainMasquerading, table: "nat", rules: []string{
			"meta mark & " + l.masqMark + " != 0 meta mark set meta mark ^ " + l.masqMark + " masquerade fully-random",
			"ct status dnat " + ip + " saddr . " + ip + " daddr @" + setHairpin + " masquerade fully-random",
		}},
		{name: chainFirewallCheck, table: "filter", rules: []string{
			dest + " @" + setFirewallIPs + " " + dest + " . " + ip + " saddr != @" + setFirewallAllow + " drop",
		}},
		{name: chainServiceEndpointsCheck, table: "filter", rules: []string{dest + " vmap @" + mapNoEndpointServices}},
		{name: chainNodePortEndpointsCheck, table: "filter", rules: []string{
			ip + " daddr != " + l.fam.loopback + " meta l4proto . th dport vmap @" + mapNoEndpointNodePorts,
		}},
		{name: chainReject, table: "filter", rules: []string{"reject"}},
		// Source ranges are checked before DNAT, for every source class.
		baseChain(chainFilterPreroutingPreDNAT, knftables.FilterType, knftables.PreroutingHook, -110, "filter", newJump(chainFirewallCheck)),
		baseChain(chainFilterOutputPreDNAT, knftables.FilterType, knftables.OutputHook, -110, "filter", newJump(chainFirewallCheck)),
		// Health-check node ports are accepted as iptables mode accepts
		// them (an accept here ends only this table's evaluation).
		baseChain(chainFilterInput, knftables.FilterType, knftables.InputHook, 0, "filter",
			"tcp dport @"+setHealthCheck+" accept",
			newJump(chainNodePortEndpointsCheck), newJump(chainServiceEndpointsCheck)),
		baseChain(chainFilterForward, knftables.FilterType, knftables.ForwardHook, 0, "filter", newJump(chainServiceEndpointsCheck)),
		baseChain(chainFilterOutput, knftables.FilterType, knftables.OutputHook, 0, "filter", newJump(chainServiceEndpointsCheck)),
		baseChain(chainNATPrerouting, knftables.NATType, knftables.PreroutingHook, -100, "nat", "jump "+chainServices),
		baseChain(chainNATOutput, knftables.NATType, knftables.OutputHook, -100, "nat", "jump "+chainServices),
		baseChain(chainNATPostrouting, knftables.NATType, knftables.PostroutingHook, 100, "nat", "jump "+chainMasquerading),
	}
}

// setDef is one map or set of the table.
type setDef struct {
	name  string
	isMap bool
	// typ or typeOf, as knftables wants them.
	typ, typeOf string
	flags       []knftables.SetFlag
	timeout     *time.Duration
	size        *uint64
	// dynamic sets are filled by the packet path: never listed, flushed or
	// given a canary.
	dynamic bool
	// big maps (the endpoints) are never listed: a full sync learns what
	// they hold from the endpoint-slots elements' comments.
	big bool
	// canary is the element that must always be there.
	canary elem
}

func (s *setDef) object() knftables.Object {
	if s.isMap {
		return &knftables.Map{Name: s.name, Type: s.typ, TypeOf: s.typeOf, Flags: s.flags, Timeout: s.timeout, Size: s.size}
	}
	return &knftables.Set{Name: s.name, Type: s.typ, TypeOf: s.typeOf, Flags: s.flags, Timeout: s.timeout, Size: s.size}
}

func endpointsMap(proto string) string         { return mapEndpointsPrefix + proto }
func nodePortEndpointsMap(proto string) string { return mapNodePortEndpointsPrefix + proto }
func affinitySet(proto string) string          { return setAffinityPrefix + proto }

// sets lists every map and set of the table.
func (l *layout) sets() []*setDef {
	if l.setDefs == nil {
		l.setDefs = l.makeSets()
	}
	return l.setDefs
}

// makeSets makes the maps and sets of sets.
func (l *layout) makeSets() []*setDef {
	ip, at, zero := l.fam.ip, l.fam.addrType, l.fam.zero
	destType := at + " . inet_proto . inet_service"
	verdictCanary := func(name string, key ...string) elem {
		return elem{set: name, key: key, value: []string{"continue"}, comment: canaryComment}
	}
	setCanary := func(name string, key ...string) elem {
		return elem{set: name, key: key, comment: canaryComment}
	}
	out := []*setDef{
		{name: mapServiceIPs, isMap: true, typ: destType + " : verdict", canary: verdictCanary(mapServiceIPs, zero, "tcp", "0")},
		{name: mapServiceNodePorts, isMap: true, typ: "inet_proto . inet_service : verdict", canary: verdictCanary(mapServiceNodePorts, "tcp", "0")},
		{name: mapNoEndpointServices, isMap: true, typ: destType + " : verdict", canary: verdictCanary(mapNoEndpointServices, zero, "tcp", "0")},
		{name: mapNoEndpointNodePorts, isMap: true, typ: "inet_proto . inet_service : verdict", canary: verdictCanary(mapNoEndpointNodePorts, "tcp", "0")},
		{name: setFirewallIPs, typ: destType, canary: setCanary(setFirewallIPs, zero, "tcp", "0")},
		{name: setFirewallAllow, typ: destType + " . " + at, flags: []knftables.SetFlag{knftables.IntervalFlag},
			canary: setCanary(setFirewallAllow, zero, "tcp", "0", zero)},
		{name: setHairpin, typ: at + " . " + at, canary: setCanary(setHairpin, zero, zero)},
		{name: setHealthCheck, typ: "inet_service", canary: setCanary(setHealthCheck, "0")},
		{name: setNodePortIPs, typ: at, canary: setCanary(setNodePortIPs, zero)},
		{name: setEndpointSlots, typ: destType, canary: setCanary(setEndpointSlots, zero, "tcp", "0")},
		{name: setNodePortEndpointSlots, typ: "inet_proto . inet_service", canary: setCanary(setNodePortEndpointSlots, "tcp", "0")},
		{name: setSyncState, typ: "inet_service", canary: setCanary(setSyncState, "0")},
	}
	for _, p := range protocols {
		epValue := ip + " daddr . " + p + " dport"
		out = append(out,
			&setDef{name: endpointsMap(p), isMap: true, big: true,
				typeOf: ip + " daddr . " + p + " dport . numgen random mod 1 : " + epValue,
				canary: elem{set: endpointsMap(p), key: []string{zero, "0", "0"}, value: []string{zero, "0"}, comment: canaryComment}},
			&setDef{name: nodePortEndpointsMap(p), isMap: true, big: true,
				typeOf: p + " dport . numgen random mod 1 : " + epValue,
				canary: elem{set: nodePortEndpointsMap(p), key: []string{"0", "0"}, value: []string{zero, "0"}, comment: canaryComment}},
			&setDef{name: affinitySet(p), dynamic: true,
				typeOf:  ip + " saddr . " + ip + " daddr . " + p + " dport . numgen random mod 1",
				flags:   []knftables.SetFlag{knftables.DynamicFlag, knftables.TimeoutFlag},
				timeout: knftables.PtrTo(10800 * time.Second), size: knftables.PtrTo(uint64(affinitySetSize))},
		)
	}
	return out
}

// stateCanary is the canary of sync-state: the layout hash and the digest
// of every element the table holds (tableState.digest).
func (l *layout) stateCanary(digest uint64) elem {
	return elem{set: setSyncState, key: []string{"0"}, comment: fmt.Sprintf("%s layout=%s digest=%016x", canaryComment, l.hash(), digest)}
}

// parseStateCanary reads stateCanary's comment.
func parseStateCanary(c string) (layout, digest string) {
	for _, f := range strings.Fields(c) {
		if v, ok := strings.CutPrefix(f, "layout="); ok {
			layout = v
		}
		if v, ok := strings.CutPrefix(f, "digest="); ok {
			digest = v
		}
	}
	return layout, digest
}

// elem is one element of a map or set.
type elem struct {
	set     string
	key     []string
	value   []string // nil for a set element
	comment string
}

func (e *elem) id() string  { return e.set + " { " + strings.Join(e.key, " . ") + " }" }
func (e *elem) val() string { return strings.Join(e.value, " . ") + " # " + e.comment }

func (e *elem) object(isMap bool) *knftables.Element {
	o := &knftables.Element{Key: e.key, Value: e.value}
	if isMap {
		o.Map = e.set
	} else {
		o.Set = e.set
	}
	if e.comment != "" {
		o.Comment = knftables.PtrTo(e.comment)
	}
	return o
}

// classAction is what a shape chain does with one source class: nothing
// (no delivery), or a delivery over count endpoints of one list, perhaps
// masqueraded.
type classAction struct {
	deliver bool
	sel     proxy.EndpointSelection
	count   int
	masq    bool
}

func (a classAction) code() string {
	if !a.deliver {
		return "x"
	}
	s := "c"
	if a.sel == proxy.SelectLocal {
		s = "l"
	}
	s += strconv.Itoa(a.count)
	if a.masq {
		s += "m"
	}
	return s
}

// pickKey names an endpoint-picking chain: DNAT to one of count endpoints
// of a list of the packet's destination, with or without affinity.
type pickKey struct {
	nodePort bool
	proto    string
	sel      proxy.EndpointSelection
	count    int
	affinity int // seconds; 0 without affinity
}

func keyKind(nodePort bool) string {
	if nodePort {
		return "np"
	}
	return "ip"
}

func (p pickKey) name() string {
	a := classAction{deliver: true, sel: p.sel, count: p.count}
	n := pickChainPrefix + keyKind(p.nodePort) + "-" + p.proto + "-" + a.code()
	if p.affinity > 0 {
		n += "-aff" + strconv.Itoa(p.affinity)
	}
	return n
}

// shapeKey names a shape chain: what every source class gets at a
// destination. Every destination with the same shape shares the chain.
type shapeKey struct {
	nodePort bool
	proto    string
	classes  [3]classAction // by proxy.SourceClass
	affinity int
}

func (s shapeKey) name() string {
	n := shapeChainPrefix + keyKind(s.nodePort) + "-" + s.proto + "-" +
		s.classes[proxy.SourcePod].code() + "." + s.classes[proxy.SourceNode].code() + "." + s.classes[proxy.SourceOther].code()
	if s.affinity > 0 {
		n += "-aff" + strconv.Itoa(s.affinity)
	}
	return n
}

func (s shapeKey) pick(a classAction) pickKey {
	return pickKey{nodePort: s.nodePort, proto: s.proto, sel: a.sel, count: a.count, affinity: s.affinity}
}

// delivers reports whether some class is delivered.
func (s shapeKey) delivers() bool {
	for _, a := range s.classes {
		if a.deliver {
			return true
		}
	}
	return false
}

// shapeChain renders a shape chain: the pods' and the node's rules where
// their action differs from everyone else's (tested in that order), then
// everyone else's.
func (l *layout) shapeChain(s shapeKey) (*chainDef, error) {
	other := s.classes[proxy.SourceOther]
	var rules []string
	for _, c := range []proxy.SourceClass{proxy.SourcePod, proxy.SourceNode} {
		a := s.classes[c]
		if a == other {
			continue
		}
		var match string
		switch c {
		case proxy.SourcePod:
			if !l.clusterCIDR.IsValid() {
				return nil, fmt.Errorf("shape %s tells pods apart without a cluster CIDR", s.name())
			}
			match = l.fam.ip + " saddr " + l.clusterCIDR.String()
		case proxy.SourceNode:
			match = "fib saddr type local"
		}
		rules = append(rules, match+" "+l.action(s, a))
	}
	if other.deliver {
		rules = append(rules, l.action(s, other))
	}
	return &chainDef{name: s.name(), table: "nat", rules: rules}, nil
}

// action is the statement of one class in a shape chain.
func (l *layout) action(s shapeKey, a classAction) string {
	if !a.deliver {
		return "return"
	}
	out := "goto " + s.pick(a).name()
	if a.masq {
		out = "meta mark set meta mark | " + l.masqMark + " " + out
	}
	return out
}

// pickChain renders an endpoint-picking chain. Slots are looked up in the
// protocol's endpoints map, keyed by the packet's destination (address and
// port, or the node port alone) and the slot number.
//
// Without affinity it is one rule: a random slot. With affinity, a
// client's earlier choice is a (client, destination, slot) entry of the
// protocol's affinity set: one rule per slot finds it and refreshes it,
// then one rule per slot picks at random (1/n, 1/(n-1), ... as iptables'
// statistic rules do) and records the choice. Entries hold slots, not
// endpoints, so an endpoint that leaves the list leaves no client pinned
// to it (its slot goes to another endpoint or away); slots are stable
// (slots.go), so the other clients keep their endpoint.
func (l *layout) pickChain(p pickKey) *chainDef {
	ip := l.fam.ip
	epMap, epKey := endpointsMap(p.proto), ip+" daddr . "+p.proto+" dport"
	if p.nodePort {
		epMap, epKey = nodePortEndpointsMap(p.proto), p.proto+" dport"
	}
	base := 0
	if p.sel == proxy.SelectLocal {
		base = localSlotBase
	}
	dnat := func(slot string) string {
		return "dnat " + ip + " to " + epKey + " . " + slot + " map @" + epMap
	}
	c := &chainDef{name: p.name(), table: "nat"}
	if p.affinity == 0 {
		slot := "numgen random mod " + strconv.Itoa(p.count)
		if base != 0 {
			slot += " offset " + strconv.Itoa(base)
		}
		c.rules = []string{dnat(slot)}
		return c
	}
	aff := affinitySet(p.proto)
	constant := func(i int) string {
		s := "numgen inc mod 1"
		if base+i != 0 {
			s += " offset " + strconv.Itoa(base+i)
		}
		return s
	}
	affKey := func(i int) string {
		return ip + " saddr . " + ip + " daddr . " + p.proto + " dport . " + constant(i)
	}
	update := func(i int) string {
		return "update @" + aff + " { " + affKey(i) + " timeout " + strconv.Itoa(p.affinity) + "s }"
	}
	for i := 0; i < p.count; i++ {
		c.rules = append(c.rules, affKey(i)+" @"+aff+" "+update(i)+" "+dnat(constant(i)))
	}
	for i := 0; i < p.count; i++ {
		r := update(i) + " " + dnat(constant(i))
		if left := p.count - i; left > 1 {
			r = "numgen random mod " + strconv.Itoa(left) + " == 0 " + r
		}
		c.rules = append(c.rules, r)
	}
	return c
}

// hostString writes an address for a map key or value.
func hostString(a netip.Addr) string { return a.Unmap().String() }
