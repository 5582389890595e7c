package iptablestest

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

func TestParseAddrMatch(t *testing.T) {
	tests := []struct {
		name     string
		args     string
		match    []string
		nomatch  []string
		wantAddr string
		wantMask string
	}{
		{name: "host", args: "-s 10.1.2.3", match: []string{"10.1.2.3"}, nomatch: []string{"10.1.2.4", "fd00::1"}, wantAddr: "10.1.2.3", wantMask: "255.255.255.255"},
		{name: "prefix is masked", args: "-s 10.1.2.3/24", match: []string{"10.1.2.200"}, nomatch: []string{"10.1.3.3"}, wantAddr: "10.1.2.0", wantMask: "255.255.255.0"},
		{name: "zero prefix matches everything", args: "-d 0.0.0.0/0", match: []string{"1.2.3.4", "255.255.255.255"}},
		{name: "dotted contiguous mask", args: "-s 192.168.0.0/255.255.0.0", match: []string{"192.168.7.7"}, nomatch: []string{"192.169.0.1"}, wantMask: "255.255.0.0"},
		{name: "non-contiguous low-bits mask", args: "-d 0.0.0.5/0.0.0.255", match: []string{"10.0.0.5", "172.30.9.5"}, nomatch: []string{"10.0.0.6", "10.0.5.0"}, wantAddr: "0.0.0.5", wantMask: "0.0.0.255"},
		{name: "non-contiguous odd mask", args: "-d 0.0.0.1/0.0.0.1", match: []string{"10.0.0.1", "10.0.0.3"}, nomatch: []string{"10.0.0.2"}},
		{name: "negated non-contiguous mask", args: "! -d 0.0.0.5/0.0.0.255", match: []string{"10.0.0.6"}, nomatch: []string{"10.0.0.5"}},
		{name: "negated host", args: "! -s 10.0.0.0/16", match: []string{"10.1.0.1"}, nomatch: []string{"10.0.3.4"}},
		{name: "ipv6 prefix", args: "-s fd00:10::/64", match: []string{"fd00:10::99"}, nomatch: []string{"fd00:11::1", "10.0.0.1"}},
		{name: "ipv6 non-contiguous mask", args: "-d ::5/::ff", match: []string{"fd00::5", "fd00:1:2::1:205"}, nomatch: []string{"fd00::6", "fd00::500"}, wantAddr: "::5", wantMask: "::ff"},
		{name: "ipv6 negated non-contiguous mask", args: "! -d ::5/::ff", match: []string{"fd00::6"}, nomatch: []string{"fd00::105"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseRule(strings.Fields(tc.args))
			if err != nil {
				t.Fatalf("ParseRule(%q): %v", tc.args, err)
			}
			m := r.Source
			if m == nil {
				m = r.Destination
			}
			if m == nil {
				t.Fatalf("no address match parsed from %q", tc.args)
			}
			if tc.wantAddr != "" && m.Addr.String() != tc.wantAddr {
				t.Errorf("Addr = %s, want %s", m.Addr, tc.wantAddr)
			}
			if tc.wantMask != "" && m.Mask.String() != tc.wantMask {
				t.Errorf("Mask = %s, want %s", m.Mask, tc.wantMask)
			}
			for _, a := range tc.match {
				if !m.Contains(netip.MustParseAddr(a)) {
					t.Errorf("%q does not match %s", tc.args, a)
				}
			}
			for _, a := range tc.nomatch {
				if m.Contains(netip.MustParseAddr(a)) {
					t.Errorf("%q matches %s", tc.args, a)
				}
			}
		})
	}
}

func TestParseRule(t *testing.T) {
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, r *Rule)
	}{
		{
			name: "empty rule",
			args: nil,
			check: func(t *testing.T, r *Rule) {
				if r.Target != nil || len(r.Matches) != 0 {
					t.Errorf("got target %v matches %v", r.Target, r.Matches)
				}
			},
		},
		{
			name: "service portal with comment and explicit tcp match",
			args: []string{"-d", "172.30.0.10/32", "-p", "tcp", "-m", "comment", "--comment", "ns/svc:http cluster IP", "-m", "tcp", "--dport", "80", "-j", "KUBE-SVC-ABC"},
			check: func(t *testing.T, r *Rule) {
				if r.Protocol.Name != "tcp" || r.Protocol.Negate {
					t.Errorf("protocol = %+v", r.Protocol)
				}
				c := r.Matches[0].(*CommentMatch)
				if c.Comment != "ns/svc:http cluster IP" {
					t.Errorf("comment = %q", c.Comment)
				}
				pm := r.Matches[1].(*PortMatch)
				if *pm.DestinationPort != (PortRange{80, 80}) || pm.SourcePort != nil {
					t.Errorf("port match = %+v", pm)
				}
				if r.Target.Name != "KUBE-SVC-ABC" || !r.Target.Chain || r.Target.Goto {
					t.Errorf("target = %+v", r.Target)
				}
			},
		},
		{
			name: "implicit port match and negated range",
			args: []string{"-p", "udp", "!", "--sport", "1000:2000", "--dport", ":53", "-j", "ACCEPT"},
			check: func(t *testing.T, r *Rule) {
				pm := r.Matches[0].(*PortMatch)
				if pm.Protocol != "udp" || !pm.SourceNegate || *pm.SourcePort != (PortRange{1000, 2000}) || *pm.DestinationPort != (PortRange{0, 53}) || pm.DestinationNegate {
					t.Errorf("port match = %+v src %v dst %v", pm, pm.SourcePort, pm.DestinationPort)
				}
				if r.Target.Chain {
					t.Errorf("ACCEPT parsed as a chain")
				}
			},
		},
		{
			name: "negated protocol and interfaces",
			args: []string{"!", "-p", "sctp", "-i", "eth+", "!", "-o", "lo"},
			check: func(t *testing.T, r *Rule) {
				if !r.Protocol.Negate || r.Protocol.Name != "sctp" {
					t.Errorf("protocol = %+v", r.Protocol)
				}
				if !r.InInterface.Matches("eth0") || r.InInterface.Matches("ens3") || r.InInterface.Matches("") {
					t.Errorf("in-interface wildcard wrong")
				}
				if r.OutInterface.Matches("lo") || !r.OutInterface.Matches("eth0") {
					t.Errorf("negated out-interface wrong")
				}
			},
		},
		{
			name: "multiport",
			args: []string{"-p", "tcp", "-m", "multiport", "!", "--dports", "80,443,8000:8100"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*MultiportMatch)
				if m.Direction != "destination" || !m.Negate || len(m.Ports) != 3 {
					t.Fatalf("multiport = %+v", m)
				}
				if m.Contains(1, 8050) || m.Contains(1, 443) || !m.Contains(443, 81) {
					t.Errorf("negated multiport matching wrong")
				}
			},
		},
		{
			name: "multiport before -p is fine",
			args: []string{"-m", "multiport", "--ports", "1,2", "-p", "tcp"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*MultiportMatch)
				if !m.Contains(2, 9) || !m.Contains(9, 1) || m.Contains(9, 9) {
					t.Errorf("--ports matching wrong")
				}
			},
		},
		{
			name: "addrtype with negation and limit-iface",
			args: []string{"-m", "addrtype", "!", "--src-type", "LOCAL", "--dst-type", "LOCAL,UNICAST", "--limit-iface-in"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*AddrTypeMatch)
				if !m.SourceNegate || m.DestinationNegate || !slices.Equal(m.DestinationTypes, []string{"LOCAL", "UNICAST"}) || !m.LimitIfaceIn {
					t.Errorf("addrtype = %+v", m)
				}
			},
		},
		{
			name: "mark match with mask, negated",
			args: []string{"-m", "mark", "!", "--mark", "0x4000/0x4000", "-j", "RETURN"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*MarkMatch)
				if m.Value != 0x4000 || m.Mask != 0x4000 || !m.Negate {
					t.Errorf("mark = %+v", m)
				}
				if m.Matches(0x4001) || !m.Matches(0x1) {
					t.Errorf("negated mark matching wrong")
				}
			},
		},
		{
			name: "mark match without mask, octal and decimal",
			args: []string{"-m", "mark", "--mark", "010"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*MarkMatch)
				if m.Value != 8 || m.Mask != 0xffffffff {
					t.Errorf("mark = %+v", m)
				}
			},
		},
		{
			name: "conntrack states",
			args: []string{"-m", "conntrack", "!", "--ctstate", "NEW,DNAT"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*ConntrackMatch)
				if !m.Negate || !slices.Equal(m.States, []string{"NEW", "DNAT"}) {
					t.Errorf("conntrack = %+v", m)
				}
			},
		},
		{
			name: "statistic random",
			args: []string{"-m", "statistic", "--mode", "random", "--probability", "0.33333333349", "-j", "KUBE-SEP-1"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*StatisticMatch)
				if m.Mode != "random" || m.Probability != 0.33333333349 {
					t.Errorf("statistic = %+v", m)
				}
				if th := m.Threshold(); th != 715827883 {
					t.Errorf("threshold = %d, want 715827883", th)
				}
			},
		},
		{
			name: "statistic nth negated",
			args: []string{"-m", "statistic", "--mode", "nth", "!", "--every", "3", "--packet", "2"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*StatisticMatch)
				if m.Mode != "nth" || m.Every != 3 || m.Packet != 2 || !m.Negate {
					t.Errorf("statistic = %+v", m)
				}
			},
		},
		{
			name: "recent check with reap and mask",
			args: []string{"-m", "recent", "--name", "KUBE-SEP-X", "--rcheck", "--seconds", "10800", "--reap", "--mask", "255.255.255.0", "--rsource", "-j", "KUBE-SEP-X"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*RecentMatch)
				if m.Name != "KUBE-SEP-X" || m.Command != "rcheck" || m.Seconds != 10800 || !m.Reap || m.Mask.String() != "255.255.255.0" || m.Dest {
					t.Errorf("recent = %+v", m)
				}
			},
		},
		{
			name: "recent set with default name",
			args: []string{"-m", "recent", "!", "--set"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*RecentMatch)
				if m.Name != "DEFAULT" || m.Command != "set" || !m.Negate {
					t.Errorf("recent = %+v", m)
				}
			},
		},
		{
			name: "ipset match",
			args: []string{"-m", "set", "!", "--match-set", "KUBE-CLUSTER-IP", "dst,dst", "-j", "ACCEPT"},
			check: func(t *testing.T, r *Rule) {
				m := r.Matches[0].(*SetMatch)
				if m.Name != "KUBE-CLUSTER-IP" || !slices.Equal(m.Flags, []string{"dst", "dst"}) || !m.Negate {
					t.Errorf("set = %+v", m)
				}
			},
		},
		{
			name: "DNAT ipv4 with port",
			args: []string{"-p", "tcp", "-m", "tcp", "-j", "DNAT", "--to-destination", "10.0.1.1:8080"},
			check: func(t *testing.T, r *Rule) {
				n := r.Target.NAT
				if n.Addr.String() != "10.0.1.1" || n.FirstPort != 8080 || n.LastPort != 8080 {
					t.Errorf("DNAT = %+v", n)
				}
			},
		},
		{
			name: "DNAT ipv6 bracketed with port",
			args: []string{"-p", "udp", "-j", "DNAT", "--to-destination", "[fd00:10::1]:53"},
			check: func(t *testing.T, r *Rule) {
				n := r.Target.NAT
				if n.Addr.String() != "fd00:10::1" || n.FirstPort != 53 {
					t.Errorf("DNAT = %+v", n)
				}
			},
		},
		{
			name: "DNAT address only",
			args: []string{"-j", "DNAT", "--to-destination", "fd00::2"},
			check: func(t *testing.T, r *Rule) {
				if n := r.Target.NAT; n.Addr.String() != "fd00::2" || n.FirstPort != 0 {
					t.Errorf("DNAT = %+v", n)
				}
			},
		},
		{
			name: "MASQUERADE random-fully",
			args: []string{"-j", "MASQUERADE", "--random-fully"},
			check: func(t *testing.T, r *Rule) {
				if !r.Target.Masquerade.RandomFully {
					t.Errorf("masquerade = %+v", r.Target.Masquerade)
				}
			},
		},
		{
			name: "MASQUERADE to-ports",
			args: []string{"-p", "tcp", "-j", "MASQUERADE", "--to-ports", "1024-2048"},
			check: func(t *testing.T, r *Rule) {
				if m := r.Target.Masquerade; m.FirstPort != 1024 || m.LastPort != 2048 {
					t.Errorf("masquerade = %+v", m)
				}
			},
		},
		{
			name: "goto user chain",
			args: []string{"-g", "KUBE-EXT-X"},
			check: func(t *testing.T, r *Rule) {
				if !r.Target.Goto || !r.Target.Chain {
					t.Errorf("target = %+v", r.Target)
				}
			},
		},
		{
			name: "REJECT defaults and explicit",
			args: []string{"-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"},
			check: func(t *testing.T, r *Rule) {
				if r.Target.Reject.With != "tcp-reset" {
					t.Errorf("reject = %+v", r.Target.Reject)
				}
			},
		},
		{
			name: "REJECT default type",
			args: []string{"-j", "REJECT"},
			check: func(t *testing.T, r *Rule) {
				if r.Target.Reject.With != "" {
					t.Errorf("reject = %+v", r.Target.Reject)
				}
			},
		},
		{
			name: "matches after the target",
			args: []string{"-j", "ACCEPT", "-m", "comment", "--comment", "late"},
			check: func(t *testing.T, r *Rule) {
				if r.Target.Name != "ACCEPT" || r.Matches[0].(*CommentMatch).Comment != "late" {
					t.Errorf("rule = %+v", r)
				}
			},
		},
		{
			name: "long option spellings",
			args: []string{"--source", "10.0.0.1", "--protocol", "tcp", "--destination-port", "80", "--jump", "ACCEPT"},
			check: func(t *testing.T, r *Rule) {
				if r.Source == nil || r.Protocol == nil || r.Target.Name != "ACCEPT" {
					t.Errorf("rule = %+v", r)
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseRule(tc.args)
			if err != nil {
				t.Fatalf("ParseRule(%q): %v", tc.args, err)
			}
			if !slices.Equal(r.Args, tc.args) {
				t.Errorf("Args = %q, want %q", r.Args, tc.args)
			}
			tc.check(t, r)
		})
	}
}

func TestParseMarkTargetForms(t *testing.T) {
	tests := []struct {
		name string
		args string
		want MarkOptions
		// apply: mark before -> after
		before, after uint32
	}{
		{name: "set-xmark with mask", args: "-j MARK --set-xmark 0x4000/0x4000", want: MarkOptions{0x4000, 0x4000}, before: 0x1, after: 0x4001},
		{name: "set-xmark without mask", args: "-j MARK --set-xmark 0x10", want: MarkOptions{0x10, 0xffffffff}, before: 0xff, after: 0x10},
		{name: "set-mark with mask", args: "-j MARK --set-mark 0x10/0x30", want: MarkOptions{0x10, 0x30}, before: 0x2f, after: 0x1f},
		{name: "or-mark", args: "-j MARK --or-mark 0x4000", want: MarkOptions{0x4000, 0x4000}, before: 0x4001, after: 0x4001},
		{name: "xor-mark", args: "-j MARK --xor-mark 0x4000", want: MarkOptions{0x4000, 0}, before: 0x4001, after: 0x1},
		{name: "and-mark", args: "-j MARK --and-mark 0x10", want: MarkOptions{0, 0xffffffef}, before: 0x31, after: 0x10},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, err := ParseRule(strings.Fields(tc.args))
			if err != nil {
				t.Fatal(err)
			}
			if *r.Target.Mark != tc.want {
				t.Errorf("mark = %#x, want %#x", *r.Target.Mark, tc.want)
			}
			if got := r.Target.Mark.Apply(tc.before); got != tc.after {
				t.Errorf("Apply(%#x) = %#x, want %#x", tc.before, got, tc.after)
			}
		})
	}
}

func TestParseRuleErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{name: "unknown option", args: []string{"--bogus"}, want: "unknown option"},
		{name: "unknown match", args: []string{"-m", "limit"}, want: "unsupported match"},
		{name: "unknown match option", args: []string{"-m", "comment", "--comment", "x", "--foo"}, want: "unknown option"},
		{name: "option of another module", args: []string{"-m", "mark", "--mark", "1", "--ctstate", "NEW"}, want: "unknown option"},
		{name: "stray argument", args: []string{"-j", "ACCEPT", "extra"}, want: "unexpected argument"},
		{name: "missing value", args: []string{"-s"}, want: "needs a value"},
		{name: "bad address", args: []string{"-s", "10.0.0.256"}, want: "invalid address"},
		{name: "hostname", args: []string{"-d", "example.com"}, want: "invalid address"},
		{name: "prefix too long", args: []string{"-s", "10.0.0.0/33"}, want: "prefix length"},
		{name: "mask of other family", args: []string{"-s", "10.0.0.0/::ff"}, want: "invalid mask"},
		{name: "intrapositioned negation", args: []string{"-s", "!10.0.0.1"}, want: "negation must precede"},
		{name: "double negation", args: []string{"!", "!", "-s", "10.0.0.1"}, want: "multiple '!'"},
		{name: "negation at end", args: []string{"-j", "ACCEPT", "!"}, want: "end of the rule"},
		{name: "negated comment", args: []string{"-m", "comment", "!", "--comment", "x"}, want: "cannot be negated"},
		{name: "negated target", args: []string{"!", "-j", "ACCEPT"}, want: "cannot be negated"},
		{name: "negated match load", args: []string{"!", "-m", "tcp"}, want: "cannot be negated"},
		{name: "duplicate source", args: []string{"-s", "1.1.1.1", "-s", "2.2.2.2"}, want: "multiple -s"},
		{name: "both -j and -g", args: []string{"-j", "X", "-g", "Y"}, want: "only one of -j and -g"},
		{name: "unsupported protocol", args: []string{"-p", "gre"}, want: "unsupported protocol"},
		{name: "tcp match without -p tcp", args: []string{"-m", "tcp", "--dport", "80"}, want: "only valid with -p tcp"},
		{name: "tcp match with -p udp", args: []string{"-p", "udp", "-m", "tcp", "--dport", "80"}, want: "only valid with -p tcp"},
		{name: "implicit port without protocol", args: []string{"--dport", "80"}, want: "unknown option"},
		{name: "bad port", args: []string{"-p", "tcp", "--dport", "http"}, want: "invalid port"},
		{name: "port out of range", args: []string{"-p", "tcp", "--dport", "65536"}, want: "invalid port"},
		{name: "reversed port range", args: []string{"-p", "tcp", "--dport", "90:80"}, want: "invalid port range"},
		{name: "multiport without protocol", args: []string{"-m", "multiport", "--dports", "1,2"}, want: "multiport needs -p"},
		{name: "multiport too many", args: []string{"-p", "tcp", "-m", "multiport", "--dports", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15:16"}, want: "too many ports"},
		{name: "multiport two directions", args: []string{"-p", "tcp", "-m", "multiport", "--dports", "1", "--sports", "2"}, want: "only one of"},
		{name: "comment too long", args: []string{"-m", "comment", "--comment", strings.Repeat("a", 256)}, want: "longer than 255"},
		{name: "comment missing", args: []string{"-m", "comment"}, want: "needs --comment"},
		{name: "addrtype unknown type", args: []string{"-m", "addrtype", "--dst-type", "LOCALE"}, want: "unknown address type"},
		{name: "addrtype without type", args: []string{"-m", "addrtype"}, want: "needs --src-type or --dst-type"},
		{name: "bad mark", args: []string{"-m", "mark", "--mark", "0xZZ"}, want: "invalid number"},
		{name: "mark too big", args: []string{"-m", "mark", "--mark", "0x100000000"}, want: "invalid number"},
		{name: "unknown ctstate", args: []string{"-m", "conntrack", "--ctstate", "NEW,BOGUS"}, want: "unknown state"},
		{name: "state module has no DNAT", args: []string{"-m", "state", "--state", "DNAT"}, want: "unknown state"},
		{name: "statistic without mode", args: []string{"-m", "statistic", "--probability", "0.5"}, want: "needs --mode"},
		{name: "statistic probability above 1", args: []string{"-m", "statistic", "--mode", "random", "--probability", "1.5"}, want: "between 0 and 1"},
		{name: "statistic probability not a number", args: []string{"-m", "statistic", "--mode", "random", "--probability", "0x1p-2"}, want: "invalid number"},
		{name: "statistic probability infinite", args: []string{"-m", "statistic", "--mode", "random", "--probability", "inf"}, want: "invalid number"},
		{name: "statistic nth packet too big", args: []string{"-m", "statistic", "--mode", "nth", "--every", "2", "--packet", "2"}, want: "--packet must be smaller"},
		{name: "recent without command", args: []string{"-m", "recent", "--name", "x"}, want: "needs one of"},
		{name: "recent two commands", args: []string{"-m", "recent", "--set", "--rcheck"}, want: "only one of"},
		{name: "recent reap without seconds", args: []string{"-m", "recent", "--rcheck", "--reap"}, want: "--reap needs --seconds"},
		{name: "recent seconds with set", args: []string{"-m", "recent", "--set", "--seconds", "5"}, want: "need --rcheck or --update"},
		{name: "set bad flag", args: []string{"-m", "set", "--match-set", "S", "dst,port"}, want: "invalid flag"},
		{name: "set missing flags", args: []string{"-m", "set", "--match-set", "S"}, want: "needs a value"},
		{name: "DNAT without destination", args: []string{"-j", "DNAT"}, want: "needs --to-destination"},
		{name: "DNAT port without protocol", args: []string{"-j", "DNAT", "--to-destination", "1.2.3.4:80"}, want: "needs -p tcp"},
		{name: "DNAT address range", args: []string{"-j", "DNAT", "--to-destination", "1.2.3.4-1.2.3.5"}, want: "invalid address"},
		{name: "DNAT empty port", args: []string{"-p", "tcp", "-j", "DNAT", "--to-destination", "1.2.3.4:"}, want: "invalid address"},
		{name: "DNAT twice", args: []string{"-p", "tcp", "-j", "DNAT", "--to-destination", "1.2.3.4:1", "--to-destination", "1.2.3.4:2"}, want: "multiple --to-destination"},
		{name: "DNAT option on MASQUERADE", args: []string{"-j", "MASQUERADE", "--to-destination", "1.2.3.4"}, want: "unknown option"},
		{name: "MARK without action", args: []string{"-j", "MARK"}, want: "MARK needs"},
		{name: "MARK two actions", args: []string{"-j", "MARK", "--or-mark", "1", "--xor-mark", "2"}, want: "only one of"},
		{name: "REJECT unknown type", args: []string{"-j", "REJECT", "--reject-with", "icmp-bogus"}, want: "unknown reject type"},
		{name: "REJECT tcp-reset without tcp", args: []string{"-p", "udp", "-j", "REJECT", "--reject-with", "tcp-reset"}, want: "needs -p tcp"},
		{name: "option on ACCEPT", args: []string{"-j", "ACCEPT", "--reject-with", "tcp-reset"}, want: "unknown option"},
		{name: "option on chain target", args: []string{"-j", "KUBE-SVC-X", "--to-destination", "1.2.3.4"}, want: "unknown option"},
		{name: "goto a verdict", args: []string{"-g", "ACCEPT"}, want: "-g needs a user chain"},
		{name: "unsupported target", args: []string{"-j", "NOTRACK"}, want: "not supported"},
		{name: "interface too long", args: []string{"-i", "abcdefghijklmnop"}, want: "invalid interface"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseRule(tc.args)
			if err == nil {
				t.Fatalf("ParseRule(%q) succeeded, want error containing %q", tc.args, tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ParseRule(%q) error = %v, want it to contain %q", tc.args, err, tc.want)
			}
		})
	}
}
