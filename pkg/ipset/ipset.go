// Package ipset is kproxy's small interface to the kernel's IP sets, which
// IPVS mode's iptables rules match with `-m set`. One real implementation
// uses github.com/vishvananda/netlink's ipset API; one fake is an in-memory
// store that also answers set-type-aware membership questions for the packet
// tracer (Fake.Contains).
//
// Six set types are supported, each with its own entry shape:
//
//	hash:ip            IP                          10.0.0.1
//	hash:ip,port       IP, Protocol, Port          10.0.0.1,tcp:80
//	hash:ip,port,ip    IP, Protocol, Port, IP2     10.0.0.1,tcp:80,10.0.0.1
//	hash:ip,port,net   IP, Protocol, Port, Net     10.0.0.1,tcp:80,10.1.0.0/16
//	hash:net           Net                         10.0.0.0/8
//	bitmap:port        Port                        30080
//
// Protocols are "tcp", "udp" and "sctp". A bitmap:port set covers every
// port (0-65535) and matches packets of any of those protocols.
package ipset

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Type is an ipset set type.
type Type string

const (
	HashIP        Type = "hash:ip"
	HashIPPort    Type = "hash:ip,port"
	HashIPPortIP  Type = "hash:ip,port,ip"
	HashIPPortNet Type = "hash:ip,port,net"
	HashNet       Type = "hash:net"
	BitmapPort    Type = "bitmap:port"
)

// Protocols of port entries.
const (
	ProtocolTCP  = "tcp"
	ProtocolUDP  = "udp"
	ProtocolSCTP = "sctp"
)

// MaxNameLength is the longest set name the kernel accepts.
const MaxNameLength = 31

// MaxElements is the capacity of every hash set kproxy creates. The
// kernel's default (65536) is too small for per-endpoint sets of large
// clusters; the table grows with its contents, so a high limit costs
// nothing until used.
const MaxElements = 1 << 20

// Set describes a set.
type Set struct {
	Name string
	Type Type
	// IPv6 makes a hash set hold IPv6 addresses (family inet6). Port
	// bitmaps have no family and ignore it.
	IPv6 bool
	// Comment, when not empty, creates the set with the comment extension
	// and labels every entry AddEntry adds with it, so `ipset list` shows
	// what the entries are for. The kernel keeps no comment for a set
	// itself.
	Comment string
}

// Entry is a member of a set; which fields are used depends on the set's
// type (see the package documentation). Unused fields must be zero.
type Entry struct {
	IP       netip.Addr
	Protocol string
	Port     uint16
	IP2      netip.Addr
	// Net is stored masked, as the kernel stores it: adding
	// 10.1.2.3/8 adds 10.0.0.0/8.
	Net netip.Prefix
}

// Interface is the whole of kproxy's access to one network namespace's IP
// sets.
type Interface interface {
	// EnsureSet creates set unless it exists. A set of that name with a
	// different type, family or extensions fails with ErrIncompatible
	// (destroy it first).
	EnsureSet(ctx context.Context, set Set) error
	// DestroySet destroys the set name; no error when absent, ErrInUse
	// while an iptables rule references it.
	DestroySet(ctx context.Context, name string) error
	// ListSets lists every set's name, kproxy's or not, sorted.
	ListSets(ctx context.Context) ([]string, error)
	// Entries lists the set's entries, sorted; ErrNotExist when the set
	// is absent.
	Entries(ctx context.Context, name string) ([]Entry, error)
	// AddEntry adds e to the set; no error when present. ErrNotExist when
	// the set is absent, ErrInvalidEntry when e does not fit the set's
	// type or family.
	AddEntry(ctx context.Context, name string, e Entry) error
	// DelEntry removes e from the set; no error when absent. ErrNotExist
	// when the set is absent.
	DelEntry(ctx context.Context, name string, e Entry) error
	// FlushSet removes every entry; ErrNotExist when the set is absent.
	FlushSet(ctx context.Context, name string) error
	// HasEntry reports whether the set holds e (one kernel request,
	// whatever the set's size); ErrNotExist when the set is absent.
	HasEntry(ctx context.Context, name string, e Entry) (bool, error)
}

var (
	// ErrNotExist: the set does not exist.
	ErrNotExist = errors.New("set does not exist")
	// ErrIncompatible: a set of that name exists with another type,
	// family or extensions.
	ErrIncompatible = errors.New("set exists with different settings")
	// ErrInUse: the set is referenced (by an iptables rule) and cannot be
	// destroyed.
	ErrInUse = errors.New("set is in use")
	// ErrInvalidEntry: the entry does not fit the set's type or family.
	ErrInvalidEntry = errors.New("invalid entry")
)

// String formats e as `ipset list` prints it: "10.0.0.1",
// "10.0.0.1,tcp:80", "10.0.0.1,tcp:80,10.0.0.2", "10.0.0.1,tcp:80,10.1.0.0/16",
// "10.0.0.0/8" or "30080". Like ipset it prints a single-address network
// without its prefix length.
func (e Entry) String() string {
	var parts []string
	if e.IP.IsValid() {
		parts = append(parts, e.IP.String())
		if e.Protocol != "" {
			parts = append(parts, e.Protocol+":"+strconv.Itoa(int(e.Port)))
		}
	} else if !e.Net.IsValid() {
		parts = append(parts, strconv.Itoa(int(e.Port)))
	}
	if e.IP2.IsValid() {
		parts = append(parts, e.IP2.String())
	}
	if e.Net.IsValid() {
		if e.Net.IsSingleIP() {
			parts = append(parts, e.Net.Addr().String())
		} else {
			parts = append(parts, e.Net.String())
		}
	}
	return strings.Join(parts, ",")
}

// shape reports which set type e is an entry of.
func (e Entry) shape() (Type, error) {
	hasIP, hasPort, hasIP2, hasNet := e.IP.IsValid(), e.Protocol != "", e.IP2.IsValid(), e.Net.IsValid()
	switch {
	case hasIP && !hasPort && !hasIP2 && !hasNet && e.Port == 0:
		return HashIP, nil
	case hasIP && hasPort && !hasIP2 && !hasNet:
		return HashIPPort, nil
	case hasIP && hasPort && hasIP2 && !hasNet:
		return HashIPPortIP, nil
	case hasIP && hasPort && !hasIP2 && hasNet:
		return HashIPPortNet, nil
	case !hasIP && !hasPort && !hasIP2 && hasNet && e.Port == 0:
		return HashNet, nil
	case !hasIP && !hasPort && !hasIP2 && !hasNet:
		return BitmapPort, nil
	}
	return "", fmt.Errorf("entry %s: %w: no set type has these fields", e, ErrInvalidEntry)
}

// normalize checks e on its own and returns the form the kernel stores
// (Net masked), its set type, and whether its addresses are IPv6.
func (e Entry) normalize() (Entry, Type, bool, error) {
	typ, err := e.shape()
	if err != nil {
		return e, "", false, err
	}
	bad := func(format string, args ...any) (Entry, Type, bool, error) {
		return e, "", false, fmt.Errorf("entry %s: %w: %s", e, ErrInvalidEntry, fmt.Sprintf(format, args...))
	}
	if e.Protocol != "" {
		switch e.Protocol {
		case ProtocolTCP, ProtocolUDP, ProtocolSCTP:
		default:
			return bad("unknown protocol %q (want tcp, udp or sctp)", e.Protocol)
		}
	}
	var addrs []netip.Addr
	for _, a := range []netip.Addr{e.IP, e.IP2, e.Net.Addr()} {
		if !a.IsValid() {
			continue
		}
		if a.Zone() != "" || a.Is4In6() {
			return bad("address %s: use a plain IPv4 or IPv6 address", a)
		}
		addrs = append(addrs, a)
	}
	ipv6 := len(addrs) > 0 && addrs[0].Is6()
	for _, a := range addrs[min(1, len(addrs)):] {
		if a.Is6() != ipv6 {
			return bad("mixes IPv4 and IPv6 addresses")
		}
	}
	if e.Net.IsValid() {
		if e.Net.Bits() == 0 {
			return bad("a /0 network is not allowed (split it into two halves)")
		}
		e.Net = e.Net.Masked()
	}
	return e, typ, ipv6, nil
}

// validateSet checks set's name and type.
func validateSet(set Set) error {
	if err := validateName(set.Name); err != nil {
		return err
	}
	switch set.Type {
	case HashIP, HashIPPort, HashIPPortIP, HashIPPortNet, HashNet, BitmapPort:
	default:
		return fmt.Errorf("set %s: unsupported type %q", set.Name, set.Type)
	}
	if strings.ContainsRune(set.Comment, 0) || len(set.Comment) > 255 {
		return fmt.Errorf("set %s: comment must be at most 255 bytes without NUL", set.Name)
	}
	return nil
}

func validateName(name string) error {
	switch {
	case name == "":
		return errors.New("empty set name")
	case len(name) > MaxNameLength:
		return fmt.Errorf("set name %q too long (max %d bytes)", name, MaxNameLength)
	case strings.ContainsRune(name, 0):
		return fmt.Errorf("set name %q contains NUL", name)
	}
	return nil
}

// normalized is Set in the form the kernel keeps: port bitmaps have no
// family.
func (s Set) normalized() Set {
	if s.Type == BitmapPort {
		s.IPv6 = false
	}
	return s
}

// checkEntry validates e for set and returns its stored form.
func (s Set) checkEntry(e Entry) (Entry, error) {
	n, typ, ipv6, err := e.normalize()
	if err != nil {
		return e, err
	}
	if typ != s.Type {
		return e, fmt.Errorf("entry %s does not fit %s set %s: %w", e, s.Type, s.Name, ErrInvalidEntry)
	}
	if s.Type != BitmapPort && ipv6 != s.IPv6 {
		return e, fmt.Errorf("entry %s does not fit %s set %s: %w: wrong address family", e, s.family(), s.Name, ErrInvalidEntry)
	}
	return n, nil
}

func (s Set) family() string {
	switch {
	case s.Type == BitmapPort:
		return "port"
	case s.IPv6:
		return "inet6"
	}
	return "inet"
}

// compareEntries orders entries by their fields.
func compareEntries(a, b Entry) int {
	if c := a.IP.Compare(b.IP); c != 0 {
		return c
	}
	if c := strings.Compare(a.Protocol, b.Protocol); c != 0 {
		return c
	}
	if a.Port != b.Port {
		return int(a.Port) - int(b.Port)
	}
	if c := a.IP2.Compare(b.IP2); c != 0 {
		return c
	}
	if c := a.Net.Addr().Compare(b.Net.Addr()); c != 0 {
		return c
	}
	return a.Net.Bits() - b.Net.Bits()
}
