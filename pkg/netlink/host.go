package netlink

import (
	"fmt"
	"net"
	"net/netip"
)

// HostAddresses lists the addresses of every interface of the current
// network namespace (IPv4-mapped IPv6 addresses unmapped), through the
// standard library: the default address source of components that need no
// netlink handle (the iptables backend's node ports, the health-check
// listeners).
func HostAddresses() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("listing interface addresses: %w", err)
	}
	var out []netip.Addr
	for _, a := range addrs {
		if p, err := netip.ParsePrefix(a.String()); err == nil {
			out = append(out, p.Addr().Unmap())
		}
	}
	return out, nil
}
