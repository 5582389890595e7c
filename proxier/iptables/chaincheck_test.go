package iptables

import (
	"context"
	"strings"
	"testing"
	"time"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// numberedChain is a chain of kind of NumberedService(i).
func numberedChain(kind string, i int) string {
	s, _ := pt.NumberedService(i)
	return servicePortChain(kind, pt.ServicePortNameOf(s, "p"))
}

// deleteRuleWith deletes the first rule of table/chain containing text.
func deleteRuleWith(t *testing.T, h *harness, table ipt.Table, chain, text string) {
	t.Helper()
	for _, r := range h.fake.Rules(table, ipt.Chain(chain)) {
		if strings.Contains(r, text) {
			args, err := ipt.SplitArgs(r)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.fake.DeleteRule(context.Background(), table, ipt.Chain(chain), args...); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("no rule of %s/%s contains %q", table, chain, text)
}

// TestChainFlushRepaired: someone else flushing one of kproxy's chains
// (not the whole table), or deleting one rule of one, is noticed by the
// next partial sync once half a CanaryInterval has passed, although
// nothing changed: that sync is full and puts every rule back
// (docs/design.md, "Flush detection").
func TestChainFlushRepaired(t *testing.T) {
	flush := func(table ipt.Table, chain string) func(t *testing.T, h *harness) {
		return func(t *testing.T, h *harness) {
			if err := h.fake.FlushChain(context.Background(), table, ipt.Chain(chain)); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, h *harness)
	}{
		{name: "nat service chain -F", damage: flush(ipt.TableNAT, numberedChain(kindCluster, 1))},
		{name: "nat external chain -F", damage: flush(ipt.TableNAT, numberedChain(kindExternal, 1))},
		{name: "nat KPROXY-SERVICES -F", damage: flush(ipt.TableNAT, chainServices)},
		{name: "nat KPROXY-NODEPORTS -F", damage: flush(ipt.TableNAT, chainNodePorts)},
		{name: "nat KPROXY-MARK-MASQ -F", damage: flush(ipt.TableNAT, chainMarkMasq)},
		{name: "nat KPROXY-POSTROUTING -F", damage: flush(ipt.TableNAT, chainPostrouting)},
		{name: "filter KPROXY-SERVICES -F", damage: flush(ipt.TableFilter, chainServices)},
		{name: "filter KPROXY-FORWARD -F", damage: flush(ipt.TableFilter, chainForward)},
		{name: "one rule of nat KPROXY-SERVICES deleted", damage: func(t *testing.T, h *harness) {
			deleteRuleWith(t, h, ipt.TableNAT, chainServices, "-d 10.96.0.2/32")
		}},
		{name: "the DNAT rule of a service chain deleted", damage: func(t *testing.T, h *harness) {
			deleteRuleWith(t, h, ipt.TableNAT, numberedChain(kindCluster, 0), "DNAT")
		}},
		{name: "a hook deleted", damage: func(t *testing.T, h *harness) {
			deleteRuleWith(t, h, ipt.TableNAT, string(ipt.ChainOutput), chainServices)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{CanaryInterval: 30 * time.Second})
			pt.AddNumberedServices(h.engine, 3)
			_, sl := pt.NumberedService(2)
			h.engine.OnEndpointSliceDelete(sl)
			h.sync()
			before := saveAll(t, h)
			tc.damage(t, h)
			if saveAll(t, h) == before {
				t.Fatal("the damage changed nothing")
			}
			h.clock.Step(15 * time.Second)
			if st := h.sync(); !st.Full {
				t.Fatal("the damage was not noticed")
			}
			if after := saveAll(t, h); after != before {
				t.Errorf("after the repair:\n%s\nwant:\n%s", after, before)
			}
			h.flows(numbered(0, "10.244.2.1"), numbered(1, "10.244.2.2"),
				pt.Flow{Name: "reject", Source: "10.244.1.9", Dest: "10.96.0.3", Port: 80, Want: pt.Rejected})
		})
	}
}

// TestChainCheckNoFalseAlarm: partial syncs that add, change and delete
// services, including the dispatch tree changing shape (more than 64
// rules) and chains being deleted, leave a kernel that the check finds
// intact: no sync after them is full.
func TestChainCheckNoFalseAlarm(t *testing.T) {
	h := newHarness(t, nil, Options{CanaryInterval: 30 * time.Second})
	pt.AddNumberedServices(h.engine, 60)
	if st := h.sync(); !st.Full {
		t.Fatal("the first sync was not full")
	}
	check := func(what string) {
		t.Helper()
		h.clock.Step(15 * time.Second)
		if st := h.sync(); st.Full {
			t.Fatalf("after %s: the check found damage where there is none", what)
		}
		damaged, err := h.backend.flushed(context.Background())
		if err != nil || len(damaged) > 0 {
			t.Fatalf("after %s: flushed = %v, %v", what, damaged, err)
		}
	}
	check("the first sync")
	for i := 60; i < 80; i++ {
		s, sl := pt.NumberedService(i)
		h.engine.OnServiceAdd(s)
		h.engine.OnEndpointSliceAdd(sl)
	}
	h.sync()
	check("services added (the tree grows)")
	moveEndpoint(h.engine, 3, "10.244.9.9")
	h.sync()
	check("an endpoint moved")
	for i := 0; i < 30; i++ {
		s, sl := pt.NumberedService(i)
		h.engine.OnEndpointSliceDelete(sl)
		h.engine.OnServiceDelete(s)
	}
	h.sync()
	check("services deleted (the tree shrinks)")
}
