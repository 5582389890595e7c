package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"

	"k8s.io/klog/v2"
)

// netnsDir is where iproute2 keeps named network namespaces.
const netnsDir = "/run/netns"

// bridgeName is the switch's bridge in SwitchNetNS.
const bridgeName = "br0"

// controlPlaneHostIface is the control plane's end of the host veth pair.
const controlPlaneHostIface = "eth1"

// networkPlan returns, in order, the commands (argv) that build the topology
// of test/LOCAL-CLUSTER.md for n nodes. Only the last four touch the host's
// own namespace, and they give it nothing but the /30 to the control plane.
func networkPlan(n int) [][]string {
	var plan [][]string
	ip := func(args ...string) { plan = append(plan, append([]string{"ip"}, args...)) }
	in := func(ns string, args ...string) { ip(append([]string{"-n", ns}, args...)...) }
	sysctl := func(ns string, kv ...string) {
		plan = append(plan, append([]string{"ip", "netns", "exec", ns, "sysctl", "-q", "-e", "-w"}, kv...))
	}

	namespaces := []string{SwitchNetNS, ControlPlaneNetNS, ClientNetNS}
	for i := 1; i <= n; i++ {
		namespaces = append(namespaces, NodeNetNS(i))
	}
	for _, ns := range namespaces {
		ip("netns", "add", ns)
		in(ns, "link", "set", "lo", "up")
	}

	// The switch: a bridge that only forwards frames. Bridged frames skip
	// the switch's netfilter where br_netfilter is loaded.
	in(SwitchNetNS, "link", "add", bridgeName, "type", "bridge")
	in(SwitchNetNS, "link", "set", bridgeName, "up")
	sysctl(SwitchNetNS, "net.bridge.bridge-nf-call-iptables=0",
		"net.bridge.bridge-nf-call-ip6tables=0", "net.bridge.bridge-nf-call-arptables=0")

	// attach plugs ns into the switch as eth0 with addr/24.
	attach := func(ns, port, addr string) {
		in(SwitchNetNS, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
		in(SwitchNetNS, "link", "set", port, "master", bridgeName)
		in(SwitchNetNS, "link", "set", port, "up")
		in(ns, "addr", "add", addr+"/24", "dev", "eth0")
		in(ns, "link", "set", "eth0", "up")
	}
	// deadDefault routes everything unknown to a gateway nobody holds.
	deadDefault := func(ns string) {
		in(ns, "neigh", "replace", DeadGatewayIP, "lladdr", DeadGatewayMAC, "dev", "eth0", "nud", "permanent")
		in(ns, "route", "add", "default", "via", DeadGatewayIP, "dev", "eth0")
	}

	attach(ControlPlaneNetNS, "cp", ControlPlaneIP)
	// The control plane routes nothing between the host link and the
	// switch, whatever the host's own setting (IPv4 settings of a new
	// namespace are copied from the host's).
	sysctl(ControlPlaneNetNS, "net.ipv4.ip_forward=0")
	// The API server answers pods (the kubernetes Service) directly.
	for i := 1; i <= n; i++ {
		in(ControlPlaneNetNS, "route", "add", NodePodCIDR(i), "via", NodeIP(i), "dev", "eth0")
	}

	attach(ClientNetNS, "client", ClientIP)
	// No ICMP redirects: a node forwarding a packet it has no rule for yet
	// back onto the switch would redirect the client to the dead gateway,
	// and the client would skip that node for minutes.
	sysctl(ClientNetNS, "net.ipv4.ip_forward=0")
	sysctl(ClientNetNS, noRedirects("accept_redirects")...)
	deadDefault(ClientNetNS)

	for i := 1; i <= n; i++ {
		ns := NodeNetNS(i)
		attach(ns, fmt.Sprintf("n%d", i), NodeIP(i))
		sysctl(ns, "net.ipv4.ip_forward=1")
		sysctl(ns, noRedirects("send_redirects", "accept_redirects")...)
		deadDefault(ns)
		for j := 1; j <= n; j++ {
			if j != i {
				in(ns, "route", "add", NodePodCIDR(j), "via", NodeIP(j), "dev", "eth0")
			}
		}
	}

	// The host: one veth to the control plane, a /30 and nothing else.
	ip("link", "add", HostLink, "type", "veth", "peer", "name", controlPlaneHostIface, "netns", ControlPlaneNetNS)
	in(ControlPlaneNetNS, "addr", "add", fmt.Sprintf("%s/%d", ControlPlaneHostSideIP, HostLinkPrefixLen), "dev", controlPlaneHostIface)
	in(ControlPlaneNetNS, "link", "set", controlPlaneHostIface, "up")
	plan = append(plan, []string{"sysctl", "-q", "-e", "-w", "net.ipv6.conf." + HostLink + ".disable_ipv6=1"})
	ip("addr", "add", fmt.Sprintf("%s/%d", HostIP, HostLinkPrefixLen), "dev", HostLink)
	ip("link", "set", HostLink, "up")
	return plan
}

// run executes argv and returns its stdout; the error carries stderr.
func run(ctx context.Context, argv ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// setupNetwork builds the topology for n nodes.
func setupNetwork(ctx context.Context, n int) error {
	logger := klog.FromContext(ctx)
	plan := networkPlan(n)
	for _, argv := range plan {
		logger.V(4).Info("Network", "cmd", strings.Join(argv, " "))
		if _, err := run(ctx, argv...); err != nil {
			return fmt.Errorf("building the network: %w", err)
		}
	}
	logger.V(2).Info("Network ready", "nodes", n, "commands", len(plan))
	return nil
}

// kpcNetNS lists the names of every kpc-* network namespace.
func kpcNetNS() ([]string, error) {
	entries, err := os.ReadDir(netnsDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", netnsDir, err)
	}
	var out []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), NetNSPrefix) {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out, nil
}

// netnsExists reports whether the named namespace exists.
func netnsExists(name string) bool {
	_, err := os.Stat(filepath.Join(netnsDir, name))
	return err == nil
}

// hostLinkExists reports whether the host end of the control plane link
// exists.
func hostLinkExists() bool {
	_, err := os.Stat(filepath.Join("/sys/class/net", HostLink))
	return err == nil
}

// teardownNetwork deletes every kpc-* namespace and the host link. The
// processes inside should be gone first, or the namespaces outlive their
// names until they exit.
func teardownNetwork(ctx context.Context) error {
	var errs []error
	names, err := kpcNetNS()
	if err != nil {
		errs = append(errs, err)
	}
	for _, ns := range names {
		if _, err := run(ctx, "ip", "netns", "delete", ns); err != nil && netnsExists(ns) {
			errs = append(errs, err)
		}
	}
	if hostLinkExists() {
		if _, err := run(ctx, "ip", "link", "delete", HostLink); err != nil && hostLinkExists() {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// noRedirects returns sysctl settings turning the given ICMP redirect keys
// off on all, default and eth0: the kernel honours a redirect key when it is
// on for "all" or for the interface, so every one must be off.
func noRedirects(keys ...string) []string {
	var out []string
	for _, key := range keys {
		for _, dev := range []string{"all", "default", "eth0"} {
			out = append(out, fmt.Sprintf("net.ipv4.conf.%s.%s=0", dev, key))
		}
	}
	return out
}
