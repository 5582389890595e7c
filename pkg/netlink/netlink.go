// Package netlink is kproxy's small interface to the kernel's devices and
// addresses for IPVS mode: the dummy device that holds every virtual IP, the
// addresses bound to it, and the node's own addresses. One real
// implementation uses github.com/vishvananda/netlink (route netlink only);
// one fake keeps devices and their addresses in memory.
package netlink

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// Interface is the whole of kproxy's access to one network namespace's
// devices and addresses.
type Interface interface {
	// EnsureDummyDevice creates the dummy device name unless it exists;
	// reports whether it existed. A device of that name that is not a
	// dummy is an error. The device is left down (as upstream kube-proxy
	// leaves kube-ipvs0): addresses on it are local all the same.
	EnsureDummyDevice(ctx context.Context, name string) (existed bool, err error)
	// DeleteDummyDevice deletes the dummy device name with its addresses;
	// no error when absent. A device of that name that is not a dummy is
	// left alone and reported as an error.
	DeleteDummyDevice(ctx context.Context, name string) error
	// EnsureAddressBound binds addr to dev as a host address (/32 or
	// /128) unless dev has it already; reports whether it had. IPv4
	// addresses get scope host, so the node never picks a virtual IP as
	// the source of traffic leaving it; IPv6 addresses are added without
	// duplicate address detection. ErrNotExist when dev is absent.
	EnsureAddressBound(ctx context.Context, addr netip.Addr, dev string) (existed bool, err error)
	// UnbindAddress removes addr from dev; no error when either is absent.
	UnbindAddress(ctx context.Context, addr netip.Addr, dev string) error
	// ListBoundAddresses lists dev's addresses, sorted, leaving out IPv6
	// link-local ones (which the kernel adds by itself). ErrNotExist when
	// dev is absent.
	ListBoundAddresses(ctx context.Context, dev string) ([]netip.Addr, error)
	// LocalAddresses lists the addresses of every device of the node
	// except the devices named in excludeDevs, sorted and without
	// duplicates, leaving out IPv6 link-local ones. Loopback addresses are
	// included.
	LocalAddresses(ctx context.Context, excludeDevs ...string) ([]netip.Addr, error)
}

var (
	// ErrNotExist: the device does not exist.
	ErrNotExist = errors.New("does not exist")
	// ErrNotDummy: a device of the requested name exists but is not a
	// dummy device.
	ErrNotDummy = errors.New("not a dummy device")
)

// maxDeviceName is the longest device name the kernel accepts (IFNAMSIZ
// less the terminating NUL).
const maxDeviceName = 15

// validateDeviceName applies the kernel's rules for device names.
func validateDeviceName(name string) error {
	switch {
	case name == "":
		return errors.New("empty device name")
	case len(name) > maxDeviceName:
		return fmt.Errorf("device name %q too long (max %d bytes)", name, maxDeviceName)
	case name == "." || name == "..":
		return fmt.Errorf("invalid device name %q", name)
	case strings.ContainsAny(name, "/: \t\n\v\f\r"):
		return fmt.Errorf("device name %q contains an invalid character", name)
	}
	return nil
}

// validateAddress accepts plain IPv4 and IPv6 addresses.
func validateAddress(addr netip.Addr) error {
	switch {
	case !addr.IsValid():
		return errors.New("invalid address")
	case addr.Zone() != "" || addr.Is4In6():
		return fmt.Errorf("address %s: use a plain IPv4 or IPv6 address", addr)
	case addr.IsUnspecified() || addr.IsMulticast():
		return fmt.Errorf("address %s cannot be bound to a device", addr)
	}
	return nil
}

// hostPrefix is addr as a single-address prefix.
func hostPrefix(addr netip.Addr) netip.Prefix {
	return netip.PrefixFrom(addr, addr.BitLen())
}

// listed reports whether an address belongs in listings.
func listed(addr netip.Addr) bool {
	return !(addr.Is6() && addr.IsLinkLocalUnicast())
}
