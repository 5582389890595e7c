package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"k8s.io/klog/v2"
)

// Options configures the real implementation returned by New.
type Options struct {
	// Protocol selects the binaries: ProtocolIPv4 uses iptables,
	// iptables-restore and iptables-save; ProtocolIPv6 the ip6tables ones.
	// Empty means IPv4.
	Protocol Protocol
	// NetNS, when set, runs every command inside that named network
	// namespace (`ip netns exec NAME ...`); for tests and tools. Empty means
	// the current namespace.
	NetNS string
	// WaitSeconds is how long a command waits for the xtables lock (-w).
	// Zero means 5.
	WaitSeconds int
}

const defaultWaitSeconds = 5

// Real is the Interface implementation that runs the iptables binaries. It
// holds no mutable state after New, so it is safe for concurrent use.
type Real struct {
	protocol Protocol
	netns    string

	ipPath      string // `ip`, only with netns
	mainPath    string // iptables / ip6tables
	restorePath string
	savePath    string

	version     string // e.g. "1.8.9"
	mode        string // "nft" or "legacy"
	mainWait    []string
	restoreWait []string
	randomFully bool
}

var _ Interface = (*Real)(nil)

// iptablesVersion is a parsed `iptables --version`.
type iptablesVersion struct {
	major, minor, patch int
	// mode is "nft" or "legacy".
	mode string
}

func (v iptablesVersion) String() string {
	return fmt.Sprintf("%d.%d.%d", v.major, v.minor, v.patch)
}

func (v iptablesVersion) atLeast(major, minor, patch int) bool {
	if v.major != major {
		return v.major > major
	}
	if v.minor != minor {
		return v.minor > minor
	}
	return v.patch >= patch
}

var iptablesVersionRE = regexp.MustCompile(`v(\d+)\.(\d+)\.(\d+)(?:\s+\(([^)]*)\))?`)

// parseIptablesVersion parses output such as "iptables v1.8.9 (nf_tables)".
// Versions without a backend suffix predate nf_tables and are legacy.
func parseIptablesVersion(out string) (iptablesVersion, error) {
	m := iptablesVersionRE.FindStringSubmatch(out)
	if m == nil {
		return iptablesVersion{}, fmt.Errorf("no version in %q", strings.TrimSpace(out))
	}
	var v iptablesVersion
	for i, p := range []*int{&v.major, &v.minor, &v.patch} {
		n, err := strconv.Atoi(m[i+1])
		if err != nil {
			return iptablesVersion{}, fmt.Errorf("bad version number in %q: %w", strings.TrimSpace(out), err)
		}
		*p = n
	}
	switch m[4] {
	case "nf_tables":
		v.mode = "nft"
	case "", "legacy":
		v.mode = "legacy"
	default:
		return iptablesVersion{}, fmt.Errorf("unknown iptables backend %q in %q", m[4], strings.TrimSpace(out))
	}
	return v, nil
}

// New finds the binaries for opts.Protocol, probes their version and returns
// an Interface that runs them (inside opts.NetNS when set).
func New(ctx context.Context, opts Options) (Interface, error) {
	r := &Real{protocol: opts.Protocol, netns: opts.NetNS}
	if r.protocol == "" {
		r.protocol = ProtocolIPv4
	}
	var base string
	switch r.protocol {
	case ProtocolIPv4:
		base = "iptables"
	case ProtocolIPv6:
		base = "ip6tables"
	default:
		return nil, fmt.Errorf("unknown iptables protocol %q", opts.Protocol)
	}
	wait := opts.WaitSeconds
	if wait <= 0 {
		wait = defaultWaitSeconds
	}

	for _, b := range []struct {
		dst  *string
		name string
		skip bool
	}{
		{&r.ipPath, "ip", r.netns == ""},
		{&r.mainPath, base, false},
		{&r.restorePath, base + "-restore", false},
		{&r.savePath, base + "-save", false},
	} {
		if b.skip {
			continue
		}
		p, err := exec.LookPath(b.name)
		if err != nil {
			return nil, fmt.Errorf("%s is required but was not found: %w", b.name, err)
		}
		*b.dst = p
	}

	out, err := r.run(ctx, nil, r.mainPath, "--version")
	if err != nil {
		return nil, fmt.Errorf("probing %s version: %w", base, err)
	}
	v, err := parseIptablesVersion(string(out))
	if err != nil {
		return nil, fmt.Errorf("probing %s version: %w", base, err)
	}
	r.version = v.String()
	r.mode = v.mode
	// -w with a timeout in seconds exists since 1.4.22 for iptables and since
	// 1.6.2 for iptables-restore; --random-fully since 1.6.2.
	ws := strconv.Itoa(wait)
	switch {
	case v.atLeast(1, 4, 22):
		r.mainWait = []string{"-w", ws}
	case v.atLeast(1, 4, 20):
		r.mainWait = []string{"-w"}
	}
	if v.atLeast(1, 6, 2) {
		r.restoreWait = []string{"-w", ws}
		r.randomFully = true
	}
	klog.FromContext(ctx).V(2).Info("Found iptables", "protocol", r.protocol, "version", r.version, "mode", r.mode, "netns", r.netns)
	return r, nil
}

// Version is the iptables version, e.g. "1.8.9".
func (r *Real) Version() string { return r.version }

// Mode is the iptables backend: "nft" or "legacy".
func (r *Real) Mode() string { return r.mode }

// Protocol implements Interface.
func (r *Real) Protocol() Protocol { return r.protocol }

// HasRandomFully implements Interface.
func (r *Real) HasRandomFully() bool { return r.randomFully }

// EnsureChain implements Interface.
func (r *Real) EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error) {
	err := r.iptables(ctx, table, "-N", string(chain))
	if err == nil {
		return false, nil
	}
	if execExitCode(err) == 1 && execStderrContains(err, "already exists") {
		return true, nil
	}
	return false, fmt.Errorf("creating chain %s in table %s: %w", chain, table, err)
}

// ChainExists implements Interface.
func (r *Real) ChainExists(ctx context.Context, table Table, chain Chain) (bool, error) {
	// Listing only the first rule keeps this cheap for long chains; a chain
	// without rules still succeeds.
	err := r.iptables(ctx, table, "-S", string(chain), "1")
	switch {
	case err == nil:
		return true, nil
	case execExitCode(err) == 1:
		return false, nil
	default:
		return false, fmt.Errorf("checking chain %s in table %s: %w", chain, table, err)
	}
}

// ListChains implements Interface.
func (r *Real) ListChains(ctx context.Context, table Table) ([]string, error) {
	out, err := r.SaveInto(ctx, table)
	if err != nil {
		return nil, err
	}
	var chains []string
	for line := range strings.Lines(string(out)) {
		if name, ok := strings.CutPrefix(line, ":"); ok {
			if f := strings.Fields(name); len(f) > 0 {
				chains = append(chains, f[0])
			}
		}
	}
	return chains, nil
}

// EnsureRule implements Interface.
func (r *Real) EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error) {
	if position != Prepend && position != Append {
		return false, fmt.Errorf("unknown rule position %q", position)
	}
	err := r.iptables(ctx, table, append([]string{"-C", string(chain)}, args...)...)
	switch {
	case err == nil:
		return true, nil
	case execExitCode(err) != 1:
		return false, fmt.Errorf("checking rule in %s/%s: %w", table, chain, err)
	}
	if err := r.iptables(ctx, table, append([]string{string(position), string(chain)}, args...)...); err != nil {
		return false, fmt.Errorf("adding rule to %s/%s: %w", table, chain, err)
	}
	return false, nil
}

// DeleteRule implements Interface. A rule is also absent when its chain or
// its jump target does not exist.
func (r *Real) DeleteRule(ctx context.Context, table Table, chain Chain, args ...string) error {
	err := r.iptables(ctx, table, append([]string{"-D", string(chain)}, args...)...)
	if err == nil || isNotExistError(err) {
		return nil
	}
	return fmt.Errorf("deleting rule from %s/%s: %w", table, chain, err)
}

// FlushChain implements Interface.
func (r *Real) FlushChain(ctx context.Context, table Table, chain Chain) error {
	err := r.iptables(ctx, table, "-F", string(chain))
	if err == nil || isNotExistError(err) {
		return nil
	}
	return fmt.Errorf("flushing chain %s in table %s: %w", chain, table, err)
}

// DeleteChain implements Interface.
func (r *Real) DeleteChain(ctx context.Context, table Table, chain Chain) error {
	err := r.iptables(ctx, table, "-X", string(chain))
	if err == nil || isNotExistError(err) {
		return nil
	}
	return fmt.Errorf("deleting chain %s in table %s: %w", chain, table, err)
}

// Restore implements Interface. On failure the error carries
// iptables-restore's message and, when it names a line, that input line.
func (r *Real) Restore(ctx context.Context, data []byte) error {
	args := append(append([]string{}, r.restoreWait...), "--noflush", "--counters")
	_, err := r.run(ctx, data, r.restorePath, args...)
	if err == nil {
		return nil
	}
	msg := fmt.Sprintf("%s failed", filepath.Base(r.restorePath))
	if n, ok := restoreErrorLine(execStderr(err)); ok {
		if line, ok := restoreInputLine(data, n); ok {
			msg += fmt.Sprintf(" at input line %d %q", n, line)
		}
	}
	return fmt.Errorf("%s: %w", msg, err)
}

// SaveInto implements Interface.
func (r *Real) SaveInto(ctx context.Context, table Table) ([]byte, error) {
	out, err := r.run(ctx, nil, r.savePath, "-t", string(table))
	if err != nil {
		return nil, fmt.Errorf("saving table %s: %w", table, err)
	}
	return out, nil
}

// iptables runs the main binary with the wait flag against table.
func (r *Real) iptables(ctx context.Context, table Table, args ...string) error {
	full := make([]string, 0, len(r.mainWait)+2+len(args))
	full = append(full, r.mainWait...)
	full = append(full, "-t", string(table))
	full = append(full, args...)
	_, err := r.run(ctx, nil, r.mainPath, full...)
	return err
}

// run executes bin (inside the namespace when one is set), feeding stdin,
// and returns stdout. Failures are *execError.
func (r *Real) run(ctx context.Context, stdin []byte, bin string, args ...string) ([]byte, error) {
	argv := append([]string{bin}, args...)
	if r.netns != "" {
		argv = append([]string{r.ipPath, "netns", "exec", r.netns}, argv...)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	start := time.Now()
	err := cmd.Run()
	logger := klog.FromContext(ctx)
	if logger.V(4).Enabled() {
		kv := []any{"command", strings.Join(argv, " "), "duration", time.Since(start)}
		if stdin != nil {
			kv = append(kv, "inputBytes", len(stdin))
		}
		if err != nil {
			kv = append(kv, "err", err, "stderr", strings.TrimSpace(stderr.String()))
		}
		logger.V(4).Info("Ran iptables command", kv...)
	}
	if err != nil {
		return stdout.Bytes(), &execError{args: argv, stderr: stderr.String(), err: err}
	}
	return stdout.Bytes(), nil
}

// execError is a failed command with its stderr.
type execError struct {
	args   []string
	stderr string
	err    error
}

func (e *execError) Error() string {
	var lines []string
	for l := range strings.Lines(e.stderr) {
		l = strings.TrimSpace(l)
		// Drop empty lines and the generic usage hint.
		if l == "" || strings.HasPrefix(l, "Try `") {
			continue
		}
		lines = append(lines, l)
	}
	s := fmt.Sprintf("%s: %v", strings.Join(e.args, " "), e.err)
	if len(lines) > 0 {
		s += ": " + strings.Join(lines, "; ")
	}
	return s
}

func (e *execError) Unwrap() error { return e.err }

// exitCode is the exit status of a failed command, or -1 when it did not run
// to an exit.
func execExitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

func execStderr(err error) string {
	var ce *execError
	if errors.As(err, &ce) {
		return ce.stderr
	}
	return ""
}

func execStderrContains(err error, s string) bool {
	return strings.Contains(execStderr(err), s)
}

// notExistStderr are what iptables (legacy and nft) prints when the rule,
// the chain or a jump target does not exist.
var notExistStderr = []string{
	"Bad rule (does a matching rule exist in that chain?)",
	"No chain/target/match by that name",
	"does not exist",       // nft: "Chain 'X' does not exist"
	"Couldn't load target", // legacy: jump to a missing chain
}

// isNotExist reports whether err is iptables saying the object is absent.
// Exit status 1 is a failed operation, 2 a parameter problem (a missing jump
// target); other statuses (3: missing table, 4: resources) are real errors.
func isNotExistError(err error) bool {
	if c := execExitCode(err); c != 1 && c != 2 {
		return false
	}
	stderr := execStderr(err)
	for _, m := range notExistStderr {
		if strings.Contains(stderr, m) {
			return true
		}
	}
	return false
}

// restoreLineRE matches the ways iptables-restore names an input line:
// "Error occurred at line: 3", "line 5 failed", "COMMIT expected at line 4".
var restoreLineRE = regexp.MustCompile(`\bline:? (\d+)\b`)

// restoreErrorLine extracts the 1-based input line iptables-restore blamed.
func restoreErrorLine(stderr string) (int, bool) {
	m := restoreLineRE.FindStringSubmatch(stderr)
	if m == nil {
		return 0, false
	}
	n, err := strconv.Atoi(m[1])
	if err != nil || n < 1 {
		return 0, false
	}
	return n, true
}

// inputLine returns the 1-based line n of data.
func restoreInputLine(data []byte, n int) (string, bool) {
	i := 0
	for line := range bytes.Lines(data) {
		i++
		if i == n {
			return strings.TrimRight(string(line), "\r\n"), true
		}
	}
	return "", false
}
