package trace

import (
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"sigs.k8s.io/knftables"

	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestNFTablesDropPolicy: in nftables mode a drop's reason names the
// traffic policy that caused it, also where every source class drops (the
// topologyKeys annotation leaves no cluster endpoint for this node, so
// there is no short circuit for pods and the node): a Service with only
// externalTrafficPolicy Local drops its external destinations for that
// policy, one with both policies Local drops its ClusterIP for
// internalTrafficPolicy and its external destinations for
// externalTrafficPolicy.
func TestNFTablesDropPolicy(t *testing.T) {
	env := pt.DefaultEnv()
	fake := knftables.NewFake(knftables.IPv4Family, nftbackend.TableName)
	local := append([]netip.Addr{}, env.NodeIPs...)
	b, err := nftbackend.New(nftbackend.Options{NFTables: fake, Family: env.Family,
		LocalAddresses: func() ([]netip.Addr, error) { return local, nil }})
	if err != nil {
		t.Fatal(err)
	}
	elsewhere := pt.EP{IP: "10.244.1.7", Node: "node-b"}
	sameHost := pt.Annotation("topologyKeys", `["kubernetes.io/hostname"]`)
	e := pt.NewEngine(t, b, pt.EngineOptions{Env: env,
		Services: []*v1.Service{
			pt.Service("ext", "10.96.0.14", pt.NodePort(30082), pt.ExternalIPs("192.0.2.101"), pt.ExternalLocal(), sameHost),
			pt.Service("both", "10.96.0.13", pt.NodePort(30081), pt.ExternalIPs("192.0.2.100"), pt.ExternalLocal(), pt.InternalLocal(), sameHost),
			pt.Service("bothready", "10.96.0.15", pt.ExternalIPs("192.0.2.102"), pt.ExternalLocal(), pt.InternalLocal()),
		},
		Slices: []*discovery.EndpointSlice{pt.Slice("ext", 8080, elsewhere), pt.Slice("both", 8080, elsewhere),
			pt.Slice("bothready", 8080, pt.EP{IP: "10.244.1.8", Node: "node-b"})}})
	pt.Sync(t, e)
	src := Source{NFT: listingOf(fake, knftables.IPv4Family), LocalAddresses: func() ([]netip.Addr, error) { return local, nil }}
	for _, tc := range []struct {
		name, src, dst, from string
		port                 int
		policy               string
	}{
		{name: "externalTrafficPolicy only: external IP from outside", src: "192.0.2.10", dst: "192.0.2.101", from: FromExternal, port: 80,
			policy: "externalTrafficPolicy"},
		{name: "externalTrafficPolicy only: external IP from a pod", src: "10.244.0.5", dst: "192.0.2.101", from: FromPod, port: 80,
			policy: "externalTrafficPolicy"},
		{name: "externalTrafficPolicy only: node port", src: "192.0.2.10", dst: "10.0.0.1", from: FromExternal, port: 30082,
			policy: "externalTrafficPolicy"},
		{name: "both: external IP from outside", src: "192.0.2.10", dst: "192.0.2.100", from: FromExternal, port: 80,
			policy: "externalTrafficPolicy"},
		{name: "both: ClusterIP", src: "10.244.0.5", dst: "10.96.0.13", from: FromPod, port: 80, policy: "internalTrafficPolicy"},
		{name: "both, endpoints elsewhere: ClusterIP", src: "10.244.0.5", dst: "10.96.0.15", from: FromPod, port: 80,
			policy: "internalTrafficPolicy"},
		{name: "both, endpoints elsewhere: external IP from outside", src: "192.0.2.10", dst: "192.0.2.102", from: FromExternal, port: 80,
			policy: "externalTrafficPolicy"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(t.Context(), Request{Source: netip.MustParseAddr(tc.src), Destination: netip.MustParseAddr(tc.dst),
				DestinationPort: tc.port, From: tc.from}, src)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Verdict != Dropped || !strings.Contains(rep.Reason, tc.policy+" is Local") {
				t.Errorf("%s: %s, want a drop for %s", rep.Verdict, rep.Reason, tc.policy)
			}
		})
	}
}
