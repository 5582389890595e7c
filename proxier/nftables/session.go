package nftables

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/rawio"
)

// The nft session. Starting a process costs the agent more than a small
// transaction does: while the clone that starts nft waits for the child to
// exec, the Go runtime's sysmon polls every 20µs, and the child maps and
// links nft's libraries before it reads a byte. At 10,000 services that
// was 1.6 of the 1.7 ms of kproxy's CPU per one-endpoint change, and about
// 1 ms of nft's. So small transactions go to one long-lived "nft -i"
// (interactive mode: each input line is parsed, evaluated and committed as
// one batch, exactly as "nft -f" does a file), one line per transaction,
// each followed by a sentinel line. The sentinel is not a command: nft
// answers it with a syntax error that repeats the line on stderr, so
// everything nft wrote to stderr before that belongs to the transaction.
// kproxy waits for the sentinel in the netpoller (no thread spins), under
// the transaction's deadline. See docs/design.md, "nftables backend":
// Talking to nft.
//
//   - A transaction nft refuses in the session was not committed (nft
//     commits a line's batch whole or not at all); it is run again through
//     "nft -f -", whose error names the line and is classified as
//     knftables does. The session ends, since what nft keeps of the table
//     between lines (its cache; it refreshes it when the table's
//     generation changes) may be what was wrong.
//   - A new session first answers a sentinel alone (a handshake); an nft
//     whose interactive mode does not work fails it having run nothing,
//     and the interface then runs every transaction through "nft -f -".
//   - A session that fails (its deadline, an I/O error, nft gone) is killed
//     with its process group; the transaction fails as a run of "nft -f"
//     would, and the next one starts a new session.
//   - Large transactions (full syncs' chunks, over sessionMaxText) and
//     checks run through "nft -f -" as before: their cost is nft's, and
//     nft's heap, which a session would keep, grows with them.
//   - A session ends after sessionMaxRuns transactions (nft keeps each line
//     in its in-memory history) and when the agent exits (nft reads the end
//     of its input); its HOME is a path that does not exist, so nft reads
//     and writes no history or editline file.

const (
	// sessionMaxText is the largest transaction (merged, in bytes) that
	// goes through the session.
	sessionMaxText = 256 << 10
	// sessionMaxRuns is the number of transactions a session runs before
	// it is replaced.
	sessionMaxRuns = 1000
	// sessionHome is nft's HOME in a session.
	sessionHome = "/nonexistent/kproxy-nft-session"
)

// errNotSent marks a session's failure before nft could read the whole
// line: nothing of it ran.
var errNotSent = errors.New("the transaction was not sent")

// nftSession is one "nft -i" process.
type nftSession struct {
	cmd    *exec.Cmd
	stdin  *os.File
	stderr *os.File
	// in writes to stdin; r reads stderr (both raw: pkg/rawio, so that a
	// transaction does not wake the runtime's sysmon thread).
	in   rawio.FD
	r    *bufio.Reader
	runs int
	seq  uint64
}

// sessionSentinel is the n-th sentinel line.
func sessionSentinel(n uint64) string {
	return "kproxysentinel" + strconv.FormatUint(n, 10)
}

// sessionLine is text, a transaction as knftables renders it, merged and
// as one line of commands separated by ";".
func sessionLine(text string, merge bool) string {
	var b strings.Builder
	b.Grow(len(text) + 64)
	if merge {
		_ = mergeElements(&b, text)
	} else {
		b.WriteString(text)
	}
	s := strings.TrimRight(b.String(), "\n")
	return strings.ReplaceAll(s, "\n", "; ")
}

// startSession starts "nft -i".
func (n *execNFT) startSession() (*nftSession, error) {
	cmd := exec.Command(n.path, "-i")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	env := nftEnv(os.Environ())
	for i, kv := range env {
		if strings.HasPrefix(kv, "HOME=") {
			env = append(env[:i:i], env[i+1:]...)
			break
		}
	}
	cmd.Env = append(env, "HOME="+sessionHome)
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("starting nft -i: %w", err)
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		_ = inR.Close()
		_ = inW.Close()
		return nil, fmt.Errorf("starting nft -i: %w", err)
	}
	cmd.Stdin, cmd.Stderr = inR, errW
	if n.startCmd != nil {
		err = n.startCmd(cmd)
	} else {
		err = cmd.Start()
	}
	_ = inR.Close()
	_ = errW.Close()
	if err != nil {
		_ = inW.Close()
		_ = errR.Close()
		return nil, fmt.Errorf("starting nft -i: %w", err)
	}
	in, err1 := rawio.New(inW)
	out, err2 := rawio.New(errR)
	if err := errors.Join(err1, err2); err != nil {
		s := &nftSession{cmd: cmd, stdin: inW, stderr: errR}
		s.kill()
		return nil, fmt.Errorf("starting nft -i: %w", err)
	}
	return &nftSession{cmd: cmd, stdin: inW, stderr: errR, in: in, r: bufio.NewReaderSize(out, 16<<10)}, nil
}

// kill ends s at once: its process group is killed and reaped.
func (s *nftSession) kill() {
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	_ = s.cmd.Process.Kill()
	_ = s.stdin.Close()
	_ = s.stderr.Close()
	_ = s.cmd.Wait()
}

// end ends s: nft reads the end of its input and exits; one that does not
// within a second is killed.
func (s *nftSession) end() {
	_ = s.stdin.Close()
	t := time.AfterFunc(time.Second, func() { _ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL) })
	_ = s.cmd.Wait()
	t.Stop()
	_ = s.stderr.Close()
}

// run sends line and its sentinel, and reads nft's error output up to the
// sentinel's: it returns what nft wrote about line. An error is the
// session's own (its pipes, nft gone, the deadline).
func (s *nftSession) run(deadlineAt time.Time, line string) (string, error) {
	s.seq++
	s.runs++
	sentinel := sessionSentinel(s.seq)
	if err := s.stdin.SetWriteDeadline(deadlineAt); err != nil {
		return "", err
	}
	if err := s.stderr.SetReadDeadline(deadlineAt); err != nil {
		return "", err
	}
	buf := make([]byte, 0, len(line)+len(sentinel)+2)
	buf = append(append(append(append(buf, line...), '\n'), sentinel...), '\n')
	if w, err := s.in.Write(buf); err != nil {
		if w <= len(line) {
			// nft never read the line's end: it ran nothing.
			err = errors.Join(errNotSent, err)
		}
		return "", fmt.Errorf("writing to nft -i: %w", err)
	}
	var out []string
	for {
		l, err := s.r.ReadString('\n')
		if err != nil {
			return strings.Join(out, ""), fmt.Errorf("reading nft -i's error output: %w", err)
		}
		if strings.TrimSuffix(l, "\n") != sentinel {
			out = append(out, l)
			continue
		}
		// The sentinel's own report: "Error: syntax error, ..." before
		// it, a caret line after it.
		if len(out) > 0 && strings.HasPrefix(out[len(out)-1], "Error: ") {
			out = out[:len(out)-1]
		}
		if _, err := s.r.ReadString('\n'); err != nil {
			return strings.Join(out, ""), fmt.Errorf("reading nft -i's error output: %w", err)
		}
		return strings.Join(out, ""), nil
	}
}

// runSession runs text (a transaction as knftables renders it) in the
// session. handled is false when the transaction must run through
// "nft -f -" instead: it is too large, the session is busy, or nft
// refused it (and so changed nothing).
func (n *execNFT) runSession(ctx context.Context, text string) (handled bool, err error) {
	if n.noSession || len(text) > sessionMaxText {
		return false, nil
	}
	if !n.sessionMu.TryLock() {
		return false, nil
	}
	defer n.sessionMu.Unlock()
	maxRuns := n.sessionRuns
	if maxRuns <= 0 {
		maxRuns = sessionMaxRuns
	}
	if n.session != nil && n.session.runs >= maxRuns {
		n.session.end()
		n.session = nil
	}
	line := sessionLine(text, !n.noMerge)
	if len(line) > sessionMaxText {
		return false, nil
	}
	if err := ctx.Err(); err != nil {
		return true, err
	}
	timeout := n.runTimeout()
	began := time.Now()
	runCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	at, _ := runCtx.Deadline()
	if n.session == nil {
		s, err := n.startSession()
		if err != nil {
			return true, err
		}
		// The handshake: a sentinel alone must come back before any
		// transaction is sent. An nft whose interactive mode does not
		// work (built without it, say) fails here, having run nothing,
		// and every transaction goes through "nft -f -" from then on.
		if _, err := s.run(at, ""); err != nil {
			s.kill()
			if errors.Is(err, os.ErrDeadlineExceeded) {
				<-runCtx.Done()
				return true, deadline.CommandError(runCtx, "nft", timeout, time.Since(began), "nft -i did not answer", err)
			}
			n.noSession = true
			klog.FromContext(ctx).Info("nft has no usable interactive mode; every transaction runs through nft -f", "err", err)
			if ctx.Err() != nil {
				return true, ctx.Err()
			}
			return false, nil
		}
		n.session = s
	}
	s := n.session
	// A caller's cancel (not only its deadline) ends the wait too.
	stop := context.AfterFunc(runCtx, func() {
		_ = s.stdin.SetWriteDeadline(time.Unix(1, 0))
		_ = s.stderr.SetReadDeadline(time.Unix(1, 0))
	})
	out, err := s.run(at, line)
	stop()
	if err != nil {
		s.kill()
		n.session = nil
		if errors.Is(err, os.ErrDeadlineExceeded) {
			// The pipes' deadline is runCtx's (or its cancel): it
			// is done now, or within microseconds.
			<-runCtx.Done()
		}
		if errors.Is(err, errNotSent) && runCtx.Err() == nil {
			// nft had gone (killed, or crashed): nothing ran, so
			// "nft -f -" runs it; the next one starts a new session.
			return false, nil
		}
		if runCtx.Err() != nil {
			return true, deadline.CommandError(runCtx, "nft", timeout, time.Since(began), strings.TrimSpace(out), err)
		}
		return true, fmt.Errorf("nft session: %w", err)
	}
	if sessionRefused(out) {
		// The session's view of the table (nft keeps what it read
		// between lines) may be what was wrong: say, someone else
		// deleted the table. The next transaction starts afresh.
		s.end()
		n.session = nil
		return false, nil
	}
	return true, nil
}

// sessionRefused says whether nft's error output about a line reports an
// error (a warning alone does not stop the commit).
func sessionRefused(out string) bool {
	for l := range strings.SplitSeq(out, "\n") {
		if strings.HasPrefix(l, "Error: ") || strings.Contains(l, ": Error: ") {
			return true
		}
	}
	return false
}

// Close ends the interface's nft session, if one runs. The interface
// stays usable: the next transaction starts a new one.
func (n *execNFT) Close() error {
	n.sessionMu.Lock()
	defer n.sessionMu.Unlock()
	if n.session != nil {
		n.session.end()
		n.session = nil
	}
	return nil
}

// sessionPID is the pid of the running session's nft, 0 when none runs
// (benchmarks read its CPU time).
func (n *execNFT) sessionPID() int {
	n.sessionMu.Lock()
	defer n.sessionMu.Unlock()
	if n.session == nil {
		return 0
	}
	return n.session.cmd.Process.Pid
}
