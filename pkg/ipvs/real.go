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
)

// Options configures the real implementation returned by New.
type Options struct {
	// NetNS, when set, is the named network namespace (as made by `ip
	// netns add`) whose IPVS table the Real manages; for tests and tools.
	// Empty means the current namespace.
	NetNS string
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
type Real struct {
	mu sync.Mutex
	h  *mobyipvs.Handle
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
	if opts.NetNS != "" {
		path = filepath.Join(netnsDir, opts.NetNS)
		if _, err := os.Stat(path); err != nil {
			return nil, fmt.Errorf("network namespace %q: %w", opts.NetNS, err)
		}
	}
	h, err := mobyipvs.New(path)
	if err != nil {
		where := "the current network namespace"
		if path != "" {
			where = "network namespace " + opts.NetNS
		}
		return nil, fmt.Errorf("opening IPVS netlink socket in %s: %w", where, err)
	}
	return &Real{h: h}, nil
}

// Close releases the netlink socket.
func (r *Real) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.h != nil {
		r.h.Close()
		r.h = nil
	}
	return nil
}

// do runs fn with the handle, after checking ctx.
func (r *Real) do(ctx context.Context, fn func(h *mobyipvs.Handle) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.h == nil {
		return errors.New("IPVS handle is closed")
	}
	return fn(r.h)
}

// Services implements Interface. Firewall-mark services and protocols
// other than TCP, UDP and SCTP are left out.
func (r *Real) Services(ctx context.Context) ([]*Service, error) {
	var libs []*mobyipvs.Service
	err := r.do(ctx, func(h *mobyipvs.Handle) error {
		var err error
		libs, err = h.GetServices()
		return err
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
	err := r.do(ctx, func(h *mobyipvs.Handle) error { return h.NewService(toLibService(svc)) })
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
	err := r.do(ctx, func(h *mobyipvs.Handle) error { return h.UpdateService(toLibService(svc)) })
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
	err := r.do(ctx, func(h *mobyipvs.Handle) error { return h.DelService(toLibService(svc)) })
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
	var libs []*mobyipvs.Destination
	err := r.do(ctx, func(h *mobyipvs.Handle) error {
		ls := toLibService(svc)
		var err error
		libs, err = h.GetDestinations(ls)
		if err == nil && len(libs) == 0 {
			_, err = h.GetService(ls)
		}
		return err
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
	err := r.do(ctx, func(h *mobyipvs.Handle) error { return h.NewDestination(toLibService(svc), toLibDestination(dst)) })
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
	err := r.do(ctx, func(h *mobyipvs.Handle) error { return h.UpdateDestination(toLibService(svc), toLibDestination(dst)) })
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
	err := r.do(ctx, func(h *mobyipvs.Handle) error { return h.DelDestination(toLibService(svc), toLibDestination(dst)) })
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
	err := r.do(ctx, func(h *mobyipvs.Handle) error {
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
	var c *mobyipvs.Config
	err := r.do(ctx, func(h *mobyipvs.Handle) error {
		var err error
		c, err = h.GetConfig()
		return err
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
