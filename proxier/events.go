package proxier

import (
	"fmt"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	netutils "k8s.io/utils/net"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Reasons of the Warning events kproxy puts on Services.
const (
	// EventReasonInvalidTopologyKeys: the topologyKeys annotation is
	// malformed; the service is treated as having no topology keys.
	EventReasonInvalidTopologyKeys = "InvalidTopologyKeys"
	// EventReasonInvalidServiceField: a field kproxy reads is malformed or
	// missing; the bad value is skipped.
	EventReasonInvalidServiceField = "InvalidServiceField"
)

// serviceProblem is one thing about a Service that kproxy cannot honour.
type serviceProblem struct {
	reason  string
	message string
}

// serviceProblems lists, in the order of the fields, what kproxy cannot
// honour in svc: the problems proxy.NewServicePortsFromService logs and
// works around, found with the same parsing. Services kproxy does not
// handle (nil, ExternalName, headless) have none. The result does not
// depend on the IP family.
func serviceProblems(svc *v1.Service) []serviceProblem {
	if svc == nil || svc.Spec.Type == v1.ServiceTypeExternalName || svc.Spec.ClusterIP == v1.ClusterIPNone ||
		(svc.Spec.ClusterIP == "" && len(svc.Spec.ClusterIPs) == 0) {
		return nil
	}
	var out []serviceProblem
	invalid := func(format string, args ...any) {
		out = append(out, serviceProblem{reason: EventReasonInvalidServiceField, message: fmt.Sprintf(format, args...)})
	}
	clusterIPs := svc.Spec.ClusterIPs
	if len(clusterIPs) == 0 {
		clusterIPs = []string{svc.Spec.ClusterIP}
	}
	for _, s := range clusterIPs {
		if s != "" && s != v1.ClusterIPNone && netutils.ParseIPSloppy(s) == nil {
			invalid("spec.clusterIPs: %q is not an IP address; kproxy ignores it", s)
		}
	}
	for _, s := range svc.Spec.ExternalIPs {
		if netutils.ParseIPSloppy(strings.TrimSpace(s)) == nil {
			invalid("spec.externalIPs: %q is not an IP address; kproxy ignores it", s)
		}
	}
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		for _, ing := range svc.Status.LoadBalancer.Ingress {
			if ing.IP != "" && (ing.IPMode == nil || *ing.IPMode != v1.LoadBalancerIPModeProxy) && netutils.ParseIPSloppy(strings.TrimSpace(ing.IP)) == nil {
				invalid("status.loadBalancer.ingress: %q is not an IP address; kproxy ignores it", ing.IP)
			}
		}
		if svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal && svc.Spec.HealthCheckNodePort == 0 {
			invalid("spec.healthCheckNodePort is not set on a LoadBalancer service with externalTrafficPolicy Local; kproxy serves no health check for it")
		}
	}
	ranges, field := svc.Spec.LoadBalancerSourceRanges, "spec.loadBalancerSourceRanges"
	if len(ranges) == 0 {
		if value := strings.TrimSpace(svc.Annotations[v1.AnnotationLoadBalancerSourceRangesKey]); value != "" {
			ranges, field = strings.Split(value, ","), "annotation "+v1.AnnotationLoadBalancerSourceRangesKey
		}
	}
	for _, s := range ranges {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		if _, _, err := netutils.ParseCIDRSloppy(s); err != nil {
			invalid("%s: %q is not a CIDR; kproxy ignores it", field, s)
		}
	}
	if value, ok := svc.Annotations[proxy.AnnotationTopologyKeys]; ok {
		if _, err := proxy.ParseTopologyKeys(value); err != nil {
			out = append(out, serviceProblem{
				reason:  EventReasonInvalidTopologyKeys,
				message: fmt.Sprintf("%v; the service is treated as having no topology keys", err),
			})
		}
	}
	return out
}

// reportServiceProblems sends a Warning event on service for each problem
// it has that oldService did not: once per change that brings it, never on
// an informer resync or a sync.
func (e *Engine) reportServiceProblems(oldService, service *v1.Service) {
	if e.opts.EventRecorder == nil || service == nil {
		return
	}
	before := sets.New(serviceProblems(oldService)...)
	for _, p := range serviceProblems(service) {
		if before.Has(p) {
			continue
		}
		before.Insert(p)
		e.logger.V(2).Info("Reporting a service problem", "service", klog.KObj(service), "reason", p.reason, "message", p.message)
		e.opts.EventRecorder.Event(service, v1.EventTypeWarning, p.reason, p.message)
	}
}
