package e2e

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kproxy/kproxy/test/cluster"
)

const (
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
		r, err := parseRoundEnv(os.Getenv(roundEnv), os.Getenv(onceEnv), os.Getenv(runModesEnv))
		if err != nil {
			fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
			return 1
		}
		suiteCluster, thisRound = c, r
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

// sigCause cancels the suite's context when a signal arrives.
type sigCause struct{ sig os.Signal }

func (s sigCause) Error() string { return "interrupted by " + s.sig.String() }

// interruptible returns a context that the first SIGINT, SIGTERM or SIGHUP
// cancels (with a sigCause), and its release. From then on a signal no
// longer ends the process: the suite stops what runs and takes the cluster
// down first.
func interruptible() (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	done := make(chan struct{})
	go func() {
		for {
			select {
			case sig := <-sigs:
				fmt.Fprintf(os.Stderr, "e2e: %v: stopping the tests, then the cluster\n", sig)
				cancel(sigCause{sig})
			case <-done:
				return
			}
		}
	}()
	return ctx, func() {
		signal.Stop(sigs)
		close(done)
		cancel(nil)
	}
}

// supervise takes the lock, probes the modes, brings the cluster up in the
// first mode that can run, runs the tests once per mode of
// $KPROXY_E2E_MODES in a child process each (switching kproxy's mode on
// every node between rounds), and takes the cluster down however the
// rounds ended.
func supervise() (code int) {
	began := time.Now()
	modes, err := parseModes(os.Getenv(modesEnv))
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		return 1
	}
	unlock, err := cluster.LockMachine(func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "e2e: "+format, args...)
	})
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
	ctx, release := interruptible()
	defer release()

	rounds := planRounds(ctx, modes, func(ctx context.Context, mode string) error {
		return cluster.ProbeMode(ctx, binDir, mode)
	})
	defer func() {
		text, ok := summary(rounds)
		fmt.Fprintf(os.Stderr, "e2e: ===== rounds (%s=%q) =====\n%s", modesEnv, strings.Join(modes, " "), text)
		if !ok && code == 0 {
			code = 1
		}
	}()
	for _, r := range rounds {
		if r.skip != nil {
			loudSkip(r)
		}
	}
	run := runnable(rounds)
	if len(run) == 0 {
		fmt.Fprintf(os.Stderr, "e2e: no mode of %s=%q can run here: nothing to test\n", modesEnv, strings.Join(modes, " "))
		return 1
	}

	upCtx, cancelUp := context.WithTimeout(ctx, upTimeout)
	defer cancelUp()
	fmt.Fprintf(os.Stderr, "e2e: bringing up a %d-node cluster in mode %s (state %s, programs %s)\n", suiteNodes, run[0].mode, stateDir, binDir)
	c, err := cluster.Up(upCtx, cluster.Options{Nodes: suiteNodes, Mode: run[0].mode, StateDir: stateDir, BinDir: binDir})
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
		run[0].err = fmt.Errorf("bringing the cluster up: %w", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "e2e: cluster up in %s\n", time.Since(began).Round(100*time.Millisecond))
	defer func() {
		if code != 0 || slices.ContainsFunc(rounds, func(r *round) bool { return r.err != nil }) {
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

	runModes := roundModes(run)
	for i, r := range run {
		if ctx.Err() != nil {
			r.err = fmt.Errorf("not run: %w", context.Cause(ctx))
			continue
		}
		if left := testTimeout() - time.Since(began); testTimeout() > 0 && left < minRoundTime {
			r.err = fmt.Errorf("not run: %s of -timeout left", left.Round(time.Second))
			continue
		}
		switched := ""
		if i > 0 {
			// Even to the same mode: a round always starts from a kproxy
			// that just started, as the first round does.
			switchBegan := time.Now()
			fmt.Fprintf(os.Stderr, "e2e: switching kproxy on every node from %s to %s\n", c.Mode(), r.mode)
			if err := c.SetMode(ctx, r.mode); err != nil {
				r.err = fmt.Errorf("switching kproxy to --proxy-mode=%s: %w", r.mode, err)
				fmt.Fprintf(os.Stderr, "e2e: round %d/%d mode=%s: %v\n", i+1, len(run), r.mode, r.err)
				continue
			}
			switched = fmt.Sprintf(" (switched in %s)", time.Since(switchBegan).Round(100*time.Millisecond))
		}
		fmt.Fprintf(os.Stderr, "e2e: ===== round %d/%d: mode=%s: kproxy --proxy-mode=%s on %s%s =====\n",
			i+1, len(run), r.mode, r.mode, strings.Join(c.NodeNames(), ", "), switched)
		env := []string{
			childEnv + "=" + c.StateDir(),
			fmt.Sprintf("%s=%d/%d", roundEnv, i+1, len(run)),
			fmt.Sprintf("%s=%t", onceEnv, i == 0),
			runModesEnv + "=" + strings.Join(runModes, " "),
		}
		runRound(ctx, r, env, began)
	}
	return 0
}

// runRound runs the tests in a child process with env added, records the
// outcome in r, and forwards a signal that cancels ctx to the child.
func runRound(ctx context.Context, r *round, env []string, began time.Time) {
	args, err := childArgs(os.Args[1:], testTimeout(), time.Since(began))
	if err != nil {
		r.err = err
		return
	}
	roundBegan := time.Now()
	failures := &failureScanner{}
	child := exec.Command(os.Args[0], args...)
	child.Env = append(os.Environ(), env...)
	child.Stdin, child.Stdout, child.Stderr = nil, io.MultiWriter(os.Stdout, failures), os.Stderr
	if err := child.Start(); err != nil {
		r.err = fmt.Errorf("starting the tests: %w", err)
		return
	}
	r.ran = true
	done := make(chan error, 1)
	go func() { done <- child.Wait() }()
	stop := ctx.Done()
	for {
		select {
		case <-stop:
			stop = nil
			var sc sigCause
			sig := os.Signal(syscall.SIGTERM)
			if errors.As(context.Cause(ctx), &sc) {
				sig = sc.sig
			}
			_ = child.Process.Signal(sig)
			go func() {
				time.Sleep(childStopGrace)
				_ = child.Process.Kill()
			}()
		case err := <-done:
			r.took = time.Since(roundBegan)
			r.failed = failures.names
			var ee *exec.ExitError
			switch {
			case err == nil && ctx.Err() == nil:
			case err == nil:
				r.err = fmt.Errorf("interrupted: %w", context.Cause(ctx))
			case errors.As(err, &ee) && ee.ExitCode() > 0:
				r.err = fmt.Errorf("the tests failed (exit code %d)", ee.ExitCode())
			default:
				r.err = fmt.Errorf("the tests ended abnormally: %w", err)
			}
			return
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
