package config

import (
	"context"
	"testing"
	"time"

	"k8s.io/klog/v2"
)

// activity is a cache.DoneChecker whose channel the test closes.
type activity struct{ done chan struct{} }

func (a activity) Name() string          { return "activity" }
func (a activity) Done() <-chan struct{} { return a.done }

func TestWaitForSync(t *testing.T) {
	tests := []struct {
		name string
		// doneAfter closes the checker's channel after that long (< 0:
		// never); cancelAfter ends the context after that long (< 0:
		// never).
		doneAfter, cancelAfter time.Duration
		want                   bool
	}{
		{name: "already done", doneAfter: 0, cancelAfter: -1, want: true},
		{name: "done later", doneAfter: 20 * time.Millisecond, cancelAfter: -1, want: true},
		{name: "context ends first", doneAfter: -1, cancelAfter: 20 * time.Millisecond, want: false},
		{name: "context already ended", doneAfter: -1, cancelAfter: 0, want: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			a := activity{done: make(chan struct{})}
			switch {
			case tc.doneAfter == 0:
				close(a.done)
			case tc.doneAfter > 0:
				timer := time.AfterFunc(tc.doneAfter, func() { close(a.done) })
				defer timer.Stop()
			}
			switch {
			case tc.cancelAfter == 0:
				cancel()
			case tc.cancelAfter > 0:
				timer := time.AfterFunc(tc.cancelAfter, cancel)
				defer timer.Stop()
			}
			if got := waitForSync(ctx, klog.Background(), a); got != tc.want {
				t.Errorf("waitForSync = %v, want %v", got, tc.want)
			}
		})
	}
}
