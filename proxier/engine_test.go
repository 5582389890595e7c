package proxier_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// thisNode is the node every test engine runs on.
const thisNode = "node-a"

// svcState is what the fake backend keeps of one service port: the
// endpoints this node uses, as "ip:port" strings.
type svcState struct {
	Cluster []string
	Local   []string
	HasAny  bool
}

// nodeState is a copy of one NodeState handed to the backend.
type nodeState struct {
	Family v1.IPFamily
	Full   bool
	// Changed names the changed services ("namespace/name"), sorted.
	Changed []string
	// Services holds every service port of the state, by
	// ServicePortName.String().
	Services map[string]svcState
}

// fakeBackend is a Backend that keeps state as a kernel would: given holds
// a copy of the NodeState of the last successful sync, and rules the
// service ports as programmed so far, where a partial sync rewrites only the
// changed services, exactly as the Backend contract lets a real backend do.
// It can be told to refuse the next sync.
type fakeBackend struct {
	mu sync.Mutex
	// given is nil until a sync succeeded.
	given *nodeState
	rules map[string]svcState
	// failNext, when set, is returned by the next Sync, which then changes
	// nothing.
	failNext error
	// block, when set, makes Sync wait for it to be closed (or ctx done)
	// before doing anything; entered gets a token when Sync starts waiting.
	block   chan struct{}
	entered chan struct{}
	cleaned bool
	// synced gets a token after every successful sync.
	synced chan struct{}
	// refuse names service ports ("ns/name:port") the kernel refuses,
	// with the refusal: a sync that would write them sets them aside
	// (BackendResult.SetAside) and leaves their last good rules, as the
	// Backend contract says; everything else is programmed.
	refuse map[string]error
	// panicNext, when set, is what the next Sync panics with.
	panicNext any
	// repairNext makes the next successful Sync report Full, as a
	// backend that found its rules flushed and rewrote them all.
	repairNext bool
}

var _ proxier.Backend = (*fakeBackend)(nil)

func newFakeBackend() *fakeBackend {
	return &fakeBackend{rules: map[string]svcState{}, synced: make(chan struct{}, 1), entered: make(chan struct{}, 1)}
}

func endpointStrings(eps []*proxy.Endpoint) []string {
	var out []string
	for _, ep := range eps {
		out = append(out, ep.String())
	}
	slices.Sort(out)
	return out
}

func (b *fakeBackend) Sync(ctx context.Context, state *proxy.NodeState, full bool) (proxy.BackendResult, error) {
	if err := state.Validate(); err != nil {
		return proxy.BackendResult{}, err
	}
	b.mu.Lock()
	block := b.block
	b.mu.Unlock()
	if block != nil {
		b.entered <- struct{}{}
		select {
		case <-block:
		case <-ctx.Done():
			return proxy.BackendResult{}, ctx.Err()
		}
	}

	b.mu.Lock()
	defer b.mu.Unlock()
	if p := b.panicNext; p != nil {
		b.panicNext = nil
		panic(p)
	}
	if err := b.failNext; err != nil {
		b.failNext = nil
		return proxy.BackendResult{}, err
	}
	var result proxy.BackendResult
	result.Full, b.repairNext = b.repairNext && !full, false
	// refused reports whether the kernel refuses the port called name,
	// noting it in the result.
	refused := func(name proxy.ServicePortName) bool {
		err, ok := b.refuse[name.String()]
		if ok {
			if result.SetAside == nil {
				result.SetAside = map[proxy.ServicePortName]error{}
			}
			result.SetAside[name] = err
		}
		return ok
	}
	given := &nodeState{Family: state.Family, Full: full, Services: map[string]svcState{}}
	for name := range state.Changed {
		given.Changed = append(given.Changed, name.String())
	}
	slices.Sort(given.Changed)
	for name, st := range state.Services {
		given.Services[name.String()] = svcState{
			Cluster: endpointStrings(st.ClusterEndpoints),
			Local:   endpointStrings(st.LocalEndpoints),
			HasAny:  st.HasAnyEndpoints,
		}
	}
	rewrite := func(name string) bool { return full || state.Changed.Has(namespacedNameOf(name)) }
	for name := range b.rules {
		// A refused port keeps its last good rules; a deleted one goes.
		_, refusedNow := b.refuse[name]
		_, inState := given.Services[name]
		if rewrite(name) && !(refusedNow && inState) {
			delete(b.rules, name)
		}
	}
	for name := range state.Services {
		if rewrite(name.String()) && !refused(name) {
			b.rules[name.String()] = given.Services[name.String()]
		}
	}
	b.given = given
	select {
	case b.synced <- struct{}{}:
	default:
	}
	return result, nil
}

// namespacedNameOf parses the "namespace/name" part of a service port name.
func namespacedNameOf(portName string) types.NamespacedName {
	nn, _, _ := strings.Cut(portName, ":")
	ns, name, _ := strings.Cut(nn, "/")
	return types.NamespacedName{Namespace: ns, Name: name}
}

func (b *fakeBackend) Cleanup(context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.rules = map[string]svcState{}
	b.given = nil
	b.cleaned = true
	return nil
}

// last returns a copy of the last state given, nil before the first sync.
func (b *fakeBackend) last() *nodeState {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.given == nil {
		return nil
	}
	cp := *b.given
	cp.Services = maps.Clone(b.given.Services)
	return &cp
}

// programmed returns a copy of the rules as programmed.
func (b *fakeBackend) programmed() map[string]svcState {
	b.mu.Lock()
	defer b.mu.Unlock()
	return maps.Clone(b.rules)
}

func (b *fakeBackend) failNextSync(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failNext = err
}

// harness drives one Engine over a fakeBackend with a fake clock.
type harness struct {
	t *testing.T
	// ctx carries a logger writing to the test's log.
	ctx     context.Context
	clock   *testingclock.FakeClock
	backend *fakeBackend
	engine  *proxier.Engine

	mu      sync.Mutex
	results []proxier.SyncResult
}

var epoch = time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)

// newHarness builds an engine; edit adjusts the options first.
func newHarness(t *testing.T, edit func(*proxier.EngineOptions)) *harness {
	t.Helper()
	logger, ctx := ktesting.NewTestContext(t)
	h := &harness{t: t, ctx: ctx, clock: testingclock.NewFakeClock(epoch), backend: newFakeBackend()}
	opts := proxier.EngineOptions{
		Family: v1.IPv4Protocol, NodeName: thisNode, Backend: h.backend,
		MinSyncPeriod: time.Second, SyncPeriod: 30 * time.Second, Clock: h.clock, Logger: logger,
		OnSync: func(r proxier.SyncResult) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.results = append(h.results, r)
		},
	}
	if edit != nil {
		edit(&opts)
	}
	e, err := proxier.NewEngine(opts)
	if err != nil {
		t.Fatalf("NewEngine: %v", err)
	}
	h.engine = e
	return h
}

// newSyncedHarness is newHarness with both informer caches synced.
func newSyncedHarness(t *testing.T, edit func(*proxier.EngineOptions)) *harness {
	h := newHarness(t, edit)
	h.engine.OnServiceSynced()
	h.engine.OnEndpointSlicesSynced()
	return h
}

// resultCount is the number of sync attempts reported through OnSync.
func (h *harness) resultCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.results)
}

func (h *harness) lastResult() proxier.SyncResult {
	h.t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.results) == 0 {
		h.t.Fatal("no sync result reported")
	}
	return h.results[len(h.results)-1]
}

// sync runs one sync, which must succeed, checks that the rules the backend
// holds match the full state it was given (a partial sync must not leave
// any service behind), and returns the sync's result.
func (h *harness) sync() proxier.SyncResult {
	h.t.Helper()
	if err := h.engine.SyncRules(h.ctx); err != nil {
		h.t.Fatalf("sync: %v", err)
	}
	r := h.lastResult()
	h.checkProgrammed()
	return r
}

func (h *harness) checkProgrammed() {
	h.t.Helper()
	given := h.backend.last()
	if given == nil {
		h.t.Fatal("backend was never synced")
	}
	if got := h.backend.programmed(); !maps.EqualFunc(got, given.Services, svcStateEqual) {
		h.t.Errorf("programmed rules diverge from the engine's state after a %s sync (changed %v):\nprogrammed %v\nstate      %v",
			syncKind(given.Full), given.Changed, got, given.Services)
	}
}

func svcStateEqual(a, b svcState) bool {
	return a.HasAny == b.HasAny && slices.Equal(a.Cluster, b.Cluster) && slices.Equal(a.Local, b.Local)
}

func syncKind(full bool) string {
	if full {
		return "full"
	}
	return "partial"
}

// Objects shared by the tests.
func web() *v1.Service { return pt.Service("web", "10.96.0.10") }
func webSlice() *discovery.EndpointSlice {
	return pt.Slice("web", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"})
}
func db() *v1.Service { return pt.Service("db", "10.96.0.11") }
func dbSlice() *discovery.EndpointSlice {
	return pt.Slice("db", 5432, pt.EP{IP: "10.244.2.6", Node: "node-b"})
}
func cache() *v1.Service { return pt.Service("cache", "10.96.0.12") }
func cacheSlice() *discovery.EndpointSlice {
	return pt.Slice("cache", 6379, pt.EP{IP: "10.244.1.7", Node: thisNode})
}

func TestEngineWaitsForInitialSync(t *testing.T) {
	for _, tc := range []struct {
		name       string
		synced     func(e *proxier.Engine)
		wantSynced bool
	}{
		{name: "neither cache synced", synced: func(*proxier.Engine) {}},
		{name: "only services synced", synced: func(e *proxier.Engine) { e.OnServiceSynced() }},
		{name: "only endpoint slices synced", synced: func(e *proxier.Engine) { e.OnEndpointSlicesSynced() }},
		{name: "node cache synced does not count", synced: func(e *proxier.Engine) {
			e.OnNodeSynced()
			e.OnServiceSynced()
		}},
		{name: "services then slices", wantSynced: true, synced: func(e *proxier.Engine) {
			e.OnServiceSynced()
			e.OnEndpointSlicesSynced()
		}},
		{name: "slices then services", wantSynced: true, synced: func(e *proxier.Engine) {
			e.OnEndpointSlicesSynced()
			e.OnServiceSynced()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.engine.OnServiceAdd(web())
			h.engine.OnEndpointSliceAdd(webSlice())
			tc.synced(h.engine)
			if err := h.engine.SyncRules(h.ctx); err != nil {
				t.Fatalf("sync: %v", err)
			}
			got := h.backend.last()
			if !tc.wantSynced {
				if got != nil {
					t.Fatalf("backend was synced before both caches were: %+v", got)
				}
				if n := h.resultCount(); n != 0 {
					t.Errorf("OnSync reported %d syncs before both caches synced", n)
				}
				return
			}
			if got == nil {
				t.Fatal("backend not synced after both caches synced")
			}
			if !got.Full || !h.lastResult().Full {
				t.Errorf("first sync was partial (backend full=%v, result full=%v)", got.Full, h.lastResult().Full)
			}
			want := map[string]svcState{"ns/web:p": {Cluster: []string{"10.244.2.5:8080"}, HasAny: true}}
			if !maps.EqualFunc(got.Services, want, svcStateEqual) {
				t.Errorf("services = %v, want %v", got.Services, want)
			}
			if got.Family != v1.IPv4Protocol {
				t.Errorf("family = %q", got.Family)
			}
		})
	}
}

func TestEnginePartialSyncs(t *testing.T) {
	webEP := []string{"10.244.2.5:8080"}
	dbEP := []string{"10.244.2.6:5432"}
	for _, tc := range []struct {
		name   string
		change func(e *proxier.Engine)
		// wantChanged is the Changed set of the partial sync.
		wantChanged []string
		// wantServices is the full state after the partial sync.
		wantServices map[string]svcState
	}{
		{
			name:        "no change",
			change:      func(*proxier.Engine) {},
			wantChanged: nil,
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name:        "service added",
			change:      func(e *proxier.Engine) { e.OnServiceAdd(pt.Service("new", "10.96.0.20")) },
			wantChanged: []string{"ns/new"},
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {}, "ns/new:p": {},
			},
		},
		{
			name: "service updated with a new port",
			change: func(e *proxier.Engine) {
				e.OnServiceUpdate(web(), pt.Service("web", "10.96.0.10", pt.Ports(
					v1.ServicePort{Name: "p", Port: 80, Protocol: v1.ProtocolTCP},
					v1.ServicePort{Name: "q", Port: 81, Protocol: v1.ProtocolTCP})))
			},
			wantChanged: []string{"ns/web"},
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/web:q": {}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name: "service updated without a relevant change",
			change: func(e *proxier.Engine) {
				s := web()
				s.Labels = map[string]string{"team": "x"}
				e.OnServiceUpdate(web(), s)
			},
			wantChanged: nil,
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name:         "service deleted",
			change:       func(e *proxier.Engine) { e.OnServiceDelete(db()) },
			wantChanged:  []string{"ns/db"},
			wantServices: map[string]svcState{"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/cache:p": {}},
		},
		{
			name:        "slice added",
			change:      func(e *proxier.Engine) { e.OnEndpointSliceAdd(cacheSlice()) },
			wantChanged: []string{"ns/cache"},
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true},
				"ns/cache:p": {Cluster: []string{"10.244.1.7:6379"}, HasAny: true},
			},
		},
		{
			name: "slice updated",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(webSlice(), pt.Slice("web", 8080,
					pt.EP{IP: "10.244.2.5", Node: "node-b"}, pt.EP{IP: "10.244.3.5", Node: "node-c"}))
			},
			wantChanged: []string{"ns/web"},
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: []string{"10.244.2.5:8080", "10.244.3.5:8080"}, HasAny: true},
				"ns/db:p":  {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name:        "slice deleted",
			change:      func(e *proxier.Engine) { e.OnEndpointSliceDelete(webSlice()) },
			wantChanged: []string{"ns/web"},
			wantServices: map[string]svcState{
				"ns/web:p": {}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name: "service and slice of different services",
			change: func(e *proxier.Engine) {
				e.OnServiceDelete(web())
				e.OnEndpointSliceDelete(webSlice())
				e.OnEndpointSliceAdd(cacheSlice())
			},
			wantChanged: []string{"ns/cache", "ns/web"},
			wantServices: map[string]svcState{
				"ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {Cluster: []string{"10.244.1.7:6379"}, HasAny: true},
			},
		},
		{
			name: "service added then deleted before the sync",
			change: func(e *proxier.Engine) {
				e.OnServiceAdd(pt.Service("new", "10.96.0.20"))
				e.OnServiceDelete(pt.Service("new", "10.96.0.20"))
			},
			wantChanged: nil,
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name: "slice added then deleted before the sync",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceAdd(cacheSlice())
				e.OnEndpointSliceDelete(cacheSlice())
			},
			wantChanged: nil,
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name: "service deleted then added back unchanged",
			change: func(e *proxier.Engine) {
				e.OnServiceDelete(db())
				e.OnServiceAdd(db())
			},
			wantChanged: nil,
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name: "slice of an unknown service",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceAdd(pt.Slice("ghost", 80, pt.EP{IP: "10.244.2.9", Node: "node-b"}))
			},
			wantChanged: []string{"ns/ghost"},
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
		{
			name: "slice of another address type is ignored",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceAdd(pt.Slice("cache", 6379, pt.EP{IP: "fd00::7", Node: thisNode}))
			},
			wantChanged: nil,
			wantServices: map[string]svcState{
				"ns/web:p": {Cluster: webEP, HasAny: true}, "ns/db:p": {Cluster: dbEP, HasAny: true}, "ns/cache:p": {},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			for _, s := range []*v1.Service{web(), db(), cache()} {
				h.engine.OnServiceAdd(s)
			}
			h.engine.OnEndpointSliceAdd(webSlice())
			h.engine.OnEndpointSliceAdd(dbSlice())
			if r := h.sync(); !r.Full {
				t.Fatal("first sync was partial")
			}

			tc.change(h.engine)
			r := h.sync()
			got := h.backend.last()
			if r.Full || got.Full {
				t.Fatalf("second sync was full (result %v, backend %v)", r.Full, got.Full)
			}
			if !slices.Equal(got.Changed, tc.wantChanged) {
				t.Errorf("changed = %v, want %v", got.Changed, tc.wantChanged)
			}
			if !maps.EqualFunc(got.Services, tc.wantServices, svcStateEqual) {
				t.Errorf("services =\n%v\nwant\n%v", got.Services, tc.wantServices)
			}
			if r.Services != len(tc.wantServices) {
				t.Errorf("result reports %d services, want %d", r.Services, len(tc.wantServices))
			}
		})
	}
}

func TestEngineFailedSyncForcesFullSync(t *testing.T) {
	type step struct {
		// add names a service added before the sync ("" adds nothing).
		add      string
		fail     bool
		wantFull bool
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{
			name: "failed partial sync",
			steps: []step{
				{add: "a", wantFull: true},
				{add: "b", fail: true},
				{add: "c", wantFull: true},
				{add: "d", wantFull: false},
			},
		},
		{
			name: "failed first sync",
			steps: []step{
				{add: "a", fail: true},
				{wantFull: true},
				{add: "b", wantFull: false},
			},
		},
		{
			name: "two failures in a row",
			steps: []step{
				{add: "a", wantFull: true},
				{add: "b", fail: true},
				{fail: true},
				{wantFull: true},
				{wantFull: false},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			injected := errors.New("injected backend failure")
			var want []string
			for i, s := range tc.steps {
				if s.add != "" {
					h.engine.OnServiceAdd(pt.Service(s.add, fmt.Sprintf("10.96.0.%d", i+1)))
					want = append(want, "ns/"+s.add+":p")
				}
				if s.fail {
					h.backend.failNextSync(injected)
					err := h.engine.SyncRules(h.ctx)
					if !errors.Is(err, injected) {
						t.Fatalf("step %d: sync error = %v, want the backend's", i, err)
					}
					if r := h.lastResult(); !errors.Is(r.Err, injected) {
						t.Errorf("step %d: result error = %v, want the backend's", i, r.Err)
					}
					continue
				}
				r := h.sync()
				if r.Err != nil {
					t.Errorf("step %d: result error = %v", i, r.Err)
				}
				if r.Full != s.wantFull || h.backend.last().Full != s.wantFull {
					t.Errorf("step %d: full = %v (backend %v), want %v", i, r.Full, h.backend.last().Full, s.wantFull)
				}
			}
			// Nothing was lost on the way: every service added is there.
			slices.Sort(want)
			if got := slices.Sorted(maps.Keys(h.backend.last().Services)); !slices.Equal(got, want) {
				t.Errorf("services %v, want %v", got, want)
			}
		})
	}
}

func TestEngineFailedSyncKeepsChanges(t *testing.T) {
	h := newSyncedHarness(t, nil)
	h.engine.OnServiceAdd(web())
	h.sync()
	h.engine.OnEndpointSliceAdd(webSlice())
	h.engine.OnServiceAdd(db())
	h.backend.failNextSync(errors.New("injected"))
	if err := h.engine.SyncRules(h.ctx); err == nil {
		t.Fatal("sync did not fail")
	}
	r := h.sync()
	if !r.Full {
		t.Fatal("sync after a failure was partial")
	}
	want := map[string]svcState{
		"ns/web:p": {Cluster: []string{"10.244.2.5:8080"}, HasAny: true},
		"ns/db:p":  {},
	}
	if got := h.backend.last().Services; !maps.EqualFunc(got, want, svcStateEqual) {
		t.Errorf("services after recovery = %v, want %v", got, want)
	}
}

func TestEngineFullSyncPeriod(t *testing.T) {
	type step struct {
		advance  time.Duration
		wantFull bool
	}
	for _, tc := range []struct {
		name   string
		period time.Duration
		steps  []step
	}{
		{
			name:   "explicit period",
			period: 10 * time.Minute,
			steps: []step{
				{advance: 4 * time.Minute, wantFull: false},
				{advance: 5*time.Minute + 59*time.Second, wantFull: false},
				{advance: time.Second, wantFull: true},
				{advance: time.Minute, wantFull: false},
				{advance: 9 * time.Minute, wantFull: true},
			},
		},
		{
			name:   "default period is an hour",
			period: 0,
			steps: []step{
				{advance: 59 * time.Minute, wantFull: false},
				{advance: time.Minute, wantFull: true},
				{advance: time.Minute, wantFull: false},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.FullSyncPeriod = tc.period })
			h.engine.OnServiceAdd(web())
			if !h.sync().Full {
				t.Fatal("first sync was partial")
			}
			elapsed := time.Duration(0)
			for i, s := range tc.steps {
				h.clock.Step(s.advance)
				elapsed += s.advance
				h.engine.OnServiceAdd(pt.Service("s"+string(rune('a'+i)), "10.96.1.1"))
				r := h.sync()
				if r.Full != s.wantFull {
					t.Errorf("step %d (%v after start): full = %v, want %v", i, elapsed, r.Full, s.wantFull)
				}
				if !r.Start.Equal(h.clock.Now()) {
					t.Errorf("step %d: result start %v, want the clock's %v", i, r.Start, h.clock.Now())
				}
			}
		})
	}
}

func TestEngineNodeLabels(t *testing.T) {
	zone := v1.LabelTopologyZone
	nodes := func(e *proxier.Engine) {
		e.OnNodeAdd(pt.Node(thisNode, map[string]string{zone: "z1"}))
		e.OnNodeAdd(pt.Node("node-b", map[string]string{zone: "z1"}))
		e.OnNodeAdd(pt.Node("node-c", map[string]string{zone: "z2"}))
	}
	topoSvc := pt.Service("topo", "10.96.0.30", pt.Annotation(proxy.AnnotationTopologyKeys, `["`+zone+`"]`))
	topoSlice := pt.Slice("topo", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"}, pt.EP{IP: "10.244.3.5", Node: "node-c"})
	plainSvc := pt.Service("plain", "10.96.0.31")
	plainSlice := pt.Slice("plain", 8080, pt.EP{IP: "10.244.2.6", Node: "node-b"})
	plain := svcState{Cluster: []string{"10.244.2.6:8080"}, HasAny: true}

	for _, tc := range []struct {
		name        string
		change      func(e *proxier.Engine)
		wantChanged []string
		wantTopo    svcState
	}{
		{
			name:        "other node moves into this node's zone",
			change:      func(e *proxier.Engine) { e.OnNodeUpdate(nil, pt.Node("node-c", map[string]string{zone: "z1"})) },
			wantChanged: []string{"ns/plain", "ns/topo"},
			wantTopo:    svcState{Cluster: []string{"10.244.2.5:8080", "10.244.3.5:8080"}, HasAny: true},
		},
		{
			name:        "this node moves zone",
			change:      func(e *proxier.Engine) { e.OnNodeUpdate(nil, pt.Node(thisNode, map[string]string{zone: "z2"})) },
			wantChanged: []string{"ns/plain", "ns/topo"},
			wantTopo:    svcState{Cluster: []string{"10.244.3.5:8080"}, HasAny: true},
		},
		{
			name:        "node of the only matching endpoint deleted",
			change:      func(e *proxier.Engine) { e.OnNodeDelete(pt.Node("node-b", nil)) },
			wantChanged: []string{"ns/plain", "ns/topo"},
			wantTopo:    svcState{},
		},
		{
			name:        "new node added",
			change:      func(e *proxier.Engine) { e.OnNodeAdd(pt.Node("node-d", map[string]string{zone: "z3"})) },
			wantChanged: []string{"ns/plain", "ns/topo"},
			wantTopo:    svcState{Cluster: []string{"10.244.2.5:8080"}, HasAny: true},
		},
		{
			name: "node update without a label change",
			change: func(e *proxier.Engine) {
				n := pt.Node("node-c", map[string]string{zone: "z2"})
				n.Spec.Unschedulable = true
				n.Annotations = map[string]string{"x": "y"}
				e.OnNodeUpdate(pt.Node("node-c", map[string]string{zone: "z2"}), n)
			},
			wantChanged: nil,
			wantTopo:    svcState{Cluster: []string{"10.244.2.5:8080"}, HasAny: true},
		},
		{
			name:        "unknown node deleted",
			change:      func(e *proxier.Engine) { e.OnNodeDelete(pt.Node("node-z", nil)) },
			wantChanged: nil,
			wantTopo:    svcState{Cluster: []string{"10.244.2.5:8080"}, HasAny: true},
		},
		{
			name: "label change together with a slice change",
			change: func(e *proxier.Engine) {
				e.OnNodeUpdate(nil, pt.Node("node-c", map[string]string{zone: "z1"}))
				e.OnEndpointSliceUpdate(nil, pt.Slice("topo", 8080, pt.EP{IP: "10.244.3.5", Node: "node-c"}))
			},
			wantChanged: []string{"ns/plain", "ns/topo"},
			wantTopo:    svcState{Cluster: []string{"10.244.3.5:8080"}, HasAny: true},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			nodes(h.engine)
			h.engine.OnServiceAdd(topoSvc)
			h.engine.OnServiceAdd(plainSvc)
			h.engine.OnEndpointSliceAdd(topoSlice)
			h.engine.OnEndpointSliceAdd(plainSlice)
			h.sync()
			before := h.backend.last().Services["ns/topo:p"]
			if want := (svcState{Cluster: []string{"10.244.2.5:8080"}, HasAny: true}); !svcStateEqual(before, want) {
				t.Fatalf("topo service before the change = %v, want %v", before, want)
			}

			tc.change(h.engine)
			r := h.sync()
			got := h.backend.last()
			if r.Full {
				t.Fatal("node change caused a full sync")
			}
			if !slices.Equal(got.Changed, tc.wantChanged) {
				t.Errorf("changed = %v, want %v", got.Changed, tc.wantChanged)
			}
			if !svcStateEqual(got.Services["ns/topo:p"], tc.wantTopo) {
				t.Errorf("topo service = %v, want %v", got.Services["ns/topo:p"], tc.wantTopo)
			}
			if !svcStateEqual(got.Services["ns/plain:p"], plain) {
				t.Errorf("plain service = %v, want %v", got.Services["ns/plain:p"], plain)
			}

			// The topology change is consumed by one sync.
			h.sync()
			if c := h.backend.last().Changed; len(c) != 0 {
				t.Errorf("sync after the change still reports changed %v", c)
			}
		})
	}
}

func TestEngineSyncResult(t *testing.T) {
	udpPort := []discovery.EndpointPort{{Name: ptr.To("p"), Port: ptr.To(int32(53)), Protocol: ptr.To(v1.ProtocolUDP)}}
	udpSvc := pt.Service("dns", "10.96.0.53", pt.Ports(v1.ServicePort{Name: "p", Port: 53, Protocol: v1.ProtocolUDP}))
	triggered := func(s *discovery.EndpointSlice, at time.Time) *discovery.EndpointSlice {
		s.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: at.Format(time.RFC3339Nano)}
		return s
	}
	remote := pt.EP{IP: "10.244.2.5", Node: "node-b"}
	local := pt.EP{IP: "10.244.1.5", Node: thisNode}

	for _, tc := range []struct {
		name string
		// setup runs before the first (full) sync, change before the second
		// (partial) one, whose result is checked.
		setup  func(h *harness)
		change func(h *harness)
		check  func(t *testing.T, r proxier.SyncResult)
	}{
		{
			name: "counts service ports",
			setup: func(h *harness) {
				h.engine.OnServiceAdd(pt.Service("two", "10.96.0.1", pt.Ports(
					v1.ServicePort{Name: "a", Port: 80, Protocol: v1.ProtocolTCP},
					v1.ServicePort{Name: "b", Port: 53, Protocol: v1.ProtocolUDP})))
				h.engine.OnServiceAdd(web())
			},
			change: func(h *harness) { h.engine.OnServiceAdd(db()) },
			check: func(t *testing.T, r proxier.SyncResult) {
				if r.Services != 4 {
					t.Errorf("services = %d, want 4", r.Services)
				}
				if r.Family != v1.IPv4Protocol {
					t.Errorf("family = %q", r.Family)
				}
			},
		},
		{
			name: "external Local policy without a local endpoint",
			change: func(h *harness) {
				h.engine.OnServiceAdd(pt.Service("np", "10.96.0.1", pt.NodePort(30080), pt.ExternalLocal()))
				h.engine.OnEndpointSliceAdd(pt.Slice("np", 8080, remote))
			},
			check: func(t *testing.T, r proxier.SyncResult) {
				if r.NoLocalEndpointsExternal != 1 || r.NoLocalEndpointsInternal != 0 {
					t.Errorf("no-local counters external=%d internal=%d, want 1 and 0", r.NoLocalEndpointsExternal, r.NoLocalEndpointsInternal)
				}
			},
		},
		{
			name: "internal Local policy without a local endpoint",
			change: func(h *harness) {
				h.engine.OnServiceAdd(pt.Service("il", "10.96.0.1", pt.InternalLocal()))
				h.engine.OnEndpointSliceAdd(pt.Slice("il", 8080, remote))
			},
			check: func(t *testing.T, r proxier.SyncResult) {
				if r.NoLocalEndpointsExternal != 0 || r.NoLocalEndpointsInternal != 1 {
					t.Errorf("no-local counters external=%d internal=%d, want 0 and 1", r.NoLocalEndpointsExternal, r.NoLocalEndpointsInternal)
				}
			},
		},
		{
			name: "both Local policies without a local endpoint",
			change: func(h *harness) {
				h.engine.OnServiceAdd(pt.Service("both", "10.96.0.1", pt.NodePort(30080), pt.ExternalLocal(), pt.InternalLocal()))
				h.engine.OnEndpointSliceAdd(pt.Slice("both", 8080, remote))
			},
			check: func(t *testing.T, r proxier.SyncResult) {
				if r.NoLocalEndpointsExternal != 1 || r.NoLocalEndpointsInternal != 1 {
					t.Errorf("no-local counters external=%d internal=%d, want 1 and 1", r.NoLocalEndpointsExternal, r.NoLocalEndpointsInternal)
				}
			},
		},
		{
			name: "Local policies with a local endpoint, or without any endpoint, are not counted",
			change: func(h *harness) {
				h.engine.OnServiceAdd(pt.Service("withlocal", "10.96.0.1", pt.NodePort(30080), pt.ExternalLocal(), pt.InternalLocal()))
				h.engine.OnEndpointSliceAdd(pt.Slice("withlocal", 8080, remote, local))
				h.engine.OnServiceAdd(pt.Service("empty", "10.96.0.2", pt.NodePort(30081), pt.ExternalLocal(), pt.InternalLocal()))
				h.engine.OnServiceAdd(pt.Service("cluster", "10.96.0.3", pt.NodePort(30082)))
				h.engine.OnEndpointSliceAdd(pt.Slice("cluster", 8080, remote))
			},
			check: func(t *testing.T, r proxier.SyncResult) {
				if r.NoLocalEndpointsExternal != 0 || r.NoLocalEndpointsInternal != 0 {
					t.Errorf("no-local counters external=%d internal=%d, want 0 and 0", r.NoLocalEndpointsExternal, r.NoLocalEndpointsInternal)
				}
			},
		},
		{
			name: "counters cover unchanged services too",
			setup: func(h *harness) {
				h.engine.OnServiceAdd(pt.Service("np", "10.96.0.1", pt.NodePort(30080), pt.ExternalLocal()))
				h.engine.OnEndpointSliceAdd(pt.Slice("np", 8080, remote))
			},
			change: func(h *harness) { h.engine.OnServiceAdd(web()) },
			check: func(t *testing.T, r proxier.SyncResult) {
				if r.NoLocalEndpointsExternal != 1 {
					t.Errorf("no-local external = %d, want 1", r.NoLocalEndpointsExternal)
				}
			},
		},
		{
			name:  "trigger time of an applied slice change",
			setup: func(h *harness) { h.engine.OnServiceAdd(web()) },
			change: func(h *harness) {
				h.engine.OnEndpointSliceAdd(triggered(webSlice(), epoch.Add(5*time.Second)))
			},
			check: func(t *testing.T, r proxier.SyncResult) {
				if want := []time.Time{epoch.Add(5 * time.Second)}; !slices.EqualFunc(r.TriggerTimes, want, time.Time.Equal) {
					t.Errorf("trigger times = %v, want %v", r.TriggerTimes, want)
				}
			},
		},
		{
			name:  "trigger times of several services",
			setup: func(h *harness) { h.engine.OnServiceAdd(web()); h.engine.OnServiceAdd(db()) },
			change: func(h *harness) {
				h.engine.OnEndpointSliceAdd(triggered(webSlice(), epoch.Add(5*time.Second)))
				h.engine.OnEndpointSliceAdd(triggered(dbSlice(), epoch.Add(7*time.Second)))
			},
			check: func(t *testing.T, r proxier.SyncResult) {
				got := slices.Clone(r.TriggerTimes)
				slices.SortFunc(got, time.Time.Compare)
				if want := []time.Time{epoch.Add(5 * time.Second), epoch.Add(7 * time.Second)}; !slices.EqualFunc(got, want, time.Time.Equal) {
					t.Errorf("trigger times = %v, want %v", got, want)
				}
			},
		},
		{
			name: "trigger times already applied are not reported again",
			setup: func(h *harness) {
				h.engine.OnServiceAdd(web())
				h.engine.OnEndpointSliceAdd(triggered(webSlice(), epoch.Add(time.Second)))
			},
			change: func(h *harness) { h.engine.OnServiceAdd(db()) },
			check: func(t *testing.T, r proxier.SyncResult) {
				if len(r.TriggerTimes) != 0 {
					t.Errorf("trigger times = %v, want none", r.TriggerTimes)
				}
			},
		},
		{
			name: "UDP endpoint removed",
			setup: func(h *harness) {
				h.engine.OnServiceAdd(udpSvc)
				h.engine.OnEndpointSliceAdd(pt.SliceWithPorts("dns", udpPort, remote, pt.EP{IP: "10.244.3.5", Node: "node-c"}))
			},
			change: func(h *harness) {
				h.engine.OnEndpointSliceUpdate(nil, pt.SliceWithPorts("dns", udpPort, pt.EP{IP: "10.244.3.5", Node: "node-c"}))
			},
			check: func(t *testing.T, r proxier.SyncResult) {
				want := []proxy.ServiceEndpoint{{Endpoint: "10.244.2.5:53", ServicePortName: pt.ServicePortNameOf(udpSvc, "p")}}
				if !slices.Equal(r.DeletedUDPEndpoints, want) {
					t.Errorf("deleted UDP endpoints = %v, want %v", r.DeletedUDPEndpoints, want)
				}
			},
		},
		{
			name: "UDP service deleted",
			setup: func(h *harness) {
				h.engine.OnServiceAdd(udpSvc)
				h.engine.OnEndpointSliceAdd(pt.SliceWithPorts("dns", udpPort, remote))
			},
			change: func(h *harness) { h.engine.OnServiceDelete(udpSvc) },
			check: func(t *testing.T, r proxier.SyncResult) {
				if !r.DeletedUDPClusterIPs.Has("10.96.0.53") || r.DeletedUDPClusterIPs.Len() != 1 {
					t.Errorf("deleted UDP cluster IPs = %v, want [10.96.0.53]", r.DeletedUDPClusterIPs)
				}
			},
		},
		{
			name: "TCP endpoint removed is not a UDP deletion",
			setup: func(h *harness) {
				h.engine.OnServiceAdd(web())
				h.engine.OnEndpointSliceAdd(webSlice())
			},
			change: func(h *harness) { h.engine.OnEndpointSliceDelete(webSlice()) },
			check: func(t *testing.T, r proxier.SyncResult) {
				if len(r.DeletedUDPEndpoints) != 0 || r.DeletedUDPClusterIPs.Len() != 0 {
					t.Errorf("deleted UDP = %v / %v, want none", r.DeletedUDPEndpoints, r.DeletedUDPClusterIPs)
				}
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			if tc.setup != nil {
				tc.setup(h)
			}
			h.sync()
			h.clock.Step(10 * time.Second)
			tc.change(h)
			r := h.sync()
			if r.Full {
				t.Fatal("second sync was full")
			}
			if r.Err != nil {
				t.Errorf("result error = %v", r.Err)
			}
			tc.check(t, r)
		})
	}
}

// waitFor waits, up to a bound far beyond what any working engine needs,
// for ch to receive; step, when set, is called while waiting to move the
// fake clock on.
func waitFor(t *testing.T, ch <-chan struct{}, what string, step func()) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	poll := time.NewTicker(time.Millisecond)
	defer poll.Stop()
	for {
		select {
		case <-ch:
			return
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		case <-poll.C:
			if step != nil {
				step()
			}
		}
	}
}

func TestEngineSyncLoop(t *testing.T) {
	h := newHarness(t, nil)
	ctx, cancel := context.WithCancel(h.ctx)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.engine.SyncLoop(ctx)
	}()
	// stepWhenWaiting moves time on only while the loop sleeps on a timer,
	// so a sync never starts early for lack of a waiting loop.
	stepWhenWaiting := func() {
		if h.clock.HasWaiters() {
			h.clock.Step(time.Second)
		}
	}

	// Events before the caches are synced never reach the backend, not
	// even when the periodic sync comes round.
	h.engine.OnServiceAdd(web())
	h.engine.OnEndpointSliceAdd(webSlice())
	for range 3 {
		waitUntil(t, h.clock.HasWaiters, "the loop to wait")
		h.clock.Step(30 * time.Second)
	}
	if got := h.backend.last(); got != nil {
		t.Fatalf("backend synced before the caches: %+v", got)
	}

	h.engine.OnServiceSynced()
	h.engine.OnEndpointSlicesSynced()
	waitFor(t, h.backend.synced, "the first sync", stepWhenWaiting)
	if got := h.backend.last(); !got.Full || len(got.Services) != 1 {
		t.Fatalf("first sync: full=%v services=%v", got.Full, got.Services)
	}

	h.engine.OnServiceAdd(db())
	waitFor(t, h.backend.synced, "a sync after a service add", stepWhenWaiting)
	if got := h.backend.last(); got.Full || !slices.Equal(got.Changed, []string{"ns/db"}) {
		t.Errorf("sync after a service add: full=%v changed=%v, want partial [ns/db]", got.Full, got.Changed)
	}

	h.engine.OnEndpointSliceAdd(dbSlice())
	waitFor(t, h.backend.synced, "a sync after a slice add", stepWhenWaiting)
	if got := h.backend.last(); !slices.Equal(got.Changed, []string{"ns/db"}) || len(got.Services["ns/db:p"].Cluster) != 1 {
		t.Errorf("sync after a slice add: changed=%v db=%v", got.Changed, got.Services["ns/db:p"])
	}

	// A failed sync is retried, in full, without any new event.
	h.backend.failNextSync(errors.New("injected"))
	h.engine.Sync()
	waitFor(t, h.backend.synced, "the retry of a failed sync", stepWhenWaiting)
	if got := h.backend.last(); !got.Full {
		t.Error("retry after a failure was partial")
	}

	cancel()
	waitFor(t, done, "SyncLoop to return after cancel", nil)
}

// waitUntil polls cond, up to a generous bound.
func waitUntil(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestEngineSyncLoopStopsWhileIdle(t *testing.T) {
	for _, tc := range []struct {
		name   string
		synced bool
	}{
		{name: "before the caches synced"},
		{name: "after a sync", synced: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			ctx, cancel := context.WithCancel(h.ctx)
			done := make(chan struct{})
			go func() {
				defer close(done)
				h.engine.SyncLoop(ctx)
			}()
			if tc.synced {
				h.engine.OnServiceSynced()
				h.engine.OnEndpointSlicesSynced()
				waitFor(t, h.backend.synced, "the first sync", nil)
			}
			waitUntil(t, h.clock.HasWaiters, "the loop to wait")
			cancel()
			waitFor(t, done, "SyncLoop to return after cancel", nil)
		})
	}
}

// Informer handlers run on the informers' goroutines, and MetaProxier
// feeds both families' engines from the same one: an event must not wait
// for a backend sync in progress.
func TestEngineEventsDoNotWaitForBackendSync(t *testing.T) {
	h := newHarness(t, nil)
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

	handled := make(chan struct{})
	go func() {
		defer close(handled)
		h.engine.OnServiceAdd(web())
		h.engine.OnEndpointSliceAdd(webSlice())
		h.engine.OnNodeAdd(pt.Node("node-b", map[string]string{"k": "v"}))
		h.engine.OnServiceSynced()
	}()
	waitFor(t, handled, "event handlers to return while the backend syncs", nil)

	h.backend.mu.Lock()
	h.backend.block = nil
	h.backend.mu.Unlock()
	close(release)
	waitFor(t, h.backend.synced, "the blocked sync to finish", nil)
	// The events above asked for another sync, which carries them.
	waitFor(t, h.backend.synced, "the sync with the new events", func() {
		if h.clock.HasWaiters() {
			h.clock.Step(time.Second)
		}
	})
	if got := h.backend.last(); !slices.Equal(got.Changed, []string{"ns/web"}) || len(got.Services["ns/web:p"].Cluster) != 1 {
		t.Errorf("sync after the blocked one: changed=%v web=%v", got.Changed, got.Services["ns/web:p"])
	}
}

func TestNewEngineValidation(t *testing.T) {
	for _, tc := range []struct {
		name    string
		edit    func(o *proxier.EngineOptions)
		wantErr string
	}{
		{name: "valid", edit: func(*proxier.EngineOptions) {}},
		{name: "zero min sync period", edit: func(o *proxier.EngineOptions) { o.MinSyncPeriod = 0 }},
		{name: "min equals max", edit: func(o *proxier.EngineOptions) { o.MinSyncPeriod = o.SyncPeriod }},
		{name: "IPv6", edit: func(o *proxier.EngineOptions) { o.Family = v1.IPv6Protocol }},
		{name: "no clock", edit: func(o *proxier.EngineOptions) { o.Clock = nil }},
		{name: "explicit full sync and retry periods", edit: func(o *proxier.EngineOptions) { o.FullSyncPeriod = time.Minute; o.RetryPeriod = time.Millisecond }},
		{name: "no backend", edit: func(o *proxier.EngineOptions) { o.Backend = nil }, wantErr: "Backend is required"},
		{name: "no family", edit: func(o *proxier.EngineOptions) { o.Family = "" }, wantErr: "unknown IP family"},
		{name: "bogus family", edit: func(o *proxier.EngineOptions) { o.Family = "IPv5" }, wantErr: `unknown IP family "IPv5"`},
		{name: "no node name", edit: func(o *proxier.EngineOptions) { o.NodeName = "" }, wantErr: "NodeName is required"},
		{name: "zero sync period", edit: func(o *proxier.EngineOptions) { o.SyncPeriod = 0 }, wantErr: "sync period must be positive"},
		{name: "negative sync period", edit: func(o *proxier.EngineOptions) { o.SyncPeriod = -time.Second }, wantErr: "sync period must be positive"},
		{name: "negative min sync period", edit: func(o *proxier.EngineOptions) { o.MinSyncPeriod = -time.Second }, wantErr: "min sync period"},
		{name: "min above max", edit: func(o *proxier.EngineOptions) { o.MinSyncPeriod = time.Minute }, wantErr: "min sync period 1m0s must be between 0 and the sync period 30s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := proxier.EngineOptions{
				Family: v1.IPv4Protocol, NodeName: thisNode, Backend: newFakeBackend(),
				MinSyncPeriod: time.Second, SyncPeriod: 30 * time.Second,
				Clock: testingclock.NewFakeClock(epoch),
			}
			tc.edit(&opts)
			e, err := proxier.NewEngine(opts)
			if tc.wantErr == "" {
				if err != nil || e == nil {
					t.Fatalf("NewEngine = %v, %v; want an engine", e, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("NewEngine error = %v, want one containing %q", err, tc.wantErr)
			}
			if e != nil {
				t.Errorf("NewEngine returned an engine with an error")
			}
		})
	}
}

func TestEngineWaitForNodes(t *testing.T) {
	for _, tc := range []struct {
		name         string
		waitForNodes bool
		nodesSynced  bool
		wantSync     bool
	}{
		{name: "nodes not awaited", waitForNodes: false, nodesSynced: false, wantSync: true},
		{name: "nodes awaited and not synced", waitForNodes: true, nodesSynced: false, wantSync: false},
		{name: "nodes awaited and synced", waitForNodes: true, nodesSynced: true, wantSync: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			backend := newFakeBackend()
			e, err := proxier.NewEngine(proxier.EngineOptions{
				Family: v1.IPv4Protocol, NodeName: "node-a", Backend: backend,
				MinSyncPeriod: time.Second, SyncPeriod: 30 * time.Second, WaitForNodes: tc.waitForNodes,
			})
			if err != nil {
				t.Fatal(err)
			}
			e.OnServiceSynced()
			e.OnEndpointSlicesSynced()
			if tc.nodesSynced {
				e.OnNodeSynced()
			}
			if err := e.SyncRules(context.Background()); err != nil {
				t.Fatal(err)
			}
			backend.mu.Lock()
			got := backend.given != nil
			backend.mu.Unlock()
			if got != tc.wantSync {
				t.Errorf("backend synced = %v, want %v", got, tc.wantSync)
			}
		})
	}
}
