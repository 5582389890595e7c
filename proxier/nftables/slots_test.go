package nftables

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/proxy"
)

func TestSlotOrder(t *testing.T) {
	// ep(i) is 10.0.0.i:80.
	ep := func(i int) netip.AddrPort { return netip.MustParseAddrPort(fmt.Sprintf("10.0.0.%d:80", i)) }
	list := func(is ...int) []netip.AddrPort {
		var out []netip.AddrPort
		for _, i := range is {
			out = append(out, ep(i))
		}
		return out
	}
	model := func(is ...int) []*proxy.Endpoint {
		var out []*proxy.Endpoint
		for _, i := range is {
			out = append(out, &proxy.Endpoint{IP: ep(i).Addr(), Port: 80})
		}
		return out
	}
	for _, tc := range []struct {
		name string
		prev []netip.AddrPort
		eps  []*proxy.Endpoint
		want []netip.AddrPort
	}{
		{name: "no earlier slots: address order", eps: model(3, 1, 2), want: list(1, 2, 3)},
		{name: "same endpoints in another order: unchanged", prev: list(3, 1, 2), eps: model(1, 2, 3), want: list(3, 1, 2)},
		{name: "replaced in place", prev: list(3, 1, 2), eps: model(2, 3, 9), want: list(3, 9, 2)},
		{name: "removed: the last moves in", prev: list(3, 1, 2, 5), eps: model(2, 3, 5), want: list(3, 5, 2)},
		{name: "last removed", prev: list(3, 1, 2), eps: model(3, 1), want: list(3, 1)},
		{name: "added at the end, in address order", prev: list(3, 1), eps: model(1, 3, 7, 4), want: list(3, 1, 4, 7)},
		{name: "two removed, trailing one among them", prev: list(1, 2, 3, 4, 5), eps: model(1, 3, 4), want: list(1, 4, 3)},
		{name: "all replaced", prev: list(1, 2), eps: model(8, 9), want: list(8, 9)},
		{name: "down to one", prev: list(1, 2, 3, 4), eps: model(2), want: list(2)},
		{name: "holes filled by new ones before moving", prev: list(1, 2, 3, 4, 5), eps: model(1, 3, 5, 9), want: list(1, 9, 3, 5)},
		{name: "none left", prev: list(1), eps: nil, want: nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := slotOrder(tc.prev, tc.eps)
			if !slices.Equal(got, tc.want) {
				t.Errorf("slots %v, want %v", got, tc.want)
			}
		})
	}
}

func TestPermToken(t *testing.T) {
	eps := func(n int, order func(i int) int) []netip.AddrPort {
		out := make([]netip.AddrPort, n)
		for i := range out {
			out[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(order(i) / 250), byte(order(i)%250 + 1)}), 80)
		}
		return out
	}
	id := func(i int) int { return i }
	for _, tc := range []struct {
		name      string
		eps       [2][]netip.AddrPort
		wantEmpty bool
	}{
		{name: "address order: empty", eps: [2][]netip.AddrPort{eps(10, id), eps(3, id)}, wantEmpty: true},
		{name: "reversed", eps: [2][]netip.AddrPort{eps(10, func(i int) int { return 9 - i }), nil}},
		{name: "local list only", eps: [2][]netip.AddrPort{eps(4, id), eps(3, func(i int) int { return (i + 1) % 3 })}},
		{name: "62 endpoints", eps: [2][]netip.AddrPort{eps(62, func(i int) int { return (i * 7) % 62 }), nil}},
		{name: "more than 62: not written", eps: [2][]netip.AddrPort{eps(63, func(i int) int { return 62 - i }), nil}, wantEmpty: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok := permToken(tc.eps)
			if (tok == "") != tc.wantEmpty {
				t.Fatalf("token %q", tok)
			}
			if tok == "" {
				return
			}
			var sorted [2][]netip.AddrPort
			for i := range sorted {
				sorted[i] = slices.Clone(tc.eps[i])
				slices.SortFunc(sorted[i], compareAddrPort)
			}
			got := applyPerm(tok, sorted)
			if got == nil || !slices.Equal(got[0], tc.eps[0]) || !slices.Equal(got[1], tc.eps[1]) {
				t.Errorf("token %q gives %v, want %v", tok, got, tc.eps)
			}
			if applyPerm(tok, [2][]netip.AddrPort{sorted[0][1:], sorted[1]}) != nil {
				t.Errorf("token %q applies to a shorter list", tok)
			}
			c := slotsComment(strings.Repeat("0", 16), [2]int{len(tc.eps[0]), len(tc.eps[1])}, tok, proxy.ServicePortName{})
			if _, _, perm, ok := parseSlotsComment(c); !ok || perm != tok {
				t.Errorf("comment %q reads back as %q", c, perm)
			}
		})
	}
}
