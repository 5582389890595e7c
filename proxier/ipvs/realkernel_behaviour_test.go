package ipvs

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/ipvs/ipvstest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
	"github.com/kproxy/kproxy/proxier/trace"
)

// TestRealKernelTraceBehaviourCases runs every case of the shared
// behaviour table on the VM's real kernel (proxiertest's real-kernel
// harness builds the topology, starts the endpoints and sends every flow
// as real packets) with this backend programming the node namespace's
// real IPVS, ipsets, dummy device and iptables, and answers each flow with
// `kproxy trace` (trace.Run, mode ipvs) over that live state: the harness
// fails every flow whose real packets and trace disagree.
func TestRealKernelTraceBehaviourCases(t *testing.T) {
	requireVM(t)
	rk := pt.RealKernel{
		NSPrefix:         "ivt",
		CheckKernel:      checkRealIPVS,
		NewBackend:       newRealTraceBackend,
		ForgetAffinity:   forgetPersistence,
		KnownDivergences: realTraceDivergences(),
	}
	rep := &pt.RealReport{}
	t.Cleanup(func() { rep.Log(t) })
	for _, c := range pt.Cases() {
		t.Run(c.Name, func(t *testing.T) {
			if why, ok := realTraceSkipped[c.Name]; ok {
				t.Skip(why)
			}
			t.Parallel()
			pt.RunCase(t, c, func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
				rc := pt.NewRealCase(t, c, env, rk, rep)
				return rc.Backend(), rc
			})
		})
	}
	for name := range realTraceSkipped {
		found := false
		for _, c := range pt.Cases() {
			found = found || c.Name == name
		}
		if !found {
			t.Errorf("skipped case %q is not a shared case", name)
		}
	}
}

// realTraceSkipped are the shared cases this test does not run, by name,
// with the reason. None today.
var realTraceSkipped = map[string]string{}

// forgetPersistence empties the IPVS persistence templates (ClientIP
// affinity) of the node, so that each flow is a first packet. No interface
// flushes the IPVS connection table, but with expire_nodest_conn (which the
// backend sets) deleting a real server queues a kernel pass that expires
// the connections, and then their templates, whose real server is gone.
// A template whose last connection the pass could not expire at once (in
// use, so expired later by its timer) outlives the pass: the real servers
// are then added and deleted again, which queues another pass. Once no
// template is left, the real servers are added back as they were.
func forgetPersistence(node *netnstest.NS) error {
	ctx := context.Background()
	iv, err := ipvs.New(ipvs.Options{NetNS: node.Name})
	if err != nil {
		return err
	}
	defer func() { _ = iv.Close() }()
	svcs, err := iv.Services(ctx)
	if err != nil {
		return err
	}
	type removed struct {
		svc *ipvs.Service
		dst *ipvs.Destination
	}
	var gone []removed
	for _, s := range svcs {
		if !s.Persistent {
			continue
		}
		dsts, err := iv.Destinations(ctx, s)
		if err != nil {
			return err
		}
		for _, d := range dsts {
			gone = append(gone, removed{s, d})
		}
	}
	if len(gone) == 0 {
		return nil
	}
	addAll := func() error {
		for _, g := range gone {
			if err := iv.AddDestination(ctx, g.svc, &ipvs.Destination{Address: g.dst.Address, Port: g.dst.Port, Weight: g.dst.Weight}); err != nil {
				return err
			}
		}
		return nil
	}
	const passes = 5
	for pass := 1; ; pass++ {
		for _, g := range gone {
			if err := iv.DeleteDestination(ctx, g.svc, g.dst); err != nil {
				return err
			}
		}
		templates, conns, err := persistenceTemplates(node, time.Second)
		if err != nil {
			return err
		}
		if templates == 0 {
			break
		}
		if pass == passes {
			return fmt.Errorf("%d persistence templates outlived their real servers %d times:\n%s", templates, passes, conns)
		}
		if err := addAll(); err != nil {
			return err
		}
	}
	// In a random order: the rr scheduler starts over at the first real
	// server of its list, so re-adding them in one order would send every
	// first packet to the same one.
	rand.Shuffle(len(gone), func(i, j int) { gone[i], gone[j] = gone[j], gone[i] })
	return addAll()
}

// persistenceTemplates waits up to wait for the node's IPVS connection
// table to hold no persistence template, and returns how many it still
// holds, with the table.
func persistenceTemplates(node *netnstest.NS, wait time.Duration) (int, []byte, error) {
	deadline := time.Now().Add(wait)
	for {
		var conns []byte
		if err := node.Do(func() error {
			var err error
			conns, err = os.ReadFile("/proc/thread-self/net/ip_vs_conn")
			return err
		}); err != nil {
			return 0, nil, fmt.Errorf("reading the IPVS connections: %w", err)
		}
		templates := 0
		for _, l := range strings.Split(string(conns), "\n")[1:] {
			// A template is keyed on the client's address alone: its
			// client port (FPrt) is 0. Its protocol column is the
			// virtual server's (TCP, UDP), "IP" only for a fwmark one.
			if f := strings.Fields(l); len(f) > 2 && f[2] == "0000" {
				templates++
			}
		}
		if templates == 0 || time.Now().After(deadline) {
			return templates, conns, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// realTraceDivergences are the flows IPVS mode answers differently from
// the shared cases by design (ipvstest.Deviations): the kernel and the
// trace both give the deviation's verdict.
func realTraceDivergences() map[string]pt.KnownDivergence {
	out := map[string]pt.KnownDivergence{}
	for _, d := range ipvstest.Deviations {
		out[d.Case+" / "+d.Flow] = pt.KnownDivergence{Kernel: d.Want, Tracer: d.Want, Why: d.Why}
	}
	return out
}

// checkRealIPVS: the node namespace has IPVS and the family's nat table.
func checkRealIPVS(ctx context.Context, node *netnstest.NS, family v1.IPFamily) error {
	cmd := "iptables"
	if family == v1.IPv6Protocol {
		cmd = "ip6tables"
	}
	if out, err := node.Exec(ctx, cmd, "-w", "5", "-t", "nat", "-S"); err != nil {
		return fmt.Errorf("no %s nat table: %w: %s", family, err, strings.TrimSpace(string(out)))
	}
	if out, err := node.Exec(ctx, "ipvsadm", "-Ln"); err != nil {
		return fmt.Errorf("no IPVS: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// newRealTraceBackend opens real IPVS, netlink, ipset and iptables
// handles in the node namespace, builds the backend over them and a tracer
// reading the same live state as `kproxy trace` does on a node.
func newRealTraceBackend(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
	t.Helper()
	ctx := t.Context()
	ns := node.NS.Name
	iv, err := ipvs.New(ipvs.Options{NetNS: ns})
	if err != nil {
		t.Fatalf("ipvs in %s: %v", ns, err)
	}
	t.Cleanup(func() { _ = iv.Close() })
	nl, err := netlink.New(netlink.Options{NetNS: ns})
	if err != nil {
		t.Fatalf("netlink in %s: %v", ns, err)
	}
	t.Cleanup(func() { _ = nl.Close() })
	sets, err := ipset.New(ipset.Options{NetNS: ns})
	if err != nil {
		t.Fatalf("ipset in %s: %v", ns, err)
	}
	t.Cleanup(func() { _ = sets.Close() })
	proto := ipt.ProtocolIPv4
	if node.Env.Family == v1.IPv6Protocol {
		proto = ipt.ProtocolIPv6
	}
	open := func() ipt.Interface {
		i, err := ipt.New(ctx, ipt.Options{Protocol: proto, NetNS: ns})
		if err != nil {
			t.Fatalf("iptables in %s: %v", ns, err)
		}
		t.Cleanup(func() { _ = i.(*ipt.Real).Close() })
		return i
	}
	b, err := New(Options{IPVS: iv, Netlink: nl, IPSet: sets, IPTables: open(), Sysctl: ProcSysctl{NetNS: ns},
		NodePortAddresses: node.Env.NodePortAddresses})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		save := "iptables-save"
		if proto == ipt.ProtocolIPv6 {
			save = "ip6tables-save"
		}
		for _, cmd := range [][]string{{"ipvsadm", "-Ln"}, {save}, {"ipset", "list"}, {"ip", "addr"}} {
			out, err := node.NS.Exec(context.Background(), cmd[0], cmd[1:]...)
			t.Logf("%s in the node namespace (err %v):\n%s", strings.Join(cmd, " "), err, out)
		}
	})
	src := trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{node.Env.Family: open()}, IPVS: iv, IPSet: sets,
		LocalAddresses: func() ([]netip.Addr, error) { return nl.LocalAddresses(context.Background()) }}
	return b, &ipvsReportTracer{t: t, src: src}
}

// ipvsReportTracer answers the harness's flows with trace.Run over the
// node's live IPVS-mode state, folded into the harness's result.
type ipvsReportTracer struct {
	t   testing.TB
	src trace.Source
}

func (rt *ipvsReportTracer) Trace(f pt.Flow) (pt.Result, error) {
	from := trace.FromExternal
	if f.Origin == pt.FromHost {
		from = trace.FromNode
	}
	proto := strings.ToLower(string(f.Protocol))
	if proto == "" {
		proto = "tcp"
	}
	rep, err := trace.Run(context.Background(), trace.Request{Source: netip.MustParseAddr(f.Source),
		Destination: netip.MustParseAddr(f.Dest), Protocol: proto, DestinationPort: f.Port, From: from,
		Mode: trace.ModeIPVS}, rt.src)
	if err != nil {
		return pt.Result{}, err
	}
	var text strings.Builder
	_ = rep.WriteText(&text)
	rt.t.Cleanup(func() {
		if rt.t.Failed() {
			rt.t.Logf("flow %q: kproxy trace:\n%s", f.Name, text.String())
		}
	})
	if msg := ipvsReportProblem(rep); msg != "" {
		rt.t.Errorf("flow %q: %s", f.Name, msg)
	}
	res := pt.Result{Endpoints: map[string]bool{}}
	switch rep.Verdict {
	case trace.Delivered:
		res.Verdict = pt.Delivered
		total := 0.0
		for _, e := range rep.Endpoints {
			res.Endpoints[e.Address] = e.Masquerade
			total += e.Probability
		}
		if total < 0.999 || total > 1.001 {
			return res, fmt.Errorf("endpoint probabilities add up to %v: %+v", total, rep.Endpoints)
		}
	case trace.Rejected:
		res.Verdict = pt.Rejected
	case trace.Dropped:
		res.Verdict = pt.Dropped
	case trace.NotHandled:
		res.Verdict = pt.NotHandled
	default:
		return res, fmt.Errorf("verdict %q: %s", rep.Verdict, rep.Reason)
	}
	return res, nil
}

// ipvsReportProblem says what is wrong with the report's mode or its
// explanation ("" if nothing): every outcome is explained in Service terms.
func ipvsReportProblem(rep *trace.Report) string {
	switch {
	case rep.Mode != trace.ModeIPVS:
		return fmt.Sprintf("traced in mode %q, want %q", rep.Mode, trace.ModeIPVS)
	case rep.Verdict == trace.Rejected && strings.HasPrefix(rep.Reason, "rejected: no Service uses "):
		// A port no Service uses on a dummy-device address: no Service owns it.
	case rep.Verdict == trace.Rejected:
		if !strings.HasPrefix(rep.Reason, "rejected: ") || !strings.Contains(rep.Reason, " has no endpoints") || rep.Service == "" {
			return fmt.Sprintf("reject reason %q (service %q)", rep.Reason, rep.Service)
		}
	case rep.Verdict == trace.Dropped:
		if !strings.HasPrefix(rep.Reason, "dropped: ") || rep.Service == "" ||
			!(strings.Contains(rep.Reason, "TrafficPolicy is Local") || strings.Contains(rep.Reason, "loadBalancerSourceRanges")) {
			return fmt.Sprintf("drop reason %q (service %q)", rep.Reason, rep.Service)
		}
	case rep.Verdict == trace.Delivered:
		if rep.Service == "" || !strings.Contains(rep.Reason, rep.Service) {
			return fmt.Sprintf("delivered without naming the service: %q", rep.Reason)
		}
	}
	return ""
}
