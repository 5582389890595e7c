package iptables

import (
	"context"
	"net/netip"
	"slices"
	"sort"

	"k8s.io/klog/v2"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// syncPlan is one sync's rendering: what every service port should get,
// and which ports the sync may set aside.
type syncPlan struct {
	r    *renderer
	full bool
	// next is each port's rendering; ports set aside earlier and unchanged
	// keep their last good one (or are absent).
	next map[proxy.ServicePortName]*renderedService
	// candidates are the ports rendered by this sync: only they can be set
	// aside (the others' rules were accepted before).
	candidates map[proxy.ServicePortName]bool
	// gone are the ports of the last sync that this one removes.
	gone []proxy.ServicePortName
	// withRules are the nat chains of the ports rendered by a partial
	// sync, handed to the writer with their rules so that it compares
	// them with what it wrote.
	withRules map[proxy.ServicePortName][]ipt.ChainRules
	addrs     []netip.Addr
}

// fallback is what a port set aside during a sync gets instead of its new
// rules.
type fallback int

const (
	// keepOld: its last good rules (b.services).
	keepOld fallback = iota + 1
	// keepNone: no rules at all (it never had good ones, or they were
	// refused too).
	keepNone
)

// sync renders state and writes it, setting aside the service ports whose
// rules the kernel refuses (docs/design.md, "Set-aside services").
func (b *Backend) sync(ctx context.Context, state *proxy.NodeState, full bool) error {
	logger := klog.FromContext(ctx)
	addrs, err := b.localAddrs()
	if err != nil {
		return err
	}
	p := b.plan(state, full, addrs)
	if full {
		if err := b.ensureHooks(ctx); err != nil {
			return err
		}
	}
	// A port no longer wanted is no longer set aside.
	for name := range b.setAside {
		if _, ok := state.Services[name]; !ok {
			delete(b.setAside, name)
		}
	}

	s := &setAsideSearch{b: b, p: p, excluded: map[proxy.ServicePortName]fallback{}, refusals: map[proxy.ServicePortName]error{}}
	cur, err := s.run(ctx)
	if err != nil {
		b.last = SyncStats{Full: full, WriteStats: s.stats, Attempts: s.attempts}
		return err
	}
	for name := range p.candidates {
		if refusal, ok := s.refusals[name]; ok && s.excluded[name] != 0 {
			b.setAside[name] = refusal
		} else {
			delete(b.setAside, name)
		}
	}
	if len(s.excluded) > 0 {
		names := make([]string, 0, len(s.excluded))
		for name := range s.excluded {
			names = append(names, name.String())
		}
		sort.Strings(names)
		logger.Info("Set aside service ports whose rules the kernel refused; they keep their last good rules", "family", state.Family, "servicePorts", names)
	}
	b.services = cur
	stats := SyncStats{
		Full: full, WriteStats: s.stats, Attempts: s.attempts, SetAside: len(b.setAside),
		NATRules: b.natWriter.RuleCount(ipt.TableNAT), FilterRules: b.filterWriter.RuleCount(ipt.TableFilter),
	}
	b.last = stats
	logger.V(2).Info("Synced iptables rules", "family", state.Family, "full", full, "services", len(cur),
		"restores", stats.Restores, "chainsWritten", stats.ChainsWritten, "chainsDeleted", stats.ChainsDeleted,
		"rulesWritten", stats.RulesWritten, "bytes", stats.Bytes, "attempts", stats.Attempts, "setAside", stats.SetAside)
	return nil
}

// plan renders the services this sync concerns; the others keep what was
// rendered before. Their own chains' rules are handed to the writer
// lazily, rendered again only when written (a full sync writes them all,
// batch by batch), except those of the services rendered in a partial
// sync, which the writer compares with what it wrote. A port set aside
// earlier is rendered (retried) only when it changed or the sync is full.
func (b *Backend) plan(state *proxy.NodeState, full bool, addrs []netip.Addr) *syncPlan {
	r := &renderer{ipv6: b.ipv6, clusterCIDR: state.Options.ClusterCIDR}
	p := &syncPlan{r: r, full: full, addrs: addrs,
		next:       make(map[proxy.ServicePortName]*renderedService, len(state.Services)),
		candidates: map[proxy.ServicePortName]bool{},
		withRules:  map[proxy.ServicePortName][]ipt.ChainRules{},
	}
	if full {
		for name, st := range state.Services {
			p.next[name] = r.render(st)
			p.candidates[name] = true
		}
		for name := range b.services {
			if _, ok := state.Services[name]; !ok {
				p.gone = append(p.gone, name)
			}
		}
		return p
	}
	for name, rs := range b.services {
		if _, ok := state.Services[name]; ok || !state.Changed.Has(name.NamespacedName) {
			p.next[name] = rs
		} else {
			p.gone = append(p.gone, name)
		}
	}
	for name, st := range state.Services {
		if !state.Changed.Has(name.NamespacedName) {
			if _, known := b.services[name]; known {
				continue
			}
			if _, aside := b.setAside[name]; aside {
				continue // no good rules, and nothing new to try
			}
		}
		p.next[name] = r.render(st)
		p.candidates[name] = true
		p.withRules[name] = r.natChains(r.layout(st), true)
	}
	return p
}

// with returns the plan's rendering with the ports of excluded given their
// fallback.
func (b *Backend) with(p *syncPlan, excluded map[proxy.ServicePortName]fallback) map[proxy.ServicePortName]*renderedService {
	if len(excluded) == 0 {
		return p.next
	}
	cur := make(map[proxy.ServicePortName]*renderedService, len(p.next))
	for name, rs := range p.next {
		cur[name] = rs
	}
	for name, fb := range excluded {
		old, ok := b.services[name]
		if fb == keepOld && ok {
			cur[name] = old
		} else {
			delete(cur, name)
		}
	}
	return cur
}

// fullWrites says which writers still owe this sync its full write: a
// writer whose full write ran (even if it failed part way, see
// ipt.Writer.Apply) finishes it with partial writes.
type fullWrites struct{ nat, filter bool }

// write brings the kernel to cur, table by table, in an order in which a
// failure after any restore leaves every service port's traffic either
// delivered or refused as before or as after (docs/design.md, "Atomic
// syncs across tables"):
//
//  1. filter gains the verdicts of cur and keeps those of the last sync
//     that cur drops (their union): a verdict only matches traffic that nat
//     did not DNAT, so an extra one is harmless while nat still DNATs;
//  2. nat, in batches;
//  3. filter loses the verdicts cur drops, when there are any.
//
// A restore failure is returned as is (an *ipt.ApplyError).
func (b *Backend) write(ctx context.Context, p *syncPlan, cur map[proxy.ServicePortName]*renderedService, excluded map[proxy.ServicePortName]fallback, full *fullWrites) (ipt.WriteStats, error) {
	names := proxy.SortedServicePortNames(cur)
	filter := b.renderFilter(names, cur, nil, nil)
	first, loses := filter, b.filterLoses(p, cur)
	if loses {
		first = b.renderFilter(unionNames(names, b.services), cur, b.services, excluded)
	}
	var stats ipt.WriteStats
	writeFilter := func(chains map[string][]string) error {
		rs := ipt.NewRuleSet()
		rs.Shared[ipt.TableFilter] = chains
		st, err := b.filterWriter.Write(ctx, rs, full.filter)
		full.filter = false
		stats.Add(st)
		return err
	}
	if err := writeFilter(first); err != nil {
		return stats, err
	}

	// Each service port's chains are one group (they jump to each other);
	// the writer leaves out what did not change since its last write.
	ns := &ipt.RuleSet{Groups: make([]ipt.ChainGroup, 0, len(names))}
	for _, name := range names {
		rs := cur[name]
		switch chains, ok := p.withRules[name]; {
		case excluded[name] != 0:
			// Its last good rules, which a failed attempt of this sync may
			// have replaced: the writer compares them with its record.
			ns.AddGroup(ipt.TableNAT, p.r.natChains(p.r.layout(rs.state), true)...)
		case ok:
			ns.AddGroup(ipt.TableNAT, chains...)
		default:
			ns.AddLazyGroup(ipt.TableNAT, rs.natChains, func() []ipt.ChainRules { return p.r.natChains(p.r.layout(rs.state), true) })
		}
	}
	ns.Shared = map[ipt.Table]map[string][]string{ipt.TableNAT: b.renderNAT(names, cur, p.addrs)}
	st, err := b.natWriter.Write(ctx, ns, full.nat)
	full.nat = false
	stats.Add(st)
	if err != nil {
		return stats, err
	}

	if loses {
		err = writeFilter(filter)
	}
	return stats, err
}

// filterLoses reports whether cur drops filter rules that the last sync
// wrote (b.services): a verdict gone, or a port gone with its verdicts.
// Only the ports the sync rendered or removed can differ (a port set aside
// gets the last sync's rules, or none).
func (b *Backend) filterLoses(p *syncPlan, cur map[proxy.ServicePortName]*renderedService) bool {
	loses := func(name proxy.ServicePortName) bool {
		old, ok := b.services[name]
		if !ok {
			return false
		}
		switch rs, ok := cur[name]; {
		case rs == old:
			return false
		case !ok:
			return !old.filter().empty()
		default:
			return !old.filter().subsetOf(rs.filter())
		}
	}
	for name := range p.candidates {
		if loses(name) {
			return true
		}
	}
	return slices.ContainsFunc(p.gone, loses)
}

// unionNames is names with the ports of old it lacks, sorted.
func unionNames(names []proxy.ServicePortName, old map[proxy.ServicePortName]*renderedService) []proxy.ServicePortName {
	all := make(map[proxy.ServicePortName]*renderedService, len(names)+len(old))
	for name, rs := range old {
		all[name] = rs
	}
	for _, name := range names {
		all[name] = nil
	}
	return proxy.SortedServicePortNames(all)
}

// renderFilter renders the filter chains from the ports' filter rules, in
// names order: those of cur, joined (when old is not nil) with those of
// old, except for the ports excluded with no rules at all (their old rules
// were refused too).
func (b *Backend) renderFilter(names []proxy.ServicePortName, cur, old map[proxy.ServicePortName]*renderedService, excluded map[proxy.ServicePortName]fallback) map[string][]string {
	var filSvc, filExt []dispatchRule
	var extNP, firewall, health []string
	for _, n := range names {
		rs, ok := cur[n]
		if old == nil {
			filSvc = append(filSvc, rs.filterServices...)
			filExt = append(filExt, rs.filterExternal...)
			extNP = append(extNP, rs.filterExtNodePorts...)
			firewall = append(firewall, rs.filterFirewall...)
			health = append(health, rs.filterHealthCheck...)
			continue
		}
		var f filterRules
		if ok {
			f = rs.filter()
		}
		if o, had := old[n]; had && o != rs && excluded[n] != keepNone {
			f = f.union(o.filter())
		}
		filSvc = append(filSvc, f.services...)
		filExt = append(filExt, f.external...)
		extNP = append(extNP, f.extNodePorts...)
		firewall = append(firewall, f.firewall...)
		health = append(health, f.healthCheck...)
	}
	extTail := []string{comment("kproxy node ports without endpoints") + " -m addrtype --dst-type LOCAL -j " + chainExternalNodePort}
	addrTree := addrBucketer{ipv6: b.ipv6}
	filter := map[string][]string{}
	for c, r := range (dispatchTree{root: chainServices, bucketer: addrTree}).render(filSvc, nil) {
		filter[c] = r
	}
	for c, r := range (dispatchTree{root: chainExternalServices, bucketer: addrTree}).render(filExt, extTail) {
		filter[c] = r
	}
	filter[chainExternalNodePort] = extNP
	filter[chainFirewall] = firewall
	filter[chainNodePorts] = health
	filter[chainForward] = []string{
		comment("kproxy: drop invalid conntrack state") + " -m conntrack --ctstate INVALID -j DROP",
		comment("kproxy forwarding rules") + " -m mark --mark " + b.masqMark + "/" + b.masqMark + " -j ACCEPT",
		comment("kproxy forwarding conntrack rule") + " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
	}
	filter[chainLocalnetFirewall] = b.localnetFirewall()
	filter[chainCanary] = []string{canaryRule}
	return filter
}

// renderNAT renders the nat chains shared by all services from the
// rendered services, in names order.
func (b *Backend) renderNAT(names []proxy.ServicePortName, services map[proxy.ServicePortName]*renderedService, addrs []netip.Addr) map[string][]string {
	var natSvc, natNP []dispatchRule
	hairpin := map[netip.Addr]bool{}
	for _, n := range names {
		rs := services[n]
		natSvc = append(natSvc, rs.natServices...)
		natNP = append(natNP, rs.natNodePorts...)
		for _, ip := range rs.hairpin {
			hairpin[ip] = true
		}
	}

	// Node ports are reached from the end of the service dispatch, on the
	// selected local addresses (never loopback ones). Node ports without
	// endpoints are rejected or dropped on every local address, as
	// kube-proxy does, whichever addresses serve them.
	npComment := comment("kproxy service nodeports; NOTE: this must be the last rule in this chain")
	var npTail []string
	if b.opts.NodePortAddresses.MatchAll() {
		loop := "127.0.0.0/8"
		if b.ipv6 {
			loop = "::1/128"
		}
		npTail = []string{npComment + " -m addrtype --dst-type LOCAL ! -d " + loop + " -j " + chainNodePorts}
	} else {
		for _, a := range b.opts.NodePortAddresses.Select(addrs) {
			npTail = append(npTail, npComment+" -d "+hostAddr(a)+" -j "+chainNodePorts)
		}
	}

	nat := map[string][]string{}
	addrTree := addrBucketer{ipv6: b.ipv6}
	for c, r := range (dispatchTree{root: chainServices, bucketer: addrTree}).render(natSvc, npTail) {
		nat[c] = r
	}
	for c, r := range (dispatchTree{root: chainNodePorts, bucketer: portBucketer{}}).render(natNP, nil) {
		nat[c] = r
	}
	nat[chainMarkMasq] = []string{"-j MARK --or-mark " + b.masqMark}
	masq := "-j MASQUERADE"
	if b.ipt.HasRandomFully() {
		masq += " --random-fully"
	}
	// Hairpin: an endpoint that reached itself through a service leaves with
	// its own address as source and destination; masquerade it. The rules
	// are keyed on the source address so the walk stays short.
	hairpinIPs := make([]netip.Addr, 0, len(hairpin))
	for ip := range hairpin {
		hairpinIPs = append(hairpinIPs, ip)
	}
	sort.Slice(hairpinIPs, func(i, j int) bool { return hairpinIPs[i].Less(hairpinIPs[j]) })
	hairpinRules := make([]dispatchRule, 0, len(hairpinIPs))
	for _, ip := range hairpinIPs {
		hairpinRules = append(hairpinRules, dispatchRule{addrBucket(ip), "-s " + hostAddr(ip) + " -d " + hostAddr(ip) + " " + masq})
	}
	for c, r := range (dispatchTree{root: chainHairpin, bucketer: addrBucketer{ipv6: b.ipv6, source: true}}).render(hairpinRules, nil) {
		nat[c] = r
	}
	post := []string{comment("kproxy hairpin: endpoints reaching themselves via a service") +
		" -m conntrack --ctstate DNAT -j " + chainHairpin}
	post = append(post,
		"-m mark ! --mark "+b.masqMark+"/"+b.masqMark+" -j RETURN",
		"-j MARK --xor-mark "+b.masqMark,
		comment("kproxy service traffic requiring SNAT")+" "+masq)
	nat[chainPostrouting] = post
	nat[chainCanary] = []string{canaryRule}
	return nat
}
