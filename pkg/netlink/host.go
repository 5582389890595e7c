package netlink

import (
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"unsafe"
)

// HostAddresses lists the addresses of every interface of the current
// network namespace (IPv4-mapped IPv6 addresses unmapped), through the
// standard library's netlink routing socket: the default address source
// of components that need no netlink handle (the node ports of the
// iptables and nftables backends, which ask once per sync, and the
// health-check listeners). It reads one address dump (RTM_GETADDR), the
// addresses net.InterfaceAddrs reports, without the link dump that call
// makes too: a partial sync spent a third of its time there.
func HostAddresses() ([]netip.Addr, error) {
	msgs, err := addrDump()
	if err != nil {
		return nil, fmt.Errorf("listing interface addresses: %w", err)
	}
	return parseAddrMessages(msgs)
}

// addrDump is the messages of syscall.NetlinkRIB(RTM_GETADDR, AF_UNSPEC),
// each read parsed once, made with raw system calls: none of them blocks (the kernel answers a dump request
// while it is sent, and reads wait only when the dump is not ready, which
// falls back to a blocking read), so the Go runtime is not told of them,
// and a sync does not wake its sysmon thread (see pkg/rawio).
func addrDump() ([]syscall.NetlinkMessage, error) {
	s, err := syscall.Socket(syscall.AF_NETLINK, syscall.SOCK_RAW|syscall.SOCK_CLOEXEC, syscall.NETLINK_ROUTE)
	if err != nil {
		return nil, err
	}
	defer func() { _, _, _ = syscall.RawSyscall(syscall.SYS_CLOSE, uintptr(s), 0, 0) }()
	sa := syscall.RawSockaddrNetlink{Family: syscall.AF_NETLINK}
	if _, _, e := syscall.RawSyscall(syscall.SYS_BIND, uintptr(s), uintptr(unsafe.Pointer(&sa)), syscall.SizeofSockaddrNetlink); e != 0 {
		return nil, os.NewSyscallError("bind", e)
	}
	const seq = 1
	req := make([]byte, syscall.NLMSG_HDRLEN+syscall.SizeofRtGenmsg)
	*(*syscall.NlMsghdr)(unsafe.Pointer(&req[0])) = syscall.NlMsghdr{
		Len:   uint32(len(req)),
		Type:  syscall.RTM_GETADDR,
		Flags: syscall.NLM_F_DUMP | syscall.NLM_F_REQUEST,
		Seq:   seq,
	}
	req[syscall.NLMSG_HDRLEN] = syscall.AF_UNSPEC
	if _, _, e := syscall.RawSyscall6(syscall.SYS_SENDTO, uintptr(s), uintptr(unsafe.Pointer(&req[0])), uintptr(len(req)), 0,
		uintptr(unsafe.Pointer(&sa)), syscall.SizeofSockaddrNetlink); e != 0 {
		return nil, os.NewSyscallError("sendto", e)
	}
	var all []syscall.NetlinkMessage
	buf := make([]byte, os.Getpagesize()*4)
	for {
		n, _, e := syscall.RawSyscall6(syscall.SYS_RECVFROM, uintptr(s), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), syscall.MSG_DONTWAIT, 0, 0)
		switch e {
		case 0:
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			n0, _, err := syscall.Recvfrom(s, buf, 0)
			if err != nil {
				return nil, os.NewSyscallError("recvfrom", err)
			}
			n = uintptr(n0)
		default:
			return nil, os.NewSyscallError("recvfrom", e)
		}
		if n < syscall.NLMSG_HDRLEN {
			return nil, syscall.EINVAL
		}
		// The messages point into what they were parsed from: a copy,
		// as buf is read into again.
		msgs, err := syscall.ParseNetlinkMessage(append([]byte(nil), buf[:n]...))
		if err != nil {
			return nil, err
		}
		all = append(all, msgs...)
		for _, m := range msgs {
			if m.Header.Seq != seq {
				return nil, syscall.EINVAL
			}
			if m.Header.Type == syscall.NLMSG_DONE || m.Header.Type == syscall.NLMSG_ERROR {
				return all, nil
			}
		}
	}
}

// parseAddrMessages reads the addresses of an RTM_GETADDR dump: an IPv4
// address is its IFA_LOCAL when it has one (point-to-point), else its
// IFA_ADDRESS, as net.InterfaceAddrs reads them.
func parseAddrMessages(msgs []syscall.NetlinkMessage) ([]netip.Addr, error) {
	var out []netip.Addr
	for _, m := range msgs {
		switch m.Header.Type {
		case syscall.NLMSG_DONE:
			return out, nil
		case syscall.NLMSG_ERROR:
			return nil, fmt.Errorf("listing interface addresses: netlink error")
		case syscall.RTM_NEWADDR:
		default:
			continue
		}
		if len(m.Data) < syscall.SizeofIfAddrmsg {
			continue
		}
		ifam := (*syscall.IfAddrmsg)(unsafe.Pointer(&m.Data[0]))
		attrs, err := syscall.ParseNetlinkRouteAttr(&m)
		if err != nil {
			return nil, fmt.Errorf("listing interface addresses: %w", err)
		}
		var addr, local []byte
		for _, a := range attrs {
			switch a.Attr.Type {
			case syscall.IFA_ADDRESS:
				addr = a.Value
			case syscall.IFA_LOCAL:
				local = a.Value
			}
		}
		if local != nil && ifam.Family == syscall.AF_INET {
			addr = local
		}
		if ip, ok := netip.AddrFromSlice(addr); ok {
			out = append(out, ip.Unmap())
		}
	}
	return out, nil
}
