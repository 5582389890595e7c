package nftables

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestRealKernelSetAside: the real kernel refuses one service's element,
// and the other services are programmed in the same sync, real packets to
// them working. The refusal is the kernel's own: an element put into
// kproxy's endpoints map from outside holds the key of one of the
// service's endpoint slots with another value, so adding the slot fails
// with "File exists", which nft reports at that element of the merged
// command (execNFT maps it back to the transaction's line).
func TestRealKernelSetAside(t *testing.T) {
	netnstest.RequireRoot(t)
	const (
		dbIP      = "10.96.0.20"
		badIP     = "10.96.0.30"
		badNP     = 30090
		outsideIP = "192.0.2.10"
	)
	ep := func(ip string) pt.EP { return pt.EP{IP: ip, Node: "node-b"} }
	web := pt.Service("web", rtClusterIP, pt.NodePort(rtNodePort))
	webSlice := pt.Slice("web", 8080, pt.EP{IP: "10.244.1.5", Node: "node-a"}, ep("10.244.2.5"))
	db := pt.Service("db", dbIP)
	bad := pt.Service("bad", badIP, pt.NodePort(badNP))
	dbSlice := func(ips ...string) *discovery.EndpointSlice { return pt.Slice("db", 8080, eps(ep, ips)...) }
	badSlice := func(ips ...string) *discovery.EndpointSlice { return pt.Slice("bad", 8080, eps(ep, ips)...) }
	// The case lists every endpoint any phase uses (the servers) and every
	// flow sent.
	c := pt.Case{
		Name:     "set aside",
		Services: []*v1.Service{web, db, bad},
		Slices:   []*discovery.EndpointSlice{webSlice, dbSlice("10.244.2.6", "10.244.2.7"), badSlice("10.244.2.8", "10.244.2.9")},
		Flows: []pt.Flow{
			{Name: "web", Source: "10.244.1.9", Dest: rtClusterIP, Port: 80},
			{Name: "db", Source: "10.244.1.9", Dest: dbIP, Port: 80},
			{Name: "bad", Source: "10.244.1.9", Dest: badIP, Port: 80},
			{Name: "bad node port", Source: outsideIP, Dest: rtNodeIP, Port: badNP},
		},
	}
	flows := func(dbEP string, badEPs ...string) []pt.Flow {
		delivered := func(f pt.Flow, to ...string) pt.Flow {
			f.Want = pt.Delivered
			for _, ip := range to {
				f.WantEndpoints = append(f.WantEndpoints, ip+":8080")
			}
			return f
		}
		out := []pt.Flow{delivered(c.Flows[0], "10.244.1.5", "10.244.2.5"), delivered(c.Flows[1], dbEP)}
		if len(badEPs) == 0 {
			for _, f := range c.Flows[2:] {
				f.Want = pt.NotHandled
				out = append(out, f)
			}
			return out
		}
		np := delivered(c.Flows[3], badEPs...)
		np.WantMasquerade = true
		return append(out, delivered(c.Flows[2], badEPs...), np)
	}

	rt := &realTable{c: c, env: c.Env(), clk: testingclock.NewFakeClock(time.Unix(1_700_000_000, 0))}
	rk := realNFTKernel(rt.clk)
	rk.NewBackend = func(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
		rt.backend, rt.tee = newRealNFTBackend(t, node, rt.clk, nil)
		return rt.backend, &fakeTracer{fake: rt.tee.fake.Fake, local: node.Addrs}
	}
	rt.rc = pt.NewRealCase(t, c, rt.env, rk, nil)
	var last proxier.SyncResult
	newEngine := func(b *Backend, services []*v1.Service, slices ...*discovery.EndpointSlice) *proxier.Engine {
		return pt.NewEngine(t, b, pt.EngineOptions{Env: rt.env, Clock: rt.clk, OnSync: func(r proxier.SyncResult) { last = r },
			Services: services, Slices: slices})
	}
	badName := proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: pt.Namespace, Name: "bad"}, Port: "p", Protocol: v1.ProtocolTCP}
	sync := func(e *proxier.Engine, b *Backend, wantMode string, wantAside bool) {
		t.Helper()
		rt.sync(t, e)
		if st := b.LastSync(); st.Mode != wantMode {
			t.Errorf("sync was %s, want %s", st.Mode, wantMode)
		}
		got := slices.SortedFunc(maps.Keys(last.Backend.SetAside), proxy.ServicePortName.Compare)
		if len(got) > 0 {
			t.Logf("set aside after a %s sync (%d transactions): %v", b.LastSync().Mode, b.LastSync().Transactions, last.Backend.SetAside)
		}
		switch {
		case wantAside && !slices.Equal(got, []proxy.ServicePortName{badName}):
			t.Errorf("set aside %v, want only %s", last.Backend.SetAside, badName)
		case wantAside && !strings.Contains(last.Backend.SetAside[badName].Error(), "File exists"):
			t.Errorf("bad set aside with %v, want the kernel's refusal", last.Backend.SetAside[badName])
		case !wantAside && len(got) > 0:
			t.Errorf("set aside %v, want none", last.Backend.SetAside)
		}
	}
	// squat puts an element with the key of bad's ClusterIP slot there,
	// from outside.
	squat := func(slot string) string {
		return endpointsMap("tcp") + " { " + badIP + " . 80 . " + slot + " : 192.0.2.99 . 9 }"
	}

	// web and db, programmed.
	e := newEngine(rt.backend, []*v1.Service{web, db}, webSlice, dbSlice("10.244.2.6"))
	sync(e, rt.backend, modeReconcile, false)
	rt.rc.CheckKernelFlows(t, flows("10.244.2.6"))

	// bad comes and is refused; db's change in the same sync is programmed.
	rt.nft(t, "add", "element", "ip", TableName, squat("0"))
	e.OnServiceAdd(bad)
	e.OnEndpointSliceAdd(badSlice("10.244.2.8"))
	e.OnEndpointSliceUpdate(nil, dbSlice("10.244.2.7"))
	rt.clk.Step(time.Second)
	sync(e, rt.backend, modePartial, true)
	rt.rc.CheckKernelFlows(t, flows("10.244.2.7"))

	// A full sync, still refused: set aside again, no rebuild.
	rt.clk.Step(2 * time.Hour)
	sync(e, rt.backend, modeReconcile, true)
	rt.rc.CheckKernelFlows(t, flows("10.244.2.7"))

	// No longer refused: the next full sync programs it.
	rt.nft(t, "delete", "element", "ip", TableName, endpointsMap("tcp")+" { "+badIP+" . 80 . 0 }")
	rt.clk.Step(2 * time.Hour)
	sync(e, rt.backend, modeReconcile, false)
	rt.rc.CheckKernelFlows(t, flows("10.244.2.7", "10.244.2.8"))

	// A change of bad refused: it keeps its last good elements.
	rt.nft(t, "add", "element", "ip", TableName, squat("1"))
	e.OnEndpointSliceUpdate(nil, badSlice("10.244.2.8", "10.244.2.9"))
	rt.clk.Step(time.Second)
	sync(e, rt.backend, modePartial, true)
	rt.rc.CheckKernelFlows(t, flows("10.244.2.7", "10.244.2.8"))

	// A restarted kproxy, refused the same: it keeps what the table has
	// (the endpoints map listed, having no state of its own).
	b2, _ := newRealNFTBackend(t, rt.rc.Node(), rt.clk, rt.tee)
	e2 := newEngine(b2, []*v1.Service{web, db, bad}, webSlice, dbSlice("10.244.2.7"), badSlice("10.244.2.8", "10.244.2.9"))
	sync(e2, b2, modeReconcile, true)
	rt.rc.CheckKernelFlows(t, flows("10.244.2.7", "10.244.2.8"))
}

func eps(ep func(string) pt.EP, ips []string) []pt.EP {
	out := make([]pt.EP, 0, len(ips))
	for _, ip := range ips {
		out = append(out, ep(ip))
	}
	return out
}

// TestRealKernelSetAsideWrittenAhead: the kernel refuses a slot that a
// full sync writes ahead of its main transaction (preWriter, which sends
// nft its own text, execNFT.runText): the service port is set aside, its
// chunk runs again as a transaction without it, and the rest is
// programmed in the same sync.
func TestRealKernelSetAsideWrittenAhead(t *testing.T) {
	netnstest.RequireRoot(t)
	const badIP = "10.96.0.30"
	ep := func(ip string) pt.EP { return pt.EP{IP: ip, Node: "node-b"} }
	web := pt.Service("web", rtClusterIP)
	webSlice := pt.Slice("web", 8080, ep("10.244.2.5"), ep("10.244.2.6"))
	bad := pt.Service("bad", badIP)
	badSlice := pt.Slice("bad", 8080, ep("10.244.2.8"), ep("10.244.2.9"))
	c := pt.Case{
		Name:     "set aside ahead",
		Services: []*v1.Service{web, bad},
		Slices:   []*discovery.EndpointSlice{webSlice, badSlice},
		Flows: []pt.Flow{
			{Name: "web", Source: "10.244.1.9", Dest: rtClusterIP, Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.2.5:8080", "10.244.2.6:8080"}},
			{Name: "bad", Source: "10.244.1.9", Dest: badIP, Port: 80, Want: pt.NotHandled},
		},
	}
	rt := &realTable{c: c, env: c.Env(), clk: testingclock.NewFakeClock(time.Unix(1_700_000_000, 0))}
	rk := realNFTKernel(rt.clk)
	rk.NewBackend = func(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
		rt.backend, rt.tee = newRealNFTBackend(t, node, rt.clk, nil)
		return rt.backend, &fakeTracer{fake: rt.tee.fake.Fake, local: node.Addrs}
	}
	rt.rc = pt.NewRealCase(t, c, rt.env, rk, nil)
	var last proxier.SyncResult
	newEngine := func(b *Backend, services []*v1.Service, slices ...*discovery.EndpointSlice) *proxier.Engine {
		return pt.NewEngine(t, b, pt.EngineOptions{Env: rt.env, Clock: rt.clk, OnSync: func(r proxier.SyncResult) { last = r },
			Services: services, Slices: slices})
	}
	rt.sync(t, newEngine(rt.backend, []*v1.Service{web}))

	// An element with the key of bad's first slot, put there from
	// outside; then a restarted kproxy with bad and web's endpoints, its
	// slots written ahead one destination per chunk.
	rt.nft(t, "add", "element", "ip", TableName, endpointsMap("tcp")+" { "+badIP+" . 80 . 0 : 192.0.2.99 . 9 }")
	b2, _ := newRealNFTBackend(t, rt.rc.Node(), rt.clk, rt.tee)
	b2.opts.EndpointChunk = 1
	rt.sync(t, newEngine(b2, []*v1.Service{web, bad}, webSlice, badSlice))
	st := b2.LastSync()
	if st.Mode != modeReconcile || st.Transactions < 3 {
		t.Errorf("sync was %s with %d transactions, want %s with the slots written ahead", st.Mode, st.Transactions, modeReconcile)
	}
	badName := proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: pt.Namespace, Name: "bad"}, Port: "p", Protocol: v1.ProtocolTCP}
	got := slices.SortedFunc(maps.Keys(last.Backend.SetAside), proxy.ServicePortName.Compare)
	if !slices.Equal(got, []proxy.ServicePortName{badName}) || !strings.Contains(last.Backend.SetAside[badName].Error(), "File exists") {
		t.Errorf("set aside %v, want only %s, refused by the kernel", last.Backend.SetAside, badName)
	}
	rt.rc.CheckKernelFlows(t, c.Flows)
}
