package proxy

import (
	"fmt"
	"maps"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func testNode(name string, labels map[string]string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

func TestNodeLabelsChanges(t *testing.T) {
	// op is one cache operation; exactly one of set and del is used.
	type op struct {
		set         *v1.Node
		del         string
		wantChanged bool
	}
	withAddress := testNode("node2", map[string]string{"zone": "a"})
	withAddress.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "192.0.2.2"}}
	withAddress.ResourceVersion = "7"

	cases := []struct {
		name string
		ops  []op
		// want is every known node's labels after the operations.
		want map[string]map[string]string
	}{
		{
			name: "new node is a change",
			ops:  []op{{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true}},
			want: map[string]map[string]string{"node2": {"zone": "a"}},
		},
		{
			name: "new node without labels is a change",
			ops:  []op{{set: testNode("node2", nil), wantChanged: true}},
			want: map[string]map[string]string{"node2": {}},
		},
		{
			name: "same labels again is no change",
			ops: []op{
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true},
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: false},
			},
			want: map[string]map[string]string{"node2": {"zone": "a"}},
		},
		{
			name: "other node fields are ignored",
			ops: []op{
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true},
				{set: withAddress, wantChanged: false},
			},
			want: map[string]map[string]string{"node2": {"zone": "a"}},
		},
		{
			name: "nil and empty labels are equal",
			ops: []op{
				{set: testNode("node2", nil), wantChanged: true},
				{set: testNode("node2", map[string]string{}), wantChanged: false},
			},
			want: map[string]map[string]string{"node2": {}},
		},
		{
			name: "changed value",
			ops: []op{
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true},
				{set: testNode("node2", map[string]string{"zone": "b"}), wantChanged: true},
			},
			want: map[string]map[string]string{"node2": {"zone": "b"}},
		},
		{
			name: "added and removed labels",
			ops: []op{
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true},
				{set: testNode("node2", map[string]string{"zone": "a", "edge": "u1"}), wantChanged: true},
				{set: testNode("node2", map[string]string{"edge": "u1"}), wantChanged: true},
			},
			want: map[string]map[string]string{"node2": {"edge": "u1"}},
		},
		{
			name: "delete known node",
			ops: []op{
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true},
				{set: testNode("node3", map[string]string{"zone": "b"}), wantChanged: true},
				{del: "node2", wantChanged: true},
			},
			want: map[string]map[string]string{"node3": {"zone": "b"}},
		},
		{
			name: "delete unknown node is no change",
			ops:  []op{{del: "node9", wantChanged: false}},
			want: map[string]map[string]string{},
		},
		{
			name: "nil node and unnamed node are ignored",
			ops: []op{
				{set: nil, wantChanged: false},
				{set: testNode("", map[string]string{"zone": "a"}), wantChanged: false},
			},
			want: map[string]map[string]string{},
		},
		{
			name: "re-added after delete is a change",
			ops: []op{
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true},
				{del: "node2", wantChanged: true},
				{set: testNode("node2", map[string]string{"zone": "a"}), wantChanged: true},
			},
			want: map[string]map[string]string{"node2": {"zone": "a"}},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := NewNodeLabels(NodeLabelsOptions{NodeName: "node1"})
			for i, o := range tc.ops {
				var changed bool
				if o.del != "" {
					changed = c.Delete(o.del)
				} else {
					changed = c.Set(o.set)
				}
				if changed != o.wantChanged {
					t.Errorf("op %d: changed = %v, want %v", i, changed, o.wantChanged)
				}
			}
			for _, name := range []string{"node1", "node2", "node3", "node9"} {
				got, ok := c.Get(name)
				want, wantOK := tc.want[name]
				if ok != wantOK || !maps.Equal(got, want) {
					t.Errorf("Get(%q) = %v, %v; want %v, %v", name, got, ok, want, wantOK)
				}
			}
		})
	}
}

func TestNodeLabelsCopiesNodeLabels(t *testing.T) {
	c := NewNodeLabels(NodeLabelsOptions{NodeName: "node1"})
	node := testNode("node2", map[string]string{"zone": "a"})
	c.Set(node)
	node.Labels["zone"] = "b"
	if got, _ := c.Get("node2"); got["zone"] != "a" {
		t.Errorf("cache follows a later change of the node object: zone = %q", got["zone"])
	}
}

func TestNodeLabelsSelf(t *testing.T) {
	c := NewNodeLabels(NodeLabelsOptions{NodeName: "node1"})
	if got := c.Self(); got != nil {
		t.Errorf("Self() before this node is known = %v, want nil", got)
	}
	c.Set(testNode("node2", map[string]string{"zone": "b"}))
	c.Set(testNode("node1", map[string]string{"zone": "a"}))
	if got, want := c.Self(), map[string]string{"zone": "a"}; !maps.Equal(got, want) {
		t.Errorf("Self() = %v, want %v", got, want)
	}
	if got := c.NodeName(); got != "node1" {
		t.Errorf("NodeName() = %q, want node1", got)
	}
}

func TestNodeLabelsTopologyInfoIsASnapshot(t *testing.T) {
	c := NewNodeLabels(NodeLabelsOptions{NodeName: "node1"})
	c.Set(testNode("node1", map[string]string{"zone": "a"}))
	c.Set(testNode("node2", map[string]string{"zone": "a"}))
	c.Set(testNode("node3", map[string]string{"zone": "b"}))

	snap := c.TopologyInfo()

	c.Set(testNode("node1", map[string]string{"zone": "c"}))
	c.Set(testNode("node2", map[string]string{"zone": "c"}))
	c.Delete("node3")
	c.Set(testNode("node4", map[string]string{"zone": "a"}))

	if snap.NodeName != "node1" {
		t.Errorf("NodeName = %q, want node1", snap.NodeName)
	}
	if got := snap.NodeLabels["zone"]; got != "a" {
		t.Errorf("snapshot NodeLabels zone = %q, want a", got)
	}
	for name, wantZone := range map[string]string{"node1": "a", "node2": "a", "node3": "b"} {
		labels, ok := snap.LabelsOf(name)
		if !ok || labels["zone"] != wantZone {
			t.Errorf("snapshot LabelsOf(%q) = %v, %v; want zone %q", name, labels, ok, wantZone)
		}
	}
	if _, ok := snap.LabelsOf("node4"); ok {
		t.Errorf("snapshot knows node4, added after it was taken")
	}

	now := c.TopologyInfo()
	if got := now.NodeLabels["zone"]; got != "c" {
		t.Errorf("new snapshot NodeLabels zone = %q, want c", got)
	}
	if _, ok := now.LabelsOf("node3"); ok {
		t.Errorf("new snapshot still knows deleted node3")
	}
	if l, ok := now.LabelsOf("node4"); !ok || l["zone"] != "a" {
		t.Errorf("new snapshot LabelsOf(node4) = %v, %v; want zone a", l, ok)
	}
}

// A label change on a node re-filters topologyKeys endpoints at the next
// categorization.
func TestNodeLabelsDriveTopologyKeys(t *testing.T) {
	c := NewNodeLabels(NodeLabelsOptions{NodeName: thisNode})
	c.Set(testNode(thisNode, map[string]string{"edge": "unit1"}))
	c.Set(testNode("node2", map[string]string{"edge": "unit1"}))
	c.Set(testNode("node3", map[string]string{"edge": "unit2"}))
	svc := testSvc(topologyKeys("edge"))
	eps := []*Endpoint{testEP("10.0.0.2", "node2", ready), testEP("10.0.0.3", "node3", ready)}

	steps := []struct {
		name   string
		change func()
		want   []string
	}{
		{name: "initial groups", change: func() {}, want: []string{"10.0.0.2"}},
		{name: "node3 joins my group", change: func() { c.Set(testNode("node3", map[string]string{"edge": "unit1"})) }, want: []string{"10.0.0.2", "10.0.0.3"}},
		{name: "node2 leaves my group", change: func() { c.Set(testNode("node2", map[string]string{"edge": "unit9"})) }, want: []string{"10.0.0.3"}},
		{name: "node3 deleted", change: func() { c.Delete("node3") }, want: nil},
		{name: "this node moves to node2's group", change: func() { c.Set(testNode(thisNode, map[string]string{"edge": "unit9"})) }, want: []string{"10.0.0.2"}},
	}
	for _, s := range steps {
		s.change()
		cluster, _, _, _ := CategorizeEndpoints(eps, svc, c.TopologyInfo())
		checkList(t, s.name, cluster, s.want, true)
	}
}

func TestNodeLabelsConcurrentUse(t *testing.T) {
	c := NewNodeLabels(NodeLabelsOptions{NodeName: "node0"})
	svc := testSvc(topologyKeys("edge"))
	eps := []*Endpoint{testEP("10.0.0.1", "node1", ready), testEP("10.0.0.2", "node2", ready)}

	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 200 {
				name := fmt.Sprintf("node%d", i%5)
				switch (i + w) % 4 {
				case 0, 1:
					c.Set(testNode(name, map[string]string{"edge": fmt.Sprintf("unit%d", (i+w)%2)}))
				case 2:
					c.Delete(name)
				case 3:
					c.Get(name)
					c.Self()
				}
			}
		})
	}
	for range 2 {
		wg.Go(func() {
			for range 200 {
				topo := c.TopologyInfo()
				CategorizeEndpoints(eps, svc, topo)
			}
		})
	}
	wg.Wait()

	// After the storm the cache still answers consistently.
	c.Set(testNode("node0", map[string]string{"edge": "x"}))
	c.Set(testNode("node1", map[string]string{"edge": "x"}))
	c.Set(testNode("node2", map[string]string{"edge": "y"}))
	cluster, _, _, _ := CategorizeEndpoints(eps, svc, c.TopologyInfo())
	checkList(t, "clusterEndpoints", cluster, []string{"10.0.0.1"}, true)
}
