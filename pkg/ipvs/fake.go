package ipvs

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// DefaultTimeouts are the kernel's initial IPVS timeouts, which NewFake
// starts with.
var DefaultTimeouts = Timeouts{TCP: 900 * time.Second, TCPFin: 120 * time.Second, UDP: 300 * time.Second}

// AllSchedulers are the schedulers a stock kernel ships (ip_vs_<name>
// modules); NewFake makes all of them available.
var AllSchedulers = []string{"rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf", "mh", "twos"}

// Fake is an in-memory IPVS table: a state store executing the Interface
// operations with the kernel's rules (duplicate and missing services and
// destinations, schedulers that must exist, destination family and weight
// checks, timeouts where zero means unchanged). Tests set connection
// counters with SetConnections, make the kernel refuse chosen changes with
// SetRefuse, and inspect the table with Services and Destinations. Safe for
// concurrent use.
type Fake struct {
	mu         sync.Mutex
	services   map[serviceKey]*fakeService
	timeouts   Timeouts
	schedulers map[string]bool
	refuse     RefuseFunc
}

// Op names a change to the table, for a RefuseFunc.
type Op string

// The changes a RefuseFunc is asked about.
const (
	OpAddService        Op = "add service"
	OpUpdateService     Op = "update service"
	OpDeleteService     Op = "delete service"
	OpAddDestination    Op = "add destination"
	OpUpdateDestination Op = "update destination"
	OpDeleteDestination Op = "delete destination"
)

// RefuseFunc decides whether the fake kernel refuses a change: a non-nil
// error fails the operation with that error (wrapped) and changes nothing,
// as the kernel refusing it would (EINVAL for what it cannot carry, ENOMEM,
// a missing module). dst is nil for the service operations. It is asked
// after the operation's own checks (a duplicate service is still
// ErrExist), with the Fake's lock held: it must not call back into the Fake.
type RefuseFunc func(op Op, svc *Service, dst *Destination) error

type fakeService struct {
	svc   Service
	dests map[destKey]*Destination
}

var _ Interface = (*Fake)(nil)

// NewFake returns an empty table with DefaultTimeouts and every scheduler
// in AllSchedulers available.
func NewFake() *Fake {
	f := &Fake{services: map[serviceKey]*fakeService{}, timeouts: DefaultTimeouts, schedulers: map[string]bool{}}
	for _, s := range AllSchedulers {
		f.schedulers[s] = true
	}
	return f
}

// SetSchedulers replaces the set of schedulers the fake kernel has; a
// service naming another one fails as with a missing module.
func (f *Fake) SetSchedulers(names ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.schedulers = map[string]bool{}
	for _, s := range names {
		f.schedulers[s] = true
	}
}

// SetRefuse makes the fake refuse the changes fn refuses; nil refuses
// nothing.
func (f *Fake) SetRefuse(fn RefuseFunc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse = fn
}

// refused asks the refusal hook about op; called with f.mu held.
func (f *Fake) refused(op Op, svc *Service, dst *Destination) error {
	if f.refuse == nil {
		return nil
	}
	if err := f.refuse(op, svc, dst); err != nil {
		what := svc.key().String()
		if dst != nil {
			what = netip.AddrPortFrom(dst.Address, dst.Port).String() + " of " + what
		}
		return fmt.Errorf("IPVS %s %s refused: %w", op, what, err)
	}
	return nil
}

// CheckScheduler is the fake's CheckScheduler: nil when name is available.
func (f *Fake) CheckScheduler(name string) error {
	if err := validSchedulerName(name); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.checkScheduler(name)
}

func (f *Fake) checkScheduler(name string) error {
	if !f.schedulers[name] {
		return fmt.Errorf("%w: %q (kernel module ip_vs_%s not loaded)", ErrSchedulerUnavailable, name, name)
	}
	return nil
}

func checkCtx(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return nil
}

func (f *Fake) service(svc *Service) (*fakeService, error) {
	fs, ok := f.services[svc.key()]
	if !ok {
		return nil, fmt.Errorf("IPVS service %s: %w", svc.key(), ErrNotExist)
	}
	return fs, nil
}

// stored returns a copy of svc as the kernel would report it.
func stored(svc *Service) Service {
	s := *svc
	s.Scheduler = svc.scheduler()
	return s
}

// Services implements Interface.
func (f *Fake) Services(ctx context.Context) ([]*Service, error) {
	if err := checkCtx(ctx); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]*Service, 0, len(f.services))
	for _, fs := range f.services {
		s := fs.svc
		out = append(out, &s)
	}
	slices.SortFunc(out, compareServices)
	return out, nil
}

// AddService implements Interface.
func (f *Fake) AddService(ctx context.Context, svc *Service) error {
	if err := checkCtx(ctx); err != nil {
		return err
	}
	if err := validateService(svc); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.services[svc.key()]; ok {
		return fmt.Errorf("adding IPVS service %s: %w", svc.key(), ErrExist)
	}
	if err := f.checkScheduler(svc.scheduler()); err != nil {
		return fmt.Errorf("adding IPVS service %s: %w", svc.key(), err)
	}
	if err := f.refused(OpAddService, svc, nil); err != nil {
		return err
	}
	f.services[svc.key()] = &fakeService{svc: stored(svc), dests: map[destKey]*Destination{}}
	return nil
}

// UpdateService implements Interface.
func (f *Fake) UpdateService(ctx context.Context, svc *Service) error {
	if err := checkCtx(ctx); err != nil {
		return err
	}
	if err := validateService(svc); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	fs, err := f.service(svc)
	if err != nil {
		return fmt.Errorf("updating: %w", err)
	}
	if err := f.checkScheduler(svc.scheduler()); err != nil {
		return fmt.Errorf("updating IPVS service %s: %w", svc.key(), err)
	}
	if err := f.refused(OpUpdateService, svc, nil); err != nil {
		return err
	}
	fs.svc = stored(svc)
	return nil
}

// DeleteService implements Interface.
func (f *Fake) DeleteService(ctx context.Context, svc *Service) error {
	if err := checkCtx(ctx); err != nil {
		return err
	}
	if err := validateService(svc); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.service(svc); err != nil {
		return fmt.Errorf("deleting: %w", err)
	}
	if err := f.refused(OpDeleteService, svc, nil); err != nil {
		return err
	}
	delete(f.services, svc.key())
	return nil
}

// Destinations implements Interface.
func (f *Fake) Destinations(ctx context.Context, svc *Service) ([]*Destination, error) {
	if err := checkCtx(ctx); err != nil {
		return nil, err
	}
	if err := validateService(svc); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	fs, err := f.service(svc)
	if err != nil {
		return nil, fmt.Errorf("listing destinations: %w", err)
	}
	out := make([]*Destination, 0, len(fs.dests))
	for _, d := range fs.dests {
		dd := *d
		out = append(out, &dd)
	}
	slices.SortFunc(out, compareDestinations)
	return out, nil
}

// AddDestination implements Interface.
func (f *Fake) AddDestination(ctx context.Context, svc *Service, dst *Destination) error {
	if err := checkCtx(ctx); err != nil {
		return err
	}
	if err := validateDestination(svc, dst); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	fs, err := f.service(svc)
	if err != nil {
		return fmt.Errorf("adding destination %s: %w", dst, err)
	}
	k := destKey{dst.Address, dst.Port}
	if _, ok := fs.dests[k]; ok {
		return fmt.Errorf("adding destination %s to IPVS service %s: %w", dst, svc.key(), ErrExist)
	}
	if err := f.refused(OpAddDestination, svc, dst); err != nil {
		return err
	}
	fs.dests[k] = &Destination{Address: dst.Address, Port: dst.Port, Weight: dst.Weight}
	return nil
}

// UpdateDestination implements Interface. Connection counters are kept.
func (f *Fake) UpdateDestination(ctx context.Context, svc *Service, dst *Destination) error {
	if err := checkCtx(ctx); err != nil {
		return err
	}
	if err := validateDestination(svc, dst); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	d, err := f.destination(svc, dst)
	if err != nil {
		return fmt.Errorf("updating %w", err)
	}
	if err := f.refused(OpUpdateDestination, svc, dst); err != nil {
		return err
	}
	d.Weight = dst.Weight
	return nil
}

// DeleteDestination implements Interface.
func (f *Fake) DeleteDestination(ctx context.Context, svc *Service, dst *Destination) error {
	if err := checkCtx(ctx); err != nil {
		return err
	}
	if err := validateDestination(svc, dst); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, err := f.destination(svc, dst); err != nil {
		return fmt.Errorf("deleting %w", err)
	}
	if err := f.refused(OpDeleteDestination, svc, dst); err != nil {
		return err
	}
	delete(f.services[svc.key()].dests, destKey{dst.Address, dst.Port})
	return nil
}

func (f *Fake) destination(svc *Service, dst *Destination) (*Destination, error) {
	fs, err := f.service(svc)
	if err != nil {
		return nil, fmt.Errorf("destination %s: %w", netip.AddrPortFrom(dst.Address, dst.Port), err)
	}
	d, ok := fs.dests[destKey{dst.Address, dst.Port}]
	if !ok {
		return nil, fmt.Errorf("destination %s of IPVS service %s: %w", netip.AddrPortFrom(dst.Address, dst.Port), svc.key(), ErrNotExist)
	}
	return d, nil
}

// SetTimeouts implements Interface.
func (f *Fake) SetTimeouts(ctx context.Context, t Timeouts) error {
	if err := checkCtx(ctx); err != nil {
		return err
	}
	if err := validateTimeouts(t); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if t.TCP != 0 {
		f.timeouts.TCP = t.TCP
	}
	if t.TCPFin != 0 {
		f.timeouts.TCPFin = t.TCPFin
	}
	if t.UDP != 0 {
		f.timeouts.UDP = t.UDP
	}
	return nil
}

// GetTimeouts implements Interface.
func (f *Fake) GetTimeouts(ctx context.Context) (Timeouts, error) {
	if err := checkCtx(ctx); err != nil {
		return Timeouts{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.timeouts, nil
}

// SetConnections sets the active and inactive connection counters of an
// existing destination, as traffic would.
func (f *Fake) SetConnections(svc *Service, dst *Destination, active, inactive int) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, err := f.destination(svc, dst)
	if err != nil {
		return err
	}
	d.ActiveConnections, d.InactiveConnections = active, inactive
	return nil
}

// Len reports the number of services in the table.
func (f *Fake) Len() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.services)
}

// ServiceStrings lists the services in the table as Service.String
// formats them, sorted.
func (f *Fake) ServiceStrings() []string {
	svcs, _ := f.Services(context.Background())
	out := make([]string, 0, len(svcs))
	for _, s := range svcs {
		out = append(out, s.String())
	}
	slices.Sort(out)
	return out
}

// Schedulers lists the available schedulers, sorted.
func (f *Fake) Schedulers() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.schedulers))
}
