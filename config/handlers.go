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

// EndpointSliceHandler is notified of EndpointSlice changes.
type EndpointSliceHandler interface {
	OnEndpointSliceAdd(endpointSlice *discovery.EndpointSlice)
	OnEndpointSliceUpdate(oldEndpointSlice, newEndpointSlice *discovery.EndpointSlice)
	OnEndpointSliceDelete(endpointSlice *discovery.EndpointSlice)
	OnEndpointSlicesSynced()
}

// NodeHandler is notified of Node changes (every node: topologyKeys needs
// the labels of the nodes endpoints run on).
type NodeHandler interface {
	OnNodeAdd(node *v1.Node)
	OnNodeUpdate(oldNode, node *v1.Node)
	OnNodeDelete(node *v1.Node)
	OnNodeSynced()
}
