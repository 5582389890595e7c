package ipvs

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// The TestRealKernel* tests run the backend against the real IPVS, ipsets,
// dummy device and iptables of a throwaway "node" network namespace and send
// real packets through it:
//
//	client 192.0.2.10 ---- 192.0.2.1  node  10.244.0.1 ---- 10.244.0.5 pod (client pod, node-b)
//	                                        10.244.1.1 ---- 10.244.1.5 be1 (node-a: local)
//	                                        10.244.2.1 ---- 10.244.2.5 be2 (node-b)
//
// Every leaf has a default route via the node. They need a kernel with IPVS:
// run them in the VM, `go test -exec "$PWD/hack/ipvs-vm.sh" ./proxier/ipvs/`;
// they skip unless KPROXY_IN_VM=1.

const (
	realPort     = 8080
	realNodeName = "node-a"
)

var (
	realClientAddr = netip.MustParsePrefix("192.0.2.10/24")
	realNodeAddr   = netip.MustParsePrefix("192.0.2.1/24")
)

func requireVM(t testing.TB) {
	t.Helper()
	if os.Getenv("KPROXY_IN_VM") != "1" {
		t.Skip("needs a kernel with IPVS: run with go test -exec hack/ipvs-vm.sh (sets KPROXY_IN_VM=1)")
	}
	netnstest.RequireRoot(t)
}

type realPod struct {
	ns      *netnstest.NS
	addr    netip.Addr
	gateway netip.Addr
}

type realNode struct {
	t       *testing.T
	node    *netnstest.NS
	client  *netnstest.NS
	pods    map[string]*realPod // "pod", "be1", "be2"
	ipvs    *ipvs.Real
	nl      *netlink.Real
	sets    *ipset.Real
	ipt     ipt.Interface
	backend *Backend
	engine  *proxier.Engine
	clock   *testingclock.FakeClock
}

// realNodeOptions configure newRealNodeWith.
type realNodeOptions struct {
	// serve starts each backend's servers.
	serve func(name string, ns *netnstest.NS, bind string)
	// agent configures the first agent (startAgent).
	agent realAgentOptions
}

// realAgentOptions configure one agent: kernel handles, backend and engine
// over the node namespace, as one kproxy process has them.
type realAgentOptions struct {
	// wrapIPVS, when set, wraps the backend's IPVS interface (fault
	// injection); r.ipvs stays the real one.
	wrapIPVS func(ipvs.Interface) ipvs.Interface
	// kernelCallTimeout bounds each netlink call (--kernel-call-timeout);
	// zero: the default.
	kernelCallTimeout time.Duration
	// onSync is passed on to the engine.
	onSync func(proxier.SyncResult)
}

// newRealNode builds the topology; serve starts each backend's servers.
func newRealNode(t *testing.T, serve func(name string, ns *netnstest.NS, bind string)) *realNode {
	t.Helper()
	return newRealNodeWith(t, realNodeOptions{serve: serve})
}

// newRealNodeWith builds the topology and starts the first agent.
func newRealNodeWith(t *testing.T, opts realNodeOptions) *realNode {
	t.Helper()
	requireVM(t)
	serve := opts.serve
	r := &realNode{t: t, pods: map[string]*realPod{}}
	r.node = netnstest.New(t, "ipvsnode")
	def := netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	r.client = netnstest.New(t, "ipvscli")
	netnstest.Link(t, r.client, realClientAddr, r.node, realNodeAddr)
	r.client.AddRoute(t, def, realNodeAddr.Addr())
	for i, name := range []string{"pod", "be1", "be2"} {
		podAddr := netip.MustParsePrefix(fmt.Sprintf("10.244.%d.5/24", i))
		gw := netip.MustParsePrefix(fmt.Sprintf("10.244.%d.1/24", i))
		ns := netnstest.New(t, "ipvs"+name)
		netnstest.Link(t, ns, podAddr, r.node, gw)
		ns.AddRoute(t, def, gw.Addr())
		r.pods[name] = &realPod{ns: ns, addr: podAddr.Addr(), gateway: gw.Addr()}
		if name != "pod" && serve != nil {
			serve(name, ns, netip.AddrPortFrom(podAddr.Addr(), realPort).String())
		}
	}
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		for _, cmd := range [][]string{{"ipvsadm", "-Ln"}, {"iptables-save"}, {"ipset", "list", "-t"}} {
			out, err := r.node.Exec(context.Background(), cmd[0], cmd[1:]...)
			t.Logf("%s (err %v):\n%s", strings.Join(cmd, " "), err, out)
		}
	})
	r.startAgent(opts.agent)
	return r
}

// startAgent starts a new agent over the node: new kernel handles, a new
// backend and a new engine with its own clock, knowing nothing of the
// previous agent's (a restarted kproxy). The previous agent's handles stay
// open until the test ends.
func (r *realNode) startAgent(opts realAgentOptions) {
	t := r.t
	t.Helper()
	ctx := t.Context()
	r.clock = pt.NewClock()
	var err error
	if r.ipvs, err = ipvs.New(ipvs.Options{NetNS: r.node.Name, Timeout: opts.kernelCallTimeout}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.ipvs.Close() })
	if r.nl, err = netlink.New(netlink.Options{NetNS: r.node.Name, Timeout: opts.kernelCallTimeout}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.nl.Close() })
	if r.sets, err = ipset.New(ipset.Options{NetNS: r.node.Name, Timeout: opts.kernelCallTimeout}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.sets.Close() })
	if r.ipt, err = ipt.New(ctx, ipt.Options{Protocol: ipt.ProtocolIPv4, NetNS: r.node.Name}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.ipt.(*ipt.Real).Close() })
	var iface ipvs.Interface = r.ipvs
	if opts.wrapIPVS != nil {
		iface = opts.wrapIPVS(iface)
	}
	r.backend, err = New(Options{
		IPVS: iface, Netlink: r.nl, IPSet: r.sets, IPTables: r.ipt, Sysctl: ProcSysctl{NetNS: r.node.Name},
		Clock: r.clock,
	})
	if err != nil {
		t.Fatal(err)
	}
	env := pt.DefaultEnv()
	env.NodeName, env.NodeIPs = realNodeName, nil
	r.engine = pt.NewEngine(t, r.backend, pt.EngineOptions{Env: env, Clock: r.clock, OnSync: opts.onSync})
}

func (r *realNode) sync() {
	r.t.Helper()
	pt.Sync(r.t, r.engine)
}

// slice is an EndpointSlice of service with the named backends.
func (r *realNode) slice(service string, backends ...string) *discovery.EndpointSlice {
	var eps []pt.EP
	for _, b := range backends {
		node := "node-b"
		if b == "be1" {
			node = realNodeName
		}
		eps = append(eps, pt.EP{IP: r.pods[b].addr.String(), Node: node})
	}
	return pt.Slice(service, realPort, eps...)
}

// request sends one TCP request from ns to addr and returns the replying
// backend and the client address it saw.
func request(ctx context.Context, ns *netnstest.NS, addr string) (backend, seen string, err error) {
	reply, err := netnstest.Request(ctx, ns, "tcp4", addr)
	if err != nil {
		return "", "", err
	}
	backend, seen, _ = strings.Cut(reply, " ")
	return backend, seen, nil
}

func TestRealKernelServices(t *testing.T) {
	r := newRealNode(t, func(name string, ns *netnstest.NS, bind string) { ns.StartEcho(t, "tcp4", bind, name) })
	ctx := t.Context()

	// Foreign virtual servers, made before kproxy starts: another address,
	// and a node address at a port no Service uses.
	foreign := []*ipvs.Service{
		{Address: netip.MustParseAddr("10.97.0.1"), Protocol: ipvs.ProtocolTCP, Port: 80, Scheduler: "rr"},
		{Address: realNodeAddr.Addr(), Protocol: ipvs.ProtocolTCP, Port: 31999, Scheduler: "rr"},
	}
	for _, s := range foreign {
		if err := r.ipvs.AddService(ctx, s); err != nil {
			t.Fatal(err)
		}
		if err := r.ipvs.AddDestination(ctx, s, &ipvs.Destination{Address: r.pods["be2"].addr, Port: realPort, Weight: 2}); err != nil {
			t.Fatal(err)
		}
	}
	checkForeign := func(when string) {
		t.Helper()
		svcs, err := r.ipvs.Services(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range foreign {
			if !slices.ContainsFunc(svcs, func(s *ipvs.Service) bool { return keyOf(s) == keyOf(f) }) {
				t.Errorf("%s: foreign virtual server %s is gone", when, f)
				continue
			}
			ds, err := r.ipvs.Destinations(ctx, f)
			if err != nil || len(ds) != 1 || ds[0].Weight != 2 {
				t.Errorf("%s: foreign virtual server %s changed: %v %v", when, f, ds, err)
			}
		}
	}

	r.engine.OnServiceAdd(pt.Service("web", "10.96.0.10", pt.NodePort(30080)))
	r.engine.OnEndpointSliceAdd(r.slice("web", "be1", "be2"))
	r.engine.OnServiceAdd(pt.Service("sticky", "10.96.0.11", pt.Affinity(0)))
	r.engine.OnEndpointSliceAdd(r.slice("sticky", "be1", "be2"))
	r.engine.OnServiceAdd(pt.Service("empty", "10.96.0.12"))
	// An external IP and a load balancer ingress IP that are the node's own
	// address.
	nodeIP := realNodeAddr.Addr()
	r.engine.OnServiceAdd(pt.Service("nodeaddr", "10.96.0.13", pt.ExternalIPs(nodeIP.String())))
	r.engine.OnEndpointSliceAdd(r.slice("nodeaddr", "be1", "be2"))
	r.engine.OnServiceAdd(pt.Service("lbnode", "10.96.0.14", pt.LoadBalancer(nodeIP.String()),
		pt.Ports(v1.ServicePort{Name: "p", Port: 8443, Protocol: v1.ProtocolTCP})))
	r.engine.OnEndpointSliceAdd(r.slice("lbnode", "be1", "be2"))
	r.sync()
	r.sync() // a partial sync over the real kernel changes nothing
	if st := r.backend.LastSync(); st.ServicesAdded+st.ServicesDeleted+st.DestinationsAdded+st.EntriesAdded+st.Restores != 0 {
		t.Errorf("idle partial sync changed the kernel: %+v", st)
	}
	checkForeign("after syncs")

	pod, client := r.pods["pod"], r.client
	t.Run("clusterIP from a pod reaches both backends, unmasqueraded", func(t *testing.T) {
		seen := map[string]bool{}
		for i := 0; i < 4; i++ {
			be, src, err := request(ctx, pod.ns, "10.96.0.10:80")
			if err != nil {
				t.Fatal(err)
			}
			seen[be] = true
			if host, _, _ := net.SplitHostPort(src); host != pod.addr.String() {
				t.Errorf("%s saw client %s, want the pod's own address %s", be, src, pod.addr)
			}
		}
		if !seen["be1"] || !seen["be2"] {
			t.Errorf("round robin reached %v, want be1 and be2", seen)
		}
	})
	t.Run("node port from outside reaches both backends, masqueraded", func(t *testing.T) {
		seen := map[string]bool{}
		for i := 0; i < 4; i++ {
			be, src, err := request(ctx, client, netip.AddrPortFrom(realNodeAddr.Addr(), 30080).String())
			if err != nil {
				t.Fatal(err)
			}
			seen[be] = true
			host, _, _ := net.SplitHostPort(src)
			if want := r.pods[be].gateway.String(); host != want {
				t.Errorf("%s saw client %s, want the node's address %s (masquerade)", be, src, want)
			}
		}
		if !seen["be1"] || !seen["be2"] {
			t.Errorf("node port reached %v, want be1 and be2", seen)
		}
	})
	t.Run("session affinity holds a client to one backend", func(t *testing.T) {
		var first string
		for i := 0; i < 6; i++ {
			be, _, err := request(ctx, pod.ns, "10.96.0.11:80")
			if err != nil {
				t.Fatal(err)
			}
			if first == "" {
				first = be
			} else if be != first {
				t.Fatalf("request %d reached %s, earlier ones %s", i, be, first)
			}
		}
	})
	t.Run("service without endpoints refuses connections", func(t *testing.T) {
		_, _, err := request(ctx, pod.ns, "10.96.0.12:80")
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("request error %v, want ECONNREFUSED", err)
		}
	})

	t.Run("a node process on a wildcard address is not reachable at a cluster IP's other port", func(t *testing.T) {
		const port = 9090
		r.node.StartEcho(t, "tcp4", fmt.Sprintf("0.0.0.0:%d", port), "node")
		// The listener answers on the node's own address...
		if who, _, err := request(ctx, pod.ns, netip.AddrPortFrom(pod.gateway, port).String()); err != nil || who != "node" {
			t.Fatalf("node address: reached %q, %v; want the node's listener", who, err)
		}
		// ...but not on the ClusterIP, which is local on the dummy device:
		// KPROXY-IPVS-FILTER rejects it.
		if _, _, err := request(ctx, pod.ns, fmt.Sprintf("10.96.0.10:%d", port)); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("cluster IP at the listener's port: error %v, want ECONNREFUSED", err)
		}
		if _, _, err := request(ctx, client, fmt.Sprintf("10.96.0.10:%d", port)); !errors.Is(err, syscall.ECONNREFUSED) {
			t.Errorf("cluster IP from outside at the listener's port: error %v, want ECONNREFUSED", err)
		}
		// The service port still works.
		if be, _, err := request(ctx, pod.ns, "10.96.0.10:80"); err != nil || (be != "be1" && be != "be2") {
			t.Errorf("service port: reached %q, %v", be, err)
		}
	})

	t.Run("an external IP or load balancer IP that is a node address leaves the node's other ports reachable", func(t *testing.T) {
		// A host process (sshd, kubelet) on the node address at another port.
		hostPort := netip.AddrPortFrom(nodeIP, 2222).String()
		r.node.StartEcho(t, "tcp4", hostPort, "node")
		for _, port := range []uint16{80, 8443} {
			be, src, err := request(ctx, client, netip.AddrPortFrom(nodeIP, port).String())
			if err != nil {
				t.Errorf("service port %d: %v", port, err)
				continue
			}
			if be != "be1" && be != "be2" {
				t.Errorf("service port %d reached %q, want be1 or be2", port, be)
				continue
			}
			if host, _, _ := net.SplitHostPort(src); host != r.pods[be].gateway.String() {
				t.Errorf("service port %d: %s saw client %s, want the node's address %s (masquerade)", port, be, src, r.pods[be].gateway)
			}
		}
		if who, _, err := request(ctx, client, hostPort); err != nil || who != "node" {
			t.Errorf("host process from outside: reached %q, %v; want the node's listener", who, err)
		}
		if who, _, err := request(ctx, r.node, hostPort); err != nil || who != "node" {
			t.Errorf("host process from the node: reached %q, %v; want the node's listener", who, err)
		}
		bound, err := r.nl.ListBoundAddresses(ctx, DefaultDummyDevice)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(bound, netip.MustParseAddr("10.96.0.13")) {
			t.Fatalf("%s holds %v, without the cluster IP 10.96.0.13", DefaultDummyDevice, bound)
		}
		if slices.Contains(bound, nodeIP) {
			t.Errorf("the node address %s is bound to %s: %v", nodeIP, DefaultDummyDevice, bound)
		}
		entries, err := r.sets.Entries(ctx, setIPVSAddresses)
		if err != nil {
			t.Fatal(err)
		}
		if slices.ContainsFunc(entries, func(e ipset.Entry) bool { return e.IP == nodeIP }) {
			t.Errorf("the node address %s is in %s: %v", nodeIP, setIPVSAddresses, entries)
		}
	})

	for i := 1; i <= 2; i++ {
		if err := r.backend.Cleanup(ctx); err != nil {
			t.Fatalf("cleanup %d: %v", i, err)
		}
		checkForeign(fmt.Sprintf("after cleanup %d", i))
		r.checkNothingOurs(fmt.Sprintf("after cleanup %d", i), len(foreign))
	}
}

// checkNothingOurs fails unless the node namespace holds no chain, set,
// device or virtual server of kproxy's (virtual servers: only the foreign
// ones remain).
func (r *realNode) checkNothingOurs(when string, foreign int) {
	t := r.t
	t.Helper()
	ctx := context.Background()
	for _, table := range []string{"nat", "filter"} {
		out, err := r.node.Exec(ctx, "iptables-save", "-t", table)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(out), "KPROXY") {
			t.Errorf("%s: kproxy iptables rules remain in %s:\n%s", when, table, out)
		}
	}
	names, err := r.sets.ListSets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if strings.HasPrefix(n, "KPROXY-") {
			t.Errorf("%s: ipset %s remains", when, n)
		}
	}
	if out, err := r.node.Exec(ctx, "ip", "-o", "link", "show"); err != nil || strings.Contains(string(out), DefaultDummyDevice) {
		t.Errorf("%s: device %s remains (err %v)", when, DefaultDummyDevice, err)
	}
	svcs, err := r.ipvs.Services(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(svcs) != foreign {
		t.Errorf("%s: virtual servers %v, want only the %d foreign ones", when, svcs, foreign)
	}
}

// holdServer accepts TCP connections, greets each with its name and then
// echoes lines until the client closes.
func holdServer(t *testing.T, ns *netnstest.NS, bind, name string) {
	l, err := ns.Listen(context.Background(), "tcp4", bind)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				if _, err := fmt.Fprintf(c, "%s\n", name); err != nil {
					return
				}
				_, _ = io.Copy(c, c)
			})
		}
	})
	t.Cleanup(func() {
		_ = l.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

func TestRealKernelGracefulTermination(t *testing.T) {
	r := newRealNode(t, func(name string, ns *netnstest.NS, bind string) { holdServer(t, ns, bind, name) })
	ctx := t.Context()
	full := r.slice("gt", "be1", "be2")
	r.engine.OnServiceAdd(pt.Service("gt", "10.96.0.20"))
	r.engine.OnEndpointSliceAdd(full)
	r.sync()

	pod := r.pods["pod"]
	conn, err := pod.ns.Dial(ctx, "tcp4", "10.96.0.20:80")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	rd := bufio.NewReader(conn)
	greeting, err := rd.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	held := strings.TrimSpace(greeting)
	other := map[string]string{"be1": "be2", "be2": "be1"}[held]

	// The held connection's backend leaves the service.
	r.engine.OnEndpointSliceUpdate(full, r.slice("gt", other))
	r.sync()
	vs := &ipvs.Service{Address: netip.MustParseAddr("10.96.0.20"), Protocol: ipvs.ProtocolTCP, Port: 80}
	weights := func() map[string]int {
		ds, err := r.ipvs.Destinations(ctx, vs)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int{}
		for _, d := range ds {
			for name, p := range r.pods {
				if p.addr == d.Address {
					out[name] = d.Weight
				}
			}
		}
		return out
	}
	if got := weights(); got[held] != 0 || got[other] != 1 || len(got) != 2 {
		t.Fatalf("after removal: weights %v, want %s at 0 and %s at 1", got, held, other)
	}
	// The open connection still works.
	for i := 0; i < 3; i++ {
		if _, err := fmt.Fprintf(conn, "ping %d\n", i); err != nil {
			t.Fatalf("held connection: %v", err)
		}
		line, err := rd.ReadString('\n')
		if err != nil || line != fmt.Sprintf("ping %d\n", i) {
			t.Fatalf("held connection answered %q, %v", line, err)
		}
	}
	// New connections go to the other backend only.
	for i := 0; i < 4; i++ {
		c, err := pod.ns.Dial(ctx, "tcp4", "10.96.0.20:80")
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		g, err := bufio.NewReader(c).ReadString('\n')
		c.Close()
		if err != nil || strings.TrimSpace(g) != other {
			t.Fatalf("new connection %d reached %q (%v), want %s", i, g, err, other)
		}
	}
	// Still waiting while the connection is open, one sync later.
	r.sync()
	if got := weights(); len(got) != 2 {
		t.Fatalf("the quiesced real server went while its connection is open: %v", got)
	}
	// Closed, and past the upper bound (the closed connection lingers in
	// IPVS's table for the FIN timeout): the real server goes.
	conn.Close()
	r.clock.Step(DefaultGracefulTerminationTimeout)
	r.sync()
	if got := weights(); len(got) != 1 || got[other] != 1 {
		t.Errorf("after the connection ended: weights %v, want only %s", got, other)
	}
}

func TestRealKernelPolicies(t *testing.T) {
	r := newRealNode(t, func(name string, ns *netnstest.NS, bind string) { ns.StartEcho(t, "tcp4", bind, name) })
	ctx := t.Context()
	// externalTrafficPolicy Local with its only endpoint on another node.
	r.engine.OnServiceAdd(pt.Service("loc", "10.96.0.30", pt.NodePort(30090), pt.ExternalLocal()))
	r.engine.OnEndpointSliceAdd(r.slice("loc", "be2"))
	// be1 alone behind a service: reaching it from be1 is hairpin.
	r.engine.OnServiceAdd(pt.Service("self", "10.96.0.31"))
	r.engine.OnEndpointSliceAdd(r.slice("self", "be1"))
	// A load balancer VIP open to the client's network only.
	r.engine.OnServiceAdd(pt.Service("lb", "10.96.0.32", pt.LoadBalancer("203.0.113.5"), pt.SourceRanges("192.0.2.0/25")))
	r.engine.OnEndpointSliceAdd(r.slice("lb", "be2"))
	// Both traffic policies Local, its only endpoint on another node.
	r.engine.OnServiceAdd(pt.Service("bothloc", "10.96.0.33", pt.NodePort(30091), pt.ExternalLocal(), pt.InternalLocal()))
	r.engine.OnEndpointSliceAdd(r.slice("bothloc", "be2"))
	// externalTrafficPolicy Local and source ranges holding the client only
	// (not the node's 192.0.2.1), endpoints on this node and another.
	r.engine.OnServiceAdd(pt.Service("lbl", "10.96.0.34", pt.LoadBalancer("203.0.113.6"), pt.NodePort(30092), pt.ExternalLocal(),
		pt.SourceRanges("192.0.2.8/29")))
	r.engine.OnEndpointSliceAdd(r.slice("lbl", "be1", "be2"))
	r.sync()
	r.client.AddRoute(t, netip.MustParsePrefix("203.0.113.0/24"), realNodeAddr.Addr())
	r.pods["pod"].ns.AddRoute(t, netip.MustParsePrefix("203.0.113.0/24"), r.pods["pod"].gateway)

	short := func(d time.Duration) context.Context {
		c, cancel := context.WithTimeout(ctx, d)
		t.Cleanup(cancel)
		return c
	}
	nodePort := netip.AddrPortFrom(realNodeAddr.Addr(), 30090).String()
	t.Run("Local policy without a local endpoint drops external traffic", func(t *testing.T) {
		_, _, err := request(short(time.Second), r.client, nodePort)
		if !errors.Is(err, netnstest.ErrTimeout) {
			t.Errorf("request error %v, want a timeout (DROP)", err)
		}
	})
	t.Run("pods reach a Local node port through the cluster endpoints, unmasqueraded", func(t *testing.T) {
		be, src, err := request(ctx, r.pods["pod"].ns, nodePort)
		if err != nil {
			t.Fatal(err)
		}
		if host, _, _ := net.SplitHostPort(src); be != "be2" || host != r.pods["pod"].addr.String() {
			t.Errorf("reached %s seeing %s, want be2 seeing the pod's address", be, src)
		}
	})
	t.Run("pods reach a node port with both policies Local through the cluster endpoints", func(t *testing.T) {
		be, src, err := request(ctx, r.pods["pod"].ns, netip.AddrPortFrom(realNodeAddr.Addr(), 30091).String())
		if err != nil {
			t.Fatal(err)
		}
		if host, _, _ := net.SplitHostPort(src); be != "be2" || host != r.pods["pod"].addr.String() {
			t.Errorf("reached %s seeing %s, want be2 seeing the pod's address", be, src)
		}
	})
	t.Run("an endpoint reaching itself through its service is masqueraded", func(t *testing.T) {
		be, src, err := request(ctx, r.pods["be1"].ns, "10.96.0.31:80")
		if err != nil {
			t.Fatal(err)
		}
		if host, _, _ := net.SplitHostPort(src); be != "be1" || host != r.pods["be1"].gateway.String() {
			t.Errorf("reached %s seeing %s, want be1 seeing the node's address %s", be, src, r.pods["be1"].gateway)
		}
	})
	t.Run("loadBalancerSourceRanges admit the listed range and drop the rest", func(t *testing.T) {
		if be, _, err := request(ctx, r.client, "203.0.113.5:80"); err != nil || be != "be2" {
			t.Errorf("client in range: reached %q, %v", be, err)
		}
		if _, _, err := request(short(time.Second), r.pods["pod"].ns, "203.0.113.5:80"); !errors.Is(err, netnstest.ErrTimeout) {
			t.Errorf("pod out of range: error %v, want a timeout (DROP)", err)
		}
	})

	t.Run("Local policy with source ranges drops pods outside the ranges", func(t *testing.T) {
		be, src, err := request(ctx, r.client, "203.0.113.6:80")
		if err != nil {
			t.Fatalf("client in range: %v", err)
		}
		if host, _, _ := net.SplitHostPort(src); be != "be1" || host != realClientAddr.Addr().String() {
			t.Errorf("client in range reached %s seeing %s, want the local be1 seeing the client's address", be, src)
		}
		if _, _, err := request(short(time.Second), r.pods["pod"].ns, "203.0.113.6:80"); !errors.Is(err, netnstest.ErrTimeout) {
			t.Errorf("pod out of range: error %v, want a timeout (DROP)", err)
		}
		// The node port ignores the source ranges: a pod still short-circuits
		// to the cluster endpoints.
		be, src, err = request(ctx, r.pods["pod"].ns, netip.AddrPortFrom(realNodeAddr.Addr(), 30092).String())
		if err != nil {
			t.Fatalf("pod to the node port: %v", err)
		}
		if host, _, _ := net.SplitHostPort(src); (be != "be1" && be != "be2") || host != r.pods["pod"].addr.String() {
			t.Errorf("pod to the node port reached %s seeing %s, want be1 or be2 seeing the pod's address", be, src)
		}
	})

	t.Run("source ranges drop the node outside the ranges", func(t *testing.T) {
		// The node's own connections to a VIP, from the address the kernel
		// picks (the VIP itself) and from the node's address, all outside the
		// ranges (the rig sets no primary node IP, so none is admitted as
		// such).
		flows := []struct {
			vip  string
			from netip.Addr
		}{
			{"203.0.113.6:80", netip.Addr{}},        // Local, ranges 192.0.2.8/29
			{"203.0.113.6:80", realNodeAddr.Addr()}, // Local, ranges 192.0.2.8/29
			{"203.0.113.5:80", netip.Addr{}},        // Cluster, ranges 192.0.2.0/25
		}
		var served []string
		for _, f := range flows {
			reply, err := netnstest.RequestWith(short(time.Second), r.node, "tcp4", f.vip, netnstest.RequestOptions{Source: f.from})
			source := "the kernel's choice"
			if f.from.IsValid() {
				source = f.from.String()
			}
			switch {
			case errors.Is(err, netnstest.ErrTimeout), errors.Is(err, syscall.EPERM):
			case err != nil:
				t.Errorf("node to %s (source %s): error %v, want a timeout or EPERM (DROP)", f.vip, source, err)
			default:
				served = append(served, fmt.Sprintf("%s (source %s) reached %q", f.vip, source, reply))
			}
		}
		if len(served) > 0 {
			// IPVS takes the node's own packets at LOCAL_OUT, after nat
			// OUTPUT and before any filter chain: the check is in mangle
			// OUTPUT (KPROXY-IPVS-NODE-FW), since filter INPUT never sees them.
			t.Errorf("the node outside the source ranges is served: %s", strings.Join(served, "; "))
		}
	})
}
