package procbench

import (
	"context"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// TestWatchCommitsKernel commits nf_tables transactions in a throwaway
// namespace and checks the watcher sees each once, with its family.
func TestWatchCommitsKernel(t *testing.T) {
	netnstest.RequireRoot(t)
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("needs nft")
	}
	ns := netnstest.New(t, "procbench")
	w, err := WatchCommits(ns)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Run() }()
	t.Cleanup(func() {
		_ = w.Close()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name   string
		script string
		family uint8
	}{
		{name: "ip", script: "add table ip pbtest\nadd chain ip pbtest c\nadd rule ip pbtest c counter accept\n", family: unix.NFPROTO_IPV4},
		{name: "ip6", script: "add table ip6 pbtest\n", family: unix.NFPROTO_IPV6},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := time.Now()
			cmd := exec.CommandContext(ctx, "ip", "netns", "exec", ns.Name, "nft", "-f", "-")
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			go func() {
				_, _ = stdin.Write([]byte(tc.script))
				stdin.Close()
			}()
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("nft: %v: %s", err, out)
			}
			deadline := time.Now().Add(5 * time.Second)
			var evs []CommitEvent
			for len(evs) == 0 && time.Now().Before(deadline) {
				select {
				case <-w.Notify():
				case <-time.After(50 * time.Millisecond):
				}
				evs = w.Since(before)
			}
			if len(evs) != 1 {
				t.Fatalf("%d commits since the script, want 1: %+v", len(evs), evs)
			}
			ev := evs[0]
			if !ev.Touches(tc.family) || ev.Proc != "nft" || ev.PID == 0 || ev.Lost || ev.Seen.Before(ev.At) {
				t.Errorf("commit %+v: want family %d by nft", ev, tc.family)
			}
			if got := ev.TouchesIPv4(); got != (tc.family == unix.NFPROTO_IPV4) {
				t.Errorf("TouchesIPv4 = %v", got)
			}
		})
	}
}
