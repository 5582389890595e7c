package proxier

import (
	"fmt"
	"maps"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/record"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// EventReasonRulesRefused is the reason of the Warning event on a Service
// some of whose ports the kernel refused: the backend set them aside and
// programmed everything else (docs/design.md, "Sync loop under failure").
const EventReasonRulesRefused = "RulesRefused"

// noteSetAside folds the service ports a successful sync set aside into
// the engine's record and reports what is new. After a full sync the
// record is exactly what the backend refused; after a partial one, the
// ports of unchanged services stay set aside (the backend did not retry
// them) and those of changed or deleted services take the sync's outcome.
//
// A port is reported (a Warning event on its Service and an error log
// line) when it is newly set aside, when its refusal changed, and on every
// full sync that refuses it again, so a port that stays set aside is not
// reported every sync but its event never ages out. A port that is no
// longer set aside is logged. Returns the record, nil when empty, for the
// sync's result (read-only: the next sync makes a new map). Called with
// e.mu held.
func (e *Engine) noteSetAside(refused map[proxy.ServicePortName]error, changed sets.Set[types.NamespacedName], full bool) map[proxy.ServicePortName]error {
	prev := e.setAside
	next := map[proxy.ServicePortName]error{}
	if !full {
		for name, err := range prev {
			if changed.Has(name.NamespacedName) {
				continue
			}
			if _, ok := e.svcPortMap[name]; !ok {
				continue
			}
			next[name] = err
		}
	}
	report := map[proxy.ServicePortName]error{}
	for name, err := range refused {
		next[name] = err
		old, was := prev[name]
		if full || !was || old.Error() != err.Error() {
			report[name] = err
		}
	}
	var released []string
	for _, name := range proxy.SortedServicePortNames(prev) {
		if _, still := next[name]; !still {
			released = append(released, name.String())
		}
	}
	if len(released) > 0 {
		e.logger.Info("Service ports no longer set aside", "servicePorts", released)
	}
	if len(report) > 0 {
		e.reportSetAside(report, len(next))
	} else if len(refused) > 0 {
		e.logger.V(2).Info("Service ports still set aside", "servicePorts", len(refused), "setAside", len(next))
	}
	if len(next) == 0 {
		next = nil
	}
	e.setAside = next
	return maps.Clone(next)
}

// reportSetAside logs one line naming the newly refused ports with their
// refusals, and sends one Warning event per Service.
func (e *Engine) reportSetAside(report map[proxy.ServicePortName]error, total int) {
	names := proxy.SortedServicePortNames(report)
	refusals := make([]string, 0, len(names))
	byService := map[types.NamespacedName][]string{}
	var services []types.NamespacedName
	for _, name := range names {
		refusals = append(refusals, name.String()+": "+report[name].Error())
		nn := name.NamespacedName
		if _, ok := byService[nn]; !ok {
			services = append(services, nn)
		}
		port := name.Port
		if port == "" {
			port = string(name.Protocol)
		}
		byService[nn] = append(byService[nn], fmt.Sprintf("port %s (%s): %v", port, name.Protocol, report[name]))
	}
	e.logger.Error(nil, "The kernel refused the rules of some service ports; they keep their last good rules, everything else is programmed",
		"servicePorts", refusals, "setAside", total)
	recorder := e.familyEventRecorder()
	if recorder == nil {
		return
	}
	for _, nn := range services {
		msg := fmt.Sprintf("The kernel refused the %s rules of %s; kproxy keeps their last good rules (none if they never had any), programs everything else, and retries them when the Service or its endpoints change and on every full sync",
			e.opts.Family, strings.Join(byService[nn], "; "))
		recorder.Event(e.serviceObject(nn), v1.EventTypeWarning, EventReasonRulesRefused, msg)
	}
}

// serviceObject is what a Service event is recorded on: the Service from
// ServiceLister, so that the event carries its UID (kubectl describe
// matches on it), else a reference by name.
func (e *Engine) serviceObject(nn types.NamespacedName) runtime.Object {
	if e.opts.ServiceLister != nil {
		svc, err := e.opts.ServiceLister.Services(nn.Namespace).Get(nn.Name)
		if err == nil {
			return svc
		}
		e.logger.V(4).Info("Service not in the lister; the event refers to it by name", "service", nn, "err", err)
	}
	return &v1.ObjectReference{Kind: "Service", APIVersion: "v1", Namespace: nn.Namespace, Name: nn.Name}
}

// familyEventRecorder is the recorder of the events about this family's
// state: FamilyEventRecorder, else EventRecorder.
func (e *Engine) familyEventRecorder() record.EventRecorder {
	if e.opts.FamilyEventRecorder != nil {
		return e.opts.FamilyEventRecorder
	}
	return e.opts.EventRecorder
}
