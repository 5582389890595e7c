package proxiertest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// ForgetRecentLists empties the node's -m recent lists (iptables mode's
// ClientIP affinity), so that the next packet is a first one: a
// RealKernel.ForgetAffinity for iptables mode.
func ForgetRecentLists(node *netnstest.NS) error {
	return node.Do(func() error {
		// thread-self: this thread is the one inside the namespace.
		dir := "/proc/thread-self/net/xt_recent"
		entries, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("listing recent lists: %w", err)
		}
		for _, e := range entries {
			if err := os.WriteFile(filepath.Join(dir, e.Name()), []byte("/\n"), 0); err != nil {
				return fmt.Errorf("emptying recent list %s: %w", e.Name(), err)
			}
		}
		return nil
	})
}
