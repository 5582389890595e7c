package proxier

import (
	"cmp"
	"context"
	"slices"

	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// maxStaleConntrackEntries bounds the stale conntrack notes kept while
// syncs fail (docs/design.md, "Sync loop under failure"). Notes are
// deduplicated, so only that many distinct stale endpoints, ClusterIPs and
// newly active ports between two successful syncs reach it.
const maxStaleConntrackEntries = 65536

// staleConntrack is the set of stale conntrack notes gathered since the
// last successful sync: each ClusterIP, endpoint and service port once,
// however many failed syncs noted it, and at most max notes (more are
// dropped and logged: their UDP flows may keep following the old rules
// until they time out, as they would without kproxy's cleanup).
type staleConntrack struct {
	max         int
	clusterIPs  sets.Set[string]
	endpoints   sets.Set[proxy.ServiceEndpoint]
	newlyActive sets.Set[proxy.ServicePortName]
}

func newStaleConntrack(max int) staleConntrack {
	return staleConntrack{
		max:         max,
		clusterIPs:  sets.New[string](),
		endpoints:   sets.New[proxy.ServiceEndpoint](),
		newlyActive: sets.New[proxy.ServicePortName](),
	}
}

// len is the number of distinct notes held.
func (s *staleConntrack) len() int {
	return s.clusterIPs.Len() + s.endpoints.Len() + s.newlyActive.Len()
}

func (s *staleConntrack) empty() bool { return s.len() == 0 }

// insertBounded adds v to set unless the bound is reached; it reports whether v
// was dropped.
func insertBounded[T comparable](s *staleConntrack, set sets.Set[T], v T) (dropped bool) {
	if set.Has(v) {
		return false
	}
	if s.len() >= s.max {
		return true
	}
	set.Insert(v)
	return false
}

// add merges what one Apply of each change tracker reported.
func (s *staleConntrack) add(logger klog.Logger, svc proxy.UpdateServiceMapResult, eps proxy.UpdateEndpointsMapResult) {
	dropped := 0
	for ip := range svc.DeletedUDPClusterIPs {
		if insertBounded(s, s.clusterIPs, ip) {
			dropped++
		}
	}
	for _, ep := range eps.DeletedUDPEndpoints {
		if insertBounded(s, s.endpoints, ep) {
			dropped++
		}
	}
	for _, name := range eps.NewlyActiveUDPServices {
		if insertBounded(s, s.newlyActive, name) {
			dropped++
		}
	}
	if dropped > 0 {
		logger.Error(nil, "Too many stale UDP conntrack entries noted while syncs fail; dropping some (their flows keep following the old rules until they time out)",
			"dropped", dropped, "limit", s.max)
	}
}

// take returns the notes, in a stable order, and empties the set.
func (s *staleConntrack) take() conntrack.StaleEntries {
	out := conntrack.StaleEntries{}
	if s.clusterIPs.Len() > 0 {
		out.DeletedUDPClusterIPs = s.clusterIPs
	}
	if s.endpoints.Len() > 0 {
		out.DeletedUDPEndpoints = s.endpoints.UnsortedList()
		slices.SortFunc(out.DeletedUDPEndpoints, func(a, b proxy.ServiceEndpoint) int {
			return cmp.Or(a.ServicePortName.Compare(b.ServicePortName), cmp.Compare(a.Endpoint, b.Endpoint))
		})
	}
	if s.newlyActive.Len() > 0 {
		out.NewlyActiveUDPServices = s.newlyActive.UnsortedList()
		slices.SortFunc(out.NewlyActiveUDPServices, proxy.ServicePortName.Compare)
	}
	*s = newStaleConntrack(s.max)
	return out
}

// noteStaleConntrack remembers what one Apply of the change trackers made
// stale. A failed sync keeps it: the entries are deleted after the next
// successful one, once the rules that replace them are in place (deleting
// them earlier would let the old rules recreate them at once). Called with
// e.mu held.
func (e *Engine) noteStaleConntrack(svc proxy.UpdateServiceMapResult, eps proxy.UpdateEndpointsMapResult) {
	if e.opts.Conntrack == nil {
		return
	}
	e.staleConntrack.add(e.logger, svc, eps)
}

// cleanStaleConntrack deletes the UDP conntrack entries noted since the
// last successful sync, judged against the services and endpoints this
// sync programmed: an endpoint noted as no longer serving by a failed sync
// that serves again keeps its flows. A failure is logged and never fails
// the sync: the entries then go stale until they time out, as they would
// without kproxy. Called with e.mu held, after a successful sync.
func (e *Engine) cleanStaleConntrack(ctx context.Context) {
	if e.opts.Conntrack == nil || e.staleConntrack.empty() {
		return
	}
	stale := e.staleConntrack.take()
	if _, err := conntrack.CleanStaleEntries(ctx, e.opts.Conntrack, e.opts.Family,
		conntrack.Current{Services: e.svcPortMap, Endpoints: e.endpointsMap}, stale); err != nil {
		e.logger.Error(err, "Failed to delete stale UDP conntrack entries")
	}
}

// cleanBlackHoledConntrack deletes, after a successful full sync, the
// flows to service addresses that began while their rules were missing and
// went nowhere (conntrack.BlackHoledFilters): a full sync follows every
// gap (kproxy's start, a repaired flush, a recovered failure). A failure
// is logged, never fails the sync. Called with e.mu held.
func (e *Engine) cleanBlackHoledConntrack(ctx context.Context) {
	if e.opts.Conntrack == nil {
		return
	}
	if _, err := conntrack.CleanBlackHoled(ctx, e.opts.Conntrack, e.opts.Family, e.svcPortMap); err != nil {
		e.logger.Error(err, "Failed to delete black-holed conntrack entries")
	}
}
