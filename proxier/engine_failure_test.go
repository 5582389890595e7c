package proxier_test

import (
	"context"
	"errors"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"

	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/pkg/healthcheck"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/pkg/runner"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

func (b *fakeBackend) setRefused(refuse map[string]error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refuse = refuse
}

func (b *fakeBackend) panicNextSync(v any) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.panicNext = v
}

// setAsideNames renders a result's SetAside as "port: refusal", sorted.
func setAsideNames(m map[proxy.ServicePortName]error) []string {
	var out []string
	for name, err := range m {
		out = append(out, name.String()+": "+err.Error())
	}
	slices.Sort(out)
	return out
}

// TestEngineSetAside walks one engine through the life of a service port
// the kernel refuses: the sync succeeds without it, it is reported once
// (log, event, result), it does not make later syncs full, it stays set
// aside across partial syncs that do not touch it, it is reported again
// when its refusal changes and on full syncs, and it leaves the set when
// the kernel takes it or the service goes.
func TestEngineSetAside(t *testing.T) {
	rec := record.NewFakeRecorder(100)
	h := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.FamilyEventRecorder = rec })
	noSCTP := errors.New("iptables-restore: line 12: unknown match sctp")
	other := errors.New("iptables-restore: line 40: bad argument")
	webSvc2 := pt.Service("web", "10.96.0.10", pt.Annotation("x", "y"), pt.Ports(v1.ServicePort{Name: "p", Port: 81, Protocol: v1.ProtocolTCP}))

	type step struct {
		name string
		// do changes the world before the sync.
		do           func()
		wantFull     bool
		wantSetAside []string
		// wantEvents are the events of this sync, as FakeRecorder writes
		// them, by prefix.
		wantEvents []string
		// wantProgrammed names the ports with rules after the sync.
		wantProgrammed []string
	}
	refusedEvent := "Warning RulesRefused The kernel refused the IPv4 rules of port p (TCP): " + noSCTP.Error()
	steps := []step{
		{
			name: "first sync: web refused, db programmed, the sync succeeds",
			do: func() {
				h.backend.setRefused(map[string]error{"ns/web:p": noSCTP})
				h.engine.OnServiceAdd(web())
				h.engine.OnEndpointSliceAdd(webSlice())
				h.engine.OnServiceAdd(db())
			},
			wantFull:       true,
			wantSetAside:   []string{"ns/web:p: " + noSCTP.Error()},
			wantEvents:     []string{refusedEvent},
			wantProgrammed: []string{"ns/db:p"},
		},
		{
			name:           "another service changes: partial sync, web still set aside, no new event",
			do:             func() { h.engine.OnServiceAdd(cache()) },
			wantSetAside:   []string{"ns/web:p: " + noSCTP.Error()},
			wantProgrammed: []string{"ns/cache:p", "ns/db:p"},
		},
		{
			name:           "web changes and is refused the same way: no new event",
			do:             func() { h.engine.OnServiceUpdate(web(), webSvc2) },
			wantSetAside:   []string{"ns/web:p: " + noSCTP.Error()},
			wantProgrammed: []string{"ns/cache:p", "ns/db:p"},
		},
		{
			name: "web's refusal changes: reported again",
			do: func() {
				h.backend.setRefused(map[string]error{"ns/web:p": other})
				h.engine.OnServiceUpdate(webSvc2, web())
			},
			wantSetAside:   []string{"ns/web:p: " + other.Error()},
			wantEvents:     []string{"Warning RulesRefused The kernel refused the IPv4 rules of port p (TCP): " + other.Error()},
			wantProgrammed: []string{"ns/cache:p", "ns/db:p"},
		},
		{
			name:           "full sync an hour later: retried, refused, reported again",
			do:             func() { h.clock.Step(proxier.DefaultFullSyncPeriod) },
			wantFull:       true,
			wantSetAside:   []string{"ns/web:p: " + other.Error()},
			wantEvents:     []string{"Warning RulesRefused The kernel refused the IPv4 rules of port p (TCP): " + other.Error()},
			wantProgrammed: []string{"ns/cache:p", "ns/db:p"},
		},
		{
			name: "the kernel takes web when it changes: no longer set aside",
			do: func() {
				h.backend.setRefused(nil)
				h.engine.OnServiceUpdate(web(), webSvc2)
			},
			wantProgrammed: []string{"ns/cache:p", "ns/db:p", "ns/web:p"},
		},
		{
			name: "db refused, then deleted: no longer set aside",
			do: func() {
				h.backend.setRefused(map[string]error{"ns/db:p": noSCTP})
				h.engine.OnServiceUpdate(db(), pt.Service("db", "10.96.0.11", pt.Annotation("x", "y"), pt.Ports(v1.ServicePort{Name: "p", Port: 82, Protocol: v1.ProtocolTCP})))
				if err := h.engine.SyncRules(h.ctx); err != nil {
					t.Fatalf("sync: %v", err)
				}
				if got := setAsideNames(h.lastResult().SetAside); len(got) != 1 {
					t.Fatalf("db not set aside: %v", got)
				}
				_ = drain(rec)
				h.engine.OnServiceDelete(db())
			},
			wantProgrammed: []string{"ns/cache:p", "ns/web:p"},
		},
	}
	for i, s := range steps {
		s.do()
		if err := h.engine.SyncRules(h.ctx); err != nil {
			t.Fatalf("step %d (%s): sync failed: %v", i, s.name, err)
		}
		r := h.lastResult()
		if r.Err != nil || r.Panicked {
			t.Errorf("step %d (%s): result error %v panicked %v", i, s.name, r.Err, r.Panicked)
		}
		if r.Full != s.wantFull {
			t.Errorf("step %d (%s): full = %v, want %v", i, s.name, r.Full, s.wantFull)
		}
		if got := setAsideNames(r.SetAside); !slices.Equal(got, s.wantSetAside) {
			t.Errorf("step %d (%s): set aside %q, want %q", i, s.name, got, s.wantSetAside)
		}
		if len(s.wantSetAside) == 0 && r.SetAside != nil {
			t.Errorf("step %d (%s): SetAside is an empty non-nil map", i, s.name)
		}
		events := drain(rec)
		if len(events) != len(s.wantEvents) {
			t.Errorf("step %d (%s): events %q, want %q", i, s.name, events, s.wantEvents)
		} else {
			for j, e := range events {
				if !strings.HasPrefix(e, s.wantEvents[j]) {
					t.Errorf("step %d (%s): event %q, want %q...", i, s.name, e, s.wantEvents[j])
				}
			}
		}
		if got := slices.Sorted(maps.Keys(h.backend.programmed())); !slices.Equal(got, s.wantProgrammed) {
			t.Errorf("step %d (%s): programmed %v, want %v", i, s.name, got, s.wantProgrammed)
		}
	}
}

// TestEngineSetAsideEventCarriesUID sends a set-aside event through a real
// broadcaster: it is about the Service, found through the lister, with its
// UID (kubectl describe matches on it), in its namespace; without a lister
// it still names the Service.
func TestEngineSetAsideEventCarriesUID(t *testing.T) {
	for _, tc := range []struct {
		name    string
		lister  bool
		wantUID string
	}{
		{name: "with a lister", lister: true, wantUID: "uid-web"},
		{name: "without a lister"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client := fake.NewClientset()
			b := record.NewBroadcaster()
			defer b.Shutdown()
			b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
			rec := b.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kproxy", Host: thisNode})
			svc := web()
			svc.UID = "uid-web"
			indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, toolscache.Indexers{})
			if err := indexer.Add(svc); err != nil {
				t.Fatal(err)
			}
			h := newSyncedHarness(t, func(o *proxier.EngineOptions) {
				o.FamilyEventRecorder = rec
				if tc.lister {
					o.ServiceLister = corelisters.NewServiceLister(indexer)
				}
			})
			h.backend.setRefused(map[string]error{"ns/web:p": errors.New("refused")})
			h.engine.OnServiceAdd(svc)
			if err := h.engine.SyncRules(h.ctx); err != nil {
				t.Fatal(err)
			}
			var events []v1.Event
			waitUntil(t, func() bool {
				l, err := client.CoreV1().Events(pt.Namespace).List(h.ctx, metav1.ListOptions{})
				if err != nil {
					t.Fatalf("listing events: %v", err)
				}
				events = l.Items
				return len(events) > 0
			}, "the event to reach the API server")
			e := events[0]
			if e.InvolvedObject.Kind != "Service" || e.InvolvedObject.Name != "web" || e.InvolvedObject.Namespace != pt.Namespace || string(e.InvolvedObject.UID) != tc.wantUID {
				t.Errorf("event is about %+v, want Service %s/web with UID %q", e.InvolvedObject, pt.Namespace, tc.wantUID)
			}
			if e.Type != v1.EventTypeWarning || e.Reason != proxier.EventReasonRulesRefused {
				t.Errorf("event %s %s, want Warning %s", e.Type, e.Reason, proxier.EventReasonRulesRefused)
			}
		})
	}
}

// TestEnginePanicInSync: a backend that panics fails the sync without
// killing the process; the engine's mutex is free again, the panic is
// reported (Panicked, an error carrying it) and the next sync is full.
func TestEnginePanicInSync(t *testing.T) {
	h := newSyncedHarness(t, nil)
	h.engine.OnServiceAdd(web())
	h.sync()
	h.engine.OnServiceAdd(db())
	h.backend.panicNextSync("renderer bug")

	err := h.engine.SyncRules(h.ctx)
	var perr *runner.PanicError
	if !errors.As(err, &perr) || perr.Value != "renderer bug" {
		t.Fatalf("sync error = %v, want the panic", err)
	}
	if !strings.Contains(string(perr.Stack), "fakeBackend") {
		t.Errorf("the panic's stack does not show where it happened:\n%s", perr.Stack)
	}
	r := h.lastResult()
	if !r.Panicked || !errors.Is(r.Err, err) {
		t.Errorf("result panicked %v err %v, want the panic", r.Panicked, r.Err)
	}
	// The mutex was released: this sync would deadlock otherwise.
	r = h.sync()
	if !r.Full {
		t.Error("the sync after a panic was partial")
	}
	if got := slices.Sorted(maps.Keys(h.backend.programmed())); !slices.Equal(got, []string{"ns/db:p", "ns/web:p"}) {
		t.Errorf("programmed %v after recovery, want both services", got)
	}
}

// TestEngineSyncLoopSurvivesPanics runs the real loop over a backend that
// panics: the loop retries, in full, and carries on.
func TestEngineSyncLoopSurvivesPanics(t *testing.T) {
	h := newSyncedHarness(t, nil)
	ctx, cancel := context.WithCancel(h.ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.engine.SyncLoop(ctx)
	}()
	defer func() {
		cancel()
		<-done
	}()
	stepWhenWaiting := func() {
		if h.clock.HasWaiters() {
			h.clock.Step(time.Second)
		}
	}
	h.engine.OnServiceAdd(web())
	waitFor(t, h.backend.synced, "the first sync", stepWhenWaiting)
	for range 3 {
		h.backend.panicNextSync(errors.New("boom"))
		h.engine.OnServiceAdd(db())
		h.engine.OnServiceDelete(db())
		h.engine.Sync()
		waitFor(t, h.backend.synced, "the retry after a panic", stepWhenWaiting)
		if !h.backend.last().Full {
			t.Error("the retry after a panic was partial")
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	panics := 0
	for _, r := range h.results {
		if r.Panicked {
			panics++
		}
	}
	if panics != 3 {
		t.Errorf("%d panicked results, want 3", panics)
	}
}

// TestEngineStaleConntrackBounded: 20,000 failed syncs, each after the same
// UDP endpoint flapped away, leave one stale note, not 20,000; the next
// successful sync consumes it.
func TestEngineStaleConntrackBounded(t *testing.T) {
	ct := conntrack.NewFake()
	h := newSyncedHarness(t, func(o *proxier.EngineOptions) {
		o.Conntrack = ct
		o.Logger = logr.Discard()
	})
	h.engine.OnServiceAdd(udpService("dns", "10.96.0.53", v1.ProtocolUDP, 30053))
	h.engine.OnEndpointSliceAdd(udpSlice("dns", v1.ProtocolUDP, ep1, ep2))
	h.sync()
	injected := errors.New("iptables-restore failed")
	for i := range 20000 {
		if i%2 == 0 {
			h.engine.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep2))
		} else {
			h.engine.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep1, ep2))
		}
		h.backend.failNextSync(injected)
		if err := h.engine.SyncRules(h.ctx); !errors.Is(err, injected) {
			t.Fatalf("sync %d: error %v, want the injected failure", i, err)
		}
	}
	if n := h.engine.StaleConntrackNotes(); n != 1 {
		t.Fatalf("%d stale conntrack notes after 20,000 failed syncs with one flapping endpoint, want 1", n)
	}
	ct.Add(engineFlows["dns to ep1"])
	h.engine.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep2))
	h.sync()
	if n := h.engine.StaleConntrackNotes(); n != 0 {
		t.Errorf("%d stale conntrack notes after a successful sync, want 0", n)
	}
	if flows := ct.Flows(); len(flows) != 0 {
		t.Errorf("flows to the removed endpoint left: %v", flows)
	}
}

// TestEngineHealthStuckSync wires the engine to a proxy health server as
// the command does: a sync stuck in the backend for 2 x the sync period
// makes /livez fail although nothing is queued, and health comes back once
// the sync returns.
func TestEngineHealthStuckSync(t *testing.T) {
	var hs *healthcheck.ProxyHealthServer
	h := newHarness(t, func(o *proxier.EngineOptions) {
		o.OnLoopRan = func(time.Time) { hs.SyncLoopRan(o.Family) }
	})
	var err error
	hs, err = healthcheck.NewProxyHealthServer(healthcheck.ProxyHealthOptions{HealthTimeout: time.Minute, NodeName: thisNode, Clock: h.clock})
	if err != nil {
		t.Fatal(err)
	}
	livez := func() int {
		rec := httptest.NewRecorder()
		hs.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/livez", nil))
		return rec.Code
	}
	release := make(chan struct{})
	h.backend.block = release
	ctx, cancel := context.WithCancel(h.ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.engine.SyncLoop(ctx)
	}()
	defer func() {
		cancel()
		<-done
	}()
	h.engine.OnServiceSynced()
	h.engine.OnEndpointSlicesSynced()
	waitFor(t, h.backend.entered, "the backend sync to start", nil)
	if code := livez(); code != http.StatusOK {
		t.Fatalf("/livez = %d at the start of the sync, want 200", code)
	}
	h.clock.Step(time.Minute - time.Second)
	if code := livez(); code != http.StatusOK {
		t.Fatalf("/livez = %d before the timeout, want 200", code)
	}
	h.clock.Step(time.Second)
	if code := livez(); code != http.StatusServiceUnavailable {
		t.Fatalf("/livez = %d with a sync stuck for 2 x the sync period, want 503", code)
	}
	h.backend.mu.Lock()
	h.backend.block = nil
	h.backend.mu.Unlock()
	close(release)
	waitFor(t, h.backend.synced, "the stuck sync to finish", nil)
	waitUntil(t, func() bool { return livez() == http.StatusOK }, "/livez to recover")
}

// TestEngineEndpointSliceEvents: an endpoint of the wrong family in a
// slice is skipped with one Warning event on the slice (not again for a
// later version that still has it), and the other endpoints are used.
func TestEngineEndpointSliceEvents(t *testing.T) {
	rec := record.NewFakeRecorder(10)
	h := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.FamilyEventRecorder = rec })
	h.engine.OnServiceAdd(web())
	bad := pt.Slice("web", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"})
	bad.Endpoints = append(bad.Endpoints, pt.Slice("web", 8080, pt.EP{IP: "fd00::5"}).Endpoints...)
	h.engine.OnEndpointSliceAdd(bad)
	h.engine.OnEndpointSliceUpdate(bad, bad.DeepCopy())
	want := []string{`Warning InvalidEndpoint endpoint "fd00::5" is an IPv6 address in a slice of address type IPv4; kproxy skips it`}
	if got := drain(rec); !slices.Equal(got, want) {
		t.Errorf("events %q, want %q", got, want)
	}
	h.sync()
	if got := h.backend.last().Services["ns/web:p"].Cluster; !slices.Equal(got, []string{"10.244.2.5:8080"}) {
		t.Errorf("web's endpoints %v, want the valid one", got)
	}
}
