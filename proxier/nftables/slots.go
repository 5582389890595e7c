package nftables

import (
	"net/netip"
	"slices"
	"strings"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Slot assignment. A destination's endpoints sit in dense slots 0..n-1
// (local ones from localSlotBase), since the pick chains draw a slot as a
// random number mod n. The assignment is stable: an endpoint keeps its slot
// while it stays, so that a change rewrites only the slots it touches and
// the ClientIP affinity entries (which name slots) keep their endpoint:
//
//   - an added endpoint takes the slot of a removed one if there is one,
//     else slot n (added endpoints in address order);
//   - a removed endpoint's slot left empty is refilled with the endpoint
//     of the last slot, so the slots stay dense.
//
// Without an earlier assignment (the first render of a destination, or a
// new process) the slots follow the endpoints' address order, whatever
// order the model lists them in. The endpoint-slots element's comment carries the
// assignment as a permutation of that order (permToken), so a new process
// over the table recovers it without listing the endpoints maps.

// compareAddrPort orders endpoints by address, then port.
func compareAddrPort(a, b netip.AddrPort) int { return a.Compare(b) }

// slotOrder returns the slots of eps given prev, the slots the destination
// had (nil: none). When eps holds the same endpoints as prev it returns prev
// itself, so a render of an unchanged destination shares the earlier one's
// slice.
func slotOrder(prev []netip.AddrPort, eps []*proxy.Endpoint) []netip.AddrPort {
	if len(eps) == 0 {
		return nil
	}
	cur := make([]netip.AddrPort, len(eps))
	for i, ep := range eps {
		cur[i] = netip.AddrPortFrom(ep.IP, uint16(ep.Port))
	}
	if !slices.IsSortedFunc(cur, compareAddrPort) {
		slices.SortFunc(cur, compareAddrPort)
	}
	if len(prev) == 0 {
		return cur
	}
	// Merge prev (through its slots sorted by endpoint) with cur.
	idx := make([]int32, len(prev))
	for i := range idx {
		idx[i] = int32(i)
	}
	slices.SortFunc(idx, func(a, b int32) int { return compareAddrPort(prev[a], prev[b]) })
	hole := make([]bool, len(prev))
	var added []netip.AddrPort
	holes := 0
	i, j := 0, 0
	for i < len(idx) || j < len(cur) {
		switch {
		case j == len(cur) || (i < len(idx) && compareAddrPort(prev[idx[i]], cur[j]) < 0):
			hole[idx[i]] = true
			holes++
			i++
		case i == len(idx) || compareAddrPort(prev[idx[i]], cur[j]) > 0:
			added = append(added, cur[j])
			j++
		default:
			i++
			j++
		}
	}
	if holes == 0 && len(added) == 0 {
		return prev
	}
	out := make([]netip.AddrPort, len(prev), max(len(prev), len(cur)))
	copy(out, prev)
	// Added endpoints fill the holes first, lowest slot first.
	for s := 0; s < len(out) && len(added) > 0; s++ {
		if hole[s] {
			out[s], hole[s] = added[0], false
			added = added[1:]
			holes--
		}
	}
	// Remaining holes take the last slot's endpoint.
	last := len(out) - 1
	for s := 0; holes > 0 && s < len(out); s++ {
		for last >= 0 && hole[last] {
			last--
			holes--
		}
		if s >= last || !hole[s] {
			continue
		}
		out[s], hole[s] = out[last], false
		hole[last] = true
	}
	for last >= 0 && hole[last] {
		last--
	}
	out = out[:last+1]
	return slices.Clip(append(out, added...))
}

// permDigits are the digits of permToken, one per slot.
const permDigits = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

// permToken writes a destination's slot assignment as the position of each
// slot's endpoint in address order: "" when both lists are in address order
// or one is too long to write (the comment has 128 characters: a new
// process then rewrites the destination's slots), else
// "p=<cluster>.<local>".
func permToken(eps [2][]netip.AddrPort) string {
	if len(eps[0]) > len(permDigits) || len(eps[1]) > len(permDigits) ||
		(slices.IsSortedFunc(eps[0], compareAddrPort) && slices.IsSortedFunc(eps[1], compareAddrPort)) {
		return ""
	}
	var b strings.Builder
	b.WriteString("p=")
	for li, list := range eps {
		if li == 1 {
			b.WriteByte('.')
		}
		sorted := slices.Clone(list)
		slices.SortFunc(sorted, compareAddrPort)
		for _, ep := range list {
			pos, _ := slices.BinarySearchFunc(sorted, ep, compareAddrPort)
			b.WriteByte(permDigits[pos])
		}
	}
	return b.String()
}

// applyPerm reorders lists in address order by permToken's token: nil when
// the token does not fit them.
func applyPerm(token string, eps [2][]netip.AddrPort) *[2][]netip.AddrPort {
	body, ok := strings.CutPrefix(token, "p=")
	if !ok {
		return nil
	}
	parts := strings.Split(body, ".")
	if len(parts) != 2 {
		return nil
	}
	var out [2][]netip.AddrPort
	for li, part := range parts {
		list := eps[li]
		if len(part) != len(list) {
			return nil
		}
		used := make([]bool, len(list))
		out[li] = make([]netip.AddrPort, len(list))
		for s := range list {
			pos := strings.IndexByte(permDigits, part[s])
			if pos < 0 || pos >= len(list) || used[pos] {
				return nil
			}
			used[pos] = true
			out[li][s] = list[pos]
		}
	}
	return &out
}
