// Package runner provides BoundedFrequencyRunner, the scheduler behind
// kproxy's sync loop: it runs a function when asked, but never more often than
// a minimum interval, at least once per maximum interval, and again after a
// failure, backing off while failures repeat.
package runner

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
)

// Options configures a BoundedFrequencyRunner.
type Options struct {
	// Name identifies the runner in logs.
	Name string
	// Fn is the work to run. A non-nil error schedules a retry (see
	// RetryInterval); a panic is recovered, logged with its stack and
	// counts as a failure (a *PanicError). Fn receives the context passed
	// to Loop, carrying a logger named after the runner.
	Fn func(ctx context.Context) error
	// MinInterval is the minimum time between the end of one run and the
	// start of the next. Zero runs every request as soon as the previous run
	// has finished.
	MinInterval time.Duration
	// RetryInterval is how long after a failed run Fn runs again (never
	// sooner than MinInterval allows). Each further consecutive failure
	// doubles the wait, up to MaxInterval; a successful run resets it.
	// Must be positive.
	RetryInterval time.Duration
	// RetryJitter spreads each retry's wait by up to this fraction either
	// way (0.2: +-20%), so that the nodes of a cluster failing together do
	// not retry in step; the wait never exceeds MaxInterval. Zero retries
	// after exactly the backed-off wait. Must be in [0, 1).
	RetryJitter float64
	// Rand returns a uniform number in [0, 1) for the jitter; nil uses
	// math/rand/v2.
	Rand func() float64
	// MaxInterval is the longest time between the end of one run and the
	// start of the next: when nothing asked for a run by then, Fn runs anyway.
	// Before the first run it is measured from the start of Loop. Must be
	// positive and no less than MinInterval.
	MaxInterval time.Duration
	// Clock is the time source; nil means the real clock.
	Clock clock.WithTicker
}

// validate checks o and reports every problem found, each naming the
// offending field, in one message.
func (o *Options) validate() error {
	var problems []string
	if o.Fn == nil {
		problems = append(problems, "Fn must not be nil")
	}
	if o.MinInterval < 0 {
		problems = append(problems, fmt.Sprintf("MinInterval must not be negative, got %v", o.MinInterval))
	}
	if o.RetryInterval <= 0 {
		problems = append(problems, fmt.Sprintf("RetryInterval must be positive, got %v", o.RetryInterval))
	}
	if o.RetryJitter < 0 || o.RetryJitter >= 1 {
		problems = append(problems, fmt.Sprintf("RetryJitter must be in [0, 1), got %v", o.RetryJitter))
	}
	if o.MaxInterval <= 0 {
		problems = append(problems, fmt.Sprintf("MaxInterval must be positive, got %v", o.MaxInterval))
	} else if o.MinInterval > o.MaxInterval {
		problems = append(problems, fmt.Sprintf("MinInterval (%v) must not exceed MaxInterval (%v)", o.MinInterval, o.MaxInterval))
	}
	if len(problems) == 0 {
		return nil
	}
	return errors.New(strings.Join(problems, "; "))
}

// BoundedFrequencyRunner runs a function on request, rate limited from below
// and above:
//
//   - a request (Run) is served as soon as MinInterval has passed since the
//     end of the previous run, immediately if it already has;
//   - requests made while a run is in progress, or while waiting for
//     MinInterval to pass, coalesce into exactly one further run;
//   - when nothing asks for a run, one happens MaxInterval after the previous
//     run ended;
//   - a failed (or panicking) run, or a RetryAfter call, schedules a retry,
//     which any run that starts earlier satisfies; consecutive failures
//     back off exponentially, with jitter, up to MaxInterval;
//   - runs never overlap: Fn is only ever called from the Loop goroutine.
//
// Create one with NewBoundedFrequencyRunner, start it with Loop, and call Run
// from any goroutine.
type BoundedFrequencyRunner struct {
	name          string
	fn            func(context.Context) error
	minInterval   time.Duration
	retryInterval time.Duration
	retryJitter   float64
	rand          func() float64
	maxInterval   time.Duration
	clock         clock.WithTicker

	// failures counts the consecutive failed runs; only the Loop goroutine
	// touches it.
	failures int

	// wake has room for one token; Run and RetryAfter leave one there so an
	// idle Loop re-reads the request state below.
	wake chan struct{}
	// looping guards against two concurrent Loop calls, which would break
	// the no-overlap guarantee.
	looping atomic.Bool

	mu sync.Mutex
	// requested is set by Run and cleared when a run starts.
	requested bool
	// retryAt, when retryScheduled, is the earliest time a retry was asked
	// for; cleared when a run starts.
	retryScheduled bool
	retryAt        time.Time
}

// NewBoundedFrequencyRunner validates opts and returns a runner. It starts
// nothing: call Loop to begin running.
func NewBoundedFrequencyRunner(opts Options) (*BoundedFrequencyRunner, error) {
	if err := opts.validate(); err != nil {
		return nil, fmt.Errorf("invalid options for runner %q: %w", opts.Name, err)
	}
	clk := opts.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	rnd := opts.Rand
	if rnd == nil {
		rnd = rand.Float64
	}
	return &BoundedFrequencyRunner{
		name:          opts.Name,
		fn:            opts.Fn,
		minInterval:   opts.MinInterval,
		retryInterval: opts.RetryInterval,
		retryJitter:   opts.RetryJitter,
		rand:          rnd,
		maxInterval:   opts.MaxInterval,
		clock:         clk,
		wake:          make(chan struct{}, 1),
	}, nil
}

// Run asks for a run as soon as the minimum interval allows. It never blocks;
// any number of calls before the run starts result in a single run. Calls
// made before Loop starts are served when it does.
func (r *BoundedFrequencyRunner) Run() {
	r.mu.Lock()
	r.requested = true
	r.mu.Unlock()
	r.signal()
}

// RetryAfter asks for a run no later than d from now (but not before the
// minimum interval has passed). An earlier pending retry is kept; any run
// that starts in the meantime satisfies the retry. It never blocks and may be
// called from Fn.
func (r *BoundedFrequencyRunner) RetryAfter(d time.Duration) {
	r.scheduleRetry(r.clock.Now().Add(d))
	r.signal()
}

func (r *BoundedFrequencyRunner) scheduleRetry(at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.retryScheduled || at.Before(r.retryAt) {
		r.retryScheduled = true
		r.retryAt = at
	}
}

// signal wakes an idle Loop without blocking; a token already waiting does
// the same job.
func (r *BoundedFrequencyRunner) signal() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Loop runs Fn whenever it is due until ctx is done. It blocks; a run in
// progress when ctx is cancelled is allowed to return, and no further run
// starts. Only one Loop may run at a time: a concurrent second call logs an
// error and returns at once.
func (r *BoundedFrequencyRunner) Loop(ctx context.Context) {
	logger := klog.FromContext(ctx).WithValues("runner", r.name)
	if !r.looping.CompareAndSwap(false, true) {
		logger.Error(nil, "Loop is already running for this runner; ignoring the second call")
		return
	}
	defer r.looping.Store(false)
	ctx = klog.NewContext(ctx, logger)

	logger.V(2).Info("Starting bounded frequency runner",
		"minInterval", r.minInterval, "retryInterval", r.retryInterval, "maxInterval", r.maxInterval)
	defer logger.V(2).Info("Stopped bounded frequency runner")

	// periodicFrom is what MaxInterval is measured from and notBefore the
	// earliest a requested run or retry may start: both the start of the loop
	// until the first run, then derived from the end of the latest run.
	start := r.clock.Now()
	periodicFrom, notBefore := start, start
	for {
		if ctx.Err() != nil {
			return
		}
		// The request state is read right below, so a wake-up token left by
		// an earlier Run is stale; dropping it avoids a pointless re-wait.
		select {
		case <-r.wake:
		default:
		}
		due, reason := r.nextRun(periodicFrom, notBefore)
		if wait := due.Sub(r.clock.Now()); wait > 0 {
			logger.V(5).Info("Waiting for next run", "wait", wait, "reason", reason)
			if !r.sleep(ctx, wait) {
				return
			}
			continue
		}
		end := r.runOnce(ctx, logger, reason)
		periodicFrom, notBefore = end, end.Add(r.minInterval)
	}
}

// nextRun decides when the next run is due, and why.
func (r *BoundedFrequencyRunner) nextRun(periodicFrom, notBefore time.Time) (time.Time, string) {
	r.mu.Lock()
	requested, retryScheduled, retryAt := r.requested, r.retryScheduled, r.retryAt
	r.mu.Unlock()

	// MinInterval <= MaxInterval, so notBefore never comes after the
	// periodic deadline.
	if requested {
		return notBefore, "requested"
	}
	due, reason := periodicFrom.Add(r.maxInterval), "periodic"
	if retryScheduled {
		if retryAt.Before(notBefore) {
			retryAt = notBefore
		}
		if retryAt.Before(due) {
			due, reason = retryAt, "retry"
		}
	}
	return due, reason
}

// sleep waits for d, a wake-up or ctx, whichever comes first. It reports
// false when ctx is done.
func (r *BoundedFrequencyRunner) sleep(ctx context.Context, d time.Duration) bool {
	timer := r.clock.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-r.wake:
	case <-timer.C():
	}
	return true
}

// runOnce calls Fn, schedules a retry if it fails, and returns when it ended.
func (r *BoundedFrequencyRunner) runOnce(ctx context.Context, logger klog.Logger, reason string) time.Time {
	// Whatever was asked for so far is served by this run; requests made
	// while it is in progress call for another one.
	r.mu.Lock()
	r.requested = false
	r.retryScheduled = false
	r.mu.Unlock()

	start := r.clock.Now()
	logger.V(4).Info("Running", "reason", reason)
	panicked, err := r.call(ctx)
	end := r.clock.Now()
	switch {
	case err != nil && ctx.Err() != nil:
		logger.V(2).Info("Run failed while stopping; not retrying", "err", err)
	case err != nil:
		r.failures++
		wait := r.retryWait(r.failures)
		r.scheduleRetry(end.Add(wait))
		if panicked != nil {
			logger.Error(err, "Run panicked; will retry", "reason", reason, "consecutiveFailures", r.failures, "retryAfter", wait, "stack", string(panicked.Stack))
		} else {
			logger.Error(err, "Run failed; will retry", "reason", reason, "consecutiveFailures", r.failures, "retryAfter", wait)
		}
	default:
		if r.failures > 0 {
			logger.V(2).Info("Run succeeded after failures", "reason", reason, "failures", r.failures)
		}
		r.failures = 0
		logger.V(4).Info("Run finished", "reason", reason, "duration", end.Sub(start))
	}
	return end
}

// call runs Fn, turning a panic into a *PanicError, returned both as
// panicked and as err (an error Fn returns is never taken for a panic of its own,
// even a *PanicError: Fn has then logged it).
func (r *BoundedFrequencyRunner) call(ctx context.Context) (panicked *PanicError, err error) {
	defer func() {
		if p := recover(); p != nil {
			panicked = NewPanicError(p)
			err = panicked
		}
	}()
	return nil, r.fn(ctx)
}

// retryWait is the wait before retrying after the given number of
// consecutive failures (at least one): RetryInterval doubled for each
// failure after the first, spread by RetryJitter, never above MaxInterval
// (by then the periodic run is due anyway).
func (r *BoundedFrequencyRunner) retryWait(failures int) time.Duration {
	wait := r.retryInterval
	for i := 1; i < failures && wait < r.maxInterval; i++ {
		wait *= 2
	}
	wait = min(wait, r.maxInterval)
	if r.retryJitter > 0 {
		spread := 1 + r.retryJitter*(2*r.rand()-1)
		wait = time.Duration(float64(wait) * spread)
	}
	return min(wait, r.maxInterval)
}

// PanicError is a panic recovered from a run, with the stack where it was
// recovered.
type PanicError struct {
	// Value is what was passed to panic.
	Value any
	// Stack is the goroutine's stack at the recovery.
	Stack []byte
}

// NewPanicError wraps a recovered panic value with the current stack; call
// it in the deferred function that recovered.
func NewPanicError(value any) *PanicError {
	return &PanicError{Value: value, Stack: debug.Stack()}
}

func (e *PanicError) Error() string { return fmt.Sprintf("panic: %v", e.Value) }

// Unwrap returns the panic value when it is an error.
func (e *PanicError) Unwrap() error {
	if err, ok := e.Value.(error); ok {
		return err
	}
	return nil
}
