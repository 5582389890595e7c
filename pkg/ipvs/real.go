package ipvs

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	mobyipvs "github.com/moby/ipvs"
	vnl "github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netlink"
)

// Options configures the real implementation returned by New.
type Options struct {
	// NetNS, when set, is the named network namespace (as made by `ip
	// netns add`) whose IPVS table the Real manages; for tests and tools.
	// Empty means the current namespace.
	NetNS string
	// Timeout bounds each call (see Real); zero means
	// netlink.DefaultTimeout.
	Timeout time.Duration
}

// netnsDir is where `ip netns` keeps its named namespaces.
const netnsDir = "/run/netns"

// modprobeTimeout bounds one modprobe run.
const modprobeTimeout = 30 * time.Second

// ipvsFlagPersistent is IP_VS_SVC_F_PERSISTENT.
const ipvsFlagPersistent = 0x1

// Real is the Interface implementation for a real kernel, over
// github.com/moby/ipvs. Calls are serialized: the library's handle owns one
// netlink socket that cannot carry concurrent requests.
//
// Every call ends by its deadline (Options.Timeout or the caller's,
// whichever is earlier) with an error wrapping context.DeadlineExceeded.
// A netlink request cannot be cancelled, so the call runs under a
// deadline.Guard; and since the library waits for its answer forever
// (it retries its socket's receive timeout), a call abandoned at its
// deadline has its socket closed, which ends it, and the next call opens
// a new one (docs/design.md, "Deadlines on kernel calls").
type Real struct {
	// open opens a handle on the Real's namespace.
	open    func() (*mobyipvs.Handle, error)
	timeout time.Duration
	guard   deadline.Guard

	mu sync.Mutex
	// h is nil when the last call was abandoned (or before the first
	// call, in tests); closed is set by Close.
	h      *mobyipvs.Handle
	closed bool
}

var _ Interface = (*Real)(nil)

// New checks that the kernel has IPVS (loading ip_vs with modprobe when it
// is missing and modprobe exists) and opens a handle on opts.NetNS's IPVS
// table. Without IPVS the error matches ErrUnavailable and names the
// missing module. The caller must Close the result.
func New(opts Options) (*Real, error) {
	if err := checkIPVS(); err != nil {
		return nil, err
	}
	path := ""
	where := "the current network namespace"
	if opts.NetNS != "" {
		path = filepath.Join(netnsDir, opts.NetNS)
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("network namespace %q: %w", opts.NetNS, err)
		}
		where = "network namespace " + opts.NetNS
	}
	r := &Real{
		open: func() (*mobyipvs.Handle, error) {
			h, err := mobyipvs.New(path)
			if err != nil {
				return nil, fmt.Errorf("opening IPVS netlink socket in %s: %w", where, err)
			}
			return h, nil
		},
		timeout: opts.Timeout,
	}
	if r.timeout <= 0 {
		r.timeout = netlink.DefaultTimeout
	}
	var err error
	if r.h, err = r.open(); err != nil {
		return nil, err
	}
	return r, nil
}

// Close releases the netlink socket.
func (r *Real) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	if r.h != nil {
		r.h.Close()
		r.h = nil
	}
	return nil
}

// do runs fn with the handle, after checking ctx, under the Real's
// deadline; op names the library call in a timeout's error.
func (r *Real) do(ctx context.Context, op string, fn func(h *mobyipvs.Handle) error) error {
	_, err := doValue(ctx, r, op, func(h *mobyipvs.Handle) (struct{}, error) { return struct{}{}, fn(h) })
	return err
}

// doValue is do for a call with a result. fn must not share variables
// with its caller: an abandoned call goes on after doValue returned.
func doValue[T any](ctx context.Context, r *Real, op string, fn func(h *mobyipvs.Handle) (T, error)) (T, error) {
	var zero T
	if err := ctx.Err(); err != nil {
		return zero, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return zero, errors.New("IPVS handle is closed")
	}
	if r.h == nil {
		h, err := r.open()
		if err != nil {
			return zero, err
		}
		r.h = h
	}
	h := r.h
	return deadline.Call(ctx, &r.guard, "IPVS "+op, r.timeout, func(context.Context) (T, error) { return fn(h) }, func() {
		// Runs with r.mu held, before doValue returns.
		h.Close()
		r.h = nil
	})
}

// Services implements Interface. Firewall-mark services and protocols
// other than TCP, UDP and SCTP are left out.
func (r *Real) Services(ctx context.Context) ([]*Service, error) {
	libs, err := doValue(ctx, r, "GetServices", func(h *mobyipvs.Handle) ([]*mobyipvs.Service, error) {
		return h.GetServices()
	})
	if err != nil {
		return nil, fmt.Errorf("listing IPVS services: %w", err)
	}
	out := make([]*Service, 0, len(libs))
	for _, l := range libs {
		if s, ok := fromLibService(l); ok {
			out = append(out, s)
		}
	}
	slices.SortFunc(out, compareServices)
	return out, nil
}

// AddService implements Interface.
func (r *Real) AddService(ctx context.Context, svc *Service) error {
	if err := validateService(svc); err != nil {
		return err
	}
	ls := toLibService(svc)
	err := r.do(ctx, "NewService", func(h *mobyipvs.Handle) error { return h.NewService(ls) })
	if err != nil {
		return fmt.Errorf("adding IPVS service %s: %w", svc.key(), serviceErr(svc, err))
	}
	klog.FromContext(ctx).V(4).Info("Added IPVS service", "service", svc)
	return nil
}

// UpdateService implements Interface.
func (r *Real) UpdateService(ctx context.Context, svc *Service) error {
	if err := validateService(svc); err != nil {
		return err
	}
	ls := toLibService(svc)
	err := r.do(ctx, "UpdateService", func(h *mobyipvs.Handle) error { return h.UpdateService(ls) })
	if err != nil {
		return fmt.Errorf("updating IPVS service %s: %w", svc.key(), serviceErr(svc, err))
	}
	klog.FromContext(ctx).V(4).Info("Updated IPVS service", "service", svc)
	return nil
}

// DeleteService implements Interface.
func (r *Real) DeleteService(ctx context.Context, svc *Service) error {
	if err := validateService(svc); err != nil {
		return err
	}
	ls := toLibService(svc)
	err := r.do(ctx, "DelService", func(h *mobyipvs.Handle) error { return h.DelService(ls) })
	if err != nil {
		return fmt.Errorf("deleting IPVS service %s: %w", svc.key(), kernelErr(err))
	}
	klog.FromContext(ctx).V(4).Info("Deleted IPVS service", "service", svc.key())
	return nil
}

// Destinations implements Interface. The kernel answers a destination dump
// for a missing service with an empty list, so an empty answer is checked
// against the service itself.
func (r *Real) Destinations(ctx context.Context, svc *Service) ([]*Destination, error) {
	if err := validateService(svc); err != nil {
		return nil, err
	}
	ls := toLibService(svc)
	libs, err := doValue(ctx, r, "GetDestinations", func(h *mobyipvs.Handle) ([]*mobyipvs.Destination, error) {
		libs, err := h.GetDestinations(ls)
		if err == nil && len(libs) == 0 {
			_, err = h.GetService(ls)
		}
		return libs, err
	})
	if err != nil {
		return nil, fmt.Errorf("listing destinations of IPVS service %s: %w", svc.key(), kernelErr(err))
	}
	out := make([]*Destination, 0, len(libs))
	for _, l := range libs {
		d, err := fromLibDestination(l)
		if err != nil {
			return nil, fmt.Errorf("listing destinations of IPVS service %s: %w", svc.key(), err)
		}
		out = append(out, d)
	}
	slices.SortFunc(out, compareDestinations)
	return out, nil
}

// AddDestination implements Interface.
func (r *Real) AddDestination(ctx context.Context, svc *Service, dst *Destination) error {
	if err := validateDestination(svc, dst); err != nil {
		return err
	}
	ls, ld := toLibService(svc), toLibDestination(dst)
	err := r.do(ctx, "NewDestination", func(h *mobyipvs.Handle) error { return h.NewDestination(ls, ld) })
	if err != nil {
		return fmt.Errorf("adding destination %s to IPVS service %s: %w", dst, svc.key(), kernelErr(err))
	}
	klog.FromContext(ctx).V(4).Info("Added IPVS destination", "service", svc.key(), "destination", dst)
	return nil
}

// UpdateDestination implements Interface.
func (r *Real) UpdateDestination(ctx context.Context, svc *Service, dst *Destination) error {
	if err := validateDestination(svc, dst); err != nil {
		return err
	}
	ls, ld := toLibService(svc), toLibDestination(dst)
	err := r.do(ctx, "UpdateDestination", func(h *mobyipvs.Handle) error { return h.UpdateDestination(ls, ld) })
	if err != nil {
		return fmt.Errorf("updating destination %s of IPVS service %s: %w", dst, svc.key(), kernelErr(err))
	}
	klog.FromContext(ctx).V(4).Info("Updated IPVS destination", "service", svc.key(), "destination", dst)
	return nil
}

// DeleteDestination implements Interface.
func (r *Real) DeleteDestination(ctx context.Context, svc *Service, dst *Destination) error {
	if err := validateDestination(svc, dst); err != nil {
		return err
	}
	ls, ld := toLibService(svc), toLibDestination(dst)
	err := r.do(ctx, "DelDestination", func(h *mobyipvs.Handle) error { return h.DelDestination(ls, ld) })
	if err != nil {
		return fmt.Errorf("deleting destination %s of IPVS service %s: %w", netip.AddrPortFrom(dst.Address, dst.Port), svc.key(), kernelErr(err))
	}
	klog.FromContext(ctx).V(4).Info("Deleted IPVS destination", "service", svc.key(), "destination", netip.AddrPortFrom(dst.Address, dst.Port))
	return nil
}

// SetTimeouts implements Interface.
func (r *Real) SetTimeouts(ctx context.Context, t Timeouts) error {
	if err := validateTimeouts(t); err != nil {
		return err
	}
	err := r.do(ctx, "SetConfig", func(h *mobyipvs.Handle) error {
		return h.SetConfig(&mobyipvs.Config{TimeoutTCP: t.TCP, TimeoutTCPFin: t.TCPFin, TimeoutUDP: t.UDP})
	})
	if err != nil {
		return fmt.Errorf("setting IPVS timeouts: %w", err)
	}
	klog.FromContext(ctx).V(2).Info("Set IPVS timeouts", "tcp", t.TCP, "tcpFin", t.TCPFin, "udp", t.UDP)
	return nil
}

// GetTimeouts implements Interface.
func (r *Real) GetTimeouts(ctx context.Context) (Timeouts, error) {
	c, err := doValue(ctx, r, "GetConfig", func(h *mobyipvs.Handle) (*mobyipvs.Config, error) {
		return h.GetConfig()
	})
	if err != nil {
		return Timeouts{}, fmt.Errorf("reading IPVS timeouts: %w", err)
	}
	return Timeouts{TCP: c.TimeoutTCP, TCPFin: c.TimeoutTCPFin, UDP: c.TimeoutUDP}, nil
}

// kernelErr adds ErrExist or ErrNotExist to the kernel's errno: EEXIST for
// a duplicate, ESRCH for a missing service, ENOENT for a missing
// destination.
func kernelErr(err error) error {
	switch {
	case errors.Is(err, unix.EEXIST):
		return fmt.Errorf("%w (%w)", ErrExist, err)
	case errors.Is(err, unix.ESRCH), errors.Is(err, unix.ENOENT):
		return fmt.Errorf("%w (%w)", ErrNotExist, err)
	}
	return err
}

// serviceErr is kernelErr for adding or updating a service, where ENOENT
// means the scheduler module is missing.
func serviceErr(svc *Service, err error) error {
	if errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("%w: %q (kernel module ip_vs_%s not found): %w", ErrSchedulerUnavailable, svc.scheduler(), svc.scheduler(), err)
	}
	return kernelErr(err)
}

var protocolNumbers = map[Protocol]uint16{ProtocolTCP: unix.IPPROTO_TCP, ProtocolUDP: unix.IPPROTO_UDP, ProtocolSCTP: unix.IPPROTO_SCTP}

func toLibService(svc *Service) *mobyipvs.Service {
	ls := &mobyipvs.Service{
		Address:   net.IP(svc.Address.AsSlice()),
		Protocol:  protocolNumbers[svc.Protocol],
		Port:      svc.Port,
		SchedName: svc.scheduler(),
		Timeout:   svc.Timeout,
	}
	if svc.Address.Is4() {
		ls.AddressFamily, ls.Netmask = unix.AF_INET, 0xffffffff
	} else {
		ls.AddressFamily, ls.Netmask = unix.AF_INET6, 128
	}
	if svc.Persistent {
		ls.Flags = ipvsFlagPersistent
	}
	return ls
}

func fromLibService(ls *mobyipvs.Service) (*Service, bool) {
	if ls.FWMark != 0 {
		return nil, false
	}
	var proto Protocol
	for p, n := range protocolNumbers {
		if n == ls.Protocol {
			proto = p
		}
	}
	addr, ok := netip.AddrFromSlice(ls.Address)
	if proto == "" || !ok {
		return nil, false
	}
	return &Service{
		Address:    addr.Unmap(),
		Protocol:   proto,
		Port:       ls.Port,
		Scheduler:  ls.SchedName,
		Persistent: ls.Flags&ipvsFlagPersistent != 0,
		Timeout:    ls.Timeout,
	}, true
}

func toLibDestination(d *Destination) *mobyipvs.Destination {
	ld := &mobyipvs.Destination{
		Address:         net.IP(d.Address.AsSlice()),
		Port:            d.Port,
		Weight:          d.Weight,
		ConnectionFlags: mobyipvs.ConnectionFlagMasq,
		AddressFamily:   unix.AF_INET,
	}
	if !d.Address.Is4() {
		ld.AddressFamily = unix.AF_INET6
	}
	return ld
}

func fromLibDestination(ld *mobyipvs.Destination) (*Destination, error) {
	addr, ok := netip.AddrFromSlice(ld.Address)
	if !ok {
		return nil, fmt.Errorf("destination with unparsable address %v", ld.Address)
	}
	return &Destination{
		Address:             addr.Unmap(),
		Port:                ld.Port,
		Weight:              ld.Weight,
		ActiveConnections:   ld.ActiveConnections,
		InactiveConnections: ld.InactiveConnections,
	}, nil
}

// checkIPVS reports whether the kernel has IPVS, loading ip_vs when it is
// missing.
func checkIPVS() error {
	if ipvsPresent() {
		return nil
	}
	modErr := modprobe("ip_vs")
	if modErr == nil && ipvsPresent() {
		return nil
	}
	if modErr == nil {
		modErr = errors.New("modprobe succeeded but IPVS is still missing")
	}
	return fmt.Errorf("%w: kernel module ip_vs not loaded (no /proc/net/ip_vs, no IPVS generic netlink family) and loading it failed: %w",
		ErrUnavailable, modErr)
}

// ipvsPresent looks for IPVS's proc file and, failing that, its generic
// netlink family (the authoritative sign; the proc file may be hidden).
func ipvsPresent() bool {
	if _, err := os.Stat("/proc/net/ip_vs"); err == nil {
		return true
	}
	_, err := vnl.GenlFamilyGet("IPVS")
	return err == nil
}

// CheckScheduler reports whether the kernel has IPVS and the scheduler
// name: its module ip_vs_<name> loaded (/sys/module, /proc/modules), built
// in (modules.builtin of the running kernel), or loadable with modprobe.
// The error matches ErrUnavailable or ErrSchedulerUnavailable and names the
// missing module.
func CheckScheduler(name string) error {
	if err := validSchedulerName(name); err != nil {
		return err
	}
	if err := checkIPVS(); err != nil {
		return fmt.Errorf("IPVS scheduler %q: %w", name, err)
	}
	mod := "ip_vs_" + name
	if moduleLoaded(mod) || moduleBuiltin(mod) {
		return nil
	}
	if err := modprobe(mod); err != nil {
		return fmt.Errorf("%w: %q needs kernel module %s, which is neither loaded nor built in, and loading it failed: %w",
			ErrSchedulerUnavailable, name, mod, err)
	}
	return nil
}

// moduleLoaded reports whether module is loaded.
func moduleLoaded(module string) bool {
	if _, err := os.Stat(filepath.Join("/sys/module", module)); err == nil {
		return true
	}
	data, err := os.ReadFile("/proc/modules")
	if err != nil {
		return false
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) > 0 && f[0] == module {
			return true
		}
	}
	return false
}

// moduleBuiltin reports whether module is built into the running kernel.
func moduleBuiltin(module string) bool {
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		return false
	}
	data, err := os.ReadFile(filepath.Join("/lib/modules", unix.ByteSliceToString(uts.Release[:]), "modules.builtin"))
	if err != nil {
		return false
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		base := strings.TrimSuffix(filepath.Base(strings.TrimSpace(sc.Text())), ".ko")
		if strings.ReplaceAll(base, "-", "_") == module {
			return true
		}
	}
	return false
}

// modprobe loads module.
func modprobe(module string) error {
	path, err := exec.LookPath("modprobe")
	if err != nil {
		return fmt.Errorf("cannot load %s: %w", module, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), modprobeTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, path, module).CombinedOutput()
	if err != nil {
		return fmt.Errorf("modprobe %s: %w: %s", module, err, bytes.TrimSpace(out))
	}
	return nil
}
