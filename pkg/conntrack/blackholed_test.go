package conntrack

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2/ktesting"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// tcpFlow is flow with a TCP state.
func tcpFlow(state uint8, src, dst, replySrc string) Flow {
	f := flow(v1.ProtocolTCP, src, dst, replySrc)
	f.TCPState = state
	return f
}

// tcpEstablished is conntrack's TCP_CONNTRACK_ESTABLISHED.
const tcpEstablished = 3

func TestCleanBlackHoled(t *testing.T) {
	flows := map[string]Flow{
		"udp to a ClusterIP, not DNATed":             flow(v1.ProtocolUDP, "10.0.0.9:41001", "10.96.0.30:161", "10.96.0.30:161"),
		"udp to an external IP, not DNATed":          flow(v1.ProtocolUDP, "203.0.113.7:41002", "192.0.2.30:161", "192.0.2.30:161"),
		"udp to a load-balancer IP, not DNATed":      flow(v1.ProtocolUDP, "203.0.113.7:41003", "198.51.100.10:53", "198.51.100.10:53"),
		"udp to a ClusterIP, DNATed":                 flow(v1.ProtocolUDP, "10.0.0.9:41004", "10.96.0.10:53", "10.244.1.5:5353"),
		"tcp SYN_SENT to a ClusterIP, not DNATed":    tcpFlow(TCPStateSynSent, "10.0.0.9:41005", "10.96.0.10:53", "10.96.0.10:53"),
		"tcp SYN_SENT to a ClusterIP, DNATed":        tcpFlow(TCPStateSynSent, "10.0.0.9:41006", "10.96.0.10:53", "10.244.1.5:5353"),
		"tcp established to a ClusterIP, not DNATed": tcpFlow(tcpEstablished, "10.0.0.9:41007", "10.96.0.10:53", "10.96.0.10:53"),
		"tcp SYN_SENT to a port no service has":      tcpFlow(TCPStateSynSent, "10.0.0.9:41008", "10.96.0.10:80", "10.96.0.10:80"),
		"udp to another port of a ClusterIP":         flow(v1.ProtocolUDP, "10.0.0.9:41009", "10.96.0.30:162", "10.96.0.30:162"),
		"udp to a node port, not DNATed":             flow(v1.ProtocolUDP, "203.0.113.7:41010", testNodes+":30161", testNodes+":30161"),
		"udp to the internet":                        flow(v1.ProtocolUDP, "10.0.0.9:41011", "8.8.8.8:53", "8.8.8.8:53"),
		"udp6 to a ClusterIP, not DNATed":            flow(v1.ProtocolUDP, "[fd00:1::9]:41012", "[fd00::10]:53", "[fd00::10]:53"),
		"tcp SYN_SENT to the internet":               tcpFlow(TCPStateSynSent, "10.0.0.9:41013", "8.8.8.8:53", "8.8.8.8:53"),
	}
	names := func(fs []Flow) []string {
		var out []string
		for _, f := range fs {
			for name, g := range flows {
				if f == g {
					out = append(out, name)
				}
			}
		}
		slices.Sort(out)
		return out
	}
	all := func() []Flow {
		var out []Flow
		for _, f := range flows {
			out = append(out, f)
		}
		return out
	}
	for _, tc := range []struct {
		name        string
		family      v1.IPFamily
		services    proxy.ServicePortMap
		wantDeleted []string
	}{
		{
			name:   "IPv4: the flows to service addresses that were never DNATed nor answered",
			family: v1.IPv4Protocol,
			wantDeleted: []string{
				"tcp SYN_SENT to a ClusterIP, not DNATed",
				"udp to a ClusterIP, not DNATed",
				"udp to a load-balancer IP, not DNATed",
				"udp to an external IP, not DNATed",
			},
		},
		{
			name:        "IPv6: its own family only",
			family:      v1.IPv6Protocol,
			wantDeleted: []string{"udp6 to a ClusterIP, not DNATed"},
		},
		{
			name:     "no services: nothing",
			family:   v1.IPv4Protocol,
			services: proxy.ServicePortMap{},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			services := tc.services
			if services == nil {
				services = testServices()
			}
			ct := NewFake(all()...)
			n, err := CleanBlackHoled(ctx, ct, tc.family, services)
			if err != nil {
				t.Fatalf("CleanBlackHoled: %v", err)
			}
			left := names(ct.Flows())
			var deleted []string
			for name := range flows {
				if !slices.Contains(left, name) {
					deleted = append(deleted, name)
				}
			}
			slices.Sort(deleted)
			if !slices.Equal(deleted, tc.wantDeleted) {
				t.Errorf("deleted %q, want %q", deleted, tc.wantDeleted)
			}
			if n != len(tc.wantDeleted) {
				t.Errorf("CleanBlackHoled returned %d, want %d", n, len(tc.wantDeleted))
			}
		})
	}
}

func TestCleanBlackHoledError(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	ct := NewFake(flow(v1.ProtocolUDP, "10.0.0.9:41001", "10.96.0.30:161", "10.96.0.30:161"))
	boom := errors.New("netlink refused")
	ct.FailNextClear(boom)
	if _, err := CleanBlackHoled(ctx, ct, v1.IPv4Protocol, testServices()); !errors.Is(err, boom) {
		t.Fatalf("CleanBlackHoled error %v, want %v", err, boom)
	}
}

// TestRealCleanBlackHoled makes real entries: TCP connections to a
// service address that no rule DNATs (the peer drops them: SYN_SENT, as
// while kproxy's rules were flushed), one that a rule DNATs to a local
// server, and an unanswered one to an address of no service. Only the
// first kind goes; a new connection from the same source port then
// follows the rule instead of the dead entry.
func TestRealCleanBlackHoled(t *testing.T) {
	r := newRealTopology(t)
	_, ctx := ktesting.NewTestContext(t)
	const (
		sportBlackHoledTCP = 41001 // 10.96.0.50:80, no rule yet
		sportDNATedTCP     = 41002 // 10.96.0.60:80 -> 10.0.0.1:8080
		sportNoService     = 41003 // 10.96.0.70:80, no service
	)
	r.ns.StartEcho(t, "tcp4", "10.0.0.1:8080", "web")
	dial := func(sport int, dst string, timeout time.Duration) error {
		return r.ns.Do(func() error {
			d := net.Dialer{LocalAddr: &net.TCPAddr{Port: sport}, Timeout: timeout}
			c, err := d.DialContext(ctx, "tcp4", dst)
			if err != nil {
				return err
			}
			return c.Close()
		})
	}
	dnat := func(dst string) []string {
		return []string{"-w", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", dst, "--dport", "80", "-j", "DNAT", "--to-destination", "10.0.0.1:8080"}
	}
	r.ns.Run(t, "iptables", dnat("10.96.0.60")...)
	if err := dial(sportDNATedTCP, "10.96.0.60:80", 2*time.Second); err != nil {
		t.Fatalf("connecting through the DNAT rule: %v", err)
	}
	if err := dial(sportBlackHoledTCP, "10.96.0.50:80", 200*time.Millisecond); err == nil {
		t.Fatal("a connection to 10.96.0.50:80 without a rule succeeded")
	}
	if err := dial(sportNoService, "10.96.0.70:80", 200*time.Millisecond); err == nil {
		t.Fatal("a connection to 10.96.0.70:80 succeeded")
	}
	tcpPorts := func() []int {
		flows, err := r.ct.ListEntries(ctx, v1.IPv4Protocol)
		if err != nil {
			t.Fatalf("ListEntries: %v", err)
		}
		var out []int
		for _, f := range flows {
			if f.Protocol == v1.ProtocolTCP {
				out = append(out, int(f.Original.Src.Port()))
			}
		}
		slices.Sort(out)
		return out
	}
	if got, want := tcpPorts(), []int{sportBlackHoledTCP, sportDNATedTCP, sportNoService}; !slices.Equal(got, want) {
		t.Fatalf("TCP flows from ports %v before the cleanup, want %v", got, want)
	}
	// The rule arrives (the sync that closes the gap)...
	r.ns.Run(t, "iptables", dnat("10.96.0.50")...)
	// ... but the dead entry still catches the same source port.
	if err := dial(sportBlackHoledTCP, "10.96.0.50:80", 500*time.Millisecond); err == nil {
		t.Fatal("the new connection from the black-holed flow's port succeeded before the cleanup: the test no longer shows the problem")
	}
	tcpSvc := func(name, ip string) (proxy.ServicePortName, *proxy.ServicePort) {
		pn := portName(name, "http", v1.ProtocolTCP)
		return pn, &proxy.ServicePort{Name: pn, ClusterIP: netip.MustParseAddr(ip), Port: 80, Protocol: v1.ProtocolTCP}
	}
	services := proxy.ServicePortMap{}
	for name, ip := range map[string]string{"blackholed": "10.96.0.50", "dnated": "10.96.0.60"} {
		pn, sp := tcpSvc(name, ip)
		services[pn] = sp
	}
	n, err := CleanBlackHoled(ctx, r.ct, v1.IPv4Protocol, services)
	if err != nil {
		t.Fatalf("CleanBlackHoled: %v", err)
	}
	if n != 1 {
		t.Errorf("CleanBlackHoled deleted %d entries, want 1", n)
	}
	if got, want := tcpPorts(), []int{sportDNATedTCP, sportNoService}; !slices.Equal(got, want) {
		t.Errorf("TCP flows from ports %v after the cleanup, want %v", got, want)
	}
	if err := dial(sportBlackHoledTCP, "10.96.0.50:80", 2*time.Second); err != nil {
		t.Errorf("a new connection from the black-holed flow's port after the cleanup: %v", err)
	}
}
