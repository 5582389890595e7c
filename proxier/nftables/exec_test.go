package nftables

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// execPair is the same table in two namespaces: one written by execNFT
// (merged), the other by knftables' own Interface.
type execPair struct {
	merged, plain *nsNFT
}

func newExecPair(t *testing.T, family knftables.Family) *execPair {
	t.Helper()
	p := &execPair{}
	for _, side := range []struct {
		n     **nsNFT
		ns    *netnstest.NS
		knfts bool
	}{{&p.merged, requireNFT(t), false}, {&p.plain, requireNFT(t), true}} {
		n := &nsNFT{ns: side.ns}
		err := side.ns.Do(func() error {
			var err error
			if side.knfts {
				n.real, err = knftables.New(family, TableName, knftables.UseNetlink)
			} else {
				n.real, err = newExecNFT(execOptions{Family: family, Table: TableName})
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		*side.n = n
	}
	return p
}

// run runs the transaction build makes on both sides and checks that they
// agree on the result and on what nft lists afterwards.
func (p *execPair) run(t *testing.T, family knftables.Family, build func(tx *knftables.Transaction)) (merged, plain error) {
	t.Helper()
	ctx := context.Background()
	for _, side := range []struct {
		n   *nsNFT
		err *error
	}{{p.merged, &merged}, {p.plain, &plain}} {
		tx := side.n.NewTransaction()
		build(tx)
		*side.err = side.n.Run(ctx, tx)
	}
	if (merged == nil) != (plain == nil) || knftables.IsNotFound(merged) != knftables.IsNotFound(plain) ||
		knftables.IsAlreadyExists(merged) != knftables.IsAlreadyExists(plain) {
		t.Errorf("merged run: %v; knftables': %v", merged, plain)
	}
	lm, lp := listTable(t, p.merged, family), listTable(t, p.plain, family)
	if lm != lp {
		t.Errorf("merged transactions left\n%s\nknftables' left\n%s", lm, lp)
	}
	return merged, plain
}

func listTable(t *testing.T, n *nsNFT, family knftables.Family) string {
	t.Helper()
	out, err := n.ns.Exec(context.Background(), "nft", "list", "table", string(family), TableName)
	if err != nil && !strings.Contains(err.Error(), "No such file") {
		t.Fatalf("nft list table: %v: %s", err, out)
	}
	return sortElements(string(out))
}

// sortElements sorts the elements nft lists ("elements = { a, b,\n c }"):
// it lists a hash set's in an order of its own.
func sortElements(listing string) string {
	var b strings.Builder
	for {
		i := strings.Index(listing, "elements = { ")
		if i < 0 {
			b.WriteString(listing)
			return b.String()
		}
		i += len("elements = { ")
		j := strings.Index(listing[i:], " }")
		b.WriteString(listing[:i])
		items := strings.Split(listing[i:i+j], ",")
		for k := range items {
			items[k] = strings.TrimSpace(items[k])
		}
		slices.Sort(items)
		b.WriteString(strings.Join(items, ", "))
		listing = listing[i+j:]
	}
}

// elems adds (or deletes) an element per key to m.
func elems(tx *knftables.Transaction, del bool, obj knftables.Element, keys ...string) {
	for _, k := range keys {
		e := obj
		e.Key = strings.Split(k, " . ")
		if del {
			e.Value, e.Comment = nil, nil
			tx.Delete(&e)
		} else {
			tx.Add(&e)
		}
	}
}

func TestExecNFTMatchesKnftables(t *testing.T) {
	for _, tc := range []struct {
		name   string
		family knftables.Family
		addr   func(i int) string
		prefix string
	}{
		{name: "IPv4", family: knftables.IPv4Family, addr: func(i int) string { return fmt.Sprintf("10.0.%d.%d", i/250, i%250+1) }, prefix: "/28"},
		{name: "IPv6", family: knftables.IPv6Family, addr: func(i int) string { return fmt.Sprintf("fd00::%x", i+1) }, prefix: "/120"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newExecPair(t, tc.family)
			at := "ipv4_addr"
			if tc.family == knftables.IPv6Family {
				at = "ipv6_addr"
			}
			keys := func(from, to int, suffix string) []string {
				var out []string
				for i := from; i < to; i++ {
					out = append(out, tc.addr(i)+suffix)
				}
				return out
			}
			// Objects, then runs of element adds with comments, concatenated
			// keys and values, intervals, interleaved across maps.
			run := func(build func(tx *knftables.Transaction)) {
				t.Helper()
				if err, _ := p.run(t, tc.family, build); err != nil {
					t.Fatal(err)
				}
			}
			run(func(tx *knftables.Transaction) {
				tx.Add(&knftables.Table{Comment: knftables.PtrTo("rules for kproxy")})
				tx.Add(&knftables.Chain{Name: "c"})
				tx.Add(&knftables.Chain{Name: "d"})
				tx.Add(&knftables.Chain{Name: "stale"})
				tx.Add(&knftables.Map{Name: "dispatch", Type: at + " . inet_proto . inet_service : verdict"})
				tx.Add(&knftables.Map{Name: "eps", Type: "mark . mark : " + at + " . inet_service"})
				tx.Add(&knftables.Set{Name: "fw", Type: at + " . inet_proto . inet_service . " + at, Flags: []knftables.SetFlag{knftables.IntervalFlag}})
				tx.Add(&knftables.Set{Name: "state", Type: "ifname"})
				tx.Flush(&knftables.Chain{Name: "c"})
				tx.Add(&knftables.Rule{Chain: "c", Rule: knftables.Concat(tc.family, "daddr . meta l4proto . th dport vmap @dispatch")})
				elems(tx, false, knftables.Element{Map: "dispatch", Value: []string{"goto c"}, Comment: knftables.PtrTo("ns/svc:http")}, keys(0, 300, " . tcp . 80")...)
				elems(tx, false, knftables.Element{Map: "dispatch", Value: []string{"goto d"}}, keys(0, 300, " . udp . 53")...)
				elems(tx, false, knftables.Element{Map: "eps", Value: []string{tc.addr(7), "8080"}}, "1 . 0", "1 . 1", "2 . 0")
				elems(tx, false, knftables.Element{Set: "fw"}, keys(0, 3, " . tcp . 80 . "+tc.addr(900)+tc.prefix)...)
				elems(tx, false, knftables.Element{Set: "state", Comment: knftables.PtrTo("hash:1 counts:c2")}, "a", "b")
				elems(tx, false, knftables.Element{Map: "eps", Value: []string{tc.addr(8), "8080"}}, "3 . 0")
			})
			// Deletes and adds of the same map in turn, a flush between.
			run(func(tx *knftables.Transaction) {
				elems(tx, true, knftables.Element{Map: "dispatch"}, keys(0, 100, " . tcp . 80")...)
				elems(tx, false, knftables.Element{Map: "dispatch", Value: []string{"goto d"}}, keys(0, 50, " . tcp . 80")...)
				elems(tx, true, knftables.Element{Map: "dispatch"}, keys(0, 10, " . tcp . 80")...)
				tx.Flush(&knftables.Set{Name: "state"})
				elems(tx, false, knftables.Element{Set: "state", Comment: knftables.PtrTo("hash:2")}, "a")
				elems(tx, true, knftables.Element{Set: "fw"}, keys(0, 1, " . tcp . 80 . "+tc.addr(900)+tc.prefix)...)
				tx.Delete(&knftables.Chain{Name: "stale"})
			})
		})
	}
}

func TestExecNFTErrors(t *testing.T) {
	p := newExecPair(t, knftables.IPv4Family)
	ctx := context.Background()
	p.run(t, knftables.IPv4Family, func(tx *knftables.Transaction) {
		tx.Add(&knftables.Table{})
		tx.Add(&knftables.Set{Name: "s", Type: "ipv4_addr"})
		tx.Add(&knftables.Map{Name: "m", Type: "ipv4_addr : ipv4_addr"})
		elems(tx, false, knftables.Element{Set: "s"}, "10.0.0.1", "10.0.0.2", "10.0.0.3")
		elems(tx, false, knftables.Element{Map: "m", Value: []string{"1.1.1.1"}}, "10.0.0.1")
	})
	for _, tc := range []struct {
		name        string
		build       func(tx *knftables.Transaction)
		check       bool
		notFound    bool
		exists      bool
		wantMessage []string
	}{
		{
			name: "a missing element amid a run of deletes",
			build: func(tx *knftables.Transaction) {
				elems(tx, true, knftables.Element{Set: "s"}, "10.0.0.1", "10.0.0.9", "10.0.0.2")
			},
			notFound:    true,
			wantMessage: []string{"(transaction line 2)", "delete element ip kproxy s { 10.0.0.9 }", "No such file or directory"},
		},
		{
			name: "a missing element amid a run of deletes, checked",
			build: func(tx *knftables.Transaction) {
				elems(tx, true, knftables.Element{Set: "s"}, "10.0.0.1", "10.0.0.9", "10.0.0.2")
			},
			check:    true,
			notFound: true,
		},
		{
			name: "an element created twice",
			build: func(tx *knftables.Transaction) {
				for _, k := range []string{"10.0.0.7", "10.0.0.3"} {
					tx.Create(&knftables.Element{Set: "s", Key: []string{k}})
				}
			},
			exists:      true,
			wantMessage: []string{"(transaction line 2)", "create element ip kproxy s { 10.0.0.3 }"},
		},
		{
			name: "a map element added again with another value",
			build: func(tx *knftables.Transaction) {
				elems(tx, false, knftables.Element{Map: "m", Value: []string{"1.1.1.2"}}, "10.0.0.8", "10.0.0.1")
			},
			exists:      true,
			wantMessage: []string{"(transaction line 2)", "add element ip kproxy m { 10.0.0.1 : 1.1.1.2 }"},
		},
		{
			name: "a missing set",
			build: func(tx *knftables.Transaction) {
				elems(tx, false, knftables.Element{Set: "nosuch"}, "10.0.0.1", "10.0.0.2")
			},
			notFound: true,
		},
		{
			name: "a missing table",
			build: func(tx *knftables.Transaction) {
				tx.Delete(&knftables.Table{})
				tx.Delete(&knftables.Table{})
			},
			notFound: true,
		},
		{
			name: "an invalid operation",
			build: func(tx *knftables.Transaction) {
				tx.Add(&knftables.Element{Set: "s"})
			},
			wantMessage: []string{"no key specified"},
		},
		{
			name: "an invalid operation, checked",
			build: func(tx *knftables.Transaction) {
				tx.Add(&knftables.Element{Set: "s"})
			},
			check:       true,
			wantMessage: []string{"no key specified"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := listTable(t, p.merged, knftables.IPv4Family)
			var errs [2]error
			for i, n := range []*nsNFT{p.merged, p.plain} {
				tx := n.NewTransaction()
				tc.build(tx)
				if tc.check {
					errs[i] = n.Check(ctx, tx)
				} else {
					errs[i] = n.Run(ctx, tx)
				}
			}
			merged, plain := errs[0], errs[1]
			if merged == nil || plain == nil {
				t.Fatalf("merged run: %v; knftables': %v; want errors", merged, plain)
			}
			if knftables.IsNotFound(merged) != tc.notFound || knftables.IsNotFound(plain) != tc.notFound {
				t.Errorf("IsNotFound: merged %v (%v), knftables' %v (%v), want %v", knftables.IsNotFound(merged), merged, knftables.IsNotFound(plain), plain, tc.notFound)
			}
			if knftables.IsAlreadyExists(merged) != tc.exists || knftables.IsAlreadyExists(plain) != tc.exists {
				t.Errorf("IsAlreadyExists: merged %v (%v), knftables' %v (%v), want %v", knftables.IsAlreadyExists(merged), merged, knftables.IsAlreadyExists(plain), plain, tc.exists)
			}
			for _, w := range tc.wantMessage {
				if !strings.Contains(merged.Error(), w) {
					t.Errorf("error %q lacks %q", merged, w)
				}
			}
			if after := listTable(t, p.merged, knftables.IPv4Family); after != before {
				t.Errorf("a failed transaction changed the table:\n%s", after)
			}
		})
	}
}

func TestNFTEnv(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  []string
		want []string
	}{
		{name: "no tunables", env: []string{"PATH=/bin"}, want: []string{"PATH=/bin", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"}},
		{name: "other tunables", env: []string{"GLIBC_TUNABLES=glibc.malloc.arena_max=2", "HOME=/"},
			want: []string{"GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "HOME=/"}},
		{name: "empty tunables", env: []string{"GLIBC_TUNABLES="}, want: []string{"GLIBC_TUNABLES=glibc.malloc.hugetlb=1"}},
		{name: "operator's hugetlb wins", env: []string{"GLIBC_TUNABLES=glibc.malloc.hugetlb=0"}, want: []string{"GLIBC_TUNABLES=glibc.malloc.hugetlb=0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := nftEnv(tc.env); !slices.Equal(got, tc.want) {
				t.Errorf("nftEnv(%q) = %q, want %q", tc.env, got, tc.want)
			}
		})
	}
}
