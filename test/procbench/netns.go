package procbench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/test/cluster"
)

// kproxy's network namespace: a port of the local cluster's switch (the
// bridge br0 in cluster.SwitchNetNS, test/LOCAL-CLUSTER.md), at an address
// no node or client of the topology takes. Its name starts with
// cluster.NetNSPrefix, so taking the cluster down removes it and stops
// whatever still runs in it, should the benchmark crash.
const (
	NodeNetNS     = cluster.NetNSPrefix + "pb"
	NodeIP        = "10.254.0.200"
	switchBridge  = "br0"
	switchPort    = "pb"
	switchCIDRLen = "24"
)

// createNodeNetNS creates NodeNetNS, fresh, plugged into the switch, and
// returns it with its removal.
func createNodeNetNS(ctx context.Context) (*netnstest.NS, func() error, error) {
	remove := func() error {
		if _, err := os.Stat(filepath.Join("/run/netns", NodeNetNS)); errors.Is(err, os.ErrNotExist) {
			return nil
		}
		// The veth pair goes with the namespace.
		return run(context.WithoutCancel(ctx), "ip", "netns", "delete", NodeNetNS)
	}
	if err := remove(); err != nil {
		return nil, nil, fmt.Errorf("removing a leftover %s: %w", NodeNetNS, err)
	}
	// The kernel frees a deleted namespace, and with it the switch's end
	// of its veth pair, asynchronously: a namespace made right after
	// another's deletion may find the port still there.
	for deadline := time.Now().Add(5 * time.Second); run(ctx, "ip", "-n", cluster.SwitchNetNS, "link", "show", switchPort) == nil; {
		if time.Now().After(deadline) {
			if err := run(ctx, "ip", "-n", cluster.SwitchNetNS, "link", "delete", switchPort); err != nil {
				return nil, nil, fmt.Errorf("removing the leftover switch port %s: %w", switchPort, err)
			}
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	plan := [][]string{
		{"ip", "netns", "add", NodeNetNS},
		{"ip", "-n", NodeNetNS, "link", "set", "lo", "up"},
		{"ip", "-n", cluster.SwitchNetNS, "link", "add", switchPort, "type", "veth", "peer", "name", "eth0", "netns", NodeNetNS},
		{"ip", "-n", cluster.SwitchNetNS, "link", "set", switchPort, "master", switchBridge},
		{"ip", "-n", cluster.SwitchNetNS, "link", "set", switchPort, "up"},
		{"ip", "-n", NodeNetNS, "addr", "add", NodeIP + "/" + switchCIDRLen, "dev", "eth0"},
		{"ip", "-n", NodeNetNS, "link", "set", "eth0", "up"},
	}
	for _, argv := range plan {
		if err := run(ctx, argv...); err != nil {
			return nil, nil, errors.Join(fmt.Errorf("creating %s: %w", NodeNetNS, err), remove())
		}
	}
	return &netnstest.NS{Name: NodeNetNS}, remove, nil
}

// run executes argv; the error carries its output.
func run(ctx context.Context, argv ...string) error {
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(argv, " "), err, bytes.TrimSpace(out))
	}
	return nil
}
