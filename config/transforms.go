package config

import (
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// The informer transforms below shrink cached Services, EndpointSlices and
// Nodes to what kproxy reads, before they enter the informer's store and
// reach the handlers: managed fields and owner references are dropped, of the
// annotations only the ones the engine looks at are kept, and of an
// EndpointSlice's labels only the service-name label and of its endpoints
// only what endpoint selection reads; a Service loses its labels and pod
// selector (the API server applies the label selectors).
//
// client-go hands a transform freshly decoded objects that nobody else holds,
// so they are trimmed in place. Tombstones (cache.DeletedFinalStateUnknown)
// carry an object that was already transformed, and client-go does not pass
// them to transforms; like any object of another type they are returned
// unchanged. Each transform is idempotent.

// serviceAnnotations are the Service annotations the engine reads:
// topologyKeys, and the load-balancer source ranges annotation (read only to
// warn that it is ignored).
var serviceAnnotations = []string{proxy.AnnotationTopologyKeys, v1.AnnotationLoadBalancerSourceRangesKey}

// endpointSliceAnnotations are the EndpointSlice annotations the engine
// reads: the last change trigger time, for network programming latency.
var endpointSliceAnnotations = []string{v1.EndpointsLastChangeTriggerTime}

// transformService trims a *v1.Service to what the engine reads: no managed
// fields, owner references, labels or pod selector, only serviceAnnotations, and no status conditions (only the load
// balancer status is read).
func transformService(obj any) (any, error) {
	svc, ok := obj.(*v1.Service)
	if !ok || svc == nil {
		return obj, nil
	}
	svc.ManagedFields = nil
	svc.OwnerReferences = nil
	// The label selectors are applied by the API server; the engine reads
	// neither labels nor the pod selector.
	svc.Labels = nil
	svc.Spec.Selector = nil
	keepAnnotations(&svc.ObjectMeta, serviceAnnotations...)
	svc.Status.Conditions = nil
	return svc, nil
}

// transformEndpointSlice trims a *discovery.EndpointSlice to what the engine
// reads: no managed fields or owner references, only
// endpointSliceAnnotations, only the service-name label, and of each
// endpoint its addresses, conditions, node, zone and hints. The endpoints'
// target references (a pod's kind, namespace, name, UID and resource
// version), hostnames and deprecated topology maps go: at 10,000 Services of
// 10 endpoints they were about a fifth of the cache.
func transformEndpointSlice(obj any) (any, error) {
	return trimSlice(obj, nil), nil
}

// sliceTrimmer is the EndpointSlice informer's transform: transformEndpointSlice,
// and the endpoints' condition flags, node names and zones made to share
// memory with those of every other cached endpoint (a decoded slice holds
// its own copy of each: three flags and two strings per endpoint, ~90 bytes,
// 9 MB at 100,000 endpoints). The shared values are only ever read, as all
// cached objects are.
type sliceTrimmer struct {
	mu          sync.Mutex
	true, false *bool
	strs        map[string]*string
}

// maxInternedStrings bounds sliceTrimmer's table (node names and zones:
// a few per node); past it the table starts again, so node churn cannot
// grow it forever.
const maxInternedStrings = 1 << 16

func newSliceTrimmer() *sliceTrimmer {
	t, f := true, false
	return &sliceTrimmer{true: &t, false: &f, strs: map[string]*string{}}
}

// transform is a client-go TransformFunc.
func (t *sliceTrimmer) transform(obj any) (any, error) {
	return trimSlice(obj, t), nil
}

func (t *sliceTrimmer) flag(b *bool) *bool {
	switch {
	case b == nil:
		return nil
	case *b:
		return t.true
	}
	return t.false
}

func (t *sliceTrimmer) str(s *string) *string {
	if s == nil {
		return nil
	}
	if shared, ok := t.strs[*s]; ok {
		return shared
	}
	if len(t.strs) >= maxInternedStrings {
		clear(t.strs)
	}
	t.strs[*s] = s
	return s
}

// trimSlice trims obj when it is an EndpointSlice, sharing values through
// t when t is not nil.
func trimSlice(obj any, t *sliceTrimmer) any {
	slice, ok := obj.(*discovery.EndpointSlice)
	if !ok || slice == nil {
		return obj
	}
	slice.ManagedFields = nil
	slice.OwnerReferences = nil
	keepAnnotations(&slice.ObjectMeta, endpointSliceAnnotations...)
	keepLabels(&slice.ObjectMeta, discovery.LabelServiceName)
	if t != nil {
		t.mu.Lock()
		defer t.mu.Unlock()
	}
	for i := range slice.Endpoints {
		ep := &slice.Endpoints[i]
		ep.TargetRef = nil
		ep.Hostname = nil
		ep.DeprecatedTopology = nil
		if t != nil {
			c := &ep.Conditions
			c.Ready, c.Serving, c.Terminating = t.flag(c.Ready), t.flag(c.Serving), t.flag(c.Terminating)
			ep.NodeName, ep.Zone = t.str(ep.NodeName), t.str(ep.Zone)
		}
	}
	return slice
}

// transformNode trims this node's *v1.Node to what kproxy reads: its labels
// (topology), its deletion timestamp and taints (the proxy health server) and
// its addresses (what node-IP detection reads). Managed fields, annotations
// and the rest of the status (conditions, images, node info, volumes) are
// dropped; on a busy node those are most of the object and change every few
// seconds.
func transformNode(obj any) (any, error) {
	node, ok := obj.(*v1.Node)
	if !ok || node == nil {
		return obj, nil
	}
	node.ManagedFields = nil
	node.Annotations = nil
	node.Status = v1.NodeStatus{Addresses: node.Status.Addresses}
	return node, nil
}

// transformNodeMetadata trims the *metav1.PartialObjectMetadata of another
// node to its name, resource version and labels: topologyKeys reads nothing
// else. Annotations (often dozens per node), managed fields, owner references
// and finalizers are dropped.
func transformNodeMetadata(obj any) (any, error) {
	m, ok := obj.(*metav1.PartialObjectMetadata)
	if !ok || m == nil {
		return obj, nil
	}
	m.ObjectMeta = metav1.ObjectMeta{Name: m.Name, ResourceVersion: m.ResourceVersion, Labels: m.Labels}
	return m, nil
}

// keepLabels is keepAnnotations for labels.
func keepLabels(meta *metav1.ObjectMeta, keys ...string) {
	meta.Labels = kept(meta.Labels, keys)
}

// keepAnnotations replaces meta's annotations with those of keys that are
// present, or nil when none is. The map is replaced rather than pruned, so
// the memory of the dropped entries is released.
func keepAnnotations(meta *metav1.ObjectMeta, keys ...string) {
	meta.Annotations = kept(meta.Annotations, keys)
}

// kept returns the entries of m under keys: m itself when it has no other
// key, else a new map, or nil when there is none.
func kept(m map[string]string, keys []string) map[string]string {
	if len(m) <= len(keys) {
		others := false
		for k := range m {
			others = others || !slices.Contains(keys, k)
		}
		if !others {
			if len(m) == 0 {
				return nil
			}
			return m
		}
	}
	var out map[string]string
	for _, key := range keys {
		value, ok := m[key]
		if !ok {
			continue
		}
		if out == nil {
			out = make(map[string]string, len(keys))
		}
		out[key] = value
	}
	return out
}
