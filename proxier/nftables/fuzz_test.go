package nftables

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier/nftables/nftablestest"
)

// FuzzRender renders arbitrary service ports and their endpoints into the
// strict fake (which refuses what the kernel refuses), traces the ClusterIP
// and checks that it reaches exactly the expected endpoints. The seed
// corpus runs with the unit tests.
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
		fake := knftables.NewFake(knftables.IPv4Family, TableName)
		local := []netip.Addr{netip.MustParseAddr("10.0.0.1")}
		b, err := New(Options{NFTables: &strictNFT{Fake: fake}, Family: v1.IPv4Protocol,
			LocalAddresses: func() ([]netip.Addr, error) { return local, nil }})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Sync(context.Background(), st, true); err != nil {
			t.Fatalf("sync: %v", err)
		}
		if cip == local[0] || cip.IsLoopback() || cip.IsUnspecified() {
			return
		}
		outs, err := nftablestest.Trace(fake, nftablestest.Packet{Source: netip.MustParseAddr("10.244.9.9"), Destination: cip,
			Protocol: strings.ToLower(string(proto)), SourcePort: 1, DestinationPort: int(port)}, nftablestest.Options{LocalAddrs: local})
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
		got := sets.New[string]()
		for _, o := range outs {
			if o.DNAT != "" {
				got.Insert(o.DNAT)
			}
		}
		if !got.Equal(want) {
			t.Fatalf("clusterIP reaches %v, want %v", sets.List(got), sets.List(want))
		}
	})
}
