package nftablestest

import (
	"net/netip"
	"strings"
	"testing"

	"sigs.k8s.io/knftables"
)

// table builds a fake ip table "t" from nft commands (knftables dump
// syntax).
func table(t *testing.T, lines ...string) *knftables.Fake {
	t.Helper()
	fake := knftables.NewFake(knftables.IPv4Family, "t")
	if err := fake.ParseDump("add table ip t\n" + strings.Join(lines, "\n")); err != nil {
		t.Fatal(err)
	}
	return fake
}

func tcp(src, dst string, port int, local bool) Packet {
	return Packet{Source: netip.MustParseAddr(src), Destination: netip.MustParseAddr(dst), Protocol: "tcp", SourcePort: 4000, DestinationPort: port, Local: local}
}

func TestTrace(t *testing.T) {
	base := []string{
		"add chain ip t pre { type nat hook prerouting priority -100 ; }",
		"add chain ip t out { type nat hook output priority -100 ; }",
		"add chain ip t post { type nat hook postrouting priority 100 ; }",
		"add chain ip t fwd { type filter hook forward priority 0 ; }",
		"add chain ip t pick",
		"add map ip t eps { typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp dport ; }",
		"add map ip t vips { type ipv4_addr . inet_proto . inet_service : verdict ; }",
		"add set ip t aff { typeof ip saddr . ip daddr . tcp dport . numgen random mod 1 ; flags dynamic,timeout ; timeout 60s ; }",
		"add rule ip t pre ip daddr . meta l4proto . th dport vmap @vips",
		"add rule ip t out ip daddr . meta l4proto . th dport vmap @vips",
		"add rule ip t post meta mark & 0x4000 != 0 meta mark set meta mark ^ 0x4000 masquerade fully-random",
		"add element ip t eps { 10.96.0.1 . 80 . 0 : 10.244.0.1 . 8080 }",
		"add element ip t eps { 10.96.0.1 . 80 . 1 : 10.244.0.2 . 8080 }",
		"add element ip t vips { 10.96.0.1 . tcp . 80 : goto pick }",
		"add element ip t vips { 10.96.0.9 . tcp . 80 : drop }",
	}
	for _, tc := range []struct {
		name    string
		rules   []string
		pkt     Packet
		sets    map[string][]string
		want    []string // "verdict dnat masq updates"
		wantErr string
	}{
		{
			name:  "random slot: every endpoint, masqueraded when marked",
			rules: []string{"add rule ip t pick ip saddr 10.0.0.0/8 meta mark set meta mark | 0x4000 goto pick2", "add chain ip t pick2", "add rule ip t pick2 dnat ip to ip daddr . tcp dport . numgen random mod 2 map @eps"},
			pkt:   tcp("10.1.1.1", "10.96.0.1", 80, false),
			want:  []string{"accept 10.244.0.1:8080 true ", "accept 10.244.0.2:8080 true "},
		},
		{
			name:  "unmatched class falls through undelivered",
			rules: []string{"add rule ip t pick ip saddr 10.0.0.0/8 dnat ip to ip daddr . tcp dport . numgen random mod 2 map @eps"},
			pkt:   tcp("192.0.2.1", "10.96.0.1", 80, false),
			want:  []string{"accept  false "},
		},
		{
			name: "verdict map drop",
			pkt:  tcp("192.0.2.1", "10.96.0.9", 80, false),
			want: []string{"drop  false "},
		},
		{
			name: "affinity entry found, or a slot picked and recorded",
			rules: []string{
				"add rule ip t pick ip saddr . ip daddr . tcp dport . numgen inc mod 1 offset 1 @aff update @aff { ip saddr . ip daddr . tcp dport . numgen inc mod 1 offset 1 timeout 60s } dnat ip to ip daddr . tcp dport . numgen inc mod 1 offset 1 map @eps",
				"add rule ip t pick numgen random mod 2 == 0 update @aff { ip saddr . ip daddr . tcp dport . numgen inc mod 1 timeout 60s } dnat ip to ip daddr . tcp dport . numgen inc mod 1 map @eps",
				"add rule ip t pick update @aff { ip saddr . ip daddr . tcp dport . numgen inc mod 1 offset 1 timeout 60s } dnat ip to ip daddr . tcp dport . numgen inc mod 1 offset 1 map @eps",
			},
			pkt: tcp("192.0.2.1", "10.96.0.1", 80, false),
			want: []string{"accept 10.244.0.1:8080 false aff { 192.0.2.1 . 10.96.0.1 . 80 . 0 }",
				"accept 10.244.0.2:8080 false aff { 192.0.2.1 . 10.96.0.1 . 80 . 1 }"},
		},
		{
			name: "affinity entry present",
			rules: []string{
				"add rule ip t pick ip saddr . ip daddr . tcp dport . numgen inc mod 1 offset 1 @aff dnat ip to ip daddr . tcp dport . numgen inc mod 1 offset 1 map @eps",
				"add rule ip t pick dnat ip to ip daddr . tcp dport . numgen random mod 2 map @eps",
			},
			pkt:  tcp("192.0.2.1", "10.96.0.1", 80, false),
			sets: map[string][]string{"aff": {"192.0.2.1 . 10.96.0.1 . 80 . 1"}},
			want: []string{"accept 10.244.0.2:8080 false "},
		},
		{
			name:    "unknown syntax fails",
			rules:   []string{"add rule ip t pick ip saddr 10.0.0.0/8 counter packets 0 bytes 0 accept"},
			pkt:     tcp("10.1.1.1", "10.96.0.1", 80, false),
			wantErr: `unsupported expression "packets"`,
		},
		{
			name:    "unknown expression fails",
			rules:   []string{"add rule ip t pick iifname lo accept"},
			pkt:     tcp("10.1.1.1", "10.96.0.1", 80, false),
			wantErr: "unsupported expression",
		},
		{
			name:    "a jump loop fails",
			rules:   []string{"add rule ip t pick jump pick"},
			pkt:     tcp("10.1.1.1", "10.96.0.1", 80, false),
			wantErr: "loop",
		},
		{
			name:    "a missing map fails",
			rules:   []string{"add rule ip t pick dnat ip to ip daddr . tcp dport . numgen random mod 2 map @nothere"},
			pkt:     tcp("10.1.1.1", "10.96.0.1", 80, false),
			wantErr: "no set or map",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lines := append([]string{}, base...)
			for _, r := range tc.rules {
				if strings.HasPrefix(r, "add chain") {
					lines = append(lines[:5], append([]string{r}, lines[5:]...)...)
				}
			}
			for _, r := range tc.rules {
				if !strings.HasPrefix(r, "add chain") {
					lines = append(lines, r)
				}
			}
			// The Fake refuses a rule naming a missing map: added
			// behind its back, the tracer must refuse it too.
			fake := table(t, withoutMissing(lines)...)
			if tc.wantErr == "no set or map" {
				fake.Table.Chains["pick"].Rules = append(fake.Table.Chains["pick"].Rules, &knftables.Rule{Chain: "pick", Rule: strings.TrimPrefix(tc.rules[0], "add rule ip t pick ")})
			}
			outs, err := Trace(fake, tc.pkt, Options{LocalAddrs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}, Sets: tc.sets})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Trace error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, o := range outs {
				got = append(got, strings.Join([]string{o.Verdict, o.DNAT, boolString(o.Masquerade), o.Updates}, " "))
			}
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Errorf("outcomes:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

func withoutMissing(lines []string) []string {
	var out []string
	for _, l := range lines {
		if !strings.Contains(l, "@nothere") {
			out = append(out, l)
		}
	}
	return out
}

func boolString(b bool) string {
	if b {
		return "true"
	}
	return "false"
}
