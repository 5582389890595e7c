package proxier

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/pkg/runner"
)

// DefaultFullSyncPeriod is how often a sync rewrites every rule even when
// partial syncs would do, as upstream kube-proxy does (one hour).
const DefaultFullSyncPeriod = time.Hour

// SyncResult and HealthCheckService are the shared types of package proxy,
// named here too for the engine's callers.
type (
	SyncResult         = proxy.SyncResult
	HealthCheckService = proxy.HealthCheckService
)

// EngineOptions configures an Engine.
type EngineOptions struct {
	Family   v1.IPFamily
	NodeName string
	Backend  Backend
	// MinSyncPeriod is the least time between syncs (--iptables-min-sync-period).
	MinSyncPeriod time.Duration
	// SyncPeriod is the most time between syncs (--iptables-sync-period).
	SyncPeriod time.Duration
	// FullSyncPeriod forces a full sync this often; default one hour.
	FullSyncPeriod time.Duration
	// RetryPeriod is the wait before retrying a failed sync; default
	// MinSyncPeriod, at least one second.
	RetryPeriod time.Duration
	// NodeLabels is the node-label cache; nil creates one. The engine
	// learns of label changes from what NodeLabels.Set and Delete report, so
	// a cache must not be fed node events by two engines (the second would
	// never see a change): give each engine of a MetaProxier its own.
	NodeLabels *proxy.NodeLabels
	// WaitForNodes delays the first sync until OnNodeSynced as well.
	WaitForNodes bool
	// OtherNodesMaxWait bounds how long syncs wait for the other nodes'
	// labels (OnOtherNodesPending): past it, a sync runs with the labels
	// known so far (their arrival later rebuilds every service), so a
	// failing Node list never stops every other service's updates.
	// Default 10s.
	OtherNodesMaxWait time.Duration
	// MasqueradeAll, ClusterCIDR and NodeIP are the node-wide settings the
	// decisions depend on (proxy.DecisionOptions).
	MasqueradeAll bool
	ClusterCIDR   netip.Prefix // this family's pod CIDR (zero: unknown)
	NodeIP        netip.Addr   // this node's primary IP of the family (zero: unknown)
	// OnSync, when set, is called after every sync attempt.
	OnSync func(SyncResult)
	// OnQueued, when set, is called whenever a change asks for a sync.
	OnQueued func(time.Time)
	Clock    clock.WithTicker
	Logger   klog.Logger

	// Conntrack, when set, deletes the UDP conntrack entries that each
	// successful sync made stale (see engine_conntrack.go); nil leaves
	// conntrack alone.
	Conntrack conntrack.Interface
	// EventRecorder, when set, gets a Warning event on a Service whenever
	// a change of it brings a field kproxy cannot honour (see events.go).
	// On a dual-stack node give it to one engine only, or every event is
	// sent twice.
	EventRecorder record.EventRecorder
	// FamilyEventRecorder, when set, gets the Warning events about this
	// family's state, which only this engine sees: service ports the
	// kernel refused (set aside, engine_setaside.go) and the ports and
	// endpoints skipped from this family's EndpointSlices. Give it to every
	// engine; nil uses EventRecorder.
	FamilyEventRecorder record.EventRecorder
	// ServiceLister, when set, finds the Service a set-aside event is
	// about, so that the event carries its UID; without it the event
	// refers to the Service by name.
	ServiceLister corelisters.ServiceLister
	// OnLoopRan, when set, is called when SyncLoop starts and after every
	// run of it, whatever the run did (synced, failed, panicked, or waited
	// for the caches): proxy health tells a stuck sync from an idle one by
	// it (docs/design.md, "Sync loop under failure").
	OnLoopRan func(time.Time)
}

// retryJitter spreads the sync loop's retries by +-20%
// (runner.Options.RetryJitter).
const retryJitter = 0.2

// Engine is the backend-independent part of a proxier for one IP family: it
// folds informer events into the model and syncs the backend from a
// bounded-frequency runner.
type Engine struct {
	opts    EngineOptions
	backend Backend
	clock   clock.WithTicker
	logger  klog.Logger
	runner  *runner.BoundedFrequencyRunner

	serviceChanges   *proxy.ServiceChangeTracker
	endpointsChanges *proxy.EndpointsChangeTracker
	nodeLabels       *proxy.NodeLabels

	// The informer handlers only touch these atomics, never mu, so that
	// an event is never held up by a backend sync in progress (on a
	// dual-stack node one family's sync would otherwise delay the other
	// family's events, which MetaProxier delivers from the same goroutine).
	servicesSynced       atomic.Bool
	endpointSlicesSynced atomic.Bool
	nodesSynced          atomic.Bool
	// otherNodesPending holds syncs back while a Service needs the other
	// nodes' labels and they are still being listed (OnOtherNodesPending).
	otherNodesPending atomic.Bool
	// otherNodesPendingSince is when otherNodesPending was last set (unix
	// nanoseconds of the engine's clock).
	otherNodesPendingSince atomic.Int64
	// otherNodesWaitWarned: the warning that syncs stopped waiting was
	// logged for the current pending period.
	otherNodesWaitWarned atomic.Bool
	// topologyChanged is set after a node-label change and consumed by the
	// next sync, which then rebuilds every service.
	topologyChanged atomic.Bool

	mu           sync.Mutex // serializes syncs and guards the fields below
	needFullSync bool
	lastFullSync time.Time
	svcPortMap   proxy.ServicePortMap
	endpointsMap proxy.EndpointsMap
	states       map[proxy.ServicePortName]*proxy.ServiceState
	// index keeps, per service, what a partial sync needs without visiting
	// every service: its port names and the counts and health checks
	// derived from its states (engine_index.go).
	index serviceIndex
	// staleConntrack accumulates what applied changes made stale until a
	// sync succeeds, bounded (engine_conntrack.go); only used with
	// opts.Conntrack.
	staleConntrack staleConntrack
	// setAside are the service ports the backend refused and has not
	// programmed since, with the refusal (engine_setaside.go).
	setAside     map[proxy.ServicePortName]error
	decisionOpts proxy.DecisionOptions
}

var _ Proxier = (*Engine)(nil)

// NewEngine validates opts and builds an Engine; it starts nothing.
func NewEngine(opts EngineOptions) (*Engine, error) {
	if opts.Backend == nil {
		return nil, errors.New("engine: Backend is required")
	}
	if opts.Family != v1.IPv4Protocol && opts.Family != v1.IPv6Protocol {
		return nil, fmt.Errorf("engine: unknown IP family %q", opts.Family)
	}
	if opts.NodeName == "" {
		return nil, errors.New("engine: NodeName is required")
	}
	if opts.SyncPeriod <= 0 {
		return nil, fmt.Errorf("engine: sync period must be positive, got %v", opts.SyncPeriod)
	}
	if opts.MinSyncPeriod < 0 || opts.MinSyncPeriod > opts.SyncPeriod {
		return nil, fmt.Errorf("engine: min sync period %v must be between 0 and the sync period %v", opts.MinSyncPeriod, opts.SyncPeriod)
	}
	if opts.OtherNodesMaxWait <= 0 {
		opts.OtherNodesMaxWait = 10 * time.Second
	}
	if opts.FullSyncPeriod <= 0 {
		opts.FullSyncPeriod = DefaultFullSyncPeriod
	}
	if opts.RetryPeriod <= 0 {
		opts.RetryPeriod = max(opts.MinSyncPeriod, time.Second)
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	if opts.NodeLabels == nil {
		opts.NodeLabels = proxy.NewNodeLabels(proxy.NodeLabelsOptions{NodeName: opts.NodeName})
	}
	logger := opts.Logger.WithValues("ipFamily", opts.Family)
	e := &Engine{
		opts:             opts,
		backend:          opts.Backend,
		clock:            opts.Clock,
		logger:           logger,
		serviceChanges:   proxy.NewServiceChangeTracker(proxy.ServiceChangeTrackerOptions{Family: opts.Family, Logger: logger}),
		endpointsChanges: proxy.NewEndpointsChangeTracker(proxy.EndpointsChangeTrackerOptions{Family: opts.Family, NodeName: opts.NodeName, Clock: opts.Clock, Logger: logger}),
		nodeLabels:       opts.NodeLabels,
		needFullSync:     true,
		svcPortMap:       proxy.ServicePortMap{},
		endpointsMap:     proxy.EndpointsMap{},
		states:           map[proxy.ServicePortName]*proxy.ServiceState{},
		index:            newServiceIndex(),
		staleConntrack:   newStaleConntrack(maxStaleConntrackEntries),
		decisionOpts:     proxy.DecisionOptions{MasqueradeAll: opts.MasqueradeAll, ClusterCIDR: opts.ClusterCIDR, NodeIP: opts.NodeIP},
	}
	r, err := runner.NewBoundedFrequencyRunner(runner.Options{
		Name:          "sync-" + string(opts.Family),
		Fn:            e.syncOnce,
		MinInterval:   opts.MinSyncPeriod,
		RetryInterval: opts.RetryPeriod,
		RetryJitter:   retryJitter,
		MaxInterval:   opts.SyncPeriod,
		Clock:         opts.Clock,
	})
	if err != nil {
		return nil, fmt.Errorf("engine: %w", err)
	}
	e.runner = r
	return e, nil
}

// requestSync asks the runner for a sync once both caches have synced.
func (e *Engine) requestSync() {
	if e.opts.OnQueued != nil {
		e.opts.OnQueued(e.clock.Now())
	}
	if e.cachesSynced() {
		e.runner.Run()
	}
}

// Sync implements Proxier.
func (e *Engine) Sync() { e.runner.Run() }

// SyncLoop implements Proxier.
func (e *Engine) SyncLoop(ctx context.Context) {
	e.loopRan()
	e.runner.Loop(ctx)
}

func (e *Engine) loopRan() {
	if e.opts.OnLoopRan != nil {
		e.opts.OnLoopRan(e.clock.Now())
	}
}

// PendingChanges names ("namespace/name") the services with Service,
// respectively EndpointSlice, changes that no sync has applied yet.
func (e *Engine) PendingChanges() (services, endpoints sets.Set[string]) {
	return e.serviceChanges.PendingChanges(), e.endpointsChanges.PendingChanges()
}

// OnServiceAdd implements config.ServiceHandler.
func (e *Engine) OnServiceAdd(service *v1.Service) { e.OnServiceUpdate(nil, service) }

// OnServiceUpdate implements config.ServiceHandler.
func (e *Engine) OnServiceUpdate(oldService, service *v1.Service) {
	pending, problems := e.serviceChanges.Update(oldService, service)
	e.reportServiceProblems(service, problems)
	if pending {
		e.requestSync()
	}
}

// OnServiceDelete implements config.ServiceHandler.
func (e *Engine) OnServiceDelete(service *v1.Service) { e.OnServiceUpdate(service, nil) }

// OnServiceSynced implements config.ServiceHandler.
func (e *Engine) OnServiceSynced() {
	e.servicesSynced.Store(true)
	e.requestSync()
}

// OnEndpointSliceAdd implements config.EndpointSliceHandler.
func (e *Engine) OnEndpointSliceAdd(slice *discovery.EndpointSlice) {
	pending, problems := e.endpointsChanges.UpdateEndpointSlice(slice, false)
	e.reportEndpointSliceProblems(slice, problems)
	if pending {
		e.requestSync()
	}
}

// OnEndpointSliceUpdate implements config.EndpointSliceHandler.
func (e *Engine) OnEndpointSliceUpdate(_, slice *discovery.EndpointSlice) {
	e.OnEndpointSliceAdd(slice)
}

// OnEndpointSliceDelete implements config.EndpointSliceHandler.
func (e *Engine) OnEndpointSliceDelete(slice *discovery.EndpointSlice) {
	if e.endpointsChanges.EndpointSliceUpdate(slice, true) {
		e.requestSync()
	}
}

// OnEndpointSlicesSynced implements config.EndpointSliceHandler.
func (e *Engine) OnEndpointSlicesSynced() {
	e.endpointSlicesSynced.Store(true)
	e.requestSync()
}

// OnNodeAdd implements config.NodeHandler. Node labels feed topology: a
// change re-filters every service's endpoints on the next sync.
func (e *Engine) OnNodeAdd(node *v1.Node) {
	if e.nodeLabels.Set(node) {
		e.markTopologyChanged()
	}
}

// OnNodeUpdate implements config.NodeHandler.
func (e *Engine) OnNodeUpdate(_, node *v1.Node) { e.OnNodeAdd(node) }

// OnNodeDelete implements config.NodeHandler.
func (e *Engine) OnNodeDelete(node *v1.Node) {
	if e.nodeLabels.Delete(node.Name) {
		e.markTopologyChanged()
	}
}

// OnNodeSynced implements config.NodeHandler.
func (e *Engine) OnNodeSynced() {
	e.nodesSynced.Store(true)
	e.requestSync()
}

// OnOtherNodesPending implements config.OtherNodesHandler: while the other
// nodes' labels that a topologyKeys Service needs are being listed, no sync
// runs (it would reject the traffic of such services that the missing labels
// would allow, as a first sync without Nodes would). OnNodeAdd, OnNodeUpdate
// and OnNodeDelete take the other nodes' labels as they take this node's.
func (e *Engine) OnOtherNodesPending(pending bool) {
	if pending && !e.otherNodesPending.Load() {
		e.otherNodesPendingSince.Store(e.clock.Now().UnixNano())
		e.otherNodesWaitWarned.Store(false)
	}
	e.otherNodesPending.Store(pending)
	if !pending {
		e.requestSync()
	}
}

// cachesSynced reports whether a sync may run: Services and EndpointSlices
// synced, this node's Node too when WaitForNodes is set (its labels give the
// zone for topology hints and the topologyKeys values), and no other nodes'
// labels pending for less than OtherNodesMaxWait.
func (e *Engine) cachesSynced() bool {
	return e.servicesSynced.Load() && e.endpointSlicesSynced.Load() &&
		(!e.opts.WaitForNodes || e.nodesSynced.Load()) && !e.waitingForOtherNodes()
}

// waitingForOtherNodes reports whether syncs still wait for the other
// nodes' labels; past OtherNodesMaxWait they go on, with a warning.
func (e *Engine) waitingForOtherNodes() bool {
	if !e.otherNodesPending.Load() {
		return false
	}
	waited := e.clock.Since(time.Unix(0, e.otherNodesPendingSince.Load()))
	if waited < e.opts.OtherNodesMaxWait {
		return true
	}
	if !e.otherNodesWaitWarned.Swap(true) {
		e.logger.Info("Other nodes' labels are still not listed; syncing with the labels known so far (topologyKeys services may reject traffic until they arrive)", "waited", waited)
	}
	return false
}

func (e *Engine) markTopologyChanged() {
	e.topologyChanged.Store(true)
	e.requestSync()
}

// SyncRules runs one sync now, outside the runner; for tests and tools.
func (e *Engine) SyncRules(ctx context.Context) error { return e.syncOnce(ctx) }

// syncOnce is the runner's function: one sync of the backend, reported
// through OnSync. A panic in the sync is recovered (syncLocked): it fails
// the sync and makes the next one full.
func (e *Engine) syncOnce(ctx context.Context) error {
	defer e.loopRan()
	ctx = klog.NewContext(ctx, e.logger)
	result, ran := e.syncLocked(ctx)
	if !ran {
		return nil
	}
	if e.opts.OnSync != nil {
		e.opts.OnSync(result)
	}
	return result.Err
}

// syncLocked runs one sync under e.mu and returns its result; ran is false
// when the caches are not synced yet and nothing ran. A panic anywhere in
// the sync (the trackers, buildState, the backend, the conntrack cleanup)
// is recovered here, with e.mu released by the deferred Unlock: it is
// logged with its stack and turned into a failed result with Panicked set,
// and the next sync is full, since the panic may have left any state half
// updated (docs/design.md, "Sync loop under failure").
func (e *Engine) syncLocked(ctx context.Context) (result SyncResult, ran bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.cachesSynced() {
		e.logger.V(2).Info("Not syncing until Services, EndpointSlices and Nodes (when awaited) are synced")
		return SyncResult{}, false
	}
	start := e.clock.Now()
	full := true
	defer func() {
		p := recover()
		if p == nil {
			return
		}
		err := runner.NewPanicError(p)
		e.needFullSync = true
		e.logger.Error(err, "Sync panicked; the next sync will be full", "full", full, "stack", string(err.Stack))
		result = SyncResult{Family: e.opts.Family, Full: full, Start: start, Duration: e.clock.Since(start), Err: err, Panicked: true}
		ran = true
	}()
	svcResult := e.serviceChanges.Apply(e.svcPortMap)
	epResult := e.endpointsChanges.Apply(e.endpointsMap)
	e.noteStaleConntrack(svcResult, epResult)
	e.applyServicePorts(svcResult)

	full = e.needFullSync || e.index.drifted || start.Sub(e.lastFullSync) >= e.opts.FullSyncPeriod
	changed := svcResult.UpdatedServices.Union(epResult.UpdatedServices)
	// The flag is cleared before buildState snapshots the labels: a change
	// landing in between is either in the snapshot or sets the flag again.
	if e.topologyChanged.Swap(false) {
		for nn := range e.index.ports {
			changed.Insert(nn)
		}
	}
	state := e.buildState(changed, full)
	backendResult, err := e.backend.Sync(ctx, state, full)
	result = SyncResult{
		Family: e.opts.Family, Full: full, Start: start, Duration: e.clock.Since(start), Err: err,
		Services: len(state.Services), DeletedUDPClusterIPs: svcResult.DeletedUDPClusterIPs,
		DeletedUDPEndpoints: epResult.DeletedUDPEndpoints,
	}
	result.ServiceChanges = svcResult.UpdatedServices.Len()
	result.EndpointChanges = epResult.UpdatedServices.Len()
	result.HealthCheckServices = e.index.healthCheckServices()
	if err == nil {
		result.Backend = backendResult
		result.RuleCounts = backendResult.RuleCounts
		result.RulesWritten = backendResult.RulesWritten
	}
	result.NoLocalEndpointsInternal = e.index.noLocalInternal
	result.NoLocalEndpointsExternal = e.index.noLocalExternal
	for _, times := range epResult.LastChangeTriggerTimes {
		result.TriggerTimes = append(result.TriggerTimes, times...)
	}
	if err != nil {
		// Only a real failure forces a full sync: service ports the
		// backend set aside come with a nil error and do not.
		e.needFullSync = true
		e.logger.Error(err, "Sync failed; the next sync will be full", "full", full)
	} else {
		e.needFullSync = false
		if full {
			e.lastFullSync = start
		}
		result.SetAside = e.noteSetAside(backendResult.SetAside, changed, full || backendResult.Full)
		e.cleanStaleConntrack(ctx)
		if full || backendResult.Full {
			e.cleanBlackHoledConntrack(ctx)
		}
		e.logger.V(2).Info("Synced", "full", full, "servicePorts", len(state.Services), "changedServices", changed.Len(),
			"setAside", len(result.SetAside), "duration", result.Duration)
	}
	return result, true
}

// buildState recomputes the ServiceState of every changed service (all of
// them on a full sync) and returns the node state for the backend. This is
// the one place where endpoints are chosen for this node. A partial sync
// visits only the ports of the changed services (e.index); a full one
// rebuilds every state and the index's counts from scratch.
func (e *Engine) buildState(changed sets.Set[types.NamespacedName], full bool) *proxy.NodeState {
	topo := e.nodeLabels.TopologyInfo()
	if full {
		for name := range e.states {
			if _, ok := e.svcPortMap[name]; !ok {
				delete(e.states, name)
			}
		}
		for name, sp := range e.svcPortMap {
			e.states[name] = proxy.NewServiceState(sp, e.endpointsMap[name], topo, e.decisionOpts)
		}
		e.index.recount(e.states, e.endpointsMap)
	} else {
		for nn := range changed {
			for _, name := range e.index.ports[nn] {
				sp, ok := e.svcPortMap[name]
				if !ok {
					// Never: the index follows every Apply (applyServicePorts).
					e.logger.Error(nil, "Service port index out of date; the next sync will be full", "servicePort", name)
					e.index.drifted = true
					continue
				}
				st := proxy.NewServiceState(sp, e.endpointsMap[name], topo, e.decisionOpts)
				e.index.setState(e.states[name], st)
				e.states[name] = st
			}
			e.index.updateHealthCheck(nn, e.states, e.endpointsMap)
		}
	}
	return &proxy.NodeState{Family: e.opts.Family, NodeName: e.opts.NodeName, Options: e.decisionOpts, Services: e.states, Changed: changed}
}

// applyServicePorts brings the index's port names up to date with what
// one Apply of the service tracker changed, and drops the states of the
// ports that went away (their service is in the changed set, so
// buildState revisits its health check).
func (e *Engine) applyServicePorts(res proxy.UpdateServiceMapResult) {
	for nn := range res.UpdatedServices {
		names := res.ServicePorts[nn]
		for _, old := range e.index.ports[nn] {
			if !slices.Contains(names, old) {
				e.index.setState(e.states[old], nil)
				delete(e.states, old)
			}
		}
		e.index.setPorts(nn, names)
	}
}
