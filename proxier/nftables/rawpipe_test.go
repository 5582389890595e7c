package nftables

import (
	"bytes"
	"errors"
	"io"
	"os"
	"syscall"
	"testing"
	"time"
)

func newTestPipe(t *testing.T) (r, w *os.File, rp, wp rawPipe) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close(); _ = w.Close() })
	if rp, err = newRawPipe(r); err != nil {
		t.Fatal(err)
	}
	if wp, err = newRawPipe(w); err != nil {
		t.Fatal(err)
	}
	return r, w, rp, wp
}

func TestRawPipe(t *testing.T) {
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
