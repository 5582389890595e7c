package conntrack

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2/ktesting"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// realTopology is a throwaway namespace acting as a node, linked to a peer
// namespace (the gateway of the service range, which drops what it gets):
// the node's addresses (10.0.0.1-3) double as the endpoints (port 5353),
// and nat OUTPUT rules DNAT like kproxy's rules would. Each client flow has its own source port so that
// the test can name it.
type realTopology struct {
	ns *netnstest.NS
	ct *Real
}

// Client source ports, one per flow.
const (
	sportSvcToEP1    = 40001 // 10.96.0.10:53 -> 10.0.0.1:5353
	sportSvcToEP2    = 40002 // 10.96.0.10:53 -> 10.0.0.2:5353
	sportOtherSvcEP1 = 40003 // 10.96.0.20:53 -> 10.0.0.1:5353
	sportNodePortEP1 = 40004 // 10.0.0.3:30053 -> 10.0.0.1:5353
	sportBlackHoled  = 40005 // 10.96.0.30:161, no DNAT, sent to the peer
	sportAltPortEP1  = 40006 // 10.96.0.10:5300 -> 10.0.0.1:5301
)

func newRealTopology(t *testing.T) *realTopology {
	t.Helper()
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "ct")
	peer := netnstest.New(t, "ctpeer")
	veth := netnstest.Link(t, ns, netip.MustParsePrefix("10.0.0.1/24"), peer, netip.MustParsePrefix("10.0.0.254/24"))
	for _, a := range []string{"10.0.0.2/32", "10.0.0.3/32"} {
		ns.AddAddr(t, veth.A, netip.MustParsePrefix(a))
	}
	ns.Run(t, "ip", "route", "add", "10.96.0.0/16", "via", "10.0.0.254", "src", "10.0.0.1")
	for _, r := range [][]string{
		{"-d", "10.96.0.10", "--dport", "53", "--sport", fmt.Sprint(sportSvcToEP1), "-j", "DNAT", "--to-destination", "10.0.0.1:5353"},
		{"-d", "10.96.0.10", "--dport", "53", "--sport", fmt.Sprint(sportSvcToEP2), "-j", "DNAT", "--to-destination", "10.0.0.2:5353"},
		{"-d", "10.96.0.20", "--dport", "53", "-j", "DNAT", "--to-destination", "10.0.0.1:5353"},
		{"-d", "10.0.0.3", "--dport", "30053", "-j", "DNAT", "--to-destination", "10.0.0.1:5353"},
		{"-d", "10.96.0.10", "--dport", "5300", "-j", "DNAT", "--to-destination", "10.0.0.1:5301"},
	} {
		ns.Run(t, "iptables", append([]string{"-w", "-t", "nat", "-A", "OUTPUT", "-p", "udp"}, r...)...)
	}
	ns.StartEcho(t, "udp4", "10.0.0.1:5353", "ep1")
	ns.StartEcho(t, "udp4", "10.0.0.2:5353", "ep2")
	ns.StartEcho(t, "udp4", "10.0.0.1:5301", "ep1-alt")
	ct, err := New(Options{NetNS: ns.Name})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { ct.Close() })
	return &realTopology{ns: ns, ct: ct}
}

// send sends one datagram from sport to dst; with wantReply it waits for
// the echo, so the flow has been seen both ways.
func (r *realTopology) send(t *testing.T, sport int, dst string, wantReply bool) {
	t.Helper()
	var c *net.UDPConn
	err := r.ns.Do(func() error {
		var err error
		c, err = net.DialUDP("udp4", &net.UDPAddr{Port: sport}, net.UDPAddrFromAddrPort(netip.MustParseAddrPort(dst)))
		if err != nil {
			return err
		}
		_, err = c.Write([]byte("ping"))
		return err
	})
	if err != nil {
		t.Fatalf("sending from port %d to %s: %v", sport, dst, err)
	}
	defer c.Close()
	if !wantReply {
		return
	}
	if err := c.SetReadDeadline(time.Now().Add(netnstest.DefaultRequestTimeout)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	if _, err := c.Read(buf); err != nil {
		t.Fatalf("no reply from %s to port %d: %v", dst, sport, err)
	}
}

// makeFlows creates one conntrack entry per client source port.
func (r *realTopology) makeFlows(t *testing.T) {
	t.Helper()
	r.send(t, sportSvcToEP1, "10.96.0.10:53", true)
	r.send(t, sportSvcToEP2, "10.96.0.10:53", true)
	r.send(t, sportOtherSvcEP1, "10.96.0.20:53", true)
	r.send(t, sportNodePortEP1, "10.0.0.3:30053", true)
	r.send(t, sportBlackHoled, "10.96.0.30:161", false)
	r.send(t, sportAltPortEP1, "10.96.0.10:5300", true)
}

// clientPorts returns the client source ports of the namespace's UDP
// flows, from the netlink list.
func (r *realTopology) clientPorts(t *testing.T) []int {
	t.Helper()
	flows, err := r.ct.ListEntries(context.Background(), v1.IPv4Protocol)
	if err != nil {
		t.Fatalf("ListEntries: %v", err)
	}
	var out []int
	for _, f := range flows {
		if f.Protocol == v1.ProtocolUDP {
			out = append(out, int(f.Original.Src.Port()))
		}
	}
	slices.Sort(out)
	return out
}

// conntrackToolPorts returns the same from `conntrack -L`, an independent
// reader of the table.
func (r *realTopology) conntrackToolPorts(t *testing.T) []int {
	t.Helper()
	out, err := r.ns.Exec(context.Background(), "conntrack", "-L", "-p", "udp")
	if err != nil {
		t.Fatalf("conntrack -L: %v", err)
	}
	var ports []int
	for _, line := range strings.Split(string(out), "\n") {
		for _, field := range strings.Fields(line) {
			var p int
			if _, err := fmt.Sscanf(field, "sport=%d", &p); err == nil {
				ports = append(ports, p)
				break // the first sport= is the original direction's
			}
		}
	}
	slices.Sort(ports)
	return ports
}

func realServices() proxy.ServicePortMap {
	dns := portName("dns", "dns", v1.ProtocolUDP)
	alt := portName("dns", "alt", v1.ProtocolUDP)
	other := portName("other", "dns", v1.ProtocolUDP)
	snmp := portName("snmp", "snmp", v1.ProtocolUDP)
	return proxy.ServicePortMap{
		dns:   {Name: dns, ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 53, Protocol: v1.ProtocolUDP, NodePort: 30053},
		alt:   {Name: alt, ClusterIP: netip.MustParseAddr("10.96.0.10"), Port: 5300, Protocol: v1.ProtocolUDP},
		other: {Name: other, ClusterIP: netip.MustParseAddr("10.96.0.20"), Port: 53, Protocol: v1.ProtocolUDP},
		snmp:  {Name: snmp, ClusterIP: netip.MustParseAddr("10.96.0.30"), Port: 161, Protocol: v1.ProtocolUDP},
	}
}

// realCurrent is the state after the sync: every service but "other" has
// a serving endpoint that no test flow uses.
func realCurrent() Current {
	return Current{
		Services: realServices(),
		Endpoints: proxy.EndpointsMap{
			portName("dns", "dns", v1.ProtocolUDP):   {servingEP("10.0.0.3:5353")},
			portName("dns", "alt", v1.ProtocolUDP):   {servingEP("10.0.0.3:5301")},
			portName("snmp", "snmp", v1.ProtocolUDP): {servingEP("10.0.0.3:161")},
		},
	}
}

// TestRealCleanStaleEntries creates real UDP conntrack entries through DNAT
// rules and deletes the stale ones with the netlink implementation.
func TestRealCleanStaleEntries(t *testing.T) {
	all := []int{sportSvcToEP1, sportSvcToEP2, sportOtherSvcEP1, sportNodePortEP1, sportBlackHoled, sportAltPortEP1}
	for _, tc := range []struct {
		name  string
		stale StaleEntries
		// cur defaults to realCurrent().
		cur         *Current
		wantDeleted []int
	}{
		{name: "nothing stale"},
		{
			name:        "deleted endpoint: via the ClusterIP and the node port, not via another service or port",
			stale:       StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.0.0.1:5353", ServicePortName: portName("dns", "dns", v1.ProtocolUDP)}}},
			wantDeleted: []int{sportSvcToEP1, sportNodePortEP1},
		},
		{
			name:  "deleted endpoint now terminating but serving: nothing",
			stale: StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.0.0.1:5353", ServicePortName: portName("dns", "dns", v1.ProtocolUDP)}}},
			cur: func() *Current {
				cur := realCurrent()
				cur.Endpoints[portName("dns", "dns", v1.ProtocolUDP)] = []*proxy.Endpoint{terminatingEP("10.0.0.1:5353")}
				return &cur
			}(),
		},
		{
			name:  "deleted ClusterIP of a deleted service: every UDP flow to it",
			stale: StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.10")},
			cur: func() *Current {
				cur := realCurrent()
				delete(cur.Services, portName("dns", "dns", v1.ProtocolUDP))
				delete(cur.Services, portName("dns", "alt", v1.ProtocolUDP))
				return &cur
			}(),
			wantDeleted: []int{sportSvcToEP1, sportSvcToEP2, sportAltPortEP1},
		},
		{
			name:  "deleted ClusterIP still used by a UDP port: nothing",
			stale: StaleEntries{DeletedUDPClusterIPs: sets.New("10.96.0.10")},
		},
		{
			name:        "newly active service: the black-holed flow",
			stale:       StaleEntries{NewlyActiveUDPServices: []proxy.ServicePortName{portName("snmp", "snmp", v1.ProtocolUDP)}},
			wantDeleted: []int{sportBlackHoled},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			topo := newRealTopology(t)
			topo.makeFlows(t)
			if got := topo.clientPorts(t); !slices.Equal(got, all) {
				t.Fatalf("flows before cleaning: client ports %v, want %v", got, all)
			}
			cur := realCurrent()
			if tc.cur != nil {
				cur = *tc.cur
			}
			n, err := CleanStaleEntries(ctx, topo.ct, v1.IPv4Protocol, cur, tc.stale)
			if err != nil {
				t.Fatalf("CleanStaleEntries: %v", err)
			}
			if n != len(tc.wantDeleted) {
				t.Errorf("deleted %d entries, want %d", n, len(tc.wantDeleted))
			}
			want := slices.DeleteFunc(slices.Clone(all), func(p int) bool { return slices.Contains(tc.wantDeleted, p) })
			if got := topo.clientPorts(t); !slices.Equal(got, want) {
				t.Errorf("netlink list after cleaning: client ports %v, want %v", got, want)
			}
			if _, err := exec.LookPath("conntrack"); err != nil {
				t.Logf("not cross-checking with conntrack -L: %v", err)
			} else if got := topo.conntrackToolPorts(t); !slices.Equal(got, want) {
				t.Errorf("conntrack -L after cleaning: client ports %v, want %v", got, want)
			}
		})
	}
}

// TestRealStaleEntryRedirect shows what the cleaning is for: a UDP client
// re-using its socket keeps reaching the old endpoint after the rules moved
// the service to a new one, until the stale entry is deleted.
func TestRealStaleEntryRedirect(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	topo := newRealTopology(t)
	rule := func(op, to string) {
		topo.ns.Run(t, "iptables", "-w", "-t", "nat", op, "OUTPUT", "-p", "udp", "-d", "10.96.0.40", "--dport", "53", "-j", "DNAT", "--to-destination", to)
	}
	rule("-I", "10.0.0.1:5353")
	var c *net.UDPConn
	if err := topo.ns.Do(func() error {
		var err error
		c, err = net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(netip.MustParseAddrPort("10.96.0.40:53")))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ask := func() string {
		t.Helper()
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if err := c.SetReadDeadline(time.Now().Add(netnstest.DefaultRequestTimeout)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 512)
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("no reply: %v", err)
		}
		name, _, _ := strings.Cut(string(buf[:n]), " ")
		return name
	}
	if got := ask(); got != "ep1" {
		t.Fatalf("first request answered by %q, want ep1", got)
	}
	// The endpoint is replaced: the rules now lead to ep2.
	rule("-D", "10.0.0.1:5353")
	rule("-I", "10.0.0.2:5353")
	if got := ask(); got != "ep1" {
		t.Fatalf("before cleaning, the stale entry should still lead to ep1; answered by %q", got)
	}
	svc := portName("dns", "dns", v1.ProtocolUDP)
	services := proxy.ServicePortMap{svc: {Name: svc, ClusterIP: netip.MustParseAddr("10.96.0.40"), Port: 53, Protocol: v1.ProtocolUDP}}
	stale := StaleEntries{DeletedUDPEndpoints: []proxy.ServiceEndpoint{{Endpoint: "10.0.0.1:5353", ServicePortName: svc}}}
	cur := Current{Services: services, Endpoints: proxy.EndpointsMap{svc: {servingEP("10.0.0.2:5353")}}}
	if n, err := CleanStaleEntries(ctx, topo.ct, v1.IPv4Protocol, cur, stale); err != nil || n != 1 {
		t.Fatalf("CleanStaleEntries = %d, %v; want 1, nil", n, err)
	}
	if got := ask(); got != "ep2" {
		t.Errorf("after cleaning, the same socket is answered by %q, want ep2", got)
	}
}
