package cluster

import (
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestNodeTopology(t *testing.T) {
	tests := []struct {
		name                        string
		i                           int
		wantName, wantNS, wantIP    string
		wantCIDR, wantZone, wantGrp string
	}{
		{name: "node 1", i: 1, wantName: "node-1", wantNS: "kpc-node-1", wantIP: "10.254.0.11", wantCIDR: "10.244.1.0/24", wantZone: "zone-a", wantGrp: "g1"},
		{name: "node 2", i: 2, wantName: "node-2", wantNS: "kpc-node-2", wantIP: "10.254.0.12", wantCIDR: "10.244.2.0/24", wantZone: "zone-b", wantGrp: "g0"},
		{name: "node 3", i: 3, wantName: "node-3", wantNS: "kpc-node-3", wantIP: "10.254.0.13", wantCIDR: "10.244.3.0/24", wantZone: "zone-a", wantGrp: "g1"},
		{name: "last node", i: MaxNodes, wantName: "node-89", wantNS: "kpc-node-89", wantIP: "10.254.0.99", wantCIDR: "10.244.89.0/24", wantZone: "zone-a", wantGrp: "g1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := NodeName(tc.i); got != tc.wantName {
				t.Errorf("NodeName = %q, want %q", got, tc.wantName)
			}
			if got := NodeNetNS(tc.i); got != tc.wantNS {
				t.Errorf("NodeNetNS = %q, want %q", got, tc.wantNS)
			}
			if got := NodeIP(tc.i); got != tc.wantIP {
				t.Errorf("NodeIP = %q, want %q", got, tc.wantIP)
			}
			if got := NodePodCIDR(tc.i); got != tc.wantCIDR {
				t.Errorf("NodePodCIDR = %q, want %q", got, tc.wantCIDR)
			}
			labels := NodeLabels(tc.i)
			for k, want := range map[string]string{LabelZone: tc.wantZone, LabelGroup: tc.wantGrp, LabelHostname: tc.wantName} {
				if labels[k] != want {
					t.Errorf("label %s = %q, want %q", k, labels[k], want)
				}
			}
			if got, ok := nodeIndex(tc.wantName, MaxNodes); !ok || got != tc.i {
				t.Errorf("nodeIndex(%q) = %d, %t; want %d, true", tc.wantName, got, ok, tc.i)
			}
		})
	}
}

func TestNodeIndex(t *testing.T) {
	tests := []struct {
		name   string
		in     string
		nodes  int
		want   int
		wantOK bool
	}{
		{name: "first", in: "node-1", nodes: 2, want: 1, wantOK: true},
		{name: "last", in: "node-2", nodes: 2, want: 2, wantOK: true},
		{name: "beyond the cluster", in: "node-3", nodes: 2, want: 3},
		{name: "zero", in: "node-0", nodes: 2},
		{name: "leading zero", in: "node-01", nodes: 2},
		{name: "trailing text", in: "node-1x", nodes: 2},
		{name: "namespace name", in: "kpc-node-1", nodes: 2},
		{name: "other", in: "client", nodes: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := nodeIndex(tc.in, tc.nodes)
			if ok != tc.wantOK || (ok && got != tc.want) {
				t.Errorf("nodeIndex(%q, %d) = %d, %t; want %d, %t", tc.in, tc.nodes, got, ok, tc.want, tc.wantOK)
			}
		})
	}
}

func TestPodNetNS(t *testing.T) {
	tests := []struct{ name, uid, want string }{
		{name: "uuid", uid: "3f1c2a9e-5b7d-4c1e-9f00-123456789abc", want: "kpc-p-3f1c2a9e"},
		{name: "short", uid: "abc", want: "kpc-p-abc"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := PodNetNS(tc.uid); got != tc.want {
				t.Errorf("PodNetNS(%q) = %q, want %q", tc.uid, got, tc.want)
			}
		})
	}
}

func TestValidateNodes(t *testing.T) {
	tests := []struct {
		name    string
		n       int
		wantErr bool
	}{
		{name: "one", n: 1},
		{name: "max", n: MaxNodes},
		{name: "zero", n: 0, wantErr: true},
		{name: "too many: addresses would reach the client's", n: MaxNodes + 1, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := validateNodes(tc.n); (err != nil) != tc.wantErr {
				t.Errorf("validateNodes(%d) = %v, want error %t", tc.n, err, tc.wantErr)
			}
		})
	}
}

func TestNodeObject(t *testing.T) {
	hb := metav1.NewTime(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
	tests := []struct {
		name string
		i    int
	}{
		{name: "node 1", i: 1},
		{name: "node 2", i: 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			n := nodeObject(tc.i, hb)
			if n.Name != NodeName(tc.i) {
				t.Errorf("name %q", n.Name)
			}
			if n.Spec.PodCIDR != NodePodCIDR(tc.i) || len(n.Spec.PodCIDRs) != 1 || n.Spec.PodCIDRs[0] != NodePodCIDR(tc.i) {
				t.Errorf("podCIDR %q / %v, want %s", n.Spec.PodCIDR, n.Spec.PodCIDRs, NodePodCIDR(tc.i))
			}
			if len(n.Spec.Taints) != 0 || n.Spec.Unschedulable {
				t.Errorf("node is not schedulable: taints %v, unschedulable %t", n.Spec.Taints, n.Spec.Unschedulable)
			}
			var internal string
			for _, a := range n.Status.Addresses {
				if a.Type == v1.NodeInternalIP {
					internal = a.Address
				}
			}
			if internal != NodeIP(tc.i) {
				t.Errorf("InternalIP %q, want %s", internal, NodeIP(tc.i))
			}
			cond := readyCondition(n)
			if cond == nil || cond.Status != v1.ConditionTrue || !cond.LastHeartbeatTime.Equal(&hb) {
				t.Errorf("Ready condition %+v, want True with heartbeat %v", cond, hb)
			}
			pods := n.Status.Allocatable[v1.ResourcePods]
			if pods.Value() < 100 {
				t.Errorf("allocatable pods %s: the scheduler needs room", pods.String())
			}
			if n.Labels[LabelZone] != NodeZone(tc.i) {
				t.Errorf("zone label %q, want %q", n.Labels[LabelZone], NodeZone(tc.i))
			}
		})
	}
}
