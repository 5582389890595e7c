package iptables

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/netnstest"
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

// realFamily is what differs between the IPv4 and IPv6 runs.
type realFamily struct {
	name     string
	protocol Protocol
	bin      string
	src      string // a CIDR for -s
	// mask is a destination with a non-contiguous mask, as iptables-save
	// prints it.
	mask string
}

var realFamilies = []realFamily{
	{name: "IPv4", protocol: ProtocolIPv4, bin: "iptables", src: "10.0.0.0/8", mask: "0.0.0.5/0.0.0.255"},
	{name: "IPv6", protocol: ProtocolIPv6, bin: "ip6tables", src: "fd00::/8", mask: "::5/::ff"},
}

// newRealInNS returns the real implementation for family inside a fresh
// namespace.
func newRealInNS(t *testing.T, family realFamily) (*Real, *netnstest.NS) {
	t.Helper()
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "ipt")
	ipt, err := New(t.Context(), Options{Protocol: family.protocol, NetNS: ns.Name})
	if err != nil {
		t.Fatal(err)
	}
	r := ipt.(*Real)
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
	})
	return r, ns
}

// realSave dumps table without the timestamped comment lines.
func realSave(t *testing.T, ipt Interface, table Table) string {
	t.Helper()
	out, err := ipt.SaveInto(t.Context(), table)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for line := range strings.Lines(string(out)) {
		if !strings.HasPrefix(line, "#") {
			b.WriteString(line)
		}
	}
	return b.String()
}

// realChainRules returns the "-A chain ..." lines of chain in a save.
func realChainRules(save string, chain Chain) []string {
	var rules []string
	for line := range strings.Lines(save) {
		if strings.HasPrefix(line, "-A "+string(chain)+" ") {
			rules = append(rules, strings.TrimSpace(line))
		}
	}
	return rules
}

func TestRealNewAndProbe(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, family := range realFamilies {
		t.Run(family.name, func(t *testing.T) {
			ipt, _ := newRealInNS(t, family)
			out, err := exec.Command(family.bin, "--version").Output()
			if err != nil {
				t.Fatal(err)
			}
			want, err := parseIptablesVersion(string(out))
			if err != nil {
				t.Fatal(err)
			}
			if ipt.Version() != want.String() || ipt.Mode() != want.mode {
				t.Errorf("Version, Mode = %s, %s; want %s, %s", ipt.Version(), ipt.Mode(), want, want.mode)
			}
			if ipt.Protocol() != family.protocol {
				t.Errorf("Protocol = %s, want %s", ipt.Protocol(), family.protocol)
			}
			// This machine has 1.8.x: --random-fully must be usable.
			if !ipt.HasRandomFully() {
				t.Errorf("HasRandomFully = false on %s", ipt.Version())
			}
			if _, err := ipt.EnsureRule(t.Context(), Append, TableNAT, ChainPostrouting, "-s", family.src, "-j", "MASQUERADE", "--random-fully"); err != nil {
				t.Fatalf("MASQUERADE --random-fully: %v", err)
			}
			if !strings.Contains(realSave(t, ipt, TableNAT), "-j MASQUERADE --random-fully") {
				t.Errorf("--random-fully missing from the saved nat table")
			}
		})
	}
}

func TestRealNewErrors(t *testing.T) {
	netnstest.RequireRoot(t)
	// A PATH holding iptables and iptables-save but no iptables-restore.
	partial := t.TempDir()
	for _, bin := range []string{"iptables", "iptables-save"} {
		p, err := exec.LookPath(bin)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(p, filepath.Join(partial, bin)); err != nil {
			t.Fatal(err)
		}
	}
	cases := []struct {
		name string
		opts Options
		path string
		want string
	}{
		{name: "unknown protocol", opts: Options{Protocol: "IPX"}, want: "unknown iptables protocol"},
		{name: "missing namespace", opts: Options{NetNS: "kpt-does-not-exist"}, want: "kpt-does-not-exist"},
		{name: "missing iptables-restore", path: partial, want: "iptables-restore is required"},
		{name: "missing ip6tables", opts: Options{Protocol: ProtocolIPv6}, path: partial, want: "ip6tables is required"},
	}
	// A failed New leaves no wrapper directory behind.
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.path != "" {
				t.Setenv("PATH", tc.path)
			}
			_, err := New(t.Context(), tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New = %v, want an error containing %q", err, tc.want)
			}
			if left := realDirEntries(t, tmp); len(left) != 0 {
				t.Errorf("failed New left %q in TMPDIR", left)
			}
		})
	}
}

// realDirEntries lists the names in dir.
func realDirEntries(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
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

// TestRealNetNSWrapper checks the go-iptables path through the namespace
// wrapper: rules land in the namespace and not in the host, and Close
// removes the wrapper directory.
func TestRealNetNSWrapper(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, family := range realFamilies {
		t.Run(family.name, func(t *testing.T) {
			tmp := t.TempDir()
			t.Setenv("TMPDIR", tmp)
			ns := netnstest.New(t, "ipt")
			iface, err := New(t.Context(), Options{Protocol: family.protocol, NetNS: ns.Name})
			if err != nil {
				t.Fatal(err)
			}
			ipt := iface.(*Real)
			closed := false
			t.Cleanup(func() {
				if !closed {
					if err := ipt.Close(); err != nil {
						t.Error(err)
					}
				}
			})
			ctx := t.Context()
			// The comment carries the namespace name, so the host cannot
			// hold the same rule.
			rule := []string{"-s", family.src, "-m", "comment", "--comment", "kpt wrapper " + ns.Name, "-j", "RETURN"}
			check := append([]string{"-w", "5", "-t", "nat", "-C", string(ChainPostrouting)}, rule...)
			inNS := func() bool {
				_, err := ns.Exec(context.Background(), family.bin, check...)
				return err == nil
			}

			steps := []struct {
				name string
				run  func(t *testing.T)
			}{
				{"wrapper script", func(t *testing.T) {
					dirs := realDirEntries(t, tmp)
					if len(dirs) != 1 {
						t.Fatalf("TMPDIR holds %q, want one wrapper directory", dirs)
					}
					script := filepath.Join(tmp, dirs[0], family.bin)
					st, err := os.Stat(script)
					if err != nil {
						t.Fatal(err)
					}
					if st.Mode().Perm()&0o100 == 0 {
						t.Errorf("%s mode %v, want executable", script, st.Mode())
					}
					body, err := os.ReadFile(script)
					if err != nil {
						t.Fatal(err)
					}
					if !strings.Contains(string(body), "netns exec '"+ns.Name+"'") {
						t.Errorf("%s = %q, want it to enter %s", script, body, ns.Name)
					}
				}},
				{"EnsureRule adds in the namespace only", func(t *testing.T) {
					for i, want := range []bool{false, true} {
						if existed, err := ipt.EnsureRule(ctx, Append, TableNAT, ChainPostrouting, rule...); err != nil || existed != want {
							t.Fatalf("EnsureRule #%d = %v, %v; want %v", i+1, existed, err, want)
						}
					}
					if !inNS() {
						t.Fatalf("rule missing in %s after EnsureRule", ns.Name)
					}
					if err := exec.Command(family.bin, check...).Run(); err == nil {
						t.Fatal("EnsureRule added the rule to the host namespace")
					}
				}},
				{"DeleteRule removes and is idempotent", func(t *testing.T) {
					for range 2 {
						if err := ipt.DeleteRule(ctx, TableNAT, ChainPostrouting, rule...); err != nil {
							t.Fatal(err)
						}
						if inNS() {
							t.Fatalf("rule still in %s after DeleteRule", ns.Name)
						}
					}
				}},
				{"Close removes the wrapper directory", func(t *testing.T) {
					for range 2 {
						if err := ipt.Close(); err != nil {
							t.Fatal(err)
						}
					}
					closed = true
					if left := realDirEntries(t, tmp); len(left) != 0 {
						t.Fatalf("TMPDIR holds %q after Close", left)
					}
					// go-iptables has nothing left to run.
					if _, err := ipt.EnsureRule(ctx, Append, TableNAT, ChainPostrouting, rule...); err == nil {
						t.Fatal("EnsureRule succeeded after Close")
					}
				}},
			}
			for _, step := range steps {
				if !t.Run(step.name, step.run) {
					return
				}
			}
		})
	}
}

func TestRealChainsAndRules(t *testing.T) {
	netnstest.RequireRoot(t)
	const chain Chain = "KPT-TEST"
	for _, family := range realFamilies {
		t.Run(family.name, func(t *testing.T) {
			ipt, _ := newRealInNS(t, family)
			ctx := t.Context()
			rule := []string{"-s", family.src, "-m", "comment", "--comment", "kpt test", "-j", "RETURN"}

			steps := []struct {
				name string
				run  func(t *testing.T)
			}{
				{"chain absent", func(t *testing.T) {
					if ok, err := ipt.ChainExists(ctx, TableNAT, chain); err != nil || ok {
						t.Fatalf("ChainExists = %v, %v; want false", ok, err)
					}
				}},
				{"absent deletes are no-ops", func(t *testing.T) {
					for name, err := range map[string]error{
						"DeleteRule missing chain":  ipt.DeleteRule(ctx, TableNAT, chain, rule...),
						"DeleteRule missing target": ipt.DeleteRule(ctx, TableNAT, ChainPrerouting, "-j", string(chain)),
						"FlushChain":                ipt.FlushChain(ctx, TableNAT, chain),
						"DeleteChain":               ipt.DeleteChain(ctx, TableNAT, chain),
					} {
						if err != nil {
							t.Errorf("%s: %v", name, err)
						}
					}
				}},
				{"EnsureChain creates then reports existing", func(t *testing.T) {
					for i, want := range []bool{false, true} {
						if existed, err := ipt.EnsureChain(ctx, TableNAT, chain); err != nil || existed != want {
							t.Fatalf("EnsureChain #%d = %v, %v; want %v", i+1, existed, err, want)
						}
					}
					if ok, err := ipt.ChainExists(ctx, TableNAT, chain); err != nil || !ok {
						t.Fatalf("ChainExists = %v, %v; want true", ok, err)
					}
					chains, err := ipt.ListChains(ctx, TableNAT)
					if err != nil {
						t.Fatal(err)
					}
					for _, c := range []string{string(chain), "PREROUTING", "POSTROUTING", "OUTPUT"} {
						if !slices.Contains(chains, c) {
							t.Errorf("ListChains = %v, missing %s", chains, c)
						}
					}
				}},
				{"EnsureRule is idempotent", func(t *testing.T) {
					for i, want := range []bool{false, true, true} {
						if existed, err := ipt.EnsureRule(ctx, Append, TableNAT, chain, rule...); err != nil || existed != want {
							t.Fatalf("EnsureRule #%d = %v, %v; want %v", i+1, existed, err, want)
						}
					}
					if got := realChainRules(realSave(t, ipt, TableNAT), chain); len(got) != 1 {
						t.Fatalf("rules in %s = %q, want exactly one", chain, got)
					}
				}},
				{"Prepend puts the rule first", func(t *testing.T) {
					if _, err := ipt.EnsureRule(ctx, Prepend, TableNAT, chain, "-p", "udp", "-j", "RETURN"); err != nil {
						t.Fatal(err)
					}
					got := realChainRules(realSave(t, ipt, TableNAT), chain)
					if len(got) != 2 || !strings.Contains(got[0], "-p udp") {
						t.Fatalf("rules in %s = %q, want the udp rule first", chain, got)
					}
				}},
				{"jump rule", func(t *testing.T) {
					if _, err := ipt.EnsureRule(ctx, Prepend, TableNAT, ChainPrerouting, "-j", string(chain)); err != nil {
						t.Fatal(err)
					}
				}},
				{"DeleteChain of a referenced chain fails", func(t *testing.T) {
					if err := ipt.DeleteChain(ctx, TableNAT, chain); err == nil {
						t.Fatal("DeleteChain of a chain with a jump to it succeeded")
					}
				}},
				{"DeleteRule removes and is idempotent", func(t *testing.T) {
					for range 2 {
						if err := ipt.DeleteRule(ctx, TableNAT, chain, rule...); err != nil {
							t.Fatal(err)
						}
						if err := ipt.DeleteRule(ctx, TableNAT, ChainPrerouting, "-j", string(chain)); err != nil {
							t.Fatal(err)
						}
					}
					save := realSave(t, ipt, TableNAT)
					if got := realChainRules(save, chain); len(got) != 1 {
						t.Fatalf("rules in %s after delete = %q, want only the udp rule", chain, got)
					}
					if got := realChainRules(save, ChainPrerouting); len(got) != 0 {
						t.Fatalf("PREROUTING after delete = %q, want empty", got)
					}
				}},
				{"FlushChain and DeleteChain", func(t *testing.T) {
					if err := ipt.FlushChain(ctx, TableNAT, chain); err != nil {
						t.Fatal(err)
					}
					if got := realChainRules(realSave(t, ipt, TableNAT), chain); len(got) != 0 {
						t.Fatalf("rules after flush = %q", got)
					}
					for range 2 {
						if err := ipt.DeleteChain(ctx, TableNAT, chain); err != nil {
							t.Fatal(err)
						}
					}
					if ok, err := ipt.ChainExists(ctx, TableNAT, chain); err != nil || ok {
						t.Fatalf("ChainExists after delete = %v, %v; want false", ok, err)
					}
				}},
				{"bad rule is an error", func(t *testing.T) {
					_, err := ipt.EnsureRule(ctx, Append, TableNAT, ChainPrerouting, "-p", "tcp", "--bogus")
					if err == nil || !strings.Contains(err.Error(), `unknown option "--bogus"`) {
						t.Fatalf("EnsureRule with a bad option = %v, want an error naming it", err)
					}
					if msg := err.Error(); strings.Contains(msg, "\n") || strings.Contains(msg, "Try `") {
						t.Errorf("error %q is not one line without the usage hint", msg)
					}
					for name, args := range map[string][]string{
						"bad option":    {"-p", "tcp", "--bogus"},
						"unknown match": {"-m", "kptbogus", "-j", "RETURN"},
					} {
						if err := ipt.DeleteRule(ctx, TableNAT, ChainPrerouting, args...); err == nil {
							t.Errorf("DeleteRule with a %s succeeded", name)
						}
					}
				}},
			}
			for _, step := range steps {
				if !t.Run(step.name, step.run) {
					return // later steps build on this one
				}
			}
		})
	}
}

func TestRealRestore(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, family := range realFamilies {
		t.Run(family.name, func(t *testing.T) {
			ipt, ns := newRealInNS(t, family)
			ctx := t.Context()
			// State owned by "someone else" and a stale chain of ours.
			for _, args := range [][]string{
				{"-t", "nat", "-N", "FOREIGN"},
				{"-t", "nat", "-A", "FOREIGN", "-s", family.src, "-j", "RETURN"},
				{"-t", "nat", "-N", "KPT-SVC"},
				{"-t", "nat", "-A", "KPT-SVC", "-p", "udp", "-j", "RETURN"},
				{"-t", "filter", "-A", "INPUT", "-p", "tcp", "--dport", "22", "-j", "ACCEPT"},
			} {
				ns.Run(t, family.bin, append([]string{"-w", "5"}, args...)...)
			}

			batch := strings.Join([]string{
				"*nat",
				":KPT-SVC - [0:0]",
				":KPT-SEP - [0:0]",
				"-A KPT-SVC -p tcp -j KPT-SEP",
				"-A KPT-SEP -d " + family.mask + " -j RETURN",
				"COMMIT",
				"*filter",
				":KPT-FW - [0:0]",
				"-A KPT-FW -p tcp --dport 80 -j REJECT",
				"COMMIT",
				"",
			}, "\n")
			if err := ipt.Restore(ctx, []byte(batch)); err != nil {
				t.Fatal(err)
			}
			nat := realSave(t, ipt, TableNAT)
			filter := realSave(t, ipt, TableFilter)
			checks := []struct {
				name  string
				save  string
				chain Chain
				want  []string
			}{
				{"declared chain flushed and refilled", nat, "KPT-SVC", []string{"-A KPT-SVC -p tcp -j KPT-SEP"}},
				{"new chain", nat, "KPT-SEP", []string{"-A KPT-SEP -d " + family.mask + " -j RETURN"}},
				{"foreign chain untouched", nat, "FOREIGN", []string{"-A FOREIGN -s " + family.src + " -j RETURN"}},
				{"second table applied", filter, "KPT-FW", []string{"-A KPT-FW -p tcp -m tcp --dport 80 -j REJECT --reject-with " + realRejectDefault(family)}},
				{"builtin chain untouched", filter, ChainInput, []string{"-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT"}},
			}
			for _, c := range checks {
				t.Run(c.name, func(t *testing.T) {
					if got := realChainRules(c.save, c.chain); !slices.Equal(got, c.want) {
						t.Errorf("%s = %q, want %q", c.chain, got, c.want)
					}
				})
			}
		})
	}
}

func realRejectDefault(family realFamily) string {
	if family.protocol == ProtocolIPv6 {
		return "icmp6-port-unreachable"
	}
	return "icmp-port-unreachable"
}

func TestRealRestoreFailureLeavesTableUnchanged(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, family := range realFamilies {
		t.Run(family.name, func(t *testing.T) {
			ipt, _ := newRealInNS(t, family)
			ctx := t.Context()
			initial := "*nat\n:KPT-SVC - [0:0]\n-A KPT-SVC -p udp -j RETURN\nCOMMIT\n"
			if err := ipt.Restore(ctx, []byte(initial)); err != nil {
				t.Fatal(err)
			}
			before := realSave(t, ipt, TableNAT)
			cases := []struct {
				name string
				data string
				// want are substrings of the error.
				want []string
			}{
				{
					name: "unknown option",
					data: "*nat\n:KPT-SVC - [0:0]\n:KPT-NEW - [0:0]\n-A KPT-SVC -j KPT-NEW\n-A KPT-NEW -p tcp --bogus\nCOMMIT\n",
					want: []string{`line 5 "-A KPT-NEW -p tcp --bogus"`, `unknown option "--bogus"`},
				},
				{
					name: "jump to missing chain",
					data: "*nat\n:KPT-SVC - [0:0]\n-A KPT-SVC -j KPT-MISSING\nCOMMIT\n",
					want: []string{"KPT-MISSING"},
				},
				{
					name: "missing COMMIT",
					data: "*nat\n:KPT-SVC - [0:0]\n-A KPT-SVC -j RETURN\n",
					want: []string{"COMMIT expected"},
				},
			}
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					err := ipt.Restore(ctx, []byte(tc.data))
					if err == nil {
						t.Fatal("Restore succeeded")
					}
					t.Logf("error: %v", err)
					for _, w := range tc.want {
						if !strings.Contains(err.Error(), w) {
							t.Errorf("error %q does not contain %q", err, w)
						}
					}
					if after := realSave(t, ipt, TableNAT); after != before {
						t.Errorf("nat table changed by a failed restore:\nbefore:\n%s\nafter:\n%s", before, after)
					}
				})
			}
		})
	}
}

func TestRealNonContiguousMaskRoundTrip(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, family := range realFamilies {
		t.Run(family.name, func(t *testing.T) {
			ipt, _ := newRealInNS(t, family)
			ctx := t.Context()
			want := "-A KPT-MASK -d " + family.mask + " -j RETURN"
			cases := []struct {
				name  string
				apply func() error
			}{
				{"restore", func() error {
					return ipt.Restore(ctx, []byte("*nat\n:KPT-MASK - [0:0]\n"+want+"\nCOMMIT\n"))
				}},
				{"EnsureRule", func() error {
					if err := ipt.FlushChain(ctx, TableNAT, "KPT-MASK"); err != nil {
						return err
					}
					_, err := ipt.EnsureRule(ctx, Append, TableNAT, "KPT-MASK", "-d", family.mask, "-j", "RETURN")
					return err
				}},
			}
			for _, tc := range cases {
				t.Run(tc.name, func(t *testing.T) {
					if err := tc.apply(); err != nil {
						t.Fatal(err)
					}
					save := realSave(t, ipt, TableNAT)
					if got := realChainRules(save, "KPT-MASK"); !slices.Equal(got, []string{want}) {
						t.Fatalf("saved rules = %q, want %q", got, want)
					}
					// The saved text restores to the same rule, and -C finds it.
					if err := ipt.Restore(ctx, []byte(save)); err != nil {
						t.Fatalf("restoring the save: %v", err)
					}
					if got := realChainRules(realSave(t, ipt, TableNAT), "KPT-MASK"); !slices.Equal(got, []string{want}) {
						t.Fatalf("after re-restore = %q, want %q", got, want)
					}
					existed, err := ipt.EnsureRule(ctx, Append, TableNAT, "KPT-MASK", "-d", family.mask, "-j", "RETURN")
					if err != nil || !existed {
						t.Fatalf("EnsureRule of the saved rule = %v, %v; want it found", existed, err)
					}
				})
			}
		})
	}
}

func TestRealContextCancelled(t *testing.T) {
	ipt, _ := newRealInNS(t, realFamilies[0])
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	cases := []struct {
		name string
		run  func() error
	}{
		{"SaveInto", func() error { _, err := ipt.SaveInto(ctx, TableNAT); return err }},
		{"Restore", func() error { return ipt.Restore(ctx, []byte("*nat\nCOMMIT\n")) }},
		{"EnsureChain", func() error { _, err := ipt.EnsureChain(ctx, TableNAT, "KPT-TEST"); return err }},
		{"EnsureRule", func() error {
			_, err := ipt.EnsureRule(ctx, Append, TableNAT, ChainPostrouting, "-j", "RETURN")
			return err
		}},
		{"DeleteRule", func() error { return ipt.DeleteRule(ctx, TableNAT, ChainPostrouting, "-j", "RETURN") }},
		{"FlushChain", func() error { return ipt.FlushChain(ctx, TableNAT, ChainPostrouting) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.run(); !errors.Is(err, context.Canceled) {
				t.Fatalf("%s with a cancelled context = %v, want context.Canceled", tc.name, err)
			}
		})
	}
	if got := realChainRules(realSave(t, ipt, TableNAT), ChainPostrouting); len(got) != 0 {
		t.Errorf("POSTROUTING = %q after cancelled calls, want empty", got)
	}
}
