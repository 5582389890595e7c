package proxy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"

	v1 "k8s.io/api/core/v1"
	netutils "k8s.io/utils/net"
)

// Keywords of --nodeport-addresses (kube-proxy's nodePortAddresses).
const (
	// NodePortAddressesPrimary is the node's primary IP of each family.
	NodePortAddressesPrimary = "primary"
	// NodePortAddressesLocalhost is 127.0.0.0/8 and ::1/128 (which never
	// accept node ports in kproxy).
	NodePortAddressesLocalhost = "localhost"
	// NodePortAddressesAll is 0.0.0.0/0 and ::/0: every address.
	NodePortAddressesAll = "all"
)

// Loopback ranges: never node-port addresses.
var (
	ipv4Loopback = netip.MustParsePrefix("127.0.0.0/8")
	ipv6Loopback = netip.MustParsePrefix("::1/128")
)

// ValidateNodePortAddresses checks --nodeport-addresses values as kube-proxy
// does: each is a CIDR (leading zeros in IPv4 octets allowed) or one of the
// keywords, and a keyword appears at most once. Surrounding blanks are
// ignored, and so are empty values. It returns one error per bad value.
func ValidateNodePortAddresses(values []string) []error {
	var errs []error
	seen := map[string]bool{}
	for _, raw := range values {
		s := strings.TrimSpace(raw)
		switch s {
		case "":
		case NodePortAddressesPrimary, NodePortAddressesLocalhost, NodePortAddressesAll:
			if seen[s] {
				errs = append(errs, fmt.Errorf("the keyword %q is given more than once", s))
			}
			seen[s] = true
		default:
			if _, err := parseCIDRSloppy(s); err != nil {
				errs = append(errs, fmt.Errorf("%q is neither a CIDR nor one of the keywords %q, %q, %q", raw,
					NodePortAddressesPrimary, NodePortAddressesLocalhost, NodePortAddressesAll))
			}
		}
	}
	return errs
}

// parseCIDRSloppy parses a CIDR as kube-proxy does (leading zeros allowed),
// masked. An IPv4-mapped IPv6 CIDR is an IPv4 one, as kube-proxy reads it.
func parseCIDRSloppy(s string) (netip.Prefix, error) {
	_, ipnet, err := netutils.ParseCIDRSloppy(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	ones, bits := ipnet.Mask.Size()
	if ip4 := ipnet.IP.To4(); ip4 != nil {
		if bits == 128 {
			ones = max(ones-96, 0)
		}
		return netip.PrefixFrom(netip.AddrFrom4([4]byte(ip4)), ones).Masked(), nil
	}
	addr, ok := netip.AddrFromSlice(ipnet.IP)
	if !ok {
		return netip.Prefix{}, fmt.Errorf("invalid CIDR %q", s)
	}
	return netip.PrefixFrom(addr, ones).Masked(), nil
}

// NodePortAddresses says which of the node's addresses of one IP family
// accept node-port traffic, from --nodeport-addresses, with kube-proxy's
// semantics:
//   - only the values of this family count; when there is none (the flag is
//     unset, or names only the other family), every address of the family
//     accepts node ports, as does a zero-length CIDR or "all";
//   - "primary" is the node's primary IP of the family, when known (a list
//     left with no value of the family then means every address);
//   - "localhost" is the family's loopback range.
//
// Unlike kube-proxy, kproxy never serves node ports on a loopback address
// (127.0.0.0/8, ::1), even when the list names one, nor on an IPv4-mapped
// IPv6 address. A nil *NodePortAddresses matches every address of either
// family.
type NodePortAddresses struct {
	family   v1.IPFamily
	prefixes []netip.Prefix
	matchAll bool
	// explicitLoopback: the list names a loopback range of this family on
	// its own (not through a zero-length CIDR).
	explicitLoopback bool
	// primaryUnknown: the list has "primary" but nodeIP is unknown.
	primaryUnknown bool
}

// NewNodePortAddresses builds the NodePortAddresses of family from the
// --nodeport-addresses values and this node's primary IP of family (zero
// when unknown; a loopback or other-family nodeIP counts as unknown). The
// values must pass ValidateNodePortAddresses.
func NewNodePortAddresses(family v1.IPFamily, values []string, nodeIP netip.Addr) (*NodePortAddresses, error) {
	if family != v1.IPv4Protocol && family != v1.IPv6Protocol {
		return nil, fmt.Errorf("node-port addresses: unknown IP family %q", family)
	}
	if errs := ValidateNodePortAddresses(values); len(errs) > 0 {
		return nil, fmt.Errorf("node-port addresses: %w", errors.Join(errs...))
	}
	ipv6 := family == v1.IPv6Protocol
	loopback, zero := ipv4Loopback, netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	if ipv6 {
		loopback, zero = ipv6Loopback, netip.PrefixFrom(netip.IPv6Unspecified(), 0)
	}
	n := &NodePortAddresses{family: family}
	nodeIP = nodeIP.Unmap().WithZone("")
	for _, raw := range values {
		s := strings.TrimSpace(raw)
		if s == "" {
			continue
		}
		var p netip.Prefix
		switch s {
		case NodePortAddressesPrimary:
			if !nodeIP.IsValid() || nodeIP.Is6() != ipv6 || nodeIP.IsLoopback() || nodeIP.IsUnspecified() {
				n.primaryUnknown = true
				continue
			}
			p = netip.PrefixFrom(nodeIP, nodeIP.BitLen())
		case NodePortAddressesLocalhost:
			p = loopback
		case NodePortAddressesAll:
			p = zero
		default:
			var err error
			if p, err = parseCIDRSloppy(s); err != nil {
				return nil, fmt.Errorf("node-port addresses: %q: %w", s, err)
			}
			if p.Addr().Is6() != ipv6 {
				continue
			}
		}
		if p.Bits() == 0 {
			n.matchAll = true
		} else if p.Overlaps(loopback) {
			// 127.0.0.0/8, 127.0.0.1/32, 0.0.0.0/1, ::1/128...
			n.explicitLoopback = true
		}
		if !containsPrefix(n.prefixes, p) {
			n.prefixes = append(n.prefixes, p)
		}
	}
	if len(n.prefixes) == 0 {
		n.matchAll = true
	}
	if n.matchAll {
		n.prefixes = []netip.Prefix{zero}
	}
	return n, nil
}

func containsPrefix(ps []netip.Prefix, p netip.Prefix) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

// Family is the IP family the addresses are of; "" for nil.
func (n *NodePortAddresses) Family() v1.IPFamily {
	if n == nil {
		return ""
	}
	return n.family
}

// MatchAll reports whether every (non-loopback) address of the family
// accepts node ports, including addresses added later.
func (n *NodePortAddresses) MatchAll() bool { return n == nil || n.matchAll }

// Prefixes are the family's ranges that accept node ports: the
// zero-length prefix when MatchAll, nil for a nil n. Loopback addresses
// inside them still never accept node ports.
func (n *NodePortAddresses) Prefixes() []netip.Prefix {
	if n == nil {
		return nil
	}
	return append([]netip.Prefix(nil), n.prefixes...)
}

// ContainsExplicitLoopback reports whether the list names a loopback range
// of the family (as "localhost" or a CIDR that is not zero-length): kproxy
// ignores it.
func (n *NodePortAddresses) ContainsExplicitLoopback() bool {
	return n != nil && n.explicitLoopback
}

// PrimaryUnknown reports whether the list has "primary" while the node's
// primary IP of the family is unknown: "primary" adds nothing then (and a
// list left without a value of the family matches every address, as in
// kube-proxy).
func (n *NodePortAddresses) PrimaryUnknown() bool { return n != nil && n.primaryUnknown }

// Accepts reports whether node ports are served on the local address a:
// one of the family (either for nil n), neither loopback, IPv4-mapped nor
// unspecified, inside the ranges. An IPv6 zone is ignored.
func (n *NodePortAddresses) Accepts(a netip.Addr) bool {
	a = a.WithZone("")
	if !a.IsValid() || a.Is4In6() || a.IsLoopback() || a.IsUnspecified() {
		return false
	}
	if n == nil {
		return true
	}
	if a.Is6() != (n.family == v1.IPv6Protocol) {
		return false
	}
	if n.matchAll {
		return true
	}
	for _, p := range n.prefixes {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Select returns the addresses of local that accept node ports (see
// Accepts), without zones or duplicates, in their order.
func (n *NodePortAddresses) Select(local []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, a := range local {
		a = a.WithZone("")
		if n.Accepts(a) && !containsAddr(out, a) {
			out = append(out, a)
		}
	}
	return out
}

func containsAddr(as []netip.Addr, a netip.Addr) bool {
	for _, b := range as {
		if a == b {
			return true
		}
	}
	return false
}

// String renders the family and its ranges, for logs.
func (n *NodePortAddresses) String() string {
	if n == nil {
		return "all"
	}
	if n.matchAll {
		return string(n.family) + ": all"
	}
	parts := make([]string, len(n.prefixes))
	for i, p := range n.prefixes {
		parts[i] = p.String()
	}
	return string(n.family) + ": " + strings.Join(parts, ",")
}
