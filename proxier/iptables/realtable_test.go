package iptables

import (
	"context"
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestBehaviourCasesRealKernel runs the shared behaviour cases on a real
// kernel (proxiertest.RunRealKernel describes the topology and the
// verdicts): the engine and this backend program the real iptables of a
// throwaway "node" namespace, every flow is sent as real packets, and the
// packet tracer, tracing each flow over a mirror of the very rules the
// kernel runs, must agree with the kernel.
func TestBehaviourCasesRealKernel(t *testing.T) {
	pt.RunRealKernel(t, pt.RealKernel{
		NSPrefix:         "bt",
		CheckKernel:      checkRealNAT,
		NewBackend:       newRealTableBackend,
		ForgetAffinity:   pt.ForgetRecentLists,
		KnownDivergences: realKnownDivergences,
	})
}

// realKnownDivergences by "case / flow". None today: on every flow sent,
// the kernel, the tracer and the cases agree.
var realKnownDivergences = map[string]pt.KnownDivergence{}

// realFamilyOf is the address plan of family.
func realFamilyOf(family v1.IPFamily) realFamily {
	if family == v1.IPv6Protocol {
		return realIPv6
	}
	return realIPv4
}

// checkRealNAT: the node namespace has the family's nat table.
func checkRealNAT(ctx context.Context, node *netnstest.NS, family v1.IPFamily) error {
	fam := realFamilyOf(family)
	if _, err := node.Exec(ctx, fam.iptables, "-w", "5", "-t", "nat", "-S"); err != nil {
		return fmt.Errorf("no %s nat table: %w", fam.protocol, err)
	}
	return nil
}

// newRealTableBackend makes the backend over the node's real iptables,
// mirrored into a fake for the tracer.
func newRealTableBackend(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
	t.Helper()
	fam := realFamilyOf(node.Env.Family)
	real, err := ipt.New(t.Context(), ipt.Options{Protocol: fam.protocol, NetNS: node.NS.Name})
	if err != nil {
		t.Fatalf("iptables in %s: %v", node.NS.Name, err)
	}
	t.Cleanup(func() {
		if err := real.(*ipt.Real).Close(); err != nil {
			t.Error(err)
		}
	})
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
			out, err := real.SaveInto(context.Background(), table)
			t.Logf("%s-save -t %s in the node namespace (err %v):\n%s", fam.protocol, table, err, out)
		}
	})
	mirror := iptablestest.NewFake(fam.protocol)
	mirror.RandomFully = real.HasRandomFully()
	backend, err := New(Options{
		IPTables: &mirroredIPTables{Interface: real, fake: mirror}, NodePortAddresses: node.Env.NodePortAddresses,
		LocalAddresses: node.LocalAddresses,
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return backend, &mirrorTracer{fake: mirror, node: node}
}

// mirrorTracer traces flows over the mirror, with the node namespace's
// addresses as the local ones.
type mirrorTracer struct {
	fake *iptablestest.Fake
	node pt.RealNode
}

func (m *mirrorTracer) Trace(f pt.Flow) (pt.Result, error) {
	return traceFlow(m.fake, m.node.Addrs, f, nil)
}

// mirroredIPTables applies every change to the real iptables and then to a
// fake, so the tracer can trace the very rules the kernel runs. Reads go to
// the real one.
type mirroredIPTables struct {
	ipt.Interface
	fake *iptablestest.Fake
}

// mirrored runs real, then (if it succeeded) fake.
func mirrored[T any](real func() (T, error), fake func() error) (T, error) {
	v, err := real()
	if err != nil {
		return v, err
	}
	if err := fake(); err != nil {
		return v, fmt.Errorf("mirroring into the fake iptables: %w", err)
	}
	return v, nil
}

// noValue adapts an error-only operation to mirrored.
func noValue(op func() error) func() (struct{}, error) {
	return func() (struct{}, error) { return struct{}{}, op() }
}

func (m *mirroredIPTables) EnsureChain(ctx context.Context, table ipt.Table, chain ipt.Chain) (bool, error) {
	return mirrored(func() (bool, error) { return m.Interface.EnsureChain(ctx, table, chain) },
		func() error { _, err := m.fake.EnsureChain(ctx, table, chain); return err })
}

func (m *mirroredIPTables) EnsureRule(ctx context.Context, pos ipt.RulePosition, table ipt.Table, chain ipt.Chain, args ...string) (bool, error) {
	return mirrored(func() (bool, error) { return m.Interface.EnsureRule(ctx, pos, table, chain, args...) },
		func() error { _, err := m.fake.EnsureRule(ctx, pos, table, chain, args...); return err })
}

func (m *mirroredIPTables) DeleteRule(ctx context.Context, table ipt.Table, chain ipt.Chain, args ...string) error {
	_, err := mirrored(noValue(func() error { return m.Interface.DeleteRule(ctx, table, chain, args...) }),
		func() error { return m.fake.DeleteRule(ctx, table, chain, args...) })
	return err
}

func (m *mirroredIPTables) FlushChain(ctx context.Context, table ipt.Table, chain ipt.Chain) error {
	_, err := mirrored(noValue(func() error { return m.Interface.FlushChain(ctx, table, chain) }),
		func() error { return m.fake.FlushChain(ctx, table, chain) })
	return err
}

func (m *mirroredIPTables) DeleteChain(ctx context.Context, table ipt.Table, chain ipt.Chain) error {
	_, err := mirrored(noValue(func() error { return m.Interface.DeleteChain(ctx, table, chain) }),
		func() error { return m.fake.DeleteChain(ctx, table, chain) })
	return err
}

func (m *mirroredIPTables) Restore(ctx context.Context, data []byte) error {
	_, err := mirrored(noValue(func() error { return m.Interface.Restore(ctx, data) }),
		func() error { return m.fake.Restore(ctx, data) })
	return err
}
