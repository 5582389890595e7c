package proxy

import (
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// TopologyInfo is what CategorizeEndpoints needs to know about the cluster's
// nodes. It is a snapshot: reading it takes no lock.
type TopologyInfo struct {
	// NodeName is the node kproxy runs on.
	NodeName string
	// NodeLabels are this node's labels; its zone is the value of
	// topology.kubernetes.io/zone.
	NodeLabels map[string]string
	// LabelsOf returns the labels of any node by name; ok is false for a
	// node that is not known. It is consulted only for services with the
	// topologyKeys annotation. nil means every other node is unknown.
	LabelsOf func(nodeName string) (labels map[string]string, ok bool)
}

// labelsOfNode returns the labels of the named node, answering for this node
// from NodeLabels. An empty name is never known.
func (t *TopologyInfo) labelsOfNode(name string) (map[string]string, bool) {
	if name == "" {
		return nil, false
	}
	if name == t.NodeName {
		return t.NodeLabels, t.NodeLabels != nil
	}
	if t.LabelsOf == nil {
		return nil, false
	}
	return t.LabelsOf(name)
}

// topologyMode is the kind of hint filtering applied to cluster endpoints.
type topologyMode string

const (
	topologyModeNone     topologyMode = ""
	topologyModeSameZone topologyMode = topologyMode(v1.ServiceTrafficDistributionPreferSameZone)
	topologyModeSameNode topologyMode = topologyMode(v1.ServiceTrafficDistributionPreferSameNode)
)

// CategorizeEndpoints decides which of a service port's endpoints this node
// uses. It returns:
//
//   - clusterEndpoints: the endpoints for traffic under the Cluster policy,
//     after topology (hints, or the topologyKeys annotation when present).
//     nil when the service never uses the Cluster policy, or when no
//     endpoint qualifies.
//   - localEndpoints: the endpoints on this node for traffic under a Local
//     policy (internal or external); topology never applies to them. nil when
//     the service never uses a Local policy, or when there is none.
//   - allReachableEndpoints: the union of the two, each endpoint once.
//   - hasAnyEndpoints: false when traffic to the service must be rejected
//     because nothing could serve it. It can be true while the lists above
//     are empty: a Local policy with usable endpoints only on other nodes
//     (the traffic is then dropped instead).
//
// Usable endpoints are the Ready ones; when there is none, the serving and
// terminating ones are used instead, chosen independently for the Cluster
// and the Local lists. Hints count only when every Ready endpoint carries
// them and one of them names this node (node hints) or zone (zone hints);
// node hints are preferred to zone hints. As in upstream kube-proxy, the
// decision rests on the hints alone: the EndpointSlice controller sets them
// only for services that asked for them through trafficDistribution or the
// topology-mode annotation.
//
// A service with topologyKeys ignores hints: among the usable endpoints,
// those whose node shares this node's value of the first key that selects
// any endpoint are kept; "*" keeps all of them; if no key selects anything
// the Cluster list is empty and, for a service that only uses the Cluster
// policy, hasAnyEndpoints is false.
func CategorizeEndpoints(endpoints []*Endpoint, svc *ServicePort, topo TopologyInfo) (clusterEndpoints, localEndpoints, allReachableEndpoints []*Endpoint, hasAnyEndpoints bool) {
	if len(endpoints) == 0 {
		return nil, nil, nil, false
	}

	// clusterFiltered records that clusterEndpoints may leave out some Ready
	// endpoint, so it is not necessarily a superset of localEndpoints.
	clusterFiltered := false
	if svc.UsesClusterEndpoints() {
		clusterEndpoints, clusterFiltered = clusterPolicyEndpoints(endpoints, svc, &topo, nil)
		if len(clusterEndpoints) > 0 {
			hasAnyEndpoints = true
		}
	}

	if !svc.UsesLocalEndpoints() {
		return clusterEndpoints, nil, clusterEndpoints, hasAnyEndpoints
	}

	var localReady, localServingTerminating bool
	for _, ep := range endpoints {
		switch {
		case ep.Ready:
			hasAnyEndpoints = true
			localReady = localReady || ep.IsLocal
		case ep.Serving && ep.Terminating:
			hasAnyEndpoints = true
			localServingTerminating = localServingTerminating || ep.IsLocal
		}
	}
	useServingTerminating := false
	switch {
	case localReady:
		localEndpoints = filterEndpoints(endpoints, func(ep *Endpoint) bool {
			return ep.IsLocal && ep.Ready
		})
	case localServingTerminating:
		useServingTerminating = true
		localEndpoints = filterEndpoints(endpoints, func(ep *Endpoint) bool {
			return ep.IsLocal && ep.Serving && ep.Terminating
		})
	}

	if !svc.UsesClusterEndpoints() {
		return nil, localEndpoints, localEndpoints, hasAnyEndpoints
	}
	if (!clusterFiltered && !useServingTerminating) || len(localEndpoints) == 0 {
		// Either clusterEndpoints holds every Ready endpoint and
		// localEndpoints only Ready ones, or there is nothing local: the
		// cluster list already is the union.
		return clusterEndpoints, localEndpoints, clusterEndpoints, hasAnyEndpoints
	}
	if len(clusterEndpoints) == 0 {
		return nil, localEndpoints, localEndpoints, hasAnyEndpoints
	}
	return clusterEndpoints, localEndpoints, unionEndpoints(endpoints, clusterEndpoints, localEndpoints), hasAnyEndpoints
}

// ClusterEndpointsChoice says how CategorizeEndpoints chose a service
// port's Cluster-policy endpoints on this node; `kproxy explain` reports it
// (docs/design.md, "kproxy explain").
type ClusterEndpointsChoice struct {
	// Hints is the topology hints that filtered the endpoints:
	// "PreferSameNode" (node hints naming this node) or "PreferSameZone"
	// (zone hints naming this node's zone); "" when hints did not filter.
	Hints string
	// HintsIgnored says why the endpoints' hints were not used; "" when
	// they were, or when not every Ready endpoint has them.
	HintsIgnored string
	// Zone is this node's topology.kubernetes.io/zone label ("" if none).
	Zone string
	// TerminatingFallback: no endpoint was usable Ready, so the serving
	// terminating ones were taken.
	TerminatingFallback bool
	// TopologyKey is the topologyKeys entry that selected the endpoints
	// ("*" for any endpoint) and TopologyValue this node's value of it;
	// both "" when the service has no topology keys or none selected any
	// endpoint.
	TopologyKey, TopologyValue string
}

// ExplainClusterEndpoints reports how CategorizeEndpoints chooses the
// Cluster-policy endpoints of svc on this node, by running the same
// selection.
func ExplainClusterEndpoints(endpoints []*Endpoint, svc *ServicePort, topo TopologyInfo) ClusterEndpointsChoice {
	var c ClusterEndpointsChoice
	if len(endpoints) > 0 {
		clusterPolicyEndpoints(endpoints, svc, &topo, &c)
	}
	return c
}

// clusterPolicyEndpoints picks the endpoints for Cluster-policy traffic.
// filtered reports whether topology may have removed some Ready endpoint.
// why, when not nil, receives how the endpoints were chosen.
func clusterPolicyEndpoints(endpoints []*Endpoint, svc *ServicePort, topo *TopologyInfo, why *ClusterEndpointsChoice) (eps []*Endpoint, filtered bool) {
	if why == nil {
		why = &ClusterEndpointsChoice{}
	}
	zone := topo.NodeLabels[v1.LabelTopologyZone]
	why.Zone = zone
	if len(svc.TopologyKeys) > 0 {
		candidates := filterEndpoints(endpoints, func(ep *Endpoint) bool { return ep.Ready })
		if len(candidates) == 0 {
			candidates = filterEndpoints(endpoints, func(ep *Endpoint) bool { return ep.Serving && ep.Terminating })
			why.TerminatingFallback = len(candidates) > 0
		}
		eps, why.TopologyKey, why.TopologyValue = filterByTopologyKeys(candidates, svc, topo)
		return eps, true
	}

	mode, ignored := topologyModeFromHints(endpoints, topo.NodeName, zone)
	if ignored != "" {
		klog.Background().V(4).Info("Ignoring topology hints", "service", svc.Name.String(), "node", topo.NodeName, "zone", zone, "reason", ignored)
	}
	why.Hints, why.HintsIgnored = string(mode), ignored
	eps = filterEndpoints(endpoints, func(ep *Endpoint) bool {
		return ep.Ready && availableForTopology(ep, mode, topo.NodeName, zone)
	})
	if len(eps) == 0 {
		// A non-empty mode guarantees a Ready endpoint for this node or
		// zone, so an empty list means nothing is Ready anywhere: fall back
		// to serving terminating endpoints, without topology.
		eps = filterEndpoints(endpoints, func(ep *Endpoint) bool { return ep.Serving && ep.Terminating })
		why.TerminatingFallback = len(eps) > 0
	}
	return eps, mode != topologyModeNone
}

// topologyModeFromHints chooses how hints filter the Cluster endpoints:
// same-node when every Ready endpoint has node hints and one names this node;
// else same-zone when every Ready endpoint has zone hints and one names this
// node's zone; else no filtering. ignored says why hints that every Ready
// endpoint carries were not used.
func topologyModeFromHints(endpoints []*Endpoint, nodeName, zone string) (mode topologyMode, ignored string) {
	anyReady := false
	allNodeHints, nodeHinted := true, false
	allZoneHints, zoneHinted := true, false
	for _, ep := range endpoints {
		if !ep.Ready {
			continue
		}
		anyReady = true
		if ep.NodeHints.Len() == 0 {
			allNodeHints = false
		} else if nodeName != "" && ep.NodeHints.Has(nodeName) {
			nodeHinted = true
		}
		if ep.ZoneHints.Len() == 0 {
			allZoneHints = false
		} else if zone != "" && ep.ZoneHints.Has(zone) {
			zoneHinted = true
		}
	}
	if !anyReady {
		return topologyModeNone, ""
	}

	var why []string
	if allNodeHints {
		if nodeHinted {
			return topologyModeSameNode, ""
		}
		why = append(why, "no node hint names this node")
	}
	if allZoneHints {
		if zoneHinted {
			return topologyModeSameZone, strings.Join(why, "; ")
		}
		if zone == "" {
			why = append(why, "this node has no "+v1.LabelTopologyZone+" label for the zone hints")
		} else {
			why = append(why, "no zone hint names this node's zone "+zone)
		}
	}
	return topologyModeNone, strings.Join(why, "; ")
}

// availableForTopology reports whether an endpoint may serve this node under
// the chosen mode.
func availableForTopology(ep *Endpoint, mode topologyMode, nodeName, zone string) bool {
	switch mode {
	case topologyModeNone:
		return true
	case topologyModeSameNode:
		return ep.NodeHints.Has(nodeName)
	case topologyModeSameZone:
		return ep.ZoneHints.Has(zone)
	default:
		return false
	}
}

// filterByTopologyKeys applies the topologyKeys annotation (docs/design.md, "Topology keys") to
// the usable endpoints: the first key that selects at least one endpoint
// wins. A key selects the endpoints whose node carries the key with the same
// value as this node; a key this node lacks selects nothing; "*" selects
// every endpoint. Endpoints on unknown nodes are selected only by "*". It
// returns the key that selected and this node's value of it ("" for "*";
// both "" when none selected).
func filterByTopologyKeys(candidates []*Endpoint, svc *ServicePort, topo *TopologyInfo) (eps []*Endpoint, key, value string) {
	if len(candidates) == 0 {
		return nil, "", ""
	}
	for _, key := range svc.TopologyKeys {
		if key == TopologyKeyAny {
			return candidates, key, ""
		}
		want, ok := topo.NodeLabels[key]
		if !ok {
			continue
		}
		eps := filterEndpoints(candidates, func(ep *Endpoint) bool {
			labels, known := topo.labelsOfNode(ep.NodeName)
			if !known {
				return false
			}
			got, ok := labels[key]
			return ok && got == want
		})
		if len(eps) > 0 {
			return eps, key, want
		}
	}
	klog.Background().V(4).Info("No endpoint matches the service's topology keys on this node", "service", svc.Name.String(), "node", topo.NodeName, "topologyKeys", svc.TopologyKeys)
	return nil, "", ""
}

// filterEndpoints returns the endpoints satisfying keep, in order; nil when
// none does.
func filterEndpoints(endpoints []*Endpoint, keep func(*Endpoint) bool) []*Endpoint {
	var out []*Endpoint
	for _, ep := range endpoints {
		if keep(ep) {
			if out == nil {
				out = make([]*Endpoint, 0, len(endpoints))
			}
			out = append(out, ep)
		}
	}
	return out
}

// unionEndpoints returns the endpoints in either list, each once, in the
// order of all (the list both were filtered from).
func unionEndpoints(all, a, b []*Endpoint) []*Endpoint {
	in := make(map[*Endpoint]struct{}, len(a)+len(b))
	for _, ep := range a {
		in[ep] = struct{}{}
	}
	for _, ep := range b {
		in[ep] = struct{}{}
	}
	out := make([]*Endpoint, 0, len(in))
	for _, ep := range all {
		if _, ok := in[ep]; ok {
			out = append(out, ep)
			delete(in, ep)
		}
	}
	return out
}
