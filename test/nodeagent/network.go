package nodeagent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// netnsDir is where `ip netns` keeps its named namespaces.
const netnsDir = "/run/netns"

// podNetConfig describes the network of one pod.
type podNetConfig struct {
	// NetNS is the pod's named network namespace.
	NetNS string
	// HostVeth is the node end of the pod's veth pair (the pod end is eth0).
	HostVeth string
	// Addr is the pod address with the length of the node's podCIDR.
	Addr netip.Prefix
}

// podNetwork creates and removes pod namespaces and opens sockets inside
// them. The real implementation drives the kernel; tests use a state store.
type podNetwork interface {
	// Setup creates the pod namespace, the veth pair, the address and the
	// routes. A namespace or veth left by an earlier run is recreated.
	Setup(ctx context.Context, cfg podNetConfig) error
	// Teardown removes the namespace and the veth pair; removing what is
	// already gone succeeds.
	Teardown(ctx context.Context, cfg podNetConfig) error
	// HostVeths lists the pod veths (HostVethPrefix + 8 characters) in the
	// node namespace.
	HostVeths(ctx context.Context) ([]string, error)
	// Listen opens a stream listener inside the named namespace.
	Listen(ctx context.Context, netnsName, network, address string) (net.Listener, error)
	// ListenPacket opens a packet socket inside the named namespace.
	ListenPacket(ctx context.Context, netnsName, network, address string) (net.PacketConn, error)
}

// ipNetwork is the podNetwork of a real node: `ip` commands for links,
// addresses and routes, setns(2) on a locked OS thread for sockets and
// sysctls. Every operation names its namespace, so the agent's own network
// namespace does not matter.
type ipNetwork struct {
	// nodeNS is the node's named namespace, holding the host ends of veths.
	nodeNS string
}

var _ podNetwork = (*ipNetwork)(nil)

// newIPNetwork checks that namespaces created by this process will be seen
// by the rest of the machine and returns the network of node namespace
// nodeNS.
func newIPNetwork(nodeNS string) (*ipNetwork, error) {
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, fmt.Errorf("the node agent needs the ip command: %w", err)
	}
	if err := checkNetnsPropagation(); err != nil {
		return nil, err
	}
	if _, err := os.Stat(netnsPath(nodeNS)); err != nil {
		return nil, fmt.Errorf("node namespace %s: %w", nodeNS, err)
	}
	return &ipNetwork{nodeNS: nodeNS}, nil
}

// checkNetnsPropagation fails when the process runs in a mount namespace
// whose netns directory only receives mounts from the host (a "master:"
// propagation peer), as under `ip netns exec`: a namespace added there is
// bind-mounted in this mount namespace only, so the host (`ip netns exec`,
// `kpc down`) would see an empty file.
func checkNetnsPropagation() error {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return fmt.Errorf("reading mountinfo: %w", err)
	}
	if slaveMount(data, netnsDir) {
		return fmt.Errorf("%s is a slave mount in this process's mount namespace (started by `ip netns exec`?): "+
			"pod namespaces created here would be invisible outside it; start the agent in the host mount namespace, "+
			"e.g. `nsenter --net=%s/<node> -- kpc agent ...`", netnsDir, netnsDir)
	}
	return nil
}

// slaveMount reports whether the topmost mount at mountPoint in the given
// /proc/self/mountinfo text only receives propagation (has "master:" and no
// "shared:" peer group of the host's).
func slaveMount(mountinfo []byte, mountPoint string) bool {
	slave := false
	sc := bufio.NewScanner(bytes.NewReader(mountinfo))
	for sc.Scan() {
		// id parent major:minor root mountpoint options [optional fields...] - fstype source superoptions
		fields := strings.Fields(sc.Text())
		if len(fields) < 7 || fields[4] != mountPoint {
			continue
		}
		slave = false // a later line mounts on top of an earlier one
		for _, f := range fields[6:] {
			if f == "-" {
				break
			}
			if strings.HasPrefix(f, "master:") {
				slave = true
			}
		}
	}
	return slave
}

func netnsPath(name string) string { return filepath.Join(netnsDir, name) }

// ip runs the ip command with args, feeding it stdin when not empty.
func ip(ctx context.Context, stdin string, args ...string) error {
	cmd := exec.CommandContext(ctx, "ip", args...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		detail := strings.TrimSpace(string(out))
		if stdin != "" {
			detail += "; commands:\n" + stdin
		}
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, detail)
	}
	return nil
}

func (n *ipNetwork) Setup(ctx context.Context, cfg podNetConfig) error {
	// Recreating is simpler than checking every piece of a leftover.
	if err := n.Teardown(ctx, cfg); err != nil {
		return fmt.Errorf("removing leftovers: %w", err)
	}
	if err := ip(ctx, "", "netns", "add", cfg.NetNS); err != nil {
		return err
	}
	podCmds := strings.Join([]string{
		"link set lo up",
		fmt.Sprintf("link add eth0 type veth peer name %s netns %s", cfg.HostVeth, n.nodeNS),
		fmt.Sprintf("addr add %s dev eth0", cfg.Addr),
		"link set eth0 up",
		"route add default dev eth0",
	}, "\n") + "\n"
	if err := ip(ctx, podCmds, "-n", cfg.NetNS, "-batch", "-"); err != nil {
		return err
	}
	// proxy_arp answers the pod's neighbour requests for every address
	// (its default route is a bare device).
	err := inNetNS(netnsPath(n.nodeNS), func() error {
		return os.WriteFile(filepath.Join("/proc/sys/net/ipv4/conf", cfg.HostVeth, "proxy_arp"), []byte("1"), 0o644)
	})
	if err != nil {
		return fmt.Errorf("enabling proxy_arp on %s in %s: %w", cfg.HostVeth, n.nodeNS, err)
	}
	nodeCmds := strings.Join([]string{
		fmt.Sprintf("link set %s up", cfg.HostVeth),
		fmt.Sprintf("route replace %s dev %s", netip.PrefixFrom(cfg.Addr.Addr(), cfg.Addr.Addr().BitLen()), cfg.HostVeth),
	}, "\n") + "\n"
	return ip(ctx, nodeCmds, "-n", n.nodeNS, "-batch", "-")
}

func (n *ipNetwork) Teardown(ctx context.Context, cfg podNetConfig) error {
	var errs []error
	// Deleting one end removes the pair and the node's route to the pod.
	if exists, err := n.hasLink(cfg.HostVeth); err != nil {
		errs = append(errs, err)
	} else if exists {
		if err := ip(ctx, "", "-n", n.nodeNS, "link", "del", cfg.HostVeth); err != nil {
			errs = append(errs, err)
		}
	}
	if _, err := os.Lstat(netnsPath(cfg.NetNS)); err == nil {
		if err := ip(ctx, "", "netns", "del", cfg.NetNS); err != nil {
			errs = append(errs, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (n *ipNetwork) hasLink(name string) (bool, error) {
	names, err := n.links()
	if err != nil {
		return false, err
	}
	for _, l := range names {
		if l == name {
			return true, nil
		}
	}
	return false, nil
}

// links lists the interface names in the node namespace.
func (n *ipNetwork) links() ([]string, error) {
	var names []string
	err := inNetNS(netnsPath(n.nodeNS), func() error {
		ifs, err := net.Interfaces()
		for _, i := range ifs {
			names = append(names, i.Name)
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listing links in %s: %w", n.nodeNS, err)
	}
	return names, nil
}

func (n *ipNetwork) HostVeths(context.Context) ([]string, error) {
	names, err := n.links()
	if err != nil {
		return nil, err
	}
	var veths []string
	for _, name := range names {
		if isHostVeth(name) {
			veths = append(veths, name)
		}
	}
	return veths, nil
}

func (n *ipNetwork) Listen(ctx context.Context, netnsName, network, address string) (net.Listener, error) {
	var l net.Listener
	err := inNetNS(netnsPath(netnsName), func() error {
		var err error
		l, err = (&net.ListenConfig{}).Listen(ctx, network, address)
		return err
	})
	return l, err
}

func (n *ipNetwork) ListenPacket(ctx context.Context, netnsName, network, address string) (net.PacketConn, error) {
	var pc net.PacketConn
	err := inNetNS(netnsPath(netnsName), func() error {
		var err error
		pc, err = (&net.ListenConfig{}).ListenPacket(ctx, network, address)
		return err
	})
	return pc, err
}

// inNetNS runs fn on an OS thread switched into the network namespace at
// path. Sockets fn opens stay in that namespace and may be used from any
// goroutine afterwards; fn must not hand work to other goroutines that
// expect to be inside the namespace.
func inNetNS(path string, fn func() error) error {
	target, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("opening network namespace: %w", err)
	}
	defer target.Close()
	done := make(chan error, 1)
	// A dedicated goroutine owns the locked thread: if switching back fails
	// it exits still locked and the runtime throws the thread away.
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("opening current network namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("entering network namespace %s: %w", path, err)
			return
		}
		fnErr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- errors.Join(fnErr, fmt.Errorf("leaving network namespace %s: %w", path, err))
			return
		}
		runtime.UnlockOSThread()
		done <- fnErr
	}()
	return <-done
}
