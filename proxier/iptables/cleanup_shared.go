package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
)

// IsKProxyChain reports whether chain belongs to kproxy, in either proxy
// mode: every chain kproxy creates starts with "KPROXY-".
func IsKProxyChain(chain string) bool { return isOwnedChain(chain) }

// CleanupChains removes, in the nat and filter tables, every chain for
// which owned is true together with every rule of another chain (a
// built-in chain's hook) that jumps or goes to one of them: one
// iptables-restore per table, so the table never holds a jump to a missing
// chain. Chains and rules of anyone else stay. Running it again changes
// nothing. Both proxy modes use it: --cleanup passes IsKProxyChain, and a
// mode starting up passes the other mode's chains to clear its leftovers.
func CleanupChains(ctx context.Context, iface ipt.Interface, owned func(chain string) bool) error {
	var errs []error
	for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
		data, err := iface.SaveInto(ctx, table)
		if err != nil {
			errs = append(errs, fmt.Errorf("saving %s: %w", table, err))
			continue
		}
		chains, jumps, err := ownedChainsAndJumps(data, owned)
		if err != nil {
			errs = append(errs, fmt.Errorf("reading %s: %w", table, err))
			continue
		}
		if len(chains) == 0 {
			continue
		}
		var buf bytes.Buffer
		fmt.Fprintf(&buf, "*%s\n", table)
		for _, c := range chains {
			fmt.Fprintf(&buf, ":%s - [0:0]\n", c)
		}
		for _, j := range jumps {
			fmt.Fprintf(&buf, "-D %s\n", j)
		}
		for _, c := range chains {
			fmt.Fprintf(&buf, "-X %s\n", c)
		}
		buf.WriteString("COMMIT\n")
		if err := iface.Restore(ctx, buf.Bytes()); err != nil {
			errs = append(errs, fmt.Errorf("deleting %d %s chains: %w", len(chains), table, err))
		}
	}
	return errors.Join(errs...)
}

// ownedChainsAndJumps reads iptables-save output: the owned chains, and
// the rules ("CHAIN args...") of other chains that jump or go to them.
func ownedChainsAndJumps(save []byte, owned func(string) bool) (chains, jumps []string, err error) {
	for _, line := range strings.Split(string(save), "\n") {
		line = strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			if owned(name) {
				chains = append(chains, name)
			}
		case strings.HasPrefix(line, "-A "):
			args, err := ipt.SplitArgs(line)
			if err != nil {
				return nil, nil, fmt.Errorf("parsing %q: %w", line, err)
			}
			if len(args) < 2 || owned(args[1]) {
				continue // flushed with its chain
			}
			for i := 2; i+1 < len(args); i++ {
				switch args[i] {
				case "-j", "--jump", "-g", "--goto":
					if owned(args[i+1]) {
						jumps = append(jumps, ipt.JoinArgs(args[1:]))
					}
				}
			}
		}
	}
	slices.Sort(chains)
	return slices.Compact(chains), jumps, nil
}
