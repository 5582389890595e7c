package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// harness drives a real engine over a backend on the fake iptables.
type harness struct {
	t       *testing.T
	fake    *iptablestest.Fake
	iface   *flakyIPTables
	backend *Backend
	engine  *proxier.Engine
	clock   *testingclock.FakeClock
	local   []netip.Addr
	// last is the result of the last sync the engine reported.
	last proxier.SyncResult
}

// flakyIPTables wraps the fake and fails the next failRestores restores,
// as a kernel that refuses a batch would.
type flakyIPTables struct {
	*iptablestest.Fake
	failRestores int
}

func (f *flakyIPTables) Restore(ctx context.Context, data []byte) error {
	if f.failRestores > 0 {
		f.failRestores--
		return errors.New("injected restore failure")
	}
	return f.Fake.Restore(ctx, data)
}

func newHarness(t *testing.T, fake *iptablestest.Fake, opts Options) *harness {
	t.Helper()
	if fake == nil {
		fake = iptablestest.NewFake(ipt.ProtocolIPv4)
		fake.RandomFully = true
	}
	h := &harness{t: t, fake: fake, iface: &flakyIPTables{Fake: fake},
		clock: pt.NewClock(), local: []netip.Addr{netip.MustParseAddr("10.0.0.1")}}
	if opts.IPTables == nil {
		opts.IPTables = h.iface
	}
	opts.LocalAddresses = func() ([]netip.Addr, error) { return h.local, nil }
	opts.Clock = h.clock
	b, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	h.backend = b
	env := pt.DefaultEnv()
	env.NodeIPs = nil // the engine is not told the node IP
	h.engine = pt.NewEngine(t, b, pt.EngineOptions{Env: env, Clock: h.clock, OnSync: func(r proxier.SyncResult) { h.last = r }})
	return h
}

func (h *harness) sync() SyncStats {
	h.t.Helper()
	pt.Sync(h.t, h.engine)
	return h.backend.LastSync()
}

func (h *harness) flows(flows ...pt.Flow) {
	h.t.Helper()
	pt.CheckFlows(h.t, &fakeTracer{fake: h.fake, local: h.local}, flows)
}

func (h *harness) chains(table ipt.Table) []string { return h.fake.Chains(table) }

func TestPartialSyncs(t *testing.T) {
	for _, tc := range []struct {
		name     string
		services int
		change   func(h *harness)
		// wantChains: chains written by the partial sync.
		wantChains int
		wantRules  func(s SyncStats) bool
		flows      []pt.Flow
	}{
		{
			name: "endpoint added rewrites only the service chain (flat dispatch)", services: 10,
			change: func(h *harness) {
				_, sl := pt.NumberedService(3)
				sl.Endpoints = append(sl.Endpoints, pt.Slice("x", 8080, pt.EP{IP: "10.244.9.9", Node: "node-c"}).Endpoints...)
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			wantChains: 1,
			flows: []pt.Flow{{Name: "both", Source: "10.244.1.9", Dest: "10.96.0.4", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.2.4:8080", "10.244.9.9:8080"}}},
		},
		{
			name: "endpoint added rewrites only the service chain (tree dispatch)", services: 500,
			change: func(h *harness) {
				_, sl := pt.NumberedService(499)
				sl.Endpoints = append(sl.Endpoints, pt.Slice("x", 8080, pt.EP{IP: "10.244.9.9", Node: "node-c"}).Endpoints...)
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			wantChains: 1,
			flows: []pt.Flow{{Name: "both", Source: "10.244.1.9", Dest: "10.96.1.250", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.3.250:8080", "10.244.9.9:8080"}}},
		},
		{
			name: "new service in tree mode writes its chain and two dispatch leaves", services: 500,
			change: func(h *harness) {
				s, sl := pt.NumberedService(600)
				h.engine.OnServiceAdd(s)
				h.engine.OnEndpointSliceAdd(sl)
			},
			// SVC + EXT chains, the nat services leaf, and a new node-port
			// leaf with its level-1 parent.
			wantChains: 5,
			flows: []pt.Flow{{Name: "new", Source: "10.244.1.9", Dest: "10.96.2.101", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.4.101:8080"}}},
		},
		{
			name: "last endpoint removed: service chain deleted, reject appears", services: 10,
			change: func(h *harness) {
				_, sl := pt.NumberedService(5)
				h.engine.OnEndpointSliceDelete(sl)
			},
			// nat dispatch root and node-port root, filter services and ext-nodeports.
			wantChains: 4,
			flows:      []pt.Flow{{Name: "reject", Source: "10.244.1.9", Dest: "10.96.0.6", Port: 80, Want: pt.Rejected}},
		},
		{
			name: "no change writes nothing", services: 10,
			change:     func(h *harness) {},
			wantChains: 0,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			pt.AddNumberedServices(h.engine, tc.services)
			if st := h.sync(); !st.Full {
				t.Fatalf("first sync was not full: %+v", st)
			}
			tc.change(h)
			st := h.sync()
			if st.Full {
				t.Fatalf("second sync was full")
			}
			if st.ChainsWritten != tc.wantChains {
				t.Errorf("partial sync wrote %d chains, want %d (restore:\n%s)", st.ChainsWritten, tc.wantChains, h.fake.LastRestore())
			}
			h.flows(tc.flows...)
		})
	}
}

func TestServiceDeletionRemovesChains(t *testing.T) {
	h := newHarness(t, nil, Options{})
	pt.AddNumberedServices(h.engine, 3)
	h.sync()
	s, sl := pt.NumberedService(1)
	svcChain := servicePortChain(kindCluster, pt.ServicePortNameOf(s, "p"))
	if !slices.Contains(h.chains(ipt.TableNAT), svcChain) {
		t.Fatalf("chain %s missing after first sync", svcChain)
	}
	h.engine.OnServiceDelete(s)
	h.engine.OnEndpointSliceDelete(sl)
	h.sync()
	if slices.Contains(h.chains(ipt.TableNAT), svcChain) {
		t.Errorf("chain %s still present after the service was deleted", svcChain)
	}
	h.flows(pt.Flow{Name: "gone", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.NotHandled},
		pt.Flow{Name: "others stay", Source: "10.244.1.9", Dest: "10.96.0.3", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.3:8080"}})
}

func TestRestartOverExistingRules(t *testing.T) {
	fake := iptablestest.NewFake(ipt.ProtocolIPv4)
	// Someone else's rules, which must survive.
	if err := fake.Restore(context.Background(), []byte("*nat\n:KUBE-SERVICES - [0:0]\n:MY-CHAIN - [0:0]\n-A MY-CHAIN -j RETURN\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n")); err != nil {
		t.Fatal(err)
	}
	first := newHarness(t, fake, Options{})
	pt.AddNumberedServices(first.engine, 5)
	first.sync()
	gone, _ := pt.NumberedService(4)
	goneChain := servicePortChain(kindCluster, pt.ServicePortNameOf(gone, "p"))

	// kproxy restarts while service 4 is deleted.
	second := newHarness(t, fake, Options{})
	for i := 0; i < 4; i++ {
		s, sl := pt.NumberedService(i)
		second.engine.OnServiceAdd(s)
		second.engine.OnEndpointSliceAdd(sl)
	}
	if st := second.sync(); !st.Full {
		t.Fatal("first sync after a restart must be full")
	}
	nat := second.chains(ipt.TableNAT)
	if slices.Contains(nat, goneChain) {
		t.Errorf("stale chain %s survived the restart sync", goneChain)
	}
	for _, c := range []string{"KUBE-SERVICES", "MY-CHAIN"} {
		if !slices.Contains(nat, c) {
			t.Errorf("foreign chain %s was removed", c)
		}
	}
	if got := fake.Rules(ipt.TableNAT, "MY-CHAIN"); len(got) != 1 {
		t.Errorf("foreign chain rules changed: %v", got)
	}
	second.flows(pt.Flow{Name: "kept", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.1:8080"}},
		pt.Flow{Name: "deleted", Source: "10.244.1.9", Dest: "10.96.0.5", Port: 80, Want: pt.NotHandled})
	// Jump rules are not duplicated.
	jumps := 0
	for _, r := range fake.Rules(ipt.TableNAT, ipt.ChainPrerouting) {
		if strings.Contains(r, chainServices) {
			jumps++
		}
	}
	if jumps != 1 {
		t.Errorf("PREROUTING has %d jumps to %s, want 1", jumps, chainServices)
	}
}

func TestCanaryRepairsExternalFlush(t *testing.T) {
	h := newHarness(t, nil, Options{CanaryInterval: 10 * time.Second})
	pt.AddNumberedServices(h.engine, 3)
	h.sync()
	// Someone flushes the nat table and deletes every chain.
	var b strings.Builder
	b.WriteString("*nat\n")
	for _, c := range h.chains(ipt.TableNAT) {
		if isOwnedChain(c) {
			fmt.Fprintf(&b, ":%s - [0:0]\n", c)
		}
	}
	b.WriteString("-F PREROUTING\n-F OUTPUT\n-F POSTROUTING\n")
	for _, c := range h.chains(ipt.TableNAT) {
		if isOwnedChain(c) {
			fmt.Fprintf(&b, "-X %s\n", c)
		}
	}
	b.WriteString("COMMIT\n")
	if err := h.fake.Restore(context.Background(), []byte(b.String())); err != nil {
		t.Fatal(err)
	}
	h.flows(pt.Flow{Name: "broken", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.NotHandled})
	h.clock.Step(11 * time.Second)
	if st := h.sync(); !st.Full {
		t.Fatal("a flushed canary must force a full sync")
	}
	h.flows(pt.Flow{Name: "repaired", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.1:8080"}})
}

func TestFailedRestoreForcesFullSync(t *testing.T) {
	h := newHarness(t, nil, Options{})
	pt.AddNumberedServices(h.engine, 3)
	h.sync()
	s, sl := pt.NumberedService(1)
	sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
	h.engine.OnEndpointSliceUpdate(nil, sl)
	h.iface.failRestores = 1
	if err := h.engine.SyncRules(context.Background()); err == nil {
		t.Fatal("sync succeeded despite a failing restore")
	}
	if st := h.sync(); !st.Full {
		t.Fatal("the sync after a failure must be full")
	}
	_ = s
	h.flows(pt.Flow{Name: "new endpoint", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.7.7:8080"}})
}

func TestBatchedFullSync(t *testing.T) {
	h := newHarness(t, nil, Options{BatchChains: 7})
	pt.AddNumberedServices(h.engine, 40)
	st := h.sync()
	// The filter table first, then 40 services x (SVC + EXT) = 80 service
	// chains, never split across restores: batches of 8 chains (4
	// services) while more than 7 chains remain, then a last restore with
	// the rest and the shared chains.
	if st.Restores != 11 {
		t.Errorf("restores = %d, want 11", st.Restores)
	}
	var flows []pt.Flow
	for i := 0; i < 40; i += 13 {
		flows = append(flows, pt.Flow{Name: fmt.Sprint(i), Source: "10.244.1.9", Dest: fmt.Sprintf("10.96.0.%d", i+1), Port: 80,
			Want: pt.Delivered, WantEndpoints: []string{fmt.Sprintf("10.244.2.%d:8080", i+1)}})
	}
	h.flows(flows...)
	// The dispatch chain is written only by the last restore.
	if !strings.Contains(string(h.fake.LastRestore()), ":"+chainServices+" ") {
		t.Error("the last restore does not write the dispatch chain")
	}
}

func TestSessionAffinitySticks(t *testing.T) {
	h := newHarness(t, nil, Options{})
	h.engine.OnServiceAdd(pt.Service("aff", "10.96.0.70", pt.Affinity(600)))
	h.engine.OnEndpointSliceAdd(pt.Slice("aff", 8080, pt.EP{IP: "10.244.2.1", Node: "node-b"}, pt.EP{IP: "10.244.2.2", Node: "node-b"}, pt.EP{IP: "10.244.2.3", Node: "node-b"}))
	h.sync()
	client := netip.MustParseAddr("10.244.1.9")
	outs, err := h.fake.Trace(iptablestest.Packet{Source: client, Destination: netip.MustParseAddr("10.96.0.70"), Protocol: "tcp", SourcePort: 1, DestinationPort: 80}, iptablestest.TraceOptions{LocalAddrs: h.local})
	if err != nil {
		t.Fatal(err)
	}
	if len(iptablestest.Endpoints(outs)) != 3 {
		t.Fatalf("first packet reaches %v, want all 3 endpoints", iptablestest.Endpoints(outs))
	}
	for _, o := range outs {
		if len(o.RecentSet) != 1 {
			t.Fatalf("outcome %s records %v recent lists, want 1", o.DNAT, o.RecentSet)
		}
		later, err := traceFlow(h.fake, h.local, pt.Flow{Source: client.String(), Dest: "10.96.0.70", Port: 80},
			map[string][]netip.Addr{o.RecentSet[0]: {client}})
		if err != nil {
			t.Fatal(err)
		}
		if len(later.Endpoints) != 1 || !later.Endpoints[o.DNAT] && later.Endpoints[o.DNAT] {
			t.Errorf("after reaching %s, the client reaches %v", o.DNAT, later.Endpoints)
		}
		if _, ok := later.Endpoints[o.DNAT]; !ok {
			t.Errorf("after reaching %s, the client reaches %v", o.DNAT, later.Endpoints)
		}
	}
	if !strings.Contains(strings.Join(h.fake.Rules(ipt.TableNAT, ipt.Chain(servicePortChain(kindCluster, pt.ServicePortNameOf(pt.Service("aff", ""), "p")))), "\n"), "--seconds 600") {
		t.Error("affinity timeout 600 not rendered")
	}
}

func TestCleanup(t *testing.T) {
	fake := iptablestest.NewFake(ipt.ProtocolIPv4)
	if err := fake.Restore(context.Background(), []byte("*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n*filter\n:DOCKER - [0:0]\n-A FORWARD -j DOCKER\nCOMMIT\n")); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, fake, Options{})
	pt.AddNumberedServices(h.engine, 80)
	h.sync()
	for i := 0; i < 2; i++ {
		if err := h.backend.Cleanup(context.Background()); err != nil {
			t.Fatalf("cleanup %d: %v", i+1, err)
		}
		for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
			for _, c := range fake.Chains(table) {
				if isOwnedChain(c) {
					t.Errorf("cleanup %d left %s/%s", i+1, table, c)
				}
				for _, r := range fake.Rules(table, ipt.Chain(c)) {
					if strings.Contains(r, chainPrefix) {
						t.Errorf("cleanup %d left rule %s/%s %s", i+1, table, c, r)
					}
				}
			}
		}
	}
	if !slices.Contains(fake.Chains(ipt.TableNAT), "KUBE-SERVICES") || !slices.Contains(fake.Chains(ipt.TableFilter), "DOCKER") {
		t.Error("cleanup removed foreign chains")
	}
	if len(fake.Rules(ipt.TableNAT, ipt.ChainPrerouting)) != 1 || len(fake.Rules(ipt.TableFilter, ipt.ChainForward)) != 1 {
		t.Error("cleanup removed foreign jump rules")
	}
}

func TestTopologyLabelChangeRefilters(t *testing.T) {
	h := newHarness(t, nil, Options{})
	h.engine.OnNodeAdd(pt.Node("node-a", map[string]string{"zone1": "g1"}))
	h.engine.OnNodeAdd(pt.Node("node-b", map[string]string{"zone1": "g1"}))
	h.engine.OnNodeAdd(pt.Node("node-c", map[string]string{"zone1": "g2"}))
	h.engine.OnServiceAdd(pt.Service("tk", "10.96.0.90", pt.Annotation("topologyKeys", `["zone1"]`)))
	h.engine.OnEndpointSliceAdd(pt.Slice("tk", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"}, pt.EP{IP: "10.244.3.5", Node: "node-c"}))
	h.sync()
	flow := pt.Flow{Name: "group", Source: "10.244.1.9", Dest: "10.96.0.90", Port: 80, Want: pt.Delivered}
	flow.WantEndpoints = []string{"10.244.2.5:8080"}
	h.flows(flow)
	// Move this node to the other group: traffic follows within one sync.
	h.engine.OnNodeUpdate(nil, pt.Node("node-a", map[string]string{"zone1": "g2"}))
	if st := h.sync(); st.Full {
		t.Error("a label change should not need a full sync")
	}
	flow.WantEndpoints = []string{"10.244.3.5:8080"}
	h.flows(flow)
}

func TestRulesWrittenByTable(t *testing.T) {
	h := newHarness(t, nil, Options{})
	pt.AddNumberedServices(h.engine, 10)
	h.sync()
	byTable := func() map[string]int {
		st := h.backend.LastSync()
		return map[string]int{"nat": st.RulesWrittenByTable[ipt.TableNAT], "filter": st.RulesWrittenByTable[ipt.TableFilter]}
	}
	full := byTable()
	if full["nat"] == 0 || full["filter"] == 0 {
		t.Fatalf("full sync wrote %v rules, want some in nat and filter", full)
	}
	_, sl := pt.NumberedService(3)
	sl.Endpoints = append(sl.Endpoints, pt.Slice("x", 8080, pt.EP{IP: "10.244.9.9", Node: "node-c"}).Endpoints...)
	h.engine.OnEndpointSliceUpdate(nil, sl)
	h.sync()
	// One service chain with its masquerade rule and two DNAT rules.
	if got := byTable(); got["nat"] != 3 || got["filter"] != 0 {
		t.Errorf("one-endpoint partial sync wrote %v rules, want nat 3, filter 0", got)
	}
}
