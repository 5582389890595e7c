package iptables

import (
	"os/exec"
	"testing"
)

func TestRealParseVersion(t *testing.T) {
	cases := []struct {
		name        string
		out         string
		want        string
		wantMode    string
		randomFully bool
		wantErr     bool
	}{
		{name: "nft", out: "iptables v1.8.9 (nf_tables)\n", want: "1.8.9", wantMode: "nft", randomFully: true},
		{name: "legacy", out: "iptables v1.8.7 (legacy)\n", want: "1.8.7", wantMode: "legacy", randomFully: true},
		{name: "ip6tables nft", out: "ip6tables v1.8.10 (nf_tables)", want: "1.8.10", wantMode: "nft", randomFully: true},
		{name: "old without backend", out: "iptables v1.6.1", want: "1.6.1", wantMode: "legacy", randomFully: false},
		{name: "first with random-fully", out: "iptables v1.6.2", want: "1.6.2", wantMode: "legacy", randomFully: true},
		{name: "older major", out: "iptables v1.4.21", want: "1.4.21", wantMode: "legacy", randomFully: false},
		{name: "unknown backend", out: "iptables v1.8.9 (bpf)", wantErr: true},
		{name: "garbage", out: "command not found", wantErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			v, err := parseIptablesVersion(tc.out)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("parse %q = %v, want error", tc.out, v)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if v.String() != tc.want || v.mode != tc.wantMode {
				t.Errorf("parse %q = %s %s, want %s %s", tc.out, v, v.mode, tc.want, tc.wantMode)
			}
			if got := v.atLeast(1, 6, 2); got != tc.randomFully {
				t.Errorf("%s at least 1.6.2 = %v, want %v", v, got, tc.randomFully)
			}
		})
	}
}

func TestRealRestoreErrorLine(t *testing.T) {
	data := []byte("*nat\n:A - [0:0]\n-A A -p tcp --bogus\nCOMMIT\n")
	cases := []struct {
		name     string
		stderr   string
		wantLine int
		wantText string
	}{
		{
			name:     "nft unknown option",
			stderr:   "iptables-restore v1.8.9 (nf_tables): unknown option \"--bogus\"\nError occurred at line: 3\nTry `iptables-restore -h' or 'iptables-restore --help' for more information.\n",
			wantLine: 3, wantText: "-A A -p tcp --bogus",
		},
		{
			name:     "legacy line failed",
			stderr:   "iptables-restore: line 3 failed\n",
			wantLine: 3, wantText: "-A A -p tcp --bogus",
		},
		{
			name:     "missing commit",
			stderr:   "iptables-restore: COMMIT expected at line 4\n",
			wantLine: 4, wantText: "COMMIT",
		},
		{
			name:     "table name",
			stderr:   "iptables-restore v1.8.9 (nf_tables): iptables-restore: line 1 table name 'bogus' invalid\nError occurred at line: 1\n",
			wantLine: 1, wantText: "*nat",
		},
		{name: "no line", stderr: "iptables-restore: unable to initialize table 'nat'\n"},
		{name: "line beyond input", stderr: "Error occurred at line: 9\n", wantLine: 9},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n, ok := restoreErrorLine(tc.stderr)
			if tc.wantLine == 0 {
				if ok {
					t.Fatalf("line %d found in %q, want none", n, tc.stderr)
				}
				return
			}
			if !ok || n != tc.wantLine {
				t.Fatalf("line = %d, %v; want %d", n, ok, tc.wantLine)
			}
			text, ok := restoreInputLine(data, n)
			if ok != (tc.wantText != "") || text != tc.wantText {
				t.Errorf("input line %d = %q, %v; want %q", n, text, ok, tc.wantText)
			}
		})
	}
}

func TestRealShellQuote(t *testing.T) {
	cases := []struct {
		name string
		in   string
	}{
		{name: "plain", in: "kpt-ipt-0a1b2c3d"},
		{name: "empty", in: ""},
		{name: "spaces", in: "a b  c"},
		{name: "single quotes", in: "it's 'quoted'"},
		{name: "shell syntax", in: `$HOME "x" \ ; $(false) * ~`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, err := exec.Command("/bin/sh", "-c", "printf %s "+shellQuote(tc.in)).Output()
			if err != nil {
				t.Fatal(err)
			}
			if string(out) != tc.in {
				t.Errorf("sh read %q back as %q", tc.in, out)
			}
		})
	}
}
