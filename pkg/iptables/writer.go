package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// This file is kproxy's one way of writing its chains: every backend hands
// the chains it wants to a Writer, which works out what differs from its
// last write and turns that into iptables-restore --noflush input.

// ChainRules is one chain with its rules, each the text after "-A CHAIN".
type ChainRules struct {
	Name  string
	Rules []string
}

// ChainGroup is chains of one table that reach the kernel in the same
// restore because they jump to each other (one service port's chains).
type ChainGroup struct {
	Table  Table
	Chains []ChainRules
}

// RuleSet is every chain a Writer should leave in the kernel. A chain
// appears once; its rules are not changed once handed to a Writer (the
// Writer keeps them as the record of its last write).
type RuleSet struct {
	// Groups may be spread over several restores before the last one
	// (WriterOptions.BatchChains); a group is never split. They are written
	// in this order.
	Groups []ChainGroup
	// Shared chains (dispatch chains, hooks' targets...) go in the last
	// restore, sorted by name, so that a jump in them never reaches a group
	// chain that is not complete yet.
	Shared map[Table]map[string][]string
}

// NewRuleSet returns an empty RuleSet.
func NewRuleSet() *RuleSet { return &RuleSet{Shared: map[Table]map[string][]string{}} }

// AddGroup adds chains of table as one group; an empty group is ignored.
func (rs *RuleSet) AddGroup(table Table, chains ...ChainRules) {
	if len(chains) > 0 {
		rs.Groups = append(rs.Groups, ChainGroup{Table: table, Chains: chains})
	}
}

// SetShared sets a shared chain's rules (nil for an empty chain).
func (rs *RuleSet) SetShared(table Table, chain string, rules []string) {
	if rs.Shared == nil {
		rs.Shared = map[Table]map[string][]string{}
	}
	if rs.Shared[table] == nil {
		rs.Shared[table] = map[string][]string{}
	}
	rs.Shared[table][chain] = rules
}

// RuleCount is the number of rules in table's chains.
func (rs *RuleSet) RuleCount(table Table) int {
	n := 0
	for _, g := range rs.Groups {
		if g.Table == table {
			for _, c := range g.Chains {
				n += len(c.Rules)
			}
		}
	}
	for _, rules := range rs.Shared[table] {
		n += len(rules)
	}
	return n
}

// names returns the set of table's chain names.
func (rs *RuleSet) names(table Table) map[string]bool {
	out := make(map[string]bool, len(rs.Shared[table]))
	for _, g := range rs.Groups {
		if g.Table == table {
			for _, c := range g.Chains {
				out[c.Name] = true
			}
		}
	}
	for name := range rs.Shared[table] {
		out[name] = true
	}
	return out
}

// WriteStats describes what a write did (or tried to do, when it failed).
type WriteStats struct {
	// Restores is the number of iptables-restore runs.
	Restores      int
	ChainsWritten int
	ChainsDeleted int
	RulesWritten  int
	// RulesDeleted counts the rules of other chains deleted with the
	// chains they jumped to (hooks, by RemoveChains).
	RulesDeleted int
	// RulesWrittenByTable splits RulesWritten by table (nil when none).
	RulesWrittenByTable map[Table]int
	// Bytes is the size of the restore input.
	Bytes int
	// RestoreTime is the time spent in iptables-restore.
	RestoreTime time.Duration
}

func (s *WriteStats) add(o WriteStats) {
	s.Restores += o.Restores
	s.ChainsWritten += o.ChainsWritten
	s.ChainsDeleted += o.ChainsDeleted
	s.RulesWritten += o.RulesWritten
	s.RulesDeleted += o.RulesDeleted
	for t, n := range o.RulesWrittenByTable {
		if s.RulesWrittenByTable == nil {
			s.RulesWrittenByTable = map[Table]int{}
		}
		s.RulesWrittenByTable[t] += n
	}
	s.Bytes += o.Bytes
	s.RestoreTime += o.RestoreTime
}

// section is one "*table ... COMMIT" part of a restore.
type section struct {
	table Table
	// write are chains declared (so flushed) and then filled.
	write []ChainRules
	// unhook are rules of other chains to delete ("CHAIN args").
	unhook []string
	// delete are chains declared (so flushed) and then deleted.
	delete []string
}

func (s *section) empty() bool { return len(s.write) == 0 && len(s.unhook) == 0 && len(s.delete) == 0 }

// appendTo appends the section to buf and counts it in st.
func (s *section) appendTo(buf *bytes.Buffer, st *WriteStats) {
	if s.empty() {
		return
	}
	fmt.Fprintf(buf, "*%s\n", s.table)
	for _, c := range s.write {
		fmt.Fprintf(buf, ":%s - [0:0]\n", c.Name)
	}
	for _, c := range s.delete {
		fmt.Fprintf(buf, ":%s - [0:0]\n", c)
	}
	rules := 0
	for _, c := range s.write {
		for _, r := range c.Rules {
			buf.WriteString("-A ")
			buf.WriteString(c.Name)
			buf.WriteByte(' ')
			buf.WriteString(r)
			buf.WriteByte('\n')
		}
		rules += len(c.Rules)
	}
	for _, r := range s.unhook {
		fmt.Fprintf(buf, "-D %s\n", r)
	}
	for _, c := range s.delete {
		fmt.Fprintf(buf, "-X %s\n", c)
	}
	buf.WriteString("COMMIT\n")
	st.ChainsWritten += len(s.write)
	st.ChainsDeleted += len(s.delete)
	st.RulesDeleted += len(s.unhook)
	if len(s.write) > 0 {
		st.RulesWritten += rules
		if st.RulesWrittenByTable == nil {
			st.RulesWrittenByTable = map[Table]int{}
		}
		st.RulesWrittenByTable[s.table] += rules
	}
}

// plannedRestore is one iptables-restore run. Its text is rendered when it
// runs (or is asked for), one restore at a time: a full sync's text is tens
// of megabytes at 10,000 services, and holding every batch at once would
// raise the peak memory by as much.
type plannedRestore struct {
	sections []section
}

func newRestore(sections []section) plannedRestore { return plannedRestore{sections: sections} }

// empty reports whether the restore would write nothing.
func (r plannedRestore) empty() bool {
	for i := range r.sections {
		if !r.sections[i].empty() {
			return false
		}
	}
	return true
}

// render returns the restore's input and what it writes.
func (r plannedRestore) render() ([]byte, WriteStats) {
	var st WriteStats
	var buf bytes.Buffer
	for i := range r.sections {
		r.sections[i].appendTo(&buf, &st)
	}
	st.Restores = 1
	st.Bytes = buf.Len()
	return buf.Bytes(), st
}

// Plan is the iptables-restore input of one write: one or more restores,
// run in order.
type Plan struct {
	// Full is true for a plan that writes every chain of its rule set.
	Full     bool
	restores []plannedRestore
	// written and deleted are what the plan changes, by table, for the
	// Writer's record.
	written map[Table][]ChainRules
	deleted map[Table][]string
}

// String returns exactly the bytes the plan hands to iptables-restore,
// its restores one after the other.
func (p *Plan) String() string {
	var b strings.Builder
	for _, r := range p.restores {
		data, _ := r.render()
		b.Write(data)
	}
	return b.String()
}

// Restores returns the input of each restore, in order.
func (p *Plan) Restores() []string {
	out := make([]string, 0, len(p.restores))
	for _, r := range p.restores {
		data, _ := r.render()
		out = append(out, string(data))
	}
	return out
}

// Empty reports whether the plan changes nothing.
func (p *Plan) Empty() bool { return len(p.restores) == 0 }

// Stats is what the plan writes (RestoreTime aside) when every restore
// succeeds.
func (p *Plan) Stats() WriteStats {
	var st WriteStats
	for _, r := range p.restores {
		_, rs := r.render()
		st.add(rs)
	}
	return st
}

// apply runs the restores in order and stops at the first failure. The
// statistics count the restores tried.
func (p *Plan) apply(ctx context.Context, iface Interface) (WriteStats, error) {
	var st WriteStats
	for _, r := range p.restores {
		data, rs := r.render()
		st.add(rs)
		start := time.Now()
		err := iface.Restore(ctx, data)
		st.RestoreTime += time.Since(start)
		if err != nil {
			return st, fmt.Errorf("iptables-restore (%d bytes): %w", len(data), err)
		}
	}
	return st, nil
}

// WriterOptions configures a Writer. IPTables and Owned are required.
type WriterOptions struct {
	IPTables Interface
	// Owned reports whether a chain is the writer's to delete: a full write
	// deletes the owned chains of the kernel that its rule set lacks, and
	// any write deletes the owned chains of its last write that the rule
	// set lacks. Chains that are not owned are never deleted.
	Owned func(table Table, chain string) bool
	// BatchChains bounds the group chains of each restore but the last:
	// iptables-nft's --noflush restore time grows with the square of the
	// chains in one restore. Zero or less writes one restore.
	BatchChains int
	// Tables the writer writes, in the order of their sections; default
	// nat then filter.
	Tables []Table
}

// Writer writes rule sets with iptables-restore --noflush and remembers
// what it last wrote, so that a partial write carries only the chains whose
// rules changed. It is not safe for concurrent use.
type Writer struct {
	opts WriterOptions
	// last holds the rules of every chain as last written; nil when
	// unknown (before a write, after a failed one, after Forget).
	last map[Table]map[string][]string
}

// NewWriter validates opts and returns a Writer. It touches nothing.
func NewWriter(opts WriterOptions) (*Writer, error) {
	if opts.IPTables == nil {
		return nil, errors.New("iptables writer: IPTables is required")
	}
	if opts.Owned == nil {
		return nil, errors.New("iptables writer: Owned is required")
	}
	if len(opts.Tables) == 0 {
		opts.Tables = []Table{TableNAT, TableFilter}
	}
	return &Writer{opts: opts}, nil
}

// Forget drops the record of the last write: the next write carries every
// chain.
func (w *Writer) Forget() { w.last = nil }

// sameRules compares rule lists; lists sharing their backing array (a
// chain handed over again unchanged) compare without reading the rules.
func sameRules(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	if len(a) == 0 || &a[0] == &b[0] {
		return true
	}
	return slices.Equal(a, b)
}

// Plan works out the restores that bring the kernel from the last write to
// rs. A full plan writes every chain of rs and deletes the owned chains
// the kernel holds (ListChains) that rs lacks; a partial one writes only
// the chains whose rules differ from the last write and deletes the owned
// chains of the last write that rs lacks. Changed group chains come first,
// in batches of about BatchChains chains while more than that remain (a
// group whole in one batch); the last restore carries the rest of them,
// the changed shared chains and every deletion, so that no jump ever
// reaches a chain that is missing or not yet complete. Apply the plan
// before planning another.
func (w *Writer) Plan(ctx context.Context, rs *RuleSet, full bool) (*Plan, error) {
	for _, g := range rs.Groups {
		if !slices.Contains(w.opts.Tables, g.Table) {
			return nil, fmt.Errorf("iptables writer: chain group in table %s, which it does not write", g.Table)
		}
	}
	for t := range rs.Shared {
		if !slices.Contains(w.opts.Tables, t) {
			return nil, fmt.Errorf("iptables writer: shared chains in table %s, which it does not write", t)
		}
	}
	p := &Plan{Full: full, written: map[Table][]ChainRules{}, deleted: map[Table][]string{}}
	// known counts, per table, the chains of rs that the last write had:
	// fewer than the last write's chains means some are no longer wanted.
	known := map[Table]int{}
	changed := func(table Table, c ChainRules) bool {
		prev, ok := w.last[table][c.Name]
		if ok {
			known[table]++
		}
		return full || !ok || !sameRules(prev, c.Rules)
	}

	var groups []ChainGroup
	pending := 0
	for _, g := range rs.Groups {
		var out []ChainRules
		for _, c := range g.Chains {
			if changed(g.Table, c) {
				out = append(out, c)
			}
		}
		if len(out) > 0 {
			groups = append(groups, ChainGroup{Table: g.Table, Chains: out})
			p.written[g.Table] = append(p.written[g.Table], out...)
			pending += len(out)
		}
	}
	shared := map[Table][]ChainRules{}
	for _, t := range w.opts.Tables {
		names := make([]string, 0, len(rs.Shared[t]))
		for name := range rs.Shared[t] {
			names = append(names, name)
		}
		slices.Sort(names)
		for _, name := range names {
			if c := (ChainRules{name, rs.Shared[t][name]}); changed(t, c) {
				shared[t] = append(shared[t], c)
			}
		}
		p.written[t] = append(p.written[t], shared[t]...)
	}

	for _, t := range w.opts.Tables {
		var candidates []string
		switch {
		case full:
			existing, err := w.opts.IPTables.ListChains(ctx, t)
			if err != nil {
				return nil, fmt.Errorf("listing %s chains: %w", t, err)
			}
			candidates = existing
		case known[t] < len(w.last[t]):
			for name := range w.last[t] {
				candidates = append(candidates, name)
			}
		default:
			continue
		}
		wanted := rs.names(t)
		for _, name := range candidates {
			if !wanted[name] && w.opts.Owned(t, name) {
				p.deleted[t] = append(p.deleted[t], name)
			}
		}
		slices.Sort(p.deleted[t])
	}

	// Whole groups go into batches of about BatchChains chains while more
	// than one batch remains; the rest joins the last restore.
	limit := w.opts.BatchChains
	var batch []ChainGroup
	batched := 0
	for _, g := range groups {
		batch = append(batch, g)
		if limit <= 0 || pending <= limit {
			continue
		}
		pending -= len(g.Chains)
		if batched += len(g.Chains); batched >= limit {
			p.restores = append(p.restores, newRestore(w.sections(batch, nil, nil)))
			batch, batched = nil, 0
		}
	}
	if last := newRestore(w.sections(batch, shared, p.deleted)); !last.empty() {
		p.restores = append(p.restores, last)
	}
	return p, nil
}

// sections lays out one restore: per table, the group chains in order,
// then the shared chains and the deletions.
func (w *Writer) sections(groups []ChainGroup, shared map[Table][]ChainRules, deleted map[Table][]string) []section {
	out := make([]section, 0, len(w.opts.Tables))
	for _, t := range w.opts.Tables {
		s := section{table: t, delete: deleted[t]}
		for _, g := range groups {
			if g.Table == t {
				s.write = append(s.write, g.Chains...)
			}
		}
		s.write = append(s.write, shared[t]...)
		out = append(out, s)
	}
	return out
}

// Apply runs p, a plan of this Writer, and records what it wrote. After a
// failure the Writer forgets its last write, so the next one carries every
// chain; a caller should make it full, as restores before the failing one
// stay applied. The statistics count the restores tried.
func (w *Writer) Apply(ctx context.Context, p *Plan) (WriteStats, error) {
	st, err := p.apply(ctx, w.opts.IPTables)
	if err != nil {
		w.last = nil
		return st, err
	}
	if p.Full || w.last == nil {
		w.last = map[Table]map[string][]string{}
	}
	for t, chains := range p.written {
		if w.last[t] == nil {
			w.last[t] = make(map[string][]string, len(chains))
		}
		for _, c := range chains {
			w.last[t][c.Name] = c.Rules
		}
	}
	for t, names := range p.deleted {
		for _, name := range names {
			delete(w.last[t], name)
		}
	}
	return st, nil
}

// Write plans and applies rs (see Plan and Apply).
func (w *Writer) Write(ctx context.Context, rs *RuleSet, full bool) (WriteStats, error) {
	p, err := w.Plan(ctx, rs, full)
	if err != nil {
		return WriteStats{}, err
	}
	return w.Apply(ctx, p)
}

// PlanRemoval plans the removal from table of every chain for which owned
// is true, with every rule of another chain (a hook in a built-in chain)
// that jumps or goes to one of them: one restore, so that the table never
// holds a jump to a missing chain. It reads the table with SaveInto.
func PlanRemoval(ctx context.Context, iface Interface, table Table, owned func(table Table, chain string) bool) (*Plan, error) {
	data, err := iface.SaveInto(ctx, table)
	if err != nil {
		return nil, fmt.Errorf("saving %s: %w", table, err)
	}
	chains, jumps, err := ownedChainsAndJumps(data, func(chain string) bool { return owned(table, chain) })
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", table, err)
	}
	p := &Plan{deleted: map[Table][]string{table: chains}}
	if len(chains) > 0 {
		p.restores = []plannedRestore{newRestore([]section{{table: table, unhook: jumps, delete: chains}})}
	}
	return p, nil
}

// RemoveChains removes, table by table (one restore each, going on after a
// failure), every chain for which owned is true and every rule jumping or
// going to one of them (see PlanRemoval). Chains and rules of anyone else
// stay; running it again changes nothing.
func RemoveChains(ctx context.Context, iface Interface, tables []Table, owned func(table Table, chain string) bool) (WriteStats, error) {
	var st WriteStats
	var errs []error
	for _, t := range tables {
		p, err := PlanRemoval(ctx, iface, t, owned)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		done, err := p.apply(ctx, iface)
		st.add(done)
		if err != nil {
			errs = append(errs, fmt.Errorf("deleting %d %s chains: %w", len(p.deleted[t]), t, err))
		}
	}
	return st, errors.Join(errs...)
}

// ownedChainsAndJumps reads iptables-save output: the owned chains, sorted,
// and the rules ("CHAIN args...") of other chains that jump or go to them.
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
			args, err := SplitArgs(line)
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
						jumps = append(jumps, JoinArgs(args[1:]))
					}
				}
			}
		}
	}
	slices.Sort(chains)
	return slices.Compact(chains), jumps, nil
}

// JumpRule is a rule of a built-in chain that leads into one of kproxy's
// chains: a hook.
type JumpRule struct {
	Table Table
	// Chain is the built-in chain holding the rule.
	Chain Chain
	// Args are the rule's arguments, after "-A CHAIN".
	Args     []string
	Position RulePosition
}

// Jump is the hook in table's chain that jumps to target, with a comment
// and the matches given before it; it is prepended.
func Jump(table Table, chain Chain, comment, target string, matches ...string) JumpRule {
	args := append(slices.Clone(matches), "-m", "comment", "--comment", comment, "-j", target)
	return JumpRule{Table: table, Chain: chain, Args: args, Position: Prepend}
}

// EnsureJumpRules adds the rules that are missing (their targets must
// exist). Prepended rules are inserted last first, so that rules added
// together appear in the order given, ahead of others' rules; appended
// ones are added in order.
func EnsureJumpRules(ctx context.Context, iface Interface, rules []JumpRule) error {
	ensure := func(j JumpRule) error {
		if _, err := iface.EnsureRule(ctx, j.Position, j.Table, j.Chain, j.Args...); err != nil {
			return fmt.Errorf("ensuring jump from %s/%s: %w", j.Table, j.Chain, err)
		}
		return nil
	}
	for i := len(rules) - 1; i >= 0; i-- {
		if rules[i].Position == Prepend {
			if err := ensure(rules[i]); err != nil {
				return err
			}
		}
	}
	for _, j := range rules {
		if j.Position != Prepend {
			if err := ensure(j); err != nil {
				return err
			}
		}
	}
	return nil
}
