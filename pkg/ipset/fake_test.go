package ipset

import (
	"context"
	"errors"
	"net/netip"
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

func TestEntryString(t *testing.T) {
	for _, c := range []struct {
		name string
		e    Entry
		want string
	}{
		{"ip", Entry{IP: ip("10.0.0.1")}, "10.0.0.1"},
		{"ip6", Entry{IP: ip("fd00::1")}, "fd00::1"},
		{"ip,port", ipPort("10.0.0.1", "tcp", 80), "10.0.0.1,tcp:80"},
		{"ip,port,ip", Entry{IP: ip("10.0.0.1"), Protocol: "tcp", Port: 80, IP2: ip("10.0.0.1")}, "10.0.0.1,tcp:80,10.0.0.1"},
		{"ip,port,net", Entry{IP: ip("10.0.0.1"), Protocol: "udp", Port: 53, Net: pfx("10.0.0.0/8")}, "10.0.0.1,udp:53,10.0.0.0/8"},
		{"ip,port,net host", Entry{IP: ip("10.0.0.1"), Protocol: "udp", Port: 53, Net: pfx("10.2.3.4/32")}, "10.0.0.1,udp:53,10.2.3.4"},
		{"net", Entry{Net: pfx("10.0.0.0/8")}, "10.0.0.0/8"},
		{"net host", Entry{Net: pfx("10.0.0.1/32")}, "10.0.0.1"},
		{"net6", Entry{Net: pfx("fd00::/64")}, "fd00::/64"},
		{"port", Entry{Port: 30080}, "30080"},
		{"ip6,port", ipPort("fd00::1", "sctp", 9), "fd00::1,sctp:9"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := c.e.String(); got != c.want {
				t.Errorf("String() = %q, want %q", got, c.want)
			}
		})
	}
}

func TestFakeContains(t *testing.T) {
	ctx := t.Context()
	f := NewFake()
	fill := map[Set][]Entry{
		{Name: "IP", Type: HashIP}:              {{IP: ip("10.0.0.1")}},
		{Name: "IP6", Type: HashIP, IPv6: true}: {{IP: ip("fd00::1")}},
		{Name: "IPPORT", Type: HashIPPort}:      {ipPort("10.96.0.1", "tcp", 443)},
		{Name: "LOOP", Type: HashIPPortIP}:      {{IP: ip("10.1.0.1"), Protocol: "tcp", Port: 8080, IP2: ip("10.1.0.1")}},
		{Name: "SRC", Type: HashIPPortNet}: {
			{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 80, Net: pfx("10.0.0.0/8")},
			{IP: ip("192.0.2.11"), Protocol: "tcp", Port: 80, Net: pfx("172.16.0.0/12")},
		},
		{Name: "NET", Type: HashNet}:              {{Net: pfx("10.0.0.0/8")}, {Net: pfx("192.168.1.0/24")}},
		{Name: "NET6", Type: HashNet, IPv6: true}: {{Net: pfx("fd00::/16")}},
		{Name: "PORTS", Type: BitmapPort}:         {{Port: 30080}},
	}
	for set, es := range fill {
		if err := f.EnsureSet(ctx, set); err != nil {
			t.Fatal(err)
		}
		for _, e := range es {
			if err := f.AddEntry(ctx, set.Name, e); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, c := range []struct {
		name string
		set  string
		q    Entry
		want bool
	}{
		{"hash:ip member", "IP", Entry{IP: ip("10.0.0.1")}, true},
		{"hash:ip other address", "IP", Entry{IP: ip("10.0.0.2")}, false},
		{"hash:ip IPv6 packet in IPv4 set", "IP", Entry{IP: ip("fd00::1")}, false},
		{"hash:ip IPv6 member", "IP6", Entry{IP: ip("fd00::1")}, true},
		{"hash:ip,port member", "IPPORT", ipPort("10.96.0.1", "tcp", 443), true},
		{"hash:ip,port other protocol", "IPPORT", ipPort("10.96.0.1", "udp", 443), false},
		{"hash:ip,port other port", "IPPORT", ipPort("10.96.0.1", "tcp", 80), false},
		{"hash:ip,port,ip hairpin", "LOOP", Entry{IP: ip("10.1.0.1"), Protocol: "tcp", Port: 8080, IP2: ip("10.1.0.1")}, true},
		{"hash:ip,port,ip other source", "LOOP", Entry{IP: ip("10.1.0.1"), Protocol: "tcp", Port: 8080, IP2: ip("10.1.0.2")}, false},
		{"hash:ip,port,net source inside", "SRC", Entry{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 80, IP2: ip("10.20.30.40")}, true},
		{"hash:ip,port,net source outside", "SRC", Entry{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 80, IP2: ip("172.16.0.1")}, false},
		{"hash:ip,port,net other entry's range", "SRC", Entry{IP: ip("192.0.2.11"), Protocol: "tcp", Port: 80, IP2: ip("172.16.0.1")}, true},
		{"hash:ip,port,net other port", "SRC", Entry{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 81, IP2: ip("10.0.0.1")}, false},
		{"hash:ip,port,net subnet", "SRC", Entry{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 80, Net: pfx("10.1.0.0/16")}, true},
		{"hash:ip,port,net wider net", "SRC", Entry{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 80, Net: pfx("8.0.0.0/6")}, false},
		{"hash:net address inside", "NET", Entry{IP: ip("10.255.0.1")}, true},
		{"hash:net address in second net", "NET", Entry{IP: ip("192.168.1.200")}, true},
		{"hash:net address outside", "NET", Entry{IP: ip("192.168.2.1")}, false},
		{"hash:net subnet", "NET", Entry{Net: pfx("10.1.0.0/16")}, true},
		{"hash:net unmasked subnet", "NET", Entry{Net: pfx("10.1.2.3/16")}, true},
		{"hash:net wider net", "NET", Entry{Net: pfx("10.0.0.0/7")}, false},
		{"hash:net IPv6 packet in IPv4 set", "NET", Entry{IP: ip("fd00::1")}, false},
		{"hash:net IPv6 inside", "NET6", Entry{IP: ip("fd00:1::1")}, true},
		{"bitmap:port tcp", "PORTS", Entry{Protocol: "tcp", Port: 30080}, true},
		{"bitmap:port udp", "PORTS", Entry{Protocol: "udp", Port: 30080}, true},
		{"bitmap:port no protocol", "PORTS", Entry{Port: 30080}, true},
		{"bitmap:port icmp", "PORTS", Entry{Protocol: "icmp", Port: 30080}, false},
		{"bitmap:port other port", "PORTS", Entry{Protocol: "tcp", Port: 30081}, false},
		{"missing set", "NOSUCH", Entry{IP: ip("10.0.0.1")}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := f.Contains(c.set, c.q); got != c.want {
				t.Errorf("Contains(%s, %+v) = %v, want %v", c.set, c.q, got, c.want)
			}
		})
	}
}

func TestFakeReferenced(t *testing.T) {
	ctx := t.Context()
	for _, c := range []struct {
		name       string
		referenced []string
		wantErr    error
		wantSets   []string
	}{
		{name: "unreferenced", wantSets: []string{"KP-B"}},
		{name: "referenced", referenced: []string{"KP-A"}, wantErr: ErrInUse, wantSets: []string{"KP-A", "KP-B"}},
		{name: "another set referenced", referenced: []string{"KP-B"}, wantSets: []string{"KP-B"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := NewFake()
			f.Referenced = func(name string) bool { return slices.Contains(c.referenced, name) }
			for _, n := range []string{"KP-A", "KP-B"} {
				if err := f.EnsureSet(ctx, Set{Name: n, Type: HashIP}); err != nil {
					t.Fatal(err)
				}
			}
			if err := f.DestroySet(ctx, "KP-A"); !errors.Is(err, c.wantErr) {
				t.Errorf("DestroySet error %v, want %v", err, c.wantErr)
			}
			if got, _ := f.ListSets(ctx); !slices.Equal(got, c.wantSets) {
				t.Errorf("sets %q, want %q", got, c.wantSets)
			}
		})
	}
}

func TestFakeGet(t *testing.T) {
	ctx := t.Context()
	f := NewFake()
	want := Set{Name: "KP-A", Type: HashIPPort, IPv6: true, Comment: "first"}
	if err := f.EnsureSet(ctx, want); err != nil {
		t.Fatal(err)
	}
	want.Comment = "second"
	if err := f.EnsureSet(ctx, want); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		set    string
		want   Set
		wantOK bool
	}{
		{"existing, latest comment", "KP-A", want, true},
		{"missing", "KP-B", Set{}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok := f.Get(c.set)
			if got != c.want || ok != c.wantOK {
				t.Errorf("Get(%q) = %+v, %v; want %+v, %v", c.set, got, ok, c.want, c.wantOK)
			}
		})
	}
}

func TestFakeCancelledContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	f := NewFake()
	if err := f.EnsureSet(ctx, Set{Name: "KP-A", Type: HashIP}); !errors.Is(err, context.Canceled) {
		t.Errorf("EnsureSet error %v, want context.Canceled", err)
	}
	if sets, _ := f.ListSets(t.Context()); len(sets) != 0 {
		t.Errorf("cancelled EnsureSet created %q", sets)
	}
}

func TestFakeRefuse(t *testing.T) {
	errRefused := errors.New("set is full")
	a, b := Entry{IP: netip.MustParseAddr("10.0.0.1")}, Entry{IP: netip.MustParseAddr("10.0.0.2")}
	for _, c := range []struct {
		name    string
		refuse  RefuseFunc
		op      func(ctx context.Context, f *Fake) error
		wantErr error
		// wantSets and wantEntries (of KP-A) afterwards.
		wantSets    []string
		wantEntries []Entry
	}{
		{
			name:   "a refused entry is not added, others are",
			refuse: func(op Op, _ string, e Entry) error { return refuseIf(op == OpAdd && e == b, errRefused) },
			op: func(ctx context.Context, f *Fake) error {
				return errors.Join(f.AddEntry(ctx, "KP-A", b), f.AddEntry(ctx, "KP-A", a))
			},
			wantErr: errRefused, wantSets: []string{"KP-A"}, wantEntries: []Entry{a},
		},
		{
			name:   "an entry that does not fit is still ErrInvalidEntry",
			refuse: func(Op, string, Entry) error { return errRefused },
			op: func(ctx context.Context, f *Fake) error {
				return f.AddEntry(ctx, "KP-A", Entry{IP: a.IP, Protocol: "tcp", Port: 1})
			},
			wantErr: ErrInvalidEntry, wantSets: []string{"KP-A"}, wantEntries: []Entry{a},
		},
		{
			name: "refused deletion, flush and destroy change nothing",
			refuse: func(op Op, _ string, _ Entry) error {
				return refuseIf(op == OpDel || op == OpFlush || op == OpDestroy, errRefused)
			},
			op: func(ctx context.Context, f *Fake) error {
				return errors.Join(f.DelEntry(ctx, "KP-A", a), f.FlushSet(ctx, "KP-A"), f.DestroySet(ctx, "KP-A"))
			},
			wantErr: errRefused, wantSets: []string{"KP-A"}, wantEntries: []Entry{a},
		},
		{
			name:    "a refused set is not created",
			refuse:  func(op Op, name string, _ Entry) error { return refuseIf(op == OpCreate && name == "KP-B", errRefused) },
			op:      func(ctx context.Context, f *Fake) error { return f.EnsureSet(ctx, Set{Name: "KP-B", Type: HashIP}) },
			wantErr: errRefused, wantSets: []string{"KP-A"}, wantEntries: []Entry{a},
		},
		{
			name:     "nil refuses nothing",
			op:       func(ctx context.Context, f *Fake) error { return f.AddEntry(ctx, "KP-A", b) },
			wantSets: []string{"KP-A"}, wantEntries: []Entry{a, b},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			f := NewFake()
			if err := f.EnsureSet(ctx, Set{Name: "KP-A", Type: HashIP}); err != nil {
				t.Fatal(err)
			}
			if err := f.AddEntry(ctx, "KP-A", a); err != nil {
				t.Fatal(err)
			}
			f.SetRefuse(c.refuse)
			err := c.op(ctx, f)
			if c.wantErr == nil && err != nil || c.wantErr != nil && !errors.Is(err, c.wantErr) {
				t.Errorf("error %v, want %v", err, c.wantErr)
			}
			f.SetRefuse(nil)
			if got, _ := f.ListSets(ctx); !slices.Equal(got, c.wantSets) {
				t.Errorf("sets %q, want %q", got, c.wantSets)
			}
			if got, _ := f.Entries(ctx, "KP-A"); !slices.Equal(got, c.wantEntries) {
				t.Errorf("entries %v, want %v", got, c.wantEntries)
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
