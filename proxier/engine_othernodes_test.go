package proxier_test

import (
	"sync/atomic"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestEngineOtherNodesPending follows a Service gaining and losing the
// topologyKeys annotation as config.OtherNodesConfig reports it: no sync runs
// while the other nodes' labels are pending, and once they are delivered the
// service is programmed as it would be with every node known from the start.
func TestEngineOtherNodesPending(t *testing.T) {
	zone := v1.LabelTopologyZone
	plain := pt.Service("web", "10.96.0.10")
	topo := pt.Service("web", "10.96.0.10", pt.Annotation(proxy.AnnotationTopologyKeys, `["`+zone+`"]`))
	slice := pt.Slice("web", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"}, pt.EP{IP: "10.244.3.5", Node: "node-c"})
	both := svcState{Cluster: []string{"10.244.2.5:8080", "10.244.3.5:8080"}, HasAny: true}
	sameZone := svcState{Cluster: []string{"10.244.2.5:8080"}, HasAny: true}
	otherNodes := []*v1.Node{pt.Node("node-b", map[string]string{zone: "z1"}), pt.Node("node-c", map[string]string{zone: "z2"})}

	// step is one thing that happens; wantSync is whether a sync then
	// reaches the backend, and want what it programs for the service;
	// wantQueued is whether the step itself requests a sync.
	type step struct {
		name       string
		do         func(e *proxier.Engine)
		wantSync   bool
		wantQueued bool
		want       svcState
	}
	pending := func(p bool) func(e *proxier.Engine) { return func(e *proxier.Engine) { e.OnOtherNodesPending(p) } }
	deliver := func(e *proxier.Engine) {
		for _, n := range otherNodes {
			e.OnNodeAdd(n)
		}
	}
	forget := func(e *proxier.Engine) {
		for _, n := range otherNodes {
			e.OnNodeDelete(n)
		}
	}
	for _, tc := range []struct {
		name  string
		steps []step
		// final is the Service at the end.
		final *v1.Service
	}{
		{
			name: "service gains and loses the annotation",
			steps: []step{
				{name: "pending", do: pending(true), wantSync: false},
				{name: "annotation added", do: func(e *proxier.Engine) { e.OnServiceUpdate(plain, topo) }, wantSync: false},
				{name: "labels delivered", do: deliver, wantSync: false},
				{name: "synced", do: pending(false), wantSync: true, wantQueued: true, want: sameZone},
				{name: "annotation removed", do: func(e *proxier.Engine) { e.OnServiceUpdate(topo, plain) }, wantSync: true, want: both},
				{name: "labels forgotten", do: forget, wantSync: true, want: both},
			},
			final: plain,
		},
		{
			name: "annotation removed before the labels arrived",
			steps: []step{
				{name: "pending", do: pending(true), wantSync: false},
				{name: "annotation added", do: func(e *proxier.Engine) { e.OnServiceUpdate(plain, topo) }, wantSync: false},
				{name: "annotation removed", do: func(e *proxier.Engine) { e.OnServiceUpdate(topo, plain) }, wantSync: false},
				{name: "no longer pending", do: pending(false), wantSync: true, wantQueued: true, want: both},
			},
			final: plain,
		},
		{
			name: "annotation back while the labels are still known",
			steps: []step{
				{name: "pending", do: pending(true), wantSync: false},
				{name: "annotation added", do: func(e *proxier.Engine) { e.OnServiceUpdate(plain, topo) }, wantSync: false},
				{name: "labels delivered and synced", do: func(e *proxier.Engine) { deliver(e); e.OnOtherNodesPending(false) }, wantSync: true, want: sameZone},
				{name: "annotation removed", do: func(e *proxier.Engine) { e.OnServiceUpdate(topo, plain) }, wantSync: true, want: both},
				{name: "annotation added again", do: func(e *proxier.Engine) { e.OnServiceUpdate(plain, topo) }, wantSync: true, want: sameZone},
			},
			final: topo,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var queued atomic.Int32
			h := newSyncedHarness(t, func(o *proxier.EngineOptions) {
				o.WaitForNodes = true
				o.OnQueued = func(time.Time) { queued.Add(1) }
			})
			h.engine.OnNodeAdd(pt.Node(thisNode, map[string]string{zone: "z1"}))
			h.engine.OnNodeSynced()
			h.engine.OnServiceAdd(plain)
			h.engine.OnEndpointSliceAdd(slice)
			h.sync()
			if got := h.backend.last().Services["ns/web:p"]; !svcStateEqual(got, both) {
				t.Fatalf("before the steps: service = %v, want %v", got, both)
			}
			for _, s := range tc.steps {
				before := h.resultCount()
				queuedBefore := queued.Load()
				s.do(h.engine)
				if err := h.engine.SyncRules(h.ctx); err != nil {
					t.Fatalf("%s: sync: %v", s.name, err)
				}
				synced := h.resultCount() > before
				if synced != s.wantSync {
					t.Fatalf("%s: backend synced = %v, want %v", s.name, synced, s.wantSync)
				}
				if s.wantQueued && queued.Load() == queuedBefore {
					t.Errorf("%s: requested no sync", s.name)
				}
				if !synced {
					continue
				}
				h.checkProgrammed()
				if got := h.backend.last().Services["ns/web:p"]; !svcStateEqual(got, s.want) {
					t.Errorf("%s: service = %v, want %v", s.name, got, s.want)
				}
			}
			// Once settled, the service is programmed as by an engine that
			// knew every node from the start (topologyKeys unchanged).
			fresh := newSyncedHarness(t, nil)
			fresh.engine.OnNodeAdd(pt.Node(thisNode, map[string]string{zone: "z1"}))
			for _, n := range otherNodes {
				fresh.engine.OnNodeAdd(n)
			}
			fresh.engine.OnServiceAdd(tc.final)
			fresh.engine.OnEndpointSliceAdd(slice)
			fresh.sync()
			got, want := h.backend.last().Services["ns/web:p"], fresh.backend.last().Services["ns/web:p"]
			if !svcStateEqual(got, want) {
				t.Errorf("settled service %v, an engine that knew every node programs %v", got, want)
			}
		})
	}
}

// TestEngineOtherNodesMaxWait: when the other nodes' labels never arrive
// (a failing Node list), syncs wait OtherNodesMaxWait and then go on with
// the labels known so far, so no other service's update is held forever.
func TestEngineOtherNodesMaxWait(t *testing.T) {
	for _, tc := range []struct {
		name     string
		advance  time.Duration
		wantSync bool
	}{
		{name: "within the wait: held", advance: 9 * time.Second, wantSync: false},
		{name: "past the wait: syncs", advance: 11 * time.Second, wantSync: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, func(o *proxier.EngineOptions) {
				o.WaitForNodes = true
				o.OtherNodesMaxWait = 10 * time.Second
			})
			h.engine.OnNodeAdd(pt.Node(thisNode, nil))
			h.engine.OnNodeSynced()
			h.sync()
			h.engine.OnOtherNodesPending(true)
			h.engine.OnServiceAdd(pt.Service("web", "10.96.0.10"))
			h.engine.OnEndpointSliceAdd(pt.Slice("web", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"}))
			h.clock.Step(tc.advance)
			before := h.resultCount()
			if err := h.engine.SyncRules(h.ctx); err != nil {
				t.Fatal(err)
			}
			if synced := h.resultCount() > before; synced != tc.wantSync {
				t.Fatalf("backend synced = %v, want %v", synced, tc.wantSync)
			}
			if tc.wantSync {
				if _, ok := h.backend.last().Services["ns/web:p"]; !ok {
					t.Errorf("service not programmed after the wait")
				}
			}
		})
	}
}
