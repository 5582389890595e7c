package ipset

import (
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// newReal makes a namespace and a Real on its sets. This machine's kernel
// has ip_set, so these tests run on the host (as root).
func newReal(t *testing.T) (*Real, *netnstest.NS) {
	t.Helper()
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "ipset")
	r, err := New(Options{NetNS: ns.Name})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r, ns
}

func requireIpsetBinary(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("ipset"); err != nil {
		t.Skip("needs the ipset command")
	}
}

func TestRealInterface(t *testing.T) {
	for _, c := range interfaceCases() {
		t.Run(c.name, func(t *testing.T) {
			r, _ := newReal(t)
			runCase(t, t.Context(), r, c)
		})
	}
}

// What Real writes is what the ipset command reads: the entries as
// Entry.String prints them, with the set's comment, in a set of the type,
// family and revision asked for.
func TestRealAgreesWithIpsetCommand(t *testing.T) {
	requireIpsetBinary(t)
	for _, c := range typeCases() {
		t.Run(c.set.Name, func(t *testing.T) {
			ctx := t.Context()
			r, ns := newReal(t)
			if err := r.EnsureSet(ctx, c.set); err != nil {
				t.Fatal(err)
			}
			for _, e := range []Entry{c.e1, c.e2} {
				if err := r.AddEntry(ctx, c.set.Name, e); err != nil {
					t.Fatal(err)
				}
			}
			save := ns.Run(t, "ipset", "save", c.set.Name)
			lines := strings.Split(strings.TrimSpace(save), "\n")
			header := fmt.Sprintf("create %s %s", c.set.Name, c.set.Type)
			if c.set.Type == BitmapPort {
				header += " range 0-65535"
			} else {
				header += fmt.Sprintf(" family %s hashsize 1024 maxelem %d", c.set.family(), MaxElements)
			}
			if c.set.Comment != "" {
				header += " comment"
			}
			if !strings.HasPrefix(lines[0], header) {
				t.Errorf("header %q, want it to start with %q", lines[0], header)
			}
			var want []string
			for _, s := range []string{c.s1, c.s2} {
				line := "add " + c.set.Name + " " + s
				if c.set.Comment != "" {
					line += fmt.Sprintf(" comment %q", c.set.Comment)
				}
				want = append(want, line)
			}
			got := slices.Sorted(slices.Values(lines[1:]))
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Errorf("ipset save:\n%s\nwant entries:\n%s", save, strings.Join(want, "\n"))
			}
			out := ns.Run(t, "ipset", "list", "-t", c.set.Name)
			if rev := fmt.Sprintf("Revision: %d", revisions[c.set.Type]); !strings.Contains(out, rev) {
				t.Errorf("ipset list -t lacks %q:\n%s", rev, out)
			}
		})
	}
}

// Sets made by someone else, and sets this Real has not ensured, are
// checked by the kernel's rules.
func TestRealForeignSets(t *testing.T) {
	requireIpsetBinary(t)
	for _, c := range []struct {
		name    string
		create  []string // ipset create arguments after the name
		set     Set
		wantErr error
	}{
		{"identical", []string{"hash:ip", "maxelem", fmt.Sprint(MaxElements)}, Set{Type: HashIP}, nil},
		{"identical with comment", []string{"hash:ip,port", "maxelem", fmt.Sprint(MaxElements), "comment"}, Set{Type: HashIPPort, Comment: "x"}, nil},
		{"identical bitmap", []string{"bitmap:port", "range", "0-65535"}, Set{Type: BitmapPort}, nil},
		{"other maxelem", []string{"hash:ip"}, Set{Type: HashIP}, ErrIncompatible},
		{"counters", []string{"hash:ip", "maxelem", fmt.Sprint(MaxElements), "counters"}, Set{Type: HashIP}, ErrIncompatible},
		{"timeout", []string{"hash:ip", "maxelem", fmt.Sprint(MaxElements), "timeout", "60"}, Set{Type: HashIP}, ErrIncompatible},
		{"other family", []string{"hash:ip", "family", "inet6", "maxelem", fmt.Sprint(MaxElements)}, Set{Type: HashIP}, ErrIncompatible},
		{"other type", []string{"hash:net", "maxelem", fmt.Sprint(MaxElements)}, Set{Type: HashIP}, ErrIncompatible},
		{"narrower bitmap", []string{"bitmap:port", "range", "30000-32767"}, Set{Type: BitmapPort}, ErrIncompatible},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, ns := newReal(t)
			ns.Run(t, "ipset", append([]string{"create", "KP-X"}, c.create...)...)
			c.set.Name = "KP-X"
			if err := r.EnsureSet(t.Context(), c.set); !errors.Is(err, c.wantErr) {
				t.Fatalf("EnsureSet error %v, want %v", err, c.wantErr)
			}
		})
	}
}

// A Real that did not ensure a set still adds and deletes its entries, and
// the kernel refuses entries of the wrong shape with ErrInvalidEntry.
func TestRealSetsEnsuredElsewhere(t *testing.T) {
	requireIpsetBinary(t)
	for _, c := range []struct {
		name    string
		create  []string
		entry   Entry
		wantErr error
		want    string // ipset save line after the add, "" for none
	}{
		{"hash:ip,port fits", []string{"hash:ip,port"}, ipPort("10.0.0.1", "udp", 53), nil, "add KP-X 10.0.0.1,udp:53"},
		{"hash:ip,port without port", []string{"hash:ip,port"}, Entry{IP: ip("10.0.0.1")}, ErrInvalidEntry, ""},
		{"hash:ip with a port", []string{"hash:ip"}, ipPort("10.0.0.1", "udp", 53), ErrInvalidEntry, ""},
		{"IPv6 entry in IPv4 set", []string{"hash:ip"}, Entry{IP: ip("fd00::1")}, ErrInvalidEntry, ""},
		{"bitmap:port fits", []string{"bitmap:port", "range", "30000-32767"}, Entry{Port: 30001}, nil, "add KP-X 30001"},
		{"bitmap:port out of range", []string{"bitmap:port", "range", "30000-32767"}, Entry{Port: 80}, errAny, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			r, ns := newReal(t)
			ns.Run(t, "ipset", append([]string{"create", "KP-X"}, c.create...)...)
			err := r.AddEntry(ctx, "KP-X", c.entry)
			switch {
			case c.wantErr == nil && err != nil:
				t.Fatalf("AddEntry: %v", err)
			case c.wantErr != nil && err == nil:
				t.Fatalf("AddEntry succeeded, want %v", c.wantErr)
			case c.wantErr != nil && c.wantErr != errAny && !errors.Is(err, c.wantErr):
				t.Fatalf("AddEntry error %v, want %v", err, c.wantErr)
			}
			save := ns.Run(t, "ipset", "save", "KP-X")
			if (c.want != "") != strings.Contains(save, "\nadd ") || (c.want != "" && !strings.Contains(save, c.want)) {
				t.Errorf("ipset save:\n%s\nwant entry %q", save, c.want)
			}
			if c.wantErr != nil {
				return
			}
			if err := r.DelEntry(ctx, "KP-X", c.entry); err != nil {
				t.Fatalf("DelEntry: %v", err)
			}
			if save := ns.Run(t, "ipset", "save", "KP-X"); strings.Contains(save, "\nadd ") {
				t.Errorf("entry left after DelEntry:\n%s", save)
			}
		})
	}
}

// A set an iptables rule references cannot be destroyed until the rule
// goes; a set destroyed behind the Real's back is created again.
func TestRealInUseAndRecreated(t *testing.T) {
	requireIpsetBinary(t)
	ctx := t.Context()
	r, ns := newReal(t)
	set := Set{Name: "KP-A", Type: HashIP, Comment: "kproxy"}
	if err := r.EnsureSet(ctx, set); err != nil {
		t.Fatal(err)
	}
	rule := []string{"INPUT", "-m", "set", "--match-set", "KP-A", "src", "-j", "ACCEPT"}
	ns.Run(t, "iptables", append([]string{"-A"}, rule...)...)
	if err := r.DestroySet(ctx, "KP-A"); !errors.Is(err, ErrInUse) {
		t.Fatalf("DestroySet of a referenced set: %v, want ErrInUse", err)
	}
	ns.Run(t, "iptables", append([]string{"-D"}, rule...)...)
	ns.Run(t, "ipset", "destroy", "KP-A")
	if err := r.EnsureSet(ctx, set); err != nil {
		t.Fatalf("EnsureSet after the set was destroyed elsewhere: %v", err)
	}
	if err := r.AddEntry(ctx, "KP-A", Entry{IP: ip("10.0.0.1")}); err != nil {
		t.Fatal(err)
	}
	if save := ns.Run(t, "ipset", "save", "KP-A"); !strings.Contains(save, `add KP-A 10.0.0.1 comment "kproxy"`) {
		t.Errorf("ipset save:\n%s", save)
	}
	if err := r.DestroySet(ctx, "KP-A"); err != nil {
		t.Fatal(err)
	}
}

// Sets too large for one netlink message are listed whole, and named once.
func TestRealLargeSets(t *testing.T) {
	ctx := t.Context()
	r, _ := newReal(t)
	const n = 5000
	for _, set := range []Set{{Name: "KP-BIG", Type: HashIPPort, Comment: "a comment to make entries longer"}, {Name: "KP-PORTS", Type: BitmapPort}} {
		if err := r.EnsureSet(ctx, set); err != nil {
			t.Fatal(err)
		}
	}
	base := ip("10.0.0.0").As4()
	for i := range n {
		a := base
		a[2], a[3] = byte(i>>8), byte(i)
		if err := r.AddEntry(ctx, "KP-BIG", Entry{IP: netip.AddrFrom4(a), Protocol: "tcp", Port: 80}); err != nil {
			t.Fatal(err)
		}
		if err := r.AddEntry(ctx, "KP-PORTS", Entry{Port: uint16(30000 + i)}); err != nil {
			t.Fatal(err)
		}
	}
	sets, err := r.ListSets(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"KP-BIG", "KP-PORTS"}; !slices.Equal(sets, want) {
		t.Errorf("ListSets = %q, want %q", sets, want)
	}
	for _, name := range sets {
		es, err := r.Entries(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if len(es) != n {
			t.Errorf("%s has %d entries, want %d", name, len(es), n)
		}
	}
}

// One Real serves concurrent callers.
func TestRealConcurrent(t *testing.T) {
	ctx := t.Context()
	r, _ := newReal(t)
	sets := []Set{{Name: "KP-A", Type: HashIP, Comment: "a"}, {Name: "KP-B", Type: BitmapPort}, {Name: "KP-C", Type: HashNet}}
	entry := func(set Set, i int) Entry {
		switch set.Type {
		case HashIP:
			return Entry{IP: netip.AddrFrom4([4]byte{10, 0, 0, byte(i)})}
		case HashNet:
			return Entry{Net: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(i), 0, 0}), 16)}
		}
		return Entry{Port: uint16(i)}
	}
	const n = 100
	var wg sync.WaitGroup
	errs := make(chan error, len(sets)*n)
	for _, set := range sets {
		wg.Go(func() {
			for i := range n {
				if err := r.EnsureSet(ctx, set); err != nil {
					errs <- err
					return
				}
				if err := r.AddEntry(ctx, set.Name, entry(set, i)); err != nil {
					errs <- err
					return
				}
				if _, err := r.ListSets(ctx); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for _, set := range sets {
		es, err := r.Entries(ctx, set.Name)
		if err != nil {
			t.Fatal(err)
		}
		if len(es) != n {
			t.Errorf("%s has %d entries, want %d", set.Name, len(es), n)
		}
	}
}
