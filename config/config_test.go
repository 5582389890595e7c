package config

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2/ktesting"
)

func TestServiceSelector(t *testing.T) {
	cases := []struct {
		name      string
		proxyName string
		labels    map[string]string
		wantMatch bool
	}{
		{name: "default proxy takes unlabelled objects", labels: nil, wantMatch: true},
		{name: "default proxy ignores unrelated labels", labels: map[string]string{"app": "web"}, wantMatch: true},
		{name: "default proxy skips objects of a named proxy", labels: map[string]string{LabelServiceProxyName: "other"}, wantMatch: false},
		{name: "default proxy skips an empty proxy name label", labels: map[string]string{LabelServiceProxyName: ""}, wantMatch: false},
		{name: "the headless label is not looked at", labels: map[string]string{LabelHeadless: ""}, wantMatch: true},
		{name: "named proxy takes its own objects", proxyName: "kproxy", labels: map[string]string{LabelServiceProxyName: "kproxy"}, wantMatch: true},
		{name: "named proxy skips other proxies' objects", proxyName: "kproxy", labels: map[string]string{LabelServiceProxyName: "other"}, wantMatch: false},
		{name: "named proxy skips unlabelled objects", proxyName: "kproxy", labels: nil, wantMatch: false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			selector, err := ServiceSelector(tc.proxyName)
			if err != nil {
				t.Fatalf("ServiceSelector(%q): %v", tc.proxyName, err)
			}
			if got := selector.Matches(labels.Set(tc.labels)); got != tc.wantMatch {
				t.Errorf("selector %q matches %v = %v, want %v", selector, tc.labels, got, tc.wantMatch)
			}
		})
	}
}

func TestServiceSelectorString(t *testing.T) {
	cases := []struct {
		name      string
		proxyName string
		want      string
	}{
		{name: "default proxy", want: "!service.kubernetes.io/service-proxy-name"},
		{name: "named proxy", proxyName: "kproxy", want: "service.kubernetes.io/service-proxy-name=kproxy"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			selector, err := ServiceSelector(tc.proxyName)
			if err != nil {
				t.Fatalf("ServiceSelector(%q): %v", tc.proxyName, err)
			}
			want, err := labels.Parse(tc.want)
			if err != nil {
				t.Fatalf("parsing %q: %v", tc.want, err)
			}
			// Selectors render their requirements sorted by key, so compare
			// canonical forms.
			if selector.String() != want.String() {
				t.Errorf("selector = %q, want %q", selector, want)
			}
		})
	}
}

func TestEndpointSliceSelector(t *testing.T) {
	cases := []struct {
		name      string
		labels    map[string]string
		wantMatch bool
	}{
		{name: "unlabelled slice", labels: nil, wantMatch: true},
		{name: "slice of a named proxy's service", labels: map[string]string{LabelServiceProxyName: "other"}, wantMatch: true},
		{name: "slice of a headless service", labels: map[string]string{LabelHeadless: ""}, wantMatch: false},
		{name: "slice of a named proxy's headless service", labels: map[string]string{LabelServiceProxyName: "kproxy", LabelHeadless: ""}, wantMatch: false},
	}
	selector := EndpointSliceSelector()
	if got, want := selector.String(), "!service.kubernetes.io/headless"; got != want {
		t.Errorf("selector = %q, want %q", got, want)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := selector.Matches(labels.Set(tc.labels)); got != tc.wantMatch {
				t.Errorf("selector %q matches %v = %v, want %v", selector, tc.labels, got, tc.wantMatch)
			}
		})
	}
}

func TestServiceFieldSelector(t *testing.T) {
	selector := ServiceFieldSelector()
	if got, want := selector.String(), "spec.clusterIP!=None"; got != want {
		t.Errorf("selector = %q, want %q", got, want)
	}
	for clusterIP, want := range map[string]bool{"10.96.0.10": true, "": true, v1.ClusterIPNone: false} {
		if got := selector.Matches(fields.Set{"spec.clusterIP": clusterIP}); got != want {
			t.Errorf("selector matches clusterIP %q = %v, want %v", clusterIP, got, want)
		}
	}
}

// TestInformerFactoriesSelectors checks the selectors each informer sends
// to the API server, as kube-proxy sends them.
func TestInformerFactoriesSelectors(t *testing.T) {
	type restrictions struct{ labels, fields string }
	cases := []struct {
		name      string
		proxyName string
		want      map[string]restrictions
	}{
		{
			name: "default proxy",
			want: map[string]restrictions{
				"services":       {labels: "!service.kubernetes.io/service-proxy-name", fields: "spec.clusterIP!=None"},
				"endpointslices": {labels: "!service.kubernetes.io/headless"},
				"nodes":          {fields: "metadata.name=" + testNode},
			},
		},
		{
			name:      "named proxy",
			proxyName: "kproxy",
			want: map[string]restrictions{
				"services":       {labels: "service.kubernetes.io/service-proxy-name=kproxy", fields: "spec.clusterIP!=None"},
				"endpointslices": {labels: "!service.kubernetes.io/headless"},
				"nodes":          {fields: "metadata.name=" + testNode},
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			client := fake.NewClientset()
			f, err := NewInformerFactories(InformerOptions{Client: client, NodeName: testNode, ServiceProxyName: tc.proxyName})
			if err != nil {
				t.Fatalf("NewInformerFactories: %v", err)
			}
			f.Services.Core().V1().Services().Informer()
			f.EndpointSlices.Discovery().V1().EndpointSlices().Informer()
			f.Nodes.Core().V1().Nodes().Informer()
			ctx, cancel := context.WithCancel(ctx)
			f.Start(ctx.Done())
			for _, factory := range []informers.SharedInformerFactory{f.Services, f.EndpointSlices, f.Nodes} {
				for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
					if !ok {
						t.Fatalf("informer of %v did not sync", typ)
					}
				}
			}
			cancel()
			f.Shutdown()

			got := map[string]restrictions{}
			for _, action := range client.Actions() {
				var r restrictions
				switch a := action.(type) {
				case k8stesting.ListAction:
					r = restrictions{labels: a.GetListRestrictions().Labels.String(), fields: a.GetListRestrictions().Fields.String()}
				case k8stesting.WatchAction:
					r = restrictions{labels: a.GetWatchRestrictions().Labels.String(), fields: a.GetWatchRestrictions().Fields.String()}
				default:
					continue
				}
				resource := action.GetResource().Resource
				if prev, seen := got[resource]; seen && prev != r {
					t.Errorf("%s: %s with %+v, earlier with %+v", resource, action.GetVerb(), r, prev)
				}
				got[resource] = r
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("selectors by resource = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestServiceSelectorRejectsInvalidNames(t *testing.T) {
	cases := []struct {
		name      string
		proxyName string
	}{
		{name: "spaces", proxyName: "my proxy"},
		{name: "leading dash", proxyName: "-kproxy"},
		{name: "too long", proxyName: strings.Repeat("k", 64)},
		{name: "selector syntax", proxyName: "a,b"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if selector, err := ServiceSelector(tc.proxyName); err == nil {
				t.Errorf("ServiceSelector(%q) = %q, want an error", tc.proxyName, selector)
			}
		})
	}
}

func TestNewInformerFactoriesRejectsBadOptions(t *testing.T) {
	cases := []struct {
		name string
		opts InformerOptions
	}{
		{name: "no client", opts: InformerOptions{NodeName: testNode}},
		{name: "no node name", opts: InformerOptions{Client: fake.NewClientset()}},
		{name: "invalid service proxy name", opts: InformerOptions{Client: fake.NewClientset(), NodeName: testNode, ServiceProxyName: "not valid"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f, err := NewInformerFactories(tc.opts)
			if err == nil {
				t.Fatal("NewInformerFactories succeeded, want an error")
			}
			if f != nil {
				t.Errorf("got factories %+v with an error, want nil", f)
			}
		})
	}
}

// op is one API call a test case makes after the initial sync.
type op[T object] struct {
	verb string // "create", "update" or "delete"
	obj  T
}

func create[T object](obj T) op[T] { return op[T]{verb: "create", obj: obj} }
func update[T object](obj T) op[T] { return op[T]{verb: "update", obj: obj} }
func remove[T object](obj T) op[T] { return op[T]{verb: "delete", obj: obj} }

// harness drives one kind of object through its config.
type harness[T object] struct {
	// start builds the informer factories for proxyName on client, a config
	// feeding every recorder, starts the factory and runs the config until
	// synced.
	start func(ctx context.Context, t *testing.T, client *fake.Clientset, proxyName string, recs []*recorder[T])
	apply func(ctx context.Context, client *fake.Clientset, o op[T]) error
	// barrier is an object every config built for proxyName receives.
	barrier func(proxyName string) T
}

type configCase[T object] struct {
	name      string
	proxyName string
	initial   []T
	ops       []op[T]
	// wantAtSync are the object keys handlers held when told of the sync.
	wantAtSync []string
	// want are the object keys handlers hold after every op.
	want []string
	// wantCounts counts the events delivered for initial and ops.
	wantCounts eventCounts
	check      func(t *testing.T, s recorderState[T])
}

// runConfigCases runs each case against two handlers registered on one
// config. After the ops it creates a barrier object and waits for it: events
// reach each handler in order, so once the barrier arrived every earlier
// event (or its absence) is final.
func runConfigCases[T object](t *testing.T, h harness[T], cases []configCase[T]) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			initial := make([]runtime.Object, 0, len(tc.initial))
			for _, obj := range tc.initial {
				initial = append(initial, obj)
			}
			client := newFakeClient(initial...)
			recs := []*recorder[T]{newRecorder[T](), newRecorder[T]()}
			h.start(ctx, t, client, tc.proxyName, recs)

			for i, rec := range recs {
				s := rec.state()
				if s.syncedCalls != 1 {
					t.Errorf("handler %d: synced called %d times, want 1", i, s.syncedCalls)
				}
				if !slices.Equal(s.keysAtSync, tc.wantAtSync) {
					t.Errorf("handler %d: objects at sync = %v, want %v", i, s.keysAtSync, tc.wantAtSync)
				}
			}

			for _, o := range tc.ops {
				if err := h.apply(ctx, client, o); err != nil {
					t.Fatalf("%s %s: %v", o.verb, objectKey(o.obj), err)
				}
			}
			barrier := h.barrier(tc.proxyName)
			if err := h.apply(ctx, client, create(barrier)); err != nil {
				t.Fatalf("creating barrier: %v", err)
			}
			for i, rec := range recs {
				waitUntil(ctx, t, fmt.Sprintf("the barrier to reach handler %d", i), func() bool {
					return rec.has(objectKey(barrier))
				})
			}

			wantCounts := tc.wantCounts
			wantCounts.Adds++ // the barrier
			for i, rec := range recs {
				s := rec.state()
				keys := slices.DeleteFunc(slices.Clone(s.keys), func(k string) bool { return k == objectKey(barrier) })
				if !slices.Equal(keys, tc.want) {
					t.Errorf("handler %d: objects = %v, want %v", i, keys, tc.want)
				}
				if s.counts != wantCounts {
					t.Errorf("handler %d: events = %+v, want %+v (including the barrier add)", i, s.counts, wantCounts)
				}
				if s.syncedCalls != 1 {
					t.Errorf("handler %d: synced called %d times, want 1", i, s.syncedCalls)
				}
				for _, v := range s.violations {
					t.Errorf("handler %d: inconsistent event stream: %s", i, v)
				}
				if tc.check != nil {
					tc.check(t, s)
				}
			}
		})
	}
}

// startFactory starts factory and arranges for it to be stopped, after ctx
// is cancelled, when the test ends.
func startFactory(ctx context.Context, t *testing.T, factory informers.SharedInformerFactory) context.Context {
	ctx, cancel := context.WithCancel(ctx)
	t.Cleanup(func() {
		cancel()
		factory.Shutdown()
	})
	factory.Start(ctx.Done())
	return ctx
}

func proxyLabels(proxyName string) map[string]string {
	if proxyName == "" {
		return nil
	}
	return map[string]string{LabelServiceProxyName: proxyName}
}

var serviceHarness = harness[*v1.Service]{
	start: func(ctx context.Context, t *testing.T, client *fake.Clientset, proxyName string, recs []*recorder[*v1.Service]) {
		f, err := NewInformerFactories(InformerOptions{Client: client, NodeName: testNode, ServiceProxyName: proxyName})
		if err != nil {
			t.Fatalf("NewInformerFactories: %v", err)
		}
		services := f.Services
		cfg, err := NewServiceConfig(ctx, services.Core().V1().Services(), 0)
		if err != nil {
			t.Fatalf("NewServiceConfig: %v", err)
		}
		for _, rec := range recs {
			cfg.RegisterEventHandler(serviceRecorder{rec})
		}
		cfg.Run(startFactory(ctx, t, services))
	},
	apply: func(ctx context.Context, client *fake.Clientset, o op[*v1.Service]) error {
		services := client.CoreV1().Services(o.obj.Namespace)
		var err error
		switch o.verb {
		case "create":
			_, err = services.Create(ctx, o.obj, metav1.CreateOptions{})
		case "update":
			_, err = services.Update(ctx, o.obj, metav1.UpdateOptions{})
		case "delete":
			err = services.Delete(ctx, o.obj.Name, metav1.DeleteOptions{})
		}
		return err
	},
	barrier: func(proxyName string) *v1.Service {
		return newService("barrier", "barrier", withServiceLabels(proxyLabels(proxyName)))
	},
}

func TestServiceConfig(t *testing.T) {
	kproxyLabels := map[string]string{LabelServiceProxyName: "kproxy"}
	otherLabels := map[string]string{LabelServiceProxyName: "other"}
	cases := []configCase[*v1.Service]{
		{
			name:       "initial services are delivered before synced",
			initial:    []*v1.Service{newService("ns", "a"), newService("ns", "b")},
			wantAtSync: []string{"ns/a", "ns/b"},
			want:       []string{"ns/a", "ns/b"},
			wantCounts: eventCounts{Adds: 2},
		},
		{
			name:    "add update and delete after sync reach every handler",
			initial: []*v1.Service{newService("ns", "a"), newService("ns", "c")},
			ops: []op[*v1.Service]{
				create(newService("ns", "b")),
				update(newService("ns", "a", withPort(8080))),
				remove(newService("ns", "c")),
			},
			wantAtSync: []string{"ns/a", "ns/c"},
			want:       []string{"ns/a", "ns/b"},
			wantCounts: eventCounts{Adds: 3, Updates: 1, Deletes: 1},
			check: func(t *testing.T, s recorderState[*v1.Service]) {
				if got := s.current["ns/a"].Spec.Ports[0].Port; got != 8080 {
					t.Errorf("ns/a port = %d, want 8080", got)
				}
				if got := s.lastOld["ns/a"].Spec.Ports[0].Port; got != 80 {
					t.Errorf("ns/a old port in update = %d, want 80", got)
				}
			},
		},
		{
			name: "headless and ExternalName services are not delivered",
			initial: []*v1.Service{
				newService("ns", "headless", withHeadless()),
				newService("ns", "external", withExternalName()),
				newService("ns", "plain"),
			},
			ops: []op[*v1.Service]{
				create(newService("ns", "headless2", withHeadless())),
				create(newService("ns", "external2", withExternalName())),
				update(newService("ns", "headless", withHeadless(), withPort(81))),
				remove(newService("ns", "external", withExternalName())),
			},
			wantAtSync: []string{"ns/plain"},
			want:       []string{"ns/plain"},
			wantCounts: eventCounts{Adds: 1},
		},
		{
			name:       "service turned headless is delivered as a delete",
			initial:    []*v1.Service{newService("ns", "a")},
			ops:        []op[*v1.Service]{update(newService("ns", "a", withHeadless()))},
			wantAtSync: []string{"ns/a"},
			want:       nil,
			wantCounts: eventCounts{Adds: 1, Deletes: 1},
		},
		{
			name:       "headless service given a cluster IP is delivered as an add",
			initial:    []*v1.Service{newService("ns", "h", withHeadless())},
			ops:        []op[*v1.Service]{update(newService("ns", "h", withClusterIP("10.96.0.20")))},
			wantAtSync: nil,
			want:       []string{"ns/h"},
			wantCounts: eventCounts{Adds: 1},
			check: func(t *testing.T, s recorderState[*v1.Service]) {
				if got := s.current["ns/h"].Spec.ClusterIP; got != "10.96.0.20" {
					t.Errorf("ns/h cluster IP = %q, want 10.96.0.20", got)
				}
			},
		},
		{
			name:    "ExternalName service turned ClusterIP and back is an add then a delete",
			initial: []*v1.Service{newService("ns", "e", withExternalName())},
			ops: []op[*v1.Service]{
				update(newService("ns", "e")),
				update(newService("ns", "e", withExternalName())),
			},
			wantAtSync: nil,
			want:       nil,
			wantCounts: eventCounts{Adds: 1, Deletes: 1},
		},
		{
			name:       "default proxy ignores services of named proxies",
			initial:    []*v1.Service{newService("ns", "other", withServiceLabels(otherLabels)), newService("ns", "plain")},
			ops:        []op[*v1.Service]{create(newService("ns", "other2", withServiceLabels(otherLabels)))},
			wantAtSync: []string{"ns/plain"},
			want:       []string{"ns/plain"},
			wantCounts: eventCounts{Adds: 1},
		},
		{
			name:      "named proxy takes only services labelled with its name",
			proxyName: "kproxy",
			initial: []*v1.Service{
				newService("ns", "mine", withServiceLabels(kproxyLabels)),
				newService("ns", "other", withServiceLabels(otherLabels)),
				newService("ns", "plain"),
			},
			ops: []op[*v1.Service]{
				create(newService("ns", "mine2", withServiceLabels(kproxyLabels))),
				create(newService("ns", "plain2")),
			},
			wantAtSync: []string{"ns/mine"},
			want:       []string{"ns/mine", "ns/mine2"},
			wantCounts: eventCounts{Adds: 2},
		},
	}
	runConfigCases(t, serviceHarness, cases)
}

// TestServiceProxyNameSelectsConfig runs a default and a named proxy's
// configs on one API: each sees only its own services.
func TestServiceProxyNameSelectsConfig(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := newFakeClient(
		newService("ns", "plain"),
		newService("ns", "mine", withServiceLabels(proxyLabels("kproxy"))),
		newService("ns", "third", withServiceLabels(proxyLabels("third"))),
	)
	proxies := []struct {
		proxyName string
		want      []string
	}{
		{proxyName: "", want: []string{"ns/plain", "ns/plain2"}},
		{proxyName: "kproxy", want: []string{"ns/mine", "ns/mine2"}},
	}
	recs := make([]*recorder[*v1.Service], len(proxies))
	for i, p := range proxies {
		recs[i] = newRecorder[*v1.Service]()
		serviceHarness.start(ctx, t, client, p.proxyName, recs[i:i+1])
	}
	for _, svc := range []*v1.Service{
		newService("ns", "plain2"),
		newService("ns", "mine2", withServiceLabels(proxyLabels("kproxy"))),
		newService("ns", "third2", withServiceLabels(proxyLabels("third"))),
	} {
		if err := serviceHarness.apply(ctx, client, create(svc)); err != nil {
			t.Fatalf("creating %s: %v", svc.Name, err)
		}
	}
	for i, p := range proxies {
		barrier := serviceHarness.barrier(p.proxyName)
		barrier.Name = "barrier-" + p.proxyName
		if err := serviceHarness.apply(ctx, client, create(barrier)); err != nil {
			t.Fatalf("creating barrier: %v", err)
		}
		waitUntil(ctx, t, "barrier for proxy "+p.proxyName, func() bool { return recs[i].has(objectKey(barrier)) })
	}
	for i, p := range proxies {
		s := recs[i].state()
		keys := slices.DeleteFunc(slices.Clone(s.keys), func(k string) bool { return strings.HasPrefix(k, "barrier/") })
		if !slices.Equal(keys, p.want) {
			t.Errorf("proxy %q: services = %v, want %v", p.proxyName, keys, p.want)
		}
		for _, v := range s.violations {
			t.Errorf("proxy %q: inconsistent event stream: %s", p.proxyName, v)
		}
	}
}

var sliceHarness = harness[*discovery.EndpointSlice]{
	start: func(ctx context.Context, t *testing.T, client *fake.Clientset, proxyName string, recs []*recorder[*discovery.EndpointSlice]) {
		f, err := NewInformerFactories(InformerOptions{Client: client, NodeName: testNode, ServiceProxyName: proxyName})
		if err != nil {
			t.Fatalf("NewInformerFactories: %v", err)
		}
		factory := f.EndpointSlices
		cfg, err := NewEndpointSliceConfig(ctx, factory.Discovery().V1().EndpointSlices())
		if err != nil {
			t.Fatalf("NewEndpointSliceConfig: %v", err)
		}
		for _, rec := range recs {
			cfg.RegisterEventHandler(sliceRecorder{rec})
		}
		cfg.Run(startFactory(ctx, t, factory))
	},
	apply: func(ctx context.Context, client *fake.Clientset, o op[*discovery.EndpointSlice]) error {
		slices := client.DiscoveryV1().EndpointSlices(o.obj.Namespace)
		var err error
		switch o.verb {
		case "create":
			_, err = slices.Create(ctx, o.obj, metav1.CreateOptions{})
		case "update":
			_, err = slices.Update(ctx, o.obj, metav1.UpdateOptions{})
		case "delete":
			err = slices.Delete(ctx, o.obj.Name, metav1.DeleteOptions{})
		}
		return err
	},
	barrier: func(proxyName string) *discovery.EndpointSlice {
		return newSlice("barrier", "barrier", proxyLabels(proxyName), "10.0.0.1")
	},
}

func TestEndpointSliceConfig(t *testing.T) {
	headless := map[string]string{LabelHeadless: ""}
	kproxyLabels := proxyLabels("kproxy")
	otherLabels := proxyLabels("other")
	cases := []configCase[*discovery.EndpointSlice]{
		{
			name:       "initial slices are delivered before synced",
			initial:    []*discovery.EndpointSlice{newSlice("ns", "a", nil, "10.0.0.1"), newSlice("ns", "b", nil, "10.0.0.2")},
			wantAtSync: []string{"ns/a", "ns/b"},
			want:       []string{"ns/a", "ns/b"},
			wantCounts: eventCounts{Adds: 2},
		},
		{
			name:    "add update and delete after sync reach every handler",
			initial: []*discovery.EndpointSlice{newSlice("ns", "a", nil, "10.0.0.1"), newSlice("ns", "c", nil, "10.0.0.3")},
			ops: []op[*discovery.EndpointSlice]{
				create(newSlice("ns", "b", nil, "10.0.0.2")),
				update(newSlice("ns", "a", nil, "10.0.0.1", "10.0.0.4")),
				remove(newSlice("ns", "c", nil)),
			},
			wantAtSync: []string{"ns/a", "ns/c"},
			want:       []string{"ns/a", "ns/b"},
			wantCounts: eventCounts{Adds: 3, Updates: 1, Deletes: 1},
			check: func(t *testing.T, s recorderState[*discovery.EndpointSlice]) {
				if got := len(s.current["ns/a"].Endpoints); got != 2 {
					t.Errorf("ns/a has %d endpoints, want 2", got)
				}
				// The old object is the cached one, whose endpoints were
				// released after the handlers had it.
				if old := s.lastOld["ns/a"]; old == nil || len(old.Endpoints) != 0 || old.Name != "a" {
					t.Errorf("ns/a old slice in update = %v, want the cached slice without endpoints", old)
				}
			},
		},
		{
			name:       "slices of headless services are not delivered",
			initial:    []*discovery.EndpointSlice{newSlice("ns", "h", headless, "10.0.0.1"), newSlice("ns", "plain", nil, "10.0.0.2")},
			ops:        []op[*discovery.EndpointSlice]{create(newSlice("ns", "h2", headless, "10.0.0.3"))},
			wantAtSync: []string{"ns/plain"},
			want:       []string{"ns/plain"},
			wantCounts: eventCounts{Adds: 1},
		},
		{
			name:       "default proxy takes slices of named proxies' services too",
			initial:    []*discovery.EndpointSlice{newSlice("ns", "other", otherLabels, "10.0.0.1")},
			ops:        []op[*discovery.EndpointSlice]{create(newSlice("ns", "other2", otherLabels, "10.0.0.2"))},
			wantAtSync: []string{"ns/other"},
			want:       []string{"ns/other", "ns/other2"},
			wantCounts: eventCounts{Adds: 2},
		},
		{
			name:      "named proxy takes every non-headless slice",
			proxyName: "kproxy",
			initial: []*discovery.EndpointSlice{
				newSlice("ns", "mine", kproxyLabels, "10.0.0.1"),
				newSlice("ns", "plain", nil, "10.0.0.2"),
				newSlice("ns", "other", otherLabels, "10.0.0.3"),
			},
			ops: []op[*discovery.EndpointSlice]{
				create(newSlice("ns", "mine2", kproxyLabels, "10.0.0.4")),
				create(newSlice("ns", "plain2", nil, "10.0.0.5")),
				create(newSlice("ns", "mine-headless", map[string]string{LabelServiceProxyName: "kproxy", LabelHeadless: ""}, "10.0.0.6")),
			},
			wantAtSync: []string{"ns/mine", "ns/other", "ns/plain"},
			want:       []string{"ns/mine", "ns/mine2", "ns/other", "ns/plain", "ns/plain2"},
			wantCounts: eventCounts{Adds: 5},
		},
	}
	runConfigCases(t, sliceHarness, cases)
}

// TestNodeConfig checks that the Node informer of NewInformerFactories
// delivers this node's Node only, whatever the other nodes do. After the
// ops it adds a label to this node's Node and waits for it: events reach
// each handler in order, so once it arrived every earlier event (or its
// absence) is final.
func TestNodeConfig(t *testing.T) {
	zoneA := map[string]string{v1.LabelTopologyZone: "a"}
	zoneB := map[string]string{v1.LabelTopologyZone: "b"}
	// Labels that would exclude a Service or EndpointSlice must not affect
	// this node.
	serviceFilterLabels := map[string]string{LabelServiceProxyName: "other", LabelHeadless: ""}
	const barrierLabel = "test.kproxy.io/barrier"
	cases := []struct {
		name      string
		proxyName string
		initial   []*v1.Node
		ops       []op[*v1.Node]
		// wantAtSync are the nodes handlers held when told of the sync.
		wantAtSync []string
		// wantCounts counts the events delivered for initial and ops.
		wantCounts eventCounts
		check      func(t *testing.T, s recorderState[*v1.Node])
	}{
		{
			name:       "only this node is delivered",
			initial:    []*v1.Node{newNode("n1", zoneA), newNode(testNode, serviceFilterLabels), newNode("n3", nil)},
			wantAtSync: []string{testNode},
			wantCounts: eventCounts{Adds: 1},
		},
		{
			name:    "this node's changes reach every handler, other nodes' do not",
			initial: []*v1.Node{newNode(testNode, zoneA), newNode("n3", nil)},
			ops: []op[*v1.Node]{
				create(newNode("n2", zoneA)),
				update(newNode("n3", zoneB)),
				update(newNode(testNode, zoneB)),
				remove(newNode("n2", nil)),
			},
			wantAtSync: []string{testNode},
			wantCounts: eventCounts{Adds: 1, Updates: 1},
			check: func(t *testing.T, s recorderState[*v1.Node]) {
				if got := s.current[testNode].Labels[v1.LabelTopologyZone]; got != "b" {
					t.Errorf("%s zone = %q, want b", testNode, got)
				}
			},
		},
		{
			name:    "this node created and deleted after sync",
			initial: []*v1.Node{newNode("n2", nil)},
			ops: []op[*v1.Node]{
				create(newNode(testNode, zoneA)),
				remove(newNode(testNode, nil)),
				create(newNode(testNode, zoneB)),
			},
			wantCounts: eventCounts{Adds: 2, Deletes: 1},
		},
		{
			name:       "a named proxy sees this node whatever its labels",
			proxyName:  "kproxy",
			initial:    []*v1.Node{newNode(testNode, proxyLabels("other")), newNode("n2", proxyLabels("kproxy"))},
			wantAtSync: []string{testNode},
			wantCounts: eventCounts{Adds: 1},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			initial := make([]runtime.Object, 0, len(tc.initial))
			for _, obj := range tc.initial {
				initial = append(initial, obj)
			}
			client := newFakeClient(initial...)
			f, err := NewInformerFactories(InformerOptions{Client: client, NodeName: testNode, ServiceProxyName: tc.proxyName})
			if err != nil {
				t.Fatalf("NewInformerFactories: %v", err)
			}
			cfg, err := NewNodeConfig(ctx, f.Nodes.Core().V1().Nodes(), 0)
			if err != nil {
				t.Fatalf("NewNodeConfig: %v", err)
			}
			recs := []*recorder[*v1.Node]{newRecorder[*v1.Node](), newRecorder[*v1.Node]()}
			for _, rec := range recs {
				cfg.RegisterEventHandler(nodeRecorder{rec})
			}
			cfg.Run(startFactory(ctx, t, f.Nodes))
			for i, rec := range recs {
				if s := rec.state(); !slices.Equal(s.keysAtSync, tc.wantAtSync) || s.syncedCalls != 1 {
					t.Errorf("handler %d: synced %d times with %v, want once with %v", i, s.syncedCalls, s.keysAtSync, tc.wantAtSync)
				}
			}
			nodes := client.CoreV1().Nodes()
			for _, o := range tc.ops {
				var err error
				switch o.verb {
				case "create":
					_, err = nodes.Create(ctx, o.obj, metav1.CreateOptions{})
				case "update":
					_, err = nodes.Update(ctx, o.obj, metav1.UpdateOptions{})
				case "delete":
					err = nodes.Delete(ctx, o.obj.Name, metav1.DeleteOptions{})
				}
				if err != nil {
					t.Fatalf("%s %s: %v", o.verb, o.obj.Name, err)
				}
			}
			barrier, err := nodes.Get(ctx, testNode, metav1.GetOptions{})
			if err != nil {
				t.Fatalf("getting %s for the barrier: %v", testNode, err)
			}
			barrier.Labels = maps.Clone(barrier.Labels)
			if barrier.Labels == nil {
				barrier.Labels = map[string]string{}
			}
			barrier.Labels[barrierLabel] = "set"
			if _, err := nodes.Update(ctx, barrier, metav1.UpdateOptions{}); err != nil {
				t.Fatalf("barrier update: %v", err)
			}
			wantCounts := tc.wantCounts
			wantCounts.Updates++ // the barrier
			for i, rec := range recs {
				waitUntil(ctx, t, fmt.Sprintf("the barrier to reach handler %d", i), func() bool {
					s := rec.state()
					n, ok := s.current[testNode]
					return ok && n.Labels[barrierLabel] == "set"
				})
				s := rec.state()
				if !slices.Equal(s.keys, []string{testNode}) {
					t.Errorf("handler %d: nodes = %v, want only %s", i, s.keys, testNode)
				}
				if s.counts != wantCounts {
					t.Errorf("handler %d: events = %+v, want %+v (including the barrier update)", i, s.counts, wantCounts)
				}
				for _, v := range s.violations {
					t.Errorf("handler %d: inconsistent event stream: %s", i, v)
				}
				if tc.check != nil {
					tc.check(t, s)
				}
			}
		})
	}
}

// directHarness feeds raw informer callbacks (tombstones, wrong types) to a
// config's event handler, which real informers rarely produce on demand.
type directHarness[T object] struct {
	// handler builds a config on a never-started informer and returns its
	// informer event handler, fanning out to rec.
	handler func(ctx context.Context, t *testing.T, rec *recorder[T]) cache.ResourceEventHandler
	obj     T
	// wrong is an object of another kind.
	wrong any
}

type directCase struct {
	name       string
	events     func(h cache.ResourceEventHandler, obj, wrong any)
	want       []string
	wantCounts eventCounts
}

var directCases = []directCase{
	{
		name: "plain delete",
		events: func(h cache.ResourceEventHandler, obj, _ any) {
			h.OnAdd(obj, true)
			h.OnDelete(obj)
		},
		wantCounts: eventCounts{Adds: 1, Deletes: 1},
	},
	{
		name: "tombstone delete is unwrapped",
		events: func(h cache.ResourceEventHandler, obj, _ any) {
			h.OnAdd(obj, false)
			h.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/x", Obj: obj})
		},
		wantCounts: eventCounts{Adds: 1, Deletes: 1},
	},
	{
		name: "tombstone holding the wrong type is skipped",
		events: func(h cache.ResourceEventHandler, obj, wrong any) {
			h.OnAdd(obj, false)
			h.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/x", Obj: wrong})
		},
		want:       []string{"ns/x"},
		wantCounts: eventCounts{Adds: 1},
	},
	{
		name: "add of the wrong type is skipped",
		events: func(h cache.ResourceEventHandler, _, wrong any) {
			h.OnAdd(wrong, false)
			h.OnAdd("not an object", false)
		},
	},
	{
		name: "update with a wrong type is skipped",
		events: func(h cache.ResourceEventHandler, obj, wrong any) {
			h.OnAdd(obj, false)
			h.OnUpdate(obj, wrong)
			h.OnUpdate(wrong, obj)
		},
		want:       []string{"ns/x"},
		wantCounts: eventCounts{Adds: 1},
	},
	{
		name: "delete of the wrong type is skipped",
		events: func(h cache.ResourceEventHandler, obj, wrong any) {
			h.OnAdd(obj, false)
			h.OnDelete(wrong)
		},
		want:       []string{"ns/x"},
		wantCounts: eventCounts{Adds: 1},
	},
	{
		name: "update delivers old and new",
		events: func(h cache.ResourceEventHandler, obj, _ any) {
			h.OnAdd(obj, false)
			h.OnUpdate(obj, obj.(runtime.Object).DeepCopyObject())
		},
		want:       []string{"ns/x"},
		wantCounts: eventCounts{Adds: 1, Updates: 1},
	},
}

func runDirectCases[T object](t *testing.T, h directHarness[T], cases []directCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			rec := newRecorder[T]()
			tc.events(h.handler(ctx, t, rec), h.obj, h.wrong)
			s := rec.state()
			if !slices.Equal(s.keys, tc.want) {
				t.Errorf("objects = %v, want %v", s.keys, tc.want)
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

// idle returns a factory that is never started: configs register on it but
// nothing is delivered unless a test calls the handlers itself.
func idle() informers.SharedInformerFactory {
	return informers.NewSharedInformerFactory(fake.NewClientset(), 0)
}

func TestServiceConfigDirectEvents(t *testing.T) {
	h := directHarness[*v1.Service]{
		handler: func(ctx context.Context, t *testing.T, rec *recorder[*v1.Service]) cache.ResourceEventHandler {
			cfg, err := NewServiceConfig(ctx, idle().Core().V1().Services(), 0)
			if err != nil {
				t.Fatalf("NewServiceConfig: %v", err)
			}
			cfg.RegisterEventHandler(serviceRecorder{rec})
			return cfg.eventHandler()
		},
		obj:   newService("ns", "x"),
		wrong: newNode("x", nil),
	}
	cases := append(slices.Clone(directCases),
		directCase{
			name: "tombstone of a headless service is skipped",
			events: func(h cache.ResourceEventHandler, _, _ any) {
				h.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/h", Obj: newService("ns", "h", withHeadless())})
			},
		},
		directCase{
			name: "typed nil service is skipped",
			events: func(h cache.ResourceEventHandler, _, _ any) {
				h.OnAdd((*v1.Service)(nil), false)
			},
		},
	)
	runDirectCases(t, h, cases)
}

func TestEndpointSliceConfigDirectEvents(t *testing.T) {
	runDirectCases(t, directHarness[*discovery.EndpointSlice]{
		handler: func(ctx context.Context, t *testing.T, rec *recorder[*discovery.EndpointSlice]) cache.ResourceEventHandler {
			cfg, err := NewEndpointSliceConfig(ctx, idle().Discovery().V1().EndpointSlices())
			if err != nil {
				t.Fatalf("NewEndpointSliceConfig: %v", err)
			}
			cfg.RegisterEventHandler(sliceRecorder{rec})
			return cfg.eventHandler()
		},
		obj:   newSlice("ns", "x", nil, "10.0.0.1"),
		wrong: newService("ns", "x"),
	}, directCases)
}

func TestNodeConfigDirectEvents(t *testing.T) {
	node := newNode("x", nil)
	// Nodes are cluster-scoped; the shared cases expect the key "ns/x", so
	// give the test node a namespace (the config does not look at it).
	node.Namespace = "ns"
	runDirectCases(t, directHarness[*v1.Node]{
		handler: func(ctx context.Context, t *testing.T, rec *recorder[*v1.Node]) cache.ResourceEventHandler {
			cfg, err := NewNodeConfig(ctx, idle().Core().V1().Nodes(), 0)
			if err != nil {
				t.Fatalf("NewNodeConfig: %v", err)
			}
			cfg.RegisterEventHandler(nodeRecorder{rec})
			return cfg.eventHandler()
		},
		obj:   node,
		wrong: newSlice("ns", "x", nil),
	}, directCases)
}

// TestRunWithoutSync checks that Run gives up, without telling handlers the
// cache synced, when its context ends before the informer ever ran.
func TestRunWithoutSync(t *testing.T) {
	cases := []struct {
		name string
		run  func(ctx context.Context, t *testing.T) func() int
	}{
		{
			name: "services",
			run: func(ctx context.Context, t *testing.T) func() int {
				rec := newRecorder[*v1.Service]()
				cfg, err := NewServiceConfig(ctx, idle().Core().V1().Services(), 0)
				if err != nil {
					t.Fatalf("NewServiceConfig: %v", err)
				}
				cfg.RegisterEventHandler(serviceRecorder{rec})
				cfg.Run(ctx)
				return func() int { return rec.state().syncedCalls }
			},
		},
		{
			name: "endpoint slices",
			run: func(ctx context.Context, t *testing.T) func() int {
				rec := newRecorder[*discovery.EndpointSlice]()
				cfg, err := NewEndpointSliceConfig(ctx, idle().Discovery().V1().EndpointSlices())
				if err != nil {
					t.Fatalf("NewEndpointSliceConfig: %v", err)
				}
				cfg.RegisterEventHandler(sliceRecorder{rec})
				cfg.Run(ctx)
				return func() int { return rec.state().syncedCalls }
			},
		},
		{
			name: "nodes",
			run: func(ctx context.Context, t *testing.T) func() int {
				rec := newRecorder[*v1.Node]()
				cfg, err := NewNodeConfig(ctx, idle().Core().V1().Nodes(), 0)
				if err != nil {
					t.Fatalf("NewNodeConfig: %v", err)
				}
				cfg.RegisterEventHandler(nodeRecorder{rec})
				cfg.Run(ctx)
				return func() int { return rec.state().syncedCalls }
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			ctx, cancel := context.WithCancel(ctx)
			cancel()
			if got := tc.run(ctx, t)(); got != 0 {
				t.Errorf("synced called %d times, want 0", got)
			}
		})
	}
}

// TestEndpointSliceConfigReleasesEndpoints: handlers get a slice's
// endpoints, the cached object then keeps none, a replay of the cache (a
// resync) is not delivered, and deletes still name the slice and its
// service.
func TestEndpointSliceConfigReleasesEndpoints(t *testing.T) {
	cases := []struct {
		name         string
		events       func(h cache.ResourceEventHandler, a, b *discovery.EndpointSlice)
		wantCounts   eventCounts
		wantReleased int
		wantEps      int // endpoints of ns/x as the handler last saw it
	}{
		{
			name:         "add delivers endpoints then releases them",
			events:       func(h cache.ResourceEventHandler, a, _ *discovery.EndpointSlice) { h.OnAdd(a, false) },
			wantCounts:   eventCounts{Adds: 1},
			wantReleased: 1, wantEps: 1,
		},
		{
			name: "a replay of the cached slice is not delivered",
			events: func(h cache.ResourceEventHandler, a, _ *discovery.EndpointSlice) {
				h.OnAdd(a, false)
				h.OnUpdate(a, a)
			},
			wantCounts:   eventCounts{Adds: 1},
			wantReleased: 1, wantEps: 1,
		},
		{
			name: "an update delivers the new slice and forgets the old",
			events: func(h cache.ResourceEventHandler, a, b *discovery.EndpointSlice) {
				h.OnAdd(a, false)
				h.OnUpdate(a, b)
			},
			wantCounts:   eventCounts{Adds: 1, Updates: 1},
			wantReleased: 1, wantEps: 2,
		},
		{
			name: "a tombstone of a released slice deletes it",
			events: func(h cache.ResourceEventHandler, a, _ *discovery.EndpointSlice) {
				h.OnAdd(a, false)
				h.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/x", Obj: a})
			},
			wantCounts: eventCounts{Adds: 1, Deletes: 1},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			cfg, err := NewEndpointSliceConfig(ctx, idle().Discovery().V1().EndpointSlices())
			if err != nil {
				t.Fatal(err)
			}
			rec := newRecorder[*discovery.EndpointSlice]()
			cfg.RegisterEventHandler(sliceRecorder{rec})
			a, b := newSlice("ns", "x", nil, "10.0.0.1"), newSlice("ns", "x", nil, "10.0.0.1", "10.0.0.2")
			tc.events(cfg.eventHandler(), a, b)
			s := rec.state()
			if s.counts != tc.wantCounts {
				t.Errorf("events = %+v, want %+v", s.counts, tc.wantCounts)
			}
			for _, v := range s.violations {
				t.Errorf("inconsistent event stream: %s", v)
			}
			if got := len(cfg.released); got != tc.wantReleased {
				t.Errorf("%d slices released, want %d", got, tc.wantReleased)
			}
			if cur, ok := s.current["ns/x"]; ok && len(cur.Endpoints) != tc.wantEps {
				t.Errorf("handler saw %d endpoints, want %d", len(cur.Endpoints), tc.wantEps)
			}
			for _, sl := range []*discovery.EndpointSlice{a, b} {
				if _, released := cfg.released[sl]; released && (len(sl.Endpoints) != 0 || sl.Labels != nil || sl.Name == "" || sl.AddressType == "") {
					t.Errorf("released slice %+v: want no endpoints or labels, its name and address type", sl)
				}
			}
		})
	}
}
