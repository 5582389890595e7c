package ipset

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"
)

// The cases in this file run against the Fake (fake_test.go) and against
// the kernel in a throwaway namespace (real_test.go): the fake must behave
// as the kernel does.

var errAny = errors.New("any error")

type step struct {
	name    string
	op      func(ctx context.Context, s Interface) error
	wantErr error // nil, a sentinel for errors.Is, or errAny
}

func (s step) fails(err error) step {
	s.wantErr = err
	return s
}

func ensure(set Set) step {
	return step{name: fmt.Sprintf("ensure %+v", set), op: func(ctx context.Context, s Interface) error { return s.EnsureSet(ctx, set) }}
}

func destroy(name string) step {
	return step{name: "destroy " + name, op: func(ctx context.Context, s Interface) error { return s.DestroySet(ctx, name) }}
}

func flush(name string) step {
	return step{name: "flush " + name, op: func(ctx context.Context, s Interface) error { return s.FlushSet(ctx, name) }}
}

func add(name string, e Entry) step {
	return step{name: "add " + e.String() + " to " + name, op: func(ctx context.Context, s Interface) error { return s.AddEntry(ctx, name, e) }}
}

func del(name string, e Entry) step {
	return step{name: "del " + e.String() + " from " + name, op: func(ctx context.Context, s Interface) error { return s.DelEntry(ctx, name, e) }}
}

// has checks HasEntry.
func has(name string, e Entry, want bool) step {
	return step{name: fmt.Sprintf("has %s in %s", e, name), op: func(ctx context.Context, s Interface) error {
		got, err := s.HasEntry(ctx, name, e)
		if err != nil {
			return err
		}
		if got != want {
			return fmt.Errorf("HasEntry = %v, want %v", got, want)
		}
		return nil
	}}
}

// entries checks the set's entries, compared as strings.
func entries(name string, want ...string) step {
	return step{name: "entries of " + name, op: func(ctx context.Context, s Interface) error {
		got, err := s.Entries(ctx, name)
		if err != nil {
			return err
		}
		gs := []string{}
		for _, e := range got {
			gs = append(gs, e.String())
		}
		if want == nil {
			want = []string{}
		}
		if !slices.Equal(gs, want) {
			return fmt.Errorf("entries %q, want %q", gs, want)
		}
		return nil
	}}
}

// sets checks ListSets.
func sets(want ...string) step {
	return step{name: "list sets", op: func(ctx context.Context, s Interface) error {
		got, err := s.ListSets(ctx)
		if err != nil {
			return err
		}
		if want == nil {
			want = []string{}
		}
		if !slices.Equal(got, want) {
			return fmt.Errorf("sets %q, want %q", got, want)
		}
		return nil
	}}
}

type interfaceCase struct {
	name  string
	steps []step
}

func ip(s string) netip.Addr    { return netip.MustParseAddr(s) }
func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }
func ipPort(a, proto string, port uint16) Entry {
	return Entry{IP: ip(a), Protocol: proto, Port: port}
}

// typeCase is one set type and family with two entries.
type typeCase struct {
	set    Set
	e1, e2 Entry
	// s1, s2 are the entries as listed.
	s1, s2 string
}

func typeCases() []typeCase {
	return []typeCase{
		{Set{Name: "KP-IP4", Type: HashIP}, Entry{IP: ip("10.0.0.1")}, Entry{IP: ip("10.0.0.2")}, "10.0.0.1", "10.0.0.2"},
		{Set{Name: "KP-IP6", Type: HashIP, IPv6: true}, Entry{IP: ip("fd00::1")}, Entry{IP: ip("fd00::2")}, "fd00::1", "fd00::2"},
		{Set{Name: "KP-IPPORT4", Type: HashIPPort, Comment: "cluster IPs"}, ipPort("10.96.0.1", "tcp", 443), ipPort("10.96.0.10", "udp", 53), "10.96.0.1,tcp:443", "10.96.0.10,udp:53"},
		{Set{Name: "KP-IPPORT4-SCTP", Type: HashIPPort}, ipPort("10.96.0.1", "sctp", 9), ipPort("10.96.0.1", "tcp", 9), "10.96.0.1,sctp:9", "10.96.0.1,tcp:9"},
		{Set{Name: "KP-IPPORT6", Type: HashIPPort, IPv6: true}, ipPort("fd00::1", "tcp", 80), ipPort("fd00::1", "udp", 80), "fd00::1,tcp:80", "fd00::1,udp:80"},
		{
			Set{Name: "KP-LOOPBACK4", Type: HashIPPortIP, Comment: "hairpin"},
			Entry{IP: ip("10.1.0.1"), Protocol: "tcp", Port: 8080, IP2: ip("10.1.0.1")},
			Entry{IP: ip("10.1.0.2"), Protocol: "udp", Port: 53, IP2: ip("10.1.0.2")},
			"10.1.0.1,tcp:8080,10.1.0.1", "10.1.0.2,udp:53,10.1.0.2",
		},
		{
			Set{Name: "KP-LOOPBACK6", Type: HashIPPortIP, IPv6: true},
			Entry{IP: ip("fd00:1::1"), Protocol: "tcp", Port: 8080, IP2: ip("fd00:1::1")},
			Entry{IP: ip("fd00:1::2"), Protocol: "sctp", Port: 80, IP2: ip("fd00:1::2")},
			"fd00:1::1,tcp:8080,fd00:1::1", "fd00:1::2,sctp:80,fd00:1::2",
		},
		{
			Set{Name: "KP-LB-SRC4", Type: HashIPPortNet},
			Entry{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 80, Net: pfx("10.0.0.0/8")},
			Entry{IP: ip("192.0.2.10"), Protocol: "tcp", Port: 80, Net: pfx("198.51.100.7/32")},
			"192.0.2.10,tcp:80,10.0.0.0/8", "192.0.2.10,tcp:80,198.51.100.7",
		},
		{
			Set{Name: "KP-LB-SRC6", Type: HashIPPortNet, IPv6: true, Comment: "lb sources"},
			Entry{IP: ip("2001:db8::10"), Protocol: "udp", Port: 53, Net: pfx("fd00::/8")},
			Entry{IP: ip("2001:db8::10"), Protocol: "udp", Port: 53, Net: pfx("2001:db8:1::/48")},
			"2001:db8::10,udp:53,fd00::/8", "2001:db8::10,udp:53,2001:db8:1::/48",
		},
		{Set{Name: "KP-NET4", Type: HashNet}, Entry{Net: pfx("10.0.0.0/8")}, Entry{Net: pfx("192.0.2.1/32")}, "10.0.0.0/8", "192.0.2.1"},
		{Set{Name: "KP-NET6", Type: HashNet, IPv6: true, Comment: "excluded"}, Entry{Net: pfx("fd00::/64")}, Entry{Net: pfx("2001:db8::/32")}, "fd00::/64", "2001:db8::/32"},
		{Set{Name: "KP-NODEPORT", Type: BitmapPort}, Entry{Port: 30080}, Entry{Port: 0}, "30080", "0"},
		{Set{Name: "KP-NODEPORT-C", Type: BitmapPort, Comment: "node ports"}, Entry{Port: 32767}, Entry{Port: 65535}, "32767", "65535"},
	}
}

// lifecycle walks a set of every type through its whole life.
func lifecycle(c typeCase) interfaceCase {
	name := c.set.Name
	first, second := c.s1, c.s2
	if compareEntries(c.e1, c.e2) > 0 {
		first, second = second, first
	}
	return interfaceCase{
		name: fmt.Sprintf("%s %s lifecycle", c.set.Type, c.set.family()),
		steps: []step{
			ensure(c.set),
			ensure(c.set),
			sets(name),
			entries(name),
			has(name, c.e1, false),
			add(name, c.e1),
			add(name, c.e2),
			add(name, c.e1),
			entries(name, first, second),
			has(name, c.e1, true),
			has(name, c.e2, true),
			del(name, c.e1),
			del(name, c.e1),
			entries(name, c.s2),
			has(name, c.e1, false),
			has(name, c.e2, true),
			add(name, c.e1),
			flush(name),
			entries(name),
			has(name, c.e2, false),
			destroy(name),
			destroy(name),
			sets(),
			entries(name).fails(ErrNotExist),
		},
	}
}

func interfaceCases() []interfaceCase {
	var cases []interfaceCase
	for _, c := range typeCases() {
		cases = append(cases, lifecycle(c))
	}
	ipSet := Set{Name: "KP-A", Type: HashIP}
	return append(cases,
		interfaceCase{
			name: "sets are listed sorted",
			steps: []step{
				ensure(Set{Name: "KP-B", Type: HashNet}),
				ensure(ipSet),
				ensure(Set{Name: "KP-C", Type: BitmapPort}),
				sets("KP-A", "KP-B", "KP-C"),
			},
		},
		interfaceCase{
			name: "a different type is incompatible",
			steps: []step{
				ensure(ipSet),
				ensure(Set{Name: "KP-A", Type: HashNet}).fails(ErrIncompatible),
				ensure(Set{Name: "KP-A", Type: BitmapPort}).fails(ErrIncompatible),
				ensure(ipSet),
			},
		},
		interfaceCase{
			name: "a different family is incompatible",
			steps: []step{
				ensure(ipSet),
				ensure(Set{Name: "KP-A", Type: HashIP, IPv6: true}).fails(ErrIncompatible),
			},
		},
		interfaceCase{
			name: "adding or dropping the comment extension is incompatible",
			steps: []step{
				ensure(ipSet),
				ensure(Set{Name: "KP-A", Type: HashIP, Comment: "x"}).fails(ErrIncompatible),
				ensure(Set{Name: "KP-B", Type: HashNet, Comment: "x"}),
				ensure(Set{Name: "KP-B", Type: HashNet, Comment: "y"}),
				ensure(Set{Name: "KP-B", Type: HashNet}).fails(ErrIncompatible),
			},
		},
		interfaceCase{
			name: "port bitmaps have no family",
			steps: []step{
				ensure(Set{Name: "KP-P", Type: BitmapPort}),
				ensure(Set{Name: "KP-P", Type: BitmapPort, IPv6: true}),
				add("KP-P", Entry{Port: 80}),
				entries("KP-P", "80"),
			},
		},
		interfaceCase{
			name: "a destroyed set can be ensured again",
			steps: []step{
				ensure(ipSet),
				add("KP-A", Entry{IP: ip("10.0.0.1")}),
				destroy("KP-A"),
				ensure(ipSet),
				entries("KP-A"),
				destroy("KP-A"),
				ensure(Set{Name: "KP-A", Type: HashNet}),
				add("KP-A", Entry{Net: pfx("10.0.0.0/8")}),
			},
		},
		interfaceCase{
			name: "networks are stored masked",
			steps: []step{
				ensure(Set{Name: "KP-N", Type: HashNet}),
				add("KP-N", Entry{Net: pfx("10.1.2.3/8")}),
				add("KP-N", Entry{Net: pfx("10.0.0.0/16")}),
				entries("KP-N", "10.0.0.0/8", "10.0.0.0/16"),
				del("KP-N", Entry{Net: pfx("10.9.9.9/8")}),
				entries("KP-N", "10.0.0.0/16"),
			},
		},
		interfaceCase{
			name: "operations on a missing set",
			steps: []step{
				add("KP-A", Entry{IP: ip("10.0.0.1")}).fails(ErrNotExist),
				del("KP-A", Entry{IP: ip("10.0.0.1")}).fails(ErrNotExist),
				flush("KP-A").fails(ErrNotExist),
				entries("KP-A").fails(ErrNotExist),
				has("KP-A", Entry{IP: ip("10.0.0.1")}, false).fails(ErrNotExist),
				destroy("KP-A"),
			},
		},
		interfaceCase{
			name: "entries that do not fit are refused",
			steps: []step{
				ensure(ipSet),
				ensure(Set{Name: "KP-IPP", Type: HashIPPort}),
				ensure(Set{Name: "KP-IPPIP6", Type: HashIPPortIP, IPv6: true}),
				ensure(Set{Name: "KP-N", Type: HashNet}),
				ensure(Set{Name: "KP-P", Type: BitmapPort}),
				add("KP-A", ipPort("10.0.0.1", "tcp", 80)).fails(ErrInvalidEntry),
				add("KP-A", Entry{IP: ip("fd00::1")}).fails(ErrInvalidEntry),
				add("KP-A", Entry{Net: pfx("10.0.0.0/8")}).fails(ErrInvalidEntry),
				add("KP-IPP", Entry{IP: ip("10.0.0.1")}).fails(ErrInvalidEntry),
				add("KP-IPP", ipPort("10.0.0.1", "icmp", 0)).fails(ErrInvalidEntry),
				add("KP-IPP", ipPort("10.0.0.1", "TCP", 80)).fails(ErrInvalidEntry),
				add("KP-IPPIP6", Entry{IP: ip("fd00::1"), Protocol: "tcp", Port: 80, IP2: ip("10.0.0.1")}).fails(ErrInvalidEntry),
				add("KP-N", Entry{Net: pfx("0.0.0.0/0")}).fails(ErrInvalidEntry),
				add("KP-N", Entry{Net: pfx("fd00::/8")}).fails(ErrInvalidEntry),
				add("KP-P", Entry{Protocol: "tcp", Port: 80}).fails(ErrInvalidEntry),
				add("KP-P", Entry{IP: ip("10.0.0.1")}).fails(ErrInvalidEntry),
				entries("KP-A"),
				entries("KP-IPP"),
				entries("KP-IPPIP6"),
				entries("KP-N"),
				entries("KP-P"),
			},
		},
		interfaceCase{
			name: "invalid sets are refused",
			steps: []step{
				ensure(Set{Name: "", Type: HashIP}).fails(errAny),
				ensure(Set{Name: "KP-THIS-NAME-IS-LONGER-THAN-31-BYTES", Type: HashIP}).fails(errAny),
				ensure(Set{Name: "KP-A", Type: "hash:mac"}).fails(errAny),
				ensure(Set{Name: "KP-A", Type: HashIP, Comment: "nul\x00"}).fails(errAny),
				sets(),
			},
		},
		interfaceCase{
			name: "31-byte names work",
			steps: []step{
				ensure(Set{Name: "KP-THIS-NAME-IS-EXACTLY-31-BYTE", Type: HashIP}),
				sets("KP-THIS-NAME-IS-EXACTLY-31-BYTE"),
			},
		},
	)
}

// runCase runs c's steps against s.
func runCase(t *testing.T, ctx context.Context, s Interface, c interfaceCase) {
	t.Helper()
	for i, st := range c.steps {
		err := st.op(ctx, s)
		switch {
		case st.wantErr == nil && err != nil:
			t.Fatalf("step %d (%s): unexpected error: %v", i, st.name, err)
		case st.wantErr != nil && err == nil:
			t.Fatalf("step %d (%s): succeeded, want error %v", i, st.name, st.wantErr)
		case st.wantErr != nil && st.wantErr != errAny && !errors.Is(err, st.wantErr):
			t.Fatalf("step %d (%s): error %v, want one matching %v", i, st.name, err, st.wantErr)
		}
	}
}
