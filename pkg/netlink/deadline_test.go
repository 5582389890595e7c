package netlink

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// TestRealDeadline checks the Real's deadline wrapper on a namespace: a
// call that hangs (the test's own, run under the Real's guard as a hung
// library request would be) fails at its deadline as a timeout; while it
// hangs every method fails at once, naming it, instead of piling up
// behind it; once it returns the methods work again; a caller whose
// deadline has passed gets its context's error.
func TestRealDeadline(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "nl")
	const timeout = time.Second
	const slack = 3 * time.Second
	r, err := New(Options{NetNS: ns.Name, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := t.Context()

	release := make(chan struct{})
	returned := make(chan struct{})
	start := time.Now()
	err = r.guard.Do(ctx, "netlink: hung request", r.timeout, func(context.Context) error {
		defer close(returned)
		<-release
		return nil
	}, nil)
	if !deadline.IsTimeout(err) || time.Since(start) > timeout+slack {
		t.Fatalf("hung call: %v after %v, want a timeout after %v", err, time.Since(start), timeout)
	}

	calls := []struct {
		name string
		run  func() error
	}{
		{"LocalAddresses", func() error { _, err := r.LocalAddresses(ctx, "eth9"); return err }},
		{"ListBoundAddresses", func() error { _, err := r.ListBoundAddresses(ctx, "lo"); return err }},
		{"EnsureDummyDevice", func() error { _, err := r.EnsureDummyDevice(ctx, "kpt-dummy"); return err }},
		{"DeleteDummyDevice", func() error { return r.DeleteDummyDevice(ctx, "kpt-dummy") }},
		{"EnsureAddressBound", func() error {
			_, err := r.EnsureAddressBound(ctx, netip.MustParseAddr("10.9.9.9"), "lo")
			return err
		}},
		{"UnbindAddress", func() error { return r.UnbindAddress(ctx, netip.MustParseAddr("10.9.9.9"), "lo") }},
	}
	for _, c := range calls {
		start := time.Now()
		err := c.run()
		if !deadline.IsTimeout(err) || !strings.Contains(err.Error(), "hung request") || time.Since(start) > slack {
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
	addrs, err := r.LocalAddresses(ctx)
	if err != nil || !slices.Contains(addrs, netip.MustParseAddr("127.0.0.1")) {
		t.Fatalf("LocalAddresses after the hung call returned = %v, %v; want 127.0.0.1 among them", addrs, err)
	}

	late, cancel := context.WithDeadline(ctx, time.Now().Add(-time.Second))
	defer cancel()
	if _, err := r.LocalAddresses(late); err == nil || !strings.Contains(err.Error(), context.DeadlineExceeded.Error()) {
		t.Fatalf("LocalAddresses past the caller's deadline = %v, want its context's error", err)
	}
}
