package nftables

import (
	"context"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// syncLoop runs an engine's sync loop (the runner, as the agent does) on a
// fake clock, and hands over each sync's result.
type syncLoop struct {
	t      *testing.T
	clk    *testingclock.FakeClock
	syncs  chan proxier.SyncResult
	cancel context.CancelFunc
	done   chan struct{}
}

// newSyncLoop returns a loop whose syncs channel the engine's OnSync must
// feed (onSync); start starts it.
func newSyncLoop(t *testing.T, clk *testingclock.FakeClock) *syncLoop {
	return &syncLoop{t: t, clk: clk, syncs: make(chan proxier.SyncResult, 16), done: make(chan struct{})}
}

func (l *syncLoop) onSync(r proxier.SyncResult) { l.syncs <- r }

func (l *syncLoop) start(e *proxier.Engine) {
	ctx, cancel := context.WithCancel(context.Background())
	l.cancel = cancel
	go func() {
		defer close(l.done)
		e.SyncLoop(ctx)
	}()
	l.t.Cleanup(func() {
		cancel()
		<-l.done
	})
}

// next waits for the next sync, moving the fake clock on by a second
// whenever the loop sleeps, for at most limit of fake time; it returns the
// sync's result and the fake time that passed.
func (l *syncLoop) next(limit time.Duration) (proxier.SyncResult, time.Duration) {
	l.t.Helper()
	start := l.clk.Now()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		select {
		case r := <-l.syncs:
			return r, l.clk.Since(start)
		default:
		}
		if l.clk.HasWaiters() {
			if l.clk.Since(start) >= limit {
				l.t.Fatalf("no sync within %v of fake time", limit)
			}
			l.clk.Step(time.Second)
			continue
		}
		time.Sleep(time.Millisecond)
	}
	l.t.Fatal("timed out waiting for a sync")
	return proxier.SyncResult{}, 0
}

// TestIdleNodeRepairsWithinSyncPeriod: with nothing changing, the sync
// loop still syncs once per sync period, and that sync notices a flushed
// or deleted table, chain, map or set (the canary check runs on it: the
// command sets CanaryInterval to the sync period) and rebuilds the table.
func TestIdleNodeRepairsWithinSyncPeriod(t *testing.T) {
	const syncPeriod = 30 * time.Second // pt.NewEngine's
	for _, tc := range []struct {
		name   string
		tamper func(tx *knftables.Transaction)
	}{
		{name: "table deleted", tamper: func(tx *knftables.Transaction) { tx.Delete(&knftables.Table{}) }},
		{name: "base chain flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Chain{Name: chainNATPrerouting}) }},
		{name: "pick chain flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Chain{Name: "pick-ip-tcp-c1"}) }},
		{name: "endpoints map flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Map{Name: endpointsMap("tcp")}) }},
		{name: "sync-state flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Set{Name: setSyncState}) }},
		{name: "source ranges flushed", tamper: func(tx *knftables.Transaction) { tx.Flush(&knftables.Set{Name: setFirewallAllow}) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{CanaryInterval: syncPeriod})
			loop := newSyncLoop(t, h.clock)
			objects := pt.EngineOptions{Env: pt.DefaultEnv(), Clock: h.clock, OnSync: loop.onSync}
			for i := range 5 {
				s, sl := svcN(i)
				objects.Services = append(objects.Services, s)
				objects.Slices = append(objects.Slices, sl)
			}
			e := pt.NewEngine(t, h.backend, objects)
			loop.start(e)
			if r, _ := loop.next(time.Second); r.Err != nil || !r.Full {
				t.Fatalf("first sync: full %v, err %v", r.Full, r.Err)
			}
			// A few idle syncs first: the canary runs on each.
			for range 2 {
				if r, _ := loop.next(syncPeriod); r.Err != nil {
					t.Fatal(r.Err)
				}
			}
			tx := h.fake.NewTransaction()
			tc.tamper(tx)
			if err := h.fake.Run(context.Background(), tx); err != nil {
				t.Fatal(err)
			}
			r, took := loop.next(syncPeriod)
			if r.Err != nil {
				t.Fatal(r.Err)
			}
			if st := h.backend.LastSync(); st.Mode != modeRebuild {
				t.Errorf("the sync %v after the damage was %s, want %s", took, st.Mode, modeRebuild)
			}
			h.flows(pt.Flow{Name: "works", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.2:8080"}})
			checkTable(t, h, func(f *harness) { addServices(f, 5) })
		})
	}
}

// TestRealKernelIdleRepair: an idle node whose table someone flushes is
// repaired by the sync loop within one sync period, and real traffic flows
// again.
func TestRealKernelIdleRepair(t *testing.T) {
	rt := newRealTable(t)
	loop := newSyncLoop(t, rt.clk)
	e := pt.NewEngine(t, rt.backend, pt.EngineOptions{Env: rt.env, Clock: rt.clk, OnSync: loop.onSync,
		Nodes: rt.c.Nodes, Services: rt.c.Services, Slices: rt.c.Slices})
	loop.start(e)
	if r, _ := loop.next(time.Second); r.Err != nil {
		t.Fatal(r.Err)
	}
	rt.nft(t, "flush table ip kproxy")
	rt.rc.CheckKernelFlows(t, unhandled(rt.c.Flows, nil))
	r, took := loop.next(30 * time.Second)
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	if st := rt.backend.LastSync(); st.Mode != modeRebuild {
		t.Errorf("the sync %v after the flush was %s, want %s", took, st.Mode, modeRebuild)
	}
	rt.rc.CheckKernelFlows(t, rt.c.Flows)
}
