// Package nftables is kproxy's nftables backend: it renders the node's
// desired state (proxy.NodeState, the decision table of every service
// port) into one table per family, "ip kproxy" and "ip6 kproxy", through
// sigs.k8s.io/knftables, one atomic transaction per sync (a full sync
// adding many endpoint slots writes those of destinations not yet
// dispatched ahead, in chunks no packet can reach until the main
// transaction: see preWriter).
//
// # Layout
//
// The table's rules do not depend on the services: a service is map and
// set elements. nft reads every chain and rule of the namespace before each
// transaction, so a table whose rule count grew with the services would
// make every change slower (docs/nftables-spike.md, layout D). The rules
// that do vary are shared by every destination of one "shape" and so grow
// only with the distinct endpoint counts in use.
//
// Dispatch (nat): nat-prerouting and nat-output jump to "services", which
// looks the packet up in two verdict maps:
//
//	service-ips        daddr . l4proto . dport : goto <shape chain>   ClusterIPs, external IPs, load-balancer IPs
//	service-nodeports  l4proto . dport : goto <shape chain>           for "fib daddr type local" and not loopback,
//	                                                                 or daddr in nodeport-ips (--nodeport-addresses)
//
// A shape chain ("svc-ip-tcp-c10.c10m.c10m") is shared by every destination
// whose decisions render alike: for each source class (pod, node, other)
// whether it is delivered, over which list (c: cluster endpoints, l: local
// ones), how many endpoints that list has and whether it is masqueraded,
// plus the ClientIP affinity timeout. Its rules test the classes in the
// model's order, pods ("ip saddr <cluster CIDR>") then the node ("fib saddr
// type local"), only where their action differs from everyone else's;
// each rule sets the masquerade bit when asked and goes to a pick chain.
// A class that is not delivered returns, leaving the packet un-NATed for
// the filter verdicts below.
//
// A pick chain ("pick-ip-tcp-c10") DNATs to a slot of the protocol's
// endpoints map, keyed by the packet's destination and a slot number:
//
//	endpoints-tcp            daddr . tcp dport . slot : endpoint address . port
//	nodeport-endpoints-tcp   tcp dport . slot : endpoint address . port
//
// slot = numgen random mod <count>, offset by localSlotBase for the local
// list, so one destination holds both lists (the short circuit of pods and
// the node to an externalTrafficPolicy Local destination takes the cluster
// list, everyone else the local one). With ClientIP affinity the pick
// chain first looks for a (client, destination, slot) entry of the
// protocol's timed "affinity-tcp" set, refreshing it, and otherwise picks
// a slot with one rule per slot (1/n, 1/(n-1), ...) that records it.
// Entries name slots, not endpoints: an endpoint that leaves the list
// leaves nobody pinned to it (its slot goes to another endpoint or away).
// Slots are stable (slots.go): an endpoint keeps its slot while it stays,
// so only the clients of an endpoint moved from the last slot into a
// removed one's are picked again.
//
// Masquerade: a chosen class sets the masquerade bit; nat-postrouting's
// "masquerading" chain clears it and masquerades (fully-random), and
// masquerades DNATed connections whose source and destination are one
// hairpin endpoint (set hairpin-endpoints).
//
// Filter: a connection that nat did not DNAT still carries the service
// destination when the filter hooks see it. filter-input, -forward and
// -output look new connections up in no-endpoint-services (daddr . l4proto
// . dport : drop or goto reject-chain), and filter-input also in
// no-endpoint-nodeports (l4proto . dport, every local address but
// loopback). Load-balancer source ranges are checked before DNAT, for every
// class, from filter chains at priority -110 of prerouting and output:
// firewall-ips holds the filtered destinations and firewall-allow, an
// interval set, (destination . allowed source range). Health-check node
// ports (health-check-nodeports) are accepted in filter-input.
//
// # Syncs
//
// A partial sync renders the changed service ports, diffs their
// destinations' elements against what it last wrote and writes only the
// difference (a changed element is deleted and added again in the same
// transaction), creating shape and pick chains when first used and
// deleting them when unused. It never reads the table.
//
// A full sync reconciles without flushing, and never lists rules: nft
// reads every element of the table to list a chain (seconds at 10,000
// services). The canary of the small set sync-state records the layout
// hash (everything the chains' rules depend on besides their names) and a
// digest of every element the table holds. Same layout: chains found by
// name (listed over netlink) hold what their names say. Same digest too:
// nothing to write. Otherwise the sync lists every map and set except the
// endpoints maps, which are large: each endpoint-slots element's comment carries
// a hash of its destination's endpoint slots, their counts and their
// assignment (permToken), so the slots of a destination whose endpoints
// are unchanged are kept, in the order the table has, and those of one
// whose hash changed are rewritten (their old keys follow from the counts).
//
// Every map and set has a canary element. A partial sync checks, at most
// once per CanaryInterval, with one "nft --check" transaction, that every
// chain still has its rules and every canary is there; a full sync checks
// the same before trusting hashes and digest. A missing one (a flushed
// chain, map or table), a failed partial transaction or a failed full sync
// makes the next sync a rebuild: every chain, map and set flushed and
// rewritten in one transaction (atomically: traffic never sees an empty
// table). Single elements deleted by someone else are not detected.
//
// # Set-aside service ports
//
// When nft refuses a transaction for some service ports' elements (the
// line it reports leads to them; else they are bisected with "nft
// --check"), those are set aside: the sync writes everything else and
// succeeds, and they keep what the table has for them (setaside.go). A
// refused shared object, or a table that lacks what the state says it
// has, still fails (and rebuilds).
package nftables

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
)

// TableName is the name of kproxy's table in the ip and ip6 families
// (never kube-proxy's "kube-proxy").
const TableName = "kproxy"

// DefaultCanaryInterval is how often, by default, a partial sync first
// checks that nobody flushed kproxy's chains, maps or table.
const DefaultCanaryInterval = 30 * time.Second

// Options configures a Backend. NFTables and Family are required; the rest
// have defaults.
type Options struct {
	// NFTables is bound to (Family, TableName): see NewInterface.
	NFTables knftables.Interface
	// Family is v1.IPv4Protocol or v1.IPv6Protocol.
	Family v1.IPFamily
	// MasqueradeBit is the fwmark bit (0-31) that asks for SNAT; default 14.
	MasqueradeBit *int
	// NodePortAddresses selects the local addresses that accept node ports
	// (--nodeport-addresses, this family); nil means every local address
	// ("fib daddr type local"). Loopback addresses never do. Node ports
	// without endpoints are rejected (or dropped) on every local address
	// but loopback all the same.
	NodePortAddresses *proxy.NodePortAddresses
	// LocalAddresses lists the node's addresses (read when
	// NodePortAddresses selects some); nil uses the host's interfaces.
	LocalAddresses func() ([]netip.Addr, error)
	Clock          clock.PassiveClock
	// CanaryInterval is how often a partial sync first checks that the
	// table is intact; default DefaultCanaryInterval (the command sets the
	// sync period).
	CanaryInterval time.Duration
	// EndpointChunk bounds the endpoint slots of each transaction a full
	// sync writes ahead of its main one; default DefaultEndpointChunk.
	EndpointChunk int
}

// SyncStats describes the last successful sync, for logs, metrics and
// tests.
type SyncStats struct {
	// Mode is "partial", "reconcile" (a full sync that diffs against the
	// table) or "rebuild" (a full sync that flushes and rewrites).
	Mode string
	Full bool
	// Operations is the number of operations of the transaction (0: none
	// was run).
	Operations int
	// ElementsAdded and ElementsDeleted count element operations (a
	// replaced element counts in both).
	ElementsAdded, ElementsDeleted int
	ChainsWritten, ChainsDeleted   int
	// RulesWritten are the rules the transaction wrote, by table ("nat",
	// "filter").
	RulesWritten map[string]int
	// NATRules and FilterRules count the rules of the table after the sync.
	NATRules, FilterRules int
	// Transactions is the number of transactions run (a failed partial one
	// followed by a rebuild counts two).
	Transactions int
	// KernelTime is the time spent running transactions, ReadTime the time
	// spent listing the table and checking canaries.
	KernelTime, ReadTime time.Duration
}

const (
	modePartial   = "partial"
	modeReconcile = "reconcile"
	modeRebuild   = "rebuild"
)

// Backend implements proxier.Backend with nftables.
type Backend struct {
	nft      knftables.Interface
	opts     Options
	fam      family
	masqMark string
	clock    clock.PassiveClock

	// state is what the last successful transaction left in the table;
	// nil until a full sync succeeded (and after a failure).
	state *tableState
	// options are the decision options state was rendered with, layout
	// its layout.
	options proxy.DecisionOptions
	layout  *layout
	// needRebuild makes the next sync a rebuild.
	needRebuild bool
	// setAside are the service ports set aside (docs/design.md,
	// "Set-aside service ports in nftables mode"), with the error that
	// set each aside: the table has what it had for them, which state
	// records.
	setAside map[proxy.ServicePortName]error
	// refused are those the last sync refused (or could not render):
	// every set-aside one after a full sync, the changed ones after a
	// partial one.
	refused    map[proxy.ServicePortName]error
	lastCanary time.Time
	last       SyncStats
}

var _ proxier.Backend = (*Backend)(nil)

// New validates opts and returns a Backend. It touches nothing and starts
// no goroutine.
func New(opts Options) (*Backend, error) {
	if opts.NFTables == nil {
		return nil, errors.New("nftables backend: NFTables is required")
	}
	if opts.Family != v1.IPv4Protocol && opts.Family != v1.IPv6Protocol {
		return nil, fmt.Errorf("nftables backend: unknown IP family %q", opts.Family)
	}
	if f := opts.NodePortAddresses.Family(); f != "" && f != opts.Family {
		return nil, fmt.Errorf("nftables backend: %s node port addresses for the %s family", f, opts.Family)
	}
	bit := 14
	if opts.MasqueradeBit != nil {
		bit = *opts.MasqueradeBit
	}
	if bit < 0 || bit > 31 {
		return nil, fmt.Errorf("nftables backend: masquerade bit %d out of range 0-31", bit)
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.LocalAddresses == nil {
		opts.LocalAddresses = netlink.HostAddresses
	}
	if opts.CanaryInterval <= 0 {
		opts.CanaryInterval = DefaultCanaryInterval
	}
	return &Backend{
		nft:      opts.NFTables,
		opts:     opts,
		fam:      newFamily(opts.Family == v1.IPv6Protocol),
		masqMark: fmt.Sprintf("%#x", uint32(1)<<bit),
		clock:    opts.Clock,
		setAside: map[proxy.ServicePortName]error{},
	}, nil
}

// NewInterface returns a knftables.Interface for family's kproxy table
// ("ip kproxy" or "ip6 kproxy"). It runs nft to check that nft works. The
// table's object names are listed over netlink (knftables.UseNetlink):
// "nft list" reads every set element of the table first, seconds at
// 10,000 services. Transactions go to nft with each run of element
// commands on one set or map merged into one command (execNFT).
func NewInterface(family v1.IPFamily) (knftables.Interface, error) {
	return NewInterfaceWith(InterfaceOptions{Family: family})
}

// InterfaceOptions configure NewInterfaceWith.
type InterfaceOptions struct {
	// Family is v1.IPv4Protocol or v1.IPv6Protocol.
	Family v1.IPFamily
	// Timeout bounds each nft transaction (nft is killed with its process
	// group after it); zero is the default, 60 s.
	Timeout time.Duration
}

// NewInterfaceWith is NewInterface with options.
func NewInterfaceWith(opts InterfaceOptions) (knftables.Interface, error) {
	family := opts.Family
	fam := knftables.IPv4Family
	switch family {
	case v1.IPv4Protocol:
	case v1.IPv6Protocol:
		fam = knftables.IPv6Family
	default:
		return nil, fmt.Errorf("nftables: unknown IP family %q", family)
	}
	nft, err := newExecNFT(execOptions{Family: fam, Table: TableName, Timeout: opts.Timeout})
	if err != nil {
		return nil, err
	}
	return nft, nil
}

// SetAside returns the service ports set aside after the last sync, with
// the error that set each aside (nil when there are none): those whose
// elements nft refused or that could not be rendered, in that sync or in
// an earlier one that did not retry them since (docs/design.md,
// "Set-aside service ports in nftables mode").
func (b *Backend) SetAside() map[proxy.ServicePortName]error {
	return refusedCopy(b.setAside)
}

func refusedCopy(m map[proxy.ServicePortName]error) map[proxy.ServicePortName]error {
	if len(m) == 0 {
		return nil
	}
	return maps.Clone(m)
}

// LastSync returns the statistics of the last successful sync.
func (b *Backend) LastSync() SyncStats { return b.last }

// Sync implements proxier.Backend.
func (b *Backend) Sync(ctx context.Context, state *proxy.NodeState, full bool) (proxy.BackendResult, error) {
	logger := klog.FromContext(ctx)
	if err := state.Validate(); err != nil {
		return proxy.BackendResult{}, err
	}
	if state.IsIPv6() != b.fam.ipv6 {
		return proxy.BackendResult{}, fmt.Errorf("nftables backend for %s given %s state", b.opts.Family, state.Family)
	}
	now := b.clock.Now()
	mode := modePartial
	switch {
	case b.needRebuild:
		mode = modeRebuild
	case full || b.state == nil || state.Options != b.options:
		mode = modeReconcile
	}
	var st SyncStats
	if mode == modePartial && now.Sub(b.lastCanary) >= b.opts.CanaryInterval {
		start := b.clock.Now()
		err := b.canary(ctx)
		st.ReadTime += b.clock.Since(start)
		b.lastCanary = now
		if err != nil {
			logger.Info("kproxy's nftables table was changed by someone else; rebuilding it", "family", b.opts.Family, "err", err)
			mode = modeRebuild
		}
	}
	st.Mode = mode
	err := b.sync(ctx, state, mode, &st)
	mode = st.Mode
	if err != nil && mode == modePartial {
		mode = modeRebuild
		if errors.Is(err, errUnknownServices) {
			mode = modeReconcile
		}
		logger.Error(err, "Partial nftables sync failed; trying a full one", "family", b.opts.Family, "mode", mode)
		st = SyncStats{Mode: mode, ReadTime: st.ReadTime, KernelTime: st.KernelTime, Transactions: st.Transactions}
		err = b.sync(ctx, state, mode, &st)
		mode = st.Mode
	}
	if err != nil {
		b.state = nil
		b.needRebuild = true
		return proxy.BackendResult{}, err
	}
	b.needRebuild = false
	b.options = state.Options
	if mode != modePartial {
		b.lastCanary = now
	}
	st.Full = mode != modePartial
	b.last = st
	logger.V(2).Info("Synced nftables", "family", b.opts.Family, "mode", mode, "servicePorts", len(b.state.services),
		"operations", st.Operations, "elementsAdded", st.ElementsAdded, "elementsDeleted", st.ElementsDeleted,
		"chainsWritten", st.ChainsWritten, "chainsDeleted", st.ChainsDeleted, "kernelTime", st.KernelTime, "readTime", st.ReadTime,
		"setAside", len(b.setAside))
	return proxy.BackendResult{
		RuleCounts:    map[string]int{"nat": st.NATRules, "filter": st.FilterRules},
		RulesWritten:  map[string]int{"nat": st.RulesWritten["nat"], "filter": st.RulesWritten["filter"]},
		ChainsWritten: st.ChainsWritten, ChainsDeleted: st.ChainsDeleted,
		KernelWrites: st.Transactions, KernelTime: st.KernelTime,
		Full:     st.Full && !full,
		SetAside: refusedCopy(b.refused),
	}, nil
}

// layoutFor is the layout of state's options: the last one when they did
// not change, so that its chains rendered so far are reused (the owner of a
// destination may change to a service port rendered syncs ago).
func (b *Backend) layoutFor(state *proxy.NodeState) *layout {
	l := &layout{fam: b.fam, masqMark: b.masqMark, clusterCIDR: state.Options.ClusterCIDR,
		nodePortIPs: !b.opts.NodePortAddresses.MatchAll()}
	if p := b.layout; p != nil && p.fam == l.fam && p.masqMark == l.masqMark && p.clusterCIDR == l.clusterCIDR && p.nodePortIPs == l.nodePortIPs {
		return p
	}
	return l
}

// nodePortIPs are the local addresses that accept node ports, when
// --nodeport-addresses selects some.
func (b *Backend) nodePortIPs() (map[netip.Addr]bool, error) {
	out := map[netip.Addr]bool{}
	if b.opts.NodePortAddresses.MatchAll() {
		return out, nil
	}
	local, err := b.opts.LocalAddresses()
	if err != nil {
		return nil, fmt.Errorf("listing local addresses: %w", err)
	}
	for _, a := range b.opts.NodePortAddresses.Select(local) {
		out[a.Unmap()] = true
	}
	return out, nil
}

// DefaultEndpointChunk bounds the endpoint slots of each transaction that
// adds them ahead of a full sync's main one. nft's time does not depend on
// it (its CPU at 10,000 services x 10 endpoints: the same within noise for
// chunks of 4,096, 16,384 or all of the slots); kproxy holds at most two
// chunks at once (preWriter).
const DefaultEndpointChunk = 16384

// plan is one transaction in the making, in the order it must run.
type plan struct {
	l *layout
	// createChains are added (and flushed: a leftover of the same name
	// would keep its rules), then get their rules.
	createChains []*chainDef
	// rewriteChains exist and are flushed and rewritten.
	rewriteChains []*chainDef
	// addSets are declared.
	addSets []*setDef
	// flushSets are emptied before the element operations.
	flushSets []*setDef
	// staleChains are flushed first and deleted last; staleSets deleted
	// last.
	staleChains []string
	staleSets   []string
	deletes     []elem
	adds        []elem
	// preEndpoints are destinations without a dispatch element in the
	// table whose endpoint slots are added by transactions of their own,
	// before the others (never on a rebuild, whose flushes come later).
	preEndpoints []*destRender
	// addEndpoints are destinations whose every endpoint slot is added
	// (after adds): their elements are made only when the transaction is.
	addEndpoints []*destRender
	addTable     bool
}

func (p *plan) transaction(nft knftables.Interface, isMap map[string]bool, st *SyncStats) *knftables.Transaction {
	tx := nft.NewTransaction()
	if p.addTable {
		tx.Add(&knftables.Table{Comment: knftables.PtrTo("rules for kproxy")})
	}
	for _, s := range p.addSets {
		tx.Add(s.object())
	}
	for _, c := range p.createChains {
		tx.Add(c.chain())
	}
	for _, c := range p.staleChains {
		tx.Flush(&knftables.Chain{Name: c})
	}
	st.RulesWritten = map[string]int{}
	for _, group := range [][]*chainDef{p.createChains, p.rewriteChains} {
		for _, c := range group {
			tx.Flush(&knftables.Chain{Name: c.name})
			for _, r := range c.rules {
				tx.Add(&knftables.Rule{Chain: c.name, Rule: r})
			}
			st.RulesWritten[c.table] += len(c.rules)
			st.ChainsWritten++
		}
	}
	for _, s := range p.flushSets {
		tx.Flush(s.object())
	}
	for i := range p.deletes {
		e := &p.deletes[i]
		tx.Delete(e.deleteObject(isMap[e.set]))
	}
	for i := range p.adds {
		e := &p.adds[i]
		tx.Add(e.object(isMap[e.set]))
	}
	var strs stringCache
	for _, dr := range p.addEndpoints {
		objs := dr.endpointObjects(&strs)
		for i := range objs {
			tx.Add(&objs[i])
		}
		st.ElementsAdded += len(objs)
	}
	for _, c := range p.staleChains {
		tx.Delete(&knftables.Chain{Name: c})
	}
	for _, s := range p.staleSets {
		if isMap[s] {
			tx.Delete(&knftables.Map{Name: s})
		} else {
			tx.Delete(&knftables.Set{Name: s})
		}
	}
	st.ElementsAdded += len(p.adds)
	st.ElementsDeleted += len(p.deletes)
	st.ChainsDeleted += len(p.staleChains)
	return tx
}

// deleteObject is the element as a delete operation names it: its key.
func (e *elem) deleteObject(isMap bool) *knftables.Element {
	o := &knftables.Element{Key: e.key}
	if isMap {
		o.Map = e.set
	} else {
		o.Set = e.set
	}
	return o
}

// diffElems appends to del the elements of old that new lacks or changes,
// and to add those of new that old lacks or has otherwise.
func diffElems(old, new []elem, del, add *[]elem) {
	om := make(map[string]string, len(old))
	for i := range old {
		om[old[i].id()] = old[i].val()
	}
	nm := make(map[string]string, len(new))
	for i := range new {
		nm[new[i].id()] = new[i].val()
	}
	for i := range old {
		if v, ok := nm[old[i].id()]; !ok || v != old[i].val() {
			*del = append(*del, old[i])
		}
	}
	for i := range new {
		if v, ok := om[new[i].id()]; !ok || v != new[i].val() {
			*add = append(*add, new[i])
		}
	}
}

func (b *Backend) endpointChunk() int {
	if b.opts.EndpointChunk > 0 {
		return b.opts.EndpointChunk
	}
	return DefaultEndpointChunk
}

// errUnknownServices: a partial sync was given service ports it never saw
// that the state does not name as changed; a full sync renders them.
var errUnknownServices = errors.New("the state has service ports that are neither known nor changed")

// kernelState is what a full sync reads of the table.
type kernelState struct {
	exists bool
	chains map[string]bool
	sets   map[string]bool
	// layout and digest are what the sync-state canary records ("" when
	// missing), stateComment its comment.
	layout, digest, stateComment string
	// trusted: the table holds the desired elements (same layout and
	// digest, canaries and rule counts checked): nothing else was listed.
	trusted bool
	// small holds the elements of the listed maps and sets (canaries
	// left out), by elem.id.
	small map[string]elem
	// dests are the destinations of the endpoint-slots elements, with the
	// hash and counts of their endpoint slots.
	dests map[destKey]destInfo
}

type destInfo struct {
	hash   string
	counts [2]int
	// perm is the slot assignment (permToken; "": address order).
	perm string
}

func newKernelState() *kernelState {
	return &kernelState{chains: map[string]bool{}, sets: map[string]bool{}, small: map[string]elem{}, dests: map[destKey]destInfo{}}
}

// readKernel lists the table's objects and every map and set but the
// endpoints maps (large: their content follows from the dispatch
// elements' comments), and checks, in one "nft --check" transaction, that
// every canary is there and, when the layout is the same, that every chain
// still has its rules. It never lists rules: nft reads every set element of
// the table to do so. An error means the table cannot be trusted (or read):
// the caller rebuilds it.
func (b *Backend) readKernel(ctx context.Context, l *layout, chains []*chainDef, want *tableState) (*kernelState, error) {
	k, err := b.readNames(ctx)
	if err != nil {
		return nil, err
	}
	if !k.exists {
		return k, nil
	}
	sets := l.sets()
	allSets := true
	for _, sd := range sets {
		allSets = allSets && k.sets[sd.name]
	}
	if k.sets[setSyncState] {
		err := b.listSet(ctx, &setDef{name: setSyncState}, func(e elem) error {
			if strings.HasPrefix(e.comment, canaryComment) {
				k.stateComment = e.comment
				k.layout, k.digest = parseStateCanary(e.comment)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	k.trusted = allSets && k.layout == l.hash() && k.digest == fmt.Sprintf("%016x", want.digest)
	if !k.trusted {
		if err := b.listSmall(ctx, l, k); err != nil {
			return nil, err
		}
	}
	// The canaries (a flushed map would make the hashes lie) and the
	// chains' rules (when they are to be trusted).
	tx := b.nft.NewTransaction()
	for _, sd := range sets {
		if sd.dynamic || !k.sets[sd.name] {
			continue
		}
		c := sd.canary
		if sd.name == setSyncState {
			if k.stateComment == "" {
				return nil, errors.New("sync-state has no canary")
			}
			c.comment = k.stateComment
		}
		tx.Delete(c.deleteObject(sd.isMap))
		tx.Add(c.object(sd.isMap))
	}
	if k.layout == l.hash() {
		for _, c := range chains {
			if k.chains[c.name] && len(c.rules) > 0 {
				tx.Add(&knftables.Rule{Chain: c.name, Rule: "counter", Index: knftables.PtrTo(len(c.rules) - 1)})
			}
		}
	}
	if tx.NumOperations() > 0 {
		if err := b.nft.Check(ctx, tx); err != nil {
			return nil, fmt.Errorf("checking canary elements and rules: %w", err)
		}
	}
	return k, nil
}

// listSet calls each with every element of a map or set.
func (b *Backend) listSet(ctx context.Context, sd *setDef, each func(e elem) error) error {
	kind := "set"
	if sd.isMap {
		kind = "map"
	}
	elems, err := b.nft.ListElements(ctx, kind, sd.name)
	if err != nil {
		return fmt.Errorf("listing %s %s: %w", kind, sd.name, err)
	}
	for _, ke := range elems {
		e := elem{set: sd.name, key: ke.Key, value: ke.Value}
		if ke.Comment != nil {
			e.comment = *ke.Comment
		}
		if err := each(e); err != nil {
			return err
		}
	}
	return nil
}

// listSmall lists every map and set of the table but the endpoints maps,
// the dynamic sets and sync-state into k.small (canaries left out) and
// the destinations of the endpoint-slots elements into k.dests. A table
// without the endpoint-slots sets was written by a kproxy of layout 1,
// whose dispatch elements carried the same comments: its destinations are
// read from those, so that its endpoint slots are reconciled, not
// rewritten.
func (b *Backend) listSmall(ctx context.Context, l *layout, k *kernelState) error {
	slotsIn := map[string]bool{setEndpointSlots: false, setNodePortEndpointSlots: true} // name: node ports
	if !k.sets[setEndpointSlots] && !k.sets[setNodePortEndpointSlots] {
		slotsIn = map[string]bool{mapServiceIPs: false, mapServiceNodePorts: true}
	}
	for _, sd := range l.sets() {
		if sd.dynamic || sd.big || sd.name == setSyncState || !k.sets[sd.name] {
			continue
		}
		nodePort, slots := slotsIn[sd.name]
		err := b.listSet(ctx, sd, func(e elem) error {
			if strings.HasPrefix(e.comment, canaryComment) {
				return nil
			}
			k.small[e.id()] = e
			if !slots {
				return nil
			}
			dk, ok := parseDispatchKey(nodePort, e.key)
			hash, counts, perm, ok2 := parseSlotsComment(e.comment)
			if !ok || !ok2 {
				return fmt.Errorf("unexpected element %s (comment %q)", e.id(), e.comment)
			}
			k.dests[dk] = destInfo{hash: hash, counts: counts, perm: perm}
			return nil
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// readNames lists the table's objects. A missing table, or one without
// objects, is reported as absent.
func (b *Backend) readNames(ctx context.Context) (*kernelState, error) {
	k := newKernelState()
	names, err := b.nft.ListAll(ctx)
	// The netlink lister of knftables reports a missing table with the
	// errno's text only.
	if knftables.IsNotFound(err) || errors.Is(err, syscall.ENOENT) ||
		(err != nil && strings.Contains(err.Error(), syscall.ENOENT.Error())) {
		return k, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing the table: %w", err)
	}
	for _, c := range names["chain"] {
		k.chains[c] = true
	}
	for _, s := range append(names["set"], names["map"]...) {
		k.sets[s] = true
	}
	k.exists = len(k.chains)+len(k.sets) > 0
	return k, nil
}

// parseDispatchKey reads a dispatch element's key back.
func parseDispatchKey(nodePort bool, key []string) (destKey, bool) {
	var k destKey
	var err error
	if nodePort {
		if len(key) != 2 {
			return k, false
		}
		k.nodePort, k.proto = true, key[0]
		_, err = fmt.Sscanf(key[1], "%d", &k.port)
		return k, err == nil
	}
	if len(key) != 3 {
		return k, false
	}
	k.addr, err = netip.ParseAddr(key[0])
	if err != nil {
		return k, false
	}
	k.proto = key[1]
	_, err = fmt.Sscanf(key[2], "%d", &k.port)
	return k, err == nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func sortedDestKeys[V any](m map[destKey]V) []destKey {
	out := make([]destKey, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.SortFunc(out, destKey.compare)
	return out
}

// canary checks, in one "nft --check" transaction, that every chain still
// has its rules and every map and set its canary element.
func (b *Backend) canary(ctx context.Context) error {
	if b.state == nil || b.layout == nil {
		return errors.New("no table written yet")
	}
	l := b.layout
	tx := b.nft.NewTransaction()
	for _, c := range append(l.staticChains(), b.state.sortedChains()...) {
		if n := len(c.rules); n > 0 {
			tx.Add(&knftables.Rule{Chain: c.name, Rule: "counter", Index: knftables.PtrTo(n - 1)})
		}
	}
	for _, sd := range l.sets() {
		if sd.dynamic {
			continue
		}
		c := sd.canary
		if sd.name == setSyncState {
			c = l.stateCanary(b.state.digest)
		}
		tx.Delete(c.deleteObject(sd.isMap))
		tx.Add(c.object(sd.isMap))
	}
	return b.nft.Check(ctx, tx)
}

// Cleanup deletes this family's kproxy table and everything in it. Other
// tables are left alone; running it again changes nothing.
func (b *Backend) Cleanup(ctx context.Context) error {
	tx := b.nft.NewTransaction()
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	b.state, b.layout = nil, nil
	b.needRebuild = false
	if err := b.nft.Run(ctx, tx); err != nil {
		return fmt.Errorf("deleting the %s %s table: %w", b.fam.ip, TableName, err)
	}
	return nil
}
