package ipvs

import (
	"context"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier"
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

// tracer traces proxiertest flows through the fake kernel: netfilter (the
// fake iptables' tracer, with ipsets) up to local delivery or a DNAT to an
// endpoint, then IPVS
// (a virtual server at the destination sends the packet to every real
// server of non-zero weight; one without such a real server rejects), then
// the output path of the rewritten packet (nat POSTROUTING decides
// masquerading for packets from outside the node).
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
	src, dst := netip.MustParseAddr(f.Source), netip.MustParseAddr(f.Dest)
	origin := iptablestest.OriginExternal
	if f.Origin == pt.FromHost {
		origin = iptablestest.OriginLocal
	}
	sets, err := tr.traceSets()
	if err != nil {
		return pt.Result{}, err
	}
	scratch, err := tr.scratch(0)
	if err != nil {
		return pt.Result{}, err
	}
	opts := iptablestest.TraceOptions{LocalAddrs: local, IPSets: sets}
	outs, err := scratch.Trace(iptablestest.Packet{Source: src, Destination: dst, Protocol: proto, SourcePort: 40000, DestinationPort: f.Port, Origin: origin}, opts)
	if err != nil {
		return pt.Result{}, err
	}
	res := pt.Result{Endpoints: map[string]bool{}}
	verdicts := map[pt.Verdict]bool{}
	for _, o := range outs {
		switch o.Verdict {
		case "DROP":
			verdicts[pt.Dropped] = true
			continue
		case "REJECT":
			verdicts[pt.Rejected] = true
			continue
		}
		to, port := dst, f.Port
		if o.DNAT != "" {
			ap := netip.MustParseAddrPort(o.DNAT)
			to, port = ap.Addr(), int(ap.Port())
		}
		isLocal := to.IsLoopback()
		for _, a := range local {
			isLocal = isLocal || a == to
		}
		if !isLocal {
			if o.DNAT == "" {
				verdicts[pt.NotHandled] = true
				continue
			}
			// DNATed by netfilter itself to an endpoint (clusterChain):
			// forwarded, masqueraded as the trace says.
			ep := netip.AddrPortFrom(to, uint16(port)).String()
			if prev, seen := res.Endpoints[ep]; seen && prev != o.Masquerade {
				return res, fmt.Errorf("endpoint %s reached both with and without masquerade", ep)
			}
			verdicts[pt.Delivered] = true
			res.Endpoints[ep] = o.Masquerade
			continue
		}
		reals, found, err := tr.ipvsLookup(to, proto, port)
		if err != nil {
			return res, err
		}
		switch {
		case !found:
			verdicts[pt.NotHandled] = true
			continue
		case len(reals) == 0:
			verdicts[pt.Rejected] = true
			continue
		}
		verdicts[pt.Delivered] = true
		for _, ep := range reals {
			masq := o.Masquerade
			if origin == iptablestest.OriginExternal {
				// IPVS sends the rewritten packet out through LOCAL_OUT and
				// POSTROUTING, with the mark it got in PREROUTING.
				if masq, err = tr.postIPVS(src, ep, proto, o.Mark, local, sets); err != nil {
					return res, err
				}
			}
			if prev, seen := res.Endpoints[ep.String()]; seen && prev != masq {
				return res, fmt.Errorf("endpoint %s reached both with and without masquerade", ep)
			}
			res.Endpoints[ep.String()] = masq
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

// ipvsLookup returns the real servers of non-zero weight of the virtual
// server at addr:port, and whether there is one.
func (tr *tracer) ipvsLookup(addr netip.Addr, proto string, port int) ([]netip.AddrPort, bool, error) {
	ctx := context.Background()
	svcs, err := tr.k.ipvs.Services(ctx)
	if err != nil {
		return nil, false, err
	}
	for _, s := range svcs {
		if s.Address != addr || s.Port != uint16(port) || !strings.EqualFold(string(s.Protocol), proto) {
			continue
		}
		dests, err := tr.k.ipvs.Destinations(ctx, s)
		if err != nil {
			return nil, false, err
		}
		var out []netip.AddrPort
		for _, d := range dests {
			if d.Weight > 0 {
				out = append(out, netip.AddrPortFrom(d.Address, d.Port))
			}
		}
		return out, true, nil
	}
	return nil, false, nil
}

// postIPVS traces the packet IPVS rewrote to ep: LOCAL_OUT (nat OUTPUT
// does not run again for the connection) and POSTROUTING, with the mark
// from PREROUTING. It reports whether the packet is masqueraded.
func (tr *tracer) postIPVS(src netip.Addr, ep netip.AddrPort, proto string, mark uint32, local []netip.Addr, sets map[string][]string) (bool, error) {
	scratch, err := tr.scratch(mark)
	if err != nil {
		return false, err
	}
	outs, err := scratch.Trace(iptablestest.Packet{Source: src, Destination: ep.Addr(), Protocol: proto, SourcePort: 40000,
		DestinationPort: int(ep.Port()), Origin: iptablestest.OriginLocal}, iptablestest.TraceOptions{LocalAddrs: local, IPSets: sets})
	if err != nil {
		return false, err
	}
	masq := false
	for _, o := range outs {
		if o.Verdict != "ACCEPT" {
			return false, fmt.Errorf("packet to %s after IPVS: %s", ep, o.Verdict)
		}
		masq = masq || o.Masquerade
	}
	return masq, nil
}

// traceSets gives the fake iptables' tracer the sets it evaluates itself
// (one or two dimensions).
func (tr *tracer) traceSets() (map[string][]string, error) {
	names, err := tr.k.sets.ListSets(context.Background())
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, n := range names {
		s, _ := tr.k.sets.Get(n)
		switch s.Type {
		case ipset.HashIP, ipset.HashIPPort, ipset.HashNet:
		default:
			continue
		}
		entries, err := tr.k.sets.Entries(context.Background(), n)
		if err != nil {
			return nil, err
		}
		out[n] = []string{}
		for _, e := range entries {
			out[n] = append(out[n], e.String())
		}
	}
	return out, nil
}

// scratch copies the ruleset into a new fake, with each three-dimension
// set match (which the fake's tracer cannot evaluate) expanded into one
// rule per set entry. A non-zero mark makes it the output path of a packet
// IPVS rewrote: mangle OUTPUT sets the mark and nat OUTPUT is empty.
func (tr *tracer) scratch(mark uint32) (*iptablestest.Fake, error) {
	ctx := context.Background()
	out := iptablestest.NewFake(tr.k.ipt.Protocol())
	out.RandomFully = tr.k.ipt.RandomFully
	for _, table := range ipvsTables {
		data, err := tr.k.ipt.SaveInto(ctx, table)
		if err != nil {
			return nil, err
		}
		var lines []string
		for _, line := range strings.Split(string(data), "\n") {
			expanded, err := tr.expand(line)
			if err != nil {
				return nil, err
			}
			lines = append(lines, expanded...)
		}
		if err := out.Restore(ctx, []byte(strings.Join(lines, "\n")+"\n")); err != nil {
			return nil, fmt.Errorf("restoring the expanded %s table: %w", table, err)
		}
	}
	if mark != 0 {
		if err := out.FlushChain(ctx, ipt.TableNAT, ipt.ChainOutput); err != nil {
			return nil, err
		}
		if _, err := out.EnsureRule(ctx, ipt.Append, ipt.TableMangle, ipt.ChainOutput,
			"-j", "MARK", "--set-xmark", fmt.Sprintf("%#x/0xffffffff", mark)); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// expand rewrites a rule line matching a three-dimension set
// ("dst,dst,src") into one line per entry, with -d, -s, -p and --dport.
func (tr *tracer) expand(line string) ([]string, error) {
	if !strings.HasPrefix(line, "-A ") || !strings.Contains(line, "--match-set") {
		return []string{line}, nil
	}
	args, err := ipt.SplitArgs(line)
	if err != nil {
		return nil, err
	}
	for i := 0; i+4 < len(args); i++ {
		if args[i] != "-m" || args[i+1] != "set" || args[i+2] != "--match-set" {
			continue
		}
		flags := args[i+4]
		if strings.Count(flags, ",") < 2 {
			return []string{line}, nil
		}
		if flags != "dst,dst,src" {
			return nil, fmt.Errorf("tracer cannot expand set flags %q in %q", flags, line)
		}
		entries, err := tr.k.sets.Entries(context.Background(), args[i+3])
		if err != nil {
			return nil, err
		}
		var out []string
		for _, e := range entries {
			source := ""
			switch {
			case e.IP2.IsValid():
				source = netip.PrefixFrom(e.IP2, e.IP2.BitLen()).String()
			case e.Net.IsValid():
				source = e.Net.String()
			default:
				return nil, fmt.Errorf("set %s entry %s has no third dimension", args[i+3], e)
			}
			repl := []string{"-d", netip.PrefixFrom(e.IP, e.IP.BitLen()).String(), "-s", source,
				"-p", e.Protocol, "-m", e.Protocol, "--dport", strconv.Itoa(int(e.Port))}
			n := append(append(append([]string{}, args[:i]...), repl...), args[i+5:]...)
			out = append(out, ipt.JoinArgs(n))
		}
		return out, nil
	}
	return []string{line}, nil
}

// ipvsDeviation is a shared flow whose outcome differs in IPVS mode by
// design.
type ipvsDeviation struct {
	caseName, flowName string
	want               pt.Verdict
	reason             string
}

// ipvsDeviations are every shared flow IPVS mode answers differently.
var ipvsDeviations = []ipvsDeviation{
	{
		caseName: "clusterIP reaches every endpoint; off-cluster sources are masqueraded", flowName: "other port",
		want: pt.Rejected,
		reason: "a ClusterIP is a local address on the dummy device in IPVS mode; KPROXY-IPVS-FILTER rejects new " +
			"connections to its ports that no Service uses (upstream's KUBE-IPVS-FILTER), where iptables mode " +
			"leaves the packet to routing",
	},
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
			for j, d := range ipvsDeviations {
				if d.caseName == c.Name && d.flowName == flows[i].Name {
					used[j] = true
					flows[i].Want, flows[i].WantEndpoints, flows[i].WantMasquerade, flows[i].WantHairpin = d.want, nil, false, nil
				}
			}
		}
		c.Flows = flows
		t.Run(c.Name, func(t *testing.T) { pt.RunCase(t, c, factory) })
	}
	for j, d := range ipvsDeviations {
		if !used[j] {
			t.Errorf("deviation for case %q flow %q matches no shared flow", d.caseName, d.flowName)
		}
	}
}
