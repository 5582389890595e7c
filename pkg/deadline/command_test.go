package deadline

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// hangScript writes a shell script that records its pid and its child's
// in dir, prints a line on stderr, creates dir/ready, then waits for a
// child that sleeps forever: a hung program with a process of its own.
func hangScript(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "hang")
	script := fmt.Sprintf(`#!/bin/sh
echo $$ > %[1]s/parent
/bin/sleep 100000 &
echo $! > %[1]s/child
echo "waiting for the lock" >&2
: > %[1]s/ready
wait
`, dir)
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

// GoneOrZombie reports whether pid no longer runs: absent, or a zombie
// (reparented children are reaped by init, which may be slow or, in a
// container, absent).
func goneOrZombie(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// The state follows the parenthesised command name.
	i := bytes.LastIndexByte(stat, ')')
	return i > 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}

func readPid(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// TestCommandKillsProcessGroup checks that a hung program ends at the
// deadline with every process it started, and that the failure reads as a
// timeout carrying what the program said.
func TestCommandKillsProcessGroup(t *testing.T) {
	for _, tc := range []struct {
		name string
		// own is the call's timeout; caller the caller's (0: none).
		own, caller time.Duration
	}{
		{name: "own timeout", own: time.Second},
		{name: "caller's deadline", own: time.Hour, caller: time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			script := hangScript(t, dir)
			ctx := t.Context()
			if tc.caller > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.caller)
				defer cancel()
			}
			ctx, cancel := context.WithTimeout(ctx, tc.own)
			defer cancel()
			cmd := Command(ctx, script)
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			start := time.Now()
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			// A loaded machine may take longer than the deadline to start
			// the script: then there is no hung process to check.
			for {
				if _, err := os.Stat(filepath.Join(dir, "ready")); err == nil {
					break
				}
				if ctx.Err() != nil {
					_ = cmd.Wait()
					t.Skipf("the script was not running by its deadline (%v)", time.Since(start))
				}
				time.Sleep(5 * time.Millisecond)
			}
			runErr := cmd.Wait()
			elapsed := time.Since(start)
			err := CommandError(ctx, "hang", tc.own, elapsed, strings.TrimSpace(stderr.String()), runErr)
			if elapsed > time.Second+slack {
				t.Errorf("returned after %v", elapsed)
			}
			if !IsTimeout(err) || !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("err = %v, want a timeout", err)
			}
			for _, want := range []string{"hang:", "process group killed", "waiting for the lock"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not contain %q", err, want)
				}
			}
			for _, name := range []string{"parent", "child"} {
				pid := readPid(t, filepath.Join(dir, name))
				for !goneOrZombie(pid) {
					if time.Since(start) > time.Second+slack {
						t.Fatalf("%s process %d still runs", name, pid)
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
		})
	}
}

// TestCommandErrorPassesOtherFailures checks that a program's own failure
// is not taken for a timeout.
func TestCommandErrorPassesOtherFailures(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	runErr := Command(ctx, "/bin/false").Run()
	err := CommandError(ctx, "false", time.Minute, 0, "", runErr)
	if err != runErr || IsTimeout(err) {
		t.Fatalf("CommandError = %v, want %v unchanged", err, runErr)
	}
	if CommandError(ctx, "true", time.Minute, 0, "", nil) != nil {
		t.Fatal("CommandError of a success is not nil")
	}
}
