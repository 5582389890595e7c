package proxier

import (
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2/ktesting"

	"github.com/kproxy/kproxy/pkg/proxy"
)

func TestStaleConntrackBound(t *testing.T) {
	name := proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "dns"}, Port: "dns", Protocol: v1.ProtocolUDP}
	endpoints := func(from, to int) proxy.UpdateEndpointsMapResult {
		var r proxy.UpdateEndpointsMapResult
		for i := from; i < to; i++ {
			r.DeletedUDPEndpoints = append(r.DeletedUDPEndpoints, proxy.ServiceEndpoint{Endpoint: fmt.Sprintf("10.244.%d.%d:53", i/250, i%250+1), ServicePortName: name})
		}
		return r
	}
	for _, tc := range []struct {
		name string
		// adds are the endpoint ranges noted, one add each.
		adds [][2]int
		// clusterIPs are deleted ClusterIPs noted in a last add.
		clusterIPs []string
		want       int
	}{
		{name: "duplicates count once", adds: [][2]int{{0, 3}, {0, 3}, {1, 2}}, want: 3},
		{name: "up to the bound", adds: [][2]int{{0, 5}}, want: 5},
		{name: "past the bound in one add", adds: [][2]int{{0, 8}}, want: 5},
		{name: "past the bound over several adds", adds: [][2]int{{0, 4}, {4, 8}}, want: 5},
		{name: "a note already held is kept at the bound", adds: [][2]int{{0, 5}, {0, 5}}, want: 5},
		{name: "ClusterIPs count towards the bound", adds: [][2]int{{0, 4}}, clusterIPs: []string{"10.96.0.1", "10.96.0.2"}, want: 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			s := newStaleConntrack(5)
			for _, r := range tc.adds {
				s.add(logger, proxy.UpdateServiceMapResult{}, endpoints(r[0], r[1]))
			}
			if tc.clusterIPs != nil {
				s.add(logger, proxy.UpdateServiceMapResult{DeletedUDPClusterIPs: sets.New(tc.clusterIPs...)}, proxy.UpdateEndpointsMapResult{})
			}
			if got := s.len(); got != tc.want {
				t.Errorf("%d notes, want %d", got, tc.want)
			}
			taken := s.take()
			if got := len(taken.DeletedUDPEndpoints) + taken.DeletedUDPClusterIPs.Len() + len(taken.NewlyActiveUDPServices); got != tc.want {
				t.Errorf("took %d notes, want %d", got, tc.want)
			}
			if !s.empty() {
				t.Errorf("%d notes left after take", s.len())
			}
		})
	}
}
