package proxiertest

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
)

// This file runs the behaviour cases on a real kernel, for any backend: the
// engine and the backend program a throwaway "node" network namespace, and
// every flow of a case is sent as real packets from a namespace standing for
// its source:
//
//	client: every source that is   ----+                +---- world: the rest of the network.
//	  not an endpoint (pods, outside    |     node       |     Holds every endpoint that is not
//	  clients), bound to its address    +--- backend ----+     a source, and on lo the case's
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
//     RealDeliveredAttempts times (each from a new socket, so a new
//     conntrack entry) and must reach every wanted endpoint and no other;
//     ClientIP affinity state is forgotten before each attempt
//     (RealKernel.ForgetAffinity), so each is a first packet, as the cases
//     mean.
//   - NotHandled: no DNAT. The destination's owner answers: the node's own
//     server ("node") for the node's addresses and loopback, the sink for
//     any other address. Positive evidence, so it is never confused with a
//     drop.
//   - Rejected: ECONNREFUSED or another ICMP error.
//   - Dropped: no answer before the deadline (realDropDeadline), or EPERM
//     when the node's own output path dropped it.
//
// The verdicts are compared with the case's expectations by RunCase itself;
// the backend's packet tracer, when it has one, also traces each flow over a
// mirror of the very rules the kernel runs, and must agree with the kernel.
// Flows a real kernel cannot represent are skipped with their reason, and
// known divergences (RealKernel.KnownDivergences) are accepted while they
// hold exactly; both are summarised at the end of RunRealKernel.

const (
	// RealDeliveredAttempts: with two endpoints chosen at random, 40
	// attempts all miss one with a probability of 2e-12.
	RealDeliveredAttempts = 40
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

// RealKernel is what differs between backends on a real kernel.
type RealKernel struct {
	// NSPrefix starts the names of a case's namespaces (e.g. "bt":
	// "btnode", "btworld", ...); at most 6 characters.
	NSPrefix string
	// CheckKernel, when set, says why the node namespace cannot run the
	// backend for family (the case is then skipped), or nil.
	CheckKernel func(ctx context.Context, node *netnstest.NS, family v1.IPFamily) error
	// NewBackend builds the backend programming the node namespace and,
	// when the backend has one, a tracer over a mirror of exactly what the
	// backend writes there (nil otherwise). It runs once the topology and
	// the servers are in place.
	NewBackend func(t *testing.T, node RealNode) (proxier.Backend, Tracer)
	// ForgetAffinity empties the node's ClientIP affinity state, so that
	// the next packet of every client is a first one. It runs before every
	// attempt of a case with a ClientIP affinity service.
	ForgetAffinity func(node *netnstest.NS) error
	// KnownDivergences are flows, by "case / flow", whose kernel result
	// differs from the case or from the tracer for a known reason.
	KnownDivergences map[string]KnownDivergence
}

// KnownDivergence is a flow whose kernel result differs from the case or
// from the tracer for a known reason.
type KnownDivergence struct {
	// Kernel and Tracer are the results, as DescribeResult prints them: the
	// divergence is accepted only while both still give exactly these.
	Kernel, Tracer string
	Why            string
}

// RealNode is the node namespace of a case, as a backend sees it.
type RealNode struct {
	NS  *netnstest.NS
	Env Env
	// Addrs are every address of the node namespace when the backend is
	// built: the local addresses a tracer must assume.
	Addrs []netip.Addr
}

// LocalAddresses lists the node namespace's addresses now, for a backend's
// options.
func (n RealNode) LocalAddresses() ([]netip.Addr, error) { return NSAddresses(n.NS) }

// RunRealKernel runs every behaviour case, in parallel, on the real kernel
// through the backend rk describes. It needs root and skips otherwise.
func RunRealKernel(t *testing.T, rk RealKernel) {
	netnstest.RequireRoot(t)
	t.Parallel()
	rep := &RealReport{}
	// Runs once every parallel subtest has finished.
	t.Cleanup(func() { rep.Log(t) })
	for _, c := range Cases() {
		t.Run(c.Name, func(t *testing.T) {
			t.Parallel()
			RunCase(t, c, func(t *testing.T, env Env) (proxier.Backend, Tracer) {
				rc := NewRealCase(t, c, env, rk, rep)
				return rc.Backend(), rc
			})
		})
	}
}

// Env is the environment the case configures.
func (c *Case) Env() Env { return c.env() }

// realAddressing is the leaf plumbing of a family.
type realAddressing struct {
	tcp, udp    string // networks for netnstest
	forwarding  string // sysctl enabling forwarding
	unspecified netip.Addr
	// gateway is the node's address on leaf link i, sink the sink's own
	// address.
	gateway func(i int) netip.Addr
	sink    netip.Addr
	bits    int // of a host prefix
}

var (
	realAddrV4 = realAddressing{
		tcp: "tcp4", udp: "udp4", forwarding: "net.ipv4.ip_forward", unspecified: netip.IPv4Unspecified(),
		gateway: func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("169.254.%d.1", i)) },
		sink:    netip.MustParseAddr("169.254.0.2"), bits: 32,
	}
	realAddrV6 = realAddressing{
		tcp: "tcp6", udp: "udp6", forwarding: "net.ipv6.conf.all.forwarding", unspecified: netip.IPv6Unspecified(),
		gateway: func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("fd00:ffff:%x::1", i)) },
		sink:    netip.MustParseAddr("fd00:ffff::2"), bits: 128,
	}
)

// RealCase is one case's topology on a real kernel, its backend, and a
// Tracer that sends real packets.
type RealCase struct {
	t    *testing.T
	name string
	env  Env
	addr realAddressing
	rk   RealKernel
	rep  *RealReport

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

	backend proxier.Backend
	tracer  Tracer // over a mirror of the kernel's rules; nil: none

	flows   []Flow
	once    sync.Once
	results map[string]realResult // by realFlowKey
}

// realResult is what the kernel did with a flow.
type realResult struct {
	skip string // why the flow cannot be sent on a real kernel
	res  Result
	err  error
}

func realFlowKey(f Flow) string {
	return fmt.Sprintf("%s|%s|%s|%s|%d|%d", f.Name, f.Protocol, f.Source, f.Dest, f.Port, f.Origin)
}

// NewRealCase builds the topology of c on the real kernel, starts its
// servers and builds the backend (rk.NewBackend); the caller drives the
// backend (RunCase does). rep collects skipped flows and known divergences;
// nil logs them in t.
func NewRealCase(t *testing.T, c Case, env Env, rk RealKernel, rep *RealReport) *RealCase {
	t.Helper()
	if rk.NSPrefix == "" {
		rk.NSPrefix = "rk"
	}
	rc := &RealCase{t: t, name: c.Name, env: env, rk: rk, rep: rep, addr: realAddrV4,
		senders: map[netip.Addr]*netnstest.NS{}, endpoints: map[string]bool{}, results: map[string]realResult{}}
	if env.Family == v1.IPv6Protocol {
		rc.addr = realAddrV6
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

	rc.node = netnstest.New(t, rk.NSPrefix+"node")
	if rk.CheckKernel != nil {
		if err := rk.CheckKernel(t.Context(), rc.node, env.Family); err != nil {
			t.Skipf("this kernel cannot run the backend for %s: %v", env.Family, err)
		}
	}
	rc.prepareNS(t, rc.node)
	rc.node.Sysctl(t, rc.addr.forwarding, "1")

	// Who listens where: the endpoints, the node's own servers and the sink.
	epListeners := realEndpointListeners(c, env.Family)
	var sources, virtual []netip.Addr
	nodeListeners, sinkListeners := map[realListener]bool{}, map[realListener]bool{}
	for _, f := range rc.flows {
		if rc.SkipReason(f) != "" {
			continue
		}
		src, dst := netip.MustParseAddr(f.Source), netip.MustParseAddr(f.Dest)
		if f.Origin == FromNetwork && !slices.Contains(sources, src) {
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
	worldNS := rc.leaf(t, rk.NSPrefix+"world", append([]netip.Addr{rc.addr.sink}, world...))
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
	rc.nodeCmds = append(rc.nodeCmds, fmt.Sprintf("route add %s via %s", netip.PrefixFrom(rc.addr.unspecified, 0), rc.addr.sink))

	// Senders: those that are endpoints too each alone with their endpoint,
	// the others together.
	var clients []netip.Addr
	for _, src := range sources {
		if _, isEP := epListeners[src]; isEP {
			rc.senders[src] = rc.leaf(t, rk.NSPrefix+"hairpin", []netip.Addr{src})
		} else {
			clients = append(clients, src)
		}
	}
	if len(clients) > 0 {
		ns := rc.leaf(t, rk.NSPrefix+"client", clients)
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

	addrs, err := NSAddresses(rc.node)
	if err != nil {
		t.Fatal(err)
	}
	rc.nodeAddrList = addrs
	rc.nodeAddrs = map[netip.Addr]bool{}
	for _, a := range addrs {
		rc.nodeAddrs[a] = true
	}
	rc.backend, rc.tracer = rk.NewBackend(t, rc.Node())
	return rc
}

// Backend is the backend rk.NewBackend built.
func (rc *RealCase) Backend() proxier.Backend { return rc.backend }

// Node is the case's node namespace.
func (rc *RealCase) Node() RealNode {
	return RealNode{NS: rc.node, Env: rc.env, Addrs: slices.Clone(rc.nodeAddrList)}
}

// realListener is one server a case needs.
type realListener struct {
	proto v1.Protocol
	at    netip.AddrPort
}

// realEndpointListeners lists, by address, the servers of every endpoint
// of the case's slices in the family.
func realEndpointListeners(c Case, family v1.IPFamily) map[netip.Addr][]realListener {
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
func (rc *RealCase) startEcho(t *testing.T, ns *netnstest.NS, l realListener, name string) {
	t.Helper()
	switch l.proto {
	case v1.ProtocolTCP:
		startLineEcho(t, ns, rc.addr.tcp, l.at.String(), name)
	case v1.ProtocolUDP:
		ns.StartEcho(t, rc.addr.udp, l.at.String(), name)
	} // SCTP is never probed (see SkipReason).
}

// startLineEcho serves TCP on addr in ns until the test ends: every
// connection gets netnstest's echo reply ("<name> <client ip:port>\n") at
// once, and again for every line it sends, until the client closes it. A
// connection can so outlive a change of the rules and show which endpoint
// still answers it.
func startLineEcho(t *testing.T, ns *netnstest.NS, network, addr, name string) {
	t.Helper()
	l, err := ns.Listen(context.Background(), network, addr)
	if err != nil {
		t.Fatalf("echo %s %s in %s: %v", network, addr, ns.Name, err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	closed := false
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return // closed
			}
			mu.Lock()
			if closed {
				mu.Unlock()
				_ = c.Close()
				return
			}
			conns[c] = true
			mu.Unlock()
			wg.Go(func() {
				serveLines(c, name)
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
				_ = c.Close()
			})
		}
	})
	t.Cleanup(func() {
		_ = l.Close()
		mu.Lock()
		closed = true
		for c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

// serveLines answers c at once and after every line it sends.
func serveLines(c net.Conn, name string) {
	reply := []byte(name + " " + c.RemoteAddr().String() + "\n")
	r := bufio.NewReader(c)
	for {
		_ = c.SetWriteDeadline(time.Now().Add(netnstest.DefaultRequestTimeout))
		if _, err := c.Write(reply); err != nil {
			return
		}
		if _, err := r.ReadString('\n'); err != nil {
			return
		}
	}
}

// prepareNS readies a namespace before links join it: IPv6 addresses
// (link-local ones included) usable at once, no ICMP redirects between
// leaves sharing the node.
func (rc *RealCase) prepareNS(t *testing.T, ns *netnstest.NS) {
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
func (rc *RealCase) host(ip netip.Addr) netip.Prefix { return netip.PrefixFrom(ip, rc.addr.bits) }

// leaf makes a namespace linked to the node holding addrs (at least one):
// its default route goes via the node's end of the link, which has an
// address of its own (a gateway), and the node gets host routes to addrs
// (in rc.nodeCmds).
func (rc *RealCase) leaf(t *testing.T, prefix string, addrs []netip.Addr) *netnstest.NS {
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
		fmt.Sprintf("route add %s via %s", netip.PrefixFrom(rc.addr.unspecified, 0), gw))
	ns.IPBatch(t, cmds...)
	for _, a := range addrs {
		rc.nodeCmds = append(rc.nodeCmds, fmt.Sprintf("route add %s dev %s", rc.host(a), v.B))
	}
	return ns
}

// isNodeLocal: one of the case's node addresses, or loopback.
func (rc *RealCase) isNodeLocal(ip netip.Addr) bool {
	return ip.IsLoopback() || slices.Contains(rc.env.NodeIPs, ip)
}

// SkipReason says why a flow cannot be sent on a real kernel ("" if it
// can).
func (rc *RealCase) SkipReason(f Flow) string {
	src := netip.MustParseAddr(f.Source)
	switch {
	case f.Protocol == v1.ProtocolSCTP:
		return "SCTP: Go's net package has no SCTP sockets" + sctpKernelNote()
	case f.Protocol != v1.ProtocolTCP && f.Protocol != v1.ProtocolUDP:
		return fmt.Sprintf("protocol %s is not probed", f.Protocol)
	case f.Origin == FromNetwork && rc.isNodeLocal(src):
		return "a packet arriving from the network with one of the node's own addresses as source is a martian on a real kernel"
	case f.Origin == FromHost && !rc.isNodeLocal(src):
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

// Trace implements Tracer with real packets. The first call sends every
// flow of the case at once (the rules are in place by then), later calls
// only look up. A skipped flow, or a known divergence that still holds,
// answers with the flow's own expectation after reporting it, so that
// RunCase has nothing to flag; everything else is the kernel's result.
func (rc *RealCase) Trace(f Flow) (Result, error) {
	rc.once.Do(func() { rc.results = rc.probeAll(rc.flows) })
	r, ok := rc.results[realFlowKey(f)]
	if !ok {
		return Result{}, fmt.Errorf("flow %q was not probed", f.Name)
	}
	key := rc.name + " / " + f.Name
	if r.skip != "" {
		rc.report("skipped", key, r.skip)
		return ExpectedResult(f), nil
	}
	if r.err != nil {
		return Result{}, r.err
	}
	kernel := DescribeResult(r.res)
	tracer := "none"
	if rc.tracer != nil {
		if tr, err := rc.tracer.Trace(f); err != nil {
			tracer = "error: " + err.Error()
		} else {
			tracer = DescribeResult(tr)
		}
	}
	want := DescribeResult(ExpectedResult(f))
	if d, ok := rc.rk.KnownDivergences[key]; ok {
		if kernel == d.Kernel && tracer == d.Tracer {
			rc.report("known divergence", key, fmt.Sprintf("want %s; tracer %s; kernel %s: %s", want, tracer, kernel, d.Why))
			return ExpectedResult(f), nil
		}
		rc.t.Errorf("flow %q: known divergence no longer holds: kernel %s, tracer %s; recorded kernel %s, tracer %s (update the known divergences)",
			f.Name, kernel, tracer, d.Kernel, d.Tracer)
	} else if rc.tracer != nil && kernel != tracer {
		rc.t.Errorf("flow %q: the kernel and the tracer disagree on the same rules: want %s; kernel %s; tracer %s", f.Name, want, kernel, tracer)
	}
	return r.res, nil
}

func (rc *RealCase) report(kind, key, detail string) {
	if rc.rep == nil {
		rc.t.Logf("%s: %s: %s", kind, key, detail)
		return
	}
	rc.rep.add(kind, key, detail)
}

// CheckKernelFlows sends flows now (each as Probe does, concurrently) and
// fails t for every one whose kernel result is not what it wants; flows the
// kernel cannot carry are logged. It can run any number of times, e.g.
// after each change of the node's rules.
func (rc *RealCase) CheckKernelFlows(t *testing.T, flows []Flow) {
	t.Helper()
	var norm []Flow
	for _, f := range flows {
		if f.Protocol == "" {
			f.Protocol = v1.ProtocolTCP
		}
		norm = append(norm, f)
	}
	results := rc.probeAll(norm)
	for _, f := range norm {
		r := results[realFlowKey(f)]
		switch {
		case r.skip != "":
			t.Logf("flow %q not sent: %s", f.Name, r.skip)
		case r.err != nil:
			t.Errorf("flow %q: %v", f.Name, r.err)
		default:
			if msg := compare(f, r.res); msg != "" {
				t.Errorf("flow %q (%s %s -> %s:%d) on the kernel: %s", f.Name, f.Protocol, f.Source, f.Dest, f.Port, msg)
			}
		}
	}
}

// probeAll sends flows, concurrently.
func (rc *RealCase) probeAll(flows []Flow) map[string]realResult {
	var mu sync.Mutex
	var wg sync.WaitGroup
	out := map[string]realResult{}
	for _, f := range flows {
		wg.Go(func() {
			r := realResult{skip: rc.SkipReason(f)}
			if r.skip == "" {
				r.res, r.err = rc.Probe(f)
			}
			mu.Lock()
			out[realFlowKey(f)] = r
			mu.Unlock()
		})
	}
	wg.Wait()
	return out
}

// RealAttempt is the outcome of one attempt of a flow.
type RealAttempt struct {
	Verdict Verdict
	// Endpoint is the server that answered a delivered attempt, and
	// Masquerade whether it saw one of the node's addresses as client.
	Endpoint   string
	Masquerade bool
}

// Probe sends a flow: a first attempt; when delivered, more, each of which
// must be delivered too (RealDeliveredAttempts in all).
func (rc *RealCase) Probe(f Flow) (Result, error) {
	res := Result{Endpoints: map[string]bool{}}
	for i := 0; i < RealDeliveredAttempts; i++ {
		a, err := rc.Attempt(f)
		if err != nil {
			return res, fmt.Errorf("attempt %d: %w", i+1, err)
		}
		if i == 0 {
			res.Verdict = a.Verdict
		}
		if a.Verdict != res.Verdict {
			return res, fmt.Errorf("attempt %d was %s after %s ones (endpoints %v)", i+1, a.Verdict, res.Verdict, res.Endpoints)
		}
		if a.Verdict != Delivered {
			return res, nil
		}
		if prev, seen := res.Endpoints[a.Endpoint]; seen && prev != a.Masquerade {
			return res, fmt.Errorf("endpoint %s reached both with and without masquerade", a.Endpoint)
		}
		res.Endpoints[a.Endpoint] = a.Masquerade
	}
	return res, nil
}

// sender is the namespace a flow is sent from.
func (rc *RealCase) sender(f Flow) (*netnstest.NS, error) {
	if f.Origin == FromHost {
		return rc.node, nil
	}
	ns := rc.senders[netip.MustParseAddr(f.Source)]
	if ns == nil {
		return nil, fmt.Errorf("no namespace holds source %s (only the case's own flows can be sent)", f.Source)
	}
	return ns, nil
}

// network is the flow's network for netnstest.
func (rc *RealCase) network(f Flow) string {
	if f.Protocol == v1.ProtocolUDP {
		return rc.addr.udp
	}
	return rc.addr.tcp
}

// Attempt sends one request of the flow from a new socket.
func (rc *RealCase) Attempt(f Flow) (RealAttempt, error) {
	src := netip.MustParseAddr(f.Source)
	from, err := rc.sender(f)
	if err != nil {
		return RealAttempt{}, err
	}
	if rc.affinity && rc.rk.ForgetAffinity != nil {
		if err := rc.rk.ForgetAffinity(rc.node); err != nil {
			return RealAttempt{}, err
		}
	}
	deadline, tries := realDropDeadline, 1
	if f.Protocol == v1.ProtocolUDP {
		deadline, tries = realUDPDeadline, realUDPTries
	}
	dest := netip.AddrPortFrom(netip.MustParseAddr(f.Dest), uint16(f.Port)).String()
	var reply string
	for try := 0; try < tries; try++ {
		ctx, cancel := context.WithTimeout(rc.t.Context(), deadline)
		reply, err = netnstest.RequestWith(ctx, from, rc.network(f), dest, netnstest.RequestOptions{Source: src})
		cancel()
		if !errors.Is(err, netnstest.ErrTimeout) {
			break
		}
	}
	switch {
	case errors.Is(err, netnstest.ErrRefused):
		return RealAttempt{Verdict: Rejected}, nil
	case errors.Is(err, netnstest.ErrTimeout), errors.Is(err, syscall.EPERM):
		return RealAttempt{Verdict: Dropped}, nil
	case err != nil:
		return RealAttempt{}, err
	}
	return rc.classify(reply, src)
}

// classify reads an echo reply to a request from src.
func (rc *RealCase) classify(reply string, src netip.Addr) (RealAttempt, error) {
	name, client, err := netnstest.ParseEchoReply(reply)
	if err != nil {
		return RealAttempt{}, err
	}
	switch {
	case name == realNodeServer || name == realSinkServer:
		return RealAttempt{Verdict: NotHandled}, nil
	case !rc.endpoints[name]:
		return RealAttempt{}, fmt.Errorf("reply %q from an unknown server", reply)
	case client.Addr() == src:
		return RealAttempt{Verdict: Delivered, Endpoint: name}, nil
	case rc.nodeAddrs[client.Addr()]:
		return RealAttempt{Verdict: Delivered, Endpoint: name, Masquerade: true}, nil
	}
	return RealAttempt{}, fmt.Errorf("endpoint %s saw client %s: neither the source %s nor a node address", name, client, src)
}

// RealConn is a TCP connection of a flow, kept open: its server answers
// each Ask.
type RealConn struct {
	rc  *RealCase
	src netip.Addr
	c   net.Conn
	r   *bufio.Reader
	// First is the answer to the connection itself.
	First RealAttempt
}

// Dial opens a TCP connection of the flow (from its source, as Attempt
// sends it) and reads its first answer. The connection is closed when the
// test ends.
func (rc *RealCase) Dial(ctx context.Context, f Flow) (*RealConn, error) {
	if f.Protocol != "" && f.Protocol != v1.ProtocolTCP {
		return nil, fmt.Errorf("flow %q: only TCP connections stay open", f.Name)
	}
	from, err := rc.sender(f)
	if err != nil {
		return nil, err
	}
	src := netip.MustParseAddr(f.Source)
	dest := netip.AddrPortFrom(netip.MustParseAddr(f.Dest), uint16(f.Port)).String()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: src.AsSlice()}}
	c, err := from.DialWith(ctx, d, rc.addr.tcp, dest)
	if err != nil {
		return nil, fmt.Errorf("flow %q: dialing %s: %w", f.Name, dest, err)
	}
	rc.t.Cleanup(func() { _ = c.Close() })
	conn := &RealConn{rc: rc, src: src, c: c, r: bufio.NewReader(c)}
	if conn.First, err = conn.read(); err != nil {
		return nil, fmt.Errorf("flow %q: first answer: %w", f.Name, err)
	}
	return conn, nil
}

// Ask sends a line on the connection and reads the answer.
func (c *RealConn) Ask() (RealAttempt, error) {
	if err := c.c.SetDeadline(time.Now().Add(realDropDeadline)); err != nil {
		return RealAttempt{}, err
	}
	if _, err := c.c.Write([]byte("again\n")); err != nil {
		return RealAttempt{}, err
	}
	return c.read()
}

func (c *RealConn) read() (RealAttempt, error) {
	if err := c.c.SetReadDeadline(time.Now().Add(realDropDeadline)); err != nil {
		return RealAttempt{}, err
	}
	line, err := c.r.ReadString('\n')
	if err != nil {
		return RealAttempt{}, err
	}
	return c.rc.classify(strings.TrimSuffix(line, "\n"), c.src)
}

// Close closes the connection.
func (c *RealConn) Close() error { return c.c.Close() }

// ExpectedResult is the result a flow wants.
func ExpectedResult(f Flow) Result {
	r := Result{Verdict: f.Want, Endpoints: map[string]bool{}}
	if f.Want == Delivered {
		for _, ep := range f.WantEndpoints {
			r.Endpoints[ep] = f.WantMasquerade || slices.Contains(f.WantHairpin, ep)
		}
	}
	return r
}

// DescribeResult prints a result: its verdict and, when delivered, each
// endpoint reached, masqueraded or not.
func DescribeResult(r Result) string {
	if r.Verdict != Delivered {
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

// RealReport collects the skipped flows and known divergences of every
// case, for one summary at the end.
type RealReport struct {
	mu    sync.Mutex
	lines []string
}

func (r *RealReport) add(kind, key, detail string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lines = append(r.lines, fmt.Sprintf("%s: %s: %s", kind, key, detail))
}

// Log logs the summary in t.
func (r *RealReport) Log(t *testing.T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	sort.Strings(r.lines)
	t.Logf("%d flows not checked against the kernel:\n%s", len(r.lines), strings.Join(r.lines, "\n"))
}

// NSAddresses lists the addresses of every interface in ns.
func NSAddresses(ns *netnstest.NS) ([]netip.Addr, error) {
	out, err := ns.Exec(context.Background(), "ip", "-j", "addr", "show")
	if err != nil {
		return nil, fmt.Errorf("listing addresses: %w", err)
	}
	var links []struct {
		AddrInfo []struct {
			Local string `json:"local"`
		} `json:"addr_info"`
	}
	if err := json.Unmarshal(out, &links); err != nil {
		return nil, fmt.Errorf("parsing `ip -j addr show`: %w", err)
	}
	var addrs []netip.Addr
	for _, l := range links {
		for _, a := range l.AddrInfo {
			ip, err := netip.ParseAddr(a.Local)
			if err != nil {
				return nil, fmt.Errorf("parsing address %q: %w", a.Local, err)
			}
			addrs = append(addrs, ip)
		}
	}
	return addrs, nil
}
