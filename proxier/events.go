package proxier

import (
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Reasons of the Warning events kproxy puts on Services: the reasons of the
// proxy.ServiceProblems that proxy.ParseService reports.
const (
	// EventReasonInvalidTopologyKeys: the topologyKeys annotation is
	// malformed; the service is treated as having no topology keys.
	EventReasonInvalidTopologyKeys = proxy.ServiceProblemInvalidTopologyKeys
	// EventReasonInvalidServiceField: a field kproxy reads is malformed or
	// missing; the bad value is skipped.
	EventReasonInvalidServiceField = proxy.ServiceProblemInvalidServiceField
	// EventReasonIgnoredAnnotation: the Service relies on an annotation
	// kproxy, like kube-proxy, does not apply (the legacy
	// load-balancer-source-ranges one).
	EventReasonIgnoredAnnotation = proxy.ServiceProblemIgnoredAnnotation
)

// reportServiceProblems sends a Warning event on service for each problem
// its change brought (the tracker's new problems: once per change that
// brings it, never on an informer resync or a sync).
func (e *Engine) reportServiceProblems(service *v1.Service, problems []proxy.ServiceProblem) {
	if e.opts.EventRecorder == nil || service == nil {
		return
	}
	for _, p := range problems {
		e.logger.V(2).Info("Reporting a service problem", "service", klog.KObj(service), "reason", p.Reason, "message", p.Message)
		e.opts.EventRecorder.Event(service, v1.EventTypeWarning, p.Reason, p.Message)
	}
}
