package conntrack

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/klog/v2"
)

// Sysctl reads and writes integer kernel parameters, named by their path
// under a root ("net/netfilter/nf_conntrack_max" under /proc/sys).
type Sysctl interface {
	Get(name string) (int, error)
	Set(name string, value int) error
}

// Kernel parameters kproxy sets, under /proc/sys.
const (
	SysctlMax                   = "net/netfilter/nf_conntrack_max"
	SysctlTCPTimeoutEstablished = "net/netfilter/nf_conntrack_tcp_timeout_established"
	SysctlTCPTimeoutCloseWait   = "net/netfilter/nf_conntrack_tcp_timeout_close_wait"
	SysctlTCPBeLiberal          = "net/netfilter/nf_conntrack_tcp_be_liberal"
	SysctlUDPTimeout            = "net/netfilter/nf_conntrack_udp_timeout"
	SysctlUDPTimeoutStream      = "net/netfilter/nf_conntrack_udp_timeout_stream"
)

// ModuleParamHashSize is the nf_conntrack hash table size, under
// ModuleParamsRoot.
const ModuleParamHashSize = "hashsize"

// Roots of the real parameter trees.
const (
	ProcSysRoot      = "/proc/sys"
	ModuleParamsRoot = "/sys/module/nf_conntrack/parameters"
)

// FileSysctl is the real Sysctl: one file per parameter under Root.
type FileSysctl struct {
	Root string
}

var _ Sysctl = FileSysctl{}

func (s FileSysctl) path(name string) (string, error) {
	if name == "" || filepath.IsAbs(name) || strings.Contains(name, "..") {
		return "", fmt.Errorf("invalid parameter name %q", name)
	}
	return filepath.Join(s.Root, name), nil
}

// Get implements Sysctl.
func (s FileSysctl) Get(name string) (int, error) {
	p, err := s.path(name)
	if err != nil {
		return 0, err
	}
	data, err := os.ReadFile(p)
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", p, err)
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		return 0, fmt.Errorf("reading %s: %w", p, err)
	}
	return v, nil
}

// Set implements Sysctl. The parameter must exist.
func (s FileSysctl) Set(name string, value int) error {
	p, err := s.path(name)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return fmt.Errorf("writing %s: %w", p, err)
	}
	_, werr := f.WriteString(strconv.Itoa(value))
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		return fmt.Errorf("writing %d to %s: %w", value, p, err)
	}
	return nil
}

// FakeSysctl is an in-memory Sysctl. It is safe for concurrent use.
type FakeSysctl struct {
	mu       sync.Mutex
	values   map[string]int
	readOnly bool
}

var _ Sysctl = (*FakeSysctl)(nil)

// NewFakeSysctl returns a FakeSysctl holding values; only those exist.
func NewFakeSysctl(values map[string]int) *FakeSysctl {
	return &FakeSysctl{values: maps.Clone(values)}
}

// SetReadOnly makes every later Set fail as a read-only /proc/sys does.
func (f *FakeSysctl) SetReadOnly(ro bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.readOnly = ro
}

// Values returns a copy of every parameter.
func (f *FakeSysctl) Values() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return maps.Clone(f.values)
}

// Get implements Sysctl.
func (f *FakeSysctl) Get(name string) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.values[name]
	if !ok {
		return 0, &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	return v, nil
}

// Set implements Sysctl.
func (f *FakeSysctl) Set(name string, value int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.values[name]; !ok {
		return &fs.PathError{Op: "open", Path: name, Err: fs.ErrNotExist}
	}
	if f.readOnly {
		return &fs.PathError{Op: "open", Path: name, Err: syscall.EROFS}
	}
	f.values[name] = value
	return nil
}

// Config is the conntrack tuning, as kube-proxy's
// KubeProxyConntrackConfiguration. Zero values leave the kernel's setting
// alone.
type Config struct {
	// MaxPerCore is the number of entries per CPU core; nf_conntrack_max
	// becomes max(Min, MaxPerCore * cores). 0 leaves it (and Min) alone.
	MaxPerCore int
	// Min is the least nf_conntrack_max, whatever the core count.
	Min int
	// TCPEstablishedTimeout and TCPCloseWaitTimeout are the idle timeouts
	// of TCP connections in those states.
	TCPEstablishedTimeout time.Duration
	TCPCloseWaitTimeout   time.Duration
	// TCPBeLiberal marks out-of-window TCP packets INVALID no more.
	TCPBeLiberal bool
	// UDPTimeout is the timeout of UDP flows seen in one direction only,
	// UDPStreamTimeout of those seen in both.
	UDPTimeout       time.Duration
	UDPStreamTimeout time.Duration
}

// DefaultConfig returns kube-proxy's defaults.
func DefaultConfig() Config {
	return Config{
		MaxPerCore:            32 * 1024,
		Min:                   128 * 1024,
		TCPEstablishedTimeout: 24 * time.Hour,
		TCPCloseWaitTimeout:   time.Hour,
	}
}

// Validate rejects negative values; flag names are kube-proxy's.
func (c Config) Validate() error {
	var errs []error
	for _, v := range []struct {
		flag  string
		value int
	}{{"--conntrack-max-per-core", c.MaxPerCore}, {"--conntrack-min", c.Min}} {
		if v.value < 0 {
			errs = append(errs, fmt.Errorf("%s=%d must not be negative", v.flag, v.value))
		}
	}
	for _, v := range []struct {
		flag  string
		value time.Duration
	}{
		{"--conntrack-tcp-timeout-established", c.TCPEstablishedTimeout},
		{"--conntrack-tcp-timeout-close-wait", c.TCPCloseWaitTimeout},
		{"--conntrack-udp-timeout", c.UDPTimeout},
		{"--conntrack-udp-timeout-stream", c.UDPStreamTimeout},
	} {
		if v.value < 0 {
			errs = append(errs, fmt.Errorf("%s=%v must not be negative", v.flag, v.value))
		}
	}
	return errors.Join(errs...)
}

// Max is the nf_conntrack_max c asks for on a machine with numCPU cores;
// 0 when c leaves it alone.
func (c Config) Max(numCPU int) int {
	if c.MaxPerCore <= 0 {
		return 0
	}
	return max(c.Min, c.MaxPerCore*numCPU)
}

// SysctlOptions configures ConfigureSysctls.
type SysctlOptions struct {
	Config Config
	// Sysctl is /proc/sys; required.
	Sysctl Sysctl
	// ModuleParams is the nf_conntrack module's parameters; nil leaves
	// the hash table size alone.
	ModuleParams Sysctl
	// NumCPU is the core count; 0 means runtime.NumCPU().
	NumCPU int
}

// ConfigureSysctls applies opts.Config once. nf_conntrack_max is only ever
// raised, and with it the hash table, to a quarter of the maximum, as
// kube-proxy does. A parameter that cannot be written (a read-only /proc/sys
// in a container, a global parameter in a non-initial network namespace) or
// does not exist is logged as a warning and skipped; other failures are
// returned, after every parameter was tried.
func ConfigureSysctls(ctx context.Context, opts SysctlOptions) error {
	logger := klog.FromContext(ctx)
	if opts.Sysctl == nil {
		return errors.New("conntrack sysctls: Sysctl is required")
	}
	if err := opts.Config.Validate(); err != nil {
		return err
	}
	numCPU := opts.NumCPU
	if numCPU <= 0 {
		numCPU = runtime.NumCPU()
	}
	var errs []error
	// skipped reports whether err is tolerated, logging it if so.
	skipped := func(err error, name string, value int) bool {
		switch {
		case errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
			logger.Info("Warning: cannot write kernel parameter; leaving it as it is", "parameter", name, "value", value, "err", err)
			return true
		case errors.Is(err, fs.ErrNotExist):
			logger.Info("Warning: kernel parameter does not exist; is nf_conntrack loaded?", "parameter", name, "err", err)
			return true
		}
		return false
	}

	if want := opts.Config.Max(numCPU); want > 0 {
		cur, err := opts.Sysctl.Get(SysctlMax)
		switch {
		case err != nil:
			if !skipped(err, SysctlMax, want) {
				errs = append(errs, err)
			}
		case cur >= want:
			logger.V(2).Info("Leaving nf_conntrack_max as it is", "current", cur, "wanted", want)
		default:
			logger.Info("Setting nf_conntrack_max", "value", want, "previous", cur)
			if err := opts.Sysctl.Set(SysctlMax, want); err != nil {
				if !skipped(err, SysctlMax, want) {
					errs = append(errs, err)
				}
			} else if opts.ModuleParams != nil {
				if err := raiseHashSize(logger, opts.ModuleParams, want/4); err != nil && !skipped(err, ModuleParamHashSize, want/4) {
					errs = append(errs, err)
				}
			}
		}
	}

	seconds := func(d time.Duration) int { return int(d / time.Second) }
	liberal := 0
	if opts.Config.TCPBeLiberal {
		liberal = 1
	}
	for _, p := range []struct {
		name  string
		value int
		set   bool
	}{
		{SysctlTCPTimeoutEstablished, seconds(opts.Config.TCPEstablishedTimeout), opts.Config.TCPEstablishedTimeout > 0},
		{SysctlTCPTimeoutCloseWait, seconds(opts.Config.TCPCloseWaitTimeout), opts.Config.TCPCloseWaitTimeout > 0},
		{SysctlTCPBeLiberal, liberal, opts.Config.TCPBeLiberal},
		{SysctlUDPTimeout, seconds(opts.Config.UDPTimeout), opts.Config.UDPTimeout > 0},
		{SysctlUDPTimeoutStream, seconds(opts.Config.UDPStreamTimeout), opts.Config.UDPStreamTimeout > 0},
	} {
		if !p.set {
			continue
		}
		if cur, err := opts.Sysctl.Get(p.name); err == nil && cur == p.value {
			continue
		}
		logger.Info("Setting kernel parameter", "parameter", p.name, "value", p.value)
		if err := opts.Sysctl.Set(p.name, p.value); err != nil && !skipped(err, p.name, p.value) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("conntrack sysctls: %w", err)
	}
	return nil
}

func raiseHashSize(logger klog.Logger, params Sysctl, want int) error {
	cur, err := params.Get(ModuleParamHashSize)
	if err != nil {
		return err
	}
	if cur >= want {
		return nil
	}
	logger.Info("Setting the conntrack hash table size", "value", want, "previous", cur)
	return params.Set(ModuleParamHashSize, want)
}
