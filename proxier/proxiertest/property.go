package proxiertest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strings"
	"testing"

	"github.com/go-logr/logr/funcr"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/proxier"
)

// The property test: a long random sequence of Service, EndpointSlice and
// Node changes goes, one batch at a time, through an engine whose backend
// syncs partially after its first full sync. After every sync, a fresh
// engine and backend on fresh fakes are given the same objects and do one
// full sync; the two fake kernels must hold the same state (StateDumper)
// and treat every flow to the objects' destinations, and to destinations
// that earlier objects had, the same way.

// StateDumper is an optional Tracer interface for the property test: the
// kernel state the backend programmed, as text that is the same for two
// kernels with the same state (one item per line; lines whose order carries
// no meaning sorted).
type StateDumper interface {
	DumpState() (StateDump, error)
}

// StateDump is a fake kernel's state.
type StateDump struct {
	// State must be the same after partial syncs as after one full sync of
	// the same objects.
	State string
	// Leftovers is state that only a history of syncs leaves, legitimately
	// (an IPVS real server kept at weight 0 while its connections drain):
	// reported on a mismatch, never compared.
	Leftovers string
}

// ConnectionSimulator is an optional Tracer interface for the property
// test: after each sync of the engine under test, Simulate opens and
// closes connections in the fake kernel (IPVS: real servers' connection
// counts), so that the following syncs meet graceful termination. A fresh
// kernel has no connection.
type ConnectionSimulator interface {
	SimulateConnections(r *rand.Rand) error
}

// Change is one object change of a scenario: exactly one of Service, Slice
// and Node is set. Without Delete the object is added or replaces the one
// of the same name; with Delete the object of that name is deleted.
type Change struct {
	Service *v1.Service
	Slice   *discovery.EndpointSlice
	Node    *v1.Node
	Delete  bool
}

// Scenario is an environment and batches of changes; each batch is
// followed by a sync.
type Scenario struct {
	Name    string
	Env     Env
	Batches [][]Change
}

// PropertyOptions tunes RunProperty and RunScenario.
type PropertyOptions struct {
	// FlowsPerStep is how many flows, drawn at random from every
	// destination seen so far, are traced after each step; default 24.
	// Every flow is traced after a step whose states differ. (When the
	// dumps cover everything the tracers read, equal states trace equally:
	// the sampled flows guard against a dump that misses something.)
	FlowsPerStep int
	// Shrink, on a failure, looks for a smaller scenario that still fails
	// and reports it (slow). The environment variable
	// KPROXY_PROPERTY_SHRINK=1 sets it too.
	Shrink bool
}

// PropertyRuns is the size of the seeded property run in `make test`:
// seeds 1..seeds, steps batches each; smaller with -short or under the race
// detector, which slows the fakes down several times.
func PropertyRuns() (seeds, steps int) {
	switch {
	case raceEnabled:
		return 4, 40
	case testing.Short():
		return 6, 40
	}
	return 20, 60
}

// RunProperties runs RunProperty for each of PropertyRuns' seeds and
// RunScenario for each of PropertyRegressions, as subtests.
func RunProperties(t *testing.T, factory Factory, opts PropertyOptions) {
	seeds, steps := PropertyRuns()
	for seed := 1; seed <= seeds; seed++ {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			RunProperty(t, uint64(seed), steps, factory, opts)
		})
	}
	for _, sc := range PropertyRegressions() {
		t.Run(sc.Name, func(t *testing.T) { RunScenario(t, sc, factory, opts) })
	}
}

// FuzzProperty fuzzes RunProperty over the seed and the number of steps
// (1 to 120), for long runs.
func FuzzProperty(f *testing.F, factory Factory, opts PropertyOptions) {
	f.Add(uint64(1000), uint8(30))
	f.Add(uint64(1001), uint8(30))
	f.Fuzz(func(t *testing.T, seed uint64, steps uint8) {
		RunProperty(t, seed, 1+int(steps)%120, factory, opts)
	})
}

// RunProperty runs the generated scenario of seed (see GenerateScenario)
// against the factory's backend; on a failure it names the seed and step
// and shows the changes that led there.
func RunProperty(t *testing.T, seed uint64, steps int, factory Factory, opts PropertyOptions) {
	t.Helper()
	RunScenario(t, GenerateScenario(seed, steps), factory, opts)
}

// RunScenario checks, after every batch of sc, that partial syncs left the
// kernel as a full sync of the same objects does (see StateDumper and
// PropertyOptions).
func RunScenario(t *testing.T, sc Scenario, factory Factory, opts PropertyOptions) {
	t.Helper()
	if opts.FlowsPerStep <= 0 {
		opts.FlowsPerStep = 24
	}
	if os.Getenv("KPROXY_PROPERTY_SHRINK") == "1" {
		opts.Shrink = true
	}
	f, summary := runScenario(t, sc, factory, opts)
	if f == nil {
		t.Logf("%s: %s", sc.Name, summary)
		return
	}
	msg := f.report(sc)
	if opts.Shrink {
		small := shrink(t, sc, factory, opts)
		if g, _ := runScenario(t, small, factory, opts); g != nil {
			msg += "\n\nsmallest failing scenario found:\n" + describeScenario(small) + "\n" + g.detail
		}
	} else {
		msg += "\n(set KPROXY_PROPERTY_SHRINK=1 to look for a smaller failing scenario)"
	}
	t.Fatal(msg)
}

// failure is the first step of a scenario where the engines disagree.
type failure struct {
	step   int
	detail string
}

func (f *failure) report(sc Scenario) string {
	var b strings.Builder
	fmt.Fprintf(&b, "scenario %s: after step %d of %d, partial syncs and a full sync disagree\n", sc.Name, f.step, len(sc.Batches))
	fmt.Fprintf(&b, "environment: %s\n", describeEnv(sc.Env))
	from := max(0, f.step-3)
	if from > 0 {
		fmt.Fprintf(&b, "(%d earlier steps not shown)\n", from)
	}
	for i := from; i <= f.step; i++ {
		fmt.Fprintf(&b, "step %d:\n", i)
		for _, c := range sc.Batches[i] {
			fmt.Fprintf(&b, "  %s\n", c)
		}
	}
	b.WriteString(f.detail)
	return b.String()
}

func describeEnv(e Env) string {
	return fmt.Sprintf("node %s %v clusterCIDR=%v masqueradeAll=%v nodePortAddresses=%v", e.NodeName, e.NodeIPs, e.ClusterCIDR, e.MasqueradeAll, e.NodePortAddresses)
}

func describeScenario(sc Scenario) string {
	var b strings.Builder
	fmt.Fprintf(&b, "environment: %s\n", describeEnv(sc.Env))
	for i, batch := range sc.Batches {
		fmt.Fprintf(&b, "step %d:\n", i)
		for _, c := range batch {
			fmt.Fprintf(&b, "  %s\n", c)
		}
	}
	return b.String()
}

// newPropertyEngine builds an engine over backend, with its caches synced.
func newPropertyEngine(t *testing.T, env Env, backend proxier.Backend, onSync func(proxier.SyncResult)) *proxier.Engine {
	t.Helper()
	e := NewEngine(t, backend, EngineOptions{Env: env, OnSync: onSync,
		// Malformed annotations are logged on every sync of a fresh engine.
		// (logr.Discard has no sink, which means "klog" to the engine.)
		Logger: funcr.New(func(string, string) {}, funcr.Options{}),
	})
	e.OnNodeSynced()
	return e
}

// runScenario runs sc and returns its first failure, nil when it passes,
// and a summary of what it exercised.
func runScenario(t *testing.T, sc Scenario, factory Factory, opts PropertyOptions) (*failure, string) {
	t.Helper()
	ctx := context.Background()
	backendA, tracerA := factory(t, sc.Env)
	dumperA, ok := tracerA.(StateDumper)
	if !ok {
		t.Fatalf("the tracer %T is not a StateDumper", tracerA)
	}
	partial := 0
	engineA := newPropertyEngine(t, sc.Env, backendA, func(r proxier.SyncResult) {
		if !r.Full {
			partial++
		}
	})

	seed := uint64(len(sc.Batches))
	for _, c := range sc.Name {
		seed = seed*31 + uint64(c)
	}
	r := rand.New(rand.NewPCG(seed, 7))
	w := newWorld()
	seen := map[flowKey]Flow{}
	verdictCounts := map[string]int{}
	for step, batch := range sc.Batches {
		for _, c := range batch {
			w.apply(c, engineA)
		}
		if err := engineA.SyncRules(ctx); err != nil {
			return &failure{step, fmt.Sprintf("partial sync failed: %v", err)}, ""
		}

		backendB, tracerB := factory(t, sc.Env)
		engineB := newPropertyEngine(t, sc.Env, backendB, nil)
		w.feed(engineB)
		if err := engineB.SyncRules(ctx); err != nil {
			return &failure{step, fmt.Sprintf("full sync of the same objects failed: %v", err)}, ""
		}
		dumpA, err := dumperA.DumpState()
		if err != nil {
			return &failure{step, fmt.Sprintf("dumping the partially synced state: %v", err)}, ""
		}
		dumpB, err := tracerB.(StateDumper).DumpState()
		if err != nil {
			return &failure{step, fmt.Sprintf("dumping the fully synced state: %v", err)}, ""
		}

		for _, f := range flowsOf(w, sc.Env) {
			k := flowKey{f.Protocol, f.Source, f.Dest, f.Port, f.Origin}
			if _, ok := seen[k]; !ok {
				seen[k] = f
			}
		}
		flows := sortedFlows(seen)
		statesDiffer := dumpA.State != dumpB.State
		if !statesDiffer && len(flows) > opts.FlowsPerStep {
			r.Shuffle(len(flows), func(i, j int) { flows[i], flows[j] = flows[j], flows[i] })
			flows = flows[:opts.FlowsPerStep]
		}
		var verdicts []string
		for _, f := range flows {
			a, b := traceString(tracerA, f), traceString(tracerB, f)
			verdictCounts[strings.SplitN(a, " ", 2)[0]]++
			if a != b {
				verdicts = append(verdicts, fmt.Sprintf("  %s (%s %s -> %s:%d):\n    partial syncs: %s\n    full sync:     %s",
					f.Name, f.Protocol, f.Source, f.Dest, f.Port, a, b))
			}
		}
		if statesDiffer || len(verdicts) > 0 {
			var b strings.Builder
			if statesDiffer {
				fmt.Fprintf(&b, "kernel state (- partial syncs, + full sync):\n%s", diffLines(dumpA.State, dumpB.State))
				if dumpA.Leftovers != "" {
					fmt.Fprintf(&b, "leftovers of the partial syncs (not compared):\n%s", dumpA.Leftovers)
				}
			}
			if len(verdicts) > 0 {
				fmt.Fprintf(&b, "flows traced differently:\n%s\n", strings.Join(verdicts, "\n"))
			}
			return &failure{step, b.String()}, ""
		}
		if sim, ok := tracerA.(ConnectionSimulator); ok {
			if err := sim.SimulateConnections(r); err != nil {
				return &failure{step, fmt.Sprintf("simulating connections: %v", err)}, ""
			}
		}
	}
	summary := fmt.Sprintf("%d steps, %d partial syncs, %d destinations seen, traced verdicts %v", len(sc.Batches), partial, len(seen), verdictCounts)
	if len(sc.Batches) > 3 && partial == 0 {
		return &failure{len(sc.Batches) - 1, "no sync of the engine under test was partial: the scenario tests nothing"}, summary
	}
	return nil, summary
}

func sortedFlows(m map[flowKey]Flow) []Flow {
	out := make([]Flow, 0, len(m))
	for _, f := range m {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.Dest != b.Dest {
			return a.Dest < b.Dest
		}
		if a.Port != b.Port {
			return a.Port < b.Port
		}
		if a.Protocol != b.Protocol {
			return a.Protocol < b.Protocol
		}
		if a.Source != b.Source {
			return a.Source < b.Source
		}
		return a.Origin < b.Origin
	})
	return out
}

// traceString is a flow's traced outcome as text.
func traceString(tr Tracer, f Flow) string {
	res, err := tr.Trace(f)
	if err != nil {
		return "error: " + err.Error()
	}
	eps := make([]string, 0, len(res.Endpoints))
	for ep, masq := range res.Endpoints {
		if masq {
			ep += " (masqueraded)"
		}
		eps = append(eps, ep)
	}
	sort.Strings(eps)
	out := string(res.Verdict)
	if res.Masquerade {
		out += " masquerade"
	}
	if len(eps) > 0 {
		out += " to " + strings.Join(eps, ", ")
	}
	return out
}

// diffLines shows the lines only in a ("-") and only in b ("+"); when both
// hold the same lines in another order, the first lines that differ.
func diffLines(a, b string) string {
	la, lb := strings.Split(a, "\n"), strings.Split(b, "\n")
	count := map[string]int{}
	for _, l := range la {
		count[l]++
	}
	for _, l := range lb {
		count[l]--
	}
	var out strings.Builder
	for _, l := range la {
		if count[l] > 0 {
			count[l]--
			fmt.Fprintf(&out, "- %s\n", l)
		}
	}
	for _, l := range lb {
		if count[l] < 0 {
			count[l]++
			fmt.Fprintf(&out, "+ %s\n", l)
		}
	}
	if out.Len() > 0 {
		return out.String()
	}
	for i := range min(len(la), len(lb)) {
		if la[i] != lb[i] {
			from, to := max(0, i-3), min(len(la), i+4)
			fmt.Fprintf(&out, "same lines in another order; partial syncs, from line %d:\n  %s\nfull sync:\n  %s\n", from+1,
				strings.Join(la[from:to], "\n  "), strings.Join(lb[from:min(len(lb), i+4)], "\n  "))
			break
		}
	}
	return out.String()
}

// shrink looks for a smaller scenario that still fails: it drops batches
// after the first failure, then single batches, then single changes, as
// long as the scenario keeps failing.
func shrink(t *testing.T, sc Scenario, factory Factory, opts PropertyOptions) Scenario {
	t.Helper()
	attempts := 0
	fails := func(c Scenario) bool {
		attempts++
		f, _ := runScenario(t, c, factory, opts)
		return f != nil
	}
	if f, _ := runScenario(t, sc, factory, opts); f != nil {
		sc.Batches = sc.Batches[:f.step+1]
	}
	for progress := true; progress && attempts < 2000; {
		progress = false
		for i := len(sc.Batches) - 1; i >= 0 && attempts < 2000; i-- {
			c := sc
			c.Batches = append(append([][]Change{}, sc.Batches[:i]...), sc.Batches[i+1:]...)
			if fails(c) {
				sc, progress = c, true
			}
		}
		for i := len(sc.Batches) - 1; i >= 0; i-- {
			for j := len(sc.Batches[i]) - 1; j >= 0 && attempts < 2000; j-- {
				if j >= len(sc.Batches[i]) {
					continue
				}
				c := sc
				c.Batches = append([][]Change{}, sc.Batches...)
				c.Batches[i] = append(append([]Change{}, sc.Batches[i][:j]...), sc.Batches[i][j+1:]...)
				if fails(c) {
					sc, progress = c, true
				}
			}
		}
		// Merge neighbouring batches (fewer syncs).
		for i := len(sc.Batches) - 2; i >= 0 && attempts < 2000; i-- {
			c := sc
			c.Batches = append([][]Change{}, sc.Batches[:i]...)
			c.Batches = append(c.Batches, append(append([]Change{}, sc.Batches[i]...), sc.Batches[i+1]...))
			c.Batches = append(c.Batches, sc.Batches[i+2:]...)
			if fails(c) {
				sc, progress = c, true
			}
		}
	}
	sc.Name += " (shrunk)"
	return sc
}

// DumpIPTables is the canonical text of the given tables of an iptables
// interface: iptables-save output without comments or counters.
func DumpIPTables(ctx context.Context, iface ipt.Interface, tables ...ipt.Table) (string, error) {
	var b strings.Builder
	for _, table := range tables {
		data, err := iface.SaveInto(ctx, table)
		if err != nil {
			return "", fmt.Errorf("saving %s: %w", table, err)
		}
		for _, line := range strings.Split(string(data), "\n") {
			if line == "" || strings.HasPrefix(line, "#") || line == "COMMIT" {
				continue
			}
			if strings.HasPrefix(line, ":") {
				line = strings.TrimSuffix(line, " [0:0]")
			}
			fmt.Fprintf(&b, "%s %s\n", table, line)
		}
	}
	return b.String(), nil
}
