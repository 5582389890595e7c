package netlink

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

func TestHostAddressesIncludesLoopback(t *testing.T) {
	addrs, err := HostAddresses()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(addrs, netip.MustParseAddr("127.0.0.1")) {
		t.Errorf("HostAddresses() = %v, want it to include 127.0.0.1", addrs)
	}
	for _, a := range addrs {
		if a.Is4In6() {
			t.Errorf("HostAddresses() returned the mapped address %v", a)
		}
	}
}

// TestHostAddressesAsStandardLibrary: the address dump reads what
// net.InterfaceAddrs does, in a namespace with point-to-point, secondary
// and IPv6 addresses.
func TestHostAddressesAsStandardLibrary(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "hostaddr")
	ns.Run(t, "ip", "link", "set", "lo", "up")
	ns.Run(t, "ip", "link", "add", "ha0", "type", "veth", "peer", "name", "ha1")
	ns.Run(t, "ip", "link", "set", "ha0", "up")
	ns.Run(t, "ip", "addr", "add", "10.77.0.1/24", "dev", "ha0")
	ns.Run(t, "ip", "addr", "add", "10.77.0.9/24", "dev", "ha0")
	ns.Run(t, "ip", "addr", "add", "10.78.0.1", "peer", "10.78.0.2/32", "dev", "ha1")
	ns.Run(t, "ip", "addr", "add", "fd77::1/64", "dev", "ha0", "nodad")
	var got, want []netip.Addr
	err := ns.Do(func() error {
		var err error
		if got, err = HostAddresses(); err != nil {
			return err
		}
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			return err
		}
		for _, a := range addrs {
			p, err := netip.ParsePrefix(a.String())
			if err != nil {
				return err
			}
			want = append(want, p.Addr().Unmap())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(got, netip.Addr.Compare)
	slices.SortFunc(want, netip.Addr.Compare)
	if !slices.Equal(got, want) {
		t.Errorf("HostAddresses() = %v, net.InterfaceAddrs() = %v", got, want)
	}
	for _, a := range []string{"10.77.0.1", "10.77.0.9", "10.78.0.1", "fd77::1", "127.0.0.1"} {
		if !slices.Contains(got, netip.MustParseAddr(a)) {
			t.Errorf("HostAddresses() = %v, want %s in it", got, a)
		}
	}
}

func BenchmarkHostAddresses(b *testing.B) {
	for b.Loop() {
		if _, err := HostAddresses(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestHostAddressCache: the cache dumps once, then again only after the
// kernel announced an address change of either family, and always lists
// what HostAddresses lists.
func TestHostAddressCache(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "hostcache")
	ns.Run(t, "ip", "link", "set", "lo", "up")
	ns.Run(t, "ip", "link", "add", "hc0", "type", "veth", "peer", "name", "hc1")
	ns.Run(t, "ip", "link", "set", "hc0", "up")
	ns.Run(t, "ip", "addr", "add", "10.79.0.1/24", "dev", "hc0")
	var c HostAddressCache
	t.Cleanup(func() { _ = c.Close() })
	steps := []struct {
		name      string
		ip        []string
		wantDumps int
		want      []string
		dontWant  []string
	}{
		{name: "first call dumps", wantDumps: 1, want: []string{"10.79.0.1", "127.0.0.1"}},
		{name: "no change: no dump", wantDumps: 1, want: []string{"10.79.0.1"}},
		{name: "still no change", wantDumps: 1, want: []string{"10.79.0.1"}},
		{name: "IPv4 address added", ip: []string{"addr", "add", "10.79.0.2/24", "dev", "hc0"}, wantDumps: 2, want: []string{"10.79.0.1", "10.79.0.2"}},
		{name: "after the change: no dump", wantDumps: 2, want: []string{"10.79.0.2"}},
		{name: "IPv4 address removed", ip: []string{"addr", "del", "10.79.0.2/24", "dev", "hc0"}, wantDumps: 3, want: []string{"10.79.0.1"}, dontWant: []string{"10.79.0.2"}},
		{name: "IPv6 address added", ip: []string{"addr", "add", "fd79::1/64", "dev", "hc0", "nodad"}, wantDumps: 4, want: []string{"fd79::1", "10.79.0.1"}},
		{name: "IPv6 address removed", ip: []string{"addr", "del", "fd79::1/64", "dev", "hc0"}, wantDumps: 5, dontWant: []string{"fd79::1"}},
		{name: "link down drops nothing IPv4", ip: []string{"link", "set", "hc1", "down"}, wantDumps: 5, want: []string{"10.79.0.1"}},
	}
	for _, st := range steps {
		if st.ip != nil {
			ns.Run(t, "ip", st.ip...)
		}
		var got, direct []netip.Addr
		err := ns.Do(func() error {
			var err error
			if got, err = c.Addresses(); err != nil {
				return err
			}
			direct, err = HostAddresses()
			return err
		})
		if err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if c.dumps != st.wantDumps {
			t.Errorf("%s: %d dumps, want %d", st.name, c.dumps, st.wantDumps)
		}
		slices.SortFunc(got, netip.Addr.Compare)
		slices.SortFunc(direct, netip.Addr.Compare)
		if !slices.Equal(got, direct) {
			t.Errorf("%s: Addresses() = %v, HostAddresses() = %v", st.name, got, direct)
		}
		for _, a := range st.want {
			if !slices.Contains(got, netip.MustParseAddr(a)) {
				t.Errorf("%s: Addresses() = %v, want %s in it", st.name, got, a)
			}
		}
		for _, a := range st.dontWant {
			if slices.Contains(got, netip.MustParseAddr(a)) {
				t.Errorf("%s: Addresses() = %v, want no %s", st.name, got, a)
			}
		}
	}
	// Closed, the next call opens a new socket and dumps.
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ns.Do(func() error { _, err := c.Addresses(); return err }); err != nil {
		t.Fatal(err)
	}
	if c.dumps != 6 {
		t.Errorf("after Close: %d dumps, want 6", c.dumps)
	}
}

// TestHostAddressCacheDumpFails: a failed dump is returned and not
// cached; the next call dumps again.
func TestHostAddressCacheDumpFails(t *testing.T) {
	fail := true
	c := HostAddressCache{dump: func() ([]netip.Addr, error) {
		if fail {
			return nil, errors.New("dump failed")
		}
		return []netip.Addr{netip.MustParseAddr("10.0.0.1")}, nil
	}}
	t.Cleanup(func() { _ = c.Close() })
	if _, err := c.Addresses(); err == nil {
		t.Fatal("Addresses() succeeded with a failing dump")
	}
	fail = false
	got, err := c.Addresses()
	if err != nil || len(got) != 1 {
		t.Fatalf("Addresses() = %v, %v after the dump recovered", got, err)
	}
	got[0] = netip.Addr{}
	again, err := c.Addresses()
	if err != nil || again[0] != netip.MustParseAddr("10.0.0.1") {
		t.Errorf("Addresses() = %v, %v: a caller's change reached the cache", again, err)
	}
	if c.dumps != 2 {
		t.Errorf("%d dumps, want 2", c.dumps)
	}
}

func BenchmarkHostAddressCache(b *testing.B) {
	var c HostAddressCache
	defer c.Close()
	for b.Loop() {
		if _, err := c.Addresses(); err != nil {
			b.Fatal(err)
		}
	}
}
