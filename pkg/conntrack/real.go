package conntrack

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	vnl "github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netlink"
)

// Options configures the real implementation returned by New.
type Options struct {
	// NetNS, when set, is the named network namespace (as made by `ip
	// netns add`) whose conntrack table the Real works on; for tests and
	// tools. Empty means the current namespace.
	NetNS string
	// Timeout bounds each call (see Real); zero means DefaultTimeout.
	Timeout time.Duration
}

// DefaultTimeout bounds one call of Real: ClearEntries dumps the whole
// table (up to nf_conntrack_max flows, hundreds of thousands on a busy
// node) and deletes each match with a request of its own, so it gets
// twice the time of a single netlink request (netlink.DefaultTimeout); a
// call still running after a minute is hung.
const DefaultTimeout = 60 * time.Second

// Real is the Interface implementation over a netfilter netlink socket
// (the nf_conntrack_netlink module).
//
// Every call ends by its deadline (Options.Timeout or the caller's,
// whichever is earlier) with an error wrapping context.DeadlineExceeded: a
// netlink request cannot be cancelled, so the call runs under a
// deadline.Guard, and the socket's send and receive timeouts are the
// same, so that an abandoned call waiting for an answer ends too
// (docs/design.md, "Deadlines on kernel calls").
type Real struct {
	// mu serializes requests: a deletion is a dump followed by one delete
	// request per matching flow on the same socket.
	mu      sync.Mutex
	h       *vnl.Handle
	timeout time.Duration
	guard   deadline.Guard
}

var _ Interface = (*Real)(nil)

// New opens a netfilter netlink socket in opts.NetNS. The caller must
// Close the result.
func New(opts Options) (*Real, error) {
	timeout := opts.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	var h *vnl.Handle
	if opts.NetNS == "" {
		var err error
		if h, err = vnl.NewHandle(unix.NETLINK_NETFILTER); err != nil {
			return nil, fmt.Errorf("opening netfilter netlink socket: %w", err)
		}
	} else {
		ns, err := netns.GetFromName(opts.NetNS)
		if err != nil {
			return nil, fmt.Errorf("opening network namespace %q: %w", opts.NetNS, err)
		}
		defer ns.Close()
		if h, err = vnl.NewHandleAt(ns, unix.NETLINK_NETFILTER); err != nil {
			return nil, fmt.Errorf("opening netfilter netlink socket in network namespace %q: %w", opts.NetNS, err)
		}
	}
	if err := h.SetSocketTimeout(timeout); err != nil {
		h.Close()
		return nil, fmt.Errorf("setting the netfilter netlink socket's timeout: %w", err)
	}
	return &Real{h: h, timeout: timeout}, nil
}

// Close releases the socket.
func (r *Real) Close() error {
	r.h.Close()
	return nil
}

func inetFamily(family v1.IPFamily) (vnl.InetFamily, error) {
	switch family {
	case v1.IPv4Protocol:
		return unix.AF_INET, nil
	case v1.IPv6Protocol:
		return unix.AF_INET6, nil
	}
	return 0, fmt.Errorf("unknown IP family %q", family)
}

// ListEntries implements Interface. A dump the kernel reports as
// interrupted is read again; when it keeps being interrupted the error
// comes with the last, possibly partial, list.
func (r *Real) ListEntries(ctx context.Context, family v1.IPFamily) ([]Flow, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	fam, err := inetFamily(family)
	if err != nil {
		return nil, err
	}
	op := fmt.Sprintf("listing %s conntrack entries", family)
	// The flows come back with the error, too: a dump interrupted every
	// time returns what it read.
	type result struct {
		flows []Flow
		err   error
	}
	res, err := deadline.Call(ctx, &r.guard, "conntrack: "+op, r.timeout, func(ctx context.Context) (result, error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		flows, err := netlink.RetryDump(ctx, op, func() ([]*vnl.ConntrackFlow, error) {
			return r.h.ConntrackTableList(vnl.ConntrackTable, fam)
		})
		out := make([]Flow, 0, len(flows))
		for _, f := range flows {
			out = append(out, flowFromNetlink(f))
		}
		return result{out, err}, nil
	}, nil)
	if err != nil {
		return nil, err
	}
	return res.flows, res.err
}

// ClearEntries implements Interface. The kernel offers no deletion by
// filter: the table is dumped and each matching flow deleted by its tuple.
// A flow that is gone by then counts as deleted. When the kernel reports
// the dump as interrupted, the flows it did return are deleted all the
// same and the table is dumped again, since a flow may have been missed.
func (r *Real) ClearEntries(ctx context.Context, family v1.IPFamily, filters ...Filter) (int, error) {
	if len(filters) == 0 {
		return 0, nil
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	fam, err := inetFamily(family)
	if err != nil {
		return 0, err
	}
	op := fmt.Sprintf("deleting %s conntrack entries", family)
	// An abandoned call goes on reading them after ClearEntries returned.
	filters = slices.Clone(filters)
	// The count comes back with the error, too: a failure part way has
	// deleted some.
	type result struct {
		n   uint
		err error
	}
	res, err := deadline.Call(ctx, &r.guard, "conntrack: "+op, r.timeout, func(ctx context.Context) (result, error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		var n uint
		_, err := netlink.RetryDump(ctx, op, func() (struct{}, error) {
			deleted, err := r.h.ConntrackDeleteFilters(vnl.ConntrackTable, fam, netlinkFilter{newFilterSet(filters)})
			n += deleted
			return struct{}{}, err
		})
		return result{n, err}, nil
	}, nil)
	if err != nil {
		// Abandoned: how many it deletes is unknown.
		return 0, err
	}
	if res.err != nil {
		return int(res.n), res.err
	}
	klog.FromContext(ctx).V(4).Info("Deleted conntrack entries", "ipFamily", family, "filters", len(filters), "deleted", res.n)
	return int(res.n), nil
}

// netlinkFilter adapts filters to the netlink library: a flow matches when
// any filter does.
type netlinkFilter struct{ set filterSet }

func (fs netlinkFilter) MatchConntrackFlow(flow *vnl.ConntrackFlow) bool {
	return fs.set.matches(flowFromNetlink(flow))
}

func flowFromNetlink(f *vnl.ConntrackFlow) Flow {
	fl := Flow{
		Protocol: protocolFromNumber(f.Forward.Protocol),
		Original: tupleFromNetlink(f.Forward),
		Reply:    tupleFromNetlink(f.Reverse),
	}
	if tcp, ok := f.ProtoInfo.(*vnl.ProtoInfoTCP); ok && tcp != nil {
		fl.TCPState = tcp.State
	}
	return fl
}

func tupleFromNetlink(t vnl.IPTuple) Tuple {
	return Tuple{Src: addrPort(t.SrcIP, t.SrcPort), Dst: addrPort(t.DstIP, t.DstPort)}
}

func addrPort(ip net.IP, port uint16) netip.AddrPort {
	a, _ := netip.AddrFromSlice(ip)
	return netip.AddrPortFrom(a.Unmap(), port)
}

func protocolFromNumber(p uint8) v1.Protocol {
	switch p {
	case unix.IPPROTO_TCP:
		return v1.ProtocolTCP
	case unix.IPPROTO_UDP:
		return v1.ProtocolUDP
	case unix.IPPROTO_SCTP:
		return v1.ProtocolSCTP
	}
	return v1.Protocol("proto-" + strconv.Itoa(int(p)))
}
