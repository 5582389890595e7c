package config

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// ServiceConfig delivers Service events from one informer to every
// registered ServiceHandler. Services that proxy.ShouldSkipService skips
// (headless, ExternalName, without a ClusterIP) are never delivered: kproxy,
// like kube-proxy, programs nothing for them. A Service that turns into one
// of those is delivered as a delete, and one that stops being one as an add,
// so handlers see a consistent stream.
type ServiceConfig struct {
	logger   klog.Logger
	synced   cache.DoneChecker
	handlers handlerSet[ServiceHandler]
}

// NewServiceConfig registers a ServiceConfig on informer with the given
// resync period. The logger is taken from ctx. Nothing runs until the
// informer is started; call Run to have handlers told when the initial list
// has been delivered.
func NewServiceConfig(ctx context.Context, informer coreinformers.ServiceInformer, resyncPeriod time.Duration) (*ServiceConfig, error) {
	c := &ServiceConfig{logger: klog.FromContext(ctx).WithName("service-config")}
	registration, err := informer.Informer().AddEventHandlerWithResyncPeriod(c.eventHandler(), resyncPeriod)
	if err != nil {
		return nil, fmt.Errorf("registering Service event handler: %w", err)
	}
	// The registration, unlike the informer, only reports synced once every
	// object of the initial list has been handed to this handler.
	c.synced = registration.HasSyncedChecker()
	return c, nil
}

// RegisterEventHandler adds a handler. Handlers are called in registration
// order, one event at a time.
func (c *ServiceConfig) RegisterEventHandler(handler ServiceHandler) {
	c.handlers.add(handler)
}

// Run waits until the initial list of Services has been delivered and then
// calls OnServiceSynced on every handler, once. It returns early, without
// calling them, when ctx ends first.
func (c *ServiceConfig) Run(ctx context.Context) {
	c.logger.Info("Starting service config controller")
	if !waitForSync(ctx, c.logger, c.synced) {
		c.logger.Info("Service config controller stopped before the cache synced")
		return
	}
	for _, h := range c.handlers.snapshot() {
		c.logger.V(3).Info("Calling handler.OnServiceSynced()")
		h.OnServiceSynced()
	}
}

func (c *ServiceConfig) eventHandler() cache.ResourceEventHandler {
	return typedEventHandler[v1.Service]{
		logger:   c.logger,
		kind:     "Service",
		onAdd:    c.handleAdd,
		onUpdate: c.handleUpdate,
		onDelete: c.handleDelete,
	}
}

func (c *ServiceConfig) handleAdd(service *v1.Service) {
	if reason := skipReason(service); reason != "" {
		c.logger.V(4).Info("Ignoring Service", "service", klog.KObj(service), "reason", reason)
		return
	}
	c.deliverAdd(service)
}

func (c *ServiceConfig) handleUpdate(oldService, service *v1.Service) {
	oldReason, newReason := skipReason(oldService), skipReason(service)
	switch {
	case oldReason != "" && newReason != "":
		c.logger.V(5).Info("Ignoring Service update", "service", klog.KObj(service), "reason", newReason)
	case oldReason != "":
		c.logger.V(4).Info("Service is no longer ignored, delivering it as added", "service", klog.KObj(service), "previousReason", oldReason)
		c.deliverAdd(service)
	case newReason != "":
		c.logger.V(4).Info("Service is now ignored, delivering it as deleted", "service", klog.KObj(service), "reason", newReason)
		c.deliverDelete(oldService)
	default:
		for _, h := range c.handlers.snapshot() {
			c.logger.V(4).Info("Calling handler.OnServiceUpdate", "service", klog.KObj(service))
			h.OnServiceUpdate(oldService, service)
		}
	}
}

func (c *ServiceConfig) handleDelete(service *v1.Service) {
	// A tombstone holds the last state the cache saw, which is also the last
	// state delivered, so an ignored Service was never delivered.
	if reason := skipReason(service); reason != "" {
		c.logger.V(5).Info("Ignoring Service delete", "service", klog.KObj(service), "reason", reason)
		return
	}
	c.deliverDelete(service)
}

func (c *ServiceConfig) deliverAdd(service *v1.Service) {
	for _, h := range c.handlers.snapshot() {
		c.logger.V(4).Info("Calling handler.OnServiceAdd", "service", klog.KObj(service))
		h.OnServiceAdd(service)
	}
}

func (c *ServiceConfig) deliverDelete(service *v1.Service) {
	for _, h := range c.handlers.snapshot() {
		c.logger.V(4).Info("Calling handler.OnServiceDelete", "service", klog.KObj(service))
		h.OnServiceDelete(service)
	}
}

// skipReason says why kproxy ignores a Service, or "" when it does not.
func skipReason(service *v1.Service) string {
	_, reason := proxy.ShouldSkipService(service)
	return reason
}
