package ipvs

import (
	"context"
	"errors"
	"slices"
	"testing"
)

func TestFakeInterface(t *testing.T) {
	for _, c := range interfaceCases() {
		t.Run(c.name, func(t *testing.T) {
			runCase(t, t.Context(), NewFake(), c)
		})
	}
}

func TestFakeTimeouts(t *testing.T) {
	for _, c := range timeoutsCases() {
		t.Run(c.name, func(t *testing.T) {
			runTimeoutsCase(t, t.Context(), NewFake(), c)
		})
	}
}

func TestFakeConnections(t *testing.T) {
	dst := &Destination{Address: ep4a, Port: 8080, Weight: 1}
	for _, c := range []struct {
		name string
		// prepare runs before SetConnections.
		prepare    func(ctx context.Context, f *Fake) error
		svc        *Service
		dst        *Destination
		wantErr    error
		wantActive int
		wantInact  int
	}{
		{
			name:       "counters of an existing destination",
			svc:        tcp4(),
			dst:        dst,
			wantActive: 3, wantInact: 2,
		},
		{
			name: "weight update keeps counters",
			svc:  tcp4(),
			dst:  dst,
			prepare: func(ctx context.Context, f *Fake) error {
				return f.UpdateDestination(ctx, tcp4(), &Destination{Address: ep4a, Port: 8080, Weight: 0})
			},
			wantActive: 3, wantInact: 2,
		},
		{
			name:    "missing destination",
			svc:     tcp4(),
			dst:     &Destination{Address: ep4b, Port: 8080},
			wantErr: ErrNotExist,
		},
		{
			name:    "missing service",
			svc:     &Service{Address: vip4, Protocol: ProtocolUDP, Port: 80},
			dst:     dst,
			wantErr: ErrNotExist,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			f := NewFake()
			if err := f.AddService(ctx, tcp4()); err != nil {
				t.Fatal(err)
			}
			if err := f.AddDestination(ctx, tcp4(), dst); err != nil {
				t.Fatal(err)
			}
			err := f.SetConnections(c.svc, c.dst, 3, 2)
			if c.prepare != nil {
				if perr := c.prepare(ctx, f); perr != nil {
					t.Fatal(perr)
				}
			}
			if !errors.Is(err, c.wantErr) {
				t.Fatalf("SetConnections error %v, want %v", err, c.wantErr)
			}
			if c.wantErr != nil {
				return
			}
			dsts, err := f.Destinations(ctx, c.svc)
			if err != nil {
				t.Fatal(err)
			}
			if len(dsts) != 1 || dsts[0].ActiveConnections != c.wantActive || dsts[0].InactiveConnections != c.wantInact {
				t.Errorf("destinations %+v, want one with %d active, %d inactive", dsts, c.wantActive, c.wantInact)
			}
		})
	}
}

func TestFakeSchedulers(t *testing.T) {
	for _, c := range []struct {
		name      string
		available []string // nil: the defaults
		check     string
		wantErr   error
	}{
		{name: "default has rr", check: "rr"},
		{name: "default has mh", check: "mh"},
		{name: "default lacks unknown", check: "nosuch", wantErr: ErrSchedulerUnavailable},
		{name: "restricted set lacks sh", available: []string{"rr", "wrr"}, check: "sh", wantErr: ErrSchedulerUnavailable},
		{name: "restricted set has wrr", available: []string{"rr", "wrr"}, check: "wrr"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := NewFake()
			if c.available != nil {
				f.SetSchedulers(c.available...)
				if got := f.Schedulers(); !slices.Equal(got, c.available) {
					t.Errorf("Schedulers() = %v, want %v", got, c.available)
				}
			}
			if err := f.CheckScheduler(c.check); !errors.Is(err, c.wantErr) {
				t.Errorf("CheckScheduler(%q) = %v, want %v", c.check, err, c.wantErr)
			}
			err := f.AddService(t.Context(), &Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: c.check})
			if !errors.Is(err, c.wantErr) {
				t.Errorf("AddService with %q = %v, want %v", c.check, err, c.wantErr)
			}
		})
	}
}

// Results are copies: changing them does not change the table.
func TestFakeReturnsCopies(t *testing.T) {
	ctx := t.Context()
	f := NewFake()
	if err := f.AddService(ctx, tcp4()); err != nil {
		t.Fatal(err)
	}
	if err := f.AddDestination(ctx, tcp4(), &Destination{Address: ep4a, Port: 8080, Weight: 1}); err != nil {
		t.Fatal(err)
	}
	svcs, _ := f.Services(ctx)
	svcs[0].Scheduler = "wrr"
	dsts, _ := f.Destinations(ctx, tcp4())
	dsts[0].Weight = 7
	want := []string{"TCP 10.96.0.10:80 rr", "  -> 10.1.0.1:8080 weight 1"}
	if got := dumpTable(t, ctx, f); !slices.Equal(got, want) {
		t.Errorf("table %q, want %q", got, want)
	}
	if f.Len() != 1 {
		t.Errorf("Len() = %d, want 1", f.Len())
	}
}

func TestFakeCancelledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	f := NewFake()
	for _, c := range []struct {
		name string
		op   func() error
	}{
		{"Services", func() error { _, err := f.Services(ctx); return err }},
		{"AddService", func() error { return f.AddService(ctx, tcp4()) }},
		{"SetTimeouts", func() error { return f.SetTimeouts(ctx, Timeouts{}) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			if err := c.op(); !errors.Is(err, context.Canceled) {
				t.Errorf("error %v, want context.Canceled", err)
			}
		})
	}
	if f.Len() != 0 {
		t.Errorf("cancelled AddService changed the table")
	}
}
