package nftables

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/deadline"
)

// execNFT is the knftables.Interface the agent uses: knftables' own for
// everything but Run and Check, which pipe the transaction to "nft -f -"
// (as knftables does) with its element commands merged (mergeElements);
// runText pipes the text kproxy writes itself (textRunner: a full sync's
// endpoint slots written ahead, preWriter).
// Its errors are knftables' kind: knftables.IsNotFound and
// IsAlreadyExists classify them as they would knftables' own, and a
// position nft reports in the merged text is mapped back to the
// transaction's line (tx.String()). An nft still running at its deadline
// (the caller's, or timeout) is killed with its process group, and the run
// fails with an error wrapping context.DeadlineExceeded (docs/design.md,
// "Deadlines on kernel calls").
type execNFT struct {
	knftables.Interface
	path string
	// timeout bounds each Run and Check.
	timeout time.Duration
	// noMerge sends the transaction as knftables renders it.
	noMerge bool
	// startCmd starts nft (tests start it in a network namespace); nil is
	// cmd.Start.
	startCmd func(*exec.Cmd) error
	// notFound and exists carry knftables' classification of an error
	// (knftables.IsNotFound, IsAlreadyExists) into execNFT's.
	notFound, exists error
	// listGuard bounds the listings, which knftables makes over netlink
	// (listdeadline.go).
	listGuard deadline.Guard
	// noSession runs every transaction through "nft -f -".
	noSession bool
	// session is the long-lived "nft -i" small transactions go to
	// (session.go); sessionMu guards it.
	sessionMu sync.Mutex
	session   *nftSession
	// sessionRuns replaces sessionMaxRuns (tests).
	sessionRuns int
}

// execOptions configure newExecNFT.
type execOptions struct {
	Family knftables.Family
	Table  string
	// NoMerge sends transactions unmerged (for measuring the merge).
	NoMerge bool
	// NoSession runs every transaction through "nft -f -" (session.go).
	NoSession bool
	// Timeout bounds each Run and Check; zero means
	// defaultNFTTimeout.
	Timeout time.Duration
}

// defaultNFTTimeout bounds one nft run. The largest, the first
// transaction at 10,000 services (every chain, map and element), takes a
// few seconds (a whole first sync of kproxy at 10,000 services measured
// 5.0 s), so a minute leaves a wide margin for a loaded node; a longer
// limit would only delay noticing a hang past the health check's tolerance
// (2 x the 30 s default sync period).
const defaultNFTTimeout = 60 * time.Second

func newExecNFT(opts execOptions) (*execNFT, error) {
	inner, err := knftables.New(opts.Family, opts.Table, knftables.UseNetlink)
	if err != nil {
		return nil, err
	}
	path, err := exec.LookPath("nft")
	if err != nil {
		return nil, fmt.Errorf("could not find nftables binary: %w", err)
	}
	notFound, exists, err := knftablesErrors()
	if err != nil {
		return nil, err
	}
	timeout := opts.Timeout
	if timeout <= 0 {
		timeout = defaultNFTTimeout
	}
	return &execNFT{Interface: inner, path: path, timeout: timeout, noMerge: opts.NoMerge, noSession: opts.NoSession, notFound: notFound, exists: exists}, nil
}

// knftablesErrors returns an error of each kind knftables classifies
// (IsNotFound, IsAlreadyExists). Its error type is unexported, so they
// come from its fake, which returns the same type.
func knftablesErrors() (notFound, exists error, err error) {
	ctx := context.Background()
	fake := knftables.NewFake(knftables.IPv4Family, "probe")
	_, notFound = fake.ListAll(ctx)
	tx := fake.NewTransaction()
	tx.Add(&knftables.Table{})
	if err := fake.Run(ctx, tx); err != nil {
		return nil, nil, fmt.Errorf("knftables fake: %w", err)
	}
	tx = fake.NewTransaction()
	tx.Create(&knftables.Table{})
	exists = fake.Run(ctx, tx)
	if !knftables.IsNotFound(notFound) || !knftables.IsAlreadyExists(exists) {
		return nil, nil, fmt.Errorf("knftables fake: unexpected errors %v, %v", notFound, exists)
	}
	return notFound, exists, nil
}

// Run is part of knftables.Interface.
func (n *execNFT) Run(ctx context.Context, tx *knftables.Transaction) error {
	return n.run(ctx, tx, false)
}

// Check is part of knftables.Interface.
func (n *execNFT) Check(ctx context.Context, tx *knftables.Transaction) error {
	return n.run(ctx, tx, true)
}

func (n *execNFT) run(ctx context.Context, tx *knftables.Transaction, check bool) error {
	var text string
	rendered := false
	if !check && !n.noSession {
		// A small transaction goes to the session (session.go).
		text, rendered = tx.String(), true
		if !hasErrorLine(text) {
			if handled, err := n.runSession(ctx, text); handled {
				return err
			}
		}
	}
	// nft starts while the transaction renders.
	r, err := n.start(ctx, check)
	if err != nil {
		return err
	}
	if !rendered {
		text = tx.String()
	}
	// A transaction with a pending error (an invalid operation) renders it
	// as a last comment line; knftables returns that error without running
	// nft. nft gets an empty input, which changes nothing.
	if hasErrorLine(text) {
		_, _ = r.finish(nil)
		if check {
			return n.Interface.Check(ctx, tx)
		}
		return n.Interface.Run(ctx, tx)
	}
	// nft reads its whole input before it runs it; the merged text is
	// written as it reads, never held whole.
	errText, err := r.finish(func(w *bufio.Writer) error {
		if n.noMerge {
			_, err := w.WriteString(text)
			return err
		}
		return mergeElements(w, text)
	})
	if err != nil && errText != "" {
		return n.wrapError(err, errText, text)
	}
	return err
}

// runTimeout bounds one run of nft: the interface's timeout, or
// defaultNFTTimeout.
func (n *execNFT) runTimeout() time.Duration {
	if n.timeout <= 0 {
		return defaultNFTTimeout
	}
	return n.timeout
}

// hasErrorLine says whether text, a transaction as knftables renders it,
// carries a pending error (an invalid operation) as a comment line.
func hasErrorLine(text string) bool {
	return strings.HasPrefix(text, "# ERROR: ") || strings.Contains(text, "\n# ERROR: ")
}

// runText runs a transaction kproxy wrote as nft's input itself
// (textRunner). Its error names the lines of that input.
func (n *execNFT) runText(ctx context.Context, t *textTx) error {
	r, err := n.start(ctx, false)
	if err != nil {
		return err
	}
	errText, err := r.finish(t.write)
	if err != nil && errText != "" {
		return n.wrapError(err, errText, "")
	}
	return err
}

// nftRun is one nft process started by execNFT.start, reading its input
// from stdin.
type nftRun struct {
	ctx     context.Context
	cancel  context.CancelFunc
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	stderr  chan string
	began   time.Time
	timeout time.Duration
}

// start starts "nft -f -" (with --check when check is set) under ctx and
// the interface's timeout.
func (n *execNFT) start(ctx context.Context, check bool) (*nftRun, error) {
	args := []string{"-f", "-"}
	if check {
		args = []string{"--check", "-f", "-"}
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	timeout := n.runTimeout()
	r := &nftRun{began: time.Now(), timeout: timeout}
	r.ctx, r.cancel = context.WithTimeout(ctx, timeout)
	cmd := deadline.Command(r.ctx, n.path, args...)
	cmd.Env = nftEnv(os.Environ())
	// nft's stderr is a pipe read to its end (by a goroutine parked in
	// the netpoller) before kproxy waits for nft. Waiting in wait4 while
	// nft runs (as os/exec's Run does) keeps a P in a system call, and
	// the Go runtime's sysmon then polls every 20µs until it returns: at
	// 10,000 services that polling was a third of kproxy's CPU per change
	// (BenchmarkNFTablesSync, change-kproxy-cpu-ms 2.30 before, 1.4 after).
	errR, errW, err := os.Pipe()
	if err != nil {
		r.cancel()
		return nil, fmt.Errorf("running nft: %w", err)
	}
	cmd.Stderr = errW
	stdin, err := cmd.StdinPipe()
	if err != nil {
		_ = errW.Close()
		_ = errR.Close()
		r.cancel()
		return nil, fmt.Errorf("running nft: %w", err)
	}
	if n.startCmd != nil {
		err = n.startCmd(cmd)
	} else {
		err = cmd.Start()
	}
	_ = errW.Close()
	if err != nil {
		_ = errR.Close()
		r.cancel()
		return nil, fmt.Errorf("running nft: %w", err)
	}
	r.cmd, r.stdin = cmd, stdin
	r.stderr = make(chan string, 1)
	go func() {
		defer errR.Close()
		b, _ := io.ReadAll(errR)
		r.stderr <- string(b)
	}()
	return r, nil
}

// finish writes nft's input with write (nil: none), closes it and waits
// for nft. It returns nft's error output when nft failed, and the error:
// a deadline.Error when the run's deadline passed, else nft's exit status
// or a failed write.
func (r *nftRun) finish(write func(*bufio.Writer) error) (string, error) {
	defer r.cancel()
	var werr error
	if write != nil {
		w := bufio.NewWriterSize(r.stdin, 64<<10)
		werr = write(w)
		if werr == nil {
			werr = w.Flush()
		}
	}
	if cerr := r.stdin.Close(); werr == nil {
		werr = cerr
	}
	errText := <-r.stderr
	if err := r.cmd.Wait(); err != nil {
		if r.ctx.Err() != nil {
			return "", deadline.CommandError(r.ctx, "nft", r.timeout, time.Since(r.began), strings.TrimSpace(errText), err)
		}
		if errText == "" {
			return "", &nftError{msg: err.Error(), errs: []error{err}}
		}
		return errText, err
	}
	if werr != nil {
		return "", fmt.Errorf("writing to nft: %w", werr)
	}
	return "", nil
}

// nftMallocTunable asks glibc's malloc in nft for transparent huge pages
// on its heap (glibc 2.35 or later, with transparent huge pages "always"
// or "madvise"; older glibc, other C libraries and "never" ignore it). nft
// keeps what it parses of a transaction until it is done, about 2 KiB per
// element (40 MiB for a 16,384-slot chunk), so without it a large
// transaction grows nft's heap one 4 KiB page fault at a time: at 10,000
// services x 10 endpoints those faults were half of nft's CPU in a full
// sync (docs/design.md, "nftables backend": Talking to nft).
const nftMallocTunable = "glibc.malloc.hugetlb=1"

// nftEnv is the environment nft runs in: the agent's, with
// nftMallocTunable added to GLIBC_TUNABLES unless that already sets
// glibc.malloc.hugetlb (an operator's choice wins).
func nftEnv(env []string) []string {
	const key = "GLIBC_TUNABLES="
	out := make([]string, 0, len(env)+1)
	found := false
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, key); ok {
			found = true
			if !strings.Contains(v, "glibc.malloc.hugetlb=") {
				if v != "" {
					v += ":"
				}
				kv = key + v + nftMallocTunable
			}
		}
		out = append(out, kv)
	}
	if !found {
		out = append(out, key+nftMallocTunable)
	}
	return out
}

// nftError is a failed nft run: its message, and knftables' kind of
// error (for knftables.IsNotFound, IsAlreadyExists) if it has one.
type nftError struct {
	msg  string
	errs []error
}

func (e *nftError) Error() string   { return e.msg }
func (e *nftError) Unwrap() []error { return e.errs }

// wrapError classifies a failed run as knftables does, by the first line
// of nft's error output, and rewrites that output to name the
// transaction's lines (see mapPositions).
func (n *execNFT) wrapError(err error, stderr, text string) error {
	if stderr == "" {
		return &nftError{msg: err.Error(), errs: []error{err}}
	}
	e := &nftError{errs: []error{err}}
	first, _, _ := strings.Cut(stderr, "\n")
	// nft does not call setlocale(): its messages are English.
	switch {
	case strings.Contains(first, "No such file or directory"):
		e.errs = append(e.errs, n.notFound)
	case strings.Contains(first, "File exists"):
		e.errs = append(e.errs, n.exists)
	}
	if n.noMerge || text == "" {
		e.msg = stderr
	} else {
		e.msg = mapPositions(stderr, text)
	}
	return e
}

// nftPosition is the position nft puts before an error in its input
// ("/dev/stdin:12:5-9: Error: ...").
var nftPosition = regexp.MustCompile(`^(\S+):(\d+):(\d+)-(\d+): (.*)$`)

// caretLine underlines the error's position in the line above it.
var caretLine = regexp.MustCompile(`^[ \t]*[\^~]+[ \t]*$`)

// mapPositions rewrites nft's error output for a merged text: each error's
// position names the transaction's line (tx.String()) too, and the merged
// command nft quotes after it (possibly thousands of elements long) is
// replaced by the transaction's command of the element at fault.
func mapPositions(stderr, text string) string {
	lines := strings.Split(strings.TrimSuffix(stderr, "\n"), "\n")
	var out strings.Builder
	for i := 0; i < len(lines); i++ {
		m := nftPosition.FindStringSubmatch(lines[i])
		if m == nil {
			out.WriteString(lines[i] + "\n")
			continue
		}
		line, _ := strconv.Atoi(m[2])
		col, _ := strconv.Atoi(m[3])
		orig, cmd, ok := originalLine(text, line, col)
		if !ok {
			out.WriteString(lines[i] + "\n")
			continue
		}
		fmt.Fprintf(&out, "%s:%d:%d-%s (transaction line %d): %s\n%s\n", m[1], line, col, m[4], orig, m[5], cmd)
		// Skip the quoted merged line and its underline.
		if i+1 < len(lines) && !nftPosition.MatchString(lines[i+1]) {
			i++
			if i+1 < len(lines) && caretLine.MatchString(lines[i+1]) {
				i++
			}
		}
	}
	return out.String()
}
