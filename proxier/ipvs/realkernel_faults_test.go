package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestRealKernelFlushRepaired removes kproxy's state with the real tools,
// as an operator or a firewall reload would, while steady traffic runs,
// and then runs one sync with nothing changed: it must find the damage, be
// full, and leave the services working; no request started after it may
// fail (docs/design.md, "IPVS mode under faults"). Other Services are
// there so that what the flush check samples is seldom web's.
func TestRealKernelFlushRepaired(t *testing.T) {
	r := newRealNode(t, echoServers(t))
	ctx := t.Context()
	r.engine.OnServiceAdd(pt.Service("web", "10.96.0.10", pt.NodePort(30080)))
	r.engine.OnEndpointSliceAdd(r.slice("web", "be1", "be2"))
	for i := range 20 {
		r.addFiller(i)
	}
	r.sync()
	works := func(t *testing.T) {
		t.Helper()
		for _, c := range []struct {
			from *netnstest.NS
			addr string
		}{
			{r.pods["pod"].ns, "10.96.0.10:80"},
			{r.client, netip.AddrPortFrom(realNodeAddr.Addr(), 30080).String()},
		} {
			if be, _, err := request(ctx, c.from, c.addr); err != nil || (be != "be1" && be != "be2") {
				t.Errorf("request to %s: backend %q, error %v", c.addr, be, err)
			}
		}
	}
	works(t)
	tr := startTraffic(t,
		trafficTarget{from: r.pods["pod"].ns, addr: "10.96.0.10:80", want: bothBackends},
		trafficTarget{from: r.client, addr: netip.AddrPortFrom(realNodeAddr.Addr(), 30080).String(), want: bothBackends},
	)
	tr.waitSent(t, 20)
	for _, tc := range []struct {
		name  string
		cmds  [][]string
		found string
	}{
		{name: "ipvsadm -C", cmds: [][]string{{"ipvsadm", "-C"}}, found: "IPVS virtual server"},
		{name: "ipset flush", cmds: [][]string{{"ipset", "flush"}}, found: "was flushed"},
		{name: "ipset flush " + setClusterIP, cmds: [][]string{{"ipset", "flush", setClusterIP}}, found: "ipset " + setClusterIP + " was flushed"},
		{name: "ipset flush " + setIPVSAddresses, cmds: [][]string{{"ipset", "flush", setIPVSAddresses}}, found: "ipset " + setIPVSAddresses + " was flushed"},
		{
			name: "iptables -F of every table, then ipset destroy",
			cmds: [][]string{
				{"iptables", "-t", "nat", "-F"}, {"iptables", "-t", "filter", "-F"}, {"iptables", "-t", "mangle", "-F"},
				{"ipset", "destroy"},
			},
			found: "is gone",
		},
		{name: "ip addr flush dev " + DefaultDummyDevice, cmds: [][]string{{"ip", "addr", "flush", "dev", DefaultDummyDevice}}, found: "was missing"},
		{
			name:  "ip addr del 10.96.0.10/32 dev " + DefaultDummyDevice,
			cmds:  [][]string{{"ip", "addr", "del", "10.96.0.10/32", "dev", DefaultDummyDevice}},
			found: "address 10.96.0.10 was missing",
		},
		{name: "ip link del " + DefaultDummyDevice, cmds: [][]string{{"ip", "link", "del", DefaultDummyDevice}}, found: "is gone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sentBefore, _ := tr.counts()
			flushed := time.Now()
			for _, cmd := range tc.cmds {
				if out, err := r.node.Exec(ctx, cmd[0], cmd[1:]...); err != nil {
					t.Fatalf("%s: %v\n%s", strings.Join(cmd, " "), err, out)
				}
			}
			// The traffic meets the damage until the next sync, at most a
			// sync period (the canary interval) later.
			tr.waitSent(t, 10)
			r.clock.Step(DefaultCanaryInterval / 2)
			start := time.Now()
			r.sync()
			repaired := time.Now()
			st := r.backend.LastSync()
			sent, _ := tr.counts()
			t.Logf("%d of %d requests failed between the flush and the repair (%v later) by one full sync of %v that found: %s",
				len(tr.failures(flushed)), sent-sentBefore, repaired.Sub(flushed).Round(time.Millisecond), repaired.Sub(start).Round(time.Millisecond), st.Repaired)
			if !st.Full || !strings.Contains(st.Repaired, tc.found) {
				t.Errorf("sync after %s: full %v, found %q; want a full sync that found %q", tc.name, st.Full, st.Repaired, tc.found)
			}
			works(t)
			tr.waitSent(t, 20)
			for _, f := range tr.failures(repaired) {
				t.Errorf("request %s failed after the repair: %s", f.target, f.err)
			}
			r.sync()
			if st := r.backend.LastSync(); st.Full || st.Repaired != "" {
				t.Errorf("the sync after the repair: full %v, found %q", st.Full, st.Repaired)
			}
		})
	}
	tr.stop()
	sent, failed := tr.counts()
	t.Logf("traffic sent %d, failed %d (between a flush and its repair only)", sent, failed)
	r.backend.initialized = false
	r.sync()
	if err := r.backend.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.checkNothingOurs("after cleanup", 0)
}

// echoServers starts an echo server on every backend of a realNode.
func echoServers(t *testing.T) func(name string, ns *netnstest.NS, bind string) {
	return func(name string, ns *netnstest.NS, bind string) { ns.StartEcho(t, "tcp4", bind, name) }
}

var bothBackends = []string{"be1", "be2"}

// faultNode is a realNode whose agent's IPVS interface injects faults,
// with its syncs' results, health fed from them, and these Services: web
// (10.96.0.10, node port 30080, be1 and be2), other (10.96.0.11, be1),
// moving (10.96.0.12, be1) and fillers f000 on (fillerIP).
type faultNode struct {
	*realNode
	faults *faultIPVS
	health *realHealth
	last   proxier.SyncResult
}

func newFaultNode(t *testing.T, fillers int, kernelCallTimeout time.Duration) *faultNode {
	t.Helper()
	f := &faultNode{faults: &faultIPVS{timeout: kernelCallTimeout}, health: newRealHealth(t)}
	f.realNode = newRealNodeWith(t, realNodeOptions{serve: echoServers(t), agent: f.agentOptions(kernelCallTimeout)})
	e := f.engine
	e.OnServiceAdd(pt.Service("web", "10.96.0.10", pt.NodePort(30080)))
	e.OnEndpointSliceAdd(f.slice("web", bothBackends...))
	e.OnServiceAdd(pt.Service("other", "10.96.0.11"))
	e.OnEndpointSliceAdd(f.slice("other", "be1"))
	e.OnServiceAdd(pt.Service("moving", "10.96.0.12"))
	e.OnEndpointSliceAdd(f.slice("moving", "be1"))
	for i := range fillers {
		f.addFiller(i)
	}
	res, took := f.syncCtx(t.Context())
	if res.Err != nil || !res.Full {
		t.Fatalf("first sync: full %v, error %v", res.Full, res.Err)
	}
	t.Logf("first sync (full, %d services): %v", fillers+3, took.Round(time.Millisecond))
	return f
}

func (f *faultNode) agentOptions(kernelCallTimeout time.Duration) realAgentOptions {
	return realAgentOptions{
		wrapIPVS: func(i ipvs.Interface) ipvs.Interface {
			f.faults.Interface = i
			return f.faults
		},
		kernelCallTimeout: kernelCallTimeout,
		onSync: func(res proxier.SyncResult) {
			f.last = res
			f.health.onSync(res)
		},
	}
}

func (f *faultNode) syncCtx(ctx context.Context) (proxier.SyncResult, time.Duration) {
	return syncWith(ctx, f.realNode, &f.last)
}

// webTraffic is steady traffic to web from the pod (ClusterIP) and from
// the client (node port).
func (f *faultNode) webTraffic() []trafficTarget {
	return []trafficTarget{
		{from: f.pods["pod"].ns, addr: "10.96.0.10:80", want: bothBackends},
		{from: f.client, addr: netip.AddrPortFrom(realNodeAddr.Addr(), 30080).String(), want: bothBackends},
	}
}

// reaches checks that requests from the pod to addr reach only want.
func (f *faultNode) reaches(t *testing.T, addr string, want ...string) {
	t.Helper()
	for i := 0; i < 4; i++ {
		be, _, err := request(t.Context(), f.pods["pod"].ns, addr)
		if err != nil || !slices.Contains(want, be) {
			t.Errorf("request %d to %s: reached %q, error %v; want %v", i, addr, be, err, want)
			return
		}
	}
}

// ipvsLines are the ipvsadm -Sn lines that mention addr.
func (f *faultNode) ipvsLines(t *testing.T, addr string) []string {
	t.Helper()
	var out []string
	for _, l := range f.kernelState(t)["ipvs"] {
		if strings.Contains(l, addr) {
			out = append(out, l)
		}
	}
	return out
}

func setAsideNames(m map[proxy.ServicePortName]error) []string {
	var out []string
	for n := range m {
		out = append(out, n.String())
	}
	slices.Sort(out)
	return out
}

// TestRealKernelPoisonedService: with steady traffic, the real kernel
// (through the IPVS interface) refuses the virtual server of a new Service
// among 50 others while another Service's endpoints change: that change is
// programmed in the same partial sync, the poisoned one is set aside with
// nothing, every other virtual server is untouched and health stays 200.
// Then an existing Service's change is refused: it keeps its last good
// real server and carries traffic. A later partial sync does not retry
// them; a full sync, once the kernel accepts them, programs both.
func TestRealKernelPoisonedService(t *testing.T) {
	f := newFaultNode(t, 50, 0)
	ctx := t.Context()
	e := f.engine
	tr := startTraffic(t, append(f.webTraffic(), trafficTarget{from: f.pods["pod"].ns, addr: "10.96.0.12:80", want: []string{"be1"}})...)
	tr.waitSent(t, 30)
	fillers := f.ipvsLines(t, "10.97.")
	badPort := proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: pt.Namespace, Name: "bad"}, Port: "p", Protocol: v1.ProtocolTCP}

	t.Log("a new Service whose virtual server the kernel refuses, while other's endpoints change")
	f.faults.set(refuseAddress("10.96.0.60"), nil, nil)
	e.OnServiceAdd(pt.Service("bad", "10.96.0.60", pt.NodePort(30060)))
	e.OnEndpointSliceAdd(f.slice("bad", "be1"))
	e.OnEndpointSliceUpdate(nil, f.slice("other", "be2"))
	res, took := f.syncCtx(ctx)
	if res.Err != nil || res.Full {
		t.Fatalf("sync: full %v, error %v; want a partial sync that succeeds", res.Full, res.Err)
	}
	t.Logf("partial sync: %v, set aside %v", took.Round(time.Millisecond), setAsideNames(res.Backend.SetAside))
	if got := setAsideNames(res.Backend.SetAside); !slices.Equal(got, []string{badPort.String()}) {
		t.Errorf("set aside %v, want %s", got, badPort)
	}
	if err := res.Backend.SetAside[badPort]; !errors.Is(err, syscall.EINVAL) {
		t.Errorf("set aside with %v, want the kernel's EINVAL", err)
	}
	f.reaches(t, "10.96.0.11:80", "be2")
	if got := f.ipvsLines(t, "10.96.0.60"); len(got) != 0 {
		t.Errorf("the refused Service has virtual servers: %v", got)
	}
	if got := f.ipvsLines(t, ":30060"); len(got) != 0 {
		t.Errorf("the refused Service has node-port virtual servers: %v", got)
	}
	if got := f.ipvsLines(t, "10.97."); !slices.Equal(got, fillers) {
		t.Errorf("the other Services' virtual servers changed:\n%s", strings.Join(minus(got, fillers), "\n"))
	}
	f.health.expectHealthy(t, "after the refusal")

	t.Log("an existing Service's change refused, while a filler's endpoints change")
	f.faults.set(refuseAddress("10.96.0.12"), nil, nil)
	e.OnEndpointSliceUpdate(nil, f.slice("moving", "be2"))
	e.OnEndpointSliceUpdate(nil, f.slice("f000", "be2"))
	res, took = f.syncCtx(ctx)
	if res.Err != nil || res.Full {
		t.Fatalf("sync: full %v, error %v; want a partial sync that succeeds", res.Full, res.Err)
	}
	t.Logf("partial sync: %v, set aside %v", took.Round(time.Millisecond), setAsideNames(res.Backend.SetAside))
	if got := setAsideNames(res.Backend.SetAside); !slices.Equal(got, []string{"ns/moving:p"}) {
		t.Errorf("set aside %v, want ns/moving:p", got)
	}
	f.reaches(t, "10.96.0.12:80", "be1")
	f.reaches(t, fillerIP(0)+":80", "be2")
	f.health.expectHealthy(t, "after the second refusal")

	t.Log("a later partial sync of another Service retries neither")
	e.OnEndpointSliceUpdate(nil, f.slice("f001", "be1"))
	res, _ = f.syncCtx(ctx)
	if res.Err != nil || res.Full || len(res.Backend.SetAside) != 0 {
		t.Errorf("sync: full %v, error %v, set aside %v; want a partial sync setting nothing aside", res.Full, res.Err, res.Backend.SetAside)
	}
	f.reaches(t, fillerIP(1)+":80", "be1")

	t.Log("accepted again: the full sync programs both")
	f.faults.set(nil, nil, nil)
	tr.setWant(2, bothBackends...)
	f.clock.Step(time.Hour)
	res, took = f.syncCtx(ctx)
	if res.Err != nil || !res.Full || len(res.Backend.SetAside) != 0 {
		t.Errorf("sync: full %v, error %v, set aside %v; want a full sync setting nothing aside", res.Full, res.Err, res.Backend.SetAside)
	}
	t.Logf("full sync: %v", took.Round(time.Millisecond))
	f.reaches(t, "10.96.0.12:80", "be2")
	f.reaches(t, "10.96.0.60:80", "be1")
	if be, _, err := request(ctx, f.client, netip.AddrPortFrom(realNodeAddr.Addr(), 30060).String()); err != nil || be != "be1" {
		t.Errorf("bad's node port: reached %q, %v", be, err)
	}
	f.health.expectHealthy(t, "at the end")
	tr.waitSent(t, 30)
	tr.stop()
	tr.expectNoFailures(t, "poisoned Service")
}

// TestRealKernelHungCall: with steady traffic, an IPVS change hangs past
// the kernel-call timeout, first before the kernel sees it, then after the
// kernel made it (its answer lost): the sync is abandoned at the deadline
// and fails, traffic keeps flowing on the rules in place, health stays 200
// and the next sync (full) programs the change.
func TestRealKernelHungCall(t *testing.T) {
	const timeout = 3 * time.Second
	f := newFaultNode(t, 10, timeout)
	ctx := t.Context()
	tr := startTraffic(t, append(f.webTraffic(), trafficTarget{from: f.pods["pod"].ns, addr: "10.96.0.11:80", want: bothBackends})...)
	tr.waitSent(t, 30)
	other := netip.MustParseAddr("10.96.0.11")
	for _, tc := range []struct {
		name string
		mode hangMode
		to   string // other's new endpoint, whose addition (or weight 1) hangs
	}{
		{"the request never reaches the kernel", hangBefore, "be2"},
		{"the kernel makes the change, its answer never comes", hangAfter, "be1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			to := f.pods[tc.to].addr
			f.faults.set(nil, func(c ipvsChange) hangMode {
				if c.svc.Address == other && c.dst != nil && c.dst.Address == to {
					return tc.mode
				}
				return noHang
			}, nil)
			f.engine.OnEndpointSliceUpdate(nil, f.slice("other", tc.to))
			res, took := f.syncCtx(ctx)
			t.Logf("hung sync ended after %v: %v", took.Round(time.Millisecond), res.Err)
			if !deadline.IsTimeout(res.Err) {
				t.Errorf("sync error %v, want a kernel call timeout", res.Err)
			}
			if took < timeout || took > timeout+10*time.Second {
				t.Errorf("the hung sync took %v, want the deadline %v plus the rest of the sync", took, timeout)
			}
			// Abandoning releases the call (the real interface closes
			// its socket): it returns soon after.
			for wait := time.Now().Add(5 * time.Second); f.faults.guard.Stuck() != 0; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(wait) {
					t.Errorf("%d abandoned calls still running 5s after the deadline", f.faults.guard.Stuck())
					break
				}
			}
			f.health.expectHealthy(t, "after the hung sync")
			f.faults.set(nil, nil, nil)
			res, took = f.syncCtx(ctx)
			if res.Err != nil || !res.Full {
				t.Fatalf("the next sync: full %v, error %v; want a full sync that succeeds", res.Full, res.Err)
			}
			t.Logf("next sync (full) programmed the change in %v", took.Round(time.Millisecond))
			f.reaches(t, "10.96.0.11:80", tc.to)
			f.health.expectHealthy(t, "after the next sync")
		})
	}
	tr.waitSent(t, 30)
	tr.stop()
	tr.expectNoFailures(t, "hung IPVS call")
}

// TestRealKernelRestart: with steady traffic to Services that exist
// throughout, an agent is killed in the middle of a full sync of 200
// Services (its IPVS changes stop after half of them: its context is
// cancelled, as kill -9 would stop them), and a new agent, knowing nothing
// of the old one, syncs the same Services over the same kernel. The
// kernel's state is then that of a clean sync of those Services on another
// node, and no request failed.
func TestRealKernelRestart(t *testing.T) {
	const (
		before  = 100 // fillers f000-f099 synced before the restart
		after   = 200 // f030-f199 wanted after it
		deleted = 30  // f000-f029 deleted
		moved   = 20  // f030-f049 move to the other backend
	)
	f := newFaultNode(t, before, 0)
	tr := startTraffic(t, append(f.webTraffic(),
		trafficTarget{from: f.pods["pod"].ns, addr: fillerIP(50) + ":80", want: []string{"be1"}},
		trafficTarget{from: f.pods["pod"].ns, addr: fillerIP(99) + ":80", want: []string{"be2"}},
	)...)
	tr.waitSent(t, 30)
	// The wanted state: web, other, moving and fillers f030-f199.
	want := func(r *realNode) {
		e := r.engine
		e.OnServiceAdd(pt.Service("web", "10.96.0.10", pt.NodePort(30080)))
		e.OnEndpointSliceAdd(r.slice("web", bothBackends...))
		e.OnServiceAdd(pt.Service("other", "10.96.0.11"))
		e.OnEndpointSliceAdd(r.slice("other", "be1"))
		e.OnServiceAdd(pt.Service("moving", "10.96.0.12"))
		e.OnEndpointSliceAdd(r.slice("moving", "be1"))
		for i := deleted; i < after; i++ {
			if i < deleted+moved {
				r.addFiller(i, []string{"be2", "be1"}[i%2])
			} else {
				r.addFiller(i)
			}
		}
	}

	// The old agent's last full sync, killed halfway through its IPVS
	// changes.
	for i := range deleted {
		name := fmt.Sprintf("f%03d", i)
		f.engine.OnServiceDelete(pt.Service(name, fillerIP(i)))
		f.engine.OnEndpointSliceDelete(f.slice(name))
	}
	want(f.realNode)
	const killAt = 130
	ctx, kill := context.WithCancel(t.Context())
	var afterKill int
	f.faults.set(nil, nil, func(n int, c ipvsChange) {
		switch {
		case n == killAt:
			kill()
		case n > killAt:
			afterKill++
		}
	})
	f.faults.changes = 0
	f.clock.Step(time.Hour)
	res, took := f.syncCtx(ctx)
	if res.Err == nil {
		t.Fatalf("the killed sync succeeded")
	}
	t.Logf("killed the full sync after %v at IPVS change %d (%d more attempted, failing): %v", took.Round(time.Millisecond), killAt, afterKill, res.Err)

	// A new agent.
	f.faults.set(nil, nil, nil)
	f.faults.changes = 0
	f.startAgent(f.agentOptions(0))
	want(f.realNode)
	res, took = f.syncCtx(t.Context())
	if res.Err != nil || !res.Full || len(res.Backend.SetAside) != 0 {
		t.Fatalf("the new agent's first sync: full %v, error %v, set aside %v", res.Full, res.Err, res.Backend.SetAside)
	}
	t.Logf("the new agent's first sync (full, %d services): %v, %d IPVS changes", after-deleted+3, took.Round(time.Millisecond), f.faults.changes)
	f.health.expectHealthy(t, "after the restart")
	tr.waitSent(t, 30)
	tr.stop()
	tr.expectNoFailures(t, "agent killed mid full sync, then restarted")

	// A clean sync of the same Services on another node.
	clean := newRealNode(t, echoServers(t))
	want(clean)
	clean.sync()
	if d := diffStates(f.kernelState(t), clean.kernelState(t)); d != "" {
		t.Errorf("the kernel after the restart differs from a clean sync:\n%s", d)
	}
	f.reaches(t, fillerIP(deleted)+":80", "be2")
	f.reaches(t, fillerIP(after-1)+":80", "be2")
	if _, _, err := request(t.Context(), f.pods["pod"].ns, fillerIP(0)+":80"); err == nil {
		t.Errorf("deleted Service f000 still answers")
	}
}
