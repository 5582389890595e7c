package proxier

import (
	"context"

	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// noteStaleConntrack remembers what one Apply of the change trackers made
// stale. A failed sync keeps it: the entries are deleted after the next
// successful one, once the rules that replace them are in place (deleting
// them earlier would let the old rules recreate them at once). Called with
// e.mu held.
func (e *Engine) noteStaleConntrack(svc proxy.UpdateServiceMapResult, eps proxy.UpdateEndpointsMapResult) {
	if e.opts.Conntrack == nil {
		return
	}
	e.staleConntrack.Add(svc, eps)
}

// cleanStaleConntrack deletes the UDP conntrack entries noted since the
// last successful sync, judged against the services and endpoints this
// sync programmed: an endpoint noted as no longer serving by a failed sync
// that serves again keeps its flows. A failure is logged and never fails
// the sync: the entries then go stale until they time out, as they would
// without kproxy. Called with e.mu held, after a successful sync.
func (e *Engine) cleanStaleConntrack(ctx context.Context) {
	if e.opts.Conntrack == nil || e.staleConntrack.Empty() {
		return
	}
	stale := e.staleConntrack
	e.staleConntrack = conntrack.StaleEntries{}
	if _, err := conntrack.CleanStaleEntries(ctx, e.opts.Conntrack, e.opts.Family,
		conntrack.Current{Services: e.svcPortMap, Endpoints: e.endpointsMap}, stale); err != nil {
		e.logger.Error(err, "Failed to delete stale UDP conntrack entries")
	}
}
