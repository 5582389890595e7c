package proxy

import (
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
)

// ServiceChangeTrackerOptions configures a ServiceChangeTracker.
type ServiceChangeTrackerOptions struct {
	// Family is the IP family whose service ports the tracker builds.
	Family v1.IPFamily
	// Logger receives the tracker's messages; klog.Background() when unset.
	Logger klog.Logger
}

// ServiceChangeTracker accumulates Service changes between syncs, keyed by
// namespace/name. For each service it keeps the ServicePorts as last applied
// (previous) and as now seen (current); a service whose changes cancel out
// (added then deleted, or updated back) is dropped. Every Service goes
// through ParseService once per update; the tracker hands the problems the
// update brings back to its caller. It is safe for concurrent use.
type ServiceChangeTracker struct {
	family v1.IPFamily
	logger klog.Logger

	mu    sync.Mutex
	items map[types.NamespacedName]*serviceChange
}

// serviceChange is the coalesced change of one service since the last Apply.
type serviceChange struct {
	previous servicePorts
	current  servicePorts
	// currentProblems are the problems of the Service last given as
	// current: the old object of the next update.
	currentProblems []ServiceProblem
}

// UpdateServiceMapResult describes what an Apply changed.
type UpdateServiceMapResult struct {
	// UpdatedServices names every service added, updated or deleted.
	UpdatedServices sets.Set[types.NamespacedName]
	// DeletedUDPClusterIPs holds the ClusterIPs of UDP service ports that
	// went away, whose conntrack entries must be cleared.
	DeletedUDPClusterIPs sets.Set[string]
	// ServicePorts names, per updated service, its ports in the map after
	// the change, in spec order (none for a deleted service or one without
	// ports of the family): with the ports it had before, what a caller
	// indexing the map by service must revisit.
	ServicePorts map[types.NamespacedName][]ServicePortName
}

// NewServiceChangeTracker returns an empty tracker for opts.Family.
func NewServiceChangeTracker(opts ServiceChangeTrackerOptions) *ServiceChangeTracker {
	logger := opts.Logger
	if logger.GetSink() == nil {
		logger = klog.Background()
	}
	return &ServiceChangeTracker{
		family: opts.Family,
		logger: logger.WithValues("ipFamily", opts.Family),
		items:  make(map[types.NamespacedName]*serviceChange),
	}
}

// Update records a change from previous to current: a nil previous is an
// add, a nil current a delete. It returns whether the tracker holds changes
// to apply (from this or an earlier update), and the problems of current
// that previous did not have, each once: what the change brings that kproxy
// cannot honour. A problem both objects have (an informer resync, an
// unrelated edit) is not returned again.
func (t *ServiceChangeTracker) Update(previous, current *v1.Service) (pending bool, newProblems []ServiceProblem) {
	svc := current
	if svc == nil {
		svc = previous
	}
	if svc == nil {
		return t.hasPending(), nil
	}
	nn := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
	currentPorts, currentProblems := parseServicePorts(current, t.family)

	t.mu.Lock()
	defer t.mu.Unlock()
	change, ok := t.items[nn]
	var previousProblems []ServiceProblem
	if ok {
		// previous is the object the last update gave as current.
		previousProblems = change.currentProblems
	} else {
		change = &serviceChange{}
		change.previous, previousProblems = parseServicePorts(previous, t.family)
		t.items[nn] = change
	}
	change.current = currentPorts
	change.currentProblems = currentProblems
	if change.previous.equal(change.current) {
		delete(t.items, nn)
		t.logger.V(4).Info("Service change cancelled out", "service", nn)
	} else {
		t.logger.V(4).Info("Service change pending", "service", nn, "ports", len(change.current))
	}
	newProblems = problemsNotIn(currentProblems, previousProblems)
	for _, p := range newProblems {
		t.logger.Error(nil, "Service has a problem kproxy works around", "service", nn, "reason", p.Reason, "problem", p.Message)
	}
	return len(t.items) > 0, newProblems
}

// problemsNotIn returns the problems of current that are not in previous,
// without duplicates, in the order of current.
func problemsNotIn(current, previous []ServiceProblem) []ServiceProblem {
	var out []ServiceProblem
	for _, p := range current {
		if !slices.Contains(previous, p) && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

func (t *ServiceChangeTracker) hasPending() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.items) > 0
}

// PendingChanges names ("namespace/name") the services with changes not yet
// applied.
func (t *ServiceChangeTracker) PendingChanges() sets.Set[string] {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := sets.New[string]()
	for nn := range t.items {
		out.Insert(nn.String())
	}
	return out
}

// Apply folds every pending change into m and clears the tracker.
func (t *ServiceChangeTracker) Apply(m ServicePortMap) UpdateServiceMapResult {
	t.mu.Lock()
	items := t.items
	t.items = make(map[types.NamespacedName]*serviceChange)
	t.mu.Unlock()

	result := UpdateServiceMapResult{
		UpdatedServices:      sets.New[types.NamespacedName](),
		DeletedUDPClusterIPs: sets.New[string](),
		ServicePorts:         make(map[types.NamespacedName][]ServicePortName, len(items)),
	}
	for nn, change := range items {
		result.UpdatedServices.Insert(nn)
		names := make([]ServicePortName, 0, len(change.current))
		for _, sp := range change.current {
			names = append(names, sp.Name)
		}
		result.ServicePorts[nn] = names
		for _, old := range change.previous {
			name := old.Name
			cur, stays := change.current.find(name)
			if old.Protocol == v1.ProtocolUDP && old.ClusterIP.IsValid() && (!stays || cur.ClusterIP != old.ClusterIP) {
				result.DeletedUDPClusterIPs.Insert(old.ClusterIP.String())
			}
			if !stays {
				t.logger.V(4).Info("Removing service port", "servicePort", name)
				delete(m, name)
			}
		}
		for _, sp := range change.current {
			t.logger.V(4).Info("Setting service port", "servicePort", sp.Name)
			m[sp.Name] = sp
		}
	}
	return result
}
