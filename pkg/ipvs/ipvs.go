// Package ipvs is kproxy's small interface to the kernel's IP Virtual Server
// table: virtual services and their real servers (destinations), plus the
// connection timeouts. One real implementation talks generic netlink through
// github.com/moby/ipvs; one fake is an in-memory table that executes the same
// operations with the kernel's errors.
//
// Only address/protocol/port services with NAT forwarding are modelled;
// firewall-mark services exist in the kernel but are never listed here.
package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"time"
)

// Protocol is a virtual service's transport protocol.
type Protocol string

const (
	ProtocolTCP  Protocol = "TCP"
	ProtocolUDP  Protocol = "UDP"
	ProtocolSCTP Protocol = "SCTP"
)

// DefaultScheduler is the scheduler used when a Service names none, as
// ipvsadm does.
const DefaultScheduler = "rr"

// Service is a virtual server, identified by (Address, Protocol, Port).
type Service struct {
	Address  netip.Addr
	Protocol Protocol
	Port     uint16
	// Scheduler is the scheduling algorithm ("rr", "wrr", "lc", "wlc",
	// "sh", "dh", "mh", ...); empty means DefaultScheduler.
	Scheduler string
	// Persistent makes the service send every connection from one client
	// address to the same destination for Timeout seconds after the
	// client's last connection ends (session affinity). Persistence is per
	// client address: the netmask is always /32 (IPv4) or /128 (IPv6).
	Persistent bool
	// Timeout is the persistence timeout in seconds. The kernel keeps it
	// even when Persistent is false, so it reads back as written.
	Timeout uint32
}

// Destination is a real server of a Service, identified within the service
// by (Address, Port). Destinations always use masquerading (NAT).
type Destination struct {
	Address netip.Addr
	Port    uint16
	// Weight 0 quiesces the destination: it keeps its connections but
	// gets no new ones.
	Weight int
	// ActiveConnections and InactiveConnections are read from the kernel
	// (the fake: set with SetConnections); ignored on write.
	ActiveConnections, InactiveConnections int
}

// Timeouts are the kernel's global IPVS connection timeouts (ipvsadm
// --set). A zero field means "leave unchanged" on SetTimeouts.
type Timeouts struct {
	TCP, TCPFin, UDP time.Duration
}

// Interface is the whole of kproxy's access to one network namespace's IPVS
// table. Operations on missing or duplicate objects fail with errors that
// match ErrNotExist or ErrExist (errors.Is).
type Interface interface {
	// Services lists every address/port virtual service, sorted by
	// address, protocol and port.
	Services(ctx context.Context) ([]*Service, error)
	// AddService creates svc; ErrExist when it exists.
	AddService(ctx context.Context, svc *Service) error
	// UpdateService changes the scheduler and persistence of the existing
	// service svc identifies; ErrNotExist when absent.
	UpdateService(ctx context.Context, svc *Service) error
	// DeleteService removes the service and its destinations;
	// ErrNotExist when absent.
	DeleteService(ctx context.Context, svc *Service) error
	// Destinations lists svc's destinations sorted by address and port;
	// ErrNotExist when the service is absent.
	Destinations(ctx context.Context, svc *Service) ([]*Destination, error)
	// AddDestination adds dst to svc; ErrNotExist when the service is
	// absent, ErrExist when the destination exists.
	AddDestination(ctx context.Context, svc *Service, dst *Destination) error
	// UpdateDestination changes dst's weight; ErrNotExist when the
	// service or destination is absent.
	UpdateDestination(ctx context.Context, svc *Service, dst *Destination) error
	// DeleteDestination removes dst from svc; ErrNotExist when the service
	// or destination is absent.
	DeleteDestination(ctx context.Context, svc *Service, dst *Destination) error
	// SetTimeouts sets the non-zero fields of t.
	SetTimeouts(ctx context.Context, t Timeouts) error
	// GetTimeouts reads the current timeouts.
	GetTimeouts(ctx context.Context) (Timeouts, error)
}

var (
	// ErrExist: the service or destination already exists (EEXIST).
	ErrExist = errors.New("already exists")
	// ErrNotExist: the service (ESRCH) or destination (ENOENT) does not
	// exist.
	ErrNotExist = errors.New("does not exist")
	// ErrUnavailable: the kernel has no IPVS (module ip_vs not loaded and
	// not loadable).
	ErrUnavailable = errors.New("IPVS not available")
	// ErrSchedulerUnavailable: the kernel has no module for the requested
	// scheduler.
	ErrSchedulerUnavailable = errors.New("IPVS scheduler not available")
)

// String formats s as ipvsadm lists it: "TCP 10.0.0.1:80 rr persistent 10800".
func (s *Service) String() string {
	out := string(s.Protocol) + " " + netip.AddrPortFrom(s.Address, s.Port).String() + " " + s.scheduler()
	if s.Persistent {
		out += " persistent " + strconv.FormatUint(uint64(s.Timeout), 10)
	}
	return out
}

// String formats d as "10.1.0.1:8080 weight 1".
func (d *Destination) String() string {
	return netip.AddrPortFrom(d.Address, d.Port).String() + " weight " + strconv.Itoa(d.Weight)
}

func (s *Service) scheduler() string {
	if s.Scheduler == "" {
		return DefaultScheduler
	}
	return s.Scheduler
}

// serviceKey identifies a service in the table.
type serviceKey struct {
	addr     netip.Addr
	protocol Protocol
	port     uint16
}

func (s *Service) key() serviceKey { return serviceKey{s.Address, s.Protocol, s.Port} }

func (k serviceKey) String() string {
	return string(k.protocol) + " " + netip.AddrPortFrom(k.addr, k.port).String()
}

// destKey identifies a destination within a service.
type destKey struct {
	addr netip.Addr
	port uint16
}

// compareServices orders services by address, protocol, port.
func compareServices(a, b *Service) int {
	if c := a.Address.Compare(b.Address); c != 0 {
		return c
	}
	if a.Protocol != b.Protocol {
		if a.Protocol < b.Protocol {
			return -1
		}
		return 1
	}
	return int(a.Port) - int(b.Port)
}

// compareDestinations orders destinations by address, port.
func compareDestinations(a, b *Destination) int {
	if c := a.Address.Compare(b.Address); c != 0 {
		return c
	}
	return int(a.Port) - int(b.Port)
}

// validateService checks what the kernel would refuse (EINVAL) or what
// this package cannot express.
func validateService(svc *Service) error {
	if svc == nil {
		return errors.New("nil service")
	}
	if !svc.Address.IsValid() {
		return errors.New("service has no address")
	}
	if svc.Address.Zone() != "" || svc.Address.Is4In6() {
		return fmt.Errorf("service address %s: use a plain IPv4 or IPv6 address", svc.Address)
	}
	switch svc.Protocol {
	case ProtocolTCP, ProtocolUDP, ProtocolSCTP:
	default:
		return fmt.Errorf("service %s: unknown protocol %q", netip.AddrPortFrom(svc.Address, svc.Port), svc.Protocol)
	}
	if err := validSchedulerName(svc.scheduler()); err != nil {
		return fmt.Errorf("service %s: %w", svc.key(), err)
	}
	return nil
}

// validateDestination checks svc, then dst for svc: NAT forwarding needs
// both in the same family, and weights are non-negative.
func validateDestination(svc *Service, dst *Destination) error {
	if err := validateService(svc); err != nil {
		return err
	}
	if dst == nil {
		return errors.New("nil destination")
	}
	if !dst.Address.IsValid() {
		return fmt.Errorf("destination of %s has no address", svc.key())
	}
	if dst.Address.Zone() != "" || dst.Address.Is4In6() {
		return fmt.Errorf("destination %s: use a plain IPv4 or IPv6 address", dst.Address)
	}
	if dst.Address.Is4() != svc.Address.Is4() {
		return fmt.Errorf("destination %s of %s: address family differs from the service's (invalid argument)",
			netip.AddrPortFrom(dst.Address, dst.Port), svc.key())
	}
	if dst.Weight < 0 {
		return fmt.Errorf("destination %s of %s: negative weight %d (invalid argument)",
			netip.AddrPortFrom(dst.Address, dst.Port), svc.key(), dst.Weight)
	}
	return nil
}

// validSchedulerName accepts the names the kernel's scheduler modules use
// (lower-case letters and digits), which also keeps module names built from
// them safe.
func validSchedulerName(name string) error {
	if name == "" || len(name) > 15 {
		return fmt.Errorf("invalid IPVS scheduler name %q", name)
	}
	for _, c := range name {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return fmt.Errorf("invalid IPVS scheduler name %q", name)
		}
	}
	return nil
}

// validateTimeouts accepts whole, non-negative seconds that fit the
// kernel's 32-bit fields.
func validateTimeouts(t Timeouts) error {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"TCP", t.TCP}, {"TCP FIN", t.TCPFin}, {"UDP", t.UDP}} {
		switch {
		case f.d < 0:
			return fmt.Errorf("IPVS %s timeout %v is negative", f.name, f.d)
		case f.d%time.Second != 0:
			return fmt.Errorf("IPVS %s timeout %v is not a whole number of seconds", f.name, f.d)
		case f.d/time.Second > 1<<32-1:
			return fmt.Errorf("IPVS %s timeout %v is too large", f.name, f.d)
		}
	}
	return nil
}
