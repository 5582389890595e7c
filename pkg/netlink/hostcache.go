package netlink

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"syscall"
	"unsafe"
)

// HostAddressCache is HostAddresses read again only when the kernel says
// an address changed. A sync that lists the node's addresses (the node
// ports of the iptables and nftables backends, the health-check
// listeners) then costs one non-blocking read of a netlink socket that
// listens to address changes (RTMGRP_IPV4_IFADDR and RTMGRP_IPV6_IFADDR)
// instead of an address dump on a new socket: at 1,000 Services that
// dump was a quarter of the sync goroutine's CPU per change (perf).
//
// The socket listens before the first dump, so a change is either in the
// dump or waiting on the socket for the next call. A change the socket
// missed (its buffer overflowed: ENOBUFS) or a failed read makes the next
// call dump again, so the cache is never older than the last call that
// saw no notification.
//
// The socket is opened by the first call, in the network namespace of the
// calling thread, and a dump reads the namespace of the calling thread:
// every call must come from the same namespace (kproxy's is the
// process's). No goroutine is started. A HostAddressCache is safe for
// concurrent use; the zero value is ready.
type HostAddressCache struct {
	mu     sync.Mutex
	fd     int
	opened bool
	// valid: addrs is the last dump, and no notification came since.
	valid bool
	addrs []netip.Addr
	// dump replaces HostAddresses (tests).
	dump func() ([]netip.Addr, error)
	// dumps counts the address dumps made (tests).
	dumps int
}

// Addresses implements the LocalAddresses option of the backends: the
// node's addresses, as HostAddresses lists them, in a slice of the
// caller's own.
func (c *HostAddressCache) Addresses() ([]netip.Addr, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.opened {
		fd, err := listenAddressChanges()
		if err != nil {
			// Without notifications every call dumps.
			return c.dumpLocked()
		}
		c.fd, c.opened = fd, true
	}
	// Drained on every call, also when the cache is already invalid (a
	// failed dump): the notifications of a change the coming dump reads
	// are not left to invalidate the next call's cache.
	if c.drainLocked() {
		c.valid = false
	}
	if !c.valid {
		addrs, err := c.dumpLocked()
		if err != nil {
			return nil, err
		}
		c.addrs, c.valid = addrs, true
	}
	return slices.Clone(c.addrs), nil
}

func (c *HostAddressCache) dumpLocked() ([]netip.Addr, error) {
	c.dumps++
	if c.dump != nil {
		return c.dump()
	}
	return HostAddresses()
}

// drainLocked reads every notification waiting on the socket without
// blocking and reports whether any came, or the socket cannot tell (an
// overflow or another error): then the addresses must be read again.
func (c *HostAddressCache) drainLocked() (changed bool) {
	var buf [4096]byte
	for {
		n, _, e := syscall.RawSyscall6(syscall.SYS_RECVFROM, uintptr(c.fd), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)),
			syscall.MSG_DONTWAIT, 0, 0)
		switch {
		case e == syscall.EINTR:
			continue
		case e == syscall.EAGAIN:
			return changed
		case e != 0:
			// ENOBUFS: notifications were lost.
			return true
		case n > 0:
			changed = true
		default:
			return true
		}
	}
}

// Close closes the socket; a later call opens another one.
func (c *HostAddressCache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.opened {
		return nil
	}
	c.opened, c.valid = false, false
	if err := syscall.Close(c.fd); err != nil {
		return os.NewSyscallError("close", err)
	}
	return nil
}

// The routing netlink multicast groups of address changes
// (linux/rtnetlink.h), as bits of a bind's Groups.
const (
	rtmgrpIPv4IfAddr = 0x10
	rtmgrpIPv6IfAddr = 0x100
)

// listenAddressChanges opens a routing netlink socket that receives the
// kernel's address notifications of both families.
func listenAddressChanges() (int, error) {
	fd, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_RAW|syscall.SOCK_CLOEXEC|syscall.SOCK_NONBLOCK, syscall.NETLINK_ROUTE)
	if err != nil {
		return -1, fmt.Errorf("listening to address changes: %w", os.NewSyscallError("socket", err))
	}
	sa := &syscall.SockaddrNetlink{Family: syscall.AF_NETLINK, Groups: rtmgrpIPv4IfAddr | rtmgrpIPv6IfAddr}
	if err := syscall.Bind(fd, sa); err != nil {
		_ = syscall.Close(fd)
		return -1, fmt.Errorf("listening to address changes: %w", os.NewSyscallError("bind", err))
	}
	return fd, nil
}
