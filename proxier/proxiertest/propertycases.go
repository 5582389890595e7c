package proxiertest

import (
	"net/netip"

	v1 "k8s.io/api/core/v1"
)

// PropertyRegressions are scenarios, each minimised from a failure of the
// property test, that every backend runs with RunScenario.
func PropertyRegressions() []Scenario {
	env := Env{NodeName: "node-a", NodeIPs: []netip.Addr{netip.MustParseAddr(nodeIP)},
		ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), Family: v1.IPv4Protocol}
	tcp := func(name string, port, nodePort int32) v1.ServicePort {
		return v1.ServicePort{Name: name, Port: port, NodePort: nodePort, Protocol: v1.ProtocolTCP}
	}
	return []Scenario{
		{
			// IPVS mode (seed 12, step 18): the partial sync added the new
			// owner before removing the old one, took the virtual server
			// for contested and deleted it.
			Name: "a node port moves to another port of its service",
			Env:  env,
			Batches: [][]Change{
				{{Service: Service("np", "10.96.6.2", Ports(tcp("q", 6004, 30504)), NodePort(30504))}},
				{{Service: Service("np", "10.96.6.2", Ports(tcp("p", 6003, 30504)), NodePort(30504))}},
			},
		},
		{
			Name: "a port is renamed",
			Env:  env,
			Batches: [][]Change{
				{{Service: Service("web", "10.96.0.10", Ports(tcp("q", 80, 0)))}, {Slice: twoEndpoints("web")}},
				{{Service: Service("web", "10.96.0.10", Ports(tcp("p", 80, 0)))}},
			},
		},
		{
			Name: "an external IP moves to another service",
			Env:  env,
			Batches: [][]Change{
				{
					{Service: Service("b", "10.96.0.11", ExternalIPs("203.0.113.7"))},
					{Service: Service("a", "10.96.0.12")},
					{Slice: twoEndpoints("a")}, {Slice: twoEndpoints("b")},
				},
				{
					{Service: Service("b", "10.96.0.11")},
					{Service: Service("a", "10.96.0.12", ExternalIPs("203.0.113.7"))},
				},
			},
		},
		{
			// Two services claim one ExternalIP and port (the API server
			// allows it): the first by name gets it, whatever the order
			// they came in, and the other gets it when the first lets go.
			Name: "two services claim one external IP and port",
			Env:  env,
			Batches: [][]Change{
				{
					{Service: Service("b", "10.96.0.11", ExternalIPs("203.0.113.7"))},
					{Slice: Slice("b", 8080, EP{IP: remoteEP, Node: "node-b"})},
					{Slice: Slice("a", 8080, EP{IP: otherEP, Node: "node-c"})},
					{Slice: Slice("c", 8080, EP{IP: localEP, Node: "node-a"})},
				},
				{{Service: Service("c", "10.96.0.13", ExternalIPs("203.0.113.7"))}},
				{{Service: Service("a", "10.96.0.12", ExternalIPs("203.0.113.7"))}},
				{{Slice: Slice("a", 8080, EP{IP: otherEP, Node: "node-c"}, EP{IP: "10.244.3.6", Node: "node-c"})}},
				{{Service: Service("a", "10.96.0.12")}},
				{{Service: Service("b", "10.96.0.11", ExternalIPs("203.0.113.7"), Ports(tcp("p", 81, 0)))}},
				{{Service: Service("a", "10.96.0.12", ExternalIPs("203.0.113.7"))}, {Service: Service("b", "10.96.0.11", ExternalIPs("203.0.113.7"))}},
				{{Service: Service("a", "10.96.0.12"), Delete: true}, {Service: Service("c", "10.96.0.13"), Delete: true}},
			},
		},
	}
}
