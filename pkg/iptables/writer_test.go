package iptables_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	. "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
)

func ownedByTest(_ Table, chain string) bool { return strings.HasPrefix(chain, "T-") }

// testRuleSet is svcs service groups (T-SVC-i, T-EP-i) in nat and a shared
// dispatch chain jumping to each, plus a filter chain.
func testRuleSet(svcs ...int) *RuleSet {
	rs := NewRuleSet()
	var dispatch []string
	for _, i := range svcs {
		rs.AddGroup(TableNAT,
			ChainRules{fmt.Sprintf("T-EP-%d", i), []string{fmt.Sprintf("-p tcp -j DNAT --to-destination 10.1.0.%d:80", i)}},
			ChainRules{fmt.Sprintf("T-SVC-%d", i), []string{fmt.Sprintf("-j T-EP-%d", i)}})
		dispatch = append(dispatch, fmt.Sprintf("-d 10.0.0.%d/32 -p tcp -m tcp --dport 80 -j T-SVC-%d", i, i))
	}
	rs.SetShared(TableNAT, "T-SERVICES", dispatch)
	rs.SetShared(TableFilter, "T-FORWARD", []string{"-j ACCEPT"})
	return rs
}

func TestWriterPlans(t *testing.T) {
	type step struct {
		rs    *RuleSet
		full  bool
		want  string     // the plan's String()
		stats WriteStats // Bytes is len(want)
	}
	for _, tc := range []struct {
		name  string
		setup string // restore input applied first (someone else's rules, leftovers)
		batch int
		steps []step
	}{
		{
			name: "full write, then nothing changes",
			steps: []step{
				{rs: testRuleSet(1), full: true, want: "*nat\n:T-EP-1 - [0:0]\n:T-SVC-1 - [0:0]\n:T-SERVICES - [0:0]\n" +
					"-A T-EP-1 -p tcp -j DNAT --to-destination 10.1.0.1:80\n-A T-SVC-1 -j T-EP-1\n" +
					"-A T-SERVICES -d 10.0.0.1/32 -p tcp -m tcp --dport 80 -j T-SVC-1\nCOMMIT\n" +
					"*filter\n:T-FORWARD - [0:0]\n-A T-FORWARD -j ACCEPT\nCOMMIT\n",
					stats: WriteStats{Restores: 1, ChainsWritten: 4, RulesWritten: 4, RulesWrittenByTable: map[Table]int{TableNAT: 3, TableFilter: 1}}},
				{rs: testRuleSet(1), want: ""},
			},
		},
		{
			name: "partial write carries the changed chains only",
			steps: []step{
				{rs: testRuleSet(1, 2), full: true},
				{rs: func() *RuleSet {
					rs := testRuleSet(1, 2)
					rs.Groups[1].Chains[0].Rules = []string{"-p tcp -j DNAT --to-destination 10.1.9.9:80"}
					return rs
				}(), want: "*nat\n:T-EP-2 - [0:0]\n-A T-EP-2 -p tcp -j DNAT --to-destination 10.1.9.9:80\nCOMMIT\n",
					stats: WriteStats{Restores: 1, ChainsWritten: 1, RulesWritten: 1, RulesWrittenByTable: map[Table]int{TableNAT: 1}}},
			},
		},
		{
			name: "a removed group's chains are deleted with the new dispatch chain",
			steps: []step{
				{rs: testRuleSet(1, 2), full: true},
				{rs: testRuleSet(1), want: "*nat\n:T-SERVICES - [0:0]\n:T-EP-2 - [0:0]\n:T-SVC-2 - [0:0]\n" +
					"-A T-SERVICES -d 10.0.0.1/32 -p tcp -m tcp --dport 80 -j T-SVC-1\n-X T-EP-2\n-X T-SVC-2\nCOMMIT\n",
					stats: WriteStats{Restores: 1, ChainsWritten: 1, ChainsDeleted: 2, RulesWritten: 1, RulesWrittenByTable: map[Table]int{TableNAT: 1}}},
			},
		},
		{
			name:  "a full write deletes owned leftovers and keeps others' chains",
			setup: "*nat\n:T-OLD - [0:0]\n:MINE - [0:0]\n-A MINE -j RETURN\nCOMMIT\n*filter\n:T-GONE - [0:0]\nCOMMIT\n",
			steps: []step{
				{rs: testRuleSet(), full: true, want: "*nat\n:T-SERVICES - [0:0]\n:T-OLD - [0:0]\n-X T-OLD\nCOMMIT\n" +
					"*filter\n:T-FORWARD - [0:0]\n:T-GONE - [0:0]\n-A T-FORWARD -j ACCEPT\n-X T-GONE\nCOMMIT\n",
					stats: WriteStats{Restores: 1, ChainsWritten: 2, ChainsDeleted: 2, RulesWritten: 1, RulesWrittenByTable: map[Table]int{TableNAT: 0, TableFilter: 1}}},
			},
		},
		{
			name:  "batches hold whole groups; shared chains and deletions come last",
			batch: 3,
			steps: []step{
				{rs: testRuleSet(1, 2, 3), full: true},
				{rs: testRuleSet(4, 5, 6), want: "*nat\n:T-EP-4 - [0:0]\n:T-SVC-4 - [0:0]\n:T-EP-5 - [0:0]\n:T-SVC-5 - [0:0]\n" +
					"-A T-EP-4 -p tcp -j DNAT --to-destination 10.1.0.4:80\n-A T-SVC-4 -j T-EP-4\n" +
					"-A T-EP-5 -p tcp -j DNAT --to-destination 10.1.0.5:80\n-A T-SVC-5 -j T-EP-5\nCOMMIT\n" +
					"*nat\n:T-EP-6 - [0:0]\n:T-SVC-6 - [0:0]\n:T-SERVICES - [0:0]\n" +
					":T-EP-1 - [0:0]\n:T-EP-2 - [0:0]\n:T-EP-3 - [0:0]\n:T-SVC-1 - [0:0]\n:T-SVC-2 - [0:0]\n:T-SVC-3 - [0:0]\n" +
					"-A T-EP-6 -p tcp -j DNAT --to-destination 10.1.0.6:80\n-A T-SVC-6 -j T-EP-6\n" +
					"-A T-SERVICES -d 10.0.0.4/32 -p tcp -m tcp --dport 80 -j T-SVC-4\n" +
					"-A T-SERVICES -d 10.0.0.5/32 -p tcp -m tcp --dport 80 -j T-SVC-5\n" +
					"-A T-SERVICES -d 10.0.0.6/32 -p tcp -m tcp --dport 80 -j T-SVC-6\n" +
					"-X T-EP-1\n-X T-EP-2\n-X T-EP-3\n-X T-SVC-1\n-X T-SVC-2\n-X T-SVC-3\nCOMMIT\n",
					stats: WriteStats{Restores: 2, ChainsWritten: 7, ChainsDeleted: 6, RulesWritten: 9, RulesWrittenByTable: map[Table]int{TableNAT: 9}}},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			fake := iptablestest.NewFake(ProtocolIPv4)
			if tc.setup != "" {
				if err := fake.Restore(ctx, []byte(tc.setup)); err != nil {
					t.Fatal(err)
				}
			}
			w, err := NewWriter(WriterOptions{IPTables: fake, Owned: ownedByTest, BatchChains: tc.batch})
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range tc.steps {
				p, err := w.Plan(ctx, s.rs, s.full)
				if err != nil {
					t.Fatalf("step %d: plan: %v", i, err)
				}
				if got := p.String(); s.want != "" && got != s.want {
					t.Errorf("step %d: plan\n%s\nwant\n%s", i, got, s.want)
				}
				if s.want == "" && i > 0 && !p.Empty() {
					t.Errorf("step %d: plan is not empty:\n%s", i, p)
				}
				before := fake.RestoreCount()
				st, err := w.Apply(ctx, p)
				if err != nil {
					t.Fatalf("step %d: apply: %v", i, err)
				}
				if n := fake.RestoreCount() - before; n != st.Restores || n != len(p.Restores()) {
					t.Errorf("step %d: %d restores run, stats say %d, plan has %d", i, n, st.Restores, len(p.Restores()))
				}
				if strings.Join(p.Restores(), "") != p.String() {
					t.Errorf("step %d: String() is not the restores' input", i)
				}
				if s.want != "" {
					st.RestoreTime = 0
					s.stats.Bytes = len(s.want)
					if fmt.Sprint(st) != fmt.Sprint(s.stats) {
						t.Errorf("step %d: stats %+v, want %+v", i, st, s.stats)
					}
				}
				checkWritten(t, fake, s.rs)
			}
			if !slices.Contains(fake.Chains(TableNAT), "MINE") && tc.setup != "" {
				t.Error("a chain the writer does not own was deleted")
			}
		})
	}
}

// checkWritten checks that the kernel's owned chains are exactly rs's.
func checkWritten(t *testing.T, fake *iptablestest.Fake, rs *RuleSet) {
	t.Helper()
	for _, table := range []Table{TableNAT, TableFilter} {
		want := map[string][]string{}
		for _, g := range rs.Groups {
			if g.Table == table {
				for _, c := range g.Chains {
					want[c.Name] = c.Rules
				}
			}
		}
		for name, rules := range rs.Shared[table] {
			want[name] = rules
		}
		for _, c := range fake.Chains(table) {
			if !ownedByTest(table, c) {
				continue
			}
			rules, ok := want[c]
			if !ok {
				t.Errorf("%s/%s left in the kernel", table, c)
				continue
			}
			if got := fake.Rules(table, Chain(c)); !slices.Equal(got, rules) && len(got)+len(rules) > 0 {
				t.Errorf("%s/%s holds %q, want %q", table, c, got, rules)
			}
			delete(want, c)
		}
		for c := range want {
			t.Errorf("%s/%s missing from the kernel", table, c)
		}
	}
}

// failingRestore fails the restores numbered in fail (1-based).
type failingRestore struct {
	*iptablestest.Fake
	n    int
	fail map[int]bool
}

func (f *failingRestore) Restore(ctx context.Context, data []byte) error {
	f.n++
	if f.fail[f.n] {
		return errors.New("injected failure")
	}
	return f.Fake.Restore(ctx, data)
}

// TestWriterAfterFailure: a failed write keeps the record of the restores
// it applied; the next write, full or not, carries the chains of the failed
// restore and, after a failed full write, what it had not written yet, and
// deletes the owned chains it does not want.
func TestWriterAfterFailure(t *testing.T) {
	for _, tc := range []struct {
		name string
		// first is written fully and successfully; second fails at
		// restore fail (1-based, counted from the second write).
		first      []int
		second     []int
		secondFull bool
		batch      int
		fail       int
		// wantChains and wantDeleted: what the next partial write of
		// second carries.
		wantChains, wantDeleted int
	}{
		{
			name: "failed partial write: its chains only", first: []int{1}, second: []int{1, 2}, fail: 1,
			// T-EP-2, T-SVC-2, T-SERVICES.
			wantChains: 3,
		},
		{
			name: "failed full write in its second batch: the rest, and the deletions", first: []int{1, 4}, second: []int{1, 2, 3}, secondFull: true, batch: 2, fail: 2,
			// Group 2 (failed) and group 3 (not written), T-SERVICES and
			// T-FORWARD (not written); T-EP-4 and T-SVC-4 deleted.
			wantChains: 6, wantDeleted: 2,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			iface := &failingRestore{Fake: iptablestest.NewFake(ProtocolIPv4), fail: map[int]bool{}}
			w, err := NewWriter(WriterOptions{IPTables: iface, Owned: ownedByTest, BatchChains: tc.batch})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := w.Write(ctx, testRuleSet(tc.first...), true); err != nil {
				t.Fatal(err)
			}
			iface.fail[iface.n+tc.fail] = true
			_, err = w.Write(ctx, testRuleSet(tc.second...), tc.secondFull)
			var ae *ApplyError
			if !errors.As(err, &ae) || ae.Restore != tc.fail-1 || ae.Line != 0 {
				t.Fatalf("failed write: %v; want an ApplyError of restore %d naming no line", err, tc.fail)
			}
			p, err := w.Plan(ctx, testRuleSet(tc.second...), false)
			if err != nil {
				t.Fatal(err)
			}
			if st := p.Stats(); st.ChainsWritten != tc.wantChains || st.ChainsDeleted != tc.wantDeleted {
				t.Errorf("the write after the failure carries %d chains and deletes %d, want %d and %d:\n%s",
					st.ChainsWritten, st.ChainsDeleted, tc.wantChains, tc.wantDeleted, p)
			}
			if _, err := w.Apply(ctx, p); err != nil {
				t.Fatal(err)
			}
			// The kernel now holds exactly the second rule set, and the
			// writer knows it.
			checkWritten(t, iface.Fake, testRuleSet(tc.second...))
			if p, err := w.Plan(ctx, testRuleSet(tc.second...), false); err != nil || !p.Empty() {
				t.Errorf("a further write is %v, %v; want nothing", p, err)
			}
		})
	}
}

// TestWriterApplyErrorNamesTheLine: a refused rule is reported with its
// line, its text and its table, and the chains of the failed restore.
func TestWriterApplyErrorNamesTheLine(t *testing.T) {
	for _, tc := range []struct {
		name     string
		atCommit bool
		wantText string
	}{
		{name: "the rule's line (iptables-nft)", wantText: "-A T-FORWARD -j ACCEPT"},
		{name: "the COMMIT line (iptables-legacy)", atCommit: true, wantText: "COMMIT"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := iptablestest.NewFake(ProtocolIPv4)
			fake.SetRefusal(func(table Table, chain Chain, args []string) error {
				if chain == "T-FORWARD" {
					return errors.New("no such match")
				}
				return nil
			}, tc.atCommit)
			w, err := NewWriter(WriterOptions{IPTables: fake, Owned: ownedByTest})
			if err != nil {
				t.Fatal(err)
			}
			_, err = w.Write(context.Background(), testRuleSet(1), true)
			var ae *ApplyError
			if !errors.As(err, &ae) {
				t.Fatalf("write: %v, want an ApplyError", err)
			}
			if ae.Line == 0 || ae.Text != tc.wantText || ae.Table != TableFilter {
				t.Errorf("blamed line %d %q in table %q, want %q in filter", ae.Line, ae.Text, ae.Table, tc.wantText)
			}
			if !slices.Equal(ae.Written[TableFilter], []string{"T-FORWARD"}) || len(ae.Written[TableNAT]) != 3 {
				t.Errorf("failed restore wrote %v", ae.Written)
			}
			// nat was committed before filter failed, as iptables-restore does.
			if got := fake.Rules(TableNAT, "T-SVC-1"); len(got) != 1 {
				t.Errorf("nat T-SVC-1 = %q, want its rule", got)
			}
		})
	}
}

func TestWriterRejectsUnknownTable(t *testing.T) {
	w, err := NewWriter(WriterOptions{IPTables: iptablestest.NewFake(ProtocolIPv4), Owned: ownedByTest, Tables: []Table{TableNAT}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Plan(context.Background(), testRuleSet(1), true); err == nil {
		t.Error("a rule set with filter chains was planned by a nat-only writer")
	}
	for _, opts := range []WriterOptions{{Owned: ownedByTest}, {IPTables: iptablestest.NewFake(ProtocolIPv4)}} {
		if _, err := NewWriter(opts); err == nil {
			t.Errorf("NewWriter(%+v) succeeded", opts)
		}
	}
}

func TestRemoveChains(t *testing.T) {
	ctx := context.Background()
	fake := iptablestest.NewFake(ProtocolIPv4)
	if err := fake.Restore(ctx, []byte("*nat\n:T-A - [0:0]\n:T-B - [0:0]\n:MINE - [0:0]\n"+
		"-A PREROUTING -m comment --comment \"t hook\" -j T-A\n-A PREROUTING -j MINE\n"+
		"-A MINE -g T-B\n-A T-A -j T-B\n-A T-B -j RETURN\nCOMMIT\n")); err != nil {
		t.Fatal(err)
	}
	p, err := PlanRemoval(ctx, fake, TableNAT, ownedByTest)
	if err != nil {
		t.Fatal(err)
	}
	want := "*nat\n:T-A - [0:0]\n:T-B - [0:0]\n" +
		"-D PREROUTING -m comment --comment \"t hook\" -j T-A\n-D MINE -g T-B\n-X T-A\n-X T-B\nCOMMIT\n"
	if p.String() != want {
		t.Errorf("removal plan\n%s\nwant\n%s", p, want)
	}
	for i := 1; i <= 2; i++ {
		st, err := RemoveChains(ctx, fake, []Table{TableNAT, TableFilter}, ownedByTest)
		if err != nil {
			t.Fatalf("removal %d: %v", i, err)
		}
		if wantDeleted := 2 * boolToInt(i == 1); st.ChainsDeleted != wantDeleted || st.RulesDeleted != wantDeleted {
			t.Errorf("removal %d deleted %d chains and %d rules, want %d of each", i, st.ChainsDeleted, st.RulesDeleted, wantDeleted)
		}
	}
	if got := fake.Chains(TableNAT); slices.Contains(got, "T-A") || slices.Contains(got, "T-B") || !slices.Contains(got, "MINE") {
		t.Errorf("nat chains after removal: %v", got)
	}
	if got := fake.Rules(TableNAT, ChainPrerouting); !slices.Equal(got, []string{"-j MINE"}) {
		t.Errorf("PREROUTING after removal: %v", got)
	}
}

func boolToInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

func TestEnsureJumpRules(t *testing.T) {
	ctx := context.Background()
	fake := iptablestest.NewFake(ProtocolIPv4)
	if err := fake.Restore(ctx, []byte("*filter\n:T-A - [0:0]\n:T-B - [0:0]\n:OTHER - [0:0]\n-A INPUT -j OTHER\nCOMMIT\n")); err != nil {
		t.Fatal(err)
	}
	rules := []JumpRule{
		Jump(TableFilter, ChainInput, "first", "T-A", "-m", "conntrack", "--ctstate", "NEW"),
		Jump(TableFilter, ChainInput, "second", "T-B"),
		{Table: TableFilter, Chain: ChainInput, Args: []string{"-j", "T-B"}, Position: Append},
	}
	want := []string{
		`-m conntrack --ctstate NEW -m comment --comment first -j T-A`,
		`-m comment --comment second -j T-B`,
		`-j OTHER`,
		`-j T-B`,
	}
	for i := 1; i <= 2; i++ {
		if err := EnsureJumpRules(ctx, fake, rules); err != nil {
			t.Fatal(err)
		}
		if got := fake.Rules(TableFilter, ChainInput); !slices.Equal(got, want) {
			t.Errorf("ensure %d: INPUT holds\n%q\nwant\n%q", i, got, want)
		}
	}
}

// lazyRuleSet is testRuleSet(svcs...) with its groups given lazily; renders
// counts the calls to their Render functions, and rules overrides the
// rules of T-EP-i.
func lazyRuleSet(renders *int, rules map[int]string, svcs ...int) *RuleSet {
	rs := testRuleSet(svcs...)
	for i, g := range rs.Groups {
		chains := g.Chains
		names := []string{chains[0].Name, chains[1].Name}
		svc := svcs[i]
		rs.Groups[i] = ChainGroup{Table: g.Table, Names: names, Render: func() []ChainRules {
			*renders++
			out := slices.Clone(chains)
			if r, ok := rules[svc]; ok {
				out[0].Rules = []string{r}
			}
			return out
		}}
	}
	return rs
}

func TestWriterLazyGroups(t *testing.T) {
	ctx := context.Background()
	fake := iptablestest.NewFake(ProtocolIPv4)
	w, err := NewWriter(WriterOptions{IPTables: fake, Owned: ownedByTest, BatchChains: 2})
	if err != nil {
		t.Fatal(err)
	}
	renders := 0
	write := func(step string, rs *RuleSet, full bool, wantRenders, wantChains int) {
		t.Helper()
		renders = 0
		st, err := w.Write(ctx, rs, full)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		if renders != wantRenders || st.ChainsWritten != wantChains {
			t.Errorf("%s: %d renders and %d chains written, want %d and %d", step, renders, st.ChainsWritten, wantRenders, wantChains)
		}
		if got, want := w.RuleCount(TableNAT)+w.RuleCount(TableFilter), 2*len(rs.Groups)+len(rs.Groups)+1; got != want {
			t.Errorf("%s: writer counts %d rules, want %d", step, got, want)
		}
	}

	// A full write renders every lazy group once, batch by batch.
	write("full", lazyRuleSet(&renders, nil, 1, 2, 3), true, 3, 8)
	checkWritten(t, fake, testRuleSet(1, 2, 3))
	// A partial write takes lazy groups as unchanged.
	write("partial, nothing changed", lazyRuleSet(&renders, nil, 1, 2, 3), false, 0, 0)
	// A new lazy group is written; an eager group is compared with the
	// record of a lazy one.
	rs := lazyRuleSet(&renders, nil, 1, 2, 4)
	rs.Groups[1] = testRuleSet(2).Groups[0]
	rs.Groups[1].Chains[0].Rules = []string{"-p tcp -j DNAT --to-destination 10.1.9.9:80"}
	write("partial, a new group and a changed one", rs, false, 1, 4)
	want := testRuleSet(1, 2, 4)
	want.Groups[1].Chains[0].Rules = rs.Groups[1].Chains[0].Rules
	checkWritten(t, fake, want)
	// After Forget, lazy groups are written again, even in a partial write.
	w.Forget()
	write("partial after Forget", lazyRuleSet(&renders, map[int]string{2: "-j RETURN"}, 1, 2, 4), false, 3, 8)
	want.Groups[1].Chains[0].Rules = []string{"-j RETURN"}
	checkWritten(t, fake, want)

	// A lazy group that renders other chains than it names fails the write.
	bad := testRuleSet(5)
	bad.Groups[0] = ChainGroup{Table: TableNAT, Names: []string{"T-EP-5", "T-SVC-5"}, Render: func() []ChainRules {
		return []ChainRules{{Name: "T-EP-5"}}
	}}
	if _, err := w.Write(ctx, bad, false); err == nil {
		t.Error("a lazy group rendering other chains was written")
	}
}

func TestWriterDropsRecordOfUnownedChains(t *testing.T) {
	ctx := context.Background()
	fake := iptablestest.NewFake(ProtocolIPv4)
	w, err := NewWriter(WriterOptions{IPTables: fake, Owned: ownedByTest})
	if err != nil {
		t.Fatal(err)
	}
	rs := testRuleSet(1)
	rs.SetShared(TableNAT, "OTHER", []string{"-j RETURN", "-j RETURN"})
	if _, err := w.Write(ctx, rs, true); err != nil {
		t.Fatal(err)
	}
	if got := w.RuleCount(TableNAT); got != 5 {
		t.Errorf("nat rules after the first write: %d, want 5", got)
	}
	st, err := w.Write(ctx, testRuleSet(1), false)
	if err != nil {
		t.Fatal(err)
	}
	if st.ChainsDeleted != 0 || !slices.Contains(fake.Chains(TableNAT), "OTHER") {
		t.Errorf("a chain the writer does not own was deleted (%d deletions)", st.ChainsDeleted)
	}
	if got := w.RuleCount(TableNAT); got != 3 {
		t.Errorf("nat rules after dropping OTHER: %d, want 3", got)
	}
}
