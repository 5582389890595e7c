package nftables

import (
	"context"
	"fmt"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/clock"
	"sigs.k8s.io/knftables"

	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// memNFT is a knftables.Interface over hash maps, for measuring the
// backend's own cost at scale (knftables.Fake looks elements up one by one
// and needs minutes for 100,000 of them). It keeps object names, elements,
// the rules of every chain and the hook of base chains (for walkFirstPacket),
// and checks nothing.
type memNFT struct {
	noRuleListing
	exists bool
	chains map[string]bool
	sets   map[string]map[string]*knftables.Element
	isMap  map[string]bool
	// rules holds each chain's rules in order, hooks the base chains'
	// hook and priority.
	rules map[string][]string
	hooks map[string]memHook
}

type memHook struct {
	hook     string
	priority int
}

func newMemNFT() *memNFT {
	return &memNFT{chains: map[string]bool{}, sets: map[string]map[string]*knftables.Element{}, isMap: map[string]bool{},
		rules: map[string][]string{}, hooks: map[string]memHook{}}
}

var memBaseChain = regexp.MustCompile(`\{ type \S+ hook (\S+) priority (-?\d+) ;`)

var memLine = regexp.MustCompile(`^(add|delete|flush) (table|chain|rule|set|map|element) \S+ \S+ ?(\S*)(.*)$`)

func (m *memNFT) NewTransaction() *knftables.Transaction {
	return knftables.NewFake(knftables.IPv4Family, TableName).NewTransaction()
}

func (m *memNFT) Check(context.Context, *knftables.Transaction) error { return nil }

func (m *memNFT) Run(_ context.Context, tx *knftables.Transaction) error { return m.apply(tx.String()) }

// apply runs a transaction's text (as tx.String writes it).
func (m *memNFT) apply(text string) error {
	for _, line := range strings.Split(text, "\n") {
		if line == "" {
			continue
		}
		g := memLine.FindStringSubmatch(line)
		if g == nil {
			return fmt.Errorf("memNFT: cannot parse %q", line)
		}
		verb, kind, name, rest := g[1], g[2], g[3], g[4]
		switch kind + " " + verb {
		case "table add":
			m.exists = true
		case "table delete":
			*m = *newMemNFT()
		case "chain add":
			m.chains[name] = true
			if h := memBaseChain.FindStringSubmatch(rest); h != nil {
				prio, _ := strconv.Atoi(h[2])
				m.hooks[name] = memHook{hook: h[1], priority: prio}
			}
		case "chain flush":
			delete(m.rules, name)
		case "chain delete":
			delete(m.chains, name)
			delete(m.rules, name)
			delete(m.hooks, name)
		case "rule add":
			if !m.chains[name] {
				return fmt.Errorf("memNFT: rule for missing chain %q", name)
			}
			m.rules[name] = append(m.rules[name], strings.TrimPrefix(rest, " "))
		case "set add", "map add":
			if m.sets[name] == nil {
				m.sets[name] = map[string]*knftables.Element{}
			}
			m.isMap[name] = kind == "map"
		case "set flush", "map flush":
			m.sets[name] = map[string]*knftables.Element{}
		case "set delete", "map delete":
			delete(m.sets, name)
		case "element add", "element delete":
			body := strings.TrimSuffix(strings.TrimPrefix(rest, " { "), " }")
			e := &knftables.Element{}
			if i := strings.Index(body, ` comment "`); i >= 0 {
				j := strings.Index(body[i+10:], `"`)
				c := body[i+10 : i+10+j]
				e.Comment = &c
				body = body[:i] + body[i+10+j+1:]
			}
			key, value, _ := strings.Cut(body, " : ")
			e.Key = strings.Split(key, " . ")
			if value != "" {
				e.Value = strings.Split(value, " . ")
			}
			if verb == "add" {
				m.sets[name][key] = e
			} else {
				delete(m.sets[name], key)
			}
		}
	}
	return nil
}

func (m *memNFT) ListAll(context.Context) (map[string][]string, error) {
	return listAll(m.exists, m.chains, m.sets, m.isMap)
}

// listAll is ListAll of the in-memory tables (memNFT, sinkNFT): the names
// of the table's chains, sets and maps.
func listAll[V any](exists bool, chains map[string]bool, sets map[string]V, isMap map[string]bool) (map[string][]string, error) {
	if !exists {
		return nil, fmt.Errorf("no such table: %w", errNotFound)
	}
	out := map[string][]string{}
	for c := range chains {
		out["chain"] = append(out["chain"], c)
	}
	for s := range sets {
		if isMap[s] {
			out["map"] = append(out["map"], s)
		} else {
			out["set"] = append(out["set"], s)
		}
	}
	return out, nil
}

var errNotFound = fmt.Errorf("no such file or directory")

// noRuleListing is the part of knftables.Interface the in-memory tables
// (memNFT, sinkNFT) do not keep: rules and counters are never listed by
// the backend's syncs.
type noRuleListing struct{}

func (noRuleListing) List(context.Context, string) ([]string, error) {
	return nil, fmt.Errorf("not supported")
}
func (noRuleListing) ListRules(context.Context, string) ([]*knftables.Rule, error) {
	return nil, fmt.Errorf("not supported")
}
func (noRuleListing) ListCounters(context.Context) ([]*knftables.Counter, error) { return nil, nil }

func (m *memNFT) ListElements(_ context.Context, _ string, name string) ([]*knftables.Element, error) {
	var out []*knftables.Element
	for _, e := range m.sets[name] {
		out = append(out, e)
	}
	return out, nil
}

// BenchmarkRestart measures, at KPROXY_BENCH_SERVICES services of the
// standard workload, the backend's own time (the engine's and the nft
// transactions' left out) of a first sync, a restart over the table and a
// one-endpoint change.
func BenchmarkRestart(b *testing.B) {
	for _, n := range pt.BenchSizes() {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			env := pt.Env{NodeName: "node-a", NodeIPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")},
				ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), Family: v1.IPv4Protocol}
			services, slices := pt.Workload(n)
			for b.Loop() {
				mem := newMemNFT()
				for _, what := range []string{"first", "restart", "change"} {
					be, err := New(Options{NFTables: mem, Family: v1.IPv4Protocol, LocalAddresses: func() ([]netip.Addr, error) { return env.NodeIPs, nil }})
					if err != nil {
						b.Fatal(err)
					}
					e := newEngine(b, env, be, clock.RealClock{})
					for i := range services {
						e.OnServiceAdd(services[i])
						e.OnEndpointSliceAdd(slices[i])
					}
					e.OnServiceSynced()
					e.OnEndpointSlicesSynced()
					if err := e.SyncRules(context.Background()); err != nil {
						b.Fatal(err)
					}
					if what == "change" {
						sl := slices[n/2].DeepCopy()
						sl.Endpoints[0].Addresses = []string{"10.250.0.1"}
						e.OnEndpointSliceUpdate(slices[n/2], sl)
						start := time.Now()
						if err := e.SyncRules(context.Background()); err != nil {
							b.Fatal(err)
						}
						b.ReportMetric(float64(time.Since(start)-be.LastSync().KernelTime)/1e6, "change-ms")
						continue
					}
					st := be.LastSync()
					_ = st
				}
			}
		})
	}
}

// BenchmarkEndpointChange measures a one-endpoint change (a partial sync,
// engine included, nft left out) at KPROXY_BENCH_SERVICES services.
func BenchmarkEndpointChange(b *testing.B) {
	for _, n := range pt.BenchSizes() {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			env := pt.Env{NodeName: "node-a", NodeIPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")},
				ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), Family: v1.IPv4Protocol}
			services, slices := pt.Workload(n)
			be, err := New(Options{NFTables: newMemNFT(), Family: v1.IPv4Protocol, LocalAddresses: func() ([]netip.Addr, error) { return env.NodeIPs, nil }})
			if err != nil {
				b.Fatal(err)
			}
			e := newEngine(b, env, be, clock.RealClock{})
			for i := range services {
				e.OnServiceAdd(services[i])
				e.OnEndpointSliceAdd(slices[i])
			}
			e.OnServiceSynced()
			e.OnEndpointSlicesSynced()
			if err := e.SyncRules(context.Background()); err != nil {
				b.Fatal(err)
			}
			i := 0
			for b.Loop() {
				old := slices[n/2]
				sl := old.DeepCopy()
				sl.Endpoints[0].Addresses = []string{fmt.Sprintf("10.250.%d.%d", i/250, i%250+1)}
				i++
				e.OnEndpointSliceUpdate(old, sl)
				slices[n/2] = sl
				if err := e.SyncRules(context.Background()); err != nil {
					b.Fatal(err)
				}
				if m := be.LastSync().Mode; m != modePartial {
					b.Fatalf("sync was %s", m)
				}
			}
		})
	}
}
