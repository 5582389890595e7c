package netlink

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"testing"
)

// fakeEnv is the Fake counterpart of the VM namespace: lo and a node
// device "eth0" with a global and a link-local IPv6 address.
func fakeEnv(t *testing.T) (*Fake, *env) {
	t.Helper()
	f := NewFake()
	if err := f.AddDevice("lo", lo4, lo6); err != nil {
		t.Fatal(err)
	}
	if err := f.AddDevice("eth0", nodeIP4, nodeIP6, netip.MustParseAddr("fe80::1")); err != nil {
		t.Fatal(err)
	}
	return f, &env{nl: f, nodeDev: "eth0", nodeAddrs: []netip.Addr{nodeIP4, nodeIP6}}
}

func TestFakeInterface(t *testing.T) {
	for _, c := range interfaceCases() {
		t.Run(c.name, func(t *testing.T) {
			_, e := fakeEnv(t)
			runCase(t, t.Context(), e, c)
		})
	}
}

func TestFakeDevices(t *testing.T) {
	ctx := t.Context()
	f, _ := fakeEnv(t)
	if _, err := f.EnsureDummyDevice(ctx, dummy); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		dev       string
		wantDummy bool
	}{
		{"dummy device", dummy, true},
		{"node device", "eth0", false},
		{"loopback", "lo", false},
		{"absent", "nosuch", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := f.IsDummy(c.dev); got != c.wantDummy {
				t.Errorf("IsDummy(%q) = %v, want %v", c.dev, got, c.wantDummy)
			}
		})
	}
	if got, want := f.Devices(), []string{"eth0", dummy, "lo"}; !slices.Equal(got, want) {
		t.Errorf("Devices() = %q, want %q", got, want)
	}
}

func TestFakeAddDevice(t *testing.T) {
	for _, c := range []struct {
		name    string
		dev     string
		addrs   []netip.Addr
		wantErr bool
	}{
		{name: "plain", dev: "eth1", addrs: []netip.Addr{nodeIP4}},
		{name: "no addresses", dev: "eth1"},
		{name: "bad name", dev: "a/b", wantErr: true},
		{name: "invalid address", dev: "eth1", addrs: []netip.Addr{{}}, wantErr: true},
		{name: "zoned address", dev: "eth1", addrs: []netip.Addr{netip.MustParseAddr("fe80::1%eth1")}, wantErr: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := NewFake()
			err := f.AddDevice(c.dev, c.addrs...)
			if (err != nil) != c.wantErr {
				t.Fatalf("AddDevice error %v, want error: %v", err, c.wantErr)
			}
			if err != nil {
				return
			}
			got, err := f.ListBoundAddresses(t.Context(), c.dev)
			if err != nil || !slices.Equal(got, append([]netip.Addr{}, c.addrs...)) {
				t.Errorf("ListBoundAddresses = %v, %v; want %v", got, err, c.addrs)
			}
		})
	}
}

func TestFakeCancelledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	f := NewFake()
	if _, err := f.EnsureDummyDevice(ctx, dummy); !errors.Is(err, context.Canceled) {
		t.Errorf("EnsureDummyDevice error %v, want context.Canceled", err)
	}
	if len(f.Devices()) != 0 {
		t.Errorf("cancelled EnsureDummyDevice created %v", f.Devices())
	}
	if _, err := f.LocalAddresses(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("LocalAddresses error %v, want context.Canceled", err)
	}
}

func TestFakeRefuse(t *testing.T) {
	errRefused := errors.New("operation not permitted")
	vipA, vipB := netip.MustParseAddr("10.96.0.1"), netip.MustParseAddr("10.96.0.2")
	for _, c := range []struct {
		name    string
		refuse  RefuseFunc
		op      func(ctx context.Context, f *Fake) error
		wantErr error
		// wantAddrs are the dummy device's addresses afterwards (nil: no
		// device).
		wantAddrs []netip.Addr
	}{
		{
			name: "a refused address is not bound, others are",
			refuse: func(op Op, _ string, a netip.Addr) error {
				return refuseIf(op == OpBindAddress && a == vipB, errRefused)
			},
			op: func(ctx context.Context, f *Fake) error {
				_, errB := f.EnsureAddressBound(ctx, vipB, dummy)
				_, errA := f.EnsureAddressBound(ctx, vipA, dummy)
				return errors.Join(errB, errA)
			},
			wantErr: errRefused, wantAddrs: []netip.Addr{vipA},
		},
		{
			name:   "binding a bound address is not asked about",
			refuse: func(Op, string, netip.Addr) error { return errRefused },
			op: func(ctx context.Context, f *Fake) error {
				_, err := f.EnsureAddressBound(ctx, vipA, dummy)
				return err
			},
			wantAddrs: []netip.Addr{vipA},
		},
		{
			name:   "refused unbinding and deletion change nothing",
			refuse: func(op Op, _ string, _ netip.Addr) error { return refuseIf(op != OpBindAddress, errRefused) },
			op: func(ctx context.Context, f *Fake) error {
				return errors.Join(f.UnbindAddress(ctx, vipA, dummy), f.DeleteDummyDevice(ctx, dummy))
			},
			wantErr: errRefused, wantAddrs: []netip.Addr{vipA},
		},
		{
			name:   "a refused device is not created",
			refuse: func(op Op, _ string, _ netip.Addr) error { return refuseIf(op == OpCreateDevice, errRefused) },
			op: func(ctx context.Context, f *Fake) error {
				_, err := f.EnsureDummyDevice(ctx, "other0")
				return err
			},
			wantErr: errRefused, wantAddrs: []netip.Addr{vipA},
		},
		{
			name: "nil refuses nothing",
			op:   func(ctx context.Context, f *Fake) error { return f.DeleteDummyDevice(ctx, dummy) },
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			f, _ := fakeEnv(t)
			if _, err := f.EnsureDummyDevice(ctx, dummy); err != nil {
				t.Fatal(err)
			}
			if _, err := f.EnsureAddressBound(ctx, vipA, dummy); err != nil {
				t.Fatal(err)
			}
			f.SetRefuse(c.refuse)
			err := c.op(ctx, f)
			if c.wantErr == nil && err != nil || c.wantErr != nil && !errors.Is(err, c.wantErr) {
				t.Errorf("error %v, want %v", err, c.wantErr)
			}
			f.SetRefuse(nil)
			if slices.Contains(f.Devices(), "other0") {
				t.Error("refused device created")
			}
			got, err := f.ListBoundAddresses(ctx, dummy)
			if c.wantAddrs == nil {
				if !errors.Is(err, ErrNotExist) {
					t.Errorf("dummy device: addresses %v, error %v; want it gone", got, err)
				}
				return
			}
			if !slices.Equal(got, c.wantAddrs) {
				t.Errorf("addresses %v (error %v), want %v", got, err, c.wantAddrs)
			}
		})
	}
}

// refuseIf returns err when cond holds.
func refuseIf(cond bool, err error) error {
	if cond {
		return err
	}
	return nil
}
