package nftables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Set-aside service ports (docs/design.md, "Set-aside service ports in
// nftables mode"). When nft refuses a transaction, the backend finds the
// service ports whose changes it refuses, programs everything else in the
// same sync, and leaves each of those with what the table has for it:
//
//   - nft names the refused command by its position, which execNFT maps
//     back to the transaction's line ("(transaction line N)"); the plan
//     knows what each of its operations writes (plan.locate): an element
//     of one destination, a shape or pick chain, a hairpin or health-check
//     element, or a shared object (the table, its maps and sets, the
//     static chains, the sync-state canary), whose refusal still fails the
//     sync;
//   - a destination, chain or element leads to the service ports of the
//     transaction that have it (touchIndex);
//   - when the error names no line, bisectRefused finds them with
//     "nft --check" runs over a growing prefix of the service ports.

// txLine is the transaction line execNFT writes for each position nft
// reports.
var txLine = regexp.MustCompile(`\(transaction line (\d+)\)`)

// refusedLines are the transaction lines (1-based) an error names.
func refusedLines(err error) []int {
	var out []int
	for _, m := range txLine.FindAllStringSubmatch(err.Error(), -1) {
		if n, convErr := strconv.Atoi(m[1]); convErr == nil && !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out
}

// refusalAt is the part of err about transaction line n: nft's message and
// the command (execNFT puts the command on the line after the position);
// err itself when it has no such part.
func refusalAt(err error, n int) error {
	lines := strings.Split(err.Error(), "\n")
	tag := "(transaction line " + strconv.Itoa(n) + ")"
	for i, l := range lines {
		if !strings.Contains(l, tag) {
			continue
		}
		msg := l
		if _, after, ok := strings.Cut(l, tag+": "); ok {
			msg = after
		}
		if i+1 < len(lines) && lines[i+1] != "" && !txLine.MatchString(lines[i+1]) {
			msg += ": " + lines[i+1]
		}
		return errors.New(msg)
	}
	return err
}

// refKind says what an operation of a transaction writes.
type refKind int

const (
	// refShared: the table, a map or set declaration or flush, a static
	// chain, the sync-state canary, a node port address, a stale object.
	refShared refKind = iota
	refDest
	refChain
	refHairpin
	refHealth
)

// opRef is what one operation writes.
type opRef struct {
	kind    refKind
	dest    destKey
	chain   string
	hairpin netip.Addr
	health  int
}

// isServiceChain reports whether a chain is a shape or pick chain (used
// by some destinations) rather than a static one.
func isServiceChain(name string) bool {
	return strings.HasPrefix(name, shapeChainPrefix) || strings.HasPrefix(name, pickChainPrefix)
}

func chainRef(name string) opRef {
	if isServiceChain(name) {
		return opRef{kind: refChain, chain: name}
	}
	return opRef{kind: refShared}
}

// elemRef is what an element belongs to, read from its map or set and key.
func elemRef(e *elem) opRef {
	switch {
	case e.set == mapServiceIPs || e.set == mapNoEndpointServices || e.set == setEndpointSlots || e.set == setFirewallIPs || e.set == setFirewallAllow:
		if dk, ok := parseDispatchKey(false, e.key[:min(3, len(e.key))]); ok {
			return opRef{kind: refDest, dest: dk}
		}
	case e.set == mapServiceNodePorts || e.set == mapNoEndpointNodePorts || e.set == setNodePortEndpointSlots:
		if dk, ok := parseDispatchKey(true, e.key); ok {
			return opRef{kind: refDest, dest: dk}
		}
	case strings.HasPrefix(e.set, mapNodePortEndpointsPrefix):
		if len(e.key) == 2 {
			if port, err := strconv.Atoi(e.key[0]); err == nil {
				return opRef{kind: refDest, dest: destKey{nodePort: true, proto: strings.TrimPrefix(e.set, mapNodePortEndpointsPrefix), port: port}}
			}
		}
	case strings.HasPrefix(e.set, mapEndpointsPrefix):
		if len(e.key) == 3 {
			a, err1 := netip.ParseAddr(e.key[0])
			port, err2 := strconv.Atoi(e.key[1])
			if err1 == nil && err2 == nil {
				return opRef{kind: refDest, dest: destKey{addr: a, proto: strings.TrimPrefix(e.set, mapEndpointsPrefix), port: port}}
			}
		}
	case e.set == setHairpin:
		if a, err := netip.ParseAddr(e.key[0]); err == nil {
			return opRef{kind: refHairpin, hairpin: a}
		}
	case e.set == setHealthCheck:
		if p, err := strconv.Atoi(e.key[0]); err == nil {
			return opRef{kind: refHealth, health: p}
		}
	}
	return opRef{kind: refShared}
}

// locate is what operation i (0-based) of p.transaction writes: it walks
// the plan in the order transaction writes it.
func (p *plan) locate(i int) opRef {
	shared := opRef{kind: refShared}
	if i < 0 {
		return shared
	}
	if p.addTable {
		if i == 0 {
			return shared
		}
		i--
	}
	if i < len(p.addSets) {
		return shared
	}
	i -= len(p.addSets)
	if i < len(p.createChains) {
		return chainRef(p.createChains[i].name)
	}
	i -= len(p.createChains)
	if i < len(p.staleChains) {
		return shared
	}
	i -= len(p.staleChains)
	for _, group := range [][]*chainDef{p.createChains, p.rewriteChains} {
		for _, c := range group {
			if n := 1 + len(c.rules); i < n {
				return chainRef(c.name)
			} else {
				i -= n
			}
		}
	}
	if i < len(p.flushSets) {
		return shared
	}
	i -= len(p.flushSets)
	if i < len(p.deletes) {
		return elemRef(&p.deletes[i])
	}
	i -= len(p.deletes)
	if i < len(p.adds) {
		return elemRef(&p.adds[i])
	}
	i -= len(p.adds)
	for _, dr := range p.addEndpoints {
		if n := len(dr.eps[0]) + len(dr.eps[1]); i < n {
			return opRef{kind: refDest, dest: dr.key}
		} else {
			i -= n
		}
	}
	return shared
}

// refs calls each with what every element and service chain operation of
// p writes (shared operations left out).
func (p *plan) refs(each func(opRef)) {
	for _, group := range [][]*chainDef{p.createChains, p.rewriteChains} {
		for _, c := range group {
			if isServiceChain(c.name) {
				each(opRef{kind: refChain, chain: c.name})
			}
		}
	}
	for _, list := range [][]elem{p.deletes, p.adds} {
		for i := range list {
			if r := elemRef(&list[i]); r.kind != refShared {
				each(r)
			}
		}
	}
	for _, list := range [][]*destRender{p.preEndpoints, p.addEndpoints} {
		for _, dr := range list {
			each(opRef{kind: refDest, dest: dr.key})
		}
	}
}

// touchIndex leads from what an operation writes to the service ports
// whose renders have it.
type touchIndex struct {
	dests   map[destKey][]proxy.ServicePortName
	chains  map[string][]proxy.ServicePortName
	hairpin map[netip.Addr][]proxy.ServicePortName
	health  map[int][]proxy.ServicePortName
}

func newTouchIndex() *touchIndex {
	return &touchIndex{dests: map[destKey][]proxy.ServicePortName{}, chains: map[string][]proxy.ServicePortName{},
		hairpin: map[netip.Addr][]proxy.ServicePortName{}, health: map[int][]proxy.ServicePortName{}}
}

func addName(list []proxy.ServicePortName, name proxy.ServicePortName) []proxy.ServicePortName {
	if slices.Contains(list, name) {
		return list
	}
	return append(list, name)
}

// add indexes a render of name (nil: none).
func (ti *touchIndex) add(name proxy.ServicePortName, rs *renderedService) {
	if rs == nil {
		return
	}
	for _, dr := range rs.dests {
		ti.dests[dr.key] = addName(ti.dests[dr.key], name)
		for _, c := range dr.chains {
			ti.chains[c] = addName(ti.chains[c], name)
		}
	}
	for _, a := range rs.hairpin {
		ti.hairpin[a] = addName(ti.hairpin[a], name)
	}
	if rs.healthCheck != 0 {
		ti.health[rs.healthCheck] = addName(ti.health[rs.healthCheck], name)
	}
}

// of lists the service ports that have what r writes (none for a shared
// operation).
func (ti *touchIndex) of(r opRef) []proxy.ServicePortName {
	switch r.kind {
	case refDest:
		return ti.dests[r.dest]
	case refChain:
		return ti.chains[r.chain]
	case refHairpin:
		return ti.hairpin[r.hairpin]
	case refHealth:
		return ti.health[r.health]
	}
	return nil
}

// tableChanged reports whether a failed transaction says that the table is
// not what kproxy wrote (nft found no such element, chain or map: someone
// deleted it), rather than refusing what kproxy writes: that is repaired
// by a rebuild, never by setting service ports aside.
func tableChanged(err error) bool { return knftables.IsNotFound(err) }

// notARefusal reports whether a failed run cannot be a refusal of what
// kproxy writes: the table changed (tableChanged), or nft did not finish
// (its deadline, or the sync's, passed: a search would only wait again).
func notARefusal(ctx context.Context, err error) bool {
	return ctx.Err() != nil || tableChanged(err) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
}

// errSharedRefused: nft refused an object that no service port owns.
var errSharedRefused = errors.New("nft refused an object shared by every service")

// hintedRefusals reads the service ports an error names: for each line it
// names, the service ports ti leads to from what locate says the line
// writes. shared is set when a line writes a shared object; ok is false
// when the error names no line, or a line that leads to none of them.
func hintedRefusals(err error, ops int, locate func(int) opRef, ti *touchIndex, eligible func(proxy.ServicePortName) bool) (refused map[proxy.ServicePortName]error, shared, ok bool) {
	lines := refusedLines(err)
	if len(lines) == 0 {
		return nil, false, false
	}
	refused = map[proxy.ServicePortName]error{}
	for _, n := range lines {
		if n < 1 || n > ops {
			return nil, false, false
		}
		r := locate(n - 1)
		if r.kind == refShared {
			return nil, true, false
		}
		found := false
		for _, name := range ti.of(r) {
			if eligible(name) {
				refused[name] = refusalAt(err, n)
				found = true
			}
		}
		if !found {
			return nil, false, false
		}
	}
	return refused, false, true
}

// maxRefusalChecks bounds the "nft --check" runs of one search.
const maxRefusalChecks = 200

// bisectRefused finds, among units (in order), the service ports whose
// changes the kernel refuses, when its error did not name them. txFor
// builds the transaction with the changes of accepted only (every other
// unit keeps what the table has). known is the refusal of the transaction
// with every unit. It checks the transaction without any unit first (a
// refusal then is of shared objects: the error), then finds the shortest
// refused prefix of the units: its last unit is refused, the units before
// it are accepted, and the search goes on with those after it.
func bisectRefused(ctx context.Context, nft knftables.Interface, units []proxy.ServicePortName, known error,
	txFor func(accepted []proxy.ServicePortName) *knftables.Transaction) (map[proxy.ServicePortName]error, error) {
	checks := 0
	check := func(accepted []proxy.ServicePortName) error {
		if checks++; checks > maxRefusalChecks {
			return errTooManyChecks
		}
		return nft.Check(ctx, txFor(accepted))
	}
	if err := check(nil); err != nil {
		if errors.Is(err, errTooManyChecks) {
			return nil, err
		}
		return nil, fmt.Errorf("%w: %w", errSharedRefused, err)
	}
	refused := map[proxy.ServicePortName]error{}
	var accepted []proxy.ServicePortName
	rest := units
	// The refusal of accepted + rest, when known: never the run's (known),
	// which a check may not repeat.
	var failing error
	for len(rest) > 0 {
		if failing == nil {
			failing = check(slices.Concat(accepted, rest))
			if failing == nil {
				break
			}
		}
		if errors.Is(failing, errTooManyChecks) {
			return nil, failing
		}
		// accepted + rest[:lo] passes, accepted + rest[:hi] fails.
		lo, hi := 0, len(rest)
		for hi-lo > 1 {
			mid := (lo + hi) / 2
			err := check(slices.Concat(accepted, rest[:mid]))
			if errors.Is(err, errTooManyChecks) {
				return nil, err
			}
			if err == nil {
				lo = mid
			} else {
				hi, failing = mid, err
			}
		}
		refused[rest[hi-1]] = failing
		accepted = append(accepted, rest[:hi-1]...)
		rest = rest[hi:]
		failing = nil
	}
	if len(refused) == 0 {
		// Every unit passes now: the refusal was not theirs to fix.
		return nil, known
	}
	return refused, nil
}

var errTooManyChecks = fmt.Errorf("more than %d nft --check runs looking for the refused service ports", maxRefusalChecks)

// setAsideError is the error a service port is reported with.
func setAsideError(err error) error {
	return fmt.Errorf("the kernel refused its nftables elements: %w", err)
}

// Adopting what the table has. A service port set aside by a full sync
// keeps the elements the table has for it: its destinations are those
// whose dispatch or no-endpoint element names it (their comment), their
// elements are those listed (readKernel), their endpoint slots the last
// state's (checked against the hash the endpoint-slots comment records) or,
// failing that, those the endpoints map lists.

// commentOwner is the service port name a dispatch or no-endpoint comment
// ends with, and whether it may be cut short (a comment of the maximum
// length).
func commentOwner(c string) (string, bool) {
	f := strings.Fields(c)
	if len(f) == 0 {
		return "", false
	}
	return f[len(f)-1], len(c) >= 128
}

// shapeFromName parses a shape chain's name back (shapeKey.name).
func shapeFromName(name string) (shapeKey, bool) {
	var s shapeKey
	f := strings.Split(name, "-")
	if len(f) < 4 || len(f) > 5 || f[0]+"-" != shapeChainPrefix {
		return s, false
	}
	s.nodePort, s.proto = f[1] == "np", f[2]
	codes := strings.Split(f[3], ".")
	if len(codes) != 3 {
		return s, false
	}
	for i, c := range []proxy.SourceClass{proxy.SourcePod, proxy.SourceNode, proxy.SourceOther} {
		a, ok := parseClassCode(codes[i])
		if !ok {
			return s, false
		}
		s.classes[c] = a
	}
	if len(f) == 5 {
		n, err := strconv.Atoi(strings.TrimPrefix(f[4], "aff"))
		if err != nil || !strings.HasPrefix(f[4], "aff") {
			return s, false
		}
		s.affinity = n
	}
	return s, s.name() == name
}

// parseClassCode parses classAction.code.
func parseClassCode(c string) (classAction, bool) {
	if c == "x" {
		return classAction{}, true
	}
	a := classAction{deliver: true}
	switch {
	case strings.HasPrefix(c, "c"):
		a.sel = proxy.SelectCluster
	case strings.HasPrefix(c, "l"):
		a.sel = proxy.SelectLocal
	default:
		return a, false
	}
	c = c[1:]
	if strings.HasSuffix(c, "m") {
		a.masq, c = true, strings.TrimSuffix(c, "m")
	}
	n, err := strconv.Atoi(c)
	if err != nil || n <= 0 {
		return a, false
	}
	a.count = n
	return a, true
}

// shapeChains are the shape chain of name and its pick chains, rendered
// into l (a table written by another kproxy may use shapes no service of
// this sync has).
func (l *layout) shapeChains(name string) ([]string, bool) {
	s, ok := shapeFromName(name)
	if !ok || !s.delivers() {
		return nil, false
	}
	if _, err := l.chain(name, func() (*chainDef, error) { return l.shapeChain(s) }); err != nil {
		return nil, false
	}
	out := []string{name}
	for _, a := range s.classes {
		if !a.deliver {
			continue
		}
		p := s.pick(a)
		if pc, _ := l.chain(p.name(), func() (*chainDef, error) { return l.pickChain(p), nil }); !slices.Contains(out, pc) {
			out = append(out, pc)
		}
	}
	return out, true
}

// kernelElems indexes what a full sync listed of the table by destination,
// and the destinations by the service port their comments name.
type kernelElems struct {
	byDest  map[destKey][]elem
	byOwner map[string][]destKey
	// cut are the destinations whose comment may name its service port
	// cut short.
	cut     map[destKey]string
	hairpin map[netip.Addr]bool
	health  map[int]bool
}

func indexKernel(k *kernelState) *kernelElems {
	ke := &kernelElems{byDest: map[destKey][]elem{}, byOwner: map[string][]destKey{}, cut: map[destKey]string{},
		hairpin: map[netip.Addr]bool{}, health: map[int]bool{}}
	for _, id := range sortedKeys(k.small) {
		e := k.small[id]
		r := elemRef(&e)
		switch r.kind {
		case refHairpin:
			ke.hairpin[r.hairpin] = true
			continue
		case refHealth:
			ke.health[r.health] = true
			continue
		case refDest:
		default:
			continue
		}
		ke.byDest[r.dest] = append(ke.byDest[r.dest], e)
		if e.set != r.dest.dispatchMap() && e.set != r.dest.noEndpointMap() {
			continue
		}
		owner, cut := commentOwner(e.comment)
		if !slices.Contains(ke.byOwner[owner], r.dest) {
			ke.byOwner[owner] = append(ke.byOwner[owner], r.dest)
		}
		if cut {
			ke.cut[r.dest] = owner
		}
	}
	return ke
}

// destsOf are the destinations whose comments name the service port.
func (ke *kernelElems) destsOf(name proxy.ServicePortName) []destKey {
	s := name.String()
	out := slices.Clone(ke.byOwner[s])
	for dk, owner := range ke.cut {
		if owner != s && strings.HasPrefix(s, owner) && !slices.Contains(out, dk) {
			out = append(out, dk)
		}
	}
	slices.SortFunc(out, destKey.compare)
	return out
}

// adoptDest is the render of what the table holds for one destination of
// name (nil when it cannot be told: no candidate slots match its hash).
// cands give candidate slots (the last state's, then the listed ones).
func (l *layout) adoptDest(name proxy.ServicePortName, dk destKey, elems []elem, cands []func() *[2][]netip.AddrPort) *destRender {
	dr := &destRender{key: dk, owner: name, small: slices.Clone(elems)}
	// The dispatch element first, as renderDest writes it (reorder reads
	// it there).
	i := slices.IndexFunc(dr.small, func(e elem) bool { return e.set == dk.dispatchMap() })
	if i < 0 {
		dr.computeDigest()
		return dr
	}
	dr.small[0], dr.small[i] = dr.small[i], dr.small[0]
	d := dr.small[0]
	// Then its endpoint-slots element (reorder reads it there), whose
	// comment says what the endpoints maps hold.
	j := slices.IndexFunc(dr.small, func(e elem) bool { return e.set == dk.slotsSet() })
	if j < 0 || len(d.value) != 1 {
		return nil
	}
	dr.small[1], dr.small[j] = dr.small[j], dr.small[1]
	hash, counts, _, ok := parseSlotsComment(dr.small[1].comment)
	if !ok {
		return nil
	}
	shape := strings.TrimPrefix(d.value[0], "goto ")
	chains, ok := l.shapeChains(shape)
	if !ok {
		return nil
	}
	dr.chains = chains
	for _, cand := range cands {
		eps := cand()
		if eps == nil {
			continue
		}
		dr.eps = *eps
		if dr.counts() != counts {
			continue
		}
		if h, big := dr.hashEndpoints(shape); h == hash {
			dr.hash, dr.bigDigest = h, big
			dr.computeDigest()
			return dr
		}
	}
	return nil
}
