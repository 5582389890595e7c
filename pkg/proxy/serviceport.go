package proxy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	netutils "k8s.io/utils/net"
)

// Reasons of the ServiceProblems ParseService reports; kproxy uses them as
// the reasons of the Warning events it puts on Services.
const (
	// ServiceProblemInvalidTopologyKeys: the topologyKeys annotation is
	// malformed; the service is treated as having no topology keys.
	ServiceProblemInvalidTopologyKeys = "InvalidTopologyKeys"
	// ServiceProblemInvalidServiceField: a field kproxy reads is malformed
	// or missing; the bad value is skipped.
	ServiceProblemInvalidServiceField = "InvalidServiceField"
	// ServiceProblemIgnoredAnnotation: the Service relies on an annotation
	// that kproxy, like kube-proxy, does not apply.
	ServiceProblemIgnoredAnnotation = "IgnoredAnnotation"
)

// ServiceProblem is one thing in a Service that kproxy cannot honour and
// works around. Problems are comparable: two parses of equal fields give
// equal problems.
type ServiceProblem struct {
	// Reason is one of the ServiceProblem* constants.
	Reason string
	// Message says what is wrong and what kproxy does instead.
	Message string
}

// ShouldSkipService reports whether kproxy programs nothing for svc, and
// why: a nil Service, an ExternalName Service, a headless Service
// (clusterIP "None") or one without any ClusterIP. Which Services this
// proxy is responsible for at all (the service-proxy-name label) is decided
// by the informer's label selector, not here.
func ShouldSkipService(svc *v1.Service) (skip bool, reason string) {
	if svc == nil {
		return true, "nil"
	}
	if svc.Spec.Type == v1.ServiceTypeExternalName {
		return true, "ExternalName"
	}
	primary := svc.Spec.ClusterIP
	if primary == "" && len(svc.Spec.ClusterIPs) > 0 {
		primary = svc.Spec.ClusterIPs[0]
	}
	switch primary {
	case v1.ClusterIPNone:
		return true, "headless"
	case "":
		return true, "no ClusterIP"
	}
	return false, ""
}

// ParseService translates one Service into the ServicePorts of one IP
// family, one per entry of spec.ports, and lists the problems it found
// on the way, in the order of the fields. It is the only place where kproxy
// reads a Service.
//
// Services that ShouldSkipService skips give neither ports nor problems.
// Otherwise the problems do not depend on family: a Service without a
// ClusterIP of the family gives no ports but still its problems, so that
// one IP family's tracker sees every problem. Malformed optional fields (an
// external IP, a source range, the topologyKeys annotation) are dropped and
// reported; they never affect another service and never drop the service
// itself.
//
// The returned ServicePorts may share slices with each other; treat them as
// read-only.
func ParseService(svc *v1.Service, family v1.IPFamily) (ServicePortMap, []ServiceProblem) {
	list, problems := parseServicePorts(svc, family)
	if list == nil {
		return nil, problems
	}
	m := make(ServicePortMap, len(list))
	for _, sp := range list {
		m[sp.Name] = sp
	}
	return m, problems
}

// servicePorts are one Service's ports, in spec order, each name once: a
// Service has a port or two, and a list is a tenth of a map's size.
type servicePorts []*ServicePort

// find returns the port called name.
func (l servicePorts) find(name ServicePortName) (*ServicePort, bool) {
	for _, sp := range l {
		if sp.Name == name {
			return sp, true
		}
	}
	return nil, false
}

// equal reports whether two lists hold equal ServicePorts under the same
// names, in any order.
func (l servicePorts) equal(o servicePorts) bool {
	if len(l) != len(o) {
		return false
	}
	for _, sp := range l {
		osp, ok := o.find(sp.Name)
		if !ok || !sp.equal(osp) {
			return false
		}
	}
	return true
}

// parseServicePorts is ParseService with the ports as a list (nil when
// none); of two ports with the same name, the last one counts.
func parseServicePorts(svc *v1.Service, family v1.IPFamily) (servicePorts, []ServiceProblem) {
	if skip, _ := ShouldSkipService(svc); skip {
		return nil, nil
	}
	var p problems
	clusterIP, hasClusterIP := clusterIPOfFamily(svc, family, &p)
	// Every port is checked, whatever the family, so that the problems
	// do not depend on it.
	validPorts := validServicePorts(svc, &p)
	externalIPs := externalIPsOfFamily(svc, family, &p)
	var lbVIPs []netip.Addr
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		lbVIPs = loadBalancerVIPsOfFamily(svc, family, &p)
	}

	healthCheckNodePort := 0
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer && svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal {
		switch hc := svc.Spec.HealthCheckNodePort; {
		case hc == 0:
			p.invalidField("spec.healthCheckNodePort is not set on a LoadBalancer service with externalTrafficPolicy Local; kproxy serves no health check for it")
		case !validPortNumber(hc):
			p.invalidField("spec.healthCheckNodePort %d is out of range 1-65535; kproxy serves no health check for it", hc)
		default:
			healthCheckNodePort = int(hc)
		}
	}

	sourceRanges, sourceRangesValid := sourceRangesOfFamily(svc, family, &p)
	if !sourceRangesValid {
		// Failing closed: without any valid range the load balancer IPs
		// would accept every source, which is not what the Service asks.
		lbVIPs = nil
	}

	var topologyKeys []string
	var topologyKeysErr error
	if value, present := svc.Annotations[AnnotationTopologyKeys]; present {
		topologyKeys, topologyKeysErr = ParseTopologyKeys(value)
		if topologyKeysErr != nil {
			topologyKeys = nil
			p.add(ServiceProblemInvalidTopologyKeys, "%v; the service is treated as having no topology keys", topologyKeysErr)
		}
	}

	if !hasClusterIP {
		return nil, p.list
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

	trafficDistribution := ""
	if svc.Spec.TrafficDistribution != nil {
		trafficDistribution = *svc.Spec.TrafficDistribution
	}

	nn := types.NamespacedName{Namespace: svc.Namespace, Name: svc.Name}
	ports := make(servicePorts, 0, len(svc.Spec.Ports))
	for _, i := range validPorts {
		sp := &svc.Spec.Ports[i]
		protocol := sp.Protocol
		if protocol == "" {
			protocol = v1.ProtocolTCP
		}
		name := ServicePortName{NamespacedName: nn, Port: sp.Name, Protocol: protocol}
		port := &ServicePort{
			Name:                     name,
			ClusterIP:                clusterIP,
			Port:                     int(sp.Port),
			Protocol:                 protocol,
			NodePort:                 int(sp.NodePort),
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
		if i := slices.IndexFunc(ports, func(o *ServicePort) bool { return o.Name == name }); i >= 0 {
			ports[i] = port
		} else {
			ports = append(ports, port)
		}
	}
	return ports, p.list
}

// problems collects the ServiceProblems of one parse.
type problems struct {
	list []ServiceProblem
}

func (p *problems) add(reason, format string, args ...any) {
	p.list = append(p.list, ServiceProblem{Reason: reason, Message: fmt.Sprintf(format, args...)})
}

func (p *problems) invalidField(format string, args ...any) {
	p.add(ServiceProblemInvalidServiceField, format, args...)
}

// validPortNumber reports whether n is a port number: 1-65535.
func validPortNumber(n int32) bool { return n >= 1 && n <= 65535 }

// validProtocol reports whether kproxy can program protocol: TCP, UDP or
// SCTP (empty means TCP, the API's default).
func validProtocol(protocol v1.Protocol) bool {
	switch protocol {
	case "", v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP:
		return true
	}
	return false
}

// validServicePorts returns the indexes of the entries of spec.ports that
// kproxy can program and reports the others, which it skips: a protocol
// other than TCP, UDP or SCTP, or a port, node port or numeric target port
// outside 1-65535 (an API server validates these; an old or non-standard
// one may not, and one such port must not stop every other from being
// programmed). A skipped port affects no other port of the Service.
func validServicePorts(svc *v1.Service, p *problems) []int {
	valid := make([]int, 0, len(svc.Spec.Ports))
	for i := range svc.Spec.Ports {
		sp := &svc.Spec.Ports[i]
		var why []string
		if !validProtocol(sp.Protocol) {
			why = append(why, fmt.Sprintf("protocol %q is not TCP, UDP or SCTP", sp.Protocol))
		}
		if !validPortNumber(sp.Port) {
			why = append(why, fmt.Sprintf("port %d is out of range 1-65535", sp.Port))
		}
		if sp.NodePort != 0 && !validPortNumber(sp.NodePort) {
			why = append(why, fmt.Sprintf("nodePort %d is out of range 1-65535", sp.NodePort))
		}
		if sp.TargetPort.Type == intstr.Int && sp.TargetPort.IntVal != 0 && !validPortNumber(sp.TargetPort.IntVal) {
			why = append(why, fmt.Sprintf("targetPort %d is out of range 1-65535", sp.TargetPort.IntVal))
		}
		if len(why) > 0 {
			p.invalidField("spec.ports[%d] (name %q): %s; kproxy skips this port", i, sp.Name, strings.Join(why, ", "))
			continue
		}
		valid = append(valid, i)
	}
	return valid
}

// specialAddrProblem says why addr cannot be a service or endpoint address
// (unspecified, loopback, link-local, multicast or broadcast: what the API
// server refuses in these fields), or "" when it can.
func specialAddrProblem(addr netip.Addr) string {
	switch {
	case addr.IsUnspecified():
		return "the unspecified address"
	case addr.IsLoopback():
		return "a loopback address"
	case addr.IsLinkLocalUnicast():
		return "a link-local address"
	case addr.IsMulticast():
		return "a multicast address"
	case addr == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "the broadcast address"
	}
	return ""
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
// Every entry is checked, so that the problems do not depend on family.
func clusterIPOfFamily(svc *v1.Service, family v1.IPFamily, p *problems) (netip.Addr, bool) {
	candidates := svc.Spec.ClusterIPs
	if len(candidates) == 0 {
		candidates = []string{svc.Spec.ClusterIP}
	}
	var found netip.Addr
	var seen []v1.IPFamily
	for _, s := range candidates {
		if s == "" || s == v1.ClusterIPNone {
			continue
		}
		addr, ok := parseAddrSloppy(s)
		if !ok {
			p.invalidField("spec.clusterIPs: %q is not an IP address; kproxy ignores it", s)
			continue
		}
		if why := specialAddrProblem(addr); why != "" {
			p.invalidField("spec.clusterIPs: %q is %s; kproxy ignores it", s, why)
			continue
		}
		f := familyOfAddr(addr)
		if slices.Contains(seen, f) {
			p.invalidField("spec.clusterIPs: %q is a second %s address; kproxy ignores it", s, f)
			continue
		}
		seen = append(seen, f)
		if f == family {
			found = addr
		}
	}
	return found, found.IsValid()
}

func externalIPsOfFamily(svc *v1.Service, family v1.IPFamily, p *problems) []netip.Addr {
	var out []netip.Addr
	for _, s := range svc.Spec.ExternalIPs {
		addr, ok := parseAddrSloppy(strings.TrimSpace(s))
		if !ok {
			p.invalidField("spec.externalIPs: %q is not an IP address; kproxy ignores it", s)
			continue
		}
		if why := specialAddrProblem(addr); why != "" {
			p.invalidField("spec.externalIPs: %q is %s; kproxy ignores it", s, why)
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
func loadBalancerVIPsOfFamily(svc *v1.Service, family v1.IPFamily, p *problems) []netip.Addr {
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
			p.invalidField("status.loadBalancer.ingress: %q is not an IP address; kproxy ignores it", ing.IP)
			continue
		}
		if why := specialAddrProblem(addr); why != "" {
			p.invalidField("status.loadBalancer.ingress: %q is %s; kproxy ignores it", ing.IP, why)
			continue
		}
		if familyOfAddr(addr) == family {
			out = append(out, addr)
		}
	}
	return out
}

// sourceRangesOfFamily reads spec.loadBalancerSourceRanges as kube-proxy
// does: entries are trimmed (validation historically allowed surrounding
// spaces), empty ones skipped, invalid ones skipped one by one (the others
// still apply), and a zero-length prefix of the family ("0.0.0.0/0", "::/0")
// means any source, which is the same as no range at all for that family.
// Unlike kube-proxy, a field whose every entry is invalid does not mean "no
// restriction": valid is then false, and the caller accepts no load
// balancer traffic for the service rather than traffic from every source.
//
// The legacy annotation service.beta.kubernetes.io/load-balancer-source-ranges
// is not applied (kube-proxy ignores it too); on a LoadBalancer Service
// whose field is empty it is reported, since the ranges it names are then
// not enforced on the node.
func sourceRangesOfFamily(svc *v1.Service, family v1.IPFamily, p *problems) (ranges []netip.Prefix, valid bool) {
	var out []netip.Prefix
	anySource := false
	invalid, parsed := 0, 0
	for _, s := range svc.Spec.LoadBalancerSourceRanges {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		prefix, ok := parsePrefixSloppy(s)
		if !ok {
			p.invalidField("spec.loadBalancerSourceRanges: %q is not a CIDR; kproxy ignores it", s)
			invalid++
			continue
		}
		parsed++
		if familyOfAddr(prefix.Addr()) != family {
			continue
		}
		if prefix.Bits() == 0 {
			anySource = true
		}
		out = append(out, prefix)
	}
	if len(svc.Spec.LoadBalancerSourceRanges) == 0 && svc.Spec.Type == v1.ServiceTypeLoadBalancer &&
		strings.TrimSpace(svc.Annotations[v1.AnnotationLoadBalancerSourceRangesKey]) != "" {
		p.add(ServiceProblemIgnoredAnnotation,
			"annotation %s is ignored: kproxy, like kube-proxy, restricts sources only by spec.loadBalancerSourceRanges",
			v1.AnnotationLoadBalancerSourceRangesKey)
	}
	if invalid > 0 && parsed == 0 {
		if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
			p.invalidField("spec.loadBalancerSourceRanges: no entry is a valid CIDR; kproxy accepts no traffic on the load balancer IPs rather than traffic from every source")
		}
		return nil, false
	}
	if anySource {
		return nil, true
	}
	return out, true
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
