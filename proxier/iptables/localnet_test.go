package iptables

import (
	"slices"
	"strings"
	"testing"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestLocalnetFirewall: with route_localnet=1 packets from outside to
// 127.0.0.0/8 are dropped (kube-proxy's martian rule); loopback traffic of
// the node itself passes; with route_localnet=0 the chain is empty, also
// after a restart that finds the sysctl back at 0.
func TestLocalnetFirewall(t *testing.T) {
	const want = `-m comment --comment "kproxy: block incoming localnet connections (route_localnet=1)" ` +
		`-d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP`
	martian := pt.Flow{Name: "neighbour to 127.0.0.1", Source: "192.0.2.10", Dest: "127.0.0.1", Port: 8080}
	fromNode := pt.Flow{Name: "node to 127.0.0.1", Source: "10.0.0.1", Dest: "127.0.0.2", Port: 8080, Origin: pt.FromHost}
	loopback := pt.Flow{Name: "loopback", Source: "127.0.0.1", Dest: "127.0.0.1", Port: 8080, Origin: pt.FromHost, Want: pt.NotHandled}

	fake := iptablestest.NewFake(ipt.ProtocolIPv4)
	h := newHarness(t, fake, Options{RouteLocalnet: true})
	h.sync()
	if got := fake.Rules(ipt.TableFilter, chainLocalnetFirewall); !slices.Equal(got, []string{want}) {
		t.Errorf("%s = %q, want %q", chainLocalnetFirewall, got, want)
	}
	for _, c := range []ipt.Chain{ipt.ChainInput, ipt.ChainOutput} {
		// First, before any of our rules that accept.
		if rules := fake.Rules(ipt.TableFilter, c); len(rules) == 0 || !strings.HasSuffix(rules[0], "-j "+chainLocalnetFirewall) {
			t.Errorf("filter %s = %q, want the jump to %s first", c, rules, chainLocalnetFirewall)
		}
	}
	martian.Want, fromNode.Want = pt.Dropped, pt.Dropped
	h.flows(martian, fromNode, loopback)

	// A restart finding route_localnet=0 empties the chain.
	h = newHarness(t, fake, Options{})
	h.sync()
	if got := fake.Rules(ipt.TableFilter, chainLocalnetFirewall); len(got) != 0 {
		t.Errorf("%s after a restart without route_localnet = %q, want it empty", chainLocalnetFirewall, got)
	}
	martian.Want, fromNode.Want = pt.NotHandled, pt.NotHandled
	h.flows(martian, fromNode, loopback)
}

// TestLocalnetFirewallIPv4Only: route_localnet is an IPv4 setting; the IPv6
// chain stays empty.
func TestLocalnetFirewallIPv4Only(t *testing.T) {
	fake := iptablestest.NewFake(ipt.ProtocolIPv6)
	b, err := New(Options{IPTables: fake, RouteLocalnet: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := b.localnetFirewall(); got != nil {
		t.Errorf("IPv6 localnet firewall = %q, want none", got)
	}
}
