package netlink

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"time"

	vnl "github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/deadline"
)

// Options configures the real implementation returned by New.
type Options struct {
	// NetNS, when set, is the named network namespace (as made by `ip
	// netns add`) whose devices the Real manages; for tests and tools.
	// Empty means the current namespace.
	NetNS string
	// Timeout bounds each call (see Real); zero means DefaultTimeout.
	Timeout time.Duration
}

// DefaultTimeout bounds one call of the real implementations of this
// package, pkg/ipset's and pkg/ipvs's: each is a request or two, or a dump
// of one kind of object (a device's addresses, one set's entries, the IPVS
// services), which the kernel answers in well under a second even at
// 10,000 services. What can make one slow is a kernel lock it waits for
// (RTNL, which other agents hold while they change devices and routes);
// a call with no answer after 30 s is hung, and failing it makes the sync
// fail and be retried.
const DefaultTimeout = 30 * time.Second

// Real is the Interface implementation for a real kernel. It holds one
// route netlink socket (no XFRM or netfilter sockets, which kernels without
// xfrm_user refuse), and is safe for concurrent use.
//
// Every call ends by its deadline (Options.Timeout or the caller's,
// whichever is earlier) with an error wrapping context.DeadlineExceeded: a
// netlink request cannot be cancelled, so the call runs under a
// deadline.Guard, and the socket's send and receive timeouts are the
// same, so that an abandoned call waiting for its answer ends too
// (docs/design.md, "Deadlines on kernel calls").
type Real struct {
	h       *vnl.Handle
	timeout time.Duration
	guard   deadline.Guard
}

var _ Interface = (*Real)(nil)

// New opens a route netlink socket in opts.NetNS. The caller must Close
// the result.
func New(opts Options) (*Real, error) {
	timeout := opts.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	var h *vnl.Handle
	if opts.NetNS == "" {
		var err error
		if h, err = vnl.NewHandle(unix.NETLINK_ROUTE); err != nil {
			return nil, fmt.Errorf("opening route netlink socket: %w", err)
		}
	} else {
		ns, err := netns.GetFromName(opts.NetNS)
		if err != nil {
			return nil, fmt.Errorf("opening network namespace %q: %w", opts.NetNS, err)
		}
		defer ns.Close()
		if h, err = vnl.NewHandleAt(ns, unix.NETLINK_ROUTE); err != nil {
			return nil, fmt.Errorf("opening route netlink socket in network namespace %q: %w", opts.NetNS, err)
		}
	}
	if err := h.SetSocketTimeout(timeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("setting the route netlink socket's timeout: %w", err)
	}
	return &Real{h: h, timeout: timeout}, nil
}

// Close releases the socket.
func (r *Real) Close() error {
	r.h.Close()
	return nil
}

// EnsureDummyDevice implements Interface.
func (r *Real) EnsureDummyDevice(ctx context.Context, name string) (bool, error) {
	return deadline.Call(ctx, &r.guard, "netlink: ensuring dummy device "+name, r.timeout, func(ctx context.Context) (bool, error) {
		return r.ensureDummyDevice(ctx, name)
	}, nil)
}

// DeleteDummyDevice implements Interface.
func (r *Real) DeleteDummyDevice(ctx context.Context, name string) error {
	return r.guard.Do(ctx, "netlink: deleting dummy device "+name, r.timeout, func(ctx context.Context) error {
		return r.deleteDummyDevice(ctx, name)
	}, nil)
}

// EnsureAddressBound implements Interface.
func (r *Real) EnsureAddressBound(ctx context.Context, addr netip.Addr, dev string) (bool, error) {
	return deadline.Call(ctx, &r.guard, fmt.Sprintf("netlink: binding %s to device %s", addr, dev), r.timeout, func(ctx context.Context) (bool, error) {
		return r.ensureAddressBound(ctx, addr, dev)
	}, nil)
}

// UnbindAddress implements Interface.
func (r *Real) UnbindAddress(ctx context.Context, addr netip.Addr, dev string) error {
	return r.guard.Do(ctx, fmt.Sprintf("netlink: unbinding %s from device %s", addr, dev), r.timeout, func(ctx context.Context) error {
		return r.unbindAddress(ctx, addr, dev)
	}, nil)
}

// ListBoundAddresses implements Interface.
func (r *Real) ListBoundAddresses(ctx context.Context, dev string) ([]netip.Addr, error) {
	return deadline.Call(ctx, &r.guard, "netlink: listing addresses of device "+dev, r.timeout, func(ctx context.Context) ([]netip.Addr, error) {
		return r.listBoundAddresses(ctx, dev)
	}, nil)
}

// LocalAddresses implements Interface.
func (r *Real) LocalAddresses(ctx context.Context, excludeDevs ...string) ([]netip.Addr, error) {
	// An abandoned call goes on reading them after LocalAddresses returned.
	excludeDevs = slices.Clone(excludeDevs)
	return deadline.Call(ctx, &r.guard, "netlink: listing local addresses", r.timeout, func(ctx context.Context) ([]netip.Addr, error) {
		return r.localAddresses(ctx, excludeDevs...)
	}, nil)
}

// link looks dev up; (nil, nil) when absent. Kernels that cannot look a
// device up by name make the library dump every device, hence the retry.
func (r *Real) link(ctx context.Context, dev string) (vnl.Link, error) {
	l, err := RetryDump(ctx, "looking up device "+dev, func() (vnl.Link, error) { return r.h.LinkByName(dev) })
	if err == nil {
		return l, nil
	}
	var nf vnl.LinkNotFoundError
	if errors.As(err, &nf) || errors.Is(err, unix.ENODEV) {
		return nil, nil
	}
	return nil, err
}

// ensureDummyDevice does EnsureDummyDevice's work, under its deadline.
func (r *Real) ensureDummyDevice(ctx context.Context, name string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if err := validateDeviceName(name); err != nil {
		return false, err
	}
	for attempt := 0; ; attempt++ {
		l, err := r.link(ctx, name)
		if err != nil {
			return false, err
		}
		if l != nil {
			if l.Type() != "dummy" {
				return true, fmt.Errorf("device %s is a %s device: %w", name, l.Type(), ErrNotDummy)
			}
			return true, nil
		}
		err = r.h.LinkAdd(&vnl.Dummy{LinkAttrs: vnl.LinkAttrs{Name: name}})
		switch {
		case err == nil:
			klog.FromContext(ctx).V(2).Info("Created dummy device", "device", name)
			return false, nil
		case errors.Is(err, unix.EEXIST) && attempt == 0:
			continue // created meanwhile: check its type
		case errors.Is(err, unix.EOPNOTSUPP):
			return false, fmt.Errorf("creating dummy device %s: the kernel has no dummy device support (module dummy not loaded): %w", name, err)
		default:
			return false, fmt.Errorf("creating dummy device %s: %w", name, err)
		}
	}
}

// deleteDummyDevice does DeleteDummyDevice's work, under its deadline.
func (r *Real) deleteDummyDevice(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateDeviceName(name); err != nil {
		return err
	}
	l, err := r.link(ctx, name)
	if err != nil || l == nil {
		return err
	}
	if l.Type() != "dummy" {
		return fmt.Errorf("not deleting device %s, a %s device: %w", name, l.Type(), ErrNotDummy)
	}
	if err := r.h.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
		return fmt.Errorf("deleting dummy device %s: %w", name, err)
	}
	klog.FromContext(ctx).V(2).Info("Deleted dummy device", "device", name)
	return nil
}

// findAddr returns dev's address addr, nil when dev lacks it.
func (r *Real) findAddr(ctx context.Context, l vnl.Link, addr netip.Addr) (*vnl.Addr, error) {
	family := vnl.FAMILY_V4
	if addr.Is6() {
		family = vnl.FAMILY_V6
	}
	addrs, err := RetryDump(ctx, "listing addresses of device "+l.Attrs().Name, func() ([]vnl.Addr, error) { return r.h.AddrList(l, family) })
	if err != nil {
		return nil, err
	}
	for i := range addrs {
		if a, ok := toAddr(addrs[i].IP); ok && a == addr {
			return &addrs[i], nil
		}
	}
	return nil, nil
}

// ensureAddressBound does EnsureAddressBound's work, under its deadline.
func (r *Real) ensureAddressBound(ctx context.Context, addr netip.Addr, dev string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if err := validateAddress(addr); err != nil {
		return false, err
	}
	if err := validateDeviceName(dev); err != nil {
		return false, err
	}
	l, err := r.link(ctx, dev)
	if err != nil {
		return false, err
	}
	if l == nil {
		return false, fmt.Errorf("binding %s to device %s: device %w", addr, dev, ErrNotExist)
	}
	// Add first and read EEXIST as "already bound": listing the device's
	// addresses before every add made binding N addresses cost O(N^2)
	// (a 10,000-service first sync spent minutes here).
	p := hostPrefix(addr)
	a := &vnl.Addr{IPNet: &net.IPNet{IP: net.IP(addr.AsSlice()), Mask: net.CIDRMask(p.Bits(), addr.BitLen())}}
	if addr.Is4() {
		a.Scope = unix.RT_SCOPE_HOST
	} else {
		a.Flags = unix.IFA_F_NODAD
	}
	if err := r.h.AddrAdd(l, a); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return true, nil
		}
		return false, fmt.Errorf("binding %s to device %s: %w", p, dev, err)
	}
	klog.FromContext(ctx).V(4).Info("Bound address", "address", p, "device", dev)
	return false, nil
}

// unbindAddress does UnbindAddress's work, under its deadline. The address
// is removed with the prefix length it has on dev, whatever that is.
func (r *Real) unbindAddress(ctx context.Context, addr netip.Addr, dev string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateAddress(addr); err != nil {
		return err
	}
	if err := validateDeviceName(dev); err != nil {
		return err
	}
	l, err := r.link(ctx, dev)
	if err != nil || l == nil {
		return err
	}
	found, err := r.findAddr(ctx, l, addr)
	if err != nil || found == nil {
		return err
	}
	if err := r.h.AddrDel(l, found); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
		return fmt.Errorf("unbinding %s from device %s: %w", addr, dev, err)
	}
	klog.FromContext(ctx).V(4).Info("Unbound address", "address", addr, "device", dev)
	return nil
}

// listBoundAddresses does ListBoundAddresses's work, under its deadline.
func (r *Real) listBoundAddresses(ctx context.Context, dev string) ([]netip.Addr, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := validateDeviceName(dev); err != nil {
		return nil, err
	}
	l, err := r.link(ctx, dev)
	if err != nil {
		return nil, err
	}
	if l == nil {
		return nil, fmt.Errorf("listing addresses of device %s: device %w", dev, ErrNotExist)
	}
	addrs, err := RetryDump(ctx, "listing addresses of device "+dev, func() ([]vnl.Addr, error) { return r.h.AddrList(l, vnl.FAMILY_ALL) })
	if err != nil {
		return nil, err
	}
	return collect(addrs, nil), nil
}

// localAddresses does LocalAddresses's work, under its deadline.
func (r *Real) localAddresses(ctx context.Context, excludeDevs ...string) ([]netip.Addr, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	excluded := map[int]bool{}
	if len(excludeDevs) > 0 {
		links, err := RetryDump(ctx, "listing devices", r.h.LinkList)
		if err != nil {
			return nil, err
		}
		for _, l := range links {
			if slices.Contains(excludeDevs, l.Attrs().Name) {
				excluded[l.Attrs().Index] = true
			}
		}
	}
	addrs, err := RetryDump(ctx, "listing addresses", func() ([]vnl.Addr, error) { return r.h.AddrList(nil, vnl.FAMILY_ALL) })
	if err != nil {
		return nil, err
	}
	return collect(addrs, excluded), nil
}

// collect converts addrs, skipping those of excluded device indexes and
// those listed leaves out, sorted and without duplicates.
func collect(addrs []vnl.Addr, excluded map[int]bool) []netip.Addr {
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		if excluded[a.LinkIndex] {
			continue
		}
		if ip, ok := toAddr(a.IP); ok && listed(ip) {
			out = append(out, ip)
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out)
}

// toAddr converts a kernel address: 4 bytes for IPv4, 16 for IPv6.
func toAddr(ip net.IP) (netip.Addr, bool) {
	return netip.AddrFromSlice(ip)
}
