package config

import (
	"context"
	"fmt"
	"time"

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
type EndpointSliceConfig struct {
	logger   klog.Logger
	synced   cache.InformerSynced
	handlers handlerSet[EndpointSliceHandler]
}

// NewEndpointSliceConfig registers an EndpointSliceConfig on informer with
// the given resync period. The logger is taken from ctx.
func NewEndpointSliceConfig(ctx context.Context, informer discoveryinformers.EndpointSliceInformer, resyncPeriod time.Duration) (*EndpointSliceConfig, error) {
	c := &EndpointSliceConfig{logger: klog.FromContext(ctx).WithName("endpointslice-config")}
	registration, err := informer.Informer().AddEventHandlerWithResyncPeriod(c.eventHandler(), resyncPeriod)
	if err != nil {
		return nil, fmt.Errorf("registering EndpointSlice event handler: %w", err)
	}
	c.synced = registration.HasSynced
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
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnEndpointSliceAdd", "endpointSlice", klog.KObj(slice))
				h.OnEndpointSliceAdd(slice)
			}
		},
		onUpdate: func(oldSlice, slice *discovery.EndpointSlice) {
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnEndpointSliceUpdate", "endpointSlice", klog.KObj(slice))
				h.OnEndpointSliceUpdate(oldSlice, slice)
			}
		},
		onDelete: func(slice *discovery.EndpointSlice) {
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnEndpointSliceDelete", "endpointSlice", klog.KObj(slice))
				h.OnEndpointSliceDelete(slice)
			}
		},
	}
}
