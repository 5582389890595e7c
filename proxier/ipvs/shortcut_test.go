package ipvs

import (
	"slices"
	"testing"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestBothPoliciesLocalShortcut checks that pods and the node reaching an
// external destination of a service port with both traffic policies Local
// use every cluster endpoint (as in iptables mode), although the ClusterIP
// virtual server has the local endpoints only; and that the port's own
// chain follows its endpoints and policies through partial syncs.
func TestBothPoliciesLocalShortcut(t *testing.T) {
	const pod, ext, local, remote = "10.244.1.9", "192.0.2.10", "10.244.1.5:8080", "10.244.2.5:8080"
	opts := []pt.SvcOpt{pt.NodePort(30040), pt.LoadBalancer("203.0.113.40"), pt.ExternalLocal()}
	both := pt.Service("both", "10.96.0.40", append(opts, pt.InternalLocal())...)
	twoEPs := pt.Slice("both", 8080, pt.EP{IP: "10.244.1.5", Node: "node-a"}, pt.EP{IP: "10.244.2.5", Node: "node-b"})
	oneEP := pt.Slice("both", 8080, pt.EP{IP: "10.244.1.5", Node: "node-a"})
	chain := clusterChain(pt.ServicePortNameOf(both, "p"))
	// chainPresent checks that the port's own chain is there, or not.
	chainPresent := func(want bool) func(t *testing.T, h *harness) {
		return func(t *testing.T, h *harness) {
			t.Helper()
			if has := slices.Contains(h.k.ipt.Chains(ipt.TableNAT), chain); has != want {
				t.Errorf("chain %s present = %v, want %v", chain, has, want)
			}
		}
	}
	steps := []syncStep{
		{
			name: "both Local, a local and a remote endpoint", full: true, check: chainPresent(true),
			flows: []pt.Flow{
				{Name: "pod to node port", Source: pod, Dest: "10.0.0.1", Port: 30040, Want: pt.Delivered, WantEndpoints: []string{local, remote}},
				{Name: "pod to load balancer IP", Source: pod, Dest: "203.0.113.40", Port: 80, Want: pt.Delivered, WantEndpoints: []string{local, remote}},
				{Name: "host to node port", Source: "10.0.0.1", Dest: "10.0.0.1", Port: 30040, Origin: pt.FromHost, Want: pt.Delivered,
					WantEndpoints: []string{local, remote}, WantMasquerade: true},
				{Name: "endpoint to its own node port", Source: "10.244.1.5", Dest: "10.0.0.1", Port: 30040, Want: pt.Delivered,
					WantEndpoints: []string{local, remote}, WantHairpin: []string{local}},
				{Name: "pod to cluster IP: local endpoints", Source: pod, Dest: "10.96.0.40", Port: 80, Want: pt.Delivered, WantEndpoints: []string{local}},
				{Name: "external to node port: local endpoints", Source: ext, Dest: "10.0.0.1", Port: 30040, Want: pt.Delivered, WantEndpoints: []string{local}},
			},
		},
		{
			name:   "remote endpoint leaves (partial sync)",
			change: func(h *harness) { h.engine.OnEndpointSliceUpdate(twoEPs, oneEP) },
			check:  chainPresent(true),
			flows: []pt.Flow{
				{Name: "pod to node port", Source: pod, Dest: "10.0.0.1", Port: 30040, Want: pt.Delivered, WantEndpoints: []string{local}},
			},
		},
		{
			name:  "remote endpoint back, internal policy Cluster (partial sync): through the cluster IP again",
			check: chainPresent(false),
			change: func(h *harness) {
				h.engine.OnEndpointSliceUpdate(oneEP, twoEPs)
				h.engine.OnServiceUpdate(both, pt.Service("both", "10.96.0.40", opts...))
			},
			flows: []pt.Flow{
				{Name: "pod to node port", Source: pod, Dest: "10.0.0.1", Port: 30040, Want: pt.Delivered, WantEndpoints: []string{local, remote}},
				{Name: "pod to cluster IP", Source: pod, Dest: "10.96.0.40", Port: 80, Want: pt.Delivered, WantEndpoints: []string{local, remote}},
			},
		},
		{
			name:   "internal policy Local again, then a forced full sync",
			change: func(h *harness) { h.engine.OnServiceUpdate(nil, both); h.backend.initialized = false },
			full:   true,
			check:  chainPresent(true),
			flows: []pt.Flow{
				{Name: "pod to node port", Source: pod, Dest: "10.0.0.1", Port: 30040, Want: pt.Delivered, WantEndpoints: []string{local, remote}},
			},
		},
	}
	h := newHarness(t, nil, Options{})
	h.engine.OnServiceAdd(both)
	h.engine.OnEndpointSliceAdd(twoEPs)
	h.runSteps(t, steps)
}
