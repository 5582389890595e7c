// Package config fans client-go informer events for Services, EndpointSlices
// and Nodes out to registered handlers, applying kube-proxy's informer
// filters.
package config

import (
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// ServiceHandler is notified of Service changes.
type ServiceHandler interface {
	OnServiceAdd(service *v1.Service)
	OnServiceUpdate(oldService, service *v1.Service)
	OnServiceDelete(service *v1.Service)
	// OnServiceSynced is called once the initial list has been delivered.
	OnServiceSynced()
}

// EndpointSliceHandler is notified of EndpointSlice changes. A handler
// must not keep the slices it is given, only what it derives from them:
// EndpointSliceConfig releases a slice's endpoints, ports, labels and
// annotations once every handler has had it. So the old slice of an update,
// and the slice of a deletion found on a relist, carry only the slice's
// namespace, name and address type.
type EndpointSliceHandler interface {
	OnEndpointSliceAdd(endpointSlice *discovery.EndpointSlice)
	OnEndpointSliceUpdate(oldEndpointSlice, newEndpointSlice *discovery.EndpointSlice)
	OnEndpointSliceDelete(endpointSlice *discovery.EndpointSlice)
	OnEndpointSlicesSynced()
}

// NodeHandler is notified of changes of this node's Node (NodeConfig).
type NodeHandler interface {
	OnNodeAdd(node *v1.Node)
	OnNodeUpdate(oldNode, node *v1.Node)
	OnNodeDelete(node *v1.Node)
	OnNodeSynced()
}

// OtherNodesHandler is notified of the labels of the other nodes, which
// OtherNodesConfig watches only while some Service uses the topologyKeys
// annotation.
type OtherNodesHandler interface {
	// OnNodeAdd, OnNodeUpdate and OnNodeDelete carry Nodes with a name,
	// a resource version and labels only. Handlers must not modify them.
	OnNodeAdd(node *v1.Node)
	OnNodeUpdate(oldNode, node *v1.Node)
	OnNodeDelete(node *v1.Node)
	// OnOtherNodesPending(true) says that a Service needs the other nodes'
	// labels and they have not all been delivered yet: a handler that
	// programs topologyKeys should hold its syncs back. It is called before
	// the handlers of the ServiceConfig registered after OtherNodesConfig
	// see the Service. OnOtherNodesPending(false) follows once the labels
	// have been delivered, or when no Service needs them any more.
	OnOtherNodesPending(pending bool)
}
