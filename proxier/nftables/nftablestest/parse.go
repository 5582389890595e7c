package nftablestest

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"
)

// stmt is one statement of a rule: a match, an action or a verdict.
type stmt interface {
	eval(t *tracer, w world, depth int) ([]branch, error)
}

// field is one component of an expression (a concatenation of fields).
type field struct {
	kind   string // saddr, daddr, l4proto, thdport, dport, numgen
	proto  string // dport: the protocol it implies
	random bool   // numgen random (else inc)
	mod    int
	offset int
}

type expr []field

// values evaluates e for w: every possible key (numgen random has several);
// ok is false when a field does not apply (tcp dport of a udp packet: the
// rule does not match).
func (e expr) values(w world) (keys [][]string, ok bool) {
	keys = [][]string{nil}
	for _, f := range e {
		var alts []string
		switch f.kind {
		case "saddr":
			alts = []string{w.src.String()}
		case "daddr":
			alts = []string{w.dst.String()}
		case "l4proto":
			alts = []string{w.proto}
		case "thdport":
			alts = []string{formatPort(w.dport)}
		case "dport":
			if w.proto != f.proto {
				return nil, false
			}
			alts = []string{formatPort(w.dport)}
		case "numgen":
			if f.random || f.mod > 1 {
				for i := 0; i < f.mod; i++ {
					alts = append(alts, strconv.Itoa(f.offset+i))
				}
			} else {
				alts = []string{strconv.Itoa(f.offset)}
			}
		}
		var next [][]string
		for _, k := range keys {
			for _, a := range alts {
				next = append(next, append(slices.Clone(k), a))
			}
		}
		keys = next
	}
	return keys, true
}

// eachKey evaluates e for w and joins the branches f gives for each key;
// when e does not apply, the rule ends (one branch that does not continue).
func eachKey(e expr, w world, f func(k []string) ([]branch, error)) ([]branch, error) {
	keys, ok := e.values(w)
	if !ok {
		return []branch{{w: w}}, nil
	}
	return joinBranches(keys, f)
}

// eachMapValue is eachKey over the values the keys find in the map set
// (stmt names the statement in the error when set is not a map); a key the
// map lacks ends the rule (the next one is tried).
func (t *tracer) eachMapValue(e expr, w world, set, stmt string, f func(w world, val []string) ([]branch, error)) ([]branch, error) {
	keys, ok := e.values(w)
	if !ok {
		return []branch{{w: w}}, nil
	}
	s, err := t.set(set)
	if err != nil {
		return nil, err
	}
	if !s.isMap {
		return nil, fmt.Errorf("%s set %s", stmt, set)
	}
	return joinBranches(keys, func(k []string) ([]branch, error) {
		el, hit := s.lookup(k)
		if !hit {
			return []branch{{w: w}}, nil
		}
		hw := w
		if t.opts.RecordPath {
			hw = t.record(hw, nil)
			step := Step{Map: set, Key: k, Value: el.Value}
			if el.Comment != nil {
				step.Comment = *el.Comment
			}
			hw = t.record(hw, &step)
		}
		return f(hw, el.Value)
	})
}

// joinBranches joins the branches f gives for each key.
func joinBranches(keys [][]string, f func(k []string) ([]branch, error)) ([]branch, error) {
	var out []branch
	for _, k := range keys {
		bs, err := f(k)
		if err != nil {
			return nil, err
		}
		out = append(out, bs...)
	}
	return out, nil
}

// match compares an expression with a set or a literal.
type match struct {
	e       expr
	negate  bool
	set     string // "@set" lookup when set
	literal string
}

func (m *match) eval(t *tracer, w world, _ int) ([]branch, error) {
	return eachKey(m.e, w, func(k []string) ([]branch, error) {
		var hit bool
		if m.set != "" {
			s, err := t.set(m.set)
			if err != nil {
				return nil, err
			}
			_, hit = s.lookup(k)
		} else {
			if len(k) != 1 {
				return nil, fmt.Errorf("comparing a concatenation with %q", m.literal)
			}
			hit = componentMatches(m.literal, k[0])
		}
		return []branch{{w: w, cont: hit != m.negate}}, nil
	})
}

// vmap looks an expression up in a verdict map.
type vmap struct {
	e   expr
	set string
}

func (v *vmap) eval(t *tracer, w world, depth int) ([]branch, error) {
	return t.eachMapValue(v.e, w, v.set, "vmap on", func(w world, val []string) ([]branch, error) {
		if len(val) != 1 {
			return nil, fmt.Errorf("verdict map %s has value %q", v.set, val)
		}
		return t.verdict(w, val[0], depth)
	})
}

// verdictStmt ends the rule: accept, drop, reject, return, jump, goto.
type verdictStmt struct{ v string }

func (v *verdictStmt) eval(t *tracer, w world, depth int) ([]branch, error) {
	return t.verdict(w, v.v, depth)
}

// dnat translates the destination to a map value and accepts.
type dnat struct {
	e   expr
	set string
}

func (d *dnat) eval(t *tracer, w world, _ int) ([]branch, error) {
	return t.eachMapValue(d.e, w, d.set, "dnat through", func(w world, val []string) ([]branch, error) {
		if len(val) != 2 {
			return nil, fmt.Errorf("dnat map %s has value %q", d.set, val)
		}
		a, err := netip.ParseAddr(val[0])
		if err != nil || a.Is6() != (t.family == knftables.IPv6Family) {
			return nil, fmt.Errorf("dnat map %s has address %q", d.set, val[0])
		}
		port, err := strconv.Atoi(val[1])
		if err != nil || port < 1 || port > 65535 {
			return nil, fmt.Errorf("dnat map %s has port %q", d.set, val[1])
		}
		nw := w
		nw.dst, nw.dport, nw.dnatted = a, port, true
		return []branch{{w: nw, verdict: "accept"}}, nil
	})
}

type masquerade struct{}

func (masquerade) eval(t *tracer, w world, _ int) ([]branch, error) {
	w = t.record(w, nil)
	w.masq = true
	return []branch{{w: w, verdict: "accept"}}, nil
}

// markSet is "meta mark set meta mark | X" or "^ X".
type markSet struct {
	op   string
	bits uint32
}

func (m *markSet) eval(t *tracer, w world, _ int) ([]branch, error) {
	w = t.record(w, nil)
	if m.op == "|" {
		w.mark |= m.bits
	} else {
		w.mark ^= m.bits
	}
	return []branch{{w: w, cont: true}}, nil
}

// markTest is "meta mark & X != 0".
type markTest struct{ bits uint32 }

func (m *markTest) eval(_ *tracer, w world, _ int) ([]branch, error) {
	return []branch{{w: w, cont: w.mark&m.bits != 0}}, nil
}

// cond is a match on the packet's context: ct state, ct status, fib.
type cond struct{ what string }

func (c *cond) eval(t *tracer, w world, _ int) ([]branch, error) {
	var hit bool
	switch c.what {
	case "ct state new":
		hit = true // every traced packet opens a connection
	case "ct status dnat":
		hit = w.dnatted
	case "fib saddr type local":
		hit = t.isLocal(w.src)
	case "fib daddr type local":
		hit = t.isLocal(w.dst)
	}
	return []branch{{w: w, cont: hit}}, nil
}

// update adds or refreshes a dynamic set entry.
type update struct {
	e   expr
	set string
}

func (u *update) eval(t *tracer, w world, _ int) ([]branch, error) {
	s, ok := t.table.Sets[u.set]
	if !ok || !slices.Contains(s.Flags, knftables.DynamicFlag) {
		return nil, fmt.Errorf("update of %s, not a dynamic set", u.set)
	}
	return eachKey(u.e, w, func(k []string) ([]branch, error) {
		nw := w
		entries := []string{}
		if nw.updates != "" {
			entries = strings.Split(nw.updates, "\n")
		}
		entries = append(entries, u.set+" { "+strings.Join(k, " . ")+" }")
		slices.Sort(entries)
		nw.updates = strings.Join(slices.Compact(entries), "\n")
		return []branch{{w: nw, cont: true}}, nil
	})
}

type noop struct{}

func (noop) eval(_ *tracer, w world, _ int) ([]branch, error) {
	return []branch{{w: w, cont: true}}, nil
}

// parser reads the tokens of one rule.
type parser struct {
	toks   []string
	i      int
	family knftables.Family
}

func (p *parser) done() bool { return p.i >= len(p.toks) }

func (p *parser) peek() string {
	if p.done() {
		return ""
	}
	return p.toks[p.i]
}

func (p *parser) next() string {
	t := p.peek()
	p.i++
	return t
}

func (p *parser) expect(words ...string) error {
	for _, w := range words {
		if got := p.next(); got != w {
			return fmt.Errorf("expected %q, found %q", w, got)
		}
	}
	return nil
}

func (p *parser) setName() (string, error) {
	t := p.next()
	if !strings.HasPrefix(t, "@") || len(t) < 2 {
		return "", fmt.Errorf("expected @set, found %q", t)
	}
	return t[1:], nil
}

func (p *parser) number() (int, error) {
	t := p.next()
	n, err := strconv.Atoi(t)
	if err != nil {
		return 0, fmt.Errorf("expected a number, found %q", t)
	}
	return n, nil
}

func (p *parser) hex() (uint32, error) {
	t := p.next()
	n, err := strconv.ParseUint(strings.TrimPrefix(t, "0x"), 16, 32)
	if err != nil || !strings.HasPrefix(t, "0x") {
		return 0, fmt.Errorf("expected a hexadecimal number, found %q", t)
	}
	return uint32(n), nil
}

// parseRule parses the rule syntax kproxy writes.
func parseRule(text string, family knftables.Family) ([]stmt, error) {
	p := &parser{toks: strings.Fields(text), family: family}
	var out []stmt
	for !p.done() {
		s, err := p.stmt()
		if err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("empty rule")
	}
	return out, nil
}

func (p *parser) stmt() (stmt, error) {
	switch tok := p.peek(); tok {
	case "accept", "drop", "reject", "return", "continue":
		p.next()
		return &verdictStmt{tok}, nil
	case "goto", "jump":
		p.next()
		target := p.next()
		if target == "" {
			return nil, fmt.Errorf("%s without a chain", tok)
		}
		return &verdictStmt{tok + " " + target}, nil
	case "counter":
		p.next()
		return noop{}, nil
	case "masquerade":
		p.next()
		if p.peek() == "fully-random" {
			p.next()
		}
		return masquerade{}, nil
	case "dnat":
		p.next()
		if err := p.expect(string(p.family), "to"); err != nil {
			return nil, err
		}
		e, err := p.expr()
		if err != nil {
			return nil, err
		}
		if err := p.expect("map"); err != nil {
			return nil, err
		}
		set, err := p.setName()
		if err != nil {
			return nil, err
		}
		return &dnat{e: e, set: set}, nil
	case "update":
		p.next()
		set, err := p.setName()
		if err != nil {
			return nil, err
		}
		if err := p.expect("{"); err != nil {
			return nil, err
		}
		e, err := p.expr()
		if err != nil {
			return nil, err
		}
		if err := p.expect("timeout"); err != nil {
			return nil, err
		}
		if t := p.next(); !validTimeout(t) {
			return nil, fmt.Errorf("timeout %q", t)
		}
		if err := p.expect("}"); err != nil {
			return nil, err
		}
		return &update{e: e, set: set}, nil
	case "ct":
		p.next()
		switch p.next() {
		case "state":
			if err := p.expect("new"); err != nil {
				return nil, err
			}
			return &cond{"ct state new"}, nil
		case "status":
			if err := p.expect("dnat"); err != nil {
				return nil, err
			}
			return &cond{"ct status dnat"}, nil
		}
		return nil, fmt.Errorf("unsupported ct match")
	case "fib":
		p.next()
		which := p.next()
		if which != "saddr" && which != "daddr" {
			return nil, fmt.Errorf("unsupported fib %q", which)
		}
		if err := p.expect("type", "local"); err != nil {
			return nil, err
		}
		return &cond{"fib " + which + " type local"}, nil
	case "meta":
		if p.i+1 < len(p.toks) && p.toks[p.i+1] == "mark" {
			return p.mark()
		}
	}
	e, err := p.expr()
	if err != nil {
		return nil, err
	}
	switch tok := p.next(); {
	case tok == "vmap":
		set, err := p.setName()
		if err != nil {
			return nil, err
		}
		return &vmap{e: e, set: set}, nil
	case strings.HasPrefix(tok, "@"):
		p.i--
		set, err := p.setName()
		if err != nil {
			return nil, err
		}
		return &match{e: e, set: set}, nil
	case tok == "!=":
		if strings.HasPrefix(p.peek(), "@") {
			set, err := p.setName()
			if err != nil {
				return nil, err
			}
			return &match{e: e, set: set, negate: true}, nil
		}
		return p.literal(e, true)
	case tok == "==":
		return p.literal(e, false)
	case tok == "":
		return nil, fmt.Errorf("expression without a relation")
	default:
		p.i--
		return p.literal(e, false)
	}
}

// literal is a comparison with an address, prefix or number.
func (p *parser) literal(e expr, negate bool) (stmt, error) {
	t := p.next()
	if len(e) != 1 {
		return nil, fmt.Errorf("comparing a concatenation with %q", t)
	}
	switch e[0].kind {
	case "saddr", "daddr":
		if _, err := netip.ParsePrefix(t); err != nil {
			if _, err := netip.ParseAddr(t); err != nil {
				return nil, fmt.Errorf("expected an address or prefix, found %q", t)
			}
		}
	default:
		if _, err := strconv.Atoi(t); err != nil {
			return nil, fmt.Errorf("expected a number, found %q", t)
		}
	}
	return &match{e: e, literal: t, negate: negate}, nil
}

func (p *parser) mark() (stmt, error) {
	if err := p.expect("meta", "mark"); err != nil {
		return nil, err
	}
	switch p.next() {
	case "set":
		if err := p.expect("meta", "mark"); err != nil {
			return nil, err
		}
		op := p.next()
		if op != "|" && op != "^" {
			return nil, fmt.Errorf("unsupported mark operation %q", op)
		}
		bits, err := p.hex()
		if err != nil {
			return nil, err
		}
		return &markSet{op: op, bits: bits}, nil
	case "&":
		bits, err := p.hex()
		if err != nil {
			return nil, err
		}
		if err := p.expect("!=", "0"); err != nil {
			return nil, err
		}
		return &markTest{bits: bits}, nil
	}
	return nil, fmt.Errorf("unsupported mark expression")
}

// expr parses fields separated by ".".
func (p *parser) expr() (expr, error) {
	var e expr
	for {
		f, err := p.field()
		if err != nil {
			return nil, err
		}
		e = append(e, f)
		if p.peek() != "." {
			return e, nil
		}
		p.next()
	}
}

func (p *parser) field() (field, error) {
	switch tok := p.next(); tok {
	case "ip", "ip6":
		if tok != string(p.family) {
			return field{}, fmt.Errorf("%s expression in a %s table", tok, p.family)
		}
		switch w := p.next(); w {
		case "saddr", "daddr":
			return field{kind: w}, nil
		}
		return field{}, fmt.Errorf("unsupported %s field", tok)
	case "meta":
		if err := p.expect("l4proto"); err != nil {
			return field{}, err
		}
		return field{kind: "l4proto"}, nil
	case "th":
		if err := p.expect("dport"); err != nil {
			return field{}, err
		}
		return field{kind: "thdport"}, nil
	case "tcp", "udp", "sctp":
		if err := p.expect("dport"); err != nil {
			return field{}, err
		}
		return field{kind: "dport", proto: tok}, nil
	case "numgen":
		f := field{kind: "numgen"}
		switch p.next() {
		case "random":
			f.random = true
		case "inc":
		default:
			return field{}, fmt.Errorf("unsupported numgen")
		}
		if err := p.expect("mod"); err != nil {
			return field{}, err
		}
		var err error
		if f.mod, err = p.number(); err != nil || f.mod < 1 {
			return field{}, fmt.Errorf("numgen modulus: %v", err)
		}
		if p.peek() == "offset" {
			p.next()
			if f.offset, err = p.number(); err != nil {
				return field{}, err
			}
		}
		return f, nil
	default:
		return field{}, fmt.Errorf("unsupported expression %q", tok)
	}
}

// validTimeout says whether t is a timeout as knftables writes it
// ("10800s") or as nft lists it ("3h", "1d2h3m4s", "500ms").
func validTimeout(t string) bool {
	if t == "" {
		return false
	}
	for t != "" {
		i := 0
		for i < len(t) && t[i] >= '0' && t[i] <= '9' {
			i++
		}
		if i == 0 {
			return false
		}
		t = t[i:]
		unit := ""
		for _, u := range []string{"ms", "d", "h", "m", "s"} {
			if strings.HasPrefix(t, u) {
				unit = u
				break
			}
		}
		if unit == "" {
			return false
		}
		t = t[len(unit):]
	}
	return true
}
