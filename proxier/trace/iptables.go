package trace

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"strings"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/proxier/cleanup"
	"github.com/kproxy/kproxy/proxier/ipvs/ipvstest"
)

// This file reads iptables mode's rules from iptables-save output into an
// iptablestest.Fake, which the iptables tracer walks.

// builtinChains are the chains of the nat and filter tables that netfilter
// hooks call.
var builtinChains = map[string]bool{"PREROUTING": true, "INPUT": true, "FORWARD": true, "OUTPUT": true, "POSTROUTING": true}

// iptablesState is what iptables-save shows of kproxy on one family.
type iptablesState struct {
	// fake holds kproxy's chains and the hook rules that jump to them.
	fake *iptablestest.Fake
	// iptablesMode and ipvsMode: chains of either mode exist.
	iptablesMode, ipvsMode bool
	// foreign counts the rules of others left out.
	foreign int
	// saved is the text per table, for errors.
	saved map[ipt.Table]string
}

// readIPTables saves the nat and filter tables of i and keeps kproxy's
// iptables-mode part.
func readIPTables(ctx context.Context, i ipt.Interface) (*iptablesState, error) {
	st := &iptablesState{fake: iptablestest.NewFake(i.Protocol()), saved: map[ipt.Table]string{}}
	var kept bytes.Buffer
	for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
		out, err := i.SaveInto(ctx, table)
		if err != nil {
			return nil, fmt.Errorf("%s-save -t %s: %w", i.Protocol(), table, err)
		}
		st.saved[table] = string(out)
		st.filter(&kept, table, out, cleanup.IsIPTablesChain)
	}
	if err := st.fake.Restore(ctx, kept.Bytes()); err != nil {
		return nil, fmt.Errorf("reading kproxy's %s rules: %w", i.Protocol(), err)
	}
	return st, nil
}

// readIPVSIPTables keeps kproxy's IPVS-mode part of the nat, filter and
// mangle tables of i (nat and filter as readIPTables saved them).
func readIPVSIPTables(ctx context.Context, i ipt.Interface, saved map[ipt.Table]string) (*iptablesState, error) {
	st := &iptablesState{fake: iptablestest.NewFake(i.Protocol()), saved: map[ipt.Table]string{}}
	var kept bytes.Buffer
	for _, table := range ipvstest.Tables {
		out, ok := saved[table]
		if !ok {
			b, err := i.SaveInto(ctx, table)
			if err != nil {
				return nil, fmt.Errorf("%s-save -t %s: %w", i.Protocol(), table, err)
			}
			out = string(b)
		}
		st.saved[table] = out
		st.filter(&kept, table, []byte(out), cleanup.IsIPVSChain)
	}
	if err := st.fake.Restore(ctx, kept.Bytes()); err != nil {
		return nil, fmt.Errorf("reading kproxy's %s rules of IPVS mode: %w", i.Protocol(), err)
	}
	return st, nil
}

// filter copies the section of table from saved into out, keeping only
// kproxy's chains of one mode (those keep accepts) and the rules of the
// built-in chains that jump to them; built-in chains get the policy ACCEPT
// (their real policy belongs to others' rules, which are left out).
func (st *iptablesState) filter(out *bytes.Buffer, table ipt.Table, saved []byte, keep func(chain string) bool) {
	fmt.Fprintf(out, "*%s\n", table)
	sc := bufio.NewScanner(bytes.NewReader(saved))
	sc.Buffer(make([]byte, 1<<20), 1<<26)
	inTable := false
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || line[0] == '#':
		case line[0] == '*':
			inTable = line[1:] == string(table)
		case !inTable || line == "COMMIT":
		case line[0] == ':':
			name := strings.Fields(line[1:])[0]
			switch {
			case builtinChains[name]:
				fmt.Fprintf(out, ":%s ACCEPT [0:0]\n", name)
			default:
				st.ipvsMode = st.ipvsMode || cleanup.IsIPVSChain(name)
				st.iptablesMode = st.iptablesMode || cleanup.IsIPTablesChain(name)
				if keep(name) {
					fmt.Fprintf(out, ":%s - [0:0]\n", name)
				}
			}
		case strings.HasPrefix(line, "-A "):
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			chain := f[1]
			switch {
			case keep(chain):
				out.WriteString(line + "\n")
			case builtinChains[chain] && jumpsTo(f, keep):
				out.WriteString(line + "\n")
			default:
				st.foreign++
			}
		}
	}
	out.WriteString("COMMIT\n")
}

// jumpsTo reports whether the rule's target is a chain keep accepts.
func jumpsTo(fields []string, keep func(chain string) bool) bool {
	for i := 0; i+1 < len(fields); i++ {
		if (fields[i] == "-j" || fields[i] == "-g" || fields[i] == "--jump" || fields[i] == "--goto") && keep(fields[i+1]) {
			return true
		}
	}
	return false
}
