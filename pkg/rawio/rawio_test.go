package rawio

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func newTestPipe(t *testing.T) (r, w *os.File, rp, wp FD) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close(); _ = w.Close() })
	if rp, err = New(r); err != nil {
		t.Fatal(err)
	}
	if wp, err = New(w); err != nil {
		t.Fatal(err)
	}
	return r, w, rp, wp
}

func TestPipe(t *testing.T) {
	t.Run("a write larger than the pipe waits for the reader", func(t *testing.T) {
		_, w, rp, wp := newTestPipe(t)
		data := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
		got := make(chan []byte)
		go func() {
			b, _ := io.ReadAll(rp)
			got <- b
		}()
		n, err := wp.Write(data)
		if err != nil || n != len(data) {
			t.Fatalf("Write = %d, %v; want %d, nil", n, err, len(data))
		}
		_ = w.Close()
		if b := <-got; !bytes.Equal(b, data) {
			t.Fatalf("read %d bytes, want the %d written", len(b), len(data))
		}
	})
	t.Run("a read of an empty pipe ends at the deadline", func(t *testing.T) {
		r, _, rp, _ := newTestPipe(t)
		if err := r.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		if _, err := rp.Read(make([]byte, 10)); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("Read = %v, want the deadline's error", err)
		}
	})
	t.Run("a read of a closed writer's pipe is EOF", func(t *testing.T) {
		_, w, rp, wp := newTestPipe(t)
		if _, err := wp.Write([]byte("last\n")); err != nil {
			t.Fatal(err)
		}
		_ = w.Close()
		b := make([]byte, 10)
		if n, err := rp.Read(b); err != nil || string(b[:n]) != "last\n" {
			t.Fatalf("Read = %q, %v", b[:n], err)
		}
		if _, err := rp.Read(b); err != io.EOF {
			t.Fatalf("Read after the end = %v, want EOF", err)
		}
	})
	t.Run("a write to a closed reader's pipe fails with EPIPE", func(t *testing.T) {
		r, _, _, wp := newTestPipe(t)
		_ = r.Close()
		if n, err := wp.Write([]byte("x")); n != 0 || !errors.Is(err, syscall.EPIPE) {
			t.Fatalf("Write = %d, %v; want 0, EPIPE", n, err)
		}
	})
}

// TestConn: a TCP connection wrapped by WrapConn carries an HTTP/2 (TLS)
// exchange as the API client uses it, and keeps net.Conn's errors.
func TestConn(t *testing.T) {
	t.Run("HTTP/2 over TLS, a 1 MiB answer", func(t *testing.T) {
		body := bytes.Repeat([]byte("0123456789abcdef"), 64<<10)
		srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			got, _ := io.ReadAll(r.Body)
			w.Header().Set("X-Got", strconv.Itoa(len(got)))
			_, _ = w.Write(body)
		}))
		srv.EnableHTTP2 = true
		srv.StartTLS()
		defer srv.Close()
		tr := srv.Client().Transport.(*http.Transport).Clone()
		tr.ForceAttemptHTTP2 = true
		wrapped := 0
		tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			w := WrapConn(c)
			if _, ok := w.(*Conn); ok {
				wrapped++
			}
			return w, nil
		}
		defer tr.CloseIdleConnections()
		for i := 0; i < 3; i++ {
			resp, err := (&http.Client{Transport: tr}).Post(srv.URL, "text/plain", bytes.NewReader(body[:100000]))
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if err != nil || !bytes.Equal(b, body) || resp.ProtoMajor != 2 || resp.Header.Get("X-Got") != "100000" {
				t.Fatalf("request %d: %d bytes, %v, %s, server read %s", i, len(b), err, resp.Proto, resp.Header.Get("X-Got"))
			}
		}
		if wrapped != 1 {
			t.Fatalf("%d connections wrapped, want the one HTTP/2 connection", wrapped)
		}
	})
	t.Run("deadline, EOF and use after close", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		accepted := make(chan net.Conn, 1)
		go func() {
			c, err := ln.Accept()
			if err == nil {
				accepted <- c
			}
			close(accepted)
		}()
		raw, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c := WrapConn(raw)
		defer c.Close()
		peer := <-accepted
		if peer == nil {
			t.Fatal("no connection accepted")
		}
		b := make([]byte, 10)
		if err := c.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
			t.Fatal(err)
		}
		var ne net.Error
		if _, err := c.Read(b); !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("Read = %v, want a timeout", err)
		}
		_ = c.SetReadDeadline(time.Time{})
		if _, err := peer.Write([]byte("bye")); err != nil {
			t.Fatal(err)
		}
		_ = peer.Close()
		if n, err := io.ReadFull(c, b[:3]); err != nil || string(b[:n]) != "bye" {
			t.Fatalf("Read = %q, %v", b[:n], err)
		}
		if _, err := c.Read(b); err != io.EOF {
			t.Fatalf("Read after the peer closed = %v, want EOF", err)
		}
		_ = c.Close()
		if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Write after Close = %v, want net.ErrClosed", err)
		}
	})
	t.Run("other connections are not wrapped", func(t *testing.T) {
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		if WrapConn(a) != a {
			t.Fatal("net.Pipe's connection was wrapped")
		}
	})
}

func TestReadFile(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 100000)
	path := t.TempDir() + "/f"
	if err := os.WriteFile(path, big, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path string
		want       func([]byte, error) bool
	}{
		{"a file larger than the first buffer", path, func(b []byte, err error) bool { return err == nil && bytes.Equal(b, big) }},
		{"a /proc file, as os.ReadFile reads it", "/proc/self/schedstat", func(b []byte, err error) bool {
			return err == nil && len(strings.Fields(string(b))) == 3
		}},
		{"a missing file", "/proc/self/no-such-file", func(_ []byte, err error) bool { return errors.Is(err, os.ErrNotExist) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if b, err := ReadFile(tc.path); !tc.want(b, err) {
				t.Fatalf("ReadFile(%s) = %d bytes %q..., %v", tc.path, len(b), b[:min(len(b), 40)], err)
			}
		})
	}
}
