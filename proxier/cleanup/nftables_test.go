package cleanup

import (
	"context"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"k8s.io/klog/v2/ktesting"
	"sigs.k8s.io/knftables"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// nftTables lists the fake's tables as "family name".
func nftTables(fake *knftables.Fake) []string {
	fake.RLock()
	defer fake.RUnlock()
	var out []string
	for family, tables := range fake.Tables {
		for name := range tables {
			out = append(out, string(family)+" "+name)
		}
	}
	slices.Sort(out)
	return out
}

// newNFTablesKernel returns a fake nftables holding kproxy's tables of both
// families, each with a base chain and a rule, and kube-proxy's table and
// another foreign table.
func newNFTablesKernel(t *testing.T) *knftables.Fake {
	t.Helper()
	fake := knftables.NewFake("", "")
	tx := fake.NewTransaction()
	for _, tbl := range []struct {
		family knftables.Family
		name   string
	}{
		{knftables.IPv4Family, NFTablesTable},
		{knftables.IPv6Family, NFTablesTable},
		{knftables.IPv4Family, "kube-proxy"},
		{knftables.IPv6Family, "kube-proxy"},
		{knftables.InetFamily, "firewall"},
	} {
		tx.Add(&knftables.Table{Family: tbl.family, Name: tbl.name})
		tx.Add(&knftables.Chain{
			Family: tbl.family, Table: tbl.name, Name: "nat-prerouting",
			Type: knftables.PtrTo(knftables.NATType), Hook: knftables.PtrTo(knftables.PreroutingHook),
			Priority: knftables.PtrTo(knftables.DNATPriority),
		})
		tx.Add(&knftables.Rule{Family: tbl.family, Table: tbl.name, Chain: "nat-prerouting", Rule: "ip daddr 10.96.0.1 counter"})
	}
	if err := fake.Run(context.Background(), tx); err != nil {
		t.Fatal(err)
	}
	return fake
}

func TestRemoveNFTablesTable(t *testing.T) {
	for _, tc := range []struct {
		name string
		ipv6 bool
		want []string
	}{
		{name: "ip kproxy", ipv6: false, want: []string{"inet firewall", "ip kube-proxy", "ip6 kproxy", "ip6 kube-proxy"}},
		{name: "ip6 kproxy", ipv6: true, want: []string{"inet firewall", "ip kproxy", "ip kube-proxy", "ip6 kube-proxy"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			fake := newNFTablesKernel(t)
			for i := 1; i <= 2; i++ {
				if err := RemoveNFTablesTable(ctx, fake, tc.ipv6); err != nil {
					t.Fatalf("removal %d: %v", i, err)
				}
				if got := nftTables(fake); !slices.Equal(got, tc.want) {
					t.Errorf("removal %d: tables %v, want %v", i, got, tc.want)
				}
			}
		})
	}
}

// TestCleanupRemovesNFTablesTable runs Cleanup, as --cleanup does, over
// both families with iptables and nftables: kproxy's tables go, with every
// chain; kube-proxy's and anyone else's stay.
func TestCleanupRemovesNFTablesTable(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	fake := newNFTablesKernel(t)
	k := newKernel(t)
	v6 := iptablestest.NewFake(ipt.ProtocolIPv6)
	for i := 1; i <= 2; i++ {
		for _, i := range []ipt.Interface{k.ipt, v6} {
			if err := Cleanup(ctx, Options{IPTables: i, NFTables: fake}); err != nil {
				t.Fatal(err)
			}
		}
		want := []string{"inet firewall", "ip kube-proxy", "ip6 kube-proxy"}
		if got := nftTables(fake); !slices.Equal(got, want) {
			t.Errorf("cleanup %d: tables %v, want %v", i, got, want)
		}
		fake.RLock()
		chains := slices.Collect(maps.Keys(fake.Tables[knftables.IPv4Family]["kube-proxy"].Chains))
		fake.RUnlock()
		if !slices.Equal(chains, []string{"nat-prerouting"}) {
			t.Errorf("cleanup %d: kube-proxy's chains %v, want them untouched", i, chains)
		}
		if left := k.kproxyChains(); len(left) > 0 {
			t.Errorf("cleanup %d left iptables chains %v", i, left)
		}
	}
}

// TestRemoveNFTablesTableRealKernel creates kproxy's and kube-proxy's tables
// with nft in a throwaway network namespace, cleans up twice and checks
// that only kproxy's went.
func TestRemoveNFTablesTableRealKernel(t *testing.T) {
	netnstest.RequireRoot(t)
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skipf("needs nft: %v", err)
	}
	_, ctx := ktesting.NewTestContext(t)
	ns := netnstest.New(t, "nftclean")
	script := filepath.Join(t.TempDir(), "tables.nft")
	if err := os.WriteFile(script, []byte(`
add table ip kproxy
add chain ip kproxy nat-prerouting { type nat hook prerouting priority dstnat ; }
add rule ip kproxy nat-prerouting ip daddr 10.96.0.1 counter
add table ip6 kproxy
add chain ip6 kproxy filter-input { type filter hook input priority filter ; }
add table ip kube-proxy
add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority dstnat ; }
add rule ip kube-proxy nat-prerouting ip daddr 10.96.0.1 counter
`), 0o600); err != nil {
		t.Fatal(err)
	}
	ns.Run(t, "nft", "-f", script)
	tables := func() []string {
		out := strings.Fields(strings.ReplaceAll(ns.Run(t, "nft", "list", "tables"), "table ", ""))
		var pairs []string
		for i := 0; i+1 < len(out); i += 2 {
			pairs = append(pairs, out[i]+" "+out[i+1])
		}
		slices.Sort(pairs)
		return pairs
	}
	if got, want := tables(), []string{"ip kproxy", "ip kube-proxy", "ip6 kproxy"}; !slices.Equal(got, want) {
		t.Fatalf("tables before cleanup %v, want %v", got, want)
	}
	for i := 1; i <= 2; i++ {
		if err := ns.Do(func() error {
			nft, err := OpenNFTables(ctx)
			if err != nil {
				return err
			}
			for _, ipv6 := range []bool{false, true} {
				if err := RemoveNFTablesTable(ctx, nft, ipv6); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Fatalf("cleanup %d: %v", i, err)
		}
		if got, want := tables(), []string{"ip kube-proxy"}; !slices.Equal(got, want) {
			t.Errorf("tables after cleanup %d: %v, want %v", i, got, want)
		}
	}
	if got := ns.Run(t, "nft", "list", "chain", "ip", "kube-proxy", "nat-prerouting"); !strings.Contains(got, "ip daddr 10.96.0.1 counter") {
		t.Errorf("kube-proxy's rule is gone:\n%s", got)
	}
}
