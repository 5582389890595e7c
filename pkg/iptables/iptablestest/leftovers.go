package iptablestest

import (
	"strings"

	"github.com/kproxy/kproxy/pkg/iptables"
)

// Leftovers lists what an owner whose chains are named with prefix has in
// the nat and filter tables of f: its chains ("table/chain") and the rules
// of other chains that mention one of them ("table/chain rule").
func Leftovers(f *Fake, prefix string) (chains, jumps []string) {
	for _, table := range []iptables.Table{iptables.TableNAT, iptables.TableFilter} {
		for _, c := range f.Chains(table) {
			if strings.HasPrefix(c, prefix) {
				chains = append(chains, string(table)+"/"+c)
				continue
			}
			for _, r := range f.Rules(table, iptables.Chain(c)) {
				if strings.Contains(r, prefix) {
					jumps = append(jumps, string(table)+"/"+c+" "+r)
				}
			}
		}
	}
	return chains, jumps
}
