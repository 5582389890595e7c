package iptables_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// refusedMatch parses in iptables and is refused by every kernel: a hash
// table garbage-collected every 0 ms is an invalid value for xt_hashlimit.
const refusedMatch = "-m hashlimit --hashlimit-upto 1/sec --hashlimit-name kpt-refused --hashlimit-htable-gcinterval 0"

// TestRealVariants runs what kproxy relies on in both iptables backends:
// which line a refused restore blames, that iptables-restore commits each
// table of its input in turn (a failure in the second table keeps the
// first one applied: a restore of several tables is not atomic), and
// ListRules.
func TestRealVariants(t *testing.T) {
	netnstest.RequireRoot(t)
	for _, variant := range []string{"nft", "legacy"} {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			ns := netnstest.New(t, "iptv")
			iface, err := iptables.New(t.Context(), iptables.Options{NetNS: ns.Name, Variant: variant})
			if err != nil {
				t.Fatal(err)
			}
			r := iface.(*iptables.Real)
			t.Cleanup(func() {
				if err := r.Close(); err != nil {
					t.Error(err)
				}
			})
			if r.Mode() != variant {
				t.Fatalf("Mode = %s, want %s", r.Mode(), variant)
			}
			ctx := t.Context()

			// The kernel refuses the filter table after nat was committed.
			input := strings.Join([]string{
				"*nat", ":KPT-NAT - [0:0]", "-A KPT-NAT -j RETURN", "COMMIT",
				"*filter", ":KPT-FILTER - [0:0]", "-A KPT-FILTER -j RETURN", "-A KPT-FILTER " + refusedMatch + " -j RETURN", "COMMIT", "",
			}, "\n")
			err = r.Restore(ctx, []byte(input))
			// iptables-nft-restore names the refused rule, iptables-legacy-restore
			// the COMMIT of its table (the kernel loads a table whole).
			wantLine := map[string]int{"nft": 8, "legacy": 9}[variant]
			if line, ok := iptables.FailedLine(err); !ok || line != wantLine {
				t.Errorf("Restore: %v; blamed line %d, %v, want %d", err, line, ok, wantLine)
			}
			rules, err := r.ListRules(ctx, iptables.TableNAT, "KPT-NAT")
			if err != nil || !slices.Equal(rules["KPT-NAT"], []string{"-j RETURN"}) {
				t.Errorf("nat after the failed filter table: %q, %v; want KPT-NAT committed", rules, err)
			}
			if ok, err := r.ChainExists(ctx, iptables.TableFilter, "KPT-FILTER"); ok || err != nil {
				t.Errorf("filter chain of the failed table exists: %v, %v", ok, err)
			}

			// ListRules reads the chains asked for, among many others.
			var b strings.Builder
			b.WriteString("*filter\n")
			for i := 0; i < 50; i++ {
				fmt.Fprintf(&b, ":KPT-%02d - [0:0]\n", i)
			}
			for i := 0; i < 50; i++ {
				fmt.Fprintf(&b, "-A KPT-%02d -s 10.0.0.%d/32 -j RETURN\n", i, i)
			}
			b.WriteString("-A INPUT -m comment --comment \"kpt hook\" -j KPT-00\nCOMMIT\n")
			if err := r.Restore(ctx, []byte(b.String())); err != nil {
				t.Fatal(err)
			}
			if _, err := r.EnsureChain(ctx, iptables.TableFilter, "KPT-EMPTY"); err != nil {
				t.Fatal(err)
			}
			got, err := r.ListRules(ctx, iptables.TableFilter, iptables.ChainInput, "KPT-03", "KPT-EMPTY", "KPT-MISSING", "KPT-41")
			if err != nil {
				t.Fatal(err)
			}
			want := map[iptables.Chain][]string{
				iptables.ChainInput: {`-m comment --comment "kpt hook" -j KPT-00`},
				"KPT-03":            {"-s 10.0.0.3/32 -j RETURN"},
				"KPT-EMPTY":         {},
				"KPT-41":            {"-s 10.0.0.41/32 -j RETURN"},
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("ListRules = %q, want %q", got, want)
			}
			if _, err := r.ListRules(ctx, "kptbogus", "X"); err == nil {
				t.Error("ListRules of an unknown table succeeded")
			}
		})
	}
}
