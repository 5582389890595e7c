package netlink

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// scriptedDump is a dump whose successive runs return the errors of
// script (nil once script is used up), each with the run's number as the
// result, and which may cancel a context on its first run.
type scriptedDump struct {
	script      []error
	runs        int
	cancelFirst context.CancelFunc
}

func (d *scriptedDump) run() (int, error) {
	d.runs++
	if d.runs == 1 && d.cancelFirst != nil {
		d.cancelFirst()
	}
	if d.runs <= len(d.script) {
		return d.runs, d.script[d.runs-1]
	}
	return d.runs, nil
}

func TestRetryDump(t *testing.T) {
	interrupted := fmt.Errorf("listing things: %w", ErrDumpInterrupted)
	always := make([]error, DumpAttempts+1)
	for i := range always {
		always[i] = interrupted
	}
	cases := []struct {
		name   string
		script []error
		cancel bool
		// wantRuns is how often the dump runs; wantResult the result
		// returned (the last run's).
		wantRuns   int
		wantResult int
		wantErrIs  []error
		wantErrMsg string
		wantNoErr  bool
	}{{
		name:       "success at once",
		wantRuns:   1,
		wantResult: 1,
		wantNoErr:  true,
	}, {
		name:       "interrupted then success",
		script:     []error{interrupted, interrupted},
		wantRuns:   3,
		wantResult: 3,
		wantNoErr:  true,
	}, {
		name:       "always interrupted",
		script:     always,
		wantRuns:   DumpAttempts,
		wantResult: DumpAttempts,
		wantErrIs:  []error{ErrDumpInterrupted},
		wantErrMsg: "list things: dump interrupted 5 times in a row",
	}, {
		name:       "other error not retried",
		script:     []error{unix.EPERM},
		wantRuns:   1,
		wantResult: 1,
		wantErrIs:  []error{unix.EPERM},
		wantErrMsg: "list things: " + unix.EPERM.Error(),
	}, {
		name:       "other error after an interruption",
		script:     []error{interrupted, unix.ENOBUFS},
		wantRuns:   2,
		wantResult: 2,
		wantErrIs:  []error{unix.ENOBUFS},
	}, {
		name:       "context cancelled while interrupted",
		script:     []error{interrupted},
		cancel:     true,
		wantRuns:   1,
		wantResult: 1,
		wantErrIs:  []error{ErrDumpInterrupted, context.Canceled},
		wantErrMsg: "list things: dump interrupted",
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			d := &scriptedDump{script: tc.script}
			if tc.cancel {
				d.cancelFirst = cancel
			}
			got, err := RetryDump(ctx, "list things", d.run)
			if d.runs != tc.wantRuns {
				t.Errorf("dump ran %d times, want %d", d.runs, tc.wantRuns)
			}
			if got != tc.wantResult {
				t.Errorf("result %d, want %d", got, tc.wantResult)
			}
			if tc.wantNoErr {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("no error")
			}
			for _, target := range tc.wantErrIs {
				if !errors.Is(err, target) {
					t.Errorf("error %q is not %v", err, target)
				}
			}
			if !strings.Contains(err.Error(), tc.wantErrMsg) {
				t.Errorf("error %q does not contain %q", err, tc.wantErrMsg)
			}
		})
	}
}
