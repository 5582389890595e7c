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
