package nftables

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/clock"
	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// The real-kernel tests run nft in a throwaway network namespace: every
// transaction the backend writes must be accepted by the installed nft and
// kernel, and what nft lists back must be what the backend wrote (so a
// restart writes nothing). They send no packets: the lead's packet tests do.

func requireNFT(t *testing.T) *netnstest.NS {
	t.Helper()
	netnstest.RequireRoot(t)
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("nft not installed")
	}
	return netnstest.New(t, "nft")
}

// nsNFT runs a real knftables.Interface inside a network namespace.
type nsNFT struct {
	ns   *netnstest.NS
	real knftables.Interface
	// log, when set, logs the duration of every call.
	log func(format string, args ...any)
}

func newNSNFT(tb testing.TB, ns *netnstest.NS, family v1.IPFamily) (*nsNFT, error) {
	n := &nsNFT{ns: ns}
	// The nft session (session.go) ends with the test.
	tb.Cleanup(func() {
		if c, ok := n.real.(io.Closer); ok {
			_ = c.Close()
		}
	})
	err := ns.Do(func() error {
		var err error
		n.real, err = NewInterface(family)
		return err
	})
	if e, ok := n.real.(*execNFT); ok {
		// Only nft starts in the namespace (a child inherits its
		// parent thread's); the rest runs as in the agent, whose
		// threads are all in the node's.
		e.startCmd = func(cmd *exec.Cmd) error { return ns.Do(cmd.Start) }
	}
	return n, err
}

// startsInNS says whether the real interface starts nft in the namespace
// itself, so that its Run and Check need no ns.Do (which would run them on
// a locked thread, costing the process CPU the agent does not spend).
func (n *nsNFT) startsInNS() bool {
	e, ok := n.real.(*execNFT)
	return ok && e.startCmd != nil
}

func (n *nsNFT) NewTransaction() *knftables.Transaction { return n.real.NewTransaction() }

func (n *nsNFT) Run(ctx context.Context, tx *knftables.Transaction) error {
	defer n.timed(fmt.Sprintf("Run (%d operations)", tx.NumOperations()))()
	if n.startsInNS() {
		return n.real.Run(ctx, tx)
	}
	return n.ns.Do(func() error { return n.real.Run(ctx, tx) })
}

// runText runs t from its text when the real interface takes text (as the
// agent's does), else as a transaction.
func (n *nsNFT) runText(ctx context.Context, t *textTx) error {
	tr, ok := n.real.(textRunner)
	if !ok {
		return n.Run(ctx, t.build())
	}
	defer n.timed("Run (text)")()
	if n.startsInNS() {
		return tr.runText(ctx, t)
	}
	return n.ns.Do(func() error { return tr.runText(ctx, t) })
}

func (n *nsNFT) Check(ctx context.Context, tx *knftables.Transaction) error {
	defer n.timed("Check")()
	if n.startsInNS() {
		return n.real.Check(ctx, tx)
	}
	return n.ns.Do(func() error { return n.real.Check(ctx, tx) })
}

func (n *nsNFT) ListAll(ctx context.Context) (out map[string][]string, err error) {
	defer n.timed("ListAll")()
	err = n.ns.Do(func() error { out, err = n.real.ListAll(ctx); return err })
	return out, err
}

// timed logs a call's duration when the test asked for it.
func (n *nsNFT) timed(what string) func() {
	if n.log == nil {
		return func() {}
	}
	start := time.Now()
	return func() { n.log("%s: %v", what, time.Since(start).Round(time.Millisecond)) }
}

func (n *nsNFT) List(ctx context.Context, objectType string) (out []string, err error) {
	err = n.ns.Do(func() error { out, err = n.real.List(ctx, objectType); return err })
	return out, err
}

func (n *nsNFT) ListRules(ctx context.Context, chain string) (out []*knftables.Rule, err error) {
	defer n.timed("ListRules")()
	err = n.ns.Do(func() error { out, err = n.real.ListRules(ctx, chain); return err })
	return out, err
}

func (n *nsNFT) ListElements(ctx context.Context, objectType, name string) (out []*knftables.Element, err error) {
	defer n.timed("ListElements " + name)()
	err = n.ns.Do(func() error { out, err = n.real.ListElements(ctx, objectType, name); return err })
	return out, err
}

func (n *nsNFT) ListCounters(ctx context.Context) (out []*knftables.Counter, err error) {
	err = n.ns.Do(func() error { out, err = n.real.ListCounters(ctx); return err })
	return out, err
}

// teeNFT runs every transaction on the real nft and on a strict fake twin
// (which the tracer reads); listings come from the real nft.
type teeNFT struct {
	*nsNFT
	fake *strictNFT
}

func (t *teeNFT) Run(ctx context.Context, tx *knftables.Transaction) error {
	if err := t.nsNFT.Run(ctx, tx); err != nil {
		return fmt.Errorf("real nft: %w\ntransaction:\n%s", err, tx.String())
	}
	if err := t.fake.Run(ctx, tx); err != nil {
		return fmt.Errorf("the real nft accepted a transaction the fake refuses: %w", err)
	}
	return nil
}

// runText runs tx's text in the real nft and its transaction in the fake.
func (t *teeNFT) runText(ctx context.Context, tx *textTx) error {
	if err := t.nsNFT.runText(ctx, tx); err != nil {
		return fmt.Errorf("real nft: %w\ntransaction:\n%s", err, tx.build().String())
	}
	if err := t.fake.Run(ctx, tx.build()); err != nil {
		return fmt.Errorf("the real nft accepted a transaction the fake refuses: %w", err)
	}
	return nil
}

func (t *teeNFT) Check(ctx context.Context, tx *knftables.Transaction) error {
	errReal, errFake := t.nsNFT.Check(ctx, tx), t.fake.Check(ctx, tx)
	if (errReal == nil) != (errFake == nil) {
		return fmt.Errorf("check: real nft says %v, the fake %v", errReal, errFake)
	}
	return errReal
}

func deleteTable(ctx context.Context, nft knftables.Interface) error {
	tx := nft.NewTransaction()
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	return nft.Run(ctx, tx)
}

// TestRealKernelCases runs every shared behaviour case against the real nft
// (flows traced over the fake twin), restarts over the table (the restart,
// reading the real table, must write nothing), deletes every service in a
// partial sync and cleans up.
func TestRealKernelCases(t *testing.T) {
	ns := requireNFT(t)
	ctx := context.Background()
	for _, c := range pt.Cases() {
		t.Run(c.Name, func(t *testing.T) {
			var env pt.Env
			var tee *teeNFT
			var first *Backend
			pt.RunCase(t, c, func(t *testing.T, e pt.Env) (proxier.Backend, pt.Tracer) {
				env = e
				real, err := newNSNFT(t, ns, e.Family)
				if err != nil {
					t.Fatal(err)
				}
				if err := deleteTable(ctx, real); err != nil {
					t.Fatal(err)
				}
				tee = &teeNFT{nsNFT: real, fake: &strictNFT{Fake: knftables.NewFake(fakeFamily(e.Family), TableName)}}
				// Chunks of 2 slots: the first sync writes them ahead
				// (preWriter), as at scale.
				b, err := New(Options{NFTables: tee, Family: e.Family, NodePortAddresses: e.NodePortAddresses,
					LocalAddresses: func() ([]netip.Addr, error) { return e.NodeIPs, nil }, EndpointChunk: 2})
				if err != nil {
					t.Fatal(err)
				}
				first = b
				return b, &fakeTracer{fake: tee.fake.Fake, local: e.NodeIPs}
			})
			if t.Failed() {
				return
			}
			if st := first.LastSync(); st.Mode != modeReconcile {
				t.Errorf("the first sync into an empty namespace was %s, want %s", st.Mode, modeReconcile)
			}

			// A new process over the table.
			twin := knftables.NewFake(fakeFamily(env.Family), TableName)
			if err := twin.ParseDump(tee.fake.Dump()); err != nil {
				t.Fatal(err)
			}
			tee2 := &teeNFT{nsNFT: tee.nsNFT, fake: &strictNFT{Fake: twin}}
			clk := testingclock.NewFakeClock(time.Unix(1_700_000_000, 0))
			b, err := New(Options{NFTables: tee2, Family: env.Family, NodePortAddresses: env.NodePortAddresses,
				LocalAddresses: func() ([]netip.Addr, error) { return env.NodeIPs, nil }, Clock: clk})
			if err != nil {
				t.Fatal(err)
			}
			e := pt.NewEngine(t, b, pt.EngineOptions{Env: env, Clock: clk, Nodes: c.Nodes, Services: c.Services, Slices: c.Slices})
			if err := e.SyncRules(ctx); err != nil {
				t.Fatalf("sync after a restart: %v", err)
			}
			if st := b.LastSync(); st.Mode != modeReconcile || st.Operations != 0 {
				t.Errorf("sync after a restart: mode %s with %d operations, want %s with none; transaction:\n%s",
					st.Mode, st.Operations, modeReconcile, twin.LastTransaction)
			}
			pt.CheckFlows(t, &fakeTracer{fake: twin, local: env.NodeIPs}, c.Flows)

			// Every service deleted by a partial sync after the canary check.
			for _, s := range c.Services {
				e.OnServiceDelete(s)
			}
			clk.Step(time.Minute)
			if err := e.SyncRules(ctx); err != nil {
				t.Fatalf("partial sync deleting every service: %v", err)
			}
			if st := b.LastSync(); st.Mode != modePartial {
				t.Errorf("the deleting sync was %s", st.Mode)
			}
			if err := b.Cleanup(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func newEngine(t testing.TB, env pt.Env, b proxier.Backend, clk clock.WithTicker) *proxier.Engine {
	t.Helper()
	e, err := proxier.NewEngine(proxier.EngineOptions{
		Family: env.Family, NodeName: env.NodeName, Backend: b,
		MasqueradeAll: env.MasqueradeAll, ClusterCIDR: env.ClusterCIDR, NodeIP: env.NodeIPs[0],
		MinSyncPeriod: time.Second, SyncPeriod: 30 * time.Second, Clock: clk,
	})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// TestRealKernelScale measures syncs at scale with the real nft
// (KPROXY_NFT_SCALE services of the standard workload, e.g. 10000; skipped
// when unset): the first sync, a restart over the table, a one-endpoint
// change, a new service.
func TestRealKernelScale(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("KPROXY_NFT_SCALE"))
	if n <= 0 {
		t.Skip("set KPROXY_NFT_SCALE to the number of services")
	}
	ns := requireNFT(t)
	ctx := context.Background()
	env := pt.Env{NodeName: "node-a", NodeIPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")},
		ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), Family: v1.IPv4Protocol}
	services, slices := pt.Workload(n)
	real, err := newNSNFT(t, ns, v1.IPv4Protocol)
	if err != nil {
		t.Fatal(err)
	}
	real.log = t.Logf
	start := func() (*Backend, *proxier.Engine) {
		b, err := New(Options{NFTables: real, Family: v1.IPv4Protocol, LocalAddresses: func() ([]netip.Addr, error) { return env.NodeIPs, nil }})
		if err != nil {
			t.Fatal(err)
		}
		e := newEngine(t, env, b, clock.RealClock{})
		for i := range services {
			e.OnServiceAdd(services[i])
			e.OnEndpointSliceAdd(slices[i])
		}
		e.OnServiceSynced()
		e.OnEndpointSlicesSynced()
		return b, e
	}
	timed := func(what string, b *Backend, e *proxier.Engine) {
		t.Helper()
		begin := time.Now()
		if err := e.SyncRules(ctx); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		st := b.LastSync()
		t.Logf("%s: %v (mode %s, %d operations, nft transactions %v, reads %v)", what, time.Since(begin).Round(time.Millisecond),
			st.Mode, st.Operations, st.KernelTime.Round(time.Millisecond), st.ReadTime.Round(time.Millisecond))
	}
	b1, e1 := start()
	timed("first sync", b1, e1)
	b2, e2 := start()
	timed("restart", b2, e2)
	sl := slices[n/2].DeepCopy()
	sl.Endpoints[0].Addresses = []string{"10.250.0.1"}
	e2.OnEndpointSliceUpdate(slices[n/2], sl)
	timed("one endpoint replaced", b2, e2)
	e2.OnServiceAdd(pt.Service("extra", "10.97.0.1"))
	e2.OnEndpointSliceAdd(pt.Slice("extra", 8080, pt.EP{IP: "10.251.0.1", Node: "node-b"}))
	timed("one service added", b2, e2)
	// Down for a while: one service's endpoint changes meanwhile.
	sl = slices[n/3].DeepCopy()
	sl.Endpoints[0].Addresses = []string{"10.250.0.2"}
	slices[n/3] = sl
	b3, e3 := start()
	e3.OnServiceAdd(pt.Service("extra", "10.97.0.1"))
	e3.OnEndpointSliceAdd(pt.Slice("extra", 8080, pt.EP{IP: "10.251.0.1", Node: "node-b"}))
	timed("restart after a change", b3, e3)
	b2 = b3
	if err := b2.Cleanup(ctx); err != nil {
		t.Fatal(err)
	}
}
