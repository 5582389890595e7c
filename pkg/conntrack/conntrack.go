// Package conntrack deletes stale connection tracking entries and sets the
// conntrack sysctls, as kube-proxy does.
//
// UDP has no connection teardown: once conntrack has recorded that a client
// socket's packets to a service IP are DNATed to some endpoint, every later
// packet of that socket follows the entry, not the rules. When the endpoint
// goes away (or the service had none and the packets were dropped), the
// client keeps sending into the void until the entry times out, which for a
// DNS resolver re-using its socket may be never. After each successful sync
// kproxy therefore deletes the UDP entries the sync made stale. It follows
// upstream kube-proxy's rule, that an entry to a service port is kept
// exactly when a serving endpoint answers it (an endpoint that is
// terminating but still serving keeps its flows until they end), working
// from the changes of each sync (see StaleFilters):
//
//   - a UDP endpoint that stopped serving or was removed: the entries whose
//     reply source is that endpoint (IP and port) and whose original
//     destination is one of the service's IPs (ClusterIP, external IPs,
//     load-balancer IPs), or the service port's node port;
//   - a UDP service port that got its first usable endpoint: the entries to
//     its IPs and port, and to its node port, made while traffic was not
//     DNATed;
//   - a deleted UDP ClusterIP that no UDP service port uses any more: every
//     UDP entry whose original destination is that IP.
//
// After a full sync it also deletes black-holed flows of every protocol
// (BlackHoledFilters): entries to a service address that were never DNATed
// and never answered, left by a gap in the rules.
//
// Interface is implemented over netlink (Real) and by an in-memory table
// (Fake). Sysctl and ConfigureSysctls set nf_conntrack_max and the
// timeouts at start-up.
package conntrack

import (
	"context"
	"fmt"
	"net/netip"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// Interface reads and deletes connection tracking entries of one network
// namespace. Implementations are safe for concurrent use.
type Interface interface {
	// ListEntries returns the entries of family.
	ListEntries(ctx context.Context, family v1.IPFamily) ([]Flow, error)
	// ClearEntries deletes the entries of family that match any of
	// filters, and returns how many it deleted (also when it fails part
	// way). No filters deletes nothing.
	ClearEntries(ctx context.Context, family v1.IPFamily, filters ...Filter) (int, error)
}

// Tuple is one direction of a flow.
type Tuple struct {
	Src, Dst netip.AddrPort
}

// Flow is one conntrack entry, reduced to what kproxy looks at. For a flow
// DNATed to an endpoint, Original.Dst is the service address the client
// used and Reply.Src the endpoint.
type Flow struct {
	Protocol v1.Protocol
	Original Tuple
	Reply    Tuple
	// TCPState is the kernel's state of a TCP flow (TCPStateSynSent and
	// the others of enum tcp_conntrack); 0 when unknown or not TCP.
	TCPState uint8
}

// TCPStateSynSent is conntrack's state of a TCP flow whose first SYN got
// no answer yet (TCP_CONNTRACK_SYN_SENT).
const TCPStateSynSent = 1

// notNATed reports whether the flow's replies come from the address it was
// sent to: no DNAT was applied when it began.
func (f Flow) notNATed() bool {
	return f.Reply.Src.Addr().Unmap() == f.Original.Dst.Addr().Unmap() && f.Reply.Src.Port() == f.Original.Dst.Port()
}

// Family is the flow's IP family, from its original source address.
func (f Flow) Family() v1.IPFamily { return familyOf(f.Original.Src.Addr()) }

// String renders the flow as conntrack -L would, compactly.
func (f Flow) String() string {
	return fmt.Sprintf("%s %s->%s reply %s->%s", strings.ToLower(string(f.Protocol)),
		f.Original.Src, f.Original.Dst, f.Reply.Src, f.Reply.Dst)
}

// Filter selects flows of Protocol; every other field, when set (valid
// address, non-zero port), must match too. A filter that sets no address
// and no port matches nothing: deleting every flow of a protocol is never
// what kproxy wants.
type Filter struct {
	Protocol     v1.Protocol
	OrigDstIP    netip.Addr
	OrigDstPort  uint16
	ReplySrcIP   netip.Addr
	ReplySrcPort uint16
	// BlackHoled restricts the filter to flows that were never DNATed
	// (their reply source is their original destination) and, for TCP,
	// never answered (SYN_SENT): traffic that reached a service address
	// while no rule for it was in place (docs/design.md, "Black-holed
	// flows").
	BlackHoled bool
}

// Matches reports whether fl is selected by f.
func (f Filter) Matches(fl Flow) bool {
	if f.Protocol == "" || fl.Protocol != f.Protocol {
		return false
	}
	if !f.OrigDstIP.IsValid() && f.OrigDstPort == 0 && !f.ReplySrcIP.IsValid() && f.ReplySrcPort == 0 {
		return false
	}
	if f.OrigDstIP.IsValid() && fl.Original.Dst.Addr().Unmap() != f.OrigDstIP.Unmap() {
		return false
	}
	if f.OrigDstPort != 0 && fl.Original.Dst.Port() != f.OrigDstPort {
		return false
	}
	if f.ReplySrcIP.IsValid() && fl.Reply.Src.Addr().Unmap() != f.ReplySrcIP.Unmap() {
		return false
	}
	if f.ReplySrcPort != 0 && fl.Reply.Src.Port() != f.ReplySrcPort {
		return false
	}
	if f.BlackHoled && (!fl.notNATed() || fl.Protocol == v1.ProtocolTCP && fl.TCPState != TCPStateSynSent) {
		return false
	}
	return true
}

// String renders the filter in conntrack(8) terms.
func (f Filter) String() string {
	parts := []string{"-p " + strings.ToLower(string(f.Protocol))}
	if f.OrigDstIP.IsValid() {
		parts = append(parts, "--orig-dst "+f.OrigDstIP.String())
	}
	if f.OrigDstPort != 0 {
		parts = append(parts, fmt.Sprintf("--orig-port-dst %d", f.OrigDstPort))
	}
	if f.ReplySrcIP.IsValid() {
		parts = append(parts, "--reply-src "+f.ReplySrcIP.String())
	}
	if f.ReplySrcPort != 0 {
		parts = append(parts, fmt.Sprintf("--reply-port-src %d", f.ReplySrcPort))
	}
	if f.BlackHoled {
		parts = append(parts, "(not DNATed, unanswered)")
	}
	return strings.Join(parts, " ")
}

func familyOf(a netip.Addr) v1.IPFamily {
	if a.Is4() || a.Is4In6() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}

// dstKey is a filter's or a flow's protocol and original destination.
type dstKey struct {
	protocol v1.Protocol
	ip       netip.Addr
	port     uint16
}

// filterSet matches flows against many filters: those naming an original
// destination address and port are found by a map lookup (a full sync's
// cleanup has one per service address), the others are tried in turn.
type filterSet struct {
	byDst map[dstKey][]Filter
	rest  []Filter
}

func newFilterSet(filters []Filter) filterSet {
	fs := filterSet{byDst: map[dstKey][]Filter{}}
	for _, f := range filters {
		if f.OrigDstIP.IsValid() && f.OrigDstPort != 0 {
			k := dstKey{f.Protocol, f.OrigDstIP.Unmap(), f.OrigDstPort}
			fs.byDst[k] = append(fs.byDst[k], f)
			continue
		}
		fs.rest = append(fs.rest, f)
	}
	return fs
}

// matches reports whether one of the filters matches fl.
func (fs filterSet) matches(fl Flow) bool {
	for _, f := range fs.byDst[dstKey{fl.Protocol, fl.Original.Dst.Addr().Unmap(), fl.Original.Dst.Port()}] {
		if f.Matches(fl) {
			return true
		}
	}
	for _, f := range fs.rest {
		if f.Matches(fl) {
			return true
		}
	}
	return false
}
