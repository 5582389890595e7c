// Package nftablestest traces packets through the state of a
// knftables.Fake: it evaluates the first packet of a new connection through
// the base chains of the Fake's table in netfilter order and reports every
// possible outcome (DNAT target, masquerade, verdict).
//
// It understands exactly the nft syntax kproxy's nftables backend writes
// (proxier/nftables) and fails on anything else, so a renderer change
// that it cannot evaluate is noticed rather than misread. Besides the
// tests, `kproxy trace` (proxier/trace) walks the node's live table with it.
package nftablestest

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"
)

// Packet is the first packet of a new connection.
type Packet struct {
	Source, Destination         netip.Addr
	Protocol                    string // "tcp", "udp" or "sctp"
	SourcePort, DestinationPort int
	// Local: a process of the node sends it (output path); otherwise it
	// arrives on one of the node's interfaces.
	Local bool
}

// Options are the parts of the node that the table does not hold.
type Options struct {
	// LocalAddrs are the node's addresses ("fib ... type local", routing);
	// loopback addresses are always local.
	LocalAddrs []netip.Addr
	// Sets are the contents of dynamic sets (filled by the packet path in
	// a real kernel), by set name: each entry a key as the table writes
	// it, components joined by " . ".
	Sets map[string][]string
	// RecordPath fills Outcome.Path. Outcomes that differ only in their
	// path are then reported separately.
	RecordPath bool
}

// Step is one rule a traced packet matched (a rule that acted on it), or
// one element a rule found for it in a map, in the order met.
type Step struct {
	// Chain and Rule (1-based) locate the rule; Text is the rule.
	Chain string
	Rule  int
	Text  string
	// Map is set for an element found in that map: its key, value and
	// comment.
	Map        string
	Key, Value []string
	Comment    string
}

// Outcome is one way the packet can end.
type Outcome struct {
	// Verdict is "accept", "drop" or "reject".
	Verdict string
	// DNAT is the destination it was DNATed to ("ip:port", "[ip]:port"),
	// "" without DNAT.
	DNAT       string
	Masquerade bool
	Mark       uint32
	// Updates are the dynamic set entries the packet added or refreshed,
	// "set { key }", sorted.
	Updates string
	// Path is what the packet met, with Options.RecordPath.
	Path []Step
}

// maxDepth bounds jumps (a loop in the ruleset).
const maxDepth = 32

// Trace evaluates p through fake's table (the Fake's default family and
// table) and returns every possible outcome, deduplicated. Hooks run in
// netfilter order, base chains of one hook by priority:
//
//   - from the network: prerouting; then input when the destination
//     (after DNAT) is local, else forward and postrouting;
//   - local: output, postrouting; then, when the destination is local,
//     delivery over loopback: prerouting and input without their nat
//     chains (the connection's NAT was set up on output).
func Trace(fake *knftables.Fake, p Packet, opts Options) ([]Outcome, error) {
	fake.RLock()
	defer fake.RUnlock()
	if fake.Table == nil {
		return nil, fmt.Errorf("the fake has no table")
	}
	t := &tracer{table: fake.Table, family: fake.Table.Family, opts: opts, parsed: map[*knftables.Rule][]stmt{},
		index: map[string]*setIndex{}}
	if t.family == "" {
		// Objects of a Fake with a default table carry no family.
		t.family = knftables.IPv4Family
		if p.Destination.Is6() {
			t.family = knftables.IPv6Family
		}
	}
	if err := t.checkPacket(p); err != nil {
		return nil, err
	}
	start := world{src: p.Source, dst: p.Destination, proto: p.Protocol, sport: p.SourcePort, dport: p.DestinationPort}
	var done []result
	run := func(ws []world, hook knftables.BaseChainHook, skipNAT bool) ([]world, error) {
		next, ended, err := t.hook(ws, hook, skipNAT)
		done = append(done, ended...)
		return next, err
	}
	var final []world
	ws := []world{start}
	var err error
	if !p.Local {
		if ws, err = run(ws, knftables.PreroutingHook, false); err != nil {
			return nil, err
		}
		for _, w := range ws {
			var out []world
			if t.isLocal(w.dst) {
				out, err = run([]world{w}, knftables.InputHook, false)
			} else if out, err = run([]world{w}, knftables.ForwardHook, false); err == nil {
				out, err = run(out, knftables.PostroutingHook, false)
			}
			if err != nil {
				return nil, err
			}
			final = append(final, out...)
		}
	} else {
		if ws, err = run(ws, knftables.OutputHook, false); err != nil {
			return nil, err
		}
		if ws, err = run(ws, knftables.PostroutingHook, false); err != nil {
			return nil, err
		}
		for _, w := range ws {
			out := []world{w}
			if t.isLocal(w.dst) {
				if out, err = run(out, knftables.PreroutingHook, true); err == nil {
					out, err = run(out, knftables.InputHook, true)
				}
				if err != nil {
					return nil, err
				}
			}
			final = append(final, out...)
		}
	}
	for _, w := range final {
		done = append(done, result{w: w, verdict: "accept"})
	}
	var outs []Outcome
	type outcomeKey struct {
		verdict, dnat, updates string
		masq                   bool
		mark                   uint32
		path                   int
	}
	seen := map[outcomeKey]bool{}
	for _, r := range done {
		o := Outcome{Verdict: r.verdict, Masquerade: r.w.masq, Mark: r.w.mark, Updates: r.w.updates}
		if r.w.dnatted {
			o.DNAT = netip.AddrPortFrom(r.w.dst, uint16(r.w.dport)).String()
		}
		if k := (outcomeKey{o.Verdict, o.DNAT, o.Updates, o.Masquerade, o.Mark, r.w.path}); !seen[k] {
			seen[k] = true
			o.Path = t.path(r.w.path)
			outs = append(outs, o)
		}
	}
	sort.Slice(outs, func(i, j int) bool { return fmt.Sprint(outs[i]) < fmt.Sprint(outs[j]) })
	return outs, nil
}

type tracer struct {
	table  *knftables.FakeTable
	family knftables.Family
	opts   Options
	parsed map[*knftables.Rule][]stmt
	index  map[string]*setIndex
	// steps hold the recorded paths (Options.RecordPath) as linked lists:
	// world.path is the index of its last step plus one (0: none).
	steps []pathNode
	// cur is the rule being evaluated, and occ counts rule evaluations
	// (so that a rule acting twice is recorded once).
	cur Step
	occ int
}

type pathNode struct {
	parent int
	occ    int
	step   Step
}

// record appends s (the current rule when s is nil) to w's path.
func (t *tracer) record(w world, s *Step) world {
	if !t.opts.RecordPath {
		return w
	}
	if s == nil {
		if w.path > 0 && t.steps[w.path-1].occ == t.occ {
			return w
		}
		s = &t.cur
	}
	t.steps = append(t.steps, pathNode{parent: w.path, occ: t.occ, step: *s})
	w.path = len(t.steps)
	return w
}

// path lists the steps ending at p, first first.
func (t *tracer) path(p int) []Step {
	var out []Step
	for ; p > 0; p = t.steps[p-1].parent {
		out = append(out, t.steps[p-1].step)
	}
	slices.Reverse(out)
	return out
}

// world is the packet and what happened to it; comparable, so that
// identical worlds merge.
type world struct {
	src, dst     netip.Addr
	proto        string
	sport, dport int
	mark         uint32
	dnatted      bool
	masq         bool
	updates      string
	path         int // see tracer.steps
}

// result is a world that left a chain: verdict "" means it returned.
type result struct {
	w       world
	verdict string
}

func (t *tracer) checkPacket(p Packet) error {
	v6 := t.family == knftables.IPv6Family
	for _, a := range []netip.Addr{p.Source, p.Destination} {
		if !a.IsValid() || a.Is4In6() || a.Is6() != v6 || a.Zone() != "" {
			return fmt.Errorf("packet address %v is not a plain %s address", a, t.family)
		}
	}
	switch p.Protocol {
	case "tcp", "udp", "sctp":
	default:
		return fmt.Errorf("packet protocol %q is not tcp, udp or sctp", p.Protocol)
	}
	for _, port := range []int{p.SourcePort, p.DestinationPort} {
		if port < 1 || port > 65535 {
			return fmt.Errorf("packet port %d out of range", port)
		}
	}
	return nil
}

func (t *tracer) isLocal(a netip.Addr) bool {
	return a.IsLoopback() || slices.Contains(t.opts.LocalAddrs, a)
}

// hook runs the base chains of hook in priority order: worlds accepted by
// every chain continue; the others end.
func (t *tracer) hook(ws []world, hook knftables.BaseChainHook, skipNAT bool) ([]world, []result, error) {
	type base struct {
		name string
		prio int
	}
	var chains []base
	for name, c := range t.table.Chains {
		if c.Hook == nil || *c.Hook != hook {
			continue
		}
		if skipNAT && c.Type != nil && *c.Type == knftables.NATType {
			continue
		}
		prio, err := knftables.ParsePriority(t.family, string(*c.Priority))
		if err != nil {
			return nil, nil, fmt.Errorf("chain %s: %w", name, err)
		}
		if c.Policy != nil && *c.Policy != knftables.AcceptPolicy {
			return nil, nil, fmt.Errorf("chain %s: policy %s not supported", name, *c.Policy)
		}
		chains = append(chains, base{name, prio})
	}
	sort.Slice(chains, func(i, j int) bool {
		if chains[i].prio != chains[j].prio {
			return chains[i].prio < chains[j].prio
		}
		return chains[i].name < chains[j].name
	})
	var ended []result
	for _, c := range chains {
		var next []world
		for _, w := range ws {
			rs, err := t.chain(w, c.name, 0)
			if err != nil {
				return nil, nil, err
			}
			for _, r := range rs {
				switch r.verdict {
				case "", "accept":
					next = append(next, r.w)
				default:
					ended = append(ended, r)
				}
			}
		}
		ws = dedupWorlds(next)
	}
	return ws, ended, nil
}

func dedupWorlds(ws []world) []world {
	seen := map[world]bool{}
	out := ws[:0]
	for _, w := range ws {
		if !seen[w] {
			seen[w] = true
			out = append(out, w)
		}
	}
	return out
}

// chain evaluates a chain; results with verdict "" returned from it.
func (t *tracer) chain(w world, name string, depth int) ([]result, error) {
	if depth > maxDepth {
		return nil, fmt.Errorf("jumps nest deeper than %d at chain %s: loop in the ruleset", maxDepth, name)
	}
	c := t.table.Chains[name]
	if c == nil {
		return nil, fmt.Errorf("no chain %q", name)
	}
	var out []result
	worlds := []world{w}
	for i, r := range c.Rules {
		stmts, ok := t.parsed[r]
		if !ok {
			var err error
			if stmts, err = parseRule(r.Rule, t.family); err != nil {
				return nil, fmt.Errorf("chain %s rule %d %q: %w", name, i+1, r.Rule, err)
			}
			t.parsed[r] = stmts
		}
		var next []world
		for _, w := range worlds {
			t.occ++
			t.cur = Step{Chain: name, Rule: i + 1, Text: r.Rule}
			steps, err := t.stmts(w, stmts, depth)
			if err != nil {
				return nil, fmt.Errorf("chain %s rule %d %q: %w", name, i+1, r.Rule, err)
			}
			for _, s := range steps {
				switch s.verdict {
				case "", "continue":
					next = append(next, s.w)
				case "return":
					out = append(out, result{w: s.w})
				default:
					out = append(out, result{w: s.w, verdict: s.verdict})
				}
			}
		}
		worlds = dedupWorlds(next)
	}
	for _, w := range worlds {
		out = append(out, result{w: w})
	}
	return out, nil
}

// step is a world after a rule: verdict "" goes on to the next rule.
type step struct {
	w       world
	verdict string
}

// stmts evaluates a rule's statements in order.
func (t *tracer) stmts(w world, stmts []stmt, depth int) ([]step, error) {
	if len(stmts) == 0 {
		return []step{{w: w}}, nil
	}
	branches, err := stmts[0].eval(t, w, depth)
	if err != nil {
		return nil, err
	}
	var out []step
	for _, b := range branches {
		if !b.cont {
			out = append(out, step{w: b.w, verdict: b.verdict})
			continue
		}
		rest, err := t.stmts(b.w, stmts[1:], depth)
		if err != nil {
			return nil, err
		}
		out = append(out, rest...)
	}
	return out, nil
}

// branch is a world after one statement: cont goes on to the next
// statement; otherwise the rule ends with verdict ("" for a mismatch).
type branch struct {
	w       world
	cont    bool
	verdict string
}

// verdict applies a verdict statement: jumps and gotos run their chain.
func (t *tracer) verdict(w world, v string, depth int) ([]branch, error) {
	w = t.record(w, nil)
	f := strings.Fields(v)
	switch {
	case len(f) == 1 && (f[0] == "accept" || f[0] == "drop" || f[0] == "reject" || f[0] == "return" || f[0] == "continue"):
		return []branch{{w: w, verdict: f[0]}}, nil
	case len(f) == 2 && (f[0] == "jump" || f[0] == "goto"):
		rs, err := t.chain(w, f[1], depth+1)
		if err != nil {
			return nil, err
		}
		var out []branch
		for _, r := range rs {
			switch {
			case r.verdict != "":
				out = append(out, branch{w: r.w, verdict: r.verdict})
			case f[0] == "jump":
				out = append(out, branch{w: r.w, verdict: "continue"})
			default:
				out = append(out, branch{w: r.w, verdict: "return"})
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("unsupported verdict %q", v)
}

// setIndex is a set or map ready for lookups.
type setIndex struct {
	exact map[string]*knftables.Element // by joined key
	// ranged holds elements with a prefix in their key.
	ranged []*knftables.Element
	isMap  bool
}

func (t *tracer) set(name string) (*setIndex, error) {
	if s, ok := t.index[name]; ok {
		return s, nil
	}
	s := &setIndex{exact: map[string]*knftables.Element{}}
	var elems []*knftables.Element
	if fs, ok := t.table.Sets[name]; ok {
		elems = fs.Elements
		if slices.Contains(fs.Flags, knftables.DynamicFlag) {
			for _, k := range t.opts.Sets[name] {
				elems = append(elems, &knftables.Element{Set: name, Key: strings.Split(k, " . ")})
			}
		}
	} else if fm, ok := t.table.Maps[name]; ok {
		elems, s.isMap = fm.Elements, true
	} else {
		return nil, fmt.Errorf("no set or map %q", name)
	}
	for _, e := range elems {
		if slices.ContainsFunc(e.Key, func(k string) bool { return strings.Contains(k, "/") }) {
			s.ranged = append(s.ranged, e)
			continue
		}
		s.exact[strings.Join(e.Key, " . ")] = e
	}
	t.index[name] = s
	return s, nil
}

// lookup finds key in a set or map.
func (s *setIndex) lookup(key []string) (*knftables.Element, bool) {
	if e, ok := s.exact[strings.Join(key, " . ")]; ok {
		return e, true
	}
	for _, e := range s.ranged {
		if len(e.Key) != len(key) {
			continue
		}
		match := true
		for i, k := range e.Key {
			if !componentMatches(k, key[i]) {
				match = false
				break
			}
		}
		if match {
			return e, true
		}
	}
	return nil, false
}

// componentMatches compares one key component: a prefix contains an
// address, anything else is compared as written.
func componentMatches(pattern, v string) bool {
	if strings.Contains(pattern, "/") {
		p, err1 := netip.ParsePrefix(pattern)
		a, err2 := netip.ParseAddr(v)
		return err1 == nil && err2 == nil && p.Contains(a)
	}
	if pa, err := netip.ParseAddr(pattern); err == nil {
		a, err := netip.ParseAddr(v)
		return err == nil && a == pa
	}
	return pattern == v
}

// formatPort writes a port as nft sets hold it.
func formatPort(p int) string { return strconv.Itoa(p) }
