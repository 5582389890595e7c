package proxy

import (
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
)

func invalidEndpoint(msg string) EndpointSliceProblem {
	return EndpointSliceProblem{Reason: EndpointSliceProblemInvalidEndpoint, Message: msg}
}

func invalidEndpointPort(msg string) EndpointSliceProblem {
	return EndpointSliceProblem{Reason: EndpointSliceProblemInvalidPort, Message: msg}
}

// TestEndpointSliceProblems feeds one slice with one bad port or endpoint
// beside good ones: the bad one is skipped and reported, everything else
// is programmed.
func TestEndpointSliceProblems(t *testing.T) {
	v4, v6 := discovery.AddressTypeIPv4, discovery.AddressTypeIPv6
	http := escPort("http", 8080, v1.ProtocolTCP)
	for _, tc := range []struct {
		name         string
		family       v1.IPFamily
		slice        *discovery.EndpointSlice
		want         []string
		wantProblems []EndpointSliceProblem
	}{
		{
			name:  "valid slice",
			slice: escSlice("s1", "svc", v4, []discovery.EndpointPort{http}, escEndpoint("10.0.0.1")),
			want:  []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
		},
		{
			name:         "IPv6 endpoint in an IPv4 slice",
			slice:        escSlice("s1", "svc", v4, []discovery.EndpointPort{http}, escEndpoint("10.0.0.1"), escEndpoint("fd00::1")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpoint(`endpoint "fd00::1" is an IPv6 address in a slice of address type IPv4; kproxy skips it`)},
		},
		{
			name:         "IPv4 endpoint in an IPv6 slice",
			family:       v1.IPv6Protocol,
			slice:        escSlice("s1", "svc", v6, []discovery.EndpointPort{http}, escEndpoint("fd00::1"), escEndpoint("10.0.0.1")),
			want:         []string{"ns/svc:http/TCP=[fd00::1]:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpoint(`endpoint "10.0.0.1" is an IPv4 address in a slice of address type IPv6; kproxy skips it`)},
		},
		{
			name:         "endpoint that is not an IP address",
			slice:        escSlice("s1", "svc", v4, []discovery.EndpointPort{http}, escEndpoint("10.0.0.1"), escEndpoint("10.0.0.256")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpoint(`endpoint "10.0.0.256" is not an IP address; kproxy skips it`)},
		},
		{
			name:         "loopback endpoint",
			slice:        escSlice("s1", "svc", v4, []discovery.EndpointPort{http}, escEndpoint("127.0.0.1"), escEndpoint("10.0.0.1")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpoint(`endpoint "127.0.0.1" is a loopback address; kproxy skips it`)},
		},
		{
			name:         "unspecified endpoint",
			slice:        escSlice("s1", "svc", v4, []discovery.EndpointPort{http}, escEndpoint("0.0.0.0"), escEndpoint("10.0.0.1")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpoint(`endpoint "0.0.0.0" is the unspecified address; kproxy skips it`)},
		},
		{
			name:         "multicast endpoint",
			family:       v1.IPv6Protocol,
			slice:        escSlice("s1", "svc", v6, []discovery.EndpointPort{http}, escEndpoint("ff02::1"), escEndpoint("fd00::1")),
			want:         []string{"ns/svc:http/TCP=[fd00::1]:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpoint(`endpoint "ff02::1" is a multicast address; kproxy skips it`)},
		},
		{
			name:         "link-local endpoint",
			slice:        escSlice("s1", "svc", v4, []discovery.EndpointPort{http}, escEndpoint("169.254.0.5"), escEndpoint("10.0.0.1")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpoint(`endpoint "169.254.0.5" is a link-local address; kproxy skips it`)},
		},
		{
			name: "port 70000",
			slice: escSlice("s1", "svc", v4, []discovery.EndpointPort{http, escPort("big", 70000, v1.ProtocolTCP)},
				escEndpoint("10.0.0.1")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpointPort(`port "big": 70000 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "port 0",
			slice: escSlice("s1", "svc", v4, []discovery.EndpointPort{http, escPort("zero", 0, v1.ProtocolTCP)},
				escEndpoint("10.0.0.1")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpointPort(`port "zero": 0 is out of range 1-65535; kproxy skips this port`)},
		},
		{
			name: "protocol ICMP",
			slice: escSlice("s1", "svc", v4, []discovery.EndpointPort{http, escPort("ping", 7, "ICMP")},
				escEndpoint("10.0.0.1")),
			want:         []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
			wantProblems: []EndpointSliceProblem{invalidEndpointPort(`port "ping": protocol "ICMP" is not TCP, UDP or SCTP; kproxy skips this port`)},
		},
		{
			name: "port without a number is skipped silently, as the API allows it",
			slice: escSlice("s1", "svc", v4, []discovery.EndpointPort{http, {Name: ptr.To("all")}},
				escEndpoint("10.0.0.1")),
			want: []string{"ns/svc:http/TCP=10.0.0.1:8080 ready"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			family := tc.family
			if family == "" {
				family = v1.IPv4Protocol
			}
			logger, _ := ktesting.NewTestContext(t)
			tracker := NewEndpointsChangeTracker(EndpointsChangeTrackerOptions{Family: family, Logger: logger})
			pending, problems := tracker.UpdateEndpointSlice(tc.slice, false)
			if !pending {
				t.Error("the slice left no change to sync")
			}
			if !slices.Equal(problems, tc.wantProblems) {
				t.Errorf("problems\n%q\nwant\n%q", problems, tc.wantProblems)
			}
			m := EndpointsMap{}
			tracker.Apply(m)
			if got := ectDescribe(m); !slices.Equal(got, tc.want) {
				t.Errorf("endpoints %q, want %q", got, tc.want)
			}
		})
	}
}

// TestEndpointSliceProblemsReportedOnce: a problem is reported by the
// update that brings it, not again by later versions of the slice that
// still have it, and again once it went away and came back.
func TestEndpointSliceProblemsReportedOnce(t *testing.T) {
	v4 := discovery.AddressTypeIPv4
	ports := []discovery.EndpointPort{escPort("http", 8080, v1.ProtocolTCP)}
	good := escSlice("s1", "svc", v4, ports, escEndpoint("10.0.0.1"))
	bad := escSlice("s1", "svc", v4, ports, escEndpoint("10.0.0.1"), escEndpoint("fd00::1"))
	badMoreEndpoints := escSlice("s1", "svc", v4, ports, escEndpoint("10.0.0.1"), escEndpoint("10.0.0.2"), escEndpoint("fd00::1"))
	otherBad := escSlice("s1", "svc", v4, ports, escEndpoint("10.0.0.1"), escEndpoint("fd00::2"))
	problem := func(addr string) []EndpointSliceProblem {
		return []EndpointSliceProblem{invalidEndpoint(`endpoint "` + addr + `" is an IPv6 address in a slice of address type IPv4; kproxy skips it`)}
	}
	type update struct {
		slice  *discovery.EndpointSlice
		remove bool
		// apply applies the tracker after the update.
		apply bool
		want  []EndpointSliceProblem
	}
	for _, tc := range []struct {
		name    string
		updates []update
	}{
		{
			name:    "same problem in a later version, pending",
			updates: []update{{slice: bad, want: problem("fd00::1")}, {slice: badMoreEndpoints}},
		},
		{
			name:    "same problem in a later version, after a sync",
			updates: []update{{slice: bad, apply: true, want: problem("fd00::1")}, {slice: badMoreEndpoints}, {slice: bad}},
		},
		{
			name: "the same object again (an equal update) reports nothing",
			updates: []update{
				{slice: bad, apply: true, want: problem("fd00::1")},
				{slice: bad},
			},
		},
		{
			name:    "a different problem is reported",
			updates: []update{{slice: bad, want: problem("fd00::1")}, {slice: otherBad, want: problem("fd00::2")}},
		},
		{
			name: "fixed, then broken again",
			updates: []update{
				{slice: bad, apply: true, want: problem("fd00::1")},
				{slice: good, apply: true},
				{slice: bad, want: problem("fd00::1")},
			},
		},
		{
			name: "fixed then broken again before a sync",
			updates: []update{
				{slice: bad, want: problem("fd00::1")},
				{slice: good},
				{slice: bad, want: problem("fd00::1")},
			},
		},
		{
			name: "deleted and added again",
			updates: []update{
				{slice: bad, apply: true, want: problem("fd00::1")},
				{slice: bad, remove: true, apply: true},
				{slice: bad, want: problem("fd00::1")},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			tracker := NewEndpointsChangeTracker(EndpointsChangeTrackerOptions{Family: v1.IPv4Protocol, Logger: logger})
			m := EndpointsMap{}
			for i, u := range tc.updates {
				_, got := tracker.UpdateEndpointSlice(u.slice, u.remove)
				if !slices.Equal(got, u.want) {
					t.Errorf("update %d: problems %q, want %q", i, got, u.want)
				}
				if u.apply {
					tracker.Apply(m)
				}
			}
		})
	}
}
