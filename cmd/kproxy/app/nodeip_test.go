package app

import (
	"context"
	"errors"
	"net/netip"
	"reflect"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/klog/v2/ktesting"

	"github.com/kproxy/kproxy/pkg/conntrack"
)

func nodeWithAddresses(name string, addrs ...v1.NodeAddress) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}, Status: v1.NodeStatus{Addresses: addrs}}
}

func TestDetectNodeIPs(t *testing.T) {
	internal := func(a string) v1.NodeAddress { return v1.NodeAddress{Type: v1.NodeInternalIP, Address: a} }
	external := func(a string) v1.NodeAddress { return v1.NodeAddress{Type: v1.NodeExternalIP, Address: a} }
	hostname := v1.NodeAddress{Type: v1.NodeHostName, Address: "node-a"}
	for _, tc := range []struct {
		name        string
		node        *v1.Node
		bindAddress string
		// getErr makes every Get of the Node fail.
		getErr error
		want   map[v1.IPFamily]string
	}{
		{
			name: "dual-stack Node: the first InternalIP of each family",
			node: nodeWithAddresses("node-a", hostname, external("203.0.113.1"), internal("10.0.0.1"), internal("fd00::1"), internal("10.0.0.2")),
			want: map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1", v1.IPv6Protocol: "fd00::1"},
		},
		{
			name: "ExternalIPs after InternalIPs",
			node: nodeWithAddresses("node-a", external("2001:db8::1"), internal("10.0.0.1")),
			want: map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1", v1.IPv6Protocol: "2001:db8::1"},
		},
		{
			name: "leading zeros and an IPv4-mapped address",
			node: nodeWithAddresses("node-a", internal("010.000.000.001"), internal("::ffff:10.0.0.2")),
			want: map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1"},
		},
		{
			name:        "a specific bind address overrides its family",
			node:        nodeWithAddresses("node-a", internal("10.0.0.1"), internal("fd00::1")),
			bindAddress: "10.0.0.9",
			want:        map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.9", v1.IPv6Protocol: "fd00::1"},
		},
		{
			name:        "an unspecified bind address does not",
			node:        nodeWithAddresses("node-a", internal("10.0.0.1")),
			bindAddress: "::",
			want:        map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1"},
		},
		{
			name:        "no Node: the bind address only",
			bindAddress: "fd00::9",
			want:        map[v1.IPFamily]string{v1.IPv6Protocol: "fd00::9"},
		},
		{
			name: "a Node without addresses",
			node: nodeWithAddresses("node-a", hostname),
			want: map[v1.IPFamily]string{},
		},
		{
			name: "another node's addresses are not ours",
			node: nodeWithAddresses("node-b", internal("10.0.0.2")),
			want: map[v1.IPFamily]string{},
		},
		{
			name:        "loopback is unknown",
			node:        nodeWithAddresses("node-a", internal("127.0.0.1"), internal("fd00::1")),
			bindAddress: "::1",
			want:        map[v1.IPFamily]string{},
		},
		{
			name:        "API errors: go on with the bind address",
			getErr:      errors.New("connection refused"),
			bindAddress: "10.0.0.9",
			want:        map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.9"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			var objects []runtime.Object
			if tc.node != nil {
				objects = append(objects, tc.node)
			}
			client := fake.NewClientset(objects...)
			if tc.getErr != nil {
				client.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) { return true, nil, tc.getErr })
			}
			got := detectNodeIPs(ctx, client, "node-a", tc.bindAddress, 10*time.Millisecond)
			want := nodeIPs{}
			for fam, s := range tc.want {
				want[fam] = netip.MustParseAddr(s)
			}
			if !reflect.DeepEqual(got, want) {
				t.Errorf("detectNodeIPs = %v, want %v", got, want)
			}
		})
	}
}

// TestDetectNodeIPsWaitsForTheNode: a Node that appears (or gets its
// addresses) while kproxy waits is used.
func TestDetectNodeIPsWaitsForTheNode(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := fake.NewClientset()
	gets := 0
	client.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		if gets++; gets == 2 {
			// The kubelet registers the Node between the polls.
			if err := client.Tracker().Add(nodeWithAddresses("node-a", v1.NodeAddress{Type: v1.NodeInternalIP, Address: "10.0.0.1"})); err != nil {
				return true, nil, err
			}
		}
		return false, nil, nil
	})
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	got := detectNodeIPs(ctx, client, "node-a", "", 30*time.Second)
	if want := (nodeIPs{v1.IPv4Protocol: netip.MustParseAddr("10.0.0.1")}); !reflect.DeepEqual(got, want) {
		t.Errorf("detectNodeIPs = %v, want %v (after %d gets)", got, want, gets)
	}
}

func TestCheckRouteLocalnet(t *testing.T) {
	for _, tc := range []struct {
		name    string
		sysctls map[string]int
		mode    string
		want    bool
	}{
		{name: "unset", sysctls: map[string]int{sysctlRouteLocalnet: 0}, mode: ModeIPTables},
		{name: "set, iptables mode", sysctls: map[string]int{sysctlRouteLocalnet: 1}, mode: ModeIPTables, want: true},
		{name: "set, ipvs mode", sysctls: map[string]int{sysctlRouteLocalnet: 1}, mode: ModeIPVS, want: true},
		{name: "set, nftables mode", sysctls: map[string]int{sysctlRouteLocalnet: 1}, mode: ModeNFTables, want: true},
		{name: "unreadable counts as unset", sysctls: map[string]int{}, mode: ModeIPTables},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			if got := checkRouteLocalnet(ctx, conntrack.NewFakeSysctl(tc.sysctls), tc.mode); got != tc.want {
				t.Errorf("checkRouteLocalnet = %v, want %v", got, tc.want)
			}
		})
	}
}
