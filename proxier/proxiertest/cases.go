package proxiertest

import (
	"fmt"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"
)

// Addresses used by the cases. Node "node-a" (this node) is 10.0.0.1 and
// hosts pods in 10.244.1.0/24; other nodes' pods are in 10.244.2.0/24 and
// 10.244.3.0/24. The external client is 192.0.2.10. Only the tracer ever
// sees these addresses.
const (
	nodeIP     = "10.0.0.1"
	localPod   = "10.244.1.9"
	extClient  = "192.0.2.10"
	localEP    = "10.244.1.5"
	remoteEP   = "10.244.2.5"
	otherEP    = "10.244.3.5"
	zoneLabel  = "topology.kubernetes.io/zone"
	localEPAt  = localEP + ":8080"
	remoteEPAt = remoteEP + ":8080"
	otherEPAt  = otherEP + ":8080"
)

func twoEndpoints(svc string) *discovery.EndpointSlice {
	return Slice(svc, 8080, EP{IP: localEP, Node: "node-a"}, EP{IP: remoteEP, Node: "node-b"})
}

// Cases returns the shared behaviour cases (docs/design.md, "The decision table" and "Topology keys").
func Cases() []Case {
	both := []string{localEPAt, remoteEPAt}
	cases := []Case{
		{
			Name:     "clusterIP reaches every endpoint; off-cluster sources are masqueraded",
			Services: []*v1.Service{Service("web", "10.96.0.10")},
			Slices:   []*discovery.EndpointSlice{twoEndpoints("web")},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.10", Port: 80, Want: Delivered, WantEndpoints: both},
				{Name: "host", Source: nodeIP, Dest: "10.96.0.10", Port: 80, Origin: FromHost, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "off-cluster", Source: extClient, Dest: "10.96.0.10", Port: 80, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "other port", Source: localPod, Dest: "10.96.0.10", Port: 81, Want: NotHandled},
				{Name: "hairpin", Source: localEP, Dest: "10.96.0.10", Port: 80, Want: Delivered, WantEndpoints: both, WantHairpin: []string{localEPAt}},
			},
		},
		{
			Name:          "masquerade-all masquerades pod traffic",
			MasqueradeAll: true,
			Services:      []*v1.Service{Service("web", "10.96.0.10")},
			Slices:        []*discovery.EndpointSlice{twoEndpoints("web")},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.10", Port: 80, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
			},
		},
		{
			Name:        "no cluster CIDR: pod traffic is not masqueraded",
			ClusterCIDR: "none",
			Services:    []*v1.Service{Service("web", "10.96.0.10")},
			Slices:      []*discovery.EndpointSlice{twoEndpoints("web")},
			Flows: []Flow{
				{Name: "off-cluster", Source: extClient, Dest: "10.96.0.10", Port: 80, Want: Delivered, WantEndpoints: both},
			},
		},
		{
			Name:     "service without endpoints rejects on every destination",
			Services: []*v1.Service{Service("empty", "10.96.0.11", NodePort(30011), ExternalIPs("203.0.113.7"))},
			Flows: []Flow{
				{Name: "pod to clusterIP", Source: localPod, Dest: "10.96.0.11", Port: 80, Want: Rejected},
				{Name: "host to clusterIP", Source: nodeIP, Dest: "10.96.0.11", Port: 80, Origin: FromHost, Want: Rejected},
				{Name: "external to node port", Source: extClient, Dest: nodeIP, Port: 30011, Want: Rejected},
				{Name: "external to external IP", Source: extClient, Dest: "203.0.113.7", Port: 80, Want: Rejected},
			},
		},
		{
			Name:     "only not-ready endpoints: reject",
			Services: []*v1.Service{Service("web", "10.96.0.12")},
			Slices:   []*discovery.EndpointSlice{Slice("web", 8080, EP{IP: localEP, Node: "node-a", NotReady: true})},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.12", Port: 80, Want: Rejected},
			},
		},
		{
			Name:     "ready endpoints win over terminating ones",
			Services: []*v1.Service{Service("web", "10.96.0.13")},
			Slices: []*discovery.EndpointSlice{Slice("web", 8080,
				EP{IP: localEP, Node: "node-a", Terminating: true}, EP{IP: remoteEP, Node: "node-b"})},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.13", Port: 80, Want: Delivered, WantEndpoints: []string{remoteEPAt}},
			},
		},
		{
			Name:     "serving terminating endpoints are used when none is ready",
			Services: []*v1.Service{Service("web", "10.96.0.14")},
			Slices: []*discovery.EndpointSlice{Slice("web", 8080,
				EP{IP: localEP, Node: "node-a", Terminating: true}, EP{IP: remoteEP, Node: "node-b", Terminating: true},
				EP{IP: otherEP, Node: "node-c", Terminating: true, NotReady: true})},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.14", Port: 80, Want: Delivered, WantEndpoints: both},
			},
		},
		{
			Name:     "node port on every local address, masqueraded, not on localhost",
			NodeIPs:  []string{nodeIP, "10.0.1.1"},
			Services: []*v1.Service{Service("np", "10.96.0.20", NodePort(30020))},
			Slices:   []*discovery.EndpointSlice{twoEndpoints("np")},
			Flows: []Flow{
				{Name: "external", Source: extClient, Dest: nodeIP, Port: 30020, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "second address", Source: extClient, Dest: "10.0.1.1", Port: 30020, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "host", Source: nodeIP, Dest: nodeIP, Port: 30020, Origin: FromHost, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "localhost", Source: "127.0.0.1", Dest: "127.0.0.1", Port: 30020, Origin: FromHost, Want: NotHandled},
				{Name: "other port", Source: extClient, Dest: nodeIP, Port: 30021, Want: NotHandled},
				{Name: "clusterIP still works", Source: localPod, Dest: "10.96.0.20", Port: 80, Want: Delivered, WantEndpoints: both},
			},
		},
		{
			Name:              "nodeport-addresses restricts node ports",
			NodeIPs:           []string{nodeIP, "10.0.1.1"},
			NodePortAddresses: []string{"10.0.0.0/24"},
			Services:          []*v1.Service{Service("np", "10.96.0.21", NodePort(30021))},
			Slices:            []*discovery.EndpointSlice{twoEndpoints("np")},
			Flows: []Flow{
				{Name: "selected address", Source: extClient, Dest: nodeIP, Port: 30021, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "other address", Source: extClient, Dest: "10.0.1.1", Port: 30021, Want: NotHandled},
			},
		},
		{
			Name:     "external IPs are served and masqueraded",
			Services: []*v1.Service{Service("ext", "10.96.0.30", ExternalIPs("203.0.113.7"))},
			Slices:   []*discovery.EndpointSlice{twoEndpoints("ext")},
			Flows: []Flow{
				{Name: "external", Source: extClient, Dest: "203.0.113.7", Port: 80, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "pod", Source: localPod, Dest: "203.0.113.7", Port: 80, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
			},
		},
		{
			Name:     "load balancer VIPs, but not ipMode Proxy ones",
			Services: []*v1.Service{Service("lb", "10.96.0.40", LoadBalancer("203.0.113.20"), NodePort(30040), ProxyModeIngress("203.0.113.21"))},
			Slices:   []*discovery.EndpointSlice{twoEndpoints("lb")},
			Flows: []Flow{
				{Name: "vip", Source: extClient, Dest: "203.0.113.20", Port: 80, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "proxy-mode vip", Source: extClient, Dest: "203.0.113.21", Port: 80, Want: NotHandled},
				{Name: "node port", Source: extClient, Dest: nodeIP, Port: 30040, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
			},
		},
		{
			Name: "loadBalancerSourceRanges admit listed sources and drop the rest",
			Services: []*v1.Service{Service("lb", "10.96.0.41", LoadBalancer("203.0.113.22"), NodePort(30041),
				SourceRanges("192.0.2.0/24", "10.0.0.0/24"))},
			Slices: []*discovery.EndpointSlice{twoEndpoints("lb")},
			Flows: []Flow{
				{Name: "allowed", Source: extClient, Dest: "203.0.113.22", Port: 80, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "denied", Source: "198.51.100.1", Dest: "203.0.113.22", Port: 80, Want: Dropped},
				{Name: "node ports ignore source ranges", Source: "198.51.100.1", Dest: nodeIP, Port: 30041, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
			},
		},
		{
			Name: "externalTrafficPolicy Local with loadBalancerSourceRanges: pods and the node outside the ranges are dropped too",
			Services: []*v1.Service{Service("lbl", "10.96.0.42", LoadBalancer("203.0.113.23"), NodePort(30042), ExternalLocal(),
				SourceRanges("192.0.2.0/24"))},
			Slices: []*discovery.EndpointSlice{twoEndpoints("lbl")},
			Flows: []Flow{
				{Name: "allowed client", Source: extClient, Dest: "203.0.113.23", Port: 80, Want: Delivered, WantEndpoints: []string{localEPAt}},
				{Name: "other client", Source: "198.51.100.1", Dest: "203.0.113.23", Port: 80, Want: Dropped},
				{Name: "pod outside the ranges", Source: localPod, Dest: "203.0.113.23", Port: 80, Want: Dropped},
				{Name: "node outside the ranges", Source: nodeIP, Dest: "203.0.113.23", Port: 80, Origin: FromHost, Want: Dropped},
				{Name: "pod to the node port short-circuits", Source: localPod, Dest: nodeIP, Port: 30042, Want: Delivered, WantEndpoints: both},
			},
		},
		{
			Name:    "loadBalancerSourceRanges admit the node when they hold its primary IP, not any local address",
			NodeIPs: []string{nodeIP, "10.0.1.1"},
			Services: []*v1.Service{
				Service("fw-primary", "10.96.0.43", LoadBalancer("203.0.113.24"), SourceRanges("10.0.0.0/24")),
				Service("fw-secondary", "10.96.0.44", LoadBalancer("203.0.113.25"), SourceRanges("10.0.1.0/24")),
			},
			Slices: []*discovery.EndpointSlice{twoEndpoints("fw-primary"), twoEndpoints("fw-secondary")},
			Flows: []Flow{
				{Name: "node via its VIP, primary IP in range", Source: "203.0.113.24", Dest: "203.0.113.24", Port: 80, Origin: FromHost, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "node via its VIP, only a secondary address in range", Source: "203.0.113.25", Dest: "203.0.113.25", Port: 80, Origin: FromHost, Want: Dropped},
				{Name: "node from its secondary address", Source: "10.0.1.1", Dest: "203.0.113.25", Port: 80, Origin: FromHost, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
			},
		},
		{
			Name: "an external IP or load balancer IP that is a node address leaves the node's other ports alone",
			Services: []*v1.Service{Service("nodeaddr", "10.96.0.45", ExternalIPs(nodeIP), LoadBalancer(nodeIP)),
				Service("lbnode", "10.96.0.46", LoadBalancer(nodeIP), Ports(v1.ServicePort{Name: "p", Port: 8443, Protocol: v1.ProtocolTCP}))},
			Slices: []*discovery.EndpointSlice{twoEndpoints("nodeaddr"), twoEndpoints("lbnode")},
			Flows: []Flow{
				{Name: "service port", Source: extClient, Dest: nodeIP, Port: 80, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "load balancer port", Source: extClient, Dest: nodeIP, Port: 8443, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "sshd on the node address", Source: extClient, Dest: nodeIP, Port: 22, Want: NotHandled},
				{Name: "kubelet from the node", Source: nodeIP, Dest: nodeIP, Port: 10250, Origin: FromHost, Want: NotHandled},
			},
		},
		{
			Name:     "externalTrafficPolicy Local keeps the client address and uses local endpoints",
			Services: []*v1.Service{Service("loc", "10.96.0.50", LoadBalancer("203.0.113.30"), NodePort(30050), ExternalLocal())},
			Slices:   []*discovery.EndpointSlice{twoEndpoints("loc")},
			Flows: []Flow{
				{Name: "external to node port", Source: extClient, Dest: nodeIP, Port: 30050, Want: Delivered, WantEndpoints: []string{localEPAt}},
				{Name: "external to vip", Source: extClient, Dest: "203.0.113.30", Port: 80, Want: Delivered, WantEndpoints: []string{localEPAt}},
				{Name: "pod to node port short-circuits to the cluster", Source: localPod, Dest: nodeIP, Port: 30050, Want: Delivered, WantEndpoints: both},
				{Name: "host to node port", Source: nodeIP, Dest: nodeIP, Port: 30050, Origin: FromHost, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "clusterIP uses every endpoint", Source: localPod, Dest: "10.96.0.50", Port: 80, Want: Delivered, WantEndpoints: both},
			},
		},
		{
			Name:     "externalTrafficPolicy Local without a local endpoint drops external traffic",
			Services: []*v1.Service{Service("loc", "10.96.0.51", NodePort(30051), ExternalLocal(), ExternalIPs("203.0.113.8"))},
			Slices:   []*discovery.EndpointSlice{Slice("loc", 8080, EP{IP: remoteEP, Node: "node-b"})},
			Flows: []Flow{
				{Name: "external to node port", Source: extClient, Dest: nodeIP, Port: 30051, Want: Dropped},
				{Name: "external to external IP", Source: extClient, Dest: "203.0.113.8", Port: 80, Want: Dropped},
				{Name: "pod to node port", Source: localPod, Dest: nodeIP, Port: 30051, Want: Delivered, WantEndpoints: []string{remoteEPAt}},
				{Name: "clusterIP", Source: localPod, Dest: "10.96.0.51", Port: 80, Want: Delivered, WantEndpoints: []string{remoteEPAt}},
			},
		},
		{
			Name:     "internalTrafficPolicy Local uses local endpoints only",
			Services: []*v1.Service{Service("il", "10.96.0.60", InternalLocal())},
			Slices:   []*discovery.EndpointSlice{twoEndpoints("il")},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.60", Port: 80, Want: Delivered, WantEndpoints: []string{localEPAt}},
				{Name: "off-cluster is masqueraded", Source: extClient, Dest: "10.96.0.60", Port: 80, Want: Delivered, WantEndpoints: []string{localEPAt}, WantMasquerade: true},
			},
		},
		{
			Name:     "internalTrafficPolicy Local without a local endpoint drops",
			Services: []*v1.Service{Service("il", "10.96.0.61", InternalLocal())},
			Slices:   []*discovery.EndpointSlice{Slice("il", 8080, EP{IP: remoteEP, Node: "node-b"})},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.61", Port: 80, Want: Dropped},
			},
		},
		{
			Name:     "session affinity still reaches every endpoint on a first packet",
			Services: []*v1.Service{Service("aff", "10.96.0.70", Affinity(0))},
			Slices:   []*discovery.EndpointSlice{twoEndpoints("aff")},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.70", Port: 80, Want: Delivered, WantEndpoints: both},
			},
		},
		{
			Name:     "zone hints keep traffic in this node's zone",
			Nodes:    []*v1.Node{Node("node-a", map[string]string{zoneLabel: "zone-a"})},
			Services: []*v1.Service{Service("hz", "10.96.0.80", TrafficDistribution("PreferClose"))},
			Slices: []*discovery.EndpointSlice{Slice("hz", 8080,
				EP{IP: localEP, Node: "node-a", Zone: "zone-a", ZoneHints: []string{"zone-a"}},
				EP{IP: remoteEP, Node: "node-b", Zone: "zone-b", ZoneHints: []string{"zone-b"}})},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.80", Port: 80, Want: Delivered, WantEndpoints: []string{localEPAt}},
			},
		},
		{
			Name:     "zone hints missing on one endpoint: no filtering",
			Nodes:    []*v1.Node{Node("node-a", map[string]string{zoneLabel: "zone-a"})},
			Services: []*v1.Service{Service("hz", "10.96.0.81", TrafficDistribution("PreferClose"))},
			Slices: []*discovery.EndpointSlice{Slice("hz", 8080,
				EP{IP: localEP, Node: "node-a", Zone: "zone-a", ZoneHints: []string{"zone-a"}},
				EP{IP: remoteEP, Node: "node-b", Zone: "zone-b"})},
			Flows: []Flow{
				{Name: "pod", Source: localPod, Dest: "10.96.0.81", Port: 80, Want: Delivered, WantEndpoints: both},
			},
		},
		{
			Name: "topologyKeys keep traffic inside the node group",
			Nodes: []*v1.Node{
				Node("node-a", map[string]string{"zone1": "g1"}), Node("node-b", map[string]string{"zone1": "g1"}),
				Node("node-c", map[string]string{"zone1": "g2"}),
			},
			Services: []*v1.Service{
				Service("tk", "10.96.0.90", Annotation("topologyKeys", `["zone1"]`)),
				Service("tk-none", "10.96.0.91", Annotation("topologyKeys", `["zone1"]`)),
				Service("tk-any", "10.96.0.92", Annotation("topologyKeys", `["zone1","*"]`)),
				Service("tk-bad", "10.96.0.93", Annotation("topologyKeys", `zone1`)),
			},
			Slices: []*discovery.EndpointSlice{
				Slice("tk", 8080, EP{IP: remoteEP, Node: "node-b"}, EP{IP: otherEP, Node: "node-c"}),
				Slice("tk-none", 8080, EP{IP: otherEP, Node: "node-c"}, EP{IP: "10.244.4.5", Node: "node-unknown"}),
				Slice("tk-any", 8080, EP{IP: otherEP, Node: "node-c"}),
				Slice("tk-bad", 8080, EP{IP: remoteEP, Node: "node-b"}, EP{IP: otherEP, Node: "node-c"}),
			},
			Flows: []Flow{
				{Name: "same group only", Source: localPod, Dest: "10.96.0.90", Port: 80, Want: Delivered, WantEndpoints: []string{remoteEPAt}},
				{Name: "no endpoint in the group rejects", Source: localPod, Dest: "10.96.0.91", Port: 80, Want: Rejected},
				{Name: "star falls back to any endpoint", Source: localPod, Dest: "10.96.0.92", Port: 80, Want: Delivered, WantEndpoints: []string{otherEPAt}},
				{Name: "malformed annotation is ignored", Source: localPod, Dest: "10.96.0.93", Port: 80, Want: Delivered, WantEndpoints: []string{remoteEPAt, otherEPAt}},
			},
		},
		{
			Name: "UDP and SCTP ports, named target ports",
			Services: []*v1.Service{Service("dns", "10.96.0.100", Ports(
				v1.ServicePort{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP, NodePort: 30053},
				v1.ServicePort{Name: "dns-tcp", Port: 53, Protocol: v1.ProtocolTCP},
				v1.ServicePort{Name: "sig", Port: 3868, Protocol: v1.ProtocolSCTP},
			), func(s *v1.Service) { s.Spec.Type = v1.ServiceTypeNodePort })},
			Slices: []*discovery.EndpointSlice{SliceWithPorts("dns", []discovery.EndpointPort{
				{Name: ptr.To("dns"), Port: ptr.To(int32(5353)), Protocol: ptr.To(v1.ProtocolUDP)},
				{Name: ptr.To("dns-tcp"), Port: ptr.To(int32(5354)), Protocol: ptr.To(v1.ProtocolTCP)},
				{Name: ptr.To("sig"), Port: ptr.To(int32(3869)), Protocol: ptr.To(v1.ProtocolSCTP)},
			}, EP{IP: localEP, Node: "node-a"})},
			Flows: []Flow{
				{Name: "udp", Protocol: v1.ProtocolUDP, Source: localPod, Dest: "10.96.0.100", Port: 53, Want: Delivered, WantEndpoints: []string{localEP + ":5353"}},
				{Name: "tcp", Protocol: v1.ProtocolTCP, Source: localPod, Dest: "10.96.0.100", Port: 53, Want: Delivered, WantEndpoints: []string{localEP + ":5354"}},
				{Name: "sctp", Protocol: v1.ProtocolSCTP, Source: localPod, Dest: "10.96.0.100", Port: 3868, Want: Delivered, WantEndpoints: []string{localEP + ":3869"}},
				{Name: "udp node port", Protocol: v1.ProtocolUDP, Source: extClient, Dest: nodeIP, Port: 30053, Want: Delivered, WantEndpoints: []string{localEP + ":5353"}, WantMasquerade: true},
				{Name: "tcp is not the udp node port", Protocol: v1.ProtocolTCP, Source: extClient, Dest: nodeIP, Port: 30053, Want: NotHandled},
			},
		},
		{
			Name:   "IPv6 clusterIP and node port",
			Family: v1.IPv6Protocol,
			Services: []*v1.Service{Service("v6", "fd00:96::10", IPv6(), NodePort(30060)),
				Service("v6-empty", "fd00:96::11", IPv6())},
			Slices: []*discovery.EndpointSlice{Slice("v6", 8080, EP{IP: "fd00:244::5", Node: "node-a"}, EP{IP: "fd00:244:1::5", Node: "node-b"})},
			Flows: []Flow{
				{Name: "pod", Source: "fd00:244::9", Dest: "fd00:96::10", Port: 80, Want: Delivered, WantEndpoints: []string{"[fd00:244::5]:8080", "[fd00:244:1::5]:8080"}},
				{Name: "external to node port", Source: "2001:db8::10", Dest: "fd00::1", Port: 30060, Want: Delivered, WantEndpoints: []string{"[fd00:244::5]:8080", "[fd00:244:1::5]:8080"}, WantMasquerade: true},
				{Name: "no endpoints", Source: "fd00:244::9", Dest: "fd00:96::11", Port: 80, Want: Rejected},
			},
		},
	}
	cases = append(cases, manyServices())
	cases = append(cases, NodePortCases()...)
	return cases
}

// manyServices makes enough services for the dispatch to leave flat mode.
func manyServices() Case {
	c := Case{Name: "300 services: every one reachable through the dispatch tree"}
	for i := 0; i < 300; i++ {
		name := fmt.Sprintf("s%03d", i)
		ip := fmt.Sprintf("10.96.%d.%d", 1+i/200, (i*7)%250+1)
		ep := fmt.Sprintf("10.244.2.%d", i%250+1)
		c.Services = append(c.Services, Service(name, ip, NodePort(int32(30100+i))))
		c.Slices = append(c.Slices, Slice(name, 8080, EP{IP: ep, Node: "node-b"}))
		if i%37 == 0 || i == 299 {
			c.Flows = append(c.Flows,
				Flow{Name: name + " clusterIP", Source: localPod, Dest: ip, Port: 80, Want: Delivered, WantEndpoints: []string{ep + ":8080"}},
				Flow{Name: name + " node port", Source: extClient, Dest: nodeIP, Port: 30100 + i, Want: Delivered, WantEndpoints: []string{ep + ":8080"}, WantMasquerade: true})
		}
	}
	c.Flows = append(c.Flows, Flow{Name: "unused address", Source: localPod, Dest: "10.96.3.3", Port: 80, Want: NotHandled})
	return c
}
