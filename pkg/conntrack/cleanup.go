package conntrack

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// StaleEntries names what some applied changes made stale, as the change
// trackers report it. The zero value is empty and ready to use.
type StaleEntries struct {
	// DeletedUDPClusterIPs are ClusterIPs of UDP service ports that went
	// away.
	DeletedUDPClusterIPs sets.Set[string]
	// DeletedUDPEndpoints are UDP endpoints that stopped serving or were
	// removed.
	DeletedUDPEndpoints []proxy.ServiceEndpoint
	// NewlyActiveUDPServices are UDP service ports that went from no
	// usable endpoint to some.
	NewlyActiveUDPServices []proxy.ServicePortName
}

// Add merges the stale entries one Apply of each change tracker reported.
func (s *StaleEntries) Add(svc proxy.UpdateServiceMapResult, eps proxy.UpdateEndpointsMapResult) {
	if svc.DeletedUDPClusterIPs.Len() > 0 {
		if s.DeletedUDPClusterIPs == nil {
			s.DeletedUDPClusterIPs = sets.New[string]()
		}
		s.DeletedUDPClusterIPs.Insert(svc.DeletedUDPClusterIPs.UnsortedList()...)
	}
	s.DeletedUDPEndpoints = append(s.DeletedUDPEndpoints, eps.DeletedUDPEndpoints...)
	s.NewlyActiveUDPServices = append(s.NewlyActiveUDPServices, eps.NewlyActiveUDPServices...)
}

// Empty reports whether nothing is stale.
func (s *StaleEntries) Empty() bool {
	return s.DeletedUDPClusterIPs.Len() == 0 && len(s.DeletedUDPEndpoints) == 0 && len(s.NewlyActiveUDPServices) == 0
}

// Current is the state that stale entries are judged against: the service
// ports and endpoints as of the successful sync after which the entries are
// deleted (noted stale entries may span several syncs when some failed).
type Current struct {
	Services  proxy.ServicePortMap
	Endpoints proxy.EndpointsMap
}

// serviceIPs are the addresses a service port takes traffic on: its
// ClusterIP, external IPs and load-balancer IPs.
func serviceIPs(sp *proxy.ServicePort) []netip.Addr {
	out := []netip.Addr{sp.ClusterIP}
	out = append(out, sp.ExternalIPs...)
	return append(out, sp.LoadBalancerVIPs...)
}

// servingKey is one endpoint of one service.
type servingKey struct {
	service  types.NamespacedName
	endpoint netip.AddrPort
}

// servingPorts maps each endpoint of the services named in eps to the
// names of the service's UDP ports it serves in endpoints.
func servingPorts(endpoints proxy.EndpointsMap, eps []proxy.ServiceEndpoint) map[servingKey]sets.Set[string] {
	wanted := sets.New[types.NamespacedName]()
	for _, se := range eps {
		wanted.Insert(se.ServicePortName.NamespacedName)
	}
	out := map[servingKey]sets.Set[string]{}
	for name, list := range endpoints {
		if name.Protocol != v1.ProtocolUDP || !wanted.Has(name.NamespacedName) {
			continue
		}
		for _, ep := range list {
			if !ep.Serving {
				continue
			}
			k := servingKey{name.NamespacedName, netip.AddrPortFrom(ep.IP.Unmap(), uint16(ep.Port))}
			if out[k] == nil {
				out[k] = sets.New[string]()
			}
			out[k].Insert(name.Port)
		}
	}
	return out
}

// StaleFilters turns stale into conntrack filters, judged against cur.
// The filters are deduplicated and sorted.
//
// The rule is upstream kube-proxy's: a UDP entry to a service port's
// address (ClusterIP, external IP, load-balancer IP, and port) or node
// port is kept exactly when a serving endpoint of that port answers it. An
// endpoint that is terminating but still serving keeps its entries until
// it stops serving or is removed. Being driven by changes rather than by a
// scan of the whole table, kproxy deletes:
//
//   - for an endpoint that stopped serving or was removed (and does not
//     serve the same service port again in cur): the entries it answers to
//     any port of the service's addresses, and to the service port's node
//     port. Entries to any port, so that flows made before the port number
//     changed are deleted too, unless the endpoint still serves another UDP
//     port of the service: then only the service port's own. The node port
//     entries are deleted also when no serving endpoint is left, which
//     upstream does not do; being matched on the endpoint as well, they
//     never include flows kproxy did not DNAT.
//   - for a service port that got its first usable endpoint (and has a
//     serving one in cur): every entry to the port on the service's
//     addresses and to its node port, made while its traffic was not
//     DNATed.
//   - for a ClusterIP of a UDP service port that went away and that no
//     current UDP service port uses: every UDP entry to that IP, whatever
//     the port. Upstream leaves these to time out; flows to a deleted
//     service would otherwise keep reaching its old endpoints.
//
// Endpoints and newly active ports of service ports no longer in cur are
// skipped: a deleted service is covered by its ClusterIP, and the flows of
// a UDP port removed from a service that keeps its ClusterIP are left to
// time out, as upstream leaves them.
func StaleFilters(logger klog.Logger, cur Current, stale StaleEntries) []Filter {
	set := sets.New[Filter]()
	if stale.DeletedUDPClusterIPs.Len() > 0 {
		inUse := sets.New[netip.Addr]()
		for _, sp := range cur.Services {
			if sp.Protocol == v1.ProtocolUDP && sp.ClusterIP.IsValid() {
				inUse.Insert(sp.ClusterIP.Unmap())
			}
		}
		for ipStr := range stale.DeletedUDPClusterIPs {
			ip, err := netip.ParseAddr(ipStr)
			if err != nil {
				logger.Error(err, "Ignoring unparsable deleted ClusterIP", "clusterIP", ipStr)
				continue
			}
			if inUse.Has(ip.Unmap()) {
				// A UDP port of the service went away, or the IP was
				// given to a new service: the flows of the ports in use
				// must stay.
				logger.V(4).Info("Keeping conntrack entries of a deleted ClusterIP that a UDP service port uses", "clusterIP", ip)
				continue
			}
			set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstIP: ip})
		}
	}
	for _, name := range stale.NewlyActiveUDPServices {
		sp, ok := cur.Services[name]
		if !ok || sp.Protocol != v1.ProtocolUDP {
			continue
		}
		if !slices.ContainsFunc(cur.Endpoints[name], func(ep *proxy.Endpoint) bool { return ep.Serving }) {
			// It lost its endpoints again since (syncs failed meanwhile).
			continue
		}
		// Only this port's traffic was black-holed; the service's other
		// ports keep their flows.
		for _, ip := range serviceIPs(sp) {
			if ip.IsValid() {
				set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstIP: ip, OrigDstPort: uint16(sp.Port)})
			}
		}
		if sp.NodePort != 0 {
			set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstPort: uint16(sp.NodePort)})
		}
	}
	serving := servingPorts(cur.Endpoints, stale.DeletedUDPEndpoints)
	for _, se := range stale.DeletedUDPEndpoints {
		sp, ok := cur.Services[se.ServicePortName]
		if !ok || sp.Protocol != v1.ProtocolUDP {
			continue
		}
		ep, err := netip.ParseAddrPort(se.Endpoint)
		if err != nil {
			logger.Error(err, "Ignoring unparsable deleted endpoint", "servicePort", se.ServicePortName, "endpoint", se.Endpoint)
			continue
		}
		ep = netip.AddrPortFrom(ep.Addr().Unmap(), ep.Port())
		ports := serving[servingKey{se.ServicePortName.NamespacedName, ep}]
		if ports.Has(se.ServicePortName.Port) {
			// Serving again (syncs failed meanwhile): its flows stay.
			continue
		}
		var port uint16 // any
		if ports.Len() > 0 {
			port = uint16(sp.Port)
		}
		for _, ip := range serviceIPs(sp) {
			if ip.IsValid() {
				set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstIP: ip, OrigDstPort: port, ReplySrcIP: ep.Addr(), ReplySrcPort: ep.Port()})
			}
		}
		if sp.NodePort != 0 {
			set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstPort: uint16(sp.NodePort), ReplySrcIP: ep.Addr(), ReplySrcPort: ep.Port()})
		}
	}
	out := set.UnsortedList()
	slices.SortFunc(out, func(a, b Filter) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// CleanStaleEntries deletes the conntrack entries of family that stale
// names, judged against cur (see StaleFilters), and returns how many it
// deleted. Call it only after the rules that made them stale are in place,
// or new packets recreate them at once.
func CleanStaleEntries(ctx context.Context, ct Interface, family v1.IPFamily, cur Current, stale StaleEntries) (int, error) {
	logger := klog.FromContext(ctx)
	filters := StaleFilters(logger, cur, stale)
	if len(filters) == 0 {
		return 0, nil
	}
	if logger.V(4).Enabled() {
		for _, f := range filters {
			logger.V(4).Info("Deleting stale conntrack entries", "ipFamily", family, "filter", f.String())
		}
	}
	n, err := ct.ClearEntries(ctx, family, filters...)
	if err != nil {
		return n, fmt.Errorf("clearing stale UDP conntrack entries: %w", err)
	}
	logger.V(2).Info("Deleted stale UDP conntrack entries", "ipFamily", family, "filters", len(filters), "deleted", n)
	return n, nil
}

// BlackHoledFilters selects, for every service port of services, the
// flows to its addresses (ClusterIP, external IPs, load-balancer IPs, of
// family) that were never DNATed and, for TCP, never answered: they began
// while the node had no rule for the address (kproxy not yet running, a
// flush not yet repaired, a refused service) and went nowhere. Their
// entries outlive the gap (120 s for an unanswered TCP SYN, 30 s for UDP),
// and a client that picks the same source port again meanwhile follows
// the entry instead of the rules: its connection fails although the
// service works. Node ports are left out: traffic to a node port without
// a rule reaches the node itself and is refused at once, and a flow to the
// same port on some other host is not kproxy's.
func BlackHoledFilters(services proxy.ServicePortMap, family v1.IPFamily) []Filter {
	var out []Filter
	for _, sp := range services {
		for _, ip := range serviceIPs(sp) {
			if !ip.IsValid() || familyOf(ip) != family || sp.Port <= 0 || sp.Port > 65535 {
				continue
			}
			out = append(out, Filter{Protocol: sp.Protocol, OrigDstIP: ip.Unmap(), OrigDstPort: uint16(sp.Port), BlackHoled: true})
		}
	}
	return out
}

// CleanBlackHoled deletes the black-holed flows of family to the addresses
// of services (BlackHoledFilters) and returns how many it deleted. Call it
// after a sync that put every rule in place (a full sync): flows made in a
// gap that such a sync closed are then dead for good.
func CleanBlackHoled(ctx context.Context, ct Interface, family v1.IPFamily, services proxy.ServicePortMap) (int, error) {
	filters := BlackHoledFilters(services, family)
	if len(filters) == 0 {
		return 0, nil
	}
	n, err := ct.ClearEntries(ctx, family, filters...)
	if err != nil {
		return n, fmt.Errorf("clearing black-holed conntrack entries: %w", err)
	}
	if n > 0 {
		klog.FromContext(ctx).V(2).Info("Deleted black-holed conntrack entries (never DNATed, unanswered)", "ipFamily", family, "deleted", n)
	}
	return n, nil
}
