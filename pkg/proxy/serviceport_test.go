package proxy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
)

// spTestService is a dual-stack ClusterIP service with one TCP port "http".
func spTestService(mods ...func(*v1.Service)) *v1.Service {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "svc"},
		Spec: v1.ServiceSpec{
			Type:       v1.ServiceTypeClusterIP,
			ClusterIP:  "10.0.0.1",
			ClusterIPs: []string{"10.0.0.1", "fd00::1"},
			IPFamilies: []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol},
			Ports:      []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	for _, mod := range mods {
		mod(svc)
	}
	return svc
}

var spTestName = types.NamespacedName{Namespace: "ns", Name: "svc"}

// spTestPort is the expected ServicePort of spTestService's "http" port.
func spTestPort(clusterIP string, mods ...func(*ServicePort)) *ServicePort {
	sp := &ServicePort{
		Name:      ServicePortName{NamespacedName: spTestName, Port: "http", Protocol: v1.ProtocolTCP},
		ClusterIP: netip.MustParseAddr(clusterIP),
		Port:      80,
		Protocol:  v1.ProtocolTCP,
	}
	for _, mod := range mods {
		mod(sp)
	}
	return sp
}

func spTestMap(ports ...*ServicePort) ServicePortMap {
	m := ServicePortMap{}
	for _, p := range ports {
		m[p.Name] = p
	}
	return m
}

func spTestAddrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func spTestPrefixes(ss ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, s := range ss {
		out = append(out, netip.MustParsePrefix(s))
	}
	return out
}

func spTestIngress(ip string, mode *v1.LoadBalancerIPMode) v1.LoadBalancerIngress {
	return v1.LoadBalancerIngress{IP: ip, IPMode: mode}
}

// invalidField is the InvalidServiceField problem with message msg.
func invalidField(msg string) ServiceProblem {
	return ServiceProblem{Reason: ServiceProblemInvalidServiceField, Message: msg}
}

func TestParseService(t *testing.T) {
	malformedKeys := `["zone1",`
	_, malformedErr := ParseTopologyKeys(malformedKeys)
	if malformedErr == nil {
		t.Fatalf("ParseTopologyKeys(%q) succeeded, the test needs a malformed value", malformedKeys)
	}

	lb := func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.Ports[0].NodePort = 30080
	}

	tests := []struct {
		name         string
		svc          *v1.Service
		family       v1.IPFamily
		want         ServicePortMap
		wantProblems []ServiceProblem
	}{
		{
			name:   "dual-stack service, IPv4 family",
			svc:    spTestService(),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
		{
			name:   "dual-stack service, IPv6 family",
			svc:    spTestService(),
			family: v1.IPv6Protocol,
			want:   spTestMap(spTestPort("fd00::1")),
		},
		{
			name: "IPv6-primary dual-stack service, IPv4 family",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = "fd00::1"
				s.Spec.ClusterIPs = []string{"fd00::1", "10.0.0.1"}
				s.Spec.IPFamilies = []v1.IPFamily{v1.IPv6Protocol, v1.IPv4Protocol}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
		{
			name: "single-stack IPv4 service, IPv6 family yields nothing",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIPs = []string{"10.0.0.1"}
				s.Spec.IPFamilies = []v1.IPFamily{v1.IPv4Protocol}
			}),
			family: v1.IPv6Protocol,
			want:   nil,
		},
		{
			name: "legacy object with only spec.clusterIP",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIPs = nil
				s.Spec.IPFamilies = nil
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
		{
			name: "headless service yields nothing",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = v1.ClusterIPNone
				s.Spec.ClusterIPs = []string{v1.ClusterIPNone}
			}),
			family: v1.IPv4Protocol,
			want:   nil,
		},
		{
			name: "ExternalName service yields nothing",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeExternalName
				s.Spec.ExternalName = "example.com"
			}),
			family: v1.IPv4Protocol,
			want:   nil,
		},
		{
			name: "service without ClusterIP yields nothing",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = ""
				s.Spec.ClusterIPs = nil
			}),
			family: v1.IPv4Protocol,
			want:   nil,
		},
		{
			name: "invalid ClusterIP yields nothing",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = "10.0.0.300"
				s.Spec.ClusterIPs = []string{"10.0.0.300"}
			}),
			family:       v1.IPv4Protocol,
			want:         nil,
			wantProblems: []ServiceProblem{invalidField(`spec.clusterIPs: "10.0.0.300" is not an IP address; kproxy ignores it`)},
		},
		{
			name: "every port, unnamed port and defaulted protocol",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = []v1.ServicePort{
					{Name: "", Port: 53, Protocol: v1.ProtocolUDP},
					{Name: "http", Port: 80},
				}
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(
				spTestPort("10.0.0.1", func(p *ServicePort) {
					p.Name = ServicePortName{NamespacedName: spTestName, Port: "", Protocol: v1.ProtocolUDP}
					p.Port = 53
					p.Protocol = v1.ProtocolUDP
				}),
				spTestPort("10.0.0.1"),
			),
		},
		{
			name: "node port",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.Ports[0].NodePort = 30080
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.NodePort = 30080 })),
		},
		{
			name: "port 70000 skips that port only",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "big", Port: 70000, Protocol: v1.ProtocolTCP})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "big"): port 70000 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "port 0",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "zero", Port: 0, Protocol: v1.ProtocolUDP})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "zero"): port 0 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "negative port",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "neg", Port: -80})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "neg"): port -80 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "protocol ICMP",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "ping", Port: 7, Protocol: "ICMP"})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "ping"): protocol "ICMP" is not TCP, UDP or SCTP; kproxy skips this port`)},
		},
		{
			name: "lower-case protocol tcp",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "low", Port: 81, Protocol: "tcp"})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "low"): protocol "tcp" is not TCP, UDP or SCTP; kproxy skips this port`)},
		},
		{
			name: "node port 70000",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.Ports[0].NodePort = 30080
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "np", Port: 81, NodePort: 70000, Protocol: v1.ProtocolTCP})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.NodePort = 30080 })),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "np"): nodePort 70000 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "target port 70000",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "tp", Port: 81, TargetPort: intstr.FromInt32(70000), Protocol: v1.ProtocolTCP})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "tp"): targetPort 70000 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "named target port and target port 0 (defaulted) are fine",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports[0].TargetPort = intstr.FromString("web")
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "tp", Port: 81, Protocol: v1.ProtocolTCP})
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1"), spTestPort("10.0.0.1", func(p *ServicePort) {
				p.Name.Port = "tp"
				p.Port = 81
			})),
		},
		{
			name: "several problems of one port in one message",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "bad", Port: 70000, Protocol: "ICMP"})
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "bad"): protocol "ICMP" is not TCP, UDP or SCTP, port 70000 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "invalid port of a single-stack IPv6 service is reported by the IPv4 family too",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = "fd00::1"
				s.Spec.ClusterIPs = []string{"fd00::1"}
				s.Spec.IPFamilies = []v1.IPFamily{v1.IPv6Protocol}
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "big", Port: 70000, Protocol: v1.ProtocolTCP})
			}),
			family:       v1.IPv4Protocol,
			want:         nil,
			wantProblems: []ServiceProblem{invalidField(`spec.ports[1] (name "big"): port 70000 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "loopback ClusterIP yields nothing",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = "127.0.0.1"
				s.Spec.ClusterIPs = []string{"127.0.0.1"}
			}),
			family:       v1.IPv4Protocol,
			want:         nil,
			wantProblems: []ServiceProblem{invalidField(`spec.clusterIPs: "127.0.0.1" is a loopback address; kproxy ignores it`)},
		},
		{
			name: "unspecified ClusterIP yields nothing",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = "0.0.0.0"
				s.Spec.ClusterIPs = []string{"0.0.0.0"}
			}),
			family:       v1.IPv4Protocol,
			want:         nil,
			wantProblems: []ServiceProblem{invalidField(`spec.clusterIPs: "0.0.0.0" is the unspecified address; kproxy ignores it`)},
		},
		{
			name: "two ClusterIPs of one family: the first counts",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIPs = []string{"10.0.0.1", "10.0.0.2", "fd00::1"}
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1")),
			wantProblems: []ServiceProblem{invalidField(`spec.clusterIPs: "10.0.0.2" is a second IPv4 address; kproxy ignores it`)},
		},
		{
			name: "special external IPs skipped",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"0.0.0.0", "192.0.2.1", "224.0.0.1", "169.254.1.1", "::1", "255.255.255.255"}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.ExternalIPs = spTestAddrs("192.0.2.1") })),
			wantProblems: []ServiceProblem{
				invalidField(`spec.externalIPs: "0.0.0.0" is the unspecified address; kproxy ignores it`),
				invalidField(`spec.externalIPs: "224.0.0.1" is a multicast address; kproxy ignores it`),
				invalidField(`spec.externalIPs: "169.254.1.1" is a link-local address; kproxy ignores it`),
				invalidField(`spec.externalIPs: "::1" is a loopback address; kproxy ignores it`),
				invalidField(`spec.externalIPs: "255.255.255.255" is the broadcast address; kproxy ignores it`),
			},
		},
		{
			name: "invalid and special load balancer ingress IPs skipped",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{
					spTestIngress("198.51.100.1", nil),
					spTestIngress("198.51.100.256", nil),
					spTestIngress("ff02::1", nil),
				}
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerVIPs = spTestAddrs("198.51.100.1")
			})),
			wantProblems: []ServiceProblem{
				invalidField(`status.loadBalancer.ingress: "198.51.100.256" is not an IP address; kproxy ignores it`),
				invalidField(`status.loadBalancer.ingress: "ff02::1" is a multicast address; kproxy ignores it`),
			},
		},
		{
			name: "health check node port 70000: no health check",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 70000
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.ExternalPolicyLocal = true
			})),
			wantProblems: []ServiceProblem{invalidField("spec.healthCheckNodePort 70000 is out of range 1-65535; kproxy serves no health check for it")},
		},
		{
			name: "external IPs of the family, invalid ones skipped",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"192.0.2.1", "not-an-ip", "2001:db8::1", " 192.0.2.2 ", "192.0.2.300"}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.ExternalIPs = spTestAddrs("192.0.2.1", "192.0.2.2") })),
			wantProblems: []ServiceProblem{
				invalidField(`spec.externalIPs: "not-an-ip" is not an IP address; kproxy ignores it`),
				invalidField(`spec.externalIPs: "192.0.2.300" is not an IP address; kproxy ignores it`),
			},
		},
		{
			name: "external IPs of the IPv6 family",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"192.0.2.1", "2001:db8::1"}
			}),
			family: v1.IPv6Protocol,
			want:   spTestMap(spTestPort("fd00::1", func(p *ServicePort) { p.ExternalIPs = spTestAddrs("2001:db8::1") })),
		},
		{
			name: "load balancer VIPs of the family, ipMode Proxy and hostnames excluded",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{
					spTestIngress("198.51.100.1", nil),
					spTestIngress("198.51.100.2", ptr.To(v1.LoadBalancerIPModeVIP)),
					spTestIngress("198.51.100.3", ptr.To(v1.LoadBalancerIPModeProxy)),
					spTestIngress("2001:db8::10", nil),
					{Hostname: "lb.example.com"},
				}
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerVIPs = spTestAddrs("198.51.100.1", "198.51.100.2")
			})),
		},
		{
			name: "load balancer VIPs of the IPv6 family",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{
					spTestIngress("198.51.100.1", nil),
					spTestIngress("2001:db8::10", nil),
					spTestIngress("2001:db8::11", ptr.To(v1.LoadBalancerIPModeProxy)),
				}
			}),
			family: v1.IPv6Protocol,
			want: spTestMap(spTestPort("fd00::1", func(p *ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerVIPs = spTestAddrs("2001:db8::10")
			})),
		},
		{
			name: "load balancer ingress ignored unless type LoadBalancer",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.Ports[0].NodePort = 30080
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{spTestIngress("198.51.100.1", nil)}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.NodePort = 30080 })),
		},
		{
			name: "source ranges from the field, trimmed, of the family, invalid skipped",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{" 192.0.2.0/24", "2001:db8::/64", "bogus", "10.1.2.3/8"}
				s.Annotations = map[string]string{v1.AnnotationLoadBalancerSourceRangesKey: "203.0.113.0/24"}
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerSourceRanges = spTestPrefixes("192.0.2.0/24", "10.0.0.0/8")
			})),
			wantProblems: []ServiceProblem{invalidField(`spec.loadBalancerSourceRanges: "bogus" is not a CIDR; kproxy ignores it`)},
		},
		{
			name: "legacy source ranges annotation is ignored and reported",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Annotations = map[string]string{v1.AnnotationLoadBalancerSourceRangesKey: "203.0.113.0/24, 2001:db8::/48 ,nope,"}
			}),
			family: v1.IPv6Protocol,
			want:   spTestMap(spTestPort("fd00::1", func(p *ServicePort) { p.NodePort = 30080 })),
			wantProblems: []ServiceProblem{{
				Reason:  ServiceProblemIgnoredAnnotation,
				Message: "annotation service.beta.kubernetes.io/load-balancer-source-ranges is ignored: kproxy, like kube-proxy, restricts sources only by spec.loadBalancerSourceRanges",
			}},
		},
		{
			name: "legacy source ranges annotation on a non-LoadBalancer service is not reported",
			svc: spTestService(func(s *v1.Service) {
				s.Annotations = map[string]string{v1.AnnotationLoadBalancerSourceRangesKey: "203.0.113.0/24"}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
		{
			// Fail closed: kube-proxy would accept every source.
			name: "only invalid source ranges: the load balancer IPs are not served",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/33", "  "}
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{spTestIngress("198.51.100.1", nil)}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.NodePort = 30080 })),
			wantProblems: []ServiceProblem{
				invalidField(`spec.loadBalancerSourceRanges: "192.0.2.0/33" is not a CIDR; kproxy ignores it`),
				invalidField("spec.loadBalancerSourceRanges: no entry is a valid CIDR; kproxy accepts no traffic on the load balancer IPs rather than traffic from every source"),
			},
		},
		{
			name: "an invalid source range beside a valid one: the valid one applies",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/33", "2001:db8::/64"}
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{spTestIngress("198.51.100.1", nil)}
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerVIPs = spTestAddrs("198.51.100.1")
			})),
			wantProblems: []ServiceProblem{invalidField(`spec.loadBalancerSourceRanges: "192.0.2.0/33" is not a CIDR; kproxy ignores it`)},
		},
		{
			name: "a zero-length source range allows every source of its family",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/24", "0.0.0.0/0", "2001:db8::/64"}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.NodePort = 30080 })),
		},
		{
			name: "a zero-length source range of the other family changes nothing",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.LoadBalancerSourceRanges = []string{"192.0.2.0/24", "0.0.0.0/0", "2001:db8::/64"}
			}),
			family: v1.IPv6Protocol,
			want: spTestMap(spTestPort("fd00::1", func(p *ServicePort) {
				p.NodePort = 30080
				p.LoadBalancerSourceRanges = spTestPrefixes("2001:db8::/64")
			})),
		},
		{
			name: "no ClusterIP of the family: no ports, but the problems",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIPs = []string{"10.0.0.1"}
				s.Spec.IPFamilies = []v1.IPFamily{v1.IPv4Protocol}
				s.Spec.ExternalIPs = []string{"2001:db8::zz"}
			}),
			family:       v1.IPv6Protocol,
			want:         nil,
			wantProblems: []ServiceProblem{invalidField(`spec.externalIPs: "2001:db8::zz" is not an IP address; kproxy ignores it`)},
		},
		{
			name: "skipped services have no problems",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = v1.ClusterIPNone
				s.Spec.ClusterIPs = []string{v1.ClusterIPNone}
				s.Spec.ExternalIPs = []string{"bogus"}
			}),
			family: v1.IPv4Protocol,
			want:   nil,
		},
		{
			name: "session affinity ClientIP without timeout uses the default",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.SessionAffinityClientIP = true
				p.StickyMaxAgeSeconds = 10800
			})),
		},
		{
			name: "session affinity ClientIP with timeout",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](60)}}
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.SessionAffinityClientIP = true
				p.StickyMaxAgeSeconds = 60
			})),
		},
		{
			name: "session affinity None ignores the config",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.SessionAffinity = v1.ServiceAffinityNone
				s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To[int32](60)}}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
		{
			name: "externalTrafficPolicy Local on a LoadBalancer, with health check node port",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 32000
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.ExternalPolicyLocal = true
				p.HealthCheckNodePort = 32000
			})),
		},
		{
			name: "externalTrafficPolicy Local on a NodePort, no health check node port",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeNodePort
				s.Spec.Ports[0].NodePort = 30080
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
				s.Spec.HealthCheckNodePort = 32000
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.ExternalPolicyLocal = true
			})),
		},
		{
			name: "externalTrafficPolicy Local on a ClusterIP service with external IPs",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ExternalIPs = []string{"192.0.2.1"}
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.ExternalIPs = spTestAddrs("192.0.2.1")
				p.ExternalPolicyLocal = true
			})),
		},
		{
			name: "externalTrafficPolicy Local on an internal-only ClusterIP service is ignored",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
		{
			name: "LoadBalancer with externalTrafficPolicy Local but no health check node port",
			svc: spTestService(lb, func(s *v1.Service) {
				s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.NodePort = 30080
				p.ExternalPolicyLocal = true
			})),
			wantProblems: []ServiceProblem{invalidField("spec.healthCheckNodePort is not set on a LoadBalancer service with externalTrafficPolicy Local; kproxy serves no health check for it")},
		},
		{
			name: "internalTrafficPolicy Local",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyLocal)
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.InternalPolicyLocal = true })),
		},
		{
			name: "internalTrafficPolicy Cluster",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.InternalTrafficPolicy = ptr.To(v1.ServiceInternalTrafficPolicyCluster)
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
		{
			name: "trafficDistribution",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferSameZone)
			}),
			family: v1.IPv4Protocol,
			want: spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) {
				p.TrafficDistribution = v1.ServiceTrafficDistributionPreferSameZone
			})),
		},
		{
			name: "topology keys",
			svc: spTestService(func(s *v1.Service) {
				s.Annotations = map[string]string{AnnotationTopologyKeys: `["zone1", "*"]`}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.TopologyKeys = []string{"zone1", "*"} })),
		},
		{
			name: "malformed topology keys: error stored, no keys, service kept",
			svc: spTestService(func(s *v1.Service) {
				s.Annotations = map[string]string{AnnotationTopologyKeys: malformedKeys}
			}),
			family:       v1.IPv4Protocol,
			want:         spTestMap(spTestPort("10.0.0.1", func(p *ServicePort) { p.TopologyKeysError = malformedErr })),
			wantProblems: []ServiceProblem{{Reason: ServiceProblemInvalidTopologyKeys, Message: malformedErr.Error() + "; the service is treated as having no topology keys"}},
		},
		{
			name: "empty topology keys annotation",
			svc: spTestService(func(s *v1.Service) {
				s.Annotations = map[string]string{AnnotationTopologyKeys: ""}
			}),
			family: v1.IPv4Protocol,
			want:   spTestMap(spTestPort("10.0.0.1")),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, problems := ParseService(tc.svc, tc.family)
			if !got.equal(tc.want) {
				t.Errorf("got\n%s\nwant\n%s", spTestDump(got), spTestDump(tc.want))
			}
			if tc.want == nil && got != nil {
				t.Errorf("got non-nil empty map %v, want nil", got)
			}
			for name, sp := range got {
				if sp.TopologyKeysError != nil && sp.TopologyKeys != nil {
					t.Errorf("%s: TopologyKeys %v set together with TopologyKeysError", name, sp.TopologyKeys)
				}
			}
			if !slices.Equal(problems, tc.wantProblems) {
				t.Errorf("problems:\n%q\nwant\n%q", problems, tc.wantProblems)
			}
			// One family's tracker reports for both: the problems must not
			// depend on the family.
			other := v1.IPv4Protocol
			if tc.family == v1.IPv4Protocol {
				other = v1.IPv6Protocol
			}
			if _, otherProblems := ParseService(tc.svc, other); !slices.Equal(otherProblems, problems) {
				t.Errorf("problems for %s:\n%q\ndiffer from those for %s:\n%q", other, otherProblems, tc.family, problems)
			}
		})
	}
}

func TestParseServiceReportsTopologyKeysOnce(t *testing.T) {
	svc := spTestService(func(s *v1.Service) {
		s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "https", Port: 443, Protocol: v1.ProtocolTCP})
		s.Annotations = map[string]string{AnnotationTopologyKeys: `"zone1"`}
	})
	ports, problems := ParseService(svc, v1.IPv4Protocol)
	if len(ports) != 2 {
		t.Fatalf("got %d ports, want 2", len(ports))
	}
	if len(problems) != 1 || problems[0].Reason != ServiceProblemInvalidTopologyKeys {
		t.Errorf("problems of a two-port service with a malformed topologyKeys annotation = %q, want one %s", problems, ServiceProblemInvalidTopologyKeys)
	}
}

func TestShouldSkipService(t *testing.T) {
	tests := []struct {
		name       string
		svc        *v1.Service
		wantSkip   bool
		wantReason string
	}{
		{name: "nil", svc: nil, wantSkip: true, wantReason: "nil"},
		{name: "ClusterIP service", svc: spTestService()},
		{name: "NodePort service", svc: spTestService(func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeNodePort })},
		{
			name:     "ExternalName service, even with a ClusterIP",
			svc:      spTestService(func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeExternalName }),
			wantSkip: true, wantReason: "ExternalName",
		},
		{
			name: "headless service",
			svc: spTestService(func(s *v1.Service) {
				s.Spec.ClusterIP = v1.ClusterIPNone
				s.Spec.ClusterIPs = []string{v1.ClusterIPNone}
			}),
			wantSkip: true, wantReason: "headless",
		},
		{
			name:     "headless service known by clusterIPs only",
			svc:      spTestService(func(s *v1.Service) { s.Spec.ClusterIP = ""; s.Spec.ClusterIPs = []string{v1.ClusterIPNone} }),
			wantSkip: true, wantReason: "headless",
		},
		{
			name:     "no ClusterIP at all",
			svc:      spTestService(func(s *v1.Service) { s.Spec.ClusterIP = ""; s.Spec.ClusterIPs = nil }),
			wantSkip: true, wantReason: "no ClusterIP",
		},
		{
			name: "ClusterIP known by clusterIPs only",
			svc:  spTestService(func(s *v1.Service) { s.Spec.ClusterIP = "" }),
		},
		{
			name: "invalid ClusterIP is handled (and reported by ParseService)",
			svc:  spTestService(func(s *v1.Service) { s.Spec.ClusterIP = "bogus"; s.Spec.ClusterIPs = []string{"bogus"} }),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			skip, reason := ShouldSkipService(tc.svc)
			if skip != tc.wantSkip || reason != tc.wantReason {
				t.Errorf("ShouldSkipService = (%v, %q), want (%v, %q)", skip, reason, tc.wantSkip, tc.wantReason)
			}
		})
	}
}

func spTestDump(m ServicePortMap) string {
	var b strings.Builder
	for name, sp := range m {
		fmt.Fprintf(&b, "%s/%s: %+v\n", name, name.Protocol, *sp)
	}
	return b.String()
}
