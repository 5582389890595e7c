package iptables_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// newReal returns the real implementation for f inside a fresh namespace.
func newReal(t *testing.T, f family) (*iptables.Real, *netnstest.NS) {
	t.Helper()
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "ipt")
	ipt, err := iptables.New(t.Context(), iptables.Options{Protocol: f.protocol, NetNS: ns.Name})
	if err != nil {
		t.Fatal(err)
	}
	r := ipt.(*iptables.Real)
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
	})
	return r, ns
}

// builtinChains are the built-in chains of the tables the cases compare.
var builtinChains = map[iptables.Table][]iptables.Chain{
	filter: {iptables.ChainInput, iptables.ChainForward, iptables.ChainOutput},
	mangle: {iptables.ChainPrerouting, iptables.ChainInput, iptables.ChainForward, iptables.ChainOutput, iptables.ChainPostrouting},
	nat:    {iptables.ChainPrerouting, iptables.ChainInput, iptables.ChainOutput, iptables.ChainPostrouting},
}

// resetInput empties every table the cases compare: built-in chains flushed
// with policy ACCEPT, user chains deleted.
func resetInput() []byte {
	var b strings.Builder
	for _, table := range tables {
		fmt.Fprintf(&b, "*%s\n", table)
		for _, c := range builtinChains[table] {
			fmt.Fprintf(&b, ":%s ACCEPT [0:0]\n", c)
		}
		b.WriteString("-F\n-X\nCOMMIT\n")
	}
	return []byte(b.String())
}

// TestRealInterface runs the cases one after another in one namespace per
// family, emptied before each case (a namespace per case costs several
// times as much); the families run in parallel.
func TestRealInterface(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			r, _ := newReal(t, f)
			reset := resetInput()
			for _, c := range interfaceCases(f) {
				t.Run(c.name, func(t *testing.T) {
					if err := r.Restore(t.Context(), reset); err != nil {
						t.Fatalf("emptying the tables: %v", err)
					}
					runCase(t, t.Context(), r, c)
				})
			}
		})
	}
}

func TestRealNewAndProbe(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			ipt, _ := newReal(t, f)
			out, err := exec.Command(f.bin, "--version").Output()
			if err != nil {
				t.Fatal(err)
			}
			mode := "legacy"
			if strings.Contains(string(out), "nf_tables") {
				mode = "nft"
			}
			if !strings.Contains(string(out), " v"+ipt.Version()+" ") || ipt.Mode() != mode {
				t.Errorf("Version, Mode = %s, %s; want them from %q", ipt.Version(), ipt.Mode(), out)
			}
			if ipt.Protocol() != f.protocol {
				t.Errorf("Protocol = %s, want %s", ipt.Protocol(), f.protocol)
			}
			// This machine has 1.8.x: --random-fully must be usable.
			if !ipt.HasRandomFully() {
				t.Errorf("HasRandomFully = false on %s", ipt.Version())
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
		opts iptables.Options
		path string
		want string
	}{
		{name: "unknown protocol", opts: iptables.Options{Protocol: "IPX"}, want: "unknown iptables protocol"},
		{name: "missing namespace", opts: iptables.Options{NetNS: "kpt-does-not-exist"}, want: "kpt-does-not-exist"},
		{name: "missing iptables-restore", path: partial, want: "iptables-restore is required"},
		{name: "missing ip6tables", opts: iptables.Options{Protocol: iptables.ProtocolIPv6}, path: partial, want: "ip6tables is required"},
	}
	// A failed New leaves nothing behind.
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.path != "" {
				t.Setenv("PATH", tc.path)
			}
			_, err := iptables.New(t.Context(), tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New = %v, want an error containing %q", err, tc.want)
			}
			if left := dirEntries(t, tmp); len(left) != 0 {
				t.Errorf("failed New left %q in TMPDIR", left)
			}
		})
	}
}

// dirEntries lists the names in dir.
func dirEntries(t *testing.T, dir string) []string {
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

// TestRealNetNS checks single-rule operations in a namespace: rules land in
// the namespace and not in the host, nothing is left in TMPDIR, and
// operations fail after Close.
func TestRealNetNS(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			tmp := t.TempDir()
			t.Setenv("TMPDIR", tmp)
			ns := netnstest.New(t, "ipt")
			iface, err := iptables.New(t.Context(), iptables.Options{Protocol: f.protocol, NetNS: ns.Name})
			if err != nil {
				t.Fatal(err)
			}
			ipt := iface.(*iptables.Real)
			t.Cleanup(func() {
				if err := ipt.Close(); err != nil {
					t.Error(err)
				}
			})
			ctx := t.Context()
			// The comment carries the namespace name, so the host cannot
			// hold the same rule.
			rule := []string{"-s", f.src, "-m", "comment", "--comment", "kpt netns " + ns.Name, "-j", "RETURN"}
			check := append([]string{"-w", "5", "-t", "nat", "-C", string(iptables.ChainPostrouting)}, rule...)
			inNS := func() bool {
				_, err := ns.Exec(context.Background(), f.bin, check...)
				return err == nil
			}

			steps := []struct {
				name string
				run  func(t *testing.T)
			}{
				{"EnsureRule adds in the namespace only", func(t *testing.T) {
					for i, want := range []bool{false, true} {
						if existed, err := ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainPostrouting, rule...); err != nil || existed != want {
							t.Fatalf("EnsureRule #%d = %v, %v; want %v", i+1, existed, err, want)
						}
					}
					if !inNS() {
						t.Fatalf("rule missing in %s after EnsureRule", ns.Name)
					}
					if err := exec.Command(f.bin, check...).Run(); err == nil {
						t.Fatal("EnsureRule added the rule to the host namespace")
					}
				}},
				{"DeleteRule removes and is idempotent", func(t *testing.T) {
					for range 2 {
						if err := ipt.DeleteRule(ctx, iptables.TableNAT, iptables.ChainPostrouting, rule...); err != nil {
							t.Fatal(err)
						}
						if inNS() {
							t.Fatalf("rule still in %s after DeleteRule", ns.Name)
						}
					}
				}},
				{"nothing in TMPDIR", func(t *testing.T) {
					if left := dirEntries(t, tmp); len(left) != 0 {
						t.Fatalf("TMPDIR holds %q", left)
					}
				}},
				{"operations fail after Close", func(t *testing.T) {
					for range 2 {
						if err := ipt.Close(); err != nil {
							t.Fatal(err)
						}
					}
					if _, err := ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainPostrouting, rule...); err == nil {
						t.Fatal("EnsureRule succeeded after Close")
					}
					if err := ipt.Restore(ctx, []byte("*nat\nCOMMIT\n")); err == nil {
						t.Fatal("Restore succeeded after Close")
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

// TestRealErrorMessages checks that failures read as one line naming the
// problem, without iptables' usage hint.
func TestRealErrorMessages(t *testing.T) {
	ipt, _ := newReal(t, families[0])
	ctx := t.Context()
	cases := []struct {
		name string
		run  func() error
		want []string
	}{
		{
			name: "EnsureRule with an unknown option",
			run: func() error {
				_, err := ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainPrerouting, "-p", "tcp", "--bogus")
				return err
			},
			want: []string{`unknown option "--bogus"`},
		},
		{
			name: "Restore names the input line",
			run: func() error {
				return ipt.Restore(ctx, []byte("*nat\n:KPT-A - [0:0]\n-A KPT-A -p tcp --bogus\nCOMMIT\n"))
			},
			want: []string{`at input line 3 "-A KPT-A -p tcp --bogus"`, `unknown option "--bogus"`},
		},
		{
			name: "Restore without COMMIT",
			run:  func() error { return ipt.Restore(ctx, []byte("*nat\n:KPT-A - [0:0]\n")) },
			want: []string{"COMMIT expected"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run()
			if err == nil {
				t.Fatal("succeeded, want an error")
			}
			msg := err.Error()
			for _, w := range tc.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q does not contain %q", msg, w)
				}
			}
			if strings.Contains(msg, "\n") || strings.Contains(msg, "Try `") {
				t.Errorf("error %q is not one line without the usage hint", msg)
			}
		})
	}
}
