package runner

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/clock"
	testingclock "k8s.io/utils/clock/testing"
)

func TestNewBoundedFrequencyRunnerValidation(t *testing.T) {
	fn := func(context.Context) error { return nil }
	valid := Options{Name: "test", Fn: fn, MinInterval: time.Second, RetryInterval: 2 * time.Second, MaxInterval: time.Minute}
	tests := []struct {
		name   string
		modify func(*Options)
		// wantErr lists substrings the error must contain; nil means valid.
		wantErr []string
	}{
		{name: "valid", modify: func(*Options) {}},
		{name: "zero MinInterval is valid", modify: func(o *Options) { o.MinInterval = 0 }},
		{name: "MinInterval equal to MaxInterval is valid", modify: func(o *Options) { o.MinInterval = o.MaxInterval }},
		{name: "RetryInterval above MaxInterval is valid", modify: func(o *Options) { o.RetryInterval = time.Hour }},
		{name: "nil Clock is valid", modify: func(o *Options) { o.Clock = nil }},
		{name: "nil Fn", modify: func(o *Options) { o.Fn = nil }, wantErr: []string{"Fn"}},
		{name: "zero MaxInterval", modify: func(o *Options) { o.MinInterval, o.MaxInterval = 0, 0 }, wantErr: []string{"MaxInterval"}},
		{name: "negative MaxInterval", modify: func(o *Options) { o.MaxInterval = -time.Second }, wantErr: []string{"MaxInterval"}},
		{name: "MinInterval above MaxInterval", modify: func(o *Options) { o.MinInterval = 2 * time.Minute }, wantErr: []string{"MinInterval", "MaxInterval"}},
		{name: "negative MinInterval", modify: func(o *Options) { o.MinInterval = -time.Second }, wantErr: []string{"MinInterval"}},
		{name: "zero RetryInterval", modify: func(o *Options) { o.RetryInterval = 0 }, wantErr: []string{"RetryInterval"}},
		{name: "negative RetryInterval", modify: func(o *Options) { o.RetryInterval = -time.Second }, wantErr: []string{"RetryInterval"}},
		{name: "RetryJitter 0.2 is valid", modify: func(o *Options) { o.RetryJitter = 0.2 }},
		{name: "negative RetryJitter", modify: func(o *Options) { o.RetryJitter = -0.1 }, wantErr: []string{"RetryJitter"}},
		{name: "RetryJitter of 1", modify: func(o *Options) { o.RetryJitter = 1 }, wantErr: []string{"RetryJitter"}},
		{
			name:    "every problem is reported",
			modify:  func(o *Options) { o.Fn, o.RetryInterval, o.MaxInterval = nil, 0, 0 },
			wantErr: []string{"Fn", "RetryInterval", "MaxInterval"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			opts := valid
			tc.modify(&opts)
			r, err := NewBoundedFrequencyRunner(opts)
			if tc.wantErr == nil {
				if err != nil {
					t.Fatalf("NewBoundedFrequencyRunner() error = %v, want nil", err)
				}
				if r == nil {
					t.Fatal("NewBoundedFrequencyRunner() returned a nil runner")
				}
				return
			}
			if err == nil {
				t.Fatalf("NewBoundedFrequencyRunner() error = nil, want one naming %q", tc.wantErr)
			}
			if r != nil {
				t.Errorf("NewBoundedFrequencyRunner() returned a runner along with error %v", err)
			}
			for _, want := range tc.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not name %q", err, want)
				}
			}
			if !strings.Contains(err.Error(), `"test"`) {
				t.Errorf("error %q does not name the runner", err)
			}
		})
	}
}

// Intervals shared by the scenario tests.
const (
	minI   = 1 * time.Second
	retryI = 3 * time.Second
	maxI   = 10 * time.Second
)

var errSync = errors.New("sync failed")

func TestBoundedFrequencyRunner(t *testing.T) {
	tests := []struct {
		name string
		// opts adjusts the default options (minI, retryI, maxI); nil keeps them.
		opts  func(*Options)
		steps []step
	}{
		{
			name: "first request runs immediately",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(nil),
				expectWait(maxI),
			},
		},
		{
			name: "requests before Loop starts coalesce into one immediate run",
			steps: []step{
				requests(100), startLoop(),
				expectRun(0), finish(nil),
				expectWait(maxI), expectQuiet(),
			},
		},
		{
			name: "burst during a run coalesces into one run after the min interval",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), requests(50), finish(nil),
				expectWait(minI), advance(minI), expectRun(minI), finish(nil),
				expectWait(minI + maxI), expectQuiet(),
			},
		},
		{
			name: "requests while waiting for the min interval coalesce into one run",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(nil), expectWait(maxI),
				request(), expectWait(minI),
				advance(minI / 4), request(), expectWait(minI),
				advance(minI / 4), request(), expectWait(minI),
				advance(minI / 2), expectRun(minI), finish(nil),
				expectWait(minI + maxI), expectQuiet(),
			},
		},
		{
			name: "no run before the min interval, a run right at it",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(nil), expectWait(maxI),
				request(), expectWait(minI),
				advance(minI - time.Nanosecond), expectQuiet(),
				advance(time.Nanosecond), expectRun(minI), finish(nil),
				expectWait(minI + maxI),
			},
		},
		{
			name: "min interval is measured from the end of the previous run",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), advance(5 * time.Second), request(), finish(nil),
				expectWait(5*time.Second + minI), advance(minI), expectRun(5*time.Second + minI), finish(nil),
				expectWait(5*time.Second + minI + maxI),
			},
		},
		{
			name: "request after the min interval has passed runs immediately",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(nil), expectWait(maxI),
				advance(2 * minI), request(), expectRun(2 * minI), finish(nil),
				expectWait(2*minI + maxI),
			},
		},
		{
			name: "zero min interval runs each request right away, still coalescing",
			opts: func(o *Options) { o.MinInterval = 0 },
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(nil), expectWait(maxI),
				request(), expectRun(0), requests(20), finish(nil),
				expectRun(0), finish(nil),
				expectWait(maxI), expectQuiet(),
			},
		},
		{
			name: "periodic runs at the max interval without requests",
			steps: []step{
				startLoop(), expectWait(maxI),
				advance(maxI - time.Nanosecond), expectQuiet(),
				advance(time.Nanosecond), expectRun(maxI), finish(nil),
				expectWait(2 * maxI), advance(maxI), expectRun(2 * maxI), finish(nil),
				expectWait(3 * maxI), advance(maxI), expectRun(3 * maxI), finish(nil),
				expectWait(4 * maxI),
			},
		},
		{
			name: "max interval is measured from the end of the latest run",
			steps: []step{
				startLoop(), expectWait(maxI),
				advance(4 * time.Second), request(), expectRun(4 * time.Second),
				advance(2 * time.Second), finish(nil),
				expectWait(6*time.Second + maxI), advance(maxI), expectRun(6*time.Second + maxI), finish(nil),
			},
		},
		{
			name: "failed run is retried after the retry interval",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync),
				expectWait(retryI), advance(retryI - time.Nanosecond), expectQuiet(),
				advance(time.Nanosecond), expectRun(retryI), finish(nil),
				expectWait(retryI + maxI),
			},
		},
		{
			name: "error then success stops retrying",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync),
				expectWait(retryI), advance(retryI), expectRun(retryI), finish(errSync),
				// The second consecutive failure waits twice as long.
				expectWait(3 * retryI), advance(2 * retryI), expectRun(3 * retryI), finish(nil),
				expectWait(3*retryI + maxI), advance(maxI), expectRun(3*retryI + maxI), finish(nil),
				expectWait(3*retryI + 2*maxI),
			},
		},
		{
			// 3s, 6s, then 12s capped at the 10s max interval; a success
			// starts again at 3s.
			name: "consecutive failures back off exponentially up to the max interval, reset by a success",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync),
				expectWait(3 * time.Second), advance(3 * time.Second), expectRun(3 * time.Second), finish(errSync),
				expectWait(9 * time.Second), advance(6 * time.Second), expectRun(9 * time.Second), finish(errSync),
				expectWait(19 * time.Second), advance(10 * time.Second), expectRun(19 * time.Second), finish(errSync),
				expectWait(29 * time.Second), advance(10 * time.Second), expectRun(29 * time.Second), finish(nil),
				expectWait(39 * time.Second), advance(10 * time.Second), expectRun(39 * time.Second), finish(errSync),
				expectWait(42 * time.Second),
			},
		},
		{
			name: "a request during backoff still runs after the min interval, and its failure backs off further",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync), expectWait(3 * time.Second),
				request(), expectWait(minI), advance(minI), expectRun(minI), finish(errSync),
				expectWait(minI + 6*time.Second),
			},
		},
		{
			// spread = 1 + 0.2 * (2*rand - 1): rand 0.25 gives 0.9.
			name: "jitter shortens a retry",
			opts: func(o *Options) { o.RetryJitter, o.Rand = 0.2, func() float64 { return 0.25 } },
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync),
				expectWait(2700 * time.Millisecond), advance(2700 * time.Millisecond), expectRun(2700 * time.Millisecond), finish(errSync),
				expectWait(2700*time.Millisecond + 5400*time.Millisecond),
			},
		},
		{
			// rand 0.75 gives 1.1: 3.3s, 6.6s, then 11s capped at 10s.
			name: "jitter lengthens a retry, never past the max interval",
			opts: func(o *Options) { o.RetryJitter, o.Rand = 0.2, func() float64 { return 0.75 } },
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync),
				expectWait(3300 * time.Millisecond), advance(3300 * time.Millisecond), expectRun(3300 * time.Millisecond), finish(errSync),
				expectWait(9900 * time.Millisecond), advance(6600 * time.Millisecond), expectRun(9900 * time.Millisecond), finish(errSync),
				expectWait(19900 * time.Millisecond),
			},
		},
		{
			name: "a panicking run is recovered and retried like a failure",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finishPanic("boom"),
				expectWait(retryI), advance(retryI), expectRun(retryI), finishPanic(errSync),
				expectWait(3 * retryI), advance(2 * retryI), expectRun(3 * retryI), finish(nil),
				expectWait(3*retryI + maxI),
			},
		},
		{
			name: "retry still respects the min interval",
			opts: func(o *Options) { o.MinInterval, o.RetryInterval = 5*time.Second, time.Second },
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync),
				expectWait(5 * time.Second), advance(5 * time.Second), expectRun(5 * time.Second), finish(nil),
				expectWait(5*time.Second + maxI),
			},
		},
		{
			name: "request sooner than the retry runs instead of it",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync), expectWait(retryI),
				advance(2 * minI), request(), expectRun(2 * minI), finish(nil),
				expectWait(2*minI + maxI), expectQuiet(),
			},
		},
		{
			name: "periodic run sooner than the retry runs instead of it",
			opts: func(o *Options) { o.RetryInterval = time.Hour },
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync), expectWait(maxI),
				advance(maxI), expectRun(maxI), finish(nil),
				expectWait(2 * maxI),
			},
		},
		{
			name: "failure of a retry in progress is retried again",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync),
				expectWait(retryI), advance(retryI), expectRun(retryI), request(), finish(errSync),
				// The request made during the failed run is served first.
				expectWait(retryI + minI), advance(minI), expectRun(retryI + minI), finish(nil),
				expectWait(retryI + minI + maxI),
			},
		},
		{
			name: "RetryAfter schedules a run",
			steps: []step{
				startLoop(), expectWait(maxI),
				retryAfter(4 * time.Second), expectWait(4 * time.Second),
				advance(4 * time.Second), expectRun(4 * time.Second), finish(nil),
				expectWait(4*time.Second + maxI),
			},
		},
		{
			name: "RetryAfter keeps the earlier of two retries",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), finish(errSync), expectWait(retryI),
				retryAfter(8 * time.Second), expectWait(retryI),
				retryAfter(2 * time.Second), expectWait(2 * time.Second),
				advance(2 * time.Second), expectRun(2 * time.Second), finish(nil),
				expectWait(2*time.Second + maxI),
			},
		},
		{
			name: "RetryAfter during a run schedules a run after it",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), retryAfter(5 * time.Second), finish(nil),
				expectWait(5 * time.Second), advance(5 * time.Second), expectRun(5 * time.Second), finish(nil),
				expectWait(5*time.Second + maxI),
			},
		},
		{
			name: "RetryAfter respects the min interval",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), retryAfter(0), finish(nil),
				expectWait(minI), advance(minI), expectRun(minI), finish(nil),
				expectWait(minI + maxI),
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			opts := Options{MinInterval: minI, RetryInterval: retryI, MaxInterval: maxI}
			if tc.opts != nil {
				tc.opts(&opts)
			}
			newHarness(t, opts).do(tc.steps...)
		})
	}
}

func TestLoopStopsOnContextCancel(t *testing.T) {
	tests := []struct {
		name  string
		steps []step
	}{
		{
			name:  "cancelled while idle",
			steps: []step{startLoop(), expectWait(maxI), cancel(), expectStopped()},
		},
		{
			name: "cancelled while waiting for the min interval with a request pending",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), request(), finish(nil), expectWait(minI),
				cancel(), expectStopped(), advance(maxI), expectQuiet(),
			},
		},
		{
			name: "cancelled during a run: the run finishes, pending requests are dropped",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), request(), cancel(), finish(nil),
				expectStopped(),
			},
		},
		{
			name: "cancelled during a run that fails: no retry",
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0), cancel(), finish(context.Canceled),
				expectStopped(),
			},
		},
		{
			name:  "cancelled before Loop starts: nothing runs",
			steps: []step{request(), cancel(), startLoop(), expectStopped()},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			newHarness(t, Options{MinInterval: minI, RetryInterval: retryI, MaxInterval: maxI}).do(tc.steps...)
		})
	}
}

// TestNoConcurrentRuns drives every trigger while a run is in progress and
// checks that the next run starts only after it ends. The harness also fails
// any test in which two calls of Fn overlap.
func TestNoConcurrentRuns(t *testing.T) {
	tests := []struct {
		name        string
		minInterval time.Duration
		steps       []step
	}{
		{
			name:        "every trigger during a run",
			minInterval: 0,
			steps: []step{
				startLoop(), expectWait(maxI),
				request(), expectRun(0),
				requests(10), retryAfter(0), advance(3 * maxI), expectQuiet(),
				finish(errSync),
				expectRun(3 * maxI), finish(nil), expectWait(4 * maxI),
			},
		},
		{
			name:        "periodic deadline passing during a long run",
			minInterval: minI,
			steps: []step{
				startLoop(), expectWait(maxI),
				advance(maxI), expectRun(maxI), advance(5 * maxI), expectQuiet(), finish(nil),
				expectWait(7 * maxI), advance(maxI), expectRun(7 * maxI), finish(nil),
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			newHarness(t, Options{MinInterval: tc.minInterval, RetryInterval: retryI, MaxInterval: maxI}).do(tc.steps...)
		})
	}
}

// TestConcurrentRequestsRealClock hammers Run and RetryAfter from many
// goroutines against the real clock: under -race it checks the locking, and
// it checks that runs never overlap and that the loop is still serving
// requests once the hammering stops.
func TestConcurrentRequestsRealClock(t *testing.T) {
	var (
		inFlight, overlaps, runs atomic.Int32
		allSent                  atomic.Bool
		served                   = make(chan struct{})
		once                     sync.Once
	)
	r, err := NewBoundedFrequencyRunner(Options{
		Name: "stress",
		Fn: func(context.Context) error {
			if inFlight.Add(1) > 1 {
				overlaps.Add(1)
			}
			defer inFlight.Add(-1)
			n := runs.Add(1)
			if allSent.Load() {
				once.Do(func() { close(served) })
			}
			if n%3 == 0 {
				return errSync
			}
			return nil
		},
		RetryInterval: time.Hour,
		MaxInterval:   time.Hour,
	})
	if err != nil {
		t.Fatal(err)
	}
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancelLoop := context.WithCancel(ctx)
	loopDone := make(chan struct{})
	go func() {
		defer close(loopDone)
		r.Loop(ctx)
	}()
	defer func() {
		cancelLoop()
		<-loopDone
	}()

	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 200 {
				if (i+j)%7 == 0 {
					r.RetryAfter(time.Hour)
				} else {
					r.Run()
				}
			}
		})
	}
	wg.Wait()
	allSent.Store(true)
	r.Run()
	select {
	case <-served:
	case <-time.After(hangTimeout):
		t.Fatalf("no run started after the final request within %v", hangTimeout)
	}
	if n := overlaps.Load(); n != 0 {
		t.Errorf("%d runs overlapped another run", n)
	}
}

func TestSecondConcurrentLoopReturns(t *testing.T) {
	h := newHarness(t, Options{MinInterval: minI, RetryInterval: retryI, MaxInterval: maxI})
	h.do(startLoop(), expectWait(maxI))
	returned := make(chan struct{})
	go func() {
		defer close(returned)
		h.r.Loop(h.ctx)
	}()
	select {
	case <-returned:
	case <-time.After(hangTimeout):
		t.Fatalf("second Loop call did not return within %v", hangTimeout)
	}
	// The first loop still serves requests, alone.
	h.do(expectQuiet(), request(), expectRun(0), finish(nil), expectWait(maxI))
}

// hangTimeout only turns a hung test into a failure; no assertion depends on
// how long anything takes.
const hangTimeout = 30 * time.Second

// notifyingClock is a FakeClock that reports each timer the loop creates,
// i.e. each time the loop is about to go idle, with the time the timer fires.
// The harness and the loop run in lockstep: the loop cannot create a timer
// until the test receives the event, and the test never moves the clock
// while the loop is between reading it and creating a timer.
type notifyingClock struct {
	*testingclock.FakeClock
	timers chan time.Time
	done   <-chan struct{}
}

func (c *notifyingClock) NewTimer(d time.Duration) clock.Timer {
	fires := c.Now().Add(d)
	timer := c.FakeClock.NewTimer(d)
	select {
	case c.timers <- fires:
	case <-c.done:
	}
	return timer
}

// call is one invocation of Fn, blocked until the test finishes it.
type call struct {
	at     time.Time
	result chan error
}

// harness runs a BoundedFrequencyRunner on a notifyingClock with an Fn that
// hands every call to the test, so the test observes each step the loop
// takes: a run starting (on calls) or the loop going idle (on clock.timers).
type harness struct {
	t       *testing.T
	clock   *notifyingClock
	start   time.Time
	r       *BoundedFrequencyRunner
	calls   chan *call
	current *call

	ctx      context.Context
	cancel   context.CancelFunc
	stop     chan struct{} // closed at cleanup to release a blocked loop
	started  bool
	loopDone chan struct{}

	inFlight, overlaps atomic.Int32
}

var errHarnessStopped = errors.New("harness stopped")

func newHarness(t *testing.T, opts Options) *harness {
	t.Helper()
	start := time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)
	stop := make(chan struct{})
	h := &harness{
		t:        t,
		clock:    &notifyingClock{FakeClock: testingclock.NewFakeClock(start), timers: make(chan time.Time), done: stop},
		start:    start,
		calls:    make(chan *call),
		stop:     stop,
		loopDone: make(chan struct{}),
	}
	_, ctx := ktesting.NewTestContext(t)
	h.ctx, h.cancel = context.WithCancel(ctx)
	opts.Name = t.Name()
	opts.Clock = h.clock
	opts.Fn = h.fn
	r, err := NewBoundedFrequencyRunner(opts)
	if err != nil {
		t.Fatalf("NewBoundedFrequencyRunner() error = %v", err)
	}
	h.r = r
	t.Cleanup(func() {
		h.cancel()
		close(h.stop)
		if h.started {
			select {
			case <-h.loopDone:
			case <-time.After(hangTimeout):
				t.Errorf("Loop did not return within %v of cancellation", hangTimeout)
			}
		}
		if n := h.overlaps.Load(); n != 0 {
			t.Errorf("%d runs overlapped another run", n)
		}
	})
	return h
}

func (h *harness) fn(context.Context) error {
	if h.inFlight.Add(1) > 1 {
		h.overlaps.Add(1)
	}
	defer h.inFlight.Add(-1)
	c := &call{at: h.clock.Now(), result: make(chan error)}
	select {
	case h.calls <- c:
	case <-h.stop:
		return errHarnessStopped
	}
	select {
	case err := <-c.result:
		var p panicWith
		if errors.As(err, &p) {
			panic(p.value)
		}
		return err
	case <-h.stop:
		return errHarnessStopped
	}
}

// panicWith, given to a run as its result, makes Fn panic with value.
type panicWith struct{ value any }

func (p panicWith) Error() string { return fmt.Sprintf("panic with %v", p.value) }

func (h *harness) do(steps ...step) {
	h.t.Helper()
	for _, s := range steps {
		s(h)
	}
}

// step is one action or expectation of a scenario.
type step func(h *harness)

func startLoop() step {
	return func(h *harness) {
		h.started = true
		go func() {
			defer close(h.loopDone)
			h.r.Loop(h.ctx)
		}()
	}
}

func request() step { return requests(1) }

func requests(n int) step {
	return func(h *harness) {
		for range n {
			h.r.Run()
		}
	}
}

func retryAfter(d time.Duration) step { return func(h *harness) { h.r.RetryAfter(d) } }

func advance(d time.Duration) step { return func(h *harness) { h.clock.Step(d) } }

func cancel() step { return func(h *harness) { h.cancel() } }

// expectRun waits for the next loop event and requires it to be a run
// starting at the given offset from the start of the test.
func expectRun(at time.Duration) step {
	return func(h *harness) {
		h.t.Helper()
		select {
		case c := <-h.calls:
			if got := c.at.Sub(h.start); got != at {
				h.t.Fatalf("run started at %v, want %v", got, at)
			}
			h.current = c
		case fires := <-h.clock.timers:
			h.t.Fatalf("loop went idle until %v, want a run at %v", fires.Sub(h.start), at)
		case <-h.loopDone:
			h.t.Fatalf("Loop returned, want a run at %v", at)
		case <-time.After(hangTimeout):
			h.t.Fatalf("no run within %v, want one at %v", hangTimeout, at)
		}
	}
}

// finish ends the run in progress with err.
func finish(err error) step {
	return func(h *harness) {
		h.t.Helper()
		if h.current == nil {
			h.t.Fatal("finish: no run in progress")
		}
		h.current.result <- err
		h.current = nil
	}
}

// finishPanic makes the run in progress panic with value.
func finishPanic(value any) step { return finish(panicWith{value}) }

// expectWait waits for the next loop event and requires it to be the loop
// going idle until the given offset from the start of the test (unless woken
// by a request sooner). With a fake clock nothing can run before then.
func expectWait(until time.Duration) step {
	return func(h *harness) {
		h.t.Helper()
		select {
		case fires := <-h.clock.timers:
			if got := fires.Sub(h.start); got != until {
				h.t.Fatalf("loop went idle until %v, want until %v", got, until)
			}
		case c := <-h.calls:
			h.t.Fatalf("run started at %v, want the loop to wait until %v", c.at.Sub(h.start), until)
		case <-h.loopDone:
			h.t.Fatalf("Loop returned, want it to wait until %v", until)
		case <-time.After(hangTimeout):
			h.t.Fatalf("loop did not go idle within %v, want it to wait until %v", hangTimeout, until)
		}
	}
}

// expectQuiet requires that no run has started and the loop has not gone
// idle again. Used where the loop is blocked (idle with a timer that has not
// fired, inside a run, or stopped) and any event would be a bug.
func expectQuiet() step {
	return func(h *harness) {
		h.t.Helper()
		select {
		case c := <-h.calls:
			h.t.Fatalf("unexpected run at %v", c.at.Sub(h.start))
		case fires := <-h.clock.timers:
			h.t.Fatalf("unexpected wait until %v", fires.Sub(h.start))
		default:
		}
	}
}

// expectStopped waits for Loop to return, with no run or wait before that.
func expectStopped() step {
	return func(h *harness) {
		h.t.Helper()
		select {
		case <-h.loopDone:
		case c := <-h.calls:
			h.t.Fatalf("run started at %v, want Loop to return", c.at.Sub(h.start))
		case fires := <-h.clock.timers:
			h.t.Fatalf("loop went idle until %v, want it to return", fires.Sub(h.start))
		case <-time.After(hangTimeout):
			h.t.Fatalf("Loop did not return within %v", hangTimeout)
		}
	}
}
