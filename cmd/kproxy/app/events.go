package app

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// EventComponent is the source component of kproxy's Kubernetes Events.
const EventComponent = "kproxy"

// nodeRef is the reference kube-proxy puts its Node events on: the UID is
// the node name, so that no API call is needed to find the Node's.
func nodeRef(name string) *v1.ObjectReference {
	return &v1.ObjectReference{Kind: "Node", Name: name, UID: types.UID(name)}
}

// startEvents starts sending Events to the API server (core/v1 Events,
// which the ServiceAccount needs create and patch on) and records the
// Normal "Starting" event on this node. The returned function stops the
// broadcaster; events not yet sent by then are dropped.
func startEvents(ctx context.Context, client kubernetes.Interface, node string) (record.EventRecorder, func()) {
	b := record.NewBroadcaster()
	b.StartStructuredLogging(4)
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	recorder := b.NewRecorder(scheme.Scheme, v1.EventSource{Component: EventComponent, Host: node})
	recorder.Eventf(nodeRef(node), v1.EventTypeNormal, "Starting", "Starting kproxy %s.", Version)
	klog.FromContext(ctx).V(2).Info("Recorded the start-up event", "node", node)
	return recorder, b.Shutdown
}

// serviceEventRecorder is the Service event recorder of the engine of
// family: only the IPv4 engine, which always exists, gets one, so that a
// dual-stack node reports each problem once.
func serviceEventRecorder(family v1.IPFamily, recorder record.EventRecorder) record.EventRecorder {
	if family != v1.IPv4Protocol {
		return nil
	}
	return recorder
}
