package proxy

import (
	"maps"
	"sync"

	v1 "k8s.io/api/core/v1"
)

// NodeLabelsOptions configures a NodeLabels cache.
type NodeLabelsOptions struct {
	// NodeName is the node kproxy runs on.
	NodeName string
}

// NodeLabels caches the labels of every node, fed by node add, update and
// delete events, for topology decisions. It is safe for concurrent use.
//
// Stored label maps are never modified after being stored, and the index is
// copied before a write whenever a snapshot may still be reading it, so maps
// returned by Get, Self and TopologyInfo stay valid without the lock. Callers
// must not modify them.
type NodeLabels struct {
	nodeName string

	mu sync.RWMutex
	// labels maps node name to that node's labels (never nil for a known node).
	labels map[string]map[string]string
	// shared is true when a snapshot holds the current labels index, so the
	// next write must copy it first.
	shared bool
}

// NewNodeLabels returns an empty cache.
func NewNodeLabels(opts NodeLabelsOptions) *NodeLabels {
	return &NodeLabels{
		nodeName: opts.NodeName,
		labels:   make(map[string]map[string]string),
	}
}

// NodeName is the node kproxy runs on.
func (c *NodeLabels) NodeName() string { return c.nodeName }

// Set records a node's labels (other node fields are ignored). It reports
// whether the cache changed: the node was not known, or its labels differ
// from the ones recorded.
func (c *NodeLabels) Set(node *v1.Node) (changed bool) {
	if node == nil || node.Name == "" {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old, known := c.labels[node.Name]
	if known && maps.Equal(old, node.Labels) {
		return false
	}
	labels := maps.Clone(node.Labels)
	if labels == nil {
		labels = map[string]string{}
	}
	c.writable()[node.Name] = labels
	return true
}

// Delete forgets a node. It reports whether the node was known.
func (c *NodeLabels) Delete(name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, known := c.labels[name]; !known {
		return false
	}
	delete(c.writable(), name)
	return true
}

// Get returns a node's labels and whether the node is known. The map must
// not be modified.
func (c *NodeLabels) Get(name string) (map[string]string, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	labels, ok := c.labels[name]
	return labels, ok
}

// Self returns this node's labels; nil while this node is not known. The map
// must not be modified.
func (c *NodeLabels) Self() map[string]string {
	labels, _ := c.Get(c.nodeName)
	return labels
}

// TopologyInfo returns a snapshot of the cache for CategorizeEndpoints. Later
// changes to the cache do not affect it, and using it takes no lock.
func (c *NodeLabels) TopologyInfo() TopologyInfo {
	c.mu.Lock()
	defer c.mu.Unlock()
	index := c.labels
	c.shared = true
	return TopologyInfo{
		NodeName:   c.nodeName,
		NodeLabels: index[c.nodeName],
		LabelsOf: func(name string) (map[string]string, bool) {
			labels, ok := index[name]
			return labels, ok
		},
	}
}

// writable returns the labels index, copying it first when a snapshot holds
// it. The caller holds the write lock.
func (c *NodeLabels) writable() map[string]map[string]string {
	if c.shared {
		c.labels = maps.Clone(c.labels)
		c.shared = false
	}
	return c.labels
}
