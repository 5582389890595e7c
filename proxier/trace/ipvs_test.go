package trace

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier"
	ipvsbackend "github.com/kproxy/kproxy/proxier/ipvs"
	"github.com/kproxy/kproxy/proxier/ipvs/ipvstest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// fakeIPVSNode is one node's IPVS-mode kernel for one family, in fakes.
type fakeIPVSNode struct {
	ipvs *ipvs.Fake
	nl   *netlink.Fake
	sets *ipset.Fake
	ipt  *iptablestest.Fake
}

func newFakeIPVSNode(t testing.TB, env pt.Env) (*fakeIPVSNode, *ipvsbackend.Backend) {
	t.Helper()
	n := &fakeIPVSNode{ipvs: ipvs.NewFake(), nl: netlink.NewFake(), sets: ipset.NewFake(), ipt: iptablestest.NewFake(iptProtocol(env.Family))}
	if err := n.nl.AddDevice("lo", netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()); err != nil {
		t.Fatal(err)
	}
	if err := n.nl.AddDevice("eth0", env.NodeIPs...); err != nil {
		t.Fatal(err)
	}
	b, err := ipvsbackend.New(ipvsbackend.Options{IPVS: n.ipvs, Netlink: n.nl, IPSet: n.sets, IPTables: n.ipt,
		Sysctl: ipvsbackend.NewFakeSysctl(nil), NodePortAddresses: env.NodePortAddresses})
	if err != nil {
		t.Fatal(err)
	}
	return n, b
}

// source reads the fake node as kproxy trace reads a live one.
func (n *fakeIPVSNode) source(family v1.IPFamily) Source {
	return Source{IPTables: map[v1.IPFamily]ipt.Interface{family: n.ipt}, IPVS: n.ipvs, IPSet: n.sets,
		LocalAddresses: func() ([]netip.Addr, error) { return n.nl.LocalAddresses(context.Background()) }}
}

// ipvsCases are the shared behaviour cases with IPVS mode's deviations.
func ipvsCases(t *testing.T) []pt.Case {
	used := map[int]bool{}
	var out []pt.Case
	for _, c := range pt.Cases() {
		flows := append([]pt.Flow(nil), c.Flows...)
		for i := range flows {
			for j, d := range ipvstest.Deviations {
				if d.Case == c.Name && d.Flow == flows[i].Name {
					used[j] = true
					flows[i].Want, flows[i].WantEndpoints, flows[i].WantMasquerade, flows[i].WantHairpin = pt.Verdict(d.Want), nil, false, nil
				}
			}
		}
		c.Flows = flows
		out = append(out, c)
	}
	for j, d := range ipvstest.Deviations {
		if !used[j] {
			t.Errorf("deviation for case %q flow %q matches no shared flow", d.Case, d.Flow)
		}
	}
	return out
}

// checkReasonIPVS is checkReason, but for IPVS-mode rejects of a port no
// Service uses on an address of the dummy device, which no Service owns.
func checkReasonIPVS(t testing.TB) func(f pt.Flow, rep *Report) {
	reason := checkReason(t)
	return func(f pt.Flow, rep *Report) {
		if rep.Mode != ModeIPVS {
			t.Errorf("flow %q: traced in mode %q, want %q (detected)", f.Name, rep.Mode, ModeIPVS)
		}
		if rep.Verdict == Rejected && strings.HasPrefix(rep.Reason, "rejected: no Service uses ") {
			return
		}
		reason(f, rep)
	}
}

// TestBehaviourCasesIPVS: IPVS mode's state, rendered by the IPVS backend
// into fake IPVS, ipset and iptables, read back as kproxy trace reads a
// node (iptables-save, the virtual servers, the sets), the mode detected.
func TestBehaviourCasesIPVS(t *testing.T) {
	for _, c := range ipvsCases(t) {
		t.Run(c.Name, func(t *testing.T) {
			pt.RunCase(t, c, func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
				n, b := newFakeIPVSNode(t, env)
				return b, &reportTracer{t: t, src: n.source(env.Family), check: checkReasonIPVS(t)}
			})
		})
	}
}

// TestIPVSReasons: the IPVS-mode report of each kind of flow says the
// outcome in Service terms, and which traffic policy drops.
func TestIPVSReasons(t *testing.T) {
	env := pt.DefaultEnv()
	n, b := newFakeIPVSNode(t, env)
	remote := func(ips ...string) []pt.EP {
		var out []pt.EP
		for _, ip := range ips {
			out = append(out, pt.EP{IP: ip, Node: "node-b"})
		}
		return out
	}
	e := pt.NewEngine(t, b, pt.EngineOptions{Env: env,
		Services: []*v1.Service{
			pt.Service("web", "10.96.0.10", pt.NodePort(30082)),
			pt.Service("none", "10.96.0.11"),
			pt.Service("loc", "10.96.0.12", pt.NodePort(30080), pt.ExternalLocal()),
			pt.Service("both", "10.96.0.13", pt.NodePort(30081), pt.ExternalLocal(), pt.InternalLocal()),
			pt.Service("lb", "10.96.0.14", pt.LoadBalancer("203.0.113.5"), pt.SourceRanges("192.0.2.0/25")),
			pt.Service("sticky", "10.96.0.15", pt.Affinity(300)),
		},
		Slices: []*discovery.EndpointSlice{
			pt.Slice("web", 8080, remote("10.244.1.5", "10.244.2.5")...),
			pt.Slice("loc", 8080, remote("10.244.1.6")...),
			pt.Slice("both", 8080, remote("10.244.1.7", "10.244.2.7")...),
			pt.Slice("lb", 8080, remote("10.244.1.8")...),
			pt.Slice("sticky", 8080, remote("10.244.1.9")...),
		}})
	pt.Sync(t, e)
	const client, pod = "192.0.2.10", "10.244.0.5"
	for _, tc := range []struct {
		name                 string
		src, dst, from       string
		port                 int
		verdict, service     string
		reason               []string
		endpoints            map[string]float64
		masquerade, affinity bool
	}{
		{name: "ClusterIP from outside the cluster: both real servers, masqueraded", src: client, dst: "10.96.0.10", port: 80,
			verdict: Delivered, service: "ClusterIP TCP 10.96.0.10:80", reason: []string{"masqueraded"},
			endpoints: map[string]float64{"10.244.1.5:8080": 0.5, "10.244.2.5:8080": 0.5}, masquerade: true},
		{name: "ClusterIP from a pod: not masqueraded", src: pod, dst: "10.96.0.10", port: 80, from: FromPod,
			verdict: Delivered, service: "ClusterIP TCP 10.96.0.10:80", reason: []string{"not masqueraded"},
			endpoints: map[string]float64{"10.244.1.5:8080": 0.5, "10.244.2.5:8080": 0.5}},
		{name: "node port", src: client, dst: "10.0.0.1", port: 30082,
			verdict: Delivered, service: "node port TCP 10.0.0.1:30082",
			endpoints: map[string]float64{"10.244.1.5:8080": 0.5, "10.244.2.5:8080": 0.5}, masquerade: true},
		{name: "no endpoints: IPVS rejects", src: client, dst: "10.96.0.11", port: 80,
			verdict: Rejected, service: "ClusterIP TCP 10.96.0.11:80", reason: []string{"has no endpoints"}},
		{name: "externalTrafficPolicy Local node port without a local endpoint", src: client, dst: "10.0.0.1", port: 30080,
			verdict: Dropped, service: "node port TCP 10.0.0.1:30080", reason: []string{"externalTrafficPolicy is Local"}},
		{name: "both policies Local: the node port drops for externalTrafficPolicy", src: client, dst: "10.0.0.1", port: 30081,
			verdict: Dropped, reason: []string{"externalTrafficPolicy is Local"}},
		{name: "both policies Local: the ClusterIP drops for internalTrafficPolicy", src: pod, dst: "10.96.0.13", port: 80, from: FromPod,
			verdict: Dropped, service: "ClusterIP TCP 10.96.0.13:80", reason: []string{"internalTrafficPolicy is Local"}},
		{name: "both policies Local: a pod reaches the node port through the cluster endpoints", src: pod, dst: "10.0.0.1", port: 30081,
			from: FromPod, verdict: Delivered, service: "ns/both:p",
			endpoints: map[string]float64{"10.244.1.7:8080": 0.5, "10.244.2.7:8080": 0.5}},
		{name: "source outside loadBalancerSourceRanges", src: "198.51.100.7", dst: "203.0.113.5", port: 80,
			verdict: Dropped, service: "load-balancer IP TCP 203.0.113.5:80", reason: []string{"outside loadBalancerSourceRanges"}},
		{name: "source inside loadBalancerSourceRanges", src: client, dst: "203.0.113.5", port: 80,
			verdict: Delivered, service: "load-balancer IP TCP 203.0.113.5:80", endpoints: map[string]float64{"10.244.1.8:8080": 1}, masquerade: true},
		{name: "ClientIP affinity is the virtual server's persistence", src: pod, dst: "10.96.0.15", port: 80, from: FromPod,
			verdict: Delivered, service: "ClusterIP TCP 10.96.0.15:80", reason: []string{"affinity", "300s"},
			endpoints: map[string]float64{"10.244.1.9:8080": 1}, affinity: true},
		{name: "another port of a ClusterIP", src: pod, dst: "10.96.0.10", port: 81, from: FromPod,
			verdict: Rejected, reason: []string{"no Service uses tcp port 81 of 10.96.0.10"}},
		{name: "not a Service", src: pod, dst: "10.1.2.3", port: 80, from: FromPod, verdict: NotHandled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := Run(t.Context(), Request{Source: netip.MustParseAddr(tc.src), Destination: netip.MustParseAddr(tc.dst),
				DestinationPort: tc.port, From: tc.from}, n.source(env.Family))
			if err != nil {
				t.Fatal(err)
			}
			var text strings.Builder
			_ = rep.WriteText(&text)
			t.Logf("report:\n%s", text.String())
			for _, p := range rep.Paths {
				for _, s := range p.Steps {
					if strings.HasSuffix(s.Rule, " ") || s.Rule == "" {
						t.Errorf("step %s shows no rule: %q", s.Where, s.Rule)
					}
				}
			}
			if rep.Mode != ModeIPVS || rep.Verdict != tc.verdict || (tc.service != "" && rep.Service != tc.service) {
				t.Errorf("mode %s, verdict %s, service %q; want ipvs, %s, %q", rep.Mode, rep.Verdict, rep.Service, tc.verdict, tc.service)
			}
			for _, r := range tc.reason {
				if !strings.Contains(rep.Reason, r) {
					t.Errorf("reason %q lacks %q", rep.Reason, r)
				}
			}
			got := map[string]float64{}
			for _, ep := range rep.Endpoints {
				got[ep.Address] = ep.Probability
				if ep.Masquerade != tc.masquerade {
					t.Errorf("endpoint %s masquerade %v, want %v", ep.Address, ep.Masquerade, tc.masquerade)
				}
			}
			if len(got) != len(tc.endpoints) {
				t.Errorf("endpoints %v, want %v", got, tc.endpoints)
			}
			for a, p := range tc.endpoints {
				if g, ok := got[a]; !ok || g < p-0.001 || g > p+0.001 {
					t.Errorf("endpoint %s probability %v, want %v", a, g, p)
				}
			}
			if (rep.AffinitySeconds > 0) != tc.affinity {
				t.Errorf("affinity %ds, want affinity %v", rep.AffinitySeconds, tc.affinity)
			}
		})
	}
}
