package procbench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kproxy/kproxy/test/cluster"
)

// FloorResult measures the floor program (./floor): the least a client-go
// agent spends on a one-endpoint change in nftables mode, watched, timed
// and counted as kproxy's changes are (measureChange), against the same
// objects.
type FloorResult struct {
	Services int `json:"services"`
	Changes  int `json:"changes"`
	// CPUP50Ms and ChildCPUP50Ms are the medians over the changes of the
	// floor's own CPU and its nft's, from before the write to 20 ms after
	// the commit; the means beside them.
	CPUP50Ms       float64   `json:"cpu_p50_ms"`
	ChildCPUP50Ms  float64   `json:"child_cpu_p50_ms"`
	CPUMeanMs      float64   `json:"cpu_mean_ms"`
	ChildCPUMeanMs float64   `json:"child_cpu_mean_ms"`
	SwitchesP50    float64   `json:"switches_p50"`
	CPUSamplesMs   []float64 `json:"cpu_samples_ms"`
	Log            string    `json:"log"`
}

// FloorOptions configure RunFloor.
type FloorOptions struct {
	// Binary is the floor program; Kubeconfig its --kubeconfig.
	Binary, Kubeconfig string
	Objects            *Objects
	Changes            int
	Settle             time.Duration
	// Log receives the program's output.
	Log  string
	Logf func(format string, args ...any)
}

// BuildFloor builds the floor program into dir and returns its path.
func BuildFloor(ctx context.Context, dir string) (string, error) {
	out := filepath.Join(dir, "procbench-floor")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./floor")
	cmd.Dir = packageDir()
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building the floor program: %v: %s", err, b)
	}
	return out, nil
}

// packageDir is this package's source directory (the working directory
// of its tests).
func packageDir() string {
	if wd, err := os.Getwd(); err == nil {
		return wd
	}
	return "."
}

// RunFloor runs the floor program in a fresh NodeNetNS and measures
// opts.Changes one-endpoint changes, each after opts.Settle of quiet,
// ending at the commit its nft makes.
func RunFloor(ctx context.Context, opts FloorOptions) (res FloorResult, err error) {
	if opts.Changes <= 0 {
		opts.Changes = DefaultChanges
	}
	if opts.Settle <= 0 {
		opts.Settle = DefaultSettle
	}
	res = FloorResult{Services: opts.Objects.Services(), Changes: opts.Changes, Log: opts.Log}
	ns, removeNS, err := createNodeNetNS(ctx)
	if err != nil {
		return res, err
	}
	defer func() {
		if rerr := removeNS(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("removing %s: %w", NodeNetNS, rerr))
		}
	}()
	watcher, err := WatchCommits(ns)
	if err != nil {
		return res, fmt.Errorf("the floor needs kernel commit notifications: %w", err)
	}
	watchDone := make(chan error, 1)
	go func() { watchDone <- watcher.Run() }()
	defer func() {
		_ = watcher.Close()
		if werr := <-watchDone; werr != nil {
			err = errors.Join(err, werr)
		}
	}()

	logf, err := os.OpenFile(opts.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return res, err
	}
	defer logf.Close()
	cmd := exec.Command("ip", "netns", "exec", ns.Name, opts.Binary, "--kubeconfig="+opts.Kubeconfig, "--namespace="+Namespace)
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return res, err
	}
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("starting the floor program: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-exited
	}()
	ready := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(stdout).ReadString('\n')
		if err == nil && strings.TrimSpace(line) != "ready" {
			err = fmt.Errorf("the floor program said %q", line)
		}
		ready <- err
	}()
	select {
	case err := <-ready:
		if err != nil {
			return res, fmt.Errorf("the floor program did not start: %w (log %s)", err, opts.Log)
		}
	case err := <-exited:
		return res, fmt.Errorf("the floor program exited: %v (log %s)", err, opts.Log)
	case <-time.After(time.Minute):
		return res, fmt.Errorf("the floor program was not ready within a minute (log %s)", opts.Log)
	}

	pid := cmd.Process.Pid // ip netns exec execs in place
	var child []float64
	var switches []float64
	n := opts.Objects.Services()
	for c := range opts.Changes {
		if err := cluster.Sleep(ctx, opts.Settle); err != nil {
			return res, err
		}
		select { // forget earlier commits
		case <-watcher.Notify():
		default:
		}
		u0, err := readUsage(pid)
		if err != nil {
			return res, err
		}
		i, j := (c*7919+17)%n, c%EndpointsPerService
		if err := opts.Objects.ChangeEndpoint(ctx, i, j, time.Now); err != nil {
			return res, err
		}
		select {
		case <-watcher.Notify():
		case err := <-exited:
			return res, fmt.Errorf("the floor program exited: %v (log %s)", err, opts.Log)
		case <-time.After(changeTimeout):
			return res, fmt.Errorf("change %d: no commit within %s", c+1, changeTimeout)
		case <-ctx.Done():
			return res, ctx.Err()
		}
		if err := cluster.Sleep(ctx, settled); err != nil {
			return res, err
		}
		u1, err := readUsage(pid)
		if err != nil {
			return res, err
		}
		res.CPUSamplesMs = append(res.CPUSamplesMs, ms(u1.CPU-u0.CPU))
		child = append(child, ms(u1.ChildCPU-u0.ChildCPU))
		switches = append(switches, float64(u1.Switches-u0.Switches))
	}
	res.CPUP50Ms, res.ChildCPUP50Ms, res.SwitchesP50 = median(res.CPUSamplesMs), median(child), median(switches)
	res.CPUMeanMs, res.ChildCPUMeanMs = round3(mean(res.CPUSamplesMs)), round3(mean(child))
	return res, nil
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// FloorLine reports a floor run beside kproxy's result r of the same size
// (nil: none): the floor's share of a change's CPU with kproxy's nft
// CPU, the least kproxy's share could be.
func FloorLine(f FloorResult, r *Result) string {
	s := fmt.Sprintf("floor, %d Services: own CPU p50 %.2f ms (mean %.2f), its nft's %.2f ms, %.0f switches, over %d changes",
		f.Services, f.CPUP50Ms, f.CPUMeanMs, f.ChildCPUP50Ms, f.SwitchesP50, f.Changes)
	if r != nil && r.ChildCPUP50Ms > 0 {
		s += fmt.Sprintf("; with kproxy's nft (%.2f ms) its share would be %.1f%%, kproxy's is %.1f%% (own CPU p50 %.2f ms)",
			r.ChildCPUP50Ms, 100*f.CPUP50Ms/(f.CPUP50Ms+r.ChildCPUP50Ms), 100*r.ShareP50, r.CPUP50Ms)
	}
	return s
}
