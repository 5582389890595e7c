package cleanup

import (
	"context"
	"net/netip"
	"slices"
	"testing"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
)

// kernel is one node's fake kernel holding what both modes leave, and
// someone else's state.
type kernel struct {
	ipt  *iptablestest.Fake
	ipvs *ipvs.Fake
	sets *ipset.Fake
	nl   *netlink.Fake
}

var (
	recordedVIP = &ipvs.Service{Address: netip.MustParseAddr("10.96.0.1"), Protocol: ipvs.ProtocolTCP, Port: 80}
	backendVIP  = &ipvs.Service{Address: netip.MustParseAddr("10.96.0.2"), Protocol: ipvs.ProtocolUDP, Port: 53}
	foreignVIP  = &ipvs.Service{Address: netip.MustParseAddr("10.96.0.1"), Protocol: ipvs.ProtocolTCP, Port: 8080}
	otherFamily = &ipvs.Service{Address: netip.MustParseAddr("fd00::1"), Protocol: ipvs.ProtocolTCP, Port: 80}
)

const (
	// What iptables mode leaves, with someone else's rules.
	iptablesModeNAT = "*nat\n:KPROXY-SERVICES - [0:0]\n:KPROXY-SVC-ABC - [0:0]\n:KUBE-SERVICES - [0:0]\n" +
		"-A PREROUTING -m comment --comment \"kproxy service portals\" -j KPROXY-SERVICES\n" +
		"-A PREROUTING -j KUBE-SERVICES\n" +
		"-A KPROXY-SERVICES -d 10.96.0.9/32 -p tcp -m tcp --dport 80 -j KPROXY-SVC-ABC\n" +
		"-A KPROXY-SVC-ABC -p tcp -j DNAT --to-destination 10.244.1.1:80\n" +
		"-A POSTROUTING -j MASQUERADE\nCOMMIT\n"
	// What IPVS mode leaves.
	ipvsModeFilter = "*filter\n:KPROXY-IPVS-INPUT - [0:0]\n:DOCKER - [0:0]\n" +
		"-A INPUT -m comment --comment \"kproxy ipvs input filter\" -j KPROXY-IPVS-INPUT\n" +
		"-A FORWARD -j DOCKER\n" +
		"-A KPROXY-IPVS-INPUT -m set --match-set KPROXY-INTERNAL-DROP dst,dst -j DROP\nCOMMIT\n"
)

func newKernel(t *testing.T) *kernel {
	t.Helper()
	ctx := context.Background()
	k := &kernel{ipt: iptablestest.NewFake(ipt.ProtocolIPv4), ipvs: ipvs.NewFake(), sets: ipset.NewFake(), nl: netlink.NewFake()}
	for _, data := range []string{iptablesModeNAT, ipvsModeFilter} {
		if err := k.ipt.Restore(ctx, []byte(data)); err != nil {
			t.Fatal(err)
		}
	}
	for _, ipv6 := range []bool{false, true} {
		for _, s := range IPVSSets() {
			if err := k.sets.EnsureSet(ctx, ipset.Set{Name: SetName(s.Name, ipv6), Type: s.Type, IPv6: ipv6, Comment: s.Comment}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := k.sets.EnsureSet(ctx, ipset.Set{Name: "SOMEONE-ELSE", Type: ipset.HashIP}); err != nil {
		t.Fatal(err)
	}
	if err := k.sets.AddEntry(ctx, SetClusterIP, ipset.Entry{IP: recordedVIP.Address, Protocol: ipset.ProtocolTCP, Port: 80}); err != nil {
		t.Fatal(err)
	}
	if err := k.sets.AddEntry(ctx, SetName(SetClusterIP, true), ipset.Entry{IP: otherFamily.Address, Protocol: ipset.ProtocolTCP, Port: 80}); err != nil {
		t.Fatal(err)
	}
	for _, s := range []*ipvs.Service{recordedVIP, backendVIP, foreignVIP, otherFamily} {
		if err := k.ipvs.AddService(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := k.nl.EnsureDummyDevice(ctx, DefaultDummyDevice); err != nil {
		t.Fatal(err)
	}
	for _, a := range []netip.Addr{recordedVIP.Address, backendVIP.Address, otherFamily.Address} {
		if _, err := k.nl.EnsureAddressBound(ctx, a, DefaultDummyDevice); err != nil {
			t.Fatal(err)
		}
	}
	return k
}

// kproxyChains lists kproxy's chains and the rules leading into them.
func (k *kernel) kproxyChains() []string {
	chains, jumps := iptablestest.Leftovers(k.ipt, ChainPrefix)
	return append(chains, jumps...)
}

func TestCleanup(t *testing.T) {
	for _, tc := range []struct {
		name string
		// opts gets the kernel's interfaces.
		opts         func(k *kernel) Options
		wantServices []*ipvs.Service
		wantSets     []string
		// wantAddrs are the addresses left on the dummy device (nil: the
		// device is gone).
		wantAddrs []netip.Addr
	}{
		{
			name: "every interface, with a backend's record",
			opts: func(k *kernel) Options {
				return Options{IPTables: k.ipt, IPVS: k.ipvs, IPSet: k.sets, Netlink: k.nl,
					OwnedVirtualServers: map[VirtualServer]bool{VirtualServerOf(backendVIP): true}}
			},
			wantServices: []*ipvs.Service{foreignVIP, otherFamily},
			wantSets:     append(IPVSSetNames(true), "SOMEONE-ELSE"),
			wantAddrs:    []netip.Addr{otherFamily.Address},
		},
		{
			name: "no record: only the sets' virtual servers go",
			opts: func(k *kernel) Options {
				return Options{IPTables: k.ipt, IPVS: k.ipvs, IPSet: k.sets, Netlink: k.nl}
			},
			wantServices: []*ipvs.Service{backendVIP, foreignVIP, otherFamily},
			wantSets:     append(IPVSSetNames(true), "SOMEONE-ELSE"),
			wantAddrs:    []netip.Addr{otherFamily.Address},
		},
		{
			name:         "iptables alone (iptables mode's backend)",
			opts:         func(k *kernel) Options { return Options{IPTables: k.ipt} },
			wantServices: []*ipvs.Service{recordedVIP, backendVIP, foreignVIP, otherFamily},
			wantSets:     append(append(IPVSSetNames(false), IPVSSetNames(true)...), "SOMEONE-ELSE"),
			wantAddrs:    []netip.Addr{recordedVIP.Address, backendVIP.Address, otherFamily.Address},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			k := newKernel(t)
			for i := 1; i <= 2; i++ {
				if err := Cleanup(ctx, tc.opts(k)); err != nil {
					t.Fatalf("cleanup %d: %v", i, err)
				}
				if left := k.kproxyChains(); len(left) > 0 {
					t.Errorf("cleanup %d left %v", i, left)
				}
				if got := k.ipt.Chains(ipt.TableNAT); !slices.Contains(got, "KUBE-SERVICES") {
					t.Errorf("cleanup %d removed a foreign chain: nat %v", i, got)
				}
				if got := k.ipt.Rules(ipt.TableFilter, ipt.ChainForward); !slices.Equal(got, []string{"-j DOCKER"}) {
					t.Errorf("cleanup %d changed foreign rules: FORWARD %v", i, got)
				}
				if got := k.ipt.Rules(ipt.TableNAT, ipt.ChainPrerouting); !slices.Equal(got, []string{"-j KUBE-SERVICES"}) {
					t.Errorf("cleanup %d changed foreign rules: PREROUTING %v", i, got)
				}
				var want []string
				for _, s := range tc.wantServices {
					want = append(want, s.String())
				}
				slices.Sort(want)
				if got := k.ipvs.ServiceStrings(); !slices.Equal(got, want) {
					t.Errorf("cleanup %d: virtual servers %v, want %v", i, got, want)
				}
				sets, err := k.sets.ListSets(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(slices.Sorted(slices.Values(sets)), slices.Sorted(slices.Values(tc.wantSets))) {
					t.Errorf("cleanup %d: sets %v, want %v", i, sets, tc.wantSets)
				}
				addrs, err := k.nl.ListBoundAddresses(ctx, DefaultDummyDevice)
				switch {
				case tc.wantAddrs == nil && err == nil:
					t.Errorf("cleanup %d: the dummy device remains with %v", i, addrs)
				case tc.wantAddrs != nil && !slices.Equal(addrs, tc.wantAddrs):
					t.Errorf("cleanup %d: dummy device addresses %v (err %v), want %v", i, addrs, err, tc.wantAddrs)
				}
			}
		})
	}
}

func TestCleanupBothFamiliesRemovesTheDevice(t *testing.T) {
	ctx := context.Background()
	k := newKernel(t)
	v6 := iptablestest.NewFake(ipt.ProtocolIPv6)
	for _, i := range []ipt.Interface{k.ipt, v6} {
		if err := Cleanup(ctx, Options{IPTables: i, IPVS: k.ipvs, IPSet: k.sets, Netlink: k.nl}); err != nil {
			t.Fatal(err)
		}
	}
	if devs := k.nl.Devices(); slices.Contains(devs, DefaultDummyDevice) {
		t.Errorf("the dummy device remains: %v", devs)
	}
	if got := k.ipvs.ServiceStrings(); !slices.Equal(got, slices.Sorted(slices.Values([]string{backendVIP.String(), foreignVIP.String()}))) {
		t.Errorf("virtual servers %v, want the unrecorded ones", got)
	}
}

func TestRemoveChainsOfTheOtherMode(t *testing.T) {
	for _, tc := range []struct {
		name  string
		owned func(string) bool
		want  []string
	}{
		{"IPVS mode's", IsIPVSChain, []string{
			"nat/KPROXY-SERVICES", "nat/KPROXY-SVC-ABC",
			`nat/PREROUTING -m comment --comment "kproxy service portals" -j KPROXY-SERVICES`}},
		{"iptables mode's", IsIPTablesChain, []string{
			"filter/KPROXY-IPVS-INPUT",
			`filter/INPUT -m comment --comment "kproxy ipvs input filter" -j KPROXY-IPVS-INPUT`}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := newKernel(t)
			if err := RemoveChains(context.Background(), k.ipt, tc.owned); err != nil {
				t.Fatal(err)
			}
			if got := k.kproxyChains(); !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(tc.want))) {
				t.Errorf("left\n%q\nwant\n%q", got, tc.want)
			}
		})
	}
}

func TestCleanupNeedsIPTables(t *testing.T) {
	if err := Cleanup(context.Background(), Options{}); err == nil {
		t.Error("Cleanup without IPTables succeeded")
	}
}
