package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestBehaviourCasesRealKernel runs the shared behaviour cases on a real
// kernel: the engine and this backend program the real iptables of a
// throwaway "node" namespace, and every flow of a case is sent as real
// packets from a namespace standing for its source:
//
//	client: every source that is   ----+                +---- world: the rest of the network.
//	  not an endpoint (pods, outside    |     node       |     Holds every endpoint that is not
//	  clients), bound to its address    +--- iptables ---+     a source, and on lo the case's
//	hairpin: one per source that is ----+  node IPs on lo|     ClusterIPs, external and LB IPs,
//	  also an endpoint, holding it        sends FromHost |     which answer as "sink"
//	                                      flows          +---- (the node's default route)
//
// Every leaf namespace has one veth to the node, its addresses as /32 (or
// /128) host routes on the node, and a default route via the node. A
// namespace never holds both a source and an endpoint that source reaches
// through the node (unless it is that endpoint: a hairpin), so every reply
// crosses the node's conntrack. Each endpoint ("ip:port" of the case's
// slices) is an echo server naming itself and the client address it saw,
// so masquerade is observable: the client is the flow's source, or one of
// the node's addresses when masqueraded.
//
// A flow's verdict on the kernel:
//   - Delivered: an endpoint answered. Delivered flows are sent
//     realDeliveredAttempts times (each from a new socket, so a new
//     conntrack entry) and must reach every wanted endpoint and no other;
//     ClientIP affinity lists are emptied before each attempt, so each is a
//     first packet, as the cases mean.
//   - NotHandled: no DNAT. The destination's owner answers: the node's own
//     server ("node") for the node's addresses and loopback, the sink for
//     any other address. Positive evidence, so it is never confused with a
//     drop.
//   - Rejected: ECONNREFUSED or another ICMP error.
//   - Dropped: no answer before the deadline (realDropDeadline), or EPERM
//     when the node's own OUTPUT dropped it.
//
// The verdicts are compared with the case's expectations by proxiertest
// itself; the packet tracer also traces each flow over a mirror of the very
// rules the kernel runs, and must agree with the kernel.
// Flows a real kernel cannot represent are skipped with their reason, and
// known divergences are listed in realKnownDivergences; both are summarised
// at the end of the test.
func TestBehaviourCasesRealKernel(t *testing.T) {
	netnstest.RequireRoot(t)
	t.Parallel()
	rep := &realReport{}
	// Runs once every parallel subtest has finished.
	t.Cleanup(func() { rep.log(t) })
	for _, c := range pt.Cases() {
		t.Run(c.Name, func(t *testing.T) {
			t.Parallel()
			pt.RunCase(t, c, func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
				rc := newRealCase(t, c, env, rep)
				return rc.backend, rc
			})
		})
	}
}

const (
	// realDeliveredAttempts: with two endpoints chosen at random, 40
	// attempts all miss one with a probability of 2e-12.
	realDeliveredAttempts = 40
	// realDropDeadline bounds a TCP attempt. An ICMP error answering the
	// very first SYN can be lost to the socket lock on a veth (see
	// pkg/netnstest); the one answering the SYN retransmitted after one
	// second counts, so a rejected connection always fails within about a
	// second, and only a drop reaches this deadline.
	realDropDeadline = 2 * time.Second
	// realUDPDeadline bounds one UDP datagram's answer; a UDP flow times out
	// (a drop) after realUDPTries of them.
	realUDPDeadline = 500 * time.Millisecond
	realUDPTries    = 3
	// Names of the servers answering flows nobody DNATs.
	realNodeServer = "node"
	realSinkServer = "sink"
)

// realKnownDivergence is a flow whose kernel result differs from the case
// or from the tracer for a known reason.
type realKnownDivergence struct {
	// kernel and tracer are the results, as realDescribe prints them: the
	// divergence is accepted only while both still give exactly these.
	kernel, tracer string
	why            string
}

// realKnownDivergences by "case / flow". None today: on every flow sent,
// the kernel, the tracer and the cases agree.
var realKnownDivergences = map[string]realKnownDivergence{}

// realAddressing is the leaf plumbing of a family: the node's address on
// leaf link i, and the sink's own address.
type realAddressing struct {
	gateway func(i int) netip.Addr
	sink    netip.Addr
	bits    int // of a host prefix
}

var (
	realAddrV4 = realAddressing{
		gateway: func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("169.254.%d.1", i)) },
		sink:    netip.MustParseAddr("169.254.0.2"), bits: 32,
	}
	realAddrV6 = realAddressing{
		gateway: func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("fd00:ffff:%x::1", i)) },
		sink:    netip.MustParseAddr("fd00:ffff::2"), bits: 128,
	}
)

// realCase is one case's topology, backend and kernel tracer.
type realCase struct {
	t    *testing.T
	name string
	env  pt.Env
	fam  realFamily
	addr realAddressing
	rep  *realReport

	node     *netnstest.NS
	leaves   int      // leaf links made so far
	nodeCmds []string // ip commands for the node, run once every leaf exists
	// senders holds the namespace of each FromNetwork source.
	senders map[netip.Addr]*netnstest.NS
	// nodeAddrs are every address of the node namespace: an endpoint seeing
	// one of them as client saw a masqueraded flow.
	nodeAddrs    map[netip.Addr]bool
	nodeAddrList []netip.Addr    // the same, for the tracer
	endpoints    map[string]bool // echo server names: "ip:port"
	affinity     bool            // some service has ClientIP affinity

	backend *Backend
	mirror  *iptablestest.Fake // the tracer's copy of the kernel's rules

	flows   []pt.Flow
	once    sync.Once
	results map[string]realResult // by realFlowKey
}

// realResult is what the kernel did with a flow.
type realResult struct {
	skip string // why the flow cannot be sent on a real kernel
	res  pt.Result
	err  error
}

func realFlowKey(f pt.Flow) string {
	return fmt.Sprintf("%s|%s|%s|%s|%d|%d", f.Name, f.Protocol, f.Source, f.Dest, f.Port, f.Origin)
}

func newRealCase(t *testing.T, c pt.Case, env pt.Env, rep *realReport) *realCase {
	t.Helper()
	rc := &realCase{t: t, name: c.Name, env: env, rep: rep, fam: realIPv4, addr: realAddrV4,
		senders: map[netip.Addr]*netnstest.NS{}, endpoints: map[string]bool{}, results: map[string]realResult{}}
	if env.Family == v1.IPv6Protocol {
		rc.fam, rc.addr = realIPv6, realAddrV6
	}
	for _, f := range c.Flows {
		if f.Protocol == "" {
			f.Protocol = v1.ProtocolTCP
		}
		rc.flows = append(rc.flows, f)
	}
	for _, s := range c.Services {
		rc.affinity = rc.affinity || s.Spec.SessionAffinity == v1.ServiceAffinityClientIP
	}

	rc.node = netnstest.New(t, "btnode")
	if _, err := rc.node.Exec(t.Context(), rc.fam.iptables, "-w", "5", "-t", "nat", "-S"); err != nil {
		t.Skipf("this kernel has no %s nat table: %v", rc.fam.protocol, err)
	}
	rc.prepareNS(t, rc.node)
	rc.node.Sysctl(t, rc.fam.forwarding, "1")

	// Who listens where: the endpoints, the node's own servers and the sink.
	epListeners := realEndpointListeners(c, env.Family)
	var sources, virtual []netip.Addr
	nodeListeners, sinkListeners := map[realListener]bool{}, map[realListener]bool{}
	for _, f := range rc.flows {
		if rc.skipReason(f) != "" {
			continue
		}
		src, dst := netip.MustParseAddr(f.Source), netip.MustParseAddr(f.Dest)
		if f.Origin == pt.FromNetwork && !slices.Contains(sources, src) {
			sources = append(sources, src)
		}
		l := realListener{proto: f.Protocol, at: netip.AddrPortFrom(dst, uint16(f.Port))}
		if _, isEP := epListeners[dst]; isEP {
			continue
		}
		if rc.isNodeLocal(dst) {
			nodeListeners[l] = true
		} else {
			sinkListeners[l] = true
			if !slices.Contains(virtual, dst) {
				virtual = append(virtual, dst)
			}
		}
	}
	slices.SortFunc(sources, netip.Addr.Compare)
	slices.SortFunc(virtual, netip.Addr.Compare)

	// The world first: the node's default route points at it.
	var world []netip.Addr
	for ip := range epListeners {
		if !slices.Contains(sources, ip) && !rc.isNodeLocal(ip) {
			world = append(world, ip)
		}
	}
	slices.SortFunc(world, netip.Addr.Compare)
	worldNS := rc.leaf(t, "btworld", append([]netip.Addr{rc.addr.sink}, world...))
	var cmds []string
	for _, ip := range virtual {
		if slices.Contains(sources, ip) {
			t.Fatalf("flow destination %s is also a flow source", ip)
		}
		cmds = append(cmds, netnstest.AddrAddCommand("lo", rc.host(ip)))
	}
	worldNS.IPBatch(t, cmds...)
	// The node's own addresses are on its lo, so that MASQUERADE, which
	// prefers the outgoing device's address, always picks a link's gateway:
	// a masqueraded flow the node itself sends from a node IP stays
	// distinguishable from an unmasqueraded one.
	for _, ip := range env.NodeIPs {
		rc.nodeCmds = append(rc.nodeCmds, netnstest.AddrAddCommand("lo", rc.host(ip)))
	}
	rc.nodeCmds = append(rc.nodeCmds, fmt.Sprintf("route add %s via %s", netip.PrefixFrom(rc.fam.unspecified, 0), rc.addr.sink))

	// Senders: those that are endpoints too each alone with their endpoint,
	// the others together.
	var clients []netip.Addr
	for _, src := range sources {
		if _, isEP := epListeners[src]; isEP {
			rc.senders[src] = rc.leaf(t, "bthairpin", []netip.Addr{src})
		} else {
			clients = append(clients, src)
		}
	}
	if len(clients) > 0 {
		ns := rc.leaf(t, "btclient", clients)
		for _, src := range clients {
			rc.senders[src] = ns
		}
	}
	rc.node.IPBatch(t, rc.nodeCmds...)

	for ip, ls := range epListeners {
		ns := worldNS
		switch {
		case rc.isNodeLocal(ip):
			ns = rc.node
		case rc.senders[ip] != nil:
			ns = rc.senders[ip]
		}
		for _, l := range ls {
			rc.endpoints[l.at.String()] = true
			rc.startEcho(t, ns, l, l.at.String())
		}
	}
	for l := range nodeListeners {
		rc.startEcho(t, rc.node, l, realNodeServer)
	}
	for l := range sinkListeners {
		rc.startEcho(t, worldNS, l, realSinkServer)
	}

	addrs, err := nsAddresses(rc.node)
	if err != nil {
		t.Fatal(err)
	}
	rc.nodeAddrList = addrs
	rc.nodeAddrs = map[netip.Addr]bool{}
	for _, a := range addrs {
		rc.nodeAddrs[a] = true
	}
	rc.newBackend(t)
	return rc
}

// realListener is one server a case needs.
type realListener struct {
	proto v1.Protocol
	at    netip.AddrPort
}

// realEndpointListeners lists, by address, the servers of every endpoint
// of the case's slices in the family.
func realEndpointListeners(c pt.Case, family v1.IPFamily) map[netip.Addr][]realListener {
	out := map[netip.Addr][]realListener{}
	for _, sl := range c.Slices {
		for _, ep := range sl.Endpoints {
			for _, a := range ep.Addresses {
				ip := netip.MustParseAddr(a)
				if ip.Is6() != (family == v1.IPv6Protocol) {
					continue
				}
				for _, p := range sl.Ports {
					l := realListener{proto: v1.ProtocolTCP, at: netip.AddrPortFrom(ip, uint16(*p.Port))}
					if p.Protocol != nil {
						l.proto = *p.Protocol
					}
					if !slices.Contains(out[ip], l) {
						out[ip] = append(out[ip], l)
					}
				}
			}
		}
	}
	return out
}

// startEcho starts the server of l in ns, answering as name.
func (rc *realCase) startEcho(t *testing.T, ns *netnstest.NS, l realListener, name string) {
	t.Helper()
	switch l.proto {
	case v1.ProtocolTCP:
		ns.StartEcho(t, rc.fam.tcp, l.at.String(), name)
	case v1.ProtocolUDP:
		ns.StartEcho(t, rc.fam.udp, l.at.String(), name)
	} // SCTP is never probed (see skipReason).
}

// prepareNS readies a namespace before links join it: IPv6 addresses
// (link-local ones included) usable at once, no ICMP redirects between
// leaves sharing the node.
func (rc *realCase) prepareNS(t *testing.T, ns *netnstest.NS) {
	t.Helper()
	if rc.env.Family == v1.IPv6Protocol {
		ns.Sysctl(t, "net.ipv6.conf.default.accept_dad", "0")
		ns.Sysctl(t, "net.ipv6.conf.all.accept_dad", "0")
		return
	}
	ns.Sysctl(t, "net.ipv4.conf.default.send_redirects", "0")
	ns.Sysctl(t, "net.ipv4.conf.all.send_redirects", "0")
}

// host is ip as a host prefix.
func (rc *realCase) host(ip netip.Addr) netip.Prefix { return netip.PrefixFrom(ip, rc.addr.bits) }

// leaf makes a namespace linked to the node holding addrs (at least one):
// its default route goes via the node's end of the link, which has an
// address of its own (a gateway), and the node gets host routes to addrs
// (in rc.nodeCmds).
func (rc *realCase) leaf(t *testing.T, prefix string, addrs []netip.Addr) *netnstest.NS {
	t.Helper()
	gw := rc.addr.gateway(rc.leaves)
	rc.leaves++
	ns := netnstest.New(t, prefix)
	rc.prepareNS(t, ns)
	v := netnstest.Link(t, ns, rc.host(addrs[0]), rc.node, rc.host(gw))
	var cmds []string
	for _, a := range addrs[1:] {
		cmds = append(cmds, netnstest.AddrAddCommand(v.A, rc.host(a)))
	}
	cmds = append(cmds, fmt.Sprintf("route add %s dev %s", rc.host(gw), v.A),
		fmt.Sprintf("route add %s via %s", netip.PrefixFrom(rc.fam.unspecified, 0), gw))
	ns.IPBatch(t, cmds...)
	for _, a := range addrs {
		rc.nodeCmds = append(rc.nodeCmds, fmt.Sprintf("route add %s dev %s", rc.host(a), v.B))
	}
	return ns
}

// newBackend makes the backend over the node's real iptables, mirrored into
// a fake for the tracer.
func (rc *realCase) newBackend(t *testing.T) {
	t.Helper()
	real, err := ipt.New(t.Context(), ipt.Options{Protocol: rc.fam.protocol, NetNS: rc.node.Name})
	if err != nil {
		t.Fatalf("iptables in %s: %v", rc.node.Name, err)
	}
	t.Cleanup(func() {
		if err := real.(*ipt.Real).Close(); err != nil {
			t.Error(err)
		}
	})
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
			out, err := real.SaveInto(context.Background(), table)
			t.Logf("%s-save -t %s in the node namespace (err %v):\n%s", rc.fam.protocol, table, err, out)
		}
	})
	rc.mirror = iptablestest.NewFake(rc.fam.protocol)
	rc.mirror.RandomFully = real.HasRandomFully()
	rc.backend, err = New(Options{
		IPTables: &mirroredIPTables{Interface: real, fake: rc.mirror}, NodePortAddresses: rc.env.NodePortAddresses,
		LocalAddresses: func() ([]netip.Addr, error) { return nsAddresses(rc.node) },
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
}

// isNodeLocal: one of the case's node addresses, or loopback.
func (rc *realCase) isNodeLocal(ip netip.Addr) bool {
	return ip.IsLoopback() || slices.Contains(rc.env.NodeIPs, ip)
}

// skipReason says why a flow cannot be sent on a real kernel ("" if it can).
func (rc *realCase) skipReason(f pt.Flow) string {
	src := netip.MustParseAddr(f.Source)
	switch {
	case f.Protocol == v1.ProtocolSCTP:
		return "SCTP: Go's net package has no SCTP sockets" + sctpKernelNote()
	case f.Protocol != v1.ProtocolTCP && f.Protocol != v1.ProtocolUDP:
		return fmt.Sprintf("protocol %s is not probed", f.Protocol)
	case f.Origin == pt.FromNetwork && rc.isNodeLocal(src):
		return "a packet arriving from the network with one of the node's own addresses as source is a martian on a real kernel"
	case f.Origin == pt.FromHost && !rc.isNodeLocal(src):
		return "the node cannot send from an address it does not hold"
	}
	return ""
}

// sctpKernelNote says whether this kernel could have carried SCTP.
func sctpKernelNote() string {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, syscall.IPPROTO_SCTP)
	if err != nil {
		return fmt.Sprintf(", nor has this kernel (%v)", err)
	}
	_ = syscall.Close(fd)
	return ""
}

// Trace implements pt.Tracer with real packets. The first call sends every
// flow of the case at once (the rules are in place by then), later calls
// only look up. A skipped flow, or a known divergence that still holds,
// answers with the flow's own expectation after reporting it, so that
// proxiertest has nothing to flag; everything else is the kernel's result.
func (rc *realCase) Trace(f pt.Flow) (pt.Result, error) {
	rc.once.Do(rc.probeAll)
	r, ok := rc.results[realFlowKey(f)]
	if !ok {
		return pt.Result{}, fmt.Errorf("flow %q was not probed", f.Name)
	}
	key := rc.name + " / " + f.Name
	if r.skip != "" {
		rc.rep.add("skipped", key, r.skip)
		return realExpected(f), nil
	}
	if r.err != nil {
		return pt.Result{}, r.err
	}
	kernel := realDescribe(r.res)
	tracer := "error"
	if tr, err := traceFlow(rc.mirror, rc.nodeAddrList, f, nil); err != nil {
		tracer += ": " + err.Error()
	} else {
		tracer = realDescribe(tr)
	}
	want := realDescribe(realExpected(f))
	if d, ok := realKnownDivergences[key]; ok {
		if kernel == d.kernel && tracer == d.tracer {
			rc.rep.add("known divergence", key, fmt.Sprintf("want %s; tracer %s; kernel %s: %s", want, tracer, kernel, d.why))
			return realExpected(f), nil
		}
		rc.t.Errorf("flow %q: known divergence no longer holds: kernel %s, tracer %s; recorded kernel %s, tracer %s (update realKnownDivergences)",
			f.Name, kernel, tracer, d.kernel, d.tracer)
	} else if kernel != tracer {
		rc.t.Errorf("flow %q: the kernel and the tracer disagree on the same rules: want %s; kernel %s; tracer %s", f.Name, want, kernel, tracer)
	}
	return r.res, nil
}

// probeAll sends every flow of the case, concurrently.
func (rc *realCase) probeAll() {
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, f := range rc.flows {
		wg.Go(func() {
			r := realResult{skip: rc.skipReason(f)}
			if r.skip == "" {
				r.res, r.err = rc.probe(f)
			}
			mu.Lock()
			rc.results[realFlowKey(f)] = r
			mu.Unlock()
		})
	}
	wg.Wait()
}

// realAttempt is the outcome of one attempt of a flow.
type realAttempt struct {
	verdict  pt.Verdict
	endpoint string // Delivered: the server that answered
	masq     bool
}

// probe sends a flow: a first attempt; when delivered, more, each of which
// must be delivered too.
func (rc *realCase) probe(f pt.Flow) (pt.Result, error) {
	res := pt.Result{Endpoints: map[string]bool{}}
	for i := 0; i < realDeliveredAttempts; i++ {
		a, err := rc.attempt(f)
		if err != nil {
			return res, fmt.Errorf("attempt %d: %w", i+1, err)
		}
		if i == 0 {
			res.Verdict = a.verdict
		}
		if a.verdict != res.Verdict {
			return res, fmt.Errorf("attempt %d was %s after %s ones (endpoints %v)", i+1, a.verdict, res.Verdict, res.Endpoints)
		}
		if a.verdict != pt.Delivered {
			return res, nil
		}
		if prev, seen := res.Endpoints[a.endpoint]; seen && prev != a.masq {
			return res, fmt.Errorf("endpoint %s reached both with and without masquerade", a.endpoint)
		}
		res.Endpoints[a.endpoint] = a.masq
	}
	return res, nil
}

// attempt sends one request of the flow from a new socket.
func (rc *realCase) attempt(f pt.Flow) (realAttempt, error) {
	src := netip.MustParseAddr(f.Source)
	from := rc.node
	if f.Origin == pt.FromNetwork {
		from = rc.senders[src]
	}
	if rc.affinity {
		if err := rc.forgetAffinity(); err != nil {
			return realAttempt{}, err
		}
	}
	network, deadline, tries := rc.fam.tcp, realDropDeadline, 1
	if f.Protocol == v1.ProtocolUDP {
		network, deadline, tries = rc.fam.udp, realUDPDeadline, realUDPTries
	}
	dest := netip.AddrPortFrom(netip.MustParseAddr(f.Dest), uint16(f.Port)).String()
	var reply string
	var err error
	for try := 0; try < tries; try++ {
		ctx, cancel := context.WithTimeout(rc.t.Context(), deadline)
		reply, err = netnstest.RequestWith(ctx, from, network, dest, netnstest.RequestOptions{Source: src})
		cancel()
		if !errors.Is(err, netnstest.ErrTimeout) {
			break
		}
	}
	switch {
	case errors.Is(err, netnstest.ErrRefused):
		return realAttempt{verdict: pt.Rejected}, nil
	case errors.Is(err, netnstest.ErrTimeout), errors.Is(err, syscall.EPERM):
		return realAttempt{verdict: pt.Dropped}, nil
	case err != nil:
		return realAttempt{}, err
	}
	name, client, err := netnstest.ParseEchoReply(reply)
	if err != nil {
		return realAttempt{}, err
	}
	switch {
	case name == realNodeServer || name == realSinkServer:
		return realAttempt{verdict: pt.NotHandled}, nil
	case !rc.endpoints[name]:
		return realAttempt{}, fmt.Errorf("reply %q from an unknown server", reply)
	case client.Addr() == src:
		return realAttempt{verdict: pt.Delivered, endpoint: name}, nil
	case rc.nodeAddrs[client.Addr()]:
		return realAttempt{verdict: pt.Delivered, endpoint: name, masq: true}, nil
	}
	return realAttempt{}, fmt.Errorf("endpoint %s saw client %s: neither the source %s nor a node address", name, client, src)
}

// forgetAffinity empties the node's -m recent lists (ClientIP affinity), so
// that the next packet is a first one.
func (rc *realCase) forgetAffinity() error {
	return rc.node.Do(func() error {
		// thread-self: this thread is the one inside the namespace.
		dir := "/proc/thread-self/net/xt_recent"
		entries, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("listing recent lists: %w", err)
		}
		for _, e := range entries {
			if err := os.WriteFile(filepath.Join(dir, e.Name()), []byte("/\n"), 0); err != nil {
				return fmt.Errorf("emptying recent list %s: %w", e.Name(), err)
			}
		}
		return nil
	})
}

// realExpected is the result a flow wants.
func realExpected(f pt.Flow) pt.Result {
	r := pt.Result{Verdict: f.Want, Endpoints: map[string]bool{}}
	if f.Want == pt.Delivered {
		for _, ep := range f.WantEndpoints {
			r.Endpoints[ep] = f.WantMasquerade || slices.Contains(f.WantHairpin, ep)
		}
	}
	return r
}

// realDescribe prints a result: its verdict and, when delivered, each
// endpoint reached, masqueraded or not.
func realDescribe(r pt.Result) string {
	if r.Verdict != pt.Delivered {
		return string(r.Verdict)
	}
	var eps []string
	for ep, masq := range r.Endpoints {
		if masq {
			ep += " masqueraded"
		}
		eps = append(eps, ep)
	}
	sort.Strings(eps)
	return "delivered to " + strings.Join(eps, ", ")
}

// realReport collects the skipped flows and known divergences of every
// case, for one summary at the end.
type realReport struct {
	mu    sync.Mutex
	lines []string
}

func (r *realReport) add(kind, key, detail string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines = append(r.lines, fmt.Sprintf("%s: %s: %s", kind, key, detail))
}

func (r *realReport) log(t *testing.T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	sort.Strings(r.lines)
	t.Logf("%d flows not checked against the kernel:\n%s", len(r.lines), strings.Join(r.lines, "\n"))
}

// mirroredIPTables applies every change to the real iptables and then to a
// fake, so the tracer can trace the very rules the kernel runs. Reads go to
// the real one.
type mirroredIPTables struct {
	ipt.Interface
	fake *iptablestest.Fake
}

// mirrored runs real, then (if it succeeded) fake.
func mirrored[T any](real func() (T, error), fake func() error) (T, error) {
	v, err := real()
	if err != nil {
		return v, err
	}
	if err := fake(); err != nil {
		return v, fmt.Errorf("mirroring into the fake iptables: %w", err)
	}
	return v, nil
}

// noValue adapts an error-only operation to mirrored.
func noValue(op func() error) func() (struct{}, error) {
	return func() (struct{}, error) { return struct{}{}, op() }
}

func (m *mirroredIPTables) EnsureChain(ctx context.Context, table ipt.Table, chain ipt.Chain) (bool, error) {
	return mirrored(func() (bool, error) { return m.Interface.EnsureChain(ctx, table, chain) },
		func() error { _, err := m.fake.EnsureChain(ctx, table, chain); return err })
}

func (m *mirroredIPTables) EnsureRule(ctx context.Context, pos ipt.RulePosition, table ipt.Table, chain ipt.Chain, args ...string) (bool, error) {
	return mirrored(func() (bool, error) { return m.Interface.EnsureRule(ctx, pos, table, chain, args...) },
		func() error { _, err := m.fake.EnsureRule(ctx, pos, table, chain, args...); return err })
}

func (m *mirroredIPTables) DeleteRule(ctx context.Context, table ipt.Table, chain ipt.Chain, args ...string) error {
	_, err := mirrored(noValue(func() error { return m.Interface.DeleteRule(ctx, table, chain, args...) }),
		func() error { return m.fake.DeleteRule(ctx, table, chain, args...) })
	return err
}

func (m *mirroredIPTables) FlushChain(ctx context.Context, table ipt.Table, chain ipt.Chain) error {
	_, err := mirrored(noValue(func() error { return m.Interface.FlushChain(ctx, table, chain) }),
		func() error { return m.fake.FlushChain(ctx, table, chain) })
	return err
}

func (m *mirroredIPTables) DeleteChain(ctx context.Context, table ipt.Table, chain ipt.Chain) error {
	_, err := mirrored(noValue(func() error { return m.Interface.DeleteChain(ctx, table, chain) }),
		func() error { return m.fake.DeleteChain(ctx, table, chain) })
	return err
}

func (m *mirroredIPTables) Restore(ctx context.Context, data []byte) error {
	_, err := mirrored(noValue(func() error { return m.Interface.Restore(ctx, data) }),
		func() error { return m.fake.Restore(ctx, data) })
	return err
}
