package proxy

import (
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
)

// TestExplainClusterEndpoints: the choice reported for kproxy explain is the
// one CategorizeEndpoints makes, for each way of choosing.
func TestExplainClusterEndpoints(t *testing.T) {
	noZone := testTopology()
	noZone.NodeLabels = map[string]string{"edge": "unit1"}
	cases := []struct {
		name      string
		svc       *ServicePort
		topo      *TopologyInfo
		endpoints []*Endpoint
		want      ClusterEndpointsChoice
	}{
		{name: "every ready endpoint", svc: testSvc(),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node1", ready), testEP("10.0.0.2", "node2", ready)},
			want:      ClusterEndpointsChoice{Zone: "zone-a"}},
		{name: "terminating fallback", svc: testSvc(),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node1", servingTerm), testEP("10.0.0.2", "node2", notReady)},
			want:      ClusterEndpointsChoice{Zone: "zone-a", TerminatingFallback: true}},
		{name: "zone hints", svc: testSvc(distribution(v1.ServiceTrafficDistributionPreferSameZone)),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node2", ready, zoneHints("zone-a")), testEP("10.0.0.2", "node3", ready, zoneHints("zone-b"))},
			want:      ClusterEndpointsChoice{Zone: "zone-a", Hints: "PreferSameZone"}},
		{name: "node hints", svc: testSvc(distribution(v1.ServiceTrafficDistributionPreferSameNode)),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node1", ready, nodeHints("node1")), testEP("10.0.0.2", "node3", ready, nodeHints("node3"))},
			want:      ClusterEndpointsChoice{Zone: "zone-a", Hints: "PreferSameNode"}},
		{name: "node hints ignored, zone hints used",
			svc: testSvc(distribution(v1.ServiceTrafficDistributionPreferSameNode)),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node2", ready, nodeHints("node2"), zoneHints("zone-a")),
				testEP("10.0.0.2", "node3", ready, nodeHints("node3"), zoneHints("zone-b"))},
			want: ClusterEndpointsChoice{Zone: "zone-a", Hints: "PreferSameZone", HintsIgnored: "no node hint names this node"}},
		{name: "zone hints of other zones", svc: testSvc(),
			endpoints: []*Endpoint{testEP("10.0.0.2", "node3", ready, zoneHints("zone-b"))},
			want:      ClusterEndpointsChoice{Zone: "zone-a", HintsIgnored: "no zone hint names this node's zone zone-a"}},
		{name: "zone hints without a zone label", svc: testSvc(), topo: &noZone,
			endpoints: []*Endpoint{testEP("10.0.0.2", "node3", ready, zoneHints("zone-b"))},
			want:      ClusterEndpointsChoice{HintsIgnored: "this node has no topology.kubernetes.io/zone label for the zone hints"}},
		{name: "topology key selects", svc: testSvc(topologyKeys("rack", "edge", "*")),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node2", ready), testEP("10.0.0.3", "node3", ready)},
			want:      ClusterEndpointsChoice{Zone: "zone-a", TopologyKey: "edge", TopologyValue: "unit1"}},
		{name: "topology key any", svc: testSvc(topologyKeys("rack", "*")),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node2", ready)},
			want:      ClusterEndpointsChoice{Zone: "zone-a", TopologyKey: "*"}},
		{name: "topology keys select nothing", svc: testSvc(topologyKeys("edge")),
			endpoints: []*Endpoint{testEP("10.0.0.1", "node2", ready)},
			want:      ClusterEndpointsChoice{Zone: "zone-a"}},
		{name: "topology keys over terminating endpoints", svc: testSvc(topologyKeys("edge")),
			endpoints: []*Endpoint{testEP("10.0.0.3", "node3", servingTerm)},
			want:      ClusterEndpointsChoice{Zone: "zone-a", TerminatingFallback: true, TopologyKey: "edge", TopologyValue: "unit1"}},
		{name: "no endpoints", svc: testSvc(), want: ClusterEndpointsChoice{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			topo := testTopology()
			if tc.topo != nil {
				topo = *tc.topo
			}
			if got := ExplainClusterEndpoints(tc.endpoints, tc.svc, topo); got != tc.want {
				t.Errorf("ExplainClusterEndpoints = %+v, want %+v", got, tc.want)
			}
			// The choice is CategorizeEndpoints': same list.
			cluster, _, _, _ := CategorizeEndpoints(tc.endpoints, tc.svc, topo)
			again, _ := clusterPolicyEndpoints(tc.endpoints, tc.svc, &topo, nil)
			if len(tc.endpoints) > 0 && !slices.Equal(ips(cluster), ips(again)) {
				t.Errorf("cluster endpoints %v, explained selection %v", ips(cluster), ips(again))
			}
		})
	}
}
