package proxier

import (
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
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
	// EventReasonInvalidEndpoint: an EndpointSlice endpoint's address is
	// not a usable IP address of the slice's family; the endpoint is
	// skipped.
	EventReasonInvalidEndpoint = proxy.EndpointSliceProblemInvalidEndpoint
	// EventReasonInvalidEndpointPort: an EndpointSlice port's number or
	// protocol cannot be programmed; the port is skipped.
	EventReasonInvalidEndpointPort = proxy.EndpointSliceProblemInvalidPort
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

// reportEndpointSliceProblems sends a Warning event on slice for each
// problem its update brought (once per update that brings it; the tracker
// has logged it). Slices are per family, so these go to the family's
// recorder.
func (e *Engine) reportEndpointSliceProblems(slice *discovery.EndpointSlice, problems []proxy.EndpointSliceProblem) {
	recorder := e.familyEventRecorder()
	if recorder == nil || slice == nil {
		return
	}
	for _, p := range problems {
		recorder.Event(slice, v1.EventTypeWarning, p.Reason, p.Message)
	}
}
