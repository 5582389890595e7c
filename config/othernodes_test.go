package config

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	metadatafake "k8s.io/client-go/metadata/fake"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2/ktesting"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// nodeMeta is a node's metadata as the API server sends it to a metadata
// client: with annotations and managed fields, which the cache drops.
func nodeMeta(name string, lbls map[string]string) *metav1.PartialObjectMetadata {
	return &metav1.PartialObjectMetadata{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Labels: lbls, ManagedFields: testManagedFields,
			Annotations: map[string]string{"node.alpha.kubernetes.io/ttl": "0", "example.com/note": strings.Repeat("x", 100)},
		},
	}
}

func newMetadataClient(objs ...*metav1.PartialObjectMetadata) *metadatafake.FakeMetadataClient {
	initial := make([]runtime.Object, 0, len(objs))
	for _, o := range objs {
		initial = append(initial, o)
	}
	scheme := metadatafake.NewTestScheme()
	if err := metav1.AddMetaToScheme(scheme); err != nil {
		panic(fmt.Sprintf("registering the meta types: %v", err))
	}
	return metadatafake.NewSimpleMetadataClient(scheme, initial...)
}

// metadataListsAndWatches counts the list and watch calls a metadata fake
// received, by resource.
func metadataListsAndWatches(client *metadatafake.FakeMetadataClient) map[string]int {
	out := map[string]int{}
	for _, a := range client.Actions() {
		if verb := a.GetVerb(); verb == "list" || verb == "watch" {
			out[verb+" "+a.GetResource().Resource]++
		}
	}
	return out
}

// otherNodesRecorder is an OtherNodesHandler state store: the nodes as the
// event stream describes them, the pending notifications, and the nodes it
// held whenever it was told the labels are no longer pending.
type otherNodesRecorder struct {
	*recorder[*v1.Node]

	mu sync.Mutex
	// pendingCalls are the OnOtherNodesPending arguments, in order.
	pendingCalls []bool
	// keysWhenSettled are the nodes held at each OnOtherNodesPending(false).
	keysWhenSettled [][]string
	// log, when set, is appended a line per call, shared with other
	// handlers to check the order of calls across them.
	log *callLog
}

func newOtherNodesRecorder() *otherNodesRecorder {
	return &otherNodesRecorder{recorder: newRecorder[*v1.Node]()}
}

func (r *otherNodesRecorder) OnNodeAdd(n *v1.Node)          { r.add(n) }
func (r *otherNodesRecorder) OnNodeUpdate(oldN, n *v1.Node) { r.update(oldN, n) }
func (r *otherNodesRecorder) OnNodeDelete(n *v1.Node)       { r.delete(n) }
func (r *otherNodesRecorder) OnOtherNodesPending(pending bool) {
	keys := r.state().keys
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pendingCalls = append(r.pendingCalls, pending)
	if !pending {
		r.keysWhenSettled = append(r.keysWhenSettled, keys)
	}
	r.log.add(fmt.Sprintf("pending %v", pending))
}

func (r *otherNodesRecorder) pendingState() (calls []bool, keysWhenSettled [][]string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.pendingCalls), slices.Clone(r.keysWhenSettled)
}

// callLog records calls to several handlers in the order they happened.
type callLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *callLog) add(line string) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, line)
}

func (l *callLog) snapshot() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.lines)
}

// loggingServiceHandler logs the Services it is told about.
type loggingServiceHandler struct{ log *callLog }

func (h loggingServiceHandler) OnServiceAdd(s *v1.Service) { h.log.add("add " + s.Name) }
func (h loggingServiceHandler) OnServiceUpdate(_, s *v1.Service) {
	h.log.add("update " + s.Name)
}
func (h loggingServiceHandler) OnServiceDelete(s *v1.Service) { h.log.add("delete " + s.Name) }
func (h loggingServiceHandler) OnServiceSynced()              {}

func withTopologyKeys(value string) serviceOption {
	return func(s *v1.Service) {
		if s.Annotations == nil {
			s.Annotations = map[string]string{}
		}
		s.Annotations[proxy.AnnotationTopologyKeys] = value
	}
}

// startOtherNodes builds an OtherNodesConfig on client with rec registered
// and runs it until the test ends; the returned function waits for Run to
// return after cancelling it.
func startOtherNodes(ctx context.Context, t *testing.T, client *metadatafake.FakeMetadataClient, rec *otherNodesRecorder) (*OtherNodesConfig, func()) {
	t.Helper()
	cfg, err := NewOtherNodesConfig(ctx, OtherNodesOptions{Client: client, NodeName: testNode})
	if err != nil {
		t.Fatalf("NewOtherNodesConfig: %v", err)
	}
	cfg.RegisterEventHandler(rec)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	stop := func() {
		cancel()
		<-done
	}
	t.Cleanup(stop)
	go func() {
		defer close(done)
		cfg.Run(ctx)
	}()
	return cfg, stop
}

func TestNeedsNodeLabels(t *testing.T) {
	cases := []struct {
		name string
		svc  *v1.Service
		want bool
	}{
		{name: "no annotation", svc: newService("ns", "a")},
		{name: "a label key", svc: newService("ns", "a", withTopologyKeys(`["example.com/site"]`)), want: true},
		{name: "a label key then any", svc: newService("ns", "a", withTopologyKeys(`["example.com/site","*"]`)), want: true},
		{name: "any only", svc: newService("ns", "a", withTopologyKeys(`["*"]`))},
		{name: "empty list", svc: newService("ns", "a", withTopologyKeys(`[]`))},
		{name: "blank", svc: newService("ns", "a", withTopologyKeys(" "))},
		{name: "malformed", svc: newService("ns", "a", withTopologyKeys(`["example.com/site"`))},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := NeedsNodeLabels(tc.svc); got != tc.want {
				t.Errorf("NeedsNodeLabels = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestNewOtherNodesConfigRejectsBadOptions(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	for name, opts := range map[string]OtherNodesOptions{
		"no client":    {NodeName: testNode},
		"no node name": {Client: newMetadataClient()},
	} {
		t.Run(name, func(t *testing.T) {
			if cfg, err := NewOtherNodesConfig(ctx, opts); err == nil || cfg != nil {
				t.Errorf("NewOtherNodesConfig = %v, %v; want an error", cfg, err)
			}
		})
	}
}

// TestOtherNodesConfigWithoutTopologyKeys: Services that need no node
// labels, including one that needed them briefly before Run started, never
// make it list or watch Nodes.
func TestOtherNodesConfigWithoutTopologyKeys(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := newMetadataClient(nodeMeta("n2", nil), nodeMeta(testNode, nil))
	rec := newOtherNodesRecorder()
	cfg, err := NewOtherNodesConfig(ctx, OtherNodesOptions{Client: client, NodeName: testNode})
	if err != nil {
		t.Fatalf("NewOtherNodesConfig: %v", err)
	}
	cfg.RegisterEventHandler(rec)
	cfg.OnServiceAdd(newService("ns", "plain"))
	cfg.OnServiceAdd(newService("ns", "any", withTopologyKeys(`["*"]`)))
	cfg.OnServiceAdd(newService("ns", "bad", withTopologyKeys(`["x"`)))
	brief := newService("ns", "brief", withTopologyKeys(`["example.com/site"]`))
	cfg.OnServiceAdd(brief)
	cfg.OnServiceUpdate(brief, newService("ns", "brief"))
	cfg.OnServiceSynced()

	ctx, cancel := context.WithCancel(ctx)
	cancel()
	cfg.Run(ctx)
	if got := metadataListsAndWatches(client); len(got) != 0 {
		t.Errorf("metadata requests %v, want none", got)
	}
	if calls, _ := rec.pendingState(); !slices.Equal(calls, []bool{true, false}) {
		t.Errorf("pending calls %v, want [true false] (the brief Service only)", calls)
	}
	if s := rec.state(); len(s.keys) != 0 {
		t.Errorf("nodes delivered %v, want none", s.keys)
	}
}

// TestOtherNodesConfigStartStop follows Services gaining and losing the
// topologyKeys annotation: the watch starts with the first, delivers every
// other node before the labels are reported settled, follows node changes,
// and stops with the last, deleting every node it delivered; a later start
// lists again from scratch.
func TestOtherNodesConfigStartStop(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	site := func(v string) map[string]string { return map[string]string{"example.com/site": v} }
	client := newMetadataClient(nodeMeta(testNode, site("s1")), nodeMeta("n2", site("s1")), nodeMeta("n3", site("s2")))
	rec := newOtherNodesRecorder()
	cfg, _ := startOtherNodes(ctx, t, client, rec)

	topoA := newService("ns", "a", withTopologyKeys(`["example.com/site"]`))
	topoB := newService("ns", "b", withTopologyKeys(`["example.com/site","*"]`))
	plainA := newService("ns", "a")

	settled := func(step string, wantCalls []bool, wantNodes []string) {
		t.Helper()
		waitUntil(ctx, t, step+": the pending calls", func() bool {
			calls, _ := rec.pendingState()
			return slices.Equal(calls, wantCalls)
		})
		_, keys := rec.pendingState()
		if got := keys[len(keys)-1]; !slices.Equal(got, wantNodes) {
			t.Errorf("%s: nodes held when the labels settled = %v, want %v", step, got, wantNodes)
		}
	}
	holds := func(step string, want []string, cond func(recorderState[*v1.Node]) bool) {
		t.Helper()
		waitUntil(ctx, t, step, func() bool {
			s := rec.state()
			return slices.Equal(s.keys, want) && (cond == nil || cond(s))
		})
	}

	cfg.OnServiceAdd(plainA)
	cfg.OnServiceSynced()
	if calls, _ := rec.pendingState(); len(calls) != 0 {
		t.Fatalf("pending calls %v before any Service needs labels", calls)
	}

	// The first Service needing labels: pending at once, then every other
	// node (this one left out although the fake ignores field selectors).
	cfg.OnServiceUpdate(plainA, topoA)
	if calls, _ := rec.pendingState(); !slices.Equal(calls, []bool{true}) {
		t.Fatalf("pending calls right after the annotation appeared = %v, want [true]", calls)
	}
	settled("started", []bool{true, false}, []string{"n2", "n3"})
	if s := rec.state(); s.current["n2"].Annotations != nil || s.current["n2"].Labels["example.com/site"] != "s1" {
		t.Errorf("n2 delivered as %+v, want its labels only", s.current["n2"].ObjectMeta)
	}

	// Node changes follow.
	tracker := client.Tracker()
	if err := tracker.Update(nodesResource, nodeMeta("n3", site("s1")), ""); err != nil {
		t.Fatal(err)
	}
	if err := tracker.Add(nodeMeta("n4", site("s2"))); err != nil {
		t.Fatal(err)
	}
	holds("n3 moved and n4 added", []string{"n2", "n3", "n4"}, func(s recorderState[*v1.Node]) bool {
		return s.current["n3"].Labels["example.com/site"] == "s1"
	})

	// A second Service and the first losing its annotation change nothing.
	cfg.OnServiceAdd(topoB)
	cfg.OnServiceUpdate(topoA, plainA)
	if err := tracker.Delete(nodesResource, "", "n4"); err != nil {
		t.Fatal(err)
	}
	holds("n4 deleted", []string{"n2", "n3"}, nil)
	if got := metadataListsAndWatches(client); got["list nodes"] != 1 {
		t.Errorf("metadata requests %v, want one list", got)
	}

	// The last one goes: every node is deleted, the watch stops.
	cfg.OnServiceDelete(topoB)
	holds("the nodes forgotten", nil, nil)
	if calls, _ := rec.pendingState(); !slices.Equal(calls, []bool{true, false}) {
		t.Errorf("pending calls %v after the stop, want no more", calls)
	}

	// Changes while stopped are picked up by the next list.
	if err := tracker.Add(nodeMeta("n5", site("s3"))); err != nil {
		t.Fatal(err)
	}
	cfg.OnServiceUpdate(plainA, topoA)
	settled("restarted", []bool{true, false, true, false}, []string{"n2", "n3", "n5"})
	if got := metadataListsAndWatches(client); got["list nodes"] != 2 {
		t.Errorf("metadata requests %v, want a second list", got)
	}
	for _, v := range rec.state().violations {
		t.Errorf("inconsistent event stream: %s", v)
	}
}

// TestOtherNodesConfigPendingBeforeService wires the configs as the command
// does: registered on a ServiceConfig before the proxier, OtherNodesConfig
// tells the proxier the labels are pending before the proxier sees the
// Service that needs them, and settled only after every node.
func TestOtherNodesConfigPendingBeforeService(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := newFakeClient(newService("ns", "plain"))
	f, err := NewInformerFactories(InformerOptions{Client: client, NodeName: testNode})
	if err != nil {
		t.Fatalf("NewInformerFactories: %v", err)
	}
	svcCfg, err := NewServiceConfig(ctx, f.Services.Core().V1().Services(), 0)
	if err != nil {
		t.Fatalf("NewServiceConfig: %v", err)
	}
	log := &callLog{}
	rec := newOtherNodesRecorder()
	rec.log = log
	metadataClient := newMetadataClient(nodeMeta("n2", nil))
	otherCfg, _ := startOtherNodes(ctx, t, metadataClient, rec)
	svcCfg.RegisterEventHandler(otherCfg)
	svcCfg.RegisterEventHandler(loggingServiceHandler{log})
	svcCfg.Run(startFactory(ctx, t, f.Services))

	topo := newService("ns", "topo", withTopologyKeys(`["example.com/site"]`))
	if _, err := client.CoreV1().Services("ns").Create(ctx, topo, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitUntil(ctx, t, "the labels to settle", func() bool { return slices.Contains(log.snapshot(), "pending false") })
	if got, want := log.snapshot(), []string{"add plain", "pending true", "add topo", "pending false"}; !slices.Equal(got, want) {
		t.Errorf("calls = %v, want %v", got, want)
	}
	if _, keys := rec.pendingState(); len(keys) != 1 || !slices.Equal(keys[0], []string{"n2"}) {
		t.Errorf("nodes held when settled = %v, want [[n2]]", keys)
	}
}

// TestOtherNodesConfigStopsWithContext: Run returns, with the watch
// stopped, when its context ends while a watch runs.
func TestOtherNodesConfigStopsWithContext(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	rec := newOtherNodesRecorder()
	cfg, stop := startOtherNodes(ctx, t, newMetadataClient(nodeMeta("n2", nil)), rec)
	cfg.OnServiceAdd(newService("ns", "topo", withTopologyKeys(`["example.com/site"]`)))
	waitUntil(ctx, t, "the labels to settle", func() bool {
		calls, _ := rec.pendingState()
		return len(calls) == 2
	})
	stop() // returns once Run has
	if s := rec.state(); !slices.Equal(s.keys, []string{"n2"}) {
		t.Errorf("nodes after shutdown = %v, want them left as delivered", s.keys)
	}
}

// TestOtherNodesConfigDirectEvents feeds raw informer callbacks to the
// metadata event handler: tombstones are unwrapped, other types and this
// node are left out.
func TestOtherNodesConfigDirectEvents(t *testing.T) {
	other, self := nodeMeta("n2", map[string]string{"k": "v"}), nodeMeta(testNode, nil)
	cases := []struct {
		name       string
		events     func(h cache.ResourceEventHandler)
		want       []string
		wantCounts eventCounts
	}{
		{
			name:       "add and update",
			events:     func(h cache.ResourceEventHandler) { h.OnAdd(other, true); h.OnUpdate(other, other) },
			want:       []string{"n2"},
			wantCounts: eventCounts{Adds: 1, Updates: 1},
		},
		{
			name: "tombstone delete is unwrapped",
			events: func(h cache.ResourceEventHandler) {
				h.OnAdd(other, true)
				h.OnDelete(cache.DeletedFinalStateUnknown{Key: "n2", Obj: other})
			},
			wantCounts: eventCounts{Adds: 1, Deletes: 1},
		},
		{
			name: "wrong types are skipped",
			events: func(h cache.ResourceEventHandler) {
				h.OnAdd(newNode("n2", nil), true)
				h.OnAdd(other, true)
				h.OnUpdate(other, newNode("n2", nil))
				h.OnDelete(cache.DeletedFinalStateUnknown{Key: "n2", Obj: newNode("n2", nil)})
			},
			want:       []string{"n2"},
			wantCounts: eventCounts{Adds: 1},
		},
		{
			name: "this node is left out",
			events: func(h cache.ResourceEventHandler) {
				h.OnAdd(self, true)
				h.OnUpdate(self, self)
				h.OnDelete(cache.DeletedFinalStateUnknown{Key: testNode, Obj: self})
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			cfg, err := NewOtherNodesConfig(ctx, OtherNodesOptions{Client: newMetadataClient(), NodeName: testNode})
			if err != nil {
				t.Fatalf("NewOtherNodesConfig: %v", err)
			}
			rec := newOtherNodesRecorder()
			cfg.RegisterEventHandler(rec)
			tc.events(cfg.eventHandler())
			s := rec.state()
			if !slices.Equal(s.keys, tc.want) {
				t.Errorf("nodes = %v, want %v", s.keys, tc.want)
			}
			if s.counts != tc.wantCounts {
				t.Errorf("events = %+v, want %+v", s.counts, tc.wantCounts)
			}
			for _, v := range s.violations {
				t.Errorf("inconsistent event stream: %s", v)
			}
		})
	}
}
