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

	"github.com/kproxy/kproxy/pkg/ipset"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

var errRefused = errors.New("invalid argument (refused by the test kernel)")

const setAsidePod = "10.244.1.9" // a pod on node-a

// flowTo is a pod's flow to dest:port, delivered to eps (none: not
// handled by kproxy); masqueraded unless dest is a cluster IP (10.96/16).
func flowTo(name, dest string, port int, eps ...string) pt.Flow {
	f := pt.Flow{Name: name, Source: setAsidePod, Dest: dest, Port: port, Want: pt.NotHandled}
	if len(eps) > 0 {
		f.Want, f.WantEndpoints = pt.Delivered, eps
		f.WantMasquerade = !strings.HasPrefix(dest, "10.96.")
	}
	return f
}

// kernelMentions lists what of the fake kernel mentions addr: virtual
// servers, bound addresses, set entries.
func (k *fakeKernel) mentions(t testing.TB, addr string) []string {
	t.Helper()
	ctx := context.Background()
	var out []string
	for _, s := range k.ipvs.ServiceStrings() {
		if strings.Contains(s, " "+addr+":") {
			out = append(out, "virtual server "+s)
		}
	}
	if bound, err := k.nl.ListBoundAddresses(ctx, DefaultDummyDevice); err == nil && slices.Contains(bound, netip.MustParseAddr(addr)) {
		out = append(out, "bound address "+addr)
	}
	sets, _ := k.sets.ListSets(ctx)
	for _, set := range sets {
		entries, _ := k.sets.Entries(ctx, set)
		for _, e := range entries {
			if strings.Contains(e.String()+",", addr+",") {
				out = append(out, "entry "+set+" "+e.String())
			}
		}
	}
	return out
}

func (k *fakeKernel) destStrings(t testing.TB, addr string, port uint16) []string {
	t.Helper()
	vs := k.vs(t, addr, ipvs.ProtocolTCP, port)
	if vs == nil {
		t.Fatalf("virtual server %s:%d missing", addr, port)
	}
	return k.dests(t, vs)
}

// checkSetAside checks the last sync's set-aside report.
func (h *harness) checkSetAside(t *testing.T, want ...proxy.ServicePortName) {
	t.Helper()
	got := h.last.Backend.SetAside
	if h.last.Err != nil {
		t.Fatalf("sync failed: %v", h.last.Err)
	}
	var names []string
	for n, err := range got {
		names = append(names, n.String())
		if !errors.Is(err, errRefused) {
			t.Errorf("set aside %s with %v, want the kernel's refusal", n, err)
		}
	}
	var wantNames []string
	for _, n := range want {
		wantNames = append(wantNames, n.String())
	}
	slices.Sort(names)
	slices.Sort(wantNames)
	if !slices.Equal(names, wantNames) {
		t.Errorf("set aside %q, want %q", names, wantNames)
	}
	if st := h.backend.LastSync(); st.SetAside != len(want) {
		t.Errorf("SyncStats.SetAside = %d, want %d", st.SetAside, len(want))
	}
}

// TestSetAside makes the fake kernel refuse one object of one service
// port, in a sync that also changes another service: that port is set
// aside with its last good state (or nothing) and everything else is
// programmed; a later partial sync of another service leaves it alone; a
// full sync retries it; once the kernel accepts it, its next change is
// programmed.
func TestSetAside(t *testing.T) {
	bad := func(opts ...pt.SvcOpt) (*v1.Service, proxy.ServicePortName) {
		s := pt.Service("bad", "10.96.1.1", append([]pt.SvcOpt{pt.NodePort(30100)}, opts...)...)
		return s, pt.ServicePortNameOf(s, "p")
	}
	badEPs := func(ips ...string) func(h *harness) {
		return func(h *harness) {
			var eps []pt.EP
			for _, ip := range ips {
				eps = append(eps, pt.EP{IP: ip, Node: "node-b"})
			}
			h.engine.OnEndpointSliceUpdate(nil, pt.Slice("bad", 8080, eps...))
		}
	}
	newBad := func(opts ...pt.SvcOpt) func(h *harness) {
		return func(h *harness) {
			s, _ := bad(opts...)
			h.engine.OnServiceAdd(s)
			badEPs("10.244.5.1")(h)
		}
	}
	_, badPort := bad()
	numbered := func(i int) proxy.ServicePortName {
		s, _ := pt.NumberedService(i)
		return pt.ServicePortNameOf(s, "p")
	}
	numberedEPs := func(i int, ips ...string) func(h *harness) {
		return func(h *harness) {
			s, _ := pt.NumberedService(i)
			var eps []pt.EP
			for _, ip := range ips {
				eps = append(eps, pt.EP{IP: ip, Node: "node-b"})
			}
			h.engine.OnEndpointSliceUpdate(nil, pt.Slice(s.Name, 8080, eps...))
		}
	}
	nothingOf := func(addr string) func(t *testing.T, h *harness) {
		return func(t *testing.T, h *harness) {
			t.Helper()
			if got := h.k.mentions(t, addr); len(got) > 0 {
				t.Errorf("the kernel has state of the set-aside service: %q", got)
			}
		}
	}
	for _, tc := range []struct {
		name   string
		refuse func(k *fakeKernel)
		// poison is the change the kernel refuses part of; port the
		// service port it sets aside.
		poison func(h *harness)
		port   proxy.ServicePortName
		// kept are the set-aside port's flows while it is set aside (its
		// last good state); check looks at the kernel then.
		kept  []pt.Flow
		check func(t *testing.T, h *harness)
		// retry changes the port again once the kernel accepts it;
		// fixed are its flows then.
		retry func(h *harness)
		fixed []pt.Flow
	}{
		{
			name: "new service: its cluster IP virtual server refused",
			refuse: func(k *fakeKernel) {
				k.ipvs.SetRefuse(func(op ipvs.Op, s *ipvs.Service, _ *ipvs.Destination) error {
					return refuseIf(op == ipvs.OpAddService && s.Address.String() == "10.96.1.1", errRefused)
				})
			},
			poison: newBad(), port: badPort,
			kept:  []pt.Flow{flowTo("cluster IP", "10.96.1.1", 80), flowTo("node port (created, then removed)", "10.0.0.1", 30100)},
			check: nothingOf("10.96.1.1"),
			retry: badEPs("10.244.5.2"),
			fixed: []pt.Flow{flowTo("cluster IP", "10.96.1.1", 80, "10.244.5.2:8080"), flowTo("node port", "10.0.0.1", 30100, "10.244.5.2:8080")},
		},
		{
			name: "new service: its external IP's set entry refused",
			refuse: func(k *fakeKernel) {
				k.sets.SetRefuse(func(op ipset.Op, set string, e ipset.Entry) error {
					return refuseIf(op == ipset.OpAdd && set == setExternalIP && e.IP.String() == "203.0.113.50", errRefused)
				})
			},
			poison: newBad(pt.ExternalIPs("203.0.113.50")), port: badPort,
			kept: []pt.Flow{flowTo("cluster IP", "10.96.1.1", 80), flowTo("external IP", "203.0.113.50", 80)},
			check: func(t *testing.T, h *harness) {
				nothingOf("10.96.1.1")(t, h)
				nothingOf("203.0.113.50")(t, h)
			},
			retry: badEPs("10.244.5.2"),
			fixed: []pt.Flow{flowTo("cluster IP", "10.96.1.1", 80, "10.244.5.2:8080"), flowTo("external IP", "203.0.113.50", 80, "10.244.5.2:8080")},
		},
		{
			name: "new service: binding its cluster IP refused",
			refuse: func(k *fakeKernel) {
				k.nl.SetRefuse(func(op netlink.Op, _ string, a netip.Addr) error {
					return refuseIf(op == netlink.OpBindAddress && a.String() == "10.96.1.1", errRefused)
				})
			},
			poison: newBad(), port: badPort,
			kept:  []pt.Flow{flowTo("cluster IP", "10.96.1.1", 80)},
			check: nothingOf("10.96.1.1"),
			retry: badEPs("10.244.5.2"),
			fixed: []pt.Flow{flowTo("cluster IP", "10.96.1.1", 80, "10.244.5.2:8080")},
		},
		{
			name: "existing service gains an endpoint the cluster IP refuses: the node port loses it again",
			refuse: func(k *fakeKernel) {
				k.ipvs.SetRefuse(func(op ipvs.Op, s *ipvs.Service, d *ipvs.Destination) error {
					return refuseIf(op == ipvs.OpAddDestination && s.Address.String() == "10.96.0.6" && d.Address.String() == "10.244.9.9", errRefused)
				})
			},
			poison: numberedEPs(5, "10.244.2.6", "10.244.9.9"), port: numbered(5),
			kept: []pt.Flow{flowTo("cluster IP", "10.96.0.6", 80, "10.244.2.6:8080"), flowTo("node port", "10.0.0.1", 30005, "10.244.2.6:8080")},
			check: func(t *testing.T, h *harness) {
				if got := h.k.destStrings(t, "10.0.0.1", 30005); !slices.Equal(got, []string{"10.244.2.6:8080 weight 1"}) {
					t.Errorf("node port real servers %q, want the old one only", got)
				}
			},
			retry: numberedEPs(5, "10.244.2.6", "10.244.9.8"),
			fixed: []pt.Flow{flowTo("cluster IP", "10.96.0.6", 80, "10.244.2.6:8080", "10.244.9.8:8080")},
		},
		{
			name: "existing service's endpoint replaced by one the cluster IP refuses: the old one stays, not even quiesced",
			refuse: func(k *fakeKernel) {
				// The old real server has connections: a sync that
				// kept the new plan would quiesce it.
				vs := k.vs(t, "10.0.0.1", ipvs.ProtocolTCP, 30006)
				if err := k.ipvs.SetConnections(vs, &ipvs.Destination{Address: netip.MustParseAddr("10.244.2.7"), Port: 8080}, 2, 0); err != nil {
					t.Fatal(err)
				}
				k.ipvs.SetRefuse(func(op ipvs.Op, s *ipvs.Service, d *ipvs.Destination) error {
					return refuseIf(op == ipvs.OpAddDestination && s.Address.String() == "10.96.0.7", errRefused)
				})
			},
			poison: numberedEPs(6, "10.244.9.7"), port: numbered(6),
			kept: []pt.Flow{flowTo("cluster IP", "10.96.0.7", 80, "10.244.2.7:8080"), flowTo("node port", "10.0.0.1", 30006, "10.244.2.7:8080")},
			check: func(t *testing.T, h *harness) {
				for _, port := range []uint16{30006} {
					if got := h.k.destStrings(t, "10.0.0.1", port); !slices.Equal(got, []string{"10.244.2.7:8080 weight 1"}) {
						t.Errorf("node port real servers %q, want the old one at weight 1", got)
					}
				}
				if got := h.k.destStrings(t, "10.96.0.7", 80); !slices.Equal(got, []string{"10.244.2.7:8080 weight 1"}) {
					t.Errorf("cluster IP real servers %q, want the old one at weight 1", got)
				}
				if n := h.backend.PendingTerminations(); n != 0 {
					t.Errorf("%d real servers waiting to terminate, want none", n)
				}
			},
			retry: numberedEPs(6, "10.244.9.6"),
			fixed: []pt.Flow{flowTo("cluster IP", "10.96.0.7", 80, "10.244.9.6:8080")},
		},
		{
			name: "node port moved to one the kernel refuses: the old node port stays",
			refuse: func(k *fakeKernel) {
				k.ipvs.SetRefuse(func(op ipvs.Op, s *ipvs.Service, _ *ipvs.Destination) error {
					return refuseIf(op == ipvs.OpAddService && s.Port == 30105, errRefused)
				})
			},
			poison: func(h *harness) {
				s, _ := pt.NumberedService(5)
				h.engine.OnServiceUpdate(nil, pt.Service(s.Name, s.Spec.ClusterIP, pt.NodePort(30105)))
			},
			port: numbered(5),
			kept: []pt.Flow{flowTo("old node port", "10.0.0.1", 30005, "10.244.2.6:8080"), flowTo("new node port", "10.0.0.1", 30105)},
			check: func(t *testing.T, h *harness) {
				if h.k.vs(t, "10.0.0.1", ipvs.ProtocolTCP, 30105) != nil {
					t.Error("the refused node port's virtual server exists")
				}
				if !h.k.sets.Contains(setNodePort, ipset.Entry{IP: nodeIP, Protocol: "tcp", Port: 30005}) {
					t.Error("the old node port's set entry is gone")
				}
			},
			retry: func(h *harness) {
				s, _ := pt.NumberedService(5)
				h.engine.OnServiceUpdate(nil, pt.Service(s.Name, s.Spec.ClusterIP, pt.NodePort(30115)))
			},
			fixed: []pt.Flow{flowTo("old node port", "10.0.0.1", 30005), flowTo("newer node port", "10.0.0.1", 30115, "10.244.2.6:8080")},
		},
		{
			name: "session affinity refused (virtual server update): the settings stay as they were",
			refuse: func(k *fakeKernel) {
				k.ipvs.SetRefuse(func(op ipvs.Op, s *ipvs.Service, _ *ipvs.Destination) error {
					return refuseIf(op == ipvs.OpUpdateService && s.Address.String() == "10.96.0.8", errRefused)
				})
			},
			poison: func(h *harness) {
				s, _ := pt.NumberedService(7)
				h.engine.OnServiceUpdate(nil, pt.Service(s.Name, s.Spec.ClusterIP, pt.NodePort(30007), pt.Affinity(60)))
			},
			port: numbered(7),
			kept: []pt.Flow{flowTo("cluster IP", "10.96.0.8", 80, "10.244.2.8:8080")},
			check: func(t *testing.T, h *harness) {
				for _, want := range []string{"TCP 10.0.0.1:30007 rr", "TCP 10.96.0.8:80 rr"} {
					if !slices.Contains(h.k.ipvs.ServiceStrings(), want) {
						t.Errorf("virtual servers %q lack %q", h.k.ipvs.ServiceStrings(), want)
					}
				}
			},
			retry: func(h *harness) {
				s, _ := pt.NumberedService(7)
				h.engine.OnServiceUpdate(nil, pt.Service(s.Name, s.Spec.ClusterIP, pt.NodePort(30007), pt.Affinity(90)))
			},
			fixed: []pt.Flow{flowTo("cluster IP", "10.96.0.8", 80, "10.244.2.8:8080")},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			pt.AddNumberedServices(h.engine, 10)
			h.sync()
			h.checkSetAside(t)
			otherFlows := []pt.Flow{flowTo("other service changed in the same sync", "10.96.0.4", 80, "10.244.7.7:8080")}
			h.runSteps(t, []syncStep{
				{
					name: "refused, with another service's change",
					change: func(h *harness) {
						tc.refuse(h.k)
						tc.poison(h)
						numberedEPs(3, "10.244.7.7")(h)
					},
					check: func(t *testing.T, h *harness) {
						h.checkSetAside(t, tc.port)
						tc.check(t, h)
					},
					flows: append(slices.Clone(tc.kept), otherFlows...),
				},
				{
					name:   "a partial sync of another service leaves it alone",
					change: numberedEPs(2, "10.244.7.8"),
					check: func(t *testing.T, h *harness) {
						h.checkSetAside(t)
						tc.check(t, h)
					},
					flows: append(slices.Clone(tc.kept), flowTo("other service", "10.96.0.3", 80, "10.244.7.8:8080")),
				},
				{
					name:   "a full sync retries it: still refused",
					change: func(h *harness) { h.backend.initialized = false },
					full:   true,
					check: func(t *testing.T, h *harness) {
						h.checkSetAside(t, tc.port)
						tc.check(t, h)
					},
					flows: append(slices.Clone(tc.kept), otherFlows...),
				},
				{
					name: "accepted again: its next change is programmed",
					change: func(h *harness) {
						h.k.ipvs.SetRefuse(nil)
						h.k.sets.SetRefuse(nil)
						h.k.nl.SetRefuse(nil)
						tc.retry(h)
					},
					check: func(t *testing.T, h *harness) { h.checkSetAside(t) },
					flows: append(slices.Clone(tc.fixed), otherFlows...),
				},
				{
					name:   "a full sync then changes nothing",
					change: func(h *harness) { h.backend.initialized = false },
					full:   true,
					check: func(t *testing.T, h *harness) {
						st := h.backend.LastSync()
						st.Full, st.Duration, st.VirtualServers, st.Terminating, st.Restores = false, 0, 0, 0, 0
						if st != (SyncStats{}) {
							t.Errorf("full sync changed %+v", st)
						}
					},
				},
			})
		})
	}
}

// TestSetAsideRules makes the kernel refuse the iptables rules of one of
// three new externalTrafficPolicy=Local services (an SCTP match module
// missing): the restore's refusal is narrowed down to that service port,
// which is set aside, and the other two get their short circuit.
func TestSetAsideRules(t *testing.T) {
	local := func(name, ip string, nodePort int32, proto v1.Protocol) *v1.Service {
		return pt.Service(name, ip, pt.Ports(v1.ServicePort{Name: "p", Port: 80, Protocol: proto, NodePort: nodePort}),
			pt.NodePort(nodePort), pt.ExternalLocal())
	}
	svcs := []*v1.Service{
		local("loc-a", "10.96.2.1", 30201, v1.ProtocolTCP),
		local("loc-b", "10.96.2.2", 30202, v1.ProtocolSCTP),
		local("loc-c", "10.96.2.3", 30203, v1.ProtocolTCP),
		local("loc-d", "10.96.2.4", 30204, v1.ProtocolTCP),
	}
	add := func(h *harness) {
		for i, s := range svcs {
			proto := s.Spec.Ports[0].Protocol
			h.engine.OnServiceAdd(s)
			h.engine.OnEndpointSliceAdd(pt.SliceWithPorts(s.Name, []discovery.EndpointPort{{Name: strPtr("p"), Port: int32Ptr(8080), Protocol: &proto}},
				pt.EP{IP: fmt.Sprintf("10.244.6.%d", i+1), Node: "node-b"}))
		}
	}
	refuseSCTP := func(h *harness) {
		h.k.refuseRestore = func(data string) error {
			if strings.Contains(data, "-m sctp") {
				return fmt.Errorf("line 7: Couldn't load match `sctp': %w", errRefused)
			}
			return nil
		}
	}
	badPort := pt.ServicePortNameOf(svcs[1], "p")
	// A pod's connection to a Local node port is short-circuited to the
	// cluster IP, not masqueraded.
	short := func(name string, port int, ep string) pt.Flow {
		f := flowTo(name, "10.0.0.1", port, ep)
		f.WantMasquerade = false
		return f
	}
	flows := []pt.Flow{
		short("pod to a Local node port: short circuit", 30201, "10.244.6.1:8080"),
		short("another one", 30203, "10.244.6.3:8080"),
		short("and another", 30204, "10.244.6.4:8080"),
		{Name: "the refused one: nothing", Protocol: v1.ProtocolSCTP, Source: setAsidePod, Dest: "10.0.0.1", Port: 30202, Want: pt.NotHandled},
		flowTo("other service changed in the same sync", "10.96.0.4", 80, "10.244.7.7:8080"),
	}
	h := newHarness(t, nil, Options{})
	pt.AddNumberedServices(h.engine, 5)
	h.sync()
	h.runSteps(t, []syncStep{
		{
			name: "four new Local services, one refused",
			change: func(h *harness) {
				refuseSCTP(h)
				add(h)
				_, sl := pt.NumberedService(3)
				h.engine.OnEndpointSliceUpdate(nil, pt.Slice(sl.Labels[discovery.LabelServiceName], 8080, pt.EP{IP: "10.244.7.7", Node: "node-b"}))
			},
			check: func(t *testing.T, h *harness) {
				h.checkSetAside(t, badPort)
				// The refused restore, one with every new port's rules
				// left out, then halves, then the final one.
				if n := h.backend.LastSync().Restores; n < 4 {
					t.Errorf("%d restores, want the refusal narrowed down by several", n)
				}
				if got := h.k.mentions(t, "10.96.2.2"); len(got) > 0 {
					t.Errorf("the kernel has state of the set-aside service: %q", got)
				}
			},
			flows: flows,
		},
		{
			name:   "a full sync retries it alone",
			change: func(h *harness) { h.backend.initialized = false },
			full:   true,
			check:  func(t *testing.T, h *harness) { h.checkSetAside(t, badPort) },
			flows:  flows,
		},
		{
			name: "the kernel gets SCTP, the service changes: programmed",
			change: func(h *harness) {
				h.k.refuseRestore = nil
				proto := v1.ProtocolSCTP
				h.engine.OnEndpointSliceUpdate(nil, pt.SliceWithPorts("loc-b", []discovery.EndpointPort{{Name: strPtr("p"), Port: int32Ptr(8080), Protocol: &proto}},
					pt.EP{IP: "10.244.6.9", Node: "node-b"}))
			},
			check: func(t *testing.T, h *harness) { h.checkSetAside(t) },
			flows: []pt.Flow{{Name: "the refused one", Protocol: v1.ProtocolSCTP, Source: setAsidePod, Dest: "10.0.0.1", Port: 30202,
				Want: pt.Delivered, WantEndpoints: []string{"10.244.6.9:8080"}}},
		},
	})
}

// TestNodeWideFailures checks that what is not one service port's fails
// the sync (the next one is full) instead of setting every port aside.
func TestNodeWideFailures(t *testing.T) {
	for _, tc := range []struct {
		name   string
		refuse func(k *fakeKernel)
		// partial: refused in a partial sync adding a Local service,
		// else in the first (full) sync.
		partial bool
	}{
		{
			name:   "every restore refused",
			refuse: func(k *fakeKernel) { k.refuseRestore = func(string) error { return errRefused } },
		},
		{
			name:    "every restore refused, in a partial sync that changes a service's rules",
			refuse:  func(k *fakeKernel) { k.refuseRestore = func(string) error { return errRefused } },
			partial: true,
		},
		{
			name: "the dummy device refused",
			refuse: func(k *fakeKernel) {
				k.nl.SetRefuse(func(op netlink.Op, _ string, _ netip.Addr) error {
					return refuseIf(op == netlink.OpCreateDevice, errRefused)
				})
			},
		},
		{
			name: "the canary entry refused",
			refuse: func(k *fakeKernel) {
				k.sets.SetRefuse(func(op ipset.Op, set string, _ ipset.Entry) error {
					return refuseIf(op == ipset.OpAdd && set == setCanary, errRefused)
				})
			},
		},
		{
			name: "a set missing (destroyed during the sync)",
			refuse: func(k *fakeKernel) {
				k.sets.SetRefuse(func(op ipset.Op, set string, _ ipset.Entry) error {
					return refuseIf(op == ipset.OpAdd && set == setClusterIP, ipset.ErrNotExist)
				})
			},
			partial: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			pt.AddNumberedServices(h.engine, 3)
			if tc.partial {
				h.sync()
				h.engine.OnServiceAdd(pt.Service("loc", "10.96.3.1", pt.NodePort(30300), pt.ExternalLocal()))
				h.engine.OnEndpointSliceAdd(pt.Slice("loc", 8080, pt.EP{IP: "10.244.6.1", Node: "node-b"}))
			}
			tc.refuse(h.k)
			if err := h.engine.SyncRules(context.Background()); err == nil {
				t.Fatalf("sync succeeded (set aside %v), want it to fail", h.last.Backend.SetAside)
			}
			h.k.refuseRestore = nil
			h.k.ipvs.SetRefuse(nil)
			h.k.sets.SetRefuse(nil)
			h.k.nl.SetRefuse(nil)
			if st := h.sync(); !st.Full {
				t.Error("the sync after a failed one is not full")
			}
			h.checkSetAside(t)
			h.flows(flowTo("service", "10.96.0.1", 80, "10.244.2.1:8080"))
		})
	}
}

// refuseIf returns err when cond holds.
func refuseIf(cond bool, err error) error {
	if cond {
		return err
	}
	return nil
}

// TestFailedAdditionKeepsOldRealServers: when the kernel refuses a virtual
// server's new real server, or the call adding it times out, the real
// server it replaces (which still has connections) keeps weight 1: the
// virtual server is never left with none to send a new connection to
// (found by TestRealKernelHungCall: the old one was quiesced first).
func TestFailedAdditionKeepsOldRealServers(t *testing.T) {
	for _, tc := range []struct {
		name     string
		err      error
		setAside bool
	}{
		{name: "refused", err: errRefused, setAside: true},
		{name: "timed out", err: context.DeadlineExceeded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			h := newHarness(t, nil, Options{})
			h.engine.OnServiceAdd(pt.Service("svc", "10.96.0.1"))
			h.engine.OnEndpointSliceAdd(pt.Slice("svc", 8080, pt.EP{IP: "10.244.2.1", Node: "node-b"}))
			h.sync()
			vs := h.k.vs(t, "10.96.0.1", ipvs.ProtocolTCP, 80)
			if err := h.k.ipvs.SetConnections(vs, &ipvs.Destination{Address: netip.MustParseAddr("10.244.2.1"), Port: 8080}, 1, 0); err != nil {
				t.Fatal(err)
			}
			newEP := netip.MustParseAddr("10.244.2.2")
			h.k.ipvs.SetRefuse(func(op ipvs.Op, _ *ipvs.Service, dst *ipvs.Destination) error {
				return refuseIf(op == ipvs.OpAddDestination && dst.Address == newEP, tc.err)
			})
			h.engine.OnEndpointSliceUpdate(nil, pt.Slice("svc", 8080, pt.EP{IP: newEP.String(), Node: "node-b"}))
			err := h.engine.SyncRules(ctx)
			if tc.setAside {
				h.checkSetAside(t, pt.ServicePortNameOf(pt.Service("svc", "10.96.0.1"), "p"))
			} else if !errors.Is(err, tc.err) {
				t.Errorf("sync error %v, want %v", err, tc.err)
			}
			if got := h.k.dests(t, vs); !slices.Equal(got, []string{"10.244.2.1:8080 weight 1"}) {
				t.Errorf("real servers after the failed addition: %v, want the old one at weight 1", got)
			}
			h.k.ipvs.SetRefuse(nil)
			h.clock.Step(time.Hour) // a full sync retries a port set aside
			h.sync()
			if got := h.k.dests(t, h.k.vs(t, "10.96.0.1", ipvs.ProtocolTCP, 80)); !slices.Equal(got, []string{"10.244.2.1:8080 weight 0", "10.244.2.2:8080 weight 1"}) {
				t.Errorf("real servers once accepted: %v, want the old one quiesced and the new one", got)
			}
		})
	}
}
