package netlink

import (
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
