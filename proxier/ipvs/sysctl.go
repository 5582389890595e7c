package ipvs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"

	"github.com/vishvananda/netns"
)

// Sysctl reads and writes kernel parameters named in dotted form
// ("net.ipv4.vs.conntrack").
type Sysctl interface {
	Get(name string) (string, error)
	Set(name, value string) error
}

// ProcSysctl is the real Sysctl, over /proc/sys. The net.* parameters
// belong to a network namespace: NetNS, when set, names the one (made by `ip
// netns add`) whose parameters are read and written; empty means the
// current one.
type ProcSysctl struct {
	NetNS string
}

var _ Sysctl = ProcSysctl{}

func sysctlPath(name string) (string, error) {
	if name == "" || strings.Contains(name, "/") || strings.Contains(name, "..") {
		return "", fmt.Errorf("invalid sysctl name %q", name)
	}
	return filepath.Join("/proc/sys", strings.ReplaceAll(name, ".", "/")), nil
}

// Get implements Sysctl.
func (p ProcSysctl) Get(name string) (string, error) {
	path, err := sysctlPath(name)
	if err != nil {
		return "", err
	}
	var out string
	err = p.in(func() error {
		data, err := os.ReadFile(path)
		out = strings.TrimSpace(string(data))
		return err
	})
	if err != nil {
		return "", fmt.Errorf("reading sysctl %s: %w", name, err)
	}
	return out, nil
}

// Set implements Sysctl. A read-only /proc/sys (as in many containers)
// fails with an error matching syscall.EROFS.
func (p ProcSysctl) Set(name, value string) error {
	path, err := sysctlPath(name)
	if err != nil {
		return err
	}
	err = p.in(func() error { return os.WriteFile(path, []byte(value+"\n"), 0o644) })
	if err != nil {
		return fmt.Errorf("setting sysctl %s=%s: %w", name, value, err)
	}
	return nil
}

// in runs fn in p's network namespace, on a locked OS thread that is
// discarded should switching back fail.
func (p ProcSysctl) in(fn func() error) error {
	if p.NetNS == "" {
		return fn()
	}
	target, err := netns.GetFromName(p.NetNS)
	if err != nil {
		return fmt.Errorf("opening network namespace %q: %w", p.NetNS, err)
	}
	defer target.Close()
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			done <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(target); err != nil {
			runtime.UnlockOSThread()
			done <- fmt.Errorf("entering network namespace %q: %w", p.NetNS, err)
			return
		}
		fnErr := fn()
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: the runtime discards it.
			done <- errors.Join(fnErr, err)
			return
		}
		runtime.UnlockOSThread()
		done <- fnErr
	}()
	return <-done
}

// FakeSysctl is an in-memory Sysctl: a parameter exists once Set or seeded
// by NewFakeSysctl; ReadOnly makes Set fail as a read-only /proc/sys does.
// Safe for concurrent use.
type FakeSysctl struct {
	mu       sync.Mutex
	values   map[string]string
	readOnly bool
}

var _ Sysctl = (*FakeSysctl)(nil)

// NewFakeSysctl returns a FakeSysctl holding values.
func NewFakeSysctl(values map[string]string) *FakeSysctl {
	f := &FakeSysctl{values: map[string]string{}}
	for k, v := range values {
		f.values[k] = v
	}
	return f
}

// SetReadOnly makes every later Set fail with syscall.EROFS, as on a
// read-only /proc/sys.
func (f *FakeSysctl) SetReadOnly(ro bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.readOnly = ro
}

// Get implements Sysctl.
func (f *FakeSysctl) Get(name string) (string, error) {
	if _, err := sysctlPath(name); err != nil {
		return "", err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.values[name]
	if !ok {
		return "", fmt.Errorf("reading sysctl %s: %w", name, fs.ErrNotExist)
	}
	return v, nil
}

// Set implements Sysctl.
func (f *FakeSysctl) Set(name, value string) error {
	if _, err := sysctlPath(name); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.readOnly {
		return fmt.Errorf("setting sysctl %s=%s: %w", name, value, syscall.EROFS)
	}
	f.values[name] = value
	return nil
}

// Values returns a copy of every parameter.
func (f *FakeSysctl) Values() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[string]string, len(f.values))
	for k, v := range f.values {
		out[k] = v
	}
	return out
}
