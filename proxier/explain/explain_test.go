package explain

import (
	"context"
	"encoding/json"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/kproxy/kproxy/config"
	"github.com/kproxy/kproxy/pkg/proxy"
)

const (
	testNode   = "node-1"
	testNodeIP = "10.0.0.1"
	groupLabel = "example.com/group"
)

var (
	testCIDR = netip.MustParsePrefix("10.244.0.0/16")
	webName  = types.NamespacedName{Namespace: "default", Name: "web"}
)

// testNodes: node-1 and node-3 in zone-a and group g1, node-2 in zone-b
// and group g0.
func testNodes() []runtime.Object {
	mk := func(name, ip, zone, group string) *v1.Node {
		return &v1.Node{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{v1.LabelTopologyZone: zone, groupLabel: group}},
			Spec:       v1.NodeSpec{PodCIDRs: []string{"10.244." + ip[len("10.0.0."):] + ".0/24"}},
			Status:     v1.NodeStatus{Addresses: []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: ip}}},
		}
	}
	return []runtime.Object{mk("node-1", "10.0.0.1", "zone-a", "g1"), mk("node-2", "10.0.0.2", "zone-b", "g0"), mk("node-3", "10.0.0.3", "zone-a", "g1")}
}

var nodeZones = map[string]string{"node-1": "zone-a", "node-2": "zone-b", "node-3": "zone-a"}

type svcMod func(*v1.Service)

func testService(mods ...svcMod) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec: v1.ServiceSpec{
			Type: v1.ServiceTypeClusterIP, ClusterIP: "172.30.0.10", ClusterIPs: []string{"172.30.0.10"},
			IPFamilies: []v1.IPFamily{v1.IPv4Protocol},
			Ports:      []v1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080), Protocol: v1.ProtocolTCP}},
		},
	}
	for _, m := range mods {
		m(s)
	}
	return s
}

func nodePort(s *v1.Service) {
	s.Spec.Type = v1.ServiceTypeNodePort
	s.Spec.Ports[0].NodePort = 30080
	s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
}

func etpLocal(s *v1.Service) {
	nodePort(s)
	s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	s.Spec.HealthCheckNodePort = 31000
}

func itpLocal(s *v1.Service) {
	p := v1.ServiceInternalTrafficPolicyLocal
	s.Spec.InternalTrafficPolicy = &p
}

func loadBalancer(vip string, ranges ...string) svcMod {
	return func(s *v1.Service) {
		nodePort(s)
		s.Spec.Type = v1.ServiceTypeLoadBalancer
		s.Spec.LoadBalancerSourceRanges = ranges
		s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: vip}}
	}
}

func externalIP(ip string) svcMod {
	return func(s *v1.Service) { s.Spec.ExternalIPs = []string{ip} }
}

func distribution(d string) svcMod {
	return func(s *v1.Service) { s.Spec.TrafficDistribution = &d }
}

func topologyKeys(keys string) svcMod {
	return func(s *v1.Service) { s.Annotations = map[string]string{proxy.AnnotationTopologyKeys: keys} }
}

func affinity(s *v1.Service) {
	s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	sec := int32(600)
	s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: &sec}}
}

// ep is an endpoint of the test slice.
type ep struct {
	ip, node string
	// state: "" ready, "term" serving and terminating, "down" not ready.
	state     string
	zoneHints []string
	nodeHints []string
}

func testSlice(eps ...ep) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "web-abc", Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: new("http"), Port: new(int32(8080)), Protocol: new(v1.ProtocolTCP)}},
	}
	for _, e := range eps {
		ready, serving, term := true, true, false
		switch e.state {
		case "term":
			ready, serving, term = false, true, true
		case "down":
			ready, serving = false, false
		}
		d := discovery.Endpoint{
			Addresses:  []string{e.ip},
			Conditions: discovery.EndpointConditions{Ready: &ready, Serving: &serving, Terminating: &term},
			NodeName:   new(e.node), Zone: new(nodeZones[e.node]),
		}
		if e.zoneHints != nil || e.nodeHints != nil {
			d.Hints = &discovery.EndpointHints{}
			for _, z := range e.zoneHints {
				d.Hints.ForZones = append(d.Hints.ForZones, discovery.ForZone{Name: z})
			}
			for _, n := range e.nodeHints {
				d.Hints.ForNodes = append(d.Hints.ForNodes, discovery.ForNode{Name: n})
			}
		}
		s.Endpoints = append(s.Endpoints, d)
	}
	return s
}

func testOptions(objs ...runtime.Object) Options {
	return Options{
		Client: fake.NewClientset(append(testNodes(), objs...)...), NodeName: testNode, Service: webName,
		ClusterCIDRs:   map[v1.IPFamily]netip.Prefix{v1.IPv4Protocol: testCIDR},
		LocalAddresses: func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr(testNodeIP)}, nil },
	}
}

// want is a flow's expected decision; endpoints by last octet of their IP.
type want struct {
	verdict   string
	endpoints []string
	masq      bool
	reason    string // a substring of the reason
}

// explainCase is a Service and its slice, with what node-1 decides.
type explainCase struct {
	name  string
	svc   *v1.Service
	slice *discovery.EndpointSlice
	// flows by "Destination/Source" ("@address" added to a second flow of
	// the same key).
	flows map[string]want
	// clusterWhy and localWhy are substrings of the lists' reasons.
	clusterWhy, localWhy string
	affinity             int
}

var (
	local1  = ep{ip: "10.244.1.5", node: "node-1"}
	remote2 = ep{ip: "10.244.2.5", node: "node-2"}
	remote3 = ep{ip: "10.244.3.5", node: "node-3"}
)

const (
	ep1 = "10.244.1.5:8080"
	ep2 = "10.244.2.5:8080"
	ep3 = "10.244.3.5:8080"
)

func explainCases() []explainCase {
	return []explainCase{
		{name: "cluster policy", svc: testService(nodePort), slice: testSlice(local1, remote2),
			clusterWhy: "every one of the ready endpoints",
			flows: map[string]want{
				"ClusterIP/pod":   {verdict: Delivered, endpoints: []string{ep1, ep2}, reason: "not masqueraded (the endpoint sees 10.244.1.2)"},
				"ClusterIP/node":  {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true, reason: "outside the cluster CIDR"},
				"ClusterIP/other": {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true},
				"NodePort/pod":    {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true, reason: "externalTrafficPolicy is Cluster"},
				"NodePort/node":   {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true},
				"NodePort/other":  {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true},
			}},
		{name: "externalTrafficPolicy Local with a local endpoint", svc: testService(etpLocal), slice: testSlice(local1, remote2),
			localWhy: "the ready endpoints on this node",
			flows: map[string]want{
				"ClusterIP/pod":  {verdict: Delivered, endpoints: []string{ep1, ep2}},
				"NodePort/other": {verdict: Delivered, endpoints: []string{ep1}, reason: "externalTrafficPolicy is Local, the client's address is kept"},
				"NodePort/pod":   {verdict: Delivered, endpoints: []string{ep1, ep2}, reason: "a pod here reaching this address is sent to any endpoint"},
				"NodePort/node":  {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true},
			}},
		{name: "externalTrafficPolicy Local without a local endpoint", svc: testService(etpLocal, externalIP("192.0.2.10")), slice: testSlice(remote2, remote3),
			localWhy: "none: this node has no ready or serving endpoint",
			flows: map[string]want{
				"ClusterIP/other":  {verdict: Delivered, endpoints: []string{ep2, ep3}, masq: true},
				"NodePort/other":   {verdict: Dropped, reason: "dropped: externalTrafficPolicy is Local and this node has no ready or serving endpoint of default/web"},
				"ExternalIP/other": {verdict: Dropped, reason: "externalTrafficPolicy is Local"},
				"ExternalIP/pod":   {verdict: Delivered, endpoints: []string{ep2, ep3}},
			}},
		{name: "internalTrafficPolicy Local without a local endpoint", svc: testService(itpLocal), slice: testSlice(remote2),
			flows: map[string]want{
				"ClusterIP/pod":  {verdict: Dropped, reason: "dropped: internalTrafficPolicy is Local and this node has no ready or serving endpoint of default/web"},
				"ClusterIP/node": {verdict: Dropped},
			}},
		{name: "internalTrafficPolicy Local with a local endpoint", svc: testService(itpLocal), slice: testSlice(local1, remote2),
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Delivered, endpoints: []string{ep1}, reason: "internalTrafficPolicy is Local"},
			}},
		{name: "terminating fallback", svc: testService(), slice: testSlice(ep{ip: "10.244.1.5", node: "node-1", state: "term"}, ep{ip: "10.244.2.5", node: "node-2", state: "down"}),
			clusterWhy: "no endpoint is ready: fallback",
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Delivered, endpoints: []string{ep1}},
			}},
		{name: "zone hints of trafficDistribution PreferSameZone", svc: testService(distribution(v1.ServiceTrafficDistributionPreferSameZone)),
			slice:      testSlice(ep{ip: "10.244.2.5", node: "node-2", zoneHints: []string{"zone-b"}}, ep{ip: "10.244.3.5", node: "node-3", zoneHints: []string{"zone-a"}}),
			clusterWhy: "hinted for this node's zone zone-a; hints set by the EndpointSlice controller for trafficDistribution PreferSameZone",
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Delivered, endpoints: []string{ep3}},
			}},
		{name: "node hints of trafficDistribution PreferSameNode", svc: testService(distribution(v1.ServiceTrafficDistributionPreferSameNode)),
			slice: testSlice(ep{ip: "10.244.1.5", node: "node-1", nodeHints: []string{"node-1"}, zoneHints: []string{"zone-a"}},
				ep{ip: "10.244.3.5", node: "node-3", nodeHints: []string{"node-3"}, zoneHints: []string{"zone-a"}}),
			clusterWhy: "topology hints: the ready endpoints hinted for this node",
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Delivered, endpoints: []string{ep1}},
			}},
		{name: "trafficDistribution without hints", svc: testService(distribution(v1.ServiceTrafficDistributionPreferSameZone)), slice: testSlice(local1, remote2),
			clusterWhy: "has no effect here",
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Delivered, endpoints: []string{ep1, ep2}},
			}},
		{name: "topologyKeys", svc: testService(topologyKeys(`["` + groupLabel + `"]`)), slice: testSlice(remote2, remote3),
			clusterWhy: "key example.com/group selects the ready endpoints on nodes with example.com/group=g1",
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Delivered, endpoints: []string{ep3}},
			}},
		{name: "topologyKeys selecting nothing", svc: testService(topologyKeys(`["` + groupLabel + `"]`)), slice: testSlice(remote2),
			clusterWhy: "no key selects an endpoint for this node (example.com/group=g1)",
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Rejected, reason: "matches its topologyKeys"},
			}},
		{name: "loadBalancerSourceRanges", svc: testService(loadBalancer("192.0.2.20", "198.51.100.0/24")), slice: testSlice(local1, remote2),
			flows: map[string]want{
				"LoadBalancerIP/other":              {verdict: Dropped, reason: "dropped: source 203.0.113.7 is outside loadBalancerSourceRanges of default/web:http"},
				"LoadBalancerIP/other@198.51.100.1": {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true},
				"LoadBalancerIP/pod":                {verdict: Dropped, reason: "outside loadBalancerSourceRanges"},
				"NodePort/other":                    {verdict: Delivered, endpoints: []string{ep1, ep2}, masq: true},
				"ClusterIP/pod":                     {verdict: Delivered, endpoints: []string{ep1, ep2}},
			}},
		{name: "no endpoints", svc: testService(nodePort), slice: testSlice(),
			flows: map[string]want{
				"ClusterIP/pod":  {verdict: Rejected, reason: "rejected: default/web:http has no endpoints"},
				"NodePort/other": {verdict: Rejected, reason: "rejected: default/web:http has no endpoints"},
			}},
		{name: "no ready endpoint", svc: testService(), slice: testSlice(ep{ip: "10.244.2.5", node: "node-2", state: "down"}),
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Rejected, reason: "no endpoints ready or serving"},
			}},
		{name: "session affinity", svc: testService(affinity), slice: testSlice(local1, remote2), affinity: 600,
			flows: map[string]want{
				"ClusterIP/pod": {verdict: Delivered, endpoints: []string{ep1, ep2}, reason: "ClientIP affinity keeps 10.244.1.2 on its endpoint for 600s"},
			}},
	}
}

// flowsByKey indexes the flows of every port as explainCase.flows.
func flowsByKey(x *Explanation) map[string]*Flow {
	out := map[string]*Flow{}
	for _, p := range x.Ports {
		for _, f := range p.Flows {
			k := f.Destination + "/" + f.Source
			if out[k] != nil {
				k += "@" + f.SourceAddress
			}
			out[k] = f
		}
	}
	return out
}

func TestExplain(t *testing.T) {
	for _, tc := range explainCases() {
		t.Run(tc.name, func(t *testing.T) {
			x, err := Explain(t.Context(), testOptions(tc.svc, tc.slice))
			if err != nil {
				t.Fatal(err)
			}
			if len(x.Ports) != 1 {
				t.Fatalf("%d ports, want 1", len(x.Ports))
			}
			p := x.Ports[0]
			flows := flowsByKey(x)
			for k, w := range tc.flows {
				f := flows[k]
				if f == nil {
					t.Errorf("no flow %s; flows: %v", k, slices.Sorted(func(yield func(string) bool) {
						for k := range flows {
							if !yield(k) {
								return
							}
						}
					}))
					continue
				}
				got := slices.Clone(f.Endpoints)
				slices.Sort(got)
				if f.Verdict != w.verdict || !slices.Equal(got, w.endpoints) || f.Masquerade != w.masq || !strings.Contains(f.Reason, w.reason) {
					t.Errorf("flow %s: %s %v masquerade %v (%q), want %s %v masquerade %v (reason with %q)",
						k, f.Verdict, got, f.Masquerade, f.Reason, w.verdict, w.endpoints, w.masq, w.reason)
				}
			}
			if tc.clusterWhy != "" && (p.Cluster == nil || !strings.Contains(p.Cluster.Why, tc.clusterWhy)) {
				t.Errorf("cluster endpoints %+v, want a reason with %q", p.Cluster, tc.clusterWhy)
			}
			if tc.localWhy != "" && (p.Local == nil || !strings.Contains(p.Local.Why, tc.localWhy)) {
				t.Errorf("local endpoints %+v, want a reason with %q", p.Local, tc.localWhy)
			}
			if p.AffinitySeconds != tc.affinity {
				t.Errorf("affinity %d, want %d", p.AffinitySeconds, tc.affinity)
			}
			var text strings.Builder
			if err := x.WriteText(&text); err != nil {
				t.Fatal(err)
			}
			var js strings.Builder
			if err := x.WriteJSON(&js); err != nil || !json.Valid([]byte(js.String())) {
				t.Fatalf("JSON: %v\n%s", err, js.String())
			}
			t.Logf("\n%s", text.String())
		})
	}
}

// TestExplainNodeState: the decisions explained are the engine's: the
// state the backend would get holds the same endpoint lists.
func TestExplainNodeState(t *testing.T) {
	o := testOptions(testService(etpLocal), testSlice(local1, remote2))
	in, err := read(t.Context(), o)
	if err != nil {
		t.Fatal(err)
	}
	states, _, err := decide(t.Context(), o, in)
	if err != nil {
		t.Fatal(err)
	}
	st := states[v1.IPv4Protocol].Services[proxy.ServicePortName{NamespacedName: webName, Port: "http", Protocol: v1.ProtocolTCP}]
	if st == nil {
		t.Fatalf("no state for default/web:http: %v", states[v1.IPv4Protocol].Services)
	}
	if got := addrs(st.LocalEndpoints); !slices.Equal(got, []string{ep1}) {
		t.Errorf("local endpoints %v", got)
	}
	if d := st.Decisions.For(proxy.DestNodePort, proxy.SourceOther); d.Verdict != proxy.VerdictDeliver || d.Endpoints != proxy.SelectLocal {
		t.Errorf("NodePort decision %+v", d)
	}
}

func TestExplainErrors(t *testing.T) {
	otherProxy := testService(func(s *v1.Service) { s.Labels = map[string]string{config.LabelServiceProxyName: "other"} })
	for _, tc := range []struct {
		name    string
		objs    []runtime.Object
		mutate  func(*Options)
		wantErr string
	}{
		{name: "not found", wantErr: "service default/web not found"},
		{name: "ExternalName", objs: []runtime.Object{testService(func(s *v1.Service) {
			s.Spec.Type, s.Spec.ExternalName, s.Spec.ClusterIP, s.Spec.ClusterIPs = v1.ServiceTypeExternalName, "db.example.com", "", nil
		})}, wantErr: "is of type ExternalName (db.example.com)"},
		{name: "headless", objs: []runtime.Object{testService(func(s *v1.Service) { s.Spec.ClusterIP, s.Spec.ClusterIPs = "None", []string{"None"} })},
			wantErr: "is headless (clusterIP None)"},
		{name: "another proxy's", objs: []runtime.Object{otherProxy},
			wantErr: `is labelled service.kubernetes.io/service-proxy-name="other": another proxy handles it`},
		{name: "ours only with the label", objs: []runtime.Object{testService()}, mutate: func(o *Options) { o.ServiceProxyName = "kproxy" },
			wantErr: "has no service.kubernetes.io/service-proxy-name label"},
		{name: "port not found", objs: []runtime.Object{testService()}, mutate: func(o *Options) { o.Port = "grpc" },
			wantErr: `has no port "grpc" (its ports: http (80))`},
		{name: "node not found", objs: []runtime.Object{testService()}, mutate: func(o *Options) { o.NodeName = "node-9" },
			wantErr: `node "node-9" not found`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions(tc.objs...)
			if tc.mutate != nil {
				tc.mutate(&o)
			}
			_, err := Explain(t.Context(), o)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want one with %q", err, tc.wantErr)
			}
		})
	}
}

func TestParseServiceArg(t *testing.T) {
	for _, tc := range []struct {
		arg      string
		want     types.NamespacedName
		wantPort string
		wantErr  bool
	}{
		{arg: "default/web", want: webName},
		{arg: "default/web:http", want: webName, wantPort: "http"},
		{arg: "default/web:80", want: webName, wantPort: "80"},
		{arg: "web", wantErr: true},
		{arg: "/web", wantErr: true},
		{arg: "default/", wantErr: true},
		{arg: "default/web:", wantErr: true},
		{arg: "a/b/c", wantErr: true},
	} {
		t.Run(tc.arg, func(t *testing.T) {
			got, port, err := ParseServiceArg(tc.arg)
			if (err != nil) != tc.wantErr || got != tc.want || port != tc.wantPort {
				t.Fatalf("ParseServiceArg(%q) = %v, %q, %v", tc.arg, got, port, err)
			}
		})
	}
}

var _ = context.Background
