package config

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/metadata/metadatainformer"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// nodesResource is the resource OtherNodesConfig reads the metadata of.
var nodesResource = v1.SchemeGroupVersion.WithResource("nodes")

// OtherNodesOptions configures NewOtherNodesConfig.
type OtherNodesOptions struct {
	// Client reads object metadata (PartialObjectMetadata); the API
	// server needs the same list and watch permission on nodes as for
	// full objects.
	Client metadata.Interface
	// NodeName is the node kproxy runs on. Its Node comes from NodeConfig;
	// OtherNodesConfig leaves it out.
	NodeName string
	// ResyncPeriod is the handlers' resync period (0: no resync).
	ResyncPeriod time.Duration
}

// OtherNodesConfig delivers the labels of the nodes other than this one to
// every registered OtherNodesHandler, for the topologyKeys annotation, and
// watches them only while that is needed: while at least one Service
// delivered to it has a topologyKeys annotation naming a node label. A
// cluster without such a Service never lists or watches the other nodes.
//
// It is a ServiceHandler: register it on the ServiceConfig before the
// handlers that program topologyKeys, so that OnOtherNodesPending(true)
// reaches them before the Service that needs the labels does. Run must be
// running, or the labels stay pending. (A Service that loses the annotation
// before the labels arrived is reported no longer pending just before the
// handlers see it change; a sync in between uses the labels known so far
// for it, and the next sync corrects it.)
//
// The watch is metadata only (PartialObjectMetadata, trimmed to names and
// labels by transformNodeMetadata) and excludes this node by field selector.
// Run starts a new watch when the first such Service appears, tells the
// handlers when it has delivered every node, and when the last such Service
// goes it stops the watch, delivers a delete for every node it had
// delivered, and drops its cache.
type OtherNodesConfig struct {
	opts     OtherNodesOptions
	logger   klog.Logger
	handlers handlerSet[OtherNodesHandler]
	// wake, with room for one signal, asks Run to look at users again.
	wake chan struct{}

	// mu guards the fields below and serializes OnOtherNodesPending calls,
	// so that handlers always end up told the current state.
	mu sync.Mutex
	// users are the Services whose topologyKeys need node labels.
	users sets.Set[types.NamespacedName]
	// watchSynced is set while a watch runs that has delivered its initial
	// list.
	watchSynced bool
	// pending is what the handlers were last told.
	pending bool
}

var _ ServiceHandler = (*OtherNodesConfig)(nil)

// NewOtherNodesConfig builds an OtherNodesConfig; nothing is watched until
// Run. The logger is taken from ctx.
func NewOtherNodesConfig(ctx context.Context, opts OtherNodesOptions) (*OtherNodesConfig, error) {
	if opts.Client == nil {
		return nil, errors.New("building the other nodes config: no metadata client")
	}
	if opts.NodeName == "" {
		return nil, errors.New("building the other nodes config: no node name")
	}
	return &OtherNodesConfig{
		opts:   opts,
		logger: klog.FromContext(ctx).WithName("other-nodes-config"),
		wake:   make(chan struct{}, 1),
		users:  sets.New[types.NamespacedName](),
	}, nil
}

// RegisterEventHandler adds a handler. Handlers are called in registration
// order, one event at a time.
func (c *OtherNodesConfig) RegisterEventHandler(handler OtherNodesHandler) {
	c.handlers.add(handler)
}

// NeedsNodeLabels reports whether a Service's topologyKeys annotation needs
// the labels of other nodes: it is valid (a malformed one is ignored by the
// engine) and names at least one label key, not just "*".
func NeedsNodeLabels(svc *v1.Service) bool {
	value, ok := svc.Annotations[proxy.AnnotationTopologyKeys]
	if !ok {
		return false
	}
	keys, err := proxy.ParseTopologyKeys(value)
	if err != nil {
		return false
	}
	return slices.ContainsFunc(keys, func(k string) bool { return k != proxy.TopologyKeyAny })
}

// OnServiceAdd implements ServiceHandler.
func (c *OtherNodesConfig) OnServiceAdd(service *v1.Service) { c.OnServiceUpdate(nil, service) }

// OnServiceUpdate implements ServiceHandler.
func (c *OtherNodesConfig) OnServiceUpdate(_, service *v1.Service) {
	c.setUser(types.NamespacedName{Namespace: service.Namespace, Name: service.Name}, NeedsNodeLabels(service))
}

// OnServiceDelete implements ServiceHandler.
func (c *OtherNodesConfig) OnServiceDelete(service *v1.Service) {
	c.setUser(types.NamespacedName{Namespace: service.Namespace, Name: service.Name}, false)
}

// OnServiceSynced implements ServiceHandler.
func (c *OtherNodesConfig) OnServiceSynced() {}

// setUser records whether a Service needs node labels. When that changes
// whether any Service does, the handlers learn whether labels are pending
// and Run is woken to start or stop the watch.
func (c *OtherNodesConfig) setUser(name types.NamespacedName, uses bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	before := c.users.Len() > 0
	if uses {
		c.users.Insert(name)
	} else {
		c.users.Delete(name)
	}
	if after := c.users.Len() > 0; after == before {
		return
	}
	c.logger.V(2).Info("Whether a Service needs other nodes' labels changed", "service", name, "needed", c.users.Len() > 0)
	c.updatePendingLocked()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// updatePendingLocked tells the handlers whether labels are pending, when
// that changed. The caller holds mu.
func (c *OtherNodesConfig) updatePendingLocked() {
	pending := c.users.Len() > 0 && !c.watchSynced
	if pending == c.pending {
		return
	}
	c.pending = pending
	for _, h := range c.handlers.snapshot() {
		c.logger.V(4).Info("Calling handler.OnOtherNodesPending", "pending", pending)
		h.OnOtherNodesPending(pending)
	}
}

// otherNodesWatch is one run of the metadata informer. An informer cannot
// be restarted, so each start builds a new one.
type otherNodesWatch struct {
	informer     cache.SharedIndexInformer
	registration cache.ResourceEventHandlerRegistration
	cancel       context.CancelFunc
	// done is closed when the informer has stopped delivering events.
	done chan struct{}
	// synced is set once the initial list has been delivered.
	synced bool
}

// Run starts and stops the watch of the other nodes as Services come and go,
// until ctx ends; then it stops the watch, if one runs, and returns.
func (c *OtherNodesConfig) Run(ctx context.Context) {
	c.logger.Info("Starting other nodes config controller")
	var w *otherNodesWatch
	defer func() {
		if w != nil {
			w.stop()
		}
	}()
	for {
		c.mu.Lock()
		want := c.users.Len() > 0
		if !want {
			// Set together with reading users: a Service that needs labels
			// from now on finds them pending.
			c.watchSynced = false
		}
		c.mu.Unlock()
		switch {
		case want && w == nil:
			var err error
			if w, err = c.startWatch(ctx); err != nil {
				// Only an informer that was already stopped refuses a
				// handler, and this one is new.
				c.logger.Error(err, "Cannot watch other nodes' labels")
				return
			}
		case !want && w != nil:
			w.stop()
			c.forget(w)
			w = nil
		}
		var synced <-chan struct{}
		if w != nil && !w.synced {
			synced = w.registration.HasSyncedChecker().Done()
		}
		select {
		case <-ctx.Done():
			c.logger.Info("Other nodes config controller stopped")
			return
		case <-c.wake:
		case <-synced:
			w.synced = true
			c.logger.Info("Other nodes' labels delivered", "nodes", len(w.informer.GetStore().ListKeys()))
			c.mu.Lock()
			c.watchSynced = true
			c.updatePendingLocked()
			c.mu.Unlock()
		}
	}
}

// startWatch builds and runs a metadata informer of the other nodes.
func (c *OtherNodesConfig) startWatch(ctx context.Context) (*otherNodesWatch, error) {
	c.logger.Info("Watching other nodes' labels: a Service uses topologyKeys")
	notThisNode := fields.OneTermNotEqualSelector("metadata.name", c.opts.NodeName).String()
	informer := metadatainformer.NewFilteredMetadataInformer(c.opts.Client, nodesResource, metav1.NamespaceAll,
		c.opts.ResyncPeriod, cache.Indexers{}, func(options *metav1.ListOptions) {
			options.FieldSelector = notThisNode
		}).Informer()
	if err := informer.SetTransform(transformNodeMetadata); err != nil {
		return nil, fmt.Errorf("setting the node metadata transform: %w", err)
	}
	registration, err := informer.AddEventHandlerWithResyncPeriod(c.eventHandler(), c.opts.ResyncPeriod)
	if err != nil {
		return nil, fmt.Errorf("registering the node metadata event handler: %w", err)
	}
	watchCtx, cancel := context.WithCancel(ctx)
	w := &otherNodesWatch{informer: informer, registration: registration, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		informer.RunWithContext(watchCtx)
	}()
	return w, nil
}

// stop stops the informer and waits until it delivers no more events.
func (w *otherNodesWatch) stop() {
	w.cancel()
	<-w.done
}

// forget delivers a delete for every node of a stopped watch; its cache
// goes with it.
func (c *OtherNodesConfig) forget(w *otherNodesWatch) {
	objs := w.informer.GetStore().List()
	c.logger.Info("Stopped watching other nodes' labels: no Service uses topologyKeys", "forgottenNodes", len(objs))
	for _, obj := range objs {
		if m, ok := obj.(*metav1.PartialObjectMetadata); ok && m != nil {
			c.deliverDelete(m)
		}
	}
}

func (c *OtherNodesConfig) eventHandler() cache.ResourceEventHandler {
	return typedEventHandler[metav1.PartialObjectMetadata]{
		logger: c.logger,
		kind:   "Node metadata",
		onAdd: func(m *metav1.PartialObjectMetadata) {
			if m.Name == c.opts.NodeName {
				return
			}
			node := nodeFromMetadata(m)
			for _, h := range c.handlers.snapshot() {
				c.logger.V(4).Info("Calling handler.OnNodeAdd", "node", klog.KObj(node))
				h.OnNodeAdd(node)
			}
		},
		onUpdate: func(oldM, m *metav1.PartialObjectMetadata) {
			if m.Name == c.opts.NodeName {
				return
			}
			oldNode, node := nodeFromMetadata(oldM), nodeFromMetadata(m)
			for _, h := range c.handlers.snapshot() {
				c.logger.V(5).Info("Calling handler.OnNodeUpdate", "node", klog.KObj(node))
				h.OnNodeUpdate(oldNode, node)
			}
		},
		onDelete: c.deliverDelete,
	}
}

func (c *OtherNodesConfig) deliverDelete(m *metav1.PartialObjectMetadata) {
	if m.Name == c.opts.NodeName {
		return
	}
	node := nodeFromMetadata(m)
	for _, h := range c.handlers.snapshot() {
		c.logger.V(4).Info("Calling handler.OnNodeDelete", "node", klog.KObj(node))
		h.OnNodeDelete(node)
	}
}

// nodeFromMetadata is the Node the handlers get for a node's metadata: its
// name, resource version and labels (shared with the cache, not copied).
func nodeFromMetadata(m *metav1.PartialObjectMetadata) *v1.Node {
	return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: m.Name, ResourceVersion: m.ResourceVersion, Labels: m.Labels}}
}
