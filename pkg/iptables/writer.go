package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"slices"
	"strings"
	"time"
	"unique"
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
//
// A group is given either with its rules (Chains) or lazily (Names and
// Render), so that its caller need not keep the rules' text between
// writes: a partial write takes a lazy group as unchanged since the
// Writer's last write when the Writer has a record of each of its chains,
// and writes it, calling Render, when not; a full write always writes it.
// Hand a group lazily to a partial write only when its rules are those
// last handed to the Writer.
type ChainGroup struct {
	Table Table
	// Chains are the chains with their rules (nil in a lazy group).
	Chains []ChainRules
	// Names are a lazy group's chains, in the order Render returns them.
	Names []string
	// Render returns a lazy group's chains with their rules; it is called
	// while the restore holding the group is written, and at most once
	// per Apply.
	Render func() []ChainRules
}

// lazy reports whether the group is given by Names and Render.
func (g *ChainGroup) lazy() bool { return g.Render != nil }

// size is the number of chains of the group.
func (g *ChainGroup) size() int {
	if g.lazy() {
		return len(g.Names)
	}
	return len(g.Chains)
}

// eachName calls fn with each chain name of the group, in order.
func (g *ChainGroup) eachName(fn func(string)) {
	if g.lazy() {
		for _, n := range g.Names {
			fn(n)
		}
		return
	}
	for _, c := range g.Chains {
		fn(c.Name)
	}
}

// RuleSet is every chain a Writer should leave in the kernel. A chain
// appears once; its rules are not changed once handed to a Writer.
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

// AddLazyGroup adds the chains names of table as one lazy group (see
// ChainGroup): render returns them, in this order, with their rules. An
// empty group is ignored.
func (rs *RuleSet) AddLazyGroup(table Table, names []string, render func() []ChainRules) {
	if len(names) > 0 {
		rs.Groups = append(rs.Groups, ChainGroup{Table: table, Names: names, Render: render})
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

// RuleCount is the number of rules in table's chains given with their
// rules; lazy groups are not counted (Writer.RuleCount counts what a
// Writer last wrote).
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
			g.eachName(func(n string) { out[n] = true })
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

// Add adds o's counts to s.
func (s *WriteStats) Add(o WriteStats) { s.add(o) }

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

// chainRecord is what a Writer remembers of a chain it wrote: a
// fingerprint of its rules (not their text, which is most of a large rule
// set's size) and their number. An unknown record is a chain a failed
// restore may or may not have changed: it matches no rules, so the chain
// is written again (or deleted, when no longer wanted).
type chainRecord struct {
	sum   uint64
	rules int
	// jumps are the targets of the rules that end in "-j TARGET" or "-g
	// TARGET" (see JumpTarget), in order, separated by spaces; interned,
	// since most chains jump to the same few. Verify counts those that are
	// chains of the record.
	jumps   unique.Handle[string]
	unknown bool
}

// fingerprinter hashes rule lists with a seed of its own: chains differ
// when their fingerprints do. A 64-bit hash with a seed drawn at random
// per Writer makes a collision between a chain's old and new rules (which
// would leave the old rules in place until the next full write) about as
// likely as a hardware fault, and impossible to arrange from Service
// objects.
type fingerprinter struct{ seed maphash.Seed }

func (f fingerprinter) record(rules []string) chainRecord {
	var h maphash.Hash
	h.SetSeed(f.seed)
	var jumps []byte
	for _, r := range rules {
		h.WriteString(r)
		h.WriteByte('\n') // rules hold no newline
		if t := JumpTarget(r); t != "" {
			if len(jumps) > 0 {
				jumps = append(jumps, ' ')
			}
			jumps = append(jumps, t...)
		}
	}
	rec := chainRecord{sum: h.Sum64(), rules: len(rules)}
	if len(jumps) > 0 {
		rec.jumps = unique.Make(string(jumps))
	}
	return rec
}

// section is one "*table ... COMMIT" part of a restore.
type section struct {
	table Table
	// write are the groups whose chains are declared (so flushed) and
	// then filled.
	write []ChainGroup
	// unhook are rules of other chains to delete ("CHAIN args").
	unhook []string
	// delete are chains declared (so flushed) and then deleted.
	delete []string
}

func (s *section) empty() bool { return len(s.write) == 0 && len(s.unhook) == 0 && len(s.delete) == 0 }

// appendTo appends the section to buf and counts it in st. Lazy groups
// are rendered here, one at a time, and the records of their chains are
// added to record when it is not nil.
func (s *section) appendTo(buf *bytes.Buffer, st *WriteStats, fp fingerprinter, record map[Table]map[string]chainRecord) error {
	if s.empty() {
		return nil
	}
	buf.WriteString("*" + string(s.table) + "\n")
	declare := func(name string) {
		buf.WriteByte(':')
		buf.WriteString(name)
		buf.WriteString(" - [0:0]\n")
	}
	chains := 0
	for i := range s.write {
		s.write[i].eachName(declare)
		chains += s.write[i].size()
	}
	for _, c := range s.delete {
		declare(c)
	}
	rules := 0
	for i := range s.write {
		g := &s.write[i]
		list := g.Chains
		if g.lazy() {
			list = g.Render()
			if !slices.EqualFunc(list, g.Names, func(c ChainRules, n string) bool { return c.Name == n }) {
				return fmt.Errorf("iptables writer: a lazy group of chains %v rendered other chains", g.Names)
			}
		}
		for _, c := range list {
			for _, r := range c.Rules {
				buf.WriteString("-A ")
				buf.WriteString(c.Name)
				buf.WriteByte(' ')
				buf.WriteString(r)
				buf.WriteByte('\n')
			}
			rules += len(c.Rules)
			if g.lazy() && record != nil {
				record[s.table][c.Name] = fp.record(c.Rules)
			}
		}
	}
	for _, r := range s.unhook {
		buf.WriteString("-D " + r + "\n")
	}
	for _, c := range s.delete {
		buf.WriteString("-X " + c + "\n")
	}
	buf.WriteString("COMMIT\n")
	st.ChainsWritten += chains
	st.ChainsDeleted += len(s.delete)
	st.RulesDeleted += len(s.unhook)
	if len(s.write) > 0 {
		st.RulesWritten += rules
		if st.RulesWrittenByTable == nil {
			st.RulesWrittenByTable = map[Table]int{}
		}
		st.RulesWrittenByTable[s.table] += rules
	}
	return nil
}

// plannedRestore is one iptables-restore run. Its text is rendered when it
// runs (or is asked for), one restore at a time, into one buffer: a full
// sync's text is tens of megabytes at 10,000 services, and holding every
// batch at once (or every chain's rules, which lazy groups avoid) would
// raise the peak memory by as much.
type plannedRestore struct {
	sections []section
}

func newRestore(sections []section) plannedRestore { return plannedRestore{sections: sections} }

// eachChain calls fn with every chain the restore writes or deletes.
func (r *plannedRestore) eachChain(fn func(t Table, name string, deleted bool)) {
	for i := range r.sections {
		s := &r.sections[i]
		for j := range s.write {
			s.write[j].eachName(func(n string) { fn(s.table, n, false) })
		}
		for _, n := range s.delete {
			fn(s.table, n, true)
		}
	}
}

// empty reports whether the restore would write nothing.
func (r plannedRestore) empty() bool {
	for i := range r.sections {
		if !r.sections[i].empty() {
			return false
		}
	}
	return true
}

// render writes the restore's input into buf (reset first) and returns
// what it writes. Lazy groups' records go to record unless it is nil.
func (r plannedRestore) render(buf *bytes.Buffer, fp fingerprinter, record map[Table]map[string]chainRecord) (WriteStats, error) {
	var st WriteStats
	buf.Reset()
	for i := range r.sections {
		if err := r.sections[i].appendTo(buf, &st, fp, record); err != nil {
			return st, err
		}
	}
	st.Restores = 1
	st.Bytes = buf.Len()
	return st, nil
}

// Plan is the iptables-restore input of one write: one or more restores,
// run in order.
type Plan struct {
	// Full is true for a plan that writes every chain of its rule set.
	Full bool
	// relist: the plan listed the kernel's chains to delete the owned ones
	// its rule set lacks (a full plan, or the first after a failed one).
	relist   bool
	restores []plannedRestore
	fp       fingerprinter
	// written are the records of the chains the plan writes, by table;
	// those of lazy groups are added as Apply renders them.
	written map[Table]map[string]chainRecord
	// deleted are the chains the plan deletes, by table; dropped the
	// chains of the last write that the rule set lacks and that are not
	// owned, which the Writer stops keeping a record of (and leaves be).
	deleted map[Table][]string
	dropped map[Table][]string
}

// String returns exactly the bytes the plan hands to iptables-restore,
// its restores one after the other (rendering lazy groups again).
func (p *Plan) String() string {
	return strings.Join(p.Restores(), "")
}

// Restores returns the input of each restore, in order (rendering lazy
// groups again); a lazy group that renders other chains than it names
// ends the list.
func (p *Plan) Restores() []string {
	out := make([]string, 0, len(p.restores))
	var buf bytes.Buffer
	for _, r := range p.restores {
		if _, err := r.render(&buf, p.fp, nil); err != nil {
			break
		}
		out = append(out, buf.String())
	}
	return out
}

// Empty reports whether the plan changes nothing.
func (p *Plan) Empty() bool { return len(p.restores) == 0 }

// Stats is what the plan writes (RestoreTime aside) when every restore
// succeeds (rendering lazy groups again).
func (p *Plan) Stats() WriteStats {
	var st WriteStats
	var buf bytes.Buffer
	for _, r := range p.restores {
		rs, _ := r.render(&buf, p.fp, nil)
		st.add(rs)
	}
	return st
}

// ApplyError is a failed write: the restore of its plan that failed (those
// before it were applied) and, when iptables-restore named one, the input
// line it blamed (see FailedLine).
type ApplyError struct {
	// Restore is the failed restore's index in the plan, of Restores.
	Restore, Restores int
	// Bytes is the size of the failed restore's input.
	Bytes int
	// Written are, by table, the chains the failed restore declared in
	// order to write them, and Deleted those it was to delete.
	Written, Deleted map[Table][]string
	// Line is the input line blamed (1-based; 0 when none was named),
	// Text that line and Table the table of the section holding it.
	Line  int
	Text  string
	Table Table
	Err   error
}

func (e *ApplyError) Error() string {
	return fmt.Sprintf("iptables-restore %d of %d (%d bytes): %v", e.Restore+1, e.Restores, e.Bytes, e.Err)
}

func (e *ApplyError) Unwrap() error { return e.Err }

// newApplyError describes the failure of restore i, whose input is data.
func (p *Plan) newApplyError(i int, data []byte, err error) *ApplyError {
	r := &p.restores[i]
	ae := &ApplyError{Restore: i, Restores: len(p.restores), Bytes: len(data), Err: err,
		Written: map[Table][]string{}, Deleted: map[Table][]string{}}
	for j := range r.sections {
		s := &r.sections[j]
		for k := range s.write {
			s.write[k].eachName(func(n string) { ae.Written[s.table] = append(ae.Written[s.table], n) })
		}
		ae.Deleted[s.table] = append(ae.Deleted[s.table], s.delete...)
	}
	if n, ok := FailedLine(err); ok {
		ae.Line = n
		ae.Text, ae.Table = lineOf(data, n)
	}
	return ae
}

// lineOf returns line n (1-based) of restore input and the table of the
// section holding it ("" when there is no such line).
func lineOf(data []byte, n int) (string, Table) {
	var table Table
	i := 0
	for line := range bytes.Lines(data) {
		i++
		text := strings.TrimRight(string(line), "\r\n")
		if strings.HasPrefix(text, "*") {
			table = Table(text[1:])
		}
		if i == n {
			return text, table
		}
	}
	return "", ""
}

// apply runs the restores in order and stops at the first failure, an
// *ApplyError. done, when not nil, is called after each restore applied.
// The statistics count the restores tried.
func (p *Plan) apply(ctx context.Context, iface Interface, done func(r *plannedRestore)) (WriteStats, error) {
	var st WriteStats
	var buf bytes.Buffer
	for i := range p.restores {
		r := &p.restores[i]
		rs, err := r.render(&buf, p.fp, p.written)
		if err != nil {
			return st, err
		}
		st.add(rs)
		start := time.Now()
		err = iface.Restore(ctx, buf.Bytes())
		st.RestoreTime += time.Since(start)
		if err != nil {
			return st, p.newApplyError(i, buf.Bytes(), err)
		}
		if done != nil {
			done(r)
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
// rules changed. It remembers a fingerprint of each chain's rules, not
// their text. It is not safe for concurrent use.
type Writer struct {
	opts WriterOptions
	fp   fingerprinter
	// last holds the record of every chain as last written; nil when
	// unknown (before a write, after Forget).
	last map[Table]map[string]chainRecord
	// relist is set after a full write failed: last then holds only what
	// that write applied, and the next write lists the kernel's chains, as
	// a full one does, to delete the owned ones it does not want.
	relist bool
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
	return &Writer{opts: opts, fp: fingerprinter{seed: maphash.MakeSeed()}}, nil
}

// Forget drops the record of the last write: the next write carries every
// chain.
func (w *Writer) Forget() { w.last, w.relist = nil, false }

// RuleCount is the number of rules in table's chains as last written
// (after a successful write, the rules of its rule set's chains); 0 when
// unknown.
func (w *Writer) RuleCount(table Table) int {
	n := 0
	for _, r := range w.last[table] {
		n += r.rules
	}
	return n
}

// Plan works out the restores that bring the kernel from the last write to
// rs. A full plan writes every chain of rs and deletes the owned chains
// the kernel holds (ListChains) that rs lacks; a partial one writes only
// the chains whose rules differ from the last write (and the lazy groups
// it has no record of) and deletes the owned chains of the last write that
// rs lacks. Changed group chains come first, in batches of about
// BatchChains chains while more than that remain (a group whole in one
// batch); the last restore carries the rest of them, the changed shared
// chains and every deletion, so that no jump ever reaches a chain that is
// missing or not yet complete. Apply the plan before planning another.
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
	p := &Plan{Full: full, relist: full || w.relist, fp: w.fp, written: map[Table]map[string]chainRecord{}, deleted: map[Table][]string{}, dropped: map[Table][]string{}}
	for _, t := range w.opts.Tables {
		p.written[t] = map[string]chainRecord{}
	}
	// known counts, per table, the chains of rs that the last write had:
	// fewer than the last write's chains means some are no longer wanted.
	known := map[Table]int{}
	// changed records c when it is to be written.
	changed := func(table Table, c ChainRules) bool {
		rec := w.fp.record(c.Rules)
		prev, ok := w.last[table][c.Name]
		if ok {
			known[table]++
		}
		if full || !ok || prev != rec {
			p.written[table][c.Name] = rec
			return true
		}
		return false
	}

	var groups []ChainGroup
	pending := 0
	for _, g := range rs.Groups {
		if g.lazy() {
			write := full
			for _, name := range g.Names {
				if rec, ok := w.last[g.Table][name]; ok {
					known[g.Table]++
					write = write || rec.unknown
				} else {
					write = true
				}
			}
			if write {
				groups = append(groups, g)
				pending += len(g.Names)
			}
			continue
		}
		var out []ChainRules
		for _, c := range g.Chains {
			if changed(g.Table, c) {
				out = append(out, c)
			}
		}
		if len(out) > 0 {
			groups = append(groups, ChainGroup{Table: g.Table, Chains: out})
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
	}

	for _, t := range w.opts.Tables {
		var candidates []string
		switch {
		case p.relist:
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
			switch {
			case wanted[name]:
			case w.opts.Owned(t, name):
				p.deleted[t] = append(p.deleted[t], name)
			case !p.relist:
				p.dropped[t] = append(p.dropped[t], name)
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
		pending -= g.size()
		if batched += g.size(); batched >= limit {
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
				s.write = append(s.write, g)
			}
		}
		if len(shared[t]) > 0 {
			s.write = append(s.write, ChainGroup{Table: t, Chains: shared[t]})
		}
		out = append(out, s)
	}
	return out
}

// Apply runs p, a plan of this Writer, and records what it wrote, restore
// by restore. A failure is an *ApplyError. The restores before the failed
// one stay applied and recorded; the chains of the failed one become
// unknown (a restore of several tables may have applied some of them), so
// the next write, full or not, carries them again. After a failed full
// plan the record holds only what it applied, and the next write also
// lists the kernel's chains to delete the owned ones it does not want: a
// partial write then finishes what the full one started. The statistics
// count the restores tried.
func (w *Writer) Apply(ctx context.Context, p *Plan) (WriteStats, error) {
	if p.Full || w.last == nil {
		w.last = map[Table]map[string]chainRecord{}
	}
	for _, t := range w.opts.Tables {
		if w.last[t] == nil {
			w.last[t] = map[string]chainRecord{}
		}
	}
	st, err := p.apply(ctx, w.opts.IPTables, func(r *plannedRestore) {
		r.eachChain(func(t Table, name string, deleted bool) {
			if deleted {
				delete(w.last[t], name)
			} else {
				w.last[t][name] = p.written[t][name]
			}
		})
	})
	if err != nil {
		var ae *ApplyError
		if errors.As(err, &ae) {
			p.restores[ae.Restore].eachChain(func(t Table, name string, _ bool) {
				w.last[t][name] = chainRecord{unknown: true}
			})
		}
		w.relist = w.relist || p.relist
		return st, err
	}
	for t, names := range p.dropped {
		for _, name := range names {
			delete(w.last[t], name)
		}
	}
	if p.relist {
		w.relist = false
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
		done, err := p.apply(ctx, iface, nil)
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

// ChainDamage is a chain of a Writer's last write that the kernel holds
// fewer rules of, or fewer jumps to, than that write left (see Verify).
type ChainDamage struct {
	Table Table
	Chain string
	// Rules and Jumps are what the last write left: the chain's rules, and
	// the rules jumping or going to it (the writer's own and the external
	// ones Verify was given).
	Rules, Jumps int
	// Use is the kernel's use count of the chain (Interface.ChainUse); -1
	// when the chain is missing.
	Use int
}

func (d ChainDamage) String() string {
	if d.Use < 0 {
		return fmt.Sprintf("%s/%s is missing", d.Table, d.Chain)
	}
	return fmt.Sprintf("%s/%s has a use count of %d, want %d rules and %d jumps to it", d.Table, d.Chain, d.Use, d.Rules, d.Jumps)
}

// Verify checks, with one Interface.ChainUse per table, that every chain
// of the last write is still in the kernel with at least the rules and
// the jumps to it that the write left there: a chain flushed or deleted by
// someone else, a rule deleted from it, or a rule jumping to it deleted,
// lowers its use count (docs/design.md, "Flush detection"). external
// counts, per table and chain, the jumps to the writer's chains from rules
// it does not write (hooks in built-in chains). Rules someone else added
// are not noticed, nor a rule deleted and another added to the same
// chain. A chain whose record is unknown (a failed restore) is not
// checked. It returns the damaged chains, sorted; none before any write.
func (w *Writer) Verify(ctx context.Context, external map[Table]map[string]int) ([]ChainDamage, error) {
	var out []ChainDamage
	for _, t := range w.opts.Tables {
		records := w.last[t]
		if len(records) == 0 {
			continue
		}
		jumps := make(map[string]int, len(records))
		for name, n := range external[t] {
			jumps[name] += n
		}
		for _, rec := range records {
			if rec.unknown || rec.jumps == (unique.Handle[string]{}) {
				continue
			}
			for target := range strings.SplitSeq(rec.jumps.Value(), " ") {
				jumps[target]++
			}
		}
		use, err := w.opts.IPTables.ChainUse(ctx, t)
		if err != nil {
			return nil, err
		}
		for name, rec := range records {
			if rec.unknown {
				continue
			}
			got, ok := use[name]
			if !ok {
				got = -1
			}
			if got < rec.rules+jumps[name] {
				out = append(out, ChainDamage{Table: t, Chain: name, Rules: rec.rules, Jumps: jumps[name], Use: got})
			}
		}
	}
	slices.SortFunc(out, func(a, b ChainDamage) int {
		if c := strings.Compare(string(a.Table), string(b.Table)); c != 0 {
			return c
		}
		return strings.Compare(a.Chain, b.Chain)
	})
	return out, nil
}
