package ipset

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sync"
)

// Fake is an in-memory set store executing the Interface operations with
// the kernel's rules: entries must fit their set's type and family, /0
// networks are refused, networks are stored masked, sets in use cannot be
// destroyed. Contains answers membership questions with each type's
// matching semantics, for the packet tracer. Safe for concurrent use.
type Fake struct {
	// Referenced, when set, reports whether something (an iptables rule)
	// references a set; DestroySet then fails with ErrInUse as the kernel
	// does. It is called with the Fake's lock held and must not call
	// back into the Fake. Set it before the Fake is shared.
	Referenced func(name string) bool

	mu     sync.Mutex
	sets   map[string]*fakeSet
	refuse RefuseFunc
}

// Op names a change to the sets, for a RefuseFunc.
type Op string

// The changes a RefuseFunc is asked about.
const (
	OpCreate  Op = "create"
	OpDestroy Op = "destroy"
	OpAdd     Op = "add"
	OpDel     Op = "del"
	OpFlush   Op = "flush"
)

// RefuseFunc decides whether the fake kernel refuses a change to the set
// name: a non-nil error fails the operation with that error (wrapped) and
// changes nothing, as the kernel refusing it would (a full set, a missing
// set type module, memory). e is the entry of OpAdd and OpDel, zero
// otherwise. It is asked after the operation's own checks (an entry that
// does not fit is still ErrInvalidEntry), with the Fake's lock held: it
// must not call back into the Fake.
type RefuseFunc func(op Op, name string, e Entry) error

type fakeSet struct {
	set     Set
	entries map[Entry]bool
}

var _ Interface = (*Fake)(nil)

// NewFake returns a Fake without sets.
func NewFake() *Fake {
	return &Fake{sets: map[string]*fakeSet{}}
}

// SetRefuse makes the fake refuse the changes fn refuses; nil refuses
// nothing.
func (f *Fake) SetRefuse(fn RefuseFunc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse = fn
}

// refused asks the refusal hook about op; called with f.mu held.
func (f *Fake) refused(op Op, name string, e Entry) error {
	if f.refuse == nil {
		return nil
	}
	if err := f.refuse(op, name, e); err != nil {
		if op == OpAdd || op == OpDel {
			return fmt.Errorf("ipset %s %s %s refused: %w", op, name, e, err)
		}
		return fmt.Errorf("ipset %s %s refused: %w", op, name, err)
	}
	return nil
}

func (f *Fake) get(name string) (*fakeSet, error) {
	if err := validateName(name); err != nil {
		return nil, err
	}
	s, ok := f.sets[name]
	if !ok {
		return nil, fmt.Errorf("set %s: %w", name, ErrNotExist)
	}
	return s, nil
}

// EnsureSet implements Interface. The comment of an existing set with the
// comment extension is replaced by set.Comment, as the real
// implementation labels new entries with the latest comment.
func (f *Fake) EnsureSet(ctx context.Context, set Set) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateSet(set); err != nil {
		return err
	}
	set = set.normalized()
	f.mu.Lock()
	defer f.mu.Unlock()
	if s, ok := f.sets[set.Name]; ok {
		have := s.set
		if have.Type != set.Type || have.IPv6 != set.IPv6 || (have.Comment != "") != (set.Comment != "") {
			return fmt.Errorf("ensuring %s set %s (family %s, comment %v): %w: it is a %s set (family %s, comment %v)",
				set.Type, set.Name, set.family(), set.Comment != "", ErrIncompatible, have.Type, have.family(), have.Comment != "")
		}
		s.set.Comment = set.Comment
		return nil
	}
	if err := f.refused(OpCreate, set.Name, Entry{}); err != nil {
		return err
	}
	f.sets[set.Name] = &fakeSet{set: set, entries: map[Entry]bool{}}
	return nil
}

// DestroySet implements Interface.
func (f *Fake) DestroySet(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := validateName(name); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.sets[name]; !ok {
		return nil
	}
	if f.Referenced != nil && f.Referenced(name) {
		return fmt.Errorf("destroying set %s: %w", name, ErrInUse)
	}
	if err := f.refused(OpDestroy, name, Entry{}); err != nil {
		return err
	}
	delete(f.sets, name)
	return nil
}

// ListSets implements Interface.
func (f *Fake) ListSets(ctx context.Context) ([]string, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.sets)), nil
}

// Entries implements Interface.
func (f *Fake) Entries(ctx context.Context, name string) ([]Entry, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s, err := f.get(name)
	if err != nil {
		return nil, fmt.Errorf("listing entries: %w", err)
	}
	return slices.SortedFunc(maps.Keys(s.entries), compareEntries), nil
}

// AddEntry implements Interface.
func (f *Fake) AddEntry(ctx context.Context, name string, e Entry) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s, err := f.get(name)
	if err != nil {
		return fmt.Errorf("adding %s: %w", e, err)
	}
	n, err := s.set.checkEntry(e)
	if err != nil {
		return err
	}
	if err := f.refused(OpAdd, name, e); err != nil {
		return err
	}
	s.entries[n] = true
	return nil
}

// DelEntry implements Interface.
func (f *Fake) DelEntry(ctx context.Context, name string, e Entry) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s, err := f.get(name)
	if err != nil {
		return fmt.Errorf("deleting %s: %w", e, err)
	}
	n, err := s.set.checkEntry(e)
	if err != nil {
		return err
	}
	if err := f.refused(OpDel, name, e); err != nil {
		return err
	}
	delete(s.entries, n)
	return nil
}

// HasEntry implements Interface.
func (f *Fake) HasEntry(ctx context.Context, name string, e Entry) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s, err := f.get(name)
	if err != nil {
		return false, fmt.Errorf("testing %s: %w", e, err)
	}
	n, err := s.set.checkEntry(e)
	if err != nil {
		return false, err
	}
	_, ok := s.entries[n]
	return ok, nil
}

// FlushSet implements Interface.
func (f *Fake) FlushSet(ctx context.Context, name string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s, err := f.get(name)
	if err != nil {
		return fmt.Errorf("flushing: %w", err)
	}
	if err := f.refused(OpFlush, name, Entry{}); err != nil {
		return err
	}
	clear(s.entries)
	return nil
}

// Get returns the set name as last ensured.
func (f *Fake) Get(name string) (Set, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.sets[name]
	if !ok {
		return Set{}, false
	}
	return s.set, true
}

// Contains reports whether a packet with the fields in q matches the set
// name, as `-m set --match-set name` would. The fields of q are those of
// the set's entries, except that network parts are matched by containment:
// for hash:net q gives IP (a packet address) or Net (contained in an
// entry's network); for hash:ip,port,net q gives IP, Protocol, Port and IP2
// (a packet address) or Net. For bitmap:port only q.Port counts, and
// q.Protocol, when given, must be tcp, udp or sctp. A packet of the other
// family, or a set that does not exist, never matches.
func (f *Fake) Contains(name string, q Entry) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.sets[name]
	if !ok {
		return false
	}
	family := func(a netip.Addr) bool { return a.IsValid() && a.Is6() == s.set.IPv6 && !a.Is4In6() }
	switch s.set.Type {
	case HashIP:
		return family(q.IP) && s.entries[Entry{IP: q.IP}]
	case HashIPPort:
		return family(q.IP) && s.entries[Entry{IP: q.IP, Protocol: q.Protocol, Port: q.Port}]
	case HashIPPortIP:
		return family(q.IP) && family(q.IP2) && s.entries[Entry{IP: q.IP, Protocol: q.Protocol, Port: q.Port, IP2: q.IP2}]
	case HashNet:
		return s.containsNet(q.IP, q.Net, func(e Entry) bool { return true })
	case HashIPPortNet:
		if !family(q.IP) {
			return false
		}
		return s.containsNet(q.IP2, q.Net, func(e Entry) bool {
			return e.IP == q.IP && e.Protocol == q.Protocol && e.Port == q.Port
		})
	case BitmapPort:
		switch q.Protocol {
		case "", ProtocolTCP, ProtocolUDP, ProtocolSCTP:
			return s.entries[Entry{Port: q.Port}]
		}
	}
	return false
}

// containsNet reports whether an entry accepted by match has a network
// containing addr (when valid) or the whole of net.
func (s *fakeSet) containsNet(addr netip.Addr, net netip.Prefix, match func(Entry) bool) bool {
	switch {
	case addr.IsValid():
		if addr.Is6() != s.set.IPv6 || addr.Is4In6() {
			return false
		}
		for e := range s.entries {
			if match(e) && e.Net.Contains(addr) {
				return true
			}
		}
	case net.IsValid():
		if net.Addr().Is6() != s.set.IPv6 || net.Addr().Is4In6() {
			return false
		}
		net = net.Masked()
		for e := range s.entries {
			if match(e) && e.Net.Bits() <= net.Bits() && e.Net.Contains(net.Addr()) {
				return true
			}
		}
	}
	return false
}
