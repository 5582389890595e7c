package ipvs

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/ipvs/ipvstest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// fakeKernel is one node's kernel for one family: the fakes of every
// interface IPVS mode uses, wired as the kernel wires them (a set that an
// iptables rule references cannot be destroyed).
type fakeKernel struct {
	ipvs    *ipvs.Fake
	nl      *netlink.Fake
	sets    *ipset.Fake
	ipt     *iptablestest.Fake
	sysctl  *FakeSysctl
	ipv6    bool
	nodeIPs []netip.Addr
	// refuseRestore, when set, makes the backend's iptables-restore runs
	// fail with its error, before the fake applies anything (a kernel
	// without a match module refuses the whole table).
	refuseRestore func(data string) error
}

// gatedIPTables is the fake iptables as the backend sees it: restores go
// through the kernel's refuseRestore first.
type gatedIPTables struct {
	*iptablestest.Fake
	k *fakeKernel
}

func (g gatedIPTables) Restore(ctx context.Context, data []byte) error {
	if refuse := g.k.refuseRestore; refuse != nil {
		if err := refuse(string(data)); err != nil {
			return fmt.Errorf("iptables-restore: %w", err)
		}
	}
	return g.Fake.Restore(ctx, data)
}

func newFakeKernel(t testing.TB, family v1.IPFamily, nodeIPs []netip.Addr) *fakeKernel {
	t.Helper()
	k := &fakeKernel{
		ipvs: ipvs.NewFake(), nl: netlink.NewFake(), sets: ipset.NewFake(),
		sysctl: NewFakeSysctl(nil), ipv6: family == v1.IPv6Protocol, nodeIPs: nodeIPs,
	}
	proto := ipt.ProtocolIPv4
	if k.ipv6 {
		proto = ipt.ProtocolIPv6
	}
	k.ipt = iptablestest.NewFake(proto)
	k.ipt.RandomFully = true
	k.sets.Referenced = func(name string) bool {
		for _, table := range ipvsTables {
			for _, c := range k.ipt.Chains(table) {
				for _, r := range k.ipt.Rules(table, ipt.Chain(c)) {
					if strings.Contains(r+" ", "--match-set "+name+" ") {
						return true
					}
				}
			}
		}
		return false
	}
	if err := k.nl.AddDevice("lo", netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("::1")); err != nil {
		t.Fatal(err)
	}
	if err := k.nl.AddDevice("eth0", nodeIPs...); err != nil {
		t.Fatal(err)
	}
	return k
}

// backend returns a Backend over k with opts' kernel interfaces filled in.
func (k *fakeKernel) backend(t testing.TB, opts Options) *Backend {
	t.Helper()
	opts.IPVS, opts.Netlink, opts.IPSet, opts.IPTables, opts.Sysctl = k.ipvs, k.nl, k.sets, gatedIPTables{k.ipt, k}, k.sysctl
	b, err := New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return b
}

// tracer traces proxiertest flows through the fake kernel with the
// shared IPVS-mode tracer (package ipvstest, which `kproxy trace` uses on
// live state too).
type tracer struct{ k *fakeKernel }

func (tr *tracer) Trace(f pt.Flow) (pt.Result, error) {
	ctx := context.Background()
	k := tr.k
	local, err := k.nl.LocalAddresses(ctx)
	if err != nil {
		return pt.Result{}, err
	}
	proto := strings.ToLower(string(f.Protocol))
	if proto == "" {
		proto = "tcp"
	}
	origin := iptablestest.OriginExternal
	if f.Origin == pt.FromHost {
		origin = iptablestest.OriginLocal
	}
	sets, err := ipvstest.SetsOf(ctx, k.sets, nil)
	if err != nil {
		return pt.Result{}, err
	}
	outs, err := ipvstest.Trace(ctx, ipvstest.State{IPTables: k.ipt, Sets: sets, IPVS: k.ipvs, LocalAddrs: local},
		ipvstest.Packet{Source: netip.MustParseAddr(f.Source), Destination: netip.MustParseAddr(f.Dest), Protocol: proto,
			DestinationPort: f.Port, Origin: origin})
	if err != nil {
		return pt.Result{}, err
	}
	res := pt.Result{Endpoints: map[string]bool{}}
	verdicts := map[pt.Verdict]bool{}
	add := func(ep string, masq bool) error {
		if prev, seen := res.Endpoints[ep]; seen && prev != masq {
			return fmt.Errorf("endpoint %s reached both with and without masquerade", ep)
		}
		res.Endpoints[ep] = masq
		return nil
	}
	for _, o := range outs {
		switch {
		case o.Verdict == "DROP":
			verdicts[pt.Dropped] = true
		case o.Verdict == "REJECT":
			verdicts[pt.Rejected] = true
		case o.VirtualServer != nil:
			verdicts[pt.Delivered] = true
			for _, rs := range o.RealServers {
				if err := add(netip.AddrPortFrom(rs.Destination.Address, rs.Destination.Port).String(), rs.Masquerade); err != nil {
					return res, err
				}
			}
		case o.Netfilter.DNAT != "":
			// DNATed by netfilter itself to an endpoint (clusterChain).
			verdicts[pt.Delivered] = true
			if err := add(o.Netfilter.DNAT, o.Netfilter.Masquerade); err != nil {
				return res, err
			}
		default:
			verdicts[pt.NotHandled] = true
		}
	}
	if len(verdicts) != 1 {
		return res, fmt.Errorf("flow has mixed outcomes %v: %+v", verdicts, outs)
	}
	for v := range verdicts {
		res.Verdict = v
	}
	return res, nil
}

func TestBehaviourCases(t *testing.T) {
	factory := func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
		k := newFakeKernel(t, env.Family, env.NodeIPs)
		b := k.backend(t, Options{NodePortAddresses: env.NodePortAddresses})
		return b, &tracer{k}
	}
	used := map[int]bool{}
	for _, c := range pt.Cases() {
		flows := make([]pt.Flow, len(c.Flows))
		copy(flows, c.Flows)
		for i := range flows {
			for j, d := range ipvstest.Deviations {
				if d.Case == c.Name && d.Flow == flows[i].Name {
					used[j] = true
					flows[i].Want, flows[i].WantEndpoints, flows[i].WantMasquerade, flows[i].WantHairpin = pt.Verdict(d.Want), nil, false, nil
				}
			}
		}
		c.Flows = flows
		t.Run(c.Name, func(t *testing.T) { pt.RunCase(t, c, factory) })
	}
	for j, d := range ipvstest.Deviations {
		if !used[j] {
			t.Errorf("deviation for case %q flow %q matches no shared flow", d.Case, d.Flow)
		}
	}
}
