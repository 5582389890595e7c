// Package deadlinetest holds test helpers for code that runs programs under
// a deadline: scripts that hang like a stuck program with a child of its
// own, and a check of which of them still run.
package deadlinetest

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// PidDir makes a fresh directory for HangScript's pids.
func PidDir(tb testing.TB) string {
	tb.Helper()
	pids := filepath.Join(tb.TempDir(), "pids")
	if err := os.Mkdir(pids, 0o755); err != nil {
		tb.Fatal(err)
	}
	return pids
}

// HangScript is shell that hangs: it records its pid and its child's under
// pids, says stderr on stderr and waits for a child that sleeps forever (a
// hung program with a process of its own). It reads none of its input.
func HangScript(pids, stderr string) string {
	return fmt.Sprintf(`echo $$ > %[1]s/$$
/bin/sleep 100000 &
echo $! > %[1]s/$!
echo %[2]q >&2
wait
`, pids, stderr)
}

// Running lists the pids recorded in dir (by HangScript) that still run;
// zombies, which only wait for their parent or init to reap them, do not
// count.
func Running(tb testing.TB, dir string) []int {
	tb.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		tb.Fatal(err)
	}
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		if i := bytes.LastIndexByte(stat, ')'); i > 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
			continue
		}
		out = append(out, pid)
	}
	return out
}
