package iptables

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	goiptables "github.com/coreos/go-iptables/iptables"
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
	// the current namespace. The Real then owns a temporary directory that
	// Close removes.
	NetNS string
	// WaitSeconds is how long a command waits for the xtables lock (-w).
	// Zero means 5.
	WaitSeconds int
	// Variant selects the binaries: empty runs iptables, iptables-restore
	// and iptables-save (whichever backend the system chose); "nft" and
	// "legacy" run iptables-nft... and iptables-legacy... (for tests and
	// tools that need one backend).
	Variant string
}

const defaultWaitSeconds = 5

// Real is the Interface implementation for a real kernel. Single-rule and
// chain operations, and the version and feature probes, go through
// go-iptables; bulk changes and dumps run iptables-restore and iptables-save.
// It holds no mutable state after New, so it is safe for concurrent use.
type Real struct {
	protocol Protocol
	netns    string

	ipt *goiptables.IPTables

	ipPath      string // `ip`, only with netns
	restorePath string
	savePath    string
	// wrapperDir holds the script go-iptables runs in place of iptables when
	// netns is set; empty otherwise.
	wrapperDir string

	version     string // e.g. "1.8.9"
	mode        string // "nft" or "legacy"
	restoreWait []string
	// mainPath is iptables' path, and wait its lock-wait option, for the
	// commands run without go-iptables.
	mainPath string
	wait     []string
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
// an Interface that runs them (inside opts.NetNS when set). With NetNS the
// caller must Close the result.
func New(ctx context.Context, opts Options) (Interface, error) {
	r := &Real{protocol: opts.Protocol, netns: opts.NetNS}
	if r.protocol == "" {
		r.protocol = ProtocolIPv4
	}
	var (
		base   string
		family goiptables.Protocol
	)
	switch r.protocol {
	case ProtocolIPv4:
		base, family = "iptables", goiptables.ProtocolIPv4
	case ProtocolIPv6:
		base, family = "ip6tables", goiptables.ProtocolIPv6
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

	// go-iptables parses the backend but does not expose it, so the mode
	// comes from a probe of our own. It runs before go-iptables' probe
	// because its error carries stderr (for example a missing namespace).
	out, err := r.run(ctx, nil, r.mainPath, "--version")
	if err != nil {
		return nil, fmt.Errorf("probing %s version: %w", base, err)
	}
	probed, err := parseIptablesVersion(string(out))
	if err != nil {
		return nil, fmt.Errorf("probing %s version: %w", base, err)
	}

	gipPath := r.mainPath
	if r.netns != "" {
		if gipPath, err = r.writeNetNSWrapper(base, r.mainPath); err != nil {
			return nil, err
		}
	}
	r.ipt, err = newGoIPTables(family, wait, gipPath)
	if err != nil {
		closeErr := r.Close()
		return nil, errors.Join(fmt.Errorf("initialising go-iptables for %s: %w", gipPath, err), closeErr)
	}
	major, minor, patch := r.ipt.GetIptablesVersion()
	v := iptablesVersion{major: major, minor: minor, patch: patch, mode: probed.mode}
	r.version = v.String()
	r.mode = v.mode
	// iptables-restore takes -w with a timeout in seconds since 1.6.2.
	if v.atLeast(1, 6, 2) {
		r.restoreWait = []string{"-w", strconv.Itoa(wait)}
	}
	// iptables waits for the lock with -w since 1.4.20, for at most a
	// number of seconds since 1.4.22.
	switch {
	case v.atLeast(1, 4, 22):
		r.wait = []string{"-w", strconv.Itoa(wait)}
	case v.atLeast(1, 4, 20):
		r.wait = []string{"-w"}
	}
	klog.FromContext(ctx).V(2).Info("Found iptables", "protocol", r.protocol, "version", r.version, "mode", r.mode, "netns", r.netns, "path", gipPath)
	return r, nil
}

// writeNetNSWrapper writes, into a fresh private directory recorded in
// r.wrapperDir, an executable named base that runs mainPath inside r.netns.
// go-iptables runs it in place of iptables, for operations and for its
// `--version` probe (it derives nothing else from the path). It returns the
// script's path.
func (r *Real) writeNetNSWrapper(base, mainPath string) (string, error) {
	dir, err := os.MkdirTemp("", "kproxy-iptables-*")
	if err != nil {
		return "", fmt.Errorf("creating the %s wrapper for netns %s: %w", base, r.netns, err)
	}
	r.wrapperDir = dir
	script := fmt.Sprintf("#!/bin/sh\nexec %s netns exec %s %s \"$@\"\n",
		shellQuote(r.ipPath), shellQuote(r.netns), shellQuote(mainPath))
	path := filepath.Join(dir, base)
	if err := os.WriteFile(path, []byte(script), 0o700); err != nil {
		return "", errors.Join(fmt.Errorf("writing the %s wrapper for netns %s: %w", base, r.netns, err), r.Close())
	}
	return path, nil
}

// newGoIPTables initialises go-iptables, which runs path --version. A
// wrapper script just written by writeNetNSWrapper can fail that with
// ETXTBSY: a child forked by another goroutine while the script was open for
// writing still holds the descriptor until it execs (Go issue 22315). That
// window is short, so the probe is retried for up to two seconds.
func newGoIPTables(family goiptables.Protocol, wait int, path string) (*goiptables.IPTables, error) {
	var err error
	for attempt := 0; attempt < 40; attempt++ {
		var ipt *goiptables.IPTables
		ipt, err = goiptables.New(goiptables.IPFamily(family), goiptables.Timeout(wait), goiptables.Path(path))
		if err == nil {
			return ipt, nil
		}
		if !strings.Contains(err.Error(), syscall.ETXTBSY.Error()) {
			return nil, err
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil, err
}

// shellQuote quotes s as one POSIX shell word.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Close removes the temporary directory New made for Options.NetNS; single
// rule and chain operations fail afterwards. Without NetNS it does nothing.
// It may be called more than once.
func (r *Real) Close() error {
	if r.wrapperDir == "" {
		return nil
	}
	if err := os.RemoveAll(r.wrapperDir); err != nil {
		return fmt.Errorf("removing the iptables wrapper directory: %w", err)
	}
	return nil
}

// Version is the iptables version, e.g. "1.8.9".
func (r *Real) Version() string { return r.version }

// Mode is the iptables backend: "nft" or "legacy".
func (r *Real) Mode() string { return r.mode }

// Protocol implements Interface.
func (r *Real) Protocol() Protocol { return r.protocol }

// HasRandomFully implements Interface.
func (r *Real) HasRandomFully() bool { return r.ipt.HasRandomFully() }

// EnsureChain implements Interface.
func (r *Real) EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error) {
	err := r.call(ctx, "NewChain", table, chain, nil, func() error {
		return r.ipt.NewChain(string(table), string(chain))
	})
	if err == nil {
		return false, nil
	}
	if exitStatus(err) == 1 && strings.Contains(err.Error(), "already exists") {
		return true, nil
	}
	return false, fmt.Errorf("creating chain %s in table %s: %w", chain, table, err)
}

// ChainExists implements Interface.
func (r *Real) ChainExists(ctx context.Context, table Table, chain Chain) (bool, error) {
	var exists bool
	err := r.call(ctx, "ChainExists", table, chain, nil, func() (err error) {
		exists, err = r.ipt.ChainExists(string(table), string(chain))
		return err
	})
	if err != nil {
		return false, fmt.Errorf("checking chain %s in table %s: %w", chain, table, err)
	}
	return exists, nil
}

// ListChains implements Interface. It reads the chain declarations at the
// head of iptables-save's output and stops it there: the rules that follow
// are most of a large table's dump (tens of megabytes at 10,000 services),
// which reading whole, as `iptables -S` through go-iptables did, made every
// full sync's memory peak.
func (r *Real) ListChains(ctx context.Context, table Table) ([]string, error) {
	var chains []string
	err := r.call(ctx, "ListChains", table, "", nil, func() error {
		return r.scanLines(ctx, r.savePath, []string{"-t", string(table)}, func(line []byte) bool {
			switch {
			case bytes.HasPrefix(line, []byte(":")):
				name, _, _ := bytes.Cut(line[1:], []byte(" "))
				chains = append(chains, string(name))
			case bytes.HasPrefix(line, []byte("-")), bytes.Equal(line, []byte("COMMIT")):
				return false // the declarations are over
			}
			return true
		})
	})
	if err != nil {
		return nil, fmt.Errorf("listing chains in table %s: %w", table, err)
	}
	return chains, nil
}

// EnsureRule implements Interface.
func (r *Real) EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error) {
	if position != Prepend && position != Append {
		return false, fmt.Errorf("unknown rule position %q", position)
	}
	var exists bool
	err := r.call(ctx, "Exists", table, chain, args, func() (err error) {
		exists, err = r.ipt.Exists(string(table), string(chain), args...)
		return err
	})
	switch {
	case err != nil:
		return false, fmt.Errorf("checking rule in %s/%s: %w", table, chain, err)
	case exists:
		return true, nil
	}
	err = r.call(ctx, string(position), table, chain, args, func() error {
		if position == Prepend {
			return r.ipt.Insert(string(table), string(chain), 1, args...)
		}
		return r.ipt.Append(string(table), string(chain), args...)
	})
	if err != nil {
		return false, fmt.Errorf("adding rule to %s/%s: %w", table, chain, err)
	}
	return false, nil
}

// DeleteRule implements Interface. A rule is also absent when its chain or
// its jump target does not exist.
func (r *Real) DeleteRule(ctx context.Context, table Table, chain Chain, args ...string) error {
	err := r.call(ctx, "DeleteIfExists", table, chain, args, func() error {
		return r.ipt.DeleteIfExists(string(table), string(chain), args...)
	})
	if err == nil || isNotExistError(err) {
		return nil
	}
	return fmt.Errorf("deleting rule from %s/%s: %w", table, chain, err)
}

// FlushChain implements Interface. go-iptables' ClearChain creates a missing
// chain, so an absent chain is detected first and left absent. A chain
// deleted by someone else between the two steps is recreated empty.
func (r *Real) FlushChain(ctx context.Context, table Table, chain Chain) error {
	exists, err := r.ChainExists(ctx, table, chain)
	if err != nil || !exists {
		return err
	}
	err = r.call(ctx, "ClearChain", table, chain, nil, func() error {
		return r.ipt.ClearChain(string(table), string(chain))
	})
	if err != nil {
		return fmt.Errorf("flushing chain %s in table %s: %w", chain, table, err)
	}
	return nil
}

// DeleteChain implements Interface.
func (r *Real) DeleteChain(ctx context.Context, table Table, chain Chain) error {
	err := r.call(ctx, "DeleteChain", table, chain, nil, func() error {
		return r.ipt.DeleteChain(string(table), string(chain))
	})
	if err == nil || isNotExistError(err) {
		return nil
	}
	return fmt.Errorf("deleting chain %s in table %s: %w", chain, table, err)
}

// call runs one go-iptables operation, which takes no context: a context
// already done fails it without running anything; the lock wait is bounded by
// Options.WaitSeconds instead.
func (r *Real) call(ctx context.Context, op string, table Table, chain Chain, args []string, f func() error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	start := time.Now()
	err := f()
	if ge, ok := errors.AsType[*goiptables.Error](err); ok {
		err = &opError{err: ge}
	}
	if logger := klog.FromContext(ctx); logger.V(4).Enabled() {
		kv := []any{"op", op, "protocol", r.protocol, "table", table, "duration", time.Since(start)}
		if chain != "" {
			kv = append(kv, "chain", chain)
		}
		if len(args) > 0 {
			kv = append(kv, "args", strings.Join(args, " "))
		}
		if r.netns != "" {
			kv = append(kv, "netns", r.netns)
		}
		if err != nil {
			kv = append(kv, "err", err)
		}
		logger.V(4).Info("Ran iptables operation", kv...)
	}
	return err
}

// exitStatus is the exit status of a failed command (go-iptables' or
// ours), or -1 when err is not one.
func exitStatus(err error) int {
	var ge *goiptables.Error
	if errors.As(err, &ge) {
		return ge.ExitStatus()
	}
	if ee, ok := errors.AsType[*exec.ExitError](err); ok {
		return ee.ExitCode()
	}
	return -1
}

// isNotExistError reports whether err is iptables saying the rule, the chain
// or a jump target is absent. Exit status 1 is a failed operation, 2 a
// parameter problem (a missing jump target); other statuses (3: missing
// table, 4: resources) are real errors even when their message matches.
func isNotExistError(err error) bool {
	var ge *goiptables.Error
	if !errors.As(err, &ge) {
		return false
	}
	if c := ge.ExitStatus(); c != 1 && c != 2 {
		return false
	}
	// go-iptables also counts "No such file or directory" from a match
	// extension that cannot be loaded; that is a broken rule, not an absent
	// one.
	return ge.IsNotExist() && !strings.Contains(ge.Error(), "Couldn't load match")
}

// opError is a failed go-iptables command, printed on one line without
// iptables' usage hint; it unwraps to the *goiptables.Error.
type opError struct {
	err *goiptables.Error
}

func (e *opError) Error() string { return summarizeLines(e.err.Error()) }

func (e *opError) Unwrap() error { return e.err }

// Restore implements Interface. On failure the error carries
// iptables-restore's message and, when it names a line, that input line.
func (r *Real) Restore(ctx context.Context, data []byte) error {
	args := append(append([]string{}, r.restoreWait...), "--noflush", "--counters")
	_, err := r.run(ctx, data, r.restorePath, args...)
	if err == nil {
		return nil
	}
	re := &restoreError{msg: fmt.Sprintf("%s failed", filepath.Base(r.restorePath)), err: err}
	if n, ok := restoreErrorLine(execStderr(err)); ok {
		re.line = n
		if line, ok := restoreInputLine(data, n); ok {
			re.msg += fmt.Sprintf(" at input line %d %q", n, line)
		}
	}
	return re
}

// SaveInto implements Interface.
func (r *Real) SaveInto(ctx context.Context, table Table) ([]byte, error) {
	out, err := r.run(ctx, nil, r.savePath, "-t", string(table))
	if err != nil {
		return nil, fmt.Errorf("saving table %s: %w", table, err)
	}
	return out, nil
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

// scanLines runs bin (inside the namespace when one is set) and hands each
// line of its output to fn until fn returns false; then it kills the
// command, which only reads, and reports no error for it. Failures are
// *execError.
func (r *Real) scanLines(ctx context.Context, bin string, args []string, fn func(line []byte) bool) error {
	argv := append([]string{bin}, args...)
	if r.netns != "" {
		argv = append([]string{r.ipPath, "netns", "exec", r.netns}, argv...)
	}
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return &execError{args: argv, err: err}
	}
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
	case stopped:
		return nil
	case err != nil:
		return &execError{args: argv, stderr: stderr.String(), err: err}
	case scanErr != nil:
		return &execError{args: argv, stderr: stderr.String(), err: scanErr}
	}
	return nil
}

// execError is a failed command with its stderr.
type execError struct {
	args   []string
	stderr string
	err    error
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

func (e *execError) Unwrap() error { return e.err }

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
