package config

import (
	"context"
	"fmt"
	"sync"

	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// typedEventHandler adapts the untyped client-go callbacks to typed ones for
// objects of type *E. It unwraps DeletedFinalStateUnknown tombstones and logs
// and drops anything that is not a non-nil *E, so the callbacks only ever see
// well-typed objects.
type typedEventHandler[E any] struct {
	logger klog.Logger
	// kind names E in log messages.
	kind     string
	onAdd    func(obj *E)
	onUpdate func(oldObj, newObj *E)
	onDelete func(obj *E)
}

var _ cache.ResourceEventHandler = typedEventHandler[struct{}]{}

// OnAdd implements cache.ResourceEventHandler.
func (h typedEventHandler[E]) OnAdd(obj any, _ bool) {
	typed, ok := h.convert("add", obj)
	if !ok {
		return
	}
	h.onAdd(typed)
}

// OnUpdate implements cache.ResourceEventHandler.
func (h typedEventHandler[E]) OnUpdate(oldObj, newObj any) {
	oldTyped, ok := h.convert("update", oldObj)
	if !ok {
		return
	}
	newTyped, ok := h.convert("update", newObj)
	if !ok {
		return
	}
	h.onUpdate(oldTyped, newTyped)
}

// OnDelete implements cache.ResourceEventHandler.
func (h typedEventHandler[E]) OnDelete(obj any) {
	if tombstone, isTombstone := obj.(cache.DeletedFinalStateUnknown); isTombstone {
		h.logger.V(4).Info("Delete observed through a tombstone", "kind", h.kind, "key", tombstone.Key)
		obj = tombstone.Obj
	}
	typed, ok := h.convert("delete", obj)
	if !ok {
		return
	}
	h.onDelete(typed)
}

// convert type-asserts obj, logging and rejecting anything that is not a
// non-nil *E.
func (h typedEventHandler[E]) convert(event string, obj any) (*E, bool) {
	typed, ok := obj.(*E)
	if !ok || typed == nil {
		h.logger.Error(nil, "Ignoring informer event with unexpected object type",
			"event", event, "expectedKind", h.kind, "type", fmt.Sprintf("%T", obj))
		return nil, false
	}
	return typed, true
}

// handlerSet is a concurrency-safe list of handlers: handlers may be
// registered while the informer is already delivering events.
type handlerSet[H any] struct {
	mu       sync.RWMutex
	handlers []H
}

func (s *handlerSet[H]) add(h H) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.handlers = append(s.handlers, h)
}

// snapshot returns the handlers registered so far; callers iterate it without
// holding the lock so that a slow handler never blocks registration.
func (s *handlerSet[H]) snapshot() []H {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.handlers[:len(s.handlers):len(s.handlers)]
}

// waitForSync blocks until synced is done or ctx ends; it reports whether
// the cache synced. It waits on the registration's channel (cache.WaitFor),
// not by polling HasSynced: the poll (cache.WaitForNamedCacheSync, every
// 100 ms) held the first sync back 60-70 ms on average at 10,000 Services
// (docs/design.md, "First sync").
func waitForSync(ctx context.Context, logger klog.Logger, synced cache.DoneChecker) bool {
	logger.Info("Waiting for caches to sync")
	if !cache.WaitFor(ctx, "", synced) {
		return false
	}
	logger.Info("Caches are synced")
	return true
}
