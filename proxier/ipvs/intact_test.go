package ipvs

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kproxy/kproxy/pkg/ipvs"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestFlushRepaired removes part of kproxy's IPVS-mode state behind its
// back, as ipvsadm, ipset and ip would: the next sync, although nothing
// changed, finds it and is made full, which repairs it.
func TestFlushRepaired(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		flush func(t *testing.T, k *fakeKernel)
		found string // in SyncStats.Repaired
	}{
		{
			name: "ipvsadm -C",
			flush: func(t *testing.T, k *fakeKernel) {
				svcs, err := k.ipvs.Services(ctx)
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range svcs {
					if err := k.ipvs.DeleteService(ctx, s); err != nil {
						t.Fatal(err)
					}
				}
			},
			found: "IPVS virtual server",
		},
		{
			name: "ipset flush (every set)",
			flush: func(t *testing.T, k *fakeKernel) {
				sets, _ := k.sets.ListSets(ctx)
				for _, s := range sets {
					if err := k.sets.FlushSet(ctx, s); err != nil {
						t.Fatal(err)
					}
				}
			},
			found: "was flushed",
		},
		{
			name: "ipset flush of one set",
			flush: func(t *testing.T, k *fakeKernel) {
				if err := k.sets.FlushSet(ctx, setClusterIP); err != nil {
					t.Fatal(err)
				}
			},
			found: "ipset " + setClusterIP + " was flushed",
		},
		{
			name: "ipset flush of one small set",
			flush: func(t *testing.T, k *fakeKernel) {
				if err := k.sets.FlushSet(ctx, setIPVSAddresses); err != nil {
					t.Fatal(err)
				}
			},
			found: "ipset " + setIPVSAddresses + " was flushed",
		},
		{
			name: "iptables -F then ipset destroy of one set",
			flush: func(t *testing.T, k *fakeKernel) {
				referenced := k.sets.Referenced
				k.sets.Referenced = nil
				defer func() { k.sets.Referenced = referenced }()
				if err := k.sets.DestroySet(ctx, setNodePort); err != nil {
					t.Fatal(err)
				}
			},
			found: "ipset " + setNodePort + " is gone",
		},
		{
			name: "ipset destroy of the unreferenced canary set",
			flush: func(t *testing.T, k *fakeKernel) {
				if err := k.sets.DestroySet(ctx, setCanary); err != nil {
					t.Fatal(err)
				}
			},
			found: "is gone",
		},
		{
			name: "ip addr flush dev " + DefaultDummyDevice,
			flush: func(t *testing.T, k *fakeKernel) {
				addrs, err := k.nl.ListBoundAddresses(ctx, DefaultDummyDevice)
				if err != nil {
					t.Fatal(err)
				}
				for _, a := range addrs {
					if err := k.nl.UnbindAddress(ctx, a, DefaultDummyDevice); err != nil {
						t.Fatal(err)
					}
				}
			},
			found: "was missing from " + DefaultDummyDevice,
		},
		{
			name: "ip addr del of one address of " + DefaultDummyDevice,
			flush: func(t *testing.T, k *fakeKernel) {
				if err := k.nl.UnbindAddress(ctx, netip.MustParseAddr("10.96.0.7"), DefaultDummyDevice); err != nil {
					t.Fatal(err)
				}
			},
			found: "address 10.96.0.7 was missing from " + DefaultDummyDevice,
		},
		{
			name: "ip link del " + DefaultDummyDevice,
			flush: func(t *testing.T, k *fakeKernel) {
				if err := k.nl.DeleteDummyDevice(ctx, DefaultDummyDevice); err != nil {
					t.Fatal(err)
				}
			},
			found: "device " + DefaultDummyDevice + " is gone",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			pt.AddNumberedServices(h.engine, 10)
			h.sync()
			if st := h.sync(); st.Full || st.Repaired != "" {
				t.Fatalf("a sync with nothing changed: full %v, repaired %q", st.Full, st.Repaired)
			}
			tc.flush(t, h.k)
			// The next sync comes at most a sync period later (the
			// canary interval): the device's addresses are listed.
			h.clock.Step(DefaultCanaryInterval / 2)
			st := h.sync()
			if !st.Full || !strings.Contains(st.Repaired, tc.found) {
				t.Errorf("sync after the flush: full %v, found %q; want a full sync that found %q", st.Full, st.Repaired, tc.found)
			}
			var flows []pt.Flow
			for i := range 10 {
				ep := fmt.Sprintf("10.244.2.%d:8080", i+1)
				flows = append(flows,
					flowTo(fmt.Sprintf("cluster IP %d", i), fmt.Sprintf("10.96.0.%d", i+1), 80, ep),
					flowTo(fmt.Sprintf("node port %d", i), "10.0.0.1", 30000+i, ep))
			}
			h.flows(flows...)
			// Repaired whole: a full sync finds nothing to do.
			h.backend.initialized = false
			full := h.sync()
			full.Full, full.Duration, full.VirtualServers, full.Terminating, full.Restores = false, 0, 0, 0, 0
			if full != (SyncStats{}) {
				t.Errorf("a full sync after the repair changed %+v", full)
			}
		})
	}
}

// TestFlushCheckFindsNothing checks that the check before a partial sync
// does not mistake kproxy's own state, nor an empty node, for a flush.
func TestFlushCheckFindsNothing(t *testing.T) {
	for _, n := range []int{0, 1, 20} {
		t.Run(fmt.Sprintf("%d services", n), func(t *testing.T) {
			h := newHarness(t, nil, Options{})
			pt.AddNumberedServices(h.engine, n)
			h.sync()
			for i := range 3 {
				h.clock.Step(DefaultCanaryInterval / 2 * time.Duration(i)) // probed, then listed
				if st := h.sync(); st.Full || st.Repaired != "" {
					t.Fatalf("sync %d with nothing changed: full %v, repaired %q", i, st.Full, st.Repaired)
				}
			}
			// A foreign virtual server going is not kproxy's business.
			foreign := &ipvs.Service{Address: nodeIP, Protocol: ipvs.ProtocolTCP, Port: 31999}
			if err := h.k.ipvs.AddService(context.Background(), foreign); err != nil {
				t.Fatal(err)
			}
			h.sync()
			if err := h.k.ipvs.DeleteService(context.Background(), foreign); err != nil {
				t.Fatal(err)
			}
			if st := h.sync(); st.Full || st.Repaired != "" {
				t.Errorf("a foreign virtual server deleted: full %v, repaired %q", st.Full, st.Repaired)
			}
		})
	}
}
