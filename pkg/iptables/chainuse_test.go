package iptables_test

import (
	"context"
	"maps"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

func TestJumpTarget(t *testing.T) {
	for _, tc := range []struct {
		name, rule, want string
	}{
		{"jump", `-m comment --comment "a -j B" -d 10.0.0.1/32 -j KPROXY-SVC-X`, "KPROXY-SVC-X"},
		{"goto", `-g KPROXY-X`, "KPROXY-X"},
		{"long flag", `-p tcp --jump KPROXY-X`, "KPROXY-X"},
		{"verdict", `-j RETURN`, "RETURN"},
		{"target with options", `-p tcp -j DNAT --to-destination 10.0.0.1:80`, ""},
		{"comment last", `-j X -m comment --comment "-j Y"`, ""},
		{"no target", `-p tcp`, ""},
		{"empty", ``, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := iptables.JumpTarget(tc.rule); got != tc.want {
				t.Errorf("JumpTarget(%q) = %q, want %q", tc.rule, got, tc.want)
			}
		})
	}
}

// chainUseInput is a nat table with a hook, chains jumping to each other
// (one twice, one by goto), an empty chain and a chain nothing uses.
const chainUseInput = `*nat
:KPT-A - [0:0]
:KPT-B - [0:0]
:KPT-C - [0:0]
:KPT-EMPTY - [0:0]
-A PREROUTING -m comment --comment "kpt hook" -j KPT-A
-A KPT-A -d 10.0.0.1/32 -j KPT-B
-A KPT-A -d 10.0.0.2/32 -j KPT-B
-A KPT-A -d 10.0.0.3/32 -g KPT-C
-A KPT-A -j RETURN
-A KPT-B -p tcp -j DNAT --to-destination 10.1.0.1:80
-A KPT-C -j MARK --or-mark 0x4000
-A KPT-C -j KPT-EMPTY
COMMIT
`

// chainUseWant is ChainUse of chainUseInput's chains.
var chainUseWant = map[string]int{"PREROUTING": 1, "KPT-A": 4 + 1, "KPT-B": 1 + 2, "KPT-C": 2 + 1, "KPT-EMPTY": 0 + 1}

// subset returns got's entries for the keys of want.
func subset(got, want map[string]int) map[string]int {
	out := map[string]int{}
	for k := range want {
		if v, ok := got[k]; ok {
			out[k] = v
		}
	}
	return out
}

// withoutUnusedBuiltins returns use without the built-in chains of count
// 0, which iptables-nft creates only when first used.
func withoutUnusedBuiltins(use map[string]int) map[string]int {
	out := maps.Clone(use)
	maps.DeleteFunc(out, func(name string, n int) bool {
		return n == 0 && strings.ToUpper(name) == name && !strings.Contains(name, "-")
	})
	return out
}

// TestChainUse checks the use counts of the fake, of iptables-save output
// and of both real backends (iptables-nft reads the kernel's), after a
// restore, after a chain is flushed and after a rule is deleted.
func TestChainUse(t *testing.T) {
	steps := []struct {
		name string
		op   func(ctx context.Context, i iptables.Interface) error
		want map[string]int
	}{
		{"restored", func(ctx context.Context, i iptables.Interface) error {
			input := chainUseInput
			if i.Protocol() == iptables.ProtocolIPv6 {
				input = strings.NewReplacer("10.0.0.", "fd00::", "/32", "/128", "10.1.0.1:80", "[fd00:1::1]:80").Replace(input)
			}
			return i.Restore(ctx, []byte(input))
		}, chainUseWant},
		{"KPT-A flushed", func(ctx context.Context, i iptables.Interface) error {
			return i.FlushChain(ctx, iptables.TableNAT, "KPT-A")
		},
			map[string]int{"PREROUTING": 1, "KPT-A": 1, "KPT-B": 1, "KPT-C": 2, "KPT-EMPTY": 1}},
		{"rule of KPT-C deleted", func(ctx context.Context, i iptables.Interface) error {
			return i.DeleteRule(ctx, iptables.TableNAT, "KPT-C", "-j", "KPT-EMPTY")
		}, map[string]int{"PREROUTING": 1, "KPT-A": 1, "KPT-B": 1, "KPT-C": 1, "KPT-EMPTY": 0}},
	}
	run := func(t *testing.T, iface iptables.Interface) {
		ctx := t.Context()
		for _, st := range steps {
			if err := st.op(ctx, iface); err != nil {
				t.Fatalf("%s: %v", st.name, err)
			}
			got, err := iface.ChainUse(ctx, iptables.TableNAT)
			if err != nil {
				t.Fatalf("%s: ChainUse: %v", st.name, err)
			}
			if !maps.Equal(subset(got, st.want), st.want) {
				t.Errorf("%s: ChainUse = %v, want %v", st.name, subset(got, st.want), st.want)
			}
			save, err := iface.SaveInto(ctx, iptables.TableNAT)
			if err != nil {
				t.Fatal(err)
			}
			if fromSave := iptables.ChainUseFromSave(save); !maps.Equal(withoutUnusedBuiltins(fromSave), withoutUnusedBuiltins(got)) {
				t.Errorf("%s: ChainUse = %v, from iptables-save %v", st.name, got, fromSave)
			}
		}
		if got, err := iface.ChainUse(ctx, iptables.TableFilter); err != nil || len(withoutUnusedBuiltins(got)) != 0 {
			t.Errorf("ChainUse(filter) = %v, %v; want the empty built-in chains", got, err)
		}
	}
	t.Run("fake", func(t *testing.T) { run(t, iptablestest.NewFake(iptables.ProtocolIPv4)) })
	for _, variant := range []string{"nft", "legacy"} {
		for _, proto := range []iptables.Protocol{iptables.ProtocolIPv4, iptables.ProtocolIPv6} {
			t.Run(variant+"/"+string(proto), func(t *testing.T) {
				netnstest.RequireRoot(t)
				t.Parallel()
				ns := netnstest.New(t, "iptu")
				iface, err := iptables.New(t.Context(), iptables.Options{NetNS: ns.Name, Variant: variant, Protocol: proto})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() {
					if err := iface.(*iptables.Real).Close(); err != nil {
						t.Error(err)
					}
				})
				run(t, iface)
			})
		}
	}
}
