package netlink

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// requireVM skips unless the test runs inside the IPVS VM
// (hack/ipvs-vm.sh sets KPROXY_IN_VM=1): this machine's kernel has no dummy
// devices.
func requireVM(t *testing.T) {
	t.Helper()
	if os.Getenv("KPROXY_IN_VM") != "1" {
		t.Skip("needs dummy devices: run with go test -exec hack/ipvs-vm.sh (sets KPROXY_IN_VM=1)")
	}
	netnstest.RequireRoot(t)
}

// realEnv makes a namespace with lo and a veth to a second namespace
// holding the node addresses, and a Real on it.
func realEnv(t *testing.T) (*env, *netnstest.NS) {
	t.Helper()
	ns := netnstest.New(t, "nl")
	peer := netnstest.New(t, "nlpeer")
	v := netnstest.Link(t, ns, netip.PrefixFrom(nodeIP4, 24), peer, netip.Prefix{})
	ns.AddAddr(t, v.A, netip.PrefixFrom(nodeIP6, 64))
	r, err := New(Options{NetNS: ns.Name})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return &env{nl: r, nodeDev: v.A, nodeAddrs: []netip.Addr{nodeIP4, nodeIP6}}, ns
}

func TestRealInterface(t *testing.T) {
	requireVM(t)
	for _, c := range interfaceCases() {
		t.Run(c.name, func(t *testing.T) {
			e, _ := realEnv(t)
			runCase(t, t.Context(), e, c)
		})
	}
}

// The bound addresses are host addresses (IPv4 with scope host), local
// while the dummy device stays down, and usable at once: a server on each
// answers a client in the same namespace.
func TestRealBoundAddressesAreLocal(t *testing.T) {
	requireVM(t)
	ctx := t.Context()
	e, ns := realEnv(t)
	if _, err := e.nl.EnsureDummyDevice(ctx, dummy); err != nil {
		t.Fatal(err)
	}
	for _, a := range []netip.Addr{vip4, vip6} {
		if _, err := e.nl.EnsureAddressBound(ctx, a, dummy); err != nil {
			t.Fatal(err)
		}
	}
	link := ns.Run(t, "ip", "-o", "link", "show", dummy)
	if strings.Contains(link, ",UP") {
		t.Errorf("dummy device is up: %s", link)
	}
	addrs := ns.Run(t, "ip", "-o", "addr", "show", "dev", dummy)
	for _, want := range []string{"inet 10.96.0.10/32 scope host", "inet6 fd00:96::10/128"} {
		if !strings.Contains(addrs, want) {
			t.Errorf("addresses of %s lack %q:\n%s", dummy, want, addrs)
		}
	}
	if strings.Contains(addrs, "tentative") {
		t.Errorf("an address is tentative:\n%s", addrs)
	}
	for _, a := range []netip.Addr{vip4, vip6} {
		t.Run(a.String(), func(t *testing.T) {
			if out := ns.Run(t, "ip", "route", "get", a.String()); !strings.HasPrefix(out, "local ") {
				t.Errorf("route to %s is not local: %s", a, out)
			}
			addr := ns.StartEcho(t, "tcp", net.JoinHostPort(a.String(), "0"), "vip")
			reply, err := netnstest.Request(ctx, ns, "tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(reply, "vip ") {
				t.Errorf("reply %q, want one from the server on %s", reply, a)
			}
		})
	}
}

// New with a namespace that does not exist fails clearly.
func TestRealNewMissingNamespace(t *testing.T) {
	name := fmt.Sprintf("kpt-missing-%d", os.Getpid())
	if _, err := New(Options{NetNS: name}); err == nil || !strings.Contains(err.Error(), name) {
		t.Errorf("New(%q) = %v, want an error naming the namespace", name, err)
	}
}

// On a kernel without dummy devices (this machine's own) the error says so.
func TestRealWithoutDummy(t *testing.T) {
	netnstest.RequireRoot(t)
	if os.Getenv("KPROXY_IN_VM") == "1" {
		t.Skip("the VM kernel has dummy devices")
	}
	ns := netnstest.New(t, "nodummy")
	r, err := New(Options{NetNS: ns.Name})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	_, err = r.EnsureDummyDevice(t.Context(), dummy)
	if err == nil {
		t.Skip("this kernel has dummy devices")
	}
	if !strings.Contains(err.Error(), "module dummy") {
		t.Errorf("error %q does not name the dummy module", err)
	}
	t.Logf("error: %v", err)
}
