package iptablestest

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/kproxy/kproxy/pkg/iptables"
)

// This file is the packet tracer: it walks the Fake's ruleset for the first
// packet of a new connection, in netfilter order, and reports every outcome
// the ruleset can produce for it (random statistic matches are explored both
// ways).

// Origin says where a traced packet comes from.
type Origin int

const (
	// OriginExternal packets arrive on an interface (PREROUTING).
	OriginExternal Origin = iota
	// OriginLocal packets come from a process on the node (OUTPUT).
	OriginLocal
)

func (o Origin) String() string {
	switch o {
	case OriginExternal:
		return "external"
	case OriginLocal:
		return "local"
	}
	return "Origin(" + strconv.Itoa(int(o)) + ")"
}

// Packet is the first packet of a connection.
type Packet struct {
	Source, Destination         netip.Addr
	Protocol                    string // "tcp", "udp" or "sctp"
	SourcePort, DestinationPort int
	// InInterface is the interface an external packet arrives on.
	InInterface string
	Origin      Origin
}

// TraceOptions is the node state the ruleset is evaluated against.
type TraceOptions struct {
	// LocalAddrs are the node's own addresses: they match addrtype LOCAL and
	// packets to them are delivered locally (INPUT). Loopback addresses are
	// always local.
	LocalAddrs []netip.Addr
	// Recent holds the contents of -m recent lists by name: --rcheck and
	// --update match when the (masked) source is listed.
	Recent map[string][]netip.Addr
	// IPSets holds ipset contents for -m set: entries "ip", "cidr",
	// "ip,proto:port" or "ip,port" (tcp).
	IPSets map[string][]string
}

// Outcome is one way the ruleset can treat a packet.
type Outcome struct {
	Verdict    string // "ACCEPT", "DROP" or "REJECT"
	DNAT       string // "ip:port" after DNAT ("" if none)
	Masquerade bool   // MASQUERADE reached in nat POSTROUTING
	Mark       uint32 // final packet mark
	RecentSet  []string
	// Path lists the matched rules as "table/chain#n" (n is 1-based).
	Path []string
	// RulesEvaluated counts rules evaluated on this path, in all tables.
	RulesEvaluated int
}

// Endpoints returns the sorted, unique DNAT destinations of the ACCEPTed
// outcomes.
func Endpoints(outcomes []Outcome) []string {
	var eps []string
	for _, o := range outcomes {
		if o.Verdict == "ACCEPT" && o.DNAT != "" {
			eps = append(eps, o.DNAT)
		}
	}
	slices.Sort(eps)
	return slices.Compact(eps)
}

// Trace limits.
const (
	// maxTraceDepth bounds nested jumps; deeper means a loop.
	maxTraceDepth = 64
	// maxTraceWorlds bounds the number of simultaneously explored branches.
	maxTraceWorlds = 1 << 14
)

type recentEntry struct {
	name string
	addr netip.Addr
}

// traceState is one world: the packet as rewritten so far and its history.
type traceState struct {
	dst        netip.Addr
	dport      int
	mark       uint32
	dnat       string
	masquerade bool
	recentSet  []string
	recentAdds []recentEntry
	path       []string
	evaluated  int
	inIface    string
}

func (s traceState) withPath(p string) traceState {
	s.path = append(s.path[:len(s.path):len(s.path)], p)
	return s
}

type tracer struct {
	f    *Fake
	pkt  Packet
	opts TraceOptions
	// hook is the built-in chain being traversed.
	hook iptables.Chain
}

// result is a world after a chain: verdict "" means it returned to the
// caller.
type result struct {
	st      traceState
	verdict string
}

// Trace evaluates the ruleset for the first packet of a new connection and
// returns every possible outcome (both sides of each random statistic
// match), deduplicated ignoring Path and RulesEvaluated. Chains run in
// netfilter order:
//
//   - OriginLocal: mangle, nat, filter OUTPUT; mangle, nat POSTROUTING; and
//     when the destination (after DNAT) is local, delivery over lo: mangle
//     PREROUTING, mangle and filter INPUT (in-interface "lo").
//   - OriginExternal: mangle, nat PREROUTING; then, when the destination
//     after DNAT is local, mangle, filter, nat INPUT; otherwise mangle,
//     filter FORWARD and mangle, nat POSTROUTING.
//
// A DROP or REJECT ends the walk. Constructs the tracer cannot evaluate
// (-o, SNAT, CONNMARK, addrtype other than LOCAL, ...) are errors, as are
// jumps nesting deeper than maxTraceDepth (a loop).
func (f *Fake) Trace(p Packet, opts TraceOptions) ([]Outcome, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.checkPacket(p); err != nil {
		return nil, err
	}
	tr := &tracer{f: f, pkt: p, opts: opts}
	start := traceState{dst: p.Destination, dport: p.DestinationPort}
	type stage struct {
		table iptables.Table
		chain iptables.Chain
	}
	run := func(states []traceState, stages []stage, done *[]result) ([]traceState, error) {
		for _, sg := range stages {
			var next []traceState
			for _, st := range states {
				rs, err := tr.hookChain(st, sg.table, sg.chain)
				if err != nil {
					return nil, err
				}
				for _, r := range rs {
					if r.verdict == "ACCEPT" {
						next = append(next, r.st)
					} else {
						*done = append(*done, r)
					}
				}
			}
			states = next
		}
		return states, nil
	}
	var done []result
	var err error
	states := []traceState{start}
	inputStages := []stage{{iptables.TableMangle, iptables.ChainInput}, {iptables.TableFilter, iptables.ChainInput}, {iptables.TableNAT, iptables.ChainInput}}
	switch p.Origin {
	case OriginLocal:
		states, err = run(states, []stage{
			{iptables.TableMangle, iptables.ChainOutput}, {iptables.TableNAT, iptables.ChainOutput}, {iptables.TableFilter, iptables.ChainOutput},
			{iptables.TableMangle, iptables.ChainPostrouting}, {iptables.TableNAT, iptables.ChainPostrouting},
		}, &done)
		if err != nil {
			return nil, err
		}
		// Local delivery over loopback: the nat INPUT chain is not consulted
		// for a connection whose NAT was set up on output.
		inputStages = []stage{{iptables.TableMangle, iptables.ChainPrerouting}, {iptables.TableMangle, iptables.ChainInput}, {iptables.TableFilter, iptables.ChainInput}}
		for i := range states {
			states[i].inIface = "lo"
		}
	case OriginExternal:
		for i := range states {
			states[i].inIface = p.InInterface
		}
		states, err = run(states, []stage{{iptables.TableMangle, iptables.ChainPrerouting}, {iptables.TableNAT, iptables.ChainPrerouting}}, &done)
		if err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("unknown packet origin %d", p.Origin)
	}
	for _, st := range states {
		var final []traceState
		if tr.isLocal(st.dst) {
			final, err = run([]traceState{st}, inputStages, &done)
		} else if p.Origin == OriginExternal {
			final, err = run([]traceState{st}, []stage{
				{iptables.TableMangle, iptables.ChainForward}, {iptables.TableFilter, iptables.ChainForward},
				{iptables.TableMangle, iptables.ChainPostrouting}, {iptables.TableNAT, iptables.ChainPostrouting},
			}, &done)
		} else {
			final = []traceState{st}
		}
		if err != nil {
			return nil, err
		}
		for _, s := range final {
			done = append(done, result{st: s, verdict: "ACCEPT"})
		}
	}

	var outcomes []Outcome
	seen := map[string]bool{}
	for _, r := range done {
		o := Outcome{
			Verdict:        r.verdict,
			DNAT:           r.st.dnat,
			Masquerade:     r.st.masquerade,
			Mark:           r.st.mark,
			RecentSet:      r.st.recentSet,
			Path:           r.st.path,
			RulesEvaluated: r.st.evaluated,
		}
		key := fmt.Sprintf("%s|%s|%t|%d|%s", o.Verdict, o.DNAT, o.Masquerade, o.Mark, strings.Join(o.RecentSet, ","))
		if seen[key] {
			continue
		}
		seen[key] = true
		outcomes = append(outcomes, o)
	}
	return outcomes, nil
}

func (f *Fake) checkPacket(p Packet) error {
	v6 := f.protocol == iptables.ProtocolIPv6
	for _, a := range []netip.Addr{p.Source, p.Destination} {
		if !a.IsValid() || a.Is4In6() || a.Is6() != v6 || a.Zone() != "" {
			return fmt.Errorf("packet address %v is not a plain %s address", a, f.protocol)
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
	if p.Origin == OriginLocal && p.InInterface != "" {
		return fmt.Errorf("a local packet has no input interface")
	}
	return nil
}

func (tr *tracer) isLocal(a netip.Addr) bool {
	return a.IsLoopback() || slices.Contains(tr.opts.LocalAddrs, a)
}

// hookChain traverses a built-in chain; worlds ending without a verdict get
// the chain's policy.
func (tr *tracer) hookChain(st traceState, table iptables.Table, chain iptables.Chain) ([]result, error) {
	t := tr.f.tables[table]
	c := t.chains[chain]
	tr.hook = chain
	rs, err := tr.chain(st, t, c, 0)
	if err != nil {
		return nil, err
	}
	for i := range rs {
		if rs[i].verdict == "" {
			rs[i].verdict = c.policy
		}
	}
	return rs, nil
}

// chain evaluates c's rules for st at jump depth depth.
func (tr *tracer) chain(st traceState, t *fakeTable, c *fakeChain, depth int) ([]result, error) {
	if depth > maxTraceDepth {
		return nil, fmt.Errorf("jumps nest deeper than %d at %s/%s: loop in the ruleset", maxTraceDepth, t.name, c.name)
	}
	var out []result
	worlds := []traceState{st}
	for i, fr := range c.rules {
		if len(worlds) == 0 {
			break
		}
		where := func() string { return string(t.name) + "/" + string(c.name) + "#" + strconv.Itoa(i+1) }
		var next []traceState
		for _, w := range worlds {
			w.evaluated++
			branches, err := tr.match(w, fr.rule)
			if err != nil {
				return nil, locate(err, where(), fr.rule)
			}
			for _, b := range branches {
				if !b.matched {
					next = append(next, b.st)
					continue
				}
				rs, err := tr.target(b.st.withPath(where()), t, fr.rule.Target, depth)
				if err != nil {
					return nil, locate(err, where(), fr.rule)
				}
				for _, r := range rs {
					switch r.verdict {
					case "":
						next = append(next, r.st)
					case "RETURN":
						out = append(out, result{st: r.st})
					default:
						out = append(out, r)
					}
				}
			}
			if len(next)+len(out) > maxTraceWorlds {
				return nil, locate(fmt.Errorf("more than %d branches", maxTraceWorlds), where(), fr.rule)
			}
		}
		worlds = dedupeWorlds(next)
	}
	for _, w := range worlds {
		out = append(out, result{st: w})
	}
	return out, nil
}

// traceError names the rule where tracing failed.
type traceError struct {
	where string
	rule  string
	err   error
}

func (e *traceError) Error() string { return fmt.Sprintf("%s (%s): %v", e.where, e.rule, e.err) }
func (e *traceError) Unwrap() error { return e.err }

// locate attributes err to a rule unless a nested rule already claimed it.
func locate(err error, where string, r *Rule) error {
	if _, ok := err.(*traceError); ok {
		return err
	}
	return &traceError{where: where, rule: r.String(), err: err}
}

// dedupeWorlds drops worlds that differ only in Path and RulesEvaluated
// (keeping the first), so that branches which converge stop multiplying.
func dedupeWorlds(worlds []traceState) []traceState {
	if len(worlds) < 2 {
		return worlds
	}
	seen := make(map[string]bool, len(worlds))
	out := worlds[:0:0]
	for _, w := range worlds {
		key := fmt.Sprintf("%v|%d|%d|%s|%t|%q|%v|%s", w.dst, w.dport, w.mark, w.dnat, w.masquerade, w.recentSet, w.recentAdds, w.inIface)
		if !seen[key] {
			seen[key] = true
			out = append(out, w)
		}
	}
	return out
}

// target applies a matched rule's target. Verdicts: "" continue with the
// next rule, "RETURN" return from this chain, else final for the hook.
func (tr *tracer) target(st traceState, t *fakeTable, tg *Target, depth int) ([]result, error) {
	if tg == nil {
		return []result{{st: st}}, nil
	}
	if tg.Chain {
		sub, ok := t.chains[iptables.Chain(tg.Name)]
		if !ok {
			return nil, fmt.Errorf("chain %s does not exist", tg.Name)
		}
		rs, err := tr.chain(st, t, sub, depth+1)
		if err != nil {
			return nil, err
		}
		if tg.Goto {
			// Falling off (or RETURN from) a goto'd chain returns from the
			// chain that did the goto.
			for i := range rs {
				if rs[i].verdict == "" {
					rs[i].verdict = "RETURN"
				}
			}
		}
		return rs, nil
	}
	if allowed, ok := targetHooks[tg.Name]; ok && allowed&hookBits[tr.hook] == 0 {
		return nil, fmt.Errorf("target %s reached from %s", tg.Name, tr.hook)
	}
	switch tg.Name {
	case "ACCEPT", "DROP", "REJECT", "RETURN":
		return []result{{st: st, verdict: tg.Name}}, nil
	case "DNAT":
		n := tg.NAT
		if n.FirstPort != n.LastPort {
			return nil, fmt.Errorf("DNAT to a port range is not supported by the tracer")
		}
		if n.Addr.IsValid() {
			st.dst = n.Addr
		}
		if n.FirstPort != 0 {
			st.dport = n.FirstPort
		}
		st.dnat = netip.AddrPortFrom(st.dst, uint16(st.dport)).String()
		return []result{{st: st, verdict: "ACCEPT"}}, nil
	case "MASQUERADE":
		st.masquerade = true
		return []result{{st: st, verdict: "ACCEPT"}}, nil
	case "MARK":
		st.mark = tg.Mark.Apply(st.mark)
		return []result{{st: st}}, nil
	case "LOG":
		return []result{{st: st}}, nil
	}
	return nil, fmt.Errorf("target %s is not supported by the tracer", tg.Name)
}

type branch struct {
	st      traceState
	matched bool
}

// match evaluates r's criteria in order; random statistic matches split the
// world in two.
func (tr *tracer) match(st traceState, r *Rule) ([]branch, error) {
	p := tr.pkt
	fixed := true
	if r.Source != nil {
		fixed = fixed && r.Source.Contains(p.Source)
	}
	if r.Destination != nil {
		fixed = fixed && r.Destination.Contains(st.dst)
	}
	if r.Protocol != nil {
		fixed = fixed && (r.Protocol.Name == p.Protocol) != r.Protocol.Negate
	}
	if r.InInterface != nil {
		fixed = fixed && r.InInterface.Matches(st.inIface)
	}
	if r.OutInterface != nil {
		return nil, fmt.Errorf("-o is not supported by the tracer (it does not model routing)")
	}
	if !fixed {
		return []branch{{st: st}}, nil
	}
	live := []traceState{st}
	var failed []branch
	for _, m := range r.Matches {
		var next []traceState
		for _, w := range live {
			ok, alt, split, err := tr.matchOne(&w, m)
			if err != nil {
				return nil, err
			}
			if split {
				next = append(next, w)
				failed = append(failed, branch{st: alt})
				continue
			}
			if ok {
				next = append(next, w)
			} else {
				failed = append(failed, branch{st: w})
			}
		}
		live = next
	}
	out := make([]branch, 0, len(live)+len(failed))
	for _, w := range live {
		out = append(out, branch{st: w, matched: true})
	}
	return append(out, failed...), nil
}

// matchOne evaluates one match for *st (which it may update: recent --set).
// When split is true both outcomes are possible: *st is the matching world
// and alt the other one.
func (tr *tracer) matchOne(st *traceState, m Match) (ok bool, alt traceState, split bool, err error) {
	p := tr.pkt
	switch m := m.(type) {
	case *CommentMatch:
		return true, alt, false, nil
	case *PortMatch:
		ok = p.Protocol == m.Protocol
		if m.SourcePort != nil {
			ok = ok && m.SourcePort.Contains(p.SourcePort) != m.SourceNegate
		}
		if m.DestinationPort != nil {
			ok = ok && m.DestinationPort.Contains(st.dport) != m.DestinationNegate
		}
		return ok, alt, false, nil
	case *MultiportMatch:
		return m.Contains(p.SourcePort, st.dport), alt, false, nil
	case *AddrTypeMatch:
		ok = true
		for _, side := range []struct {
			types  []string
			negate bool
			addr   netip.Addr
		}{{m.SourceTypes, m.SourceNegate, p.Source}, {m.DestinationTypes, m.DestinationNegate, st.dst}} {
			if side.types == nil {
				continue
			}
			for _, ty := range side.types {
				if ty != "LOCAL" {
					return false, alt, false, fmt.Errorf("addrtype %s is not supported by the tracer", ty)
				}
			}
			ok = ok && tr.isLocal(side.addr) != side.negate
		}
		return ok, alt, false, nil
	case *MarkMatch:
		return m.Matches(st.mark), alt, false, nil
	case *ConntrackMatch:
		found := false
		for _, s := range m.States {
			switch s {
			case "NEW":
				found = true
			case "DNAT":
				found = found || st.dnat != ""
			}
		}
		return found != m.Negate, alt, false, nil
	case *StatisticMatch:
		always, never := false, false
		switch m.Mode {
		case "random":
			th := m.Threshold()
			always, never = th >= 1<<31, th == 0
		case "nth":
			always = m.Every == 1
		}
		switch {
		case always:
			return !m.Negate, alt, false, nil
		case never:
			return m.Negate, alt, false, nil
		}
		return true, *st, true, nil
	case *RecentMatch:
		return tr.recent(st, m)
	case *SetMatch:
		ok, err := tr.ipset(st, m)
		return ok, alt, false, err
	}
	return false, alt, false, fmt.Errorf("match %s is not supported by the tracer", m.Module())
}

func (tr *tracer) recent(st *traceState, m *RecentMatch) (bool, traceState, bool, error) {
	addr := tr.pkt.Source
	if m.Dest {
		addr = st.dst
	}
	mask := m.Mask
	if !mask.IsValid() {
		mask = prefixMask(addr.BitLen(), addr.BitLen())
	}
	key := andAddr(addr, mask)
	switch m.Command {
	case "set":
		st.recentSet = append(st.recentSet[:len(st.recentSet):len(st.recentSet)], m.Name)
		st.recentAdds = append(st.recentAdds[:len(st.recentAdds):len(st.recentAdds)], recentEntry{m.Name, key})
		return !m.Negate, traceState{}, false, nil
	case "rcheck", "update":
		if m.HitCount != 0 {
			return false, traceState{}, false, fmt.Errorf("recent --hitcount is not supported by the tracer")
		}
		listed := slices.Contains(st.recentAdds, recentEntry{m.Name, key})
		for _, a := range tr.opts.Recent[m.Name] {
			if a.Is4() == key.Is4() && andAddr(a, mask) == key {
				listed = true
			}
		}
		return listed != m.Negate, traceState{}, false, nil
	}
	return false, traceState{}, false, fmt.Errorf("recent --%s is not supported by the tracer", m.Command)
}

// ipset looks the packet up in an ipset from TraceOptions.IPSets. Entries
// have one dimension ("ip" or "cidr"), two ("ip,proto:port", "ip,port"
// meaning tcp) or three ("ip,proto:port,ip" or "ip,proto:port,cidr"), as
// many as the match's flags.
func (tr *tracer) ipset(st *traceState, m *SetMatch) (bool, error) {
	entries, ok := tr.opts.IPSets[m.Name]
	if !ok {
		return false, fmt.Errorf("ipset %q is not in TraceOptions.IPSets", m.Name)
	}
	if len(m.Flags) > 3 {
		return false, fmt.Errorf("ipset %q: more than three dimensions are not supported by the tracer", m.Name)
	}
	addrOf := func(flag string) netip.Addr {
		if flag == "dst" {
			return st.dst
		}
		return tr.pkt.Source
	}
	port := 0
	if len(m.Flags) >= 2 {
		port = tr.pkt.SourcePort
		if m.Flags[1] == "dst" {
			port = st.dport
		}
	}
	found := false
	for _, e := range entries {
		parts := strings.Split(e, ",")
		if len(parts) != len(m.Flags) {
			return false, fmt.Errorf("ipset %q entry %q does not fit the match's %d dimension(s)", m.Name, e, len(m.Flags))
		}
		ipOK, err := addrInEntry(parts[0], addrOf(m.Flags[0]))
		if err != nil {
			return false, fmt.Errorf("ipset %q: bad entry %q", m.Name, e)
		}
		if !ipOK {
			continue
		}
		if len(parts) >= 2 {
			proto, portStr, withProto := strings.Cut(parts[1], ":")
			if !withProto {
				proto, portStr = "tcp", parts[1]
			}
			n, err := parsePort(portStr)
			if err != nil {
				return false, fmt.Errorf("ipset %q: bad entry %q", m.Name, e)
			}
			if proto != tr.pkt.Protocol || n != port {
				continue
			}
		}
		if len(parts) == 3 {
			ok, err := addrInEntry(parts[2], addrOf(m.Flags[2]))
			if err != nil {
				return false, fmt.Errorf("ipset %q: bad entry %q", m.Name, e)
			}
			if !ok {
				continue
			}
		}
		found = true
		break
	}
	return found != m.Negate, nil
}

// addrInEntry reports whether addr is the address, or in the network, of
// one dimension of a set entry.
func addrInEntry(part string, addr netip.Addr) (bool, error) {
	if strings.Contains(part, "/") {
		pfx, err := netip.ParsePrefix(part)
		if err != nil {
			return false, err
		}
		return pfx.Contains(addr), nil
	}
	a, err := netip.ParseAddr(part)
	if err != nil {
		return false, err
	}
	return a == addr, nil
}
