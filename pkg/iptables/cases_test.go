package iptables_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/iptables"
)

// The cases in this file run against iptablestest.Fake (fake_test.go) and,
// as root, against Real inside a throwaway network namespace (real_test.go):
// the fake must behave as the kernel does. Rules are written the way
// iptables-save prints them (the kernel normalizes what it is given, the fake
// keeps it as it is), so that both dump the same tables afterwards.

// errAny accepts any error.
var errAny = errors.New("any error")

// family is what differs between the IPv4 and IPv6 runs.
type family struct {
	name     string
	protocol iptables.Protocol
	bin      string // the iptables binary
	src      string // a network for -s
	host     string // host addresses with their prefix length
	host2    string
	other    string // a host address of the other family
	mask     string // a destination with a non-contiguous mask
	dnat     string // a --to-destination value
	// otherDNAT is a --to-destination value of the other family.
	otherDNAT string
	// reject is the family's default --reject-with, otherReject a type only
	// the other family has.
	reject, otherReject string
}

var families = []family{
	{
		name: "IPv4", protocol: iptables.ProtocolIPv4, bin: "iptables",
		src: "10.0.0.0/8", host: "10.0.0.1/32", host2: "10.0.0.2/32", other: "fd00::1/128", mask: "0.0.0.5/0.0.0.255",
		dnat: "10.0.1.1:8080", otherDNAT: "[fd00::1]:8080", reject: "icmp-port-unreachable", otherReject: "icmp6-port-unreachable",
	},
	{
		name: "IPv6", protocol: iptables.ProtocolIPv6, bin: "ip6tables",
		src: "fd00::/8", host: "fd00::1/128", host2: "fd00::2/128", other: "10.0.0.1/32", mask: "::5/::ff",
		dnat: "[fd00::1]:8080", otherDNAT: "10.0.1.1:8080", reject: "icmp6-port-unreachable", otherReject: "icmp-port-unreachable",
	},
}

// step is one operation, the result it must report (when set) and the error
// it must return: nil, a sentinel matched with errors.Is, or errAny.
type step struct {
	name    string
	op      func(ctx context.Context, ipt iptables.Interface) (string, error)
	result  string
	wantErr error
	// errHas are substrings the error must contain.
	errHas []string
}

// is sets the result s must report.
func (s step) is(result string) step {
	s.result = result
	return s
}

// fails sets the error s must return, and substrings of it.
func (s step) fails(err error, has ...string) step {
	s.wantErr, s.errHas = err, has
	return s
}

// cancelled runs s with a cancelled context: it must fail with
// context.Canceled and change nothing.
func (s step) cancelled() step {
	op := s.op
	s.name += " with a cancelled context"
	s.op = func(ctx context.Context, ipt iptables.Interface) (string, error) {
		ctx, cancel := context.WithCancel(ctx)
		cancel()
		return op(ctx, ipt)
	}
	return s.fails(context.Canceled)
}

// ignoringError runs s and accepts any outcome (for operations where
// iptables backends differ); the tables afterwards are still compared.
func (s step) ignoringError() step {
	op := s.op
	s.name += " (outcome not compared)"
	s.op = func(ctx context.Context, ipt iptables.Interface) (string, error) {
		_, _ = op(ctx, ipt)
		return "", nil
	}
	return s
}

func existed(b bool) string {
	if b {
		return "existed"
	}
	return "created"
}

func ensureChain(table iptables.Table, chain iptables.Chain) step {
	return step{name: fmt.Sprintf("EnsureChain %s %s", table, chain), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		ok, err := ipt.EnsureChain(ctx, table, chain)
		return existed(ok), err
	}}
}

func chainExists(table iptables.Table, chain iptables.Chain) step {
	return step{name: fmt.Sprintf("ChainExists %s %s", table, chain), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		ok, err := ipt.ChainExists(ctx, table, chain)
		return fmt.Sprint(ok), err
	}}
}

func listChains(table iptables.Table) step {
	return step{name: fmt.Sprintf("ListChains %s", table), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		chains, err := ipt.ListChains(ctx, table)
		return strings.Join(chains, " "), err
	}}
}

func ensureRule(pos iptables.RulePosition, table iptables.Table, chain iptables.Chain, args ...string) step {
	return step{name: fmt.Sprintf("EnsureRule %s %s %s %q", pos, table, chain, args), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		ok, err := ipt.EnsureRule(ctx, pos, table, chain, args...)
		return existed(ok), err
	}}
}

func deleteRule(table iptables.Table, chain iptables.Chain, args ...string) step {
	return step{name: fmt.Sprintf("DeleteRule %s %s %q", table, chain, args), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		return "", ipt.DeleteRule(ctx, table, chain, args...)
	}}
}

func flushChain(table iptables.Table, chain iptables.Chain) step {
	return step{name: fmt.Sprintf("FlushChain %s %s", table, chain), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		return "", ipt.FlushChain(ctx, table, chain)
	}}
}

func deleteChain(table iptables.Table, chain iptables.Chain) step {
	return step{name: fmt.Sprintf("DeleteChain %s %s", table, chain), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		return "", ipt.DeleteChain(ctx, table, chain)
	}}
}

// listRules reports ListRules as "CHAIN: [rules]" or "CHAIN: missing" for
// each chain, in order.
func listRules(table iptables.Table, chains ...iptables.Chain) step {
	return step{name: fmt.Sprintf("ListRules %s %s", table, chains), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		rules, err := ipt.ListRules(ctx, table, chains...)
		var out []string
		for _, c := range chains {
			if r, ok := rules[c]; ok {
				out = append(out, fmt.Sprintf("%s: %q", c, r))
			} else {
				out = append(out, fmt.Sprintf("%s: missing", c))
			}
		}
		return strings.Join(out, "; "), err
	}}
}

// restore feeds lines, each ending in a newline, to Restore.
func restore(lines ...string) step {
	data := []byte(strings.Join(lines, "\n") + "\n")
	return step{name: fmt.Sprintf("Restore %q", lines), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		return "", ipt.Restore(ctx, data)
	}}
}

func saveInto(table iptables.Table) step {
	return step{name: fmt.Sprintf("SaveInto %s", table), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		_, err := ipt.SaveInto(ctx, table)
		return "", err
	}}
}

// resave restores what SaveInto printed for table.
func resave(table iptables.Table) step {
	return step{name: fmt.Sprintf("Restore of SaveInto %s", table), op: func(ctx context.Context, ipt iptables.Interface) (string, error) {
		data, err := ipt.SaveInto(ctx, table)
		if err != nil {
			return "", err
		}
		return "", ipt.Restore(ctx, data)
	}}
}

type interfaceCase struct {
	name  string
	steps []step
	// want is every table afterwards, as dumpTable prints it; a table not
	// listed must be empty.
	want map[iptables.Table][]string
}

const (
	filter = iptables.TableFilter
	nat    = iptables.TableNAT
	mangle = iptables.TableMangle
)

// tables are the tables compared after every case.
var tables = []iptables.Table{filter, mangle, nat}

func interfaceCases(f family) []interfaceCase {
	const chain iptables.Chain = "KPT-TEST"
	rule := []string{"-s", f.src, "-m", "comment", "--comment", "kpt test", "-j", "RETURN"}
	ruleLine := "-A KPT-TEST -s " + f.src + ` -m comment --comment "kpt test" -j RETURN`
	cases := []interfaceCase{
		{
			name: "absent chain: reported missing, removals are no-ops",
			steps: []step{
				chainExists(nat, chain).is("false"),
				deleteRule(nat, chain, rule...),
				deleteRule(nat, iptables.ChainPrerouting, "-j", string(chain)),
				flushChain(nat, chain),
				deleteChain(nat, chain),
			},
		},
		{
			name: "EnsureChain creates the chain once",
			steps: []step{
				ensureChain(nat, chain).is("created"),
				ensureChain(nat, chain).is("existed"),
				chainExists(nat, chain).is("true"),
				chainExists(filter, chain).is("false"),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -"}},
		},
		{
			name:  "EnsureChain of a built-in chain reports it existing",
			steps: []step{ensureChain(nat, iptables.ChainPrerouting).is("existed")},
		},
		{
			name: "built-in chain names of other tables are ordinary chain names",
			steps: []step{
				ensureChain(filter, iptables.ChainPrerouting).is("created"),
				ensureRule(iptables.Append, filter, iptables.ChainPrerouting, "-j", "RETURN"),
			},
			want: map[iptables.Table][]string{filter: {":PREROUTING -", "-A PREROUTING -j RETURN"}},
		},
		{
			name: "ListChains lists built-in chains, then user chains by name",
			steps: []step{
				ensureChain(nat, "KPT-B"),
				ensureChain(nat, "KPT-A"),
				ensureChain(nat, "KPT-10"),
				listChains(nat).is("PREROUTING INPUT OUTPUT POSTROUTING KPT-10 KPT-A KPT-B"),
				listChains(filter).is("INPUT FORWARD OUTPUT"),
				listChains(mangle).is("PREROUTING INPUT FORWARD OUTPUT POSTROUTING"),
			},
			want: map[iptables.Table][]string{nat: {":KPT-10 -", ":KPT-A -", ":KPT-B -"}},
		},
		{
			name: "invalid chain names are refused",
			steps: []step{
				ensureChain(nat, "").fails(errAny),
				ensureChain(nat, "KPT BAD").fails(errAny),
				ensureChain(nat, iptables.Chain("KPT-"+strings.Repeat("X", 25))).fails(errAny),
				ensureChain(nat, "MASQUERADE").fails(errAny),
				ensureChain(nat, "-KPT").fails(errAny),
			},
		},
		{
			name: "the longest chain name",
			steps: []step{
				ensureChain(nat, iptables.Chain("KPT-"+strings.Repeat("X", 24))).is("created"),
			},
			want: map[iptables.Table][]string{nat: {":KPT-" + strings.Repeat("X", 24) + " -"}},
		},
		{
			name: "unknown table",
			steps: []step{
				ensureChain("kptbogus", chain).fails(errAny),
				chainExists("kptbogus", chain).fails(errAny),
				listChains("kptbogus").fails(errAny),
				ensureRule(iptables.Append, "kptbogus", iptables.ChainOutput, "-j", "RETURN").fails(errAny),
				saveInto("kptbogus").fails(errAny),
				restore("*kptbogus", "COMMIT").fails(errAny),
			},
		},
		{
			name: "EnsureRule adds the rule once",
			steps: []step{
				ensureChain(nat, chain),
				ensureRule(iptables.Append, nat, chain, rule...).is("created"),
				ensureRule(iptables.Append, nat, chain, rule...).is("existed"),
				ensureRule(iptables.Prepend, nat, chain, rule...).is("existed"),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -", ruleLine}},
		},
		{
			name: "ListRules lists the chains asked for, in order; a missing chain has no entry",
			steps: []step{
				ensureChain(nat, chain),
				ensureChain(nat, "KPT-EMPTY"),
				listRules(nat, chain, "KPT-EMPTY", "KPT-MISSING").is("KPT-TEST: []; KPT-EMPTY: []; KPT-MISSING: missing"),
				ensureRule(iptables.Append, nat, chain, rule...),
				ensureRule(iptables.Append, nat, chain, "-p", "tcp", "-j", "RETURN"),
				ensureRule(iptables.Append, nat, iptables.ChainPostrouting, "-j", string(chain)),
				listRules(nat, iptables.ChainPostrouting, chain, "KPT-EMPTY").is(fmt.Sprintf(`POSTROUTING: ["-j KPT-TEST"]; KPT-TEST: %q; KPT-EMPTY: []`,
					[]string{ruleLine[len("-A KPT-TEST "):], "-p tcp -j RETURN"})),
				listRules(filter, chain).is("KPT-TEST: missing"),
				listRules("kptbogus", chain).fails(errAny),
				listRules(nat, chain).cancelled(),
			},
			want: map[iptables.Table][]string{nat: {":KPT-EMPTY -", ":KPT-TEST -", "-A POSTROUTING -j KPT-TEST", ruleLine, "-A KPT-TEST -p tcp -j RETURN"}},
		},
		{
			name: "Prepend puts the rule first, Append last",
			steps: []step{
				ensureChain(nat, chain),
				ensureRule(iptables.Append, nat, chain, rule...),
				ensureRule(iptables.Prepend, nat, chain, "-p", "udp", "-j", "RETURN").is("created"),
				ensureRule(iptables.Append, nat, chain, "-p", "tcp", "-j", "RETURN").is("created"),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -", "-A KPT-TEST -p udp -j RETURN", ruleLine, "-A KPT-TEST -p tcp -j RETURN"}},
		},
		{
			name: "EnsureRule refuses rules the kernel refuses",
			steps: []step{
				ensureChain(nat, chain),
				ensureRule(iptables.Append, nat, chain, "-p", "tcp", "--bogus").fails(errAny, `unknown option "--bogus"`),
				ensureRule(iptables.Append, nat, chain, "-m", "kptbogus", "-j", "RETURN").fails(errAny),
				ensureRule(iptables.Append, nat, chain, "-j", "KPT-MISSING").fails(errAny),
				ensureRule(iptables.Append, nat, chain, "-j", "DROP").fails(errAny),
				ensureRule(iptables.Append, nat, chain, "-s", f.other, "-j", "RETURN").fails(errAny),
				ensureRule(iptables.Append, nat, "KPT-MISSING", "-j", "RETURN").fails(errAny),
				ensureRule("-X", nat, chain, "-j", "RETURN").fails(errAny),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -"}},
		},
		{
			name: "DeleteRule removes the rule and is idempotent",
			steps: []step{
				ensureChain(nat, chain),
				ensureRule(iptables.Append, nat, chain, "-p", "udp", "-j", "RETURN"),
				ensureRule(iptables.Append, nat, chain, rule...),
				deleteRule(nat, chain, rule...),
				deleteRule(nat, chain, rule...),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -", "-A KPT-TEST -p udp -j RETURN"}},
		},
		{
			name: "DeleteRule of a jump to a missing chain is a no-op",
			steps: []step{
				deleteRule(nat, iptables.ChainPrerouting, "-j", "KPT-MISSING"),
			},
		},
		{
			name: "DeleteRule refuses rules the kernel refuses",
			steps: []step{
				ensureChain(nat, chain),
				deleteRule(nat, chain, "-p", "tcp", "--bogus").fails(errAny),
				deleteRule(nat, chain, "-m", "kptbogus", "-j", "RETURN").fails(errAny),
				deleteRule(nat, chain, "-s", f.other, "-j", "RETURN").fails(errAny),
				deleteRule(nat, "KPT-MISSING", "-p", "tcp", "--bogus").fails(errAny),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -"}},
		},
		{
			name: "DeleteChain of a referenced chain fails",
			steps: []step{
				ensureChain(nat, chain),
				ensureRule(iptables.Prepend, nat, iptables.ChainPrerouting, "-j", string(chain)),
				deleteChain(nat, chain).fails(errAny),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -", "-A PREROUTING -j KPT-TEST"}},
		},
		{
			name: "DeleteChain of a non-empty chain fails",
			steps: []step{
				ensureChain(nat, chain),
				ensureRule(iptables.Append, nat, chain, rule...),
				deleteChain(nat, chain).fails(errAny),
			},
			want: map[iptables.Table][]string{nat: {":KPT-TEST -", ruleLine}},
		},
		{
			name: "FlushChain and DeleteChain remove the chain and are idempotent",
			steps: []step{
				ensureChain(nat, chain),
				ensureRule(iptables.Append, nat, chain, rule...),
				flushChain(nat, chain),
				flushChain(nat, chain),
				chainExists(nat, chain).is("true"),
				deleteChain(nat, chain),
				deleteChain(nat, chain),
				chainExists(nat, chain).is("false"),
			},
		},
		{
			name: "FlushChain empties a built-in chain",
			steps: []step{
				ensureRule(iptables.Append, filter, iptables.ChainInput, "-s", f.host, "-j", "ACCEPT"),
				flushChain(filter, iptables.ChainInput),
			},
		},
		{
			// iptables-nft reports a built-in chain as missing, so Real
			// returns nil; iptables-legacy returns an error.
			name:  "DeleteChain leaves a built-in chain in place",
			steps: []step{deleteChain(nat, iptables.ChainOutput).ignoringError(), chainExists(nat, iptables.ChainOutput).is("true")},
		},
		{
			name: "a cancelled context fails every operation and changes nothing",
			steps: []step{
				ensureChain(nat, chain).cancelled(),
				chainExists(nat, chain).cancelled(),
				listChains(nat).cancelled(),
				ensureRule(iptables.Append, nat, iptables.ChainPostrouting, "-j", "RETURN").cancelled(),
				deleteRule(nat, iptables.ChainPostrouting, "-j", "RETURN").cancelled(),
				flushChain(nat, iptables.ChainPostrouting).cancelled(),
				deleteChain(nat, chain).cancelled(),
				restore("*nat", ":KPT-TEST - [0:0]", "COMMIT").cancelled(),
				saveInto(nat).cancelled(),
			},
		},
		{
			name: "MASQUERADE --random-fully",
			steps: []step{
				ensureRule(iptables.Append, nat, iptables.ChainPostrouting, "-s", f.src, "-j", "MASQUERADE", "--random-fully"),
			},
			want: map[iptables.Table][]string{nat: {"-A POSTROUTING -s " + f.src + " -j MASQUERADE --random-fully"}},
		},
		{
			name: "a non-contiguous mask survives SaveInto and Restore",
			steps: []step{
				restore("*nat", ":KPT-MASK - [0:0]", "-A KPT-MASK -d "+f.mask+" -j RETURN", "COMMIT"),
				resave(nat),
				ensureRule(iptables.Append, nat, "KPT-MASK", "-d", f.mask, "-j", "RETURN").is("existed"),
				flushChain(nat, "KPT-MASK"),
				ensureRule(iptables.Append, nat, "KPT-MASK", "-d", f.mask, "-j", "RETURN").is("created"),
			},
			want: map[iptables.Table][]string{nat: {":KPT-MASK -", "-A KPT-MASK -d " + f.mask + " -j RETURN"}},
		},
		{
			name: "comments are quoted as iptables-save quotes them and survive Restore",
			steps: []step{
				ensureChain(filter, chain),
				ensureRule(iptables.Append, filter, chain, "-m", "comment", "--comment", "kpt-word_1", "-j", "RETURN"),
				ensureRule(iptables.Append, filter, chain, "-m", "comment", "--comment", "ns/svc:http", "-j", "RETURN"),
				ensureRule(iptables.Append, filter, chain, "-m", "comment", "--comment", `say "hi" \o/ it's`, "-j", "RETURN"),
				resave(filter),
				ensureRule(iptables.Append, filter, chain, "-m", "comment", "--comment", `say "hi" \o/ it's`, "-j", "RETURN").is("existed"),
			},
			want: map[iptables.Table][]string{filter: {
				":KPT-TEST -",
				"-A KPT-TEST -m comment --comment kpt-word_1 -j RETURN",
				`-A KPT-TEST -m comment --comment "ns/svc:http" -j RETURN`,
				`-A KPT-TEST -m comment --comment "say \"hi\" \\o/ it\'s" -j RETURN`,
			}},
		},
		{
			name: "Restore applies every table, flushes declared chains and leaves the rest alone",
			steps: []step{
				ensureChain(nat, "FOREIGN"),
				ensureRule(iptables.Append, nat, "FOREIGN", "-s", f.src, "-j", "RETURN"),
				ensureChain(nat, "KPT-SVC"),
				ensureRule(iptables.Append, nat, "KPT-SVC", "-p", "udp", "-j", "RETURN"),
				ensureRule(iptables.Append, filter, iptables.ChainInput, "-p", "tcp", "-m", "tcp", "--dport", "22", "-j", "ACCEPT"),
				restore(
					"*nat",
					":KPT-SVC - [0:0]",
					":KPT-SEP - [0:0]",
					"-A KPT-SVC -p tcp -j KPT-SEP",
					"-A KPT-SEP -d "+f.mask+" -j RETURN",
					"COMMIT",
					"*filter",
					":KPT-FW - [0:0]",
					"-A KPT-FW -p tcp -m tcp --dport 80 -j REJECT --reject-with "+f.reject,
					"COMMIT",
				),
			},
			want: map[iptables.Table][]string{
				nat: {
					":FOREIGN -", ":KPT-SEP -", ":KPT-SVC -",
					"-A FOREIGN -s " + f.src + " -j RETURN",
					"-A KPT-SEP -d " + f.mask + " -j RETURN",
					"-A KPT-SVC -p tcp -j KPT-SEP",
				},
				filter: {
					":KPT-FW -",
					"-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT",
					"-A KPT-FW -p tcp -m tcp --dport 80 -j REJECT --reject-with " + f.reject,
				},
			},
		},
		{
			name: "Restore of empty input changes nothing",
			steps: []step{
				restore(""),
				restore("*nat", "COMMIT"),
			},
		},
		{
			name: "policies: set by a declaration or -P, kept by '-'",
			steps: []step{
				restore("*filter", ":FORWARD DROP [0:0]", "COMMIT"),
				restore("*filter", ":FORWARD - [0:0]", "COMMIT"),
				restore("*filter", "-P INPUT DROP", "COMMIT"),
				restore("*filter", ":INPUT ACCEPT [0:0]", "-P FORWARD DROP", "COMMIT"),
				restore("*mangle", "-P PREROUTING DROP", "COMMIT"),
			},
			want: map[iptables.Table][]string{filter: {":FORWARD DROP"}, mangle: {":PREROUTING DROP"}},
		},
		{
			name: "policies that do not exist are refused",
			steps: []step{
				restore("*filter", ":INPUT REJECT [0:0]", "COMMIT").fails(errAny),
				restore("*filter", "-P INPUT RETURN", "COMMIT").fails(errAny),
			},
		},
	}
	return append(cases, restoreCases(f)...)
}

// restoreCases start from the same filter table (setup) and feed it one
// input.
func restoreCases(f family) []interfaceCase {
	setup := restore(
		"*filter",
		":KUBE-A - [0:0]",
		":KUBE-B - [0:0]",
		"-A INPUT -j KUBE-A",
		"-A KUBE-A -s "+f.host+" -j ACCEPT",
		"-A KUBE-B -j DROP",
		"COMMIT",
	)
	setupFilter := []string{":KUBE-A -", ":KUBE-B -", "-A INPUT -j KUBE-A", "-A KUBE-A -s " + f.host + " -j ACCEPT", "-A KUBE-B -j DROP"}
	unchanged := map[iptables.Table][]string{filter: setupFilter}
	filterIs := func(lines ...string) map[iptables.Table][]string {
		return map[iptables.Table][]string{filter: lines}
	}
	// in wraps lines in a filter section.
	in := func(lines ...string) step {
		return restore(append(append([]string{"*filter"}, lines...), "COMMIT")...)
	}
	cases := []interfaceCase{
		{
			name:  "declaring an existing user chain flushes it",
			steps: []step{in(":KUBE-A - [0:0]", "-A KUBE-A -s "+f.host2+" -j ACCEPT")},
			want:  filterIs(":KUBE-A -", ":KUBE-B -", "-A INPUT -j KUBE-A", "-A KUBE-A -s "+f.host2+" -j ACCEPT", "-A KUBE-B -j DROP"),
		},
		{
			name:  "chains not declared are left alone",
			steps: []step{in("-A KUBE-B -j ACCEPT")},
			want:  filterIs(append(slices.Clone(setupFilter), "-A KUBE-B -j ACCEPT")...),
		},
		{
			name:  "declaring a built-in chain sets its policy without flushing it",
			steps: []step{in(":INPUT DROP [0:0]")},
			want:  filterIs(append([]string{":INPUT DROP"}, setupFilter...)...),
		},
		{
			name:  "flush and delete a chain",
			steps: []step{in(":KUBE-B - [0:0]", "-X KUBE-B")},
			want:  filterIs(":KUBE-A -", "-A INPUT -j KUBE-A", "-A KUBE-A -s "+f.host+" -j ACCEPT"),
		},
		{
			name:  "delete a chain after removing the jump to it",
			steps: []step{in("-D INPUT -j KUBE-A", ":KUBE-A - [0:0]", "-X KUBE-A")},
			want:  filterIs(":KUBE-B -", "-A KUBE-B -j DROP"),
		},
		{
			name:  "deleting a jump to a chain deleted before fails",
			steps: []step{in(":KUBE-A - [0:0]", "-X KUBE-A", "-D INPUT -j KUBE-A").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "delete a referenced chain fails",
			steps: []step{in(":KUBE-A - [0:0]", "-X KUBE-A").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "delete a non-empty chain fails",
			steps: []step{in("-X KUBE-B").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "delete a chain created and referenced in the same section fails",
			steps: []step{in(":KUBE-C - [0:0]", "-A KUBE-B -j KUBE-C", "-X KUBE-C").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "delete and re-create a chain in one section",
			steps: []step{in(":KUBE-B - [0:0]", "-X KUBE-B", ":KUBE-B - [0:0]", "-A KUBE-B -j RETURN")},
			want:  filterIs(":KUBE-A -", ":KUBE-B -", "-A INPUT -j KUBE-A", "-A KUBE-A -s "+f.host+" -j ACCEPT", "-A KUBE-B -j RETURN"),
		},
		{
			name:  "delete a built-in chain fails",
			steps: []step{in("-X INPUT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "delete a missing chain fails",
			steps: []step{in("-X KUBE-NOPE").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "flush and delete every user chain",
			steps: []step{in("-F", "-X")},
		},
		{
			name:  "jump to a missing chain fails",
			steps: []step{in("-A KUBE-B -j KUBE-NOPE").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "goto a chain declared later fails",
			steps: []step{in("-A KUBE-B -g KUBE-C", ":KUBE-C - [0:0]").fails(errAny)},
			want:  unchanged,
		},
		{
			name: "a bad line in the middle changes nothing",
			steps: []step{in(
				":KUBE-A - [0:0]",
				":KUBE-NEW - [0:0]",
				"-A KUBE-A -j DROP",
				"-A KUBE-NEW -p tcp --bogus",
				"-A KUBE-B -j ACCEPT",
			).fails(errAny, `line 5 "-A KUBE-NEW -p tcp --bogus"`, `unknown option "--bogus"`)},
			want: unchanged,
		},
		{
			name: "several tables in one input",
			steps: []step{restore(
				"# a comment",
				"*nat",
				":KUBE-SERVICES - [0:0]",
				"-A PREROUTING -j KUBE-SERVICES",
				"COMMIT",
				"*filter",
				":KUBE-A - [0:0]",
				"COMMIT",
				"*mangle",
				"-A PREROUTING -j MARK --set-xmark 0x1/0x1",
				"COMMIT",
			)},
			want: map[iptables.Table][]string{
				nat:    {":KUBE-SERVICES -", "-A PREROUTING -j KUBE-SERVICES"},
				filter: {":KUBE-A -", ":KUBE-B -", "-A INPUT -j KUBE-A", "-A KUBE-B -j DROP"},
				mangle: {"-A PREROUTING -j MARK --set-xmark 0x1/0x1"},
			},
		},
		{
			name: "a failing table keeps the tables committed before it",
			steps: []step{restore(
				"*nat",
				":KUBE-SERVICES - [0:0]",
				"COMMIT",
				"*filter",
				":KUBE-A - [0:0]",
				"-A KUBE-A -j KUBE-NOPE",
				"COMMIT",
			).fails(errAny)},
			want: map[iptables.Table][]string{nat: {":KUBE-SERVICES -"}, filter: setupFilter},
		},
		{
			name:  "a quoted comment is one argument",
			steps: []step{in(`-A KUBE-B -m comment --comment "ns/svc:p \"x\" cluster IP" -j ACCEPT`)},
			want:  filterIs(append(slices.Clone(setupFilter), `-A KUBE-B -m comment --comment "ns/svc:p \"x\" cluster IP" -j ACCEPT`)...),
		},
		{
			name:  "insert at positions, delete by arguments and by number",
			steps: []step{in("-I KUBE-B -j ACCEPT", "-I KUBE-B 2 -j RETURN", "-A KUBE-B -s "+f.host2, "-D KUBE-B -j DROP", "-D KUBE-B 1")},
			want:  filterIs(":KUBE-A -", ":KUBE-B -", "-A INPUT -j KUBE-A", "-A KUBE-A -s "+f.host+" -j ACCEPT", "-A KUBE-B -j RETURN", "-A KUBE-B -s "+f.host2),
		},
		{
			name:  "insert at the position after the last rule",
			steps: []step{in("-I KUBE-B 2 -j ACCEPT")},
			want:  filterIs(append(slices.Clone(setupFilter), "-A KUBE-B -j ACCEPT")...),
		},
		{
			name:  "insert beyond the end fails",
			steps: []step{in("-I KUBE-B 3 -j ACCEPT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "delete a missing rule fails",
			steps: []step{in("-D KUBE-B -j ACCEPT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "delete by a number beyond the end fails",
			steps: []step{in("-D KUBE-B 2").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "append to a missing chain fails",
			steps: []step{in("-A KUBE-NOPE -j ACCEPT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "flush a missing chain fails",
			steps: []step{in("-F KUBE-NOPE").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "-N of an existing chain fails",
			steps: []step{in("-N KUBE-A").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "-N creates a chain",
			steps: []step{in("-N KUBE-C", "-A KUBE-C -j RETURN")},
			want:  filterIs(":KUBE-A -", ":KUBE-B -", ":KUBE-C -", "-A INPUT -j KUBE-A", "-A KUBE-A -s "+f.host+" -j ACCEPT", "-A KUBE-B -j DROP", "-A KUBE-C -j RETURN"),
		},
		{
			name:  "missing COMMIT applies nothing",
			steps: []step{restore("*filter", "-A KUBE-B -j ACCEPT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "a rule outside a table fails",
			steps: []step{restore("-A INPUT -j ACCEPT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "a chain name too long fails",
			steps: []step{in(":KUBE-SVC-ABCDEFGHIJKLMNOPQRST - [0:0]").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "a declared chain may take a target's name",
			steps: []step{in(":MASQUERADE - [0:0]")},
			want:  filterIs(":KUBE-A -", ":KUBE-B -", ":MASQUERADE -", "-A INPUT -j KUBE-A", "-A KUBE-A -s "+f.host+" -j ACCEPT", "-A KUBE-B -j DROP"),
		},
		{
			name:  "-N of a chain named like a target fails",
			steps: []step{in("-N MASQUERADE").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "a jump to a built-in chain fails",
			steps: []step{in("-A KUBE-B -j INPUT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "DNAT outside the nat table fails",
			steps: []step{in("-A KUBE-B -p tcp -j DNAT --to-destination " + f.dnat).fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "DROP in the nat table fails",
			steps: []step{restore("*nat", "-A PREROUTING -j DROP", "COMMIT").fails(errAny, `line 2 "-A PREROUTING -j DROP"`)},
			want:  unchanged,
		},
		{
			name:  "DNAT reachable from POSTROUTING fails",
			steps: []step{restore("*nat", ":KUBE-X - [0:0]", "-A KUBE-X -p tcp -j DNAT --to-destination "+f.dnat, "-A POSTROUTING -j KUBE-X", "COMMIT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "MASQUERADE reachable from PREROUTING fails",
			steps: []step{restore("*nat", ":KUBE-X - [0:0]", "-A KUBE-X -j MASQUERADE", "-A PREROUTING -j KUBE-X", "COMMIT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "REJECT reachable from PREROUTING fails",
			steps: []step{restore("*mangle", ":KUBE-X - [0:0]", "-A KUBE-X -j REJECT --reject-with "+f.reject, "-A PREROUTING -j KUBE-X", "COMMIT").fails(errAny)},
			want:  unchanged,
		},
		{
			name: "unreachable chains may hold any nat target",
			steps: []step{
				restore("*nat", ":KUBE-X - [0:0]", "-A KUBE-X -j MASQUERADE", "-A KUBE-X -p tcp -j DNAT --to-destination "+f.dnat, "COMMIT"),
			},
			want: map[iptables.Table][]string{
				filter: setupFilter,
				nat:    {":KUBE-X -", "-A KUBE-X -j MASQUERADE", "-A KUBE-X -p tcp -j DNAT --to-destination " + f.dnat},
			},
		},
		{
			name:  "a jump loop reachable from a built-in chain fails",
			steps: []step{in(":L1 - [0:0]", ":L2 - [0:0]", "-A L1 -j L2", "-A L2 -j L1", "-A FORWARD -j L1").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "-i in OUTPUT fails",
			steps: []step{in("-A OUTPUT -i eth0 -j ACCEPT").fails(errAny, `line 2 "-A OUTPUT -i eth0 -j ACCEPT"`)},
			want:  unchanged,
		},
		{
			name:  "-t in restore input fails",
			steps: []step{in("-t nat -A INPUT -j ACCEPT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "an address of the other family fails",
			steps: []step{in("-A KUBE-B -s " + f.other + " -j ACCEPT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "a DNAT address of the other family fails",
			steps: []step{restore("*nat", "-A OUTPUT -p tcp -j DNAT --to-destination "+f.otherDNAT, "COMMIT").fails(errAny)},
			want:  unchanged,
		},
		{
			name:  "a reject type of the other family fails",
			steps: []step{in("-A INPUT -j REJECT --reject-with " + f.otherReject).fails(errAny)},
			want:  unchanged,
		},
		{
			// The kernel prints the family's default --reject-with, the
			// fake the rule as given: the chain is flushed before comparing.
			name:  "REJECT without a type",
			steps: []step{in("-A KUBE-B -j REJECT"), flushChain(filter, "KUBE-B")},
			want:  filterIs(":KUBE-A -", ":KUBE-B -", "-A INPUT -j KUBE-A", "-A KUBE-A -s "+f.host+" -j ACCEPT"),
		},
		{
			name:  "counters, blank lines and comments are accepted",
			steps: []step{restore("*filter", "", "[5:100] -A KUBE-B -j RETURN", "# a comment", "COMMIT")},
			want:  filterIs(append(slices.Clone(setupFilter), "-A KUBE-B -j RETURN")...),
		},
	}
	for i := range cases {
		cases[i].steps = append([]step{setup}, cases[i].steps...)
	}
	return append(cases, depthCases()...)
}

// depthCases nest user chains as deep as nf_tables allows, and one deeper.
func depthCases() []interfaceCase {
	const maxDepth = 15
	var cases []interfaceCase
	for _, depth := range []int{maxDepth, maxDepth + 1} {
		lines := []string{"*filter"}
		var decls, rules []string
		for i := 1; i <= depth; i++ {
			lines = append(lines, fmt.Sprintf(":C%02d - [0:0]", i))
			decls = append(decls, fmt.Sprintf(":C%02d -", i))
		}
		rules = append(rules, "-A INPUT -j C01")
		for i := 1; i < depth; i++ {
			rules = append(rules, fmt.Sprintf("-A C%02d -j C%02d", i, i+1))
		}
		lines = append(append(lines, rules...), "COMMIT")
		c := interfaceCase{name: fmt.Sprintf("chains nested %d deep", depth), steps: []step{restore(lines...)}}
		if depth <= maxDepth {
			c.want = map[iptables.Table][]string{filter: append(decls, rules...)}
		} else {
			c.steps[0] = c.steps[0].fails(errAny)
		}
		cases = append(cases, c)
	}
	return cases
}

// runCase runs c's steps against ipt and compares the tables afterwards.
func runCase(t *testing.T, ctx context.Context, ipt iptables.Interface, c interfaceCase) {
	t.Helper()
	for i, s := range c.steps {
		result, err := s.op(ctx, ipt)
		switch {
		case s.wantErr == nil && err != nil:
			t.Fatalf("step %d (%s): unexpected error: %v", i, s.name, err)
		case s.wantErr != nil && err == nil:
			t.Fatalf("step %d (%s): succeeded, want an error", i, s.name)
		case s.wantErr != nil && s.wantErr != errAny && !errors.Is(err, s.wantErr):
			t.Fatalf("step %d (%s): error %v, want one matching %v", i, s.name, err, s.wantErr)
		case err != nil:
			for _, has := range s.errHas {
				if !strings.Contains(err.Error(), has) {
					t.Errorf("step %d (%s): error %q does not contain %q", i, s.name, err, has)
				}
			}
		case s.result != "" && result != s.result:
			t.Errorf("step %d (%s) = %q, want %q", i, s.name, result, s.result)
		}
	}
	for _, table := range tables {
		if got := dumpTable(t, ctx, ipt, table); !slices.Equal(got, c.want[table]) {
			t.Errorf("table %s:\n%s\nwant:\n%s", table, strings.Join(got, "\n"), strings.Join(c.want[table], "\n"))
		}
	}
}

// dumpTable is SaveInto without comments, the table line, COMMIT, counters
// and the declarations of built-in chains with policy ACCEPT.
func dumpTable(t *testing.T, ctx context.Context, ipt iptables.Interface, table iptables.Table) []string {
	t.Helper()
	data, err := ipt.SaveInto(ctx, table)
	if err != nil {
		t.Fatalf("SaveInto %s: %v", table, err)
	}
	var out []string
	for line := range strings.Lines(string(data)) {
		line = strings.TrimRight(line, "\n")
		switch {
		case line == "" || line[0] == '#' || line[0] == '*' || line == "COMMIT":
			continue
		case line[0] == ':':
			fields := strings.Fields(line)
			if len(fields) < 2 || fields[1] == "ACCEPT" {
				continue
			}
			line = fields[0] + " " + fields[1]
		}
		out = append(out, line)
	}
	return out
}
