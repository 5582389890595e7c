package proxy

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
)

func ectDescribe(m EndpointsMap) []string {
	var out []string
	for name, eps := range m {
		for _, ep := range eps {
			state := "ready"
			switch {
			case ep.Ready:
			case ep.Serving && ep.Terminating:
				state = "terminating"
			default:
				state = "not-ready"
			}
			out = append(out, fmt.Sprintf("%s/%s=%s %s", name, name.Protocol, ep, state))
		}
	}
	slices.Sort(out)
	return out
}

func TestEndpointsChangeTracker(t *testing.T) {
	type step struct {
		slice  *discovery.EndpointSlice
		remove bool
	}
	v4 := discovery.AddressTypeIPv4
	dnsPorts := []discovery.EndpointPort{escPort("dns", 53, v1.ProtocolUDP), escPort("http", 80, v1.ProtocolTCP)}
	udp := func(name string, eps ...discovery.Endpoint) *discovery.EndpointSlice {
		return escSlice(name, "svc", v4, dnsPorts, eps...)
	}
	dns := escSPN("dns", v1.ProtocolUDP)
	svcName := sets.New(escSvc)
	other := types.NamespacedName{Namespace: "ns", Name: "other"}

	s1 := udp("s1", escEndpoint("10.0.0.1"), escEndpoint("10.0.0.2"))
	s1OnlyFirst := udp("s1", escEndpoint("10.0.0.1"))
	s1SecondNotReady := udp("s1", escEndpoint("10.0.0.1"), escEndpoint("10.0.0.2", escNotReady))
	s1SecondTerminating := udp("s1", escEndpoint("10.0.0.1"), escEndpoint("10.0.0.2", escTerminating))
	s1SecondTerminatingNotServing := udp("s1", escEndpoint("10.0.0.1"), escEndpoint("10.0.0.2", escConditions(ptr.To(false), ptr.To(false), ptr.To(true))))
	s1SecondNotReadyServingUnset := udp("s1", escEndpoint("10.0.0.1"), escEndpoint("10.0.0.2", escConditions(ptr.To(false), nil, nil)))
	s1FirstTerminating := udp("s1", escEndpoint("10.0.0.1", escTerminating))
	s1NotReady := udp("s1", escEndpoint("10.0.0.1", escNotReady))
	s2 := udp("s2", escEndpoint("10.0.0.3"))
	s2WithSecond := udp("s2", escEndpoint("10.0.0.3"), escEndpoint("10.0.0.2"))
	otherSlice := escSlice("o1", "other", v4, []discovery.EndpointPort{escPort("dns", 53, v1.ProtocolUDP)}, escEndpoint("10.0.1.1"))
	v6Slice := escSlice("v6", "svc", discovery.AddressTypeIPv6, dnsPorts, escEndpoint("fd00::1"))
	v6SliceLess := escSlice("v6", "svc", discovery.AddressTypeIPv6, dnsPorts)
	// released is a slice as the informer's cache keeps it once handlers
	// had it (config.EndpointSliceConfig): no labels, endpoints or ports.
	released := func(sl *discovery.EndpointSlice) *discovery.EndpointSlice {
		out := sl.DeepCopy()
		out.Labels, out.Endpoints, out.Ports = nil, nil, nil
		return out
	}

	tests := []struct {
		name          string
		family        v1.IPFamily
		initial       []*discovery.EndpointSlice // added and applied before the window
		steps         []step
		wantReturn    []bool
		wantPending   []string
		wantUpdated   sets.Set[types.NamespacedName]
		wantDeleted   []ServiceEndpoint
		wantNewActive []ServicePortName
		wantEndpoints []string
	}{
		{
			name:          "add a slice: UDP port newly active",
			steps:         []step{{s1, false}},
			wantReturn:    []bool{true},
			wantPending:   []string{"ns/svc"},
			wantUpdated:   svcName,
			wantNewActive: []ServicePortName{dns},
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 ready",
			},
		},
		{
			name:        "slice added and removed in one window is no change",
			steps:       []step{{s1, false}, {s1, true}},
			wantReturn:  []bool{true, false},
			wantUpdated: sets.New[types.NamespacedName](),
		},
		{
			name:          "slice updated and reverted in one window is no change",
			initial:       []*discovery.EndpointSlice{s1},
			steps:         []step{{s1OnlyFirst, false}, {s1, false}},
			wantReturn:    []bool{true, false},
			wantUpdated:   sets.New[types.NamespacedName](),
			wantEndpoints: ectDescribe(EndpointsMap{dns: {escEP("10.0.0.1:53"), escEP("10.0.0.2:53")}, escSPN("http", v1.ProtocolTCP): {escEP("10.0.0.1:80"), escEP("10.0.0.2:80")}}),
		},
		{
			name:          "slice removed and re-added unchanged in one window is no change",
			initial:       []*discovery.EndpointSlice{s2},
			steps:         []step{{s2, true}, {s2, false}},
			wantReturn:    []bool{true, false},
			wantUpdated:   sets.New[types.NamespacedName](),
			wantEndpoints: []string{"ns/svc:dns/UDP=10.0.0.3:53 ready", "ns/svc:http/TCP=10.0.0.3:80 ready"},
		},
		{
			name:          "removing a released applied slice finds its service by name",
			initial:       []*discovery.EndpointSlice{s1, s2},
			steps:         []step{{released(s1), true}},
			wantReturn:    []bool{true},
			wantPending:   []string{"ns/svc"},
			wantUpdated:   svcName,
			wantDeleted:   []ServiceEndpoint{{Endpoint: "10.0.0.1:53", ServicePortName: dns}, {Endpoint: "10.0.0.2:53", ServicePortName: dns}},
			wantEndpoints: []string{"ns/svc:dns/UDP=10.0.0.3:53 ready", "ns/svc:http/TCP=10.0.0.3:80 ready"},
		},
		{
			name:        "removing a released pending slice finds its service by name",
			steps:       []step{{s1, false}, {released(s1), true}},
			wantReturn:  []bool{true, false},
			wantUpdated: sets.New[types.NamespacedName](),
		},
		{
			name:          "removing an unknown released slice is no change",
			initial:       []*discovery.EndpointSlice{otherSlice},
			steps:         []step{{released(s1), true}},
			wantReturn:    []bool{false},
			wantUpdated:   sets.New[types.NamespacedName](),
			wantEndpoints: []string{"ns/other:dns/UDP=10.0.1.1:53 ready"},
		},
		{
			name:        "removing an unknown slice is no change",
			steps:       []step{{s1, true}},
			wantReturn:  []bool{false},
			wantUpdated: sets.New[types.NamespacedName](),
		},
		{
			name:          "identical update is no change",
			initial:       []*discovery.EndpointSlice{s2},
			steps:         []step{{s2.DeepCopy(), false}},
			wantReturn:    []bool{false},
			wantUpdated:   sets.New[types.NamespacedName](),
			wantEndpoints: []string{"ns/svc:dns/UDP=10.0.0.3:53 ready", "ns/svc:http/TCP=10.0.0.3:80 ready"},
		},
		{
			name:          "UDP endpoint removed",
			initial:       []*discovery.EndpointSlice{s1},
			steps:         []step{{s1OnlyFirst, false}},
			wantReturn:    []bool{true},
			wantPending:   []string{"ns/svc"},
			wantUpdated:   svcName,
			wantDeleted:   []ServiceEndpoint{{Endpoint: "10.0.0.2:53", ServicePortName: dns}},
			wantEndpoints: []string{"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:http/TCP=10.0.0.1:80 ready"},
		},
		{
			name:        "UDP endpoint turned not ready",
			initial:     []*discovery.EndpointSlice{s1},
			steps:       []step{{s1SecondNotReady, false}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantDeleted: []ServiceEndpoint{{Endpoint: "10.0.0.2:53", ServicePortName: dns}},
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 not-ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 not-ready",
			},
		},
		{
			name:        "UDP endpoint terminating but still serving keeps its entries",
			initial:     []*discovery.EndpointSlice{s1},
			steps:       []step{{s1SecondTerminating, false}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 terminating",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 terminating",
			},
		},
		{
			name:        "terminating UDP endpoint stops serving",
			initial:     []*discovery.EndpointSlice{s1SecondTerminating},
			steps:       []step{{s1SecondTerminatingNotServing, false}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantDeleted: []ServiceEndpoint{{Endpoint: "10.0.0.2:53", ServicePortName: dns}},
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 not-ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 not-ready",
			},
		},
		{
			name:        "ready UDP endpoint stops serving at once",
			initial:     []*discovery.EndpointSlice{s1},
			steps:       []step{{s1SecondTerminatingNotServing, false}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantDeleted: []ServiceEndpoint{{Endpoint: "10.0.0.2:53", ServicePortName: dns}},
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 not-ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 not-ready",
			},
		},
		{
			// Serving unset reads as serving, as upstream reads it.
			name:        "not-ready UDP endpoint without a serving condition keeps its entries",
			initial:     []*discovery.EndpointSlice{s1},
			steps:       []step{{s1SecondNotReadyServingUnset, false}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 not-ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 not-ready",
			},
		},
		{
			name:        "terminating UDP endpoint ready again needs no cleanup",
			initial:     []*discovery.EndpointSlice{s1SecondTerminating},
			steps:       []step{{s1, false}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 ready",
			},
		},
		{
			name:          "serving terminating UDP endpoint removed",
			initial:       []*discovery.EndpointSlice{s1FirstTerminating},
			steps:         []step{{s1FirstTerminating, true}},
			wantReturn:    []bool{true},
			wantPending:   []string{"ns/svc"},
			wantUpdated:   svcName,
			wantDeleted:   []ServiceEndpoint{{Endpoint: "10.0.0.1:53", ServicePortName: dns}},
			wantEndpoints: nil,
		},
		{
			name:        "not-ready UDP endpoint removed needs no cleanup",
			initial:     []*discovery.EndpointSlice{s1NotReady},
			steps:       []step{{s1NotReady, true}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
		},
		{
			name:          "UDP service from not-ready to ready endpoints is newly active",
			initial:       []*discovery.EndpointSlice{s1NotReady},
			steps:         []step{{s1OnlyFirst, false}},
			wantReturn:    []bool{true},
			wantPending:   []string{"ns/svc"},
			wantUpdated:   svcName,
			wantNewActive: []ServicePortName{dns},
			wantEndpoints: []string{"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:http/TCP=10.0.0.1:80 ready"},
		},
		{
			// The terminating endpoints took the traffic: nothing was
			// black-holed, and their flows must drain.
			name:          "UDP service from serving terminating to ready endpoints is not newly active",
			initial:       []*discovery.EndpointSlice{s1FirstTerminating},
			steps:         []step{{s1OnlyFirst, false}},
			wantReturn:    []bool{true},
			wantPending:   []string{"ns/svc"},
			wantUpdated:   svcName,
			wantEndpoints: []string{"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:http/TCP=10.0.0.1:80 ready"},
		},
		{
			name:        "UDP service gaining a second endpoint is not newly active",
			initial:     []*discovery.EndpointSlice{s1OnlyFirst},
			steps:       []step{{s2, false}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.3:53 ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.3:80 ready",
			},
		},
		{
			name:        "endpoint moved between slices is no update",
			initial:     []*discovery.EndpointSlice{s1, s2},
			steps:       []step{{s1OnlyFirst, false}, {s2WithSecond, false}},
			wantReturn:  []bool{true, true},
			wantPending: []string{"ns/svc"},
			wantUpdated: sets.New[types.NamespacedName](),
			wantEndpoints: []string{
				"ns/svc:dns/UDP=10.0.0.1:53 ready", "ns/svc:dns/UDP=10.0.0.2:53 ready", "ns/svc:dns/UDP=10.0.0.3:53 ready",
				"ns/svc:http/TCP=10.0.0.1:80 ready", "ns/svc:http/TCP=10.0.0.2:80 ready", "ns/svc:http/TCP=10.0.0.3:80 ready",
			},
		},
		{
			name:        "deleting one of two slices keeps the other",
			initial:     []*discovery.EndpointSlice{s1, s2},
			steps:       []step{{s1, true}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantDeleted: []ServiceEndpoint{
				{Endpoint: "10.0.0.1:53", ServicePortName: dns},
				{Endpoint: "10.0.0.2:53", ServicePortName: dns},
			},
			wantEndpoints: []string{"ns/svc:dns/UDP=10.0.0.3:53 ready", "ns/svc:http/TCP=10.0.0.3:80 ready"},
		},
		{
			name:        "changes to two services, sorted results",
			initial:     []*discovery.EndpointSlice{s1, otherSlice},
			steps:       []step{{otherSlice, true}, {s1, true}},
			wantReturn:  []bool{true, true},
			wantPending: []string{"ns/other", "ns/svc"},
			wantUpdated: sets.New(escSvc, other),
			wantDeleted: []ServiceEndpoint{
				{Endpoint: "10.0.1.1:53", ServicePortName: ServicePortName{NamespacedName: other, Port: "dns", Protocol: v1.ProtocolUDP}},
				{Endpoint: "10.0.0.1:53", ServicePortName: dns},
				{Endpoint: "10.0.0.2:53", ServicePortName: dns},
			},
		},
		{
			name:        "IPv4 tracker ignores an IPv6 slice",
			steps:       []step{{v6Slice, false}},
			wantReturn:  []bool{false},
			wantUpdated: sets.New[types.NamespacedName](),
		},
		{
			name:        "IPv6 tracker: deleted endpoints in bracket form",
			family:      v1.IPv6Protocol,
			initial:     []*discovery.EndpointSlice{v6Slice},
			steps:       []step{{s1, false}, {v6SliceLess, false}},
			wantReturn:  []bool{false, true},
			wantPending: []string{"ns/svc"},
			wantUpdated: svcName,
			wantDeleted: []ServiceEndpoint{{Endpoint: "[fd00::1]:53", ServicePortName: dns}},
		},
		{
			name:        "slice without service label is ignored",
			steps:       []step{{escSlice("orphan", "", v4, dnsPorts, escEndpoint("10.0.0.1")), false}},
			wantReturn:  []bool{false},
			wantUpdated: sets.New[types.NamespacedName](),
		},
		{
			name:        "nil slice is ignored",
			steps:       []step{{nil, false}},
			wantReturn:  []bool{false},
			wantUpdated: sets.New[types.NamespacedName](),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			family := tc.family
			if family == "" {
				family = v1.IPv4Protocol
			}
			tracker := NewEndpointsChangeTracker(EndpointsChangeTrackerOptions{Family: family, NodeName: "node-a", Logger: logger})
			m := EndpointsMap{}
			for _, s := range tc.initial {
				tracker.EndpointSliceUpdate(s, false)
			}
			tracker.Apply(m)

			for i, s := range tc.steps {
				if got := tracker.EndpointSliceUpdate(s.slice, s.remove); got != tc.wantReturn[i] {
					t.Errorf("step %d: EndpointSliceUpdate returned %v, want %v", i, got, tc.wantReturn[i])
				}
			}
			if got := sets.List(tracker.PendingChanges()); !slices.Equal(got, tc.wantPending) {
				t.Errorf("PendingChanges = %v, want %v", got, tc.wantPending)
			}
			result := tracker.Apply(m)
			if !result.UpdatedServices.Equal(tc.wantUpdated) {
				t.Errorf("UpdatedServices = %v, want %v", result.UpdatedServices.UnsortedList(), tc.wantUpdated.UnsortedList())
			}
			if !slices.Equal(result.DeletedUDPEndpoints, tc.wantDeleted) {
				t.Errorf("DeletedUDPEndpoints = %v, want %v", result.DeletedUDPEndpoints, tc.wantDeleted)
			}
			if !slices.Equal(result.NewlyActiveUDPServices, tc.wantNewActive) {
				t.Errorf("NewlyActiveUDPServices = %v, want %v", result.NewlyActiveUDPServices, tc.wantNewActive)
			}
			if got := ectDescribe(m); !slices.Equal(got, tc.wantEndpoints) {
				t.Errorf("endpoints = %v, want %v", got, tc.wantEndpoints)
			}
			if n := tracker.PendingChanges().Len(); n != 0 {
				t.Errorf("%d changes pending after Apply", n)
			}
		})
	}
}

func TestEndpointsChangeTrackerTriggerTimes(t *testing.T) {
	start := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	at := func(d time.Duration) time.Time { return start.Add(d) }
	v4 := discovery.AddressTypeIPv4
	ports := []discovery.EndpointPort{escPort("http", 80, v1.ProtocolTCP)}
	slice := func(name, service string, trigger string, ip string) *discovery.EndpointSlice {
		s := escSlice(name, service, v4, ports, escEndpoint(ip))
		if trigger != "" {
			s.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: trigger}
		}
		return s
	}
	stamp := func(d time.Duration) string { return at(d).Format(time.RFC3339Nano) }
	other := types.NamespacedName{Namespace: "ns", Name: "other"}

	type step struct {
		slice  *discovery.EndpointSlice
		remove bool
	}
	tests := []struct {
		name    string
		initial []*discovery.EndpointSlice
		steps   []step
		want    map[types.NamespacedName][]time.Time
	}{
		{
			name:  "trigger time of an added slice",
			steps: []step{{slice("s1", "svc", stamp(time.Second), "10.0.0.1"), false}},
			want:  map[types.NamespacedName][]time.Time{escSvc: {at(time.Second)}},
		},
		{
			name: "every update of the window, per service",
			steps: []step{
				{slice("s1", "svc", stamp(time.Second), "10.0.0.1"), false},
				{slice("s1", "svc", stamp(2*time.Second), "10.0.0.2"), false},
				{slice("o1", "other", stamp(3*time.Second), "10.0.1.1"), false},
			},
			want: map[types.NamespacedName][]time.Time{
				escSvc: {at(time.Second), at(2 * time.Second)},
				other:  {at(3 * time.Second)},
			},
		},
		{
			name:  "trigger time before the tracker started is ignored",
			steps: []step{{slice("s1", "svc", stamp(-time.Second), "10.0.0.1"), false}},
			want:  map[types.NamespacedName][]time.Time{},
		},
		{
			name:  "malformed trigger time is ignored",
			steps: []step{{slice("s1", "svc", "yesterday", "10.0.0.1"), false}},
			want:  map[types.NamespacedName][]time.Time{},
		},
		{
			name:  "missing trigger time",
			steps: []step{{slice("s1", "svc", "", "10.0.0.1"), false}},
			want:  map[types.NamespacedName][]time.Time{},
		},
		{
			name:    "slice deletion drops the service's trigger times",
			initial: []*discovery.EndpointSlice{slice("s2", "svc", "", "10.0.0.9")},
			steps: []step{
				{slice("s1", "svc", stamp(time.Second), "10.0.0.1"), false},
				{slice("s2", "svc", stamp(2*time.Second), "10.0.0.9"), true},
			},
			want: map[types.NamespacedName][]time.Time{},
		},
		{
			name: "slice added and removed in one window leaves no trigger time",
			steps: []step{
				{slice("s1", "svc", stamp(time.Second), "10.0.0.1"), false},
				{slice("s1", "svc", stamp(time.Second), "10.0.0.1"), true},
			},
			want: map[types.NamespacedName][]time.Time{},
		},
		{
			name:    "no-op update records no trigger time",
			initial: []*discovery.EndpointSlice{slice("s1", "svc", "", "10.0.0.1")},
			steps:   []step{{slice("s1", "svc", stamp(time.Second), "10.0.0.1"), false}},
			want:    map[types.NamespacedName][]time.Time{},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			clk := testingclock.NewFakePassiveClock(start)
			tracker := NewEndpointsChangeTracker(EndpointsChangeTrackerOptions{Family: v1.IPv4Protocol, Clock: clk, Logger: logger})
			m := EndpointsMap{}
			for _, s := range tc.initial {
				tracker.EndpointSliceUpdate(s, false)
			}
			tracker.Apply(m)
			for _, s := range tc.steps {
				tracker.EndpointSliceUpdate(s.slice, s.remove)
			}
			got := tracker.Apply(m).LastChangeTriggerTimes
			if len(got) != len(tc.want) {
				t.Fatalf("LastChangeTriggerTimes = %v, want %v", got, tc.want)
			}
			for nn, want := range tc.want {
				if !slices.EqualFunc(got[nn], want, time.Time.Equal) {
					t.Errorf("LastChangeTriggerTimes[%s] = %v, want %v", nn, got[nn], want)
				}
			}
			if again := tracker.Apply(m).LastChangeTriggerTimes; len(again) != 0 {
				t.Errorf("second Apply reported trigger times %v, want none", again)
			}
		})
	}
}

func TestEndpointsChangeTrackerConcurrentUse(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	tracker := NewEndpointsChangeTracker(EndpointsChangeTrackerOptions{Family: v1.IPv4Protocol, NodeName: "node-a", Logger: logger})
	ports := []discovery.EndpointPort{escPort("dns", 53, v1.ProtocolUDP)}
	const writers, perWriter = 4, 50

	m := EndpointsMap{}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWriter {
				s := escSlice(fmt.Sprintf("s%d-%d", w, i), fmt.Sprintf("svc%d-%d", w, i), discovery.AddressTypeIPv4, ports,
					escEndpoint(fmt.Sprintf("10.2.%d.%d", w, i+1), escOnNode("node-a")))
				tracker.EndpointSliceUpdate(s, false)
				_ = tracker.PendingChanges()
			}
		}()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 20 {
			tracker.Apply(m)
		}
	}()
	wg.Wait()
	<-done
	tracker.Apply(m)
	if len(m) != writers*perWriter {
		t.Fatalf("got %d service ports, want %d", len(m), writers*perWriter)
	}
	for name, eps := range m {
		if len(eps) != 1 || !eps[0].IsLocal {
			t.Errorf("%s: endpoints %v, want one local endpoint", name, eps)
		}
	}
}

// Endpoint objects handed out by Apply must not be changed by later updates.
func TestEndpointsChangeTrackerAppliedEndpointsAreStable(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	tracker := NewEndpointsChangeTracker(EndpointsChangeTrackerOptions{Family: v1.IPv4Protocol, Logger: logger})
	ports := []discovery.EndpointPort{escPort("http", 80, v1.ProtocolTCP)}
	slice := escSlice("s1", "svc", discovery.AddressTypeIPv4, ports, escEndpoint("10.0.0.1"))
	tracker.EndpointSliceUpdate(slice, false)
	m := EndpointsMap{}
	tracker.Apply(m)
	before := m[escSPN("http", v1.ProtocolTCP)]

	updated := slice.DeepCopy()
	updated.Endpoints[0].Conditions.Ready = ptr.To(false)
	tracker.EndpointSliceUpdate(updated, false)
	tracker.Apply(m)

	if len(before) != 1 || !before[0].Ready {
		t.Errorf("previously applied endpoint changed: %+v", before)
	}
	if after := m[escSPN("http", v1.ProtocolTCP)]; len(after) != 1 || after[0].Ready {
		t.Errorf("applied endpoints after update = %+v, want one not-ready endpoint", after)
	}
}
