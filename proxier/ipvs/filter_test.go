package ipvs

import (
	"context"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestIPVSFilter checks KPROXY-IPVS-FILTER: a new connection to an address
// on the dummy device at a port (or protocol) no Service uses is rejected,
// its service ports still work, node addresses are not affected, and the
// KPROXY-IPVS-IPS set follows the bound addresses through partial and full
// syncs.
func TestIPVSFilter(t *testing.T) {
	const extClient, pod = "192.0.2.10", "10.244.1.9"
	web := pt.Service("web", "10.96.0.10", pt.NodePort(30080), pt.ExternalIPs("203.0.113.7"), pt.LoadBalancer("203.0.113.8"))
	webEPs := pt.Slice("web", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"})
	late := pt.Service("late", "10.96.0.20")
	lateEPs := pt.Slice("late", 8080, pt.EP{IP: "10.244.2.6", Node: "node-b"})
	webFlows := []pt.Flow{
		{Name: "service port", Source: pod, Dest: "10.96.0.10", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.5:8080"}},
		{Name: "cluster IP, other port, from a pod", Source: pod, Dest: "10.96.0.10", Port: 81, Want: pt.Rejected},
		{Name: "cluster IP, other port, from the host", Source: "10.0.0.1", Dest: "10.96.0.10", Port: 22, Origin: pt.FromHost, Want: pt.Rejected},
		{Name: "cluster IP, other protocol", Protocol: v1.ProtocolUDP, Source: pod, Dest: "10.96.0.10", Port: 80, Want: pt.Rejected},
		{Name: "external IP, other port", Source: extClient, Dest: "203.0.113.7", Port: 81, Want: pt.Rejected},
		{Name: "load balancer IP, other port", Source: extClient, Dest: "203.0.113.8", Port: 81, Want: pt.Rejected},
		{Name: "external IP, service port", Source: extClient, Dest: "203.0.113.7", Port: 80, Want: pt.Delivered,
			WantEndpoints: []string{"10.244.2.5:8080"}, WantMasquerade: true},
		{Name: "node address, other port: not kproxy's", Source: extClient, Dest: "10.0.0.1", Port: 22, Want: pt.NotHandled},
	}
	// The steps run in order on one node.
	steps := []syncStep{
		{
			name:  "full sync",
			check: addressSetMatches,
			full:  true,
			flows: webFlows,
		},
		{
			name:  "partial sync adds a service",
			check: addressSetMatches,
			change: func(h *harness) {
				h.engine.OnServiceAdd(late)
				h.engine.OnEndpointSliceAdd(lateEPs)
			},
			flows: append([]pt.Flow{
				{Name: "new cluster IP, service port", Source: pod, Dest: "10.96.0.20", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.6:8080"}},
				{Name: "new cluster IP, other port", Source: pod, Dest: "10.96.0.20", Port: 81, Want: pt.Rejected},
			}, webFlows...),
		},
		{
			name:   "partial sync deletes it: its address is no longer filtered",
			check:  addressSetMatches,
			change: func(h *harness) { h.engine.OnServiceDelete(late) },
			flows: append([]pt.Flow{
				{Name: "old cluster IP, other port", Source: pod, Dest: "10.96.0.20", Port: 81, Want: pt.NotHandled},
			}, webFlows...),
		},
		{
			name:  "external IP removed by a partial sync",
			check: addressSetMatches,
			change: func(h *harness) {
				h.engine.OnServiceUpdate(web, pt.Service("web", "10.96.0.10", pt.NodePort(30080), pt.LoadBalancer("203.0.113.8")))
			},
			flows: []pt.Flow{
				{Name: "old external IP, other port", Source: extClient, Dest: "203.0.113.7", Port: 81, Want: pt.NotHandled},
				{Name: "cluster IP, other port", Source: pod, Dest: "10.96.0.10", Port: 81, Want: pt.Rejected},
				{Name: "load balancer IP, other port", Source: extClient, Dest: "203.0.113.8", Port: 81, Want: pt.Rejected},
			},
		},
		{
			name:  "forced full sync removes a stale entry and keeps the rest",
			check: addressSetMatches,
			change: func(h *harness) {
				if err := h.k.sets.AddEntry(context.Background(), setIPVSAddresses, ipset.Entry{IP: netip.MustParseAddr("10.96.9.9")}); err != nil {
					h.t.Fatal(err)
				}
				h.backend.initialized = false
			},
			full: true,
			flows: []pt.Flow{
				{Name: "cluster IP, other port", Source: pod, Dest: "10.96.0.10", Port: 81, Want: pt.Rejected},
				{Name: "old external IP, other port", Source: extClient, Dest: "203.0.113.7", Port: 81, Want: pt.NotHandled},
				{Name: "stale entry", Source: pod, Dest: "10.96.9.9", Port: 81, Want: pt.NotHandled},
			},
		},
	}
	h := newHarness(t, nil, Options{})
	h.engine.OnServiceAdd(web)
	h.engine.OnEndpointSliceAdd(webEPs)
	h.runSteps(t, steps)
}

// addressSetMatches is checkIPVSAddressSet as a syncStep check.
func addressSetMatches(t *testing.T, h *harness) { checkIPVSAddressSet(t, h.k) }

// checkIPVSAddressSet fails unless KPROXY-IPVS-IPS holds exactly the
// addresses bound to the dummy device.
func checkIPVSAddressSet(t *testing.T, k *fakeKernel) {
	t.Helper()
	ctx := context.Background()
	bound, err := k.nl.ListBoundAddresses(ctx, DefaultDummyDevice)
	if err != nil {
		t.Fatal(err)
	}
	entries, err := k.sets.Entries(ctx, setIPVSAddresses)
	if err != nil {
		t.Fatal(err)
	}
	var inSet []netip.Addr
	for _, e := range entries {
		inSet = append(inSet, e.IP)
	}
	slices.SortFunc(bound, netip.Addr.Compare)
	slices.SortFunc(inSet, netip.Addr.Compare)
	if !slices.Equal(bound, inSet) {
		t.Errorf("%s holds %v, the dummy device %v", setIPVSAddresses, inSet, bound)
	}
}
