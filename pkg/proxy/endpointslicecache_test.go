package proxy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
)

// escSlice is an EndpointSlice "ns/<name>" of service "ns/<service>".
func escSlice(name, service string, addressType discovery.AddressType, ports []discovery.EndpointPort, endpoints ...discovery.Endpoint) *discovery.EndpointSlice {
	labels := map[string]string{}
	if service != "" {
		labels[discovery.LabelServiceName] = service
	}
	return &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: labels},
		AddressType: addressType,
		Ports:       ports,
		Endpoints:   endpoints,
	}
}

func escPort(name string, port int32, protocol v1.Protocol) discovery.EndpointPort {
	return discovery.EndpointPort{Name: ptr.To(name), Port: ptr.To(port), Protocol: ptr.To(protocol)}
}

func escEndpoint(ip string, mods ...func(*discovery.Endpoint)) discovery.Endpoint {
	ep := discovery.Endpoint{Addresses: []string{ip}}
	for _, mod := range mods {
		mod(&ep)
	}
	return ep
}

func escConditions(ready, serving, terminating *bool) func(*discovery.Endpoint) {
	return func(ep *discovery.Endpoint) {
		ep.Conditions = discovery.EndpointConditions{Ready: ready, Serving: serving, Terminating: terminating}
	}
}

func escOnNode(node string) func(*discovery.Endpoint) {
	return func(ep *discovery.Endpoint) { ep.NodeName = ptr.To(node) }
}

// escTerminating is a serving, terminating, not-ready endpoint.
var escTerminating = escConditions(ptr.To(false), ptr.To(true), ptr.To(true))

// escNotReady is a not-ready, not-serving, not-terminating endpoint.
var escNotReady = escConditions(ptr.To(false), ptr.To(false), ptr.To(false))

var escSvc = types.NamespacedName{Namespace: "ns", Name: "svc"}

func escSPN(port string, protocol v1.Protocol) ServicePortName {
	return ServicePortName{NamespacedName: escSvc, Port: port, Protocol: protocol}
}

// escEP is the expected Endpoint: ready and serving unless modified.
func escEP(addrPort string, mods ...func(*Endpoint)) *Endpoint {
	ap := netip.MustParseAddrPort(addrPort)
	ep := &Endpoint{IP: ap.Addr(), Port: int(ap.Port()), Ready: true, Serving: true}
	for _, mod := range mods {
		mod(ep)
	}
	return ep
}

func escDump(m EndpointsMap) string {
	var lines []string
	for name, eps := range m {
		var parts []string
		for _, ep := range eps {
			parts = append(parts, fmt.Sprintf("%+v", *ep))
		}
		lines = append(lines, fmt.Sprintf("%s/%s: %s", name, name.Protocol, strings.Join(parts, " ")))
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

func TestEndpointSliceCache(t *testing.T) {
	http := []discovery.EndpointPort{escPort("http", 8080, v1.ProtocolTCP)}
	v4, v6 := discovery.AddressTypeIPv4, discovery.AddressTypeIPv6

	tests := []struct {
		name     string
		family   v1.IPFamily
		nodeName string
		slices   []*discovery.EndpointSlice
		want     EndpointsMap
	}{
		{
			name:   "nil conditions mean ready, serving and not terminating",
			slices: []*discovery.EndpointSlice{escSlice("s1", "svc", v4, http, escEndpoint("10.0.0.1"))},
			want:   EndpointsMap{escSPN("http", v1.ProtocolTCP): {escEP("10.0.0.1:8080")}},
		},
		{
			name: "explicit conditions; nil serving means serving, as upstream",
			slices: []*discovery.EndpointSlice{escSlice("s1", "svc", v4, http,
				escEndpoint("10.0.0.1", escTerminating),
				escEndpoint("10.0.0.2", escConditions(ptr.To(false), nil, nil)),
				escEndpoint("10.0.0.3", escConditions(ptr.To(true), ptr.To(true), ptr.To(false))),
			)},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {
				escEP("10.0.0.1:8080", func(e *Endpoint) { e.Ready, e.Serving, e.Terminating = false, true, true }),
				escEP("10.0.0.2:8080", func(e *Endpoint) { e.Ready, e.Serving = false, true }),
				escEP("10.0.0.3:8080"),
			}},
		},
		{
			name: "two slices merged and sorted numerically by IP",
			slices: []*discovery.EndpointSlice{
				escSlice("s2", "svc", v4, http, escEndpoint("10.0.0.10"), escEndpoint("10.0.0.9")),
				escSlice("s1", "svc", v4, http, escEndpoint("10.0.0.2")),
			},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {
				escEP("10.0.0.2:8080"), escEP("10.0.0.9:8080"), escEP("10.0.0.10:8080"),
			}},
		},
		{
			name: "same IP and port in two slices: the first slice by name wins",
			slices: []*discovery.EndpointSlice{
				escSlice("s-b", "svc", v4, http, escEndpoint("10.0.0.1", escOnNode("node-b"))),
				escSlice("s-a", "svc", v4, http, escEndpoint("10.0.0.1", escOnNode("node-a"))),
			},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {
				escEP("10.0.0.1:8080", func(e *Endpoint) { e.NodeName = "node-a" }),
			}},
		},
		{
			name: "same IP and port in two slices: a non-terminating endpoint beats a terminating one",
			slices: []*discovery.EndpointSlice{
				escSlice("s-a", "svc", v4, http, escEndpoint("10.0.0.1", escTerminating, escOnNode("old"))),
				escSlice("s-b", "svc", v4, http, escEndpoint("10.0.0.1", escOnNode("new"))),
			},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {
				escEP("10.0.0.1:8080", func(e *Endpoint) { e.NodeName = "new" }),
			}},
		},
		{
			name: "same port name with different numbers in two slices keeps both",
			slices: []*discovery.EndpointSlice{
				escSlice("s1", "svc", v4, http, escEndpoint("10.0.0.1")),
				escSlice("s2", "svc", v4, []discovery.EndpointPort{escPort("http", 9090, v1.ProtocolTCP)}, escEndpoint("10.0.0.1")),
			},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {escEP("10.0.0.1:8080"), escEP("10.0.0.1:9090")}},
		},
		{
			name: "IPv4 cache ignores IPv6 and FQDN slices",
			slices: []*discovery.EndpointSlice{
				escSlice("s1", "svc", v4, http, escEndpoint("10.0.0.1")),
				escSlice("s2", "svc", v6, http, escEndpoint("fd00::1")),
				escSlice("s3", "svc", discovery.AddressTypeFQDN, http, escEndpoint("pod.example.com")),
			},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {escEP("10.0.0.1:8080")}},
		},
		{
			name:   "IPv6 cache uses only IPv6 slices",
			family: v1.IPv6Protocol,
			slices: []*discovery.EndpointSlice{
				escSlice("s1", "svc", v4, http, escEndpoint("10.0.0.1")),
				escSlice("s2", "svc", v6, http, escEndpoint("fd00::2"), escEndpoint("fd00::1")),
			},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {escEP("[fd00::1]:8080"), escEP("[fd00::2]:8080")}},
		},
		{
			name: "invalid, empty and wrong-family addresses are skipped",
			slices: []*discovery.EndpointSlice{escSlice("s1", "svc", v4, http,
				escEndpoint("10.0.0.1"),
				escEndpoint("not-an-ip"),
				escEndpoint("fd00::1"),
				discovery.Endpoint{},
			)},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {escEP("10.0.0.1:8080")}},
		},
		{
			name: "slice without the service-name label is ignored",
			slices: []*discovery.EndpointSlice{
				escSlice("orphan", "", v4, http, escEndpoint("10.0.0.1")),
			},
			want: EndpointsMap{},
		},
		{
			name: "several ports: unnamed, nil name and nil protocol defaulted, nil port skipped",
			slices: []*discovery.EndpointSlice{escSlice("s1", "svc", v4, []discovery.EndpointPort{
				escPort("", 8080, v1.ProtocolTCP),
				escPort("dns", 53, v1.ProtocolUDP),
				{Name: nil, Port: ptr.To[int32](7070), Protocol: ptr.To(v1.ProtocolSCTP)},
				{Name: ptr.To("defaulted"), Port: ptr.To[int32](6060)},
				{Name: ptr.To("noport"), Protocol: ptr.To(v1.ProtocolTCP)},
			}, escEndpoint("10.0.0.1"))},
			want: EndpointsMap{
				escSPN("", v1.ProtocolTCP):          {escEP("10.0.0.1:8080")},
				escSPN("dns", v1.ProtocolUDP):       {escEP("10.0.0.1:53")},
				escSPN("", v1.ProtocolSCTP):         {escEP("10.0.0.1:7070")},
				escSPN("defaulted", v1.ProtocolTCP): {escEP("10.0.0.1:6060")},
			},
		},
		{
			name: "slice without ports yields nothing",
			slices: []*discovery.EndpointSlice{
				escSlice("s1", "svc", v4, nil, escEndpoint("10.0.0.1")),
			},
			want: EndpointsMap{},
		},
		{
			name: "slice without endpoints yields nothing",
			slices: []*discovery.EndpointSlice{
				escSlice("s1", "svc", v4, http),
			},
			want: EndpointsMap{},
		},
		{
			name:     "node name, zone, local",
			nodeName: "node-a",
			slices: []*discovery.EndpointSlice{escSlice("s1", "svc", v4, http,
				escEndpoint("10.0.0.1", escOnNode("node-a"), func(e *discovery.Endpoint) { e.Zone = ptr.To("zone-1") }),
				escEndpoint("10.0.0.2", escOnNode("node-b")),
				escEndpoint("10.0.0.3"),
			)},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {
				escEP("10.0.0.1:8080", func(e *Endpoint) { e.NodeName, e.Zone, e.IsLocal = "node-a", "zone-1", true }),
				escEP("10.0.0.2:8080", func(e *Endpoint) { e.NodeName = "node-b" }),
				escEP("10.0.0.3:8080"),
			}},
		},
		{
			name: "no node name configured: nothing is local",
			slices: []*discovery.EndpointSlice{escSlice("s1", "svc", v4, http,
				escEndpoint("10.0.0.1", escOnNode("node-a")),
				escEndpoint("10.0.0.2", escOnNode("")),
			)},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {
				escEP("10.0.0.1:8080", func(e *Endpoint) { e.NodeName = "node-a" }),
				escEP("10.0.0.2:8080"),
			}},
		},
		{
			name: "zone and node hints",
			slices: []*discovery.EndpointSlice{escSlice("s1", "svc", v4, http,
				escEndpoint("10.0.0.1", func(e *discovery.Endpoint) {
					e.Hints = &discovery.EndpointHints{
						ForZones: []discovery.ForZone{{Name: "zone-1"}, {Name: "zone-2"}},
						ForNodes: []discovery.ForNode{{Name: "node-a"}},
					}
				}),
				escEndpoint("10.0.0.2", func(e *discovery.Endpoint) {
					e.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: "zone-2"}}}
				}),
				escEndpoint("10.0.0.3", func(e *discovery.Endpoint) { e.Hints = &discovery.EndpointHints{} }),
				escEndpoint("10.0.0.4"),
			)},
			want: EndpointsMap{escSPN("http", v1.ProtocolTCP): {
				escEP("10.0.0.1:8080", func(e *Endpoint) {
					e.ZoneHints = sets.New("zone-1", "zone-2")
					e.NodeHints = sets.New("node-a")
				}),
				escEP("10.0.0.2:8080", func(e *Endpoint) { e.ZoneHints = sets.New("zone-2") }),
				escEP("10.0.0.3:8080"),
				escEP("10.0.0.4:8080"),
			}},
		},
		{
			name: "slices of different services stay apart",
			slices: []*discovery.EndpointSlice{
				escSlice("s1", "svc", v4, http, escEndpoint("10.0.0.1")),
				escSlice("s2", "other", v4, http, escEndpoint("10.0.0.2")),
			},
			want: EndpointsMap{
				escSPN("http", v1.ProtocolTCP): {escEP("10.0.0.1:8080")},
				{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "other"}, Port: "http", Protocol: v1.ProtocolTCP}: {escEP("10.0.0.2:8080")},
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			family := tc.family
			if family == "" {
				family = v1.IPv4Protocol
			}
			tracker := NewEndpointsChangeTracker(EndpointsChangeTrackerOptions{Family: family, NodeName: tc.nodeName, Logger: logger})
			for _, s := range tc.slices {
				tracker.EndpointSliceUpdate(s, false)
			}
			got := EndpointsMap{}
			tracker.Apply(got)
			if !got.equal(tc.want) {
				t.Errorf("got\n%s\nwant\n%s", escDump(got), escDump(tc.want))
			}
			if cached := tracker.cache.EndpointsMap(escSvc); !cached.equal(filterEndpointsMapByService(tc.want, escSvc)) {
				t.Errorf("cache.EndpointsMap(%s) =\n%s\nwant the service's part of\n%s", escSvc, escDump(cached), escDump(tc.want))
			}
		})
	}
}

func filterEndpointsMapByService(m EndpointsMap, nn types.NamespacedName) EndpointsMap {
	out := EndpointsMap{}
	for name, eps := range m {
		if name.NamespacedName == nn {
			out[name] = eps
		}
	}
	return out
}

func TestEndpointSliceCacheOrderIndependent(t *testing.T) {
	http := []discovery.EndpointPort{escPort("http", 8080, v1.ProtocolTCP)}
	a := escSlice("s-a", "svc", discovery.AddressTypeIPv4, http, escEndpoint("10.0.0.1", escOnNode("node-a")), escEndpoint("10.0.0.3"))
	b := escSlice("s-b", "svc", discovery.AddressTypeIPv4, http, escEndpoint("10.0.0.1", escOnNode("node-b")), escEndpoint("10.0.0.2"))

	var results []EndpointsMap
	for _, order := range [][]*discovery.EndpointSlice{{a, b}, {b, a}} {
		cache := NewEndpointSliceCache(EndpointSliceCacheOptions{Family: v1.IPv4Protocol})
		for _, s := range order {
			if _, _, _, _, err := cache.updatePending(s, false); err != nil {
				t.Fatalf("updatePending(%s): %v", s.Name, err)
			}
		}
		cache.checkoutChanges()
		results = append(results, cache.EndpointsMap(escSvc))
	}
	if !results[0].equal(results[1]) {
		t.Errorf("merge depends on update order:\n%s\nvs\n%s", escDump(results[0]), escDump(results[1]))
	}
	want := EndpointsMap{escSPN("http", v1.ProtocolTCP): {
		escEP("10.0.0.1:8080", func(e *Endpoint) { e.NodeName = "node-a" }),
		escEP("10.0.0.2:8080"),
		escEP("10.0.0.3:8080"),
	}}
	if !results[0].equal(want) {
		t.Errorf("got\n%s\nwant\n%s", escDump(results[0]), escDump(want))
	}
}
