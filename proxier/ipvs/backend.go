// Package ipvs is kproxy's IPVS backend: every ClusterIP, ExternalIP,
// LoadBalancer VIP and node port is an IPVS virtual server whose real
// servers are the service's endpoints; the VIPs are bound to a dummy device
// so that their packets are local and reach IPVS; a small, constant set of
// iptables rules matching ipsets decides masquerading, Local-policy drops
// and loadBalancerSourceRanges. Because the VIPs are local addresses, a
// host process listening on a wildcard address would answer on every VIP
// at its own port: KPROXY-IPVS-FILTER (filter INPUT) rejects new
// connections to an address of the KPROXY-IPVS-IPS set (every address on
// the dummy device) unless its (address, protocol:port) is a ClusterIP,
// ExternalIP or LoadBalancer service port, as upstream's KUBE-IPVS-FILTER.
//
// # What kproxy owns
//
// kproxy touches only what it created:
//   - the dummy device (DefaultDummyDevice) and the addresses on it;
//   - the ipsets named in cleanup.IPVSSetNames;
//   - iptables chains starting with ChainPrefix and the jumps to them;
//   - IPVS virtual servers that are its own: a virtual server is kproxy's
//     when this backend created (or adopted, being one a Service wants) it,
//     or when its (address, protocol, port) is recorded in the sets kproxy
//     last wrote (KPROXY-CLUSTER-IP, -EXTERNAL-IP, -LOAD-BALANCER,
//     -NODE-PORT). A sync adds a virtual server's entry before creating it
//     and removes the entry after deleting it, so a restarted kproxy
//     recognises everything its predecessor left. Any other virtual server
//     (another address, a VIP's address at a port no Service uses, or a
//     node address and port that no Service uses) is foreign and never
//     changed or deleted, by a sync or by Cleanup. A full sync also leaves
//     alone virtual servers inside Options.ExcludeCIDRs.
//
// # Deviations from upstream kube-proxy's IPVS mode
//
// Ownership is by (address, protocol, port), not by "address bound to
// the dummy device": a virtual server someone else put on a ClusterIP's
// address at another port survives. Node ports are hash:ip,port sets of (node address, protocol:port) instead
// of bitmap:port sets: they match exactly the addresses that have node-port
// virtual servers (so --nodeport-addresses is honoured by the rules too) and
// give a precise ownership record. Upstream flushes every IPVS virtual server
// on cleanup; kproxy removes only its own. Pods and the node reaching an
// external destination of an externalTrafficPolicy=Local service are
// short-circuited to the cluster endpoints, as in iptables mode: a DNAT to
// the ClusterIP virtual server (upstream IPVS mode sends them to the local
// endpoints only). When internalTrafficPolicy is Local too, that virtual
// server has the local endpoints only, so the short circuit goes instead to
// a nat chain of the port's own (KPROXY-IPVS-CL-<hash>) that DNATs to the
// cluster endpoints with statistic rules, as iptables mode does; with
// ClientIP affinity it keeps using the ClusterIP virtual server (local
// endpoints), whose persistence those rules could not give.
//
// # Faults
//
// A service port whose state the kernel refuses is set aside with its last
// good state while the sync programs everything else, and a partial sync
// first checks, at a fixed cost, that nobody flushed the virtual servers,
// the sets or the dummy device's addresses (docs/design.md, "IPVS mode
// under faults").
package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// DefaultGracefulTerminationTimeout bounds how long a removed TCP or SCTP
// real server is kept at weight 0 waiting for its connections to end.
const DefaultGracefulTerminationTimeout = 15 * time.Minute

// Options configures a Backend. The four kernel interfaces and Sysctl are
// required; the rest have kube-proxy's defaults.
type Options struct {
	IPVS     ipvs.Interface
	Netlink  netlink.Interface
	IPSet    ipset.Interface
	IPTables ipt.Interface
	// Sysctl sets the kernel parameters IPVS mode needs (ProcSysctl for
	// the node).
	Sysctl Sysctl
	// Scheduler is the IPVS scheduler of every virtual server; default
	// "rr".
	Scheduler string
	// StrictARP sets arp_ignore=1 and arp_announce=2, so that the node does
	// not answer ARP for the addresses on the dummy device.
	StrictARP bool
	// Timeouts are the IPVS TCP, TCP FIN and UDP timeouts; zero fields
	// leave the kernel's values.
	Timeouts ipvs.Timeouts
	// ExcludeCIDRs: a full sync never deletes a virtual server inside them.
	ExcludeCIDRs []netip.Prefix
	// MasqueradeBit is the fwmark bit (0-31) that asks for SNAT; default 14.
	MasqueradeBit *int
	// NodePortAddresses selects the local addresses that accept node ports
	// (--nodeport-addresses, this family); nil means every local address.
	// Loopback addresses never do.
	NodePortAddresses *proxy.NodePortAddresses
	// DummyDevice holds the VIPs; default DefaultDummyDevice.
	DummyDevice string
	// GracefulTerminationTimeout: default DefaultGracefulTerminationTimeout.
	GracefulTerminationTimeout time.Duration
	// CanaryInterval bounds how long an address removed from the dummy
	// device goes unnoticed: a partial sync lists the device's addresses
	// (the one check whose cost grows with the services) when the last
	// listing is at least half of it old, so that a node syncing every
	// CanaryInterval lists them at every sync; the other checks run at
	// every partial sync (checkIntact). Default DefaultCanaryInterval (the
	// command sets the sync period).
	CanaryInterval time.Duration
	Clock          clock.PassiveClock
}

// DefaultCanaryInterval is Options.CanaryInterval's default.
const DefaultCanaryInterval = 30 * time.Second

// SyncStats counts what the last sync did to the kernel, for logs and
// tests.
type SyncStats struct {
	Full                                                        bool
	ServicesAdded, ServicesUpdated, ServicesDeleted             int
	DestinationsAdded, DestinationsUpdated, DestinationsDeleted int
	EntriesAdded, EntriesDeleted                                int
	AddressesBound, AddressesUnbound                            int
	Restores                                                    int
	// VirtualServers is the number of virtual servers kproxy wants;
	// Terminating the real servers waiting at weight 0.
	VirtualServers, Terminating int
	// Errors is the number of failures that failed the sync; SetAside the
	// service ports it set aside (their refusals did not fail it).
	Errors, SetAside int
	// Repaired, when not empty, says what the check of a partial sync
	// found changed behind kproxy's back (checkIntact): the sync was made
	// full to repair it.
	Repaired string
	Duration time.Duration
}

// Backend implements proxier.Backend with IPVS, for one IP family.
type Backend struct {
	opts     Options
	ipvs     ipvs.Interface
	nl       netlink.Interface
	ipset    ipset.Interface
	ipt      ipt.Interface
	ipv6     bool
	device   string
	masqMark string
	clock    clock.PassiveClock

	// initialized is true after a full sync without errors; false makes
	// the next sync full.
	initialized bool
	// What was last applied.
	plans     map[proxy.ServicePortName]*servicePlan
	vsWanted  map[vsKey]*virtualServer
	vsOwner   map[vsKey]proxy.ServicePortName
	contested map[vsKey]bool // wanted by more than one service port
	addrRefs  map[netip.Addr]int
	entryRefs map[setEntry]int
	// ours are the virtual servers this backend created or adopted and has
	// not deleted: the in-memory ownership record.
	ours map[vsKey]bool
	// applied holds the scheduler and persistence each virtual server got
	// from kproxy.
	applied     map[vsKey]ipvs.Service
	terminating map[vsKey]*termVS
	// writer writes IPVS mode's chains and remembers them.
	writer     *ipt.Writer
	ruleCounts map[string]int
	// nodePortAddrs and localAddrs as of the last sync.
	nodePortAddrs, localAddrs []netip.Addr
	// decisionOpts are the node-wide options of the last state synced.
	decisionOpts proxy.DecisionOptions
	// setAside are the service ports whose latest plan the kernel
	// refused; plans holds their last good one (or nothing). A partial
	// sync retries one when its service changes.
	setAside map[proxy.ServicePortName]bool
	// addrsListed is when the dummy device's addresses were last listed
	// (a full sync, or checkAddresses).
	addrsListed time.Time
	last        SyncStats
}

// termVS holds the real servers of one virtual server that wait at weight
// 0 for their connections to end, with the time each started waiting.
type termVS struct {
	svc   ipvs.Service
	since map[destKey]time.Time
}

var _ proxier.Backend = (*Backend)(nil)

// New validates opts and returns a Backend. It touches nothing.
func New(opts Options) (*Backend, error) {
	switch {
	case opts.IPVS == nil:
		return nil, errors.New("ipvs backend: IPVS is required")
	case opts.Netlink == nil:
		return nil, errors.New("ipvs backend: Netlink is required")
	case opts.IPSet == nil:
		return nil, errors.New("ipvs backend: IPSet is required")
	case opts.IPTables == nil:
		return nil, errors.New("ipvs backend: IPTables is required")
	case opts.Sysctl == nil:
		return nil, errors.New("ipvs backend: Sysctl is required")
	}
	if opts.Scheduler == "" {
		opts.Scheduler = ipvs.DefaultScheduler
	}
	if err := ValidateScheduler(opts.Scheduler); err != nil {
		return nil, fmt.Errorf("ipvs backend: %w", err)
	}
	bit := 14
	if opts.MasqueradeBit != nil {
		bit = *opts.MasqueradeBit
	}
	if bit < 0 || bit > 31 {
		return nil, fmt.Errorf("ipvs backend: masquerade bit %d out of range 0-31", bit)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"TCP", opts.Timeouts.TCP}, {"TCP FIN", opts.Timeouts.TCPFin}, {"UDP", opts.Timeouts.UDP}} {
		if d.v < 0 || d.v%time.Second != 0 {
			return nil, fmt.Errorf("ipvs backend: %s timeout %v must be a non-negative whole number of seconds", d.name, d.v)
		}
	}
	if opts.DummyDevice == "" {
		opts.DummyDevice = DefaultDummyDevice
	}
	if opts.GracefulTerminationTimeout <= 0 {
		opts.GracefulTerminationTimeout = DefaultGracefulTerminationTimeout
	}
	if opts.CanaryInterval <= 0 {
		opts.CanaryInterval = DefaultCanaryInterval
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	writer, err := ipt.NewWriter(ipt.WriterOptions{
		IPTables: opts.IPTables,
		Tables:   ipvsTables,
		Owned:    func(_ ipt.Table, chain string) bool { return cleanup.IsIPVSChain(chain) },
	})
	if err != nil {
		return nil, fmt.Errorf("ipvs backend: %w", err)
	}
	b := &Backend{
		writer:   writer,
		opts:     opts,
		ipvs:     opts.IPVS,
		nl:       opts.Netlink,
		ipset:    opts.IPSet,
		ipt:      opts.IPTables,
		ipv6:     opts.IPTables.Protocol() == ipt.ProtocolIPv6,
		device:   opts.DummyDevice,
		masqMark: fmt.Sprintf("%#x", uint32(1)<<bit),
		clock:    opts.Clock,
	}
	b.reset()
	return b, nil
}

// reset forgets what was applied (not the ownership record).
func (b *Backend) reset() {
	b.initialized = false
	b.plans = map[proxy.ServicePortName]*servicePlan{}
	b.vsWanted = map[vsKey]*virtualServer{}
	b.vsOwner = map[vsKey]proxy.ServicePortName{}
	b.contested = map[vsKey]bool{}
	b.addrRefs = map[netip.Addr]int{}
	// The canary entry is always wanted (checkIntact).
	b.entryRefs = map[setEntry]int{canaryEntry(b.ipv6): 1}
	b.applied = map[vsKey]ipvs.Service{}
	if b.ours == nil {
		b.ours = map[vsKey]bool{}
	}
	if b.terminating == nil {
		b.terminating = map[vsKey]*termVS{}
	}
	if b.setAside == nil {
		b.setAside = map[proxy.ServicePortName]bool{}
	}
	b.writer.Forget()
}

// ValidateScheduler checks that name could be an IPVS scheduler (lower-case
// letters and digits, as the kernel's ip_vs_<name> modules are named).
func ValidateScheduler(name string) error {
	if name == "" || len(name) > 15 {
		return fmt.Errorf("invalid IPVS scheduler name %q", name)
	}
	for _, c := range name {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return fmt.Errorf("invalid IPVS scheduler name %q", name)
		}
	}
	return nil
}

// LastSync returns what the last sync did.
func (b *Backend) LastSync() SyncStats { return b.last }

// RuleCounts are the iptables rules IPVS mode owns, by table.
func (b *Backend) RuleCounts() map[string]int { return b.ruleCounts }

// PendingTerminations is the number of real servers waiting at weight 0.
func (b *Backend) PendingTerminations() int {
	n := 0
	for _, t := range b.terminating {
		n += len(t.since)
	}
	return n
}

// addresses returns this family's local addresses outside the dummy
// device (loopback excluded) and those of them that take node ports.
func (b *Backend) addresses(ctx context.Context) (local, nodePort []netip.Addr, err error) {
	all, err := b.nl.LocalAddresses(ctx, b.device)
	if err != nil {
		return nil, nil, fmt.Errorf("listing local addresses: %w", err)
	}
	for _, a := range all {
		if a.Is6() != b.ipv6 || a.Is4In6() || a.IsLoopback() || a.IsUnspecified() {
			continue
		}
		local = append(local, a)
	}
	return local, b.opts.NodePortAddresses.Select(local), nil
}

// Sync implements proxier.Backend.
func (b *Backend) Sync(ctx context.Context, state *proxy.NodeState, full bool) (proxy.BackendResult, error) {
	if err := state.Validate(); err != nil {
		return proxy.BackendResult{}, err
	}
	if state.IsIPv6() != b.ipv6 {
		return proxy.BackendResult{}, fmt.Errorf("ipvs backend for %s given %s state", b.ipt.Protocol(), state.Family)
	}
	logger := klog.FromContext(ctx)
	start := b.clock.Now()
	local, nodePort, err := b.addresses(ctx)
	if err != nil {
		b.initialized = false
		return proxy.BackendResult{}, err
	}
	asked := full
	full = full || !b.initialized || !slices.Equal(local, b.localAddrs) || !slices.Equal(nodePort, b.nodePortAddrs) ||
		b.decisionOpts != state.Options
	var st SyncStats
	if !full {
		if found := b.checkIntact(ctx); found != "" {
			logger.Info("kproxy's IPVS state was changed behind its back; repairing it with a full sync", "family", state.Family, "found", found)
			full, st.Repaired = true, found
		}
	}
	b.decisionOpts = state.Options
	r := &renderer{ipv6: b.ipv6, scheduler: b.opts.Scheduler, nodePortAddrs: nodePort, localAddrs: local}
	st.Full = full
	var refused map[proxy.ServicePortName]error
	var errs []error
	if full {
		refused, errs = b.fullSync(ctx, state, r, &st)
	} else {
		refused, errs = b.partialSync(ctx, state, r, &st)
	}
	b.localAddrs, b.nodePortAddrs = local, nodePort
	st.VirtualServers = len(b.vsWanted)
	st.Terminating = b.PendingTerminations()
	st.Errors, st.SetAside = len(errs), len(refused)
	st.Duration = b.clock.Since(start)
	b.last = st
	if len(errs) > 0 {
		b.initialized = false
		return proxy.BackendResult{}, fmt.Errorf("ipvs sync (%d errors): %w", len(errs), errors.Join(errs...))
	}
	if full {
		b.initialized = true
		clear(b.setAside)
	} else {
		for name := range b.setAside {
			if state.Changed.Has(name.NamespacedName) {
				delete(b.setAside, name) // retried: set aside again below if refused
			}
		}
	}
	for name := range refused {
		b.setAside[name] = true
	}
	logger.V(2).Info("Synced IPVS", "family", state.Family, "full", full, "servicePorts", len(b.plans),
		"virtualServers", st.VirtualServers, "servicesAdded", st.ServicesAdded, "servicesDeleted", st.ServicesDeleted,
		"destinationsAdded", st.DestinationsAdded, "destinationsDeleted", st.DestinationsDeleted,
		"entriesAdded", st.EntriesAdded, "entriesDeleted", st.EntriesDeleted, "terminating", st.Terminating, "setAside", st.SetAside)
	return proxy.BackendResult{
		RuleCounts: b.ruleCounts,
		KernelWrites: st.ServicesAdded + st.ServicesUpdated + st.ServicesDeleted + st.DestinationsAdded + st.DestinationsUpdated +
			st.DestinationsDeleted + st.EntriesAdded + st.EntriesDeleted + st.AddressesBound + st.AddressesUnbound + st.Restores,
		KernelTime: st.Duration,
		SetAside:   refused,
		// A repair (or changed addresses) made the sync full: the engine
		// then treats it as one (set-aside retries, black-holed flows).
		Full: full && !asked,
	}, nil
}

// sysctls IPVS mode needs: conntrack for IPVS connections (iptables
// MASQUERADE and the conntrack matches work on them), forwarding,
// dropping connections whose real server is gone, and expiring persistence
// templates of quiesced real servers.
var sysctls = [][2]string{
	{"net.ipv4.vs.conntrack", "1"},
	{"net.ipv4.ip_forward", "1"},
	{"net.ipv4.vs.expire_nodest_conn", "1"},
	{"net.ipv4.vs.expire_quiescent_template", "1"},
}

var strictARPSysctls = [][2]string{
	{"net.ipv4.conf.all.arp_ignore", "1"},
	{"net.ipv4.conf.all.arp_announce", "2"},
}

// setSysctls sets what IPVS mode needs; a read-only /proc/sys is logged
// and tolerated.
func (b *Backend) setSysctls(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	want := sysctls
	if b.opts.StrictARP {
		want = append(append([][2]string{}, sysctls...), strictARPSysctls...)
	}
	for _, kv := range want {
		if v, err := b.opts.Sysctl.Get(kv[0]); err == nil && v == kv[1] {
			continue
		}
		if err := b.opts.Sysctl.Set(kv[0], kv[1]); err != nil {
			if errors.Is(err, syscall.EROFS) {
				logger.Info("Warning: cannot set a sysctl IPVS mode needs: /proc/sys is read-only", "sysctl", kv[0], "want", kv[1])
				continue
			}
			return err
		}
		logger.V(2).Info("Set sysctl", "sysctl", kv[0], "value", kv[1])
	}
	return nil
}

// prepare does what every full sync starts with: sysctls, IPVS timeouts,
// the dummy device and the sets.
func (b *Backend) prepare(ctx context.Context) error {
	if err := b.setSysctls(ctx); err != nil {
		return err
	}
	if t := b.opts.Timeouts; t.TCP != 0 || t.TCPFin != 0 || t.UDP != 0 {
		if err := b.ipvs.SetTimeouts(ctx, t); err != nil {
			return err
		}
	}
	if _, err := b.nl.EnsureDummyDevice(ctx, b.device); err != nil {
		return fmt.Errorf("ensuring dummy device: %w", err)
	}
	for _, d := range cleanup.IPVSSets() {
		if err := b.ipset.EnsureSet(ctx, ipset.Set{Name: setName(d.Name, b.ipv6), Type: d.Type, IPv6: b.ipv6, Comment: d.Comment}); err != nil {
			return fmt.Errorf("ensuring ipset: %w", err)
		}
	}
	return nil
}

// refCounts tracks reference transitions of addresses or set entries
// during one sync: what was first seen at zero and ends positive must be
// added, the reverse removed.
type refCounts[K comparable] struct {
	refs   map[K]int
	before map[K]int
}

func (c *refCounts[K]) touch(k K) {
	if _, ok := c.before[k]; !ok {
		c.before[k] = c.refs[k]
	}
}

func (c *refCounts[K]) inc(k K) { c.touch(k); c.refs[k]++ }

func (c *refCounts[K]) dec(k K) {
	c.touch(k)
	if c.refs[k]--; c.refs[k] <= 0 {
		delete(c.refs, k)
	}
}

// changes returns what went from zero to positive and back.
func (c *refCounts[K]) changes() (added, removed []K) {
	for k, n := range c.before {
		switch after := c.refs[k]; {
		case n == 0 && after > 0:
			added = append(added, k)
		case n > 0 && after == 0:
			removed = append(removed, k)
		}
	}
	return added, removed
}

// addPlan records p's virtual servers, addresses and entries as wanted by
// name; it returns the virtual servers name now owns.
func (b *Backend) addPlan(ctx context.Context, name proxy.ServicePortName, p *servicePlan, addrs *refCounts[netip.Addr], entries *refCounts[setEntry]) []*virtualServer {
	var owned []*virtualServer
	for _, v := range p.vs {
		k := keyOf(&v.svc)
		if other, ok := b.vsOwner[k]; ok && other != name {
			// A full sync adds plans in name order, so the first by name
			// keeps it; a partial sync calls resolveContested afterwards.
			klog.FromContext(ctx).Error(nil, "Two service ports want the same IPVS virtual server; the first by name gets it",
				"virtualServer", k, "servicePorts", []string{other.String(), name.String()})
			b.contested[k] = true
			continue
		}
		b.vsOwner[k] = name
		b.vsWanted[k] = v
		owned = append(owned, v)
	}
	for _, a := range p.addrs {
		addrs.inc(a)
	}
	for _, e := range p.entries {
		entries.inc(e)
	}
	return owned
}

// removePlan forgets p as wanted by name; it returns the virtual servers
// name owned.
func (b *Backend) removePlan(name proxy.ServicePortName, p *servicePlan, addrs *refCounts[netip.Addr], entries *refCounts[setEntry]) []vsKey {
	var owned []vsKey
	for _, v := range p.vs {
		k := keyOf(&v.svc)
		if b.vsOwner[k] == name {
			delete(b.vsOwner, k)
			delete(b.vsWanted, k)
			owned = append(owned, k)
		}
	}
	for _, a := range p.addrs {
		addrs.dec(a)
	}
	for _, e := range p.entries {
		entries.dec(e)
	}
	return owned
}

// resolveContested gives each contested virtual server of keys to the
// first, by name, of the service ports whose plans want it (as a full
// sync, which adds plans in name order, does) and forgets the contest once
// one service port or none wants it. It returns the virtual servers that
// changed owner.
func (b *Backend) resolveContested(keys map[vsKey]bool) []*virtualServer {
	var moved []*virtualServer
	for k := range keys {
		if !b.contested[k] {
			continue
		}
		var owner proxy.ServicePortName
		var want *virtualServer
		claimants := 0
		for name, p := range b.plans {
			for _, v := range p.vs {
				if keyOf(&v.svc) == k {
					claimants++
					if want == nil || name.Compare(owner) < 0 {
						owner, want = name, v
					}
				}
			}
		}
		if claimants < 2 {
			delete(b.contested, k)
		}
		if want == nil || b.vsWanted[k] == want {
			continue
		}
		b.vsOwner[k], b.vsWanted[k] = owner, want
		moved = append(moved, want)
	}
	return moved
}

// shortcutRules are the shortcut rules of every plan, in name order; a
// plan of override replaces the port's own (nil: none).
func (b *Backend) shortcutRules(override map[proxy.ServicePortName]*servicePlan) []string {
	names := proxy.SortedServicePortNames(b.plans)
	if len(override) > 0 {
		for n := range override {
			if _, ok := b.plans[n]; !ok {
				names = append(names, n)
			}
		}
		slices.SortFunc(names, proxy.ServicePortName.Compare)
	}
	var out []string
	for _, n := range names {
		p, ok := override[n]
		if !ok {
			p = b.plans[n]
		}
		if p != nil {
			out = append(out, p.shortcut...)
		}
	}
	return out
}

// fullSync rewrites everything from state and removes what kproxy owns and
// no longer wants. A service port whose objects the kernel refuses is set
// aside with the plan it had before (refused); errs are the failures that
// are not any one service port's.
func (b *Backend) fullSync(ctx context.Context, state *proxy.NodeState, r *renderer, st *SyncStats) (refused map[proxy.ServicePortName]error, errs []error) {
	logger := klog.FromContext(ctx)
	if err := b.prepare(ctx); err != nil {
		return nil, []error{err}
	}
	// Ownership evidence and the kernel's state, read before anything
	// changes.
	bound, err := b.boundAddresses(ctx)
	if err != nil {
		return nil, []error{err}
	}
	b.addrsListed = b.clock.Now()
	recorded, err := recordedVS(ctx, b.ipset, b.ipv6)
	if err != nil {
		return nil, []error{err}
	}
	kernel, err := b.kernelServices(ctx)
	if err != nil {
		return nil, []error{err}
	}
	haveEntries, err := b.kernelEntries(ctx)
	if err != nil {
		return nil, []error{err}
	}

	prev, ours, terminating := b.plans, b.ours, b.terminating
	b.reset()
	b.ours, b.terminating = ours, terminating
	tx := b.newTxn(true)
	for _, name := range proxy.SortedServicePortNames(state.Services) {
		p := r.render(state.Services[name])
		if p == nil {
			logger.V(2).Info("Skipping service port with a protocol IPVS cannot carry", "servicePort", name.String(), "protocol", name.Protocol)
			continue
		}
		tx.changed = append(tx.changed, name)
		tx.old[name] = prev[name]
		b.plans[name] = p
		b.addPlan(ctx, name, p, tx.addrs, tx.entries)
	}

	// The rules first, so that a newly bound address is covered by the
	// filter that rejects its other ports from the start.
	if err := tx.writeRules(ctx, st); err != nil {
		return nil, []error{err}
	}
	// Set entries are added before the addresses and virtual servers they
	// record and removed after them; addresses are bound before the
	// virtual servers, so that a new virtual server's packets are local.
	var addEntries []setEntry
	for e := range b.entryRefs {
		if !haveEntries[e] {
			addEntries = append(addEntries, e)
		}
	}
	slices.SortFunc(addEntries, compareSetEntries)
	errs = append(errs, tx.addEntries(ctx, addEntries, st)...)
	var bind []netip.Addr
	for _, a := range sortedAddrs(b.addrRefs) {
		if !bound[a] {
			bind = append(bind, a)
		}
	}
	errs = append(errs, tx.bindAddresses(ctx, bind, st)...)
	// Every wanted virtual server; a port set aside meanwhile brings its
	// old ones back, which the next round ensures.
	done := map[vsKey]bool{}
	for {
		var keys []vsKey
		for k := range b.vsWanted {
			if !done[k] {
				keys = append(keys, k)
			}
		}
		if len(keys) == 0 {
			break
		}
		slices.SortFunc(keys, compareKeys)
		for _, k := range keys {
			done[k] = true
			if v := b.vsWanted[k]; v != nil {
				if err := tx.grow(ctx, k, v, kernel[k], st); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	// Ports set aside since the rules were written take back their old
	// rules.
	if err := tx.writeRules(ctx, st); err != nil {
		errs = append(errs, err)
	}

	errs = append(errs, tx.shrinkVS(ctx, st)...)
	for k, svc := range kernel {
		if _, ok := b.vsWanted[k]; ok || tx.grown[k] != nil {
			continue
		}
		if !b.ours[k] && !recorded[k] {
			logger.V(4).Info("Leaving foreign IPVS virtual server alone", "virtualServer", k)
			continue
		}
		if b.excluded(k.addr) {
			logger.V(2).Info("Not deleting IPVS virtual server inside --ipvs-exclude-cidrs", "virtualServer", k)
			continue
		}
		if err := b.deleteVS(ctx, svc, st); err != nil {
			b.ours[k] = true // its set entry goes: remember it here
			errs = append(errs, err)
		}
	}
	for k := range b.terminating {
		if _, ok := kernel[k]; !ok {
			if _, ok := b.vsWanted[k]; !ok {
				delete(b.terminating, k)
			}
		}
	}
	errs = append(errs, tx.unbindUnwanted(ctx, bound, st)...)
	errs = append(errs, tx.deleteUnwanted(ctx, haveEntries, st)...)
	return tx.setAsideResult(), errs
}

// partialSync rewrites only the services in state.Changed (and services it
// has not seen, unless they were set aside), then looks after terminating
// real servers. Refusals are handled as in fullSync.
func (b *Backend) partialSync(ctx context.Context, state *proxy.NodeState, r *renderer, st *SyncStats) (refused map[proxy.ServicePortName]error, errs []error) {
	logger := klog.FromContext(ctx)
	changed := func(n types.NamespacedName) bool { return state.Changed.Has(n) }
	tx := b.newTxn(false)
	for name := range b.plans {
		if _, ok := state.Services[name]; !ok && changed(name.NamespacedName) {
			tx.changed = append(tx.changed, name)
		}
	}
	for name := range state.Services {
		// A port set aside is retried when its service changes (or on
		// a full sync), not on every sync.
		if _, known := b.plans[name]; (!known && !b.setAside[name]) || changed(name.NamespacedName) {
			tx.changed = append(tx.changed, name)
		}
	}
	slices.SortFunc(tx.changed, proxy.ServicePortName.Compare)
	tx.changed = slices.Compact(tx.changed)

	plans := make([]*servicePlan, len(tx.changed))
	for i, name := range tx.changed {
		if s, ok := state.Services[name]; ok {
			if plans[i] = r.render(s); plans[i] == nil {
				logger.V(2).Info("Skipping service port with a protocol IPVS cannot carry", "servicePort", name.String())
			}
		}
		tx.old[name] = b.plans[name]
	}
	// Every old plan goes before any new one comes: a virtual server that
	// passes from one changed service port to another in this sync (a
	// renamed port, a node port or an ExternalIP moved) must find its old
	// owner gone, or addPlan would take it for contested and the new owner
	// would lose it until a full sync.
	claimed := map[vsKey]bool{} // every virtual server the changed plans want or wanted
	var remove []vsKey
	for _, name := range tx.changed {
		if old := tx.old[name]; old != nil {
			for _, v := range old.vs {
				claimed[keyOf(&v.svc)] = true
			}
			remove = append(remove, b.removePlan(name, old, tx.addrs, tx.entries)...)
			delete(b.plans, name)
		}
	}
	var ensure []*virtualServer
	for i, name := range tx.changed {
		if p := plans[i]; p != nil {
			for _, v := range p.vs {
				claimed[keyOf(&v.svc)] = true
			}
			ensure = append(ensure, b.addPlan(ctx, name, p, tx.addrs, tx.entries)...)
			b.plans[name] = p
		}
	}
	// A virtual server several service ports want goes to the first by
	// name, whichever of them this sync touched.
	ensure = append(ensure, b.resolveContested(claimed)...)

	// Set entries before the addresses and virtual servers they record,
	// removed after them (see fullSync).
	addedEntries, _ := tx.entries.changes()
	slices.SortFunc(addedEntries, compareSetEntries)
	errs = append(errs, tx.addEntries(ctx, addedEntries, st)...)
	addedAddrs, _ := tx.addrs.changes()
	slices.SortFunc(addedAddrs, netip.Addr.Compare)
	errs = append(errs, tx.bindAddresses(ctx, addedAddrs, st)...)
	for _, v := range ensure {
		k := keyOf(&v.svc)
		if b.vsWanted[k] != v || tx.grown[k] != nil {
			continue // its port was set aside, or done
		}
		// The service as kproxy last made it (nil when new); its real
		// servers are read from the kernel all the same.
		if err := tx.grow(ctx, k, v, b.previous(k), st); err != nil {
			errs = append(errs, err)
		}
	}
	if err := tx.writeRules(ctx, st); err != nil {
		errs = append(errs, err)
	}

	errs = append(errs, tx.shrinkVS(ctx, st)...)
	touchedVS := map[vsKey]bool{}
	for k := range tx.grown {
		touchedVS[k] = true
	}
	for k := range tx.moved {
		touchedVS[k] = true
	}
	for _, k := range remove {
		if _, again := b.vsWanted[k]; again || touchedVS[k] {
			continue // now wanted by the same or another service port
		}
		touchedVS[k] = true
		if err := b.deleteVS(ctx, &ipvs.Service{Address: k.addr, Protocol: k.proto, Port: k.port, Scheduler: b.opts.Scheduler}, st); err != nil &&
			!errors.Is(err, ipvs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	haveAddrs := map[netip.Addr]bool{}
	for a, n := range tx.addrs.before {
		if n > 0 {
			haveAddrs[a] = true
		}
	}
	errs = append(errs, tx.unbindUnwanted(ctx, haveAddrs, st)...)
	haveEntries := map[setEntry]bool{}
	for e, n := range tx.entries.before {
		if n > 0 {
			haveEntries[e] = true
		}
	}
	errs = append(errs, tx.deleteUnwanted(ctx, haveEntries, st)...)
	errs = append(errs, b.processTerminating(ctx, touchedVS, st)...)
	return tx.setAsideResult(), errs
}

// previous is the virtual server k as kproxy last made it in the kernel;
// nil when unknown.
func (b *Backend) previous(k vsKey) *ipvs.Service {
	if v, ok := b.applied[k]; ok {
		return &v
	}
	return nil
}

func (b *Backend) excluded(a netip.Addr) bool {
	for _, p := range b.opts.ExcludeCIDRs {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

func compareKeys(a, b vsKey) int {
	if c := a.addr.Compare(b.addr); c != 0 {
		return c
	}
	if c := strings.Compare(string(a.proto), string(b.proto)); c != 0 {
		return c
	}
	return int(a.port) - int(b.port)
}

func sortedAddrs(m map[netip.Addr]int) []netip.Addr {
	out := make([]netip.Addr, 0, len(m))
	for a := range m {
		out = append(out, a)
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}
