package ipset

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	vnl "github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netlink"
)

// Options configures the real implementation returned by New.
type Options struct {
	// NetNS, when set, is the named network namespace (as made by `ip
	// netns add`) whose sets the Real manages; for tests and tools. Empty
	// means the current namespace.
	NetNS string
	// Timeout bounds each call (see Real); zero means
	// netlink.DefaultTimeout.
	Timeout time.Duration
}

// revisions are the set type revisions Real creates: the first of each
// type with the comment extension (and, for the port types, SCTP).
var revisions = map[Type]uint8{
	HashIP:        2,
	HashIPPort:    3,
	HashIPPortIP:  3,
	HashIPPortNet: 5,
	HashNet:       4,
	BitmapPort:    2,
}

// Real is the Interface implementation for a real kernel, over
// vishvananda/netlink's ipset API (netfilter netlink; no ipset binary).
//
// netlink v1.3.1 creates, lists, flushes and destroys every supported type
// and adds and deletes the entries of every hash type, but not bitmap:port
// entries: its entry encoding always adds a protocol attribute next to the
// port, which the kernel's bitmap:port refuses (IPSET_ERR_PROTOCOL). Real
// therefore sends bitmap:port add and delete requests itself, over a second
// netfilter netlink socket in the same namespace, with the port alone. No
// set type needs `ipset restore`.
//
// Real remembers the sets passed to EnsureSet: their comment labels new
// entries, and their type and family let AddEntry and DelEntry refuse
// unfitting entries with ErrInvalidEntry before asking the kernel. Safe
// for concurrent use.
//
// Every call ends by its deadline (Options.Timeout or the caller's,
// whichever is earlier) with an error wrapping context.DeadlineExceeded: a
// netlink request cannot be cancelled, so the call runs under a
// deadline.Guard, and both sockets' send and receive timeouts are the
// same, so that an abandoned call waiting for its answer ends too
// (docs/design.md, "Deadlines on kernel calls").
type Real struct {
	h   *vnl.Handle
	raw *nl.NetlinkSocket
	// rawSockets makes nl requests use raw.
	rawSockets map[int]*nl.SocketHandle

	timeout time.Duration
	guard   deadline.Guard

	mu   sync.Mutex
	sets map[string]Set // by name, as last ensured
}

var _ Interface = (*Real)(nil)

// New opens netfilter netlink sockets in opts.NetNS. The caller must Close
// the result.
func New(opts Options) (*Real, error) {
	ns := netns.None()
	where := "the current network namespace"
	if opts.NetNS != "" {
		var err error
		if ns, err = netns.GetFromName(opts.NetNS); err != nil {
			return nil, fmt.Errorf("opening network namespace %q: %w", opts.NetNS, err)
		}
		defer ns.Close()
		where = "network namespace " + opts.NetNS
	}
	h, err := vnl.NewHandleAt(ns, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("opening netfilter netlink socket in %s: %w", where, err)
	}
	raw, err := nl.GetNetlinkSocketAt(ns, netns.None(), unix.NETLINK_NETFILTER)
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("opening netfilter netlink socket in %s: %w", where, err)
	}
	timeout := opts.Timeout
	if timeout <= 0 {
		timeout = netlink.DefaultTimeout
	}
	tv := unix.NsecToTimeval(timeout.Nanoseconds())
	for _, set := range []func(*unix.Timeval) error{raw.SetSendTimeout, raw.SetReceiveTimeout} {
		if err := set(&tv); err != nil {
			h.Close()
			raw.Close()
			return nil, fmt.Errorf("setting netlink socket timeout: %w", err)
		}
	}
	if err := h.SetSocketTimeout(timeout); err != nil {
		h.Close()
		raw.Close()
		return nil, fmt.Errorf("setting netlink socket timeout: %w", err)
	}
	return &Real{
		h:          h,
		raw:        raw,
		rawSockets: map[int]*nl.SocketHandle{unix.NETLINK_NETFILTER: {Socket: raw}},
		timeout:    timeout,
		sets:       map[string]Set{},
	}, nil
}

// Close releases the sockets.
func (r *Real) Close() error {
	r.h.Close()
	r.raw.Close()
	return nil
}

// call runs a netlink ipset call, turning a panic into an error: the
// library asserts that every failure is an errno, which a few (an
// interrupted dump, a reply from the wrong sender) are not. The panic of
// an interrupted dump becomes an error wrapping netlink.ErrDumpInterrupted,
// so that the dump can be retried.
func call(fn func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			if isDumpInterruptedPanic(p) {
				err = fmt.Errorf("netlink ipset request: %w", netlink.ErrDumpInterrupted)
				return
			}
			err = fmt.Errorf("netlink ipset request failed: %v", p)
		}
	}()
	return fn()
}

// isDumpInterruptedPanic reports whether p is the panic of the library's
// errno assertion failing on netlink.ErrDumpInterrupted: it compares p
// with the panic of that very assertion, made here.
func isDumpInterruptedPanic(p any) bool {
	got, ok := p.(runtime.Error)
	if !ok {
		return false
	}
	return got.Error() == errnoAssertionPanic(netlink.ErrDumpInterrupted)
}

// errnoAssertionPanic is the message of the panic that asserting err to
// be a syscall.Errno raises ("" when err is one).
func errnoAssertionPanic(err error) (msg string) {
	defer func() {
		if p, ok := recover().(runtime.Error); ok {
			msg = p.Error()
		}
	}()
	_ = err.(syscall.Errno)
	return ""
}

// errno extracts the kernel's error number, ipset's private ones included.
func errno(err error) (int, bool) {
	var ie nl.IPSetError
	if errors.As(err, &ie) {
		return int(ie), true
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		return int(e), true
	}
	return 0, false
}

// kernelErr names ipset's private errors and adds this package's
// sentinels.
func kernelErr(err error) error {
	n, ok := errno(err)
	if !ok {
		return err
	}
	if _, isIPSet := err.(nl.IPSetError); !isIPSet && n >= nl.IPSET_ERR_PRIVATE {
		err = nl.IPSetError(n)
	}
	switch n {
	case int(unix.ENOENT):
		return fmt.Errorf("%w (%w)", ErrNotExist, err)
	case nl.IPSET_ERR_BUSY, nl.IPSET_ERR_REFERENCED:
		return fmt.Errorf("%w (%w)", ErrInUse, err)
	case nl.IPSET_ERR_PROTOCOL, nl.IPSET_ERR_INVALID_CIDR, nl.IPSET_ERR_INVALID_FAMILY,
		nl.IPSET_ERR_IPADDR_IPV4, nl.IPSET_ERR_IPADDR_IPV6:
		return fmt.Errorf("%w (%w)", ErrInvalidEntry, err)
	}
	return err
}

// ensureSet does EnsureSet's work, under its deadline. A set met for the
// first time is created exclusively; if it exists, its header is checked.
// Later calls for the same set ask the kernel to create it unless an
// identical one exists, which recreates a set destroyed behind kproxy's
// back.
func (r *Real) ensureSet(ctx context.Context, set Set) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateSet(set); err != nil {
		return err
	}
	set = set.normalized()
	r.mu.Lock()
	known, ok := r.sets[set.Name]
	r.mu.Unlock()
	mayExist := ok && known.Type == set.Type && known.IPv6 == set.IPv6 && (known.Comment != "") == (set.Comment != "")

	err := call(func() error { return r.h.IpsetCreate(set.Name, string(set.Type), createOptions(set, mayExist)) })
	if err != nil {
		n, _ := errno(err)
		if n == nl.IPSET_ERR_FIND_TYPE {
			module := "ip_set_" + strings.NewReplacer(":", "_", ",", "").Replace(string(set.Type))
			return fmt.Errorf("creating %s set %s: the kernel has no set type %s of revision %d (module %s not loaded?): %w",
				set.Type, set.Name, set.Type, revisions[set.Type], module, kernelErr(err))
		}
		if n != int(unix.EEXIST) && n != nl.IPSET_ERR_EXIST {
			return fmt.Errorf("creating %s set %s: %w", set.Type, set.Name, kernelErr(err))
		}
		if err := r.checkExisting(ctx, set); err != nil {
			return err
		}
	}
	r.mu.Lock()
	r.sets[set.Name] = set
	r.mu.Unlock()
	klog.FromContext(ctx).V(4).Info("Ensured ipset", "set", set.Name, "type", set.Type, "family", set.family())
	return nil
}

// EnsureSet implements Interface.
func (r *Real) EnsureSet(ctx context.Context, set Set) error {
	return r.guard.Do(ctx, "ipset: ensuring set "+set.Name, r.timeout, func(ctx context.Context) error {
		return r.ensureSet(ctx, set)
	}, nil)
}

// DestroySet implements Interface.
func (r *Real) DestroySet(ctx context.Context, name string) error {
	return r.guard.Do(ctx, "ipset: destroying set "+name, r.timeout, func(ctx context.Context) error {
		return r.destroySet(ctx, name)
	}, nil)
}

// ListSets implements Interface.
func (r *Real) ListSets(ctx context.Context) ([]string, error) {
	return deadline.Call(ctx, &r.guard, "ipset: listing sets", r.timeout, r.listSets, nil)
}

// Entries implements Interface.
func (r *Real) Entries(ctx context.Context, name string) ([]Entry, error) {
	return deadline.Call(ctx, &r.guard, "ipset: listing entries of set "+name, r.timeout, func(ctx context.Context) ([]Entry, error) {
		return r.entries(ctx, name)
	}, nil)
}

// AddEntry implements Interface.
func (r *Real) AddEntry(ctx context.Context, name string, e Entry) error {
	return r.guard.Do(ctx, "ipset: adding an entry to set "+name, r.timeout, func(ctx context.Context) error {
		return r.addEntry(ctx, name, e)
	}, nil)
}

// DelEntry implements Interface.
func (r *Real) DelEntry(ctx context.Context, name string, e Entry) error {
	return r.guard.Do(ctx, "ipset: deleting an entry from set "+name, r.timeout, func(ctx context.Context) error {
		return r.delEntry(ctx, name, e)
	}, nil)
}

// HasEntry implements Interface.
func (r *Real) HasEntry(ctx context.Context, name string, e Entry) (bool, error) {
	return deadline.Call(ctx, &r.guard, "ipset: testing an entry of set "+name, r.timeout, func(ctx context.Context) (bool, error) {
		return r.hasEntry(ctx, name, e)
	}, nil)
}

// FlushSet implements Interface.
func (r *Real) FlushSet(ctx context.Context, name string) error {
	return r.guard.Do(ctx, "ipset: flushing set "+name, r.timeout, func(ctx context.Context) error {
		return r.flushSet(ctx, name)
	}, nil)
}

func (r *Real) comment(name string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sets[name].Comment
}

func createOptions(set Set, mayExist bool) vnl.IpsetCreateOptions {
	o := vnl.IpsetCreateOptions{
		Replace:  mayExist, // no NLM_F_EXCL: an identical set is not an error
		Comments: set.Comment != "",
		Revision: revisions[set.Type],
	}
	if set.Type == BitmapPort {
		o.PortFrom, o.PortTo = 0, 65535
		return o
	}
	o.Family = unix.AF_INET
	if set.IPv6 {
		o.Family = unix.AF_INET6
	}
	o.MaxElements = MaxElements
	return o
}

// extensionFlags are the create flags of extensions kproxy may use or must
// not find.
const extensionFlags = nl.IPSET_FLAG_WITH_COMMENT | nl.IPSET_FLAG_WITH_COUNTERS | nl.IPSET_FLAG_WITH_SKBINFO | nl.IPSET_FLAG_WITH_FORCEADD

// checkExisting compares the existing set name with set.
func (r *Real) checkExisting(ctx context.Context, set Set) error {
	headers, err := r.list(ctx, "reading existing set "+set.Name, set.Name, listHeader)
	if err != nil {
		return err
	}
	if len(headers) == 0 {
		return fmt.Errorf("reading existing set %s: the kernel listed nothing", set.Name)
	}
	have := headers[len(headers)-1]
	haveSet := Set{Name: set.Name, Type: Type(have.typeName), IPv6: have.family == unix.AF_INET6}.normalized()
	var wantFlags uint32
	if set.Comment != "" {
		wantFlags = nl.IPSET_FLAG_WITH_COMMENT
	}
	switch {
	case haveSet.Type != set.Type || haveSet.IPv6 != set.IPv6:
		return fmt.Errorf("ensuring %s set %s (family %s): %w: it is a %s set (family %s)",
			set.Type, set.Name, set.family(), ErrIncompatible, have.typeName, haveSet.family())
	case have.cadtFlags&extensionFlags != wantFlags || have.timeout:
		return fmt.Errorf("ensuring %s set %s (comment %v): %w: it has other extensions (flags %#x, timeout %v)",
			set.Type, set.Name, set.Comment != "", ErrIncompatible, have.cadtFlags&extensionFlags, have.timeout)
	case set.Type != BitmapPort && have.maxElements != MaxElements:
		return fmt.Errorf("ensuring %s set %s: %w: its maxelem is %d, not %d",
			set.Type, set.Name, ErrIncompatible, have.maxElements, MaxElements)
	case set.Type == BitmapPort && (have.portFrom != 0 || have.portTo != 65535):
		return fmt.Errorf("ensuring %s set %s: %w: its range is %d-%d, not 0-65535",
			set.Type, set.Name, ErrIncompatible, have.portFrom, have.portTo)
	}
	return nil
}

// destroySet does DestroySet's work, under its deadline.
func (r *Real) destroySet(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateName(name); err != nil {
		return err
	}
	err := call(func() error { return r.h.IpsetDestroy(name) })
	if err != nil {
		if n, _ := errno(err); n != int(unix.ENOENT) {
			return fmt.Errorf("destroying set %s: %w", name, kernelErr(err))
		}
	}
	r.mu.Lock()
	delete(r.sets, name)
	r.mu.Unlock()
	klog.FromContext(ctx).V(4).Info("Destroyed ipset", "set", name)
	return nil
}

// listSets does ListSets' work, under its deadline. It asks the kernel for
// names only.
func (r *Real) listSets(ctx context.Context) ([]string, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	headers, err := r.list(ctx, "listing sets", "", listSetName)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(headers))
	for _, h := range headers {
		names = append(names, h.name)
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

// entries does Entries' work, under its deadline. Sets of other types
// than this package's are refused.
func (r *Real) entries(ctx context.Context, name string) ([]Entry, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := validateName(name); err != nil {
		return nil, err
	}
	res, err := netlink.RetryDump(ctx, "listing entries of set "+name, func() (*vnl.IPSetResult, error) {
		var res *vnl.IPSetResult
		err := call(func() error {
			var err error
			res, err = r.h.IpsetList(name)
			return err
		})
		return res, kernelErr(err)
	})
	if err != nil {
		return nil, err
	}
	typ := Type(res.TypeName)
	if _, ok := revisions[typ]; !ok {
		return nil, fmt.Errorf("listing entries of set %s: unsupported type %q", name, res.TypeName)
	}
	out := make([]Entry, 0, len(res.Entries))
	for _, le := range res.Entries {
		e, err := fromLibEntry(typ, le)
		if err != nil {
			return nil, fmt.Errorf("listing entries of %s set %s: %w", typ, name, err)
		}
		out = append(out, e)
	}
	slices.SortFunc(out, compareEntries)
	return out, nil
}

// entryFor validates e, against the set's type and family when known.
func (r *Real) entryFor(name string, e Entry) (Entry, Type, error) {
	if err := validateName(name); err != nil {
		return e, "", err
	}
	r.mu.Lock()
	set, known := r.sets[name]
	r.mu.Unlock()
	if known {
		n, err := set.checkEntry(e)
		return n, set.Type, err
	}
	n, typ, _, err := e.normalize()
	return n, typ, err
}

// addEntry does AddEntry's work, under its deadline.
func (r *Real) addEntry(ctx context.Context, name string, e Entry) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	n, typ, err := r.entryFor(name, e)
	if err != nil {
		return err
	}
	comment := r.comment(name)
	if typ == BitmapPort {
		err = r.portRequest(nl.IPSET_CMD_ADD, name, n.Port, comment)
	} else {
		le := toLibEntry(n)
		le.Comment = comment
		err = call(func() error { return r.h.IpsetAdd(name, le) })
	}
	if err != nil {
		return fmt.Errorf("adding %s to set %s: %w", e, name, kernelErr(err))
	}
	klog.FromContext(ctx).V(5).Info("Added ipset entry", "set", name, "entry", n)
	return nil
}

// delEntry does DelEntry's work, under its deadline.
func (r *Real) delEntry(ctx context.Context, name string, e Entry) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	n, typ, err := r.entryFor(name, e)
	if err != nil {
		return err
	}
	if typ == BitmapPort {
		err = r.portRequest(nl.IPSET_CMD_DEL, name, n.Port, "")
	} else {
		err = call(func() error { return r.h.IpsetDel(name, toLibEntry(n)) })
	}
	if err != nil {
		return fmt.Errorf("deleting %s from set %s: %w", e, name, kernelErr(err))
	}
	klog.FromContext(ctx).V(5).Info("Deleted ipset entry", "set", name, "entry", n)
	return nil
}

// hasEntry does HasEntry's work, under its deadline: the kernel answers a
// test request with IPSET_ERR_EXIST when the entry is absent.
func (r *Real) hasEntry(ctx context.Context, name string, e Entry) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	n, typ, err := r.entryFor(name, e)
	if err != nil {
		return false, err
	}
	var has bool
	if typ == BitmapPort {
		err = r.portRequest(nl.IPSET_CMD_TEST, name, n.Port, "")
		has = err == nil
		if code, ok := errno(err); ok && code == nl.IPSET_ERR_EXIST {
			err = nil
		}
	} else {
		// The library answers IPSET_ERR_EXIST with (false, nil).
		err = call(func() error {
			var err error
			has, err = r.h.IpsetTest(name, toLibEntry(n))
			return err
		})
	}
	if err != nil {
		return false, fmt.Errorf("testing %s in set %s: %w", e, name, kernelErr(err))
	}
	return has, nil
}

// flushSet does FlushSet's work, under its deadline.
func (r *Real) flushSet(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateName(name); err != nil {
		return err
	}
	if err := call(func() error { return r.h.IpsetFlush(name) }); err != nil {
		return fmt.Errorf("flushing set %s: %w", name, kernelErr(err))
	}
	klog.FromContext(ctx).V(4).Info("Flushed ipset", "set", name)
	return nil
}

// portRequest adds (cmd IPSET_CMD_ADD) or deletes (IPSET_CMD_DEL) port in
// the bitmap:port set name, without NLM_F_EXCL: adding a present port or
// deleting an absent one is no error. This is the request netlink's
// IpsetAdd and IpsetDel build, minus the protocol attribute.
func (r *Real) portRequest(cmd int, name string, port uint16, comment string) error {
	_, err := r.newPortRequest(cmd, name, port, comment).Execute(unix.NETLINK_NETFILTER, 0)
	return err
}

// newPortRequest builds portRequest's request, on the raw socket.
func (r *Real) newPortRequest(cmd int, name string, port uint16, comment string) *nl.NetlinkRequest {
	req := nl.NewNetlinkRequest(cmd|(unix.NFNL_SUBSYS_IPSET<<8), nl.GetIpsetFlags(cmd))
	req.Sockets = r.rawSockets
	req.AddData(&nl.Nfgenmsg{NfgenFamily: unix.AF_NETLINK, Version: nl.NFNETLINK_V0})
	req.AddData(nl.NewRtAttr(nl.IPSET_ATTR_PROTOCOL, nl.Uint8Attr(nl.IPSET_PROTOCOL)))
	req.AddData(nl.NewRtAttr(nl.IPSET_ATTR_SETNAME, nl.ZeroTerminated(name)))
	data := nl.NewRtAttr(nl.IPSET_ATTR_DATA|int(nl.NLA_F_NESTED), nil)
	data.AddChild(nl.NewRtAttr(nl.IPSET_ATTR_PORT|int(nl.NLA_F_NET_BYTEORDER), binary.BigEndian.AppendUint16(nil, port)))
	if comment != "" {
		data.AddChild(nl.NewRtAttr(nl.IPSET_ATTR_COMMENT, nl.ZeroTerminated(comment)))
	}
	req.AddData(data)
	return req
}

var protocolNumbers = map[string]uint8{ProtocolTCP: unix.IPPROTO_TCP, ProtocolUDP: unix.IPPROTO_UDP, ProtocolSCTP: unix.IPPROTO_SCTP}

// toLibEntry encodes a normalized hash set entry. Replace leaves out
// NLM_F_EXCL, so adding a present entry or deleting an absent one is no
// error.
func toLibEntry(e Entry) *vnl.IPSetEntry {
	le := &vnl.IPSetEntry{Replace: true}
	if e.IP.IsValid() {
		le.IP = net.IP(e.IP.AsSlice())
	}
	if e.Protocol != "" {
		proto, port := protocolNumbers[e.Protocol], e.Port
		le.Protocol, le.Port = &proto, &port
	}
	if e.IP2.IsValid() {
		le.IP2 = net.IP(e.IP2.AsSlice())
	}
	if e.Net.IsValid() {
		addr, bits := net.IP(e.Net.Addr().AsSlice()), uint8(e.Net.Bits())
		if e.IP.IsValid() {
			le.IP2, le.CIDR2 = addr, bits
		} else {
			le.IP, le.CIDR = addr, bits
		}
	}
	return le
}

// fromLibEntry decodes an entry of a typ set.
func fromLibEntry(typ Type, le vnl.IPSetEntry) (Entry, error) {
	addr := func(ip net.IP) (netip.Addr, error) {
		a, ok := netip.AddrFromSlice(ip)
		if !ok {
			return a, fmt.Errorf("entry with unparsable address %v", ip)
		}
		return a, nil
	}
	prefix := func(ip net.IP, bits uint8) (netip.Prefix, error) {
		a, err := addr(ip)
		if err != nil {
			return netip.Prefix{}, err
		}
		if bits == 0 {
			bits = uint8(a.BitLen())
		}
		return netip.PrefixFrom(a, int(bits)).Masked(), nil
	}
	var e Entry
	var err error
	port := func() {
		if le.Port != nil {
			e.Port = *le.Port
		}
		if le.Protocol != nil {
			e.Protocol = strconv.Itoa(int(*le.Protocol))
			for name, n := range protocolNumbers {
				if n == *le.Protocol {
					e.Protocol = name
				}
			}
		}
	}
	switch typ {
	case HashIP:
		e.IP, err = addr(le.IP)
	case HashIPPort:
		e.IP, err = addr(le.IP)
		port()
	case HashIPPortIP:
		if e.IP, err = addr(le.IP); err == nil {
			e.IP2, err = addr(le.IP2)
		}
		port()
	case HashIPPortNet:
		if e.IP, err = addr(le.IP); err == nil {
			e.Net, err = prefix(le.IP2, le.CIDR2)
		}
		port()
	case HashNet:
		e.Net, err = prefix(le.IP, le.CIDR)
	case BitmapPort:
		if le.Port == nil {
			return e, errors.New("port entry without a port")
		}
		e.Port = *le.Port
	}
	return e, err
}

// List flags (IPSET_FLAG_LIST_*): names only, or headers without entries.
const (
	listSetName = 1 << 1
	listHeader  = 1 << 2
)

// header is what a header-only listing says about a set.
type header struct {
	name, typeName   string
	family           uint8
	cadtFlags        uint32
	maxElements      uint32
	timeout          bool
	portFrom, portTo uint16
}

// list dumps the set name (every set when empty) with listing flags,
// parsing each message itself: netlink's parser logs every attribute it does
// not know (such as newer kernels' bucket size) through the standard
// logger, and its listing always includes every entry. An interrupted dump
// is retried; errors name op.
func (r *Real) list(ctx context.Context, op, name string, flags uint32) ([]header, error) {
	return netlink.RetryDump(ctx, op, func() ([]header, error) {
		headers, err := r.listOnce(name, flags)
		return headers, kernelErr(err)
	})
}

// listOnce dumps as list does, once.
func (r *Real) listOnce(name string, flags uint32) ([]header, error) {
	req := nl.NewNetlinkRequest(nl.IPSET_CMD_LIST|(unix.NFNL_SUBSYS_IPSET<<8), nl.GetIpsetFlags(nl.IPSET_CMD_LIST))
	req.Sockets = r.rawSockets
	req.AddData(&nl.Nfgenmsg{NfgenFamily: unix.AF_NETLINK, Version: nl.NFNETLINK_V0})
	req.AddData(nl.NewRtAttr(nl.IPSET_ATTR_PROTOCOL, nl.Uint8Attr(nl.IPSET_PROTOCOL)))
	if name != "" {
		req.AddData(nl.NewRtAttr(nl.IPSET_ATTR_SETNAME, nl.ZeroTerminated(name)))
	}
	req.AddData(nl.NewRtAttr(nl.IPSET_ATTR_FLAGS, binary.BigEndian.AppendUint32(nil, flags)))
	var (
		headers  []header
		parseErr error
	)
	err := req.ExecuteIter(unix.NETLINK_NETFILTER, 0, func(msg []byte) bool {
		h, err := parseHeader(msg)
		if err != nil {
			parseErr = err
			return false
		}
		headers = append(headers, h)
		return true
	})
	if err != nil {
		return headers, err
	}
	return headers, parseErr
}

// parseHeader reads one listing message: the netfilter header, then
// attributes, with the set's settings nested in IPSET_ATTR_DATA.
func parseHeader(msg []byte) (header, error) {
	var h header
	if len(msg) < nl.SizeofNfgenmsg {
		return h, fmt.Errorf("short ipset listing message (%d bytes)", len(msg))
	}
	err := walkAttrs(msg[nl.SizeofNfgenmsg:], func(typ uint16, v []byte) {
		switch typ {
		case nl.IPSET_ATTR_SETNAME:
			h.name = unix.ByteSliceToString(v)
		case nl.IPSET_ATTR_TYPENAME:
			h.typeName = unix.ByteSliceToString(v)
		case nl.IPSET_ATTR_FAMILY:
			if len(v) > 0 {
				h.family = v[0]
			}
		case nl.IPSET_ATTR_DATA:
			_ = walkAttrs(v, func(typ uint16, v []byte) {
				switch {
				case typ == nl.IPSET_ATTR_CADT_FLAGS && len(v) == 4:
					h.cadtFlags = binary.BigEndian.Uint32(v)
				case typ == nl.IPSET_ATTR_MAXELEM && len(v) == 4:
					h.maxElements = binary.BigEndian.Uint32(v)
				case typ == nl.IPSET_ATTR_TIMEOUT:
					h.timeout = true
				case typ == nl.IPSET_ATTR_PORT_FROM && len(v) == 2:
					h.portFrom = binary.BigEndian.Uint16(v)
				case typ == nl.IPSET_ATTR_PORT_TO && len(v) == 2:
					h.portTo = binary.BigEndian.Uint16(v)
				}
			})
		}
	})
	return h, err
}

// walkAttrs calls fn with each netlink attribute's type (without the
// nested and byte-order flags) and value.
func walkAttrs(b []byte, fn func(typ uint16, v []byte)) error {
	for len(b) >= unix.SizeofNlAttr {
		n := int(nl.NativeEndian().Uint16(b[0:2]))
		if n < unix.SizeofNlAttr || n > len(b) {
			return fmt.Errorf("malformed netlink attribute (length %d of %d bytes)", n, len(b))
		}
		fn(nl.NativeEndian().Uint16(b[2:4])&nl.NLA_TYPE_MASK, b[unix.SizeofNlAttr:n])
		b = b[min(nlaAlign(n), len(b)):]
	}
	return nil
}

func nlaAlign(n int) int { return (n + unix.NLA_ALIGNTO - 1) &^ (unix.NLA_ALIGNTO - 1) }
