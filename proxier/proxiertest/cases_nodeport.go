package proxiertest

import (
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// NodePortCases are the cases of --nodeport-addresses: its keywords, its
// per-family reading, loopback addresses (never serving node ports) and
// node ports without endpoints (rejected on every local address).
func NodePortCases() []Case {
	both := []string{localEPAt, remoteEPAt}
	const secondIP = "10.0.1.1"
	v6Endpoints := []string{"[fd00:244::5]:8080", "[fd00:244:1::5]:8080"}
	v6Slice := func(svc string) *discovery.EndpointSlice {
		return Slice(svc, 8080, EP{IP: "fd00:244::5", Node: "node-a"}, EP{IP: "fd00:244:1::5", Node: "node-b"})
	}
	return []Case{
		{
			Name:              "nodeport-addresses primary: the node's primary IP only",
			NodeIPs:           []string{nodeIP, secondIP},
			NodeIP:            secondIP,
			NodePortAddresses: []string{"primary"},
			Services:          []*v1.Service{Service("np", "10.96.0.24", NodePort(30024))},
			Slices:            []*discovery.EndpointSlice{twoEndpoints("np")},
			Flows: []Flow{
				{Name: "primary IP", Source: extClient, Dest: secondIP, Port: 30024, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "other address", Source: extClient, Dest: nodeIP, Port: 30024, Want: NotHandled},
				{Name: "localhost", Source: "127.0.0.1", Dest: "127.0.0.1", Port: 30024, Origin: FromHost, Want: NotHandled},
			},
		},
		{
			Name:              "nodeport-addresses primary, IPv6",
			Family:            v1.IPv6Protocol,
			NodeIPs:           []string{"fd00::1", "fd00:1::1"},
			NodePortAddresses: []string{"primary", "192.168.0.0/16"},
			Services:          []*v1.Service{Service("np", "fd00:96::24", IPv6(), NodePort(30024))},
			Slices:            []*discovery.EndpointSlice{v6Slice("np")},
			Flows: []Flow{
				{Name: "primary IP", Source: "2001:db8::10", Dest: "fd00::1", Port: 30024, Want: Delivered, WantEndpoints: v6Endpoints, WantMasquerade: true},
				{Name: "other address", Source: "2001:db8::10", Dest: "fd00:1::1", Port: 30024, Want: NotHandled},
			},
		},
		{
			Name:              "nodeport-addresses primary without a node IP: every address, as kube-proxy",
			NodeIPs:           []string{nodeIP, secondIP},
			NodeIP:            "none",
			NodePortAddresses: []string{"primary"},
			Services:          []*v1.Service{Service("np", "10.96.0.25", NodePort(30025))},
			Slices:            []*discovery.EndpointSlice{twoEndpoints("np")},
			Flows: []Flow{
				{Name: "first address", Source: extClient, Dest: nodeIP, Port: 30025, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "second address", Source: extClient, Dest: secondIP, Port: 30025, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "localhost", Source: "127.0.0.1", Dest: "127.0.0.1", Port: 30025, Origin: FromHost, Want: NotHandled},
			},
		},
		{
			Name:              "nodeport-addresses of the other family only: every address of this one",
			Family:            v1.IPv6Protocol,
			NodeIPs:           []string{"fd00::1", "fd00:1::1"},
			NodePortAddresses: []string{"10.0.0.0/24"},
			Services:          []*v1.Service{Service("np", "fd00:96::26", IPv6(), NodePort(30026))},
			Slices:            []*discovery.EndpointSlice{v6Slice("np")},
			Flows: []Flow{
				{Name: "first address", Source: "2001:db8::10", Dest: "fd00::1", Port: 30026, Want: Delivered, WantEndpoints: v6Endpoints, WantMasquerade: true},
				{Name: "second address", Source: "2001:db8::10", Dest: "fd00:1::1", Port: 30026, Want: Delivered, WantEndpoints: v6Endpoints, WantMasquerade: true},
				{Name: "localhost", Source: "::1", Dest: "::1", Port: 30026, Origin: FromHost, Want: NotHandled},
			},
		},
		{
			Name:              "nodeport-addresses 0.0.0.0/0: every address but 127.0.0.1",
			NodeIPs:           []string{nodeIP, secondIP},
			NodePortAddresses: []string{"0.0.0.0/0"},
			Services:          []*v1.Service{Service("np", "10.96.0.27", NodePort(30027))},
			Slices:            []*discovery.EndpointSlice{twoEndpoints("np")},
			Flows: []Flow{
				{Name: "first address", Source: extClient, Dest: nodeIP, Port: 30027, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "second address", Source: extClient, Dest: secondIP, Port: 30027, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "localhost", Source: "127.0.0.1", Dest: "127.0.0.1", Port: 30027, Origin: FromHost, Want: NotHandled},
			},
		},
		{
			Name:              "nodeport-addresses naming 127.0.0.0/8: loopback still never serves node ports",
			NodePortAddresses: []string{"127.0.0.0/8", "10.0.0.0/24"},
			Services:          []*v1.Service{Service("np", "10.96.0.28", NodePort(30028))},
			Slices:            []*discovery.EndpointSlice{twoEndpoints("np")},
			Flows: []Flow{
				{Name: "node address", Source: extClient, Dest: nodeIP, Port: 30028, Want: Delivered, WantEndpoints: both, WantMasquerade: true},
				{Name: "localhost", Source: "127.0.0.1", Dest: "127.0.0.1", Port: 30028, Origin: FromHost, Want: NotHandled},
				{Name: "other loopback address", Source: "127.0.0.1", Dest: "127.0.0.2", Port: 30028, Origin: FromHost, Want: NotHandled},
			},
		},
		{
			Name:              "nodeport-addresses ::/0: every address but ::1",
			Family:            v1.IPv6Protocol,
			NodePortAddresses: []string{"::/0"},
			Services:          []*v1.Service{Service("np", "fd00:96::29", IPv6(), NodePort(30029))},
			Slices:            []*discovery.EndpointSlice{v6Slice("np")},
			Flows: []Flow{
				{Name: "node address", Source: "2001:db8::10", Dest: "fd00::1", Port: 30029, Want: Delivered, WantEndpoints: v6Endpoints, WantMasquerade: true},
				{Name: "localhost", Source: "::1", Dest: "::1", Port: 30029, Origin: FromHost, Want: NotHandled},
			},
		},
		{
			Name:              "node port without endpoints is rejected on every local address, selected or not",
			NodeIPs:           []string{nodeIP, secondIP},
			NodePortAddresses: []string{"10.0.0.0/24"},
			Services:          []*v1.Service{Service("empty", "10.96.0.30", NodePort(30030))},
			Flows: []Flow{
				{Name: "selected address", Source: extClient, Dest: nodeIP, Port: 30030, Want: Rejected},
				{Name: "address outside nodeport-addresses", Source: extClient, Dest: secondIP, Port: 30030, Want: Rejected},
			},
		},
	}
}
