package app

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/conntrack"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestRunNodePortAddressesPrimary: with --nodeport-addresses=primary,
// kproxy finds this node's IP on its Node object and serves node ports on
// that address only; node ports without endpoints are rejected on every
// local address all the same.
func TestRunNodePortAddressesPrimary(t *testing.T) {
	node := nodeWithAddresses(runNode, v1.NodeAddress{Type: v1.NodeInternalIP, Address: "10.0.0.7"})
	np := pt.Service("np", "10.96.0.30", pt.NodePort(30030))
	slice := pt.Slice("np", 8080, pt.EP{IP: "10.244.2.5", Node: "node-b"})
	h := startRunWith(t, conntrack.NewFake(), func(o *Options, deps *runDeps) {
		o.NodePortAddresses = []string{"primary"}
		deps.localAddresses = func() ([]netip.Addr, error) {
			return []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.MustParseAddr("10.0.0.7"), netip.MustParseAddr("10.0.1.7")}, nil
		}
	}, node, np, slice)

	const want = `-m comment --comment "kproxy service nodeports; NOTE: this must be the last rule in this chain" -d 10.0.0.7/32 -j KPROXY-NODEPORTS`
	waitUntil(t, func() bool { return slices.Contains(h.ipt.Rules(ipt.TableNAT, "KPROXY-SERVICES"), want) }, "the node-port rule for the Node's address")
	for _, r := range h.ipt.Rules(ipt.TableNAT, "KPROXY-SERVICES") {
		if strings.Contains(r, "KPROXY-NODEPORTS") && r != want {
			t.Errorf("unexpected node-port rule %q; want only %q", r, want)
		}
	}
	const reject = `-m comment --comment "kproxy node ports without endpoints" -m addrtype --dst-type LOCAL -j KPROXY-EXT-NODEPORTS`
	if !slices.Contains(h.ipt.Rules(ipt.TableFilter, "KPROXY-EXTERNAL-SERVICES"), reject) {
		t.Errorf("KPROXY-EXTERNAL-SERVICES %q lacks %q", h.ipt.Rules(ipt.TableFilter, "KPROXY-EXTERNAL-SERVICES"), reject)
	}
}

// TestRunRouteLocalnet: route_localnet=1 found at start-up makes the IPv4
// iptables backend drop martian packets to 127.0.0.0/8.
func TestRunRouteLocalnet(t *testing.T) {
	h := startRunWith(t, conntrack.NewFake(), func(o *Options, deps *runDeps) {
		values := deps.sysctl.(*conntrack.FakeSysctl).Values()
		values[sysctlRouteLocalnet] = 1
		deps.sysctl = conntrack.NewFakeSysctl(values)
	}, pt.Node(runNode, nil))
	waitUntil(t, func() bool {
		rules := h.ipt.Rules(ipt.TableFilter, "KPROXY-LOCALNET-FIREWALL")
		return len(rules) == 1 && strings.Contains(rules[0], "-d 127.0.0.0/8 ! -s 127.0.0.0/8") && strings.HasSuffix(rules[0], "-j DROP")
	}, "the martian drop rule")
}
