package proxiertest

import (
	"fmt"
	"net/netip"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// RenderCase is one fuzzed service port and the node state that holds it,
// ready for a backend to render.
type RenderCase struct {
	Port  *proxy.ServicePort
	State *proxy.NodeState
	// NodeIP is the node's primary and only local address.
	NodeIP netip.Addr
}

// WantClusterEndpoints are the endpoints ("ip:port") a pod's connection to
// the ClusterIP may reach.
func (c RenderCase) WantClusterEndpoints() sets.Set[string] {
	svc := c.State.Services[c.Port.Name]
	internal := svc.ClusterEndpoints
	if c.Port.InternalPolicyLocal {
		internal = svc.LocalEndpoints
	}
	want := sets.New[string]()
	for _, ep := range internal {
		want.Insert(ep.String())
	}
	return want
}

// FuzzRender adds the render seed corpus to f and fuzzes check with the
// service port (any protocol, ClusterIP, node port, affinity, traffic
// policies, external IP and load balancer with source ranges) and up to
// eleven endpoints built from the fuzzer's arguments, on node-0 (IPv4,
// cluster CIDR 10.244.0.0/16, node IP 10.0.0.1).
func FuzzRender(f *testing.F, check func(t *testing.T, c RenderCase)) {
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
		nodeIP := netip.MustParseAddr("10.0.0.1")
		opts := proxy.DecisionOptions{ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), NodeIP: nodeIP}
		st := &proxy.NodeState{Family: v1.IPv4Protocol, NodeName: "node-0", Options: opts, Changed: sets.New[types.NamespacedName](),
			Services: map[proxy.ServicePortName]*proxy.ServiceState{sp.Name: proxy.NewServiceState(sp, eps, proxy.TopologyInfo{NodeName: "node-0"}, opts)}}
		check(t, RenderCase{Port: sp, State: st, NodeIP: nodeIP})
	})
}
