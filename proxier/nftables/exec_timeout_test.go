package nftables

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/deadline/deadlinetest"
)

// hungNFT writes an nft that hangs without reading its input: it records
// its pid and its child's under pids and waits for a child that sleeps
// forever.
func hungNFT(t *testing.T) (path, pids string) {
	t.Helper()
	pids = deadlinetest.PidDir(t)
	path = filepath.Join(t.TempDir(), "nft")
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+deadlinetest.HangScript(pids, "netlink: waiting")), 0o755); err != nil {
		t.Fatal(err)
	}
	return path, pids
}

// TestExecNFTHungTimesOut runs transactions into an nft that hangs: Run
// and Check fail by their deadline (their own or the caller's, whichever
// is earlier) with an error recognisable as a timeout, also when nft stops
// reading a transaction larger than a pipe holds, and leave no process
// behind.
func TestExecNFTHungTimesOut(t *testing.T) {
	path, pids := hungNFT(t)
	const short = time.Second
	small := func(tx *knftables.Transaction) { tx.Add(&knftables.Table{}) }
	large := func(tx *knftables.Transaction) {
		tx.Add(&knftables.Table{})
		tx.Add(&knftables.Set{Name: "s", Type: "ipv4_addr"})
		for i := range 20000 {
			tx.Add(&knftables.Element{Set: "s", Key: []string{fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&255, i&255)}})
		}
	}
	cases := []struct {
		name            string
		timeout, caller time.Duration
		check           bool
		build           func(tx *knftables.Transaction)
	}{
		{name: "Run, own deadline", timeout: short, build: small},
		{name: "Run, caller's earlier deadline", timeout: time.Hour, caller: short, build: small},
		{name: "Check", timeout: short, check: true, build: small},
		{name: "Run, input nft does not read", timeout: short, build: large},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := &execNFT{Interface: knftables.NewFake(knftables.IPv4Family, TableName), path: path, timeout: tc.timeout}
			ctx := t.Context()
			if tc.caller > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.caller)
				defer cancel()
			}
			tx := n.NewTransaction()
			tc.build(tx)
			start := time.Now()
			var err error
			if tc.check {
				err = n.Check(ctx, tx)
			} else {
				err = n.Run(ctx, tx)
			}
			elapsed := time.Since(start)
			defer func() {
				for end := time.Now().Add(3 * time.Second); ; time.Sleep(10 * time.Millisecond) {
					left := deadlinetest.Running(t, pids)
					if len(left) == 0 {
						return
					}
					if time.Now().After(end) {
						for _, pid := range left {
							_ = syscall.Kill(pid, syscall.SIGKILL)
						}
						t.Fatalf("processes %v still run after the call returned", left)
					}
				}
			}()
			if !errors.Is(err, context.DeadlineExceeded) || !deadline.IsTimeout(err) {
				t.Fatalf("err = %v, want a timeout", err)
			}
			if elapsed > short+3*time.Second {
				t.Errorf("returned after %v, want about %v", elapsed, short)
			}
			if msg := err.Error(); !strings.Contains(msg, "nft:") || !strings.Contains(msg, "process group killed") {
				t.Errorf("error %q does not say nft was killed", msg)
			}
		})
	}
}
