package config

import (
	"context"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// NodeConfig delivers Node events from one informer to every registered
// NodeHandler. The informer of NewInformerFactories watches this node's Node
// only; the other nodes' labels come from OtherNodesConfig.
type NodeConfig struct {
	logger   klog.Logger
	synced   cache.DoneChecker
	handlers handlerSet[NodeHandler]
}

// NewNodeConfig registers a NodeConfig on informer with the given resync
// period. The logger is taken from ctx.
func NewNodeConfig(ctx context.Context, informer coreinformers.NodeInformer, resyncPeriod time.Duration) (*NodeConfig, error) {
	c := &NodeConfig{logger: klog.FromContext(ctx).WithName("node-config")}
	registration, err := informer.Informer().AddEventHandlerWithResyncPeriod(c.eventHandler(), resyncPeriod)
	if err != nil {
		return nil, fmt.Errorf("registering Node event handler: %w", err)
	}
	c.synced = registration.HasSyncedChecker()
	return c, nil
}

// RegisterEventHandler adds a handler. Handlers are called in registration
// order, one event at a time.
func (c *NodeConfig) RegisterEventHandler(handler NodeHandler) {
	c.handlers.add(handler)
}

// Run waits until the initial list of Nodes has been delivered and then calls
// OnNodeSynced on every handler, once. It returns early, without calling
// them, when ctx ends first.
func (c *NodeConfig) Run(ctx context.Context) {
	c.logger.Info("Starting node config controller")
	if !waitForSync(ctx, c.logger, c.synced) {
		c.logger.Info("Node config controller stopped before the cache synced")
		return
	}
	for _, h := range c.handlers.snapshot() {
		c.logger.V(3).Info("Calling handler.OnNodeSynced()")
		h.OnNodeSynced()
	}
}

func (c *NodeConfig) eventHandler() cache.ResourceEventHandler {
	return typedEventHandler[v1.Node]{
		logger: c.logger,
		kind:   "Node",
		onAdd: func(node *v1.Node) {
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnNodeAdd", "node", klog.KObj(node))
				h.OnNodeAdd(node)
			}
		},
		onUpdate: func(oldNode, node *v1.Node) {
			for _, h := range c.handlers.snapshot() {
				c.logger.V(5).Info("Calling handler.OnNodeUpdate", "node", klog.KObj(node))
				h.OnNodeUpdate(oldNode, node)
			}
		},
		onDelete: func(node *v1.Node) {
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnNodeDelete", "node", klog.KObj(node))
				h.OnNodeDelete(node)
			}
		},
	}
}
