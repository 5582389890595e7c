package deadline

import (
	"context"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"k8s.io/klog/v2"
)

// Guard bounds calls that take no context and cannot be interrupted:
// netlink library requests. Each call runs in a goroutine of its own and
// the caller returns at the earlier of its context's deadline and the
// call's timeout; the call is then abandoned, not stopped.
//
// An abandoned call goes on until the kernel answers or its socket gives
// up: the implementations set the library's socket send and receive
// timeouts to the same timeout, so a call waiting for a reply ends soon
// after its caller left, and one of them (IPVS, whose library retries a
// receive timeout forever) closes the socket instead through abort. A
// request the kernel itself blocks on (a kernel mutex held by someone
// else) cannot be ended by anything; its goroutine, and the socket it
// holds, stay until the kernel returns. So that a kernel that never
// returns costs one goroutine and not one per sync, a Guard refuses every
// new call at once, with an *Error, while a call it abandoned is still
// running.
//
// The zero Guard is ready to use. A Guard is safe for concurrent use; it
// must not be copied after first use.
type Guard struct {
	mu sync.Mutex
	// stuck counts abandoned calls still running; op and since describe
	// the first of them.
	stuck int
	op    string
	since time.Time
}

// call is one run of a Guard's function. Its results are read only after
// done is closed, and only by a caller that did not abandon it.
type call[T any] struct {
	val       T
	err       error
	panicked  *PanicError
	finished  bool // under Guard.mu
	abandoned bool // under Guard.mu
	done      chan struct{}
}

// Do runs fn and returns its error, or an *Error when ctx ends or timeout
// passes first. fn gets a context with that deadline, for what it does
// between kernel requests (such as waiting to retry a dump). When Do
// abandons fn it calls abort, if not nil, before returning: abort may
// release what fn uses so that fn returns sooner (it runs concurrently with
// fn). timeout <= 0 means no limit of Do's own. A panic of fn is raised
// again in Do's caller as a *PanicError.
func (g *Guard) Do(ctx context.Context, op string, timeout time.Duration, fn func(ctx context.Context) error, abort func()) error {
	_, err := Call(ctx, g, op, timeout, func(ctx context.Context) (struct{}, error) { return struct{}{}, fn(ctx) }, abort)
	return err
}

// Call is Do for a function with a result, which it returns when fn
// returns in time. fn must not share variables with its caller: an
// abandoned fn goes on running after Call has returned.
func Call[T any](ctx context.Context, g *Guard, op string, timeout time.Duration, fn func(ctx context.Context) (T, error), abort func()) (T, error) {
	var zero T
	if err := ctx.Err(); err != nil {
		return zero, err
	}
	if err := g.refuse(op, timeout); err != nil {
		return zero, err
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	start := time.Now()
	c := &call[T]{done: make(chan struct{})}
	go run(ctx, g, op, start, c, fn)
	select {
	case <-c.done:
		return c.result(ctx, op, timeout, start)
	case <-ctx.Done():
	}
	g.mu.Lock()
	if c.finished {
		// It returned while the deadline passed: its answer counts.
		g.mu.Unlock()
		<-c.done
		return c.result(ctx, op, timeout, start)
	}
	c.abandoned = true
	if g.stuck == 0 {
		g.op, g.since = op, time.Now()
	}
	g.stuck++
	g.mu.Unlock()
	if abort != nil {
		abort()
	}
	klog.FromContext(ctx).Info("Abandoned a kernel call at its deadline", "operation", op, "timeout", timeout, "elapsed", time.Since(start))
	return zero, &Error{Op: op, Limit: timeout, Elapsed: time.Since(start), Abandoned: true, Err: ctx.Err()}
}

// result returns what fn returned, or raises its panic again in the
// caller's goroutine, where the sync's recovery can see it. A failure at
// or after the deadline is the deadline's: a socket timeout that matches
// the call's (EAGAIN from the netlink library) may end the call a moment
// before the deadline's timer fires.
func (c *call[T]) result(ctx context.Context, op string, timeout time.Duration, start time.Time) (T, error) {
	if c.panicked != nil {
		panic(c.panicked)
	}
	if c.err != nil {
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
			var zero T
			return zero, &Error{Op: op, Limit: timeout, Elapsed: time.Since(start), Detail: c.err.Error(), Err: context.DeadlineExceeded}
		}
	}
	return c.val, c.err
}

// PanicError is a panic of a function a Guard ran, raised again in its
// caller's goroutine: Value is what it panicked with, Stack where.
type PanicError struct {
	Value any
	Stack []byte
}

func (p *PanicError) Error() string {
	return fmt.Sprintf("panic in a kernel call: %v\n%s", p.Value, p.Stack)
}

// run runs fn for Call and records its end. A panic of fn is recorded for
// the caller; an abandoned call's is logged, as nobody is left to get it.
func run[T any](ctx context.Context, g *Guard, op string, start time.Time, c *call[T], fn func(ctx context.Context) (T, error)) {
	var (
		val      T
		err      error
		panicked *PanicError
	)
	func() {
		defer func() {
			if p := recover(); p != nil {
				panicked = &PanicError{Value: p, Stack: debug.Stack()}
			}
		}()
		val, err = fn(ctx)
	}()
	g.mu.Lock()
	c.val, c.err, c.panicked, c.finished = val, err, panicked, true
	abandoned := c.abandoned
	if abandoned {
		g.stuck--
	}
	g.mu.Unlock()
	close(c.done)
	if abandoned {
		logger := klog.FromContext(ctx)
		if panicked != nil {
			logger.Error(panicked, "Abandoned kernel call panicked", "operation", op, "after", time.Since(start))
			return
		}
		logger.Info("Abandoned kernel call returned", "operation", op, "after", time.Since(start), "err", err)
	}
}

// refuse fails a new call while an abandoned one is still running.
func (g *Guard) refuse(op string, timeout time.Duration) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.stuck == 0 {
		return nil
	}
	return &Error{
		Op:      op,
		Limit:   timeout,
		Refused: fmt.Sprintf("%q, abandoned at its deadline %v ago, has not returned", g.op, time.Since(g.since).Round(time.Millisecond)),
		Err:     context.DeadlineExceeded,
	}
}

// Stuck reports how many calls the Guard abandoned are still running.
func (g *Guard) Stuck() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.stuck
}
