package cluster

// What the e2e suite's fault injection needs of the cluster: kproxy killed
// the hard way, the control plane stopped and started again, and a kproxy of
// reference syncing the same objects as a node without touching the node.

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"
)

// controlPlaneStopGrace is how long etcd and kube-apiserver may take to
// exit after SIGTERM before StopControlPlane kills them (the API server
// drains its watches for a minute otherwise).
const controlPlaneStopGrace = 3 * time.Second

// KproxyPID returns the pid of the running kproxy on node.
func (c *Cluster) KproxyPID(node string) (int, error) {
	if _, err := c.node(node); err != nil {
		return 0, err
	}
	name := progKproxy + "/" + node
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.refreshLocked(); err != nil {
		return 0, err
	}
	for _, p := range c.procs {
		if p.Name == name && p.alive() {
			return p.PID, nil
		}
	}
	return 0, fmt.Errorf("kproxy does not run on %s", node)
}

// KillKproxy sends SIGKILL to kproxy on node, to its process only (as a
// crash or the OOM killer ends it: the commands it runs go on), waits
// until it is gone and forgets it.
func (c *Cluster) KillKproxy(ctx context.Context, node string) error {
	if _, err := c.node(node); err != nil {
		return err
	}
	name := progKproxy + "/" + node
	c.mu.Lock()
	if err := c.refreshLocked(); err != nil {
		c.mu.Unlock()
		return err
	}
	var mine []process
	for _, p := range c.procs {
		if p.Name == name && p.alive() {
			mine = append(mine, p)
		}
	}
	c.mu.Unlock()
	if len(mine) == 0 {
		return fmt.Errorf("kproxy does not run on %s", node)
	}
	for _, p := range mine {
		if err := syscall.Kill(p.PID, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
			return fmt.Errorf("killing kproxy on %s (pid %d): %w", node, p.PID, err)
		}
	}
	if !waitGone(ctx, mine, 5*time.Second) {
		return fmt.Errorf("kproxy on %s still runs 5s after SIGKILL", node)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.procs = slices.DeleteFunc(c.procs, func(p process) bool { return p.Name == name })
	return c.savePidsLocked()
}

// ControlPlaneRunning reports whether etcd and kube-apiserver both run.
func (c *Cluster) ControlPlaneRunning() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.refreshLocked(); err != nil {
		return false
	}
	running := 0
	for _, p := range c.procs {
		if (p.Name == progEtcd || p.Name == progAPIServer) && p.alive() {
			running++
		}
	}
	return running == 2
}

// StopControlPlane stops kube-apiserver, then etcd (SIGTERM; SIGKILL after
// a grace period). The controller manager, the scheduler, the node agents
// and kproxy keep running and retry. StartControlPlane starts them again.
func (c *Cluster) StopControlPlane(ctx context.Context) error {
	for _, name := range []string{progAPIServer, progEtcd} {
		c.mu.Lock()
		if err := c.refreshLocked(); err != nil {
			c.mu.Unlock()
			return err
		}
		var mine []process
		for _, p := range c.procs {
			if p.Name == name {
				mine = append(mine, p)
			}
		}
		c.mu.Unlock()
		if err := stop(ctx, mine, controlPlaneStopGrace); err != nil {
			return fmt.Errorf("stopping %s: %w", name, err)
		}
		c.mu.Lock()
		c.procs = slices.DeleteFunc(c.procs, func(p process) bool { return p.Name == name })
		err := c.savePidsLocked()
		c.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

// StartControlPlane starts etcd and kube-apiserver (those not running)
// with the arguments Up gave them, on the same data, and waits until the
// API server is ready.
func (c *Cluster) StartControlPlane(ctx context.Context) error {
	c.mu.Lock()
	if err := c.refreshLocked(); err != nil {
		c.mu.Unlock()
		return err
	}
	running := map[string]bool{}
	for _, p := range c.procs {
		if p.alive() {
			running[p.Name] = true
		}
	}
	c.mu.Unlock()
	for _, l := range []launch{
		{Name: progEtcd, NetNS: ControlPlaneNetNS, Argv: append([]string{c.bin(progEtcd)}, etcdArgs(c.l)...), Log: c.l.logFile(progEtcd)},
		{Name: progAPIServer, NetNS: ControlPlaneNetNS, Argv: append([]string{c.bin(progAPIServer)}, apiServerArgs(c.l)...), Log: c.l.logFile(progAPIServer)},
	} {
		if running[l.Name] {
			continue
		}
		c.mu.Lock()
		c.procs = slices.DeleteFunc(c.procs, func(p process) bool { return p.Name == l.Name })
		c.mu.Unlock()
		if err := c.startAll(ctx, l); err != nil {
			return err
		}
	}
	return c.waitAPIReady(ctx)
}

// Scratch network namespace of ScratchKproxy: a port of the switch at an
// address no node, client or benchmark takes (test/LOCAL-CLUSTER.md).
const (
	ScratchNetNS  = NetNSPrefix + "scratch"
	ScratchIP     = "10.254.0.201"
	scratchPort   = "scratch"
	scratchPrefix = "/24"
)

// ScratchKproxy is a kproxy that acts as one node (same flags, same Node
// object) in a network namespace of its own, plugged into the switch to
// reach the API server: it programs that namespace's kernel only, so its
// rules are what a fresh kproxy writes for the node, with nothing in
// the node disturbed. Taking the cluster down removes it too.
type ScratchKproxy struct {
	c    *Cluster
	proc process
	log  string
}

// StartScratchKproxy creates ScratchNetNS (replacing a leftover one) and
// starts kproxy there as node with the cluster's flags and extraArgs.
func (c *Cluster) StartScratchKproxy(ctx context.Context, node string, extraArgs ...string) (*ScratchKproxy, error) {
	i, err := c.node(node)
	if err != nil {
		return nil, err
	}
	if err := removeScratchNetNS(ctx); err != nil {
		return nil, err
	}
	plan := [][]string{
		{"ip", "netns", "add", ScratchNetNS},
		{"ip", "-n", ScratchNetNS, "link", "set", "lo", "up"},
		{"ip", "-n", SwitchNetNS, "link", "add", scratchPort, "type", "veth", "peer", "name", "eth0", "netns", ScratchNetNS},
		{"ip", "-n", SwitchNetNS, "link", "set", scratchPort, "master", bridgeName},
		{"ip", "-n", SwitchNetNS, "link", "set", scratchPort, "up"},
		{"ip", "-n", ScratchNetNS, "addr", "add", ScratchIP + scratchPrefix, "dev", "eth0"},
		// The node's address, local as on the node (kproxy's NodePort
		// addresses come from the local ones), on the loopback device
		// (kernels may lack the dummy device): eth0 answers ARP only for
		// its own address, so the node's traffic never comes here.
		{"ip", "netns", "exec", ScratchNetNS, "sysctl", "-q", "-w", "net.ipv4.conf.all.arp_ignore=1", "net.ipv4.conf.all.arp_announce=2"},
		{"ip", "-n", ScratchNetNS, "addr", "add", NodeIP(i) + "/32", "dev", "lo"},
		{"ip", "-n", ScratchNetNS, "link", "set", "eth0", "up"},
	}
	for _, argv := range plan {
		if _, err := run(ctx, argv...); err != nil {
			return nil, errors.Join(fmt.Errorf("creating %s: %w", ScratchNetNS, err), removeScratchNetNS(context.WithoutCancel(ctx)))
		}
	}
	l := c.kproxyLaunch(i, extraArgs)
	l.Name, l.NetNS = "kproxy-scratch/"+node, ScratchNetNS
	l.Log = c.l.logFile(l.Name)
	// Logs are appended to; a scratch kproxy's log starts empty, so that a
	// sync logged by an earlier one (another mode's round) is not taken
	// for this one's.
	if err := os.Remove(l.Log); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, errors.Join(fmt.Errorf("removing the old scratch kproxy log: %w", err), removeScratchNetNS(context.WithoutCancel(ctx)))
	}
	p, err := start(ctx, l)
	if err != nil {
		return nil, errors.Join(err, removeScratchNetNS(context.WithoutCancel(ctx)))
	}
	return &ScratchKproxy{c: c, proc: p, log: l.Log}, nil
}

// Log is the scratch kproxy's log file.
func (s *ScratchKproxy) Log() string { return s.log }

// Running reports whether the scratch kproxy still runs.
func (s *ScratchKproxy) Running() bool { return s.proc.alive() }

// Close stops the scratch kproxy and deletes its namespace.
func (s *ScratchKproxy) Close(ctx context.Context) error {
	err := stop(ctx, []process{s.proc}, stopGrace)
	return errors.Join(err, removeScratchNetNS(ctx))
}

func removeScratchNetNS(ctx context.Context) error {
	if _, err := os.Stat(filepath.Join(netnsDir, ScratchNetNS)); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	// Whatever a crashed run left running there goes first.
	stray, err := processesInNetNS([]string{ScratchNetNS})
	if err != nil {
		return err
	}
	if err := terminate(ctx, stray, stopGrace, false); err != nil {
		return err
	}
	// The veth pair goes with the namespace.
	if _, err := run(ctx, "ip", "netns", "delete", ScratchNetNS); err != nil && netnsExists(ScratchNetNS) {
		return err
	}
	return nil
}
