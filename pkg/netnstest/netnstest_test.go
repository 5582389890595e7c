package netnstest

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Set KPT_NETNS_SWEEP (see MainWithSweep) to remove leftovers of crashed runs.
func TestMain(m *testing.M) { os.Exit(MainWithSweep(m)) }

var (
	clientV4 = netip.MustParsePrefix("10.201.0.1/24")
	serverV4 = netip.MustParsePrefix("10.201.0.2/24")
	clientV6 = netip.MustParsePrefix("fd00:201::1/64")
	serverV6 = netip.MustParsePrefix("fd00:201::2/64")
)

// pair makes a client and a server namespace joined by one dual-stack veth.
func pair(t *testing.T) (client, server *NS) {
	t.Helper()
	client = New(t, "cli")
	server = New(t, "srv")
	v := Link(t, client, clientV4, server, serverV4)
	client.AddAddr(t, v.A, clientV6)
	server.AddAddr(t, v.B, serverV6)
	return client, server
}

// namespaces lists the named namespaces.
func namespaces(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(netnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// checkReply asserts reply is "<name> <client ip:port>" with the given ip.
func checkReply(t *testing.T, reply, name string, client netip.Addr) {
	t.Helper()
	i := strings.LastIndexByte(reply, ' ')
	if i < 0 || reply[:i] != name {
		t.Fatalf("reply %q: want it to start with %q", reply, name+" ")
	}
	ap, err := netip.ParseAddrPort(reply[i+1:])
	if err != nil {
		t.Fatalf("reply %q: client address: %v", reply, err)
	}
	if ap.Addr() != client || ap.Port() == 0 {
		t.Fatalf("reply %q: client %v, want %v with a port", reply, ap, client)
	}
}

func TestEchoOverLink(t *testing.T) {
	RequireRoot(t)
	client, server := pair(t)
	cases := []struct {
		name    string
		network string
		listen  string
		target  string
		client  netip.Addr
	}{
		{"tcp4", "tcp4", "10.201.0.2:8080", "10.201.0.2:8080", clientV4.Addr()},
		{"udp4", "udp4", "10.201.0.2:8080", "10.201.0.2:8080", clientV4.Addr()},
		{"tcp6", "tcp6", "[fd00:201::2]:8080", "[fd00:201::2]:8080", clientV6.Addr()},
		{"udp6", "udp6", "[fd00:201::2]:8080", "[fd00:201::2]:8080", clientV6.Addr()},
		{"tcp wildcard", "tcp", ":9090", "10.201.0.2:9090", clientV4.Addr()},
		{"tcp port zero", "tcp4", "10.201.0.2:0", "", clientV4.Addr()},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			bound := server.StartEcho(t, tc.network, tc.listen, "echo-"+tc.name)
			target := tc.target
			if target == "" {
				target = bound
			}
			// Several requests: every connection or datagram is answered.
			for range 3 {
				reply, err := Request(t.Context(), client, tc.network, target)
				if err != nil {
					t.Fatal(err)
				}
				checkReply(t, reply, "echo-"+tc.name, tc.client)
			}
		})
	}
}

func TestNSRequestClassification(t *testing.T) {
	RequireRoot(t)
	client, server := pair(t)
	cases := []struct {
		name    string
		network string
		addr    string
		// iptables (or ip6tables) INPUT rule in the server namespace.
		rule    []string
		cmd     string
		wantErr error
		// wantErrno, when set, must also be in the chain.
		wantErrno syscall.Errno
	}{
		{
			name: "tcp closed port", network: "tcp4", addr: "10.201.0.2:7001",
			wantErr: ErrRefused, wantErrno: syscall.ECONNREFUSED,
		},
		{
			name: "udp closed port", network: "udp4", addr: "10.201.0.2:7002",
			wantErr: ErrRefused, wantErrno: syscall.ECONNREFUSED,
		},
		{
			name: "tcp6 closed port", network: "tcp6", addr: "[fd00:201::2]:7003",
			wantErr: ErrRefused, wantErrno: syscall.ECONNREFUSED,
		},
		{
			name: "tcp drop", network: "tcp4", addr: "10.201.0.2:7004",
			cmd: "iptables", rule: []string{"-p", "tcp", "--dport", "7004", "-j", "DROP"},
			wantErr: ErrTimeout,
		},
		{
			name: "udp drop", network: "udp4", addr: "10.201.0.2:7005",
			cmd: "iptables", rule: []string{"-p", "udp", "--dport", "7005", "-j", "DROP"},
			wantErr: ErrTimeout,
		},
		{
			name: "udp6 drop", network: "udp6", addr: "[fd00:201::2]:7006",
			cmd: "ip6tables", rule: []string{"-p", "udp", "--dport", "7006", "-j", "DROP"},
			wantErr: ErrTimeout,
		},
		{
			name: "tcp reject port unreachable", network: "tcp4", addr: "10.201.0.2:7007",
			cmd: "iptables", rule: []string{"-p", "tcp", "--dport", "7007", "-j", "REJECT"},
			wantErr: ErrRefused, wantErrno: syscall.ECONNREFUSED,
		},
		{
			name: "udp reject port unreachable", network: "udp4", addr: "10.201.0.2:7008",
			cmd: "iptables", rule: []string{"-p", "udp", "--dport", "7008", "-j", "REJECT"},
			wantErr: ErrRefused, wantErrno: syscall.ECONNREFUSED,
		},
		{
			name: "tcp reject admin prohibited", network: "tcp4", addr: "10.201.0.2:7009",
			cmd:     "iptables",
			rule:    []string{"-p", "tcp", "--dport", "7009", "-j", "REJECT", "--reject-with", "icmp-admin-prohibited"},
			wantErr: ErrRefused, wantErrno: syscall.EHOSTUNREACH,
		},
		{
			name: "tcp6 reject admin prohibited", network: "tcp6", addr: "[fd00:201::2]:7010",
			cmd:     "ip6tables",
			rule:    []string{"-p", "tcp", "--dport", "7010", "-j", "REJECT", "--reject-with", "icmp6-adm-prohibited"},
			wantErr: ErrRefused, wantErrno: syscall.EACCES,
		},
		{
			name: "tcp reset", network: "tcp4", addr: "10.201.0.2:7011",
			cmd:     "iptables",
			rule:    []string{"-p", "tcp", "--dport", "7011", "-j", "REJECT", "--reject-with", "tcp-reset"},
			wantErr: ErrRefused, wantErrno: syscall.ECONNREFUSED,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.rule != nil {
				server.Run(t, tc.cmd, append([]string{"-w", "5", "-A", "INPUT"}, tc.rule...)...)
			}
			// A silent drop needs only a short wait. An ICMP error answering the
			// very first SYN can arrive while connect() still holds the socket
			// lock on a veth, and the kernel then ignores it
			// (TcpExtLockDroppedIcmps); the one answering the retransmitted SYN
			// a second later counts. So refusals get a longer deadline.
			timeout := 300 * time.Millisecond
			if tc.wantErr == ErrRefused {
				timeout = 5 * time.Second
			}
			ctx, cancel := context.WithTimeout(t.Context(), timeout)
			defer cancel()
			reply, err := Request(ctx, client, tc.network, tc.addr)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("Request = %q, %v; want %v", reply, err, tc.wantErr)
			}
			for _, other := range []error{ErrRefused, ErrTimeout} {
				if other != tc.wantErr && errors.Is(err, other) {
					t.Errorf("error %v is also %v", err, other)
				}
			}
			if tc.wantErrno != 0 && !errors.Is(err, tc.wantErrno) {
				t.Errorf("error %v does not carry errno %v", err, tc.wantErrno)
			}
		})
	}
}

func TestNSDoIsolation(t *testing.T) {
	RequireRoot(t)
	n := New(t, "do")
	// A listener on loopback inside the namespace is invisible outside it.
	l, err := n.Listen(t.Context(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	addr := l.Addr().String()

	inside, err := n.Dial(t.Context(), "tcp4", addr)
	if err != nil {
		t.Fatalf("dial inside namespace: %v", err)
	}
	_ = inside.Close()
	if c, err := (&net.Dialer{}).DialContext(t.Context(), "tcp4", addr); err == nil {
		_ = c.Close()
		t.Fatalf("dial %s from the test's namespace succeeded; the listener leaked out of %s", addr, n.Name)
	} else if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dial from the test's namespace: %v, want connection refused", err)
	}

	// Do reports fn's error and leaves the caller's namespace alone.
	want := errors.New("from fn")
	if err := n.Do(func() error { return want }); !errors.Is(err, want) {
		t.Fatalf("Do = %v, want %v", err, want)
	}
	// The namespace's only interface is lo.
	out := n.Run(t, "ip", "-o", "link", "show")
	if got := strings.Count(out, "\n"); got != 1 || !strings.Contains(out, " lo:") {
		t.Fatalf("links in new namespace:\n%s\nwant only lo", out)
	}
}

func TestLinkRoutedThroughRouter(t *testing.T) {
	RequireRoot(t)
	a := New(t, "a")
	r := New(t, "r")
	b := New(t, "b")
	va := Link(t, a, netip.MustParsePrefix("10.202.1.1/24"), r, netip.MustParsePrefix("10.202.1.254/24"))
	vb := Link(t, b, netip.MustParsePrefix("10.202.2.1/24"), r, netip.MustParsePrefix("10.202.2.254/24"))
	a.AddAddr(t, va.A, netip.MustParsePrefix("fd00:202:1::1/64"))
	r.AddAddr(t, va.B, netip.MustParsePrefix("fd00:202:1::fe/64"))
	b.AddAddr(t, vb.A, netip.MustParsePrefix("fd00:202:2::1/64"))
	r.AddAddr(t, vb.B, netip.MustParsePrefix("fd00:202:2::fe/64"))
	for _, v := range []Veth{va, vb} {
		for _, dev := range []string{v.A, v.B} {
			if len(dev) > 15 {
				t.Errorf("device name %q longer than 15 bytes", dev)
			}
		}
	}
	a.AddRoute(t, netip.MustParsePrefix("10.202.2.0/24"), netip.MustParseAddr("10.202.1.254"))
	b.AddRoute(t, netip.MustParsePrefix("10.202.1.0/24"), netip.MustParseAddr("10.202.2.254"))
	a.AddRoute(t, netip.MustParsePrefix("fd00:202:2::/64"), netip.MustParseAddr("fd00:202:1::fe"))
	b.AddRoute(t, netip.MustParsePrefix("fd00:202:1::/64"), netip.MustParseAddr("fd00:202:2::fe"))
	b.StartEcho(t, "tcp", ":8080", "b")
	b.StartEcho(t, "udp6", "[fd00:202:2::1]:8080", "b6")

	cases := []struct {
		name    string
		network string
		addr    string
		echo    string
		client  netip.Addr
	}{
		{"tcp4", "tcp4", "10.202.2.1:8080", "b", netip.MustParseAddr("10.202.1.1")},
		{"tcp6", "tcp6", "[fd00:202:2::1]:8080", "b", netip.MustParseAddr("fd00:202:1::1")},
		{"udp6", "udp6", "[fd00:202:2::1]:8080", "b6", netip.MustParseAddr("fd00:202:1::1")},
	}
	// Forwarding is off in a new namespace: the router drops, so no reply.
	for _, tc := range cases {
		t.Run("no forwarding/"+tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
			defer cancel()
			if reply, err := Request(ctx, a, tc.network, tc.addr); err == nil {
				t.Fatalf("got reply %q through a router without forwarding", reply)
			}
		})
	}

	r.Sysctl(t, "net.ipv4.ip_forward", "1")
	r.Sysctl(t, "net.ipv6.conf.all.forwarding", "1")
	if got := strings.TrimSpace(r.Run(t, "sysctl", "-n", "net.ipv4.ip_forward")); got != "1" {
		t.Fatalf("ip_forward in %s = %q, want 1", r.Name, got)
	}
	if got := strings.TrimSpace(b.Run(t, "sysctl", "-n", "net.ipv4.ip_forward")); got != "0" {
		t.Fatalf("ip_forward in %s = %q: Sysctl leaked out of its namespace", b.Name, got)
	}
	for _, tc := range cases {
		t.Run("forwarding/"+tc.name, func(t *testing.T) {
			reply, err := Request(t.Context(), a, tc.network, tc.addr)
			if err != nil {
				t.Fatal(err)
			}
			checkReply(t, reply, tc.echo, tc.client)
		})
	}
}

func TestNSCleanupRemovesEverything(t *testing.T) {
	RequireRoot(t)
	var names []string
	var veth Veth
	// The subtest's cleanups run when it ends, as they would after a failure.
	t.Run("setup", func(t *testing.T) {
		a := New(t, "clean")
		b := New(t, "clean")
		names = []string{a.Name, b.Name}
		veth = Link(t, a, netip.MustParsePrefix("10.203.0.1/24"), b, netip.MustParsePrefix("10.203.0.2/24"))
		b.StartEcho(t, "tcp4", "10.203.0.2:80", "b")
		b.StartEcho(t, "udp4", "10.203.0.2:80", "b")
		if _, err := Request(t.Context(), a, "tcp4", "10.203.0.2:80"); err != nil {
			t.Fatal(err)
		}
		for _, name := range names {
			if !slices.Contains(namespaces(t), name) {
				t.Fatalf("namespace %s missing while the test runs", name)
			}
		}
	})
	left := namespaces(t)
	for _, name := range names {
		if slices.Contains(left, name) {
			t.Errorf("namespace %s left behind", name)
		}
	}
	for _, dev := range []string{veth.A, veth.B} {
		if err := exec.Command("ip", "link", "show", "dev", dev).Run(); err == nil {
			t.Errorf("veth %s visible in the test's namespace", dev)
		}
	}
}

func TestNSSweep(t *testing.T) {
	RequireRoot(t)
	prefix := "sweep" + randomHex(3)
	leftovers := []string{NamePrefix + prefix + "-aaaa", NamePrefix + prefix + "-bbbb"}
	for _, name := range leftovers {
		if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
			t.Fatalf("ip netns add %s: %v: %s", name, err, out)
		}
		t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	}
	// Same leading letters but another prefix: must survive.
	keep := New(t, prefix+"x")

	deleted, err := Sweep(prefix)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(deleted)
	if !slices.Equal(deleted, leftovers) {
		t.Errorf("Sweep deleted %v, want %v", deleted, leftovers)
	}
	left := namespaces(t)
	for _, name := range leftovers {
		if slices.Contains(left, name) {
			t.Errorf("namespace %s survived Sweep", name)
		}
	}
	if !slices.Contains(left, keep.Name) {
		t.Errorf("Sweep(%q) deleted %s", prefix, keep.Name)
	}
	if again, err := Sweep(prefix); err != nil || len(again) != 0 {
		t.Errorf("second Sweep = %v, %v; want nothing", again, err)
	}
}
