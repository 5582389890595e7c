package config

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

// RetryOptions configure NewRetryingTransport.
type RetryOptions struct {
	// Interval is the wait between attempts; default 500ms.
	Interval time.Duration
	// MaxWait bounds how long one request keeps retrying before its
	// error goes back to the caller; default 2 minutes.
	MaxWait time.Duration
	// Logger logs the first failure of a request (V(2)) and its recovery.
	Logger klog.Logger
}

// NewRetryingTransport wraps rt so that the informers' list and watch
// requests (GETs) ride out an API server that is down or starting: a
// request refused at the connection, or answered 403, 429, 500, 502, 503
// or 504 (an API server whose authorizer or storage is not ready yet), is
// sent again every Interval until it gets another answer, its context ends
// or MaxWait passes.
//
// Without it client-go's reflectors back off exponentially on such
// failures (0.8 s doubling to 30 s, with jitter): after a 30 s outage the
// first relist came 26 s (Services) and 49 s (EndpointSlices) after the API
// server was back, and changes made meanwhile waited that long to be
// programmed. With it a reflector's request simply waits for the server,
// and goes through within Interval of its return.
//
// Other methods (events, the Node lookup) are not retried here.
func NewRetryingTransport(rt http.RoundTripper, opts RetryOptions) http.RoundTripper {
	if opts.Interval <= 0 {
		opts.Interval = 500 * time.Millisecond
	}
	if opts.MaxWait <= 0 {
		opts.MaxWait = 2 * time.Minute
	}
	return &retryingTransport{rt: rt, opts: opts}
}

type retryingTransport struct {
	rt   http.RoundTripper
	opts RetryOptions
}

func (t *retryingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Method != http.MethodGet || req.Body != nil && req.Body != http.NoBody {
		return t.rt.RoundTrip(req)
	}
	ctx := req.Context()
	start := time.Now()
	for attempt := 0; ; attempt++ {
		resp, err := t.rt.RoundTrip(req)
		why := retryable(resp, err)
		if why == "" || time.Since(start) >= t.opts.MaxWait || ctx.Err() != nil {
			if attempt > 0 && why == "" {
				t.opts.Logger.Info("API server answers again", "url", req.URL.Path, "after", time.Since(start).Round(time.Millisecond))
			}
			return resp, err
		}
		if resp != nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
			_ = resp.Body.Close()
		}
		if attempt == 0 {
			t.opts.Logger.V(2).Info("API server not answering; retrying the request until it does", "url", req.URL.Path, "reason", why)
		}
		timer := time.NewTimer(t.opts.Interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
	}
}

// retryable says why a request should be sent again ("" if not).
func retryable(resp *http.Response, err error) string {
	if err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return ""
		}
		var op *net.OpError
		if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
			errors.Is(err, syscall.EHOSTUNREACH) || errors.Is(err, io.EOF) || errors.As(err, &op) {
			return err.Error()
		}
		return ""
	}
	switch resp.StatusCode {
	case http.StatusForbidden, http.StatusTooManyRequests, http.StatusInternalServerError,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return resp.Status
	}
	return ""
}
