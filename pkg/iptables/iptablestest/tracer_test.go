package iptablestest

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/iptables"
)

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

// summary renders outcomes without Path and RulesEvaluated, sorted, for
// comparison.
func summary(outcomes []Outcome) []string {
	var out []string
	for _, o := range outcomes {
		s := o.Verdict
		if o.DNAT != "" {
			s += " dnat=" + o.DNAT
		}
		if o.Masquerade {
			s += " masq"
		}
		if o.Mark != 0 {
			s += fmt.Sprintf(" mark=%#x", o.Mark)
		}
		if len(o.RecentSet) > 0 {
			s += " recent=" + strings.Join(o.RecentSet, ",")
		}
		out = append(out, s)
	}
	slices.Sort(out)
	return out
}

// kubeRules is a small kube-proxy style ruleset: service A (ClusterIP
// 172.30.0.10:80, NodePort 30080) with three endpoints, service B (ClusterIP
// 172.30.0.20:53/udp) with client-IP affinity over two endpoints, service C
// (172.30.0.30:80) without endpoints, rejected in filter.
var kubeRules = []string{
	"*nat",
	":KUBE-SERVICES - [0:0]",
	":KUBE-NODEPORTS - [0:0]",
	":KUBE-POSTROUTING - [0:0]",
	":KUBE-MARK-MASQ - [0:0]",
	":KUBE-SVC-A - [0:0]",
	":KUBE-EXT-A - [0:0]",
	":KUBE-SEP-A1 - [0:0]",
	":KUBE-SEP-A2 - [0:0]",
	":KUBE-SEP-A3 - [0:0]",
	":KUBE-SVC-B - [0:0]",
	":KUBE-SEP-B1 - [0:0]",
	":KUBE-SEP-B2 - [0:0]",
	`-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`,
	`-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES`,
	`-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING`,
	"-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
	"-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000",
	`-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully`,
	"-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
	`-A KUBE-SERVICES -d 172.30.0.10/32 -p tcp -m comment --comment "ns/a:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-A`,
	`-A KUBE-SERVICES -d 172.30.0.20/32 -p udp -m comment --comment "ns/b:dns cluster IP" -m udp --dport 53 -j KUBE-SVC-B`,
	`-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS`,
	"-A KUBE-NODEPORTS -p tcp -m tcp --dport 30080 -j KUBE-EXT-A",
	"-A KUBE-EXT-A -j KUBE-MARK-MASQ",
	"-A KUBE-EXT-A -j KUBE-SVC-A",
	"-A KUBE-SVC-A ! -s 10.0.0.0/16 -d 172.30.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-MARK-MASQ",
	"-A KUBE-SVC-A -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-A1",
	"-A KUBE-SVC-A -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-A2",
	"-A KUBE-SVC-A -j KUBE-SEP-A3",
	"-A KUBE-SEP-A1 -s 10.0.1.1/32 -j KUBE-MARK-MASQ",
	"-A KUBE-SEP-A1 -p tcp -m tcp -j DNAT --to-destination 10.0.1.1:8080",
	"-A KUBE-SEP-A2 -s 10.0.1.2/32 -j KUBE-MARK-MASQ",
	"-A KUBE-SEP-A2 -p tcp -m tcp -j DNAT --to-destination 10.0.1.2:8080",
	"-A KUBE-SEP-A3 -s 10.0.2.3/32 -j KUBE-MARK-MASQ",
	"-A KUBE-SEP-A3 -p tcp -m tcp -j DNAT --to-destination 10.0.2.3:8080",
	"-A KUBE-SVC-B -m recent --name KUBE-SEP-B1 --mask 255.255.255.255 --rsource --rcheck --seconds 10800 --reap -j KUBE-SEP-B1",
	"-A KUBE-SVC-B -m recent --name KUBE-SEP-B2 --mask 255.255.255.255 --rsource --rcheck --seconds 10800 --reap -j KUBE-SEP-B2",
	"-A KUBE-SVC-B -m statistic --mode random --probability 0.5 -j KUBE-SEP-B1",
	"-A KUBE-SVC-B -j KUBE-SEP-B2",
	"-A KUBE-SEP-B1 -p udp -m recent --name KUBE-SEP-B1 --set -m udp -j DNAT --to-destination 10.0.3.1:5353",
	"-A KUBE-SEP-B2 -p udp -m recent --name KUBE-SEP-B2 --set -m udp -j DNAT --to-destination 10.0.3.2:5353",
	"COMMIT",
	"*filter",
	":KUBE-SERVICES - [0:0]",
	":KUBE-FORWARD - [0:0]",
	"-A INPUT -m conntrack --ctstate NEW -j KUBE-SERVICES",
	"-A OUTPUT -m conntrack --ctstate NEW -j KUBE-SERVICES",
	"-A FORWARD -m conntrack --ctstate NEW -j KUBE-SERVICES",
	"-A FORWARD -j KUBE-FORWARD",
	`-A KUBE-SERVICES -d 172.30.0.30/32 -p tcp -m comment --comment "ns/c:http has no endpoints" -m tcp --dport 80 -j REJECT --reject-with icmp-port-unreachable`,
	"-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
	"-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT",
	"-A KUBE-FORWARD -m conntrack --ctstate DNAT -j ACCEPT",
	"COMMIT",
}

var nodeIP = mustAddr("192.168.1.10")

func TestTrace(t *testing.T) {
	tcp := func(src, dst string, dport int, origin Origin) Packet {
		p := Packet{Source: mustAddr(src), Destination: mustAddr(dst), Protocol: "tcp", SourcePort: 40000, DestinationPort: dport, Origin: origin}
		if origin == OriginExternal {
			p.InInterface = "eth0"
		}
		return p
	}
	udp := func(src, dst string, dport int) Packet {
		return Packet{Source: mustAddr(src), Destination: mustAddr(dst), Protocol: "udp", SourcePort: 40000, DestinationPort: dport, InInterface: "eth0"}
	}
	opts := TraceOptions{LocalAddrs: []netip.Addr{nodeIP}}
	tests := []struct {
		name string
		pkt  Packet
		opts TraceOptions
		want []string
	}{
		{
			name: "cluster IP from a pod: every endpoint, no masquerade",
			pkt:  tcp("10.0.5.5", "172.30.0.10", 80, OriginExternal),
			opts: opts,
			want: []string{"ACCEPT dnat=10.0.1.1:8080", "ACCEPT dnat=10.0.1.2:8080", "ACCEPT dnat=10.0.2.3:8080"},
		},
		{
			name: "cluster IP from outside the cluster CIDR is masqueraded via the mark",
			pkt:  tcp("192.168.1.50", "172.30.0.10", 80, OriginExternal),
			opts: opts,
			want: []string{"ACCEPT dnat=10.0.1.1:8080 masq", "ACCEPT dnat=10.0.1.2:8080 masq", "ACCEPT dnat=10.0.2.3:8080 masq"},
		},
		{
			name: "hairpin: only the endpoint reaching itself is masqueraded",
			pkt:  tcp("10.0.1.2", "172.30.0.10", 80, OriginExternal),
			opts: opts,
			want: []string{"ACCEPT dnat=10.0.1.1:8080", "ACCEPT dnat=10.0.1.2:8080 masq", "ACCEPT dnat=10.0.2.3:8080"},
		},
		{
			name: "cluster IP from a host process",
			pkt:  tcp("192.168.1.10", "172.30.0.10", 80, OriginLocal),
			opts: opts,
			want: []string{"ACCEPT dnat=10.0.1.1:8080 masq", "ACCEPT dnat=10.0.1.2:8080 masq", "ACCEPT dnat=10.0.2.3:8080 masq"},
		},
		{
			name: "wrong port is not a service",
			pkt:  tcp("10.0.5.5", "172.30.0.10", 81, OriginExternal),
			opts: opts,
			want: []string{"ACCEPT"},
		},
		{
			name: "node port on a local address",
			pkt:  tcp("203.0.113.9", "192.168.1.10", 30080, OriginExternal),
			opts: opts,
			want: []string{"ACCEPT dnat=10.0.1.1:8080 masq", "ACCEPT dnat=10.0.1.2:8080 masq", "ACCEPT dnat=10.0.2.3:8080 masq"},
		},
		{
			name: "node port on loopback from a host process",
			pkt:  tcp("127.0.0.1", "127.0.0.1", 30080, OriginLocal),
			opts: opts,
			want: []string{"ACCEPT dnat=10.0.1.1:8080 masq", "ACCEPT dnat=10.0.1.2:8080 masq", "ACCEPT dnat=10.0.2.3:8080 masq"},
		},
		{
			name: "node port on an address that is not local",
			pkt:  tcp("203.0.113.9", "192.168.1.11", 30080, OriginExternal),
			opts: opts,
			want: []string{"ACCEPT"},
		},
		{
			name: "no endpoints: REJECT in filter (forwarded)",
			pkt:  tcp("10.0.5.5", "172.30.0.30", 80, OriginExternal),
			opts: opts,
			want: []string{"REJECT"},
		},
		{
			name: "no endpoints: REJECT in filter (host process)",
			pkt:  tcp("192.168.1.10", "172.30.0.30", 80, OriginLocal),
			opts: opts,
			want: []string{"REJECT"},
		},
		{
			name: "affinity without history: every endpoint, each recorded",
			pkt:  udp("10.0.5.5", "172.30.0.20", 53),
			opts: opts,
			want: []string{"ACCEPT dnat=10.0.3.1:5353 recent=KUBE-SEP-B1", "ACCEPT dnat=10.0.3.2:5353 recent=KUBE-SEP-B2"},
		},
		{
			name: "affinity with history: only the remembered endpoint",
			pkt:  udp("10.0.5.5", "172.30.0.20", 53),
			opts: TraceOptions{LocalAddrs: opts.LocalAddrs, Recent: map[string][]netip.Addr{"KUBE-SEP-B2": {mustAddr("10.0.5.5")}}},
			want: []string{"ACCEPT dnat=10.0.3.2:5353 recent=KUBE-SEP-B2"},
		},
		{
			name: "affinity history of another client does not apply",
			pkt:  udp("10.0.5.6", "172.30.0.20", 53),
			opts: TraceOptions{LocalAddrs: opts.LocalAddrs, Recent: map[string][]netip.Addr{"KUBE-SEP-B2": {mustAddr("10.0.5.5")}}},
			want: []string{"ACCEPT dnat=10.0.3.1:5353 recent=KUBE-SEP-B1", "ACCEPT dnat=10.0.3.2:5353 recent=KUBE-SEP-B2"},
		},
	}
	f := NewFake(iptables.ProtocolIPv4)
	mustRestore(t, f, kubeRules...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			outcomes, err := f.Trace(tc.pkt, tc.opts)
			if err != nil {
				t.Fatalf("Trace: %v", err)
			}
			if got := summary(outcomes); !slices.Equal(got, tc.want) {
				t.Errorf("outcomes:\n got %q\nwant %q", got, tc.want)
			}
			for _, o := range outcomes {
				if o.RulesEvaluated < len(o.Path) || (o.DNAT != "" && len(o.Path) == 0) {
					t.Errorf("outcome %+v: implausible Path/RulesEvaluated", o)
				}
			}
		})
	}
}

func TestTracePath(t *testing.T) {
	f := NewFake(iptables.ProtocolIPv4)
	mustRestore(t, f, kubeRules...)
	outcomes, err := f.Trace(Packet{Source: mustAddr("10.0.5.5"), Destination: mustAddr("172.30.0.10"), Protocol: "tcp",
		SourcePort: 1234, DestinationPort: 80, InInterface: "eth0"}, TraceOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var first *Outcome
	for i := range outcomes {
		if outcomes[i].DNAT == "10.0.1.1:8080" {
			first = &outcomes[i]
		}
	}
	if first == nil {
		t.Fatalf("no outcome for the first endpoint: %+v", outcomes)
	}
	wantPath := []string{"nat/PREROUTING#1", "nat/KUBE-SERVICES#1", "nat/KUBE-SVC-A#2", "nat/KUBE-SEP-A1#2",
		"filter/FORWARD#1", "filter/FORWARD#2", "filter/KUBE-FORWARD#3", "nat/POSTROUTING#1", "nat/KUBE-POSTROUTING#1"}
	if !slices.Equal(first.Path, wantPath) {
		t.Errorf("Path = %q, want %q", first.Path, wantPath)
	}
	// nat PREROUTING 1, KUBE-SERVICES 1, KUBE-SVC-A 2, KUBE-SEP-A1 2,
	// filter FORWARD 2, KUBE-SERVICES 1, KUBE-FORWARD 3, nat POSTROUTING 1,
	// KUBE-POSTROUTING 1.
	if first.RulesEvaluated != 14 {
		t.Errorf("RulesEvaluated = %d, want 14", first.RulesEvaluated)
	}
}

func TestTraceEndpoints(t *testing.T) {
	outcomes := []Outcome{
		{Verdict: "ACCEPT", DNAT: "10.0.0.2:80"},
		{Verdict: "ACCEPT", DNAT: "10.0.0.1:80"},
		{Verdict: "ACCEPT", DNAT: "10.0.0.2:80", Masquerade: true},
		{Verdict: "DROP", DNAT: "10.0.0.3:80"},
		{Verdict: "ACCEPT"},
	}
	if got, want := Endpoints(outcomes), []string{"10.0.0.1:80", "10.0.0.2:80"}; !slices.Equal(got, want) {
		t.Errorf("Endpoints = %q, want %q", got, want)
	}
	if got := Endpoints(nil); len(got) != 0 {
		t.Errorf("Endpoints(nil) = %q", got)
	}
}

// traceRules builds a Fake from restore lines.
func traceRules(t *testing.T, protocol iptables.Protocol, lines ...string) *Fake {
	t.Helper()
	f := NewFake(protocol)
	mustRestore(t, f, lines...)
	return f
}

func TestTraceSmallRulesets(t *testing.T) {
	pkt4 := Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.96.0.5"), Protocol: "tcp", SourcePort: 1000, DestinationPort: 80, InInterface: "eth0"}
	tests := []struct {
		name     string
		protocol iptables.Protocol
		rules    []string
		pkt      Packet
		opts     TraceOptions
		want     []string
		// wantEvaluated, when set, is the RulesEvaluated of every outcome.
		wantEvaluated int
	}{
		{
			name: "statistic branches give every endpoint",
			rules: []string{"*nat", ":S - [0:0]", "-A PREROUTING -j S",
				"-A S -p tcp -m statistic --mode random --probability 0.25 -j DNAT --to-destination 10.1.0.1:80",
				"-A S -p tcp -m statistic --mode random --probability 0.33333 -j DNAT --to-destination 10.1.0.2:80",
				"-A S -p tcp -m statistic --mode random --probability 0.5 -j DNAT --to-destination 10.1.0.3:80",
				"-A S -p tcp -j DNAT --to-destination 10.1.0.4:80", "COMMIT"},
			pkt:  pkt4,
			want: []string{"ACCEPT dnat=10.1.0.1:80", "ACCEPT dnat=10.1.0.2:80", "ACCEPT dnat=10.1.0.3:80", "ACCEPT dnat=10.1.0.4:80"},
		},
		{
			name: "probability 1 always and 0 never matches",
			rules: []string{"*nat", "-A PREROUTING -p tcp -m statistic --mode random --probability 0 -j DNAT --to-destination 10.1.0.1",
				"-A PREROUTING -p tcp -m statistic --mode random --probability 1.0 -j DNAT --to-destination 10.1.0.2",
				"-A PREROUTING -p tcp -j DNAT --to-destination 10.1.0.3", "COMMIT"},
			pkt:  pkt4,
			want: []string{"ACCEPT dnat=10.1.0.2:80"},
		},
		{
			name: "nth statistic branches, every 1 always matches",
			rules: []string{"*nat", "-A PREROUTING -p tcp -m statistic --mode nth --every 2 --packet 0 -j DNAT --to-destination 10.1.0.1",
				"-A PREROUTING -p tcp -m statistic --mode nth --every 1 -j DNAT --to-destination 10.1.0.2",
				"-A PREROUTING -p tcp -j DNAT --to-destination 10.1.0.3", "COMMIT"},
			pkt:  pkt4,
			want: []string{"ACCEPT dnat=10.1.0.1:80", "ACCEPT dnat=10.1.0.2:80"},
		},
		{
			name:  "negated statistic branches too",
			rules: []string{"*filter", "-A FORWARD -m statistic --mode random ! --probability 0.5 -j DROP", "COMMIT"},
			pkt:   pkt4,
			want:  []string{"ACCEPT", "DROP"},
		},
		{
			name: "identical outcomes are deduplicated",
			rules: []string{"*nat", "-A PREROUTING -p tcp -m statistic --mode random --probability 0.5 -j DNAT --to-destination 10.1.0.1:80",
				"-A PREROUTING -p tcp -j DNAT --to-destination 10.1.0.1:80", "COMMIT"},
			pkt:  pkt4,
			want: []string{"ACCEPT dnat=10.1.0.1:80"},
		},
		{
			name:  "converging branches do not multiply",
			rules: append(append([]string{"*filter"}, slices.Repeat([]string{"-A FORWARD -m statistic --mode random --probability 0.5"}, 40)...), "COMMIT"),
			pkt:   pkt4,
			want:  []string{"ACCEPT"},
			// 40 rules in filter FORWARD, every world evaluates all.
			wantEvaluated: 40,
		},
		{
			name: "dispatch on low address bits with a non-contiguous mask",
			rules: []string{"*nat", ":D0 - [0:0]", ":D1 - [0:0]",
				"-A PREROUTING -d 0.0.0.0/0.0.0.1 -j D0", "-A PREROUTING -d 0.0.0.1/0.0.0.1 -j D1",
				"-A D0 -d 10.96.0.4 -p tcp -j DNAT --to-destination 10.1.0.4:80",
				"-A D0 -d 10.96.0.6 -p tcp -j DNAT --to-destination 10.1.0.6:80",
				"-A D1 -d 10.96.0.5 -p tcp -j DNAT --to-destination 10.1.0.5:80",
				"COMMIT"},
			pkt:  pkt4,
			want: []string{"ACCEPT dnat=10.1.0.5:80"},
			// PREROUTING 2 + D1 1; filter and POSTROUTING are empty.
			wantEvaluated: 3,
		},
		{
			name: "DNAT without a port keeps the port; conntrack DNAT matches afterwards",
			rules: []string{"*nat", "-A PREROUTING -j DNAT --to-destination 10.1.0.9", "COMMIT",
				"*filter", ":FORWARD DROP [0:0]", "-A FORWARD -m conntrack --ctstate DNAT -j ACCEPT", "COMMIT"},
			pkt:  pkt4,
			want: []string{"ACCEPT dnat=10.1.0.9:80"},
		},
		{
			name:  "builtin policy applies",
			rules: []string{"*filter", ":FORWARD DROP [0:0]", "-A FORWARD -m conntrack --ctstate DNAT,INVALID -j ACCEPT", "COMMIT"},
			pkt:   pkt4,
			want:  []string{"DROP"},
		},
		{
			name: "return from a user chain continues in the caller",
			rules: []string{"*filter", ":C - [0:0]", "-A FORWARD -j C", "-A FORWARD -j REJECT",
				"-A C -p tcp -j RETURN", "-A C -j ACCEPT", "COMMIT"},
			pkt:  pkt4,
			want: []string{"REJECT"},
		},
		{
			name: "falling off a goto'd chain returns from the calling chain",
			rules: []string{"*filter", ":A - [0:0]", ":B - [0:0]", "-A FORWARD -j A", "-A FORWARD -j DROP",
				"-A A -g B", "-A A -j REJECT", "-A B -s 10.9.9.9 -j ACCEPT", "COMMIT"},
			pkt:  pkt4,
			want: []string{"DROP"},
		},
		{
			name: "marks accumulate and are matched",
			rules: []string{"*mangle", "-A PREROUTING -j MARK --set-xmark 0x1/0xff", "COMMIT",
				"*nat", "-A PREROUTING -m mark --mark 0x1/0x1 -j MARK --or-mark 0x4000", "COMMIT",
				"*filter", "-A FORWARD -m mark ! --mark 0x4001 -j DROP", "COMMIT"},
			pkt:  pkt4,
			want: []string{"ACCEPT mark=0x4001"},
		},
		{
			name:  "recent --set then --rcheck on the same path",
			rules: []string{"*filter", "-A FORWARD -m recent --name R --set", "-A FORWARD -m recent --name R --rcheck -j DROP", "COMMIT"},
			pkt:   pkt4,
			want:  []string{"DROP recent=R"},
		},
		{
			name:  "recent with a mask matches the network",
			rules: []string{"*filter", "-A FORWARD -m recent --name R --rcheck --mask 255.255.0.0 -j DROP", "COMMIT"},
			pkt:   pkt4,
			opts:  TraceOptions{Recent: map[string][]netip.Addr{"R": {mustAddr("10.0.77.77")}}},
			want:  []string{"DROP"},
		},
		{
			name: "interface matching",
			rules: []string{"*filter", "-A FORWARD -i eth1 -j DROP", "-A FORWARD ! -i et+ -j DROP",
				"-A FORWARD -i eth+ -j REJECT", "COMMIT"},
			pkt:  pkt4,
			want: []string{"REJECT"},
		},
		{
			name: "addrtype LOCAL source and negation",
			rules: []string{"*filter", "-A INPUT -m addrtype --src-type LOCAL -j DROP",
				"-A INPUT -m addrtype ! --dst-type LOCAL -j DROP", "-A INPUT -j REJECT", "COMMIT"},
			pkt:  Packet{Source: mustAddr("10.0.0.1"), Destination: nodeIP, Protocol: "tcp", SourcePort: 1, DestinationPort: 22, InInterface: "eth0"},
			opts: TraceOptions{LocalAddrs: []netip.Addr{nodeIP}},
			want: []string{"REJECT"},
		},
		{
			name:  "multiport and sctp",
			rules: []string{"*filter", "-A FORWARD -p sctp -m multiport --dports 1:10,80 -j REJECT", "COMMIT"},
			pkt:   Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.0.0.2"), Protocol: "sctp", SourcePort: 5, DestinationPort: 80},
			want:  []string{"REJECT"},
		},
		{
			name: "ipset with ip,port entries",
			rules: []string{"*nat", ":KUBE-SERVICES - [0:0]", "-A PREROUTING -j KUBE-SERVICES",
				"-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j MARK --or-mark 0x1",
				"-A KUBE-SERVICES -m set --match-set KUBE-LB src -j MARK --or-mark 0x2",
				"-A KUBE-SERVICES -m set ! --match-set KUBE-LB dst -j MARK --or-mark 0x4", "COMMIT"},
			pkt: pkt4,
			opts: TraceOptions{IPSets: map[string][]string{
				"KUBE-CLUSTER-IP": {"10.96.0.1,tcp:443", "10.96.0.5,tcp:80"},
				"KUBE-LB":         {"10.0.0.0/24"},
			}},
			want: []string{"ACCEPT mark=0x7"},
		},
		{
			name: "ipset with three dimensions: ip,port,ip and ip,port,net",
			rules: []string{"*filter", ":SRC - [0:0]", "-A INPUT -j SRC",
				"-A SRC -m set --match-set LB-SRC-IP dst,dst,src -j MARK --or-mark 0x1",
				"-A SRC -m set --match-set LB-SRC-NET dst,dst,src -j MARK --or-mark 0x2",
				"-A SRC -m set ! --match-set LB-SRC-OTHER dst,dst,src -j MARK --or-mark 0x4", "COMMIT"},
			pkt: Packet{Source: mustAddr("10.0.0.7"), Destination: nodeIP, Protocol: "tcp", SourcePort: 5, DestinationPort: 80},
			opts: TraceOptions{LocalAddrs: []netip.Addr{nodeIP}, IPSets: map[string][]string{
				"LB-SRC-IP":    {nodeIP.String() + ",tcp:80,10.0.0.7"},
				"LB-SRC-NET":   {nodeIP.String() + ",udp:80,10.0.0.0/24", nodeIP.String() + ",tcp:80,10.0.0.0/29"},
				"LB-SRC-OTHER": {nodeIP.String() + ",tcp:80,10.0.0.8/29", nodeIP.String() + ",tcp:81,10.0.0.7"},
			}},
			want: []string{"ACCEPT mark=0x7"},
		},
		{
			name:     "IPv6 service with non-contiguous dispatch and masquerade",
			protocol: iptables.ProtocolIPv6,
			rules: []string{"*nat", ":KUBE-SVC - [0:0]", ":KUBE-MARK-MASQ - [0:0]",
				"-A OUTPUT -d ::5/::ff -p tcp -m tcp --dport 80 -j KUBE-SVC",
				"-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
				"-A KUBE-SVC ! -s fd00:10::/64 -j KUBE-MARK-MASQ",
				"-A KUBE-SVC -m statistic --mode random --probability 0.5 -p tcp -j DNAT --to-destination [fd00:10::1]:8080",
				"-A KUBE-SVC -p tcp -j DNAT --to-destination [fd00:10::2]:8080",
				"-A POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE", "COMMIT"},
			pkt:  Packet{Source: mustAddr("fd00:1::1"), Destination: mustAddr("fd00:96::105"), Protocol: "tcp", SourcePort: 5, DestinationPort: 80, Origin: OriginLocal},
			want: []string{"ACCEPT dnat=[fd00:10::1]:8080 masq mark=0x4000", "ACCEPT dnat=[fd00:10::2]:8080 masq mark=0x4000"},
		},
		{
			name:     "IPv6 REJECT and address that does not dispatch",
			protocol: iptables.ProtocolIPv6,
			rules:    []string{"*filter", "-A FORWARD -d ::5/::ff -j ACCEPT", "-A FORWARD -p tcp -j REJECT --reject-with tcp-reset", "COMMIT"},
			pkt:      Packet{Source: mustAddr("fd00:1::1"), Destination: mustAddr("fd00:96::106"), Protocol: "tcp", SourcePort: 5, DestinationPort: 80},
			want:     []string{"REJECT"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			protocol := tc.protocol
			if protocol == "" {
				protocol = iptables.ProtocolIPv4
			}
			f := traceRules(t, protocol, tc.rules...)
			outcomes, err := f.Trace(tc.pkt, tc.opts)
			if err != nil {
				t.Fatalf("Trace: %v", err)
			}
			if got := summary(outcomes); !slices.Equal(got, tc.want) {
				t.Errorf("outcomes:\n got %q\nwant %q", got, tc.want)
			}
			if tc.wantEvaluated != 0 {
				for _, o := range outcomes {
					if o.RulesEvaluated != tc.wantEvaluated {
						t.Errorf("RulesEvaluated = %d, want %d (path %q)", o.RulesEvaluated, tc.wantEvaluated, o.Path)
					}
				}
			}
		})
	}
}

func TestTraceErrors(t *testing.T) {
	pkt := Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.96.0.5"), Protocol: "tcp", SourcePort: 1000, DestinationPort: 80}
	tests := []struct {
		name  string
		rules []string
		pkt   *Packet
		opts  TraceOptions
		want  string
	}{
		{name: "-o is not modelled", rules: []string{"*filter", "-A FORWARD -o eth0 -j ACCEPT", "COMMIT"}, want: "-o is not supported"},
		{name: "addrtype other than LOCAL", rules: []string{"*filter", "-A FORWARD -m addrtype --dst-type UNICAST", "COMMIT"}, want: "addrtype UNICAST"},
		{name: "ipset missing from options", rules: []string{"*filter", "-A FORWARD -m set --match-set NOPE dst", "COMMIT"}, want: `ipset "NOPE"`},
		{name: "ipset entry of the wrong shape", rules: []string{"*filter", "-A FORWARD -m set --match-set S dst", "COMMIT"},
			opts: TraceOptions{IPSets: map[string][]string{"S": {"10.96.0.5,tcp:80"}}}, want: "does not fit"},
		{name: "SNAT", rules: []string{"*nat", "-A POSTROUTING -j SNAT --to-source 1.2.3.4", "COMMIT"}, want: "SNAT is not supported"},
		{name: "recent hitcount", rules: []string{"*filter", "-A FORWARD -m recent --rcheck --hitcount 2", "COMMIT"}, want: "--hitcount"},
		{name: "recent remove", rules: []string{"*filter", "-A FORWARD -m recent --remove", "COMMIT"}, want: "--remove"},
		{name: "DNAT to a port range", rules: []string{"*nat", "-A PREROUTING -p tcp -j DNAT --to-destination 1.2.3.4:80-81", "COMMIT"}, want: "port range"},
		{name: "too many branches", rules: branchyRules(15), want: "more than 16384 branches"},
		{name: "packet of the wrong family", pkt: &Packet{Source: mustAddr("fd00::1"), Destination: mustAddr("fd00::2"), Protocol: "tcp", SourcePort: 1, DestinationPort: 1}, want: "not a plain IPv4"},
		{name: "packet without protocol", pkt: &Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.0.0.2"), SourcePort: 1, DestinationPort: 1}, want: "protocol"},
		{name: "packet without port", pkt: &Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.0.0.2"), Protocol: "udp"}, want: "port 0"},
		{name: "local packet with an input interface", pkt: &Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.0.0.2"), Protocol: "udp", SourcePort: 1, DestinationPort: 1, InInterface: "eth0", Origin: OriginLocal}, want: "no input interface"},
		{name: "unknown origin", pkt: &Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.0.0.2"), Protocol: "udp", SourcePort: 1, DestinationPort: 1, Origin: 7}, want: "origin"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := traceRules(t, iptables.ProtocolIPv4, tc.rules...)
			p := pkt
			if tc.pkt != nil {
				p = *tc.pkt
			}
			_, err := f.Trace(p, tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Trace error = %v, want it to contain %q", err, tc.want)
			}
		})
	}
}

// branchyRules has n random rules each setting a different mark bit: 2^n
// distinct worlds.
func branchyRules(n int) []string {
	rules := []string{"*filter"}
	for i := range n {
		rules = append(rules, fmt.Sprintf("-A FORWARD -m statistic --mode random --probability 0.5 -j MARK --or-mark %#x", 1<<i))
	}
	return append(rules, "COMMIT")
}

// TestTraceLoopDetection plants a jump loop the kernel (and Restore) would
// refuse, to check the tracer's own guard.
func TestTraceLoopDetection(t *testing.T) {
	f := traceRules(t, iptables.ProtocolIPv4, "*filter", ":L1 - [0:0]", ":L2 - [0:0]", "-A L1 -j L2", "-A FORWARD -j L1", "COMMIT")
	err := f.Restore(t.Context(), restoreText("*filter", "-A L2 -j L1", "COMMIT"))
	if err == nil || !strings.Contains(err.Error(), "loop") {
		t.Fatalf("Restore of a loop = %v, want a loop error", err)
	}
	back := []string{"-j", "L1"}
	r, err := ParseRule(back)
	if err != nil {
		t.Fatal(err)
	}
	l2 := f.tables[iptables.TableFilter].chains["L2"]
	l2.rules = append(l2.rules, &fakeRule{args: back, rule: r})

	_, err = f.Trace(Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.0.0.2"), Protocol: "tcp", SourcePort: 1, DestinationPort: 2}, TraceOptions{})
	if err == nil || !strings.Contains(err.Error(), "loop") {
		t.Errorf("Trace = %v, want a loop error", err)
	}
	t.Logf("loop error: %v", err)
}
