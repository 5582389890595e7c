package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

var (
	nodeIP      = netip.MustParseAddr("10.0.0.1")
	clusterCIDR = netip.MustParsePrefix("10.244.0.0/16")
)

// harness drives a real engine over a backend on a fake kernel.
type harness struct {
	t       *testing.T
	k       *fakeKernel
	backend *Backend
	engine  *proxier.Engine
	clock   *testingclock.FakeClock
	// last is the engine's report of the last sync.
	last proxier.SyncResult
}

func newHarness(t *testing.T, k *fakeKernel, opts Options) *harness {
	t.Helper()
	if k == nil {
		k = newFakeKernel(t, v1.IPv4Protocol, []netip.Addr{nodeIP})
	}
	h := &harness{t: t, k: k, clock: pt.NewClock()}
	opts.Clock = h.clock
	h.backend = k.backend(t, opts)
	env := pt.DefaultEnv()
	env.NodeIPs, env.ClusterCIDR = []netip.Addr{nodeIP}, clusterCIDR
	h.engine = pt.NewEngine(t, h.backend, pt.EngineOptions{Env: env, Clock: h.clock, OnSync: func(r proxier.SyncResult) { h.last = r }})
	return h
}

func (h *harness) sync() SyncStats {
	h.t.Helper()
	pt.Sync(h.t, h.engine)
	return h.backend.LastSync()
}

// syncStep is one step of a test that changes and syncs one harness in
// turn.
type syncStep struct {
	name   string
	change func(h *harness) // nil: nothing changes
	full   bool             // the sync is a full one
	// check, when set, checks the kernel after the sync.
	check func(t *testing.T, h *harness)
	flows []pt.Flow
}

// runSteps runs the steps in order, each as a subtest, up to the first
// that fails.
func (h *harness) runSteps(t *testing.T, steps []syncStep) {
	for _, step := range steps {
		ok := t.Run(step.name, func(t *testing.T) {
			h.t = t
			if step.change != nil {
				step.change(h)
			}
			if st := h.sync(); st.Full != step.full {
				t.Errorf("sync full = %v, want %v", st.Full, step.full)
			}
			if step.check != nil {
				step.check(t, h)
			}
			h.flows(step.flows...)
		})
		if !ok {
			break
		}
	}
}

func (h *harness) flows(flows ...pt.Flow) {
	h.t.Helper()
	pt.CheckFlows(h.t, &tracer{h.k}, flows)
}

// vs returns the kernel's virtual server, nil when absent.
func (k *fakeKernel) vs(t testing.TB, addr string, proto ipvs.Protocol, port uint16) *ipvs.Service {
	t.Helper()
	svcs, err := k.ipvs.Services(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range svcs {
		if s.Address == netip.MustParseAddr(addr) && s.Protocol == proto && s.Port == port {
			return s
		}
	}
	return nil
}

// dests returns "ip:port weight w" of the virtual server's real servers.
func (k *fakeKernel) dests(t testing.TB, svc *ipvs.Service) []string {
	t.Helper()
	ds, err := k.ipvs.Destinations(context.Background(), svc)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, d := range ds {
		out = append(out, d.String())
	}
	return out
}

// ours lists what of kproxy's remains in the fake kernel.
func (k *fakeKernel) ours(t testing.TB) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	for _, d := range k.nl.Devices() {
		if d == DefaultDummyDevice {
			out = append(out, "device "+d)
		}
	}
	sets, _ := k.sets.ListSets(ctx)
	for _, s := range sets {
		if strings.HasPrefix(s, "KPROXY-") {
			out = append(out, "set "+s)
		}
	}
	chains, jumps := iptablestest.Leftovers(k.ipt, "KPROXY-")
	for _, c := range chains {
		out = append(out, "chain "+c)
	}
	for _, j := range jumps {
		out = append(out, "jump "+j)
	}
	return out
}

func TestPartialSyncs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(h *harness)
		want   SyncStats // Full, Duration, VirtualServers, Terminating ignored
		flows  []pt.Flow
	}{
		{
			name:   "nothing changed: nothing touched",
			change: func(h *harness) {},
		},
		{
			name: "endpoint added: one real server per virtual server of that service",
			change: func(h *harness) {
				_, sl := pt.NumberedService(3)
				sl.Endpoints = append(sl.Endpoints, pt.Slice("x", 8080, pt.EP{IP: "10.244.9.9", Node: "node-c"}).Endpoints...)
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			want: SyncStats{DestinationsAdded: 2},
			flows: []pt.Flow{{Name: "both", Source: "10.244.1.9", Dest: "10.96.0.4", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.2.4:8080", "10.244.9.9:8080"}}},
		},
		{
			name: "local endpoint added: its hairpin entry too",
			change: func(h *harness) {
				_, sl := pt.NumberedService(3)
				sl.Endpoints = append(sl.Endpoints, pt.Slice("x", 8080, pt.EP{IP: "10.244.1.7", Node: "node-a"}).Endpoints...)
				h.engine.OnEndpointSliceUpdate(nil, sl)
			},
			want: SyncStats{DestinationsAdded: 2, EntriesAdded: 1},
			flows: []pt.Flow{{Name: "hairpin", Source: "10.244.1.7", Dest: "10.96.0.4", Port: 80, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.2.4:8080", "10.244.1.7:8080"}, WantHairpin: []string{"10.244.1.7:8080"}}},
		},
		{
			name: "new service: its virtual servers, address and set entries",
			change: func(h *harness) {
				s, sl := pt.NumberedService(60)
				h.engine.OnServiceAdd(s)
				h.engine.OnEndpointSliceAdd(sl)
			},
			// CLUSTER-IP, NODE-PORT and IPVS-IPS entries.
			want: SyncStats{ServicesAdded: 2, DestinationsAdded: 2, EntriesAdded: 3, AddressesBound: 1},
			flows: []pt.Flow{{Name: "new", Source: "192.0.2.10", Dest: "10.0.0.1", Port: 30060, Want: pt.Delivered,
				WantEndpoints: []string{"10.244.2.61:8080"}, WantMasquerade: true}},
		},
		{
			name: "service deleted: its virtual servers, address and entries go",
			change: func(h *harness) {
				s, _ := pt.NumberedService(5)
				h.engine.OnServiceDelete(s)
			},
			want: SyncStats{ServicesDeleted: 2, EntriesDeleted: 3, AddressesUnbound: 1},
			flows: []pt.Flow{
				{Name: "gone", Source: "10.244.1.9", Dest: "10.96.0.6", Port: 80, Want: pt.NotHandled},
				{Name: "node port gone", Source: "192.0.2.10", Dest: "10.0.0.1", Port: 30005, Want: pt.NotHandled},
			},
		},
		{
			name: "session affinity turned on: the virtual servers are updated in place",
			change: func(h *harness) {
				s, _ := pt.NumberedService(7)
				h.engine.OnServiceUpdate(nil, pt.Service(s.Name, s.Spec.ClusterIP, pt.NodePort(30007), pt.Affinity(60)))
			},
			want: SyncStats{ServicesUpdated: 2},
		},
		{
			name: "externalTrafficPolicy Local: the shortcut chain is rewritten",
			change: func(h *harness) {
				s, _ := pt.NumberedService(8)
				h.engine.OnServiceUpdate(nil, pt.Service(s.Name, s.Spec.ClusterIP, pt.NodePort(30008), pt.ExternalLocal()))
			},
			// NODE-PORT-LOCAL and EXTERNAL-DROP entries; the node port's
			// only (remote) real server goes.
			want: SyncStats{EntriesAdded: 2, DestinationsDeleted: 1, Restores: 1},
			flows: []pt.Flow{
				{Name: "external dropped", Source: "192.0.2.10", Dest: "10.0.0.1", Port: 30008, Want: pt.Dropped},
				{Name: "pod short-circuited", Source: "10.244.1.9", Dest: "10.0.0.1", Port: 30008, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.9:8080"}},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			pt.AddNumberedServices(h.engine, 20)
			if st := h.sync(); !st.Full {
				t.Fatalf("first sync not full: %+v", st)
			}
			tc.change(h)
			got := h.sync()
			if got.Full {
				t.Fatalf("second sync was full")
			}
			got.Full, got.Duration, got.VirtualServers, got.Terminating = false, 0, 0, 0
			if got != tc.want {
				t.Errorf("partial sync did %+v, want %+v", got, tc.want)
			}
			h.flows(tc.flows...)
			// A full sync over the same state finds nothing to change.
			h.engine.OnNodeAdd(pt.Node("node-a", map[string]string{"x": fmt.Sprint(time.Now().UnixNano())}))
			h.backend.initialized = false
			full := h.sync()
			if !full.Full {
				t.Fatal("forced sync not full")
			}
			full.Full, full.Duration, full.VirtualServers, full.Terminating, full.Restores = false, 0, 0, 0, 0
			if full != (SyncStats{}) {
				t.Errorf("full sync after the partial one changed %+v", full)
			}
		})
	}
}

func TestOwnership(t *testing.T) {
	ctx := context.Background()
	foreign := []*ipvs.Service{
		{Address: netip.MustParseAddr("10.97.0.1"), Protocol: ipvs.ProtocolTCP, Port: 80},    // another address
		{Address: nodeIP, Protocol: ipvs.ProtocolTCP, Port: 31999},                           // node address, no service's port
		{Address: netip.MustParseAddr("10.96.0.2"), Protocol: ipvs.ProtocolUDP, Port: 53},    // a ClusterIP's address, another port
		{Address: netip.MustParseAddr("fd00::10"), Protocol: ipvs.ProtocolTCP, Port: 80},     // the other family
		{Address: netip.MustParseAddr("10.99.0.0"), Protocol: ipvs.ProtocolSCTP, Port: 3868}, // another protocol
	}
	for _, tc := range []struct {
		name    string
		exclude []netip.Prefix
		// stale virtual servers a previous kproxy left: at an address
		// bound to the dummy device, or a node port it recorded.
		wantStaleGone bool
	}{
		{name: "stale virtual servers of kproxy go, foreign ones stay", wantStaleGone: true},
		{name: "exclude CIDRs protect stale ones too", exclude: []netip.Prefix{netip.MustParsePrefix("10.96.9.0/24"), netip.MustParsePrefix("10.0.0.0/24")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := newFakeKernel(t, v1.IPv4Protocol, []netip.Addr{nodeIP})
			for _, s := range foreign {
				if err := k.ipvs.AddService(ctx, s); err != nil {
					t.Fatal(err)
				}
				if err := k.ipvs.AddDestination(ctx, s, &ipvs.Destination{Address: s.Address.Next(), Port: 1, Weight: 3}); err != nil {
					t.Fatal(err)
				}
			}
			// What a previous kproxy left: a ClusterIP virtual server on
			// the dummy device and a recorded node port.
			staleVIP := &ipvs.Service{Address: netip.MustParseAddr("10.96.9.9"), Protocol: ipvs.ProtocolTCP, Port: 80}
			staleNP := &ipvs.Service{Address: nodeIP, Protocol: ipvs.ProtocolTCP, Port: 30999}
			for _, s := range []*ipvs.Service{staleVIP, staleNP} {
				if err := k.ipvs.AddService(ctx, s); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := k.nl.EnsureDummyDevice(ctx, DefaultDummyDevice); err != nil {
				t.Fatal(err)
			}
			if _, err := k.nl.EnsureAddressBound(ctx, staleVIP.Address, DefaultDummyDevice); err != nil {
				t.Fatal(err)
			}
			for _, rec := range []struct {
				set   string
				entry ipset.Entry
			}{
				{setClusterIP, ipset.Entry{IP: staleVIP.Address, Protocol: "tcp", Port: 80}},
				{setNodePort, ipset.Entry{IP: nodeIP, Protocol: "tcp", Port: 30999}},
			} {
				if err := k.sets.EnsureSet(ctx, ipset.Set{Name: rec.set, Type: ipset.HashIPPort, Comment: "x"}); err != nil {
					t.Fatal(err)
				}
				if err := k.sets.AddEntry(ctx, rec.set, rec.entry); err != nil {
					t.Fatal(err)
				}
			}
			foreignBefore := []string{}
			for _, s := range foreign {
				foreignBefore = append(foreignBefore, s.String()+" "+strings.Join(k.dests(t, s), ","))
			}

			h := newHarness(t, k, Options{ExcludeCIDRs: tc.exclude})
			pt.AddNumberedServices(h.engine, 3)
			h.sync()
			checkForeign := func(when string) {
				t.Helper()
				for i, s := range foreign {
					got := k.vs(t, s.Address.String(), s.Protocol, s.Port)
					if got == nil {
						t.Errorf("%s: foreign %s deleted", when, s)
						continue
					}
					if desc := got.String() + " " + strings.Join(k.dests(t, got), ","); desc != foreignBefore[i] {
						t.Errorf("%s: foreign virtual server changed: %s, was %s", when, desc, foreignBefore[i])
					}
				}
			}
			checkForeign("after sync")
			for _, s := range []*ipvs.Service{staleVIP, staleNP} {
				if gone := k.vs(t, s.Address.String(), s.Protocol, s.Port) == nil; gone != tc.wantStaleGone {
					t.Errorf("stale %s gone = %v, want %v", s, gone, tc.wantStaleGone)
				}
			}
			h.flows(pt.Flow{Name: "ours", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.1:8080"}})

			for i := 1; i <= 2; i++ {
				if err := h.backend.Cleanup(ctx); err != nil {
					t.Fatalf("cleanup %d: %v", i, err)
				}
				checkForeign(fmt.Sprintf("after cleanup %d", i))
				if left := k.ours(t); len(left) > 0 {
					t.Errorf("after cleanup %d kproxy's state remains: %v", i, left)
				}
				if got := len(k.ipvs.ServiceStrings()); got != len(foreign)+2*boolInt(!tc.wantStaleGone) {
					t.Errorf("after cleanup %d: virtual servers %v, want only the foreign ones", i, k.ipvs.ServiceStrings())
				}
			}
		})
	}
}

func TestRestartOverExistingState(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(t, v1.IPv4Protocol, []netip.Addr{nodeIP})
	h1 := newHarness(t, k, Options{})
	pt.AddNumberedServices(h1.engine, 5)
	h1.sync()
	// Traffic: a connection on service 0's real server.
	s0 := k.vs(t, "10.96.0.1", ipvs.ProtocolTCP, 80)
	if err := k.ipvs.SetConnections(s0, &ipvs.Destination{Address: netip.MustParseAddr("10.244.2.1"), Port: 8080}, 3, 1); err != nil {
		t.Fatal(err)
	}

	// A new kproxy, while service 4 was deleted.
	h2 := newHarness(t, k, Options{})
	pt.AddNumberedServices(h2.engine, 4)
	st := h2.sync()
	want := SyncStats{Full: true, ServicesDeleted: 2, EntriesDeleted: 3, AddressesUnbound: 1}
	st.Duration, st.VirtualServers, st.Terminating, st.Restores = 0, 0, 0, 0
	if st != want {
		t.Errorf("first sync after restart did %+v, want %+v", st, want)
	}
	ds, err := k.ipvs.Destinations(ctx, s0)
	if err != nil {
		t.Fatal(err)
	}
	if len(ds) != 1 || ds[0].ActiveConnections != 3 {
		t.Errorf("service 0's real server was replaced: %+v", ds)
	}
	h2.flows(
		pt.Flow{Name: "kept", Source: "10.244.1.9", Dest: "10.96.0.1", Port: 80, Want: pt.Delivered, WantEndpoints: []string{"10.244.2.1:8080"}},
		pt.Flow{Name: "deleted", Source: "192.0.2.10", Dest: "10.0.0.1", Port: 30004, Want: pt.NotHandled},
	)
}

func TestGracefulTermination(t *testing.T) {
	ep := func(ip string) pt.EP { return pt.EP{IP: ip, Node: "node-b"} }
	for _, tc := range []struct {
		name     string
		protocol v1.Protocol
		// active, inactive connections of the removed real server.
		active, inactive int
		// then runs after the removal sync; it returns whether the
		// removed real server must still be there after one more sync.
		then func(h *harness) bool
	}{
		{
			name: "TCP real server without connections goes at once", protocol: v1.ProtocolTCP,
			then: func(h *harness) bool { return false },
		},
		{
			name: "TCP real server waits at weight 0 until its connections end", protocol: v1.ProtocolTCP, active: 1, inactive: 2,
			then: func(h *harness) bool {
				h.clock.Step(time.Minute)
				return true
			},
		},
		{
			name: "connections ending lets it go", protocol: v1.ProtocolTCP, active: 1,
			then: func(h *harness) bool {
				setConns(h, v1.ProtocolTCP, 0, 0)
				return false
			},
		},
		{
			name: "the upper bound forces it out", protocol: v1.ProtocolTCP, active: 5,
			then: func(h *harness) bool {
				h.clock.Step(DefaultGracefulTerminationTimeout)
				return false
			},
		},
		{
			name: "SCTP waits like TCP", protocol: v1.ProtocolSCTP, inactive: 1,
			then: func(h *harness) bool { return true },
		},
		{
			name: "UDP real server goes at once, connections or not", protocol: v1.ProtocolUDP, active: 4,
			then: func(h *harness) bool { return false },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			svc := pt.Service("gt", "10.96.0.50", pt.Ports(v1.ServicePort{Name: "p", Port: 80, Protocol: tc.protocol}))
			slice := pt.SliceWithPorts("gt", []discovery.EndpointPort{{Name: strPtr("p"), Port: int32Ptr(8080), Protocol: &tc.protocol}},
				ep("10.244.2.5"), ep("10.244.3.5"))
			h.engine.OnServiceAdd(svc)
			h.engine.OnEndpointSliceAdd(slice)
			h.sync()
			setConns(h, tc.protocol, tc.active, tc.inactive)

			// 10.244.3.5 leaves.
			h.engine.OnEndpointSliceUpdate(slice, pt.SliceWithPorts("gt", slice.Ports, ep("10.244.2.5")))
			h.sync()
			vs := h.k.vs(t, "10.96.0.50", ipvsProtocols[tc.protocol], 80)
			waiting := tc.protocol != v1.ProtocolUDP && tc.active+tc.inactive > 0
			wantDests := []string{"10.244.2.5:8080 weight 1"}
			if waiting {
				wantDests = append(wantDests, "10.244.3.5:8080 weight 0")
			}
			if got := h.k.dests(t, vs); !slices.Equal(got, wantDests) {
				t.Fatalf("after removal: real servers %v, want %v", got, wantDests)
			}
			// New connections go to the remaining one only.
			h.flows(pt.Flow{Name: "new connection", Protocol: tc.protocol, Source: "10.244.1.9", Dest: "10.96.0.50", Port: 80,
				Want: pt.Delivered, WantEndpoints: []string{"10.244.2.5:8080"}})

			stays := tc.then(h)
			h.sync()
			wantDests = []string{"10.244.2.5:8080 weight 1"}
			if stays {
				wantDests = append(wantDests, "10.244.3.5:8080 weight 0")
			}
			if got := h.k.dests(t, vs); !slices.Equal(got, wantDests) {
				t.Errorf("one sync later: real servers %v, want %v", got, wantDests)
			}
			if n := h.backend.PendingTerminations(); (n > 0) != stays {
				t.Errorf("PendingTerminations() = %d, want pending %v", n, stays)
			}
		})
	}
}

func TestTerminatingRealServerComesBack(t *testing.T) {
	h := newHarness(t, nil, Options{})
	s, sl := pt.NumberedService(0)
	sl.Endpoints = append(sl.Endpoints, pt.Slice("x", 8080, pt.EP{IP: "10.244.9.9", Node: "node-c"}).Endpoints...)
	h.engine.OnServiceAdd(s)
	h.engine.OnEndpointSliceAdd(sl)
	h.sync()
	vs := h.k.vs(t, "10.96.0.1", ipvs.ProtocolTCP, 80)
	if err := h.k.ipvs.SetConnections(vs, &ipvs.Destination{Address: netip.MustParseAddr("10.244.9.9"), Port: 8080}, 1, 0); err != nil {
		t.Fatal(err)
	}
	_, one := pt.NumberedService(0)
	h.engine.OnEndpointSliceUpdate(sl, one)
	h.sync()
	if got := h.k.dests(t, vs); !slices.Contains(got, "10.244.9.9:8080 weight 0") {
		t.Fatalf("removed real server not quiesced: %v", got)
	}
	h.engine.OnEndpointSliceUpdate(one, sl)
	st := h.sync()
	if got := h.k.dests(t, vs); !slices.Equal(got, []string{"10.244.2.1:8080 weight 1", "10.244.9.9:8080 weight 1"}) {
		t.Errorf("real server back: %v", got)
	}
	// The ClusterIP's waiting real server gets weight 1 again; the node
	// port's had no connections, went at once, and comes back anew.
	if st.DestinationsUpdated != 1 || st.DestinationsAdded != 1 || h.backend.PendingTerminations() != 0 {
		t.Errorf("coming back: %d updated, %d added (want 1, 1), %d pending", st.DestinationsUpdated, st.DestinationsAdded, h.backend.PendingTerminations())
	}
}

// setConns sets the connection counters of the gt service's 10.244.3.5.
func setConns(h *harness, proto v1.Protocol, active, inactive int) {
	h.t.Helper()
	vs := h.k.vs(h.t, "10.96.0.50", ipvsProtocols[proto], 80)
	if err := h.k.ipvs.SetConnections(vs, &ipvs.Destination{Address: netip.MustParseAddr("10.244.3.5"), Port: 8080}, active, inactive); err != nil {
		h.t.Fatal(err)
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func strPtr(s string) *string { return &s }
func int32Ptr(i int32) *int32 { return &i }

func TestKernelSettings(t *testing.T) {
	for _, tc := range []struct {
		name        string
		opts        Options
		readOnly    bool
		wantSysctls map[string]string
		wantTimeout ipvs.Timeouts
	}{
		{
			name: "defaults",
			wantSysctls: map[string]string{"net.ipv4.vs.conntrack": "1", "net.ipv4.ip_forward": "1",
				"net.ipv4.vs.expire_nodest_conn": "1", "net.ipv4.vs.expire_quiescent_template": "1"},
			wantTimeout: ipvs.DefaultTimeouts,
		},
		{
			name: "strict ARP and timeouts",
			opts: Options{StrictARP: true, Timeouts: ipvs.Timeouts{TCP: time.Hour, UDP: 10 * time.Second}},
			wantSysctls: map[string]string{"net.ipv4.vs.conntrack": "1", "net.ipv4.ip_forward": "1",
				"net.ipv4.vs.expire_nodest_conn": "1", "net.ipv4.vs.expire_quiescent_template": "1",
				"net.ipv4.conf.all.arp_ignore": "1", "net.ipv4.conf.all.arp_announce": "2"},
			wantTimeout: ipvs.Timeouts{TCP: time.Hour, TCPFin: ipvs.DefaultTimeouts.TCPFin, UDP: 10 * time.Second},
		},
		{
			name: "read-only /proc/sys is tolerated", readOnly: true,
			wantSysctls: map[string]string{}, wantTimeout: ipvs.DefaultTimeouts,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := newFakeKernel(t, v1.IPv4Protocol, []netip.Addr{nodeIP})
			k.sysctl.SetReadOnly(tc.readOnly)
			h := newHarness(t, k, tc.opts)
			pt.AddNumberedServices(h.engine, 1)
			h.sync()
			if got := k.sysctl.Values(); fmt.Sprint(got) != fmt.Sprint(tc.wantSysctls) {
				t.Errorf("sysctls %v, want %v", got, tc.wantSysctls)
			}
			got, err := k.ipvs.GetTimeouts(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.wantTimeout {
				t.Errorf("timeouts %+v, want %+v", got, tc.wantTimeout)
			}
		})
	}
}

func TestSchedulers(t *testing.T) {
	for _, tc := range []struct {
		name      string
		scheduler string
		available []string
		affinity  bool
		wantErr   error
		want      string
	}{
		{name: "default round robin", want: "TCP 10.96.0.1:80 rr"},
		{name: "source hashing", scheduler: "sh", want: "TCP 10.96.0.1:80 sh"},
		{name: "maglev with persistence", scheduler: "mh", affinity: true, want: "TCP 10.96.0.1:80 mh persistent 10800"},
		{name: "scheduler the kernel lacks", scheduler: "wlc", available: []string{"rr"}, wantErr: ipvs.ErrSchedulerUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := newFakeKernel(t, v1.IPv4Protocol, []netip.Addr{nodeIP})
			if tc.available != nil {
				k.ipvs.SetSchedulers(tc.available...)
			}
			h := newHarness(t, k, Options{Scheduler: tc.scheduler})
			var opts []pt.SvcOpt
			if tc.affinity {
				opts = append(opts, pt.Affinity(0))
			}
			h.engine.OnServiceAdd(pt.Service("s", "10.96.0.1", opts...))
			err := h.engine.SyncRules(context.Background())
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("sync error %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := k.ipvs.ServiceStrings(); !slices.Equal(got, []string{tc.want}) {
				t.Errorf("virtual servers %v, want [%s]", got, tc.want)
			}
		})
	}
}

func TestCleanupRemovesBothModesChains(t *testing.T) {
	ctx := context.Background()
	k := newFakeKernel(t, v1.IPv4Protocol, []netip.Addr{nodeIP})
	// What iptables mode leaves.
	if err := k.ipt.Restore(ctx, []byte("*nat\n:KPROXY-SERVICES - [0:0]\n:KPROXY-SVC-ABC - [0:0]\n"+
		"-A PREROUTING -m comment --comment \"kproxy service portals\" -j KPROXY-SERVICES\n"+
		"-A KPROXY-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 80 -j KPROXY-SVC-ABC\n"+
		"-A KPROXY-SVC-ABC -p tcp -j DNAT --to-destination 10.244.1.1:80\n"+
		"-A POSTROUTING -j MASQUERADE\nCOMMIT\n")); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, k, Options{})
	pt.AddNumberedServices(h.engine, 2)
	h.sync()
	if err := h.backend.Cleanup(ctx); err != nil {
		t.Fatal(err)
	}
	if left := k.ours(t); len(left) > 0 {
		t.Errorf("kproxy's state remains: %v", left)
	}
	if got := k.ipt.Rules(ipt.TableNAT, ipt.ChainPostrouting); !slices.Equal(got, []string{"-j MASQUERADE"}) {
		t.Errorf("foreign POSTROUTING rules changed: %v", got)
	}
}

func TestNewValidates(t *testing.T) {
	k := newFakeKernel(t, v1.IPv4Protocol, nil)
	full := Options{IPVS: k.ipvs, Netlink: k.nl, IPSet: k.sets, IPTables: k.ipt, Sysctl: k.sysctl}
	bit := 32
	for _, tc := range []struct {
		name   string
		modify func(o *Options)
	}{
		{"no IPVS", func(o *Options) { o.IPVS = nil }},
		{"no netlink", func(o *Options) { o.Netlink = nil }},
		{"no ipset", func(o *Options) { o.IPSet = nil }},
		{"no iptables", func(o *Options) { o.IPTables = nil }},
		{"no sysctl", func(o *Options) { o.Sysctl = nil }},
		{"bad scheduler name", func(o *Options) { o.Scheduler = "Round-Robin" }},
		{"mark bit out of range", func(o *Options) { o.MasqueradeBit = &bit }},
		{"fractional timeout", func(o *Options) { o.Timeouts.TCP = 1500 * time.Millisecond }},
		{"negative timeout", func(o *Options) { o.Timeouts.UDP = -time.Second }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := full
			tc.modify(&o)
			if _, err := New(o); err == nil {
				t.Fatal("New succeeded, want an error")
			}
		})
	}
	if _, err := New(full); err != nil {
		t.Errorf("New with every interface: %v", err)
	}
}
