// Package iptables is kproxy's iptables backend: it renders the node's
// desired state into nat and filter rules and applies them with
// iptables-restore --noflush, table by table in an order in which every
// prefix is safe (docs/design.md, "Atomic syncs across tables"), setting
// aside the service ports whose rules the kernel refuses (docs/design.md,
// "Set-aside services").
package iptables

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// DefaultCanaryInterval is Options.CanaryInterval's default.
const DefaultCanaryInterval = 30 * time.Second

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
	// CanaryInterval bounds how long a flush of kproxy's chains or hooks
	// by someone else goes unnoticed: a partial sync first checks the
	// canary chains and the hooks (docs/design.md, "Flush detection") when
	// the last check is at least half of it old, so that a node syncing
	// every CanaryInterval checks at every sync. Default
	// DefaultCanaryInterval (the command sets the sync period).
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
	// Attempts is the number of writes of the rule set the sync made: one,
	// plus one per service port set aside or bisection step.
	Attempts int
	// SetAside counts the service ports set aside after the sync.
	SetAside int
}

// Backend implements proxier.Backend with iptables.
type Backend struct {
	ipt      ipt.Interface
	ipv6     bool
	opts     Options
	masqMark string // e.g. 0x4000
	clock    clock.PassiveClock

	// services is what was last applied, per service port: for a port set
	// aside, its last good rules (absent when it never had any).
	services map[proxy.ServicePortName]*renderedService
	// setAside are the ports whose rules the kernel refused, with the
	// refusal; they keep services' rules until they change or a full sync
	// (docs/design.md, "Set-aside services").
	setAside map[proxy.ServicePortName]error
	// natWriter and filterWriter write each table's chains and remember
	// what they last wrote; one restore never holds both tables.
	natWriter, filterWriter *ipt.Writer
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
		opts.CanaryInterval = DefaultCanaryInterval
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.LocalAddresses == nil {
		opts.LocalAddresses = netlink.HostAddresses
	}
	// Base chains are never deleted by a sync (only by Cleanup).
	owned := func(table ipt.Table, chain string) bool { return isOwnedChain(chain) && !isBaseChain(table, chain) }
	natWriter, err := ipt.NewWriter(ipt.WriterOptions{IPTables: opts.IPTables, Owned: owned, BatchChains: opts.BatchChains, Tables: []ipt.Table{ipt.TableNAT}})
	if err != nil {
		return nil, fmt.Errorf("iptables backend: %w", err)
	}
	filterWriter, err := ipt.NewWriter(ipt.WriterOptions{IPTables: opts.IPTables, Owned: owned, Tables: []ipt.Table{ipt.TableFilter}})
	if err != nil {
		return nil, fmt.Errorf("iptables backend: %w", err)
	}
	return &Backend{
		natWriter:    natWriter,
		filterWriter: filterWriter,
		setAside:     map[proxy.ServicePortName]error{},
		ipt:          opts.IPTables,
		ipv6:         opts.IPTables.Protocol() == ipt.ProtocolIPv6,
		opts:         opts,
		masqMark:     fmt.Sprintf("%#x", uint32(1)<<bit),
		clock:        opts.Clock,
		services:     map[proxy.ServicePortName]*renderedService{},
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

// canaryRule is the one rule of each table's canary chain: an empty
// canary chain means someone flushed the table (iptables -F), a missing one
// that they deleted its chains too (-X).
var canaryRule = comment("kproxy canary: empty or missing means this table was flushed") + " -j RETURN"

// hookJumps counts, per table and chain of kproxy's, the hooks (jumpRules)
// that jump to it.
var hookJumps = func() map[ipt.Table]map[string]int {
	out := map[ipt.Table]map[string]int{}
	for _, j := range jumpRules {
		if out[j.Table] == nil {
			out[j.Table] = map[string]int{}
		}
		out[j.Table][j.Args[len(j.Args)-1]]++
	}
	return out
}()

// flushed checks, with one read of the kernel's chain use counts per
// table, that every chain of kproxy's last write still holds its rules and
// the jumps to it, the hooks included (docs/design.md, "Flush
// detection"). It returns the damaged chains, none when nothing is.
func (b *Backend) flushed(ctx context.Context) ([]ipt.ChainDamage, error) {
	var out []ipt.ChainDamage
	for _, w := range []*ipt.Writer{b.natWriter, b.filterWriter} {
		damaged, err := w.Verify(ctx, hookJumps)
		if err != nil {
			return nil, err
		}
		out = append(out, damaged...)
	}
	return out, nil
}

// describeDamage sums damaged up for a log line: whether a canary chain
// (so a whole table) was hit, and the first few chains.
func describeDamage(damaged []ipt.ChainDamage) (tablesFlushed []string, chains []string) {
	const shown = 10
	for _, d := range damaged {
		if d.Chain == chainCanary {
			tablesFlushed = append(tablesFlushed, string(d.Table))
		}
		if len(chains) < shown {
			chains = append(chains, d.String())
		}
	}
	return tablesFlushed, chains
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
	asked := full
	full = full || !b.initialized
	now := b.clock.Now()
	if !full && now.Sub(b.lastCanary) >= b.opts.CanaryInterval/2 {
		damaged, err := b.flushed(ctx)
		if err != nil {
			return proxy.BackendResult{}, fmt.Errorf("checking for a flush: %w", err)
		}
		b.lastCanary = now
		if len(damaged) > 0 {
			tables, chains := describeDamage(damaged)
			logger.Info("kproxy's rules were flushed or deleted by someone else; doing a full sync", "family", state.Family,
				"tablesFlushed", tables, "damagedChains", len(damaged), "damaged", chains)
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
	res := proxy.BackendResult{
		RuleCounts: map[string]int{string(ipt.TableNAT): st.NATRules, string(ipt.TableFilter): st.FilterRules},
		RulesWritten: map[string]int{
			string(ipt.TableNAT):    st.RulesWrittenByTable[ipt.TableNAT],
			string(ipt.TableFilter): st.RulesWrittenByTable[ipt.TableFilter],
		},
		ChainsWritten: st.ChainsWritten, ChainsDeleted: st.ChainsDeleted, KernelWrites: st.Restores, KernelTime: st.RestoreTime,
		Full: full && !asked,
	}
	if len(b.setAside) > 0 {
		res.SetAside = maps.Clone(b.setAside)
	}
	return res, nil
}

func isBaseChain(table ipt.Table, chain string) bool {
	for _, c := range baseChains[table] {
		if c == chain {
			return true
		}
	}
	return false
}

// Cleanup implements proxier.Backend with cleanup.Cleanup over iptables
// alone: every chain of kproxy's (KPROXY-, of either mode) in nat and
// filter, with the rules of other chains that jump to them. Chains and
// rules of anyone else stay. Running it again changes nothing.
func (b *Backend) Cleanup(ctx context.Context) error {
	err := cleanup.Cleanup(ctx, cleanup.Options{IPTables: b.ipt})
	b.initialized = false
	b.services = map[proxy.ServicePortName]*renderedService{}
	b.setAside = map[proxy.ServicePortName]error{}
	b.natWriter.Forget()
	b.filterWriter.Forget()
	return err
}
