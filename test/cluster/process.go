package cluster

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

// process is one program the local cluster started, as the pids file
// records it. StartTime (clock ticks after boot, /proc/<pid>/stat field 22)
// tells the process apart from a later one that reuses its pid; 0 means
// unknown.
type process struct {
	Name      string
	PID       int
	StartTime uint64
}

// formatPids renders the pids file: one "<name> <pid> <start time>" line
// per process.
func formatPids(procs []process) []byte {
	var buf bytes.Buffer
	for _, p := range procs {
		fmt.Fprintf(&buf, "%s %d %d\n", p.Name, p.PID, p.StartTime)
	}
	return buf.Bytes()
}

// parsePids parses what formatPids renders.
func parsePids(data []byte) ([]process, error) {
	var out []process
	sc := bufio.NewScanner(bytes.NewReader(data))
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" {
			continue
		}
		f := strings.Fields(text)
		if len(f) != 3 {
			return nil, fmt.Errorf("line %d: want \"<name> <pid> <start time>\", got %q", line, text)
		}
		pid, err := strconv.Atoi(f[1])
		if err != nil || pid <= 1 {
			return nil, fmt.Errorf("line %d: bad pid %q", line, f[1])
		}
		start, err := strconv.ParseUint(f[2], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("line %d: bad start time %q", line, f[2])
		}
		out = append(out, process{Name: f[0], PID: pid, StartTime: start})
	}
	return out, sc.Err()
}

// procStat returns a process's state letter and start time from
// /proc/<pid>/stat.
func procStat(pid int) (state byte, start uint64, err error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	return parseProcStat(data)
}

// parseProcStat parses /proc/<pid>/stat: the command name (field 2) may
// hold spaces and parentheses, so fields are counted after its last ')'.
func parseProcStat(data []byte) (state byte, start uint64, err error) {
	i := bytes.LastIndexByte(data, ')')
	if i < 0 {
		return 0, 0, errors.New("malformed stat: no ')'")
	}
	f := strings.Fields(string(data[i+1:]))
	// f[0] is field 3 (state); field 22 (starttime) is f[19].
	if len(f) < 20 {
		return 0, 0, fmt.Errorf("malformed stat: %d fields after the name", len(f))
	}
	start, err = strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("malformed stat start time %q: %w", f[19], err)
	}
	return f[0][0], start, nil
}

// alive reports whether p still runs (a zombie does not).
func (p process) alive() bool {
	state, start, err := procStat(p.PID)
	if err != nil || state == 'Z' || state == 'X' {
		return false
	}
	return p.StartTime == 0 || start == p.StartTime
}

// launch is how to start one process.
type launch struct {
	Name string
	// NetNS is the network namespace to run in.
	NetNS string
	// NetOnly enters only the network namespace (nsenter) and keeps the
	// host's mount namespace, so network namespaces the process names
	// (`ip netns add`) are seen by everyone. Otherwise `ip netns exec`
	// also gives the process the namespace's own /sys, like a real node.
	NetOnly bool
	Argv    []string
	Log     string
	// Env is added to the caller's environment (later entries win).
	Env []string
}

// command returns the argv that runs l.Argv inside l.NetNS. Both forms
// exec the program in place, so the pid started is the program's.
func (l launch) command() []string {
	if l.NetOnly {
		return append([]string{"nsenter", "--net=" + filepath.Join(netnsDir, l.NetNS), "--"}, l.Argv...)
	}
	return append([]string{"ip", "netns", "exec", l.NetNS}, l.Argv...)
}

// start starts l in a session (and process group) of its own, its output
// appended to l.Log, and returns it for the pids file. The process outlives
// the caller; a goroutine reaps it if it exits first.
func start(ctx context.Context, l launch) (process, error) {
	logger := klog.FromContext(ctx)
	logf, err := os.OpenFile(l.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return process{}, fmt.Errorf("opening the log of %s: %w", l.Name, err)
	}
	defer logf.Close()
	fmt.Fprintf(logf, "=== kpc: %s starting at %s: %s\n", l.Name, time.Now().Format(time.RFC3339), strings.Join(l.command(), " "))
	argv := l.command()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	if len(l.Env) > 0 {
		cmd.Env = append(os.Environ(), l.Env...)
		fmt.Fprintf(logf, "=== kpc: %s environment adds: %s\n", l.Name, strings.Join(l.Env, " "))
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return process{}, fmt.Errorf("starting %s: %w", l.Name, err)
	}
	p := process{Name: l.Name, PID: cmd.Process.Pid}
	if _, st, err := procStat(p.PID); err == nil {
		p.StartTime = st
	}
	go func() { _ = cmd.Wait() }()
	logger.V(2).Info("Started", "name", l.Name, "pid", p.PID, "netns", l.NetNS, "log", l.Log)
	return p, nil
}

// stop ends procs: SIGTERM to each one's process group (each is a session
// leader), SIGKILL to what still runs after grace. Processes that are gone
// or whose pid now belongs to another program are skipped.
func stop(ctx context.Context, procs []process, grace time.Duration) error {
	return terminate(ctx, procs, grace, true)
}

// terminate signals procs (their groups when group is set) and waits.
func terminate(ctx context.Context, procs []process, grace time.Duration, group bool) error {
	logger := klog.FromContext(ctx)
	signal := func(p process, sig syscall.Signal) {
		target := p.PID
		if group {
			target = -p.PID
		}
		if err := syscall.Kill(target, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
			logger.Info("Signal failed", "name", p.Name, "pid", p.PID, "signal", sig, "err", err)
		}
	}
	var live []process
	for _, p := range procs {
		if p.PID > 1 && p.PID != os.Getpid() && p.alive() {
			live = append(live, p)
			signal(p, syscall.SIGTERM)
		}
	}
	if len(live) == 0 {
		return nil
	}
	if waitGone(ctx, live, grace) {
		return nil
	}
	for _, p := range live {
		if p.alive() {
			logger.Info("Killing", "name", p.Name, "pid", p.PID)
			signal(p, syscall.SIGKILL)
		}
	}
	if waitGone(ctx, live, 5*time.Second) {
		return nil
	}
	var still []string
	for _, p := range live {
		if p.alive() {
			still = append(still, fmt.Sprintf("%s (pid %d)", p.Name, p.PID))
		}
	}
	return fmt.Errorf("still running after SIGKILL: %s", strings.Join(still, ", "))
}

// waitGone polls until none of procs is alive, up to limit.
func waitGone(ctx context.Context, procs []process, limit time.Duration) bool {
	deadline := time.Now().Add(limit)
	for {
		gone := true
		for _, p := range procs {
			if p.alive() {
				gone = false
				break
			}
		}
		if gone {
			return true
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// processesInNetNS returns every process with a thread inside one of the
// named network namespaces (the caller excluded).
func processesInNetNS(names []string) ([]process, error) {
	inodes := map[uint64]string{}
	for _, n := range names {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(netnsDir, n), &st); err != nil {
			continue
		}
		inodes[st.Ino] = n
	}
	if len(inodes) == 0 {
		return nil, nil
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("listing /proc: %w", err)
	}
	var out []process
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		ns, ok := threadNetNS(pid, inodes)
		if !ok {
			continue
		}
		state, start, err := procStat(pid)
		if err != nil || state == 'Z' || state == 'X' {
			continue
		}
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		out = append(out, process{Name: ns + ":" + strings.TrimSpace(string(comm)), PID: pid, StartTime: start})
	}
	return out, nil
}

// threadNetNS reports the first of inodes that a thread of pid is in.
func threadNetNS(pid int, inodes map[uint64]string) (string, bool) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return "", false
	}
	for _, t := range tasks {
		link, err := os.Readlink(fmt.Sprintf("/proc/%d/task/%s/ns/net", pid, t.Name()))
		if err != nil {
			continue
		}
		ino, ok := parseNSLink(link)
		if !ok {
			continue
		}
		if ns, ok := inodes[ino]; ok {
			return ns, true
		}
	}
	return "", false
}

// parseNSLink parses a /proc/<pid>/ns/net link target, "net:[<inode>]".
func parseNSLink(link string) (uint64, bool) {
	rest, ok := strings.CutPrefix(link, "net:[")
	if !ok {
		return 0, false
	}
	rest, ok = strings.CutSuffix(rest, "]")
	if !ok {
		return 0, false
	}
	ino, err := strconv.ParseUint(rest, 10, 64)
	return ino, err == nil
}

// TailFile returns up to n last lines of a file, for error messages.
func TailFile(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
