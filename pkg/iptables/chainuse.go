package iptables

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"syscall"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// This file reads each chain's use count (Interface.ChainUse): the number
// of its rules plus the number of rules that jump or go to it. nf_tables
// keeps exactly this count for each chain (it refuses to delete a chain in
// use), so iptables-nft reads it with one netlink dump of the table's
// chains, without the rules (docs/design.md, "Flush detection").

// JumpTarget returns the target of a rule (its arguments as iptables-save
// or iptables-restore input writes them, without "-A CHAIN") when the rule
// ends with "-j TARGET" or "-g TARGET" (a target without options, such as
// a user chain), and "" otherwise. Whether TARGET is a chain is for the
// caller to decide.
func JumpTarget(rule string) string {
	i := lastSpace(rule)
	if i < 0 {
		return ""
	}
	if isJumpFlag(rule[lastSpace(rule[:i])+1 : i]) {
		return rule[i+1:]
	}
	return ""
}

func isJumpFlag(s string) bool { return s == "-j" || s == "--jump" || s == "-g" || s == "--goto" }

func lastSpace[S string | []byte](s S) int {
	for i := len(s) - 1; i >= 0; i-- {
		if isSpace(s[i]) {
			return i
		}
	}
	return -1
}

// chainUseCounter computes the use counts from iptables-save output, line
// by line: it declares every chain before the first rule. It allocates
// nothing per rule (a large table's output is hundreds of thousands).
type chainUseCounter struct {
	use map[string]*int
}

func newChainUseCounter() *chainUseCounter { return &chainUseCounter{use: map[string]*int{}} }

func (c *chainUseCounter) line(line []byte) {
	switch {
	case bytes.HasPrefix(line, []byte(":")):
		name, _, _ := bytes.Cut(line[1:], []byte(" "))
		if c.use[string(name)] == nil {
			c.use[string(name)] = new(int)
		}
	case bytes.HasPrefix(line, []byte("-A ")):
		name, rule, _ := bytes.Cut(line[3:], []byte(" "))
		if n := c.use[string(name)]; n != nil {
			*n++
		}
		// The rule's target, when it is a chain (see JumpTarget).
		if i := lastSpace(rule); i >= 0 && isJumpFlag(string(rule[lastSpace(rule[:i])+1:i])) {
			if n := c.use[string(rule[i+1:])]; n != nil {
				*n++
			}
		}
	}
}

func (c *chainUseCounter) result() map[string]int {
	out := make(map[string]int, len(c.use))
	for name, n := range c.use {
		out[name] = *n
	}
	return out
}

// ChainUseFromSave computes the use count of every chain of one table
// from its iptables-save output.
func ChainUseFromSave(save []byte) map[string]int {
	c := newChainUseCounter()
	for line := range bytes.Lines(save) {
		c.line(bytes.TrimRight(line, "\r\n"))
	}
	return c.result()
}

// ChainUse implements Interface. iptables-nft reads the counts nf_tables
// keeps with one netlink dump of the family's chains (a few milliseconds
// at 10,000 services, where iptables-save takes seconds); iptables-legacy
// computes them from iptables-save, which reads the table whole anyway.
func (r *Real) ChainUse(ctx context.Context, table Table) (map[string]int, error) {
	if r.mode == "legacy" {
		c := newChainUseCounter()
		err := r.scanLines(ctx, r.savePath, []string{"-t", string(table)}, func(line []byte) bool {
			c.line(line)
			return true
		})
		if err != nil {
			return nil, fmt.Errorf("counting chain use in table %s: %w", table, err)
		}
		return c.result(), nil
	}
	if r.closed.Load() {
		return nil, fmt.Errorf("counting chain use in table %s: %w", table, errClosed)
	}
	family := uint8(unix.NFPROTO_IPV4)
	if r.protocol == ProtocolIPv6 {
		family = unix.NFPROTO_IPV6
	}
	// A dump that a concurrent change interrupted is inconsistent: read
	// it again.
	for attempt := 1; ; attempt++ {
		use, err := r.dumpChainUse(ctx, family, table)
		if errors.Is(err, errDumpInterrupted) && attempt < 5 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("counting chain use in table %s: %w", table, err)
		}
		if len(use) == 0 {
			// iptables-nft creates a table when first used; a table that
			// does not exist has no chains.
			return map[string]int{}, nil
		}
		return use, nil
	}
}

var errDumpInterrupted = errors.New("netlink dump interrupted by a change")

// netlinkSocket opens a netfilter netlink socket in the namespace named
// ns (the current one when empty). The socket is made on a thread of its
// own, which is dropped, not reused, if it cannot return to its namespace.
func netlinkSocket(ns string) (int, error) {
	if ns == "" {
		return unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	}
	type result struct {
		fd  int
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- result{-1, fmt.Errorf("opening the current network namespace: %w", err)}
			return
		}
		defer orig.Close()
		target, err := netns.GetFromName(ns)
		if err != nil {
			runtime.UnlockOSThread()
			done <- result{-1, fmt.Errorf("opening network namespace %q: %w", ns, err)}
			return
		}
		defer target.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			done <- result{-1, fmt.Errorf("entering network namespace %q: %w", ns, err)}
			return
		}
		fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		if err := netns.Set(orig); err != nil {
			// The thread stays locked: it ends with this goroutine.
			if fd >= 0 {
				unix.Close(fd)
			}
			done <- result{-1, fmt.Errorf("leaving network namespace %q: %w", ns, err)}
			return
		}
		runtime.UnlockOSThread()
		done <- result{fd, err}
	}()
	res := <-done
	return res.fd, res.err
}

// dumpChainUse dumps the family's chains and returns the use count of
// those of table.
func (r *Real) dumpChainUse(ctx context.Context, family uint8, table Table) (map[string]int, error) {
	fd, err := netlinkSocket(r.netns)
	if err != nil {
		return nil, fmt.Errorf("opening a netfilter netlink socket: %w", err)
	}
	defer unix.Close(fd)
	// The deadline: Options.Timeout, or the context's when sooner.
	limit := time.Now().Add(r.timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(limit) {
		limit = d
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	tv := unix.NsecToTimeval(time.Until(limit).Nanoseconds())
	for _, opt := range []int{unix.SO_RCVTIMEO, unix.SO_SNDTIMEO} {
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, opt, &tv); err != nil {
			return nil, fmt.Errorf("setting the socket's timeout: %w", err)
		}
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("binding: %w", err)
	}

	// nlmsghdr, nfgenmsg: every chain of the family.
	const seq = 1
	req := make([]byte, unix.NLMSG_HDRLEN+4)
	binary.NativeEndian.PutUint32(req[0:], uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_GETCHAIN)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:], seq)
	req[unix.NLMSG_HDRLEN] = family
	req[unix.NLMSG_HDRLEN+1] = unix.NFNETLINK_V0
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("sending the chain dump request: %w", err)
	}

	use := map[string]int{}
	interrupted := false
	buf := make([]byte, 1<<16)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		switch {
		case err == nil:
		case errors.Is(err, unix.EINTR) && time.Now().Before(limit):
			continue
		case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
			// SO_RCVTIMEO ran out.
			return nil, fmt.Errorf("reading the chain dump: %w", context.DeadlineExceeded)
		default:
			return nil, fmt.Errorf("reading the chain dump: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, fmt.Errorf("reading the chain dump: %w", err)
		}
		for _, m := range msgs {
			if m.Header.Seq != seq {
				continue
			}
			if m.Header.Flags&unix.NLM_F_DUMP_INTR != 0 {
				interrupted = true
			}
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				if interrupted {
					return nil, errDumpInterrupted
				}
				return use, nil
			case unix.NLMSG_ERROR:
				if len(m.Data) >= 4 {
					if errno := int32(binary.NativeEndian.Uint32(m.Data)); errno != 0 {
						return nil, fmt.Errorf("chain dump: %w", unix.Errno(-errno))
					}
				}
				return use, nil
			}
			if name, n, ok := chainUseOf(m.Data, string(table)); ok {
				use[name] = n
			}
		}
	}
}

// chainUseOf reads one NFT_MSG_NEWCHAIN message of a dump: the chain's
// name and use count when it belongs to table.
func chainUseOf(data []byte, table string) (string, int, bool) {
	if len(data) < 4 {
		return "", 0, false
	}
	attrs := data[4:] // nfgenmsg
	var name, tbl string
	use := -1
	for len(attrs) >= unix.SizeofRtAttr {
		l := int(binary.NativeEndian.Uint16(attrs[0:]))
		typ := binary.NativeEndian.Uint16(attrs[2:]) &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
		if l < unix.SizeofRtAttr || l > len(attrs) {
			break
		}
		v := attrs[unix.SizeofRtAttr:l]
		switch typ {
		case unix.NFTA_CHAIN_TABLE:
			tbl = unix.ByteSliceToString(v)
		case unix.NFTA_CHAIN_NAME:
			name = unix.ByteSliceToString(v)
		case unix.NFTA_CHAIN_USE:
			if len(v) == 4 {
				use = int(binary.BigEndian.Uint32(v))
			}
		}
		next := (l + unix.NLA_ALIGNTO - 1) &^ (unix.NLA_ALIGNTO - 1)
		if next > len(attrs) {
			break
		}
		attrs = attrs[next:]
	}
	if tbl != table || name == "" || use < 0 {
		return "", 0, false
	}
	return name, use, true
}
