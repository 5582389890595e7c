package proxier_test

import (
	"context"
	"errors"
	"maps"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// countingBackend is a fakeBackend that also reports rule counts, as the
// iptables backend does: one nat rule per programmed service port and a
// fixed filter rule.
type countingBackend struct{ *fakeBackend }

func (b countingBackend) Sync(ctx context.Context, state *proxy.NodeState, full bool) (proxy.BackendResult, error) {
	res, err := b.fakeBackend.Sync(ctx, state, full)
	if err == nil {
		res.RuleCounts = map[string]int{"nat": len(b.programmed()), "filter": 1}
	}
	return res, err
}

func nn(name string) types.NamespacedName {
	return types.NamespacedName{Namespace: pt.Namespace, Name: name}
}

func TestEngineHealthCheckServices(t *testing.T) {
	lb := func(name string) *v1.Service {
		return pt.Service(name, "10.96.0.20", pt.LoadBalancer("192.0.2.10"), pt.ExternalLocal())
	}
	twoPorts := []discovery.EndpointPort{
		{Name: ptr.To("p"), Port: ptr.To(int32(8080)), Protocol: ptr.To(v1.ProtocolTCP)},
		{Name: ptr.To("q"), Port: ptr.To(int32(8443)), Protocol: ptr.To(v1.ProtocolTCP)},
	}
	twoPortSvc := func(name string) *v1.Service {
		return pt.Service(name, "10.96.0.21", pt.Ports(
			v1.ServicePort{Name: "p", Port: 80, Protocol: v1.ProtocolTCP},
			v1.ServicePort{Name: "q", Port: 443, Protocol: v1.ProtocolTCP},
		), pt.LoadBalancer("192.0.2.11"), pt.ExternalLocal())
	}
	for _, tc := range []struct {
		name   string
		events func(e *proxier.Engine)
		want   map[types.NamespacedName]proxier.HealthCheckService
	}{
		{
			name:   "no load balancer, no health check",
			events: func(e *proxier.Engine) { e.OnServiceAdd(web()); e.OnEndpointSliceAdd(webSlice()) },
			want:   map[types.NamespacedName]proxier.HealthCheckService{},
		},
		{
			name: "cluster-policy load balancer has no health check",
			events: func(e *proxier.Engine) {
				e.OnServiceAdd(pt.Service("lb", "10.96.0.20", pt.LoadBalancer("192.0.2.10")))
			},
			want: map[types.NamespacedName]proxier.HealthCheckService{},
		},
		{
			name:   "Local load balancer without endpoints",
			events: func(e *proxier.Engine) { e.OnServiceAdd(lb("lb")) },
			want:   map[types.NamespacedName]proxier.HealthCheckService{nn("lb"): {Port: 32000, LocalEndpoints: 0}},
		},
		{
			name: "only local Ready endpoints count",
			events: func(e *proxier.Engine) {
				e.OnServiceAdd(lb("lb"))
				e.OnEndpointSliceAdd(pt.Slice("lb", 8080,
					pt.EP{IP: "10.244.1.5", Node: thisNode},
					pt.EP{IP: "10.244.1.6", Node: thisNode},
					pt.EP{IP: "10.244.1.7", Node: thisNode, Terminating: true},
					pt.EP{IP: "10.244.1.8", Node: thisNode, NotReady: true},
					pt.EP{IP: "10.244.2.5", Node: "node-b"},
				))
			},
			want: map[types.NamespacedName]proxier.HealthCheckService{nn("lb"): {Port: 32000, LocalEndpoints: 2}},
		},
		{
			name: "a pod serving two ports counts once",
			events: func(e *proxier.Engine) {
				e.OnServiceAdd(twoPortSvc("multi"))
				e.OnEndpointSliceAdd(pt.SliceWithPorts("multi", twoPorts, pt.EP{IP: "10.244.1.5", Node: thisNode}))
			},
			want: map[types.NamespacedName]proxier.HealthCheckService{nn("multi"): {Port: 32000, LocalEndpoints: 1}},
		},
		{
			name: "deleted service disappears",
			events: func(e *proxier.Engine) {
				e.OnServiceAdd(lb("lb"))
				e.OnServiceAdd(lb("other"))
				e.OnServiceDelete(lb("lb"))
			},
			want: map[types.NamespacedName]proxier.HealthCheckService{nn("other"): {Port: 32000, LocalEndpoints: 0}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			h.sync()
			tc.events(h.engine)
			r := h.sync()
			if !maps.Equal(r.HealthCheckServices, tc.want) {
				t.Errorf("health check services = %v, want %v", r.HealthCheckServices, tc.want)
			}
			// An unrelated later sync still reports every health check.
			h.clock.Step(10 * time.Second)
			h.engine.OnServiceAdd(db())
			if r := h.sync(); !maps.Equal(r.HealthCheckServices, tc.want) {
				t.Errorf("after an unrelated change: health check services = %v, want %v", r.HealthCheckServices, tc.want)
			}
		})
	}
}

func TestEngineChangeCounts(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		events               func(e *proxier.Engine)
		wantPendingServices  []string
		wantPendingEndpoints []string
		wantServiceChanges   int
		wantEndpointChanges  int
	}{
		{name: "nothing", events: func(*proxier.Engine) {}},
		{
			name: "two services and one slice",
			events: func(e *proxier.Engine) {
				e.OnServiceAdd(web())
				e.OnServiceAdd(db())
				e.OnEndpointSliceAdd(webSlice())
			},
			wantPendingServices: []string{"ns/db", "ns/web"}, wantPendingEndpoints: []string{"ns/web"},
			wantServiceChanges: 2, wantEndpointChanges: 1,
		},
		{
			name: "updates of one service between syncs count once",
			events: func(e *proxier.Engine) {
				e.OnServiceAdd(web())
				e.OnServiceUpdate(web(), pt.Service("web", "10.96.0.10", pt.NodePort(30080)))
			},
			wantPendingServices: []string{"ns/web"}, wantServiceChanges: 1,
		},
		{
			name: "a change undone before the sync is no change",
			events: func(e *proxier.Engine) {
				e.OnServiceAdd(web())
				e.OnServiceDelete(web())
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			h.sync()
			tc.events(h.engine)
			svcs, eps := h.engine.PendingChanges()
			if got := sets.List(svcs); !slices.Equal(got, tc.wantPendingServices) {
				t.Errorf("pending service changes = %v, want %v", got, tc.wantPendingServices)
			}
			if got := sets.List(eps); !slices.Equal(got, tc.wantPendingEndpoints) {
				t.Errorf("pending endpoint changes = %v, want %v", got, tc.wantPendingEndpoints)
			}
			r := h.sync()
			if r.ServiceChanges != tc.wantServiceChanges || r.EndpointChanges != tc.wantEndpointChanges {
				t.Errorf("applied changes: services %d, endpoints %d; want %d and %d",
					r.ServiceChanges, r.EndpointChanges, tc.wantServiceChanges, tc.wantEndpointChanges)
			}
			svcs, eps = h.engine.PendingChanges()
			if svcs.Len() != 0 || eps.Len() != 0 {
				t.Errorf("after the sync, pending = %v / %v, want none", sets.List(svcs), sets.List(eps))
			}
		})
	}
}

func TestEngineRuleCounts(t *testing.T) {
	for _, tc := range []struct {
		name     string
		counting bool
		fail     bool
		want     map[string]int
	}{
		{name: "backend without rule counts", counting: false, want: nil},
		{name: "backend with rule counts", counting: true, want: map[string]int{"nat": 2, "filter": 1}},
		{name: "failed sync reports none", counting: true, fail: true, want: nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, func(o *proxier.EngineOptions) {
				if tc.counting {
					o.Backend = countingBackend{o.Backend.(*fakeBackend)}
				}
			})
			h.engine.OnServiceAdd(web())
			h.engine.OnServiceAdd(db())
			if tc.fail {
				h.backend.failNextSync(errors.New("restore failed"))
				if err := h.engine.SyncRules(h.ctx); err == nil {
					t.Fatal("sync succeeded, want the injected failure")
				}
			} else {
				h.sync()
			}
			if got := h.lastResult().RuleCounts; !maps.Equal(got, tc.want) || (got == nil) != (tc.want == nil) {
				t.Errorf("rule counts = %v, want %v", got, tc.want)
			}
		})
	}
}
