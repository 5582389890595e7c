package proxy

import (
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
)

// BackendResult is what one successful backend sync did, the same type for
// every backend (docs/design.md, "Data flow").
type BackendResult struct {
	// RuleCounts are the rules the backend owns after the sync, by table
	// ("nat", "filter"); nil when the backend has no such count.
	RuleCounts map[string]int
	// RulesWritten are the rules the sync wrote, by table.
	RulesWritten map[string]int
	// ChainsWritten and ChainsDeleted count the chains the sync wrote and
	// deleted; KernelWrites the kernel transactions it made
	// (iptables-restore runs, netlink operations).
	ChainsWritten, ChainsDeleted, KernelWrites int
	// KernelTime is the time spent in those transactions.
	KernelTime time.Duration
	// SetAside are the service ports whose rules the kernel refused in
	// this sync, each with the refusal. The backend programmed everything
	// else in the same sync and left each of these with its last good
	// rules (none if it never had any; docs/design.md, "Set-aside
	// services"). It retries them when they change and on full syncs; the
	// engine reports them (Warning Event, gauge, log). A sync whose only
	// failures are set-aside service ports returns a nil error.
	SetAside map[ServicePortName]error
	// Full says that the backend rewrote everything although the engine
	// asked for a partial sync (it repaired a table someone changed, or
	// recovered from a failed partial sync): SetAside then names every
	// refused service port, not only changed ones.
	Full bool
}

// SyncResult describes one sync attempt, for metrics and health.
type SyncResult struct {
	Family   v1.IPFamily
	Full     bool
	Start    time.Time
	Duration time.Duration
	Err      error
	// Services is the number of service ports programmed.
	Services int
	// NoLocalEndpointsInternal / External count service ports whose Local
	// policy leaves them without an endpoint on this node.
	NoLocalEndpointsInternal int
	NoLocalEndpointsExternal int
	// TriggerTimes are the EndpointSlice last-change-trigger-times this sync
	// applied (network programming latency).
	TriggerTimes []time.Time
	// DeletedUDPClusterIPs and DeletedUDPEndpoints name conntrack entries
	// that went stale with this sync.
	DeletedUDPClusterIPs sets.Set[string]
	DeletedUDPEndpoints  []ServiceEndpoint
	// ServiceChanges and EndpointChanges count the services whose Service,
	// respectively EndpointSlice, changes this sync applied.
	ServiceChanges  int
	EndpointChanges int
	// HealthCheckServices holds, per service with a healthCheckNodePort
	// (LoadBalancer with externalTrafficPolicy Local), that port and the
	// number of distinct Ready endpoint IPs on this node, as of this sync.
	// Read-only: consecutive results share the map until it changes (the
	// engine maintains it incrementally, copying it on write).
	HealthCheckServices map[types.NamespacedName]HealthCheckService
	// Backend is what the backend reported of a successful sync (zero when
	// the sync failed); RuleCounts and RulesWritten repeat its fields.
	Backend BackendResult
	// RuleCounts are the rules the backend owns after a successful sync,
	// by table; nil when the sync failed or the backend does not count.
	RuleCounts map[string]int
	// RulesWritten is, by table, the rules the last successful sync wrote
	// (a partial sync writes only what changed); nil when the sync failed.
	RulesWritten map[string]int
	// SetAside are the service ports set aside after a successful sync,
	// each with the kernel's refusal: those the backend refused in this
	// sync and those of earlier syncs that it has not retried since (their
	// services did not change and the sync was partial). nil when none,
	// or when the sync failed. Read-only.
	SetAside map[ServicePortName]error
	// Panicked is set when the sync panicked; Err then holds the panic
	// (docs/design.md, "Sync loop under failure").
	Panicked bool
}

// HealthCheckService is one service's healthCheckNodePort and its local
// endpoint count.
type HealthCheckService struct {
	Port           int
	LocalEndpoints int
}
