package iptablestest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/kproxy/kproxy/pkg/iptables"
)

// Fake is an in-memory iptables: a state store that parses and executes
// restore input and the other Interface operations with the kernel's rules
// (atomic tables, --noflush semantics, jumps only to existing chains, no
// deleting referenced chains, target/hook restrictions, no jump loops). Rules
// are validated with ParseRule, so output kproxy could not load into the
// kernel fails here too. Trace walks the resulting ruleset.
//
// Rules are stored exactly as given (iptables-save would print a normalized
// form; the fake does not), and EnsureRule and -D compare arguments exactly.
type Fake struct {
	// RandomFully is what HasRandomFully reports; when false, MASQUERADE
	// --random-fully is rejected as an old iptables would. NewFake sets it
	// to true. Set it before the Fake is shared.
	RandomFully bool

	protocol iptables.Protocol

	mu           sync.Mutex
	tables       map[iptables.Table]*fakeTable
	restoreCount int
	lastRestore  []byte
	// refuse and refuseAtCommit: see SetRefusal.
	refuse         func(table iptables.Table, chain iptables.Chain, args []string) error
	refuseAtCommit bool
}

var _ iptables.Interface = (*Fake)(nil)

type fakeTable struct {
	name   iptables.Table
	chains map[iptables.Chain]*fakeChain
}

type fakeChain struct {
	name    iptables.Chain
	builtin bool
	policy  string // "ACCEPT" or "DROP" for builtin chains
	rules   []*fakeRule
}

type fakeRule struct {
	args []string
	rule *Rule
}

// builtinChains lists each table's built-in chains in iptables-save order.
var builtinChains = map[iptables.Table][]iptables.Chain{
	iptables.TableNAT:    {iptables.ChainPrerouting, iptables.ChainInput, iptables.ChainOutput, iptables.ChainPostrouting},
	iptables.TableFilter: {iptables.ChainInput, iptables.ChainForward, iptables.ChainOutput},
	iptables.TableMangle: {iptables.ChainPrerouting, iptables.ChainInput, iptables.ChainForward, iptables.ChainOutput, iptables.ChainPostrouting},
}

// maxChainDepth is the deepest a chain may sit below a built-in chain, in
// jumps: nf_tables refuses rulesets nesting deeper (iptables-legacy allows
// more; kproxy must work with both).
const maxChainDepth = 15

// NewFake returns an empty Fake for protocol: every table with its built-in
// chains, policy ACCEPT.
func NewFake(protocol iptables.Protocol) *Fake {
	f := &Fake{RandomFully: true, protocol: protocol, tables: map[iptables.Table]*fakeTable{}}
	for table, chains := range builtinChains {
		t := &fakeTable{name: table, chains: map[iptables.Chain]*fakeChain{}}
		for _, c := range chains {
			t.chains[c] = &fakeChain{name: c, builtin: true, policy: "ACCEPT"}
		}
		f.tables[table] = t
	}
	return f
}

// chainNames lists built-in chains first (iptables-save order), then user
// chains sorted by name.
func (t *fakeTable) chainNames() []iptables.Chain {
	names := slices.Clone(builtinChains[t.name])
	var user []iptables.Chain
	for name, c := range t.chains {
		if !c.builtin {
			user = append(user, name)
		}
	}
	slices.Sort(user)
	return append(names, user...)
}

// table looks table up for an operation under ctx: like the real
// implementation, every operation fails once ctx is done.
func (f *Fake) table(ctx context.Context, table iptables.Table) (*fakeTable, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	t, ok := f.tables[table]
	if !ok {
		return nil, fmt.Errorf("unknown table %q", table)
	}
	return t, nil
}

// Protocol implements Interface.
func (f *Fake) Protocol() iptables.Protocol { return f.protocol }

// HasRandomFully implements Interface.
func (f *Fake) HasRandomFully() bool { return f.RandomFully }

// EnsureChain implements Interface.
func (f *Fake) EnsureChain(ctx context.Context, table iptables.Table, chain iptables.Chain) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return false, err
	}
	if _, ok := t.chains[chain]; ok {
		return true, nil
	}
	if err := validNewChainName(chain); err != nil {
		return false, err
	}
	t.chains[chain] = &fakeChain{name: chain}
	return false, nil
}

// ChainExists implements Interface.
func (f *Fake) ChainExists(ctx context.Context, table iptables.Table, chain iptables.Chain) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return false, err
	}
	_, ok := t.chains[chain]
	return ok, nil
}

// ListChains implements Interface: built-in chains first, then user chains
// sorted by name.
func (f *Fake) ListChains(ctx context.Context, table iptables.Table) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, c := range t.chainNames() {
		out = append(out, string(c))
	}
	return out, nil
}

// EnsureRule implements Interface. The rule is validated as Restore would.
func (f *Fake) EnsureRule(ctx context.Context, position iptables.RulePosition, table iptables.Table, chain iptables.Chain, args ...string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return false, err
	}
	c, ok := t.chains[chain]
	if !ok {
		return false, fmt.Errorf("chain %s does not exist in table %s", chain, table)
	}
	for _, r := range c.rules {
		if slices.Equal(r.args, args) {
			return true, nil
		}
	}
	at := -1
	switch position {
	case iptables.Prepend:
		at = 0
	case iptables.Append:
	default:
		return false, fmt.Errorf("unknown rule position %q", position)
	}
	tx := f.begin(t)
	if err := tx.insertRule(chain, at, args, 0); err != nil {
		return false, fmt.Errorf("adding rule to %s/%s: %w", table, chain, err)
	}
	if err := tx.commit(); err != nil {
		return false, fmt.Errorf("adding rule to %s/%s: %w", table, chain, err)
	}
	return false, nil
}

// DeleteRule implements Interface. Like iptables it parses the rule first,
// so a rule iptables cannot parse is an error even when it is absent.
func (f *Fake) DeleteRule(ctx context.Context, table iptables.Table, chain iptables.Chain, args ...string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return err
	}
	// iptables parses the rule before it looks for it.
	if _, err := f.parseRule(args); err != nil {
		return fmt.Errorf("deleting rule from %s/%s: %w", table, chain, err)
	}
	c, ok := t.chains[chain]
	if !ok {
		return nil
	}
	if i := slices.IndexFunc(c.rules, func(r *fakeRule) bool { return slices.Equal(r.args, args) }); i >= 0 {
		c.rules = slices.Delete(c.rules, i, i+1)
	}
	return nil
}

// FlushChain implements Interface.
func (f *Fake) FlushChain(ctx context.Context, table iptables.Table, chain iptables.Chain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return err
	}
	if c, ok := t.chains[chain]; ok {
		c.rules = nil
	}
	return nil
}

// DeleteChain implements Interface: like iptables -X it refuses built-in,
// non-empty and referenced chains.
func (f *Fake) DeleteChain(ctx context.Context, table iptables.Table, chain iptables.Chain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return err
	}
	if _, ok := t.chains[chain]; !ok {
		return nil
	}
	tx := f.begin(t)
	if err := tx.deleteChain(chain, 0); err != nil {
		return fmt.Errorf("deleting chain %s/%s: %w", table, chain, err)
	}
	if err := tx.commit(); err != nil {
		return fmt.Errorf("deleting chain %s/%s: %w", table, chain, err)
	}
	return nil
}

// SaveInto implements Interface. The output restores into an empty Fake
// (or kernel) to the same state.
func (f *Fake) SaveInto(ctx context.Context, table iptables.Table) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Generated by kproxy fake iptables (%s)\n*%s\n", f.protocol, table)
	names := t.chainNames()
	for _, name := range names {
		c := t.chains[name]
		policy := "-"
		if c.builtin {
			policy = c.policy
		}
		fmt.Fprintf(&b, ":%s %s [0:0]\n", name, policy)
	}
	for _, name := range names {
		for _, r := range t.chains[name].rules {
			fmt.Fprintf(&b, "-A %s", name)
			if len(r.args) > 0 {
				b.WriteByte(' ')
				b.WriteString(saveArgs(r.args))
			}
			b.WriteByte('\n')
		}
	}
	b.WriteString("COMMIT\n# Completed\n")
	return b.Bytes(), nil
}

// saveArgs renders a rule's arguments as iptables-save prints them: the
// text of --comment and --log-prefix is quoted unless it is a plain word
// (letters, digits, '-' and '_'), with `"`, `\` and `'` escaped; other
// arguments as iptables.QuoteArg renders them. Both read back the same with
// iptables.SplitArgs.
func saveArgs(args []string) string {
	out := make([]string, len(args))
	for i, a := range args {
		if i > 0 && (args[i-1] == "--comment" || args[i-1] == "--log-prefix") {
			out[i] = saveString(a)
		} else {
			out[i] = iptables.QuoteArg(a)
		}
	}
	return strings.Join(out, " ")
}

func saveString(s string) string {
	plain := s != ""
	for i := 0; i < len(s) && plain; i++ {
		c := s[i]
		plain = c == '-' || c == '_' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
	}
	if plain {
		return s
	}
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == '"' || c == '\\' || c == '\'' {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	b.WriteByte('"')
	return b.String()
}

// ListRules implements Interface.
func (f *Fake) ListRules(ctx context.Context, table iptables.Table, chains ...iptables.Chain) (map[iptables.Chain][]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return nil, err
	}
	out := make(map[iptables.Chain][]string, len(chains))
	for _, name := range chains {
		c, ok := t.chains[name]
		if !ok {
			continue
		}
		rules := make([]string, 0, len(c.rules))
		for _, r := range c.rules {
			rules = append(rules, iptables.JoinArgs(r.args))
		}
		out[name] = rules
	}
	return out, nil
}

// ChainUse implements Interface: each chain's rules plus the rules of the
// table that jump or go to it, as nf_tables counts them.
func (f *Fake) ChainUse(ctx context.Context, table iptables.Table) (map[string]int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, err := f.table(ctx, table)
	if err != nil {
		return nil, err
	}
	out := make(map[string]int, len(t.chains))
	for name, c := range t.chains {
		out[string(name)] += len(c.rules)
		for _, r := range c.rules {
			if tg := r.rule.Target; tg != nil && tg.Chain {
				if _, ok := t.chains[iptables.Chain(tg.Name)]; ok {
					out[tg.Name]++
				}
			}
		}
	}
	return out, nil
}

// SetRefusal makes the fake refuse, as a kernel refuses a rule it cannot
// load (a match module it lacks, a value it rejects), every rule added by
// Restore or EnsureRule for which refuse returns an error: the rule's table
// is not changed. Restore blames the rule's own line, as
// iptables-nft-restore does, or with atCommit the COMMIT line of its
// table, as iptables-legacy-restore does (the kernel loads a table whole).
// A nil refuse refuses nothing; refuse runs with the Fake locked and must
// not call it.
func (f *Fake) SetRefusal(refuse func(table iptables.Table, chain iptables.Chain, args []string) error, atCommit bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse, f.refuseAtCommit = refuse, atCommit
}

// Chains lists table's chains (built-in first, then user chains sorted); nil
// for an unknown table.
func (f *Fake) Chains(table iptables.Table) []string {
	chains, _ := f.ListChains(context.Background(), table)
	return chains
}

// Rules lists the rules of table/chain, each as its arguments joined as in
// iptables-save (without "-A chain"); nil when the chain does not exist.
func (f *Fake) Rules(table iptables.Table, chain iptables.Chain) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	t, ok := f.tables[table]
	if !ok {
		return nil
	}
	c, ok := t.chains[chain]
	if !ok {
		return nil
	}
	out := make([]string, 0, len(c.rules))
	for _, r := range c.rules {
		out = append(out, iptables.JoinArgs(r.args))
	}
	return out
}

// Policy reports a built-in chain's policy ("" when not a built-in chain).
func (f *Fake) Policy(table iptables.Table, chain iptables.Chain) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if t, ok := f.tables[table]; ok {
		if c, ok := t.chains[chain]; ok && c.builtin {
			return c.policy
		}
	}
	return ""
}

// RestoreCount is how many times Restore was called (failed calls included).
func (f *Fake) RestoreCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.restoreCount
}

// LastRestore is the data of the last Restore call (failed calls included).
func (f *Fake) LastRestore() []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return bytes.Clone(f.lastRestore)
}

// RestoreError is Restore's error: the line (1-based) and its text.
type RestoreError struct {
	Line int
	Text string
	Err  error
}

func (e *RestoreError) Error() string {
	return fmt.Sprintf("iptables-restore: line %d %q: %v", e.Line, e.Text, e.Err)
}

func (e *RestoreError) Unwrap() error { return e.Err }

// RestoreLine is the line blamed (see iptables.FailedLine).
func (e *RestoreError) RestoreLine() int { return e.Line }

// Restore implements Interface with iptables-restore --noflush semantics.
// Each "*table ... COMMIT" section is applied atomically when its COMMIT is
// reached: on error nothing of that section changes, while sections
// committed earlier in data stay applied (as with the kernel).
func (f *Fake) Restore(ctx context.Context, data []byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.restoreCount++
	f.lastRestore = bytes.Clone(data)

	lines := strings.Split(string(data), "\n")
	var (
		tx        *txn
		startLine int
	)
	lineErr := func(n int, err error) error {
		return &RestoreError{Line: n, Text: strings.TrimRight(lines[n-1], "\r"), Err: err}
	}
	for i, raw := range lines {
		n := i + 1
		line := strings.Trim(raw, " \t\r\v\f")
		if line == "" || line[0] == '#' {
			continue
		}
		switch {
		case line[0] == '*':
			if tx != nil {
				return lineErr(n, fmt.Errorf("table %s (line %d) has no COMMIT", tx.t.name, startLine))
			}
			t, err := f.table(ctx, iptables.Table(line[1:]))
			if err != nil {
				return lineErr(n, err)
			}
			tx, startLine = f.begin(t), n
		case line == "COMMIT":
			if tx == nil {
				return lineErr(n, fmt.Errorf("COMMIT outside a table"))
			}
			if tx.refused != nil {
				return lineErr(n, tx.refused)
			}
			if err := tx.commit(); err != nil {
				var le *RestoreError
				if errors.As(err, &le) {
					le.Text = strings.TrimRight(lines[le.Line-1], "\r")
					return le
				}
				return lineErr(n, err)
			}
			tx = nil
		case tx == nil:
			return lineErr(n, fmt.Errorf("line outside a table section"))
		case line[0] == ':':
			if err := tx.declare(line[1:]); err != nil {
				return lineErr(n, err)
			}
		default:
			if err := tx.command(line, n); err != nil {
				return lineErr(n, err)
			}
		}
	}
	if tx != nil {
		return lineErr(len(lines), fmt.Errorf("table %s (line %d) has no COMMIT", tx.t.name, startLine))
	}
	return nil
}

// txn is one table's pending changes, kept as a copy-on-write overlay on
// the committed table and applied by commit.
type txn struct {
	f *Fake
	t *fakeTable
	// overlay holds chains created or modified in this transaction.
	overlay map[iptables.Chain]*fakeChain
	// removed holds chains deleted in this transaction (never also in
	// overlay), with the line of the -X (0 outside Restore).
	removed map[iptables.Chain]int
	// lines records where rules added in this transaction came from.
	lines map[*fakeRule]int
	// graphChanged is set when a change may break the graph invariants
	// validate checks (removing rules or flushing never does).
	graphChanged bool
	// refused is the first refusal (SetRefusal) to report at COMMIT.
	refused error
}

func (f *Fake) begin(t *fakeTable) *txn {
	return &txn{f: f, t: t, overlay: map[iptables.Chain]*fakeChain{}, removed: map[iptables.Chain]int{}, lines: map[*fakeRule]int{}}
}

// chain returns the transaction's view of a chain, nil when absent.
func (tx *txn) chain(name iptables.Chain) *fakeChain {
	if _, ok := tx.removed[name]; ok {
		return nil
	}
	if c, ok := tx.overlay[name]; ok {
		return c
	}
	return tx.t.chains[name]
}

// writable returns a chain the transaction may modify, nil when absent.
func (tx *txn) writable(name iptables.Chain) *fakeChain {
	if c, ok := tx.overlay[name]; ok {
		return c
	}
	c := tx.chain(name)
	if c == nil {
		return nil
	}
	cc := *c
	cc.rules = slices.Clone(c.rules)
	tx.overlay[name] = &cc
	return &cc
}

func (tx *txn) create(name iptables.Chain) {
	delete(tx.removed, name)
	tx.overlay[name] = &fakeChain{name: name}
}

// chains lists the transaction's view of all chains, in no particular order.
func (tx *txn) chains() []*fakeChain {
	out := make([]*fakeChain, 0, len(tx.t.chains)+len(tx.overlay))
	for name, c := range tx.t.chains {
		if _, ok := tx.overlay[name]; ok {
			continue
		}
		if _, ok := tx.removed[name]; ok {
			continue
		}
		out = append(out, c)
	}
	for _, c := range tx.overlay {
		out = append(out, c)
	}
	return out
}

// sortedChains is chains in iptables-save order.
func (tx *txn) sortedChains() []*fakeChain {
	out := tx.chains()
	order := map[iptables.Chain]int{}
	for i, b := range builtinChains[tx.t.name] {
		order[b] = i + 1
	}
	slices.SortFunc(out, func(a, b *fakeChain) int {
		oa, ob := order[a.name], order[b.name]
		if oa == 0 {
			oa = len(order) + 1
		}
		if ob == 0 {
			ob = len(order) + 1
		}
		if oa != ob {
			return oa - ob
		}
		return strings.Compare(string(a.name), string(b.name))
	})
	return out
}

// declare handles ":CHAIN POLICY [packets:bytes]".
func (tx *txn) declare(decl string) error {
	fields := strings.Fields(decl)
	if len(fields) < 2 || len(fields) > 3 {
		return fmt.Errorf("bad chain declaration")
	}
	if len(fields) == 3 && !validCounters(fields[2]) {
		return fmt.Errorf("bad counters %q", fields[2])
	}
	name, policy := iptables.Chain(fields[0]), fields[1]
	if c := tx.chain(name); c != nil && c.builtin {
		switch policy {
		case "-":
		case "ACCEPT", "DROP":
			tx.writable(name).policy = policy
		default:
			return fmt.Errorf("bad policy %q for built-in chain %s", policy, name)
		}
		return nil
	}
	if policy != "-" {
		return fmt.Errorf("cannot set policy %q on user chain %s", policy, name)
	}
	if c := tx.chain(name); c != nil {
		// --noflush: declaring an existing user chain flushes it.
		if len(c.rules) > 0 {
			tx.writable(name).rules = nil
		}
		return nil
	}
	if err := validChainName(name); err != nil {
		return err
	}
	tx.create(name)
	return nil
}

func validCounters(s string) bool {
	inner, ok := strings.CutPrefix(s, "[")
	if !ok {
		return false
	}
	inner, ok = strings.CutSuffix(inner, "]")
	if !ok {
		return false
	}
	p, b, ok := strings.Cut(inner, ":")
	_, err1 := strconv.ParseUint(p, 10, 64)
	_, err2 := strconv.ParseUint(b, 10, 64)
	return ok && err1 == nil && err2 == nil
}

// command handles one -A/-I/-D/-F/-X/-N/-P line.
func (tx *txn) command(line string, n int) error {
	args, err := iptables.SplitArgs(line)
	if err != nil {
		return err
	}
	if len(args) > 0 && validCounters(args[0]) {
		args = args[1:]
	}
	if len(args) == 0 {
		return fmt.Errorf("empty command")
	}
	cmd, rest := args[0], args[1:]
	chainArg := func() (iptables.Chain, error) {
		if len(rest) == 0 {
			return "", fmt.Errorf("%s needs a chain", cmd)
		}
		return iptables.Chain(rest[0]), nil
	}
	switch cmd {
	case "-A", "--append", "-I", "--insert":
		chain, err := chainArg()
		if err != nil {
			return err
		}
		ruleArgs, at := rest[1:], -1
		if cmd == "-I" || cmd == "--insert" {
			at = 0
			if len(ruleArgs) > 0 && ruleArgs[0] != "" && strings.Trim(ruleArgs[0], "0123456789") == "" {
				pos, err := strconv.Atoi(ruleArgs[0])
				if err != nil || pos < 1 {
					return fmt.Errorf("invalid rule number %q", ruleArgs[0])
				}
				at, ruleArgs = pos-1, ruleArgs[1:]
			}
		}
		return tx.insertRule(chain, at, ruleArgs, n)
	case "-D", "--delete":
		chain, err := chainArg()
		if err != nil {
			return err
		}
		return tx.deleteRule(chain, rest[1:])
	case "-F", "--flush", "-X", "--delete-chain":
		if len(rest) > 1 {
			return fmt.Errorf("%s: unexpected argument %q", cmd, rest[1])
		}
		var chains []iptables.Chain
		if len(rest) == 1 {
			chains = []iptables.Chain{iptables.Chain(rest[0])}
		} else {
			for _, c := range tx.sortedChains() {
				if cmd == "-F" || cmd == "--flush" || !c.builtin {
					chains = append(chains, c.name)
				}
			}
		}
		for _, c := range chains {
			var err error
			if cmd == "-F" || cmd == "--flush" {
				err = tx.flushChain(c)
			} else {
				err = tx.deleteChain(c, n)
			}
			if err != nil {
				return err
			}
		}
		return nil
	case "-N", "--new-chain", "--new":
		chain, err := chainArg()
		if err != nil {
			return err
		}
		if len(rest) > 1 {
			return fmt.Errorf("%s: unexpected argument %q", cmd, rest[1])
		}
		if tx.chain(chain) != nil {
			return fmt.Errorf("chain %s already exists", chain)
		}
		if err := validNewChainName(chain); err != nil {
			return err
		}
		tx.create(chain)
		return nil
	case "-P", "--policy":
		if len(rest) != 2 {
			return fmt.Errorf("%s needs a chain and a policy", cmd)
		}
		c := tx.chain(iptables.Chain(rest[0]))
		if c == nil || !c.builtin {
			return fmt.Errorf("%s: %s is not a built-in chain", cmd, rest[0])
		}
		if rest[1] != "ACCEPT" && rest[1] != "DROP" {
			return fmt.Errorf("bad policy %q", rest[1])
		}
		tx.writable(c.name).policy = rest[1]
		return nil
	case "-t", "--table":
		return fmt.Errorf("the -t option cannot be used in iptables-restore input")
	}
	return fmt.Errorf("unsupported command %q", cmd)
}

// insertRule parses args and puts the rule at index at (-1: append).
func (tx *txn) insertRule(chain iptables.Chain, at int, args []string, line int) error {
	c := tx.chain(chain)
	if c == nil {
		return fmt.Errorf("chain %s does not exist", chain)
	}
	r, err := ParseRule(args)
	if err != nil {
		return fmt.Errorf("bad rule: %w", err)
	}
	if err := tx.checkRule(c, r); err != nil {
		return err
	}
	if refuse := tx.f.refuse; refuse != nil {
		if err := refuse(tx.t.name, chain, args); err != nil {
			err = fmt.Errorf("refused by the kernel: %w", err)
			if !tx.f.refuseAtCommit || line == 0 {
				return err
			}
			if tx.refused == nil {
				tx.refused = err
			}
		}
	}
	fr := &fakeRule{args: slices.Clone(args), rule: r}
	if at < 0 {
		at = len(c.rules)
	}
	if at > len(c.rules) {
		return fmt.Errorf("index of insertion too big (chain %s has %d rules)", chain, len(c.rules))
	}
	c = tx.writable(chain)
	c.rules = slices.Insert(c.rules, at, fr)
	if t := r.Target; t != nil && (t.Chain || targetHooks[t.Name] != 0) {
		tx.graphChanged = true
	}
	if line > 0 {
		tx.lines[fr] = line
	}
	return nil
}

// checkRule applies the checks iptables and the kernel make when a rule is
// added to c.
func (tx *txn) checkRule(c *fakeChain, r *Rule) error {
	table := tx.t.name
	if c.builtin {
		if r.InInterface != nil && (c.name == iptables.ChainOutput || c.name == iptables.ChainPostrouting) {
			return fmt.Errorf("can't use -i with %s", c.name)
		}
		if r.OutInterface != nil && (c.name == iptables.ChainPrerouting || c.name == iptables.ChainInput) {
			return fmt.Errorf("can't use -o with %s", c.name)
		}
	}
	if err := checkRuleFamily(r, tx.f.protocol); err != nil {
		return err
	}
	t := r.Target
	if t == nil {
		return nil
	}
	if t.Chain {
		target := tx.chain(iptables.Chain(t.Name))
		if target == nil {
			return fmt.Errorf("chain %s does not exist (target of %s)", t.Name, jumpFlag(t))
		}
		if target.builtin {
			return fmt.Errorf("cannot jump to built-in chain %s", t.Name)
		}
		return nil
	}
	switch t.Name {
	case "DNAT", "SNAT", "MASQUERADE", "REDIRECT":
		if table != iptables.TableNAT {
			return fmt.Errorf("target %s is only valid in the nat table", t.Name)
		}
	case "DROP":
		if table == iptables.TableNAT {
			return fmt.Errorf("the nat table is not intended for filtering, DROP is not allowed")
		}
	case "REJECT":
		if table == iptables.TableNAT {
			return fmt.Errorf("target REJECT is not valid in the nat table")
		}
	}
	if t.Masquerade != nil && t.Masquerade.RandomFully && !tx.f.RandomFully {
		return fmt.Errorf("--random-fully is not supported by this iptables")
	}
	return nil
}

// parseRule parses the rule of a delete: the checks iptables makes before
// it looks the rule up.
func (f *Fake) parseRule(args []string) (*Rule, error) {
	r, err := ParseRule(args)
	if err != nil {
		return nil, fmt.Errorf("bad rule: %w", err)
	}
	if err := checkRuleFamily(r, f.protocol); err != nil {
		return nil, err
	}
	return r, nil
}

func jumpFlag(t *Target) string {
	if t.Goto {
		return "-g"
	}
	return "-j"
}

// checkRuleFamily rejects addresses and options of the other IP family.
func checkRuleFamily(r *Rule, protocol iptables.Protocol) error {
	v6 := protocol == iptables.ProtocolIPv6
	check := func(what string, ok bool) error {
		if !ok {
			return fmt.Errorf("%s is not an %s value", what, protocol)
		}
		return nil
	}
	for _, m := range []*AddrMatch{r.Source, r.Destination} {
		if m != nil {
			if err := check(m.Addr.String(), m.Addr.Is6() == v6); err != nil {
				return err
			}
		}
	}
	for _, m := range r.Matches {
		if rm, ok := m.(*RecentMatch); ok && rm.Mask.IsValid() {
			if err := check("recent --mask "+rm.Mask.String(), rm.Mask.Is6() == v6); err != nil {
				return err
			}
		}
	}
	if t := r.Target; t != nil {
		if t.NAT != nil && t.NAT.Addr.IsValid() {
			if err := check(t.NAT.Addr.String(), t.NAT.Addr.Is6() == v6); err != nil {
				return err
			}
		}
		if t.Reject != nil && t.Reject.With != "" {
			fam := rejectTypes[t.Reject.With]
			if err := check("--reject-with "+t.Reject.With, (v6 && fam.v6) || (!v6 && fam.v4)); err != nil {
				return err
			}
		}
	}
	return nil
}

func (tx *txn) deleteRule(chain iptables.Chain, args []string) error {
	c := tx.chain(chain)
	if c == nil {
		return fmt.Errorf("chain %s does not exist", chain)
	}
	if len(args) == 1 && args[0] != "" && strings.Trim(args[0], "0123456789") == "" {
		pos, err := strconv.Atoi(args[0])
		if err != nil || pos < 1 || pos > len(c.rules) {
			return fmt.Errorf("index of deletion too big (chain %s has %d rules)", chain, len(c.rules))
		}
		c = tx.writable(chain)
		c.rules = slices.Delete(c.rules, pos-1, pos)
		return nil
	}
	r, err := tx.f.parseRule(args)
	if err != nil {
		return err
	}
	if t := r.Target; t != nil && t.Chain && tx.chain(iptables.Chain(t.Name)) == nil {
		return fmt.Errorf("chain %s does not exist (target of %s)", t.Name, jumpFlag(t))
	}
	i := slices.IndexFunc(c.rules, func(r *fakeRule) bool { return slices.Equal(r.args, args) })
	if i < 0 {
		return fmt.Errorf("bad rule (does a matching rule exist in chain %s?)", chain)
	}
	c = tx.writable(chain)
	c.rules = slices.Delete(c.rules, i, i+1)
	return nil
}

func (tx *txn) flushChain(chain iptables.Chain) error {
	c := tx.chain(chain)
	if c == nil {
		return fmt.Errorf("chain %s does not exist", chain)
	}
	if len(c.rules) > 0 {
		tx.writable(chain).rules = nil
	}
	return nil
}

// deleteChain removes an empty user chain; references are checked at commit.
func (tx *txn) deleteChain(chain iptables.Chain, line int) error {
	c := tx.chain(chain)
	switch {
	case c == nil:
		return fmt.Errorf("chain %s does not exist", chain)
	case c.builtin:
		return fmt.Errorf("cannot delete built-in chain %s", chain)
	case len(c.rules) > 0:
		return fmt.Errorf("chain %s is not empty (%d rules)", chain, len(c.rules))
	}
	delete(tx.overlay, chain)
	tx.removed[chain] = line
	return nil
}

// commit validates the working copy and swaps it in.
func (tx *txn) commit() error {
	if err := tx.validate(); err != nil {
		return err
	}
	for name := range tx.removed {
		delete(tx.t.chains, name)
	}
	for name, c := range tx.overlay {
		tx.t.chains[name] = c
	}
	return nil
}

// ruleError attributes err to the line a rule came from when it was added
// in this transaction.
func (tx *txn) ruleError(r *fakeRule, err error) error {
	if line, ok := tx.lines[r]; ok {
		return &RestoreError{Line: line, Err: err}
	}
	return err
}

// hook bits, one per built-in chain.
type hookSet uint8

var hookBits = map[iptables.Chain]hookSet{
	iptables.ChainPrerouting: 1 << 0, iptables.ChainInput: 1 << 1, iptables.ChainForward: 1 << 2, iptables.ChainOutput: 1 << 3, iptables.ChainPostrouting: 1 << 4,
}

const allHooks hookSet = 1<<5 - 1

// targetHooks are the hooks where extension targets may be used.
var targetHooks = map[string]hookSet{
	"DNAT":       hookBits[iptables.ChainPrerouting] | hookBits[iptables.ChainOutput],
	"REDIRECT":   hookBits[iptables.ChainPrerouting] | hookBits[iptables.ChainOutput],
	"SNAT":       hookBits[iptables.ChainPostrouting] | hookBits[iptables.ChainInput],
	"MASQUERADE": hookBits[iptables.ChainPostrouting],
	"REJECT":     hookBits[iptables.ChainInput] | hookBits[iptables.ChainForward] | hookBits[iptables.ChainOutput],
}

func hookNames(h hookSet) string {
	var names []string
	for _, c := range []iptables.Chain{iptables.ChainPrerouting, iptables.ChainInput, iptables.ChainForward, iptables.ChainOutput, iptables.ChainPostrouting} {
		if h&hookBits[c] != 0 {
			names = append(names, string(c))
		}
	}
	return strings.Join(names, ",")
}

// validate checks what the kernel checks when a table is committed: every
// jump target exists, chains reachable from built-in chains form no loop and
// nest at most maxChainDepth deep, and targets are used only from the hooks
// that allow them. A transaction that only removed rules cannot break these
// and skips the walk.
func (tx *txn) validate() error {
	if !tx.graphChanged && len(tx.removed) == 0 {
		return nil
	}
	err := tx.validateOrder(tx.chains())
	if err != nil {
		// Report the first error in iptables-save order, not map order.
		err = tx.validateOrder(tx.sortedChains())
	}
	return err
}

func (tx *txn) validateOrder(chains []*fakeChain) error {
	idx := make(map[iptables.Chain]int32, len(chains))
	for i, c := range chains {
		idx[c.name] = int32(i)
	}
	// edges[i] are the chains chain i jumps to, in rule order, with the
	// rule; allowed[i] are the hooks chain i's targets may be used from.
	type edge struct {
		to   int32
		rule *fakeRule
	}
	edges := make([][]edge, len(chains))
	allowed := make([]hookSet, len(chains))
	for i, c := range chains {
		allowed[i] = allHooks
		for _, r := range c.rules {
			tg := r.rule.Target
			if tg == nil {
				continue
			}
			if !tg.Chain {
				if h, ok := targetHooks[tg.Name]; ok {
					allowed[i] &= h
				}
				continue
			}
			j, ok := idx[iptables.Chain(tg.Name)]
			if !ok {
				if line, ok := tx.removed[iptables.Chain(tg.Name)]; ok {
					err := fmt.Errorf("chain %s is still referenced by a rule in chain %s", tg.Name, c.name)
					if line > 0 {
						return &RestoreError{Line: line, Err: err}
					}
					return err
				}
				return tx.ruleError(r, fmt.Errorf("chain %s (target of %s in chain %s) does not exist", tg.Name, jumpFlag(tg), c.name))
			}
			edges[i] = append(edges[i], edge{j, r})
		}
	}

	// Depth-first walk from each built-in chain: loops and nesting depth.
	const (
		white = iota
		grey
		black
	)
	color := make([]uint8, len(chains))
	height := make([]int, len(chains)) // deepest nesting below a chain
	var walk func(i int32, depth int) error
	walk = func(i int32, depth int) error {
		color[i] = grey
		h := 0
		for _, e := range edges[i] {
			switch color[e.to] {
			case grey:
				return tx.ruleError(e.rule, fmt.Errorf("jump from %s to %s closes a loop", chains[i].name, chains[e.to].name))
			case white:
				if depth+1 > maxChainDepth {
					return tx.ruleError(e.rule, fmt.Errorf("jump from %s to %s nests chains deeper than the kernel's limit of %d", chains[i].name, chains[e.to].name, maxChainDepth))
				}
				if err := walk(e.to, depth+1); err != nil {
					return err
				}
			}
			if depth+1+height[e.to] > maxChainDepth {
				return tx.ruleError(e.rule, fmt.Errorf("jump from %s to %s nests chains deeper than the kernel's limit of %d", chains[i].name, chains[e.to].name, maxChainDepth))
			}
			h = max(h, height[e.to]+1)
		}
		color[i] = black
		height[i] = h
		return nil
	}
	hooks := make([]hookSet, len(chains))
	for _, b := range builtinChains[tx.t.name] {
		bi := idx[b]
		if color[bi] == white {
			if err := walk(bi, 0); err != nil {
				return err
			}
		}
		// Mark every chain reachable from b (acyclic now) with b's hook.
		stack := []int32{bi}
		for len(stack) > 0 {
			i := stack[len(stack)-1]
			stack = stack[:len(stack)-1]
			if hooks[i]&hookBits[b] != 0 {
				continue
			}
			hooks[i] |= hookBits[b]
			for _, e := range edges[i] {
				stack = append(stack, e.to)
			}
		}
	}
	for i, c := range chains {
		if hooks[i]&^allowed[i] == 0 {
			continue
		}
		for _, r := range c.rules {
			tg := r.rule.Target
			if tg == nil || tg.Chain {
				continue
			}
			if ok, restricted := targetHooks[tg.Name]; restricted && hooks[i]&^ok != 0 {
				return tx.ruleError(r, fmt.Errorf("target %s in chain %s is reachable from %s but only valid from %s",
					tg.Name, c.name, hookNames(hooks[i]&^ok), hookNames(ok)))
			}
		}
	}
	return nil
}

// validChainName applies the chain name rules of iptables-restore's chain
// declarations, plus: no names that need quoting.
func validChainName(name iptables.Chain) error {
	s := string(name)
	switch {
	case s == "":
		return fmt.Errorf("empty chain name")
	case len(s) > MaxChainNameLength:
		return fmt.Errorf("chain name %q too long (max %d)", s, MaxChainNameLength)
	case s[0] == '-' || s[0] == '!':
		return fmt.Errorf("chain name %q may not start with %q", s, s[0])
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\'' || c == '\\' {
			return fmt.Errorf("chain name %q contains an invalid character", s)
		}
	}
	return nil
}

// validNewChainName adds the rule of `iptables -N` (EnsureChain, and -N in
// restore input) to validChainName: no target names. A chain declaration in
// restore input may take a target's name.
func validNewChainName(name iptables.Chain) error {
	if IsBuiltinTarget(string(name)) {
		return fmt.Errorf("chain name %q clashes with a target name", name)
	}
	return validChainName(name)
}
