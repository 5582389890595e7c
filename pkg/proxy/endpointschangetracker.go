package proxy

import (
	"cmp"
	"net/netip"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
)

// EndpointsChangeTrackerOptions configures an EndpointsChangeTracker.
type EndpointsChangeTrackerOptions struct {
	// Family selects the EndpointSlices tracked (address type IPv4 or IPv6).
	Family v1.IPFamily
	// NodeName is the node kproxy runs on; endpoints on it are local.
	NodeName string
	// Clock dates the tracker's creation: change trigger times before it are
	// not reported. clock.RealClock{} when unset.
	Clock clock.PassiveClock
	// Logger receives the tracker's messages; klog.Background() when unset.
	Logger klog.Logger
}

// EndpointsChangeTracker accumulates EndpointSlice changes between syncs for
// one IP family. It is safe for concurrent use: informer handlers call
// EndpointSliceUpdate while the sync loop calls Apply.
type EndpointsChangeTracker struct {
	cache     *EndpointSliceCache
	logger    klog.Logger
	startTime time.Time

	// mu serializes updates and Apply so that trigger times and the slice
	// changes they belong to are always checked out together.
	mu sync.Mutex
	// lastChangeTriggerTimes holds, per service, the trigger times of the
	// pending slice changes (network programming latency).
	lastChangeTriggerTimes map[types.NamespacedName][]time.Time
}

// ServiceEndpoint is one endpoint ("ip:port") of one service port.
type ServiceEndpoint struct {
	Endpoint        string
	ServicePortName ServicePortName
}

// UpdateEndpointsMapResult describes what an Apply changed.
type UpdateEndpointsMapResult struct {
	// UpdatedServices names every service whose endpoints changed.
	UpdatedServices sets.Set[types.NamespacedName]
	// DeletedUDPEndpoints are UDP endpoints that may have had flows and are
	// now removed or no longer serving: their conntrack entries must be
	// cleared. An endpoint that turns terminating but keeps serving is not
	// among them, so that its flows drain. Sorted.
	DeletedUDPEndpoints []ServiceEndpoint
	// NewlyActiveUDPServices are UDP service ports that went from no usable
	// endpoint to some: conntrack entries made while traffic to them was
	// not DNATed must be cleared. Sorted.
	NewlyActiveUDPServices []ServicePortName
	// LastChangeTriggerTimes are the endpoints.kubernetes.io/last-change-trigger-time
	// values of the applied changes, per updated service.
	LastChangeTriggerTimes map[types.NamespacedName][]time.Time
}

// NewEndpointsChangeTracker returns an empty tracker.
func NewEndpointsChangeTracker(opts EndpointsChangeTrackerOptions) *EndpointsChangeTracker {
	logger := opts.Logger
	if logger.GetSink() == nil {
		logger = klog.Background()
	}
	clk := opts.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	return &EndpointsChangeTracker{
		cache: NewEndpointSliceCache(EndpointSliceCacheOptions{
			Family:   opts.Family,
			NodeName: opts.NodeName,
			Logger:   logger,
		}),
		logger:                 logger.WithValues("ipFamily", opts.Family),
		startTime:              clk.Now(),
		lastChangeTriggerTimes: make(map[types.NamespacedName][]time.Time),
	}
}

// EndpointSliceUpdate records an added or updated slice, or with removeSlice
// a deleted one. Slices of another address type (including FQDN) and slices
// without the kubernetes.io/service-name label are ignored. It returns true
// when this update left a change to sync; an update that restores what was
// last applied returns false.
func (t *EndpointsChangeTracker) EndpointSliceUpdate(slice *discovery.EndpointSlice, removeSlice bool) bool {
	pending, _ := t.UpdateEndpointSlice(slice, removeSlice)
	return pending
}

// UpdateEndpointSlice is EndpointSliceUpdate that also returns the problems
// the update brings: the ports and endpoints of slice that kproxy skips
// (see newSliceInfo) and that the slice's previous version did not have,
// each logged once here. A problem both versions have is not returned
// again.
func (t *EndpointsChangeTracker) UpdateEndpointSlice(slice *discovery.EndpointSlice, removeSlice bool) (pending bool, newProblems []EndpointSliceProblem) {
	if slice == nil {
		return false, nil
	}
	if !t.cache.Handles(slice) {
		t.logger.V(5).Info("Ignoring EndpointSlice of another address type", "endpointSlice", klog.KObj(slice), "addressType", slice.AddressType)
		return false, nil
	}

	t.mu.Lock()
	defer t.mu.Unlock()
	nn, changed, pending, newProblems, err := t.cache.updatePending(slice, removeSlice)
	if err != nil {
		t.logger.Info("Ignoring EndpointSlice", "endpointSlice", klog.KObj(slice), "err", err)
		return false, nil
	}
	for _, p := range newProblems {
		t.logger.Error(nil, "EndpointSlice has a problem kproxy works around", "endpointSlice", klog.KObj(slice), "reason", p.Reason, "problem", p.Message)
	}
	switch {
	case !pending:
		// Nothing left to program for this service.
		delete(t.lastChangeTriggerTimes, nn)
	case !changed:
	case removeSlice:
		// A deletion's annotation dates the slice's last update, not the
		// deletion: it would overstate the latency.
		delete(t.lastChangeTriggerTimes, nn)
	default:
		if ts, ok := t.triggerTime(slice); ok && ts.After(t.startTime) {
			t.lastChangeTriggerTimes[nn] = append(t.lastChangeTriggerTimes[nn], ts)
		}
	}
	return changed && pending, newProblems
}

func (t *EndpointsChangeTracker) triggerTime(slice *discovery.EndpointSlice) (time.Time, bool) {
	value, ok := slice.Annotations[v1.EndpointsLastChangeTriggerTime]
	if !ok {
		return time.Time{}, false
	}
	ts, err := time.Parse(time.RFC3339Nano, value)
	if err != nil {
		t.logger.Error(err, "Ignoring malformed EndpointSlice annotation", "endpointSlice", klog.KObj(slice), "annotation", v1.EndpointsLastChangeTriggerTime, "value", value)
		return time.Time{}, false
	}
	return ts, true
}

// PendingChanges names ("namespace/name") the services with slice changes
// not yet applied.
func (t *EndpointsChangeTracker) PendingChanges() sets.Set[string] {
	return t.cache.pendingServices()
}

// Apply folds every pending change into m and clears the tracker. Services
// whose endpoints come out identical (say an endpoint moved between slices)
// are not reported as updated.
func (t *EndpointsChangeTracker) Apply(m EndpointsMap) UpdateEndpointsMapResult {
	t.mu.Lock()
	changes := t.cache.checkoutChanges()
	triggerTimes := t.lastChangeTriggerTimes
	t.lastChangeTriggerTimes = make(map[types.NamespacedName][]time.Time)
	t.mu.Unlock()

	result := UpdateEndpointsMapResult{
		UpdatedServices:        sets.New[types.NamespacedName](),
		LastChangeTriggerTimes: make(map[types.NamespacedName][]time.Time),
	}
	for nn, change := range changes {
		if change.previous.equal(change.current) {
			continue
		}
		result.UpdatedServices.Insert(nn)
		if ts := triggerTimes[nn]; len(ts) > 0 {
			result.LastChangeTriggerTimes[nn] = ts
		}
		result.DeletedUDPEndpoints = appendDeletedUDPEndpoints(result.DeletedUDPEndpoints, change.previous, change.current)
		result.NewlyActiveUDPServices = appendNewlyActiveUDPServices(result.NewlyActiveUDPServices, change.previous, change.current)
		for name := range change.previous {
			delete(m, name)
		}
		for name, eps := range change.current {
			m[name] = eps
		}
		t.logger.V(4).Info("Applied endpoint changes", "service", nn, "servicePorts", len(change.current))
	}
	slices.SortFunc(result.DeletedUDPEndpoints, func(a, b ServiceEndpoint) int {
		return cmp.Or(compareServicePortNames(a.ServicePortName, b.ServicePortName), cmp.Compare(a.Endpoint, b.Endpoint))
	})
	slices.SortFunc(result.NewlyActiveUDPServices, compareServicePortNames)
	return result
}

// endpointUsable reports whether the dataplane may send traffic to ep: it is
// ready, or it is the serving-and-terminating fallback.
func endpointUsable(ep *Endpoint) bool {
	return ep.Ready || (ep.Serving && ep.Terminating)
}

// appendDeletedUDPEndpoints adds the UDP endpoints of previous that may have
// flows (serving or usable) and in current are gone or no longer serving.
// Serving is what keeps an endpoint's conntrack entries, as in upstream
// kube-proxy's reconciler: a ready endpoint that turns terminating but
// still serves keeps them, so that its flows drain; it loses them when it
// stops serving or is removed.
func appendDeletedUDPEndpoints(out []ServiceEndpoint, previous, current EndpointsMap) []ServiceEndpoint {
	for name, oldEps := range previous {
		if name.Protocol != v1.ProtocolUDP {
			continue
		}
		now := make(map[netip.AddrPort]*Endpoint, len(current[name]))
		for _, ep := range current[name] {
			now[netip.AddrPortFrom(ep.IP, uint16(ep.Port))] = ep
		}
		for _, old := range oldEps {
			if !old.Serving && !endpointUsable(old) {
				continue
			}
			if cur, ok := now[netip.AddrPortFrom(old.IP, uint16(old.Port))]; ok && cur.Serving {
				continue
			}
			out = append(out, ServiceEndpoint{Endpoint: old.String(), ServicePortName: name})
		}
	}
	return out
}

// appendNewlyActiveUDPServices adds the UDP service ports of current that had
// no usable endpoint in previous and now have one. A port whose only
// endpoints were serving and terminating (usable as the fallback) that
// gets a ready one is not newly active: its traffic was DNATed all along,
// and the terminating endpoints' flows must drain.
func appendNewlyActiveUDPServices(out []ServicePortName, previous, current EndpointsMap) []ServicePortName {
	for name, eps := range current {
		if name.Protocol != v1.ProtocolUDP {
			continue
		}
		if !slices.ContainsFunc(previous[name], endpointUsable) && slices.ContainsFunc(eps, endpointUsable) {
			out = append(out, name)
		}
	}
	return out
}

func compareServicePortNames(a, b ServicePortName) int {
	return cmp.Or(
		cmp.Compare(a.Namespace, b.Namespace),
		cmp.Compare(a.Name, b.Name),
		cmp.Compare(a.Port, b.Port),
		cmp.Compare(a.Protocol, b.Protocol),
	)
}
