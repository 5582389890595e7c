package netlink

import (
	"context"
	"fmt"
	"iter"
	"maps"
	"net/netip"
	"slices"
	"sync"
)

// Fake is an in-memory set of devices and their addresses: a state store
// executing the Interface operations with the kernel's rules (device name
// limits, dummy devices only where a dummy is asked for, addresses bound to
// existing devices only). Tests add the node's other devices with
// AddDevice and make the kernel refuse chosen changes with SetRefuse. Safe
// for concurrent use.
type Fake struct {
	mu      sync.Mutex
	devices map[string]*fakeDevice
	refuse  RefuseFunc
}

// Op names a change to devices or addresses, for a RefuseFunc.
type Op string

// The changes a RefuseFunc is asked about.
const (
	OpCreateDevice  Op = "create device"
	OpDeleteDevice  Op = "delete device"
	OpBindAddress   Op = "bind address"
	OpUnbindAddress Op = "unbind address"
)

// RefuseFunc decides whether the fake kernel refuses a change to device
// dev: a non-nil error fails the operation with that error (wrapped) and
// changes nothing, as the kernel refusing it would. addr is the address of
// OpBindAddress and OpUnbindAddress, zero otherwise. It is asked only for
// changes that would happen (not for binding an address the device has,
// nor unbinding one it lacks), with the Fake's lock held: it must not call
// back into the Fake.
type RefuseFunc func(op Op, dev string, addr netip.Addr) error

type fakeDevice struct {
	dummy bool
	addrs map[netip.Addr]bool
}

var _ Interface = (*Fake)(nil)

// NewFake returns a Fake without devices.
func NewFake() *Fake {
	return &Fake{devices: map[string]*fakeDevice{}}
}

// AddDevice creates or replaces the non-dummy device name (such as "lo" or
// "eth0") with addrs, which may include IPv6 link-local addresses.
func (f *Fake) AddDevice(name string, addrs ...netip.Addr) error {
	if err := validateDeviceName(name); err != nil {
		return err
	}
	d := &fakeDevice{addrs: map[netip.Addr]bool{}}
	for _, a := range addrs {
		if !a.IsValid() || a.Zone() != "" || a.Is4In6() {
			return fmt.Errorf("device %s: invalid address %s", name, a)
		}
		d.addrs[a] = true
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.devices[name] = d
	return nil
}

// SetRefuse makes the fake refuse the changes fn refuses; nil refuses
// nothing.
func (f *Fake) SetRefuse(fn RefuseFunc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse = fn
}

// refused asks the refusal hook about op; called with f.mu held.
func (f *Fake) refused(op Op, dev string, addr netip.Addr) error {
	if f.refuse == nil {
		return nil
	}
	if err := f.refuse(op, dev, addr); err != nil {
		if addr.IsValid() {
			return fmt.Errorf("%s %s on device %s refused: %w", op, addr, dev, err)
		}
		return fmt.Errorf("%s %s refused: %w", op, dev, err)
	}
	return nil
}

// Devices lists the device names, sorted.
func (f *Fake) Devices() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.devices))
}

// IsDummy reports whether name exists and is a dummy device.
func (f *Fake) IsDummy(name string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.devices[name]
	return ok && d.dummy
}

// EnsureDummyDevice implements Interface.
func (f *Fake) EnsureDummyDevice(ctx context.Context, name string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if err := validateDeviceName(name); err != nil {
		return false, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if d, ok := f.devices[name]; ok {
		if !d.dummy {
			return true, fmt.Errorf("device %s is not a dummy device: %w", name, ErrNotDummy)
		}
		return true, nil
	}
	if err := f.refused(OpCreateDevice, name, netip.Addr{}); err != nil {
		return false, err
	}
	f.devices[name] = &fakeDevice{dummy: true, addrs: map[netip.Addr]bool{}}
	return false, nil
}

// DeleteDummyDevice implements Interface.
func (f *Fake) DeleteDummyDevice(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateDeviceName(name); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.devices[name]
	if !ok {
		return nil
	}
	if !d.dummy {
		return fmt.Errorf("not deleting device %s: %w", name, ErrNotDummy)
	}
	if err := f.refused(OpDeleteDevice, name, netip.Addr{}); err != nil {
		return err
	}
	delete(f.devices, name)
	return nil
}

// EnsureAddressBound implements Interface.
func (f *Fake) EnsureAddressBound(ctx context.Context, addr netip.Addr, dev string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if err := validateAddress(addr); err != nil {
		return false, err
	}
	if err := validateDeviceName(dev); err != nil {
		return false, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.devices[dev]
	if !ok {
		return false, fmt.Errorf("binding %s to device %s: device %w", addr, dev, ErrNotExist)
	}
	if d.addrs[addr] {
		return true, nil
	}
	if err := f.refused(OpBindAddress, dev, addr); err != nil {
		return false, err
	}
	d.addrs[addr] = true
	return false, nil
}

// UnbindAddress implements Interface.
func (f *Fake) UnbindAddress(ctx context.Context, addr netip.Addr, dev string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateAddress(addr); err != nil {
		return err
	}
	if err := validateDeviceName(dev); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if d, ok := f.devices[dev]; ok && d.addrs[addr] {
		if err := f.refused(OpUnbindAddress, dev, addr); err != nil {
			return err
		}
		delete(d.addrs, addr)
	}
	return nil
}

// ListBoundAddresses implements Interface.
func (f *Fake) ListBoundAddresses(ctx context.Context, dev string) ([]netip.Addr, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := validateDeviceName(dev); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.devices[dev]
	if !ok {
		return nil, fmt.Errorf("listing addresses of device %s: device %w", dev, ErrNotExist)
	}
	return sortedListed(maps.Keys(d.addrs)), nil
}

// LocalAddresses implements Interface.
func (f *Fake) LocalAddresses(ctx context.Context, excludeDevs ...string) ([]netip.Addr, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	all := map[netip.Addr]bool{}
	for name, d := range f.devices {
		if slices.Contains(excludeDevs, name) {
			continue
		}
		maps.Copy(all, d.addrs)
	}
	return sortedListed(maps.Keys(all)), nil
}

func sortedListed(addrs iter.Seq[netip.Addr]) []netip.Addr {
	out := []netip.Addr{}
	for a := range addrs {
		if listed(a) {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}
