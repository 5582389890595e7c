package netlink

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"
)

// The cases in this file run against the Fake (fake_test.go) and, inside the
// IPVS VM, against the kernel (real_test.go): the fake must behave as the
// kernel does.

const dummy = "kproxy-ipvs0"

var (
	vip4   = netip.MustParseAddr("10.96.0.10")
	vip4b  = netip.MustParseAddr("10.96.0.11")
	vip6   = netip.MustParseAddr("fd00:96::10")
	errAny = errors.New("any error")
)

// env is what a case runs against: nodeDev is a non-dummy device (veth or
// fake "eth0") holding nodeAddrs, besides lo with 127.0.0.1 and ::1.
type env struct {
	nl        Interface
	nodeDev   string
	nodeAddrs []netip.Addr
}

var (
	nodeIP4 = netip.MustParseAddr("192.0.2.1")
	nodeIP6 = netip.MustParseAddr("2001:db8::1")
	lo4     = netip.MustParseAddr("127.0.0.1")
	lo6     = netip.MustParseAddr("::1")
)

type step struct {
	name    string
	op      func(ctx context.Context, e *env) error
	wantErr error // nil, a sentinel for errors.Is, or errAny
}

func ensureDummy(name string, wantExisted bool) step {
	return step{name: "ensure dummy " + name, op: func(ctx context.Context, e *env) error {
		existed, err := e.nl.EnsureDummyDevice(ctx, name)
		if err == nil && existed != wantExisted {
			return fmt.Errorf("existed = %v, want %v", existed, wantExisted)
		}
		return err
	}}
}

func deleteDummy(name string) step {
	return step{name: "delete dummy " + name, op: func(ctx context.Context, e *env) error {
		return e.nl.DeleteDummyDevice(ctx, name)
	}}
}

func bind(addr netip.Addr, dev string, wantExisted bool) step {
	return step{name: "bind " + addr.String() + " to " + dev, op: func(ctx context.Context, e *env) error {
		existed, err := e.nl.EnsureAddressBound(ctx, addr, dev)
		if err == nil && existed != wantExisted {
			return fmt.Errorf("existed = %v, want %v", existed, wantExisted)
		}
		return err
	}}
}

func unbind(addr netip.Addr, dev string) step {
	return step{name: "unbind " + addr.String() + " from " + dev, op: func(ctx context.Context, e *env) error {
		return e.nl.UnbindAddress(ctx, addr, dev)
	}}
}

// bound checks dev's addresses.
func bound(dev string, want ...netip.Addr) step {
	return step{name: "list " + dev, op: func(ctx context.Context, e *env) error {
		got, err := e.nl.ListBoundAddresses(ctx, dev)
		if err == nil && !slices.Equal(got, want) {
			return fmt.Errorf("addresses %v, want %v", got, want)
		}
		return err
	}}
}

// local checks LocalAddresses(exclude...) against the node's own addresses
// (lo and nodeDev) plus extra.
func local(exclude []string, extra ...netip.Addr) step {
	return step{name: fmt.Sprintf("local addresses excluding %v", exclude), op: func(ctx context.Context, e *env) error {
		got, err := e.nl.LocalAddresses(ctx, exclude...)
		if err != nil {
			return err
		}
		want := append([]netip.Addr{lo4, lo6}, e.nodeAddrs...)
		want = append(want, extra...)
		slices.SortFunc(want, netip.Addr.Compare)
		if !slices.Equal(got, want) {
			return fmt.Errorf("local addresses %v, want %v", got, want)
		}
		return nil
	}}
}

func (s step) fails(err error) step {
	s.wantErr = err
	return s
}

type interfaceCase struct {
	name  string
	steps []step
}

func interfaceCases() []interfaceCase {
	return []interfaceCase{
		{
			name: "dummy device is created once",
			steps: []step{
				ensureDummy(dummy, false),
				ensureDummy(dummy, true),
				bound(dummy),
			},
		},
		{
			name: "a device that is not a dummy is neither taken nor deleted",
			steps: []step{
				ensureDummy("lo", true).fails(ErrNotDummy),
				deleteDummy("lo").fails(ErrNotDummy),
				bound("lo", lo4, lo6),
			},
		},
		{
			name:  "deleting an absent device",
			steps: []step{deleteDummy(dummy), deleteDummy(dummy)},
		},
		{
			name: "invalid device names",
			steps: []step{
				ensureDummy("", false).fails(errAny),
				ensureDummy("averyveryverylongname", false).fails(errAny),
				ensureDummy("a/b", false).fails(errAny),
				bind(vip4, "a b", false).fails(errAny),
			},
		},
		{
			name: "bind IPv4 and IPv6 addresses",
			steps: []step{
				ensureDummy(dummy, false),
				bind(vip6, dummy, false),
				bind(vip4b, dummy, false),
				bind(vip4, dummy, false),
				bind(vip4, dummy, true),
				bind(vip6, dummy, true),
				bound(dummy, vip4, vip4b, vip6),
			},
		},
		{
			name: "bind to a missing device",
			steps: []step{
				bind(vip4, dummy, false).fails(ErrNotExist),
				bound(dummy).fails(ErrNotExist),
			},
		},
		{
			name: "invalid addresses",
			steps: []step{
				ensureDummy(dummy, false),
				bind(netip.Addr{}, dummy, false).fails(errAny),
				bind(netip.IPv4Unspecified(), dummy, false).fails(errAny),
				bind(netip.MustParseAddr("::ffff:10.0.0.1"), dummy, false).fails(errAny),
				bind(netip.MustParseAddr("fe80::1%eth0"), dummy, false).fails(errAny),
				bound(dummy),
			},
		},
		{
			name: "unbind",
			steps: []step{
				ensureDummy(dummy, false),
				bind(vip4, dummy, false),
				bind(vip6, dummy, false),
				unbind(vip4, dummy),
				unbind(vip4, dummy),
				bound(dummy, vip6),
				unbind(vip6, dummy),
				bound(dummy),
			},
		},
		{
			name:  "unbind from a missing device",
			steps: []step{unbind(vip4, dummy)},
		},
		{
			name: "deleting the dummy device removes its addresses",
			steps: []step{
				ensureDummy(dummy, false),
				bind(vip4, dummy, false),
				bind(vip6, dummy, false),
				deleteDummy(dummy),
				bound(dummy).fails(ErrNotExist),
				local(nil),
				ensureDummy(dummy, false),
				bound(dummy),
			},
		},
		{
			name: "local addresses with and without the dummy device",
			steps: []step{
				local(nil),
				ensureDummy(dummy, false),
				bind(vip4, dummy, false),
				bind(vip6, dummy, false),
				local(nil, vip4, vip6),
				local([]string{dummy}),
				local([]string{dummy, "nosuchdev"}),
			},
		},
		{
			name: "an address on the dummy device and on another device",
			steps: []step{
				ensureDummy(dummy, false),
				bind(nodeIP4, dummy, false),
				local(nil),
				local([]string{dummy}),
				bound(dummy, nodeIP4),
			},
		},
	}
}

// runCase runs c's steps against e.
func runCase(t *testing.T, ctx context.Context, e *env, c interfaceCase) {
	t.Helper()
	for i, s := range c.steps {
		err := s.op(ctx, e)
		switch {
		case s.wantErr == nil && err != nil:
			t.Fatalf("step %d (%s): unexpected error: %v", i, s.name, err)
		case s.wantErr != nil && err == nil:
			t.Fatalf("step %d (%s): succeeded, want error %v", i, s.name, s.wantErr)
		case s.wantErr != nil && s.wantErr != errAny && !errors.Is(err, s.wantErr):
			t.Fatalf("step %d (%s): error %v, want one matching %v", i, s.name, err, s.wantErr)
		}
	}
}
