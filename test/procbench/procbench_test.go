package procbench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"

	"github.com/kproxy/kproxy/test/cluster"
)

const (
	// teardownReserve is the part of -test.timeout kept for taking the
	// control plane down.
	teardownReserve = time.Minute
	// populateWorkers is how many API requests are in flight while
	// creating objects.
	populateWorkers = 16
)

// TestProcessBenchmark measures the real kproxy process against the local
// cluster's API server (see the package documentation). It runs only with
// KPROXY_PROCBENCH=1 (`make bench`), as root, and takes the machine's
// cluster lock.
func TestProcessBenchmark(t *testing.T) {
	if os.Getenv(EnvEnable) != "1" {
		t.Skipf("a benchmark of the kproxy process on a local control plane: set %s=1 (make bench)", EnvEnable)
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (network namespaces)")
	}
	cfg, err := ParseConfig(os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Out == "" {
		cfg.Out = filepath.Join(repoRoot(t), "_output", "procbench.json")
	}
	// A signal or the test's deadline cancels ctx, so that every cleanup
	// still runs.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if dl, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, dl.Add(-teardownReserve))
		defer cancel()
	}
	logger := ktesting.NewLogger(t, ktesting.NewConfig(ktesting.Verbosity(1)))
	ctx = klog.NewContext(ctx, logger)
	began := time.Now()
	say := func(format string, args ...any) {
		fmt.Printf("procbench: [%6.1fs] %s\n", time.Since(began).Seconds(), fmt.Sprintf(format, args...))
	}

	binaries := strings.Fields(cfg.Kproxy)
	if len(binaries) == 0 {
		binaries = []string{buildKproxy(t)}
	}
	binDir := findBinDir(t)
	logDir := filepath.Join(filepath.Dir(cfg.Out), "procbench-logs")
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		t.Fatal(err)
	}

	unlock, err := cluster.LockMachine(func(format string, args ...any) { say(strings.TrimSuffix(format, "\n"), args...) })
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()

	say("starting the control plane (etcd, kube-apiserver; state %s)", cfg.StateDir)
	c, err := cluster.Up(ctx, cluster.Options{Nodes: 1, ControlPlaneOnly: true, StateDir: cfg.StateDir, BinDir: binDir})
	if errors.Is(err, cluster.ErrAlreadyUp) {
		t.Fatalf("%v: another local cluster runs (`make demo-down` removes the demo's)", err)
	}
	// From here on the kpc namespaces are this test's: take everything
	// down, whatever happens (Up removed what it started when it failed,
	// but kept its state directory).
	defer func() {
		if err := cluster.Down(context.Background(), cfg.StateDir); err != nil {
			t.Errorf("taking the control plane down: %v", err)
		}
		say("control plane down")
	}()
	if err != nil {
		t.Fatalf("starting the control plane: %v", err)
	}
	kubeconfig, err := c.KproxyKubeconfig(cluster.NodeName(1))
	if err != nil {
		t.Fatal(err)
	}
	client, err := fastClient(c.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	objs := NewObjects(client, populateWorkers)
	if err := objs.EnsureNamespace(ctx); err != nil {
		t.Fatal(err)
	}
	if err := objs.CreateMeasuredNode(ctx, NodeIP); err != nil {
		t.Fatal(err)
	}
	say("control plane up")

	notes := map[string]string{}
	if ok, why := ipvsSupport(); !ok {
		notes["ipvs"] = "not measured: " + why
		say("ipvs: not measured: %s", why)
	}
	var results []Result
	var floors []FloorResult
	floorBinary := ""
	if cfg.Floor {
		if floorBinary, err = BuildFloor(ctx, t.TempDir()); err != nil {
			t.Fatal(err)
		}
	}
	report := func() {
		if len(results) == 0 {
			return
		}
		fmt.Println("procbench: " + TableHeader())
		for _, r := range results {
			fmt.Println("procbench: " + TableLine(r))
		}
		for _, f := range floors {
			fmt.Println("procbench: " + FloorLine(f, nftablesResult(results, f.Services)))
		}
		rep := NewReport(results, notes)
		rep.Floors = floors
		if err := rep.Write(cfg.Out); err != nil {
			t.Error(err)
			return
		}
		say("wrote %s", cfg.Out)
	}
	defer report()

	for _, step := range cfg.Steps() {
		start := time.Now()
		if err := objs.GrowServices(ctx, step.Services); err != nil {
			t.Fatalf("creating Services: %v", err)
		}
		if step.Nodes > objs.Nodes() {
			if err := objs.GrowNodes(ctx, step.Nodes); err != nil {
				t.Fatalf("creating Nodes: %v", err)
			}
		}
		say("%d Services (%d endpoints), %d Nodes in place (%.1f s)",
			objs.Services(), objs.Services()*EndpointsPerService, objs.Nodes(), time.Since(start).Seconds())
		for _, run := range runsOf(cfg.Modes, binaries) {
			mode, binary := run.mode, run.binary
			if mode == "ipvs" {
				if ok, why := ipvsSupport(); !ok {
					results = append(results, Result{Mode: mode, Services: objs.Services(), Nodes: objs.Nodes(), Skipped: why})
					continue
				}
			}
			say("%s: %d Services, %d Nodes: starting %s", mode, objs.Services(), objs.Nodes(), binary)
			runStart := time.Now()
			res, err := Run(ctx, RunOptions{
				Kproxy: KproxyOptions{
					Binary: binary, Kubeconfig: kubeconfig, Node: MeasuredNode, Mode: mode,
					MetricsAddress: "127.0.0.1:10249", ProfileDir: run.profileDir(cfg.ProfileDir),
					Log: filepath.Join(logDir, fmt.Sprintf("kproxy-%s-%d-%d%s.log", mode, objs.Services(), objs.Nodes(), run.suffix)),
				},
				Objects: objs,
				Changes: cfg.Changes,
				Logf:    say,
			})
			if err != nil {
				if ctx.Err() != nil {
					t.Fatalf("%s run: %v (%v)", mode, err, context.Cause(ctx))
				}
				t.Errorf("%s run with %d Services, %d Nodes: %v", mode, objs.Services(), objs.Nodes(), err)
				continue
			}
			results = append(results, res)
			say("%s (run took %.0f s)", TableLine(res), time.Since(runStart).Seconds())
			if res.ReceiveOnlyEvents > 0 {
				say("%s, %d Services: receive-only event (median) %.2f ms, %.1f switches (the same window idle: %.2f ms, %.1f switches; %d events)",
					mode, res.Services, res.ReceiveOnlyCPUMs, res.ReceiveOnlySwitches, res.IdleWindowCPUMs, res.IdleWindowSwitches, res.ReceiveOnlyEvents)
			}
		}
		if floorBinary != "" && step.Nodes <= 1 {
			say("floor: %d Services: starting the floor program", objs.Services())
			f, err := RunFloor(ctx, FloorOptions{
				Binary: floorBinary, Kubeconfig: kubeconfig, Objects: objs, Changes: cfg.Changes,
				Log: filepath.Join(logDir, fmt.Sprintf("floor-%d.log", objs.Services())),
			})
			if err != nil {
				if ctx.Err() != nil {
					t.Fatalf("floor run: %v (%v)", err, context.Cause(ctx))
				}
				t.Errorf("floor run with %d Services: %v", objs.Services(), err)
				continue
			}
			floors = append(floors, f)
			say("%s", FloorLine(f, nftablesResult(results, f.Services)))
		}
	}
}

// nftablesResult is the last nftables-mode result at that many Services
// with the measured node alone (nil: none).
func nftablesResult(results []Result, services int) *Result {
	for i := len(results) - 1; i >= 0; i-- {
		if r := &results[i]; r.Mode == "nftables" && r.Services == services && r.Nodes <= 1 && r.Skipped == "" {
			return r
		}
	}
	return nil
}

// benchRun is one kproxy run of a step: a mode and a program.
type benchRun struct {
	mode, binary string
	// suffix tells the logs of several programs apart ("" for one).
	suffix string
}

// runsOf are the runs of a step: every mode with every program (several
// programs compare builds or settings, e.g. wrapper scripts that exec
// kproxy with another GOGC, against the same objects).
func runsOf(modes, binaries []string) []benchRun {
	var out []benchRun
	for _, mode := range modes {
		for i, b := range binaries {
			r := benchRun{mode: mode, binary: b}
			if len(binaries) > 1 {
				r.suffix = fmt.Sprintf("-%d", i)
			}
			out = append(out, r)
		}
	}
	return out
}

// profileDir is where the run's heap profiles go: dir, or a directory in
// it per program.
func (r benchRun) profileDir(dir string) string {
	if dir == "" || r.suffix == "" {
		return dir
	}
	return filepath.Join(dir, "kproxy"+r.suffix)
}

// fastClient is an admin client for populating the API server quickly: no
// client-side rate limiting, and protobuf rather than JSON (less of the
// API server's CPU per object).
func fastClient(kubeconfig string) (kubernetes.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", kubeconfig, err)
	}
	cfg.UserAgent = "procbench"
	cfg.QPS, cfg.Burst = 5000, 10000
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	return kubernetes.NewForConfig(cfg)
}

// repoRoot is the kproxy repository's root: two levels up.
func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "cmd", "kproxy")); err != nil {
		t.Fatalf("no cmd/kproxy under %s: %v", root, err)
	}
	return root
}

// buildKproxy builds cmd/kproxy of this repository.
func buildKproxy(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "kproxy")
	cmd := exec.Command("go", "build", "-o", out, "./cmd/kproxy")
	cmd.Dir = repoRoot(t)
	if data, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/kproxy: %v: %s", err, bytes.TrimSpace(data))
	}
	return out
}

// findBinDir is $KPC_BIN_DIR, or what hack/build-control-plane.sh prints.
func findBinDir(t *testing.T) string {
	t.Helper()
	if d := os.Getenv("KPC_BIN_DIR"); d != "" {
		return d
	}
	script := filepath.Join(repoRoot(t), "hack", "build-control-plane.sh")
	cmd := exec.Command(script)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s: %v (set KPC_BIN_DIR to skip the build)", script, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return strings.TrimSpace(lines[len(lines)-1])
}
