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

func TestFakeRefuse(t *testing.T) {
	errRefused := errors.New("invalid argument")
	other := &Service{Address: vip4, Protocol: ProtocolUDP, Port: 53, Scheduler: "rr"}
	dst := &Destination{Address: ep4a, Port: 8080, Weight: 1}
	for _, c := range []struct {
		name string
		// refuse is the hook; op runs after tcp4() with dst was created.
		refuse  RefuseFunc
		op      func(ctx context.Context, f *Fake) error
		wantErr error
		// want is the table afterwards (Service.String, then
		// destinations of tcp4()).
		want      []string
		wantDests []string
	}{
		{
			name: "a refused service is not added",
			refuse: func(op Op, s *Service, _ *Destination) error {
				return refuseIf(op == OpAddService && s.Protocol == ProtocolUDP, errRefused)
			},
			op: func(ctx context.Context, f *Fake) error { return f.AddService(ctx, other) },
			// the other services are still accepted
			wantErr: errRefused, want: []string{"TCP 10.96.0.10:80 rr"}, wantDests: []string{"10.1.0.1:8080 weight 1"},
		},
		{
			name:      "other services are accepted",
			refuse:    func(op Op, s *Service, _ *Destination) error { return refuseIf(s.Port == 443, errRefused) },
			op:        func(ctx context.Context, f *Fake) error { return f.AddService(ctx, other) },
			want:      []string{"TCP 10.96.0.10:80 rr", "UDP 10.96.0.10:53 rr"},
			wantDests: []string{"10.1.0.1:8080 weight 1"},
		},
		{
			name:    "a duplicate is still ErrExist",
			refuse:  func(Op, *Service, *Destination) error { return errRefused },
			op:      func(ctx context.Context, f *Fake) error { return f.AddService(ctx, tcp4()) },
			wantErr: ErrExist, want: []string{"TCP 10.96.0.10:80 rr"}, wantDests: []string{"10.1.0.1:8080 weight 1"},
		},
		{
			name:   "a refused update changes nothing",
			refuse: func(op Op, _ *Service, _ *Destination) error { return refuseIf(op == OpUpdateService, errRefused) },
			op: func(ctx context.Context, f *Fake) error {
				return f.UpdateService(ctx, &Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "sh"})
			},
			wantErr: errRefused, want: []string{"TCP 10.96.0.10:80 rr"}, wantDests: []string{"10.1.0.1:8080 weight 1"},
		},
		{
			name: "a refused destination is not added",
			refuse: func(op Op, _ *Service, d *Destination) error {
				return refuseIf(op == OpAddDestination && d.Address == ep4b, errRefused)
			},
			op: func(ctx context.Context, f *Fake) error {
				return f.AddDestination(ctx, tcp4(), &Destination{Address: ep4b, Port: 8080, Weight: 1})
			},
			wantErr: errRefused, want: []string{"TCP 10.96.0.10:80 rr"}, wantDests: []string{"10.1.0.1:8080 weight 1"},
		},
		{
			name:   "a refused weight change keeps the weight",
			refuse: func(op Op, _ *Service, _ *Destination) error { return refuseIf(op == OpUpdateDestination, errRefused) },
			op: func(ctx context.Context, f *Fake) error {
				return f.UpdateDestination(ctx, tcp4(), &Destination{Address: ep4a, Port: 8080, Weight: 0})
			},
			wantErr: errRefused, want: []string{"TCP 10.96.0.10:80 rr"}, wantDests: []string{"10.1.0.1:8080 weight 1"},
		},
		{
			name: "refused deletions keep the service and its destination",
			refuse: func(op Op, _ *Service, _ *Destination) error {
				return refuseIf(op == OpDeleteService || op == OpDeleteDestination, errRefused)
			},
			op: func(ctx context.Context, f *Fake) error {
				return errors.Join(f.DeleteDestination(ctx, tcp4(), dst), f.DeleteService(ctx, tcp4()))
			},
			wantErr: errRefused, want: []string{"TCP 10.96.0.10:80 rr"}, wantDests: []string{"10.1.0.1:8080 weight 1"},
		},
		{
			name: "nil refuses nothing",
			op:   func(ctx context.Context, f *Fake) error { return f.DeleteService(ctx, tcp4()) },
			want: []string{},
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
			f.SetRefuse(c.refuse)
			err := c.op(ctx, f)
			if c.wantErr == nil && err != nil || c.wantErr != nil && !errors.Is(err, c.wantErr) {
				t.Errorf("error %v, want %v", err, c.wantErr)
			}
			f.SetRefuse(nil)
			if got := f.ServiceStrings(); !slices.Equal(got, c.want) {
				t.Errorf("services %q, want %q", got, c.want)
			}
			if c.wantDests == nil {
				return
			}
			ds, err := f.Destinations(ctx, tcp4())
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, d := range ds {
				got = append(got, d.String())
			}
			if !slices.Equal(got, c.wantDests) {
				t.Errorf("destinations %q, want %q", got, c.wantDests)
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
