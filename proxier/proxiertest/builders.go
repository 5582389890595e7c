package proxiertest

import (
	"fmt"
	"net/netip"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Namespace of every test object.
const Namespace = "ns"

// SvcOpt modifies a Service under construction.
type SvcOpt func(*v1.Service)

// Service builds a ClusterIP Service with one TCP port "p" (port 80).
func Service(name, clusterIP string, opts ...SvcOpt) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: name},
		Spec: v1.ServiceSpec{
			Type:       v1.ServiceTypeClusterIP,
			ClusterIP:  clusterIP,
			ClusterIPs: []string{clusterIP},
			Ports:      []v1.ServicePort{{Name: "p", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Ports replaces the service's ports.
func Ports(ports ...v1.ServicePort) SvcOpt { return func(s *v1.Service) { s.Spec.Ports = ports } }

// NodePort makes the service type NodePort with nodePort on its first port.
func NodePort(nodePort int32) SvcOpt {
	return func(s *v1.Service) {
		if s.Spec.Type == v1.ServiceTypeClusterIP {
			s.Spec.Type = v1.ServiceTypeNodePort
		}
		s.Spec.Ports[0].NodePort = nodePort
	}
}

// LoadBalancer makes the service a LoadBalancer with the ingress IPs.
func LoadBalancer(ingress ...string) SvcOpt {
	return func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		for _, ip := range ingress {
			s.Status.LoadBalancer.Ingress = append(s.Status.LoadBalancer.Ingress, v1.LoadBalancerIngress{IP: ip})
		}
	}
}

// ProxyModeIngress adds an ingress IP with ipMode Proxy.
func ProxyModeIngress(ip string) SvcOpt {
	return func(s *v1.Service) {
		s.Status.LoadBalancer.Ingress = append(s.Status.LoadBalancer.Ingress,
			v1.LoadBalancerIngress{IP: ip, IPMode: ptr.To(v1.LoadBalancerIPModeProxy)})
	}
}

// SourceRanges sets loadBalancerSourceRanges.
func SourceRanges(r ...string) SvcOpt {
	return func(s *v1.Service) { s.Spec.LoadBalancerSourceRanges = r }
}

// ExternalIPs sets spec.externalIPs.
func ExternalIPs(ips ...string) SvcOpt { return func(s *v1.Service) { s.Spec.ExternalIPs = ips } }

// ExternalLocal sets externalTrafficPolicy Local (and a health check port
// for LoadBalancers).
func ExternalLocal() SvcOpt {
	return func(s *v1.Service) {
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
		if s.Spec.Type == v1.ServiceTypeLoadBalancer {
			s.Spec.HealthCheckNodePort = 32000
		}
	}
}

// InternalLocal sets internalTrafficPolicy Local.
func InternalLocal() SvcOpt {
	return func(s *v1.Service) { s.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal) }
}

// Affinity sets ClientIP session affinity with timeout seconds (0: default).
func Affinity(seconds int32) SvcOpt {
	return func(s *v1.Service) {
		s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		if seconds > 0 {
			s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(seconds)}}
		}
	}
}

// Annotation sets an annotation.
func Annotation(k, v string) SvcOpt {
	return func(s *v1.Service) {
		if s.Annotations == nil {
			s.Annotations = map[string]string{}
		}
		s.Annotations[k] = v
	}
}

// TrafficDistribution sets spec.trafficDistribution.
func TrafficDistribution(td string) SvcOpt {
	return func(s *v1.Service) { s.Spec.TrafficDistribution = ptr.To(td) }
}

// IPv6 makes the service single-stack IPv6 (clusterIP already v6).
func IPv6() SvcOpt {
	return func(s *v1.Service) { s.Spec.IPFamilies = []v1.IPFamily{v1.IPv6Protocol} }
}

// EP describes one endpoint of a slice.
type EP struct {
	IP          string
	Node        string
	Zone        string
	NotReady    bool // ready=false, serving=false
	Terminating bool // terminating (serving unless NotReady)
	ZoneHints   []string
	NodeHints   []string
}

// Slice builds an EndpointSlice for service with one port named "p" at
// port, holding eps. Its address type follows the first endpoint.
func Slice(service string, port int32, eps ...EP) *discovery.EndpointSlice {
	return SliceWithPorts(service, []discovery.EndpointPort{{Name: ptr.To("p"), Port: ptr.To(port), Protocol: ptr.To(v1.ProtocolTCP)}}, eps...)
}

// SliceWithPorts is Slice with explicit ports.
func SliceWithPorts(service string, ports []discovery.EndpointPort, eps ...EP) *discovery.EndpointSlice {
	at := discovery.AddressTypeIPv4
	if len(eps) > 0 && netip.MustParseAddr(eps[0].IP).Is6() {
		at = discovery.AddressTypeIPv6
	}
	s := &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: Namespace, Name: fmt.Sprintf("%s-%s", service, at),
			Labels: map[string]string{discovery.LabelServiceName: service},
		},
		AddressType: at,
		Ports:       ports,
	}
	for _, e := range eps {
		ready := !e.NotReady && !e.Terminating
		serving := !e.NotReady
		ep := discovery.Endpoint{
			Addresses: []string{e.IP},
			Conditions: discovery.EndpointConditions{
				Ready: ptr.To(ready), Serving: ptr.To(serving), Terminating: ptr.To(e.Terminating),
			},
		}
		if e.Node != "" {
			ep.NodeName = ptr.To(e.Node)
		}
		if e.Zone != "" {
			ep.Zone = ptr.To(e.Zone)
		}
		if len(e.ZoneHints) > 0 || len(e.NodeHints) > 0 {
			ep.Hints = &discovery.EndpointHints{}
			for _, z := range e.ZoneHints {
				ep.Hints.ForZones = append(ep.Hints.ForZones, discovery.ForZone{Name: z})
			}
			for _, n := range e.NodeHints {
				ep.Hints.ForNodes = append(ep.Hints.ForNodes, discovery.ForNode{Name: n})
			}
		}
		s.Endpoints = append(s.Endpoints, ep)
	}
	return s
}

// Node builds a Node with labels.
func Node(name string, labels map[string]string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

// ServicePortNameOf names port of a Service built here.
func ServicePortNameOf(s *v1.Service, port string) proxy.ServicePortName {
	proto := v1.ProtocolTCP
	for _, p := range s.Spec.Ports {
		if p.Name == port {
			proto = p.Protocol
		}
	}
	return proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: s.Namespace, Name: s.Name}, Port: port, Protocol: proto}
}
