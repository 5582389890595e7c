package config

import (
	"context"
	"maps"
	"reflect"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/pkg/proxy"
)

var testManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl", Operation: metav1.ManagedFieldsOperationApply}}

// fullService is a Service carrying everything the transform drops, besides
// what it keeps.
func fullService() *v1.Service {
	svc := newService("ns", "web", withServiceLabels(map[string]string{"app": "web"}))
	svc.Spec.Selector = map[string]string{"app": "web"}
	svc.ManagedFields = testManagedFields
	svc.Annotations = map[string]string{
		proxy.AnnotationTopologyKeys:                       "kubernetes.io/hostname,*",
		v1.AnnotationLoadBalancerSourceRangesKey:           "10.0.0.0/8",
		"kubectl.kubernetes.io/last-applied-configuration": `{"big":"blob"}`,
		"example.com/note":                                 "x",
	}
	svc.OwnerReferences = []metav1.OwnerReference{{APIVersion: "example.com/v1", Kind: "App", Name: "web", UID: "u0"}}
	svc.Status = v1.ServiceStatus{
		LoadBalancer: v1.LoadBalancerStatus{Ingress: []v1.LoadBalancerIngress{{IP: "192.0.2.1"}}},
		Conditions:   []metav1.Condition{{Type: "Ready", Status: metav1.ConditionTrue}},
	}
	return svc
}

func fullSlice() *discovery.EndpointSlice {
	slice := newSlice("ns", "web-abc", map[string]string{"app": "web"}, "10.1.0.1")
	slice.ManagedFields = testManagedFields
	slice.Annotations = map[string]string{
		v1.EndpointsLastChangeTriggerTime: "2026-01-01T00:00:00Z",
		"example.com/note":                "x",
	}
	slice.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Service", Name: "web", UID: "u1"}}
	ep := &slice.Endpoints[0]
	ep.Conditions = discovery.EndpointConditions{Ready: ptr.To(true), Serving: ptr.To(true), Terminating: ptr.To(false)}
	ep.NodeName, ep.Zone = ptr.To("node-a"), ptr.To("z1")
	ep.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "z1"}}}
	ep.TargetRef = &v1.ObjectReference{Kind: "Pod", Namespace: "ns", Name: "web-1", UID: "u2", ResourceVersion: "7"}
	ep.Hostname = ptr.To("web-1")
	ep.DeprecatedTopology = map[string]string{"kubernetes.io/hostname": "node-a"}
	return slice
}

// fullNode is this node's Node as the kubelet and controllers leave it: the
// parts kproxy reads, and managed fields, annotations and a busy status.
func fullNode() *v1.Node {
	node := newNode(testNode, map[string]string{v1.LabelTopologyZone: "z1", v1.LabelHostname: testNode})
	node.ManagedFields = testManagedFields
	node.Annotations = map[string]string{"node.alpha.kubernetes.io/ttl": "0", "example.com/note": "x"}
	node.Spec = v1.NodeSpec{PodCIDR: "10.244.1.0/24", Taints: []v1.Taint{{Key: "ToBeDeletedByClusterAutoscaler", Effect: v1.TaintEffectNoSchedule}}}
	deleted := metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	node.DeletionTimestamp = &deleted
	node.Status = v1.NodeStatus{
		Addresses:  []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "192.0.2.10"}},
		Conditions: []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue}},
		Images:     []v1.ContainerImage{{Names: []string{"registry.example/app:1"}, SizeBytes: 1 << 20}},
		NodeInfo:   v1.NodeSystemInfo{KubeletVersion: "v1.37.2"},
		Capacity:   v1.ResourceList{v1.ResourcePods: resource.MustParse("110")},
	}
	return node
}

func TestTransformNode(t *testing.T) {
	trimmed := fullNode()
	trimmed.ManagedFields = nil
	trimmed.Annotations = nil
	trimmed.Status = v1.NodeStatus{Addresses: trimmed.Status.Addresses}
	tombstone := cache.DeletedFinalStateUnknown{Key: testNode, Obj: fullNode()}
	cases := []struct {
		name string
		in   any
		want any
	}{
		{name: "managed fields, annotations and status but addresses dropped", in: fullNode(), want: trimmed},
		{name: "an already trimmed node is unchanged", in: trimmed.DeepCopy(), want: trimmed},
		{name: "tombstone passed through", in: tombstone, want: tombstone},
		{name: "other kind passed through", in: fullService(), want: fullService()},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := transformNode(tc.in)
			if err != nil {
				t.Fatalf("transformNode: %v", err)
			}
			if !apiequality.Semantic.DeepEqual(got, tc.want) {
				t.Errorf("transformNode =\n%#v\nwant\n%#v", got, tc.want)
			}
		})
	}
}

func TestTransformNodeMetadata(t *testing.T) {
	full := func() *metav1.PartialObjectMetadata {
		m := nodeMeta("n2", map[string]string{"example.com/site": "s1"})
		m.ResourceVersion = "42"
		m.UID = "uid-n2"
		m.OwnerReferences = []metav1.OwnerReference{{Kind: "Machine", Name: "m2"}}
		m.Finalizers = []string{"example.com/keep"}
		return m
	}
	trimmed := &metav1.PartialObjectMetadata{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
		ObjectMeta: metav1.ObjectMeta{Name: "n2", ResourceVersion: "42", Labels: map[string]string{"example.com/site": "s1"}},
	}
	tombstone := cache.DeletedFinalStateUnknown{Key: "n2", Obj: full()}
	cases := []struct {
		name string
		in   any
		want any
	}{
		{name: "everything but name, resource version and labels dropped", in: full(), want: trimmed},
		{name: "an already trimmed object is unchanged", in: trimmed.DeepCopy(), want: trimmed},
		{name: "tombstone passed through", in: tombstone, want: tombstone},
		{name: "other kind passed through", in: fullNode(), want: fullNode()},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := transformNodeMetadata(tc.in)
			if err != nil {
				t.Fatalf("transformNodeMetadata: %v", err)
			}
			if !apiequality.Semantic.DeepEqual(got, tc.want) {
				t.Errorf("transformNodeMetadata =\n%#v\nwant\n%#v", got, tc.want)
			}
		})
	}
}

func TestTransformService(t *testing.T) {
	trimmed := func(annotations map[string]string) *v1.Service {
		svc := fullService()
		svc.ManagedFields = nil
		svc.OwnerReferences = nil
		svc.Labels = nil
		svc.Spec.Selector = nil
		svc.Annotations = annotations
		svc.Status.Conditions = nil
		return svc
	}
	tombstone := cache.DeletedFinalStateUnknown{Key: "ns/web", Obj: fullService()}
	cases := []struct {
		name string
		in   any
		want any
	}{
		{
			name: "managed fields, unread annotations and conditions dropped",
			in:   fullService(),
			want: trimmed(map[string]string{
				proxy.AnnotationTopologyKeys:             "kubernetes.io/hostname,*",
				v1.AnnotationLoadBalancerSourceRangesKey: "10.0.0.0/8",
			}),
		},
		{
			name: "only unread annotations leaves none",
			in: func() *v1.Service {
				svc := fullService()
				svc.Annotations = map[string]string{"example.com/note": "x"}
				return svc
			}(),
			want: trimmed(nil),
		},
		{
			name: "an already trimmed service is unchanged",
			in:   trimmed(map[string]string{proxy.AnnotationTopologyKeys: "*"}),
			want: trimmed(map[string]string{proxy.AnnotationTopologyKeys: "*"}),
		},
		{name: "tombstone passed through", in: tombstone, want: tombstone},
		{name: "other kind passed through", in: fullSlice(), want: fullSlice()},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := transformService(tc.in)
			if err != nil {
				t.Fatalf("transformService: %v", err)
			}
			if !apiequality.Semantic.DeepEqual(got, tc.want) {
				t.Errorf("transformService =\n%#v\nwant\n%#v", got, tc.want)
			}
		})
	}
}

func TestTransformEndpointSlice(t *testing.T) {
	trimmed := func(annotations map[string]string) *discovery.EndpointSlice {
		slice := fullSlice()
		slice.ManagedFields = nil
		slice.OwnerReferences = nil
		slice.Annotations = annotations
		slice.Labels = map[string]string{discovery.LabelServiceName: "svc"}
		ep := &slice.Endpoints[0]
		ep.TargetRef, ep.Hostname, ep.DeprecatedTopology = nil, nil, nil
		return slice
	}
	tombstone := cache.DeletedFinalStateUnknown{Key: "ns/web-abc", Obj: fullSlice()}
	cases := []struct {
		name string
		in   any
		want any
	}{
		{
			name: "managed fields and unread annotations dropped",
			in:   fullSlice(),
			want: trimmed(map[string]string{v1.EndpointsLastChangeTriggerTime: "2026-01-01T00:00:00Z"}),
		},
		{
			name: "no annotations stays without",
			in: func() *discovery.EndpointSlice {
				slice := fullSlice()
				slice.Annotations = nil
				return slice
			}(),
			want: trimmed(nil),
		},
		{
			name: "an already trimmed slice is unchanged",
			in:   trimmed(nil),
			want: trimmed(nil),
		},
		{name: "tombstone passed through", in: tombstone, want: tombstone},
		{name: "other kind passed through", in: fullService(), want: fullService()},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := transformEndpointSlice(tc.in)
			if err != nil {
				t.Fatalf("transformEndpointSlice: %v", err)
			}
			if !apiequality.Semantic.DeepEqual(got, tc.want) {
				t.Errorf("transformEndpointSlice =\n%#v\nwant\n%#v", got, tc.want)
			}
		})
	}
}

// TestInformerFactoriesTrimObjects checks that the factories install the
// transforms: objects reach handlers and the informer's store trimmed.
func TestInformerFactoriesTrimObjects(t *testing.T) {
	cases := []struct {
		name     string
		object   object
		informer func(*InformerFactories) cache.SharedIndexInformer
		wantAnn  map[string]string
		// wantLabels, when set, are the labels kept (else all are).
		wantLabels map[string]string
	}{
		{
			name:   "service",
			object: fullService(),
			informer: func(f *InformerFactories) cache.SharedIndexInformer {
				return f.Services.Core().V1().Services().Informer()
			},
			wantAnn: map[string]string{
				proxy.AnnotationTopologyKeys:             "kubernetes.io/hostname,*",
				v1.AnnotationLoadBalancerSourceRangesKey: "10.0.0.0/8",
			},
			wantLabels: map[string]string{},
		},
		{
			name:   "endpoint slice",
			object: fullSlice(),
			informer: func(f *InformerFactories) cache.SharedIndexInformer {
				return f.EndpointSlices.Discovery().V1().EndpointSlices().Informer()
			},
			wantAnn:    map[string]string{v1.EndpointsLastChangeTriggerTime: "2026-01-01T00:00:00Z"},
			wantLabels: map[string]string{discovery.LabelServiceName: "svc"},
		},
		{
			name:   "this node",
			object: fullNode(),
			informer: func(f *InformerFactories) cache.SharedIndexInformer {
				return f.Nodes.Core().V1().Nodes().Informer()
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			client := newFakeClient(tc.object)
			f, err := NewInformerFactories(InformerOptions{Client: client, NodeName: testNode})
			if err != nil {
				t.Fatalf("NewInformerFactories: %v", err)
			}
			delivered := make(chan metav1.Object, 1)
			informer := tc.informer(f)
			if _, err := informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
				AddFunc: func(obj any) { delivered <- obj.(metav1.Object) },
			}); err != nil {
				t.Fatalf("adding the handler: %v", err)
			}
			f.Start(ctx.Done())
			defer func() {
				cancel()
				f.Shutdown()
			}()
			var got metav1.Object
			select {
			case got = <-delivered:
			case <-ctx.Done():
				t.Fatalf("no object delivered: %v", ctx.Err())
			}
			wantLabels := tc.wantLabels
			if wantLabels == nil {
				wantLabels = tc.object.GetLabels()
			}
			checkTrimmed(t, "delivered", got, tc.wantAnn, wantLabels)
			cached := informer.GetStore().List()
			if len(cached) != 1 {
				t.Fatalf("informer store holds %d objects, want 1", len(cached))
			}
			checkTrimmed(t, "cached", cached[0].(metav1.Object), tc.wantAnn, wantLabels)
		})
	}
}

func checkTrimmed(t *testing.T, what string, got metav1.Object, wantAnnotations, wantLabels map[string]string) {
	t.Helper()
	if mf := got.GetManagedFields(); mf != nil {
		t.Errorf("%s object has managed fields %v, want none", what, mf)
	}
	if ann := got.GetAnnotations(); !apiequality.Semantic.DeepEqual(ann, wantAnnotations) {
		t.Errorf("%s object has annotations %v, want %v", what, ann, wantAnnotations)
	}
	if lbls := got.GetLabels(); !apiequality.Semantic.DeepEqual(lbls, wantLabels) {
		t.Errorf("%s object has labels %v, want %v", what, lbls, wantLabels)
	}
}

// TestSliceTrimmerShares: the informer's transform trims as
// transformEndpointSlice does, and equal condition flags, node names and
// zones of different slices end up as one value in memory.
func TestSliceTrimmerShares(t *testing.T) {
	tr := newSliceTrimmer()
	a, b := fullSlice(), fullSlice()
	b.Name = "web-def"
	b.Endpoints[0].Conditions.Terminating = ptr.To(true)
	b.Endpoints[0].Zone = ptr.To("z2")
	wantA, _ := transformEndpointSlice(fullSlice())
	gotA, _ := tr.transform(a)
	gotB, _ := tr.transform(b)
	if !apiequality.Semantic.DeepEqual(gotA, wantA) {
		t.Errorf("trimmer = %#v, want %#v", gotA, wantA)
	}
	ea, eb := gotA.(*discovery.EndpointSlice).Endpoints[0], gotB.(*discovery.EndpointSlice).Endpoints[0]
	for _, tc := range []struct {
		name  string
		same  bool
		x, y  any
		value string
	}{
		{name: "ready flags shared", same: true, x: ea.Conditions.Ready, y: eb.Conditions.Ready},
		{name: "ready and serving are one true", same: true, x: ea.Conditions.Ready, y: eb.Conditions.Serving},
		{name: "false and true differ", same: false, x: ea.Conditions.Terminating, y: eb.Conditions.Terminating},
		{name: "node names shared", same: true, x: ea.NodeName, y: eb.NodeName},
		{name: "different zones differ", same: false, x: ea.Zone, y: eb.Zone},
	} {
		if got := tc.x == tc.y; got != tc.same {
			t.Errorf("%s: pointers equal = %v, want %v", tc.name, got, tc.same)
		}
	}
	if *eb.Conditions.Terminating != true || *ea.Conditions.Terminating != false || *eb.Zone != "z2" {
		t.Errorf("shared values changed meaning: %v %v %q", *ea.Conditions.Terminating, *eb.Conditions.Terminating, *eb.Zone)
	}
	if got, _ := tr.transform(fullService()); !apiequality.Semantic.DeepEqual(got, fullService()) {
		t.Errorf("trimmer changed a Service")
	}
}

// TestKept: the kept entries, reusing the map when nothing is dropped.
func TestKept(t *testing.T) {
	keys := []string{"a", "b"}
	for _, tc := range []struct {
		name      string
		in, want  map[string]string
		wantSame  bool
		wantIsNil bool
	}{
		{name: "nil stays nil", in: nil, wantIsNil: true},
		{name: "empty becomes nil", in: map[string]string{}, wantIsNil: true},
		{name: "only kept keys: the same map", in: map[string]string{"a": "1"}, want: map[string]string{"a": "1"}, wantSame: true},
		{name: "all kept keys: the same map", in: map[string]string{"a": "1", "b": "2"}, want: map[string]string{"a": "1", "b": "2"}, wantSame: true},
		{name: "others dropped into a new map", in: map[string]string{"a": "1", "c": "3"}, want: map[string]string{"a": "1"}},
		{name: "no kept key: nil", in: map[string]string{"c": "3"}, wantIsNil: true},
		{name: "more entries than keys", in: map[string]string{"a": "1", "b": "2", "c": "3"}, want: map[string]string{"a": "1", "b": "2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := kept(tc.in, keys)
			if tc.wantIsNil {
				if got != nil {
					t.Fatalf("kept = %v, want nil", got)
				}
				return
			}
			if !maps.Equal(got, tc.want) {
				t.Errorf("kept = %v, want %v", got, tc.want)
			}
			if same := reflect.ValueOf(got).UnsafePointer() == reflect.ValueOf(tc.in).UnsafePointer(); same != tc.wantSame {
				t.Errorf("kept returned the same map = %v, want %v", same, tc.wantSame)
			}
		})
	}
}
