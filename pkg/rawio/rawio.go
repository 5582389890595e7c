// Package rawio reads and writes non-blocking descriptors (pipes and
// sockets the Go runtime polls) with raw system calls, and waits for them
// in the netpoller only when they are full or empty.
//
// Why: os.File's and net.Conn's Read and Write tell the runtime that the
// call may block (entersyscall). The first such call after an idle spell
// wakes the runtime's sysmon thread from its deep sleep, and sysmon then
// polls every 20 µs for as long as a goroutine runs: dozens of context
// switches for one change of one Service on a node where nothing else
// happens. On a non-blocking descriptor the call cannot block, so the
// runtime need not be told.
package rawio

import (
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"
)

// FD reads and writes one non-blocking descriptor with raw system calls.
// The descriptor's deadlines (SetReadDeadline, SetWriteDeadline of the
// file or connection it came from) bound the waits.
type FD struct {
	rc syscall.RawConn
}

// New is the FD of c (an *os.File from os.Pipe, a *net.TCPConn, ...),
// which must be non-blocking and registered with the netpoller, as the
// os and net packages make pipes and sockets.
func New(c syscall.Conn) (FD, error) {
	rc, err := c.SyscallConn()
	return FD{rc: rc}, err
}

// once is one read or write (trap) of b on fd, retried when a signal
// interrupts it.
func once(trap, fd uintptr, b []byte) (int, syscall.Errno) {
	for {
		n, _, e := syscall.RawSyscall(trap, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
		if e != syscall.EINTR {
			return int(n), e
		}
	}
}

// Write writes all of b, waiting while the descriptor is full; n is what
// was written when an error (the deadline, a closed reader) stopped it.
func (f FD) Write(b []byte) (n int, err error) {
	if len(b) == 0 {
		return 0, nil
	}
	var errno syscall.Errno
	werr := f.rc.Write(func(fd uintptr) bool {
		for n < len(b) {
			w, e := once(syscall.SYS_WRITE, fd, b[n:])
			switch e {
			case 0:
				n += w
			case syscall.EAGAIN:
				return false
			default:
				errno = e
				return true
			}
		}
		return true
	})
	if werr != nil {
		return n, werr
	}
	if errno != 0 {
		return n, os.NewSyscallError("write", errno)
	}
	return n, nil
}

// Read reads what the descriptor holds, waiting while it is empty; io.EOF
// when the other end has closed it.
func (f FD) Read(b []byte) (n int, err error) {
	if len(b) == 0 {
		return 0, nil
	}
	var errno syscall.Errno
	rerr := f.rc.Read(func(fd uintptr) bool {
		r, e := once(syscall.SYS_READ, fd, b)
		switch e {
		case 0:
			n = r
		case syscall.EAGAIN:
			return false
		default:
			errno = e
		}
		return true
	})
	switch {
	case rerr != nil:
		return 0, rerr
	case errno != 0:
		return 0, os.NewSyscallError("read", errno)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

// Conn is a stream connection whose Read and Write are its FD's; every
// other method (Close, deadlines, addresses) is the connection's own.
type Conn struct {
	net.Conn
	fd FD
}

// WrapConn is c with raw reads and writes when c is a stream socket the
// runtime polls (TCP, unix); any other connection is returned as it is.
func WrapConn(c net.Conn) net.Conn {
	switch c.(type) {
	case *net.TCPConn, *net.UnixConn:
	default:
		return c
	}
	fd, err := New(c.(syscall.Conn))
	if err != nil {
		return c
	}
	return &Conn{Conn: c, fd: fd}
}

// Read is net.Conn's Read, errors wrapped as the net package wraps them.
func (c *Conn) Read(b []byte) (int, error) {
	n, err := c.fd.Read(b)
	if err != nil && err != io.EOF {
		err = &net.OpError{Op: "read", Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
	}
	return n, err
}

// Write is net.Conn's Write, errors wrapped as the net package wraps them.
func (c *Conn) Write(b []byte) (int, error) {
	n, err := c.fd.Write(b)
	if err != nil {
		err = &net.OpError{Op: "write", Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
	}
	return n, err
}

// ReadFile reads a whole file with raw system calls. It is for files whose
// reads never block, /proc and /sys (a benchmark reading a child's CPU
// between measured syncs must not wake sysmon itself); any other file
// would stall the thread, out of the runtime's sight.
func ReadFile(path string) ([]byte, error) {
	p, err := syscall.BytePtrFromString(path)
	if err != nil {
		return nil, err
	}
	var fd uintptr
	dir := -100 // AT_FDCWD; a variable, as a negative constant cannot become a uintptr
	for {
		r, _, e := syscall.RawSyscall6(syscall.SYS_OPENAT, uintptr(dir), uintptr(unsafe.Pointer(p)), syscall.O_RDONLY|syscall.O_CLOEXEC, 0, 0, 0)
		if e == syscall.EINTR {
			continue
		}
		if e != 0 {
			return nil, &os.PathError{Op: "open", Path: path, Err: e}
		}
		fd = r
		break
	}
	defer func() { _, _, _ = syscall.RawSyscall(syscall.SYS_CLOSE, fd, 0, 0) }()
	out := make([]byte, 0, 512)
	for {
		if len(out) == cap(out) {
			out = append(out, 0)[:len(out)]
		}
		n, e := once(syscall.SYS_READ, fd, out[len(out):cap(out)])
		if e != 0 {
			return nil, &os.PathError{Op: "read", Path: path, Err: e}
		}
		if n == 0 {
			return out, nil
		}
		out = out[:len(out)+n]
	}
}
