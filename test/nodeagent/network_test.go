package nodeagent

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
)

// Root-only tests against the real kernel. Every namespace they make is
// named kpt-* and removed in t.Cleanup, even on failure; all traffic stays
// inside those namespaces.

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	for _, bin := range []string{"ip", "nsenter"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s: %v", bin, err)
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return string(out)
}

// newNodeNS creates the node namespace kpt-na-<random> with the node
// address on lo (so the node has a source address toward pods) and removes
// it, and every namespace named podPrefix*, when the test ends.
func newNodeNS(t *testing.T, podPrefix string) string {
	t.Helper()
	name := "kpt-na-" + randomHex(4)
	run(t, "ip", "netns", "add", name)
	t.Cleanup(func() {
		entries, _ := os.ReadDir(netnsDir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), podPrefix) {
				if out, err := exec.Command("ip", "netns", "del", e.Name()).CombinedOutput(); err != nil {
					t.Errorf("ip netns del %s: %v: %s", e.Name(), err, out)
				}
			}
		}
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", name, err, out)
		}
	})
	run(t, "ip", "-n", name, "link", "set", "lo", "up")
	run(t, "ip", "-n", name, "addr", "add", testNodeIP.String()+"/32", "dev", "lo")
	return name
}

// dialIn returns a dialer whose sockets live in the named namespace.
func dialIn(netnsName string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		var c net.Conn
		err := inNetNS(netnsPath(netnsName), func() error {
			var err error
			c, err = (&net.Dialer{}).DialContext(ctx, network, addr)
			return err
		})
		return c, err
	}
}

// checkRealEcho asserts the pod answers TCP, HTTP and UDP from the node
// namespace with its name and the node's address as the client.
func checkRealEcho(t *testing.T, nodeNS, podIP, podName string) {
	t.Helper()
	for _, tc := range []struct {
		kind string
		port string
	}{{"tcp", "8080"}, {"http", "8081"}, {"udp", "5353"}} {
		got, err := request(t.Context(), dialIn(nodeNS), tc.kind, net.JoinHostPort(podIP, tc.port))
		if err != nil {
			t.Errorf("%s to %s:%s from %s: %v", tc.kind, podIP, tc.port, nodeNS, err)
			continue
		}
		name, client, _ := strings.Cut(got, " ")
		if name != podName || !strings.HasPrefix(client, testNodeIP.String()+":") {
			t.Errorf("%s reply %q, want %q and a client address from %s", tc.kind, got, podName, testNodeIP)
		}
	}
}

func TestAgentRealNetwork(t *testing.T) {
	requireRoot(t)
	podPrefix := "kpt-nap-" + randomHex(2) + "-"
	nodeNS := newNodeNS(t, podPrefix)
	nw, err := newIPNetwork(nodeNS)
	if err != nil {
		t.Fatal(err)
	}
	const uid = "c0ffee01-aaaa-bbbb-cccc-dddddddddddd"
	podNS := podPrefix + "c0ffee01"
	veth := "vpc0ffee01"

	// A leftover from an earlier run with another address: the agent
	// must recreate it.
	stale := podNetConfig{NetNS: podNS, HostVeth: veth, Addr: netip.MustParsePrefix("10.244.1.99/24")}
	if err := nw.Setup(t.Context(), stale); err != nil {
		t.Fatalf("setting up a leftover: %v", err)
	}

	env := startAgent(t, nw, nodeNS, podPrefix, testPod("web-1", uid))
	pod := env.waitRunning(t, "web-1", v1.ConditionTrue)
	if pod.Status.PodIP != "10.244.1.2" {
		t.Fatalf("podIP %s, want 10.244.1.2", pod.Status.PodIP)
	}
	if _, err := os.Stat(filepath.Join(netnsDir, podNS)); err != nil {
		t.Fatalf("pod namespace: %v", err)
	}
	if addrs := run(t, "ip", "-n", podNS, "-4", "-o", "addr", "show", "dev", "eth0"); !strings.Contains(addrs, "10.244.1.2/24") || strings.Contains(addrs, "10.244.1.99") {
		t.Errorf("eth0 addresses in %s:\n%s", podNS, addrs)
	}
	if routes := run(t, "ip", "-n", nodeNS, "-4", "route", "show"); !strings.Contains(routes, "10.244.1.2 dev "+veth) || strings.Contains(routes, "10.244.1.99") {
		t.Errorf("node routes:\n%s", routes)
	}
	if got := strings.TrimSpace(run(t, "ip", "netns", "exec", nodeNS, "cat", "/proc/sys/net/ipv4/conf/"+veth+"/proxy_arp")); got != "1" {
		t.Errorf("proxy_arp on %s = %s, want 1", veth, got)
	}
	checkRealEcho(t, nodeNS, pod.Status.PodIP, "web-1")

	// Readiness follows the annotation; the servers keep answering.
	env.setAnnotation(t, "web-1", ReadyAnnotation, "false")
	env.waitRunning(t, "web-1", v1.ConditionFalse)
	checkRealEcho(t, nodeNS, pod.Status.PodIP, "web-1")
	env.setAnnotation(t, "web-1", ReadyAnnotation, "true")
	env.waitRunning(t, "web-1", v1.ConditionTrue)

	// Deletion waits for the grace period, serving meanwhile.
	env.markDeleted(t, "web-1", 5)
	env.waitTerminating(t, testPodNS+"/web-1")
	if _, err := env.getPod("web-1"); err != nil {
		t.Fatalf("pod deleted before its grace period ended: %v", err)
	}
	checkRealEcho(t, nodeNS, pod.Status.PodIP, "web-1")
	env.clock.Step(5 * time.Second)
	env.waitGone(t, "web-1")
	if _, err := os.Lstat(filepath.Join(netnsDir, podNS)); !os.IsNotExist(err) {
		t.Errorf("pod namespace still exists after deletion (stat: %v)", err)
	}
	veths, err := nw.HostVeths(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(veths, veth) {
		t.Errorf("veth %s still in %s", veth, nodeNS)
	}
	if routes := run(t, "ip", "-n", nodeNS, "-4", "route", "show"); strings.Contains(routes, "10.244.1.2") {
		t.Errorf("route to the deleted pod remains:\n%s", routes)
	}
}

func TestIPNetworkTeardownOfMissing(t *testing.T) {
	requireRoot(t)
	podPrefix := "kpt-nap-" + randomHex(2) + "-"
	nodeNS := newNodeNS(t, podPrefix)
	nw, err := newIPNetwork(nodeNS)
	if err != nil {
		t.Fatal(err)
	}
	cfg := podNetConfig{NetNS: podPrefix + "00000000", HostVeth: "vp00000000", Addr: netip.MustParsePrefix("10.244.1.5/24")}
	if err := nw.Teardown(t.Context(), cfg); err != nil {
		t.Errorf("teardown of a network that never existed: %v", err)
	}
	if err := nw.Setup(t.Context(), cfg); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		if err := nw.Teardown(t.Context(), cfg); err != nil {
			t.Errorf("teardown %d: %v", i, err)
		}
	}
	if _, err := os.Lstat(netnsPath(cfg.NetNS)); !os.IsNotExist(err) {
		t.Errorf("namespace remains (stat: %v)", err)
	}
}

// TestNetnsPropagation runs checkNetnsPropagation in a child started the
// way `kpc up` might start the agent: under `ip netns exec` it must
// refuse, under `nsenter --net` it must pass.
func TestNetnsPropagation(t *testing.T) {
	if os.Getenv("KPT_NODEAGENT_PROPAGATION_CHILD") == "1" {
		if err := checkNetnsPropagation(); err != nil {
			os.Stdout.WriteString("REFUSED: " + err.Error() + "\n")
			return
		}
		os.Stdout.WriteString("ACCEPTED\n")
		return
	}
	requireRoot(t)
	nodeNS := newNodeNS(t, "kpt-nap-none-")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		prefix []string
		want   string
	}{
		{name: "ip netns exec", prefix: []string{"ip", "netns", "exec", nodeNS}, want: "REFUSED"},
		{name: "nsenter --net", prefix: []string{"nsenter", "--net=" + netnsPath(nodeNS), "--"}, want: "ACCEPTED"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			args := append(tc.prefix[1:], exe, "-test.run=^TestNetnsPropagation$", "-test.v")
			cmd := exec.Command(tc.prefix[0], args...)
			cmd.Env = append(os.Environ(), "KPT_NODEAGENT_PROPAGATION_CHILD=1")
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("child: %v: %s", err, out)
			}
			if !strings.Contains(string(out), tc.want) {
				t.Errorf("child output:\n%s\nwant %s", out, tc.want)
			}
		})
	}
}
