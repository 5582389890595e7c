package proxy

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
)

func TestValidateNodePortAddresses(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values []string
		// wantErrs are substrings, one per expected error.
		wantErrs []string
	}{
		{name: "unset"},
		{name: "CIDRs of both families", values: []string{"10.0.0.0/8", "fd00::/64", "192.168.1.7/24"}},
		{name: "keywords", values: []string{"primary", "localhost", "all"}},
		{name: "keywords and CIDRs", values: []string{"primary", "10.0.0.0/8"}},
		{name: "leading zeros, as kube-proxy's sloppy parsing", values: []string{"010.000.000.000/8"}},
		{name: "blanks around values and empty values", values: []string{" 10.0.0.0/8 ", "", " primary"}},
		{name: "the same CIDR twice", values: []string{"10.0.0.0/8", "10.0.0.0/8"}},
		{name: "IPv4-mapped CIDR", values: []string{"::ffff:10.0.0.0/104"}},

		{name: "address without a length", values: []string{"10.0.0.1"}, wantErrs: []string{`"10.0.0.1" is neither a CIDR nor one of the keywords`}},
		{name: "unknown keyword", values: []string{"primary-ish"}, wantErrs: []string{`"primary-ish"`}},
		{name: "keywords are case-sensitive", values: []string{"Primary"}, wantErrs: []string{`"Primary"`}},
		{name: "keyword twice", values: []string{"primary", "10.0.0.0/8", "primary"}, wantErrs: []string{`"primary" is given more than once`}},
		{name: "every bad value", values: []string{"x", "all", "y/8", "all"}, wantErrs: []string{`"x"`, `"y/8"`, `"all" is given more than once`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := ValidateNodePortAddresses(tc.values)
			if len(errs) != len(tc.wantErrs) {
				t.Fatalf("ValidateNodePortAddresses(%q) = %v, want %d errors", tc.values, errs, len(tc.wantErrs))
			}
			for i, want := range tc.wantErrs {
				if !strings.Contains(errs[i].Error(), want) {
					t.Errorf("error %d = %q, want it to mention %s", i, errs[i], want)
				}
			}
		})
	}
}

func TestNodePortAddresses(t *testing.T) {
	const (
		v4 = v1.IPv4Protocol
		v6 = v1.IPv6Protocol
	)
	// The node's addresses, both families, as an address lister returns
	// them.
	local := []string{"127.0.0.1", "10.0.0.1", "10.0.1.1", "192.168.5.5", "::ffff:10.0.0.9", "::1", "fd00::1", "fd00:1::1", "fe80::1"}
	for _, tc := range []struct {
		name   string
		family v1.IPFamily
		values []string
		nodeIP string
		// want is what Select returns from local.
		want           []string
		wantMatchAll   bool
		wantPrefixes   []string
		wantLoopback   bool
		wantPrimaryUnk bool
	}{
		{
			name: "unset: every address of the family but loopback and IPv4-mapped ones", family: v4,
			want: []string{"10.0.0.1", "10.0.1.1", "192.168.5.5"}, wantMatchAll: true, wantPrefixes: []string{"0.0.0.0/0"},
		},
		{
			name: "unset, IPv6", family: v6,
			want: []string{"fd00::1", "fd00:1::1", "fe80::1"}, wantMatchAll: true, wantPrefixes: []string{"::/0"},
		},
		{
			name: "a CIDR selects the addresses inside it", family: v4, values: []string{"10.0.0.0/24"},
			want: []string{"10.0.0.1"}, wantPrefixes: []string{"10.0.0.0/24"},
		},
		{
			name: "host bits are masked; duplicates collapse", family: v4, values: []string{"10.0.1.7/24", "10.0.1.0/24", "192.168.0.0/16"},
			want: []string{"10.0.1.1", "192.168.5.5"}, wantPrefixes: []string{"10.0.1.0/24", "192.168.0.0/16"},
		},
		{
			name: "leading zeros", family: v4, values: []string{"010.000.001.000/24"},
			want: []string{"10.0.1.1"}, wantPrefixes: []string{"10.0.1.0/24"},
		},
		{
			name: "a list of the other family only: every address of this one", family: v6, values: []string{"10.0.0.0/24"},
			want: []string{"fd00::1", "fd00:1::1", "fe80::1"}, wantMatchAll: true, wantPrefixes: []string{"::/0"},
		},
		{
			name: "an IPv6 list on the IPv4 side: every IPv4 address", family: v4, values: []string{"fd00::/64"},
			want: []string{"10.0.0.1", "10.0.1.1", "192.168.5.5"}, wantMatchAll: true, wantPrefixes: []string{"0.0.0.0/0"},
		},
		{
			name: "dual-stack list: each family its own", family: v6, values: []string{"10.0.0.0/24", "fd00:1::/64"},
			want: []string{"fd00:1::1"}, wantPrefixes: []string{"fd00:1::/64"},
		},
		{
			name: "0.0.0.0/0 matches all but never loopback", family: v4, values: []string{"0.0.0.0/0"},
			want: []string{"10.0.0.1", "10.0.1.1", "192.168.5.5"}, wantMatchAll: true, wantPrefixes: []string{"0.0.0.0/0"},
		},
		{
			name: "a zero-length CIDR wins over the rest", family: v4, values: []string{"10.0.0.0/24", "1.2.3.4/0"},
			want: []string{"10.0.0.1", "10.0.1.1", "192.168.5.5"}, wantMatchAll: true, wantPrefixes: []string{"0.0.0.0/0"},
		},
		{
			name: "::/0 never serves ::1", family: v6, values: []string{"::/0"},
			want: []string{"fd00::1", "fd00:1::1", "fe80::1"}, wantMatchAll: true, wantPrefixes: []string{"::/0"},
		},
		{
			name: "all", family: v6, values: []string{"all", "fd00::/64"},
			want: []string{"fd00::1", "fd00:1::1", "fe80::1"}, wantMatchAll: true, wantPrefixes: []string{"::/0"},
		},
		{
			name: "127.0.0.0/8 in a list is ignored", family: v4, values: []string{"127.0.0.0/8", "10.0.0.0/24"},
			want: []string{"10.0.0.1"}, wantPrefixes: []string{"127.0.0.0/8", "10.0.0.0/24"}, wantLoopback: true,
		},
		{
			name: "localhost alone: no address at all", family: v4, values: []string{"localhost"},
			want: nil, wantPrefixes: []string{"127.0.0.0/8"}, wantLoopback: true,
		},
		{
			name: "localhost, IPv6", family: v6, values: []string{"localhost"},
			want: nil, wantPrefixes: []string{"::1/128"}, wantLoopback: true,
		},
		{
			name: "primary is the node IP of the family", family: v4, values: []string{"primary"}, nodeIP: "10.0.1.1",
			want: []string{"10.0.1.1"}, wantPrefixes: []string{"10.0.1.1/32"},
		},
		{
			name: "primary, IPv6", family: v6, values: []string{"primary"}, nodeIP: "fd00:1::1",
			want: []string{"fd00:1::1"}, wantPrefixes: []string{"fd00:1::1/128"},
		},
		{
			name: "primary and a CIDR", family: v4, values: []string{"primary", "192.168.0.0/16"}, nodeIP: "10.0.0.1",
			want: []string{"10.0.0.1", "192.168.5.5"}, wantPrefixes: []string{"10.0.0.1/32", "192.168.0.0/16"},
		},
		{
			name: "primary without a node IP of the family: every address, as kube-proxy", family: v6, values: []string{"primary"},
			want: []string{"fd00::1", "fd00:1::1", "fe80::1"}, wantMatchAll: true, wantPrefixes: []string{"::/0"}, wantPrimaryUnk: true,
		},
		{
			name: "primary with the other family's node IP", family: v6, values: []string{"primary", "10.0.0.0/8"}, nodeIP: "10.0.0.1",
			want: []string{"fd00::1", "fd00:1::1", "fe80::1"}, wantMatchAll: true, wantPrefixes: []string{"::/0"}, wantPrimaryUnk: true,
		},
		{
			name: "primary with a loopback node IP counts as unknown", family: v4, values: []string{"primary", "192.168.0.0/16"}, nodeIP: "127.0.0.1",
			want: []string{"192.168.5.5"}, wantPrefixes: []string{"192.168.0.0/16"}, wantPrimaryUnk: true,
		},
		{
			name: "an IPv4-mapped node IP is IPv4", family: v4, values: []string{"primary"}, nodeIP: "::ffff:10.0.0.1",
			want: []string{"10.0.0.1"}, wantPrefixes: []string{"10.0.0.1/32"},
		},
		{
			name: "an IPv4-mapped CIDR is IPv4, as kube-proxy reads it", family: v4, values: []string{"::ffff:10.0.1.0/120"},
			want: []string{"10.0.1.1"}, wantPrefixes: []string{"10.0.1.0/24"},
		},
		{
			name: "nothing of the node inside the list", family: v4, values: []string{"172.16.0.0/12"},
			want: nil, wantPrefixes: []string{"172.16.0.0/12"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var nodeIP netip.Addr
			if tc.nodeIP != "" {
				nodeIP = netip.MustParseAddr(tc.nodeIP)
			}
			n, err := NewNodePortAddresses(tc.family, tc.values, nodeIP)
			if err != nil {
				t.Fatal(err)
			}
			var in []netip.Addr
			for _, s := range local {
				in = append(in, netip.MustParseAddr(s))
			}
			var got []string
			for _, a := range n.Select(in) {
				got = append(got, a.String())
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("Select = %v, want %v", got, tc.want)
			}
			var prefixes []string
			for _, p := range n.Prefixes() {
				prefixes = append(prefixes, p.String())
			}
			if !slices.Equal(prefixes, tc.wantPrefixes) {
				t.Errorf("Prefixes = %v, want %v", prefixes, tc.wantPrefixes)
			}
			if n.MatchAll() != tc.wantMatchAll {
				t.Errorf("MatchAll = %v, want %v", n.MatchAll(), tc.wantMatchAll)
			}
			if n.ContainsExplicitLoopback() != tc.wantLoopback {
				t.Errorf("ContainsExplicitLoopback = %v, want %v", n.ContainsExplicitLoopback(), tc.wantLoopback)
			}
			if n.PrimaryUnknown() != tc.wantPrimaryUnk {
				t.Errorf("PrimaryUnknown = %v, want %v", n.PrimaryUnknown(), tc.wantPrimaryUnk)
			}
			if n.Family() != tc.family {
				t.Errorf("Family = %q, want %q", n.Family(), tc.family)
			}
		})
	}
}

func TestNodePortAddressesNil(t *testing.T) {
	var n *NodePortAddresses
	if !n.MatchAll() || n.Prefixes() != nil || n.ContainsExplicitLoopback() || n.PrimaryUnknown() {
		t.Errorf("nil: MatchAll %v, Prefixes %v, loopback %v, primary unknown %v; want every address",
			n.MatchAll(), n.Prefixes(), n.ContainsExplicitLoopback(), n.PrimaryUnknown())
	}
	got := n.Select([]netip.Addr{
		netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("::1"),
		netip.MustParseAddr("fe80::1%eth0"), netip.MustParseAddr("::ffff:10.0.0.2"), netip.MustParseAddr("10.0.0.1"),
		{}, netip.IPv4Unspecified(),
	})
	want := []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("fe80::1")}
	if !slices.Equal(got, want) {
		t.Errorf("nil Select = %v, want %v (zones dropped, no loopback, mapped, unspecified or duplicate)", got, want)
	}
}

func TestNewNodePortAddressesRefuses(t *testing.T) {
	for _, tc := range []struct {
		name   string
		family v1.IPFamily
		values []string
	}{
		{"unknown family", "IPv5", nil},
		{"invalid value", v1.IPv4Protocol, []string{"ten"}},
		{"keyword twice", v1.IPv4Protocol, []string{"all", "all"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if n, err := NewNodePortAddresses(tc.family, tc.values, netip.Addr{}); err == nil {
				t.Errorf("NewNodePortAddresses = %v, want an error", n)
			}
		})
	}
}
