package netlink

import (
	"context"
	"errors"
	"fmt"
	"time"

	vnl "github.com/vishvananda/netlink"
	"k8s.io/klog/v2"
)

// ErrDumpInterrupted is the netlink library's report that the kernel
// flagged a dump as interrupted (NLM_F_DUMP_INTR): the object list changed
// while it was being read, so the result may be incomplete or inconsistent.
var ErrDumpInterrupted = vnl.ErrDumpInterrupted

const (
	// DumpAttempts is how many times RetryDump runs an interrupted dump
	// before giving up.
	DumpAttempts = 5
	// dumpBackoff is the pause before the first retry; it doubles before
	// each further one.
	dumpBackoff = time.Millisecond
)

// RetryDump runs dump, and runs it again, after a short pause, as long as
// it reports ErrDumpInterrupted, at most DumpAttempts times in all. Any
// other error is returned at once. Errors name op (such as "listing
// addresses") and wrap the cause: the dump's error, and ctx's when it ends
// while waiting to retry. The last result, possibly partial, is returned
// with the error.
func RetryDump[T any](ctx context.Context, op string, dump func() (T, error)) (T, error) {
	backoff := dumpBackoff
	for attempt := 1; ; attempt++ {
		res, err := dump()
		switch {
		case err == nil:
			return res, nil
		case !errors.Is(err, ErrDumpInterrupted):
			return res, fmt.Errorf("%s: %w", op, err)
		}
		if attempt == DumpAttempts {
			return res, fmt.Errorf("%s: dump interrupted %d times in a row: %w", op, attempt, err)
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return res, fmt.Errorf("%s: dump interrupted (%w), not retried: %w", op, err, context.Cause(ctx))
		case <-t.C:
		}
		backoff *= 2
		klog.FromContext(ctx).V(4).Info("Retrying interrupted netlink dump", "operation", op, "attempt", attempt+1)
	}
}
