package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/test/cluster"
)

// perNode deploys one workload per node (name-<i>, pinned to node i) whose
// pods carry sel, and returns the pods of node i at index i-1.
func (e *env) perNode(name string, sel map[string]string, replicas ...int32) [][]v1.Pod {
	e.t.Helper()
	out := make([][]v1.Pod, suiteNodes)
	for i := 1; i <= suiteNodes; i++ {
		n := int32(1)
		if i <= len(replicas) {
			n = replicas[i-1]
		}
		if n == 0 {
			continue
		}
		out[i-1] = e.deploy(workload{name: fmt.Sprintf("%s-%d", name, i), replicas: n, node: nodeName(i), labels: sel})
	}
	return out
}

// TestExternalTrafficPolicyLocal: a NodePort with eTP=Local answers only
// from the receiving node's pods, which see the client's own address; a
// node without a local endpoint drops the traffic.
func TestExternalTrafficPolicyLocal(t *testing.T) { inMode(t, testExternalTrafficPolicyLocal) }

func testExternalTrafficPolicyLocal(t *testing.T) {
	e := newEnv(t)
	sel := map[string]string{"svc": "etp"}
	byNode := e.perNode("etp", sel, 2, 1, 0)
	svc := e.createService("etp", sel, withType(v1.ServiceTypeNodePort), func(s *v1.Service) {
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	})
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	np := svc.Spec.Ports[0].NodePort

	for i := 1; i <= suiteNodes; i++ {
		local := names(byNode[i-1], "")
		t.Run(fmt.Sprintf("%s with %d local endpoints", nodeName(i), len(local)), func(t *testing.T) {
			e := e.sub(t)
			addr := hostPort(cluster.NodeIP(i), np)
			if len(local) == 0 {
				e.expectFailure(cluster.TargetClient, "tcp", addr, netnstest.ErrTimeout)
				return
			}
			s := e.expectTraffic(cluster.TargetClient, "tcp", addr, 20,
				expect{all: local, only: local, sources: []string{cluster.ClientIP}})
			t.Logf("%s", s)
		})
	}
}

// TestInternalTrafficPolicyLocal: with iTP=Local a pod reaches only the
// endpoints of its own node; a pod on a node without one is dropped.
func TestInternalTrafficPolicyLocal(t *testing.T) { inMode(t, testInternalTrafficPolicyLocal) }

func testInternalTrafficPolicyLocal(t *testing.T) {
	e := newEnv(t)
	sel := map[string]string{"svc": "itp"}
	byNode := e.perNode("itp", sel, 2, 1, 0)
	svc := e.createService("itp", sel, func(s *v1.Service) {
		s.Spec.InternalTrafficPolicy = new(v1.ServiceInternalTrafficPolicyLocal)
	})
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	addr := hostPort(svc.Spec.ClusterIP, servicePort)

	for i := 1; i <= suiteNodes; i++ {
		local := names(byNode[i-1], "")
		t.Run(fmt.Sprintf("pod on %s with %d local endpoints", nodeName(i), len(local)), func(t *testing.T) {
			e := e.sub(t)
			from, ip := e.clientPod(fmt.Sprintf("client-%d", i), nodeName(i))
			if len(local) == 0 {
				e.expectFailure(from, "tcp", addr, netnstest.ErrTimeout)
				return
			}
			s := e.expectTraffic(from, "tcp", addr, 20, expect{all: local, only: local, sources: []string{ip}})
			t.Logf("%s", s)
		})
	}
}

// TestTopologyHints: with trafficDistribution PreferSameZone the real
// EndpointSlice controller hints each endpoint for its zone, and kproxy
// keeps a pod's traffic inside its zone (node-1 and node-3 are zone-a,
// node-2 zone-b).
func TestTopologyHints(t *testing.T) { inMode(t, testTopologyHints) }

func testTopologyHints(t *testing.T) {
	e := newEnv(t)
	sel := map[string]string{"svc": "zonal"}
	byNode := e.perNode("zonal", sel)
	svc := e.createService("zonal", sel, func(s *v1.Service) {
		s.Spec.TrafficDistribution = new(v1.ServiceTrafficDistributionPreferSameZone)
	})
	e.waitEndpoints(svc.Name, "3 ready, each hinted for its own zone", func(eps []discoveryv1.Endpoint) error {
		if err := readyCount(3)(eps); err != nil {
			return err
		}
		for _, ep := range eps {
			if ep.Zone == nil || ep.Hints == nil || len(ep.Hints.ForZones) != 1 || ep.Hints.ForZones[0].Name != *ep.Zone {
				return fmt.Errorf("endpoint %v has no hint for its own zone", ep.Addresses)
			}
		}
		return nil
	})
	addr := hostPort(svc.Spec.ClusterIP, servicePort)

	cases := []struct {
		node int
		// want are the nodes whose endpoints must answer, alone.
		want []int
	}{
		{node: 2, want: []int{2}},
		{node: 1, want: []int{1, 3}},
		{node: 3, want: []int{1, 3}},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("pod on %s in %s", nodeName(tc.node), cluster.NodeZone(tc.node)), func(t *testing.T) {
			e := e.sub(t)
			var want []string
			for _, i := range tc.want {
				want = append(want, names(byNode[i-1], "")...)
			}
			from, _ := e.clientPod(fmt.Sprintf("client-%d", tc.node), nodeName(tc.node))
			s := e.expectTraffic(from, "tcp", addr, 20, expect{all: want, only: want})
			t.Logf("%s", s)
		})
	}
}

// TestTopologyKeys: with the topologyKeys annotation on the node group
// label a pod reaches only the endpoints of its group; relabelling its node
// into the other group moves its traffic there within seconds (node-1 and
// node-3 are g1, node-2 g0).
func TestTopologyKeys(t *testing.T) { inMode(t, testTopologyKeys) }

func testTopologyKeys(t *testing.T) {
	const movedNode = 1
	e := newEnv(t)
	sel := map[string]string{"svc": "grouped"}
	byNode := e.perNode("grouped", sel)
	keys, _ := json.Marshal([]string{cluster.LabelGroup})
	svc := e.createService("grouped", sel, func(s *v1.Service) {
		s.Annotations = map[string]string{"topologyKeys": string(keys)}
	})
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	addr := hostPort(svc.Spec.ClusterIP, servicePort)
	podsOf := func(nodes ...int) []string {
		var out []string
		for _, i := range nodes {
			out = append(out, names(byNode[i-1], "")...)
		}
		return out
	}
	movedPod, _ := e.clientPod("client-1", nodeName(movedNode))
	otherPod, _ := e.clientPod("client-2", nodeName(2))

	t.Run("inside each group", func(t *testing.T) {
		e := e.sub(t)
		e.expectTraffic(movedPod, "tcp", addr, 20, expect{all: podsOf(1, 3), only: podsOf(1, 3)})
		e.expectTraffic(otherPod, "tcp", addr, 20, expect{all: podsOf(2), only: podsOf(2)})
	})
	if t.Failed() {
		return
	}

	t.Run("node-1 relabelled into g0", func(t *testing.T) {
		e := e.sub(t)
		node, err := e.k.CoreV1().Nodes().Get(e.ctx, nodeName(movedNode), metav1.GetOptions{})
		if err != nil {
			t.Fatalf("getting %s: %v", nodeName(movedNode), err)
		}
		old, ok := node.Labels[cluster.LabelGroup]
		if !ok || old == "g0" {
			t.Fatalf("%s has %s=%q, want g1", node.Name, cluster.LabelGroup, old)
		}
		t.Cleanup(func() { e.setNodeLabel(movedNode, cluster.LabelGroup, old) })
		began := time.Now()
		e.setNodeLabel(movedNode, cluster.LabelGroup, "g0")
		e.eventuallyWithin("node-1's pod reaches g0 only", 15*time.Second, movedPod, addr, expect{all: podsOf(1, 2), only: podsOf(1, 2)})
		t.Logf("node-1's traffic moved to g0 %s after the relabel", time.Since(began).Round(time.Millisecond))
		e.eventuallyWithin("node-2's pod also reaches the relabelled node", 15*time.Second, otherPod, addr, expect{all: podsOf(1, 2), only: podsOf(1, 2)})
	})
}

// eventuallyWithin is expectTraffic (20 requests) with its own bound.
func (e *env) eventuallyWithin(what string, timeout time.Duration, from, addr string, x expect) {
	e.t.Helper()
	e.eventually(what, timeout, func() error {
		s, err := e.sample(from, "tcp", addr, 20)
		if err != nil {
			return err
		}
		return x.check(s)
	})
}

// setNodeLabel patches one label of node i (also from cleanups).
func (e *env) setNodeLabel(i int, key, value string) {
	e.t.Helper()
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]string{key: value}}})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := e.k.CoreV1().Nodes().Patch(ctx, nodeName(i), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		e.t.Errorf("setting %s=%s on %s: %v", key, value, nodeName(i), err)
	}
}
