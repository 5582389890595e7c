package cluster

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// LockPath serialises every local cluster on the machine (make demo, the
// e2e suite, TestUpDown): whoever brings one up holds it until it is down.
const LockPath = "/tmp/kpc-cluster.lock"

// LockMachine takes LockPath exclusively and returns its release. When a
// process this one descends from already holds it (the suite run as
// `flock /tmp/kpc-cluster.lock go test ...`), that lock covers this run.
// Otherwise it waits for the holder, saying so through logf.
func LockMachine(logf func(format string, args ...any)) (func(), error) {
	f, err := os.OpenFile(LockPath, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", LockPath, err)
	}
	release := func() { _ = f.Close() }
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		return release, nil
	}
	if !errors.Is(err, unix.EWOULDBLOCK) {
		release()
		return nil, fmt.Errorf("locking %s: %w", LockPath, err)
	}
	holder, _ := lockHolder(f)
	if holder > 0 && isAncestor(holder) {
		logf("%s is held by pid %d, an ancestor of this test\n", LockPath, holder)
		return release, nil
	}
	logf("waiting for %s (held by pid %d: another local cluster run)\n", LockPath, holder)
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		release()
		return nil, fmt.Errorf("locking %s: %w", LockPath, err)
	}
	return release, nil
}

// lockHolder finds the pid holding a flock on f in /proc/locks.
func lockHolder(f *os.File) (int, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return 0, err
	}
	id := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
	data, err := os.ReadFile("/proc/locks")
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		// "3: FLOCK  ADVISORY  WRITE 14939 fe:00:9773225 0 EOF"
		fields := strings.Fields(sc.Text())
		if len(fields) >= 6 && fields[1] == "FLOCK" && fields[5] == id {
			return strconv.Atoi(fields[4])
		}
	}
	return 0, sc.Err()
}

// isAncestor reports whether pid is this process's parent, grandparent...
func isAncestor(pid int) bool {
	for p := os.Getppid(); p > 1; {
		if p == pid {
			return true
		}
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p))
		if err != nil {
			return false
		}
		// The parent is the second field after the parenthesised command.
		i := bytes.LastIndexByte(data, ')')
		if i < 0 {
			return false
		}
		fields := strings.Fields(string(data[i+1:]))
		if len(fields) < 2 {
			return false
		}
		if p, err = strconv.Atoi(fields[1]); err != nil {
			return false
		}
	}
	return false
}
