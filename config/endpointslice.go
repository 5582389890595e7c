package config

import (
	"context"
	"fmt"
	"sync"

	discovery "k8s.io/api/discovery/v1"
	discoveryinformers "k8s.io/client-go/informers/discovery/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// EndpointSliceConfig delivers EndpointSlice events from one informer to
// every registered EndpointSliceHandler. The slices of headless Services
// are left out by the informer's label selector (EndpointSliceSelector);
// slices of Services this proxy does not handle are delivered, as kube-proxy
// has them, and program nothing without their Service.
//
// The informer's cache does not keep the slices' endpoints: once every
// handler has been given a slice, its endpoints and ports are released (see
// release), and the cached object keeps only what a delete needs (name,
// namespace, address type). The engines' EndpointSliceCache is the
// one copy of the endpoints; at 10,000 Services of 10 endpoints this is
// about 25 MB less. Hence the slice informer never resyncs to these
// handlers: a resync would replay the released objects.
type EndpointSliceConfig struct {
	logger   klog.Logger
	synced   cache.DoneChecker
	handlers handlerSet[EndpointSliceHandler]

	// mu guards released: the cached slices whose endpoints were
	// released. An update whose new object is one of them is a replay of
	// the cache (a resync), not news, and is not delivered.
	mu       sync.Mutex
	released map[*discovery.EndpointSlice]struct{}
}

// NewEndpointSliceConfig registers an EndpointSliceConfig on informer,
// without resync (see EndpointSliceConfig). The logger is taken from ctx.
func NewEndpointSliceConfig(ctx context.Context, informer discoveryinformers.EndpointSliceInformer) (*EndpointSliceConfig, error) {
	c := &EndpointSliceConfig{
		logger:   klog.FromContext(ctx).WithName("endpointslice-config"),
		released: map[*discovery.EndpointSlice]struct{}{},
	}
	registration, err := informer.Informer().AddEventHandlerWithResyncPeriod(c.eventHandler(), 0)
	if err != nil {
		return nil, fmt.Errorf("registering EndpointSlice event handler: %w", err)
	}
	c.synced = registration.HasSyncedChecker()
	return c, nil
}

// RegisterEventHandler adds a handler. Handlers are called in registration
// order, one event at a time.
func (c *EndpointSliceConfig) RegisterEventHandler(handler EndpointSliceHandler) {
	c.handlers.add(handler)
}

// Run waits until the initial list of EndpointSlices has been delivered and
// then calls OnEndpointSlicesSynced on every handler, once. It returns early,
// without calling them, when ctx ends first.
func (c *EndpointSliceConfig) Run(ctx context.Context) {
	c.logger.Info("Starting endpoint slice config controller")
	if !waitForSync(ctx, c.logger, c.synced) {
		c.logger.Info("Endpoint slice config controller stopped before the cache synced")
		return
	}
	for _, h := range c.handlers.snapshot() {
		c.logger.V(3).Info("Calling handler.OnEndpointSlicesSynced()")
		h.OnEndpointSlicesSynced()
	}
}

func (c *EndpointSliceConfig) eventHandler() cache.ResourceEventHandler {
	return typedEventHandler[discovery.EndpointSlice]{
		logger: c.logger,
		kind:   "EndpointSlice",
		onAdd: func(slice *discovery.EndpointSlice) {
			if c.isReleased(slice) {
				return
			}
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnEndpointSliceAdd", "endpointSlice", klog.KObj(slice))
				h.OnEndpointSliceAdd(slice)
			}
			c.release(nil, slice)
		},
		onUpdate: func(oldSlice, slice *discovery.EndpointSlice) {
			if c.isReleased(slice) {
				c.logger.V(5).Info("Not replaying a cached EndpointSlice", "endpointSlice", klog.KObj(slice))
				return
			}
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnEndpointSliceUpdate", "endpointSlice", klog.KObj(slice))
				h.OnEndpointSliceUpdate(oldSlice, slice)
			}
			c.release(oldSlice, slice)
		},
		onDelete: func(slice *discovery.EndpointSlice) {
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnEndpointSliceDelete", "endpointSlice", klog.KObj(slice))
				h.OnEndpointSliceDelete(slice)
			}
			c.mu.Lock()
			delete(c.released, slice)
			c.mu.Unlock()
		},
	}
}

func (c *EndpointSliceConfig) isReleased(slice *discovery.EndpointSlice) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.released[slice]
	return ok
}

// release drops the endpoints and ports of slice, which every handler has
// been given and which the informer's cache holds (and its annotations and
// labels: a deletion without the service-name label is matched by slice
// name in the engines' EndpointSliceCache), and forgets old, the
// object it replaced. The handlers keep nothing of a slice but what they
// derived from it (the EndpointSliceHandler contract), and nothing else
// reads the slice informer's cache: the engines' EndpointSliceCache holds
// the endpoints. A delete needs only the name, namespace, labels and
// address type, which stay.
func (c *EndpointSliceConfig) release(old, slice *discovery.EndpointSlice) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old != nil {
		delete(c.released, old)
	}
	slice.Endpoints, slice.Ports, slice.Annotations, slice.Labels = nil, nil, nil, nil
	c.released[slice] = struct{}{}
}
