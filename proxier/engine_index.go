package proxier

import (
	"maps"
	"net/netip"
	"slices"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// serviceIndex is what the engine keeps per service so that a partial sync
// costs the changed services, not every service: the service's port names
// (the model's maps are keyed by port), and the figures every SyncResult
// reports over all services, maintained as states are replaced: the
// no-local-endpoint counts and the health-check services. A full sync
// recounts them from scratch (recount). Only used with Engine.mu held.
type serviceIndex struct {
	// ports names each service's ports in Engine.svcPortMap (and so in
	// Engine.states); a service without ports is absent.
	ports map[types.NamespacedName][]proxy.ServicePortName
	// noLocalInternal and noLocalExternal count the states whose decisions
	// have NoLocalEndpointsInternal, respectively NoLocalEndpointsExternal.
	noLocalInternal, noLocalExternal int
	// healthChecks holds the services with a healthCheckNodePort, as
	// SyncResult.HealthCheckServices reports them.
	healthChecks map[types.NamespacedName]HealthCheckService
	// healthChecksShared is set once healthChecks was handed out in a
	// SyncResult: the next change copies the map first, so that a result
	// never changes after its sync (copy on write).
	healthChecksShared bool
	// drifted is set when the index was found out of date with the
	// model (never, short of a bug): the next sync is full, and recounts.
	drifted bool
}

func newServiceIndex() serviceIndex {
	return serviceIndex{
		ports:        map[types.NamespacedName][]proxy.ServicePortName{},
		healthChecks: map[types.NamespacedName]HealthCheckService{},
	}
}

// setPorts records the port names of a service; none forgets it.
func (x *serviceIndex) setPorts(nn types.NamespacedName, names []proxy.ServicePortName) {
	if len(names) == 0 {
		delete(x.ports, nn)
		return
	}
	x.ports[nn] = names
}

// setState accounts for the state of one port going from old to st; either
// may be nil (a port added, respectively removed).
func (x *serviceIndex) setState(old, st *proxy.ServiceState) {
	x.count(old, -1)
	x.count(st, +1)
}

func (x *serviceIndex) count(st *proxy.ServiceState, delta int) {
	if st == nil {
		return
	}
	if st.Decisions.NoLocalEndpointsInternal {
		x.noLocalInternal += delta
	}
	if st.Decisions.NoLocalEndpointsExternal {
		x.noLocalExternal += delta
	}
}

// updateHealthCheck recomputes the health check of one service from the
// states of its ports.
func (x *serviceIndex) updateHealthCheck(nn types.NamespacedName, states map[proxy.ServicePortName]*proxy.ServiceState, endpoints proxy.EndpointsMap) {
	hc, ok := healthCheckOf(x.ports[nn], states, endpoints)
	cur, had := x.healthChecks[nn]
	if ok == had && hc == cur {
		return
	}
	if x.healthChecksShared {
		x.healthChecks = maps.Clone(x.healthChecks)
		x.healthChecksShared = false
	}
	if ok {
		x.healthChecks[nn] = hc
	} else {
		delete(x.healthChecks, nn)
	}
}

// healthCheckServices returns the health-check services for a SyncResult;
// the map must not be modified, and the index no longer modifies it.
func (x *serviceIndex) healthCheckServices() map[types.NamespacedName]HealthCheckService {
	x.healthChecksShared = true
	return x.healthChecks
}

// recount rebuilds the index from every state: a full sync's O(services)
// pass, which also repairs any drift.
func (x *serviceIndex) recount(states map[proxy.ServicePortName]*proxy.ServiceState, endpoints proxy.EndpointsMap) {
	ports := make(map[types.NamespacedName][]proxy.ServicePortName, len(x.ports))
	x.noLocalInternal, x.noLocalExternal = 0, 0
	for name, st := range states {
		ports[name.NamespacedName] = append(ports[name.NamespacedName], name)
		x.count(st, +1)
	}
	for _, names := range ports {
		slices.SortFunc(names, proxy.ServicePortName.Compare)
	}
	x.ports = ports
	x.drifted = false
	x.healthChecks = map[types.NamespacedName]HealthCheckService{}
	x.healthChecksShared = false
	for nn, names := range ports {
		if hc, ok := healthCheckOf(names, states, endpoints); ok {
			x.healthChecks[nn] = hc
		}
	}
}

// healthCheckOf is the health check of the service with the given ports:
// its healthCheckNodePort, with the number of distinct Ready endpoint IPs on
// this node over all its ports (terminating endpoints do not count: a load
// balancer should stop sending new connections to this node). ok is false
// when the service has no healthCheckNodePort.
func healthCheckOf(names []proxy.ServicePortName, states map[proxy.ServicePortName]*proxy.ServiceState, endpoints proxy.EndpointsMap) (hc HealthCheckService, ok bool) {
	var local sets.Set[netip.Addr]
	for _, name := range names {
		st := states[name]
		if st == nil || st.HealthCheckNodePort == 0 {
			continue
		}
		ok = true
		hc.Port = st.HealthCheckNodePort
		for _, ep := range endpoints[name] {
			if ep.IsLocal && ep.Ready {
				if local == nil {
					local = sets.New[netip.Addr]()
				}
				local.Insert(ep.IP)
			}
		}
	}
	hc.LocalEndpoints = local.Len()
	return hc, ok
}
