package proxy

import (
	"net/netip"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

func TestDecide(t *testing.T) {
	cidr := netip.MustParsePrefix("10.244.0.0/16")
	nodeIP := netip.MustParseAddr("10.0.0.1")
	local := &Endpoint{IP: netip.MustParseAddr("10.244.1.5"), Port: 8080, Ready: true, Serving: true, NodeName: "node-a", IsLocal: true}
	remote := &Endpoint{IP: netip.MustParseAddr("10.244.2.5"), Port: 8080, Ready: true, Serving: true, NodeName: "node-b"}
	unknownNode := &Endpoint{IP: netip.MustParseAddr("10.244.9.5"), Port: 8080, Ready: true, Serving: true}

	deliver := func(sel EndpointSelection, masq bool) Decision {
		return Decision{Verdict: VerdictDeliver, Endpoints: sel, Masquerade: masq}
	}
	short := func(masq bool) Decision {
		return Decision{Verdict: VerdictDeliver, Endpoints: SelectCluster, ShortCircuit: true, Masquerade: masq}
	}
	drop, reject := Decision{Verdict: VerdictDrop}, Decision{Verdict: VerdictReject}
	none := Decision{}
	row := func(pod, node, other Decision) [3]Decision { return [3]Decision{pod, node, other} }
	all := func(d Decision) [3]Decision { return row(d, d, d) }

	type port func(*ServicePort)
	nodePort := func(sp *ServicePort) { sp.NodePort = 30080 }
	lb := func(sp *ServicePort) { sp.LoadBalancerVIPs = []netip.Addr{netip.MustParseAddr("203.0.113.20")} }
	extIP := func(sp *ServicePort) { sp.ExternalIPs = []netip.Addr{netip.MustParseAddr("203.0.113.7")} }
	etpLocal := func(sp *ServicePort) { sp.ExternalPolicyLocal = true }
	itpLocal := func(sp *ServicePort) { sp.InternalPolicyLocal = true }
	ranges := func(r ...string) port {
		return func(sp *ServicePort) {
			for _, p := range r {
				sp.LoadBalancerSourceRanges = append(sp.LoadBalancerSourceRanges, netip.MustParsePrefix(p))
			}
		}
	}

	tests := []struct {
		name      string
		port      []port
		endpoints []*Endpoint
		opts      DecisionOptions
		want      map[DestinationKind][3]Decision
		firewall  *SourceFilter
		noLocal   [2]bool // internal, external
		hairpin   int
	}{
		{
			name: "cluster policy: pods kept, off-cluster masqueraded", endpoints: []*Endpoint{local, remote},
			opts:    DecisionOptions{ClusterCIDR: cidr},
			want:    map[DestinationKind][3]Decision{DestClusterIP: row(deliver(SelectCluster, false), deliver(SelectCluster, true), deliver(SelectCluster, true))},
			hairpin: 1,
		},
		{
			name: "no cluster CIDR: nothing masqueraded, pods are everyone else", endpoints: []*Endpoint{remote},
			want: map[DestinationKind][3]Decision{DestClusterIP: all(deliver(SelectCluster, false))},
		},
		{
			name: "masquerade-all", endpoints: []*Endpoint{remote}, opts: DecisionOptions{ClusterCIDR: cidr, MasqueradeAll: true},
			want: map[DestinationKind][3]Decision{DestClusterIP: all(deliver(SelectCluster, true))},
		},
		{
			name: "no endpoints: every destination rejects", port: []port{nodePort, lb, extIP, ranges("192.0.2.0/24")},
			opts: DecisionOptions{ClusterCIDR: cidr},
			want: map[DestinationKind][3]Decision{DestClusterIP: all(reject), DestNodePort: all(reject), DestExternalIP: all(reject), DestLoadBalancerIP: all(reject)},
		},
		{
			name: "external cluster policy: always masqueraded", port: []port{nodePort, extIP}, endpoints: []*Endpoint{remote},
			opts: DecisionOptions{ClusterCIDR: cidr},
			want: map[DestinationKind][3]Decision{
				DestNodePort: all(deliver(SelectCluster, true)), DestExternalIP: all(deliver(SelectCluster, true)), DestLoadBalancerIP: all(none),
			},
		},
		{
			name: "eTP Local: local endpoints keep the client; pods and node short-circuit", port: []port{nodePort, lb, etpLocal},
			endpoints: []*Endpoint{local, remote}, opts: DecisionOptions{ClusterCIDR: cidr},
			want: map[DestinationKind][3]Decision{
				DestClusterIP:      row(deliver(SelectCluster, false), deliver(SelectCluster, true), deliver(SelectCluster, true)),
				DestNodePort:       row(short(false), short(true), deliver(SelectLocal, false)),
				DestLoadBalancerIP: row(short(false), short(true), deliver(SelectLocal, false)),
			},
			hairpin: 1,
		},
		{
			name: "eTP Local without local endpoint: others dropped", port: []port{nodePort, etpLocal}, endpoints: []*Endpoint{remote},
			opts:    DecisionOptions{ClusterCIDR: cidr},
			want:    map[DestinationKind][3]Decision{DestNodePort: row(short(false), short(true), drop)},
			noLocal: [2]bool{false, true},
		},
		{
			name: "eTP Local without cluster CIDR: pods are not told apart", port: []port{nodePort, etpLocal}, endpoints: []*Endpoint{remote},
			want:    map[DestinationKind][3]Decision{DestNodePort: row(drop, short(true), drop)},
			noLocal: [2]bool{false, true},
		},
		{
			name: "iTP Local without local endpoint: ClusterIP dropped", port: []port{itpLocal}, endpoints: []*Endpoint{remote},
			opts:    DecisionOptions{ClusterCIDR: cidr},
			want:    map[DestinationKind][3]Decision{DestClusterIP: all(drop)},
			noLocal: [2]bool{true, false},
		},
		{
			name: "both policies Local: ClusterIP local, external short circuit over the cluster endpoints", port: []port{itpLocal, etpLocal, nodePort},
			endpoints: []*Endpoint{local, remote}, opts: DecisionOptions{ClusterCIDR: cidr},
			want: map[DestinationKind][3]Decision{
				DestClusterIP: row(deliver(SelectLocal, false), deliver(SelectLocal, true), deliver(SelectLocal, true)),
				DestNodePort:  row(short(false), short(true), deliver(SelectLocal, false)),
			},
			hairpin: 1,
		},
		{
			name: "source ranges holding the node IP admit the VIP as source", port: []port{lb, ranges("10.0.0.0/24", "192.0.2.0/24")},
			endpoints: []*Endpoint{remote}, opts: DecisionOptions{ClusterCIDR: cidr, NodeIP: nodeIP},
			want:     map[DestinationKind][3]Decision{DestLoadBalancerIP: all(deliver(SelectCluster, true))},
			firewall: &SourceFilter{Allowed: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("192.0.2.0/24")}, AllowVIPSource: true},
		},
		{
			name: "source ranges without the node IP", port: []port{lb, ranges("192.0.2.0/24")},
			endpoints: []*Endpoint{remote}, opts: DecisionOptions{ClusterCIDR: cidr, NodeIP: nodeIP},
			firewall: &SourceFilter{Allowed: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}},
		},
		{
			name: "source ranges without a LoadBalancer IP filter nothing", port: []port{nodePort, ranges("192.0.2.0/24")},
			endpoints: []*Endpoint{remote}, opts: DecisionOptions{ClusterCIDR: cidr},
		},
		{
			name: "an endpoint of unknown node may hairpin", endpoints: []*Endpoint{unknownNode, remote},
			hairpin: 1,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sp := &ServicePort{
				Name:      ServicePortName{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "svc"}, Port: "p", Protocol: v1.ProtocolTCP},
				ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 80, Protocol: v1.ProtocolTCP,
			}
			for _, f := range tc.port {
				f(sp)
			}
			st := NewServiceState(sp, tc.endpoints, TopologyInfo{NodeName: "node-a"}, tc.opts)
			d := &st.Decisions
			for kind, want := range tc.want {
				for _, c := range SourceClasses {
					if got := d.For(kind, c); got != want[c] {
						t.Errorf("%s from %s: got %+v, want %+v", kind, c, got, want[c])
					}
				}
			}
			// Every external kind the port has shares one row.
			var first *[3]Decision
			for _, k := range DestinationKinds[1:] {
				if !d.Has(k) {
					continue
				}
				r := [3]Decision{d.For(k, SourcePod), d.For(k, SourceNode), d.For(k, SourceOther)}
				if first != nil && r != *first {
					t.Errorf("%s row %+v differs from another external kind's %+v", k, r, *first)
				}
				first = &r
			}
			switch {
			case (tc.firewall == nil) != (d.Firewall == nil):
				t.Errorf("firewall %+v, want %+v", d.Firewall, tc.firewall)
			case tc.firewall != nil && (d.Firewall.AllowVIPSource != tc.firewall.AllowVIPSource || len(d.Firewall.Allowed) != len(tc.firewall.Allowed)):
				t.Errorf("firewall %+v, want %+v", d.Firewall, tc.firewall)
			}
			if got := [2]bool{d.NoLocalEndpointsInternal, d.NoLocalEndpointsExternal}; got != tc.noLocal {
				t.Errorf("no local endpoints (internal, external) = %v, want %v", got, tc.noLocal)
			}
			if len(d.Hairpin) != tc.hairpin {
				t.Errorf("hairpin endpoints %d, want %d", len(d.Hairpin), tc.hairpin)
			}
		})
	}
}

func TestSourceFilterAllows(t *testing.T) {
	vip := netip.MustParseAddr("203.0.113.20")
	f := &SourceFilter{Allowed: []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")}}
	tests := []struct {
		name   string
		filter *SourceFilter
		src    string
		want   bool
	}{
		{"no filter", nil, "198.51.100.1", true},
		{"inside a range", f, "192.0.2.9", true},
		{"outside", f, "198.51.100.1", false},
		{"the VIP itself, not admitted", f, vip.String(), false},
		{"the VIP itself, admitted", &SourceFilter{Allowed: f.Allowed, AllowVIPSource: true}, vip.String(), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.filter.Allows(netip.MustParseAddr(tc.src), vip); got != tc.want {
				t.Errorf("Allows(%s) = %v, want %v", tc.src, got, tc.want)
			}
		})
	}
}
