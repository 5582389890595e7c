package nftablestest

import (
	"strings"
	"testing"
)

// TestTraceRecordPath: with RecordPath every outcome lists the rules that
// acted on the packet and the map elements it found, with their comments;
// without it, none.
func TestTraceRecordPath(t *testing.T) {
	fake := table(t,
		"add chain ip t pre { type nat hook prerouting priority -100 ; }",
		"add chain ip t pick",
		"add chain ip t svc",
		"add map ip t eps { typeof ip daddr . tcp dport . numgen random mod 1 : ip daddr . tcp dport ; }",
		"add map ip t vips { type ipv4_addr . inet_proto . inet_service : verdict ; }",
		"add rule ip t pre ip daddr . meta l4proto . th dport vmap @vips",
		"add rule ip t svc ip saddr 10.0.0.0/8 meta mark set meta mark | 0x4000 goto pick",
		"add rule ip t pick dnat ip to ip daddr . tcp dport . numgen random mod 2 map @eps",
		"add element ip t eps { 10.96.0.1 . 80 . 0 : 10.244.0.1 . 8080 }",
		"add element ip t eps { 10.96.0.1 . 80 . 1 : 10.244.0.2 . 8080 }",
		`add element ip t vips { 10.96.0.1 . tcp . 80 comment "ns/web:http" : goto svc }`,
	)
	pkt := tcp("10.1.1.1", "10.96.0.1", 80, false)
	outs, err := Trace(fake, pkt, Options{RecordPath: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(outs) != 2 {
		t.Fatalf("%d outcomes, want 2: %+v", len(outs), outs)
	}
	for i, o := range outs {
		var got []string
		for _, s := range o.Path {
			if s.Map != "" {
				got = append(got, "map "+s.Map+" "+strings.Join(s.Key, ".")+" "+strings.Join(s.Value, ".")+" #"+s.Comment)
			} else {
				got = append(got, s.Chain+"#"+string(rune('0'+s.Rule)))
			}
		}
		want := []string{"pre#1", "map vips 10.96.0.1.tcp.80 goto svc #ns/web:http", "svc#1", "pick#1",
			"map eps 10.96.0.1.80." + string(rune('0'+i)) + " " + strings.ReplaceAll(o.DNAT, ":", ".") + " #"}
		if strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("outcome %s: path\n%s\nwant\n%s", o.DNAT, strings.Join(got, "|"), strings.Join(want, "|"))
		}
	}
	plain, err := Trace(fake, pkt, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range plain {
		if o.Path != nil {
			t.Errorf("path recorded without RecordPath: %+v", o.Path)
		}
	}
}
