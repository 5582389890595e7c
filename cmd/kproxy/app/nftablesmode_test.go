package app

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2/ktesting"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/metrics"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier/cleanup"
	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// leftovers is a node's kernel holding what iptables and IPVS modes left
// (kproxy's chains, sets, a recorded virtual server and the dummy device),
// kproxy's nftables tables, and kube-proxy's and others' state.
type leftovers struct {
	ipt  map[v1.IPFamily]*iptablestest.Fake
	ipvs *ipvs.Fake
	sets *ipset.Fake
	nl   *netlink.Fake
	nft  *knftables.Fake
}

var (
	leftoverVIP = &ipvs.Service{Address: netip.MustParseAddr("10.96.0.1"), Protocol: ipvs.ProtocolTCP, Port: 443}
	foreignVIP  = &ipvs.Service{Address: netip.MustParseAddr("10.96.0.1"), Protocol: ipvs.ProtocolTCP, Port: 8443}
)

func newLeftovers(t *testing.T) *leftovers {
	t.Helper()
	ctx := context.Background()
	l := &leftovers{
		ipt: map[v1.IPFamily]*iptablestest.Fake{
			v1.IPv4Protocol: iptablestest.NewFake(ipt.ProtocolIPv4), v1.IPv6Protocol: iptablestest.NewFake(ipt.ProtocolIPv6),
		},
		ipvs: ipvs.NewFake(), sets: ipset.NewFake(), nl: netlink.NewFake(), nft: knftables.NewFake("", ""),
	}
	for _, i := range l.ipt {
		for _, data := range []string{
			"*nat\n:KPROXY-SERVICES - [0:0]\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KPROXY-SERVICES\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n",
			"*filter\n:KPROXY-IPVS-INPUT - [0:0]\n-A INPUT -j KPROXY-IPVS-INPUT\nCOMMIT\n",
		} {
			if err := i.Restore(ctx, []byte(data)); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, s := range cleanup.IPVSSets() {
		if err := l.sets.EnsureSet(ctx, ipset.Set{Name: s.Name, Type: s.Type, Comment: s.Comment}); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.sets.AddEntry(ctx, cleanup.SetClusterIP, ipset.Entry{IP: leftoverVIP.Address, Protocol: ipset.ProtocolTCP, Port: leftoverVIP.Port}); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*ipvs.Service{leftoverVIP, foreignVIP} {
		if err := l.ipvs.AddService(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.nl.EnsureDummyDevice(ctx, cleanup.DefaultDummyDevice); err != nil {
		t.Fatal(err)
	}
	if _, err := l.nl.EnsureAddressBound(ctx, leftoverVIP.Address, cleanup.DefaultDummyDevice); err != nil {
		t.Fatal(err)
	}
	tx := l.nft.NewTransaction()
	for _, f := range []knftables.Family{knftables.IPv4Family, knftables.IPv6Family} {
		for _, name := range []string{cleanup.NFTablesTable, "kube-proxy"} {
			tx.Add(&knftables.Table{Family: f, Name: name})
			tx.Add(&knftables.Chain{Family: f, Table: name, Name: "services"})
		}
	}
	if err := l.nft.Run(ctx, tx); err != nil {
		t.Fatal(err)
	}
	return l
}

// use points run's dependencies at the leftovers, with iptables for the
// given families.
func (l *leftovers) use(deps *runDeps, families ...v1.IPFamily) {
	deps.iptables = map[v1.IPFamily]ipt.Interface{}
	for _, f := range families {
		deps.iptables[f] = l.ipt[f]
	}
	deps.cleanupKernel = &kernelCleanup{ipvs: l.ipvs, ipset: l.sets, nl: l.nl, nft: l.nft}
}

func (l *leftovers) nftTables() []string {
	l.nft.RLock()
	defer l.nft.RUnlock()
	var out []string
	for family, tables := range l.nft.Tables {
		for name := range tables {
			out = append(out, string(family)+" "+name)
		}
	}
	slices.Sort(out)
	return out
}

func (l *leftovers) kproxyChains(family v1.IPFamily) []string {
	chains, _ := iptablestest.Leftovers(l.ipt[family], cleanup.ChainPrefix)
	return chains
}

// TestRunNFTablesModeRemovesOtherModesState starts nftables mode over
// iptables and IPVS modes' leftovers: they go (chains, sets, recorded
// virtual servers, dummy device), while kproxy's nftables tables (this
// mode's) and everyone else's state stay.
func TestRunNFTablesModeRemovesOtherModesState(t *testing.T) {
	for _, tc := range []struct {
		name     string
		families []v1.IPFamily
		// wantServices are the virtual servers left.
		wantServices []string
	}{
		{name: "dual-stack iptables", families: []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}, wantServices: []string{foreignVIP.String()}},
		{name: "IPv4 iptables only", families: []v1.IPFamily{v1.IPv4Protocol}, wantServices: []string{foreignVIP.String()}},
		// Without iptables, IPVS mode's ownership record cannot be
		// matched to its chains: only the dummy device goes.
		{name: "no iptables", wantServices: []string{leftoverVIP.String(), foreignVIP.String()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLeftovers(t)
			h := startRunWith(t, nil, func(o *Options, deps *runDeps) {
				o.ProxyMode = ModeNFTables
				deps.nftables = map[v1.IPFamily]knftables.Interface{
					v1.IPv4Protocol: knftables.NewFake(knftables.IPv4Family, nftbackend.TableName),
					v1.IPv6Protocol: knftables.NewFake(knftables.IPv6Family, nftbackend.TableName),
				}
				l.use(deps, tc.families...)
			}, pt.Node(runNode, nil))
			// The dummy device goes last.
			waitUntil(t, func() bool { return !slices.Contains(l.nl.Devices(), cleanup.DefaultDummyDevice) }, "the dummy device's removal")
			select {
			case err := <-h.done:
				t.Fatalf("run returned %v", err)
			default:
			}
			stopRun(t, h)
			for _, fam := range tc.families {
				if left := l.kproxyChains(fam); len(left) > 0 {
					t.Errorf("%s: kproxy's chains %v remain", fam, left)
				}
				if got := l.ipt[fam].Chains(ipt.TableNAT); !slices.Contains(got, "KUBE-SERVICES") {
					t.Errorf("%s: a foreign chain went: nat %v", fam, got)
				}
			}
			if got := l.ipvs.ServiceStrings(); !slices.Equal(got, slices.Sorted(slices.Values(tc.wantServices))) {
				t.Errorf("virtual servers %v, want %v", got, tc.wantServices)
			}
			if len(tc.families) > 0 {
				if sets, _ := l.sets.ListSets(context.Background()); len(sets) > 0 {
					t.Errorf("IPVS mode's sets remain: %v", sets)
				}
			}
			want := []string{"ip kproxy", "ip kube-proxy", "ip6 kproxy", "ip6 kube-proxy"}
			if got := l.nftTables(); !slices.Equal(got, want) {
				t.Errorf("nftables tables %v, want them all kept: %v", got, want)
			}
		})
	}
}

// TestRunIPTablesModeRemovesNFTablesTables starts iptables mode over
// nftables mode's leftovers: kproxy's tables of both families go,
// kube-proxy's stay.
func TestRunIPTablesModeRemovesNFTablesTables(t *testing.T) {
	l := newLeftovers(t)
	h := startRunWith(t, nil, func(_ *Options, deps *runDeps) { l.use(deps, v1.IPv4Protocol) }, pt.Node(runNode, nil))
	defer stopRun(t, h)
	want := []string{"ip kube-proxy", "ip6 kube-proxy"}
	waitUntil(t, func() bool { return slices.Equal(l.nftTables(), want) }, "the removal of kproxy's nftables tables")
	// iptables mode removes IPVS mode's chains, and keeps its own.
	waitUntil(t, func() bool {
		chains := l.kproxyChains(v1.IPv4Protocol)
		return slices.Contains(chains, "nat/KPROXY-SERVICES") && !slices.Contains(chains, "filter/KPROXY-IPVS-INPUT")
	}, "IPVS mode's chains' removal")
}

// failingNFTables fails every transaction, as nft does without permission.
type failingNFTables struct{ knftables.Interface }

func (failingNFTables) Run(context.Context, *knftables.Transaction) error {
	return errors.New("nft: Operation not permitted")
}

// TestCleanupOtherModesCountsNFTablesFailures checks that iptables and IPVS
// modes count a failed removal of kproxy's nftables tables, per family,
// and go on.
func TestCleanupOtherModesCountsNFTablesFailures(t *testing.T) {
	for _, mode := range []string{ModeIPTables, ModeIPVS} {
		t.Run(mode, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			l := newLeftovers(t)
			m, err := metrics.New(metrics.Options{Mode: mode})
			if err != nil {
				t.Fatal(err)
			}
			ipts := map[v1.IPFamily]ipt.Interface{v1.IPv4Protocol: l.ipt[v1.IPv4Protocol]}
			cleanupOtherModes(ctx, NewOptions(), mode, ipts, &kernelCleanup{nft: failingNFTables{l.nft}}, m)
			for _, fam := range []string{"IPv4", "IPv6"} {
				if got := gaugeOrCounter(t, m, "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total", map[string]string{"ip_family": fam}); got != 1 {
					t.Errorf("nftables cleanup failures of %s = %v, want 1", fam, got)
				}
			}
			if got := l.kproxyChains(v1.IPv4Protocol); len(got) != 1 {
				t.Errorf("the other mode's chain was not removed: kproxy's chains %v", got)
			}
		})
	}
}

// TestCleanupAll is --cleanup's path over fakes: every mode's state goes,
// for both families (an IPv6 nftables table even without ip6tables), twice
// without error; kube-proxy's and others' stay.
func TestCleanupAll(t *testing.T) {
	for _, tc := range []struct {
		name     string
		families []v1.IPFamily
	}{
		{name: "dual-stack", families: []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}},
		{name: "no ip6tables", families: []v1.IPFamily{v1.IPv4Protocol}},
		{name: "no iptables", families: nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			l := newLeftovers(t)
			var deps runDeps
			l.use(&deps, tc.families...)
			for i := 1; i <= 2; i++ {
				if err := cleanupAll(ctx, deps.iptables, deps.cleanupKernel); err != nil {
					t.Fatalf("cleanup %d: %v", i, err)
				}
				if got, want := l.nftTables(), []string{"ip kube-proxy", "ip6 kube-proxy"}; !slices.Equal(got, want) {
					t.Errorf("cleanup %d: nftables tables %v, want %v", i, got, want)
				}
				for _, fam := range tc.families {
					if left := l.kproxyChains(fam); len(left) > 0 {
						t.Errorf("cleanup %d: %s chains %v remain", i, fam, left)
					}
				}
				if slices.Contains(l.nl.Devices(), cleanup.DefaultDummyDevice) {
					t.Errorf("cleanup %d: the dummy device remains", i)
				}
			}
		})
	}
}

// TestNFTablesTableName checks that cleanup removes the table the backend
// programs.
func TestNFTablesTableName(t *testing.T) {
	if cleanup.NFTablesTable != nftbackend.TableName {
		t.Errorf("cleanup removes table %q, the nftables backend programs %q", cleanup.NFTablesTable, nftbackend.TableName)
	}
}

// TestMainNFTablesUnavailable checks that --proxy-mode=nftables without the
// nft command fails before touching the API server, says what is missing
// and does not fall back to another mode.
func TestMainNFTablesUnavailable(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	code, stdout, stderr := runMain("--proxy-mode=nftables", "--kubeconfig=/nonexistent", "--hostname-override=node-a",
		"--healthz-bind-address=", "--metrics-bind-address=")
	if code == 0 {
		t.Fatalf("exit code 0; stderr %q", stderr)
	}
	for _, want := range []string{"--proxy-mode=nftables", "nft command", "nf_tables"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr = %q, want it to name %q", stderr, want)
		}
	}
	for _, bad := range []string{"API client", "Starting kproxy"} {
		if strings.Contains(stderr+stdout, bad) {
			t.Errorf("kproxy went on without nftables (%q in the output)", bad)
		}
	}
}
