package proxy

import (
	"net/netip"
)

// This file is where kproxy decides, once for every backend, what this node
// does with a new connection to a service port: for each kind of
// destination (DestinationKind) and each class of source (SourceClass), a
// Decision. Backends render the decisions and hold no Service semantics of
// their own (docs/design.md, "The decision table").

// DestinationKind is how a packet addresses a service port.
type DestinationKind uint8

const (
	// DestClusterIP is the service's ClusterIP and port.
	DestClusterIP DestinationKind = iota
	// DestNodePort is a node-port-accepting node address and the node port.
	DestNodePort
	// DestExternalIP is one of spec.externalIPs and the port.
	DestExternalIP
	// DestLoadBalancerIP is a LoadBalancer ingress IP (not ipMode Proxy)
	// and the port.
	DestLoadBalancerIP
)

// DestinationKinds lists every DestinationKind, in order.
var DestinationKinds = [...]DestinationKind{DestClusterIP, DestNodePort, DestExternalIP, DestLoadBalancerIP}

func (k DestinationKind) String() string {
	switch k {
	case DestClusterIP:
		return "ClusterIP"
	case DestNodePort:
		return "NodePort"
	case DestExternalIP:
		return "ExternalIP"
	case DestLoadBalancerIP:
		return "LoadBalancerIP"
	}
	return "unknown"
}

// External reports whether the destination is subject to the external
// traffic policy.
func (k DestinationKind) External() bool { return k != DestClusterIP }

// SourceClass is who sends a packet, as far as a node can tell.
type SourceClass uint8

const (
	// SourcePod is a source inside the cluster CIDR (kube-proxy's "local
	// traffic" detector). When the cluster CIDR is unknown pods cannot be
	// told apart and the model gives SourcePod the decisions of
	// SourceOther.
	SourcePod SourceClass = iota
	// SourceNode is a process of this node (a locally generated packet).
	SourceNode
	// SourceOther is anything else: another node, a client outside the
	// cluster.
	SourceOther
)

// SourceClasses lists every SourceClass, in the order a backend must test
// them: a pod first, then the node, then everyone else.
var SourceClasses = [...]SourceClass{SourcePod, SourceNode, SourceOther}

func (c SourceClass) String() string {
	switch c {
	case SourcePod:
		return "pod"
	case SourceNode:
		return "node"
	case SourceOther:
		return "other"
	}
	return "unknown"
}

// Verdict is what happens to a new connection.
type Verdict uint8

const (
	// VerdictNone: the destination does not exist for this port (no node
	// port, no such address); nothing is rendered for it.
	VerdictNone Verdict = iota
	// VerdictDeliver: DNAT to one of the selected endpoints.
	VerdictDeliver
	// VerdictDrop: silently dropped (a Local policy without a local
	// endpoint, a source outside loadBalancerSourceRanges).
	VerdictDrop
	// VerdictReject: refused with ICMP (the service has no endpoint).
	VerdictReject
)

func (v Verdict) String() string {
	switch v {
	case VerdictNone:
		return "none"
	case VerdictDeliver:
		return "deliver"
	case VerdictDrop:
		return "drop"
	case VerdictReject:
		return "reject"
	}
	return "unknown"
}

// EndpointSelection names the endpoint list a delivery balances over.
type EndpointSelection uint8

const (
	SelectNone EndpointSelection = iota
	// SelectCluster is ServiceState.ClusterEndpoints.
	SelectCluster
	// SelectLocal is ServiceState.LocalEndpoints.
	SelectLocal
)

func (s EndpointSelection) String() string {
	switch s {
	case SelectCluster:
		return "cluster"
	case SelectLocal:
		return "local"
	}
	return "none"
}

// Decision is what this node does with a new connection to one kind of
// destination of a service port from one class of source.
type Decision struct {
	Verdict Verdict
	// Endpoints is the list a VerdictDeliver balances over.
	Endpoints EndpointSelection
	// ShortCircuit marks a delivery over the cluster endpoints that
	// bypasses the destination's Local policy: a pod or the node reaching
	// an external destination is treated as if it went out to a load
	// balancer and came back.
	ShortCircuit bool
	// Masquerade asks for SNAT to the node's address.
	Masquerade bool
}

// SourceFilter is loadBalancerSourceRanges on the LoadBalancer IPs of a
// port: a new connection whose source is not allowed is dropped, whatever
// its class, before any other decision.
type SourceFilter struct {
	// Allowed are the source ranges.
	Allowed []netip.Prefix
	// AllowVIPSource also admits the LoadBalancer IP itself as source: the
	// node's primary IP is inside a range, and a node reaching a VIP that is
	// a local address uses the VIP as its source.
	AllowVIPSource bool
}

// Allows reports whether a connection from src to the LoadBalancer IP vip
// passes the filter.
func (f *SourceFilter) Allows(src, vip netip.Addr) bool {
	if f == nil {
		return true
	}
	if f.AllowVIPSource && src == vip {
		return true
	}
	for _, p := range f.Allowed {
		if p.Contains(src) {
			return true
		}
	}
	return false
}

// DecisionOptions is the node-wide configuration the decisions depend on.
type DecisionOptions struct {
	// MasqueradeAll masquerades every connection to a ClusterIP.
	MasqueradeAll bool
	// ClusterCIDR recognises pods by source address; invalid (zero) when
	// unknown, and then SourcePod is decided as SourceOther.
	ClusterCIDR netip.Prefix
	// NodeIP is this node's primary IP of the family; zero when unknown.
	// loadBalancerSourceRanges containing it admit the node itself.
	NodeIP netip.Addr
}

// ClusterIPMasquerade is, by source class, whether connections to a
// ClusterIP are masqueraded: it depends on the node's options only. With
// --masquerade-all everything is; otherwise what comes from outside the
// cluster CIDR (the node itself, other hosts), which could not be answered
// through this node otherwise; without a cluster CIDR nothing is (pods
// cannot be told apart).
func ClusterIPMasquerade(opts DecisionOptions) [len(SourceClasses)]bool {
	offCluster := opts.MasqueradeAll || opts.ClusterCIDR.IsValid()
	var m [len(SourceClasses)]bool
	m[SourcePod] = opts.MasqueradeAll
	m[SourceNode] = offCluster
	m[SourceOther] = offCluster
	return m
}

// ServiceDecisions is the complete decision for one service port on this
// node.
type ServiceDecisions struct {
	table [len(DestinationKinds)][len(SourceClasses)]Decision
	// Firewall filters the LoadBalancer IPs; nil when the port has no
	// loadBalancerSourceRanges (or no LoadBalancer IP, or no endpoint: then
	// everything is rejected anyway).
	Firewall *SourceFilter
	// AffinitySeconds is the ClientIP session affinity timeout; 0 without
	// affinity.
	AffinitySeconds int
	// Hairpin are the endpoints that may reach themselves through the
	// service (on this node, or of unknown node): such a connection is
	// masqueraded, or the endpoint would answer itself directly.
	Hairpin []*Endpoint
	// NoLocalEndpointsInternal and NoLocalEndpointsExternal report a Local
	// policy that leaves the port without an endpoint on this node while it
	// has endpoints elsewhere (kube-proxy's no-local-endpoints metric).
	NoLocalEndpointsInternal bool
	NoLocalEndpointsExternal bool
}

// For returns the decision for a destination kind and source class; the
// verdict is VerdictNone when the port has no such destination.
func (d *ServiceDecisions) For(kind DestinationKind, class SourceClass) Decision {
	return d.table[kind][class]
}

// Has reports whether the port has destinations of kind.
func (d *ServiceDecisions) Has(kind DestinationKind) bool {
	return d.table[kind][SourceOther].Verdict != VerdictNone
}

// Uniform reports whether every source class gets the same decision for
// kind, and returns it.
func (d *ServiceDecisions) Uniform(kind DestinationKind) (Decision, bool) {
	row := d.table[kind]
	return row[SourceOther], row[SourcePod] == row[SourceOther] && row[SourceNode] == row[SourceOther]
}

// Uses reports whether any decision delivers over sel.
func (d *ServiceDecisions) Uses(sel EndpointSelection) bool {
	for _, row := range d.table {
		for _, dec := range row {
			if dec.Verdict == VerdictDeliver && dec.Endpoints == sel {
				return true
			}
		}
	}
	return false
}

// Endpoints returns the endpoint list of sel.
func (s *ServiceState) Endpoints(sel EndpointSelection) []*Endpoint {
	switch sel {
	case SelectCluster:
		return s.ClusterEndpoints
	case SelectLocal:
		return s.LocalEndpoints
	}
	return nil
}

// NewServiceState chooses this node's endpoints for sp
// (CategorizeEndpoints) and decides what the node does with its traffic.
func NewServiceState(sp *ServicePort, endpoints []*Endpoint, topo TopologyInfo, opts DecisionOptions) *ServiceState {
	cluster, local, all, hasAny := CategorizeEndpoints(endpoints, sp, topo)
	st := &ServiceState{ServicePort: sp, ClusterEndpoints: cluster, LocalEndpoints: local, AllEndpoints: all, HasAnyEndpoints: hasAny}
	st.Decisions = Decide(st, opts)
	return st
}

// Decide computes the decisions of a service port whose endpoints have been
// categorized. It follows kube-proxy v1.37:
//
//   - No usable endpoint at all: every destination rejects.
//   - ClusterIP: the internal policy's endpoints (the local ones with
//     internalTrafficPolicy Local, which drops when there are none here).
//     Masqueraded with --masquerade-all, or when the source is outside the
//     cluster CIDR (the node itself, other hosts).
//   - External destinations with the Cluster policy: the cluster endpoints,
//     always masqueraded.
//   - External destinations with externalTrafficPolicy Local: the local
//     endpoints with the client's address kept, dropped when there are none
//     here; pods and the node itself short-circuit to the cluster endpoints
//     (the node masqueraded, since its source would be a local address).
//   - LoadBalancer IPs with loadBalancerSourceRanges: other sources are
//     dropped first, whatever their class.
func Decide(st *ServiceState, opts DecisionOptions) ServiceDecisions {
	var d ServiceDecisions
	sp := st.ServicePort
	if sp.SessionAffinityClientIP {
		d.AffinitySeconds = sp.StickyMaxAgeSeconds
	}
	for _, ep := range st.AllEndpoints {
		if ep.IsLocal || ep.NodeName == "" {
			d.Hairpin = append(d.Hairpin, ep)
		}
	}
	podsKnown := opts.ClusterCIDR.IsValid()
	set := func(kind DestinationKind, class SourceClass, dec Decision) {
		d.table[kind][class] = dec
	}
	setAll := func(kind DestinationKind, dec Decision) {
		for _, c := range SourceClasses {
			set(kind, c, dec)
		}
	}
	kinds := []DestinationKind{DestClusterIP}
	if sp.NodePort != 0 {
		kinds = append(kinds, DestNodePort)
	}
	if len(sp.ExternalIPs) > 0 {
		kinds = append(kinds, DestExternalIP)
	}
	if len(sp.LoadBalancerVIPs) > 0 {
		kinds = append(kinds, DestLoadBalancerIP)
	}
	if !st.HasAnyEndpoints {
		for _, k := range kinds {
			setAll(k, Decision{Verdict: VerdictReject})
		}
		return d
	}

	// deliver is a delivery over sel, or the verdict for an empty list: a
	// drop when a Local policy leaves nothing here, else a reject.
	deliver := func(sel EndpointSelection, masq bool) Decision {
		if len(st.Endpoints(sel)) > 0 {
			return Decision{Verdict: VerdictDeliver, Endpoints: sel, Masquerade: masq}
		}
		if sel == SelectLocal {
			return Decision{Verdict: VerdictDrop}
		}
		return Decision{Verdict: VerdictReject}
	}

	// ClusterIP.
	internal := SelectCluster
	if sp.InternalPolicyLocal {
		internal = SelectLocal
		d.NoLocalEndpointsInternal = len(st.LocalEndpoints) == 0
	}
	masq := ClusterIPMasquerade(opts)
	for _, c := range SourceClasses {
		set(DestClusterIP, c, deliver(internal, masq[c]))
	}

	// External destinations.
	for _, k := range kinds[1:] {
		if !sp.ExternalPolicyLocal {
			setAll(k, deliver(SelectCluster, true))
			continue
		}
		d.NoLocalEndpointsExternal = len(st.LocalEndpoints) == 0
		other := deliver(SelectLocal, false)
		set(k, SourceOther, other)
		set(k, SourcePod, other)
		set(k, SourceNode, other)
		if len(st.ClusterEndpoints) > 0 {
			short := Decision{Verdict: VerdictDeliver, Endpoints: SelectCluster, ShortCircuit: true}
			if podsKnown {
				set(k, SourcePod, short)
			}
			short.Masquerade = true
			set(k, SourceNode, short)
		}
	}

	if len(sp.LoadBalancerVIPs) > 0 && len(sp.LoadBalancerSourceRanges) > 0 {
		f := &SourceFilter{Allowed: sp.LoadBalancerSourceRanges}
		for _, p := range sp.LoadBalancerSourceRanges {
			if opts.NodeIP.IsValid() && p.Contains(opts.NodeIP) {
				f.AllowVIPSource = true
			}
		}
		d.Firewall = f
	}
	return d
}
