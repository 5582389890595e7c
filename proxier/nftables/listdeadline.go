package nftables

import (
	"context"
	"fmt"
	"runtime"

	"github.com/vishvananda/netns"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/deadline"
)

// knftables lists the table's objects over netlink (knftables.UseNetlink),
// and its netlink calls ignore their context: a kernel that never answers
// would block the sync for good. Each listing therefore runs under the
// interface's deadline (the same timeout as a transaction) through
// n.listGuard: the caller gets a timeout error at the deadline and the
// call is abandoned; while one is still running, new listings fail at once
// (docs/design.md, "Deadlines on kernel calls").
//
// knftables opens its netlink socket in the network namespace of the
// calling thread, and the deadline runs the call in a goroutine of its
// own, on whatever thread the runtime gives it. So the goroutine enters
// the caller's thread's namespace first, always: the agent's threads are
// all in the node's namespace, but a test's locked thread (netnstest.NS.Do)
// is not, and the process's own namespace (/proc/self/ns/net, its main
// thread's) cannot tell: that thread may itself be running a locked
// goroutine in some namespace.

// listWithDeadline runs fn under n's listing deadline, in the calling
// thread's network namespace.
func listWithDeadline[T any](ctx context.Context, n *execNFT, op string, fn func(context.Context) (T, error)) (T, error) {
	var zero T
	runtime.LockOSThread()
	here, err := netns.Get()
	runtime.UnlockOSThread()
	if err != nil {
		return zero, fmt.Errorf("%s: the caller's network namespace: %w", op, err)
	}
	// The call owns here from now on: an abandoned one still needs it.
	return deadline.Call(ctx, &n.listGuard, op, n.timeout, func(ctx context.Context) (T, error) {
		defer here.Close()
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			return zero, fmt.Errorf("%s: %w", op, err)
		}
		defer orig.Close()
		if err := netns.Set(here); err != nil {
			runtime.UnlockOSThread()
			return zero, fmt.Errorf("%s: entering the caller's network namespace: %w", op, err)
		}
		v, err := fn(ctx)
		if netns.Set(orig) == nil {
			// Only a thread back in its own namespace is given back to
			// the runtime; otherwise it ends with the goroutine.
			runtime.UnlockOSThread()
		}
		return v, err
	}, nil)
}

// ListAll implements knftables.Interface with a deadline.
func (n *execNFT) ListAll(ctx context.Context) (map[string][]string, error) {
	return listWithDeadline(ctx, n, "nft: listing the table", n.Interface.ListAll)
}

// List implements knftables.Interface with a deadline.
func (n *execNFT) List(ctx context.Context, objectType string) ([]string, error) {
	return listWithDeadline(ctx, n, "nft: listing "+objectType+"s", func(ctx context.Context) ([]string, error) {
		return n.Interface.List(ctx, objectType)
	})
}

// ListRules implements knftables.Interface with a deadline.
func (n *execNFT) ListRules(ctx context.Context, chain string) ([]*knftables.Rule, error) {
	return listWithDeadline(ctx, n, "nft: listing the rules of chain "+chain, func(ctx context.Context) ([]*knftables.Rule, error) {
		return n.Interface.ListRules(ctx, chain)
	})
}

// ListElements implements knftables.Interface with a deadline.
func (n *execNFT) ListElements(ctx context.Context, objectType, name string) ([]*knftables.Element, error) {
	return listWithDeadline(ctx, n, "nft: listing the elements of "+objectType+" "+name, func(ctx context.Context) ([]*knftables.Element, error) {
		return n.Interface.ListElements(ctx, objectType, name)
	})
}

// ListCounters implements knftables.Interface with a deadline.
func (n *execNFT) ListCounters(ctx context.Context) ([]*knftables.Counter, error) {
	return listWithDeadline(ctx, n, "nft: listing counters", n.Interface.ListCounters)
}
