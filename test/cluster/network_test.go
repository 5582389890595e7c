package cluster

import (
	"fmt"
	"slices"
	"strings"
	"testing"
)

// planIndex summarises a network plan: per namespace ("" = host) the
// argv of every command run in it.
func planIndex(plan [][]string) map[string][]string {
	out := map[string][]string{}
	for _, argv := range plan {
		ns := ""
		rest := argv
		switch {
		case len(argv) > 2 && argv[0] == "ip" && argv[1] == "-n":
			ns, rest = argv[2], argv[3:]
		case len(argv) > 3 && argv[0] == "ip" && argv[1] == "netns" && argv[2] == "exec":
			ns, rest = argv[3], argv[4:]
		case argv[0] == "ip":
			rest = argv[1:]
		}
		out[ns] = append(out[ns], strings.Join(rest, " "))
	}
	return out
}

func TestNetworkPlan(t *testing.T) {
	tests := []struct {
		name  string
		nodes int
	}{
		{name: "one node", nodes: 1},
		{name: "two nodes", nodes: 2},
		{name: "three nodes", nodes: 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			idx := planIndex(networkPlan(tc.nodes))

			// The host only gets the /30 to the control plane: no route,
			// no address but 10.254.1.1/30, no forwarding.
			host := idx[""]
			wantHost := []string{
				"netns add kpc-sw", "netns add kpc-cp", "netns add kpc-client",
				"link add kpc-host type veth peer name eth1 netns kpc-cp",
				"sysctl -q -e -w net.ipv6.conf.kpc-host.disable_ipv6=1",
				"addr add 10.254.1.1/30 dev kpc-host",
				"link set kpc-host up",
			}
			for i := 1; i <= tc.nodes; i++ {
				wantHost = append(wantHost, "netns add "+NodeNetNS(i))
			}
			slices.Sort(host)
			slices.Sort(wantHost)
			if !slices.Equal(host, wantHost) {
				t.Errorf("host commands:\n  %s\nwant:\n  %s", strings.Join(host, "\n  "), strings.Join(wantHost, "\n  "))
			}

			cp := idx[ControlPlaneNetNS]
			mustHave(t, ControlPlaneNetNS, cp, "addr add 10.254.0.2/24 dev eth0", "addr add 10.254.1.2/30 dev eth1",
				"sysctl -q -e -w net.ipv4.ip_forward=0")
			mustLack(t, ControlPlaneNetNS, cp, "ip_forward=1", "route add default")

			client := idx[ClientNetNS]
			mustHave(t, ClientNetNS, client, "addr add 10.254.0.100/24 dev eth0", "sysctl -q -e -w net.ipv4.ip_forward=0",
				"sysctl -q -e -w net.ipv4.conf.all.accept_redirects=0 net.ipv4.conf.default.accept_redirects=0 net.ipv4.conf.eth0.accept_redirects=0",
				"neigh replace 10.254.0.254 lladdr "+DeadGatewayMAC+" dev eth0 nud permanent",
				"route add default via 10.254.0.254 dev eth0")
			mustLack(t, ClientNetNS, client, "10.244.")

			for i := 1; i <= tc.nodes; i++ {
				ns := NodeNetNS(i)
				node := idx[ns]
				mustHave(t, ns, node, "link set lo up", fmt.Sprintf("addr add %s/24 dev eth0", NodeIP(i)),
					"sysctl -q -e -w net.ipv4.ip_forward=1",
					"sysctl -q -e -w net.ipv4.conf.all.send_redirects=0 net.ipv4.conf.default.send_redirects=0 net.ipv4.conf.eth0.send_redirects=0 net.ipv4.conf.all.accept_redirects=0 net.ipv4.conf.default.accept_redirects=0 net.ipv4.conf.eth0.accept_redirects=0",
					"neigh replace 10.254.0.254 lladdr "+DeadGatewayMAC+" dev eth0 nud permanent",
					"route add default via 10.254.0.254 dev eth0")
				mustHave(t, ControlPlaneNetNS, cp, fmt.Sprintf("route add %s via %s dev eth0", NodePodCIDR(i), NodeIP(i)))
				mustHave(t, SwitchNetNS, idx[SwitchNetNS], fmt.Sprintf("link set n%d master br0", i))
				for j := 1; j <= tc.nodes; j++ {
					route := fmt.Sprintf("route add %s via %s dev eth0", NodePodCIDR(j), NodeIP(j))
					if j == i {
						mustLack(t, ns, node, route)
					} else {
						mustHave(t, ns, node, route)
					}
				}
			}
		})
	}
}

func TestNetworkPlanOrder(t *testing.T) {
	// Every namespace exists before a command runs in it.
	created := map[string]bool{}
	for _, argv := range networkPlan(2) {
		line := strings.Join(argv, " ")
		if ns, ok := strings.CutPrefix(line, "ip netns add "); ok {
			created[ns] = true
			continue
		}
		for _, f := range argv {
			if strings.HasPrefix(f, NetNSPrefix) && f != HostLink && !created[f] {
				t.Errorf("%q uses %s before it is created", line, f)
			}
		}
	}
}

func mustHave(t *testing.T, ns string, cmds []string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !slices.Contains(cmds, w) {
			t.Errorf("%s: no %q among:\n  %s", ns, w, strings.Join(cmds, "\n  "))
		}
	}
}

func mustLack(t *testing.T, ns string, cmds []string, substrings ...string) {
	t.Helper()
	for _, c := range cmds {
		for _, s := range substrings {
			if strings.Contains(c, s) {
				t.Errorf("%s: unexpected %q", ns, c)
			}
		}
	}
}
