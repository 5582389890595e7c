package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kproxy/kproxy/test/cluster"
)

const (
	// lockPath serialises every local cluster on the machine (make demo,
	// this suite).
	lockPath = "/tmp/kpc-cluster.lock"
	// childEnv names the running cluster's state directory in the child
	// test process; its absence marks the supervising parent.
	childEnv = "KPC_E2E_STATE"
	// suiteNodes is the cluster size: zones a, b, a and groups g1, g0, g1.
	suiteNodes = 3
	// upTimeout bounds bringing the cluster up.
	upTimeout = 5 * time.Minute
	// teardownReserve is the part of -test.timeout kept back from the
	// child so that the parent can still take the cluster down.
	teardownReserve = 30 * time.Second
	// childStopGrace is how long a signalled child may take to exit.
	childStopGrace = 20 * time.Second
)

var (
	// suiteCluster is the cluster every test shares (child process only).
	suiteCluster *cluster.Cluster
	// skipReason, when set, makes every test skip.
	skipReason string
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	if dir := os.Getenv(childEnv); dir != "" {
		c, err := cluster.Load(dir)
		if err != nil {
			fmt.Fprintf(os.Stderr, "e2e: loading the suite's cluster: %v\n", err)
			return 1
		}
		suiteCluster = c
		return m.Run()
	}
	switch {
	case os.Geteuid() != 0:
		skipReason = "the e2e suite needs root (it runs a local cluster in network namespaces)"
	case testing.Short():
		skipReason = "the e2e suite brings up a real cluster; skipped with -short"
	case flagSet("test.list"):
		// Listing runs no test: no cluster needed.
		return m.Run()
	}
	if skipReason != "" {
		fmt.Fprintf(os.Stderr, "e2e: skipping every test: %s\n", skipReason)
		return m.Run()
	}
	return supervise()
}

// flagSet reports whether a string flag has a non-empty value.
func flagSet(name string) bool {
	f := flag.Lookup(name)
	return f != nil && f.Value.String() != ""
}

// supervise takes the lock, brings the cluster up, runs the tests in a
// child process and takes the cluster down however the child ended.
func supervise() (code int) {
	began := time.Now()
	unlock, err := lockClusters()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		return 1
	}
	defer unlock()

	binDir, err := findBinDir()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		return 1
	}
	stateDir := os.Getenv("KPC_E2E_STATE_DIR")
	if stateDir == "" {
		stateDir = "/run/kpc-e2e"
	}

	// From here on a signal must not end the process before the cluster
	// is down: it aborts Up, or stops the child.
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	upCtx, cancelUp := context.WithTimeout(context.Background(), upTimeout)
	defer cancelUp()
	go func() {
		select {
		case sig := <-sigs:
			fmt.Fprintf(os.Stderr, "e2e: %v while bringing the cluster up; aborting\n", sig)
			cancelUp()
		case <-upCtx.Done():
		}
	}()
	fmt.Fprintf(os.Stderr, "e2e: bringing up a %d-node cluster (state %s, programs %s)\n", suiteNodes, stateDir, binDir)
	c, err := cluster.Up(upCtx, cluster.Options{Nodes: suiteNodes, StateDir: stateDir, BinDir: binDir})
	interrupted := upCtx.Err() != nil && errors.Is(context.Cause(upCtx), context.Canceled)
	cancelUp()
	if errors.Is(err, cluster.ErrAlreadyUp) {
		fmt.Fprintf(os.Stderr, "e2e: %v\ne2e: another local cluster runs (`make demo` leaves one up: `make demo-down` removes it)\n", err)
		return 1
	}
	if err != nil {
		// Up stopped what it started and kept the logs: keep them where
		// asked, then remove the rest (this state directory is ours; a
		// cluster of someone else's would have been ErrAlreadyUp).
		fmt.Fprintf(os.Stderr, "e2e: bringing the cluster up: %v\n", err)
		keepLogs(filepath.Join(stateDir, "logs"))
		if derr := cluster.Down(context.Background(), stateDir); derr != nil {
			fmt.Fprintf(os.Stderr, "e2e: removing what the failed Up left: %v\n", derr)
		}
		return 1
	}
	upTook := time.Since(began)
	fmt.Fprintf(os.Stderr, "e2e: cluster up in %s\n", upTook.Round(100*time.Millisecond))
	defer func() {
		if code != 0 {
			keepLogs(filepath.Dir(c.Log("etcd")))
		}
		downBegan := time.Now()
		if err := c.Down(context.Background()); err != nil {
			fmt.Fprintf(os.Stderr, "e2e: taking the cluster down: %v\n", err)
			code = 1
			return
		}
		fmt.Fprintf(os.Stderr, "e2e: cluster down in %s; suite wall time %s\n",
			time.Since(downBegan).Round(100*time.Millisecond), time.Since(began).Round(time.Second))
	}()
	if interrupted {
		return 1
	}
	args, err := childArgs(os.Args[1:], testTimeout(), time.Since(began))
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		return 1
	}
	child := exec.Command(os.Args[0], args...)
	child.Env = append(os.Environ(), childEnv+"="+c.StateDir())
	child.Stdin, child.Stdout, child.Stderr = nil, os.Stdout, os.Stderr
	if err := child.Start(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: starting the tests: %v\n", err)
		return 1
	}
	done := make(chan error, 1)
	go func() { done <- child.Wait() }()
	for {
		select {
		case sig := <-sigs:
			fmt.Fprintf(os.Stderr, "e2e: %v: stopping the tests, then the cluster\n", sig)
			_ = child.Process.Signal(sig)
			go func() {
				time.Sleep(childStopGrace)
				_ = child.Process.Kill()
			}()
		case err := <-done:
			var ee *exec.ExitError
			switch {
			case err == nil:
				return 0
			case errors.As(err, &ee) && ee.ExitCode() > 0:
				return ee.ExitCode()
			default:
				fmt.Fprintf(os.Stderr, "e2e: the tests ended abnormally: %v\n", err)
				return 1
			}
		}
	}
}

// childArgs are the child's arguments: the parent's, with a timeout
// (-test.timeout, 0 for none) shortened by what bringing the cluster up
// took and by teardownReserve, so that the child's own timeout (a panic)
// fires while the parent can still take the cluster down.
func childArgs(args []string, timeout, elapsed time.Duration) ([]string, error) {
	if timeout <= 0 {
		return args, nil
	}
	left := timeout - elapsed - teardownReserve
	if left <= 0 {
		return nil, fmt.Errorf("-timeout %s leaves no time for the tests after %s bringing the cluster up", timeout, elapsed.Round(time.Second))
	}
	return append(slices.Clone(args), "-test.timeout="+left.String()), nil
}

// testTimeout is the value of -test.timeout.
func testTimeout() time.Duration {
	if f := flag.Lookup("test.timeout"); f != nil {
		if d, ok := f.Value.(flag.Getter).Get().(time.Duration); ok {
			return d
		}
	}
	return 0
}

// keepLogs copies the log directory src to $KPC_E2E_LOGS, when set.
func keepLogs(src string) {
	dst := os.Getenv("KPC_E2E_LOGS")
	if dst == "" {
		return
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: keeping logs: %v\n", err)
		return
	}
	if out, err := exec.Command("cp", "-r", src+"/.", dst).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: keeping logs: %v: %s\n", err, bytes.TrimSpace(out))
		return
	}
	fmt.Fprintf(os.Stderr, "e2e: the cluster's logs are in %s\n", dst)
}

// findBinDir is $KPC_BIN_DIR, or what hack/build-control-plane.sh prints.
func findBinDir() (string, error) {
	if d := os.Getenv("KPC_BIN_DIR"); d != "" {
		return d, nil
	}
	script, err := filepath.Abs(filepath.Join("..", "..", "hack", "build-control-plane.sh"))
	if err != nil {
		return "", err
	}
	fmt.Fprintf(os.Stderr, "e2e: KPC_BIN_DIR unset; running %s\n", script)
	cmd := exec.Command(script)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w (set KPC_BIN_DIR to skip the build)", script, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return strings.TrimSpace(lines[len(lines)-1]), nil
}

// lockClusters takes lockPath exclusively and returns its release. When a
// process this one descends from already holds it (the suite run as
// `flock /tmp/kpc-cluster.lock go test ...`), that lock covers this run.
// Otherwise it waits for the holder.
func lockClusters() (func(), error) {
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", lockPath, err)
	}
	release := func() { _ = f.Close() }
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	if err == nil {
		return release, nil
	}
	if !errors.Is(err, unix.EWOULDBLOCK) {
		release()
		return nil, fmt.Errorf("locking %s: %w", lockPath, err)
	}
	holder, _ := lockHolder(f)
	if holder > 0 && isAncestor(holder) {
		fmt.Fprintf(os.Stderr, "e2e: %s is held by pid %d, an ancestor of this test\n", lockPath, holder)
		return release, nil
	}
	fmt.Fprintf(os.Stderr, "e2e: waiting for %s (held by pid %d: another local cluster run)\n", lockPath, holder)
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		release()
		return nil, fmt.Errorf("locking %s: %w", lockPath, err)
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
