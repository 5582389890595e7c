package iptables

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// refusedMatch parses in iptables and is refused by every kernel (a hash
// table garbage-collected every 0 ms is an invalid xt_hashlimit value); the
// fake cannot parse it, which refuses it as well.
const refusedMatch = "-m hashlimit --hashlimit-upto 1/sec --hashlimit-name kpt-refused --hashlimit-htable-gcinterval 0"

// faultIPTables injects kernel refusals at the Interface boundary, into the
// restore input kproxy hands over:
//
//   - poisoned: every rule holding all the strings of one of its entries
//     (say a service port's name as in the rules' comments, "ns/name:port",
//     and an endpoint) gets refusedMatch, as if the kernel could not load
//     it;
//   - secondTable: every table section from the second one written since
//     it was set gets a refused rule in the canary chain, which no service
//     port explains: the second table of a sync fails.
//
// Line numbers are kept, except after the inserted rule.
type faultIPTables struct {
	ipt.Interface
	mu          sync.Mutex
	poisoned    [][]string
	secondTable bool
	sections    int
}

func (f *faultIPTables) poison(entries ...[]string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.poisoned = entries
}

// poisonedLine reports whether line holds every string of an entry.
func (f *faultIPTables) poisonedLine(line string) bool {
	return slices.ContainsFunc(f.poisoned, func(entry []string) bool {
		return !slices.ContainsFunc(entry, func(s string) bool { return !strings.Contains(line, s) })
	})
}

func (f *faultIPTables) failSecondTable(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.secondTable, f.sections = on, 0
}

func (f *faultIPTables) Restore(ctx context.Context, data []byte) error {
	f.mu.Lock()
	var out strings.Builder
	for line := range strings.Lines(string(data)) {
		switch {
		case strings.HasPrefix(line, "*"):
			f.sections++
		case line == "COMMIT\n" && f.secondTable && f.sections >= 2:
			out.WriteString("-A " + chainCanary + " " + refusedMatch + " -j RETURN\n")
		case strings.HasPrefix(line, "-A ") && f.poisonedLine(line):
			args := strings.SplitN(line, " ", 3)
			line = args[0] + " " + args[1] + " " + refusedMatch + " " + args[2]
		}
		out.WriteString(line)
	}
	f.mu.Unlock()
	return f.Interface.Restore(ctx, []byte(out.String()))
}

// numbered is the flow to NumberedService(i)'s ClusterIP from a pod,
// delivered to ep (an endpoint IP), or not handled when ep is "".
func numbered(i int, ep string) pt.Flow {
	f := pt.Flow{Name: fmt.Sprintf("s%04d", i), Source: "10.244.1.9", Dest: fmt.Sprintf("10.96.0.%d", i+1), Port: 80, Want: pt.NotHandled}
	if ep != "" {
		f.Want, f.WantEndpoints = pt.Delivered, []string{ep + ":8080"}
	}
	return f
}

// moveEndpoint gives NumberedService(i) the endpoint ip instead.
func moveEndpoint(e *proxier.Engine, i int, ip string) {
	_, sl := pt.NumberedService(i)
	sl.Endpoints[0].Addresses = []string{ip}
	e.OnEndpointSliceUpdate(nil, sl)
}

func setAsideNames(r proxier.SyncResult) []string {
	var out []string
	for name := range r.Backend.SetAside {
		out = append(out, name.String())
	}
	slices.Sort(out)
	return out
}

// TestSetAsideRefusedServicePorts: the ports whose rules the kernel
// refuses are set aside and keep their last good rules (none when they
// never had any); everything else is programmed in the same sync, later
// partial syncs program other changes without retrying them, a change of
// theirs retries them, and a full sync retries them all.
func TestSetAsideRefusedServicePorts(t *testing.T) {
	for _, tc := range []struct {
		name     string
		atCommit bool
	}{
		{name: "the refusal names the rule (iptables-nft)"},
		{name: "the refusal names the table's COMMIT (iptables-legacy): bisection", atCommit: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			// refuse makes the kernel refuse the rules with these
			// arguments (DNATs to these endpoints).
			refuse := func(values ...string) {
				h.fake.SetRefusal(func(_ ipt.Table, _ ipt.Chain, args []string) error {
					for _, v := range values {
						if slices.Contains(args, v) {
							return errors.New("the kernel refuses " + v)
						}
					}
					return nil
				}, tc.atCommit)
			}
			pt.AddNumberedServices(h.engine, 40)
			h.sync()
			sync := func(wantAside ...string) SyncStats {
				t.Helper()
				st := h.sync()
				if got := setAsideNames(h.last); !slices.Equal(got, wantAside) {
					t.Fatalf("set aside %v, want %v", got, wantAside)
				}
				if st.SetAside != len(wantAside) {
					t.Errorf("SyncStats.SetAside = %d, want %d", st.SetAside, len(wantAside))
				}
				return st
			}

			// s0002 and s0003 change; s0002's new rules are refused.
			refuse("10.244.7.2:8080", "10.244.8.2:8080")
			moveEndpoint(h.engine, 2, "10.244.7.2")
			moveEndpoint(h.engine, 3, "10.244.7.3")
			if st := sync("ns/s0002:p"); st.Full {
				t.Error("setting a port aside made the sync full")
			}
			h.flows(numbered(2, "10.244.2.3"), numbered(3, "10.244.7.3"), numbered(1, "10.244.2.2"))

			// Another change is programmed by a partial sync, which does
			// not retry s0002.
			moveEndpoint(h.engine, 4, "10.244.7.4")
			if st := sync("ns/s0002:p"); st.Full || st.Attempts != 1 {
				t.Errorf("sync %+v, want a partial sync of one attempt", st)
			}
			h.flows(numbered(2, "10.244.2.3"), numbered(4, "10.244.7.4"))

			// A new port refused never had rules: it gets none.
			refuse("10.244.7.2:8080", "10.244.8.2:8080", "10.244.2.46:8080")
			s, sl := pt.NumberedService(45)
			h.engine.OnServiceAdd(s)
			h.engine.OnEndpointSliceAdd(sl)
			sync("ns/s0002:p", "ns/s0045:p")
			h.flows(numbered(45, ""), numbered(2, "10.244.2.3"))

			// A change of a port set aside retries it.
			moveEndpoint(h.engine, 2, "10.244.8.2")
			if st := sync("ns/s0002:p", "ns/s0045:p"); st.Attempts < 2 {
				t.Errorf("a change of a port set aside was not retried: %+v", st)
			}
			h.flows(numbered(2, "10.244.2.3"))

			// The kernel takes them again: a partial sync without their
			// change leaves them aside, the full sync programs them.
			refuse()
			sync("ns/s0002:p", "ns/s0045:p")
			h.clock.Step(proxier.DefaultFullSyncPeriod)
			if st := sync(); !st.Full {
				t.Error("the hourly sync was not full")
			}
			h.flows(numbered(2, "10.244.8.2"), numbered(45, "10.244.2.46"), numbered(3, "10.244.7.3"))
			if h.last.Err != nil {
				t.Errorf("sync result error %v", h.last.Err)
			}
		})
	}
}

// TestSetAsideAtTheFirstSync: a port refused by the first (full) sync of a
// kproxy that just started gets no rules; the others are programmed.
func TestSetAsideAtTheFirstSync(t *testing.T) {
	for _, atCommit := range []bool{false, true} {
		t.Run(fmt.Sprintf("atCommit=%v", atCommit), func(t *testing.T) {
			h := newHarness(t, nil, Options{BatchChains: 10})
			h.fake.SetRefusal(func(_ ipt.Table, _ ipt.Chain, args []string) error {
				if slices.Contains(args, "ns/s0017:p") {
					return errors.New("refused")
				}
				return nil
			}, atCommit)
			pt.AddNumberedServices(h.engine, 30)
			if st := h.sync(); !st.Full || st.SetAside != 1 {
				t.Fatalf("first sync %+v, want full with one port set aside", st)
			}
			h.flows(numbered(17, ""), numbered(16, "10.244.2.17"), numbered(29, "10.244.2.30"), numbered(0, "10.244.2.1"))
		})
	}
}

// TestUnexplainedRefusalFailsTheSync: a refusal that no port explains (its
// rule is nobody's, and it stays when every changed port is set aside)
// fails the sync, which makes the next one full.
func TestUnexplainedRefusalFailsTheSync(t *testing.T) {
	h := newHarness(t, nil, Options{})
	pt.AddNumberedServices(h.engine, 5)
	h.sync()
	h.fake.SetRefusal(func(_ ipt.Table, chain ipt.Chain, _ []string) error {
		if chain == chainCanary {
			return errors.New("refused")
		}
		return nil
	}, false)
	moveEndpoint(h.engine, 1, "10.244.7.1")
	h.clock.Step(proxier.DefaultFullSyncPeriod)
	if err := h.engine.SyncRules(context.Background()); err == nil {
		t.Fatal("sync succeeded although the canary chain is refused")
	}
	if len(h.last.Backend.SetAside) != 0 {
		t.Errorf("set aside %v for a refusal nobody explains", setAsideNames(h.last))
	}
}

// TestSecondTableFailure: a sync whose second table write fails leaves
// every service either as before or as after, never without both its DNAT
// and its reject (docs/design.md, "Atomic syncs across tables"), and the
// next sync repairs it. One iptables-restore of nat then filter would
// commit nat (the DNAT gone) and fail filter (no reject): traffic to the
// service would go nowhere.
func TestSecondTableFailure(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(e *proxier.Engine)
		// during: the verdicts allowed while the sync failed.
		during []pt.Verdict
		after  pt.Verdict
	}{
		{
			name: "the service loses its endpoints",
			change: func(e *proxier.Engine) {
				_, sl := pt.NumberedService(1)
				e.OnEndpointSliceDelete(sl)
			},
			during: []pt.Verdict{pt.Delivered, pt.Rejected}, after: pt.Rejected,
		},
		{
			name: "the service gets its first endpoint",
			change: func(e *proxier.Engine) {
				_, sl := pt.NumberedService(1)
				e.OnEndpointSliceAdd(sl)
			},
			during: []pt.Verdict{pt.Delivered, pt.Rejected}, after: pt.Delivered,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := iptablestest.NewFake(ipt.ProtocolIPv4)
			faults := &faultIPTables{Interface: fake}
			h := newHarness(t, fake, Options{IPTables: faults})
			pt.AddNumberedServices(h.engine, 5)
			if tc.after == pt.Delivered {
				_, sl := pt.NumberedService(1)
				h.engine.OnEndpointSliceDelete(sl)
			}
			h.sync()
			tc.change(h.engine)
			faults.failSecondTable(true)
			if err := h.engine.SyncRules(context.Background()); err == nil {
				t.Fatal("the sync succeeded although its second table failed")
			}
			res, err := (&fakeTracer{fake: h.fake, local: h.local}).Trace(numbered(1, ""))
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Contains(tc.during, res.Verdict) {
				t.Errorf("after the failed sync the service's traffic is %v, want one of %v", res.Verdict, tc.during)
			}
			faults.failSecondTable(false)
			if st := h.sync(); !st.Full {
				t.Error("the sync after a failure was not full")
			}
			want := numbered(1, "10.244.2.2")
			if tc.after != pt.Delivered {
				want = pt.Flow{Name: "rejected", Source: want.Source, Dest: want.Dest, Port: 80, Want: tc.after}
			}
			h.flows(want, numbered(2, "10.244.2.3"))
		})
	}
}

// TestFlushRepaired: a flush of kproxy's chains (the table flushed, with
// or without its chains deleted) or of its hooks is noticed by the next
// partial sync once half a CanaryInterval has passed, which then is full.
func TestFlushRepaired(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flush string // restore input
	}{
		{name: "nat -F", flush: "*nat\n-F\nCOMMIT\n"},
		{name: "nat -F -X", flush: "*nat\n-F\n-X\nCOMMIT\n"},
		{name: "filter -F", flush: "*filter\n-F\nCOMMIT\n"},
		{name: "filter -F -X", flush: "*filter\n-F\n-X\nCOMMIT\n"},
		{name: "nat PREROUTING -F", flush: "*nat\n-F PREROUTING\nCOMMIT\n"},
		{name: "filter FORWARD -F", flush: "*filter\n-F FORWARD\nCOMMIT\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{CanaryInterval: 30 * time.Second})
			pt.AddNumberedServices(h.engine, 3)
			_, sl := pt.NumberedService(2)
			h.engine.OnEndpointSliceDelete(sl)
			h.sync()
			before := saveAll(t, h)
			if err := h.fake.Restore(context.Background(), []byte(tc.flush)); err != nil {
				t.Fatal(err)
			}
			// Before half the interval: not checked yet.
			h.clock.Step(14 * time.Second)
			if st := h.sync(); st.Full {
				t.Fatal("checked before half the canary interval")
			}
			h.clock.Step(time.Second)
			if st := h.sync(); !st.Full {
				t.Fatal("the flush was not noticed")
			}
			if after := saveAll(t, h); after != before {
				t.Errorf("after the repair:\n%s\nwant:\n%s", after, before)
			}
			h.flows(numbered(0, "10.244.2.1"), pt.Flow{Name: "reject", Source: "10.244.1.9", Dest: "10.96.0.3", Port: 80, Want: pt.Rejected})
		})
	}
}

// saveAll is the fake's nat and filter tables.
func saveAll(t *testing.T, h *harness) string {
	t.Helper()
	var b strings.Builder
	for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
		data, err := h.fake.SaveInto(context.Background(), table)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(data)
	}
	return b.String()
}

// TestSetAsideRefusals covers the other ways a port is set aside.
func TestSetAsideRefusals(t *testing.T) {
	for _, tc := range []struct {
		name   string
		refuse func(table ipt.Table, args []string) bool
		change func(e *proxier.Engine)
		// want is the flow to s0002 after the sync.
		want pt.Flow
	}{
		{
			name:   "its last good rules are refused too: no rules",
			refuse: func(_ ipt.Table, args []string) bool { return slices.Contains(args, "ns/s0002:p") },
			change: func(e *proxier.Engine) { moveEndpoint(e, 2, "10.244.7.2") },
			want:   numbered(2, ""),
		},
		{
			name: "its new reject in filter is refused: it keeps its DNAT",
			refuse: func(table ipt.Table, args []string) bool {
				return table == ipt.TableFilter && slices.ContainsFunc(args, func(a string) bool { return strings.HasPrefix(a, "ns/s0002:p ") })
			},
			change: func(e *proxier.Engine) {
				_, sl := pt.NumberedService(2)
				e.OnEndpointSliceDelete(sl)
			},
			want: numbered(2, "10.244.2.3"),
		},
	} {
		for _, atCommit := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/atCommit=%v", tc.name, atCommit), func(t *testing.T) {
				h := newHarness(t, nil, Options{})
				pt.AddNumberedServices(h.engine, 5)
				h.sync()
				h.fake.SetRefusal(func(table ipt.Table, _ ipt.Chain, args []string) error {
					if tc.refuse(table, args) {
						return errors.New("refused")
					}
					return nil
				}, atCommit)
				tc.change(h.engine)
				moveEndpoint(h.engine, 3, "10.244.7.3")
				h.sync()
				if got := setAsideNames(h.last); !slices.Equal(got, []string{"ns/s0002:p"}) {
					t.Errorf("set aside %v, want ns/s0002:p", got)
				}
				h.flows(tc.want, numbered(3, "10.244.7.3"), numbered(1, "10.244.2.2"))
			})
		}
	}
}
