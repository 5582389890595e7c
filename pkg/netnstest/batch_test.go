package netnstest

import (
	"net/netip"
	"strings"
	"testing"
)

func TestIPBatchAndSysctl(t *testing.T) {
	RequireRoot(t)
	n := New(t, "batch")
	n.IPBatch(t,
		AddrAddCommand("lo", netip.MustParsePrefix("10.204.0.1/32")),
		AddrAddCommand("lo", netip.MustParsePrefix("fd00:204::1/128")),
		"route add 10.204.1.0/24 dev lo",
	)
	addrs := n.Run(t, "ip", "-o", "addr", "show", "dev", "lo")
	for _, want := range []string{"10.204.0.1/32", "fd00:204::1/128"} {
		if !strings.Contains(addrs, want) {
			t.Errorf("address %s missing on lo:\n%s", want, addrs)
		}
	}
	if routes := n.Run(t, "ip", "route", "show"); !strings.Contains(routes, "10.204.1.0/24 dev lo") {
		t.Errorf("route missing:\n%s", routes)
	}

	other := New(t, "batch")
	for _, key := range []string{"net.ipv4.ip_forward", "net/ipv6/conf/all/forwarding"} {
		n.Sysctl(t, key, "1")
		if got := strings.TrimSpace(n.Run(t, "sysctl", "-n", key)); got != "1" {
			t.Errorf("%s in %s = %q, want 1", key, n.Name, got)
		}
		if got := strings.TrimSpace(other.Run(t, "sysctl", "-n", key)); got != "0" {
			t.Errorf("%s in %s = %q: Sysctl leaked out of its namespace", key, other.Name, got)
		}
	}
}

func TestAddrAddCommand(t *testing.T) {
	for _, tc := range []struct {
		addr string
		want string
	}{
		{"10.0.0.1/24", "addr add 10.0.0.1/24 dev eth0"},
		{"fd00::1/64", "addr add fd00::1/64 dev eth0 nodad"},
	} {
		if got := AddrAddCommand("eth0", netip.MustParsePrefix(tc.addr)); got != tc.want {
			t.Errorf("AddrAddCommand(%s) = %q, want %q", tc.addr, got, tc.want)
		}
	}
}

func TestRequestWithSource(t *testing.T) {
	RequireRoot(t)
	client, server := pair(t)
	// A second address of each family on the client's end of the link.
	second := []netip.Prefix{netip.MustParsePrefix("10.201.0.3/24"), netip.MustParsePrefix("fd00:201::3/64")}
	dev := strings.Fields(client.Run(t, "ip", "-o", "-4", "addr", "show", "to", clientV4.Addr().String()))[1]
	client.IPBatch(t, AddrAddCommand(dev, second[0]), AddrAddCommand(dev, second[1]))
	server.StartEcho(t, "tcp4", serverV4.Addr().String()+":8080", "s")
	server.StartEcho(t, "udp6", "["+serverV6.Addr().String()+"]:8080", "s6")
	for _, tc := range []struct {
		network, addr, name string
		source              netip.Addr
	}{
		{"tcp4", serverV4.Addr().String() + ":8080", "s", second[0].Addr()},
		{"tcp4", serverV4.Addr().String() + ":8080", "s", clientV4.Addr()},
		{"udp6", "[" + serverV6.Addr().String() + "]:8080", "s6", second[1].Addr()},
	} {
		reply, err := RequestWith(t.Context(), client, tc.network, tc.addr, RequestOptions{Source: tc.source})
		if err != nil {
			t.Fatal(err)
		}
		checkReply(t, reply, tc.name, tc.source)
	}
}

func TestParseEchoReply(t *testing.T) {
	for _, tc := range []struct {
		reply, name, client string
		bad                 bool
	}{
		{reply: "be1 10.0.0.1:4000", name: "be1", client: "10.0.0.1:4000"},
		{reply: "10.244.1.5:8080 [fd00::1]:4000", name: "10.244.1.5:8080", client: "[fd00::1]:4000"},
		{reply: "be1", bad: true},
		{reply: "be1 10.0.0.1", bad: true},
	} {
		name, client, err := ParseEchoReply(tc.reply)
		if tc.bad {
			if err == nil {
				t.Errorf("ParseEchoReply(%q) = %q, %v; want an error", tc.reply, name, client)
			}
			continue
		}
		if err != nil || name != tc.name || client.String() != tc.client {
			t.Errorf("ParseEchoReply(%q) = %q, %v, %v; want %q, %s", tc.reply, name, client, err, tc.name, tc.client)
		}
	}
}
