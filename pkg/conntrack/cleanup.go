package conntrack

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
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
	// DeletedUDPEndpoints are UDP endpoints that stopped taking traffic.
	DeletedUDPEndpoints []proxy.ServiceEndpoint
	// NewlyActiveUDPServices are UDP service ports that went from no
	// endpoint to some.
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

// serviceIPs are the addresses a service port takes traffic on: its
// ClusterIP, external IPs and load-balancer IPs.
func serviceIPs(sp *proxy.ServicePort) []netip.Addr {
	out := []netip.Addr{sp.ClusterIP}
	out = append(out, sp.ExternalIPs...)
	return append(out, sp.LoadBalancerVIPs...)
}

// StaleFilters turns stale into conntrack filters, looking services up in
// services (the service ports as of the sync that made them stale).
// Endpoints and newly active ports of services no longer in services are
// skipped: the service's deletion is covered by its ClusterIP. The filters
// are deduplicated and sorted.
func StaleFilters(logger klog.Logger, services proxy.ServicePortMap, stale StaleEntries) []Filter {
	set := sets.New[Filter]()
	for ipStr := range stale.DeletedUDPClusterIPs {
		ip, err := netip.ParseAddr(ipStr)
		if err != nil {
			logger.Error(err, "Ignoring unparsable deleted ClusterIP", "clusterIP", ipStr)
			continue
		}
		set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstIP: ip})
	}
	for _, name := range stale.NewlyActiveUDPServices {
		sp, ok := services[name]
		if !ok || sp.Protocol != v1.ProtocolUDP {
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
	for _, se := range stale.DeletedUDPEndpoints {
		sp, ok := services[se.ServicePortName]
		if !ok || sp.Protocol != v1.ProtocolUDP {
			continue
		}
		ep, err := netip.ParseAddrPort(se.Endpoint)
		if err != nil {
			logger.Error(err, "Ignoring unparsable deleted endpoint", "servicePort", se.ServicePortName, "endpoint", se.Endpoint)
			continue
		}
		epIP := ep.Addr().Unmap()
		// The service port is not matched: flows made before a change of
		// the port number still lead to this endpoint.
		for _, ip := range serviceIPs(sp) {
			if ip.IsValid() {
				set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstIP: ip, ReplySrcIP: epIP, ReplySrcPort: ep.Port()})
			}
		}
		if sp.NodePort != 0 {
			set.Insert(Filter{Protocol: v1.ProtocolUDP, OrigDstPort: uint16(sp.NodePort), ReplySrcIP: epIP, ReplySrcPort: ep.Port()})
		}
	}
	out := set.UnsortedList()
	slices.SortFunc(out, func(a, b Filter) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// CleanStaleEntries deletes the conntrack entries of family that stale
// names, and returns how many it deleted. Call it only after the rules that
// made them stale are in place, or new packets recreate them at once.
func CleanStaleEntries(ctx context.Context, ct Interface, family v1.IPFamily, services proxy.ServicePortMap, stale StaleEntries) (int, error) {
	logger := klog.FromContext(ctx)
	filters := StaleFilters(logger, services, stale)
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
