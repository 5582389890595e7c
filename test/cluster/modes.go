package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// kproxy's proxy modes (--proxy-mode).
const (
	ModeIPTables = "iptables"
	ModeNFTables = "nftables"
	ModeIPVS     = "ipvs"
)

// KnownModes lists every proxy mode kproxy has: the names kpc and the e2e
// suite accept. Whether a given kproxy binary and host can run one is
// ProbeMode's question.
func KnownModes() []string { return []string{ModeIPTables, ModeNFTables, ModeIPVS} }

// ValidateMode rejects a name that is not one of KnownModes.
func ValidateMode(mode string) error {
	if slices.Contains(KnownModes(), mode) {
		return nil
	}
	return fmt.Errorf("%q is not a kproxy proxy mode; use one of %s", mode, strings.Join(KnownModes(), ", "))
}

// Why ProbeMode finds that a mode cannot run here. Any other ProbeMode
// error means the probe itself, or the kproxy binary, is broken.
var (
	// ErrModeUnknownToKproxy: the kproxy binary rejects the mode's name, as
	// a kproxy built before the mode existed does.
	ErrModeUnknownToKproxy = errors.New("the kproxy binary does not know this proxy mode")
	// ErrHostLacksMode: the host lacks a program or kernel feature the
	// mode needs.
	ErrHostLacksMode = errors.New("this host cannot run this proxy mode")
)

// unknownModeText is how kproxy's flag validation rejects a --proxy-mode it
// does not know; a binary built before a mode existed says exactly this.
const unknownModeText = "is not a proxy mode"

// probeTimeout bounds each command of ProbeMode.
const probeTimeout = 30 * time.Second

// ProbeMode checks, without starting an agent, that kproxy in binDir and
// this host can run mode: kproxy validates --proxy-mode=mode (it writes its
// effective configuration to a scratch file and exits), and the host has
// what the mode needs (iptables-restore; nft and the kernel's nf_tables;
// the kernel's IPVS). It returns nil, or an error wrapping
// ErrModeUnknownToKproxy or ErrHostLacksMode, or another error when kproxy
// fails in some other way.
func ProbeMode(ctx context.Context, binDir, mode string) error {
	if err := ValidateMode(mode); err != nil {
		return err
	}
	if err := probeKproxyMode(ctx, filepath.Join(binDir, progKproxy), mode); err != nil {
		return err
	}
	return probeHost(ctx, mode)
}

// probeKproxyMode runs kproxy --proxy-mode=mode --write-config-to, and on
// failure tells a rejected mode name (the same command with iptables works)
// from a broken binary.
func probeKproxyMode(ctx context.Context, kproxy, mode string) error {
	dir, err := os.MkdirTemp("", "kpc-mode-probe-")
	if err != nil {
		return fmt.Errorf("probing --proxy-mode=%s: %w", mode, err)
	}
	defer os.RemoveAll(dir)
	run := func(m string) ([]byte, error) {
		ctx, cancel := context.WithTimeout(ctx, probeTimeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, kproxy, "--proxy-mode="+m, "--write-config-to="+filepath.Join(dir, m+".yaml"))
		return cmd.CombinedOutput()
	}
	out, err := run(mode)
	if err == nil {
		return nil
	}
	baselineOK := false
	if mode != ModeIPTables && bytes.Contains(out, []byte(unknownModeText)) {
		_, berr := run(ModeIPTables)
		baselineOK = berr == nil
	}
	return classifyModeProbe(kproxy, mode, out, err, baselineOK)
}

// classifyModeProbe turns a failed kproxy probe into an error: one wrapping
// ErrModeUnknownToKproxy when kproxy rejected the mode's name and accepts
// iptables (baselineOK), a plain one otherwise.
func classifyModeProbe(kproxy, mode string, out []byte, err error, baselineOK bool) error {
	msg := strings.TrimSpace(string(out))
	if baselineOK && strings.Contains(msg, unknownModeText) {
		return fmt.Errorf("%w: %s rejects --proxy-mode=%s (built before that mode? rebuild with hack/build-control-plane.sh): %s",
			ErrModeUnknownToKproxy, kproxy, mode, firstLines(msg, 3))
	}
	return fmt.Errorf("%s --proxy-mode=%s --write-config-to failed: %v: %s", kproxy, mode, err, firstLines(msg, 10))
}

// probeHost checks that the host has what mode needs, the way kproxy
// itself would find it.
func probeHost(ctx context.Context, mode string) error {
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	switch mode {
	case ModeIPTables:
		for _, p := range []string{"iptables", "iptables-save", "iptables-restore"} {
			if _, err := exec.LookPath(p); err != nil {
				return fmt.Errorf("%w: iptables mode needs %s: %v", ErrHostLacksMode, p, err)
			}
		}
	case ModeNFTables:
		if _, err := exec.LookPath("nft"); err != nil {
			return fmt.Errorf("%w: nftables mode needs the nft program (Debian package nftables): %v", ErrHostLacksMode, err)
		}
		// A transaction checked, never committed: the kernel must know
		// nf_tables; nothing changes.
		if out, err := exec.CommandContext(ctx, "nft", "--check", "add", "table", "ip", "kpc-probe").CombinedOutput(); err != nil {
			return fmt.Errorf("%w: nftables mode needs the kernel's nf_tables: nft --check add table: %v: %s",
				ErrHostLacksMode, err, strings.TrimSpace(string(out)))
		}
	case ModeIPVS:
		if !ipvsLoaded() {
			// As kproxy does: load it when modprobe can.
			_ = exec.CommandContext(ctx, "modprobe", "ip_vs").Run()
		}
		if !ipvsLoaded() {
			return fmt.Errorf("%w: ipvs mode needs the kernel's IPVS (module ip_vs): /proc/net/ip_vs is missing", ErrHostLacksMode)
		}
	}
	return nil
}

func ipvsLoaded() bool {
	_, err := os.Stat("/proc/net/ip_vs")
	return err == nil
}

// firstLines returns the first n lines of s on one line, "; " apart (the
// e2e suite prints probe errors a line each).
func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	if len(lines) > n {
		lines = append(lines[:n], "...")
	}
	for i := range lines {
		lines[i] = strings.TrimSpace(lines[i])
	}
	return strings.Join(lines, "; ")
}

// SetMode switches kproxy on every node to mode: it stops every node's
// kproxy, records the mode, starts kproxy --proxy-mode=mode on each node
// (with the extra flags each last started with) and waits until each logs
// its start in that mode and a sync. It does not run --cleanup: kproxy
// removes the other modes' rules itself when it starts. It fails, quoting
// the log, when a new kproxy exits or does not sync in time.
func (c *Cluster) SetMode(ctx context.Context, mode string) error {
	if err := ValidateMode(mode); err != nil {
		return err
	}
	nodes := c.NodeNames()
	for _, node := range nodes {
		// StopKproxy first reads the pids file anew: whoever started
		// the kproxy running now, it is the one stopped.
		if err := c.StopKproxy(ctx, node); err != nil {
			return err
		}
	}
	c.mu.Lock()
	err := c.refreshLocked()
	if err == nil {
		c.st.Mode = mode
		err = c.saveStateLocked()
	}
	c.mu.Unlock()
	if err != nil {
		return err
	}
	offsets := map[string]int64{}
	for _, node := range nodes {
		offsets[node] = fileSize(c.KproxyLog(node))
		c.mu.Lock()
		extra := slices.Clone(c.st.NodeKproxyArgs[node])
		c.mu.Unlock()
		if err := c.StartKproxy(ctx, node, extra...); err != nil {
			return err
		}
	}
	return c.waitKproxies(ctx, offsets)
}

// waitKproxies waits until kproxy on each node of offsets has logged, past
// its offset in the log, its start in the cluster's mode and then a sync.
func (c *Cluster) waitKproxies(ctx context.Context, offsets map[string]int64) error {
	mode := c.Mode()
	deadline := time.Now().Add(agentTimeout)
	pending := slices.Sorted(maps.Keys(offsets))
	for len(pending) > 0 {
		node := pending[0]
		log := c.KproxyLog(node)
		data, err := os.ReadFile(log)
		if err != nil {
			return fmt.Errorf("reading the kproxy log of %s: %w", node, err)
		}
		synced, err := kproxyStartedAndSynced(data, offsets[node], mode)
		if err != nil {
			return fmt.Errorf("kproxy on %s: %w; its log %s ends:\n%s", node, err, log, TailFile(log, 15))
		}
		if synced {
			pending = pending[1:]
			continue
		}
		if err := c.exited(progKproxy + "/" + node); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kproxy on %s did not log a start in mode %s and a sync within %s; its log %s ends:\n%s",
				node, mode, agentTimeout, log, TailFile(log, 15))
		}
		if err := Sleep(ctx, 200*time.Millisecond); err != nil {
			return fmt.Errorf("waiting for kproxy on %s: %w", node, err)
		}
	}
	return nil
}

// kproxyStartedAndSynced reads a kproxy log from offset (from the start
// when the log is shorter): true once it shows "Starting kproxy" and then
// "Synced" (at -v=2, which the cluster passes); an error when the start
// names another mode than mode.
func kproxyStartedAndSynced(data []byte, offset int64, mode string) (bool, error) {
	if int64(len(data)) < offset {
		offset = 0
	}
	text := string(data[offset:])
	i := strings.Index(text, `"Starting kproxy"`)
	if i < 0 {
		return false, nil
	}
	line, _, _ := strings.Cut(text[i:], "\n")
	if !strings.Contains(line, ` mode="`+mode+`"`) {
		return false, fmt.Errorf("started in another mode than %s: %s", mode, line)
	}
	return strings.Contains(text[i:], `"Synced"`), nil
}

// fileSize is the size of path, 0 when it does not exist.
func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}
