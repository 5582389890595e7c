package iptables_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/deadline/deadlinetest"
	"github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// slack is how late past its deadline a call may return on a loaded
// machine.
const slack = 3 * time.Second

// hungBinaries writes, into a fresh directory, iptables, iptables-restore
// and iptables-save scripts that hang: each records its pid and its child's
// under pids/ and waits for a child that sleeps forever (a hung program
// with a process of its own). `iptables --version` answers, so New works.
func hungBinaries(t *testing.T) (dir, pids string) {
	t.Helper()
	dir = t.TempDir()
	pids = deadlinetest.PidDir(t)
	hang := deadlinetest.HangScript(pids, "Another app is currently holding the xtables lock; still waiting")
	scripts := map[string]string{
		"iptables":         "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'iptables v1.8.9 (legacy)'; exit 0; fi\n" + hang,
		"iptables-restore": "#!/bin/sh\n" + hang,
		"iptables-save":    "#!/bin/sh\n" + hang,
	}
	for name, body := range scripts {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir, pids
}

// waitGone waits until no recorded process runs; it kills the ones left
// at the end (so that a failing test leaves nothing behind) and fails.
func waitGone(t *testing.T, dir string, within time.Duration) {
	t.Helper()
	end := time.Now().Add(within)
	for {
		left := deadlinetest.Running(t, dir)
		if len(left) == 0 {
			return
		}
		if time.Now().After(end) {
			for _, pid := range left {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			t.Fatalf("processes %v still run after the call returned", left)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestRealHungCommandsTimeOut runs every kind of operation against hung
// programs: each fails by its deadline (its own or the caller's, whichever
// is earlier) with an error recognisable as a timeout, and leaves no
// process behind.
func TestRealHungCommandsTimeOut(t *testing.T) {
	dir, pids := hungBinaries(t)
	t.Setenv("PATH", dir)
	const (
		short = time.Second
		long  = time.Hour
	)
	cases := []struct {
		name string
		// timeout and restoreTimeout are the options; caller, when set,
		// the caller's deadline.
		timeout, restoreTimeout, caller time.Duration
		run                             func(ctx context.Context, r iptables.Interface) error
		wantWithin                      time.Duration
	}{
		{
			name: "Restore, its own deadline", timeout: long, restoreTimeout: short,
			run:        func(ctx context.Context, r iptables.Interface) error { return r.Restore(ctx, []byte("*nat\nCOMMIT\n")) },
			wantWithin: short,
		},
		{
			name: "Restore, the caller's earlier deadline", timeout: long, restoreTimeout: long, caller: short,
			run:        func(ctx context.Context, r iptables.Interface) error { return r.Restore(ctx, []byte("*nat\nCOMMIT\n")) },
			wantWithin: short,
		},
		{
			name: "SaveInto", timeout: long, restoreTimeout: short,
			run: func(ctx context.Context, r iptables.Interface) error {
				_, err := r.SaveInto(ctx, iptables.TableNAT)
				return err
			},
			wantWithin: short,
		},
		{
			name: "ListChains", timeout: long, restoreTimeout: short,
			run: func(ctx context.Context, r iptables.Interface) error {
				_, err := r.ListChains(ctx, iptables.TableNAT)
				return err
			},
			wantWithin: short,
		},
		{
			name: "EnsureRule", timeout: short, restoreTimeout: long,
			run: func(ctx context.Context, r iptables.Interface) error {
				_, err := r.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainOutput, "-j", "RETURN")
				return err
			},
			wantWithin: short,
		},
		{
			name: "EnsureChain, the caller's earlier deadline", timeout: long, restoreTimeout: long, caller: short,
			run: func(ctx context.Context, r iptables.Interface) error {
				_, err := r.EnsureChain(ctx, iptables.TableNAT, "KPT-X")
				return err
			},
			wantWithin: short,
		},
		{
			name: "DeleteChain", timeout: short, restoreTimeout: long,
			run: func(ctx context.Context, r iptables.Interface) error {
				return r.DeleteChain(ctx, iptables.TableNAT, "KPT-X")
			},
			wantWithin: short,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := iptables.New(t.Context(), iptables.Options{Timeout: tc.timeout, RestoreTimeout: tc.restoreTimeout})
			if err != nil {
				t.Fatal(err)
			}
			ctx := t.Context()
			if tc.caller > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.caller)
				defer cancel()
			}
			start := time.Now()
			err = tc.run(ctx, r)
			elapsed := time.Since(start)
			defer waitGone(t, pids, slack)
			if !errors.Is(err, context.DeadlineExceeded) || !deadline.IsTimeout(err) {
				t.Fatalf("err = %v, want a timeout", err)
			}
			if errors.Is(err, iptables.ErrLocked) {
				t.Errorf("err = %v: a timeout is not a lock failure", err)
			}
			if elapsed > tc.wantWithin+slack {
				t.Errorf("returned after %v, want about %v", elapsed, tc.wantWithin)
			}
			t.Logf("error: %v", err)
			if msg := err.Error(); !strings.Contains(msg, "process group killed") || strings.Contains(msg, "\n") {
				t.Errorf("error %q: want one line saying the program was killed", msg)
			}
		})
	}
}

// legacyBinaries returns a directory holding iptables, iptables-restore
// and iptables-save links to the legacy binaries; it skips without them.
func legacyBinaries(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, name := range []string{"iptables", "iptables-restore", "iptables-save"} {
		p, err := exec.LookPath(strings.Replace(name, "iptables", "iptables-legacy", 1))
		if err != nil {
			t.Skipf("needs iptables-legacy: %v", err)
		}
		if err := os.Symlink(p, filepath.Join(dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// TestRealXtablesLock holds the xtables lock (a lock file of the test's:
// XTABLES_LOCKFILE, which iptables-legacy honours) while the real
// iptables-legacy works in a namespace. Changes fail once the lock wait
// (-w) is over, as a lock failure, leaving the rules as they were; a
// deadline shorter than the wait kills the restore; a lock released during
// the wait lets the restore through; once it is free, changes succeed.
func TestRealXtablesLock(t *testing.T) {
	netnstest.RequireRoot(t)
	bin := legacyBinaries(t)
	t.Setenv("PATH", bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	lockFile := filepath.Join(t.TempDir(), "xtables.lock")
	t.Setenv("XTABLES_LOCKFILE", lockFile)
	ns := netnstest.New(t, "xtl")
	ctx := t.Context()
	open := func(opts iptables.Options) iptables.Interface {
		t.Helper()
		opts.NetNS = ns.Name
		r, err := iptables.New(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		if m := r.(*iptables.Real).Mode(); m != "legacy" {
			t.Fatalf("mode %s, want legacy", m)
		}
		return r
	}
	r := open(iptables.Options{WaitSeconds: 1})
	if err := r.Restore(ctx, []byte("*nat\n:KPT-KEEP - [0:0]\n-A KPT-KEEP -j RETURN\nCOMMIT\n")); err != nil {
		t.Fatal(err)
	}
	saved := func() string {
		t.Helper()
		out, err := ns.Exec(ctx, "iptables-legacy-save", "-t", "nat")
		if err != nil {
			t.Fatalf("iptables-legacy-save: %v: %s", err, out)
		}
		return string(out)
	}

	lock, err := os.OpenFile(lockFile, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	hold := func() {
		t.Helper()
		if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
			t.Fatal(err)
		}
	}
	change := []byte("*nat\n:KPT-NEW - [0:0]\n-A KPT-NEW -j RETURN\n-A KPT-KEEP -j KPT-NEW\nCOMMIT\n")

	hold()
	t.Run("restore gives up after the lock wait", func(t *testing.T) {
		start := time.Now()
		err := r.Restore(ctx, change)
		elapsed := time.Since(start)
		if !errors.Is(err, iptables.ErrLocked) || deadline.IsTimeout(err) {
			t.Fatalf("Restore = %v, want ErrLocked", err)
		}
		t.Logf("error: %v", err)
		if elapsed < time.Second || elapsed > time.Second+slack {
			t.Errorf("Restore failed after %v, want after the 1s lock wait", elapsed)
		}
		if s := saved(); !strings.Contains(s, "-A KPT-KEEP -j RETURN") || strings.Contains(s, "KPT-NEW") {
			t.Errorf("rules changed by a failed restore:\n%s", s)
		}
	})
	t.Run("a rule operation gives up after the lock wait", func(t *testing.T) {
		start := time.Now()
		_, err := r.EnsureChain(ctx, iptables.TableNAT, "KPT-OTHER")
		if !errors.Is(err, iptables.ErrLocked) || time.Since(start) > time.Second+slack {
			t.Fatalf("EnsureChain = %v after %v, want ErrLocked after the 1s lock wait", err, time.Since(start))
		}
	})
	t.Run("a deadline shorter than the lock wait kills the restore", func(t *testing.T) {
		patient := open(iptables.Options{WaitSeconds: 60, RestoreTimeout: 500 * time.Millisecond})
		start := time.Now()
		err := patient.Restore(ctx, change)
		if !deadline.IsTimeout(err) || time.Since(start) > 500*time.Millisecond+slack {
			t.Fatalf("Restore = %v after %v, want a timeout after 500ms", err, time.Since(start))
		}
		if left := processesRunning(t, bin); len(left) != 0 {
			t.Errorf("still running: %q", left)
		}
	})
	t.Run("a lock released during the wait lets the restore through", func(t *testing.T) {
		patient := open(iptables.Options{WaitSeconds: 30})
		fd := int(lock.Fd())
		released := make(chan struct{})
		time.AfterFunc(300*time.Millisecond, func() {
			defer close(released)
			_ = syscall.Flock(fd, syscall.LOCK_UN)
		})
		defer func() { <-released }()
		start := time.Now()
		if err := patient.Restore(ctx, change); err != nil {
			t.Fatalf("Restore: %v", err)
		}
		if time.Since(start) > 300*time.Millisecond+slack {
			t.Errorf("Restore took %v after the lock was released at 300ms", time.Since(start))
		}
		if s := saved(); !strings.Contains(s, "-A KPT-KEEP -j KPT-NEW") {
			t.Errorf("restore not applied:\n%s", s)
		}
	})
	t.Run("changes succeed with the lock free", func(t *testing.T) {
		if _, err := r.EnsureChain(ctx, iptables.TableNAT, "KPT-OTHER"); err != nil {
			t.Fatal(err)
		}
	})
}

// processesRunning lists the command lines of processes (not zombies)
// running a program from dir.
func processesRunning(t *testing.T, dir string) []string {
	t.Helper()
	procs, err := filepath.Glob("/proc/[0-9]*/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range procs {
		cmdline, err := os.ReadFile(p)
		if err != nil || !bytes.Contains(cmdline, []byte(dir+"/")) {
			continue
		}
		stat, err := os.ReadFile(filepath.Join(filepath.Dir(p), "stat"))
		if err != nil {
			continue
		}
		if i := bytes.LastIndexByte(stat, ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
			continue
		}
		out = append(out, string(bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '})))
	}
	return out
}
