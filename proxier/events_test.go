package proxier_test

import (
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// drain returns the events recorded so far.
func drain(r *record.FakeRecorder) []string {
	var out []string
	for {
		select {
		case e := <-r.Events:
			out = append(out, e)
		default:
			return out
		}
	}
}

func withTopologyKeys(v string) pt.SvcOpt { return pt.Annotation(proxy.AnnotationTopologyKeys, v) }

func TestEngineServiceEvents(t *testing.T) {
	good := pt.Service("web", "10.96.0.10", withTopologyKeys(`["zone1"]`))
	badKeys := pt.Service("web", "10.96.0.10", withTopologyKeys(`["zone1"`))
	badKeysRelabelled := pt.Service("web", "10.96.0.10", withTopologyKeys(`["zone1"`), pt.Annotation("team", "a"))
	otherBadKeys := pt.Service("web", "10.96.0.10", withTopologyKeys(`["*", "zone1"]`))
	const (
		badKeysEvent      = `Warning InvalidTopologyKeys annotation topologyKeys must be a JSON list of node label keys: unexpected end of JSON input; the service is treated as having no topology keys`
		otherBadKeysEvent = `Warning InvalidTopologyKeys annotation topologyKeys: "*" must be the last key; the service is treated as having no topology keys`
	)
	type update struct{ old, cur *v1.Service }
	for _, tc := range []struct {
		name    string
		updates []update
		want    []string
	}{
		{
			name:    "valid service",
			updates: []update{{nil, good}},
		},
		{
			name:    "malformed topologyKeys on add",
			updates: []update{{nil, badKeys}},
			want:    []string{badKeysEvent},
		},
		{
			name:    "informer resync of the same object: once",
			updates: []update{{nil, badKeys}, {badKeys, badKeys}, {badKeys, badKeys}},
			want:    []string{badKeysEvent},
		},
		{
			name:    "unrelated change keeps the same problem: once",
			updates: []update{{nil, badKeys}, {badKeys, badKeysRelabelled}},
			want:    []string{badKeysEvent},
		},
		{
			name:    "another malformed value",
			updates: []update{{nil, badKeys}, {badKeys, otherBadKeys}},
			want:    []string{badKeysEvent, otherBadKeysEvent},
		},
		{
			name:    "fixed, then broken again",
			updates: []update{{nil, badKeys}, {badKeys, good}, {good, badKeys}},
			want:    []string{badKeysEvent, badKeysEvent},
		},
		{
			name:    "becomes malformed on update",
			updates: []update{{nil, good}, {good, badKeys}},
			want:    []string{badKeysEvent},
		},
		{
			name:    "deleted",
			updates: []update{{badKeys, nil}},
		},
		{
			name: "invalid external IP and source range",
			updates: []update{{nil, pt.Service("lb", "10.96.0.11",
				pt.ExternalIPs("192.0.2.1", "192.0.2.999"), pt.LoadBalancer("198.51.100.1"), pt.SourceRanges("203.0.113.0/24", "203.0.113.0/33"))}},
			want: []string{
				`Warning InvalidServiceField spec.externalIPs: "192.0.2.999" is not an IP address; kproxy ignores it`,
				`Warning InvalidServiceField spec.loadBalancerSourceRanges: "203.0.113.0/33" is not a CIDR; kproxy ignores it`,
			},
		},
		{
			name: "invalid load balancer IP; the legacy source range annotation is ignored",
			updates: []update{{nil, pt.Service("lb", "10.96.0.11", pt.LoadBalancer("198.51.100.300"),
				pt.Annotation(v1.AnnotationLoadBalancerSourceRangesKey, "203.0.113.0/24, nonsense"))}},
			want: []string{
				`Warning InvalidServiceField status.loadBalancer.ingress: "198.51.100.300" is not an IP address; kproxy ignores it`,
				`Warning IgnoredAnnotation annotation service.beta.kubernetes.io/load-balancer-source-ranges is ignored: kproxy, like kube-proxy, restricts sources only by spec.loadBalancerSourceRanges`,
			},
		},
		{
			name: "legacy source range annotation next to the field: not reported",
			updates: []update{{nil, pt.Service("lb", "10.96.0.11", pt.LoadBalancer("198.51.100.1"), pt.SourceRanges("203.0.113.0/24"),
				pt.Annotation(v1.AnnotationLoadBalancerSourceRangesKey, "198.51.100.0/24"))}},
		},
		{
			name:    "IPv6-only service on the IPv4 engine: reported all the same",
			updates: []update{{nil, pt.Service("v6", "fd00::10", pt.IPv6(), withTopologyKeys(`["zone1"`))}},
			want:    []string{badKeysEvent},
		},
		{
			name:    "the same invalid value twice: once",
			updates: []update{{nil, pt.Service("web", "10.96.0.10", pt.ExternalIPs("192.0.2.999", "192.0.2.999"))}},
			want:    []string{`Warning InvalidServiceField spec.externalIPs: "192.0.2.999" is not an IP address; kproxy ignores it`},
		},
		{
			name:    "resync after a sync: once",
			updates: []update{{nil, badKeys}, {nil, nil}, {badKeys, badKeys}},
			want:    []string{badKeysEvent},
		},
		{
			name:    "LoadBalancer with externalTrafficPolicy Local and no health check port",
			updates: []update{{nil, pt.Service("lb", "10.96.0.11", pt.LoadBalancer("198.51.100.1"), pt.ExternalLocal(), func(s *v1.Service) { s.Spec.HealthCheckNodePort = 0 })}},
			want:    []string{`Warning InvalidServiceField spec.healthCheckNodePort is not set on a LoadBalancer service with externalTrafficPolicy Local; kproxy serves no health check for it`},
		},
		{
			name:    "headless service: kproxy does not handle it",
			updates: []update{{nil, pt.Service("headless", v1.ClusterIPNone, withTopologyKeys(`nonsense`))}},
		},
		{
			name: "ExternalName service: kproxy does not handle it",
			updates: []update{{nil, pt.Service("ext", "", withTopologyKeys(`nonsense`), func(s *v1.Service) {
				s.Spec.Type = v1.ServiceTypeExternalName
				s.Spec.ClusterIPs = nil
			})}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := record.NewFakeRecorder(100)
			h := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.EventRecorder = rec })
			for _, u := range tc.updates {
				switch {
				case u.old == nil && u.cur == nil:
					h.sync() // {nil, nil} stands for a sync between updates
				case u.old == nil:
					h.engine.OnServiceAdd(u.cur)
				case u.cur == nil:
					h.engine.OnServiceDelete(u.old)
				default:
					h.engine.OnServiceUpdate(u.old, u.cur)
				}
			}
			// Syncs send nothing.
			h.sync()
			h.sync()
			if got := drain(rec); !slices.Equal(got, tc.want) {
				t.Errorf("events:\n%q\nwant\n%q", got, tc.want)
			}
		})
	}
}

// TestDualStackServiceEventsOnce feeds a dual-stack pair of engines, only
// the IPv4 one with a recorder (as kproxy sets them up), through a
// MetaProxier: a problem is reported once, whatever the Service's families.
func TestDualStackServiceEventsOnce(t *testing.T) {
	rec := record.NewFakeRecorder(100)
	v4 := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.EventRecorder = rec })
	v6 := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.Family = v1.IPv6Protocol })
	meta := proxier.NewMetaProxier(v4.engine, v6.engine)

	dual := pt.Service("dual", "10.96.0.12", withTopologyKeys(`["zone1"`), func(s *v1.Service) {
		s.Spec.ClusterIPs = []string{"10.96.0.12", "fd00::12"}
		s.Spec.IPFamilies = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
	})
	v6Only := pt.Service("v6", "fd00::13", pt.IPv6(), withTopologyKeys(`["zone1"`))
	meta.OnServiceAdd(dual)
	meta.OnServiceAdd(v6Only)
	meta.OnServiceUpdate(dual, dual)
	meta.OnServiceUpdate(v6Only, v6Only)
	v4.sync()
	v6.sync()

	const event = `Warning InvalidTopologyKeys annotation topologyKeys must be a JSON list of node label keys: unexpected end of JSON input; the service is treated as having no topology keys`
	if got, want := drain(rec), []string{event, event}; !slices.Equal(got, want) {
		t.Errorf("events:\n%q\nwant one per service\n%q", got, want)
	}
	if got := len(v6.backend.last().Services); got != 2 {
		t.Errorf("IPv6 engine programs %d service ports, want 2", got)
	}
}

// TestEngineServiceEventsToAPI sends the events through a real broadcaster
// to a fake API server: the event is about the Service, in its namespace.
func TestEngineServiceEventsToAPI(t *testing.T) {
	client := fake.NewClientset()
	b := record.NewBroadcaster()
	defer b.Shutdown()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	rec := b.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kproxy", Host: thisNode})
	h := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.EventRecorder = rec })
	h.engine.OnServiceAdd(pt.Service("web", "10.96.0.10", withTopologyKeys(`{}`)))

	var events []v1.Event
	waitUntil(t, func() bool {
		l, err := client.CoreV1().Events(pt.Namespace).List(h.ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatalf("listing events: %v", err)
		}
		events = l.Items
		return len(events) > 0
	}, "the event to reach the API server")
	if len(events) != 1 {
		t.Fatalf("%d events, want 1: %v", len(events), events)
	}
	e := events[0]
	if e.InvolvedObject.Kind != "Service" || e.InvolvedObject.Namespace != pt.Namespace || e.InvolvedObject.Name != "web" {
		t.Errorf("event is about %+v, want Service %s/web", e.InvolvedObject, pt.Namespace)
	}
	if e.Type != v1.EventTypeWarning || e.Reason != proxier.EventReasonInvalidTopologyKeys || e.Source.Component != "kproxy" {
		t.Errorf("event type %q reason %q source %q, want Warning %s from kproxy", e.Type, e.Reason, e.Source.Component, proxier.EventReasonInvalidTopologyKeys)
	}
	if !strings.Contains(e.Message, "topologyKeys") {
		t.Errorf("event message %q does not name the annotation", e.Message)
	}
}
