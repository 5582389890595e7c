package iptables

import (
	"context"
	"fmt"
	"net/netip"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// FuzzRender renders arbitrary service ports and their endpoints, applies
// them to the fake iptables (which parses every rule and rejects jumps to
// missing chains) and checks that the ClusterIP reaches exactly the
// expected endpoints. The seed corpus runs in `make test`.
func FuzzRender(f *testing.F) {
	f.Add(uint16(80), uint16(30080), uint8(0), uint8(2), uint8(0), uint32(0x0a600001), "web", "p", false, false, false, uint8(0))
	f.Add(uint16(53), uint16(0), uint8(1), uint8(1), uint8(1), uint32(0x0a600102), "dns", "", true, false, true, uint8(1))
	f.Add(uint16(443), uint16(31000), uint8(2), uint8(5), uint8(3), uint32(0xfffffff0), "x\"y", "q z", true, true, true, uint8(2))
	f.Add(uint16(1), uint16(65535), uint8(0), uint8(0), uint8(2), uint32(7), "", "", false, true, false, uint8(3))
	f.Fuzz(func(t *testing.T, port, nodePort uint16, protoIdx, nEndpoints, policy uint8, ipBits uint32,
		name, portName string, affinity, extIP, lb bool, sourceRanges uint8) {
		if port == 0 {
			return
		}
		protos := []v1.Protocol{v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP}
		proto := protos[int(protoIdx)%len(protos)]
		cip := netip.AddrFrom4([4]byte{byte(ipBits >> 24), byte(ipBits >> 16), byte(ipBits >> 8), byte(ipBits)})
		sp := &proxy.ServicePort{
			Name:      proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: "ns", Name: name}, Port: portName, Protocol: proto},
			ClusterIP: cip, Port: int(port), Protocol: proto, NodePort: int(nodePort),
			SessionAffinityClientIP: affinity, StickyMaxAgeSeconds: 10800,
		}
		if extIP {
			sp.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.9")}
		}
		if lb {
			sp.LoadBalancerVIPs = []netip.Addr{netip.MustParseAddr("203.0.113.10")}
			for i := 0; i < int(sourceRanges%4); i++ {
				sp.LoadBalancerSourceRanges = append(sp.LoadBalancerSourceRanges, netip.MustParsePrefix(fmt.Sprintf("192.0.%d.0/24", i)))
			}
		}
		sp.InternalPolicyLocal = policy&1 != 0
		sp.ExternalPolicyLocal = policy&2 != 0 && sp.ExternallyAccessible()
		var eps []*proxy.Endpoint
		for i := 0; i < int(nEndpoints%12); i++ {
			eps = append(eps, &proxy.Endpoint{IP: netip.AddrFrom4([4]byte{10, 244, byte(i % 3), byte(i + 1)}), Port: 8080,
				Ready: true, Serving: true, NodeName: fmt.Sprintf("node-%d", i%3), IsLocal: i%3 == 0})
		}
		opts := proxy.DecisionOptions{ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), NodeIP: netip.MustParseAddr("10.0.0.1")}
		st := &proxy.NodeState{Family: v1.IPv4Protocol, NodeName: "node-0", Options: opts, Changed: sets.New[types.NamespacedName](),
			Services: map[proxy.ServicePortName]*proxy.ServiceState{sp.Name: proxy.NewServiceState(sp, eps, proxy.TopologyInfo{NodeName: "node-0"}, opts)}}
		fake := iptablestest.NewFake(ipt.ProtocolIPv4)
		b, err := New(Options{IPTables: fake,
			LocalAddresses: func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("10.0.0.1")}, nil }})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Sync(context.Background(), st, true); err != nil {
			t.Fatalf("sync: %v", err)
		}
		if cip == netip.MustParseAddr("10.0.0.1") || cip.IsLoopback() {
			return
		}
		outs, err := fake.Trace(iptablestest.Packet{Source: netip.MustParseAddr("10.244.9.9"), Destination: cip, Protocol: string(toLower(proto)),
			SourcePort: 1, DestinationPort: int(port)}, iptablestest.TraceOptions{LocalAddrs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}})
		if err != nil {
			t.Fatalf("trace: %v", err)
		}
		want := sets.New[string]()
		svc := st.Services[sp.Name]
		internal := svc.ClusterEndpoints
		if sp.InternalPolicyLocal {
			internal = svc.LocalEndpoints
		}
		for _, ep := range internal {
			want.Insert(ep.String())
		}
		got := sets.New(iptablestest.Endpoints(outs)...)
		if !got.Equal(want) {
			t.Fatalf("clusterIP reaches %v, want %v", sets.List(got), sets.List(want))
		}
	})
}

func toLower(p v1.Protocol) string {
	switch p {
	case v1.ProtocolUDP:
		return "udp"
	case v1.ProtocolSCTP:
		return "sctp"
	}
	return "tcp"
}
