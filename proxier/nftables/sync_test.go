package nftables

import (
	"context"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/nftables/nftablestest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// harness drives a real engine over a backend on a strict fake.
type harness struct {
	t       *testing.T
	fake    *knftables.Fake
	nft     *strictNFT
	backend *Backend
	engine  *proxier.Engine
	clock   *testingclock.FakeClock
	local   []netip.Addr
	last    proxier.SyncResult
}

func newHarness(t *testing.T, fake *knftables.Fake, opts Options) *harness {
	t.Helper()
	if fake == nil {
		fake = knftables.NewFake(knftables.IPv4Family, TableName)
	}
	h := &harness{t: t, fake: fake, nft: &strictNFT{Fake: fake},
		clock: testingclock.NewFakeClock(time.Unix(1_700_000_000, 0)),
		local: []netip.Addr{netip.MustParseAddr("10.0.0.1")}}
	opts.NFTables = h.nft
	opts.Family = v1.IPv4Protocol
	opts.LocalAddresses = func() ([]netip.Addr, error) { return h.local, nil }
	opts.Clock = h.clock
	b, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	h.backend = b
	e, err := proxier.NewEngine(proxier.EngineOptions{
		Family: v1.IPv4Protocol, NodeName: "node-a", Backend: b, ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"),
		NodeIP: h.local[0], MinSyncPeriod: time.Second, SyncPeriod: 30 * time.Second, Clock: h.clock,
		OnSync: func(r proxier.SyncResult) { h.last = r },
	})
	if err != nil {
		t.Fatal(err)
	}
	h.engine = e
	e.OnServiceSynced()
	e.OnEndpointSlicesSynced()
	return h
}

func (h *harness) sync() SyncStats {
	h.t.Helper()
	if err := h.engine.SyncRules(context.Background()); err != nil {
		h.t.Fatalf("sync: %v", err)
	}
	return h.backend.LastSync()
}

func (h *harness) tracer() *fakeTracer { return &fakeTracer{fake: h.fake, local: h.local} }

func (h *harness) flows(flows ...pt.Flow) {
	h.t.Helper()
	pt.CheckFlows(h.t, h.tracer(), flows)
}

// lastTx is the text of the last transaction the fake ran.
func (h *harness) lastTx() string {
	h.fake.RLock()
	defer h.fake.RUnlock()
	if h.fake.LastTransaction == nil {
		return ""
	}
	return h.fake.LastTransaction.String()
}

func svcN(i int) (*v1.Service, *discovery.EndpointSlice) {
	name := fmt.Sprintf("s%04d", i)
	return pt.Service(name, fmt.Sprintf("10.96.%d.%d", i/250, i%250+1), pt.NodePort(int32(30000+i))),
		pt.Slice(name, 8080, pt.EP{IP: fmt.Sprintf("10.244.%d.%d", 2+i/250, i%250+1), Node: "node-b"})
}

func addServices(h *harness, n int) {
	for i := 0; i < n; i++ {
		s, sl := svcN(i)
		h.engine.OnServiceAdd(s)
		h.engine.OnEndpointSliceAdd(sl)
	}
}

// txLines are the operation lines of a transaction.
func txLines(tx string) []string {
	var out []string
	for _, l := range strings.Split(tx, "\n") {
		if l != "" {
			out = append(out, l)
		}
	}
	return out
}

// stateOps are the operations that replace the sync-state canary, whose
// comment records the digest of the table, in every transaction that
// changes elements.
const stateOps = 2

func TestPartialSyncs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(h *harness)
		// wantOps is the exact number of operations of the partial sync;
		// every element operation must name one of mentions.
		wantOps  int
		mentions []string
		// noVerdict: the sync must not touch a verdict map (an added jump
		// or goto makes the kernel validate the whole table).
		noVerdict bool
		flows     []pt.Flow
	}{
		{
			name: "endpoint added: the dispatch and endpoint-slots elements and one slot per key kind",
			change: func(h *harness) {
				_, sl := svcN(3)
				sl.Endpoints = append(sl.Endpoints, pt.Slice("x", 8080, pt.EP{IP: "10.244.9.9", Node: "node-c"}).Endpoints...)
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			// New shape and pick chains for two endpoints (ClusterIP and
			// node port: 4 chains, each added and flushed, 5 rules), the
			// dispatch elements replaced for the new shape (2 x
			// delete+add), the endpoint-slots elements too (2 x
			// delete+add), a new slot each (2). The one-endpoint chains
			// stay: other services use them.
			wantOps:  4*2 + 5 + 2*2 + 2*2 + 2 + stateOps,
			mentions: []string{"10.96.0.4", "30003"},
			flows: []pt.Flow{{Name: "both", Source: "10.244.1.9", Dest: "10.96.0.4", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.2.4:8080", "10.244.9.9:8080"}}},
		},
		{
			name: "endpoint replaced: one slot and the endpoint-slots element per key kind, no verdict element",
			change: func(h *harness) {
				_, sl := svcN(5)
				sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			wantOps:   2*2 + 2*2 + stateOps,
			mentions:  []string{"10.96.0.6", "30005"},
			noVerdict: true,
			flows: []pt.Flow{{Name: "new endpoint", Source: "10.244.1.9", Dest: "10.96.0.6", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.7.7:8080"}}},
		},
		{
			name: "last endpoint removed: slots and dispatch go, rejects appear",
			change: func(h *harness) {
				_, sl := svcN(5)
				h.engine.OnEndpointSliceDelete(sl)
			},
			// Per key kind: the dispatch, endpoint-slots and slot elements
			// deleted, the no-endpoint element added.
			wantOps:  2*(1+1+1+1) + stateOps,
			mentions: []string{"10.96.0.6", "30005"},
			flows:    []pt.Flow{{Name: "reject", Source: "10.244.1.9", Dest: "10.96.0.6", Port: 80, Want: pt.Rejected}},
		},
		{
			name: "new service",
			change: func(h *harness) {
				s, sl := svcN(600)
				h.engine.OnServiceAdd(s)
				h.engine.OnEndpointSliceAdd(sl)
			},
			// Per key kind: the dispatch, endpoint-slots and slot
			// elements.
			wantOps:  2*3 + stateOps,
			mentions: []string{"10.96.2.101", "30600"},
			flows: []pt.Flow{{Name: "new", Source: "10.244.1.9", Dest: "10.96.2.101", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.4.101:8080"}}},
		},
		{
			name:   "no change writes nothing",
			change: func(h *harness) {},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			addServices(h, 50)
			if st := h.sync(); !st.Full {
				t.Fatalf("first sync was not full: %+v", st)
			}
			before := h.nft.runs
			tc.change(h)
			st := h.sync()
			if st.Mode != modePartial {
				t.Fatalf("second sync was %s", st.Mode)
			}
			if st.Operations != tc.wantOps {
				t.Errorf("partial sync ran %d operations, want %d:\n%s", st.Operations, tc.wantOps, h.lastTx())
			}
			if tc.wantOps == 0 {
				if h.nft.runs != before {
					t.Errorf("a sync without changes ran a transaction")
				}
				return
			}
			for _, l := range txLines(h.lastTx()) {
				if !strings.Contains(l, " element ") || strings.Contains(l, " "+setSyncState+" ") {
					continue
				}
				ok := false
				for _, m := range tc.mentions {
					ok = ok || strings.Contains(l, m)
				}
				if !ok {
					t.Errorf("partial sync touched another service: %s", l)
				}
				for _, m := range []string{mapServiceIPs, mapServiceNodePorts, mapNoEndpointServices, mapNoEndpointNodePorts} {
					if tc.noVerdict && strings.Contains(l, " "+m+" ") {
						t.Errorf("partial sync touched a verdict map: %s", l)
					}
				}
			}
			h.flows(tc.flows...)
		})
	}
}

func TestRestartOverExistingTable(t *testing.T) {
	for _, tc := range []struct {
		name string
		// whileDown changes the objects the second process sees.
		whileDown func(h *harness)
		wantOps   int
		// mentions: every element operation names one of them.
		mentions []string
		flows    []pt.Flow
	}{
		{
			name:      "nothing changed: nothing written",
			whileDown: func(h *harness) {},
			flows: []pt.Flow{{Name: "kept", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.2.1:8080"}}},
		},
		{
			name: "an endpoint changed: only its destinations",
			whileDown: func(h *harness) {
				_, sl := svcN(7)
				sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			// Per destination: the old slot deleted, the new one added,
			// the endpoint-slots element replaced.
			wantOps:  2*(2+2) + stateOps,
			mentions: []string{"10.96.0.8", "30007"},
			flows: []pt.Flow{{Name: "changed", Source: "10.244.1.9", Dest: "10.96.0.8", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.7.7:8080"}}},
		},
		{
			name: "a service deleted: its elements go",
			whileDown: func(h *harness) {
				s, sl := svcN(4)
				h.engine.OnServiceDelete(s)
				h.engine.OnEndpointSliceDelete(sl)
			},
			// Per destination: the dispatch, endpoint-slots and slot
			// elements.
			wantOps:  2*3 + stateOps,
			mentions: []string{"10.96.0.5", "30004"},
			flows:    []pt.Flow{{Name: "deleted", Source: "10.244.1.9", Dest: "10.96.0.5", Port: 80, Want: pt.NotHandled}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			first := newHarness(t, nil, Options{})
			addServices(first, 20)
			first.sync()
			dump := first.fake.Dump()

			// A new process over a table with the same content.
			fake := knftables.NewFake(knftables.IPv4Family, TableName)
			if err := fake.ParseDump(dump); err != nil {
				t.Fatal(err)
			}
			second := newHarness(t, fake, Options{})
			addServices(second, 20)
			tc.whileDown(second)
			st := second.sync()
			if st.Mode != modeReconcile {
				t.Fatalf("first sync after a restart was %s, want %s", st.Mode, modeReconcile)
			}
			if st.Operations != tc.wantOps {
				t.Errorf("restart sync ran %d operations, want %d:\n%s", st.Operations, tc.wantOps, second.lastTx())
			}
			if tc.wantOps > 0 {
				for _, l := range txLines(second.lastTx()) {
					if strings.HasPrefix(l, "flush ") {
						t.Errorf("restart sync flushed: %s", l)
					}
					ok := strings.Contains(l, " "+setSyncState+" ")
					for _, m := range tc.mentions {
						ok = ok || strings.Contains(l, m)
					}
					if !ok {
						t.Errorf("restart sync touched something else: %s", l)
					}
				}
			}
			second.flows(tc.flows...)
			// The result is the table a fresh process writes.
			fresh := newHarness(t, nil, Options{})
			addServices(fresh, 20)
			tc.whileDown(fresh)
			fresh.sync()
			if got, want := sortedDump(second.fake), sortedDump(fresh.fake); got != want {
				t.Errorf("table after restart differs from a fresh one:\n%s", diff(got, want))
			}
		})
	}
}

func diff(a, b string) string {
	in := map[string]int{}
	for _, l := range strings.Split(a, "\n") {
		in[l]++
	}
	for _, l := range strings.Split(b, "\n") {
		in[l]--
	}
	var out []string
	for l, n := range in {
		switch {
		case n > 0:
			out = append(out, "- "+l)
		case n < 0:
			out = append(out, "+ "+l)
		}
	}
	return strings.Join(out, "\n")
}

// TestRepairsTamperedTable: someone else flushes or deletes parts of the
// table; the canary check of a partial sync (or the partial transaction
// failing) makes the backend rebuild the table within one sync.
func TestRepairsTamperedTable(t *testing.T) {
	flowOK := pt.Flow{Name: "works", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.2:8080"}}
	for _, tc := range []struct {
		name string
		// tamper changes the table behind the backend's back.
		tamper func(tx *knftables.Transaction)
		// change makes the next sync carry a change.
		change bool
		// waitCanary lets the canary interval pass.
		waitCanary bool
		wantMode   string
	}{
		{name: "table deleted", tamper: func(tx *knftables.Transaction) { tx.Delete(&knftables.Table{}) }, waitCanary: true, wantMode: modeRebuild},
		{name: "dispatch chain flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Chain{Name: chainServices}) }, waitCanary: true, wantMode: modeRebuild},
		{name: "base chain flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Chain{Name: chainNATPrerouting}) }, waitCanary: true, wantMode: modeRebuild},
		{name: "endpoints map flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Map{Name: endpointsMap("tcp")}) }, waitCanary: true, wantMode: modeRebuild},
		{name: "dispatch map flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Map{Name: mapServiceIPs}) }, waitCanary: true, wantMode: modeRebuild},
		{
			name:     "endpoints map flushed, a change before the canary is due",
			tamper:   func(tx *knftables.Transaction) { tx.Flush(&knftables.Map{Name: endpointsMap("tcp")}) },
			change:   true,
			wantMode: modeRebuild,
		},
		{name: "nothing tampered", tamper: nil, waitCanary: true, wantMode: modePartial},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{CanaryInterval: 10 * time.Second})
			addServices(h, 5)
			h.sync()
			h.flows(flowOK)
			if tc.tamper != nil {
				tx := h.fake.NewTransaction()
				tc.tamper(tx)
				if err := h.fake.Run(context.Background(), tx); err != nil {
					t.Fatal(err)
				}
			}
			if tc.waitCanary {
				h.clock.Step(11 * time.Second)
			}
			if tc.change {
				_, sl := svcN(3)
				sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
				h.engine.OnEndpointSliceUpdate(nil, sl)
			}
			st := h.sync()
			if st.Mode != tc.wantMode {
				t.Errorf("sync mode %s, want %s", st.Mode, tc.wantMode)
			}
			h.flows(flowOK)
			fresh := newHarness(t, nil, Options{})
			addServices(fresh, 5)
			if tc.change {
				_, sl := svcN(3)
				sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
				fresh.engine.OnEndpointSliceUpdate(nil, sl)
			}
			fresh.sync()
			if got, want := sortedDump(h.fake), sortedDump(fresh.fake); got != want {
				t.Errorf("repaired table differs from a fresh one:\n%s", diff(got, want))
			}
		})
	}
}

func TestFailedTransactionRebuilds(t *testing.T) {
	h := newHarness(t, nil, Options{})
	addServices(h, 3)
	h.sync()
	_, sl := svcN(1)
	sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
	h.engine.OnEndpointSliceUpdate(nil, sl)
	// The partial transaction fails, and so does the rebuild right after.
	h.nft.failRuns = 2
	if err := h.engine.SyncRules(context.Background()); err == nil {
		t.Fatal("sync succeeded despite failing transactions")
	}
	if st := h.sync(); st.Mode != modeRebuild {
		t.Errorf("the sync after a failure was %s, want %s", st.Mode, modeRebuild)
	}
	h.flows(pt.Flow{Name: "new endpoint", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.7.7:8080"}})

	// A failed partial transaction alone is repaired within the same sync.
	sl.Endpoints[0].Addresses = []string{"10.244.7.8"}
	h.engine.OnEndpointSliceUpdate(nil, sl)
	h.nft.failRuns = 1
	if st := h.sync(); st.Mode != modeRebuild || st.Transactions != 2 {
		t.Errorf("sync after a failed partial transaction: mode %s with %d transactions, want %s with 2", st.Mode, st.Transactions, modeRebuild)
	}
	h.flows(pt.Flow{Name: "newer endpoint", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.7.8:8080"}})
}

func TestCleanup(t *testing.T) {
	h := newHarness(t, nil, Options{})
	addServices(h, 10)
	h.sync()
	// Other tables: someone's ip filter table and kproxy's IPv6 table.
	h.fake.Lock()
	h.fake.Tables[knftables.IPv4Family]["filter"] = &knftables.FakeTable{Table: knftables.Table{Name: "filter", Family: knftables.IPv4Family},
		Chains: map[string]*knftables.FakeChain{"input": {Chain: knftables.Chain{Name: "input"}}}, Sets: map[string]*knftables.FakeSet{},
		Maps: map[string]*knftables.FakeMap{}, Flowtables: map[string]*knftables.FakeFlowtable{}, Counters: map[string]*knftables.FakeCounter{}}
	h.fake.Tables[knftables.IPv6Family] = map[string]*knftables.FakeTable{TableName: {Table: knftables.Table{Name: TableName, Family: knftables.IPv6Family},
		Chains: map[string]*knftables.FakeChain{}, Sets: map[string]*knftables.FakeSet{},
		Maps: map[string]*knftables.FakeMap{}, Flowtables: map[string]*knftables.FakeFlowtable{}, Counters: map[string]*knftables.FakeCounter{}}}
	h.fake.Unlock()
	for i := 0; i < 2; i++ {
		if err := h.backend.Cleanup(context.Background()); err != nil {
			t.Fatalf("cleanup %d: %v", i+1, err)
		}
		h.fake.RLock()
		if h.fake.Tables[knftables.IPv4Family][TableName] != nil {
			t.Errorf("cleanup %d left the ip kproxy table", i+1)
		}
		if h.fake.Tables[knftables.IPv4Family]["filter"] == nil || h.fake.Tables[knftables.IPv6Family][TableName] == nil {
			t.Errorf("cleanup %d removed other tables", i+1)
		}
		h.fake.RUnlock()
	}
	// The next sync writes everything again.
	if st := h.sync(); !st.Full {
		t.Errorf("the sync after a cleanup was %s", st.Mode)
	}
	h.flows(pt.Flow{Name: "back", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.2:8080"}})
}

// TestSessionAffinity: a client pinned to a slot keeps its endpoint; when
// that endpoint leaves, the client is never sent to it again.
func TestSessionAffinity(t *testing.T) {
	h := newHarness(t, nil, Options{})
	h.engine.OnServiceAdd(pt.Service("aff", "10.96.0.70", pt.Affinity(600)))
	eps := []pt.EP{{IP: "10.244.2.1", Node: "node-b"}, {IP: "10.244.2.2", Node: "node-b"}, {IP: "10.244.2.3", Node: "node-b"}}
	h.engine.OnEndpointSliceAdd(pt.Slice("aff", 8080, eps...))
	h.sync()
	client := "10.244.1.9"
	trace := func(sets map[string][]string) []nftablestest.Outcome {
		t.Helper()
		outs, err := nftablestest.Trace(h.fake, nftablestest.Packet{Source: netip.MustParseAddr(client), Destination: netip.MustParseAddr("10.96.0.70"),
			Protocol: "tcp", SourcePort: 1, DestinationPort: 80}, nftablestest.Options{LocalAddrs: h.local, Sets: sets})
		if err != nil {
			t.Fatal(err)
		}
		return outs
	}
	first := trace(nil)
	if len(first) != 3 {
		t.Fatalf("a first packet has %d outcomes, want one per endpoint: %+v", len(first), first)
	}
	pins := map[string]string{}
	for _, o := range first {
		if !strings.Contains(o.Updates, "timeout") && !strings.HasPrefix(o.Updates, "affinity-tcp { "+client+" . 10.96.0.70 . 80 . ") {
			t.Fatalf("outcome to %s records %q", o.DNAT, o.Updates)
		}
		key := strings.TrimSuffix(strings.TrimPrefix(o.Updates, "affinity-tcp { "), " }")
		pins[o.DNAT] = key
		later := trace(map[string][]string{"affinity-tcp": {key}})
		if len(later) != 1 || later[0].DNAT != o.DNAT {
			t.Errorf("a client pinned by %q reaches %+v, want only %s", key, later, o.DNAT)
		}
	}
	if !strings.Contains(h.lastTx(), "timeout 600s") {
		t.Error("affinity timeout 600 not rendered")
	}

	// The pinned endpoint 10.244.2.3 goes away.
	h.engine.OnEndpointSliceUpdate(nil, pt.Slice("aff", 8080, eps[:2]...))
	h.sync()
	for _, o := range trace(map[string][]string{"affinity-tcp": {pins["10.244.2.3:8080"]}}) {
		if o.DNAT == "10.244.2.3:8080" || o.DNAT == "" {
			t.Errorf("a client pinned to a removed endpoint reaches %+v", o)
		}
	}
}

func TestSourceRangesOverlap(t *testing.T) {
	h := newHarness(t, nil, Options{})
	h.engine.OnServiceAdd(pt.Service("lb", "10.96.0.41", pt.LoadBalancer("203.0.113.22"),
		pt.SourceRanges("192.0.2.0/24", "192.0.2.128/25", "10.0.0.0/8", "10.0.0.0/24", "0.0.0.0/0")))
	h.engine.OnEndpointSliceAdd(pt.Slice("lb", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"}))
	h.sync()
	h.flows(pt.Flow{Name: "anyone", Source: "198.51.100.1", Dest: "203.0.113.22", Port: 80, Want: pt.Delivered,
		WantEndpoints: []string{"10.244.2.5:8080"}, WantMasquerade: true})
	h.engine.OnServiceUpdate(nil, pt.Service("lb", "10.96.0.41", pt.LoadBalancer("203.0.113.22"),
		pt.SourceRanges("192.0.2.0/24", "192.0.2.128/25", "10.0.0.0/8", "10.0.0.0/24")))
	h.sync()
	h.flows(
		pt.Flow{Name: "denied", Source: "198.51.100.1", Dest: "203.0.113.22", Port: 80, Want: pt.Dropped},
		pt.Flow{Name: "node primary IP in range: the VIP as source", Source: "203.0.113.22", Dest: "203.0.113.22", Port: 80, Origin: pt.FromHost,
			Want: pt.Delivered, WantEndpoints: []string{"10.244.2.5:8080"}, WantMasquerade: true},
		pt.Flow{Name: "allowed", Source: "192.0.2.200", Dest: "203.0.113.22", Port: 80, Want: pt.Delivered,
			WantEndpoints: []string{"10.244.2.5:8080"}, WantMasquerade: true})
}

func TestBackendResult(t *testing.T) {
	h := newHarness(t, nil, Options{})
	addServices(h, 200)
	h.sync()
	full := h.last.Backend
	if full.RuleCounts["nat"] == 0 || full.RuleCounts["filter"] == 0 || full.RulesWritten["nat"] == 0 || full.KernelWrites != 1 || full.ChainsWritten == 0 {
		t.Errorf("full sync result %+v", full)
	}
	// The rules do not grow with the services.
	addServices(h, 400)
	h.sync()
	if got := h.last.Backend.RuleCounts; got["nat"] != full.RuleCounts["nat"] || got["filter"] != full.RuleCounts["filter"] {
		t.Errorf("rule counts grew from %v to %v with the services", full.RuleCounts, got)
	}
	if w := h.last.Backend.RulesWritten; w["nat"] != 0 || w["filter"] != 0 {
		t.Errorf("adding services of a known shape wrote rules: %v", w)
	}
}

// nodeState builds a state of one-endpoint TCP services by name and
// ClusterIP.
func nodeState(opts proxy.DecisionOptions, changed []string, svcs map[string]string) *proxy.NodeState {
	ns := &proxy.NodeState{Family: v1.IPv4Protocol, NodeName: "node-a", Options: opts,
		Services: map[proxy.ServicePortName]*proxy.ServiceState{}, Changed: sets.New[types.NamespacedName]()}
	for _, c := range changed {
		ns.Changed.Insert(types.NamespacedName{Namespace: "ns", Name: c})
	}
	names := make([]string, 0, len(svcs))
	for name := range svcs {
		names = append(names, name)
	}
	slices.Sort(names)
	for i, name := range names {
		ip := svcs[name]
		i++
		sp := &proxy.ServicePort{Name: proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: "ns", Name: name}, Port: "p", Protocol: v1.ProtocolTCP},
			ClusterIP: netip.MustParseAddr(ip), Port: 80, Protocol: v1.ProtocolTCP}
		eps := []*proxy.Endpoint{{IP: netip.MustParseAddr(fmt.Sprintf("10.244.2.%d", i)), Port: 8080, Ready: true, Serving: true, NodeName: "node-b"}}
		ns.Services[sp.Name] = proxy.NewServiceState(sp, eps, proxy.TopologyInfo{NodeName: "node-a"}, opts)
	}
	return ns
}

func TestFullSyncTriggers(t *testing.T) {
	opts := proxy.DecisionOptions{ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), NodeIP: netip.MustParseAddr("10.0.0.1")}
	other := opts
	other.ClusterCIDR = netip.MustParsePrefix("10.200.0.0/16")
	for _, tc := range []struct {
		name     string
		next     *proxy.NodeState
		wantMode string
		flows    []pt.Flow
	}{
		{
			name:     "nothing changed",
			next:     nodeState(opts, nil, map[string]string{"a": "10.96.0.1"}),
			wantMode: modePartial,
		},
		{
			name:     "a service port that is neither known nor changed",
			next:     nodeState(opts, nil, map[string]string{"a": "10.96.0.1", "b": "10.96.0.2"}),
			wantMode: modeReconcile,
			flows:    []pt.Flow{{Name: "b", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.2:8080"}}},
		},
		{
			name:     "decision options changed",
			next:     nodeState(other, nil, map[string]string{"a": "10.96.0.1"}),
			wantMode: modeReconcile,
			flows: []pt.Flow{
				{Name: "new pod range", Source: "10.200.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.1:8080"}},
				{Name: "old pod range", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.1:8080"}, WantMasquerade: true},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			ctx := context.Background()
			if _, err := h.backend.Sync(ctx, nodeState(opts, nil, map[string]string{"a": "10.96.0.1"}), true); err != nil {
				t.Fatal(err)
			}
			if _, err := h.backend.Sync(ctx, tc.next, false); err != nil {
				t.Fatal(err)
			}
			if st := h.backend.LastSync(); st.Mode != tc.wantMode {
				t.Errorf("sync mode %s, want %s", st.Mode, tc.wantMode)
			}
			h.flows(tc.flows...)
		})
	}
}

// elemOps are the element operations of a transaction but the sync-state
// canary's, as "<op> <map> <key>", sorted.
func elemOps(tx string) []string {
	var out []string
	for _, l := range txLines(tx) {
		f := strings.Fields(l)
		if len(f) < 6 || f[1] != "element" || f[4] == setSyncState {
			continue
		}
		key := strings.TrimPrefix(l[strings.Index(l, "{")+1:], " ")
		if i := strings.IndexAny(key, ":}"); i >= 0 {
			key = key[:i]
		}
		if i := strings.Index(key, " comment "); i >= 0 {
			key = key[:i]
		}
		out = append(out, f[0]+" "+f[4]+" "+strings.TrimSpace(key))
	}
	slices.Sort(out)
	return out
}

// slotService gives the service "big" the endpoints eps (on node-b).
func slotService(h *harness, eps []string) {
	h.t.Helper()
	var list []pt.EP
	for _, ip := range eps {
		list = append(list, pt.EP{IP: ip, Node: "node-b"})
	}
	h.engine.OnEndpointSliceUpdate(nil, pt.Slice("big", 8080, list...))
}

func bigEndpoints(drop ...int) []string {
	var out []string
	for i := 1; i <= 10; i++ {
		if !slices.Contains(drop, i) {
			out = append(out, fmt.Sprintf("10.244.3.%d", i))
		}
	}
	return out
}

// replaceOps are the operations that replace one element.
func replaceOps(m, key string) []string {
	return []string{"add " + m + " " + key, "delete " + m + " " + key}
}

// bigDispatch are the replaced dispatch elements of "big" (ClusterIP
// 10.96.9.1:80, node port 31000).
var bigDispatch = append(replaceOps(mapServiceIPs, "10.96.9.1 . tcp . 80"), replaceOps(mapServiceNodePorts, "tcp . 31000")...)

// bigSlotsElems are the replaced endpoint-slots elements of "big": every
// change of its endpoints replaces them; the dispatch elements only when
// the count (and so the shape) changes.
var bigSlotsElems = append(replaceOps(setEndpointSlots, "10.96.9.1 . tcp . 80"), replaceOps(setNodePortEndpointSlots, "tcp . 31000")...)

// bigSlots are element operations on both endpoint slots of "big" of op.
func bigSlots(op string, slots ...int) []string {
	var out []string
	for _, s := range slots {
		out = append(out, fmt.Sprintf("%s %s 10.96.9.1 . 80 . %d", op, endpointsMap("tcp"), s),
			fmt.Sprintf("%s %s 31000 . %d", op, nodePortEndpointsMap("tcp"), s))
	}
	return out
}

// slotObjects gives h's engine 20 one-endpoint services, "big" with
// bigEps and "loc".
func slotObjects(h *harness, bigEps []string) {
	addServices(h, 20)
	h.engine.OnServiceAdd(pt.Service("big", "10.96.9.1", pt.NodePort(31000)))
	slotService(h, bigEps)
	h.engine.OnServiceAdd(pt.Service("loc", "10.96.9.2", pt.NodePort(31001), pt.ExternalLocal()))
	h.engine.OnEndpointSliceAdd(pt.Slice("loc", 8080,
		pt.EP{IP: "10.244.1.1", Node: "node-a"}, pt.EP{IP: "10.244.1.2", Node: "node-a"}, pt.EP{IP: "10.244.1.3", Node: "node-a"},
		pt.EP{IP: "10.244.3.21", Node: "node-b"}, pt.EP{IP: "10.244.3.22", Node: "node-b"}, pt.EP{IP: "10.244.3.23", Node: "node-b"}))
}

func newSlotHarness(t *testing.T) *harness {
	h := newHarness(t, nil, Options{})
	slotObjects(h, bigEndpoints())
	if st := h.sync(); !st.Full {
		t.Fatalf("first sync was %s", st.Mode)
	}
	return h
}

// freshDump is canonicalDump of the table a fresh process writes for the
// objects setup gives it.
func freshDump(t *testing.T, setup func(h *harness)) string {
	t.Helper()
	fresh := newHarness(t, nil, Options{})
	setup(fresh)
	fresh.sync()
	return canonicalDump(fresh.fake)
}

// layoutOneDump turns a dump of this kproxy's table into the table an
// earlier kproxy (layout 1) left: no endpoint-slots sets, each dispatch
// element's comment recording its endpoint slots instead, and another
// layout hash in sync-state.
func layoutOneDump(t *testing.T, dump string) string {
	t.Helper()
	slotsRe := regexp.MustCompile(`^add element ip kproxy (nodeport-)?endpoint-slots \{ (.*) comment "(.*)" \}$`)
	dispatchRe := regexp.MustCompile(`^(add element ip kproxy service-(ips|nodeports) \{ (.*) comment )"[^"]*"( : goto .*)$`)
	comments := map[string]string{}
	var lines []string
	for _, l := range strings.Split(dump, "\n") {
		if m := slotsRe.FindStringSubmatch(l); m != nil {
			if m[3] != canaryComment {
				comments[m[2]] = m[3]
			}
			continue
		}
		if strings.HasPrefix(l, "add set ip kproxy endpoint-slots ") || strings.HasPrefix(l, "add set ip kproxy nodeport-endpoint-slots ") {
			continue
		}
		lines = append(lines, l)
	}
	n := 0
	for i, l := range lines {
		if m := dispatchRe.FindStringSubmatch(l); m != nil {
			c, ok := comments[m[3]]
			if !ok {
				t.Fatalf("no endpoint-slots element for %s", l)
			}
			lines[i] = m[1] + strconv.Quote(c) + m[4]
			n++
		}
		lines[i] = regexp.MustCompile(`layout=[0-9a-f]+`).ReplaceAllString(lines[i], "layout=0123456789abcdef")
	}
	if n == 0 || n != len(comments) {
		t.Fatalf("%d dispatch elements for %d endpoint-slots elements", n, len(comments))
	}
	return strings.Join(lines, "\n")
}

// TestRestartOverLayoutOneTable: a kproxy over the table an earlier one
// left, whose dispatch elements carried the endpoint slots' comments,
// reconciles it in one transaction (its chains rewritten) without touching
// a single endpoint slot, and leaves the table a fresh process writes.
func TestRestartOverLayoutOneTable(t *testing.T) {
	first := newSlotHarness(t)
	churn(first) // slots out of address order: the recorded assignment matters
	assigned := slotLines(first.fake)
	fake := knftables.NewFake(knftables.IPv4Family, TableName)
	if err := fake.ParseDump(layoutOneDump(t, first.fake.Dump())); err != nil {
		t.Fatal(err)
	}
	second := newHarness(t, fake, Options{})
	slotObjects(second, append(bigEndpoints(3, 5), "10.244.3.99"))
	st := second.sync()
	if st.Mode != modeReconcile {
		t.Fatalf("first sync after the upgrade was %s, want %s", st.Mode, modeReconcile)
	}
	// The chains are rewritten (another layout), in the same transaction;
	// no map or set is flushed, and no endpoint slot is written.
	for _, l := range txLines(second.lastTx()) {
		f := strings.Fields(l)
		if strings.HasPrefix(l, "flush map ") || strings.HasPrefix(l, "flush set ") ||
			(len(f) > 4 && f[1] == "element" && (strings.HasPrefix(f[4], mapEndpointsPrefix) || strings.HasPrefix(f[4], mapNodePortEndpointsPrefix))) {
			t.Errorf("the upgrade sync flushed or rewrote a slot: %s", l)
		}
	}
	if got := slotLines(second.fake); got != assigned {
		t.Errorf("slots changed:\n%s", diff(got, assigned))
	}
	want := freshDump(t, func(f *harness) { slotObjects(f, append(bigEndpoints(3, 5), "10.244.3.99")) })
	if got := canonicalDump(second.fake); got != want {
		t.Errorf("table differs from a fresh one's (slots aside):\n%s", diff(got, want))
	}
	second.flows(pt.Flow{Name: "big", Source: "10.244.1.9", Dest: "10.96.9.1", Port: 80, Want: pt.Delivered,
		WantEndpoints: func() (out []string) {
			for _, ip := range append(bigEndpoints(3, 5), "10.244.3.99") {
				out = append(out, ip+":8080")
			}
			return out
		}()})
}

// TestStableSlots: an endpoint keeps its slot while it stays, so a change
// writes only the slots it touches (docs/design.md, "nftables backend").
func TestStableSlots(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(h *harness)
		// wantElems are the element operations (elemOps).
		wantElems []string
		// wantChains: whether shape and pick chains change (the count).
		wantChains bool
		wantEps    []string // the endpoints of big's ClusterIP after it
	}{
		{
			name:      "endpoint replaced: one slot and the endpoint-slots element per destination",
			change:    func(h *harness) { slotService(h, append(bigEndpoints(4), "10.244.3.99")) },
			wantElems: cat(bigSlots("add", 3), bigSlots("delete", 3), bigSlotsElems),
			wantEps:   append(bigEndpoints(4), "10.244.3.99"),
		},
		{
			name:       "endpoint removed: the last slot's endpoint moves into its slot",
			change:     func(h *harness) { slotService(h, bigEndpoints(4)) },
			wantElems:  cat(bigSlots("add", 3), bigSlots("delete", 3, 9), bigDispatch, bigSlotsElems),
			wantChains: true,
			wantEps:    bigEndpoints(4),
		},
		{
			name:       "last slot's endpoint removed: one slot deleted",
			change:     func(h *harness) { slotService(h, bigEndpoints(10)) },
			wantElems:  cat(bigSlots("delete", 9), bigDispatch, bigSlotsElems),
			wantChains: true,
			wantEps:    bigEndpoints(10),
		},
		{
			name:       "endpoint added: slot n",
			change:     func(h *harness) { slotService(h, append(bigEndpoints(), "10.244.3.11")) },
			wantElems:  cat(bigSlots("add", 10), bigDispatch, bigSlotsElems),
			wantChains: true,
			wantEps:    append(bigEndpoints(), "10.244.3.11"),
		},
		{
			name:      "one replaced and one removed: the new one fills the lower slot, the last moves into the other",
			change:    func(h *harness) { slotService(h, append(bigEndpoints(3, 6), "10.244.3.99")) },
			wantElems: cat(bigSlots("add", 2, 5), bigSlots("delete", 2, 5, 9), bigDispatch, bigSlotsElems),
			// 10 -> 9 endpoints.
			wantChains: true,
			wantEps:    append(bigEndpoints(3, 6), "10.244.3.99"),
		},
		{
			name:       "ten to three endpoints: two slots refilled from the end, seven deleted",
			change:     func(h *harness) { slotService(h, bigEndpoints(2, 3, 4, 5, 7, 8, 9)) },
			wantElems:  cat(bigSlots("add", 1, 2), bigSlots("delete", 1, 2, 3, 4, 5, 6, 7, 8, 9), bigDispatch, bigSlotsElems),
			wantChains: true,
			wantEps:    bigEndpoints(2, 3, 4, 5, 7, 8, 9),
		},
		{
			name: "endpoints listed in another order: nothing",
			change: func(h *harness) {
				eps := bigEndpoints()
				slices.Reverse(eps)
				slotService(h, eps)
			},
			wantEps: bigEndpoints(),
		},
		{
			name: "local endpoint replaced: its cluster slot and its local slot",
			change: func(h *harness) {
				h.engine.OnEndpointSliceUpdate(nil, pt.Slice("loc", 8080,
					pt.EP{IP: "10.244.1.1", Node: "node-a"}, pt.EP{IP: "10.244.1.9", Node: "node-a"}, pt.EP{IP: "10.244.1.3", Node: "node-a"},
					pt.EP{IP: "10.244.3.21", Node: "node-b"}, pt.EP{IP: "10.244.3.22", Node: "node-b"}, pt.EP{IP: "10.244.3.23", Node: "node-b"}))
			},
			// The ClusterIP has the cluster list; the node port the
			// cluster list (for pods and the node) and the local one.
			// Local endpoints are hairpin endpoints.
			wantElems: cat([]string{"add hairpin-endpoints 10.244.1.9 . 10.244.1.9", "delete hairpin-endpoints 10.244.1.2 . 10.244.1.2"}, replaceOps(endpointsMap("tcp"), "10.96.9.2 . 80 . 1"),
				replaceOps(nodePortEndpointsMap("tcp"), "31001 . 1"),
				replaceOps(nodePortEndpointsMap("tcp"), fmt.Sprintf("31001 . %d", localSlotBase+1)),
				replaceOps(setEndpointSlots, "10.96.9.2 . tcp . 80"), replaceOps(setNodePortEndpointSlots, "tcp . 31001")),
			wantEps: bigEndpoints(),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSlotHarness(t)
			before := h.nft.runs
			tc.change(h)
			st := h.sync()
			if st.Mode != modePartial {
				t.Fatalf("sync was %s", st.Mode)
			}
			got := elemOps(h.lastTx())
			if len(tc.wantElems) == 0 {
				if h.nft.runs != before {
					t.Errorf("ran a transaction:\n%s", h.lastTx())
				}
			} else if !slices.Equal(got, tc.wantElems) {
				t.Errorf("element operations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.wantElems, "\n"))
			}
			if chains := st.ChainsWritten+st.ChainsDeleted > 0; chains != tc.wantChains {
				t.Errorf("chains written %d, deleted %d; want changes: %v", st.ChainsWritten, st.ChainsDeleted, tc.wantChains)
			}
			var wantEps []string
			for _, ip := range tc.wantEps {
				wantEps = append(wantEps, ip+":8080")
			}
			h.flows(pt.Flow{Name: "big", Source: "10.244.1.9", Dest: "10.96.9.1", Port: 80, Want: pt.Delivered, WantEndpoints: wantEps},
				pt.Flow{Name: "big node port", Source: "192.0.2.1", Dest: "10.0.0.1", Port: 31000, Want: pt.Delivered, WantEndpoints: wantEps, WantMasquerade: true})
			want := freshDump(t, func(f *harness) { slotObjects(f, bigEndpoints()); tc.change(f) })
			if got := canonicalDump(h.fake); got != want {
				t.Errorf("table differs from a fresh one's (slots aside):\n%s", diff(got, want))
			}
		})
	}
}

// slotLines are the endpoints maps' elements of the table, sorted.
func slotLines(fake *knftables.Fake) string {
	var out []string
	for _, l := range strings.Split(fake.Dump(), "\n") {
		if strings.Contains(l, " "+mapEndpointsPrefix) {
			out = append(out, l)
		}
	}
	slices.Sort(out)
	return strings.Join(out, "\n")
}

// churn leaves big's slots out of address order: 10.244.3.3 gone (slot 2
// takes 10.244.3.10) and 10.244.3.5 replaced by 10.244.3.99 (slot 4).
func churn(h *harness) {
	slotService(h, bigEndpoints(3))
	h.sync()
	slotService(h, append(bigEndpoints(3, 5), "10.244.3.99"))
	h.sync()
}

// TestSlotsSurviveFullSyncs: reconciles, rebuilds and a new process over
// the table keep the slots that partial syncs assigned.
func TestSlotsSurviveFullSyncs(t *testing.T) {
	finalEps := append(bigEndpoints(3, 5), "10.244.3.99")
	// restart is a new process over h's table, given the objects h has
	// and those whileDown changes.
	var whileDown func(h *harness)
	restart := func(t *testing.T, h *harness) *harness {
		fake := knftables.NewFake(knftables.IPv4Family, TableName)
		if err := fake.ParseDump(h.fake.Dump()); err != nil {
			t.Fatal(err)
		}
		second := newHarness(t, fake, Options{})
		slotObjects(second, finalEps)
		if whileDown != nil {
			whileDown(second)
		}
		return second
	}
	for _, tc := range []struct {
		name string
		// full runs the full sync (restart: a new process over the
		// table); it returns the harness that goes on.
		full     func(t *testing.T, h *harness) *harness
		wantMode string
		// whileDown changes objects before a restart.
		whileDown func(h *harness)
		// wantElems are the element operations of the full sync (nil:
		// none, no transaction).
		wantElems []string
		// keepsSlots: big's slots are those partial syncs assigned.
		keepsSlots bool
	}{
		{
			name: "reconcile",
			full: func(t *testing.T, h *harness) *harness {
				h.clock.Step(2 * time.Hour)
				return h
			},
			wantMode: modeReconcile, keepsSlots: true,
		},
		{
			name: "rebuild",
			full: func(t *testing.T, h *harness) *harness {
				h.backend.needRebuild = true
				return h
			},
			wantMode: modeRebuild, keepsSlots: true,
		},
		{
			name:     "restart, nothing changed",
			full:     restart,
			wantMode: modeReconcile, keepsSlots: true,
		},
		{
			name: "restart, another service changed",
			full: restart,
			whileDown: func(h *harness) {
				_, sl := svcN(7)
				sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			wantMode: modeReconcile, keepsSlots: true,
			wantElems: cat(replaceOps(endpointsMap("tcp"), "10.96.0.8 . 80 . 0"), replaceOps(nodePortEndpointsMap("tcp"), "30007 . 0"),
				replaceOps(setEndpointSlots, "10.96.0.8 . tcp . 80"), replaceOps(setNodePortEndpointSlots, "tcp . 30007")),
		},
		{
			name: "restart, big changed: only its slots rewritten",
			full: restart,
			whileDown: func(h *harness) {
				finalEps := append(bigEndpoints(3, 5, 6), "10.244.3.99")
				slotService(h, finalEps)
			},
			wantMode:  modeReconcile,
			wantElems: cat(bigSlots("add", 0, 1, 2, 3, 4, 5, 6, 7), bigSlots("delete", 0, 1, 2, 3, 4, 5, 6, 7, 8), bigDispatch, bigSlotsElems),
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSlotHarness(t)
			churn(h)
			assigned := slotLines(h.fake)
			whileDown = tc.whileDown
			h = tc.full(t, h)
			before := h.nft.runs
			st := h.sync()
			if st.Mode != tc.wantMode {
				t.Fatalf("full sync was %s, want %s", st.Mode, tc.wantMode)
			}
			got := elemOps(h.lastTx())
			if tc.wantElems == nil && tc.wantMode != modeRebuild {
				if h.nft.runs != before {
					t.Errorf("ran a transaction:\n%s", h.lastTx())
				}
			} else if tc.wantElems != nil && !slices.Equal(got, tc.wantElems) {
				t.Errorf("element operations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.wantElems, "\n"))
			}
			if tc.keepsSlots {
				if got := slotLines(h.fake); !strings.Contains(got, "10.96.9.1 . 80 . 2 : 10.244.3.10 . 8080") || !strings.Contains(got, "10.96.9.1 . 80 . 4 : 10.244.3.99 . 8080") {
					t.Errorf("big's slots were not kept:\n%s", got)
				}
				if tc.whileDown == nil && slotLines(h.fake) != assigned {
					t.Errorf("slots changed:\n%s", diff(slotLines(h.fake), assigned))
				}
			}
			want := freshDump(t, func(f *harness) {
				slotObjects(f, finalEps)
				if tc.whileDown != nil {
					tc.whileDown(f)
				}
			})
			if got := canonicalDump(h.fake); got != want {
				t.Errorf("table differs from a fresh one's (slots aside):\n%s", diff(got, want))
			}
			// The next change of big is still one slot per destination.
			eps := finalEps
			if tc.name == "restart, big changed: only its slots rewritten" {
				eps = append(bigEndpoints(3, 5, 6), "10.244.3.99")
			}
			next := slices.Clone(eps)
			next[0] = "10.244.3.77" // 10.244.3.1
			slotService(h, next)
			if st := h.sync(); st.Mode != modePartial {
				t.Fatalf("sync after the full one was %s", st.Mode)
			}
			if got := elemOps(h.lastTx()); len(got) != 8 {
				t.Errorf("replacing an endpoint after the full sync: %d element operations, want 8:\n%s", len(got), strings.Join(got, "\n"))
			}
		})
	}
}

func cat(lists ...[]string) []string {
	var out []string
	for _, l := range lists {
		out = append(out, l...)
	}
	slices.Sort(out)
	return out
}
