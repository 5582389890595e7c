// Package deadline bounds kproxy's calls into the kernel, so that a hung
// iptables-restore, nft or netlink request fails the sync that made it
// instead of blocking the sync loop forever (docs/design.md, "Deadlines on
// kernel calls").
//
// Every bounded call ends at the earlier of its caller's context deadline
// and its own timeout. A call that runs out of time fails with an *Error
// that wraps the context's error, so errors.Is(err,
// context.DeadlineExceeded) (or IsTimeout) recognises it however many
// times it was wrapped.
//
// Two kinds of call are bounded:
//   - programs (Command): the child and every process of its process group
//     are killed with SIGKILL at the deadline, so no orphan keeps the
//     xtables lock or a half-read pipe;
//   - library calls that take no context and cannot be interrupted, such
//     as netlink requests (Guard): the call runs in its own goroutine and
//     the caller returns at the deadline.
package deadline

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// Error is a kernel call that did not finish in time: it ran out of its
// own timeout or of its caller's deadline (Err is then
// context.DeadlineExceeded), or its caller cancelled it (Err is
// context.Canceled).
type Error struct {
	// Op names the call: "iptables-restore", "netlink: listing addresses".
	Op string
	// Limit is the call's own timeout; the caller's deadline may have
	// been earlier. Zero: none.
	Limit time.Duration
	// Elapsed is how long the caller waited.
	Elapsed time.Duration
	// Killed says that the call was a program whose process group was
	// killed; Abandoned that it was a call left running (see Guard).
	// Neither: it returned, failing, at its deadline.
	Killed, Abandoned bool
	// Detail is what the call reported before it was stopped, such as a
	// program's error output; may be empty.
	Detail string
	// Refused, when set, says why the call was not even started (see
	// Guard).
	Refused string
	// Err is the context's error.
	Err error
}

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: ", e.Op)
	if e.Refused != "" {
		fmt.Fprintf(&b, "not started: %s: %v", e.Refused, e.Err)
		return b.String()
	}
	if errors.Is(e.Err, context.DeadlineExceeded) {
		fmt.Fprintf(&b, "no result within %v", e.Elapsed.Round(time.Millisecond))
		if e.Limit > 0 {
			fmt.Fprintf(&b, " (deadline %v)", e.Limit)
		}
	} else {
		fmt.Fprintf(&b, "stopped after %v", e.Elapsed.Round(time.Millisecond))
	}
	switch {
	case e.Killed:
		b.WriteString(", process group killed")
	case e.Abandoned:
		b.WriteString(", call abandoned")
	}
	if e.Detail != "" {
		fmt.Fprintf(&b, " (it said: %s)", e.Detail)
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	return b.String()
}

// Unwrap returns the context's error.
func (e *Error) Unwrap() error { return e.Err }

// Timeout reports whether the call ran out of time (as opposed to being
// cancelled), in the manner of net.Error.
func (e *Error) Timeout() bool { return errors.Is(e.Err, context.DeadlineExceeded) }

// IsTimeout reports whether err is, or wraps, a kernel call that ran out
// of time.
func IsTimeout(err error) bool {
	if e, ok := errors.AsType[*Error](err); ok {
		return e.Timeout()
	}
	return false
}

// waitDelay bounds how long Wait waits for a killed program's output pipes
// to close: a grandchild that left the process group could hold them open
// forever.
const waitDelay = 2 * time.Second

// Command returns exec.CommandContext(ctx, name, args...) made to end
// cleanly when ctx ends: the child gets a process group of its own, and
// cancelling kills that whole group with SIGKILL (a shell wrapper's
// children, `ip netns exec`'s program) before the child itself; Wait then
// waits at most a few seconds for its output pipes. Bound ctx with
// context.WithTimeout and turn the failure into an *Error with
// CommandError.
func Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return killGroup(cmd.Process) }
	cmd.WaitDelay = waitDelay
	return cmd
}

// killGroup kills p's process group, then p. A process already reaped
// reports os.ErrProcessDone (os/exec then adds no error of its own). Until
// the child is reaped its pid cannot be reused, so the group it leads is
// still its own.
func killGroup(p *os.Process) error {
	if err := p.Signal(syscall.Signal(0)); errors.Is(err, os.ErrProcessDone) {
		return err
	}
	_ = syscall.Kill(-p.Pid, syscall.SIGKILL)
	return p.Kill()
}

// CommandError returns err as the failure of a program started with
// Command under ctx: an *Error when ctx ended (op, timeout and detail
// describe the call), err itself otherwise.
func CommandError(ctx context.Context, op string, timeout, elapsed time.Duration, detail string, err error) error {
	if err == nil {
		return nil
	}
	cerr := ctx.Err()
	if cerr == nil {
		return err
	}
	return &Error{Op: op, Limit: timeout, Elapsed: elapsed, Killed: true, Detail: detail, Err: cerr}
}
