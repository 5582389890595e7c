package procbench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/test/cluster"
)

// KproxyOptions say how to run kproxy.
type KproxyOptions struct {
	// Binary is the kproxy program.
	Binary string
	// NetNS is the network namespace it runs in (`ip netns exec`, which
	// execs it in place: the pid started is kproxy's).
	NetNS *netnstest.NS
	// Kubeconfig, Node and Mode are --kubeconfig, --hostname-override and
	// --proxy-mode.
	Kubeconfig, Node, Mode string
	// MetricsAddress is --metrics-bind-address, inside NetNS.
	MetricsAddress string
	// Log receives kproxy's output.
	Log string
	// ProfileDir, when set, runs kproxy with --profiling; Run saves heap
	// profiles there (SaveHeapProfile).
	ProfileDir string
}

// healthzAddress is kproxy's --healthz-bind-address, inside its namespace.
const healthzAddress = "127.0.0.1:10256"

// args are kproxy's flags: as a DaemonSet runs it, with the metrics and
// health servers on the namespace's loopback.
func (o KproxyOptions) args() []string {
	args := []string{
		"--kubeconfig=" + o.Kubeconfig,
		"--hostname-override=" + o.Node,
		"--proxy-mode=" + o.Mode,
		"--cluster-cidr=" + ClusterCIDR,
		"--metrics-bind-address=" + o.MetricsAddress,
		"--healthz-bind-address=" + healthzAddress,
		"-v=1",
	}
	if o.ProfileDir != "" {
		args = append(args, "--profiling")
	}
	return args
}

// CheckMode runs kproxy's own validation of opts' flags (--write-config-to,
// which validates and exits): an error when kproxy rejects them, e.g. a
// proxy mode this build does not have.
func CheckMode(ctx context.Context, opts KproxyOptions) error {
	tmp, err := os.CreateTemp("", "procbench-config-*.yaml")
	if err != nil {
		return err
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	cmd := exec.CommandContext(ctx, opts.Binary, append(opts.args(), "--write-config-to="+tmp.Name())...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, firstLines(string(out), 3))
	}
	return nil
}

// Kproxy is a running kproxy process.
type Kproxy struct {
	opts    KproxyOptions
	cmd     *exec.Cmd
	Started time.Time
	done    chan struct{}
	waitErr error
	client  *http.Client
}

// StartKproxy starts kproxy in its own session, its output appended to
// opts.Log. Stop ends it.
func StartKproxy(opts KproxyOptions) (*Kproxy, error) {
	logf, err := os.OpenFile(opts.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("opening kproxy's log: %w", err)
	}
	defer logf.Close()
	argv := append([]string{"ip", "netns", "exec", opts.NetNS.Name, opts.Binary}, opts.args()...)
	fmt.Fprintf(logf, "=== procbench: starting at %s: %s\n", time.Now().Format(time.RFC3339Nano), strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	k := &Kproxy{opts: opts, cmd: cmd, done: make(chan struct{})}
	k.client = &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return opts.NetNS.Dial(ctx, network, addr)
			},
			MaxIdleConnsPerHost: 1,
		},
	}
	k.Started = time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting kproxy: %w", err)
	}
	go func() {
		k.waitErr = cmd.Wait()
		close(k.done)
	}()
	return k, nil
}

// PID is kproxy's pid.
func (k *Kproxy) PID() int { return k.cmd.Process.Pid }

// Exited reports whether kproxy has exited, and how.
func (k *Kproxy) Exited() (bool, error) {
	select {
	case <-k.done:
		return true, k.waitErr
	default:
		return false, nil
	}
}

// Stop sends SIGTERM to kproxy's session, then SIGKILL after grace, and
// waits for it.
func (k *Kproxy) Stop(grace time.Duration) error {
	k.client.CloseIdleConnections()
	if exited, _ := k.Exited(); exited {
		return nil
	}
	pgid := k.cmd.Process.Pid
	if err := syscall.Kill(-pgid, syscall.SIGTERM); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("stopping kproxy: %w", err)
	}
	select {
	case <-k.done:
		return nil
	case <-time.After(grace):
	}
	if err := syscall.Kill(-pgid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("killing kproxy: %w", err)
	}
	select {
	case <-k.done:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("kproxy (pid %d) still runs after SIGKILL", pgid)
	}
}

// Scrape reads kproxy's /metrics.
func (k *Kproxy) Scrape(ctx context.Context) (Samples, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+k.opts.MetricsAddress+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := k.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: HTTP %d: %s", resp.StatusCode, firstLines(string(body), 2))
	}
	return ParseSamples(string(body))
}

// LastSync reads from /healthz when kproxy's last successful IPv4 sync
// ended (zero before the first). The answer is a few hundred bytes of
// JSON, where /metrics renders every metric (about 2 ms of kproxy's CPU,
// and garbage that brings its collections forward into later changes):
// the benchmark polls this while a change is synced, as a user's probes
// would, and reads /metrics only where it needs kproxy's counters.
func (k *Kproxy) LastSync(ctx context.Context) (time.Time, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+healthzAddress+"/healthz", nil)
	if err != nil {
		return time.Time{}, err
	}
	resp, err := k.client.Do(req)
	if err != nil {
		return time.Time{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return time.Time{}, err
	}
	// 503 while a queued change waits or before the first sync: the
	// body is the same document.
	return parseHealthzLastSync(body)
}

// parseHealthzLastSync reads the IPv4 family's lastUpdated from a /healthz
// body.
func parseHealthzLastSync(body []byte) (time.Time, error) {
	var h struct {
		Status map[string]struct {
			LastUpdated time.Time `json:"lastUpdated"`
		} `json:"status"`
	}
	if err := json.Unmarshal(body, &h); err != nil {
		return time.Time{}, fmt.Errorf("/healthz: %w: %s", err, firstLines(string(body), 2))
	}
	return h.Status["IPv4"].LastUpdated, nil
}

// SaveHeapProfile writes kproxy's heap profile (/debug/pprof/heap) to
// ProfileDir/name; nothing without a ProfileDir.
func (k *Kproxy) SaveHeapProfile(ctx context.Context, name string) error {
	return k.saveProfile(ctx, "heap", name)
}

// SaveCPUProfile writes a CPU profile of kproxy over the next d
// (/debug/pprof/profile) to ProfileDir/name; nothing without a ProfileDir.
func (k *Kproxy) SaveCPUProfile(ctx context.Context, name string, d time.Duration) error {
	return k.saveProfile(ctx, fmt.Sprintf("profile?seconds=%d", int(d.Seconds())), name)
}

// saveProfile writes /debug/pprof/<what> to ProfileDir/name.
func (k *Kproxy) saveProfile(ctx context.Context, what, name string) error {
	if k.opts.ProfileDir == "" {
		return nil
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+k.opts.MetricsAddress+"/debug/pprof/"+what, nil)
	if err != nil {
		return err
	}
	// A CPU profile answers after its duration, past the client's timeout.
	client := *k.client
	client.Timeout = 0
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("%s profile: %w", what, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("%s profile: %w", what, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s profile: HTTP %d: %s", what, resp.StatusCode, firstLines(string(body), 2))
	}
	if err := os.MkdirAll(k.opts.ProfileDir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(k.opts.ProfileDir, name), body, 0o644)
}

// SyncState scrapes kproxy's IPv4 sync state.
func (k *Kproxy) SyncState(ctx context.Context) (syncState, error) {
	s, err := k.Scrape(ctx)
	if err != nil {
		return syncState{}, err
	}
	return syncStateOf(s), nil
}

// Usage reads kproxy's resource use.
func (k *Kproxy) Usage() (Usage, error) { return readUsage(k.PID()) }

// LogTail is the end of kproxy's log, for errors.
func (k *Kproxy) LogTail(lines int) string { return cluster.TailFile(k.opts.Log, lines) }

// firstLines returns up to n first non-empty lines of s, joined by " | ".
func firstLines(s string, n int) string {
	var out []string
	for _, l := range strings.Split(string(bytes.TrimSpace([]byte(s))), "\n") {
		if l = strings.TrimSpace(l); l != "" && len(out) < n {
			out = append(out, l)
		}
	}
	return strings.Join(out, " | ")
}
