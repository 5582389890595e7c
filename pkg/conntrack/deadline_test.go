package conntrack

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// TestRealDeadline checks the Real's deadline wrapper on a namespace: a
// call that hangs (the test's own, run under the Real's guard as a hung
// netlink request would be) fails at its deadline as a timeout; while it
// hangs ListEntries and ClearEntries fail at once, naming it; once it
// returns they work again.
func TestRealDeadline(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "ct")
	const timeout = time.Second
	const slack = 3 * time.Second
	r, err := New(Options{NetNS: ns.Name, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := t.Context()
	if _, err := r.ListEntries(ctx, v1.IPv4Protocol); err != nil {
		t.Skipf("no conntrack netlink in this kernel: %v", err)
	}

	release := make(chan struct{})
	returned := make(chan struct{})
	start := time.Now()
	err = r.guard.Do(ctx, "conntrack: hung request", r.timeout, func(context.Context) error {
		defer close(returned)
		<-release
		return nil
	}, nil)
	if !deadline.IsTimeout(err) || time.Since(start) > timeout+slack {
		t.Fatalf("hung call: %v after %v, want a timeout after %v", err, time.Since(start), timeout)
	}
	filter := Filter{Protocol: v1.ProtocolUDP, OrigDstIP: netip.MustParseAddr("10.96.0.10")}
	calls := []struct {
		name string
		run  func() error
	}{
		{"ListEntries", func() error { _, err := r.ListEntries(ctx, v1.IPv4Protocol); return err }},
		{"ClearEntries", func() error { _, err := r.ClearEntries(ctx, v1.IPv4Protocol, filter); return err }},
	}
	for _, c := range calls {
		start := time.Now()
		if err := c.run(); !deadline.IsTimeout(err) || !strings.Contains(err.Error(), "hung request") || time.Since(start) > slack {
			t.Errorf("%s while a call hangs: %v after %v; want a refusal at once naming it", c.name, err, time.Since(start))
		}
	}
	close(release)
	<-returned
	for r.guard.Stuck() != 0 {
		if time.Since(start) > timeout+slack {
			t.Fatal("the returned call is still counted as hung")
		}
		time.Sleep(time.Millisecond)
	}
	for _, c := range calls {
		if err := c.run(); err != nil {
			t.Errorf("%s after the hung call returned: %v", c.name, err)
		}
	}
}
