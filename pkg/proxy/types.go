// Package proxy holds kproxy's backend-free model of what a node must do with
// service traffic: service ports, endpoints, change trackers, endpoint
// categorization (traffic policy, topology) and the per-node desired state
// that every backend consumes.
package proxy

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strconv"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
)

// ServicePortName names one port of one Service, as upstream kube-proxy does.
type ServicePortName struct {
	types.NamespacedName
	Port     string
	Protocol v1.Protocol
}

// String renders "namespace/name:port" (":port" omitted for unnamed ports).
func (n ServicePortName) String() string {
	if n.Port == "" {
		return n.NamespacedName.String()
	}
	return n.NamespacedName.String() + ":" + n.Port
}

// Compare orders service port names by namespace, name, port name and
// protocol: -1, 0 or +1.
func (n ServicePortName) Compare(o ServicePortName) int {
	return cmp.Or(cmp.Compare(n.Namespace, o.Namespace), cmp.Compare(n.Name, o.Name),
		cmp.Compare(n.Port, o.Port), cmp.Compare(n.Protocol, o.Protocol))
}

// SortedServicePortNames returns the keys of m in Compare order.
func SortedServicePortNames[V any](m map[ServicePortName]V) []ServicePortName {
	names := make([]ServicePortName, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	slices.SortFunc(names, ServicePortName.Compare)
	return names
}

// ServicePort is everything the dataplane needs to know about one port of one
// Service, for one IP family.
type ServicePort struct {
	Name      ServicePortName
	ClusterIP netip.Addr
	Port      int
	Protocol  v1.Protocol
	// NodePort is 0 when the port has none.
	NodePort                 int
	ExternalIPs              []netip.Addr
	LoadBalancerVIPs         []netip.Addr // ingress IPs, excluding ipMode: Proxy
	LoadBalancerSourceRanges []netip.Prefix
	// SessionAffinityClientIP with StickyMaxAgeSeconds (default 10800).
	SessionAffinityClientIP bool
	StickyMaxAgeSeconds     int
	// ExternalPolicyLocal is externalTrafficPolicy=Local on an externally
	// accessible service.
	ExternalPolicyLocal bool
	// InternalPolicyLocal is internalTrafficPolicy=Local.
	InternalPolicyLocal bool
	HealthCheckNodePort int
	// TrafficDistribution is spec.trafficDistribution ("" when unset).
	TrafficDistribution string
	// TopologyKeys from the "topologyKeys" annotation (docs/design.md, "Topology keys"); nil when
	// absent or malformed.
	TopologyKeys []string
	// TopologyKeysError is set when the annotation was present but malformed;
	// the service is then treated as having no topology keys.
	TopologyKeysError error
}

// String is the service port name.
func (s *ServicePort) String() string { return s.Name.String() }

// ExternallyAccessible reports whether the port takes traffic from outside
// the cluster: a NodePort, ExternalIPs or LoadBalancer VIPs.
func (s *ServicePort) ExternallyAccessible() bool {
	return s.NodePort != 0 || len(s.ExternalIPs) > 0 || len(s.LoadBalancerVIPs) > 0
}

// UsesClusterEndpoints reports whether the port needs the cluster-wide
// endpoint set: for ClusterIP traffic under the Cluster policy, and for any
// externally accessible port (even with externalTrafficPolicy Local, traffic
// from pods and from the node itself to an external destination is
// short-circuited to the cluster endpoints, as upstream does).
func (s *ServicePort) UsesClusterEndpoints() bool {
	return !s.InternalPolicyLocal || s.ExternallyAccessible()
}

// UsesLocalEndpoints reports whether some traffic to this port is routed to
// node-local endpoints only.
func (s *ServicePort) UsesLocalEndpoints() bool {
	return s.InternalPolicyLocal || (s.ExternalPolicyLocal && s.ExternallyAccessible())
}

// Endpoint is one backend of a service port, as seen in an EndpointSlice.
type Endpoint struct {
	IP          netip.Addr
	Port        int
	Ready       bool
	Serving     bool
	Terminating bool
	NodeName    string
	Zone        string
	// ZoneHints and NodeHints are the EndpointSlice topology hints; nil when
	// the endpoint has none.
	ZoneHints sets.Set[string]
	NodeHints sets.Set[string]
	// IsLocal is true when NodeName is the node kproxy runs on.
	IsLocal bool
}

// String renders "ip:port" ("[ip]:port" for IPv6).
func (e *Endpoint) String() string {
	return netip.AddrPortFrom(e.IP, uint16(e.Port)).String()
}

// AddrString is the endpoint as iptables' DNAT target wants it.
func (e *Endpoint) AddrString() string {
	if e.IP.Is6() {
		return "[" + e.IP.String() + "]:" + strconv.Itoa(e.Port)
	}
	return e.IP.String() + ":" + strconv.Itoa(e.Port)
}

// ServicePortMap is the set of service ports of one IP family.
type ServicePortMap map[ServicePortName]*ServicePort

// EndpointsMap is every service port's endpoints, of one IP family.
type EndpointsMap map[ServicePortName][]*Endpoint

// ServiceState is one service port with the endpoints this node must use,
// after CategorizeEndpoints.
type ServiceState struct {
	*ServicePort
	// ClusterEndpoints serve traffic subject to the cluster policy; nil when
	// the service has no cluster-policy traffic or no usable endpoint.
	ClusterEndpoints []*Endpoint
	// LocalEndpoints serve traffic subject to a Local policy.
	LocalEndpoints []*Endpoint
	// AllEndpoints is the union of the two (each endpoint once).
	AllEndpoints []*Endpoint
	// HasAnyEndpoints is false only when the service has no usable endpoint
	// at all (REJECT); it may be true with both lists empty (policy DROP).
	HasAnyEndpoints bool
	// Decisions is what the node does with each kind of destination from
	// each class of source (decision.go): what every backend renders.
	Decisions ServiceDecisions
}

// NodeState is the desired dataplane state of this node for one IP family:
// what every backend consumes.
type NodeState struct {
	Family   v1.IPFamily
	NodeName string
	// Options are the node-wide settings the decisions were made with; a
	// backend renders SourcePod as "source in Options.ClusterCIDR".
	Options  DecisionOptions
	Services map[ServicePortName]*ServiceState
	// Changed names the services (by namespace/name) whose ports or
	// endpoints may differ from the previous sync, including deleted ones.
	// A backend doing a partial sync rewrites only these. Ignored on a full
	// sync.
	Changed sets.Set[types.NamespacedName]
}

// IsIPv6 reports whether this state is for the IPv6 family.
func (n *NodeState) IsIPv6() bool { return n.Family == v1.IPv6Protocol }

// Validate reports an error for a state a backend must not render.
func (n *NodeState) Validate() error {
	if n.Family != v1.IPv4Protocol && n.Family != v1.IPv6Protocol {
		return fmt.Errorf("node state has unknown IP family %q", n.Family)
	}
	return nil
}
