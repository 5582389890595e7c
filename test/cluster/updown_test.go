package cluster

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
)

// TestUpDown brings a real two-node cluster up and down, twice, holding
// LockPath meanwhile. It needs root and the programs of
// hack/build-control-plane.sh in $KPC_BIN_DIR, and skips with -short.
func TestUpDown(t *testing.T) {
	binDir := os.Getenv("KPC_BIN_DIR")
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
	if _, err := checkBinDir(binDir); err != nil {
		t.Skipf("needs KPC_BIN_DIR with the cluster's programs: %v", err)
	}
	if testing.Short() {
		t.Skip("brings up a real cluster; skipped with -short")
	}
	unlock, err := LockMachine(t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if netnsExists(ControlPlaneNetNS) {
		if procs, _ := processesInNetNS([]string{ControlPlaneNetNS}); len(procs) > 0 {
			t.Skip("a kpc cluster already runs on this machine")
		}
	}
	for round := 1; round <= 2; round++ {
		t.Logf("round %d", round)
		upDownOnce(t, binDir)
		if t.Failed() {
			return
		}
	}
}

func upDownOnce(t *testing.T, binDir string) {
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.Verbosity(2)))
	ctx, cancel := context.WithTimeout(klog.NewContext(context.Background(), logger), 5*time.Minute)
	defer cancel()
	stateDir := filepath.Join(t.TempDir(), "state")
	downed := false
	t.Cleanup(func() {
		if !downed {
			if err := Down(context.Background(), stateDir); err != nil {
				t.Errorf("cleanup Down: %v", err)
			}
		}
	})

	began := time.Now()
	c, err := Up(ctx, Options{Nodes: 2, StateDir: stateDir, BinDir: binDir})
	if err != nil {
		t.Fatalf("Up: %v", err)
	}
	t.Logf("up in %s", time.Since(began).Round(time.Millisecond))

	if _, err := Up(ctx, Options{Nodes: 2, StateDir: stateDir, BinDir: binDir}); !errors.Is(err, ErrAlreadyUp) {
		t.Errorf("second Up = %v, want ErrAlreadyUp", err)
	}

	nodes, err := c.Client().CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatalf("listing nodes: %v", err)
	}
	var names []string
	for _, n := range nodes.Items {
		names = append(names, n.Name)
		i, _ := nodeIndex(n.Name, 2)
		if n.Spec.PodCIDR != NodePodCIDR(i) || n.Labels[LabelZone] != NodeZone(i) {
			t.Errorf("node %s: podCIDR %q zone %q", n.Name, n.Spec.PodCIDR, n.Labels[LabelZone])
		}
		if cond := readyCondition(&n); cond == nil || cond.Status != "True" {
			t.Errorf("node %s not Ready: %+v", n.Name, cond)
		}
	}
	slices.Sort(names)
	if !slices.Equal(names, c.NodeNames()) {
		t.Errorf("nodes %v, want %v", names, c.NodeNames())
	}
	if body, err := c.Client().CoreV1().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx); err != nil || string(body) != "ok" {
		t.Errorf("/readyz = %q, %v", body, err)
	}

	// The host has the /30 to the control plane and nothing else of ours.
	routes, err := run(ctx, "ip", "-4", "route", "show")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range strings.Split(strings.TrimSpace(routes), "\n") {
		if strings.Contains(r, "10.254.") || strings.Contains(r, "10.244.") || strings.Contains(r, "10.96.") {
			if !strings.HasPrefix(r, "10.254.1.0/30 dev kpc-host ") {
				t.Errorf("host route %q reaches into the cluster", r)
			}
		}
	}

	out, err := c.Exec(ctx, TargetClient, "ip", "-4", "-o", "addr", "show", "dev", "eth0")
	if err != nil || !strings.Contains(out, ClientIP+"/24") {
		t.Errorf("client eth0: %q, %v", out, err)
	}

	loaded, err := Load(stateDir)
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	if err := loaded.RestartKproxy(ctx, "node-1"); err != nil {
		t.Errorf("RestartKproxy: %v", err)
	}
	s, err := loaded.Status(ctx)
	if err != nil || !s.Healthy() {
		t.Errorf("status after restart: %+v, %v", s, err)
	}
	if data, _ := os.ReadFile(loaded.KproxyLog("node-1")); strings.Count(string(data), "=== kpc: kproxy/node-1 starting") != 2 {
		t.Errorf("kproxy log of node-1 does not show two starts")
	}
	// A mode switch (to the same mode: the only one every kproxy has)
	// restarts kproxy on every node and waits for its sync. c has not
	// seen loaded restart node-1's kproxy: it must stop that one anyway.
	if err := c.SetMode(ctx, "userspace"); err == nil {
		t.Errorf("SetMode(userspace) succeeded")
	}
	if err := c.SetMode(ctx, ModeIPTables); err != nil {
		t.Errorf("SetMode(%s): %v", ModeIPTables, err)
	}
	for i := 1; i <= 2; i++ {
		procs, err := processesInNetNS([]string{NodeNetNS(i)})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, p := range procs {
			if strings.HasSuffix(p.Name, ":kproxy") {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%d kproxy processes in %s after SetMode, want 1: %v", n, NodeNetNS(i), procs)
		}
	}
	for _, node := range loaded.NodeNames() {
		want := 2
		if node == "node-1" {
			want = 3
		}
		if data, _ := os.ReadFile(loaded.KproxyLog(node)); strings.Count(string(data), "=== kpc: kproxy/"+node+" starting") != want {
			t.Errorf("kproxy log of %s does not show %d starts after SetMode", node, want)
		}
	}
	if again, err := Load(stateDir); err != nil {
		t.Errorf("Load after SetMode: %v", err)
	} else if again.Mode() != ModeIPTables {
		t.Errorf("Load after SetMode: mode %q, want %s", again.Mode(), ModeIPTables)
	}
	if s, err := loaded.Status(ctx); err != nil || !s.Healthy() {
		t.Errorf("status after SetMode: %+v, %v", s, err)
	}

	// What Down must remove.
	procs, err := readPids(loaded.l)
	if err != nil {
		t.Fatal(err)
	}
	nsNames, _ := kpcNetNS()
	inodes := map[uint64]bool{}
	for _, n := range nsNames {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(netnsDir, n), &st); err == nil {
			inodes[st.Ino] = true
		}
	}

	began = time.Now()
	if err := c.Down(ctx); err != nil {
		t.Errorf("Down: %v", err)
	}
	downed = true
	t.Logf("down in %s", time.Since(began).Round(time.Millisecond))
	if err := Down(ctx, stateDir); err != nil {
		t.Errorf("second Down: %v", err)
	}

	if left, _ := kpcNetNS(); len(left) > 0 {
		t.Errorf("namespaces left: %v", left)
	}
	if hostLinkExists() {
		t.Errorf("link %s left", HostLink)
	}
	for _, p := range procs {
		if p.alive() {
			t.Errorf("process %s (pid %d) left", p.Name, p.PID)
		}
	}
	if stray := processesInInodes(inodes); len(stray) > 0 {
		t.Errorf("processes left in the cluster's namespaces: %v", stray)
	}
	if _, err := os.Stat(stateDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("state directory left: %v", err)
	}
}

// processesInInodes lists pids with a thread in one of the namespaces.
func processesInInodes(inodes map[uint64]bool) []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		tasks, _ := os.ReadDir(filepath.Join("/proc", e.Name(), "task"))
		for _, task := range tasks {
			link, err := os.Readlink(filepath.Join("/proc", e.Name(), "task", task.Name(), "ns", "net"))
			if err != nil {
				continue
			}
			if ino, ok := parseNSLink(link); ok && inodes[ino] {
				if state, _, err := procStat(pid); err == nil && state != 'Z' {
					out = append(out, pid)
				}
				break
			}
		}
	}
	return out
}
