package ipvs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// The VM hack/ipvs-vm.sh boots must hold what kproxy's IPVS mode and its
// tests use: the IPVS table with every scheduler, dummy/veth/bridge devices,
// the ipset types, iptables (nft and legacy) with the matches and targets of
// IPVS-mode rules, and conntrack. Each case runs its commands in order in a
// namespace of its own (deleted afterwards, with everything made in it); the
// last command's standard output must contain every want.
func TestVMSmoke(t *testing.T) {
	if os.Getenv("KPROXY_IN_VM") != "1" {
		t.Skip("needs the IPVS VM: run with go test -exec hack/ipvs-vm.sh (sets KPROXY_IN_VM=1)")
	}
	netnstest.RequireRoot(t)

	// Rules in the shape of IPVS mode's: set, ipvs, addrtype, comment, mark,
	// conntrack, statistic, recent, multiport matches; MASQUERADE, MARK,
	// REJECT targets.
	v4Rules := strings.Join([]string{
		"*nat",
		":KPROXY-SMOKE-POSTROUTING - [0:0]",
		"-A POSTROUTING -m comment --comment \"kproxy smoke\" -j KPROXY-SMOKE-POSTROUTING",
		"-A KPROXY-SMOKE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE",
		"-A KPROXY-SMOKE-POSTROUTING -m ipvs --ipvs --vdir ORIGINAL --vmethod MASQ -m set --match-set KPROXY-SMOKE dst,dst -j MASQUERADE",
		"-A PREROUTING -m addrtype --dst-type LOCAL -m set --match-set KPROXY-SMOKE dst,dst -j MARK --set-xmark 0x4000/0x4000",
		"COMMIT",
		"*filter",
		"-A INPUT -m conntrack --ctstate INVALID -j DROP",
		"-A INPUT -p tcp -m multiport --dports 80,443 -m statistic --mode random --probability 0.5 -j REJECT --reject-with icmp-port-unreachable",
		"-A INPUT -p udp -m recent --name kproxy-smoke --set -j ACCEPT",
		"COMMIT",
		"",
	}, "\n")
	v6Rules := strings.Join([]string{
		"*filter",
		"-A INPUT -p tcp --dport 80 -m comment --comment \"kproxy smoke\" -j REJECT --reject-with tcp-reset",
		"COMMIT",
		"",
	}, "\n")
	dir := t.TempDir()
	v4File := filepath.Join(dir, "v4.rules")
	v6File := filepath.Join(dir, "v6.rules")
	for name, content := range map[string]string{v4File: v4Rules, v6File: v6Rules} {
		if err := os.WriteFile(name, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	withSet := [][]string{{"ipset", "create", "KPROXY-SMOKE", "hash:ip,port"}, {"ipset", "add", "KPROXY-SMOKE", "10.96.0.10,tcp:80"}}

	var schedulers [][]string
	for _, s := range []string{"rr", "wrr", "lc", "wlc", "sh", "dh", "mh"} {
		schedulers = append(schedulers, []string{"ipvsadm", "-A", "-t", "10.96.0.10:80", "-s", s}, []string{"ipvsadm", "-D", "-t", "10.96.0.10:80"})
	}

	for _, c := range []struct {
		name  string
		steps [][]string
		want  []string
	}{
		{
			name:  "IPVS table",
			steps: [][]string{{"cat", "/proc/net/ip_vs"}},
			want:  []string{"IP Virtual Server version"},
		},
		{
			name: "IPVS NAT service with a real server",
			steps: [][]string{
				{"ipvsadm", "-A", "-t", "10.96.0.10:80", "-s", "rr", "-p", "10800"},
				{"ipvsadm", "-a", "-t", "10.96.0.10:80", "-r", "10.1.0.1:8080", "-m", "-w", "1"},
				{"ipvsadm", "-A", "-u", "10.96.0.10:53", "-s", "rr"},
				{"ipvsadm", "-A", "--sctp-service", "10.96.0.10:9999", "-s", "rr"},
				{"ipvsadm", "-Ln"},
			},
			want: []string{"TCP  10.96.0.10:80 rr persistent 10800", "10.1.0.1:8080", "UDP  10.96.0.10:53", "SCTP 10.96.0.10:9999"},
		},
		{
			name:  "every scheduler kproxy offers",
			steps: append(schedulers, []string{"ipvsadm", "-Ln"}),
			want:  []string{"IP Virtual Server version"},
		},
		{
			name: "dummy device holding a VIP",
			steps: [][]string{
				{"ip", "link", "add", "kproxy-smoke0", "type", "dummy"},
				{"ip", "addr", "add", "10.96.0.10/32", "dev", "kproxy-smoke0"},
				{"ip", "-o", "addr", "show", "dev", "kproxy-smoke0"},
			},
			want: []string{"10.96.0.10/32"},
		},
		{
			name: "veth pair and bridge",
			steps: [][]string{
				{"ip", "link", "add", "smoke-a", "type", "veth", "peer", "name", "smoke-b"},
				{"ip", "link", "add", "smoke-br", "type", "bridge"},
				{"ip", "link", "set", "smoke-a", "master", "smoke-br"},
				{"ip", "-o", "link", "show", "master", "smoke-br"},
			},
			want: []string{"smoke-a"},
		},
		{
			name: "ipset types of IPVS mode",
			steps: [][]string{
				{"ipset", "create", "s-ip", "hash:ip"},
				{"ipset", "create", "s-ipport", "hash:ip,port"},
				{"ipset", "create", "s-ipportip", "hash:ip,port,ip"},
				{"ipset", "create", "s-ipportnet", "hash:ip,port,net"},
				{"ipset", "create", "s-net", "hash:net"},
				{"ipset", "create", "s-port", "bitmap:port", "range", "0-65535"},
				{"ipset", "create", "s-ip6", "hash:ip,port", "family", "inet6"},
				{"ipset", "list", "-n"},
			},
			want: []string{"s-ip\n", "s-ipport\n", "s-ipportip\n", "s-ipportnet\n", "s-net\n", "s-port\n", "s-ip6\n"},
		},
		{
			name:  "iptables-nft restore of IPVS-mode rules",
			steps: append(withSet, []string{"iptables-nft-restore", "--noflush", v4File}, []string{"iptables-nft-save"}),
			want:  []string{"--match-set KPROXY-SMOKE dst,dst", "-m ipvs --vdir ORIGINAL --vmethod MASQ", "--dst-type LOCAL", "-j MASQUERADE", "--mode random", "--name kproxy-smoke"},
		},
		{
			name:  "iptables-legacy restore of IPVS-mode rules",
			steps: append(withSet, []string{"iptables-legacy-restore", "--noflush", v4File}, []string{"iptables-legacy-save"}),
			want:  []string{"--match-set KPROXY-SMOKE dst,dst", "-m ipvs --vdir ORIGINAL --vmethod MASQ", "--dst-type LOCAL", "-j MASQUERADE", "--mode random", "--name kproxy-smoke"},
		},
		{
			name:  "ip6tables-nft REJECT",
			steps: [][]string{{"ip6tables-nft-restore", "--noflush", v6File}, {"ip6tables-nft-save"}},
			want:  []string{"--reject-with tcp-reset"},
		},
		{
			name:  "ip6tables-legacy REJECT",
			steps: [][]string{{"ip6tables-legacy-restore", "--noflush", v6File}, {"ip6tables-legacy-save"}},
			want:  []string{"--reject-with tcp-reset"},
		},
		{
			name:  "conntrack table",
			steps: [][]string{{"conntrack", "-L"}},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			ns := netnstest.New(t, "vmsmoke")
			var out string
			for _, step := range c.steps {
				out = ns.Run(t, step[0], step[1:]...)
			}
			for _, w := range c.want {
				if !strings.Contains(out, w) {
					t.Errorf("output of %q lacks %q:\n%s", c.steps[len(c.steps)-1], w, out)
				}
			}
		})
	}
}
