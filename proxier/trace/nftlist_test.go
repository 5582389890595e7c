package trace

import (
	"strings"
	"testing"

	"sigs.k8s.io/knftables"
)

// realListing is nft 1.0.6's `nft list table ip kproxy` for a ClusterIP
// with two endpoints (trimmed), plus a dynamic set holding an entry and
// an element comment with the separators of the syntax in it.
const realListing = `table ip kproxy {
	comment "rules for kproxy"
	set affinity-tcp {
		typeof ip saddr . ip daddr . tcp dport . numgen random mod 1
		size 1048576
		flags dynamic,timeout
		timeout 3h
		elements = { 10.244.1.9 . 10.96.0.10 . 80 . 0 timeout 3h expires 2h59m58s }
	}

	set hairpin-endpoints {
		type ipv4_addr . ipv4_addr
		elements = { 0.0.0.0 . 0.0.0.0 comment "kproxy canary",
			     10.244.1.5 . 10.244.1.5 }
	}

	map endpoints-tcp {
		typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp dport
		elements = { 0.0.0.0 . 0 . 0 comment "kproxy canary" : 0.0.0.0 . 0,
			     10.96.0.10 . 80 . 0 : 10.244.1.5 . 8080,
			     10.96.0.10 . 80 . 1 : 10.244.2.5 . 8080 }
	}

	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		elements = { 0.0.0.0 . tcp . 0 comment "kproxy canary" : continue,
			     10.96.0.10 . tcp . 80 comment "263635c656c69329 2 0 ns/web:p, a : b" : goto svc-ip-tcp-c2.c2m.c2m }
	}

	chain filter-prerouting-pre-dnat {
		type filter hook prerouting priority dstnat - 10; policy accept;
	}

	chain masquerading {
		meta mark & 0x00004000 != 0x00000000 meta mark set meta mark ^ 0x00004000 masquerade fully-random
		ct status dnat ip saddr . ip daddr @hairpin-endpoints masquerade fully-random
	}

	chain nat-postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		jump masquerading
	}

	chain pick-ip-tcp-c2 {
		dnat ip to ip daddr . tcp dport . numgen random mod 2 map @endpoints-tcp
	}

	chain svc-ip-tcp-c2.c2m.c2m {
		ip saddr 10.244.0.0/16 goto pick-ip-tcp-c2
		meta mark set meta mark | 0x00004000 goto pick-ip-tcp-c2
	}
}
`

func TestParseNFTList(t *testing.T) {
	fake, err := ParseNFTList(realListing, knftables.IPv4Family, "kproxy")
	if err != nil {
		t.Fatal(err)
	}
	tb := fake.Table
	if p := *tb.Chains["filter-prerouting-pre-dnat"].Priority; p != "-110" {
		t.Errorf("priority %q, want -110", p)
	}
	if p := *tb.Chains["nat-postrouting"].Priority; p != "100" {
		t.Errorf("priority %q, want 100", p)
	}
	if r := tb.Chains["masquerading"].Rules[0].Rule; r != "meta mark & 0x4000 != 0 meta mark set meta mark ^ 0x4000 masquerade fully-random" {
		t.Errorf("rule %q", r)
	}
	if n := len(tb.Sets["affinity-tcp"].Elements); n != 0 {
		t.Errorf("%d affinity entries read, want none (a first packet finds none)", n)
	}
	if n := len(tb.Maps["endpoints-tcp"].Elements); n != 3 {
		t.Errorf("%d endpoints, want 3", n)
	}
	e := tb.Maps["service-ips"].FindElement("10.96.0.10", "tcp", "80")
	if e == nil || e.Comment == nil || *e.Comment != "263635c656c69329 2 0 ns/web:p, a : b" || strings.Join(e.Value, "|") != "goto svc-ip-tcp-c2.c2m.c2m" {
		t.Errorf("dispatch element %+v", e)
	}
	if e := tb.Maps["endpoints-tcp"].FindElement("10.96.0.10", "80", "1"); e == nil || strings.Join(e.Value, "|") != "10.244.2.5|8080" {
		t.Errorf("endpoint element %+v", e)
	}
}

func TestParseNFTListErrors(t *testing.T) {
	for _, tc := range []struct{ name, text, want string }{
		{"empty", "", "no table ip kproxy"},
		{"other table", "table ip other {\n}\n", "table ip other, want ip kproxy"},
		{"unterminated", "table ip kproxy {\n\tchain a {\n", "ends inside a block"},
		{"unknown rule reference", "table ip kproxy {\n\tchain a {\n\t\tjump b\n\t}\n}\n", "no such chain"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseNFTList(tc.text, knftables.IPv4Family, "kproxy")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want %q", err, tc.want)
			}
		})
	}
}
