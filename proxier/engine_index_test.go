package proxier_test

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// world holds the objects an engine was given, to replay them into a fresh
// engine: the from-scratch computation that an incremental one must match.
type world struct {
	e      *proxier.Engine
	svcs   map[string]*v1.Service
	slices map[string]*discovery.EndpointSlice
	nodes  map[string]*v1.Node
}

func newWorld(e *proxier.Engine) *world {
	return &world{e: e, svcs: map[string]*v1.Service{}, slices: map[string]*discovery.EndpointSlice{}, nodes: map[string]*v1.Node{}}
}

func (w *world) setService(s *v1.Service) {
	if old := w.svcs[s.Name]; old != nil {
		w.e.OnServiceUpdate(old, s)
	} else {
		w.e.OnServiceAdd(s)
	}
	w.svcs[s.Name] = s
}

func (w *world) deleteService(name string) {
	if old := w.svcs[name]; old != nil {
		w.e.OnServiceDelete(old)
		delete(w.svcs, name)
	}
}

func (w *world) setSlice(s *discovery.EndpointSlice) {
	if old := w.slices[s.Name]; old != nil {
		w.e.OnEndpointSliceUpdate(old, s)
	} else {
		w.e.OnEndpointSliceAdd(s)
	}
	w.slices[s.Name] = s
}

func (w *world) deleteSlice(name string) {
	if old := w.slices[name]; old != nil {
		w.e.OnEndpointSliceDelete(old)
		delete(w.slices, name)
	}
}

func (w *world) setNode(n *v1.Node) {
	w.e.OnNodeUpdate(w.nodes[n.Name], n)
	w.nodes[n.Name] = n
}

// fromScratch feeds every object of w to a fresh engine and returns its
// first (full) sync's result and the state its backend was given.
func (w *world) fromScratch(t *testing.T) (proxier.SyncResult, *nodeState) {
	t.Helper()
	h := newHarness(t, nil)
	for _, n := range w.nodes {
		h.engine.OnNodeAdd(n)
	}
	for _, s := range w.svcs {
		h.engine.OnServiceAdd(s)
	}
	for _, s := range w.slices {
		h.engine.OnEndpointSliceAdd(s)
	}
	h.engine.OnServiceSynced()
	h.engine.OnEndpointSlicesSynced()
	r := h.sync()
	return r, h.backend.last()
}

// checkAgainstScratch compares what an incremental sync reported with a
// from-scratch computation over the same objects.
func checkAgainstScratch(t *testing.T, what string, h *harness, w *world, r proxier.SyncResult) {
	t.Helper()
	want, wantState := w.fromScratch(t)
	if r.NoLocalEndpointsInternal != want.NoLocalEndpointsInternal || r.NoLocalEndpointsExternal != want.NoLocalEndpointsExternal {
		t.Errorf("%s: no-local counts internal %d, external %d; from scratch %d, %d", what,
			r.NoLocalEndpointsInternal, r.NoLocalEndpointsExternal, want.NoLocalEndpointsInternal, want.NoLocalEndpointsExternal)
	}
	if !maps.Equal(r.HealthCheckServices, want.HealthCheckServices) {
		t.Errorf("%s: health check services %v; from scratch %v", what, r.HealthCheckServices, want.HealthCheckServices)
	}
	if r.Services != want.Services {
		t.Errorf("%s: %d service ports; from scratch %d", what, r.Services, want.Services)
	}
	if got := h.backend.last(); !maps.EqualFunc(got.Services, wantState.Services, svcStateEqual) {
		t.Errorf("%s: state given to the backend\n%v\nfrom scratch\n%v", what, got.Services, wantState.Services)
	}
}

func TestEngineIncrementalCounts(t *testing.T) {
	itp := func(opts ...pt.SvcOpt) *v1.Service {
		return pt.Service("itp", "10.96.0.30", append([]pt.SvcOpt{pt.InternalLocal()}, opts...)...)
	}
	lb := func() *v1.Service {
		return pt.Service("lb", "10.96.0.31", pt.LoadBalancer("192.0.2.10"), pt.ExternalLocal())
	}
	twoPorts := pt.Ports(
		v1.ServicePort{Name: "p", Port: 80, Protocol: v1.ProtocolTCP},
		v1.ServicePort{Name: "q", Port: 443, Protocol: v1.ProtocolTCP},
	)
	slicePorts := []discovery.EndpointPort{
		{Name: ptr.To("p"), Port: ptr.To(int32(8080)), Protocol: ptr.To(v1.ProtocolTCP)},
		{Name: ptr.To("q"), Port: ptr.To(int32(8443)), Protocol: ptr.To(v1.ProtocolTCP)},
	}
	remote := pt.EP{IP: "10.244.2.5", Node: "node-b"}
	local := pt.EP{IP: "10.244.1.5", Node: thisNode}
	local2 := pt.EP{IP: "10.244.1.6", Node: thisNode}
	hc := func(n int) map[types.NamespacedName]proxier.HealthCheckService {
		return map[types.NamespacedName]proxier.HealthCheckService{nn("lb"): {Port: 32000, LocalEndpoints: n}}
	}
	none := map[types.NamespacedName]proxier.HealthCheckService{}

	type step struct {
		name         string
		do           func(w *world)
		wantInternal int
		wantExternal int
		wantHC       map[types.NamespacedName]proxier.HealthCheckService
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{
			name: "endpoint moves between local and remote",
			steps: []step{
				{name: "remote only", do: func(w *world) { w.setService(itp()); w.setSlice(pt.Slice("itp", 8080, remote)) }, wantInternal: 1, wantHC: none},
				{name: "moves here", do: func(w *world) { w.setSlice(pt.Slice("itp", 8080, local)) }, wantHC: none},
				{name: "moves away", do: func(w *world) { w.setSlice(pt.Slice("itp", 8080, remote)) }, wantInternal: 1, wantHC: none},
			},
		},
		{
			name: "internal policy changes",
			steps: []step{
				{name: "Local", do: func(w *world) { w.setService(itp()); w.setSlice(pt.Slice("itp", 8080, remote)) }, wantInternal: 1, wantHC: none},
				{name: "Cluster", do: func(w *world) { w.setService(pt.Service("itp", "10.96.0.30")) }, wantHC: none},
				{name: "Local again", do: func(w *world) { w.setService(itp()) }, wantInternal: 1, wantHC: none},
			},
		},
		{
			name: "Local load balancer",
			steps: []step{
				{name: "no endpoints", do: func(w *world) { w.setService(lb()) }, wantHC: hc(0)},
				{name: "remote endpoint", do: func(w *world) { w.setSlice(pt.Slice("lb", 8080, remote)) }, wantExternal: 1, wantHC: hc(0)},
				{name: "two local endpoints", do: func(w *world) { w.setSlice(pt.Slice("lb", 8080, remote, local, local2)) }, wantHC: hc(2)},
				{name: "one local endpoint terminates", do: func(w *world) {
					w.setSlice(pt.Slice("lb", 8080, remote, local, pt.EP{IP: local2.IP, Node: thisNode, Terminating: true}))
				}, wantHC: hc(1)},
				{name: "external policy Cluster", do: func(w *world) {
					w.setService(pt.Service("lb", "10.96.0.31", pt.LoadBalancer("192.0.2.10")))
				}, wantHC: none},
				{name: "external policy Local again", do: func(w *world) { w.setService(lb()) }, wantHC: hc(1)},
				{name: "slice deleted", do: func(w *world) { w.deleteSlice("lb-IPv4") }, wantHC: hc(0)},
			},
		},
		{
			name: "services deleted",
			steps: []step{
				{name: "both", do: func(w *world) {
					w.setService(itp())
					w.setSlice(pt.Slice("itp", 8080, remote))
					w.setService(lb())
					w.setSlice(pt.Slice("lb", 8080, remote))
				}, wantInternal: 1, wantExternal: 1, wantHC: hc(0)},
				{name: "load balancer deleted", do: func(w *world) { w.deleteService("lb") }, wantInternal: 1, wantHC: none},
				{name: "internal Local deleted", do: func(w *world) { w.deleteService("itp") }, wantHC: none},
				{name: "load balancer back", do: func(w *world) { w.setService(lb()) }, wantExternal: 1, wantHC: hc(0)},
			},
		},
		{
			name: "slices before their service",
			steps: []step{
				{name: "slice alone", do: func(w *world) { w.setSlice(pt.Slice("itp", 8080, remote)) }, wantHC: none},
				{name: "service arrives", do: func(w *world) { w.setService(itp()) }, wantInternal: 1, wantHC: none},
			},
		},
		{
			name: "ports added and removed",
			steps: []step{
				{name: "two ports", do: func(w *world) {
					w.setService(itp(twoPorts))
					w.setSlice(pt.SliceWithPorts("itp", slicePorts, remote))
				}, wantInternal: 2, wantHC: none},
				{name: "one port", do: func(w *world) { w.setService(itp()) }, wantInternal: 1, wantHC: none},
				{name: "two ports again", do: func(w *world) { w.setService(itp(twoPorts)) }, wantInternal: 2, wantHC: none},
				{name: "the pod moves here", do: func(w *world) { w.setSlice(pt.SliceWithPorts("itp", slicePorts, local)) }, wantHC: none},
			},
		},
		{
			name: "two-port load balancer counts a pod once",
			steps: []step{
				{name: "one local pod", do: func(w *world) {
					w.setService(pt.Service("lb", "10.96.0.31", twoPorts, pt.LoadBalancer("192.0.2.10"), pt.ExternalLocal()))
					w.setSlice(pt.SliceWithPorts("lb", slicePorts, local, remote))
				}, wantHC: hc(1)},
				{name: "pod moves away", do: func(w *world) { w.setSlice(pt.SliceWithPorts("lb", slicePorts, remote)) }, wantExternal: 2, wantHC: hc(0)},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			h.sync()
			w := newWorld(h.engine)
			for _, s := range tc.steps {
				h.clock.Step(10 * time.Second)
				s.do(w)
				r := h.sync()
				if r.Full {
					t.Fatalf("%s: sync was full, want partial", s.name)
				}
				if r.NoLocalEndpointsInternal != s.wantInternal || r.NoLocalEndpointsExternal != s.wantExternal {
					t.Errorf("%s: no-local counts internal %d, external %d; want %d, %d",
						s.name, r.NoLocalEndpointsInternal, r.NoLocalEndpointsExternal, s.wantInternal, s.wantExternal)
				}
				if !maps.Equal(r.HealthCheckServices, s.wantHC) {
					t.Errorf("%s: health check services %v, want %v", s.name, r.HealthCheckServices, s.wantHC)
				}
				checkAgainstScratch(t, s.name, h, w, r)
			}
		})
	}
}

// randomChanges makes random changes to a handful of services, their
// slices and this node's zone.
type randomChanges struct {
	rng *rand.Rand
	w   *world
}

var randomServiceNames = []string{"a", "b", "c", "d", "e"}

func (g *randomChanges) pick(n int) int { return g.rng.IntN(n) }

func (g *randomChanges) service(name string) *v1.Service {
	ip := fmt.Sprintf("10.96.1.%d", slices.Index(randomServiceNames, name)+1)
	var opts []pt.SvcOpt
	if g.pick(2) == 0 {
		opts = append(opts, pt.Ports(
			v1.ServicePort{Name: "p", Port: 80, Protocol: v1.ProtocolTCP},
			v1.ServicePort{Name: "q", Port: 53, Protocol: v1.ProtocolUDP},
		))
	}
	switch g.pick(3) {
	case 1:
		opts = append(opts, pt.NodePort(int32(30000+g.pick(3))))
	case 2:
		opts = append(opts, pt.LoadBalancer("192.0.2.1"))
	}
	if g.pick(2) == 0 {
		opts = append(opts, pt.ExternalLocal())
	}
	if g.pick(3) == 0 {
		opts = append(opts, pt.InternalLocal())
	}
	if g.pick(4) == 0 {
		opts = append(opts, pt.TrafficDistribution(v1.ServiceTrafficDistributionPreferClose))
	}
	return pt.Service(name, ip, opts...)
}

func (g *randomChanges) slice(svc string) *discovery.EndpointSlice {
	var ports []discovery.EndpointPort
	if g.pick(3) != 0 {
		ports = append(ports, discovery.EndpointPort{Name: ptr.To("p"), Port: ptr.To(int32(8080 + g.pick(2))), Protocol: ptr.To(v1.ProtocolTCP)})
	}
	if g.pick(2) == 0 {
		ports = append(ports, discovery.EndpointPort{Name: ptr.To("q"), Port: ptr.To(int32(5353)), Protocol: ptr.To(v1.ProtocolUDP)})
	}
	var eps []pt.EP
	for range g.pick(4) {
		ep := pt.EP{IP: fmt.Sprintf("10.244.0.%d", 1+g.pick(6)), Node: []string{thisNode, "node-b", ""}[g.pick(3)]}
		switch g.pick(4) {
		case 0:
			ep.NotReady = true
		case 1:
			ep.Terminating = true
		}
		if g.pick(2) == 0 {
			ep.ZoneHints = []string{[]string{"z1", "z2"}[g.pick(2)]}
		}
		eps = append(eps, ep)
	}
	sl := pt.SliceWithPorts(svc, ports, eps...)
	sl.AddressType = discovery.AddressTypeIPv4
	sl.Name = fmt.Sprintf("%s-%d", svc, g.pick(2))
	return sl
}

// change makes one random change.
func (g *randomChanges) change() string {
	name := randomServiceNames[g.pick(len(randomServiceNames))]
	switch g.pick(10) {
	case 0, 1, 2:
		g.w.setService(g.service(name))
		return "set service " + name
	case 3:
		g.w.deleteService(name)
		return "delete service " + name
	case 4, 5, 6, 7:
		sl := g.slice(name)
		g.w.setSlice(sl)
		return "set slice " + sl.Name
	case 8:
		sl := fmt.Sprintf("%s-%d", name, g.pick(2))
		g.w.deleteSlice(sl)
		return "delete slice " + sl
	default:
		zone := []string{"z1", "z2"}[g.pick(2)]
		g.w.setNode(pt.Node(thisNode, map[string]string{v1.LabelTopologyZone: zone}))
		return "this node in zone " + zone
	}
}

// TestEngineIncrementalMatchesFromScratch runs random change sequences
// through partial syncs (a few made full by a failed sync) and compares
// after every sync what the engine maintains incrementally (states, no-local
// counts, health checks) with a fresh engine given the same objects.
func TestEngineIncrementalMatchesFromScratch(t *testing.T) {
	const seeds, syncs = 40, 40
	for seed := range uint64(seeds) {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			h := newSyncedHarness(t, nil)
			h.sync()
			g := &randomChanges{rng: rand.New(rand.NewPCG(seed, 0x6b70726f7879)), w: newWorld(h.engine)}
			type kept struct {
				got, want map[types.NamespacedName]proxier.HealthCheckService
			}
			var earlier []kept
			var log []string
			for i := range syncs {
				h.clock.Step(10 * time.Second)
				for range 1 + g.pick(3) {
					log = append(log, g.change())
				}
				if g.pick(10) == 0 {
					h.backend.failNextSync(fmt.Errorf("sync %d refused", i))
					if err := h.engine.SyncRules(h.ctx); err == nil {
						t.Fatalf("sync %d: want the refused sync's error", i)
					}
					log = append(log, "failed sync")
					continue
				}
				r := h.sync()
				log = append(log, fmt.Sprintf("sync (full %v)", r.Full))
				what := fmt.Sprintf("after %v", log)
				checkAgainstScratch(t, what, h, g.w, r)
				if t.Failed() {
					return
				}
				earlier = append(earlier, kept{r.HealthCheckServices, maps.Clone(r.HealthCheckServices)})
			}
			for i, k := range earlier {
				if !maps.Equal(k.got, k.want) {
					t.Errorf("sync %d's health check services changed afterwards: %v, were %v", i, k.got, k.want)
				}
			}
		})
	}
}
