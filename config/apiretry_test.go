package config

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/klog/v2"
)

func TestRetryingTransport(t *testing.T) {
	for _, tc := range []struct {
		name string
		// failures are the answers before a 200 (0: a refused
		// connection).
		failures []int
		method   string
		maxWait  time.Duration
		// cancelAfter cancels the request's context.
		cancelAfter time.Duration
		wantStatus  int
		wantErr     bool
		wantCalls   int
	}{
		{name: "answers at once", method: http.MethodGet, wantStatus: 200, wantCalls: 1},
		{name: "refused connections, then up", failures: []int{0, 0, 0}, method: http.MethodGet, wantStatus: 200, wantCalls: 4},
		{name: "forbidden while the authorizer starts, then up", failures: []int{403, 403}, method: http.MethodGet, wantStatus: 200, wantCalls: 3},
		{name: "unavailable, then up", failures: []int{503, 500, 429}, method: http.MethodGet, wantStatus: 200, wantCalls: 4},
		{name: "not found is an answer", failures: []int{404}, method: http.MethodGet, wantStatus: 404, wantCalls: 1},
		{name: "gone is an answer (the reflector relists)", failures: []int{410}, method: http.MethodGet, wantStatus: 410, wantCalls: 1},
		{name: "POST is not retried", failures: []int{503}, method: http.MethodPost, wantStatus: 503, wantCalls: 1},
		{name: "gives up after MaxWait", failures: []int{503, 503, 503, 503, 503, 503, 503, 503}, method: http.MethodGet, maxWait: 25 * time.Millisecond, wantStatus: 503},
		{name: "a cancelled request stops", failures: []int{0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, method: http.MethodGet, cancelAfter: 30 * time.Millisecond, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
				n := int(calls.Add(1)) - 1
				if n < len(tc.failures) {
					if tc.failures[n] == 0 {
						// A refused connection: hijack and close.
						conn, _, err := w.(http.Hijacker).Hijack()
						if err == nil {
							_ = conn.(*net.TCPConn).SetLinger(0)
							_ = conn.Close()
						}
						return
					}
					w.WriteHeader(tc.failures[n])
					return
				}
				w.WriteHeader(http.StatusOK)
			}))
			defer srv.Close()
			rt := NewRetryingTransport(srv.Client().Transport, RetryOptions{Interval: 5 * time.Millisecond, MaxWait: tc.maxWait, Logger: klog.Background()})
			ctx := context.Background()
			if tc.cancelAfter > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.cancelAfter)
				defer cancel()
			}
			req, err := http.NewRequestWithContext(ctx, tc.method, srv.URL+"/api/v1/services", nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := rt.RoundTrip(req)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("status %d, want an error", resp.StatusCode)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			if resp.StatusCode != tc.wantStatus {
				t.Errorf("status %d, want %d", resp.StatusCode, tc.wantStatus)
			}
			if tc.wantCalls > 0 && int(calls.Load()) != tc.wantCalls {
				t.Errorf("%d requests, want %d", calls.Load(), tc.wantCalls)
			}
		})
	}
}
