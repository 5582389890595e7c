package deadline

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// slack is how late past its deadline a call may return on a loaded
// machine.
const slack = 2 * time.Second

func TestGuardDo(t *testing.T) {
	errKernel := errors.New("kernel says no")
	cases := []struct {
		name    string
		timeout time.Duration
		// ctxTimeout, when set, is the caller's deadline.
		ctxTimeout time.Duration
		cancel     bool // the caller cancels after 50ms
		// fn runs until release is closed when it blocks.
		blocks bool
		// failsLate: fn fails just after its deadline, as a netlink
		// socket timeout set to the same value does.
		failsLate bool
		fnErr     error
		wantErr   error // matched with errors.Is
		timeOut   bool  // IsTimeout(err)
		// wantWithin bounds the caller's wait.
		wantWithin time.Duration
	}{
		{name: "returns its result", timeout: time.Minute, fnErr: errKernel, wantErr: errKernel, wantWithin: slack},
		{name: "succeeds", timeout: time.Minute, wantWithin: slack},
		{name: "own timeout", timeout: 100 * time.Millisecond, blocks: true, wantErr: context.DeadlineExceeded, timeOut: true, wantWithin: 100*time.Millisecond + slack},
		{name: "caller's earlier deadline", timeout: time.Hour, ctxTimeout: 100 * time.Millisecond, blocks: true, wantErr: context.DeadlineExceeded, timeOut: true, wantWithin: 100*time.Millisecond + slack},
		{name: "no own timeout, caller's deadline", timeout: 0, ctxTimeout: 100 * time.Millisecond, blocks: true, wantErr: context.DeadlineExceeded, timeOut: true, wantWithin: 100*time.Millisecond + slack},
		{name: "caller cancels", timeout: time.Hour, cancel: true, blocks: true, wantErr: context.Canceled, wantWithin: 50*time.Millisecond + slack},
		{name: "fails at the deadline", timeout: 100 * time.Millisecond, failsLate: true, wantErr: context.DeadlineExceeded, timeOut: true, wantWithin: 100*time.Millisecond + slack},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var g Guard
			ctx := t.Context()
			if tc.ctxTimeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.ctxTimeout)
				defer cancel()
			}
			if tc.cancel {
				var cancel context.CancelFunc
				ctx, cancel = context.WithCancel(ctx)
				time.AfterFunc(50*time.Millisecond, cancel)
			}
			release := make(chan struct{})
			defer close(release)
			var aborted atomic.Int32
			start := time.Now()
			err := g.Do(ctx, "test call", tc.timeout, func(fctx context.Context) error {
				if _, ok := fctx.Deadline(); !ok && (tc.timeout > 0 || tc.ctxTimeout > 0) {
					t.Error("fn's context has no deadline")
				}
				if tc.blocks {
					<-release
				}
				if tc.failsLate {
					dl, _ := fctx.Deadline()
					time.Sleep(time.Until(dl) + time.Millisecond)
					return errors.New("resource temporarily unavailable")
				}
				return tc.fnErr
			}, func() { aborted.Add(1) })
			elapsed := time.Since(start)
			switch {
			case tc.wantErr == nil && err != nil:
				t.Fatalf("Do = %v, want success", err)
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Fatalf("Do = %v, want an error wrapping %v", err, tc.wantErr)
			}
			if IsTimeout(err) != tc.timeOut {
				t.Errorf("IsTimeout(%v) = %v, want %v", err, !tc.timeOut, tc.timeOut)
			}
			if elapsed > tc.wantWithin {
				t.Errorf("Do returned after %v, want within %v", elapsed, tc.wantWithin)
			}
			if tc.blocks {
				if !strings.Contains(err.Error(), "test call") || !strings.Contains(err.Error(), "abandoned") {
					t.Errorf("error %q does not name the call and say it was abandoned", err)
				}
				if got := aborted.Load(); got != 1 {
					t.Errorf("abort called %d times, want once", got)
				}
			}
			if tc.wantErr == nil || tc.fnErr != nil {
				if got := aborted.Load(); got != 0 {
					t.Errorf("abort called %d times for a call that returned in time", got)
				}
			}
		})
	}
}

// TestGuardRefusesWhileStuck checks that one hung call costs one goroutine:
// while it runs, new calls fail at once as timeouts naming it, and they run
// again once it has returned.
func TestGuardRefusesWhileStuck(t *testing.T) {
	var g Guard
	release := make(chan struct{})
	returned := make(chan struct{})
	err := g.Do(t.Context(), "hung request", 50*time.Millisecond, func(context.Context) error {
		<-release
		defer close(returned)
		return nil
	}, nil)
	if !IsTimeout(err) {
		t.Fatalf("hung call: %v, want a timeout", err)
	}
	if n := g.Stuck(); n != 1 {
		t.Fatalf("Stuck() = %d, want 1", n)
	}
	ran := false
	start := time.Now()
	err = g.Do(t.Context(), "next request", time.Minute, func(context.Context) error { ran = true; return nil }, nil)
	if ran || !IsTimeout(err) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("call while stuck: ran %v, err %v; want a timeout without running", ran, err)
	}
	if !strings.Contains(err.Error(), `"hung request"`) || time.Since(start) > slack {
		t.Errorf("refusal %q after %v: want it at once, naming the hung call", err, time.Since(start))
	}
	close(release)
	<-returned
	// The hung call's goroutine records its end just after returning.
	for g.Stuck() != 0 {
		if time.Since(start) > slack {
			t.Fatal("the abandoned call returned but the Guard still counts it")
		}
		time.Sleep(time.Millisecond)
	}
	if err := g.Do(t.Context(), "after", time.Minute, func(context.Context) error { ran = true; return nil }, nil); err != nil || !ran {
		t.Fatalf("call after the hung one returned: ran %v, err %v", ran, err)
	}
}

// TestGuardDoneContext checks that a caller whose context has ended runs
// nothing.
func TestGuardDoneContext(t *testing.T) {
	var g Guard
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	ran := false
	err := g.Do(ctx, "late", time.Minute, func(context.Context) error { ran = true; return nil }, nil)
	if ran || !errors.Is(err, context.Canceled) {
		t.Fatalf("ran %v, err %v; want context.Canceled without running", ran, err)
	}
}

// TestGuardPanicReachesCaller checks that a panic in a guarded call is
// raised again in the caller's goroutine (where a sync's recovery can see
// it), with the stack of the original panic.
func TestGuardPanicReachesCaller(t *testing.T) {
	var g Guard
	var got any
	func() {
		defer func() { got = recover() }()
		_ = g.Do(t.Context(), "panicky", time.Minute, func(context.Context) error { panic("library bug") }, nil)
	}()
	p, ok := got.(*PanicError)
	if !ok {
		t.Fatalf("recovered %v (%T), want a *PanicError", got, got)
	}
	if p.Value != "library bug" || !strings.Contains(string(p.Stack), "TestGuardPanicReachesCaller") {
		t.Errorf("panic %v with stack\n%s\nwant the original value and stack", p.Value, p.Stack)
	}
	if n := g.Stuck(); n != 0 {
		t.Errorf("Stuck() = %d after a call that panicked, want 0", n)
	}
	if err := g.Do(t.Context(), "after", time.Minute, func(context.Context) error { return nil }, nil); err != nil {
		t.Errorf("call after a panic: %v", err)
	}
}
