package netlink

import (
	"net/netip"
	"slices"
	"testing"
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
