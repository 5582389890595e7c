package proxy

import (
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	netutils "k8s.io/utils/net"
)

// NewServicePortsFromService translates one Service into the ServicePorts of
// one IP family, one per entry of spec.ports. It returns nil for services
// kube-proxy does not handle (headless, ExternalName, no ClusterIP of the
// family). Malformed optional fields (an external IP, a source range, the
// topologyKeys annotation) are logged and dropped; they never affect another
// service and never drop the service itself.
//
// The returned ServicePorts may share slices with each other; treat them as
// read-only.
func NewServicePortsFromService(svc *v1.Service, family v1.IPFamily, logger klog.Logger) ServicePortMap {
	if svc == nil {
		return nil
	}
	logger = logger.WithValues("service", klog.KObj(svc), "ipFamily", family)
	if svc.Spec.Type == v1.ServiceTypeExternalName {
		logger.V(5).Info("Skipping ExternalName service")
		return nil
	}
	if svc.Spec.ClusterIP == v1.ClusterIPNone || (svc.Spec.ClusterIP == "" && len(svc.Spec.ClusterIPs) == 0) {
		logger.V(5).Info("Skipping service without a ClusterIP")
		return nil
	}
	clusterIP, ok := clusterIPOfFamily(svc, family, logger)
	if !ok {
		logger.V(5).Info("Service has no ClusterIP of this family")
		return nil
	}

	externallyAccessible := serviceExternallyAccessible(svc)
	externalPolicyLocal := externallyAccessible && svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal
	internalPolicyLocal := svc.Spec.InternalTrafficPolicy != nil && *svc.Spec.InternalTrafficPolicy == v1.ServiceInternalTrafficPolicyLocal

	affinity := svc.Spec.SessionAffinity == v1.ServiceAffinityClientIP
	stickySeconds := 0
	if affinity {
		stickySeconds = int(v1.DefaultClientIPServiceAffinitySeconds)
		if cfg := svc.Spec.SessionAffinityConfig; cfg != nil && cfg.ClientIP != nil && cfg.ClientIP.TimeoutSeconds != nil && *cfg.ClientIP.TimeoutSeconds > 0 {
			stickySeconds = int(*cfg.ClientIP.TimeoutSeconds)
		}
	}

	externalIPs := externalIPsOfFamily(svc, family, logger)
	var lbVIPs []netip.Addr
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		lbVIPs = loadBalancerVIPsOfFamily(svc, family, logger)
	}
	sourceRanges := sourceRangesOfFamily(svc, family, logger)

	healthCheckNodePort := 0
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer && svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal {
		if svc.Spec.HealthCheckNodePort == 0 {
			logger.Error(nil, "LoadBalancer service with externalTrafficPolicy Local has no healthCheckNodePort")
		} else {
			healthCheckNodePort = int(svc.Spec.HealthCheckNodePort)
		}
	}

	trafficDistribution := ""
	if svc.Spec.TrafficDistribution != nil {
		trafficDistribution = *svc.Spec.TrafficDistribution
	}

	var topologyKeys []string
	var topologyKeysErr error
	if value, present := svc.Annotations[AnnotationTopologyKeys]; present {
		topologyKeys, topologyKeysErr = ParseTopologyKeys(value)
		if topologyKeysErr != nil {
			topologyKeys = nil
			logger.Error(topologyKeysErr, "Ignoring malformed topologyKeys annotation; the service is treated as having no topology keys", "value", value)
		}
	}

	nn := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
	ports := make(ServicePortMap, len(svc.Spec.Ports))
	for i := range svc.Spec.Ports {
		p := &svc.Spec.Ports[i]
		protocol := p.Protocol
		if protocol == "" {
			protocol = v1.ProtocolTCP
		}
		name := ServicePortName{NamespacedName: nn, Port: p.Name, Protocol: protocol}
		ports[name] = &ServicePort{
			Name:                     name,
			ClusterIP:                clusterIP,
			Port:                     int(p.Port),
			Protocol:                 protocol,
			NodePort:                 int(p.NodePort),
			ExternalIPs:              externalIPs,
			LoadBalancerVIPs:         lbVIPs,
			LoadBalancerSourceRanges: sourceRanges,
			SessionAffinityClientIP:  affinity,
			StickyMaxAgeSeconds:      stickySeconds,
			ExternalPolicyLocal:      externalPolicyLocal,
			InternalPolicyLocal:      internalPolicyLocal,
			HealthCheckNodePort:      healthCheckNodePort,
			TrafficDistribution:      trafficDistribution,
			TopologyKeys:             topologyKeys,
			TopologyKeysError:        topologyKeysErr,
		}
	}
	return ports
}

// serviceExternallyAccessible mirrors the API's notion: NodePort and
// LoadBalancer services, and ClusterIP services with external IPs.
func serviceExternallyAccessible(svc *v1.Service) bool {
	switch svc.Spec.Type {
	case v1.ServiceTypeNodePort, v1.ServiceTypeLoadBalancer:
		return true
	}
	return len(svc.Spec.ExternalIPs) > 0
}

// clusterIPOfFamily picks the service's ClusterIP of the given family from
// spec.clusterIPs (spec.clusterIP when clusterIPs is empty, for old objects).
func clusterIPOfFamily(svc *v1.Service, family v1.IPFamily, logger klog.Logger) (netip.Addr, bool) {
	candidates := svc.Spec.ClusterIPs
	if len(candidates) == 0 {
		candidates = []string{svc.Spec.ClusterIP}
	}
	for _, s := range candidates {
		if s == "" || s == v1.ClusterIPNone {
			continue
		}
		addr, ok := parseAddrSloppy(s)
		if !ok {
			logger.Error(nil, "Ignoring invalid ClusterIP", "clusterIP", s)
			continue
		}
		if familyOfAddr(addr) == family {
			return addr, true
		}
	}
	return netip.Addr{}, false
}

func externalIPsOfFamily(svc *v1.Service, family v1.IPFamily, logger klog.Logger) []netip.Addr {
	var out []netip.Addr
	for _, s := range svc.Spec.ExternalIPs {
		addr, ok := parseAddrSloppy(strings.TrimSpace(s))
		if !ok {
			logger.Error(nil, "Ignoring invalid external IP", "externalIP", s)
			continue
		}
		if familyOfAddr(addr) == family {
			out = append(out, addr)
		}
	}
	return out
}

// loadBalancerVIPsOfFamily returns the ingress IPs the node must accept
// traffic for: ingress in ipMode Proxy is delivered by the load balancer to
// the endpoints itself and is excluded.
func loadBalancerVIPsOfFamily(svc *v1.Service, family v1.IPFamily, logger klog.Logger) []netip.Addr {
	var out []netip.Addr
	for _, ing := range svc.Status.LoadBalancer.Ingress {
		if ing.IP == "" {
			continue
		}
		if ing.IPMode != nil && *ing.IPMode == v1.LoadBalancerIPModeProxy {
			continue
		}
		addr, ok := parseAddrSloppy(strings.TrimSpace(ing.IP))
		if !ok {
			logger.Error(nil, "Ignoring invalid load balancer ingress IP", "ingressIP", ing.IP)
			continue
		}
		if familyOfAddr(addr) == family {
			out = append(out, addr)
		}
	}
	return out
}

// sourceRangesOfFamily reads spec.loadBalancerSourceRanges, falling back to
// the legacy annotation when the field is empty, as upstream does. Entries
// are trimmed because validation historically allowed surrounding spaces.
func sourceRangesOfFamily(svc *v1.Service, family v1.IPFamily, logger klog.Logger) []netip.Prefix {
	raw := svc.Spec.LoadBalancerSourceRanges
	source := "spec.loadBalancerSourceRanges"
	if len(raw) == 0 {
		if value := strings.TrimSpace(svc.Annotations[v1.AnnotationLoadBalancerSourceRangesKey]); value != "" {
			raw = strings.Split(value, ",")
			source = "annotation " + v1.AnnotationLoadBalancerSourceRangesKey
		}
	}
	var out []netip.Prefix
	for _, s := range raw {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		prefix, ok := parsePrefixSloppy(s)
		if !ok {
			logger.Error(nil, "Ignoring invalid load balancer source range", "sourceRange", s, "source", source)
			continue
		}
		if familyOfAddr(prefix.Addr()) == family {
			out = append(out, prefix)
		}
	}
	return out
}

// parseAddrSloppy parses an IP address accepting the legacy forms the API
// server still admits (IPv4 octets with leading zeros). IPv4-mapped IPv6
// addresses are treated as IPv4, like net.IP does.
func parseAddrSloppy(s string) (netip.Addr, bool) {
	ip := netutils.ParseIPSloppy(s)
	if ip == nil {
		return netip.Addr{}, false
	}
	addr, ok := netip.AddrFromSlice(ip)
	if !ok {
		return netip.Addr{}, false
	}
	return addr.Unmap(), true
}

// parsePrefixSloppy parses a CIDR like parseAddrSloppy parses an IP; the
// result is the masked network.
func parsePrefixSloppy(s string) (netip.Prefix, bool) {
	_, ipNet, err := netutils.ParseCIDRSloppy(s)
	if err != nil || ipNet == nil {
		return netip.Prefix{}, false
	}
	addr, ok := netip.AddrFromSlice(ipNet.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	ones, bits := ipNet.Mask.Size()
	addr = addr.Unmap()
	if bits == 128 && addr.Is4() {
		// A 16-byte mask over an IPv4 address: keep the IPv4 part.
		ones -= 96
	}
	if ones < 0 {
		return netip.Prefix{}, false
	}
	return netip.PrefixFrom(addr, ones).Masked(), true
}

func familyOfAddr(a netip.Addr) v1.IPFamily {
	if a.Is4() || a.Is4In6() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}

// equal reports whether two ServicePorts describe the same dataplane
// behaviour. Errors are compared by message.
func (s *ServicePort) equal(o *ServicePort) bool {
	if s == nil || o == nil {
		return s == o
	}
	return s.Name == o.Name &&
		s.ClusterIP == o.ClusterIP &&
		s.Port == o.Port &&
		s.Protocol == o.Protocol &&
		s.NodePort == o.NodePort &&
		slices.Equal(s.ExternalIPs, o.ExternalIPs) &&
		slices.Equal(s.LoadBalancerVIPs, o.LoadBalancerVIPs) &&
		slices.Equal(s.LoadBalancerSourceRanges, o.LoadBalancerSourceRanges) &&
		s.SessionAffinityClientIP == o.SessionAffinityClientIP &&
		s.StickyMaxAgeSeconds == o.StickyMaxAgeSeconds &&
		s.ExternalPolicyLocal == o.ExternalPolicyLocal &&
		s.InternalPolicyLocal == o.InternalPolicyLocal &&
		s.HealthCheckNodePort == o.HealthCheckNodePort &&
		s.TrafficDistribution == o.TrafficDistribution &&
		slices.Equal(s.TopologyKeys, o.TopologyKeys) &&
		errorMessagesEqual(s.TopologyKeysError, o.TopologyKeysError)
}

func errorMessagesEqual(a, b error) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return a.Error() == b.Error()
}

// equal reports whether two maps hold equal ServicePorts under the same
// names; nil and empty maps are equal.
func (m ServicePortMap) equal(o ServicePortMap) bool {
	if len(m) != len(o) {
		return false
	}
	for name, sp := range m {
		osp, ok := o[name]
		if !ok || !sp.equal(osp) {
			return false
		}
	}
	return true
}
