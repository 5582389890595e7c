package proxy

import (
	"fmt"
	"slices"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2/ktesting"
)

// sctService is a single-stack IPv4 ClusterIP service "ns/<name>".
func sctService(name, clusterIP string, ports ...v1.ServicePort) *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
		Spec: v1.ServiceSpec{
			Type:       v1.ServiceTypeClusterIP,
			ClusterIP:  clusterIP,
			ClusterIPs: []string{clusterIP},
			Ports:      ports,
		},
	}
}

func sctPort(name string, port int32, protocol v1.Protocol) v1.ServicePort {
	return v1.ServicePort{Name: name, Port: port, Protocol: protocol}
}

var (
	sctDNS   = sctPort("dns", 53, v1.ProtocolUDP)
	sctHTTP  = sctPort("http", 80, v1.ProtocolTCP)
	sctHTTPS = sctPort("https", 443, v1.ProtocolTCP)
)

// sctDescribe renders a ServicePortMap as sorted "ns/name:port/PROTO=ip:port" strings.
func sctDescribe(m ServicePortMap) []string {
	var out []string
	for name, sp := range m {
		out = append(out, fmt.Sprintf("%s/%s=%s:%d", name, name.Protocol, sp.ClusterIP, sp.Port))
	}
	slices.Sort(out)
	return out
}

func sctNames(names ...string) sets.Set[types.NamespacedName] {
	out := sets.New[types.NamespacedName]()
	for _, n := range names {
		out.Insert(types.NamespacedName{Namespace: "ns", Name: n})
	}
	return out
}

func TestServiceChangeTracker(t *testing.T) {
	type step struct{ previous, current *v1.Service }

	a := sctService("a", "10.0.0.1", sctDNS, sctHTTP)
	aNoDNS := sctService("a", "10.0.0.1", sctHTTP, sctHTTPS)
	aDNSOverTCP := sctService("a", "10.0.0.1", sctPort("dns", 53, v1.ProtocolTCP), sctHTTP)
	aNewIP := sctService("a", "10.0.0.9", sctDNS, sctHTTP)
	aHeadless := sctService("a", v1.ClusterIPNone, sctDNS, sctHTTP)
	aRenumbered := sctService("a", "10.0.0.1", sctPort("dns", 5353, v1.ProtocolUDP), sctHTTP)
	b := sctService("b", "10.0.0.2", sctHTTP)
	headless := sctService("h", v1.ClusterIPNone, sctHTTP)
	malformed := sctService("m", "10.0.0.3", sctHTTP)
	malformed.Spec.ExternalIPs = []string{"not-an-ip", "192.0.2.1"}
	malformed.Annotations = map[string]string{AnnotationTopologyKeys: "{broken"}
	ipv6Only := sctService("v6", "fd00::6", sctHTTP)

	tests := []struct {
		name           string
		family         v1.IPFamily
		initial        []*v1.Service // added and applied before the window
		steps          []step
		wantReturn     []bool // Update's return value per step
		wantPending    []string
		wantUpdated    sets.Set[types.NamespacedName]
		wantDeletedUDP []string
		wantPorts      []string
	}{
		{
			name:        "add",
			steps:       []step{{nil, a}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/a"},
			wantUpdated: sctNames("a"),
			wantPorts:   []string{"ns/a:dns/UDP=10.0.0.1:53", "ns/a:http/TCP=10.0.0.1:80"},
		},
		{
			name:           "delete reports the UDP ClusterIP",
			initial:        []*v1.Service{a, b},
			steps:          []step{{a, nil}},
			wantReturn:     []bool{true},
			wantPending:    []string{"ns/a"},
			wantUpdated:    sctNames("a"),
			wantDeletedUDP: []string{"10.0.0.1"},
			wantPorts:      []string{"ns/b:http/TCP=10.0.0.2:80"},
		},
		{
			name:        "delete of a TCP-only service needs no UDP cleanup",
			initial:     []*v1.Service{a, b},
			steps:       []step{{b, nil}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/b"},
			wantUpdated: sctNames("b"),
			wantPorts:   []string{"ns/a:dns/UDP=10.0.0.1:53", "ns/a:http/TCP=10.0.0.1:80"},
		},
		{
			name:           "update removing a UDP port",
			initial:        []*v1.Service{a},
			steps:          []step{{a, aNoDNS}},
			wantReturn:     []bool{true},
			wantPending:    []string{"ns/a"},
			wantUpdated:    sctNames("a"),
			wantDeletedUDP: []string{"10.0.0.1"},
			wantPorts:      []string{"ns/a:http/TCP=10.0.0.1:80", "ns/a:https/TCP=10.0.0.1:443"},
		},
		{
			name:           "update moving a port from UDP to TCP",
			initial:        []*v1.Service{a},
			steps:          []step{{a, aDNSOverTCP}},
			wantReturn:     []bool{true},
			wantPending:    []string{"ns/a"},
			wantUpdated:    sctNames("a"),
			wantDeletedUDP: []string{"10.0.0.1"},
			wantPorts:      []string{"ns/a:dns/TCP=10.0.0.1:53", "ns/a:http/TCP=10.0.0.1:80"},
		},
		{
			name:        "update changing a UDP port number keeps the ClusterIP",
			initial:     []*v1.Service{a},
			steps:       []step{{a, aRenumbered}},
			wantReturn:  []bool{true},
			wantPending: []string{"ns/a"},
			wantUpdated: sctNames("a"),
			wantPorts:   []string{"ns/a:dns/UDP=10.0.0.1:5353", "ns/a:http/TCP=10.0.0.1:80"},
		},
		{
			name:           "delete and re-create with another ClusterIP in one window",
			initial:        []*v1.Service{a},
			steps:          []step{{a, nil}, {nil, aNewIP}},
			wantReturn:     []bool{true, true},
			wantPending:    []string{"ns/a"},
			wantUpdated:    sctNames("a"),
			wantDeletedUDP: []string{"10.0.0.1"},
			wantPorts:      []string{"ns/a:dns/UDP=10.0.0.9:53", "ns/a:http/TCP=10.0.0.9:80"},
		},
		{
			name:        "add then delete in one window is no change",
			initial:     []*v1.Service{b},
			steps:       []step{{nil, a}, {a, nil}},
			wantReturn:  []bool{true, false},
			wantUpdated: sctNames(),
			wantPorts:   []string{"ns/b:http/TCP=10.0.0.2:80"},
		},
		{
			name:        "update and back in one window is no change",
			initial:     []*v1.Service{a},
			steps:       []step{{a, aNoDNS}, {aNoDNS, a}},
			wantReturn:  []bool{true, false},
			wantUpdated: sctNames(),
			wantPorts:   []string{"ns/a:dns/UDP=10.0.0.1:53", "ns/a:http/TCP=10.0.0.1:80"},
		},
		{
			name:        "delete and re-add unchanged in one window is no change",
			initial:     []*v1.Service{a},
			steps:       []step{{a, nil}, {nil, a}},
			wantReturn:  []bool{true, false},
			wantUpdated: sctNames(),
			wantPorts:   []string{"ns/a:dns/UDP=10.0.0.1:53", "ns/a:http/TCP=10.0.0.1:80"},
		},
		{
			name:           "update then delete compares with the applied state",
			initial:        []*v1.Service{a},
			steps:          []step{{a, aNoDNS}, {aNoDNS, nil}},
			wantReturn:     []bool{true, true},
			wantPending:    []string{"ns/a"},
			wantUpdated:    sctNames("a"),
			wantDeletedUDP: []string{"10.0.0.1"},
		},
		{
			name:        "change to another service keeps the tracker pending",
			initial:     []*v1.Service{a},
			steps:       []step{{nil, b}, {a, aNoDNS}, {aNoDNS, a}},
			wantReturn:  []bool{true, true, true},
			wantPending: []string{"ns/b"},
			wantUpdated: sctNames("b"),
			wantPorts:   []string{"ns/a:dns/UDP=10.0.0.1:53", "ns/a:http/TCP=10.0.0.1:80", "ns/b:http/TCP=10.0.0.2:80"},
		},
		{
			name:        "headless service is no change",
			steps:       []step{{nil, headless}},
			wantReturn:  []bool{false},
			wantUpdated: sctNames(),
		},
		{
			name:           "service turning headless loses its ports",
			initial:        []*v1.Service{a},
			steps:          []step{{a, aHeadless}},
			wantReturn:     []bool{true},
			wantPending:    []string{"ns/a"},
			wantUpdated:    sctNames("a"),
			wantDeletedUDP: []string{"10.0.0.1"},
		},
		{
			name:        "malformed fields affect only their service",
			steps:       []step{{nil, malformed}, {nil, b}},
			wantReturn:  []bool{true, true},
			wantPending: []string{"ns/b", "ns/m"},
			wantUpdated: sctNames("b", "m"),
			wantPorts:   []string{"ns/b:http/TCP=10.0.0.2:80", "ns/m:http/TCP=10.0.0.3:80"},
		},
		{
			name:        "IPv6 tracker ignores an IPv4-only service",
			family:      v1.IPv6Protocol,
			steps:       []step{{nil, a}, {nil, ipv6Only}},
			wantReturn:  []bool{false, true},
			wantPending: []string{"ns/v6"},
			wantUpdated: sctNames("v6"),
			wantPorts:   []string{"ns/v6:http/TCP=fd00::6:80"},
		},
		{
			name:        "nil previous and current is ignored",
			steps:       []step{{nil, nil}},
			wantReturn:  []bool{false},
			wantUpdated: sctNames(),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			family := tc.family
			if family == "" {
				family = v1.IPv4Protocol
			}
			tracker := NewServiceChangeTracker(ServiceChangeTrackerOptions{Family: family, Logger: logger})
			m := ServicePortMap{}
			for _, svc := range tc.initial {
				tracker.Update(nil, svc)
			}
			tracker.Apply(m)

			for i, s := range tc.steps {
				if got, _ := tracker.Update(s.previous, s.current); got != tc.wantReturn[i] {
					t.Errorf("step %d: Update returned %v, want %v", i, got, tc.wantReturn[i])
				}
			}
			if got := sets.List(tracker.PendingChanges()); !slices.Equal(got, tc.wantPending) {
				t.Errorf("PendingChanges = %v, want %v", got, tc.wantPending)
			}
			result := tracker.Apply(m)
			if !result.UpdatedServices.Equal(tc.wantUpdated) {
				t.Errorf("UpdatedServices = %v, want %v", result.UpdatedServices.UnsortedList(), tc.wantUpdated.UnsortedList())
			}
			checkServicePortsIndex(t, result, m)
			if got := sets.List(result.DeletedUDPClusterIPs); !slices.Equal(got, tc.wantDeletedUDP) {
				t.Errorf("DeletedUDPClusterIPs = %v, want %v", got, tc.wantDeletedUDP)
			}
			if got := sctDescribe(m); !slices.Equal(got, tc.wantPorts) {
				t.Errorf("service ports = %v, want %v", got, tc.wantPorts)
			}
			if n := tracker.PendingChanges().Len(); n != 0 {
				t.Errorf("%d changes pending after Apply", n)
			}
			again := tracker.Apply(m)
			if again.UpdatedServices.Len() != 0 || again.DeletedUDPClusterIPs.Len() != 0 {
				t.Errorf("second Apply reported %v / %v, want nothing", again.UpdatedServices.UnsortedList(), sets.List(again.DeletedUDPClusterIPs))
			}
		})
	}
}

func TestServiceChangeTrackerMalformedServiceFields(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	tracker := NewServiceChangeTracker(ServiceChangeTrackerOptions{Family: v1.IPv4Protocol, Logger: logger})
	svc := sctService("m", "10.0.0.3", sctHTTP)
	svc.Spec.ExternalIPs = []string{"not-an-ip", "192.0.2.1"}
	svc.Annotations = map[string]string{AnnotationTopologyKeys: "{broken"}
	tracker.Update(nil, svc)
	m := ServicePortMap{}
	tracker.Apply(m)

	sp := m[ServicePortName{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "m"}, Port: "http", Protocol: v1.ProtocolTCP}]
	if sp == nil {
		t.Fatalf("service port missing; map: %v", sctDescribe(m))
	}
	if want := spTestAddrs("192.0.2.1"); !slices.Equal(sp.ExternalIPs, want) {
		t.Errorf("ExternalIPs = %v, want %v", sp.ExternalIPs, want)
	}
	if sp.TopologyKeysError == nil || sp.TopologyKeys != nil {
		t.Errorf("TopologyKeys = %v, TopologyKeysError = %v; want nil keys and an error", sp.TopologyKeys, sp.TopologyKeysError)
	}

	// An unrelated update (a label) keeps the same error and is no change.
	relabelled := svc.DeepCopy()
	relabelled.Labels = map[string]string{"team": "x"}
	if pending, problems := tracker.Update(svc, relabelled); pending || problems != nil {
		t.Errorf("label-only update of a service with a malformed annotation reported a change (%v) or problems %q", pending, problems)
	}
}

func TestServiceChangeTrackerProblems(t *testing.T) {
	withExternalIPs := func(name string, ips ...string) *v1.Service {
		svc := sctService(name, "10.0.0.1", sctHTTP)
		svc.Spec.ExternalIPs = ips
		return svc
	}
	good := withExternalIPs("a", "192.0.2.1")
	bad := withExternalIPs("a", "192.0.2.999")
	badRelabelled := bad.DeepCopy()
	badRelabelled.Labels = map[string]string{"team": "x"}
	otherBad := withExternalIPs("a", "192.0.2.999", "192.0.2.888")
	twiceBad := withExternalIPs("a", "192.0.2.999", "192.0.2.999")
	badIPv6Only := sctService("a", "fd00::1", sctHTTP)
	badIPv6Only.Spec.ExternalIPs = []string{"192.0.2.999"}
	headlessBad := withExternalIPs("a", "192.0.2.999")
	headlessBad.Spec.ClusterIP, headlessBad.Spec.ClusterIPs = v1.ClusterIPNone, []string{v1.ClusterIPNone}

	p999 := invalidField(`spec.externalIPs: "192.0.2.999" is not an IP address; kproxy ignores it`)
	p888 := invalidField(`spec.externalIPs: "192.0.2.888" is not an IP address; kproxy ignores it`)

	type step struct {
		previous, current *v1.Service
		// apply folds the pending changes in before this step.
		apply bool
		want  []ServiceProblem
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{name: "valid service", steps: []step{{current: good}}},
		{name: "problem on add", steps: []step{{current: bad, want: []ServiceProblem{p999}}}},
		{
			name:  "resync after a sync: not again",
			steps: []step{{current: bad, want: []ServiceProblem{p999}}, {previous: bad, current: bad, apply: true}},
		},
		{
			name:  "resync before a sync: not again",
			steps: []step{{current: bad, want: []ServiceProblem{p999}}, {previous: bad, current: bad}},
		},
		{
			name: "unrelated change: not again",
			steps: []step{
				{current: bad, want: []ServiceProblem{p999}},
				{previous: bad, current: badRelabelled, apply: true},
				{previous: badRelabelled, current: badRelabelled},
			},
		},
		{
			name:  "a second problem: only the new one",
			steps: []step{{current: bad, want: []ServiceProblem{p999}}, {previous: bad, current: otherBad, apply: true, want: []ServiceProblem{p888}}},
		},
		{
			name: "fixed, then broken again, in one window",
			steps: []step{
				{current: bad, want: []ServiceProblem{p999}},
				{previous: bad, current: good},
				{previous: good, current: bad, want: []ServiceProblem{p999}},
			},
		},
		{
			name: "fixed, then broken again, across syncs",
			steps: []step{
				{current: bad, want: []ServiceProblem{p999}},
				{previous: bad, current: good, apply: true},
				{previous: good, current: bad, apply: true, want: []ServiceProblem{p999}},
			},
		},
		{
			name: "a change that cancels out still brings back the problem it had",
			steps: []step{
				{current: bad, want: []ServiceProblem{p999}},
				{previous: bad, current: good, apply: true},
				{previous: good, current: bad, want: []ServiceProblem{p999}},
				{previous: bad, current: bad},
			},
		},
		{name: "the same problem twice in one object: once", steps: []step{{current: twiceBad, want: []ServiceProblem{p999}}}},
		{name: "delete", steps: []step{{current: bad, want: []ServiceProblem{p999}}, {previous: bad, apply: true}}},
		{name: "delete never seen", steps: []step{{previous: bad}}},
		{name: "service of the other family only: reported all the same", steps: []step{{current: badIPv6Only, want: []ServiceProblem{p999}}}},
		{name: "headless service: nothing", steps: []step{{current: headlessBad}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			tracker := NewServiceChangeTracker(ServiceChangeTrackerOptions{Family: v1.IPv4Protocol, Logger: logger})
			m := ServicePortMap{}
			for i, s := range tc.steps {
				if s.apply {
					tracker.Apply(m)
				}
				if _, got := tracker.Update(s.previous, s.current); !slices.Equal(got, s.want) {
					t.Errorf("step %d: new problems %q, want %q", i, got, s.want)
				}
			}
		})
	}
}

func TestServiceChangeTrackerConcurrentUse(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	tracker := NewServiceChangeTracker(ServiceChangeTrackerOptions{Family: v1.IPv4Protocol, Logger: logger})
	const writers, perWriter = 4, 50

	m := ServicePortMap{}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perWriter {
				name := fmt.Sprintf("w%d-%d", w, i)
				tracker.Update(nil, sctService(name, fmt.Sprintf("10.1.%d.%d", w, i+1), sctHTTP))
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
		t.Errorf("got %d service ports, want %d", len(m), writers*perWriter)
	}
}

// checkServicePortsIndex checks that result.ServicePorts names, for each
// updated service and for it only, exactly the ports m holds of it.
func checkServicePortsIndex(t *testing.T, result UpdateServiceMapResult, m ServicePortMap) {
	t.Helper()
	if len(result.ServicePorts) != result.UpdatedServices.Len() {
		t.Errorf("ServicePorts has %d services, want the %d updated ones", len(result.ServicePorts), result.UpdatedServices.Len())
	}
	for nn := range result.UpdatedServices {
		var want []ServicePortName
		for name := range m {
			if name.NamespacedName == nn {
				want = append(want, name)
			}
		}
		got := slices.Clone(result.ServicePorts[nn])
		slices.SortFunc(got, ServicePortName.Compare)
		slices.SortFunc(want, ServicePortName.Compare)
		if !slices.Equal(got, want) {
			t.Errorf("ServicePorts[%v] = %v, want %v", nn, got, want)
		}
	}
}
