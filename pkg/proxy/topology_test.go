package proxy

import (
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
)

const thisNode = "node1"

// epState is an endpoint's conditions as an EndpointSlice reports them.
type epState int

const (
	ready          epState = iota // ready, serving
	servingTerm                   // serving, terminating
	notServingTerm                // terminating, not serving
	notReady                      // neither ready nor terminating
)

// testEP builds an endpoint at ip on node; mods add hints.
func testEP(ip, node string, state epState, mods ...func(*Endpoint)) *Endpoint {
	ep := &Endpoint{
		IP:       netip.MustParseAddr(ip),
		Port:     80,
		NodeName: node,
		IsLocal:  node == thisNode,
	}
	switch state {
	case ready:
		ep.Ready, ep.Serving = true, true
	case servingTerm:
		ep.Serving, ep.Terminating = true, true
	case notServingTerm:
		ep.Terminating = true
	}
	for _, m := range mods {
		m(ep)
	}
	return ep
}

func zoneHints(zones ...string) func(*Endpoint) {
	return func(ep *Endpoint) { ep.ZoneHints = sets.New(zones...) }
}

func nodeHints(nodes ...string) func(*Endpoint) {
	return func(ep *Endpoint) { ep.NodeHints = sets.New(nodes...) }
}

// svcMod shapes the test service port.
type svcMod func(*ServicePort)

var (
	itpLocal = func(s *ServicePort) { s.InternalPolicyLocal = true }
	etpLocal = func(s *ServicePort) { s.ExternalPolicyLocal = true }
	nodePort = func(s *ServicePort) { s.NodePort = 30080 }
)

func distribution(d string) svcMod { return func(s *ServicePort) { s.TrafficDistribution = d } }

func topologyKeys(keys ...string) svcMod { return func(s *ServicePort) { s.TopologyKeys = keys } }

func testSvc(mods ...svcMod) *ServicePort {
	s := &ServicePort{
		Name: ServicePortName{
			NamespacedName: types.NamespacedName{Namespace: "ns", Name: "svc"},
			Port:           "http",
			Protocol:       v1.ProtocolTCP,
		},
		ClusterIP: netip.MustParseAddr("172.30.0.10"),
		Port:      80,
		Protocol:  v1.ProtocolTCP,
	}
	for _, m := range mods {
		m(s)
	}
	return s
}

// testNodes are the cluster's nodes as the topology tests see them; node5 is
// unknown.
var testNodes = map[string]map[string]string{
	"node1": {v1.LabelTopologyZone: "zone-a", "edge": "unit1", "region": "r1"},
	"node2": {v1.LabelTopologyZone: "zone-a", "edge": "unit2", "region": "r1", "rack": "rack2"},
	"node3": {v1.LabelTopologyZone: "zone-b", "edge": "unit1", "region": "r1"},
	"node4": {v1.LabelTopologyZone: "zone-b", "edge": "unit3"},
}

func testTopology() TopologyInfo {
	return TopologyInfo{
		NodeName:   thisNode,
		NodeLabels: testNodes[thisNode],
		LabelsOf: func(name string) (map[string]string, bool) {
			l, ok := testNodes[name]
			return l, ok
		},
	}
}

func ips(eps []*Endpoint) []string {
	out := make([]string, 0, len(eps))
	for _, ep := range eps {
		out = append(out, ep.IP.String())
	}
	return out
}

type categorizeCase struct {
	name      string
	svc       *ServicePort
	topo      *TopologyInfo // default testTopology()
	endpoints []*Endpoint
	// Expected endpoint IPs; empty means the list must be nil.
	cluster, local, all []string
	hasAny              bool
}

func runCategorizeCases(t *testing.T, cases []categorizeCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			topo := testTopology()
			if tc.topo != nil {
				topo = *tc.topo
			}
			input := slices.Clone(tc.endpoints)
			cluster, local, all, hasAny := CategorizeEndpoints(tc.endpoints, tc.svc, topo)

			checkList(t, "clusterEndpoints", cluster, tc.cluster, true)
			checkList(t, "localEndpoints", local, tc.local, true)
			checkList(t, "allReachableEndpoints", all, tc.all, false)
			if hasAny != tc.hasAny {
				t.Errorf("hasAnyEndpoints = %v, want %v", hasAny, tc.hasAny)
			}
			if !slices.Equal(input, tc.endpoints) {
				t.Errorf("CategorizeEndpoints modified its input")
			}
		})
	}
}

// checkList compares endpoint IPs; ordered lists must keep the input order,
// the union is compared as a set and must hold each endpoint once.
func checkList(t *testing.T, what string, got []*Endpoint, want []string, ordered bool) {
	t.Helper()
	if len(want) == 0 {
		if got != nil {
			t.Errorf("%s = %v, want nil", what, ips(got))
		}
		return
	}
	g := ips(got)
	if !ordered {
		g = slices.Sorted(slices.Values(g))
		want = slices.Sorted(slices.Values(want))
	}
	if !slices.Equal(g, want) {
		t.Errorf("%s = %v, want %v", what, g, want)
	}
}

func TestCategorizeEndpoints(t *testing.T) {
	runCategorizeCases(t, []categorizeCase{
		{
			name: "no endpoints at all",
			svc:  testSvc(),
		},
		{
			name: "no endpoints at all with both Local policies",
			svc:  testSvc(itpLocal, etpLocal, nodePort),
		},
		{
			name: "cluster uses ready endpoints only when some are ready",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", servingTerm),
				testEP("10.0.0.3", "node3", ready),
				testEP("10.0.0.4", "node4", notReady),
			},
			cluster: []string{"10.0.0.1", "10.0.0.3"},
			all:     []string{"10.0.0.1", "10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "cluster falls back to serving terminating endpoints",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", notReady),
				testEP("10.0.0.2", "node2", servingTerm),
				testEP("10.0.0.3", "node3", notServingTerm),
				testEP("10.0.0.4", "node4", servingTerm),
			},
			cluster: []string{"10.0.0.2", "10.0.0.4"},
			all:     []string{"10.0.0.2", "10.0.0.4"},
			hasAny:  true,
		},
		{
			name: "terminating endpoints that are not serving are never used",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", notServingTerm),
				testEP("10.0.0.2", "node2", notReady),
			},
		},
		{
			name: "zone hints filter when every ready endpoint has one and one names my zone",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, zoneHints("zone-a")),
				testEP("10.0.0.2", "node2", ready, zoneHints("zone-b")),
				testEP("10.0.0.3", "node3", ready, zoneHints("zone-a", "zone-b")),
				testEP("10.0.0.4", "node4", notReady),
			},
			cluster: []string{"10.0.0.1", "10.0.0.3"},
			all:     []string{"10.0.0.1", "10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "one ready endpoint without zone hints disables filtering",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, zoneHints("zone-a")),
				testEP("10.0.0.2", "node2", ready, zoneHints("zone-b")),
				testEP("10.0.0.3", "node3", ready),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2", "10.0.0.3"},
			all:     []string{"10.0.0.1", "10.0.0.2", "10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "endpoints that are not ready do not need hints",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, zoneHints("zone-a")),
				testEP("10.0.0.2", "node2", ready, zoneHints("zone-b")),
				testEP("10.0.0.3", "node3", servingTerm),
			},
			cluster: []string{"10.0.0.1"},
			all:     []string{"10.0.0.1"},
			hasAny:  true,
		},
		{
			name: "no endpoint hinted for my zone disables filtering",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node3", ready, zoneHints("zone-b")),
				testEP("10.0.0.2", "node4", ready, zoneHints("zone-c")),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "node without a zone label ignores zone hints",
			svc:  testSvc(),
			topo: &TopologyInfo{NodeName: thisNode, NodeLabels: map[string]string{"edge": "unit1"}},
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, zoneHints("zone-a")),
				testEP("10.0.0.2", "node3", ready, zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "node hints beat zone hints",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, nodeHints("node1"), zoneHints("zone-a")),
				testEP("10.0.0.2", "node2", ready, nodeHints("node2"), zoneHints("zone-a")),
				testEP("10.0.0.3", "node3", ready, nodeHints("node3"), zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.1"},
			all:     []string{"10.0.0.1"},
			hasAny:  true,
		},
		{
			name: "one ready endpoint without node hints falls back to zone hints",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, nodeHints("node1"), zoneHints("zone-a")),
				testEP("10.0.0.2", "node2", ready, zoneHints("zone-a")),
				testEP("10.0.0.3", "node3", ready, nodeHints("node3"), zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "no endpoint hinted for my node falls back to zone hints",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready, nodeHints("node2"), zoneHints("zone-a")),
				testEP("10.0.0.3", "node3", ready, nodeHints("node3"), zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.2"},
			all:     []string{"10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "node hints alone, none for my node: no filtering",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready, nodeHints("node2")),
				testEP("10.0.0.3", "node3", ready, nodeHints("node3")),
			},
			cluster: []string{"10.0.0.2", "10.0.0.3"},
			all:     []string{"10.0.0.2", "10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "PreferClose with zone hints filters by zone",
			svc:  testSvc(distribution(v1.ServiceTrafficDistributionPreferClose)),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node2", ready, zoneHints("zone-a")),
				testEP("10.0.0.2", "node3", ready, zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.1"},
			all:     []string{"10.0.0.1"},
			hasAny:  true,
		},
		{
			name: "PreferClose without hints does not filter",
			svc:  testSvc(distribution(v1.ServiceTrafficDistributionPreferClose)),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node2", ready),
				testEP("10.0.0.2", "node3", ready),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "PreferSameZone with zone hints filters by zone",
			svc:  testSvc(distribution(v1.ServiceTrafficDistributionPreferSameZone)),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node2", ready, zoneHints("zone-a")),
				testEP("10.0.0.2", "node3", ready, zoneHints("zone-b")),
				testEP("10.0.0.3", "node4", ready, zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.1"},
			all:     []string{"10.0.0.1"},
			hasAny:  true,
		},
		{
			name: "PreferSameNode with node and zone hints filters by node",
			svc:  testSvc(distribution(v1.ServiceTrafficDistributionPreferSameNode)),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, nodeHints("node1"), zoneHints("zone-a")),
				testEP("10.0.0.2", "node2", ready, nodeHints("node2"), zoneHints("zone-a")),
			},
			cluster: []string{"10.0.0.1"},
			all:     []string{"10.0.0.1"},
			hasAny:  true,
		},
		{
			name: "PreferSameNode with no local endpoint uses the zone hints",
			svc:  testSvc(distribution(v1.ServiceTrafficDistributionPreferSameNode)),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready, nodeHints("node2"), zoneHints("zone-a")),
				testEP("10.0.0.3", "node3", ready, nodeHints("node3"), zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.2"},
			all:     []string{"10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "terminating fallback ignores hints",
			svc:  testSvc(),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node2", servingTerm, zoneHints("zone-a")),
				testEP("10.0.0.2", "node3", servingTerm, zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "iTP Local uses local ready endpoints",
			svc:  testSvc(itpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node1", servingTerm),
				testEP("10.0.0.3", "node2", ready),
			},
			local:  []string{"10.0.0.1"},
			all:    []string{"10.0.0.1"},
			hasAny: true,
		},
		{
			name: "iTP Local falls back to local serving terminating endpoints",
			svc:  testSvc(itpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", servingTerm),
				testEP("10.0.0.2", "node1", notServingTerm),
				testEP("10.0.0.3", "node2", ready),
			},
			local:  []string{"10.0.0.1"},
			all:    []string{"10.0.0.1"},
			hasAny: true,
		},
		{
			name: "iTP Local without local endpoints still has endpoints elsewhere",
			svc:  testSvc(itpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", notServingTerm),
				testEP("10.0.0.2", "node2", ready),
			},
			hasAny: true,
		},
		{
			name: "iTP Local with only unusable endpoints has none",
			svc:  testSvc(itpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", notServingTerm),
				testEP("10.0.0.2", "node2", notReady),
			},
		},
		{
			name: "hints never filter local endpoints",
			svc:  testSvc(itpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, nodeHints("node2"), zoneHints("zone-b")),
				testEP("10.0.0.2", "node1", ready, nodeHints("node2"), zoneHints("zone-b")),
				testEP("10.0.0.3", "node2", ready, nodeHints("node2"), zoneHints("zone-a")),
			},
			local:  []string{"10.0.0.1", "10.0.0.2"},
			all:    []string{"10.0.0.1", "10.0.0.2"},
			hasAny: true,
		},
		{
			name: "eTP Local with local endpoints",
			svc:  testSvc(etpLocal, nodePort),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.3", "node3", servingTerm),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			local:   []string{"10.0.0.1"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "eTP Local without local endpoints: endpoints exist but the local list is empty",
			svc:  testSvc(etpLocal, nodePort),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.3", "node3", ready),
			},
			cluster: []string{"10.0.0.2", "10.0.0.3"},
			all:     []string{"10.0.0.2", "10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "eTP Local with only a local terminating endpoint: union holds both kinds",
			svc:  testSvc(etpLocal, nodePort),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", servingTerm),
				testEP("10.0.0.2", "node2", ready),
			},
			cluster: []string{"10.0.0.2"},
			local:   []string{"10.0.0.1"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "eTP Local with zone hints excluding the local endpoint from cluster: union holds it",
			svc:  testSvc(etpLocal, nodePort),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready, zoneHints("zone-b")),
				testEP("10.0.0.2", "node2", ready, zoneHints("zone-a")),
			},
			cluster: []string{"10.0.0.2"},
			local:   []string{"10.0.0.1"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "eTP Local on a ClusterIP-only service is ignored",
			svc:  testSvc(etpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "iTP Local with a NodePort still uses cluster endpoints for external traffic",
			svc:  testSvc(itpLocal, nodePort),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			local:   []string{"10.0.0.1"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			// Upstream keeps cluster endpoints for externally accessible
			// services even with eTP Local: pods short-circuit to them.
			name: "both Local policies on a NodePort service",
			svc:  testSvc(itpLocal, etpLocal, nodePort),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
			},
			cluster: []string{"10.0.0.1", "10.0.0.2"},
			local:   []string{"10.0.0.1"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "iTP Local and eTP Local on a ClusterIP-only service use only local endpoints",
			svc:  testSvc(itpLocal, etpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
			},
			local:  []string{"10.0.0.1"},
			all:    []string{"10.0.0.1"},
			hasAny: true,
		},
		{
			name: "both Local policies without local endpoints: local list empty, endpoints exist",
			svc:  testSvc(itpLocal, etpLocal, nodePort),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.3", "node3", servingTerm),
			},
			cluster: []string{"10.0.0.2"},
			all:     []string{"10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "iTP Local on a ClusterIP-only service without local endpoints: none reachable, endpoints exist",
			svc:  testSvc(itpLocal, etpLocal),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.3", "node3", servingTerm),
			},
			hasAny: true,
		},
	})
}

func TestCategorizeEndpointsTopologyKeys(t *testing.T) {
	const zoneKey = v1.LabelTopologyZone
	runCategorizeCases(t, []categorizeCase{
		{
			name: "single key keeps endpoints on nodes sharing my value",
			svc:  testSvc(topologyKeys("edge")),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.3", "node3", ready),
				testEP("10.0.0.4", "node4", ready),
			},
			cluster: []string{"10.0.0.1", "10.0.0.3"},
			all:     []string{"10.0.0.1", "10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "first key selects nothing, second key wins",
			svc:  testSvc(topologyKeys("edge", zoneKey, "region")),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.4", "node4", ready),
			},
			cluster: []string{"10.0.0.2"},
			all:     []string{"10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "first matching key wins over later broader keys",
			svc:  testSvc(topologyKeys(zoneKey, "region")),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.3", "node3", ready),
			},
			cluster: []string{"10.0.0.2"},
			all:     []string{"10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "star after a key that selects nothing keeps every endpoint",
			svc:  testSvc(topologyKeys("edge", "*")),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.4", "node4", ready),
				testEP("10.0.0.5", "node5", ready),
			},
			cluster: []string{"10.0.0.2", "10.0.0.4", "10.0.0.5"},
			all:     []string{"10.0.0.2", "10.0.0.4", "10.0.0.5"},
			hasAny:  true,
		},
		{
			name: "star alone keeps endpoints on unknown nodes",
			svc:  testSvc(topologyKeys("*")),
			endpoints: []*Endpoint{
				testEP("10.0.0.5", "node5", ready),
				testEP("10.0.0.6", "", ready),
			},
			cluster: []string{"10.0.0.5", "10.0.0.6"},
			all:     []string{"10.0.0.5", "10.0.0.6"},
			hasAny:  true,
		},
		{
			name: "key missing on this node is skipped",
			svc:  testSvc(topologyKeys("rack", "region")),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.4", "node4", ready),
			},
			cluster: []string{"10.0.0.2"},
			all:     []string{"10.0.0.2"},
			hasAny:  true,
		},
		{
			name: "only key missing on this node: no endpoints (reject)",
			svc:  testSvc(topologyKeys("rack")),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready),
			},
		},
		{
			name: "no key selects anything: no endpoints (reject)",
			svc:  testSvc(topologyKeys("edge", zoneKey)),
			endpoints: []*Endpoint{
				testEP("10.0.0.4", "node4", ready),
			},
		},
		{
			name: "endpoints on unknown or unnamed nodes are not eligible",
			svc:  testSvc(topologyKeys("edge")),
			endpoints: []*Endpoint{
				testEP("10.0.0.3", "node3", ready),
				testEP("10.0.0.5", "node5", ready),
				testEP("10.0.0.6", "", ready),
			},
			cluster: []string{"10.0.0.3"},
			all:     []string{"10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "only endpoints on unknown nodes: no endpoints (reject)",
			svc:  testSvc(topologyKeys("edge")),
			endpoints: []*Endpoint{
				testEP("10.0.0.5", "node5", ready),
			},
		},
		{
			name: "this node's labels come from NodeLabels without LabelsOf",
			svc:  testSvc(topologyKeys("edge")),
			topo: &TopologyInfo{NodeName: thisNode, NodeLabels: testNodes[thisNode]},
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.3", "node3", ready),
			},
			cluster: []string{"10.0.0.1"},
			all:     []string{"10.0.0.1"},
			hasAny:  true,
		},
		{
			name: "keys win over hints",
			svc:  testSvc(topologyKeys("region")),
			endpoints: []*Endpoint{
				testEP("10.0.0.2", "node2", ready, nodeHints("node2"), zoneHints("zone-a")),
				testEP("10.0.0.3", "node3", ready, nodeHints("node3"), zoneHints("zone-b")),
				testEP("10.0.0.4", "node4", ready, nodeHints("node4"), zoneHints("zone-b")),
			},
			cluster: []string{"10.0.0.2", "10.0.0.3"},
			all:     []string{"10.0.0.2", "10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "keys filter serving terminating endpoints when none is ready",
			svc:  testSvc(topologyKeys("edge")),
			endpoints: []*Endpoint{
				testEP("10.0.0.3", "node3", servingTerm),
				testEP("10.0.0.4", "node4", servingTerm),
				testEP("10.0.0.5", "node1", notServingTerm),
			},
			cluster: []string{"10.0.0.3"},
			all:     []string{"10.0.0.3"},
			hasAny:  true,
		},
		{
			name: "keys apply after the ready choice: no fallback to eligible terminating endpoints",
			svc:  testSvc(topologyKeys("edge")),
			endpoints: []*Endpoint{
				testEP("10.0.0.3", "node3", servingTerm),
				testEP("10.0.0.4", "node4", ready),
			},
		},
		{
			name: "iTP Local is unaffected by keys",
			svc:  testSvc(itpLocal, topologyKeys("rack")),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
			},
			local:  []string{"10.0.0.1"},
			all:    []string{"10.0.0.1"},
			hasAny: true,
		},
		{
			name: "eTP Local keeps local endpoints when keys select nothing",
			svc:  testSvc(etpLocal, nodePort, topologyKeys("rack")),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", ready),
				testEP("10.0.0.2", "node2", ready),
			},
			local:  []string{"10.0.0.1"},
			all:    []string{"10.0.0.1"},
			hasAny: true,
		},
		{
			name: "eTP Local with keys: union of filtered cluster and local endpoints",
			svc:  testSvc(etpLocal, nodePort, topologyKeys(zoneKey)),
			endpoints: []*Endpoint{
				testEP("10.0.0.1", "node1", servingTerm),
				testEP("10.0.0.2", "node2", ready),
				testEP("10.0.0.3", "node3", ready),
			},
			cluster: []string{"10.0.0.2"},
			local:   []string{"10.0.0.1"},
			all:     []string{"10.0.0.1", "10.0.0.2"},
			hasAny:  true,
		},
	})
}

func TestCategorizeEndpointsUnionHoldsEachEndpointOnce(t *testing.T) {
	svc := testSvc(etpLocal, nodePort, topologyKeys("edge"))
	eps := []*Endpoint{
		testEP("10.0.0.1", "node1", ready),
		testEP("10.0.0.2", "node1", ready),
		testEP("10.0.0.3", "node3", ready),
		testEP("10.0.0.4", "node4", ready),
	}
	_, _, all, _ := CategorizeEndpoints(eps, svc, testTopology())
	want := []*Endpoint{eps[0], eps[1], eps[2]}
	if !slices.Equal(all, want) {
		t.Errorf("allReachableEndpoints = %v, want %v (input order, each once)", ips(all), ips(want))
	}
}
