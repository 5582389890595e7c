package iptables

import (
	"bytes"
	"context"
	"fmt"
)

// restoreError is a failed iptables-restore, with the input line it
// blamed (0 when none); see FailedLine.
type restoreError struct {
	msg  string
	line int
	err  error
}

func (e *restoreError) Error() string    { return e.msg + ": " + e.err.Error() }
func (e *restoreError) Unwrap() error    { return e.err }
func (e *restoreError) RestoreLine() int { return e.line }

// ListRules implements Interface. iptables-nft lists each chain on its
// own (`iptables -S CHAIN` reads only that chain from the kernel);
// iptables-legacy reads the whole table for any listing, so it reads it
// once, through iptables-save, and stops after the last chain asked for.
func (r *Real) ListRules(ctx context.Context, table Table, chains ...Chain) (map[Chain][]string, error) {
	if r.mode == "legacy" {
		return r.listRulesFromSave(ctx, table, chains)
	}
	out := make(map[Chain][]string, len(chains))
	for _, chain := range chains {
		prefix := []byte("-A " + string(chain) + " ")
		rules := []string{}
		args := append(append([]string{}, r.wait...), "-t", string(table), "-S", string(chain))
		err := r.scanLines(ctx, r.mainPath, args, func(line []byte) bool {
			if bytes.HasPrefix(line, prefix) {
				rules = append(rules, string(line[len(prefix):]))
			}
			return true
		})
		switch {
		case err == nil:
			out[chain] = rules
		case exitStatus(err) == 1:
			// A missing chain, as for ChainExists (iptables-nft 1.8.9
			// calls it "incompatible"; a lock timeout is status 4, a bad
			// parameter 2).
		default:
			return nil, fmt.Errorf("listing chain %s in table %s: %w", chain, table, err)
		}
	}
	return out, nil
}

// listRulesFromSave reads the chains' rules from iptables-save, which
// declares every chain first and then prints the rules chain by chain in
// the order of the declarations.
func (r *Real) listRulesFromSave(ctx context.Context, table Table, chains []Chain) (map[Chain][]string, error) {
	want := make(map[string]bool, len(chains))
	for _, c := range chains {
		want[string(c)] = true
	}
	out := make(map[Chain][]string, len(chains))
	order := map[string]int{}
	last := -1 // the declaration index of the last chain asked for
	err := r.scanLines(ctx, r.savePath, []string{"-t", string(table)}, func(line []byte) bool {
		switch {
		case bytes.HasPrefix(line, []byte(":")):
			name, _, _ := bytes.Cut(line[1:], []byte(" "))
			order[string(name)] = len(order)
			if want[string(name)] {
				out[Chain(name)] = []string{}
				last = len(order) - 1
			}
		case bytes.HasPrefix(line, []byte("-A ")):
			name, rule, _ := bytes.Cut(line[3:], []byte(" "))
			if want[string(name)] {
				out[Chain(name)] = append(out[Chain(name)], string(rule))
			} else if i, ok := order[string(name)]; ok && i > last {
				return false // past every chain asked for
			}
		case bytes.Equal(line, []byte("COMMIT")):
			return false
		}
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("listing rules in table %s: %w", table, err)
	}
	return out, nil
}
