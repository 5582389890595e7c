package conntrack

import (
	"context"
	"slices"
	"strings"
	"sync"

	v1 "k8s.io/api/core/v1"
)

// Fake is an in-memory conntrack table: ClearEntries removes the flows its
// filters match, as the kernel would. It is safe for concurrent use.
type Fake struct {
	mu    sync.Mutex
	flows []Flow
	// failNext, when set, is returned by the next ClearEntries, which then
	// deletes nothing.
	failNext error
}

var _ Interface = (*Fake)(nil)

// NewFake returns a table holding flows.
func NewFake(flows ...Flow) *Fake {
	return &Fake{flows: slices.Clone(flows)}
}

// Add records flows, as traffic would.
func (f *Fake) Add(flows ...Flow) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.flows = append(f.flows, flows...)
}

// Flows returns every flow of the table, sorted by String.
func (f *Fake) Flows() []Flow {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := slices.Clone(f.flows)
	slices.SortFunc(out, func(a, b Flow) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// FailNextClear makes the next ClearEntries fail with err without deleting
// anything.
func (f *Fake) FailNextClear(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failNext = err
}

// ListEntries implements Interface.
func (f *Fake) ListEntries(ctx context.Context, family v1.IPFamily) ([]Flow, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []Flow
	for _, fl := range f.flows {
		if fl.Family() == family {
			out = append(out, fl)
		}
	}
	return out, nil
}

// ClearEntries implements Interface.
func (f *Fake) ClearEntries(ctx context.Context, family v1.IPFamily, filters ...Filter) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.failNext; err != nil {
		f.failNext = nil
		return 0, err
	}
	before := len(f.flows)
	fs := newFilterSet(filters)
	f.flows = slices.DeleteFunc(f.flows, func(fl Flow) bool {
		return fl.Family() == family && fs.matches(fl)
	})
	return before - len(f.flows), nil
}
