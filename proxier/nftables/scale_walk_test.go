package nftables

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/proxier/nftables/nftablestest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// walkFirstPacket counts the rules the first packet of a new connection
// evaluates in a memNFT's table (which mirrors what the backend wrote),
// hook by hook in netfilter order, and reports where it went. It is a
// structural count, not a timing: every rule whose evaluation starts counts
// once, in base chains and in the chains they jump or go to.
//
// It evaluates exactly the statements of this backend's rules on the path
// of a packet of a service without session affinity or source ranges, and
// fails on anything else (an affinity "update", an unknown statement), so
// that a layout change it cannot follow is noticed rather than miscounted.
// Set and map lookups are exact (no interval matching). A numgen picks
// slot 0 (plus its offset): the count does not depend on the slot.
// nftablestest.Trace is the reference for outcomes (TestFirstPacketWalk
// compares them); this walk only adds the count.
func walkFirstPacket(m *memNFT, p walkPacket) (*walkResult, error) {
	w := &walker{m: m, p: p, dst: p.dst, dport: p.dport}
	hooks := []string{"prerouting"}
	if p.local {
		hooks = []string{"output", "postrouting"}
	}
	for i := 0; i < len(hooks); i++ {
		if err := w.hook(hooks[i]); err != nil {
			return nil, err
		}
		if w.res.Verdict != "" {
			break
		}
		if hooks[i] == "prerouting" {
			if w.isLocal(w.dst) {
				hooks = append(hooks, "input")
			} else {
				hooks = append(hooks, "forward", "postrouting")
			}
		}
	}
	if w.res.Verdict == "" {
		w.res.Verdict = "accept"
	}
	if w.dnatted {
		w.res.DNAT = netip.AddrPortFrom(w.dst, uint16(w.dport)).String()
	}
	w.res.Masquerade = w.masq
	return &w.res, nil
}

// walkPacket is the first packet of a connection.
type walkPacket struct {
	src, dst netip.Addr
	proto    string // tcp, udp or sctp
	dport    int
	// local: sent by a process of the node (output path); otherwise it
	// arrives from the network (prerouting, then input or forward).
	local     bool
	nodeAddrs []netip.Addr
}

// walkResult is the walk's count and outcome.
type walkResult struct {
	Rules int
	// Chains lists the chains evaluated with their rule counts, in order
	// ("services:1").
	Chains []string
	// Verdict is "accept", "drop" or "reject"; DNAT the destination after
	// DNAT ("" without).
	Verdict    string
	DNAT       string
	Masquerade bool
}

type walker struct {
	m       *memNFT
	p       walkPacket
	dst     netip.Addr
	dport   int
	mark    uint32
	dnatted bool
	masq    bool
	res     walkResult
	depth   int
}

func (w *walker) isLocal(a netip.Addr) bool {
	return a.IsLoopback() || slices.Contains(w.p.nodeAddrs, a)
}

// hook runs the base chains of hook by priority (then name). A drop or a
// reject ends the walk; an accept (or a NAT statement) ends one base chain.
func (w *walker) hook(hook string) error {
	var chains []string
	for name, h := range w.m.hooks {
		if h.hook == hook {
			chains = append(chains, name)
		}
	}
	slices.SortFunc(chains, func(a, b string) int {
		if pa, pb := w.m.hooks[a].priority, w.m.hooks[b].priority; pa != pb {
			return pa - pb
		}
		return strings.Compare(a, b)
	})
	for _, c := range chains {
		v, err := w.chain(c)
		if err != nil {
			return err
		}
		if v == "drop" || v == "reject" {
			w.res.Verdict = v
			return nil
		}
	}
	return nil
}

// chain evaluates a chain: its verdict, "" when the chain returned.
func (w *walker) chain(name string) (string, error) {
	if !w.m.chains[name] {
		return "", fmt.Errorf("no chain %q", name)
	}
	if w.depth++; w.depth > 16 {
		return "", fmt.Errorf("jumps nest deeper than 16 at chain %s", name)
	}
	defer func() { w.depth-- }()
	evaluated, at := 0, len(w.res.Chains)
	w.res.Chains = append(w.res.Chains, name)
	defer func() { w.res.Chains[at] = fmt.Sprintf("%s:%d", name, evaluated) }()
	for i, r := range w.m.rules[name] {
		evaluated++
		w.res.Rules++
		v, err := w.rule(r)
		if err != nil {
			return "", fmt.Errorf("chain %s rule %d %q: %w", name, i+1, r, err)
		}
		switch v {
		case "", "continue":
		case "return":
			return "", nil
		default:
			return v, nil
		}
	}
	return "", nil
}

// rule evaluates one rule: "" when a match failed or the rule ended
// without a verdict, else its verdict.
func (w *walker) rule(r string) (string, error) {
	t := &tokens{f: strings.Fields(r)}
	for !t.done() {
		switch t.peek() {
		case "counter":
			t.next()
		case "accept", "drop", "reject", "return", "continue":
			return t.next(), nil
		case "jump", "goto":
			kind := t.next()
			return w.verdict(kind + " " + t.next())
		case "masquerade":
			t.next()
			if t.peek() == "fully-random" {
				t.next()
			}
			w.masq = true
			return "accept", nil
		case "dnat":
			t.next()
			if t.next() != w.fam() || t.next() != "to" {
				return "", fmt.Errorf("unsupported dnat")
			}
			key, err := w.expr(t)
			if err != nil {
				return "", err
			}
			if t.next() != "map" {
				return "", fmt.Errorf("unsupported dnat")
			}
			v, ok, err := w.lookup(t.next(), key)
			if err != nil || !ok {
				return "", err
			}
			if len(v) != 2 {
				return "", fmt.Errorf("dnat map value %q", v)
			}
			a, err := netip.ParseAddr(v[0])
			if err != nil {
				return "", err
			}
			port, err := strconv.Atoi(v[1])
			if err != nil {
				return "", err
			}
			w.dst, w.dport, w.dnatted = a, port, true
			return "accept", nil
		case "meta":
			if t.at(1) == "mark" && t.at(2) == "set" {
				// meta mark set meta mark (|,^) <mark>
				t.skip(3)
				if t.next() != "meta" || t.next() != "mark" {
					return "", fmt.Errorf("unsupported mark statement")
				}
				op := t.next()
				v, err := strconv.ParseUint(t.next(), 0, 32)
				if err != nil {
					return "", err
				}
				switch op {
				case "|":
					w.mark |= uint32(v)
				case "^":
					w.mark ^= uint32(v)
				default:
					return "", fmt.Errorf("unsupported mark operator %q", op)
				}
				continue
			}
			fallthrough
		default:
			ok, verdict, err := w.match(t)
			if err != nil || !ok || verdict != "" {
				return verdict, err
			}
		}
	}
	return "", nil
}

// match evaluates one relational or lookup statement: whether it matched,
// and the verdict of a verdict map.
func (w *walker) match(t *tokens) (bool, string, error) {
	key, err := w.expr(t)
	if err != nil {
		return false, "", err
	}
	if key == nil {
		// A protocol-specific header of another protocol.
		return false, "", nil
	}
	switch op := t.next(); {
	case op == "vmap":
		v, ok, err := w.lookup(t.next(), key)
		if err != nil || !ok {
			return false, "", err
		}
		verdict, err := w.verdict(strings.Join(v, " "))
		return true, verdict, err
	case strings.HasPrefix(op, "@"):
		_, ok, err := w.lookup(op, key)
		return ok, "", err
	case op == "!=" && strings.HasPrefix(t.peek(), "@"):
		_, ok, err := w.lookup(t.next(), key)
		return !ok, "", err
	case op == "!=":
		eq, err := equal(key, t.next())
		return !eq, "", err
	case op == "&":
		mask, err := strconv.ParseUint(t.next(), 0, 32)
		if err != nil {
			return false, "", err
		}
		if t.next() != "!=" || t.next() != "0" || len(key) != 1 {
			return false, "", fmt.Errorf("unsupported mask test")
		}
		v, err := strconv.ParseUint(key[0], 0, 32)
		return uint32(v)&uint32(mask) != 0, "", err
	case op == "":
		return false, "", fmt.Errorf("expression without a test")
	default:
		eq, err := equal(key, op)
		return eq, "", err
	}
}

// equal compares a value with a constant (a prefix contains an address).
func equal(key []string, c string) (bool, error) {
	if len(key) != 1 {
		return false, fmt.Errorf("comparing a concatenation with %q", c)
	}
	if p, err := netip.ParsePrefix(c); err == nil {
		a, err := netip.ParseAddr(key[0])
		return err == nil && p.Contains(a), nil
	}
	return key[0] == c, nil
}

// verdict runs a verdict ("goto svc-...", "drop").
func (w *walker) verdict(v string) (string, error) {
	f := strings.Fields(v)
	switch {
	case len(f) == 1:
		return f[0], nil
	case len(f) == 2 && f[0] == "jump":
		return w.chain(f[1])
	case len(f) == 2 && f[0] == "goto":
		verdict, err := w.chain(f[1])
		if err != nil || verdict != "" {
			return verdict, err
		}
		return "return", nil
	}
	return "", fmt.Errorf("unsupported verdict %q", v)
}

func (w *walker) fam() string {
	if w.dst.Is6() {
		return "ip6"
	}
	return "ip"
}

// expr reads a value or a concatenation; nil for a header of another
// protocol ("udp dport" of a tcp packet).
func (w *walker) expr(t *tokens) ([]string, error) {
	var out []string
	other := false
	for {
		v, err := w.primary(t)
		if err != nil {
			return nil, err
		}
		if v == nil {
			other = true
		}
		out = append(out, v...)
		if t.peek() != "." {
			break
		}
		t.next()
	}
	if other {
		return nil, nil
	}
	return out, nil
}

func (w *walker) primary(t *tokens) ([]string, error) {
	a, b := t.next(), t.next()
	switch {
	case a == w.fam() && b == "saddr":
		return []string{w.p.src.String()}, nil
	case a == w.fam() && b == "daddr":
		return []string{w.dst.String()}, nil
	case a == "meta" && b == "l4proto":
		return []string{w.p.proto}, nil
	case a == "meta" && b == "mark":
		return []string{strconv.FormatUint(uint64(w.mark), 10)}, nil
	case a == "th" && b == "dport":
		return []string{strconv.Itoa(w.dport)}, nil
	case (a == "tcp" || a == "udp" || a == "sctp") && b == "dport":
		if a != w.p.proto {
			return nil, nil
		}
		return []string{strconv.Itoa(w.dport)}, nil
	case a == "ct" && b == "state":
		return []string{"new"}, nil
	case a == "ct" && b == "status":
		if w.dnatted {
			return []string{"dnat"}, nil
		}
		return []string{""}, nil
	case a == "fib" && (b == "saddr" || b == "daddr") && t.peek() == "type":
		t.next()
		addr := w.p.src
		if b == "daddr" {
			addr = w.dst
		}
		if w.isLocal(addr) {
			return []string{"local"}, nil
		}
		return []string{"unicast"}, nil
	case a == "numgen" && b == "random" && t.peek() == "mod":
		t.skip(2)
		slot := 0
		if t.peek() == "offset" {
			t.next()
			n, err := strconv.Atoi(t.next())
			if err != nil {
				return nil, err
			}
			slot = n
		}
		return []string{strconv.Itoa(slot)}, nil
	}
	return nil, fmt.Errorf("unsupported expression %q", a+" "+b)
}

// lookup finds key in the set or map "@name": the value of a map element.
func (w *walker) lookup(ref string, key []string) ([]string, bool, error) {
	name, ok := strings.CutPrefix(ref, "@")
	if !ok {
		return nil, false, fmt.Errorf("%q is not a set reference", ref)
	}
	set, ok := w.m.sets[name]
	if !ok {
		return nil, false, fmt.Errorf("no set or map %q", name)
	}
	e, ok := set[strings.Join(key, " . ")]
	if !ok {
		return nil, false, nil
	}
	return e.Value, true, nil
}

// tokens reads a rule's words.
type tokens struct {
	f []string
	i int
}

func (t *tokens) done() bool { return t.i >= len(t.f) }
func (t *tokens) peek() string {
	return t.at(0)
}
func (t *tokens) at(k int) string {
	if t.i+k < len(t.f) {
		return t.f[t.i+k]
	}
	return ""
}
func (t *tokens) next() string {
	s := t.peek()
	t.i++
	return s
}
func (t *tokens) skip(n int) { t.i += n }

// mirrorNFT runs every transaction on a knftables.Fake (for the tracer)
// and on a memNFT (for walkFirstPacket).
type mirrorNFT struct {
	*knftables.Fake
	mem *memNFT
}

func (m *mirrorNFT) Run(ctx context.Context, tx *knftables.Transaction) error {
	if err := m.Fake.Run(ctx, tx); err != nil {
		return err
	}
	return m.mem.apply(tx.String())
}

// walkEnv is the node of the walk tests and benchmarks.
func walkEnv() pt.Env {
	return pt.Env{NodeName: "node-a", NodeIPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")},
		ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), Family: v1.IPv4Protocol}
}

// walkFlows are first packets to service i of a ShapedWorkload: its
// ClusterIP from a pod (forwarded), from outside the cluster and from the
// node itself, and its node port from outside when it has one.
func walkFlows(svc *v1.Service) map[string]walkPacket {
	node := walkEnv().NodeIPs
	vip := netip.MustParseAddr(svc.Spec.ClusterIP)
	out := map[string]walkPacket{
		"pod to ClusterIP":     {src: netip.MustParseAddr("10.244.1.9"), dst: vip, proto: "tcp", dport: 80, nodeAddrs: node},
		"outside to ClusterIP": {src: netip.MustParseAddr("192.168.5.5"), dst: vip, proto: "tcp", dport: 80, nodeAddrs: node},
		"node to ClusterIP":    {src: node[0], dst: vip, proto: "tcp", dport: 80, local: true, nodeAddrs: node},
	}
	if np := svc.Spec.Ports[0].NodePort; np != 0 {
		out["outside to node port"] = walkPacket{src: netip.MustParseAddr("192.168.5.5"), dst: node[0], proto: "tcp", dport: int(np), nodeAddrs: node}
	}
	return out
}

// syncedMirror programs a ShapedWorkload into a fresh memNFT (and a Fake
// twin when withFake) through the engine and the backend.
func syncedMirror(t testing.TB, s pt.WorkloadShape, withFake bool) (*memNFT, *knftables.Fake, []*v1.Service) {
	t.Helper()
	svcs, slices := pt.ShapedWorkload(s)
	mem := newMemNFT()
	var nft knftables.Interface = mem
	var fake *knftables.Fake
	if withFake {
		fake = knftables.NewFake(knftables.IPv4Family, TableName)
		nft = &mirrorNFT{Fake: fake, mem: mem}
	}
	b, err := New(Options{NFTables: nft, Family: v1.IPv4Protocol, LocalAddresses: func() ([]netip.Addr, error) { return walkEnv().NodeIPs, nil }})
	if err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, walkEnv(), b, testingclock.NewFakeClock(time.Unix(1_700_000_000, 0)))
	for i := range svcs {
		e.OnServiceAdd(svcs[i])
		e.OnEndpointSliceAdd(slices[i])
	}
	e.OnServiceSynced()
	e.OnEndpointSlicesSynced()
	if err := e.SyncRules(context.Background()); err != nil {
		t.Fatal(err)
	}
	return mem, fake, svcs
}

// TestFirstPacketWalk checks walkFirstPacket's outcomes against
// nftablestest.Trace, and that the rules a first packet evaluates do not
// grow with the services (BenchmarkNFTablesSync reports them at scale).
func TestFirstPacketWalk(t *testing.T) {
	small := pt.WorkloadShape{Services: 200, Endpoints: 3}
	mem, fake, svcs := syncedMirror(t, small, true)
	counts := map[string]int{}
	for _, i := range []int{0, 1, len(svcs) - 1} {
		for name, p := range walkFlows(svcs[i]) {
			t.Run(fmt.Sprintf("%s %d", name, i), func(t *testing.T) {
				got, err := walkFirstPacket(mem, p)
				if err != nil {
					t.Fatal(err)
				}
				outs, err := nftablestest.Trace(fake, nftablestest.Packet{Source: p.src, Destination: p.dst, Protocol: p.proto,
					SourcePort: 40000, DestinationPort: p.dport, Local: p.local}, nftablestest.Options{LocalAddrs: p.nodeAddrs})
				if err != nil {
					t.Fatal(err)
				}
				i := slices.IndexFunc(outs, func(o nftablestest.Outcome) bool { return o.DNAT == got.DNAT })
				if got.DNAT == "" || i < 0 || outs[i].Verdict != got.Verdict || outs[i].Masquerade != got.Masquerade {
					t.Errorf("walk: %+v; tracer: %+v", got, outs)
				}
				if c, ok := counts[name]; ok && c != got.Rules {
					t.Errorf("%d rules (%v), another service's %d", got.Rules, got.Chains, c)
				}
				counts[name] = got.Rules
			})
		}
	}
	// Ten times the services: the same counts.
	mem, _, svcs = syncedMirror(t, pt.WorkloadShape{Services: 2000, Endpoints: 3}, false)
	for name, p := range walkFlows(svcs[len(svcs)-10]) {
		got, err := walkFirstPacket(mem, p)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got.Rules != counts[name] {
			t.Errorf("%s: %d rules at 2,000 services (%v), %d at 200", name, got.Rules, got.Chains, counts[name])
		}
		t.Logf("%s: %d rules: %s", name, got.Rules, strings.Join(got.Chains, " "))
	}
}

// TestShapedWorkload checks what the benchmarks rely on: distinct
// ClusterIPs and endpoint addresses at the largest shapes.
func TestShapedWorkload(t *testing.T) {
	shapes, err := pt.ParseWorkloadShapes("45000x1, 5000x50 30000")
	if err != nil {
		t.Fatal(err)
	}
	if want := []pt.WorkloadShape{{Services: 45000, Endpoints: 1}, {Services: 5000, Endpoints: 50}, {Services: 30000, Endpoints: 10}}; !slices.Equal(shapes, want) {
		t.Fatalf("ParseWorkloadShapes = %v, want %v", shapes, want)
	}
	for _, bad := range []string{"10x", "x10", "0x1", "10x0", "ten"} {
		if _, err := pt.ParseWorkloadShapes(bad); err == nil {
			t.Errorf("ParseWorkloadShapes(%q) accepted", bad)
		}
	}
	for _, s := range shapes {
		svcs, sls := pt.ShapedWorkload(s)
		vips, eps := map[string]bool{}, map[string]bool{}
		for i := range svcs {
			vips[svcs[i].Spec.ClusterIP] = true
			for _, ep := range sls[i].Endpoints {
				eps[ep.Addresses[0]] = true
			}
		}
		if len(vips) != s.Services || len(eps) != s.Services*s.Endpoints {
			t.Errorf("%v: %d distinct ClusterIPs, %d distinct endpoints", s, len(vips), len(eps))
		}
	}
}
