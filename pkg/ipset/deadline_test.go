package ipset

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// TestRealUnansweredRequest sends, through a Real's socket and guard, a
// request the kernel never answers (an add without NLM_F_ACK, which
// succeeds silently): the call fails at its deadline as a timeout, the
// socket's receive timeout ends the request itself, and the Real works
// again.
func TestRealUnansweredRequest(t *testing.T) {
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "ipset")
	const timeout = time.Second
	const slack = 3 * time.Second
	r, err := New(Options{NetNS: ns.Name, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := t.Context()
	const name = "kpt-unanswered"
	if err := r.EnsureSet(ctx, Set{Name: name, Type: BitmapPort}); err != nil {
		t.Fatal(err)
	}

	req := r.newPortRequest(nl.IPSET_CMD_ADD, name, 8080, "")
	req.Flags &^= unix.NLM_F_ACK
	start := time.Now()
	err = r.guard.Do(ctx, "ipset: unanswered add", r.timeout, func(context.Context) error {
		_, err := req.Execute(unix.NETLINK_NETFILTER, 0)
		return err
	}, nil)
	if !deadline.IsTimeout(err) || time.Since(start) > timeout+slack {
		t.Fatalf("unanswered request: %v after %v, want a timeout after %v", err, time.Since(start), timeout)
	}

	// The socket's receive timeout, the same as the call's, ends the
	// request (if it was abandoned at all) right after the deadline.
	for r.guard.Stuck() != 0 {
		if time.Since(start) > timeout+slack {
			t.Fatal("the socket's receive timeout did not end the abandoned request")
		}
		time.Sleep(10 * time.Millisecond)
	}
	entries, err := r.Entries(ctx, name)
	if err != nil {
		t.Fatalf("Entries after the abandoned request ended: %v", err)
	}
	if !slices.Contains(entries, Entry{Port: 8080}) {
		t.Errorf("entries %v: the unanswered add did not happen", entries)
	}
}
