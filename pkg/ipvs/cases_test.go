package ipvs

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"
)

// The cases in this file run against the Fake (fake_test.go) and, inside the
// IPVS VM, against the kernel (real_test.go): the fake must behave as the
// kernel does.

var (
	vip4   = netip.MustParseAddr("10.96.0.10")
	vip6   = netip.MustParseAddr("fd00:96::10")
	ep4a   = netip.MustParseAddr("10.1.0.1")
	ep4b   = netip.MustParseAddr("10.1.0.2")
	ep6a   = netip.MustParseAddr("fd00:1::1")
	errAny = errors.New("any error")
)

func tcp4() *Service {
	return &Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "rr"}
}

// step is one operation and the error it must return: nil, a sentinel
// matched with errors.Is, or errAny for any error.
type step struct {
	name    string
	op      func(ctx context.Context, ipvs Interface) error
	wantErr error
}

func addSvc(s *Service) step {
	return step{name: "add " + s.String(), op: func(ctx context.Context, i Interface) error { return i.AddService(ctx, s) }}
}

func addDst(s *Service, d *Destination) step {
	return step{name: "add " + d.String() + " to " + s.String(), op: func(ctx context.Context, i Interface) error { return i.AddDestination(ctx, s, d) }}
}

func (s step) fails(err error) step {
	s.wantErr = err
	return s
}

func op(name string, fn func(ctx context.Context, i Interface) error) step {
	return step{name: name, op: fn}
}

type interfaceCase struct {
	name  string
	steps []step
	// want is the table afterwards, as dumpTable prints it.
	want []string
}

func interfaceCases() []interfaceCase {
	svc := tcp4
	dst := func(a netip.Addr, w int) *Destination { return &Destination{Address: a, Port: 8080, Weight: w} }
	return []interfaceCase{
		{
			name:  "service with default scheduler reads back as rr",
			steps: []step{addSvc(&Service{Address: vip4, Protocol: ProtocolTCP, Port: 80})},
			want:  []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name:  "duplicate service",
			steps: []step{addSvc(svc()), addSvc(svc()).fails(ErrExist)},
			want:  []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name: "same address with other protocols and ports are separate services",
			steps: []step{
				addSvc(svc()),
				addSvc(&Service{Address: vip4, Protocol: ProtocolUDP, Port: 80, Scheduler: "rr"}),
				addSvc(&Service{Address: vip4, Protocol: ProtocolSCTP, Port: 80, Scheduler: "rr"}),
				addSvc(&Service{Address: vip4, Protocol: ProtocolTCP, Port: 443, Scheduler: "rr"}),
			},
			want: []string{
				"SCTP 10.96.0.10:80 rr",
				"TCP 10.96.0.10:80 rr",
				"TCP 10.96.0.10:443 rr",
				"UDP 10.96.0.10:80 rr",
			},
		},
		{
			name: "persistence with timeout and the sh scheduler",
			steps: []step{
				addSvc(&Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "sh", Persistent: true, Timeout: 10800}),
			},
			want: []string{"TCP 10.96.0.10:80 sh persistent 10800"},
		},
		{
			name: "update changes scheduler and persistence",
			steps: []step{
				addSvc(svc()),
				op("update to wrr persistent", func(ctx context.Context, i Interface) error {
					return i.UpdateService(ctx, &Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "wrr", Persistent: true, Timeout: 60})
				}),
			},
			want: []string{"TCP 10.96.0.10:80 wrr persistent 60"},
		},
		{
			name: "update back to non-persistent",
			steps: []step{
				addSvc(&Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "rr", Persistent: true, Timeout: 60}),
				op("update without persistence", func(ctx context.Context, i Interface) error {
					return i.UpdateService(ctx, svc())
				}),
			},
			want: []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name:  "update missing service",
			steps: []step{op("update", func(ctx context.Context, i Interface) error { return i.UpdateService(ctx, svc()) }).fails(ErrNotExist)},
		},
		{
			name:  "delete missing service",
			steps: []step{op("delete", func(ctx context.Context, i Interface) error { return i.DeleteService(ctx, svc()) }).fails(ErrNotExist)},
		},
		{
			name: "unknown scheduler",
			steps: []step{
				addSvc(&Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "nosuch"}).fails(ErrSchedulerUnavailable),
				addSvc(svc()),
				op("update to unknown scheduler", func(ctx context.Context, i Interface) error {
					return i.UpdateService(ctx, &Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "nosuch"})
				}).fails(ErrSchedulerUnavailable),
			},
			want: []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name: "invalid services are refused",
			steps: []step{
				addSvc(&Service{Protocol: ProtocolTCP, Port: 80}).fails(errAny),
				addSvc(&Service{Address: vip4, Protocol: "ICMP", Port: 80}).fails(errAny),
				addSvc(&Service{Address: vip4, Protocol: ProtocolTCP, Port: 80, Scheduler: "RR;"}).fails(errAny),
			},
		},
		{
			name: "destinations with weights, sorted",
			steps: []step{
				addSvc(svc()),
				addDst(svc(), dst(ep4b, 1)),
				addDst(svc(), dst(ep4a, 3)),
			},
			want: []string{"TCP 10.96.0.10:80 rr", "  -> 10.1.0.1:8080 weight 3", "  -> 10.1.0.2:8080 weight 1"},
		},
		{
			name: "same destination address on two ports",
			steps: []step{
				addSvc(svc()),
				addDst(svc(), dst(ep4a, 1)),
				addDst(svc(), &Destination{Address: ep4a, Port: 9090, Weight: 1}),
			},
			want: []string{"TCP 10.96.0.10:80 rr", "  -> 10.1.0.1:8080 weight 1", "  -> 10.1.0.1:9090 weight 1"},
		},
		{
			name:  "destination of missing service",
			steps: []step{addDst(svc(), dst(ep4a, 1)).fails(ErrNotExist)},
		},
		{
			name: "duplicate destination",
			steps: []step{
				addSvc(svc()),
				addDst(svc(), dst(ep4a, 1)),
				addDst(svc(), dst(ep4a, 5)).fails(ErrExist),
			},
			want: []string{"TCP 10.96.0.10:80 rr", "  -> 10.1.0.1:8080 weight 1"},
		},
		{
			name: "update destination weight to zero keeps it",
			steps: []step{
				addSvc(svc()),
				addDst(svc(), dst(ep4a, 1)),
				op("quiesce", func(ctx context.Context, i Interface) error { return i.UpdateDestination(ctx, svc(), dst(ep4a, 0)) }),
			},
			want: []string{"TCP 10.96.0.10:80 rr", "  -> 10.1.0.1:8080 weight 0"},
		},
		{
			name: "update and delete missing destination",
			steps: []step{
				addSvc(svc()),
				op("update", func(ctx context.Context, i Interface) error { return i.UpdateDestination(ctx, svc(), dst(ep4a, 1)) }).fails(ErrNotExist),
				op("delete", func(ctx context.Context, i Interface) error { return i.DeleteDestination(ctx, svc(), dst(ep4a, 1)) }).fails(ErrNotExist),
			},
			want: []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name: "update and delete destination of missing service",
			steps: []step{
				op("update", func(ctx context.Context, i Interface) error { return i.UpdateDestination(ctx, svc(), dst(ep4a, 1)) }).fails(ErrNotExist),
				op("delete", func(ctx context.Context, i Interface) error { return i.DeleteDestination(ctx, svc(), dst(ep4a, 1)) }).fails(ErrNotExist),
			},
		},
		{
			name: "destinations of missing service",
			steps: []step{op("list", func(ctx context.Context, i Interface) error {
				_, err := i.Destinations(ctx, svc())
				return err
			}).fails(ErrNotExist)},
		},
		{
			name: "destinations of a service without any",
			steps: []step{addSvc(svc()), op("list", func(ctx context.Context, i Interface) error {
				d, err := i.Destinations(ctx, svc())
				if err == nil && len(d) != 0 {
					return fmt.Errorf("got %d destinations, want none", len(d))
				}
				return err
			})},
			want: []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name: "delete destination",
			steps: []step{
				addSvc(svc()),
				addDst(svc(), dst(ep4a, 1)),
				addDst(svc(), dst(ep4b, 1)),
				op("delete", func(ctx context.Context, i Interface) error { return i.DeleteDestination(ctx, svc(), dst(ep4a, 1)) }),
			},
			want: []string{"TCP 10.96.0.10:80 rr", "  -> 10.1.0.2:8080 weight 1"},
		},
		{
			name: "delete service removes its destinations",
			steps: []step{
				addSvc(svc()),
				addDst(svc(), dst(ep4a, 1)),
				op("delete", func(ctx context.Context, i Interface) error { return i.DeleteService(ctx, svc()) }),
				addSvc(svc()),
			},
			want: []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name: "invalid destinations are refused",
			steps: []step{
				addSvc(svc()),
				addDst(svc(), dst(ep6a, 1)).fails(errAny),
				addDst(svc(), dst(ep4a, -1)).fails(errAny),
				addDst(svc(), &Destination{Port: 80}).fails(errAny),
			},
			want: []string{"TCP 10.96.0.10:80 rr"},
		},
		{
			name: "IPv6 service with persistence and destinations",
			steps: []step{
				addSvc(&Service{Address: vip6, Protocol: ProtocolUDP, Port: 53, Scheduler: "wrr", Persistent: true, Timeout: 300}),
				addDst(&Service{Address: vip6, Protocol: ProtocolUDP, Port: 53}, &Destination{Address: ep6a, Port: 5353, Weight: 2}),
				addDst(&Service{Address: vip6, Protocol: ProtocolUDP, Port: 53}, dst(ep4a, 1)).fails(errAny),
			},
			want: []string{"UDP [fd00:96::10]:53 wrr persistent 300", "  -> [fd00:1::1]:5353 weight 2"},
		},
		{
			name: "IPv4 and IPv6 services sort by address",
			steps: []step{
				addSvc(&Service{Address: vip6, Protocol: ProtocolTCP, Port: 80}),
				addSvc(svc()),
			},
			want: []string{"TCP 10.96.0.10:80 rr", "TCP [fd00:96::10]:80 rr"},
		},
	}
}

// runCase runs c's steps against ipvs and compares the resulting table.
func runCase(t *testing.T, ctx context.Context, ipvs Interface, c interfaceCase) {
	t.Helper()
	for i, s := range c.steps {
		err := s.op(ctx, ipvs)
		switch {
		case s.wantErr == nil && err != nil:
			t.Fatalf("step %d (%s): unexpected error: %v", i, s.name, err)
		case s.wantErr != nil && err == nil:
			t.Fatalf("step %d (%s): succeeded, want error %v", i, s.name, s.wantErr)
		case s.wantErr != nil && s.wantErr != errAny && !errors.Is(err, s.wantErr):
			t.Fatalf("step %d (%s): error %v, want one matching %v", i, s.name, err, s.wantErr)
		}
	}
	got := dumpTable(t, ctx, ipvs)
	if !slices.Equal(got, c.want) {
		t.Errorf("table:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(c.want, "\n"))
	}
}

// dumpTable prints every service and its destinations.
func dumpTable(t *testing.T, ctx context.Context, ipvs Interface) []string {
	t.Helper()
	svcs, err := ipvs.Services(ctx)
	if err != nil {
		t.Fatalf("Services: %v", err)
	}
	var out []string
	for _, s := range svcs {
		out = append(out, s.String())
		dsts, err := ipvs.Destinations(ctx, s)
		if err != nil {
			t.Fatalf("Destinations(%s): %v", s, err)
		}
		for _, d := range dsts {
			out = append(out, "  -> "+d.String())
		}
	}
	return out
}

type timeoutsCase struct {
	name    string
	set     []Timeouts
	wantErr bool
	want    Timeouts
}

func timeoutsCases() []timeoutsCase {
	return []timeoutsCase{
		{name: "kernel defaults", want: DefaultTimeouts},
		{
			name: "set all",
			set:  []Timeouts{{TCP: 3600 * time.Second, TCPFin: 30 * time.Second, UDP: 60 * time.Second}},
			want: Timeouts{TCP: 3600 * time.Second, TCPFin: 30 * time.Second, UDP: 60 * time.Second},
		},
		{
			name: "zero fields leave values unchanged",
			set:  []Timeouts{{TCP: 3600 * time.Second, TCPFin: 30 * time.Second, UDP: 60 * time.Second}, {UDP: 10 * time.Second}},
			want: Timeouts{TCP: 3600 * time.Second, TCPFin: 30 * time.Second, UDP: 10 * time.Second},
		},
		{name: "negative", set: []Timeouts{{TCP: -time.Second}}, wantErr: true, want: DefaultTimeouts},
		{name: "fraction of a second", set: []Timeouts{{UDP: 1500 * time.Millisecond}}, wantErr: true, want: DefaultTimeouts},
	}
}

func runTimeoutsCase(t *testing.T, ctx context.Context, ipvs Interface, c timeoutsCase) {
	t.Helper()
	var err error
	for _, s := range c.set {
		if err = ipvs.SetTimeouts(ctx, s); err != nil {
			break
		}
	}
	if (err != nil) != c.wantErr {
		t.Fatalf("SetTimeouts error %v, want error: %v", err, c.wantErr)
	}
	got, err := ipvs.GetTimeouts(ctx)
	if err != nil {
		t.Fatalf("GetTimeouts: %v", err)
	}
	if got != c.want {
		t.Errorf("timeouts %+v, want %+v", got, c.want)
	}
}
