package nftables

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/clock"
	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestBehaviourCasesRealKernel runs the shared behaviour cases with real
// packets (proxiertest.RunRealKernel describes the topology and the
// verdicts): the engine and this backend program kproxy's table with the
// real nft in a throwaway "node" namespace, every flow is sent through it,
// and the tracer, tracing each flow over the fake twin of every
// transaction the kernel ran, must agree with the kernel.
func TestBehaviourCasesRealKernel(t *testing.T) {
	pt.RunRealKernel(t, realNFTKernel(nil))
}

// realNFTKnownDivergences by "case / flow". None today: on every flow
// sent, the kernel, the tracer and the cases agree.
var realNFTKnownDivergences = map[string]pt.KnownDivergence{}

// realNFTKernel describes this backend to proxiertest's real-kernel
// harness; clk is the backends' clock (nil: the real one).
func realNFTKernel(clk clock.PassiveClock) pt.RealKernel {
	return pt.RealKernel{
		NSPrefix:    "nb",
		CheckKernel: checkRealNFT,
		NewBackend: func(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
			b, tee := newRealNFTBackend(t, node, clk, nil)
			return b, &fakeTracer{fake: tee.fake.Fake, local: node.Addrs}
		},
		ForgetAffinity:   forgetAffinitySets,
		KnownDivergences: realNFTKnownDivergences,
	}
}

// checkRealNFT: nft is installed and lists the node's ruleset.
func checkRealNFT(ctx context.Context, node *netnstest.NS, _ v1.IPFamily) error {
	if _, err := exec.LookPath("nft"); err != nil {
		return err
	}
	_, err := node.Exec(ctx, "nft", "list", "ruleset")
	return err
}

// newRealNFTBackend makes a backend over the node namespace's real nft,
// every transaction also run on a strict fake twin. The twin starts as a
// copy of from's (a backend that programmed the namespace before), or
// empty.
func newRealNFTBackend(t *testing.T, node pt.RealNode, clk clock.PassiveClock, from *teeNFT) (*Backend, *teeNFT) {
	t.Helper()
	real, err := newNSNFT(t, node.NS, node.Env.Family)
	if err != nil {
		t.Fatalf("nft in %s: %v", node.NS.Name, err)
	}
	dumpRulesetOnFailure(t, node.NS)
	twin := knftables.NewFake(fakeFamily(node.Env.Family), TableName)
	if from != nil {
		if err := twin.ParseDump(from.fake.Dump()); err != nil {
			t.Fatalf("copying the fake twin: %v", err)
		}
	}
	tee := &teeNFT{nsNFT: real, fake: &strictNFT{Fake: twin}}
	b, err := New(Options{NFTables: tee, Family: node.Env.Family, NodePortAddresses: node.Env.NodePortAddresses,
		LocalAddresses: node.LocalAddresses, Clock: clk})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return b, tee
}

// dumpRulesetOnFailure logs the namespace's ruleset when t fails
// (registered after the namespace, so it runs before its deletion).
func dumpRulesetOnFailure(t *testing.T, ns *netnstest.NS) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		out, err := ns.Exec(context.Background(), "nft", "list", "ruleset")
		t.Logf("nft list ruleset in the node namespace (err %v):\n%s", err, out)
	})
}

// forgetAffinitySets empties the node's affinity sets (ClientIP
// affinity), so that the next packet is a first one. A family's table may
// be missing (the case is of the other family).
func forgetAffinitySets(node *netnstest.NS) error {
	out, err := node.Exec(context.Background(), "nft", "-j", "list", "tables")
	if err != nil {
		return err
	}
	var list struct {
		NFTables []struct {
			Table *struct{ Family, Name string } `json:"table"`
		} `json:"nftables"`
	}
	if err := json.Unmarshal(out, &list); err != nil {
		return fmt.Errorf("parsing `nft -j list tables`: %w", err)
	}
	var cmds []string
	for _, o := range list.NFTables {
		if o.Table == nil || o.Table.Name != TableName {
			continue
		}
		for _, p := range protocols {
			cmds = append(cmds, "flush set "+o.Table.Family+" "+TableName+" "+affinitySet(p))
		}
	}
	if len(cmds) == 0 {
		return nil
	}
	if _, err := node.Exec(context.Background(), "nft", strings.Join(cmds, "; ")); err != nil {
		return fmt.Errorf("emptying the affinity sets: %w", err)
	}
	return nil
}

// The tests below drive one service through an engine of their own, with
// real packets, across events a backend must survive.

const (
	rtClusterIP = "10.96.0.10"
	rtNodeIP    = "10.0.0.1"
	rtNodePort  = 30080
)

// realTableCase is a ClusterIP and node port service with two endpoints
// (one on this node), reached by a pod, an outside client and the node.
func realTableCase() pt.Case {
	both := []string{"10.244.1.5:8080", "10.244.2.5:8080"}
	return pt.Case{
		Name:     "web",
		Services: []*v1.Service{pt.Service("web", rtClusterIP, pt.NodePort(rtNodePort))},
		Slices: []*discovery.EndpointSlice{pt.Slice("web", 8080,
			pt.EP{IP: "10.244.1.5", Node: "node-a"}, pt.EP{IP: "10.244.2.5", Node: "node-b"})},
		Flows: []pt.Flow{
			{Name: "pod", Source: "10.244.1.9", Dest: rtClusterIP, Port: 80, Want: pt.Delivered, WantEndpoints: both},
			{Name: "pod, other port", Source: "10.244.1.9", Dest: rtClusterIP, Port: 81, Want: pt.NotHandled},
			{Name: "outside to node port", Source: "192.0.2.10", Dest: rtNodeIP, Port: rtNodePort, Want: pt.Delivered, WantEndpoints: both, WantMasquerade: true},
			{Name: "node", Source: rtNodeIP, Dest: rtClusterIP, Port: 80, Origin: pt.FromHost, Want: pt.Delivered, WantEndpoints: both, WantMasquerade: true},
			{Name: "pod, UDP", Source: "10.244.1.9", Dest: rtClusterIP, Port: 80, Protocol: v1.ProtocolUDP, Want: pt.NotHandled},
		},
	}
}

// unhandled is flows with those that broken selects (every one when nil)
// not handled: what the kernel does without kproxy's rules for them.
func unhandled(flows []pt.Flow, broken func(pt.Flow) bool) []pt.Flow {
	out := make([]pt.Flow, 0, len(flows))
	for _, f := range flows {
		if broken == nil || broken(f) {
			f.Want, f.WantEndpoints, f.WantMasquerade, f.WantHairpin = pt.NotHandled, nil, false, nil
		}
		out = append(out, f)
	}
	return out
}

// realTable is realTableCase on the real kernel, driven by an engine.
type realTable struct {
	c       pt.Case
	env     pt.Env
	rc      *pt.RealCase
	clk     *testingclock.FakeClock
	backend *Backend
	tee     *teeNFT
	engine  *proxier.Engine
}

func newRealTable(t *testing.T) *realTable {
	t.Helper()
	return newRealTableOf(t, realTableCase())
}

// newRealTableOf is newRealTable for case c.
func newRealTableOf(t *testing.T, c pt.Case) *realTable {
	t.Helper()
	netnstest.RequireRoot(t)
	rt := &realTable{c: c, clk: testingclock.NewFakeClock(time.Unix(1_700_000_000, 0))}
	rt.env = rt.c.Env()
	rk := realNFTKernel(rt.clk)
	rk.NewBackend = func(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
		rt.backend, rt.tee = newRealNFTBackend(t, node, rt.clk, nil)
		return rt.backend, &fakeTracer{fake: rt.tee.fake.Fake, local: node.Addrs}
	}
	rt.rc = pt.NewRealCase(t, rt.c, rt.env, rk, nil)
	rt.engine = rt.start(t, rt.backend)
	rt.sync(t, rt.engine)
	rt.rc.CheckKernelFlows(t, rt.c.Flows)
	return rt
}

// start makes an engine over b holding the case's objects.
func (rt *realTable) start(t *testing.T, b *Backend) *proxier.Engine {
	t.Helper()
	e := newEngine(t, rt.env, b, rt.clk)
	for _, n := range rt.c.Nodes {
		e.OnNodeAdd(n)
	}
	for _, s := range rt.c.Services {
		e.OnServiceAdd(s)
	}
	for _, s := range rt.c.Slices {
		e.OnEndpointSliceAdd(s)
	}
	e.OnServiceSynced()
	e.OnEndpointSlicesSynced()
	return e
}

func (rt *realTable) sync(t *testing.T, e *proxier.Engine) {
	t.Helper()
	if err := e.SyncRules(t.Context()); err != nil {
		t.Fatalf("sync: %v", err)
	}
}

func (rt *realTable) nft(t *testing.T, args ...string) string {
	t.Helper()
	out, err := rt.rc.Node().NS.Exec(context.Background(), "nft", args...)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// flow is the case's flow named name.
func (rt *realTable) flow(t *testing.T, name string) pt.Flow {
	t.Helper()
	for _, f := range rt.c.Flows {
		if f.Name == name {
			return f
		}
	}
	t.Fatalf("no flow %q", name)
	return pt.Flow{}
}

// checkConn checks that conn is still answered by the endpoint that first
// answered it, as it first was.
func checkConn(t *testing.T, conn *pt.RealConn, when string) {
	t.Helper()
	a, err := conn.Ask()
	if err != nil {
		t.Errorf("the connection opened before %s: %v", when, err)
	} else if a != conn.First {
		t.Errorf("the connection opened before %s: answered as %+v, first as %+v", when, a, conn.First)
	}
}

// TestRealKernelRestart starts a new backend and engine over a programmed
// namespace, as a restarted kproxy: its first sync writes nothing, traffic
// flows during and after it, and a connection opened before the restart
// keeps its endpoint.
func TestRealKernelRestart(t *testing.T) {
	rt := newRealTable(t)
	pod := rt.flow(t, "pod")
	conn, err := rt.rc.Dial(t.Context(), pod)
	if err != nil {
		t.Fatal(err)
	}
	if conn.First.Verdict != pt.Delivered {
		t.Fatalf("connection opened before the restart: %+v", conn.First)
	}

	// Traffic all along the restart: the new backend and engine, their
	// first sync, and a while after it.
	stop := make(chan struct{})
	var during []pt.RealAttempt
	var errs []error
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				if i >= 10 {
					return
				}
			default:
			}
			a, err := rt.rc.Attempt(pod)
			if err != nil {
				errs = append(errs, err)
				return
			}
			during = append(during, a)
			time.Sleep(5 * time.Millisecond)
		}
	})
	b2, _ := newRealNFTBackend(t, rt.rc.Node(), rt.clk, rt.tee)
	e2 := rt.start(t, b2)
	rt.sync(t, e2)
	close(stop)
	wg.Wait()
	if st := b2.LastSync(); st.Mode != modeReconcile || st.Operations != 0 {
		t.Errorf("first sync after the restart: mode %s with %d operations, want %s with none", st.Mode, st.Operations, modeReconcile)
	}
	for _, err := range errs {
		t.Errorf("during the restart: %v", err)
	}
	for i, a := range during {
		if a.Verdict != pt.Delivered || !strings.HasSuffix(a.Endpoint, ":8080") || a.Masquerade {
			t.Errorf("attempt %d during the restart: %+v, want delivered to an endpoint, unmasqueraded", i+1, a)
		}
	}
	t.Logf("%d attempts during the restart", len(during))
	checkConn(t, conn, "the restart")
	rt.rc.CheckKernelFlows(t, rt.c.Flows)

	// The restarted backend goes on with partial syncs.
	sl := rt.c.Slices[0].DeepCopy()
	sl.Endpoints = sl.Endpoints[1:]
	e2.OnEndpointSliceUpdate(rt.c.Slices[0], sl)
	rt.clk.Step(time.Second)
	rt.sync(t, e2)
	if st := b2.LastSync(); st.Mode != modePartial {
		t.Errorf("sync after an endpoint left: mode %s, want %s", st.Mode, modePartial)
	}
	var flows []pt.Flow
	for _, f := range rt.c.Flows {
		if f.Want == pt.Delivered {
			f.WantEndpoints = []string{"10.244.2.5:8080"}
		}
		flows = append(flows, f)
	}
	rt.rc.CheckKernelFlows(t, flows)
}

// realLBCase is realTableCase plus a load balancer whose source ranges
// admit 192.0.2.0/24 only.
func realLBCase() pt.Case {
	c := realTableCase()
	c.Name = "web and lb"
	c.Services = append(c.Services, pt.Service("lb", "10.96.0.20", pt.LoadBalancer(rtLBIP), pt.SourceRanges("192.0.2.0/24")))
	c.Slices = append(c.Slices, pt.Slice("lb", 8080, pt.EP{IP: "10.244.2.6", Node: "node-b"}))
	c.Flows = append(c.Flows,
		pt.Flow{Name: "allowed to lb", Source: "192.0.2.10", Dest: rtLBIP, Port: 80, Want: pt.Delivered,
			WantEndpoints: []string{"10.244.2.6:8080"}, WantMasquerade: true},
		pt.Flow{Name: "denied to lb", Source: "198.51.100.1", Dest: rtLBIP, Port: 80, Want: pt.Dropped})
	return c
}

const rtLBIP = "203.0.113.22"

// TestRealKernelRepair breaks kproxy's table from outside; traffic stops
// being handled (or is handled wrongly), the next sync (the canary check)
// repairs it, and traffic works again. A connection opened before the
// damage is answered again after the repair, by its endpoint.
func TestRealKernelRepair(t *testing.T) {
	// chainOf names the first chain of the table whose name starts with
	// prefix.
	chainOf := func(t *testing.T, rt *realTable, prefix string) string {
		t.Helper()
		for _, f := range strings.Fields(rt.nft(t, "list", "chains", "ip")) {
			if strings.HasPrefix(f, prefix) {
				return f
			}
		}
		t.Fatalf("no chain %s* in:\n%s", prefix, rt.nft(t, "list", "chains", "ip"))
		return ""
	}
	fromHost := func(f pt.Flow) bool { return f.Origin == pt.FromHost }
	toClusterIP := func(f pt.Flow) bool { return f.Dest == rtClusterIP }
	for _, tc := range []struct {
		name string
		// cmd is the damage, given the table (to name its chains).
		cmd func(t *testing.T, rt *realTable) string
		// lb: the case has the load balancer (realLBCase).
		lb bool
		// broken selects the flows the damage leaves unhandled; nil: all.
		broken func(pt.Flow) bool
		// during, when set, is what each flow does while broken instead.
		during func(pt.Flow) pt.Flow
	}{
		{name: "flush table", cmd: fixed("flush table ip kproxy")},
		{name: "delete table", cmd: fixed("delete table ip kproxy")},
		{name: "flush the service-ips map", cmd: fixed("flush map ip kproxy " + mapServiceIPs), broken: toClusterIP},
		{name: "flush a base chain", cmd: fixed("flush chain ip kproxy " + chainNATPrerouting),
			broken: func(f pt.Flow) bool { return !fromHost(f) }},
		{name: "delete a base chain", cmd: fixed("flush chain ip kproxy " + chainNATOutput + "; delete chain ip kproxy " + chainNATOutput),
			broken: fromHost},
		{name: "flush the dispatch chain", cmd: fixed("flush chain ip kproxy " + chainServices)},
		{name: "flush a shape chain", cmd: func(t *testing.T, rt *realTable) string {
			return "flush chain ip kproxy " + chainOf(t, rt, shapeChainPrefix+"ip-")
		}, broken: toClusterIP},
		{name: "flush a pick chain", cmd: func(t *testing.T, rt *realTable) string {
			return "flush chain ip kproxy " + chainOf(t, rt, pickChainPrefix+"ip-")
		}, broken: toClusterIP},
		{name: "flush the endpoints map", cmd: fixed("flush map ip kproxy " + endpointsMap("tcp")), broken: toClusterIP},
		{name: "flush the node port endpoints map", cmd: fixed("flush map ip kproxy " + nodePortEndpointsMap("tcp")),
			broken: func(f pt.Flow) bool { return f.Port == rtNodePort }},
		{name: "flush the sync-state set", cmd: fixed("flush set ip kproxy " + setSyncState),
			broken: func(pt.Flow) bool { return false }},
		{name: "flush the source ranges", cmd: fixed("flush set ip kproxy " + setFirewallAllow), lb: true,
			during: func(f pt.Flow) pt.Flow {
				if f.Dest == rtLBIP {
					f.Want, f.WantEndpoints, f.WantMasquerade = pt.Dropped, nil, false
				}
				return f
			}},
		{name: "flush the load balancers with source ranges", cmd: fixed("flush set ip kproxy " + setFirewallIPs), lb: true,
			during: func(f pt.Flow) pt.Flow {
				if f.Name == "denied to lb" {
					f.Want, f.WantEndpoints, f.WantMasquerade = pt.Delivered, []string{"10.244.2.6:8080"}, true
				}
				return f
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := realTableCase()
			if tc.lb {
				c = realLBCase()
			}
			rt := newRealTableOf(t, c)
			conn, err := rt.rc.Dial(t.Context(), rt.flow(t, "pod"))
			if err != nil {
				t.Fatal(err)
			}
			cmd := tc.cmd(t, rt)
			rt.nft(t, cmd)
			broken := unhandled(rt.c.Flows, tc.broken)
			if tc.during != nil {
				broken = nil
				for _, f := range rt.c.Flows {
					broken = append(broken, tc.during(f))
				}
			}
			rt.rc.CheckKernelFlows(t, broken)

			rt.clk.Step(DefaultCanaryInterval)
			rt.sync(t, rt.engine)
			if st := rt.backend.LastSync(); st.Mode != modeRebuild {
				t.Errorf("sync after %q: mode %s, want %s", cmd, st.Mode, modeRebuild)
			}
			rt.rc.CheckKernelFlows(t, rt.c.Flows)
			checkConn(t, conn, fmt.Sprintf("%q and the repair", cmd))
		})
	}
}

// fixed is a damage command that does not depend on the table.
func fixed(cmd string) func(*testing.T, *realTable) string {
	return func(*testing.T, *realTable) string { return cmd }
}

// TestRealKernelCleanupKeepsForeignTables runs Cleanup twice: kproxy's
// table goes, traffic is no longer handled, and another table of the same
// family is left as it was.
func TestRealKernelCleanupKeepsForeignTables(t *testing.T) {
	rt := newRealTable(t)
	rt.nft(t, "add table ip other; add chain ip other input { type filter hook input priority 10; policy accept; }; "+
		"add rule ip other input ip saddr 198.51.100.99 drop")
	before := rt.nft(t, "list", "table", "ip", "other")
	for i := range 2 {
		if err := rt.backend.Cleanup(t.Context()); err != nil {
			t.Fatalf("cleanup %d: %v", i+1, err)
		}
	}
	if after := rt.nft(t, "list", "table", "ip", "other"); after != before {
		t.Errorf("cleanup changed table ip other:\n%s\nwas:\n%s", after, before)
	}
	tables := rt.nft(t, "list", "tables")
	if strings.Contains(tables, TableName) {
		t.Errorf("kproxy's table is still there after cleanup:\n%s", tables)
	}
	rt.rc.CheckKernelFlows(t, unhandled(rt.c.Flows, nil))
}

// TestRealKernelRestartKeepsSlots: a new process over a table whose slots
// partial syncs assigned out of address order recovers them from the
// dispatch comments as the kernel lists them: its first sync writes nothing
// and its next change writes one slot per destination.
func TestRealKernelRestartKeepsSlots(t *testing.T) {
	rt := newRealTable(t)
	ep := func(ip, node string) pt.EP { return pt.EP{IP: ip, Node: node} }
	old := rt.c.Slices[0]
	// Slots [1.5, 2.5] -> [1.5, 2.5, 3.5] -> [3.5, 2.5].
	for _, eps := range [][]pt.EP{
		{ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b"), ep("10.244.3.5", "node-b")},
		{ep("10.244.2.5", "node-b"), ep("10.244.3.5", "node-b")},
	} {
		sl := pt.Slice("web", 8080, eps...)
		rt.engine.OnEndpointSliceUpdate(old, sl)
		old = sl
		rt.clk.Step(time.Second)
		rt.sync(t, rt.engine)
		if st := rt.backend.LastSync(); st.Mode != modePartial {
			t.Fatalf("churn sync was %s", st.Mode)
		}
	}
	if out := rt.nft(t, "list", "map", "ip", TableName, endpointsMap("tcp")); !strings.Contains(out, ". 0 : 10.244.3.5 . 8080") {
		t.Fatalf("slot 0 is not 10.244.3.5:\n%s", out)
	}
	rt.c.Slices = []*discovery.EndpointSlice{old}
	b2, _ := newRealNFTBackend(t, rt.rc.Node(), rt.clk, rt.tee)
	e2 := rt.start(t, b2)
	rt.sync(t, e2)
	if st := b2.LastSync(); st.Mode != modeReconcile || st.Operations != 0 {
		t.Errorf("first sync after the restart: mode %s with %d operations, want %s with none", st.Mode, st.Operations, modeReconcile)
	}
	// 10.244.2.5 (slot 1) replaced: per destination (ClusterIP, node
	// port) one slot and the dispatch element, and the sync-state canary.
	sl := pt.Slice("web", 8080, ep("10.244.2.6", "node-b"), ep("10.244.3.5", "node-b"))
	e2.OnEndpointSliceUpdate(old, sl)
	rt.clk.Step(time.Second)
	rt.sync(t, e2)
	if st := b2.LastSync(); st.Mode != modePartial || st.ElementsAdded != 5 || st.ElementsDeleted != 5 {
		t.Errorf("replacing an endpoint after the restart: %+v, want a partial sync replacing 5 elements", st)
	}
	// (Those endpoints have no namespace: the table is read, not traced.)
	out := rt.nft(t, "list", "map", "ip", TableName, endpointsMap("tcp"))
	for _, want := range []string{". 0 : 10.244.3.5 . 8080", ". 1 : 10.244.2.6 . 8080"} {
		if !strings.Contains(out, want) {
			t.Errorf("endpoints map lacks %q:\n%s", want, out)
		}
	}
}
