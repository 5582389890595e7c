package iptables

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/deadline"
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
	// WaitSeconds is how long a command waits for the xtables lock (-w),
	// which iptables-legacy takes for every change: another program holding
	// it longer makes the command fail (ErrLocked), and the sync be
	// retried, instead of queueing behind it. Zero means 5 (kube-proxy's
	// wait). iptables-nft takes no lock and ignores it.
	WaitSeconds int
	// Timeout bounds each single iptables command (a chain or rule
	// operation, the version probe); zero means DefaultTimeout.
	Timeout time.Duration
	// RestoreTimeout bounds each iptables-restore and iptables-save run;
	// zero means DefaultRestoreTimeout.
	RestoreTimeout time.Duration
	// Variant selects the binaries: empty runs iptables, iptables-restore
	// and iptables-save (whichever backend the system chose); "nft" and
	// "legacy" run iptables-nft... and iptables-legacy... (for tests and
	// tools that need one backend).
	Variant string
}

const (
	defaultWaitSeconds = 5
	// DefaultTimeout bounds a single iptables command: the xtables lock
	// wait (5 s by default) plus the command itself, which with
	// iptables-legacy reads and writes back the whole table, megabytes
	// at 10,000 services. Six times the lock wait leaves room for a
	// loaded node; a command slower than that is hung, not busy.
	DefaultTimeout = 30 * time.Second
	// DefaultRestoreTimeout bounds an iptables-restore or iptables-save
	// run. The largest, a full restore at 10,000 services (tens of
	// megabytes), takes seconds (a whole first sync of kproxy at 10,000
	// services, informers included, measured 9.1 s), so a minute leaves
	// a wide margin for a loaded node; a longer limit would only delay
	// noticing a hang past the health check's tolerance (2 x the 30 s
	// default sync period).
	DefaultRestoreTimeout = 60 * time.Second
)

// ErrLocked is an iptables command that gave up waiting for the xtables
// lock, held by another program (Options.WaitSeconds): nothing was
// changed, and a later attempt may succeed.
var ErrLocked = errors.New("the xtables lock is held by another program")

// Real is the Interface implementation for a real kernel. Every operation
// runs a program, bounded by a deadline (Options.Timeout,
// RestoreTimeout, and the caller's context): single-rule and chain
// operations and the version probe run iptables; bulk changes and dumps
// iptables-restore and iptables-save. The exception is ChainUse with
// iptables-nft, one netlink dump under Options.Timeout (chainuse.go). A program still running at its
// deadline is killed with its process group, and the operation fails with
// an error that wraps context.DeadlineExceeded (docs/design.md, "Deadlines
// on kernel calls"). After New a Real changes only when closed, so it is
// safe for concurrent use.
type Real struct {
	protocol Protocol
	netns    string

	ipPath      string // `ip`, only with netns
	mainPath    string
	restorePath string
	savePath    string

	timeout, restoreTimeout time.Duration

	version     string // e.g. "1.8.9"
	mode        string // "nft" or "legacy"
	randomFully bool
	// wait is the lock-wait option of iptables commands, restoreWait
	// iptables-restore's; empty when the version has none.
	wait, restoreWait []string

	closed atomic.Bool
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
	r := &Real{protocol: opts.Protocol, netns: opts.NetNS, timeout: opts.Timeout, restoreTimeout: opts.RestoreTimeout}
	if r.protocol == "" {
		r.protocol = ProtocolIPv4
	}
	if r.timeout <= 0 {
		r.timeout = DefaultTimeout
	}
	if r.restoreTimeout <= 0 {
		r.restoreTimeout = DefaultRestoreTimeout
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
	switch opts.Variant {
	case "":
	case "nft", "legacy":
		base += "-" + opts.Variant
	default:
		return nil, fmt.Errorf("unknown iptables variant %q", opts.Variant)
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

	out, err := r.run(ctx, r.timeout, nil, r.mainPath, "--version")
	if err != nil {
		return nil, fmt.Errorf("probing %s version: %w", base, err)
	}
	v, err := parseIptablesVersion(string(out))
	if err != nil {
		return nil, fmt.Errorf("probing %s version: %w", base, err)
	}
	r.version = v.String()
	r.mode = v.mode
	r.randomFully = v.atLeast(1, 6, 2)
	// iptables waits for the lock with -w since 1.4.20, for at most a
	// number of seconds since 1.4.22; iptables-restore since 1.6.2.
	switch {
	case v.atLeast(1, 4, 22):
		r.wait = []string{"-w", strconv.Itoa(wait)}
	case v.atLeast(1, 4, 20):
		r.wait = []string{"-w"}
	}
	if v.atLeast(1, 6, 2) {
		r.restoreWait = []string{"-w", strconv.Itoa(wait)}
	}
	klog.FromContext(ctx).V(2).Info("Found iptables", "protocol", r.protocol, "version", r.version, "mode", r.mode, "netns", r.netns, "path", r.mainPath)
	return r, nil
}

// Close makes every later operation fail. It holds no resources; it may be
// called more than once.
func (r *Real) Close() error {
	r.closed.Store(true)
	return nil
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
	if exitStatus(err) == 1 && strings.Contains(execStderr(err), "already exists") {
		return true, nil
	}
	return false, fmt.Errorf("creating chain %s in table %s: %w", chain, table, err)
}

// ChainExists implements Interface. Listing the chain's first rule fails
// with status 1 exactly when the chain is absent.
func (r *Real) ChainExists(ctx context.Context, table Table, chain Chain) (bool, error) {
	err := r.iptables(ctx, table, "-S", string(chain), "1")
	switch {
	case err == nil:
		return true, nil
	case exitStatus(err) == 1:
		return false, nil
	}
	return false, fmt.Errorf("checking chain %s in table %s: %w", chain, table, err)
}

// ListChains implements Interface. It reads the chain declarations at the
// head of iptables-save's output and stops it there: the rules that follow
// are most of a large table's dump (tens of megabytes at 10,000 services),
// which reading whole, as `iptables -S` would, made every full sync's
// memory peak.
func (r *Real) ListChains(ctx context.Context, table Table) ([]string, error) {
	var chains []string
	err := r.scanLines(ctx, r.savePath, []string{"-t", string(table)}, func(line []byte) bool {
		switch {
		case bytes.HasPrefix(line, []byte(":")):
			name, _, _ := bytes.Cut(line[1:], []byte(" "))
			chains = append(chains, string(name))
		case bytes.HasPrefix(line, []byte("-")), bytes.Equal(line, []byte("COMMIT")):
			return false // the declarations are over
		}
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("listing chains in table %s: %w", table, err)
	}
	return chains, nil
}

// exists reports whether the rule is in chain (`iptables -C`, which fails
// with status 1 when it is not).
func (r *Real) exists(ctx context.Context, table Table, chain Chain, args []string) (bool, error) {
	err := r.iptables(ctx, table, append([]string{"-C", string(chain)}, args...)...)
	switch {
	case err == nil:
		return true, nil
	case exitStatus(err) == 1:
		return false, nil
	}
	return false, err
}

// EnsureRule implements Interface.
func (r *Real) EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error) {
	if position != Prepend && position != Append {
		return false, fmt.Errorf("unknown rule position %q", position)
	}
	exists, err := r.exists(ctx, table, chain, args)
	switch {
	case err != nil:
		return false, fmt.Errorf("checking rule in %s/%s: %w", table, chain, err)
	case exists:
		return true, nil
	}
	op := []string{"-A", string(chain)}
	if position == Prepend {
		op = []string{"-I", string(chain), "1"}
	}
	if err := r.iptables(ctx, table, append(op, args...)...); err != nil {
		return false, fmt.Errorf("adding rule to %s/%s: %w", table, chain, err)
	}
	return false, nil
}

// DeleteRule implements Interface. A rule is also absent when its chain or
// its jump target does not exist.
func (r *Real) DeleteRule(ctx context.Context, table Table, chain Chain, args ...string) error {
	exists, err := r.exists(ctx, table, chain, args)
	if err == nil && exists {
		err = r.iptables(ctx, table, append([]string{"-D", string(chain)}, args...)...)
	}
	if err == nil || isNotExistError(err) {
		return nil
	}
	return fmt.Errorf("deleting rule from %s/%s: %w", table, chain, err)
}

// FlushChain implements Interface. An absent chain is left absent. A chain
// deleted by someone else between the check and the flush is not an
// error.
func (r *Real) FlushChain(ctx context.Context, table Table, chain Chain) error {
	exists, err := r.ChainExists(ctx, table, chain)
	if err != nil || !exists {
		return err
	}
	err = r.iptables(ctx, table, "-F", string(chain))
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

// iptables runs one iptables command on table, waiting for the xtables
// lock as configured, within Options.Timeout.
func (r *Real) iptables(ctx context.Context, table Table, args ...string) error {
	argv := make([]string, 0, len(r.wait)+2+len(args))
	argv = append(append(append(argv, r.wait...), "-t", string(table)), args...)
	_, err := r.run(ctx, r.timeout, nil, r.mainPath, argv...)
	return err
}

// exitStatus is the exit status of a command that ran and failed, or -1.
func exitStatus(err error) int {
	if ee, ok := errors.AsType[*exec.ExitError](err); ok {
		return ee.ExitCode()
	}
	return -1
}

// notExistMessages are what iptables says when a rule, a chain or a jump
// target is absent.
var notExistMessages = []string{
	"Bad rule (does a matching rule exist in that chain?)",
	"No chain/target/match by that name",
	"No such file or directory",
	"does not exist",
}

// isNotExistError reports whether err is iptables saying the rule, the chain
// or a jump target is absent. Exit status 1 is a failed operation, 2 a
// parameter problem (a missing jump target); other statuses (3: missing
// table, 4: resources) are real errors even when their message matches.
func isNotExistError(err error) bool {
	if c := exitStatus(err); c != 1 && c != 2 {
		return false
	}
	msg := execStderr(err)
	// "No such file or directory" also comes from a match extension that
	// cannot be loaded; that is a broken rule, not an absent one.
	if strings.Contains(msg, "Couldn't load match") {
		return false
	}
	for _, m := range notExistMessages {
		if strings.Contains(msg, m) {
			return true
		}
	}
	return false
}

// Restore implements Interface. On failure the error carries
// iptables-restore's message and, when it names a line, that input line.
func (r *Real) Restore(ctx context.Context, data []byte) error {
	args := append(append([]string{}, r.restoreWait...), "--noflush", "--counters")
	_, err := r.run(ctx, r.restoreTimeout, data, r.restorePath, args...)
	if err == nil {
		return nil
	}
	re := &restoreError{msg: fmt.Sprintf("%s failed", filepath.Base(r.restorePath)), err: err}
	if n, ok := restoreErrorLine(execStderr(err)); ok && !deadline.IsTimeout(err) {
		re.line = n
		if line, ok := restoreInputLine(data, n); ok {
			re.msg += fmt.Sprintf(" at input line %d %q", n, line)
		}
	}
	return re
}

// SaveInto implements Interface.
func (r *Real) SaveInto(ctx context.Context, table Table) ([]byte, error) {
	out, err := r.run(ctx, r.restoreTimeout, nil, r.savePath, "-t", string(table))
	if err != nil {
		return nil, fmt.Errorf("saving table %s: %w", table, err)
	}
	return out, nil
}

// command returns the argv that runs bin with args, inside the namespace
// when one is set.
func (r *Real) command(bin string, args []string) []string {
	argv := append([]string{bin}, args...)
	if r.netns != "" {
		argv = append([]string{r.ipPath, "netns", "exec", r.netns}, argv...)
	}
	return argv
}

// errClosed fails operations after Close.
var errClosed = errors.New("iptables interface is closed")

// run executes bin (inside the namespace when one is set) within timeout
// and ctx's deadline, feeding stdin, and returns stdout. Failures are
// *execError; one that ran out of time also wraps a *deadline.Error.
func (r *Real) run(ctx context.Context, timeout time.Duration, stdin []byte, bin string, args ...string) ([]byte, error) {
	argv := r.command(bin, args)
	if r.closed.Load() {
		return nil, &execError{args: argv, err: errClosed}
	}
	if err := ctx.Err(); err != nil {
		return nil, &execError{args: argv, err: err}
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := deadline.Command(ctx, argv[0], argv[1:]...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	start := time.Now()
	err := cmd.Run()
	elapsed := time.Since(start)
	logger := klog.FromContext(ctx)
	if logger.V(4).Enabled() {
		kv := []any{"command", strings.Join(argv, " "), "duration", elapsed}
		if stdin != nil {
			kv = append(kv, "inputBytes", len(stdin))
		}
		if err != nil {
			kv = append(kv, "err", err, "stderr", strings.TrimSpace(stderr.String()))
		}
		logger.V(4).Info("Ran iptables command", kv...)
	}
	if err != nil {
		return stdout.Bytes(), commandError(ctx, bin, argv, timeout, elapsed, stderr.String(), err)
	}
	return stdout.Bytes(), nil
}

// commandError is the *execError of a failed command: the timeout when
// ctx ended, ErrLocked when it gave up waiting for the xtables lock.
func commandError(ctx context.Context, bin string, argv []string, timeout, elapsed time.Duration, stderr string, err error) error {
	// The *execError prints stderr: the timeout carries no detail.
	err = deadline.CommandError(ctx, filepath.Base(bin), timeout, elapsed, "", err)
	ce := &execError{args: argv, stderr: stderr, err: err}
	if exitStatus(err) == 4 && strings.Contains(stderr, "xtables lock") {
		ce.locked = true
	}
	return ce
}

// scanLines runs bin (inside the namespace when one is set) within
// Options.RestoreTimeout and hands each line of its output to fn until fn
// returns false; then it kills the command, which only reads, and reports
// no error for it. Failures are *execError.
func (r *Real) scanLines(ctx context.Context, bin string, args []string, fn func(line []byte) bool) error {
	argv := r.command(bin, args)
	if r.closed.Load() {
		return &execError{args: argv, err: errClosed}
	}
	if err := ctx.Err(); err != nil {
		return &execError{args: argv, err: err}
	}
	ctx, cancel := context.WithTimeout(ctx, r.restoreTimeout)
	defer cancel()
	cmd := deadline.Command(ctx, argv[0], argv[1:]...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return &execError{args: argv, err: err}
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return &execError{args: argv, err: err}
	}
	sc := bufio.NewScanner(out)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	stopped := false
	for sc.Scan() {
		if !fn(sc.Bytes()) {
			stopped = true
			break
		}
	}
	scanErr := sc.Err()
	if stopped {
		_ = cmd.Process.Kill()
	}
	err = cmd.Wait()
	switch {
	case stopped && ctx.Err() == nil:
		return nil
	case err != nil:
		return commandError(ctx, bin, argv, r.restoreTimeout, time.Since(start), stderr.String(), err)
	case scanErr != nil:
		return &execError{args: argv, stderr: stderr.String(), err: scanErr}
	}
	return nil
}

// execError is a failed command with its stderr. It unwraps to the
// command's error (a *deadline.Error when it ran out of time) and, when
// the command gave up waiting for the xtables lock, to ErrLocked.
type execError struct {
	args   []string
	stderr string
	err    error
	locked bool
}

func (e *execError) Error() string {
	s := fmt.Sprintf("%s: %v", strings.Join(e.args, " "), e.err)
	if msg := summarizeLines(e.stderr); msg != "" {
		s += ": " + msg
	}
	return s
}

// summarizeLines joins the lines of iptables output with "; ", dropping
// empty lines and the generic usage hint.
func summarizeLines(text string) string {
	var lines []string
	for l := range strings.Lines(text) {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "Try `") {
			continue
		}
		lines = append(lines, l)
	}
	return strings.Join(lines, "; ")
}

func (e *execError) Unwrap() []error {
	if e.locked {
		return []error{e.err, ErrLocked}
	}
	return []error{e.err}
}

func execStderr(err error) string {
	var ce *execError
	if errors.As(err, &ce) {
		return ce.stderr
	}
	return ""
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
