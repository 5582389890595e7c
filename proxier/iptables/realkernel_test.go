package iptables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	testingclock "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// The TestRealKernel* tests run the backend against the real iptables of a
// throwaway "node" network namespace and send real packets through it:
//
//	client 192.0.2.10 ---- 192.0.2.1  node  10.244.0.1 ---- 10.244.0.5 pod (client pod)
//	                                        10.244.1.1 ---- 10.244.1.5 be1 (node-a: local)
//	                                        10.244.2.1 ---- 10.244.2.5 be2 (node-b)
//	                                        10.244.3.1 ---- 10.244.3.5 be3 (node-c)
//
// Every leaf has a default route via the node, which forwards between them.
// The node's own default route points at a neighbour with a made-up MAC
// address on an uplink: packets nobody else handles leave the node and are
// silently lost, as on a real node, instead of failing the route lookup
// before the filter table sees them. The backends run echo
// servers that answer with their name and the client address they saw.
// They need root and skip otherwise.

// realEchoPort is the port of every backend's echo servers.
const realEchoPort = 8080

// realNodeName is the engine's node; be1 is on it.
const realNodeName = "node-a"

// realFamily is the address plan of one IP family.
type realFamily struct {
	family      v1.IPFamily
	protocol    ipt.Protocol
	tcp, udp    string // networks for netnstest
	iptables    string // the command
	forwarding  string // sysctl enabling forwarding
	unspecified netip.Addr
	// clientAddr and nodeAddr are the two ends of the client link; the
	// node's address is the one node ports are reached on.
	clientAddr, nodeAddr netip.Prefix
	// uplinkAddr is the node's address on its uplink, and uplink its
	// default gateway there, a neighbour that never answers.
	uplinkAddr  netip.Prefix
	uplink      netip.Addr
	clusterCIDR netip.Prefix
	// podLink returns the pod's and the node's end of pod link i.
	podLink func(i int) (pod, node netip.Prefix)
	// serviceIP returns the i-th ClusterIP.
	serviceIP func(i int) netip.Addr
	svcOpts   []pt.SvcOpt
}

var realIPv4 = realFamily{
	family: v1.IPv4Protocol, protocol: ipt.ProtocolIPv4, tcp: "tcp4", udp: "udp4", iptables: "iptables",
	forwarding: "net.ipv4.ip_forward", unspecified: netip.IPv4Unspecified(),
	clientAddr: netip.MustParsePrefix("192.0.2.10/24"), nodeAddr: netip.MustParsePrefix("192.0.2.1/24"),
	uplinkAddr: netip.MustParsePrefix("198.51.100.1/24"), uplink: netip.MustParseAddr("198.51.100.254"),
	clusterCIDR: netip.MustParsePrefix("10.244.0.0/16"),
	podLink: func(i int) (netip.Prefix, netip.Prefix) {
		return netip.MustParsePrefix(fmt.Sprintf("10.244.%d.5/24", i)), netip.MustParsePrefix(fmt.Sprintf("10.244.%d.1/24", i))
	},
	serviceIP: func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("10.96.0.%d", i)) },
}

var realIPv6 = realFamily{
	family: v1.IPv6Protocol, protocol: ipt.ProtocolIPv6, tcp: "tcp6", udp: "udp6", iptables: "ip6tables",
	forwarding: "net.ipv6.conf.all.forwarding", unspecified: netip.IPv6Unspecified(),
	clientAddr: netip.MustParsePrefix("fd00:2::10/64"), nodeAddr: netip.MustParsePrefix("fd00:2::1/64"),
	uplinkAddr: netip.MustParsePrefix("fd00:3::1/64"), uplink: netip.MustParseAddr("fd00:3::fe"),
	clusterCIDR: netip.MustParsePrefix("fd00:244::/48"),
	podLink: func(i int) (netip.Prefix, netip.Prefix) {
		return netip.MustParsePrefix(fmt.Sprintf("fd00:244:0:%x::5/64", i)), netip.MustParsePrefix(fmt.Sprintf("fd00:244:0:%x::1/64", i))
	},
	serviceIP: func(i int) netip.Addr { return netip.MustParseAddr(fmt.Sprintf("fd00:96::%x", i)) },
	svcOpts:   []pt.SvcOpt{pt.IPv6()},
}

// realPod is a pod namespace on its own link to the node.
type realPod struct {
	name string
	ns   *netnstest.NS
	addr netip.Addr
	// gateway is the node's address on the pod's link: the source a
	// backend sees for masqueraded traffic.
	gateway  netip.Addr
	nodeName string
}

// realTopo is the topology above with a proxier.Engine driving the backend
// over the node namespace's iptables.
type realTopo struct {
	fam     realFamily
	node    *netnstest.NS
	client  *netnstest.NS
	pods    map[string]*realPod // "pod" (the client pod), "be1", "be2", "be3"
	ipt     ipt.Interface
	backend *Backend
	engine  *proxier.Engine
	clock   *testingclock.FakeClock
	// last is the result of the engine's last sync.
	last proxier.SyncResult
}

// realBackends are the pods running echo servers, with their nodes.
var realBackends = []struct{ name, node string }{{"be1", realNodeName}, {"be2", "node-b"}, {"be3", "node-c"}}

// realTopoOptions varies newRealTopoWith.
type realTopoOptions struct {
	// variant selects the iptables binaries (ipt.Options.Variant).
	variant string
	// wrap, when set, wraps the node's iptables as the backend sees it.
	wrap func(ipt.Interface) ipt.Interface
}

func newRealTopo(t *testing.T, fam realFamily) *realTopo {
	t.Helper()
	return newRealTopoWith(t, fam, realTopoOptions{})
}

func newRealTopoWith(t *testing.T, fam realFamily, opts realTopoOptions) *realTopo {
	t.Helper()
	netnstest.RequireRoot(t)
	ctx := t.Context()
	topo := &realTopo{fam: fam, pods: map[string]*realPod{}}
	topo.node = netnstest.New(t, "iptnode")
	if _, err := topo.node.Exec(ctx, fam.iptables, "-w", "5", "-t", "nat", "-S"); err != nil {
		t.Skipf("this kernel has no %s nat table: %v", fam.protocol, err)
	}
	topo.node.Sysctl(t, fam.forwarding, "1")
	def := netip.PrefixFrom(fam.unspecified, 0)

	topo.client = netnstest.New(t, "iptcli")
	netnstest.Link(t, topo.client, fam.clientAddr, topo.node, fam.nodeAddr)
	topo.client.AddRoute(t, def, fam.nodeAddr.Addr())
	// The uplink is a veth pair inside the node namespace: frames sent to
	// the gateway's made-up MAC address arrive on the other end and are
	// dropped there as addressed to another host. (A gateway on the client
	// link would make the node send ICMP redirects to the client.)
	up := netnstest.Link(t, topo.node, fam.uplinkAddr, topo.node, netip.Prefix{})
	topo.node.Run(t, "ip", "neigh", "replace", fam.uplink.String(), "lladdr", "02:00:00:00:00:fe", "dev", up.A, "nud", "permanent")
	topo.node.AddRoute(t, def, fam.uplink)

	pods := append([]struct{ name, node string }{{"pod", "node-b"}}, realBackends...) // the client pod is on another node
	for i, p := range pods {
		podAddr, gw := fam.podLink(i)
		ns := netnstest.New(t, "ipt"+p.name)
		netnstest.Link(t, ns, podAddr, topo.node, gw)
		ns.AddRoute(t, def, gw.Addr())
		topo.pods[p.name] = &realPod{name: p.name, ns: ns, addr: podAddr.Addr(), gateway: gw.Addr(), nodeName: p.node}
		if p.name != "pod" {
			bind := netip.AddrPortFrom(podAddr.Addr(), realEchoPort).String()
			ns.StartEcho(t, fam.tcp, bind, p.name)
			ns.StartEcho(t, fam.udp, bind, p.name)
		}
	}

	iface, err := ipt.New(ctx, ipt.Options{Protocol: fam.protocol, NetNS: topo.node.Name, Variant: opts.variant})
	if err != nil {
		t.Fatalf("iptables in %s: %v", topo.node.Name, err)
	}
	t.Cleanup(func() {
		if err := iface.(*ipt.Real).Close(); err != nil {
			t.Error(err)
		}
	})
	topo.ipt = iface
	// Registered after the namespace, so it runs before its deletion.
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
			out, err := iface.SaveInto(context.Background(), table)
			t.Logf("%s-save -t %s in the node namespace (err %v):\n%s", fam.protocol, table, err, out)
		}
	})
	clk := pt.NewClock()
	topo.clock = clk
	var backendIPT ipt.Interface = iface
	if opts.wrap != nil {
		backendIPT = opts.wrap(iface)
	}
	topo.backend, err = New(Options{
		IPTables: backendIPT, Clock: clk,
		LocalAddresses: func() ([]netip.Addr, error) { return pt.NSAddresses(topo.node) },
	})
	if err != nil {
		t.Fatal(err)
	}
	topo.engine = pt.NewEngine(t, topo.backend, pt.EngineOptions{
		Env: pt.Env{Family: fam.family, NodeName: realNodeName, ClusterCIDR: fam.clusterCIDR}, Clock: clk,
		OnSync: func(r proxier.SyncResult) { topo.last = r }})
	return topo
}

func (topo *realTopo) sync(t *testing.T) SyncStats {
	t.Helper()
	pt.Sync(t, topo.engine)
	return topo.backend.LastSync()
}

// service builds a Service with ClusterIP number i.
func (topo *realTopo) service(name string, i int, opts ...pt.SvcOpt) *v1.Service {
	return pt.Service(name, topo.fam.serviceIP(i).String(), append(slices.Clone(topo.fam.svcOpts), opts...)...)
}

// slice builds the EndpointSlice of service with the named backends (at
// least one), for the echo port over proto.
func (topo *realTopo) slice(service string, proto v1.Protocol, backends ...string) *discovery.EndpointSlice {
	var eps []pt.EP
	for _, b := range backends {
		eps = append(eps, pt.EP{IP: topo.pods[b].addr.String(), Node: topo.pods[b].nodeName})
	}
	return pt.SliceWithPorts(service, []discovery.EndpointPort{{Name: ptr.To("p"), Port: ptr.To[int32](realEchoPort), Protocol: ptr.To(proto)}}, eps...)
}

// nodePort is the node's address on the client link at port.
func (topo *realTopo) nodePort(port uint16) netip.AddrPort {
	return netip.AddrPortFrom(topo.fam.nodeAddr.Addr(), port)
}

// clusterIP is ClusterIP number i at the service port, 80.
func (topo *realTopo) clusterIP(i int) netip.AddrPort {
	return netip.AddrPortFrom(topo.fam.serviceIP(i), 80)
}

// sender returns the namespace and own address of a flow's origin.
func (topo *realTopo) sender(t *testing.T, from string) (*netnstest.NS, netip.Addr) {
	t.Helper()
	switch from {
	case "client":
		return topo.client, topo.fam.clientAddr.Addr()
	case "node":
		return topo.node, netip.Addr{}
	}
	p, ok := topo.pods[from]
	if !ok {
		t.Fatalf("unknown sender %q", from)
	}
	return p.ns, p.addr
}

// sourceKind is the client address a backend should see.
type sourceKind int

const (
	// sourceSender: the sender's own address (not masqueraded).
	sourceSender sourceKind = iota
	// sourceMasqueraded: the node's address on the backend's link.
	sourceMasqueraded
	// sourceHairpin: masqueraded when the backend is the sender itself,
	// the sender's address otherwise.
	sourceHairpin
)

// realFlow is a series of real requests and what they must produce.
type realFlow struct {
	name  string
	from  string // "client", "node" or a pod name
	proto v1.Protocol
	to    netip.AddrPort
	// want lists the backends that must all answer, and no other.
	want   []string
	source sourceKind
	// refused: every request must be actively refused with an ICMP port
	// unreachable (ECONNREFUSED), not time out.
	refused bool
}

// check sends the flow's requests and checks the answers.
func (topo *realTopo) check(t *testing.T, f realFlow) {
	t.Helper()
	ns, self := topo.sender(t, f.from)
	network := topo.fam.tcp
	if f.proto == v1.ProtocolUDP {
		network = topo.fam.udp
	}
	if f.refused {
		// An ICMP error answering the first SYN can be lost to the socket
		// lock (see pkg/netnstest); the retransmission's counts, about a
		// second later, so the deadline is generous.
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		reply, err := netnstest.Request(ctx, ns, network, f.to.String())
		if !errors.Is(err, netnstest.ErrRefused) || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("%s from %s to %s = %q, %v; want refused by an ICMP port unreachable (ECONNREFUSED)", network, f.from, f.to, reply, err)
		}
		return
	}
	// With two or three endpoints chosen at random, 40 requests miss one
	// with a probability below 1e-7.
	requests := 40
	if len(f.want) == 1 {
		requests = 10
	}
	seen := map[string]int{}
	for i := 0; i < requests; i++ {
		reply, err := netnstest.Request(t.Context(), ns, network, f.to.String())
		if err != nil {
			t.Fatalf("request %d: %v", i+1, err)
		}
		name, client := parseEchoReply(t, reply)
		if !slices.Contains(f.want, name) {
			t.Fatalf("request %d reached %q (reply %q), want only %v", i+1, name, reply, f.want)
		}
		be := topo.pods[name]
		want := self
		switch {
		case f.source == sourceMasqueraded, f.source == sourceHairpin && name == f.from:
			want = be.gateway
		}
		if client.Addr() != want {
			t.Errorf("request %d: %s saw client %s, want %s", i+1, name, client.Addr(), want)
		}
		seen[name]++
	}
	for _, w := range f.want {
		if seen[w] == 0 {
			t.Errorf("%s never answered in %d requests (answers: %v)", w, requests, seen)
		}
	}
}

// parseEchoReply splits "<name> <client ip:port>".
func parseEchoReply(t *testing.T, reply string) (string, netip.AddrPort) {
	t.Helper()
	name, ap, err := netnstest.ParseEchoReply(reply)
	if err != nil {
		t.Fatal(err)
	}
	return name, ap
}

// save returns the table's iptables-save output in the node namespace.
func (topo *realTopo) save(t *testing.T, table ipt.Table) string {
	t.Helper()
	out, err := topo.ipt.SaveInto(t.Context(), table)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

func TestRealKernelIPv4(t *testing.T) {
	t.Parallel()
	testRealKernelFlows(t, realIPv4)
}

func TestRealKernelIPv6(t *testing.T) {
	t.Parallel()
	testRealKernelFlows(t, realIPv6)
}

// Services of testRealKernelFlows: ClusterIP number and node port.
const (
	realWeb    = 10 // both be1 and be2; node port 30010
	realEmpty  = 20 // no endpoints; node port 30020
	realLocal  = 30 // externalTrafficPolicy Local, be1 and be2; node port 30030
	realUDP    = 40 // UDP, be1 and be2
	realGrowth = 50 // be2, then be3 too, then deleted
)

func testRealKernelFlows(t *testing.T, fam realFamily) {
	topo := newRealTopo(t, fam)
	// Something listens on the node port of the service without endpoints:
	// only kproxy's reject stops it from answering.
	topo.node.StartEcho(t, fam.tcp, netip.AddrPortFrom(fam.unspecified, 30020).String(), "node")

	e := topo.engine
	e.OnServiceAdd(topo.service("web", realWeb, pt.NodePort(30010)))
	e.OnEndpointSliceAdd(topo.slice("web", v1.ProtocolTCP, "be1", "be2"))
	e.OnServiceAdd(topo.service("empty", realEmpty, pt.NodePort(30020)))
	e.OnServiceAdd(topo.service("local", realLocal, pt.NodePort(30030), pt.ExternalLocal()))
	e.OnEndpointSliceAdd(topo.slice("local", v1.ProtocolTCP, "be1", "be2"))
	e.OnServiceAdd(topo.service("udp", realUDP, pt.Ports(v1.ServicePort{Name: "p", Port: 80, Protocol: v1.ProtocolUDP})))
	e.OnEndpointSliceAdd(topo.slice("udp", v1.ProtocolUDP, "be1", "be2"))
	growth := topo.service("growth", realGrowth)
	e.OnServiceAdd(growth)
	e.OnEndpointSliceAdd(topo.slice("growth", v1.ProtocolTCP, "be2"))
	if st := topo.sync(t); !st.Full {
		t.Fatalf("first sync was not full: %+v", st)
	}

	both := []string{"be1", "be2"}
	for _, f := range []realFlow{
		{name: "cluster IP from a pod reaches both backends", from: "pod", to: topo.clusterIP(realWeb), want: both, source: sourceSender},
		{name: "cluster IP from outside the cluster is masqueraded", from: "client", to: topo.clusterIP(realWeb), want: both, source: sourceMasqueraded},
		{name: "cluster IP from the node itself is masqueraded", from: "node", to: topo.clusterIP(realWeb), want: both, source: sourceMasqueraded},
		{name: "hairpin: a backend reaching its own service", from: "be1", to: topo.clusterIP(realWeb), want: both, source: sourceHairpin},
		{name: "node port from outside reaches both backends masqueraded", from: "client", to: topo.nodePort(30010), want: both, source: sourceMasqueraded},
		{name: "node port from the node itself", from: "node", to: topo.nodePort(30010), want: both, source: sourceMasqueraded},
		{name: "cluster IP without endpoints is rejected (client)", from: "client", to: topo.clusterIP(realEmpty), refused: true},
		{name: "cluster IP without endpoints is rejected (pod)", from: "pod", to: topo.clusterIP(realEmpty), refused: true},
		{name: "node port without endpoints is rejected", from: "client", to: topo.nodePort(30020), refused: true},
		{name: "externalTrafficPolicy Local node port keeps the client address", from: "client", to: topo.nodePort(30030), want: []string{"be1"}, source: sourceSender},
		{name: "externalTrafficPolicy Local leaves the cluster IP to all endpoints", from: "pod", to: topo.clusterIP(realLocal), want: both, source: sourceSender},
		{name: "udp cluster IP from a pod", from: "pod", proto: v1.ProtocolUDP, to: topo.clusterIP(realUDP), want: both, source: sourceSender},
		{name: "udp cluster IP from outside the cluster", from: "client", proto: v1.ProtocolUDP, to: topo.clusterIP(realUDP), want: both, source: sourceMasqueraded},
	} {
		t.Run(f.name, func(t *testing.T) { topo.check(t, f) })
	}

	t.Run("partial syncs add an endpoint and delete a service", func(t *testing.T) {
		flow := realFlow{from: "pod", to: topo.clusterIP(realGrowth), want: []string{"be2"}, source: sourceSender}
		topo.check(t, flow)

		e.OnEndpointSliceUpdate(nil, topo.slice("growth", v1.ProtocolTCP, "be2", "be3"))
		if st := topo.sync(t); st.Full || st.ChainsWritten == 0 {
			t.Fatalf("adding an endpoint: sync %+v, want a partial sync writing chains", st)
		}
		flow.want = []string{"be2", "be3"}
		topo.check(t, flow)

		chain := servicePortChain(kindCluster, pt.ServicePortNameOf(growth, "p"))
		dest := hostAddr(topo.fam.serviceIP(realGrowth))
		if nat := topo.save(t, ipt.TableNAT); !strings.Contains(nat, ":"+chain+" ") || !strings.Contains(nat, dest) {
			t.Fatalf("chain %s or destination %s missing before the deletion:\n%s", chain, dest, nat)
		}
		e.OnServiceDelete(growth)
		e.OnEndpointSliceDelete(topo.slice("growth", v1.ProtocolTCP, "be2", "be3"))
		if st := topo.sync(t); st.Full || st.ChainsDeleted == 0 {
			t.Fatalf("deleting the service: sync %+v, want a partial sync deleting chains", st)
		}
		for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
			saved := topo.save(t, table)
			for _, gone := range []string{chain, dest, "ns/growth:p"} {
				if strings.Contains(saved, gone) {
					t.Errorf("%q still in %s after the service was deleted:\n%s", gone, table, saved)
				}
			}
		}
		// Nothing handles the address any more: the packet leaves through
		// the node's uplink and is lost. (A short wait is enough: a
		// surviving rule would answer at once.)
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		defer cancel()
		if reply, err := netnstest.Request(ctx, topo.pods["pod"].ns, fam.tcp, flow.to.String()); !errors.Is(err, netnstest.ErrTimeout) {
			t.Errorf("request to the deleted service = %q, %v; want a timeout", reply, err)
		}
		// The other services were not disturbed.
		topo.check(t, realFlow{from: "pod", to: topo.clusterIP(realWeb), want: both, source: sourceSender})
	})
}

// saveCounters matches the packet and byte counters of chain headers.
var saveCounters = regexp.MustCompile(`\[\d+:\d+\]`)

// normalizedSave is iptables-save of nat and filter without comments and
// counters, for comparing rule sets over time.
func (topo *realTopo) normalizedSave(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
		for _, line := range strings.Split(topo.save(t, table), "\n") {
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			b.WriteString(saveCounters.ReplaceAllString(line, "[0:0]") + "\n")
		}
	}
	return b.String()
}

func TestRealKernelCleanup(t *testing.T) {
	t.Parallel()
	topo := newRealTopo(t, realIPv4)
	// Someone else's chains and jumps, which must survive.
	for _, args := range [][]string{
		{"-t", "nat", "-N", "KUBE-SERVICES"},
		{"-t", "nat", "-A", "KUBE-SERVICES", "-d", "10.96.0.1/32", "-p", "tcp", "--dport", "443", "-j", "RETURN"},
		{"-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES"},
		{"-t", "filter", "-N", "MY-RULES"},
		{"-t", "filter", "-A", "MY-RULES", "-s", "198.51.100.0/24", "-j", "DROP"},
		{"-t", "filter", "-A", "INPUT", "-j", "MY-RULES"},
		{"-t", "filter", "-A", "FORWARD", "-j", "MY-RULES"},
	} {
		topo.node.Run(t, topo.fam.iptables, append([]string{"-w", "5"}, args...)...)
	}
	before := topo.normalizedSave(t)
	// The node's own server on the node port answers once kproxy is gone.
	topo.node.StartEcho(t, "tcp4", "0.0.0.0:30010", "node")

	topo.engine.OnServiceAdd(topo.service("web", realWeb, pt.NodePort(30010)))
	topo.engine.OnEndpointSliceAdd(topo.slice("web", v1.ProtocolTCP, "be1", "be2"))
	topo.engine.OnServiceAdd(topo.service("empty", realEmpty, pt.NodePort(30020)))
	topo.sync(t)
	topo.check(t, realFlow{from: "client", to: topo.nodePort(30010), want: []string{"be1", "be2"}, source: sourceMasqueraded})
	if saved := topo.normalizedSave(t); !strings.Contains(saved, "KPROXY") {
		t.Fatalf("no KPROXY rules after the sync:\n%s", saved)
	}

	for run := 1; run <= 2; run++ {
		if err := topo.backend.Cleanup(t.Context()); err != nil {
			t.Fatalf("cleanup %d: %v", run, err)
		}
		after := topo.normalizedSave(t)
		if strings.Contains(after, "KPROXY") {
			t.Errorf("cleanup %d left KPROXY rules:\n%s", run, after)
		}
		if after != before {
			t.Errorf("cleanup %d did not restore the foreign rules.\nbefore:\n%s\nafter:\n%s", run, before, after)
		}
		reply, err := netnstest.Request(t.Context(), topo.client, "tcp4", topo.nodePort(30010).String())
		if err != nil {
			t.Fatalf("after cleanup %d: %v", run, err)
		}
		if name, _ := parseEchoReply(t, reply); name != "node" {
			t.Errorf("after cleanup %d the node port reached %q, want the node's own server", run, name)
		}
	}
}
