package ipvs

import (
	"context"
	"errors"
	"sync"
	"syscall"
	"testing"
	"time"

	mobyipvs "github.com/moby/ipvs"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// TestRealAbandonedCallReopens checks Real's handling of a call that hangs
// (no kernel needed: the handles are empty and the call is the test's): it
// fails at its deadline as a timeout and its handle is dropped; calls made
// while it still runs are refused at once; once it has returned, the next
// call opens a new handle and runs.
func TestRealAbandonedCallReopens(t *testing.T) {
	var (
		mu     sync.Mutex
		opened []*mobyipvs.Handle
	)
	open := func() (*mobyipvs.Handle, error) {
		mu.Lock()
		defer mu.Unlock()
		h := &mobyipvs.Handle{}
		opened = append(opened, h)
		return h, nil
	}
	const timeout = 200 * time.Millisecond
	const slack = 3 * time.Second
	r := &Real{open: open, timeout: timeout}
	ctx := t.Context()

	release := make(chan struct{})
	returned := make(chan struct{})
	start := time.Now()
	err := r.do(ctx, "NewService", func(h *mobyipvs.Handle) error {
		defer close(returned)
		<-release
		return nil
	})
	if !deadline.IsTimeout(err) || !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > timeout+slack {
		t.Fatalf("hung call: %v after %v, want a timeout after %v", err, time.Since(start), timeout)
	}
	r.mu.Lock()
	dropped := r.h == nil
	r.mu.Unlock()
	if !dropped {
		t.Error("the abandoned call's handle is still in use")
	}

	ran := false
	err = r.do(ctx, "GetServices", func(*mobyipvs.Handle) error { ran = true; return nil })
	if ran || !deadline.IsTimeout(err) {
		t.Fatalf("call while the hung one runs: ran %v, err %v; want a refusal", ran, err)
	}

	close(release)
	<-returned
	for r.guard.Stuck() != 0 {
		if time.Since(start) > timeout+slack {
			t.Fatal("the returned call is still counted as running")
		}
		time.Sleep(time.Millisecond)
	}
	var got *mobyipvs.Handle
	if err := r.do(ctx, "GetServices", func(h *mobyipvs.Handle) error { got = h; return nil }); err != nil {
		t.Fatalf("call after the hung one returned: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(opened) != 2 || got != opened[1] {
		t.Fatalf("opened %d handles, the call got %p; want a second handle, used", len(opened), got)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.do(ctx, "GetServices", func(*mobyipvs.Handle) error { return nil }); err == nil {
		t.Fatal("call after Close succeeded")
	}
	if len(opened) != 2 {
		t.Fatalf("a call after Close opened a handle")
	}
}

// TestNetlinkSocketCloseEndsReceive checks what the Real's abort relies
// on: closing a netlink socket of the library (as mobyipvs.Handle.Close
// does) ends github.com/moby/ipvs's wait for an answer, which retries
// Receive for as long as it fails with EAGAIN. The Receive blocked at the
// close returns EAGAIN; the next one fails with another error.
func TestNetlinkSocketCloseEndsReceive(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "ipvs")
	handle, err := netns.GetFromName(ns.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer handle.Close()
	s, err := nl.GetNetlinkSocketAt(handle, netns.None(), unix.NETLINK_GENERIC)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		// The library's loop; nothing was asked, so nothing comes.
		for attempt := 0; ; attempt++ {
			_, _, err := s.Receive()
			if !errors.Is(err, syscall.EAGAIN) || attempt == 10 {
				done <- err
				return
			}
		}
	}()
	select {
	case err := <-done:
		t.Fatalf("Receive returned before the close: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	s.Close()
	select {
	case err := <-done:
		if err == nil || errors.Is(err, syscall.EAGAIN) {
			t.Fatalf("Receive after close = %v, want an error other than EAGAIN", err)
		}
		t.Logf("Receive after close: %v", err)
	case <-time.After(3 * time.Second):
		t.Fatal("closing the socket did not end Receive")
	}
}
