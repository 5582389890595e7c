package nftables

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// The poisoned service "bad": ClusterIP 10.96.9.9, node port 31999. The
// strict fake refuses what mentions its ClusterIP (refuseMentions), as a
// kernel refuses what it cannot take.
const badClusterIP = "10.96.9.9"

var badName = proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: pt.Namespace, Name: "bad"}, Port: "p", Protocol: v1.ProtocolTCP}

// addBad adds or updates "bad" with endpoints eps (on node-b).
func addBad(h *harness, eps ...string) {
	h.engine.OnServiceAdd(pt.Service("bad", badClusterIP, pt.NodePort(31999)))
	var list []pt.EP
	for _, ip := range eps {
		list = append(list, pt.EP{IP: ip, Node: "node-b"})
	}
	h.engine.OnEndpointSliceUpdate(nil, pt.Slice("bad", 8080, list...))
}

// refuseMentions refuses the element additions that mention any of words.
func refuseMentions(words ...string) func(string) bool {
	return func(line string) bool {
		if !strings.HasPrefix(line, "add element ") {
			return false
		}
		for _, w := range words {
			if strings.Contains(line, w) {
				return true
			}
		}
		return false
	}
}

// changeS3 replaces s0003's endpoint: the change another service makes
// while "bad" is refused.
func changeS3(h *harness) {
	_, sl := svcN(3)
	sl.Endpoints[0].Addresses = []string{"10.244.7.7"}
	h.engine.OnEndpointSliceUpdate(nil, sl)
}

var (
	flowS3Changed = pt.Flow{Name: "s0003 changed", Source: "10.244.1.9", Dest: "10.96.0.4", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.7.7:8080"}}
	flowS5        = pt.Flow{Name: "s0005", Source: "10.244.1.9", Dest: "10.96.0.6", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.6:8080"}}
	flowBadGone   = pt.Flow{Name: "bad", Source: "10.244.1.9", Dest: badClusterIP, Port: 80, Want: pt.NotHandled}
	flowBadNPGone = pt.Flow{Name: "bad node port", Source: "192.0.2.1", Dest: "10.0.0.1", Port: 31999, Want: pt.NotHandled}
)

func flowBad(eps ...string) []pt.Flow {
	var want []string
	for _, ip := range eps {
		want = append(want, ip+":8080")
	}
	return []pt.Flow{
		{Name: "bad", Source: "10.244.1.9", Dest: badClusterIP, Port: 80, Want: pt.Delivered, WantEndpoints: want},
		{Name: "bad node port", Source: "192.0.2.1", Dest: "10.0.0.1", Port: 31999, Want: pt.Delivered, WantEndpoints: want, WantMasquerade: true},
	}
}

// checkSetAside checks the last sync: no error, exactly want set aside
// after it (Backend.SetAside), and its result's SetAside, the service
// ports it refused, among them; refusedNow says that it refused all of
// them (it retried them).
func checkSetAside(t *testing.T, h *harness, refusedNow bool, want ...proxy.ServicePortName) {
	t.Helper()
	if h.last.Err != nil {
		t.Fatalf("sync failed: %v", h.last.Err)
	}
	current := h.backend.SetAside()
	if got := slices.SortedFunc(maps.Keys(current), proxy.ServicePortName.Compare); !slices.Equal(got, want) {
		t.Errorf("set aside %v, want %v", current, want)
	}
	for name, err := range current {
		if err == nil {
			t.Errorf("%s set aside without an error", name)
		}
	}
	got := slices.SortedFunc(maps.Keys(h.last.Backend.SetAside), proxy.ServicePortName.Compare)
	switch {
	case refusedNow && !slices.Equal(got, want):
		t.Errorf("the sync refused %v, want %v", got, want)
	case !refusedNow && len(got) > 0:
		t.Errorf("the sync refused %v, want none (it retried nothing)", got)
	}
}

// checkTable checks that the table is consistent (its digest and hashes
// say what it holds) and is the one a fresh process writes for the
// objects setup gives it.
func checkTable(t *testing.T, h *harness, setup func(h *harness)) {
	t.Helper()
	got := canonicalDump(h.fake)
	if strings.Contains(got, "inconsistent") {
		t.Errorf("the table is inconsistent:\n%s", got)
	}
	if want := freshDump(t, setup); got != want {
		t.Errorf("table differs from a fresh one's:\n%s", diff(got, want))
	}
}

// TestSetAsideFullSync: a full sync with a poisoned service among others
// programs the others, sets the poisoned one aside (it never had
// anything, so it has nothing) and reports it; later syncs leave it aside
// without rebuilding, a full sync still refused sets it aside again, and
// one no longer refused programs it.
func TestSetAsideFullSync(t *testing.T) {
	for _, tc := range []struct {
		name string
		// noLine: the refusal names no line (bisection).
		noLine bool
		// chunk: the endpoint slots go ahead in chunks of that many
		// (preWriter), some refused.
		chunk int
	}{
		{name: "refusal names the line"},
		{name: "refusal names nothing", noLine: true},
		{name: "slots written ahead, refusal names the line", chunk: 2},
		{name: "slots written ahead, refusal names nothing", noLine: true, chunk: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{EndpointChunk: tc.chunk})
			addServices(h, 20)
			addBad(h, "10.244.9.9")
			h.nft.refuse, h.nft.refuseNoLine = refuseMentions(badClusterIP), tc.noLine
			if st := h.sync(); st.Mode != modeReconcile {
				t.Errorf("first sync was %s", st.Mode)
			}
			checkSetAside(t, h, true, badName)
			h.flows(flowS5, flowBadGone, flowBadNPGone)
			checkTable(t, h, func(f *harness) { addServices(f, 20) })

			// Nothing changed: nothing written, still aside.
			runs := h.nft.runs
			h.clock.Step(time.Second)
			if st := h.sync(); st.Mode != modePartial || h.nft.runs != runs {
				t.Errorf("idle sync: mode %s, %d transactions", st.Mode, h.nft.runs-runs)
			}
			checkSetAside(t, h, false, badName)

			// Another change goes through, partially.
			changeS3(h)
			h.clock.Step(time.Second)
			if st := h.sync(); st.Mode != modePartial {
				t.Errorf("sync of another change was %s", st.Mode)
			}
			checkSetAside(t, h, false, badName)
			h.flows(flowS3Changed, flowBadGone)

			// A full sync still refused: aside again, no rebuild.
			h.clock.Step(2 * time.Hour)
			if st := h.sync(); st.Mode != modeReconcile || st.Operations != 0 {
				t.Errorf("full sync: mode %s with %d operations, want %s with none", st.Mode, st.Operations, modeReconcile)
			}
			checkSetAside(t, h, true, badName)
			h.clock.Step(time.Second)
			if st := h.sync(); st.Mode != modePartial {
				t.Errorf("sync after the full one was %s", st.Mode)
			}
			checkTable(t, h, func(f *harness) { addServices(f, 20); changeS3(f) })

			// No longer refused: the next full sync programs it.
			h.nft.refuse = nil
			h.clock.Step(2 * time.Hour)
			h.sync()
			checkSetAside(t, h, false)
			h.flows(flowBad("10.244.9.9")...)
			checkTable(t, h, func(f *harness) { addServices(f, 20); changeS3(f); addBad(f, "10.244.9.9") })
		})
	}
}

// TestSetAsidePartialSync: a partial sync with a poisoned change programs
// the other service's change in the same sync; the poisoned service keeps
// its last good elements, a full sync leaves the table as the partial one
// did, and the service is retried when it changes.
func TestSetAsidePartialSync(t *testing.T) {
	for _, tc := range []struct {
		name string
		// before are bad's endpoints before the poisoned change (none: no
		// bad), after its endpoints in it.
		before, after []string
		refuse        string
	}{
		{name: "new service refused", after: []string{"10.244.9.9"}, refuse: badClusterIP},
		{name: "update refused: keeps its last good elements", before: []string{"10.244.9.9"},
			after: []string{"10.244.9.9", "10.244.66.6"}, refuse: "10.244.66.6"},
		{name: "endpoint replaced, refused: keeps its last good elements", before: []string{"10.244.9.9"},
			after: []string{"10.244.66.6"}, refuse: "10.244.66.6"},
	} {
		for _, noLine := range []bool{false, true} {
			name := tc.name
			if noLine {
				name += ", refusal names nothing"
			}
			t.Run(name, func(t *testing.T) {
				// lastGood is the table's objects with bad as it was.
				lastGood := func(f *harness) {
					addServices(f, 20)
					if tc.before != nil {
						addBad(f, tc.before...)
					}
				}
				h := newHarness(t, nil, Options{})
				lastGood(h)
				h.sync()
				checkSetAside(t, h, false)

				h.nft.refuse, h.nft.refuseNoLine = refuseMentions(tc.refuse), noLine
				addBad(h, tc.after...)
				changeS3(h)
				h.clock.Step(time.Second)
				if st := h.sync(); st.Mode != modePartial {
					t.Errorf("sync was %s, want %s", st.Mode, modePartial)
				}
				checkSetAside(t, h, true, badName)
				h.flows(flowS3Changed, flowS5)
				if tc.before == nil {
					h.flows(flowBadGone, flowBadNPGone)
				} else {
					h.flows(flowBad(tc.before...)...)
				}
				withS3 := func(f *harness) { lastGood(f); changeS3(f) }
				checkTable(t, h, withS3)

				// A full sync, still refused, finds the table as it wants it.
				h.clock.Step(2 * time.Hour)
				if st := h.sync(); st.Mode != modeReconcile || st.Operations != 0 {
					t.Errorf("full sync: mode %s with %d operations, want %s with none", st.Mode, st.Operations, modeReconcile)
				}
				checkSetAside(t, h, true, badName)
				checkTable(t, h, withS3)

				// Changed again, and no longer refused: programmed.
				h.nft.refuse = nil
				addBad(h, "10.244.9.8")
				h.clock.Step(time.Second)
				if st := h.sync(); st.Mode != modePartial {
					t.Errorf("retry was %s", st.Mode)
				}
				checkSetAside(t, h, false)
				h.flows(flowBad("10.244.9.8")...)
				checkTable(t, h, func(f *harness) { withS3(f); addBad(f, "10.244.9.8") })
			})
		}
	}
}

// TestSetAsideDeleted: a service deleted while set aside is no longer
// reported.
func TestSetAsideDeleted(t *testing.T) {
	h := newHarness(t, nil, Options{})
	addServices(h, 5)
	h.sync()
	h.nft.refuse = refuseMentions(badClusterIP)
	addBad(h, "10.244.9.9")
	h.sync()
	checkSetAside(t, h, true, badName)
	h.engine.OnServiceDelete(pt.Service("bad", badClusterIP))
	h.engine.OnEndpointSliceDelete(pt.Slice("bad", 8080))
	h.clock.Step(time.Second)
	h.sync()
	checkSetAside(t, h, false)
	checkTable(t, h, func(f *harness) { addServices(f, 5) })
}

// TestSetAsideAfterRestart: a new process whose first sync (a reconcile
// over the table an earlier one wrote) is refused for one service keeps
// what the table has for it: its slots come from listing the endpoints
// map, since the process has no state of its own yet. Other services'
// changes, made while kproxy was down, are programmed; with small chunks,
// the slots of the new destinations go ahead (preWriter), the refused
// ones among them.
func TestSetAsideAfterRestart(t *testing.T) {
	for _, tc := range []struct {
		name  string
		chunk int
		// before are bad's endpoints in the table (none: no bad), after
		// those the new process is given, refuse what it refuses.
		before, after []string
		refuse        string
	}{
		{name: "update refused", before: []string{"10.244.9.9", "10.244.9.10"}, after: []string{"10.244.9.9", "10.244.66.6"}, refuse: "10.244.66.6"},
		{name: "update refused, slots ahead", chunk: 2, before: []string{"10.244.9.9", "10.244.9.10"}, after: []string{"10.244.9.9", "10.244.66.6"}, refuse: "10.244.66.6"},
		{name: "new service refused", after: []string{"10.244.9.9"}, refuse: badClusterIP},
		{name: "new service refused, slots ahead", chunk: 2, after: []string{"10.244.9.9"}, refuse: badClusterIP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objects := func(f *harness) {
				addServices(f, 20)
				if tc.before != nil {
					addBad(f, tc.before...)
				}
			}
			first := newHarness(t, nil, Options{})
			objects(first)
			first.sync()

			fake := knftables.NewFake(knftables.IPv4Family, TableName)
			if err := fake.ParseDump(first.fake.Dump()); err != nil {
				t.Fatal(err)
			}
			second := newHarness(t, fake, Options{EndpointChunk: tc.chunk})
			// More services, whose slots go ahead with chunk 2.
			addServices(second, 25)
			changeS3(second)
			addBad(second, tc.after...)
			second.nft.refuse = refuseMentions(tc.refuse)
			if st := second.sync(); st.Mode != modeReconcile {
				t.Errorf("first sync after the restart was %s", st.Mode)
			}
			checkSetAside(t, second, true, badName)
			second.flows(flowS3Changed)
			if tc.before != nil {
				second.flows(flowBad(tc.before...)...)
			} else {
				second.flows(flowBadGone, flowBadNPGone)
			}
			checkTable(t, second, func(f *harness) {
				addServices(f, 25)
				changeS3(f)
				if tc.before != nil {
					addBad(f, tc.before...)
				}
			})
		})
	}
}

// TestSetAsideNotForSharedObjects: a refused shared object (a base chain)
// still fails the sync, and a table changed behind kproxy's back is
// rebuilt, not blamed on a service.
func TestSetAsideNotForSharedObjects(t *testing.T) {
	for _, noLine := range []bool{false, true} {
		h := newHarness(t, nil, Options{})
		addServices(h, 5)
		h.nft.refuse = func(line string) bool { return strings.HasPrefix(line, "add chain ip kproxy "+chainNATPrerouting) }
		h.nft.refuseNoLine = noLine
		if err := h.engine.SyncRules(context.Background()); err == nil {
			t.Errorf("noLine=%v: a refused base chain did not fail the sync", noLine)
		}
		if len(h.backend.SetAside()) != 0 {
			t.Errorf("noLine=%v: set aside %v", noLine, h.backend.SetAside())
		}
	}

	// An element deleted by someone else: the partial transaction that
	// deletes it fails, and the sync rebuilds.
	h := newHarness(t, nil, Options{})
	addServices(h, 5)
	h.sync()
	tx := h.fake.NewTransaction()
	tx.Delete(&knftables.Element{Map: endpointsMap("tcp"), Key: []string{"10.96.0.4", "80", "0"}})
	if err := h.fake.Run(context.Background(), tx); err != nil {
		t.Fatal(err)
	}
	changeS3(h)
	if st := h.sync(); st.Mode != modeRebuild {
		t.Errorf("sync over a deleted element was %s, want %s", st.Mode, modeRebuild)
	}
	checkSetAside(t, h, false)
	h.flows(flowS3Changed)
}

// TestSetAsideUnrenderable: a service port the backend cannot render (a
// state a renderer bug or a model it does not expect gives it) is set
// aside as a refused one is, in full and partial syncs alike.
func TestSetAsideUnrenderable(t *testing.T) {
	opts := proxy.DecisionOptions{ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), NodeIP: netip.MustParseAddr("10.0.0.1")}
	svcs := map[string]string{"a": "10.96.0.1", "b": "10.96.0.2", "c": "10.96.0.3"}
	// broken gives b a decision to deliver over an empty list.
	broken := func(ns *proxy.NodeState) *proxy.NodeState {
		for name, st := range ns.Services {
			if name.Name == "b" {
				st.ClusterEndpoints, st.AllEndpoints = nil, nil
			}
		}
		return ns
	}
	bName := proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "b"}, Port: "p", Protocol: v1.ProtocolTCP}
	flowA := pt.Flow{Name: "a", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.1:8080"}}
	flowB := pt.Flow{Name: "b", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.2:8080"}}
	ctx := context.Background()
	for _, full := range []bool{true, false} {
		h := newHarness(t, nil, Options{})
		if !full {
			if _, err := h.backend.Sync(ctx, nodeState(opts, nil, svcs), true); err != nil {
				t.Fatal(err)
			}
		}
		res, err := h.backend.Sync(ctx, broken(nodeState(opts, []string{"b"}, svcs)), full)
		if err != nil {
			t.Fatalf("full=%v: %v", full, err)
		}
		if len(res.SetAside) != 1 || res.SetAside[bName] == nil {
			t.Errorf("full=%v: set aside %v, want %s", full, res.SetAside, bName)
		}
		h.flows(flowA)
		if full {
			h.flows(pt.Flow{Name: "b", Source: "10.244.1.9", Dest: "10.96.0.2", Port: 80, Want: pt.NotHandled})
		} else {
			h.flows(flowB) // its last good elements
		}
		// Renderable again, when it changes: programmed.
		res, err = h.backend.Sync(ctx, nodeState(opts, []string{"b"}, svcs), false)
		if err != nil || len(res.SetAside) != 0 {
			t.Errorf("full=%v: the retry: set aside %v, err %v", full, res.SetAside, err)
		}
		h.flows(flowA, flowB)
	}
}

// TestSetAsideNotForTimeouts: an nft run that did not finish (its deadline
// passed) is not a refusal: nothing is set aside or searched for, the
// sync fails.
func TestSetAsideNotForTimeouts(t *testing.T) {
	h := newHarness(t, nil, Options{})
	addServices(h, 5)
	h.sync()
	changeS3(h)
	h.nft.failIf = func(*knftables.Transaction) bool { return true }
	h.nft.failErr = fmt.Errorf("running nft: %w", context.DeadlineExceeded)
	if err := h.engine.SyncRules(context.Background()); err == nil {
		t.Fatal("a sync whose every run timed out succeeded")
	}
	if h.nft.checks != 0 || len(h.backend.SetAside()) != 0 {
		t.Errorf("%d checks, set aside %v; want none", h.nft.checks, h.backend.SetAside())
	}
}
