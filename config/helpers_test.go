package config

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// testNode is the node the tests' kproxy runs on.
const testNode = "node-a"

// newFakeClient returns a fake clientset holding objs. The stock fake filters
// lists by label selector but not watches, and applies no field selector; the
// reactors added here filter lists and watches by both (fields: see
// objectFields), as the API server does, so objects created after the
// informers started are subject to the same selectors as the initial list. (They do not emulate the API server
// turning a change that leaves the selector into a DELETED event; no test
// relies on that.)
func newFakeClient(objs ...runtime.Object) *fake.Clientset {
	client := fake.NewClientset(objs...)
	client.PrependReactor("list", "*", func(action k8stesting.Action) (bool, runtime.Object, error) {
		listAction, ok := action.(k8stesting.ListActionImpl)
		if !ok {
			return false, nil, nil
		}
		selector := listAction.GetListRestrictions().Fields
		if selector == nil || selector.Empty() {
			return false, nil, nil
		}
		_, list, err := k8stesting.ObjectReaction(client.Tracker())(action)
		if err != nil {
			return true, nil, err
		}
		items, err := meta.ExtractList(list)
		if err != nil {
			return true, nil, fmt.Errorf("listing %s: %w", action.GetResource(), err)
		}
		items = slices.DeleteFunc(items, func(obj runtime.Object) bool { return !selector.Matches(objectFields(obj)) })
		if err := meta.SetList(list, items); err != nil {
			return true, nil, fmt.Errorf("listing %s: %w", action.GetResource(), err)
		}
		return true, list, nil
	})
	client.PrependWatchReactor("*", func(action k8stesting.Action) (bool, watch.Interface, error) {
		watchAction, ok := action.(k8stesting.WatchActionImpl)
		if !ok {
			return false, nil, nil
		}
		w, err := client.Tracker().Watch(action.GetResource(), action.GetNamespace(), watchAction.ListOptions)
		if err != nil {
			return true, nil, fmt.Errorf("watching %s: %w", action.GetResource(), err)
		}
		restrictions := watchAction.GetWatchRestrictions()
		labelSelector, fieldSelector := restrictions.Labels, restrictions.Fields
		if (labelSelector == nil || labelSelector.Empty()) && (fieldSelector == nil || fieldSelector.Empty()) {
			return true, w, nil
		}
		return true, watch.Filter(w, func(event watch.Event) (watch.Event, bool) {
			accessor, err := meta.Accessor(event.Object)
			if err != nil {
				return event, true // not an object (e.g. an error status): pass through
			}
			if labelSelector != nil && !labelSelector.Matches(labels.Set(accessor.GetLabels())) {
				return event, false
			}
			return event, fieldSelector == nil || fieldSelector.Matches(objectFields(event.Object))
		}), nil
	})
	return client
}

// objectFields are the fields of obj that the fake client's field selectors
// look at: its name and namespace. Other fields are absent, so a selector
// like spec.clusterIP!=None lets everything through (ServiceConfig skips
// headless Services itself, and tests count on it to see them turn
// headless).
func objectFields(obj runtime.Object) fields.Set {
	set := fields.Set{}
	if accessor, err := meta.Accessor(obj); err == nil {
		set["metadata.name"] = accessor.GetName()
		set["metadata.namespace"] = accessor.GetNamespace()
	}
	return set
}

// object is what every recorded API type satisfies.
type object interface {
	metav1.Object
	runtime.Object
}

func objectKey(obj metav1.Object) string {
	if obj.GetNamespace() == "" {
		return obj.GetName()
	}
	return obj.GetNamespace() + "/" + obj.GetName()
}

// eventCounts counts the events a recorder received.
type eventCounts struct {
	Adds, Updates, Deletes int
}

// recorder is a handler state store: it keeps the current objects as the
// event stream describes them, and records every stream inconsistency (an add
// for a known object, an update or delete for an unknown one, an update whose
// old object is not the one last delivered) as a violation.
type recorder[T object] struct {
	mu          sync.Mutex
	current     map[string]T
	lastOld     map[string]T
	counts      eventCounts
	syncedCalls int
	keysAtSync  []string
	violations  []string
}

func newRecorder[T object]() *recorder[T] {
	return &recorder[T]{current: map[string]T{}, lastOld: map[string]T{}}
}

func (r *recorder[T]) add(obj T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := objectKey(obj)
	if _, exists := r.current[key]; exists {
		r.violations = append(r.violations, "add of known object "+key)
	}
	r.current[key] = obj.DeepCopyObject().(T)
	r.counts.Adds++
}

func (r *recorder[T]) update(oldObj, newObj T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := objectKey(newObj)
	if oldKey := objectKey(oldObj); oldKey != key {
		r.violations = append(r.violations, fmt.Sprintf("update from %s to %s", oldKey, key))
	}
	known, exists := r.current[key]
	switch {
	case !exists:
		r.violations = append(r.violations, "update of unknown object "+key)
	case !apiequality.Semantic.DeepEqual(metaOf(known), metaOf(oldObj)):
		r.violations = append(r.violations, "update of "+key+" whose old object is not the last delivered one")
	}
	r.current[key] = newObj.DeepCopyObject().(T)
	r.lastOld[key] = oldObj.DeepCopyObject().(T)
	r.counts.Updates++
}

// metaOf is the object metadata of obj: what an update's old object is
// checked on (an EndpointSlice's old object has no endpoints, labels or
// annotations, see EndpointSliceConfig).
func metaOf(obj metav1.Object) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Namespace: obj.GetNamespace(), Name: obj.GetName(), UID: obj.GetUID(),
		ResourceVersion: obj.GetResourceVersion(),
	}
}

func (r *recorder[T]) delete(obj T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := objectKey(obj)
	if _, exists := r.current[key]; !exists {
		r.violations = append(r.violations, "delete of unknown object "+key)
	}
	delete(r.current, key)
	r.counts.Deletes++
}

func (r *recorder[T]) synced() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.syncedCalls++
	r.keysAtSync = r.keysLocked()
}

func (r *recorder[T]) keysLocked() []string {
	keys := make([]string, 0, len(r.current))
	for key := range r.current {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	return keys
}

func (r *recorder[T]) has(key string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.current[key]
	return ok
}

// recorderState is a copy of a recorder's state, safe to inspect.
type recorderState[T object] struct {
	keys        []string
	current     map[string]T
	lastOld     map[string]T
	counts      eventCounts
	syncedCalls int
	keysAtSync  []string
	violations  []string
}

func (r *recorder[T]) state() recorderState[T] {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := recorderState[T]{
		keys:        r.keysLocked(),
		current:     map[string]T{},
		lastOld:     map[string]T{},
		counts:      r.counts,
		syncedCalls: r.syncedCalls,
		keysAtSync:  slices.Clone(r.keysAtSync),
		violations:  slices.Clone(r.violations),
	}
	for k, v := range r.current {
		s.current[k] = v
	}
	for k, v := range r.lastOld {
		s.lastOld[k] = v
	}
	return s
}

type serviceRecorder struct{ *recorder[*v1.Service] }

func (r serviceRecorder) OnServiceAdd(s *v1.Service)          { r.add(s) }
func (r serviceRecorder) OnServiceUpdate(oldS, s *v1.Service) { r.update(oldS, s) }
func (r serviceRecorder) OnServiceDelete(s *v1.Service)       { r.delete(s) }
func (r serviceRecorder) OnServiceSynced()                    { r.synced() }

type sliceRecorder struct {
	*recorder[*discovery.EndpointSlice]
}

func (r sliceRecorder) OnEndpointSliceAdd(s *discovery.EndpointSlice) { r.add(s) }
func (r sliceRecorder) OnEndpointSliceUpdate(oldS, s *discovery.EndpointSlice) {
	r.update(oldS, s)
}
func (r sliceRecorder) OnEndpointSliceDelete(s *discovery.EndpointSlice) { r.delete(s) }
func (r sliceRecorder) OnEndpointSlicesSynced()                          { r.synced() }

type nodeRecorder struct{ *recorder[*v1.Node] }

func (r nodeRecorder) OnNodeAdd(n *v1.Node)          { r.add(n) }
func (r nodeRecorder) OnNodeUpdate(oldN, n *v1.Node) { r.update(oldN, n) }
func (r nodeRecorder) OnNodeDelete(n *v1.Node)       { r.delete(n) }
func (r nodeRecorder) OnNodeSynced()                 { r.synced() }

// waitUntil polls cond until it holds, failing the test if it does not within
// a generous bound (the bound only guards against hangs; nothing is timed).
func waitUntil(ctx context.Context, t *testing.T, what string, cond func() bool) {
	t.Helper()
	err := wait.PollUntilContextTimeout(ctx, 5*time.Millisecond, 30*time.Second, true,
		func(context.Context) (bool, error) { return cond(), nil })
	if err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

// Object builders.

type serviceOption func(*v1.Service)

func newService(namespace, name string, opts ...serviceOption) *v1.Service {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
		Spec: v1.ServiceSpec{
			Type:      v1.ServiceTypeClusterIP,
			ClusterIP: "10.96.0.10",
			Ports:     []v1.ServicePort{{Name: "http", Port: 80, Protocol: v1.ProtocolTCP}},
		},
	}
	for _, opt := range opts {
		opt(svc)
	}
	return svc
}

func withClusterIP(ip string) serviceOption {
	return func(s *v1.Service) { s.Spec.ClusterIP = ip }
}

func withHeadless() serviceOption { return withClusterIP(v1.ClusterIPNone) }

func withExternalName() serviceOption {
	return func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeExternalName
		s.Spec.ClusterIP = ""
		s.Spec.ExternalName = "db.example.com"
	}
}

func withPort(port int32) serviceOption {
	return func(s *v1.Service) { s.Spec.Ports[0].Port = port }
}

func withServiceLabels(l map[string]string) serviceOption {
	return func(s *v1.Service) { s.Labels = l }
}

func newSlice(namespace, name string, lbls map[string]string, addresses ...string) *discovery.EndpointSlice {
	all := map[string]string{discovery.LabelServiceName: "svc"}
	for k, v := range lbls {
		all[k] = v
	}
	slice := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: namespace, Name: name, Labels: all},
		AddressType: discovery.AddressTypeIPv4,
	}
	for _, a := range addresses {
		slice.Endpoints = append(slice.Endpoints, discovery.Endpoint{Addresses: []string{a}})
	}
	return slice
}

func newNode(name string, lbls map[string]string) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: lbls}}
}
