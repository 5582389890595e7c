package procbench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// commitRcvBuf is the receive buffer of the notification socket: a sync
// rewriting a 10,000-rule chain notifies every deleted and added rule
// before the commit's new generation.
const commitRcvBuf = 64 << 20

// newGenType is the netlink message type of nf_tables' new-generation
// notification, sent once at the end of every committed transaction.
const newGenType = unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWGEN

// CommitEvent is one nf_tables transaction committed in the watched
// namespace.
type CommitEvent struct {
	// At is when the first notification of the transaction was received:
	// the kernel queues all of a transaction's notifications, and then its
	// new generation, when it commits.
	At time.Time
	// Seen is when the new-generation message was received.
	Seen time.Time
	// Gen is the new generation; PID and Proc the committing process.
	Gen  uint32
	PID  uint32
	Proc string
	// Families has bit f set when the transaction changed an object of
	// netfilter family f (NFPROTO_IPV4, NFPROTO_IPV6, NFPROTO_INET...).
	Families uint32
	// Lost is set when notifications were lost before this one, so At and
	// Families may be incomplete.
	Lost bool
}

// Touches reports whether the transaction changed a table of family f.
func (ev CommitEvent) Touches(f uint8) bool { return f < 32 && ev.Families&(1<<f) != 0 }

// TouchesIPv4 reports whether the transaction changed IPv4 rules: a table
// of the ip or inet family.
func (ev CommitEvent) TouchesIPv4() bool {
	return ev.Touches(unix.NFPROTO_IPV4) || ev.Touches(unix.NFPROTO_INET)
}

// CommitWatcher receives the nf_tables notifications of one network
// namespace and records every commit. Run reads until Close.
type CommitWatcher struct {
	f      *os.File
	notify chan struct{}

	mu        sync.Mutex
	events    []CommitEvent
	overflows int
}

// WatchCommits opens a netlink socket inside ns subscribed to nf_tables'
// notifications. Call Run (in a goroutine of the caller's) to read them,
// and Close.
func WatchCommits(ns *netnstest.NS) (*CommitWatcher, error) {
	fd := -1
	err := ns.Do(func() error {
		var err error
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_NETFILTER)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("opening a netfilter netlink socket in %s: %w", ns.Name, err)
	}
	setup := func() error {
		if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			return fmt.Errorf("binding: %w", err)
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_ADD_MEMBERSHIP, unix.NFNLGRP_NFTABLES); err != nil {
			return fmt.Errorf("joining the nf_tables group: %w", err)
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, commitRcvBuf); err != nil {
			return fmt.Errorf("setting the receive buffer: %w", err)
		}
		return nil
	}
	if err := setup(); err != nil {
		_ = unix.Close(fd)
		return nil, fmt.Errorf("nf_tables notifications in %s: %w", ns.Name, err)
	}
	// Non-blocking, so the file uses the runtime's poller and Close
	// interrupts a pending Read.
	return &CommitWatcher{f: os.NewFile(uintptr(fd), "nftables-notifications"), notify: make(chan struct{}, 1)}, nil
}

// Run reads notifications until Close; it returns nil then.
func (w *CommitWatcher) Run() error {
	buf := make([]byte, 1<<20)
	// The transaction being received: when its first notification came,
	// the families it touched, whether some were lost.
	var first time.Time
	var families uint32
	lost := false
	for {
		n, err := w.f.Read(buf)
		now := time.Now()
		switch {
		case errors.Is(err, unix.ENOBUFS):
			// The socket overflowed: notifications were lost (a big
			// full sync). The next commit's burst starts afresh.
			w.mu.Lock()
			w.overflows++
			w.mu.Unlock()
			first, lost = time.Time{}, true
			continue
		case errors.Is(err, os.ErrClosed):
			return nil
		case err != nil:
			return fmt.Errorf("reading nf_tables notifications: %w", err)
		}
		for _, m := range splitNetlink(buf[:n]) {
			if first.IsZero() {
				first = now
			}
			if m.typ != newGenType {
				if m.typ>>8 == unix.NFNL_SUBSYS_NFTABLES && len(m.payload) > 0 && m.payload[0] < 32 {
					families |= 1 << m.payload[0]
				}
				continue
			}
			ev := parseNewGen(m.payload)
			ev.At, ev.Seen, ev.Families, ev.Lost = first, now, families, lost
			first, families, lost = time.Time{}, 0, false
			w.mu.Lock()
			w.events = append(w.events, ev)
			w.mu.Unlock()
			select {
			case w.notify <- struct{}{}:
			default:
			}
		}
	}
}

// Notify is signalled after new commits are recorded.
func (w *CommitWatcher) Notify() <-chan struct{} { return w.notify }

// Since returns the commits whose first notification was received at or
// after t.
func (w *CommitWatcher) Since(t time.Time) []CommitEvent {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []CommitEvent
	for _, ev := range w.events {
		if !ev.At.Before(t) {
			out = append(out, ev)
		}
	}
	return out
}

// Overflows counts the times notifications were lost.
func (w *CommitWatcher) Overflows() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.overflows
}

// Close closes the socket; Run returns.
func (w *CommitWatcher) Close() error { return w.f.Close() }

// netlinkMessage is one message of a netlink datagram.
type netlinkMessage struct {
	typ     uint16
	payload []byte
}

// splitNetlink splits a datagram into its messages; a malformed tail is
// dropped.
func splitNetlink(b []byte) []netlinkMessage {
	var out []netlinkMessage
	for len(b) >= unix.NLMSG_HDRLEN {
		l := int(binary.NativeEndian.Uint32(b[0:4]))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			break
		}
		out = append(out, netlinkMessage{typ: binary.NativeEndian.Uint16(b[4:6]), payload: b[unix.NLMSG_HDRLEN:l]})
		b = b[min(align4(l), len(b)):]
	}
	return out
}

func align4(n int) int { return (n + 3) &^ 3 }

// nlaTypeMask strips the nested and byte-order flags off an attribute type.
const nlaTypeMask = 0x3fff

// parseNewGen reads the attributes of a new-generation message: after the
// nfgenmsg header, the generation and the committing process's pid (both
// big-endian) and name.
func parseNewGen(payload []byte) CommitEvent {
	var ev CommitEvent
	const nfgenmsgLen = 4
	if len(payload) < nfgenmsgLen {
		return ev
	}
	b := payload[nfgenmsgLen:]
	for len(b) >= unix.SizeofNlAttr {
		l := int(binary.NativeEndian.Uint16(b[0:2]))
		typ := binary.NativeEndian.Uint16(b[2:4]) & nlaTypeMask
		if l < unix.SizeofNlAttr || l > len(b) {
			break
		}
		v := b[unix.SizeofNlAttr:l]
		switch {
		case typ == unix.NFTA_GEN_ID && len(v) >= 4:
			ev.Gen = binary.BigEndian.Uint32(v)
		case typ == unix.NFTA_GEN_PROC_PID && len(v) >= 4:
			ev.PID = binary.BigEndian.Uint32(v)
		case typ == unix.NFTA_GEN_PROC_NAME:
			for i, c := range v {
				if c == 0 {
					v = v[:i]
					break
				}
			}
			ev.Proc = string(v)
		}
		b = b[min(align4(l), len(b)):]
	}
	return ev
}
