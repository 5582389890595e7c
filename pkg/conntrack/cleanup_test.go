package conntrack

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2/ktesting"

	"github.com/kproxy/kproxy/pkg/proxy"
)

func portName(svc, port string, proto v1.Protocol) proxy.ServicePortName {
	return proxy.ServicePortName{NamespacedName: types.NamespacedName{Namespace: "ns", Name: svc}, Port: port, Protocol: proto}
}

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

// Service ports of the test node.
var (
	dnsPort   = portName("dns", "dns", v1.ProtocolUDP)
	dnsTCP    = portName("dns", "dns-tcp", v1.ProtocolTCP)
	dnsAlt    = portName("dns", "alt", v1.ProtocolUDP)
	ntpPort   = portName("ntp", "ntp", v1.ProtocolUDP)
	snmpPort  = portName("snmp", "snmp", v1.ProtocolUDP)
	dns6Port  = portName("dns6", "dns", v1.ProtocolUDP)
	gonePort  = portName("gone", "dns", v1.ProtocolUDP)
	testNodes = "10.0.0.1"
)

func testServices() proxy.ServicePortMap {
	return proxy.ServicePortMap{
		dnsPort: {
			Name: dnsPort, ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 53, Protocol: v1.ProtocolUDP, NodePort: 30053,
			ExternalIPs: addrs("192.0.2.10"), LoadBalancerVIPs: addrs("198.51.100.10"),
		},
		dnsTCP:  {Name: dnsTCP, ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 53, Protocol: v1.ProtocolTCP, NodePort: 30054},
		dnsAlt:  {Name: dnsAlt, ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 5300, Protocol: v1.ProtocolUDP},
		ntpPort: {Name: ntpPort, ClusterIP: netip.MustParseAddr("10.96.0.20"), Port: 123, Protocol: v1.ProtocolUDP},
		snmpPort: {
			Name: snmpPort, ClusterIP: netip.MustParseAddr("10.96.0.30"), Port: 161, Protocol: v1.ProtocolUDP, NodePort: 30161,
			ExternalIPs: addrs("192.0.2.30"),
		},
		dns6Port: {Name: dns6Port, ClusterIP: netip.MustParseAddr("fd00::10"), Port: 53, Protocol: v1.ProtocolUDP},
	}
}

// servingEP is a ready endpoint; terminatingEP a terminating one that
// still serves.
func servingEP(addrPort string) *proxy.Endpoint {
	ap := netip.MustParseAddrPort(addrPort)
	return &proxy.Endpoint{IP: ap.Addr(), Port: int(ap.Port()), Ready: true, Serving: true}
}

func terminatingEP(addrPort string) *proxy.Endpoint {
	ep := servingEP(addrPort)
	ep.Ready, ep.Terminating = false, true
	return ep
}

// testEndpoints are the endpoints of the test node's service ports after
// the sync: dns and snmp have a serving endpoint that no test flow uses.
func testEndpoints() proxy.EndpointsMap {
	return proxy.EndpointsMap{
		dnsPort:  {servingEP("10.244.3.8:5353")},
		snmpPort: {servingEP("10.244.3.9:161")},
	}
}

func testCurrent() Current {
	return Current{Services: testServices(), Endpoints: testEndpoints()}
}

// flow builds a flow from "ip:port" strings: the client's view
// (src -> dst) and the reply's source (the endpoint after DNAT).
func flow(proto v1.Protocol, src, dst, replySrc string) Flow {
	s, d, r := netip.MustParseAddrPort(src), netip.MustParseAddrPort(dst), netip.MustParseAddrPort(replySrc)
	return Flow{Protocol: proto, Original: Tuple{Src: s, Dst: d}, Reply: Tuple{Src: r, Dst: s}}
}

// The flows of the test node, by name.
var testFlows = map[string]Flow{
	"dns via ClusterIP to ep1":      flow(v1.ProtocolUDP, "10.0.0.9:40001", "10.96.0.10:53", "10.244.1.5:5353"),
	"dns via ClusterIP to ep2":      flow(v1.ProtocolUDP, "10.0.0.9:40002", "10.96.0.10:53", "10.244.2.6:5353"),
	"dns via NodePort to ep1":       flow(v1.ProtocolUDP, "203.0.113.7:40003", testNodes+":30053", "10.244.1.5:5353"),
	"dns via external IP to ep1":    flow(v1.ProtocolUDP, "203.0.113.7:40004", "192.0.2.10:53", "10.244.1.5:5353"),
	"dns via LB IP to ep1":          flow(v1.ProtocolUDP, "203.0.113.7:40005", "198.51.100.10:53", "10.244.1.5:5353"),
	"dns over TCP to ep1":           flow(v1.ProtocolTCP, "10.0.0.9:40006", "10.96.0.10:53", "10.244.1.5:5353"),
	"dns TCP NodePort to ep1":       flow(v1.ProtocolTCP, "203.0.113.7:40007", testNodes+":30053", "10.244.1.5:5353"),
	"dns alt port to ep1 port 5301": flow(v1.ProtocolUDP, "10.0.0.9:40008", "10.96.0.10:5300", "10.244.1.5:5301"),
	"dns alt port to ep1 port 5353": flow(v1.ProtocolUDP, "10.0.0.9:40016", "10.96.0.10:5300", "10.244.1.5:5353"),
	"gone service via ClusterIP":    flow(v1.ProtocolUDP, "10.0.0.9:40017", "10.96.0.40:53", "10.244.1.5:5353"),
	"ntp to ep1 IP":                 flow(v1.ProtocolUDP, "10.0.0.9:40009", "10.96.0.20:123", "10.244.1.5:123"),
	"snmp black-holed":              flow(v1.ProtocolUDP, "10.0.0.9:40010", "10.96.0.30:161", "10.96.0.30:161"),
	"snmp other port black-holed":   flow(v1.ProtocolUDP, "10.0.0.9:40011", "10.96.0.30:162", "10.96.0.30:162"),
	"snmp NodePort black-holed":     flow(v1.ProtocolUDP, "203.0.113.7:40012", testNodes+":30161", testNodes+":30161"),
	"snmp external IP black-holed":  flow(v1.ProtocolUDP, "203.0.113.7:40013", "192.0.2.30:161", "192.0.2.30:161"),
	"unrelated DNS to the internet": flow(v1.ProtocolUDP, "10.0.0.9:40014", "8.8.8.8:53", "8.8.8.8:53"),
	"dns6 to ep1":                   flow(v1.ProtocolUDP, "[fd00:1::9]:40015", "[fd00::10]:53", "[fd00:244::5]:5353"),
}

func flowNames(flows []Flow) []string {
	byFlow := map[Flow]string{}
	for name, f := range testFlows {
		byFlow[f] = name
	}
	var out []string
	for _, f := range flows {
		out = append(out, byFlow[f])
	}
	slices.Sort(out)
	return out
}

func TestCleanStaleEntries(t *testing.T) {
	for _, tc := range []struct {
		name   string
		family v1.IPFamily
		stale  StaleEntries
		// services defaults to testServices(), endpoints to
		// testEndpoints().
		services    proxy.ServicePortMap
		endpoints   proxy.EndpointsMap
		wantDeleted []string
	}{
		{
			name: "nothing stale",
		},
		{
			name:        "deleted UDP ClusterIP of a deleted service: every UDP flow to it, whatever the port",
			stale:       StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.40")},
			wantDeleted: []string{"gone service via ClusterIP"},
		},
		{
			name:  "deleted UDP ClusterIP that another UDP port of the service still uses: nothing",
			stale: StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.10")},
		},
		{
			name:  "deleted UDP ClusterIP that only a TCP port still uses: every UDP flow to it",
			stale: StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.10")},
			services: func() proxy.ServicePortMap {
				m := testServices()
				delete(m, dnsPort)
				delete(m, dnsAlt)
				return m
			}(),
			wantDeleted: []string{
				"dns alt port to ep1 port 5301", "dns alt port to ep1 port 5353", "dns via ClusterIP to ep1", "dns via ClusterIP to ep2",
			},
		},
		{
			name:  "deleted endpoint: its flows via every service address, whatever the port, and the node port",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort}}},
			wantDeleted: []string{
				"dns alt port to ep1 port 5353", "dns via ClusterIP to ep1", "dns via LB IP to ep1", "dns via NodePort to ep1", "dns via external IP to ep1",
			},
		},
		{
			name:  "deleted endpoint that serves another UDP port of the service: only its port's flows",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort}}},
			endpoints: proxy.EndpointsMap{
				dnsPort: {servingEP("10.244.3.8:5353")},
				dnsAlt:  {servingEP("10.244.1.5:5353")},
			},
			wantDeleted: []string{
				"dns via ClusterIP to ep1", "dns via LB IP to ep1", "dns via NodePort to ep1", "dns via external IP to ep1",
			},
		},
		{
			name:  "deleted endpoint serving again, ready: its flows stay",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort}}},
			endpoints: proxy.EndpointsMap{
				dnsPort: {servingEP("10.244.1.5:5353")},
			},
		},
		{
			name:  "deleted endpoint serving again, terminating: its flows stay",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort}}},
			endpoints: proxy.EndpointsMap{
				dnsPort: {terminatingEP("10.244.1.5:5353")},
			},
		},
		{
			name:  "last endpoint deleted: its flows, also via the node port",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort}}},
			endpoints: proxy.EndpointsMap{
				dnsPort: {{IP: netip.MustParseAddr("10.244.3.8"), Port: 5353}}, // neither ready nor serving
			},
			wantDeleted: []string{
				"dns alt port to ep1 port 5353", "dns via ClusterIP to ep1", "dns via LB IP to ep1", "dns via NodePort to ep1", "dns via external IP to ep1",
			},
		},
		{
			name: "deleted endpoint of another port of the same service and pod",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{
				{Endpoint: "10.244.1.5:5301", ServicePortName: dnsAlt},
			}},
			wantDeleted: []string{"dns alt port to ep1 port 5301"},
		},
		{
			name: "two deleted endpoints",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{
				{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort},
				{Endpoint: "10.244.2.6:5353", ServicePortName: dnsPort},
			}},
			wantDeleted: []string{
				"dns alt port to ep1 port 5353", "dns via ClusterIP to ep1", "dns via ClusterIP to ep2",
				"dns via LB IP to ep1", "dns via NodePort to ep1", "dns via external IP to ep1",
			},
		},
		{
			name:  "deleted endpoint of a service that is gone: left to the ClusterIP deletion",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: gonePort}}},
		},
		{
			name:  "deleted endpoint with an unparsable address is skipped",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5", ServicePortName: dnsPort}}},
		},
		{
			name:        "newly active service: black-holed flows to its port on every address and the node port",
			stale:       StaleEntries{NewlyActiveUDPServices: []proxy.ServicePortName{snmpPort}},
			wantDeleted: []string{"snmp NodePort black-holed", "snmp black-holed", "snmp external IP black-holed"},
		},
		{
			name:  "newly active service that is gone",
			stale: StaleEntries{NewlyActiveUDPServices: []proxy.ServicePortName{gonePort}},
		},
		{
			name:      "newly active service without a serving endpoint any more: nothing",
			stale:     StaleEntries{NewlyActiveUDPServices: []proxy.ServicePortName{snmpPort}},
			endpoints: proxy.EndpointsMap{snmpPort: {{IP: netip.MustParseAddr("10.244.3.9"), Port: 161}}},
		},
		{
			name: "every kind at once",
			stale: StaleEntries{
				DeletedUDPClusterIPs:   sets.New("10.96.0.40"),
				DeletedUDPEndpoints:    []proxy.ServiceEndpoint{{Endpoint: "10.244.2.6:5353", ServicePortName: dnsPort}},
				NewlyActiveUDPServices: []proxy.ServicePortName{snmpPort},
			},
			wantDeleted: []string{
				"dns via ClusterIP to ep2", "gone service via ClusterIP", "snmp NodePort black-holed", "snmp black-holed", "snmp external IP black-holed",
			},
		},
		{
			name:        "IPv6 endpoint",
			family:      v1.IPv6Protocol,
			stale:       StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "[fd00:244::5]:5353", ServicePortName: dns6Port}}},
			wantDeleted: []string{"dns6 to ep1"},
		},
		{
			name:   "IPv4 changes leave the IPv6 table alone",
			family: v1.IPv6Protocol,
			stale:  StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.10")},
		},
		{
			name:  "a TCP service port is never cleaned",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: dnsTCP}}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			family := tc.family
			if family == "" {
				family = v1.IPv4Protocol
			}
			cur := testCurrent()
			if tc.services != nil {
				cur.Services = tc.services
			}
			if tc.endpoints != nil {
				cur.Endpoints = tc.endpoints
			}
			var all []Flow
			for _, f := range testFlows {
				all = append(all, f)
			}
			ct := NewFake(all...)
			n, err := CleanStaleEntries(ctx, ct, family, cur, tc.stale)
			if err != nil {
				t.Fatalf("CleanStaleEntries: %v", err)
			}
			remaining := sets.New(flowNames(ct.Flows())...)
			gotDeleted := sets.New[string]()
			for name := range testFlows {
				if !remaining.Has(name) {
					gotDeleted.Insert(name)
				}
			}
			if got := sets.List(gotDeleted); !slices.Equal(got, tc.wantDeleted) {
				t.Errorf("deleted %q\nwant    %q", got, tc.wantDeleted)
			}
			if n != gotDeleted.Len() {
				t.Errorf("reported %d deletions, the table lost %d flows", n, gotDeleted.Len())
			}
		})
	}
}

func TestCleanStaleEntriesError(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ct := NewFake(testFlows["gone service via ClusterIP"])
	ct.FailNextClear(errors.New("netlink: no buffer space"))
	stale := StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.40")}
	if _, err := CleanStaleEntries(ctx, ct, v1.IPv4Protocol, testCurrent(), stale); err == nil {
		t.Fatal("CleanStaleEntries succeeded, want the table's error")
	}
	if got := len(ct.Flows()); got != 1 {
		t.Errorf("%d flows left after a failed clear, want 1", got)
	}
	// The failure was one-off: the next clean deletes the flow.
	if n, err := CleanStaleEntries(ctx, ct, v1.IPv4Protocol, testCurrent(), stale); err != nil || n != 1 {
		t.Errorf("second CleanStaleEntries = %d, %v; want 1, nil", n, err)
	}
}

func TestStaleFilters(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	ep := netip.MustParseAddr("10.244.1.5")
	for _, tc := range []struct {
		name  string
		stale StaleEntries
		// cur defaults to testCurrent().
		cur  *Current
		want []Filter
	}{
		{name: "empty"},
		{
			name:  "deleted ClusterIP",
			stale: StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.40", "not-an-ip")},
			want:  []Filter{{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.40")}},
		},
		{
			name: "deleted endpoint listed twice gives each filter once",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{
				{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort},
				{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort},
			}},
			want: []Filter{
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.10"), ReplySrcIP: ep, ReplySrcPort: 5353},
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("192.0.2.10"), ReplySrcIP: ep, ReplySrcPort: 5353},
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("198.51.100.10"), ReplySrcIP: ep, ReplySrcPort: 5353},
				{Protocol: v1.ProtocolUDP, OrigDstPort: 30053, ReplySrcIP: ep, ReplySrcPort: 5353},
			},
		},
		{
			name:  "deleted endpoint that serves another UDP port of the service",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort}}},
			cur: &Current{Services: testServices(), Endpoints: proxy.EndpointsMap{
				dnsAlt: {servingEP("10.244.1.5:5353")},
			}},
			want: []Filter{
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.10"), OrigDstPort: 53, ReplySrcIP: ep, ReplySrcPort: 5353},
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("192.0.2.10"), OrigDstPort: 53, ReplySrcIP: ep, ReplySrcPort: 5353},
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("198.51.100.10"), OrigDstPort: 53, ReplySrcIP: ep, ReplySrcPort: 5353},
				{Protocol: v1.ProtocolUDP, OrigDstPort: 30053, ReplySrcIP: ep, ReplySrcPort: 5353},
			},
		},
		{
			name:  "newly active",
			stale: StaleEntries{NewlyActiveUDPServices: []proxy.ServicePortName{snmpPort}},
			want: []Filter{
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.30"), OrigDstPort: 161},
				{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("192.0.2.30"), OrigDstPort: 161},
				{Protocol: v1.ProtocolUDP, OrigDstPort: 30161},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cur := testCurrent()
			if tc.cur != nil {
				cur = *tc.cur
			}
			got := StaleFilters(logger, cur, tc.stale)
			if !sets.New(got...).Equal(sets.New(tc.want...)) || len(got) != len(tc.want) {
				t.Errorf("filters:\n%v\nwant\n%v", got, tc.want)
			}
		})
	}
}

func TestStaleEntriesAdd(t *testing.T) {
	var s StaleEntries
	if !s.Empty() {
		t.Fatal("zero StaleEntries is not empty")
	}
	ep := proxy.ServiceEndpoint{Endpoint: "10.244.1.5:5353", ServicePortName: dnsPort}
	s.Add(proxy.UpdateServiceMapResult{DeletedUDPClusterIPs: sets.New("10.96.0.10")},
		proxy.UpdateEndpointsMapResult{DeletedUDPEndpoints: []proxy.ServiceEndpoint{ep}})
	s.Add(proxy.UpdateServiceMapResult{DeletedUDPClusterIPs: sets.New("10.96.0.20")},
		proxy.UpdateEndpointsMapResult{NewlyActiveUDPServices: []proxy.ServicePortName{snmpPort}})
	if s.Empty() {
		t.Fatal("StaleEntries empty after Add")
	}
	if got := sets.List(s.DeletedUDPClusterIPs); !slices.Equal(got, []string{"10.96.0.10", "10.96.0.20"}) {
		t.Errorf("DeletedUDPClusterIPs = %v", got)
	}
	if !slices.Equal(s.DeletedUDPEndpoints, []proxy.ServiceEndpoint{ep}) {
		t.Errorf("DeletedUDPEndpoints = %v", s.DeletedUDPEndpoints)
	}
	if !slices.Equal(s.NewlyActiveUDPServices, []proxy.ServicePortName{snmpPort}) {
		t.Errorf("NewlyActiveUDPServices = %v", s.NewlyActiveUDPServices)
	}
}

func TestFilterMatches(t *testing.T) {
	f := testFlows["dns via ClusterIP to ep1"]
	for _, tc := range []struct {
		name   string
		filter Filter
		want   bool
	}{
		{name: "protocol only matches nothing", filter: Filter{Protocol: v1.ProtocolUDP}},
		{name: "no protocol matches nothing", filter: Filter{OrigDstIP: netip.MustParseAddr("10.96.0.10")}},
		{name: "other protocol", filter: Filter{Protocol: v1.ProtocolTCP, OrigDstIP: netip.MustParseAddr("10.96.0.10")}},
		{name: "orig dst", filter: Filter{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.10")}, want: true},
		{name: "IPv4-mapped orig dst", filter: Filter{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("::ffff:10.96.0.10")}, want: true},
		{name: "orig dst and port", filter: Filter{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.10"), OrigDstPort: 53}, want: true},
		{name: "other orig port", filter: Filter{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.10"), OrigDstPort: 54}},
		{name: "reply src", filter: Filter{Protocol: v1.ProtocolUDP, ReplySrcIP: netip.MustParseAddr("10.244.1.5"), ReplySrcPort: 5353}, want: true},
		{name: "other reply port", filter: Filter{Protocol: v1.ProtocolUDP, ReplySrcIP: netip.MustParseAddr("10.244.1.5"), ReplySrcPort: 5354}},
		{name: "other reply src", filter: Filter{Protocol: v1.ProtocolUDP, ReplySrcIP: netip.MustParseAddr("10.244.1.6")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.filter.Matches(f); got != tc.want {
				t.Errorf("%s matches %s = %v, want %v", tc.filter, f, got, tc.want)
			}
		})
	}
}

func TestFakeClearEntriesWithoutFilters(t *testing.T) {
	ct := NewFake(testFlows["dns via ClusterIP to ep1"])
	if n, err := ct.ClearEntries(context.Background(), v1.IPv4Protocol); err != nil || n != 0 {
		t.Errorf("ClearEntries() = %d, %v; want 0, nil", n, err)
	}
	if len(ct.Flows()) != 1 {
		t.Error("ClearEntries without filters deleted a flow")
	}
}
