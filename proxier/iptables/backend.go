// Package iptables is kproxy's iptables backend: it renders the node's
// desired state into nat and filter rules and applies them with
// iptables-restore --noflush, one atomic restore per sync.
package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sort"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// Options configures a Backend. IPTables is required; the rest have
// kube-proxy's defaults.
type Options struct {
	IPTables ipt.Interface
	// MasqueradeBit is the fwmark bit (0-31) that asks for SNAT; default 14.
	MasqueradeBit *int
	// NodePortAddresses selects the local addresses that accept node ports
	// (--nodeport-addresses, this family); nil means every local address.
	// Loopback addresses never do. Node ports without endpoints are
	// rejected (or dropped) on every local address all the same.
	NodePortAddresses *proxy.NodePortAddresses
	// RouteLocalnet says that net.ipv4.conf.all.route_localnet is 1 (say
	// kube-proxy left it): IPv4 packets from outside to 127.0.0.0/8 could
	// then reach services bound to loopback, so the backend drops them, as
	// kube-proxy does. Ignored for IPv6.
	RouteLocalnet bool
	// LocalAddresses lists the node's addresses; nil uses the host's
	// interfaces.
	LocalAddresses func() ([]netip.Addr, error)
	// BatchChains bounds the service chains per iptables-restore in a full
	// sync: iptables-nft's restore time grows with the square of the chains
	// in one batch. Default 1000.
	BatchChains int
	// CanaryInterval is how often a partial sync first checks that our
	// chains were not flushed by someone else. Default 30s.
	CanaryInterval time.Duration
	Clock          clock.PassiveClock
}

// SyncStats describes the last successful sync, for logs, metrics and tests.
type SyncStats struct {
	Full bool
	// WriteStats is what the sync wrote: restores, chains, rules, bytes
	// and the time spent in iptables-restore.
	ipt.WriteStats
	// NATRules and FilterRules count every rule kproxy owns after the sync.
	NATRules    int
	FilterRules int
}

// Backend implements proxier.Backend with iptables.
type Backend struct {
	ipt      ipt.Interface
	ipv6     bool
	opts     Options
	masqMark string // e.g. 0x4000
	clock    clock.PassiveClock

	// services is what was last applied, per service port.
	services map[proxy.ServicePortName]*renderedService
	// writer writes the chains and remembers what it last wrote.
	writer *ipt.Writer
	// initialized is true once a full sync succeeded; false forces the next
	// sync to be full.
	initialized   bool
	lastCanary    time.Time
	last          SyncStats
	familyChecked bool
}

var _ proxier.Backend = (*Backend)(nil)

// New validates opts and returns a Backend. It touches nothing.
func New(opts Options) (*Backend, error) {
	if opts.IPTables == nil {
		return nil, errors.New("iptables backend: IPTables is required")
	}
	bit := 14
	if opts.MasqueradeBit != nil {
		bit = *opts.MasqueradeBit
	}
	if bit < 0 || bit > 31 {
		return nil, fmt.Errorf("iptables backend: masquerade bit %d out of range 0-31", bit)
	}
	if opts.BatchChains <= 0 {
		opts.BatchChains = 1000
	}
	if opts.CanaryInterval <= 0 {
		opts.CanaryInterval = 30 * time.Second
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.LocalAddresses == nil {
		opts.LocalAddresses = netlink.HostAddresses
	}
	writer, err := ipt.NewWriter(ipt.WriterOptions{
		IPTables: opts.IPTables,
		// Base chains are never deleted by a sync (only by Cleanup).
		Owned:       func(table ipt.Table, chain string) bool { return isOwnedChain(chain) && !isBaseChain(table, chain) },
		BatchChains: opts.BatchChains,
	})
	if err != nil {
		return nil, fmt.Errorf("iptables backend: %w", err)
	}
	return &Backend{
		writer:   writer,
		ipt:      opts.IPTables,
		ipv6:     opts.IPTables.Protocol() == ipt.ProtocolIPv6,
		opts:     opts,
		masqMark: fmt.Sprintf("%#x", uint32(1)<<bit),
		clock:    opts.Clock,
		services: map[proxy.ServicePortName]*renderedService{},
	}, nil
}

// LastSync returns the statistics of the last successful sync.
func (b *Backend) LastSync() SyncStats { return b.last }

// localAddrs returns this family's local addresses.
func (b *Backend) localAddrs() ([]netip.Addr, error) {
	all, err := b.opts.LocalAddresses()
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, a := range all {
		if a.Is6() == b.ipv6 && !a.Is4In6() {
			out = append(out, a)
		}
	}
	return out, nil
}

// newConnJump is a hook that only new connections take.
func newConnJump(table ipt.Table, chain ipt.Chain, comment, target string) ipt.JumpRule {
	return ipt.Jump(table, chain, comment, target, "-m", "conntrack", "--ctstate", "NEW")
}

// jumpRules lists kproxy's hooks, in the order they should appear.
var jumpRules = []ipt.JumpRule{
	ipt.Jump(ipt.TableNAT, ipt.ChainPrerouting, "kproxy service portals", chainServices),
	ipt.Jump(ipt.TableNAT, ipt.ChainOutput, "kproxy service portals", chainServices),
	ipt.Jump(ipt.TableNAT, ipt.ChainPostrouting, "kproxy postrouting rules", chainPostrouting),
	// First: no other rule of ours may accept a martian packet (localnet.go).
	ipt.Jump(ipt.TableFilter, ipt.ChainInput, "kproxy localnet firewall", chainLocalnetFirewall),
	ipt.Jump(ipt.TableFilter, ipt.ChainOutput, "kproxy localnet firewall", chainLocalnetFirewall),
	newConnJump(ipt.TableFilter, ipt.ChainInput, "kproxy load balancer firewall", chainFirewall),
	ipt.Jump(ipt.TableFilter, ipt.ChainInput, "kproxy health check service ports", chainNodePorts),
	newConnJump(ipt.TableFilter, ipt.ChainInput, "kproxy externally-visible service portals", chainExternalServices),
	newConnJump(ipt.TableFilter, ipt.ChainForward, "kproxy load balancer firewall", chainFirewall),
	ipt.Jump(ipt.TableFilter, ipt.ChainForward, "kproxy forwarding rules", chainForward),
	newConnJump(ipt.TableFilter, ipt.ChainForward, "kproxy service portals", chainServices),
	newConnJump(ipt.TableFilter, ipt.ChainForward, "kproxy externally-visible service portals", chainExternalServices),
	newConnJump(ipt.TableFilter, ipt.ChainOutput, "kproxy load balancer firewall", chainFirewall),
	newConnJump(ipt.TableFilter, ipt.ChainOutput, "kproxy service portals", chainServices),
}

// baseChains exist before any rule refers to them and are never deleted by
// a sync (only by Cleanup).
var baseChains = map[ipt.Table][]string{
	ipt.TableNAT:    {chainServices, chainNodePorts, chainPostrouting, chainMarkMasq, chainHairpin, chainCanary},
	ipt.TableFilter: {chainServices, chainExternalServices, chainExternalNodePort, chainNodePorts, chainFirewall, chainForward, chainLocalnetFirewall, chainCanary},
}

// ensureHooks creates the base chains and the jumps into them.
func (b *Backend) ensureHooks(ctx context.Context) error {
	for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
		for _, c := range baseChains[table] {
			if _, err := b.ipt.EnsureChain(ctx, table, ipt.Chain(c)); err != nil {
				return fmt.Errorf("ensuring chain %s/%s: %w", table, c, err)
			}
		}
	}
	return ipt.EnsureJumpRules(ctx, b.ipt, jumpRules)
}

// canaryIntact reports whether our canary chains still exist.
func (b *Backend) canaryIntact(ctx context.Context) (bool, error) {
	for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
		ok, err := b.ipt.ChainExists(ctx, table, chainCanary)
		if err != nil || !ok {
			return false, err
		}
	}
	return true, nil
}

// Sync implements proxier.Backend.
func (b *Backend) Sync(ctx context.Context, state *proxy.NodeState, full bool) (proxy.BackendResult, error) {
	logger := klog.FromContext(ctx)
	if err := state.Validate(); err != nil {
		return proxy.BackendResult{}, err
	}
	if state.IsIPv6() != b.ipv6 {
		return proxy.BackendResult{}, fmt.Errorf("iptables backend for %s given %s state", b.ipt.Protocol(), state.Family)
	}
	full = full || !b.initialized
	now := b.clock.Now()
	if !full && now.Sub(b.lastCanary) >= b.opts.CanaryInterval {
		ok, err := b.canaryIntact(ctx)
		if err != nil {
			return proxy.BackendResult{}, fmt.Errorf("checking canary chain: %w", err)
		}
		b.lastCanary = now
		if !ok {
			logger.Info("kproxy chains were flushed by someone else; doing a full sync", "family", state.Family)
			full = true
		}
	}
	err := b.sync(ctx, state, full)
	if err != nil {
		b.initialized = false
		return proxy.BackendResult{}, err
	}
	if full {
		b.initialized = true
		b.lastCanary = now
	}
	st := b.last
	return proxy.BackendResult{
		RuleCounts: map[string]int{string(ipt.TableNAT): st.NATRules, string(ipt.TableFilter): st.FilterRules},
		RulesWritten: map[string]int{
			string(ipt.TableNAT):    st.RulesWrittenByTable[ipt.TableNAT],
			string(ipt.TableFilter): st.RulesWrittenByTable[ipt.TableFilter],
		},
		ChainsWritten: st.ChainsWritten, ChainsDeleted: st.ChainsDeleted, KernelWrites: st.Restores, KernelTime: st.RestoreTime,
	}, nil
}

func (b *Backend) sync(ctx context.Context, state *proxy.NodeState, full bool) error {
	logger := klog.FromContext(ctx)
	addrs, err := b.localAddrs()
	if err != nil {
		return err
	}
	r := &renderer{ipv6: b.ipv6, clusterCIDR: state.Options.ClusterCIDR}

	// Render the services this sync concerns; the others keep what was
	// rendered before. Their own chains' rules are handed to the writer
	// lazily, rendered again only when written (a full sync writes them
	// all, batch by batch), except those of the services rendered in a
	// partial sync, which the writer compares with what it wrote.
	next := make(map[proxy.ServicePortName]*renderedService, len(state.Services))
	var fresh map[proxy.ServicePortName][]ipt.ChainRules
	if full {
		for name, st := range state.Services {
			next[name] = r.render(st)
		}
	} else {
		fresh = map[proxy.ServicePortName][]ipt.ChainRules{}
		for name, rs := range b.services {
			if _, ok := state.Services[name]; ok || !state.Changed.Has(name.NamespacedName) {
				next[name] = rs
			}
		}
		for name, st := range state.Services {
			if _, known := b.services[name]; known && !state.Changed.Has(name.NamespacedName) {
				continue
			}
			next[name] = r.render(st)
			fresh[name] = r.natChains(r.layout(st), true)
		}
	}

	if full {
		if err := b.ensureHooks(ctx); err != nil {
			return err
		}
	}
	// Each service port's chains are one group (they jump to each other);
	// the writer leaves out what did not change since its last write.
	names := proxy.SortedServicePortNames(next)
	rules := &ipt.RuleSet{Groups: make([]ipt.ChainGroup, 0, len(names))}
	for _, name := range names {
		if chains, ok := fresh[name]; ok {
			rules.AddGroup(ipt.TableNAT, chains...)
			continue
		}
		rs := next[name]
		rules.AddLazyGroup(ipt.TableNAT, rs.natChains, func() []ipt.ChainRules { return r.natChains(r.layout(rs.state), true) })
	}
	rules.Shared = b.renderGlobal(names, next, addrs)
	written, err := b.writer.Write(ctx, rules, full)
	if err != nil {
		return err
	}
	b.services = next
	stats := SyncStats{
		Full: full, WriteStats: written,
		NATRules: b.writer.RuleCount(ipt.TableNAT), FilterRules: b.writer.RuleCount(ipt.TableFilter),
	}
	b.last = stats
	logger.V(2).Info("Synced iptables rules", "family", state.Family, "full", full, "services", len(next),
		"restores", stats.Restores, "chainsWritten", stats.ChainsWritten, "chainsDeleted", stats.ChainsDeleted,
		"rulesWritten", stats.RulesWritten, "bytes", stats.Bytes)
	return nil
}

func isBaseChain(table ipt.Table, chain string) bool {
	for _, c := range baseChains[table] {
		if c == chain {
			return true
		}
	}
	return false
}

// renderGlobal renders the chains shared by all services from the rendered
// services, in names order.
func (b *Backend) renderGlobal(names []proxy.ServicePortName, services map[proxy.ServicePortName]*renderedService, addrs []netip.Addr) map[ipt.Table]map[string][]string {
	var natSvc, natNP, filSvc, filExt []dispatchRule
	var extNP, firewall, health []string
	hairpin := map[netip.Addr]bool{}
	for _, n := range names {
		rs := services[n]
		natSvc = append(natSvc, rs.natServices...)
		natNP = append(natNP, rs.natNodePorts...)
		filSvc = append(filSvc, rs.filterServices...)
		filExt = append(filExt, rs.filterExternal...)
		extNP = append(extNP, rs.filterExtNodePorts...)
		firewall = append(firewall, rs.filterFirewall...)
		health = append(health, rs.filterHealthCheck...)
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
	extTail := []string{comment("kproxy node ports without endpoints") + " -m addrtype --dst-type LOCAL -j " + chainExternalNodePort}

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
	nat[chainCanary] = nil

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
	filter[chainCanary] = nil
	return map[ipt.Table]map[string][]string{ipt.TableNAT: nat, ipt.TableFilter: filter}
}

// Cleanup implements proxier.Backend with cleanup.Cleanup over iptables
// alone: every chain of kproxy's (KPROXY-, of either mode) in nat and
// filter, with the rules of other chains that jump to them. Chains and
// rules of anyone else stay. Running it again changes nothing.
func (b *Backend) Cleanup(ctx context.Context) error {
	err := cleanup.Cleanup(ctx, cleanup.Options{IPTables: b.ipt})
	b.initialized = false
	b.services = map[proxy.ServicePortName]*renderedService{}
	b.writer.Forget()
	return err
}
