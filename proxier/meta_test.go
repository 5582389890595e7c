package proxier_test

import (
	"context"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// fakeProxier is a Proxier that keeps the objects it was told about, the
// way an informer cache would: by namespace/name, added and updated
// objects replace, deleted ones go.
type fakeProxier struct {
	mu       sync.Mutex
	services map[string]*v1.Service
	slices   map[string]*discovery.EndpointSlice
	nodes    map[string]*v1.Node
	// synced records which caches were reported synced.
	synced        map[string]bool
	syncRequested bool
	// otherNodesPending is the last OnOtherNodesPending value.
	otherNodesPending bool
	// looping is true while SyncLoop runs; started gets a token when it
	// begins.
	looping bool
	started chan struct{}
}

var _ proxier.Proxier = (*fakeProxier)(nil)

func newFakeProxier() *fakeProxier {
	return &fakeProxier{
		services: map[string]*v1.Service{}, slices: map[string]*discovery.EndpointSlice{},
		nodes: map[string]*v1.Node{}, synced: map[string]bool{}, started: make(chan struct{}, 1),
	}
}

func key(ns, name string) string { return ns + "/" + name }

func (f *fakeProxier) do(fn func()) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn()
}

func (f *fakeProxier) OnServiceAdd(s *v1.Service) {
	f.do(func() { f.services[key(s.Namespace, s.Name)] = s })
}
func (f *fakeProxier) OnServiceUpdate(_, s *v1.Service) { f.OnServiceAdd(s) }
func (f *fakeProxier) OnServiceDelete(s *v1.Service) {
	f.do(func() { delete(f.services, key(s.Namespace, s.Name)) })
}
func (f *fakeProxier) OnServiceSynced() { f.do(func() { f.synced["services"] = true }) }
func (f *fakeProxier) OnEndpointSliceAdd(s *discovery.EndpointSlice) {
	f.do(func() { f.slices[key(s.Namespace, s.Name)] = s })
}
func (f *fakeProxier) OnEndpointSliceUpdate(_, s *discovery.EndpointSlice) { f.OnEndpointSliceAdd(s) }
func (f *fakeProxier) OnEndpointSliceDelete(s *discovery.EndpointSlice) {
	f.do(func() { delete(f.slices, key(s.Namespace, s.Name)) })
}
func (f *fakeProxier) OnEndpointSlicesSynced() { f.do(func() { f.synced["slices"] = true }) }
func (f *fakeProxier) OnNodeAdd(n *v1.Node)    { f.do(func() { f.nodes[n.Name] = n }) }
func (f *fakeProxier) OnNodeUpdate(_, n *v1.Node) {
	f.OnNodeAdd(n)
}
func (f *fakeProxier) OnNodeDelete(n *v1.Node) { f.do(func() { delete(f.nodes, n.Name) }) }
func (f *fakeProxier) OnNodeSynced()           { f.do(func() { f.synced["nodes"] = true }) }
func (f *fakeProxier) Sync()                   { f.do(func() { f.syncRequested = true }) }
func (f *fakeProxier) OnOtherNodesPending(pending bool) {
	f.do(func() { f.otherNodesPending = pending })
}

func (f *fakeProxier) SyncLoop(ctx context.Context) {
	f.do(func() { f.looping = true })
	f.started <- struct{}{}
	<-ctx.Done()
	f.do(func() { f.looping = false })
}

// contents is what the fake holds, as sorted keys.
type contents struct {
	Services, Slices, Nodes, Synced  []string
	SyncRequested, OtherNodesPending bool
}

func (f *fakeProxier) contents() contents {
	f.mu.Lock()
	defer f.mu.Unlock()
	var synced []string
	for k, v := range f.synced {
		if v {
			synced = append(synced, k)
		}
	}
	slices.Sort(synced)
	return contents{
		Services:      slices.Sorted(maps.Keys(f.services)),
		Slices:        slices.Sorted(maps.Keys(f.slices)),
		Nodes:         slices.Sorted(maps.Keys(f.nodes)),
		Synced:        synced,
		SyncRequested: f.syncRequested, OtherNodesPending: f.otherNodesPending,
	}
}

func contentsEqual(a, b contents) bool {
	return slices.Equal(a.Services, b.Services) && slices.Equal(a.Slices, b.Slices) &&
		slices.Equal(a.Nodes, b.Nodes) && slices.Equal(a.Synced, b.Synced) && a.SyncRequested == b.SyncRequested &&
		a.OtherNodesPending == b.OtherNodesPending
}

func fqdnSlice(name string) *discovery.EndpointSlice {
	s := pt.Slice(name, 80)
	s.Name = name + "-fqdn"
	s.AddressType = discovery.AddressTypeFQDN
	s.Endpoints = []discovery.Endpoint{{Addresses: []string{"db.example.com"}}}
	return s
}

func TestMetaProxierRouting(t *testing.T) {
	v4 := pt.Slice("web", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"})
	v6 := pt.Slice("web", 8080, pt.EP{IP: "fd00::5", Node: "node-b"})
	for _, tc := range []struct {
		name     string
		events   func(m *proxier.MetaProxier)
		wantIPv4 contents
		wantIPv6 contents
	}{
		{
			name:     "services go to both",
			events:   func(m *proxier.MetaProxier) { m.OnServiceAdd(web()); m.OnServiceAdd(db()) },
			wantIPv4: contents{Services: []string{"ns/db", "ns/web"}},
			wantIPv6: contents{Services: []string{"ns/db", "ns/web"}},
		},
		{
			name: "service update and delete go to both",
			events: func(m *proxier.MetaProxier) {
				m.OnServiceAdd(web())
				m.OnServiceAdd(db())
				m.OnServiceUpdate(web(), web())
				m.OnServiceDelete(db())
			},
			wantIPv4: contents{Services: []string{"ns/web"}},
			wantIPv6: contents{Services: []string{"ns/web"}},
		},
		{
			name: "slices go to the engine of their address type",
			events: func(m *proxier.MetaProxier) {
				m.OnEndpointSliceAdd(v4)
				m.OnEndpointSliceAdd(v6)
			},
			wantIPv4: contents{Slices: []string{"ns/web-IPv4"}},
			wantIPv6: contents{Slices: []string{"ns/web-IPv6"}},
		},
		{
			name: "slice updates and deletes follow the address type",
			events: func(m *proxier.MetaProxier) {
				m.OnEndpointSliceAdd(v4)
				m.OnEndpointSliceAdd(v6)
				m.OnEndpointSliceUpdate(v6, v6)
				m.OnEndpointSliceDelete(v4)
			},
			wantIPv4: contents{},
			wantIPv6: contents{Slices: []string{"ns/web-IPv6"}},
		},
		{
			name: "FQDN slices are dropped",
			events: func(m *proxier.MetaProxier) {
				m.OnEndpointSliceAdd(fqdnSlice("ext"))
				m.OnEndpointSliceUpdate(fqdnSlice("ext"), fqdnSlice("ext"))
			},
			wantIPv4: contents{},
			wantIPv6: contents{},
		},
		{
			// Slices of both IP address types share the FQDN slice's name:
			// had its deletion been passed on, one of them would be gone.
			name: "FQDN slice deletions are dropped",
			events: func(m *proxier.MetaProxier) {
				for _, s := range []*discovery.EndpointSlice{v4.DeepCopy(), v6.DeepCopy()} {
					s.Name = "ext-fqdn"
					m.OnEndpointSliceAdd(s)
				}
				m.OnEndpointSliceDelete(fqdnSlice("ext"))
			},
			wantIPv4: contents{Slices: []string{"ns/ext-fqdn"}},
			wantIPv6: contents{Slices: []string{"ns/ext-fqdn"}},
		},
		{
			name: "nodes go to both",
			events: func(m *proxier.MetaProxier) {
				m.OnNodeAdd(pt.Node("node-b", nil))
				m.OnNodeAdd(pt.Node("node-c", nil))
				m.OnNodeUpdate(nil, pt.Node("node-b", map[string]string{"k": "v"}))
				m.OnNodeDelete(pt.Node("node-c", nil))
			},
			wantIPv4: contents{Nodes: []string{"node-b"}},
			wantIPv6: contents{Nodes: []string{"node-b"}},
		},
		{
			name:     "other nodes pending goes to both",
			events:   func(m *proxier.MetaProxier) { m.OnOtherNodesPending(true) },
			wantIPv4: contents{OtherNodesPending: true},
			wantIPv6: contents{OtherNodesPending: true},
		},
		{
			name: "other nodes no longer pending goes to both",
			events: func(m *proxier.MetaProxier) {
				m.OnOtherNodesPending(true)
				m.OnOtherNodesPending(false)
			},
			wantIPv4: contents{},
			wantIPv6: contents{},
		},
		{
			name: "synced notifications and sync requests go to both",
			events: func(m *proxier.MetaProxier) {
				m.OnServiceSynced()
				m.OnEndpointSlicesSynced()
				m.OnNodeSynced()
				m.Sync()
			},
			wantIPv4: contents{Synced: []string{"nodes", "services", "slices"}, SyncRequested: true},
			wantIPv6: contents{Synced: []string{"nodes", "services", "slices"}, SyncRequested: true},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ipv4, ipv6 := newFakeProxier(), newFakeProxier()
			m := proxier.NewMetaProxier(ipv4, ipv6)
			tc.events(m)
			if got := ipv4.contents(); !contentsEqual(got, tc.wantIPv4) {
				t.Errorf("IPv4 proxier holds %+v, want %+v", got, tc.wantIPv4)
			}
			if got := ipv6.contents(); !contentsEqual(got, tc.wantIPv6) {
				t.Errorf("IPv6 proxier holds %+v, want %+v", got, tc.wantIPv6)
			}
		})
	}
}

func TestMetaProxierSyncLoop(t *testing.T) {
	ipv4, ipv6 := newFakeProxier(), newFakeProxier()
	m := proxier.NewMetaProxier(ipv4, ipv6)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		m.SyncLoop(ctx)
	}()
	waitFor(t, ipv4.started, "the IPv4 loop to start", nil)
	waitFor(t, ipv6.started, "the IPv6 loop to start", nil)
	select {
	case <-done:
		t.Fatal("SyncLoop returned before cancel")
	default:
	}
	cancel()
	waitFor(t, done, "SyncLoop to return after cancel", nil)
	for fam, p := range map[string]*fakeProxier{"IPv4": ipv4, "IPv6": ipv6} {
		p.mu.Lock()
		looping := p.looping
		p.mu.Unlock()
		if looping {
			t.Errorf("%s loop still running after SyncLoop returned", fam)
		}
	}
}

// TestMetaProxierDualStackEngines runs real engines behind a MetaProxier:
// each family's backend gets that family's endpoints, and each engine sees
// node label changes although both are fed the same node events.
func TestMetaProxierDualStackEngines(t *testing.T) {
	logger, ctx := ktesting.NewTestContext(t)
	clk := testingclock.NewFakeClock(epoch)
	backends := map[v1.IPFamily]*fakeBackend{v1.IPv4Protocol: newFakeBackend(), v1.IPv6Protocol: newFakeBackend()}
	engines := map[v1.IPFamily]*proxier.Engine{}
	for fam, b := range backends {
		e, err := proxier.NewEngine(proxier.EngineOptions{
			Family: fam, NodeName: thisNode, Backend: b, MinSyncPeriod: time.Second,
			SyncPeriod: 30 * time.Second, Clock: clk, Logger: logger,
		})
		if err != nil {
			t.Fatal(err)
		}
		engines[fam] = e
	}
	m := proxier.NewMetaProxier(engines[v1.IPv4Protocol], engines[v1.IPv6Protocol])
	syncBoth := func() {
		t.Helper()
		for fam, e := range engines {
			if err := e.SyncRules(ctx); err != nil {
				t.Fatalf("%s sync: %v", fam, err)
			}
		}
	}

	zone := v1.LabelTopologyZone
	svc := pt.Service("web", "10.96.0.10", pt.Annotation(proxy.AnnotationTopologyKeys, `["`+zone+`"]`))
	svc.Spec.ClusterIPs = []string{"10.96.0.10", "fd00:96::10"}
	svc.Spec.IPFamilies = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
	m.OnNodeAdd(pt.Node(thisNode, map[string]string{zone: "z1"}))
	m.OnNodeAdd(pt.Node("node-b", map[string]string{zone: "z1"}))
	m.OnNodeAdd(pt.Node("node-c", map[string]string{zone: "z2"}))
	m.OnServiceAdd(svc)
	m.OnEndpointSliceAdd(pt.Slice("web", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"}, pt.EP{IP: "10.244.3.5", Node: "node-c"}))
	m.OnEndpointSliceAdd(pt.Slice("web", 8080, pt.EP{IP: "fd00::2:5", Node: "node-b"}, pt.EP{IP: "fd00::3:5", Node: "node-c"}))
	m.OnEndpointSliceAdd(fqdnSlice("web"))
	m.OnServiceSynced()
	m.OnEndpointSlicesSynced()
	syncBoth()

	check := func(step string, want map[v1.IPFamily][]string) {
		t.Helper()
		for fam, b := range backends {
			got := b.last()
			if got == nil {
				t.Fatalf("%s: %s backend never synced", step, fam)
			}
			if got.Family != fam {
				t.Errorf("%s: %s backend got a %s state", step, fam, got.Family)
			}
			if eps := got.Services["ns/web:p"].Cluster; !slices.Equal(eps, want[fam]) {
				t.Errorf("%s: %s endpoints = %v, want %v", step, fam, eps, want[fam])
			}
		}
	}
	check("initial", map[v1.IPFamily][]string{
		v1.IPv4Protocol: {"10.244.2.5:8080"},
		v1.IPv6Protocol: {"[fd00::2:5]:8080"},
	})

	m.OnNodeUpdate(nil, pt.Node("node-c", map[string]string{zone: "z1"}))
	syncBoth()
	check("after node-c joined the zone", map[v1.IPFamily][]string{
		v1.IPv4Protocol: {"10.244.2.5:8080", "10.244.3.5:8080"},
		v1.IPv6Protocol: {"[fd00::2:5]:8080", "[fd00::3:5]:8080"},
	})
	for fam, b := range backends {
		if got := b.last(); got.Full || !slices.Equal(got.Changed, []string{"ns/web"}) {
			t.Errorf("%s: node change gave full=%v changed=%v, want partial [ns/web]", fam, got.Full, got.Changed)
		}
	}
}
