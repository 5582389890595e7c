package proxier

import (
	"context"
	"sync"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// MetaProxier drives one Engine per IP family on a dual-stack node: Services
// and Nodes (this one and the other nodes' labels) go to both,
// EndpointSlices to the engine of their address type.
type MetaProxier struct {
	ipv4, ipv6 Proxier
}

var _ Proxier = (*MetaProxier)(nil)

// NewMetaProxier combines an IPv4 and an IPv6 proxier.
func NewMetaProxier(ipv4, ipv6 Proxier) *MetaProxier {
	return &MetaProxier{ipv4: ipv4, ipv6: ipv6}
}

func (m *MetaProxier) both(f func(p Proxier)) { f(m.ipv4); f(m.ipv6) }

// Sync implements Proxier.
func (m *MetaProxier) Sync() { m.both(func(p Proxier) { p.Sync() }) }

// SyncLoop implements Proxier: both loops run until ctx is done.
func (m *MetaProxier) SyncLoop(ctx context.Context) {
	var wg sync.WaitGroup
	m.both(func(p Proxier) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.SyncLoop(ctx)
		}()
	})
	wg.Wait()
}

// OnServiceAdd implements config.ServiceHandler.
func (m *MetaProxier) OnServiceAdd(s *v1.Service) { m.both(func(p Proxier) { p.OnServiceAdd(s) }) }

// OnServiceUpdate implements config.ServiceHandler.
func (m *MetaProxier) OnServiceUpdate(o, s *v1.Service) {
	m.both(func(p Proxier) { p.OnServiceUpdate(o, s) })
}

// OnServiceDelete implements config.ServiceHandler.
func (m *MetaProxier) OnServiceDelete(s *v1.Service) {
	m.both(func(p Proxier) { p.OnServiceDelete(s) })
}

// OnServiceSynced implements config.ServiceHandler.
func (m *MetaProxier) OnServiceSynced() { m.both(func(p Proxier) { p.OnServiceSynced() }) }

// forSlice picks the proxier of a slice's address type (nil for FQDN).
func (m *MetaProxier) forSlice(s *discovery.EndpointSlice) Proxier {
	switch s.AddressType {
	case discovery.AddressTypeIPv4:
		return m.ipv4
	case discovery.AddressTypeIPv6:
		return m.ipv6
	}
	return nil
}

// OnEndpointSliceAdd implements config.EndpointSliceHandler.
func (m *MetaProxier) OnEndpointSliceAdd(s *discovery.EndpointSlice) {
	if p := m.forSlice(s); p != nil {
		p.OnEndpointSliceAdd(s)
	}
}

// OnEndpointSliceUpdate implements config.EndpointSliceHandler.
func (m *MetaProxier) OnEndpointSliceUpdate(o, s *discovery.EndpointSlice) {
	if p := m.forSlice(s); p != nil {
		p.OnEndpointSliceUpdate(o, s)
	}
}

// OnEndpointSliceDelete implements config.EndpointSliceHandler.
func (m *MetaProxier) OnEndpointSliceDelete(s *discovery.EndpointSlice) {
	if p := m.forSlice(s); p != nil {
		p.OnEndpointSliceDelete(s)
	}
}

// OnEndpointSlicesSynced implements config.EndpointSliceHandler.
func (m *MetaProxier) OnEndpointSlicesSynced() {
	m.both(func(p Proxier) { p.OnEndpointSlicesSynced() })
}

// OnNodeAdd implements config.NodeHandler.
func (m *MetaProxier) OnNodeAdd(n *v1.Node) { m.both(func(p Proxier) { p.OnNodeAdd(n) }) }

// OnNodeUpdate implements config.NodeHandler.
func (m *MetaProxier) OnNodeUpdate(o, n *v1.Node) { m.both(func(p Proxier) { p.OnNodeUpdate(o, n) }) }

// OnNodeDelete implements config.NodeHandler.
func (m *MetaProxier) OnNodeDelete(n *v1.Node) { m.both(func(p Proxier) { p.OnNodeDelete(n) }) }

// OnNodeSynced implements config.NodeHandler.
func (m *MetaProxier) OnNodeSynced() { m.both(func(p Proxier) { p.OnNodeSynced() }) }

// OnOtherNodesPending implements config.OtherNodesHandler.
func (m *MetaProxier) OnOtherNodesPending(pending bool) {
	m.both(func(p Proxier) { p.OnOtherNodesPending(pending) })
}
