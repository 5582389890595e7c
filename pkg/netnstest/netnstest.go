// Package netnstest creates throwaway network namespaces for tests that need
// a real kernel: namespaces joined by veth pairs, commands and sockets inside
// them, in-process echo servers and classified client requests.
//
// Every namespace is named kpt-<prefix>-<random> and deleted by t.Cleanup, so
// it goes away even when the test fails. A crashed test binary can leave
// namespaces behind; Sweep removes them, and MainWithSweep is an opt-in
// TestMain that sweeps before running:
//
//	func TestMain(m *testing.M) { os.Exit(netnstest.MainWithSweep(m)) }
//
//	KPT_NETNS_SWEEP=all go test -p 1 ./...   # remove every leftover kpt-* namespace
//	KPT_NETNS_SWEEP=echo go test ./pkg/x     # remove only kpt-echo-*
//
// Sweeping every kpt-* namespace while other test binaries run would delete
// their namespaces too, so it is never done implicitly.
package netnstest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netns"
)

// NamePrefix starts the name of every namespace this package creates.
const NamePrefix = "kpt-"

// netnsDir is where `ip netns` keeps its named namespaces.
const netnsDir = "/run/netns"

// DefaultRequestTimeout bounds Request when its context has no deadline.
const DefaultRequestTimeout = 5 * time.Second

// RequireRoot skips the test unless it runs as root and the `ip` and
// `iptables` commands exist.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	for _, bin := range []string{"ip", "iptables"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s: %v", bin, err)
		}
	}
}

// NS is a named network namespace created by New.
type NS struct {
	Name string
}

// New creates the namespace kpt-<prefix>-<random>, brings its loopback up and
// deletes it in t.Cleanup. Cleanups registered later (servers, sockets) run
// before the deletion.
func New(t testing.TB, prefix string) *NS {
	t.Helper()
	n := &NS{Name: NamePrefix + prefix + "-" + randomHex(4)}
	if out, err := exec.Command("ip", "netns", "add", n.Name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", n.Name, err, bytes.TrimSpace(out))
	}
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", n.Name).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", n.Name, err, bytes.TrimSpace(out))
		}
	})
	n.IPBatch(t, "link set lo up")
	return n
}

// String returns the namespace name.
func (n *NS) String() string { return n.Name }

// Exec runs cmd inside the namespace (`ip netns exec`) and returns its
// standard output; the error includes standard error.
func (n *NS) Exec(ctx context.Context, cmd string, args ...string) ([]byte, error) {
	c := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", n.Name, cmd}, args...)...)
	var stdout, stderr bytes.Buffer
	c.Stdout = &stdout
	c.Stderr = &stderr
	if err := c.Run(); err != nil {
		return stdout.Bytes(), fmt.Errorf("in %s: %s %s: %w: %s", n.Name, cmd, strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return stdout.Bytes(), nil
}

// Run is Exec that fails the test on error. It does not use the test's
// context, so it also works inside cleanups.
func (n *NS) Run(t testing.TB, cmd string, args ...string) string {
	t.Helper()
	out, err := n.Exec(context.Background(), cmd, args...)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// Veth names the two ends of a veth pair made by Link.
type Veth struct {
	// A is the device in the first namespace, B in the second.
	A, B string
}

// Link connects a and b with a veth pair, puts aAddr and bAddr on the ends
// (an invalid, zero Prefix means no address; IPv6 addresses skip duplicate
// address detection) and brings both up. The pair disappears with the
// namespaces.
func Link(t testing.TB, a *NS, aAddr netip.Prefix, b *NS, bAddr netip.Prefix) Veth {
	t.Helper()
	// Device names are limited to 15 bytes: "kv" + 8 hex + "a"/"b".
	base := "kv" + randomHex(4)
	v := Veth{A: base + "a", B: base + "b"}
	if out, err := exec.Command("ip", "link", "add", v.A, "netns", a.Name, "type", "veth", "peer", "name", v.B, "netns", b.Name).CombinedOutput(); err != nil {
		t.Fatalf("creating veth %s/%s between %s and %s: %v: %s", v.A, v.B, a.Name, b.Name, err, bytes.TrimSpace(out))
	}
	for _, end := range []struct {
		ns   *NS
		dev  string
		addr netip.Prefix
	}{{a, v.A, aAddr}, {b, v.B, bAddr}} {
		var cmds []string
		if end.addr.IsValid() {
			cmds = append(cmds, AddrAddCommand(end.dev, end.addr))
		}
		end.ns.IPBatch(t, append(cmds, "link set "+end.dev+" up")...)
	}
	return v
}

// AddAddr adds addr to dev (IPv6 without duplicate address detection, so the
// address is usable at once).
func (n *NS) AddAddr(t testing.TB, dev string, addr netip.Prefix) {
	t.Helper()
	n.IPBatch(t, AddrAddCommand(dev, addr))
}

// AddrAddCommand is AddAddr's command for IPBatch.
func AddrAddCommand(dev string, addr netip.Prefix) string {
	cmd := "addr add " + addr.String() + " dev " + dev
	if addr.Addr().Is6() && !addr.Addr().Is4In6() {
		cmd += " nodad"
	}
	return cmd
}

// AddRoute adds a route to dst via the gateway via.
func (n *NS) AddRoute(t testing.TB, dst netip.Prefix, via netip.Addr) {
	t.Helper()
	n.IPBatch(t, "route add "+dst.String()+" via "+via.String())
}

// IPBatch runs ip commands inside the namespace (`ip -n <ns> -batch -`):
// one per string, without the leading "ip" (e.g. "route add 10.0.0.0/8 dev
// eth0"), in order, failing the test at the first that fails. One process
// for many addresses or routes is much faster than one each, and `ip -n`
// is cheaper than `ip netns exec`.
func (n *NS) IPBatch(t testing.TB, cmds ...string) {
	t.Helper()
	if len(cmds) == 0 {
		return
	}
	c := exec.Command("ip", "-n", n.Name, "-batch", "-")
	c.Stdin = strings.NewReader(strings.Join(cmds, "\n") + "\n")
	if out, err := c.CombinedOutput(); err != nil {
		t.Fatalf("ip -batch in %s: %v: %s", n.Name, err, bytes.TrimSpace(out))
	}
}

// Sysctl sets key (e.g. "net.ipv4.ip_forward", or with slashes) to value
// inside the namespace. It writes /proc/sys from a thread inside the
// namespace, where the net.* keys are the namespace's own.
func (n *NS) Sysctl(t testing.TB, key, value string) {
	t.Helper()
	path := key
	if !strings.Contains(key, "/") {
		path = strings.ReplaceAll(key, ".", "/")
	}
	path = "/proc/sys/" + path
	if err := n.Do(func() error { return os.WriteFile(path, []byte(value+"\n"), 0) }); err != nil {
		t.Fatalf("sysctl %s=%s in %s: %v", key, value, n.Name, err)
	}
}

// Do runs fn on an OS thread switched into the namespace, then switches the
// thread back. Sockets created by fn stay in the namespace and can be used
// from any goroutine afterwards. fn must not start goroutines that expect to
// be inside the namespace.
func (n *NS) Do(fn func() error) error {
	target, err := netns.GetFromName(n.Name)
	if err != nil {
		return fmt.Errorf("opening namespace %s: %w", n.Name, err)
	}
	defer target.Close()
	done := make(chan error, 1)
	// A fresh goroutine owns the locked thread: should switching back fail,
	// the thread stays locked and the runtime discards it when the goroutine
	// exits, so no other goroutine ever runs in the wrong namespace.
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("getting current namespace: %w", err)
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("entering namespace %s: %w", n.Name, err)
			return
		}
		fnErr := fn()
		if err := netns.Set(orig); err != nil {
			done <- errors.Join(fnErr, fmt.Errorf("leaving namespace %s: %w", n.Name, err))
			return
		}
		runtime.UnlockOSThread()
		done <- fnErr
	}()
	return <-done
}

// Dial opens a connection from inside the namespace.
func (n *NS) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	return n.DialWith(ctx, &net.Dialer{}, network, addr)
}

// DialWith is Dial with a dialer of the caller's, e.g. one binding a local
// address.
func (n *NS) DialWith(ctx context.Context, d *net.Dialer, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := n.Do(func() error {
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// Listen opens a stream listener inside the namespace.
func (n *NS) Listen(ctx context.Context, network, addr string) (net.Listener, error) {
	var l net.Listener
	err := n.Do(func() error {
		var err error
		l, err = (&net.ListenConfig{}).Listen(ctx, network, addr)
		return err
	})
	return l, err
}

// ListenPacket opens a packet socket inside the namespace.
func (n *NS) ListenPacket(ctx context.Context, network, addr string) (net.PacketConn, error) {
	var pc net.PacketConn
	err := n.Do(func() error {
		var err error
		pc, err = (&net.ListenConfig{}).ListenPacket(ctx, network, addr)
		return err
	})
	return pc, err
}

// StartEcho serves network ("tcp", "tcp4", "tcp6", "udp", "udp4", "udp6") on
// addr inside the namespace until the test ends and returns the bound
// address (useful with port 0). Every TCP connection and every UDP datagram
// gets the reply "<name> <client ip:port>\n"; TCP connections are closed
// after it. A UDP server on a wildcard address answers from the address the
// kernel routes by, so in a namespace with several addresses bind the one
// clients use.
func (n *NS) StartEcho(t testing.TB, network, addr, name string) string {
	t.Helper()
	var wg sync.WaitGroup
	var bound string
	switch {
	case strings.HasPrefix(network, "tcp"):
		l, err := n.Listen(context.Background(), network, addr)
		if err != nil {
			t.Fatalf("echo %s %s in %s: %v", network, addr, n.Name, err)
		}
		bound = l.Addr().String()
		wg.Go(func() { serveStream(l, name, &wg) })
		t.Cleanup(func() {
			_ = l.Close()
			wg.Wait()
		})
	case strings.HasPrefix(network, "udp"):
		pc, err := n.ListenPacket(context.Background(), network, addr)
		if err != nil {
			t.Fatalf("echo %s %s in %s: %v", network, addr, n.Name, err)
		}
		bound = pc.LocalAddr().String()
		wg.Go(func() { servePackets(pc, name) })
		t.Cleanup(func() {
			_ = pc.Close()
			wg.Wait()
		})
	default:
		t.Fatalf("echo: unsupported network %q", network)
	}
	return bound
}

func echoReply(name string, client net.Addr) []byte {
	return []byte(name + " " + client.String() + "\n")
}

// ParseEchoReply splits a reply of StartEcho's servers, without its newline,
// into the server's name (which must not contain spaces) and the client
// address the server saw.
func ParseEchoReply(reply string) (name string, client netip.AddrPort, err error) {
	name, addr, ok := strings.Cut(reply, " ")
	if !ok {
		return "", netip.AddrPort{}, fmt.Errorf("malformed echo reply %q", reply)
	}
	client, err = netip.ParseAddrPort(addr)
	if err != nil {
		return "", netip.AddrPort{}, fmt.Errorf("echo reply %q: %w", reply, err)
	}
	return name, client, nil
}

// serveStream answers every accepted connection until l is closed.
func serveStream(l net.Listener, name string, wg *sync.WaitGroup) {
	for {
		c, err := l.Accept()
		if err != nil {
			return // closed
		}
		wg.Go(func() {
			defer c.Close()
			_ = c.SetWriteDeadline(time.Now().Add(DefaultRequestTimeout))
			_, _ = c.Write(echoReply(name, c.RemoteAddr()))
		})
	}
}

// servePackets answers every datagram until pc is closed.
func servePackets(pc net.PacketConn, name string) {
	buf := make([]byte, 64<<10)
	for {
		_, from, err := pc.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // e.g. an ICMP error queued on the socket
		}
		_, _ = pc.WriteTo(echoReply(name, from), from)
	}
}

// Request classes, matched with errors.Is.
var (
	// ErrRefused: the connection or datagram was actively rejected: a TCP
	// reset answering the SYN, or an ICMP port unreachable, admin prohibited or host/network
	// unreachable (the last can also mean neighbour resolution failed). The
	// original errno stays in the chain (errors.Is(err, syscall.EHOSTUNREACH)).
	ErrRefused = errors.New("refused")
	// ErrTimeout: no answer before the deadline, e.g. a silent DROP.
	ErrTimeout = errors.New("timed out")
)

// Request sends one request from inside n (the current namespace when n is
// nil) to addr and returns the echo reply without its newline. TCP: connect
// and read a line. UDP: send "ping" and read one datagram. Without a
// deadline on ctx the request times out after DefaultRequestTimeout. Errors
// are classified as ErrRefused or ErrTimeout where possible.
func Request(ctx context.Context, n *NS, network, addr string) (string, error) {
	return RequestWith(ctx, n, network, addr, RequestOptions{})
}

// RequestOptions tunes RequestWith.
type RequestOptions struct {
	// Source, when valid, is the local address the request is sent from
	// (it must be one of the namespace's addresses); otherwise the kernel
	// picks one.
	Source netip.Addr
}

// RequestWith is Request with options.
func RequestWith(ctx context.Context, n *NS, network, addr string, opts RequestOptions) (string, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultRequestTimeout)
		defer cancel()
	}
	reply, err := request(ctx, n, network, addr, opts)
	if err != nil {
		from := "current namespace"
		if n != nil {
			from = n.Name
		}
		if kind := classify(err); kind != nil {
			return "", fmt.Errorf("%s %s from %s: %w: %w", network, addr, from, kind, err)
		}
		return "", fmt.Errorf("%s %s from %s: %w", network, addr, from, err)
	}
	return reply, nil
}

func request(ctx context.Context, n *NS, network, addr string, opts RequestOptions) (string, error) {
	d := &net.Dialer{}
	if opts.Source.IsValid() {
		ip := opts.Source.AsSlice()
		if strings.HasPrefix(network, "tcp") {
			d.LocalAddr = &net.TCPAddr{IP: ip}
		} else {
			d.LocalAddr = &net.UDPAddr{IP: ip}
		}
	}
	var c net.Conn
	var err error
	if n != nil {
		c, err = n.DialWith(ctx, d, network, addr)
	} else {
		c, err = d.DialContext(ctx, network, addr)
	}
	if err != nil {
		return "", err
	}
	defer c.Close()
	// Closing the connection when ctx ends interrupts a blocked read even if
	// ctx is cancelled rather than timed out.
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	if dl, ok := ctx.Deadline(); ok {
		if err := c.SetDeadline(dl); err != nil {
			return "", err
		}
	}
	switch {
	case strings.HasPrefix(network, "tcp"):
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			if errors.Is(err, io.EOF) {
				return "", fmt.Errorf("connection closed before a full reply (got %q): %w", line, err)
			}
			return "", ctxErr(ctx, err)
		}
		return strings.TrimSuffix(line, "\n"), nil
	default:
		if _, err := c.Write([]byte("ping\n")); err != nil {
			return "", ctxErr(ctx, err)
		}
		buf := make([]byte, 64<<10)
		k, err := c.Read(buf)
		if err != nil {
			return "", ctxErr(ctx, err)
		}
		return strings.TrimSuffix(string(buf[:k]), "\n"), nil
	}
}

// ctxErr prefers the context's own error when the context ended (the
// deadline forced by AfterFunc shows up as a generic timeout otherwise).
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("%w (%w)", err, cerr)
	}
	return err
}

// classify maps a request error to ErrRefused, ErrTimeout or nil.
func classify(err error) error {
	for _, errno := range []syscall.Errno{syscall.ECONNREFUSED, syscall.EHOSTUNREACH, syscall.ENETUNREACH, syscall.EACCES} {
		if errors.Is(err, errno) {
			return ErrRefused
		}
	}
	if errors.Is(err, context.Canceled) {
		return nil
	}
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		return ErrTimeout
	}
	return nil
}

// Sweep deletes namespaces named kpt-<prefix>-* (every kpt-* one when prefix
// is empty), left behind by test binaries that crashed before their
// cleanups ran, and returns the names it deleted. Never call it while other
// tests may be using matching namespaces.
func Sweep(prefix string) ([]string, error) {
	match := NamePrefix
	if prefix != "" {
		match += prefix + "-"
	}
	entries, err := os.ReadDir(netnsDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", netnsDir, err)
	}
	var deleted []string
	var errs []error
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), match) {
			continue
		}
		if out, err := exec.Command("ip", "netns", "del", e.Name()).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("ip netns del %s: %w: %s", e.Name(), err, bytes.TrimSpace(out)))
			continue
		}
		deleted = append(deleted, e.Name())
	}
	return deleted, errors.Join(errs...)
}

// SweepEnv is the environment variable MainWithSweep reads: a prefix to
// sweep kpt-<prefix>-*, or "all" for every kpt-* namespace.
const SweepEnv = "KPT_NETNS_SWEEP"

// MainWithSweep is an optional TestMain body: when $KPT_NETNS_SWEEP is set
// it sweeps leftover namespaces (see Sweep), then runs the tests and returns
// their exit code.
func MainWithSweep(m *testing.M) int {
	if v := os.Getenv(SweepEnv); v != "" && os.Geteuid() == 0 {
		prefix := v
		if v == "all" {
			prefix = ""
		}
		deleted, err := Sweep(prefix)
		for _, name := range deleted {
			fmt.Fprintf(os.Stderr, "netnstest: deleted leftover namespace %s\n", name)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "netnstest: sweep: %v\n", err)
		}
	}
	return m.Run()
}

// randomHex returns 2n random hex digits.
func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // never fails (crypto/rand panics instead)
	return hex.EncodeToString(b)
}
