package proxiertest

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// The property test's universe. This node is node-a (10.0.0.1, sometimes
// 10.0.1.1 too); nodes node-a..node-d host pods in 10.244.1.0/24 ..
// 10.244.4.0/24. Service slot i has ClusterIPs 10.96.<i+1>.x, ports
// 1000*(i+1)+k, node ports 30000+100*i+k and health check node port
// 32000+i. ExternalIPs (203.0.113.1-3) and load balancer IPs
// (203.0.113.10-12) are shared between slots, at the slots' own ports, so
// that slots do not compete for an (address, protocol, port), except now
// and then: a port may be sharedPort in any slot, and two services with
// the same ExternalIP or load balancer IP then claim one destination (the
// API server allows it). Filler services (10.97.0.0/16, endpoints
// 10.244.5.0/24 on node-b) push the dispatch chains past their flat size.
// Only fakes see these addresses.
const (
	propertySlots = 8
	fillerStep    = 35
	fillerMax     = 70
	deniedClient  = "198.51.100.200"
	topoKeyLabel  = "zone1"
	sharedPort    = 9000
)

var (
	propertyNodes = []string{"node-a", "node-b", "node-c", "node-d"}
	externalPool  = []string{"203.0.113.1", "203.0.113.2", "203.0.113.3"}
	ingressPool   = []string{"203.0.113.10", "203.0.113.11", "203.0.113.12"}
	rangeChoices  = [][]string{nil, nil, {"192.0.2.0/24"}, {"198.51.100.0/25", "10.0.0.0/24"}, {"192.0.2.10/32", "198.51.100.128/25"}}
	topoChoices   = []string{"", "", `["zone1"]`, `["zone1","*"]`, `["topology.kubernetes.io/zone"]`, `zone1`}
	distChoices   = []string{"", "", v1.ServiceTrafficDistributionPreferClose, v1.ServiceTrafficDistributionPreferSameZone, v1.ServiceTrafficDistributionPreferSameNode}
	protocols     = []v1.Protocol{v1.ProtocolTCP, v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP}
	portNames     = []string{"p", "q", "r"}
)

// GenerateScenario builds the property test's scenario for a seed: the
// environment and steps batches of object changes. The same seed always
// gives the same scenario.
func GenerateScenario(seed uint64, steps int) Scenario {
	g := &generator{
		r:       rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		w:       newWorld(),
		clusIPs: make([]int, propertySlots),
	}
	sc := Scenario{Name: fmt.Sprintf("seed=%d", seed), Env: g.env()}
	for step := 0; step < steps; step++ {
		var batch []Change
		if step == 0 {
			batch = g.initial()
		} else {
			batch = g.batch()
		}
		sc.Batches = append(sc.Batches, batch)
	}
	return sc
}

// generator makes random, API-valid changes to its own copy of the
// objects.
type generator struct {
	r       *rand.Rand
	w       *world
	clusIPs []int  // per slot: how many ClusterIPs it has had
	filler  [2]int // filler services with and without endpoints
	pending []Change
}

func (g *generator) env() Env {
	e := Env{NodeName: "node-a", NodeIPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")},
		ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), Family: v1.IPv4Protocol}
	if g.r.IntN(4) == 0 {
		e.NodeIPs = append(e.NodeIPs, netip.MustParseAddr("10.0.1.1"))
	}
	if g.r.IntN(8) == 0 {
		e.MasqueradeAll = true
	}
	if g.r.IntN(6) == 0 {
		npa, err := proxy.NewNodePortAddresses(v1.IPv4Protocol, []string{"10.0.0.0/24"}, e.NodeIPs[0])
		if err != nil {
			panic(fmt.Sprintf("a constant --nodeport-addresses value: %v", err))
		}
		e.NodePortAddresses = npa
	}
	return e
}

func (g *generator) chance(n int) bool { return g.r.IntN(n) == 0 }

func pick[T any](g *generator, s []T) T { return s[g.r.IntN(len(s))] }

// emit records a change in the batch under construction and in the model.
func (g *generator) emit(c Change) {
	g.w.apply(c, nil)
	g.pending = append(g.pending, c)
}

func (g *generator) take() []Change {
	out := g.pending
	g.pending = nil
	return out
}

func (g *generator) initial() []Change {
	for _, n := range propertyNodes {
		g.emit(Change{Node: g.node(n)})
	}
	for i := 0; i < propertySlots; i++ {
		if g.chance(3) {
			continue
		}
		g.emit(Change{Service: g.newService(i)})
		g.regenSlices(i)
	}
	return g.take()
}

func (g *generator) batch() []Change {
	n := 1 + g.r.IntN(4)
	if g.chance(10) {
		n = 5 + g.r.IntN(6)
	}
	for k := 0; k < n; k++ {
		switch x := g.r.IntN(100); {
		case x < 42:
			g.serviceOp(g.r.IntN(propertySlots))
		case x < 86:
			g.sliceOp(g.r.IntN(propertySlots))
		case x < 97:
			g.nodeOp()
		default:
			g.fillerOp()
		}
	}
	return g.take()
}

// Nodes.

func (g *generator) node(name string) *v1.Node {
	labels := map[string]string{}
	if z := pick(g, []string{"zone-a", "zone-a", "zone-b", ""}); z != "" {
		labels[zoneLabel] = z
	}
	if k := pick(g, []string{"g1", "g1", "g2", ""}); k != "" {
		labels[topoKeyLabel] = k
	}
	return Node(name, labels)
}

func (g *generator) nodeOp() {
	name := pick(g, propertyNodes)
	_, present := g.w.nodes[name]
	switch {
	case !present:
		g.emit(Change{Node: g.node(name)})
	case g.chance(6) && (name != "node-a" || g.chance(3)):
		g.emit(Change{Node: g.w.nodes[name], Delete: true})
	default:
		g.emit(Change{Node: g.node(name)})
	}
}

// Services.

func slotName(i int) string { return fmt.Sprintf("svc-%d", i) }

func (g *generator) service(i int) *v1.Service { return g.w.services[Namespace+"/"+slotName(i)] }

// newService makes a fresh service for slot i, with a new ClusterIP.
func (g *generator) newService(i int) *v1.Service {
	g.clusIPs[i]++
	cip := fmt.Sprintf("10.96.%d.%d", i+1, g.clusIPs[i]%250+1)
	s := Service(slotName(i), cip)
	switch x := g.r.IntN(40); {
	case x == 0:
		s.Spec.Type = v1.ServiceTypeExternalName
		s.Spec.ExternalName = "example.test"
		s.Spec.ClusterIP, s.Spec.ClusterIPs = "", nil
	case x == 1:
		s.Spec.ClusterIP, s.Spec.ClusterIPs = v1.ClusterIPNone, []string{v1.ClusterIPNone}
	case x == 2:
		// Dual-stack: the IPv4 engine uses the IPv4 ClusterIP.
		s.Spec.ClusterIPs = append(s.Spec.ClusterIPs, fmt.Sprintf("fd00:96::%x:%x", i+1, g.clusIPs[i]))
		s.Spec.IPFamilies = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
	}
	s.Spec.Ports = nil
	for n := 1 + g.r.IntN(3); len(s.Spec.Ports) < n; {
		g.addPort(i, s)
	}
	switch x := g.r.IntN(20); {
	case x < 8:
	case x < 13:
		g.setType(i, s, v1.ServiceTypeNodePort)
	default:
		g.setType(i, s, v1.ServiceTypeLoadBalancer)
	}
	for _, mutate := range serviceMutations {
		if g.chance(4) {
			mutate(g, i, s)
		}
	}
	return s
}

// addPort adds a port with a name, protocol and number no other port of s
// has.
func (g *generator) addPort(i int, s *v1.Service) {
	if len(s.Spec.Ports) >= len(portNames) {
		return
	}
	var name string
	for {
		name = pick(g, portNames)
		if !slices.ContainsFunc(s.Spec.Ports, func(p v1.ServicePort) bool { return p.Name == name }) {
			break
		}
	}
	p := v1.ServicePort{Name: name, Protocol: pick(g, protocols)}
	p.Port = g.freePort(i, s, p.Protocol)
	s.Spec.Ports = append(s.Spec.Ports, p)
	if s.Spec.Type == v1.ServiceTypeNodePort || s.Spec.Type == v1.ServiceTypeLoadBalancer && allocatesNodePorts(s) {
		last := &s.Spec.Ports[len(s.Spec.Ports)-1]
		last.NodePort = g.freeNodePort(i, s, last.Protocol)
	}
	fixPortNames(s)
}

// fixPortNames leaves a single port unnamed now and then, and names every
// port of a multi-port service, as the API requires.
func fixPortNames(s *v1.Service) {
	if len(s.Spec.Ports) == 1 {
		return
	}
	for k := range s.Spec.Ports {
		if s.Spec.Ports[k].Name == "" {
			for _, n := range portNames {
				if !slices.ContainsFunc(s.Spec.Ports, func(p v1.ServicePort) bool { return p.Name == n }) {
					s.Spec.Ports[k].Name = n
					break
				}
			}
		}
	}
}

func (g *generator) freePort(i int, s *v1.Service, proto v1.Protocol) int32 {
	for {
		port := int32(1000*(i+1) + g.r.IntN(6))
		if g.chance(15) {
			port = sharedPort
		}
		if !slices.ContainsFunc(s.Spec.Ports, func(p v1.ServicePort) bool { return p.Port == port && p.Protocol == proto }) {
			return port
		}
	}
}

func (g *generator) freeNodePort(i int, s *v1.Service, proto v1.Protocol) int32 {
	for {
		np := int32(30000 + 100*i + g.r.IntN(12))
		if !slices.ContainsFunc(s.Spec.Ports, func(p v1.ServicePort) bool { return p.NodePort == np && p.Protocol == proto }) {
			return np
		}
	}
}

func allocatesNodePorts(s *v1.Service) bool {
	return s.Spec.AllocateLoadBalancerNodePorts == nil || *s.Spec.AllocateLoadBalancerNodePorts
}

// setType changes s's type as the API server would: node ports allocated
// or released, load balancer status and health check port cleared when
// no longer a load balancer.
func (g *generator) setType(i int, s *v1.Service, t v1.ServiceType) {
	s.Spec.Type = t
	s.Spec.AllocateLoadBalancerNodePorts = nil
	if t == v1.ServiceTypeLoadBalancer && g.chance(6) {
		s.Spec.AllocateLoadBalancerNodePorts = ptr.To(false)
	}
	wantNodePorts := t == v1.ServiceTypeNodePort || t == v1.ServiceTypeLoadBalancer && allocatesNodePorts(s)
	for k := range s.Spec.Ports {
		switch {
		case !wantNodePorts:
			s.Spec.Ports[k].NodePort = 0
		case s.Spec.Ports[k].NodePort == 0:
			s.Spec.Ports[k].NodePort = g.freeNodePort(i, s, s.Spec.Ports[k].Protocol)
		}
	}
	if t != v1.ServiceTypeLoadBalancer {
		s.Status.LoadBalancer.Ingress = nil
	} else if len(s.Status.LoadBalancer.Ingress) == 0 {
		g.setIngress(s)
	}
	g.fixHealthCheck(i, s)
}

// fixHealthCheck gives a LoadBalancer with externalTrafficPolicy Local its
// health check node port and takes it from every other service.
func (g *generator) fixHealthCheck(i int, s *v1.Service) {
	s.Spec.HealthCheckNodePort = 0
	if s.Spec.Type == v1.ServiceTypeLoadBalancer && s.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal {
		s.Spec.HealthCheckNodePort = int32(32000 + i)
	}
}

func (g *generator) setIngress(s *v1.Service) {
	s.Status.LoadBalancer.Ingress = nil
	n := g.r.IntN(3)
	for _, k := range g.r.Perm(len(ingressPool))[:n] {
		in := v1.LoadBalancerIngress{IP: ingressPool[k]}
		if g.chance(4) {
			in.IPMode = ptr.To(v1.LoadBalancerIPModeProxy)
		} else if g.chance(3) {
			in.IPMode = ptr.To(v1.LoadBalancerIPModeVIP)
		}
		s.Status.LoadBalancer.Ingress = append(s.Status.LoadBalancer.Ingress, in)
	}
	if g.chance(10) {
		s.Status.LoadBalancer.Ingress = append(s.Status.LoadBalancer.Ingress, v1.LoadBalancerIngress{Hostname: "lb.example.test"})
	}
}

// serviceMutations each change one aspect of a service (a copy of the
// model's).
var serviceMutations = []func(g *generator, i int, s *v1.Service){
	// type
	func(g *generator, i int, s *v1.Service) {
		g.setType(i, s, pick(g, []v1.ServiceType{v1.ServiceTypeClusterIP, v1.ServiceTypeNodePort, v1.ServiceTypeLoadBalancer}))
	},
	// add or remove a port
	func(g *generator, i int, s *v1.Service) {
		if len(s.Spec.Ports) > 1 && g.chance(2) {
			k := g.r.IntN(len(s.Spec.Ports))
			s.Spec.Ports = slices.Delete(s.Spec.Ports, k, k+1)
			return
		}
		g.addPort(i, s)
	},
	// port number, protocol or node port of one port
	func(g *generator, i int, s *v1.Service) {
		k := g.r.IntN(len(s.Spec.Ports))
		p := &s.Spec.Ports[k]
		switch g.r.IntN(3) {
		case 0:
			p.Port = g.freePort(i, s, p.Protocol)
		case 1:
			proto := pick(g, protocols)
			port := g.freePort(i, s, proto)
			p.Protocol, p.Port = proto, port
			if p.NodePort != 0 {
				p.NodePort = 0
				p.NodePort = g.freeNodePort(i, s, proto)
			}
		default:
			if p.NodePort != 0 {
				p.NodePort = g.freeNodePort(i, s, p.Protocol)
			}
		}
	},
	// externalTrafficPolicy
	func(g *generator, i int, s *v1.Service) {
		s.Spec.ExternalTrafficPolicy = pick(g, []v1.ServiceExternalTrafficPolicy{"", v1.ServiceExternalTrafficPolicyCluster, v1.ServiceExternalTrafficPolicyLocal})
		g.fixHealthCheck(i, s)
	},
	// internalTrafficPolicy
	func(g *generator, i int, s *v1.Service) {
		s.Spec.InternalTrafficPolicy = pick(g, []*v1.ServiceInternalTrafficPolicy{nil,
			ptr.To(v1.ServiceInternalTrafficPolicyCluster), ptr.To(v1.ServiceInternalTrafficPolicyLocal)})
	},
	// session affinity
	func(g *generator, i int, s *v1.Service) {
		s.Spec.SessionAffinity, s.Spec.SessionAffinityConfig = v1.ServiceAffinityNone, nil
		switch g.r.IntN(3) {
		case 0:
			s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		case 1:
			s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
			s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(int32(10 + g.r.IntN(3)*50))}}
		}
	},
	// externalIPs
	func(g *generator, i int, s *v1.Service) {
		s.Spec.ExternalIPs = nil
		for _, k := range g.r.Perm(len(externalPool))[:g.r.IntN(3)] {
			s.Spec.ExternalIPs = append(s.Spec.ExternalIPs, externalPool[k])
		}
		if g.chance(12) {
			s.Spec.ExternalIPs = append(s.Spec.ExternalIPs, "2001:db8::7") // other family: ignored
		}
	},
	// load balancer status
	func(g *generator, i int, s *v1.Service) {
		if s.Spec.Type == v1.ServiceTypeLoadBalancer {
			g.setIngress(s)
		}
	},
	// loadBalancerSourceRanges (the field, sometimes the annotation)
	func(g *generator, i int, s *v1.Service) {
		r := pick(g, rangeChoices)
		s.Spec.LoadBalancerSourceRanges = nil
		delete(s.Annotations, v1.AnnotationLoadBalancerSourceRangesKey)
		if len(r) > 0 && g.chance(5) {
			annotate(s, v1.AnnotationLoadBalancerSourceRangesKey, r[0])
			return
		}
		s.Spec.LoadBalancerSourceRanges = r
	},
	// topologyKeys annotation (sometimes malformed)
	func(g *generator, i int, s *v1.Service) {
		delete(s.Annotations, proxy.AnnotationTopologyKeys)
		if v := pick(g, topoChoices); v != "" {
			annotate(s, proxy.AnnotationTopologyKeys, v)
		}
	},
	// trafficDistribution
	func(g *generator, i int, s *v1.Service) {
		s.Spec.TrafficDistribution = nil
		if v := pick(g, distChoices); v != "" {
			s.Spec.TrafficDistribution = ptr.To(v)
		}
	},
}

func annotate(s *v1.Service, k, v string) {
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	s.Annotations[k] = v
}

func (g *generator) serviceOp(i int) {
	old := g.service(i)
	switch {
	case old == nil:
		g.emit(Change{Service: g.newService(i)})
		if g.chance(2) {
			g.regenSlices(i)
		}
	case g.chance(12):
		g.emit(Change{Service: old, Delete: true})
		if g.chance(3) {
			g.deleteSlices(i)
		}
	case g.chance(12):
		// Deleted and created again (new ClusterIP) before the next sync.
		g.emit(Change{Service: old, Delete: true})
		g.emit(Change{Service: g.newService(i)})
	case old.Spec.Type == v1.ServiceTypeExternalName || old.Spec.ClusterIP == v1.ClusterIPNone:
		g.emit(Change{Service: old, Delete: true})
	default:
		s := old.DeepCopy()
		for n := 1 + g.r.IntN(2); n > 0; n-- {
			pick(g, serviceMutations)(g, i, s)
		}
		g.emit(Change{Service: s})
	}
}

// Endpoint slices. Slot i has slices svc-i-a and svc-i-b (a service's
// endpoints split in two) and, rarely, an IPv6 slice the engine ignores.

func sliceName(i int, part string) string { return fmt.Sprintf("%s-%s", slotName(i), part) }

func (g *generator) slice(i int, part string) *discovery.EndpointSlice {
	return g.w.slices[Namespace+"/"+sliceName(i, part)]
}

// slicePorts follows the service's current ports (target ports 8000-8002),
// or, now and then, names ports the service does not have.
func (g *generator) slicePorts(i int) []discovery.EndpointPort {
	var out []discovery.EndpointPort
	s := g.service(i)
	if s == nil || g.chance(10) {
		for _, n := range portNames[:1+g.r.IntN(2)] {
			out = append(out, discovery.EndpointPort{Name: ptr.To(n), Port: ptr.To(int32(8000 + g.r.IntN(3))), Protocol: ptr.To(pick(g, protocols))})
		}
		return out
	}
	for _, p := range s.Spec.Ports {
		out = append(out, discovery.EndpointPort{Name: ptr.To(p.Name), Port: ptr.To(int32(8000 + g.r.IntN(3))), Protocol: ptr.To(p.Protocol)})
	}
	return out
}

// endpoint makes a random endpoint of slot i on a random node.
func (g *generator) endpoint(i int) discovery.Endpoint {
	n := g.r.IntN(len(propertyNodes))
	ep := discovery.Endpoint{Addresses: []string{fmt.Sprintf("10.244.%d.%d", n+1, 10*i+1+g.r.IntN(8))}}
	switch x := g.r.IntN(30); {
	case x == 0:
		// no node name
	case x == 1:
		ep.NodeName = ptr.To("node-x") // a node nobody knows
	default:
		ep.NodeName = ptr.To(propertyNodes[n])
		if node, ok := g.w.nodes[propertyNodes[n]]; ok && node.Labels[zoneLabel] != "" {
			ep.Zone = ptr.To(node.Labels[zoneLabel])
		}
	}
	g.setConditions(&ep)
	return ep
}

// setConditions: ready; serving and terminating; terminating and not
// serving; not ready.
func (g *generator) setConditions(ep *discovery.Endpoint) {
	ready, serving, terminating := true, true, false
	switch x := g.r.IntN(10); {
	case x < 6:
	case x < 8:
		ready, terminating = false, true
	case x < 9:
		ready, serving, terminating = false, false, true
	default:
		ready, serving = false, false
	}
	ep.Conditions = discovery.EndpointConditions{Ready: ptr.To(ready), Serving: ptr.To(serving), Terminating: ptr.To(terminating)}
}

// setHints gives every endpoint of sl zone hints (its own zone), node
// hints, hints on some endpoints only, or none.
func (g *generator) setHints(sl *discovery.EndpointSlice) {
	mode := g.r.IntN(5)
	for k := range sl.Endpoints {
		ep := &sl.Endpoints[k]
		ep.Hints = nil
		switch {
		case mode == 1 || mode == 3 && g.chance(2):
			zone := pick(g, []string{"zone-a", "zone-b"})
			if ep.Zone != nil {
				zone = *ep.Zone
			}
			ep.Hints = &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zone}}}
		case mode == 2 && ep.NodeName != nil:
			ep.Hints = &discovery.EndpointHints{ForNodes: []discovery.ForNode{{Name: *ep.NodeName}}}
			if ep.Zone != nil {
				ep.Hints.ForZones = []discovery.ForZone{{Name: *ep.Zone}}
			}
		}
	}
}

func (g *generator) newSlice(i int, part string, eps []discovery.Endpoint) *discovery.EndpointSlice {
	sl := SliceWithPorts(slotName(i), g.slicePorts(i))
	sl.Name = sliceName(i, part)
	sl.Endpoints = dedupEndpoints(eps)
	g.setHints(sl)
	return sl
}

func dedupEndpoints(eps []discovery.Endpoint) []discovery.Endpoint {
	seen := map[string]bool{}
	var out []discovery.Endpoint
	for _, ep := range eps {
		if !seen[ep.Addresses[0]] {
			seen[ep.Addresses[0]] = true
			out = append(out, ep)
		}
	}
	return out
}

func (g *generator) randomEndpoints(i, n int) []discovery.Endpoint {
	var eps []discovery.Endpoint
	for k := 0; k < n; k++ {
		eps = append(eps, g.endpoint(i))
	}
	return eps
}

// regenSlices replaces slot i's slices with new ones (one or two).
func (g *generator) regenSlices(i int) {
	eps := g.randomEndpoints(i, g.r.IntN(5))
	if len(eps) > 1 && g.chance(3) {
		cut := 1 + g.r.IntN(len(eps)-1)
		g.emit(Change{Slice: g.newSlice(i, "a", eps[:cut])})
		g.emit(Change{Slice: g.newSlice(i, "b", eps[cut:])})
		return
	}
	g.emit(Change{Slice: g.newSlice(i, "a", eps)})
	if old := g.slice(i, "b"); old != nil {
		g.emit(Change{Slice: old, Delete: true})
	}
}

func (g *generator) deleteSlices(i int) {
	for _, part := range []string{"a", "b", "v6"} {
		if old := g.slice(i, part); old != nil {
			g.emit(Change{Slice: old, Delete: true})
		}
	}
}

func (g *generator) sliceOp(i int) {
	a, b := g.slice(i, "a"), g.slice(i, "b")
	if a == nil && b == nil {
		g.regenSlices(i)
		return
	}
	parts := []*discovery.EndpointSlice{}
	for _, sl := range []*discovery.EndpointSlice{a, b} {
		if sl != nil {
			parts = append(parts, sl)
		}
	}
	sl := pick(g, parts).DeepCopy()
	switch x := g.r.IntN(100); {
	case x < 25:
		// One endpoint changes condition (ready, terminating...).
		if len(sl.Endpoints) == 0 {
			sl.Endpoints = append(sl.Endpoints, g.endpoint(i))
		} else {
			g.setConditions(&sl.Endpoints[g.r.IntN(len(sl.Endpoints))])
		}
	case x < 42:
		sl.Endpoints = dedupEndpoints(append(sl.Endpoints, g.endpoint(i)))
	case x < 55:
		if len(sl.Endpoints) > 0 {
			k := g.r.IntN(len(sl.Endpoints))
			sl.Endpoints = slices.Delete(sl.Endpoints, k, k+1)
		}
	case x < 63:
		// Target ports (and port names) follow the service again.
		sl.Ports = g.slicePorts(i)
	case x < 70:
		g.setHints(sl)
	case x < 78:
		// Split: some endpoints move to the other slice.
		if a != nil && len(a.Endpoints) > 1 {
			na := a.DeepCopy()
			cut := 1 + g.r.IntN(len(na.Endpoints)-1)
			moved := na.Endpoints[cut:]
			na.Endpoints = na.Endpoints[:cut]
			nb := g.newSlice(i, "b", nil)
			if b != nil {
				nb = b.DeepCopy()
			}
			nb.Endpoints = dedupEndpoints(append(nb.Endpoints, moved...))
			if g.chance(4) {
				// An endpoint listed in both slices for a while.
				na.Endpoints = append(na.Endpoints, moved[0])
			}
			g.emit(Change{Slice: nb})
			g.emit(Change{Slice: na})
			return
		}
		g.regenSlices(i)
		return
	case x < 84:
		// Merge: slice b goes, its endpoints join slice a.
		if a != nil && b != nil {
			na := a.DeepCopy()
			na.Endpoints = dedupEndpoints(append(na.Endpoints, b.Endpoints...))
			g.emit(Change{Slice: na})
			g.emit(Change{Slice: b, Delete: true})
			return
		}
		g.regenSlices(i)
		return
	case x < 90:
		g.emit(Change{Slice: pick(g, parts), Delete: true})
		return
	case x < 93:
		// An IPv6 slice: ignored by the IPv4 engine.
		if old := g.slice(i, "v6"); old != nil {
			g.emit(Change{Slice: old, Delete: true})
			return
		}
		v6 := SliceWithPorts(slotName(i), g.slicePorts(i), EP{IP: fmt.Sprintf("fd00:244::%x", 10*i+1), Node: "node-a"})
		v6.Name = sliceName(i, "v6")
		g.emit(Change{Slice: v6})
		return
	default:
		g.regenSlices(i)
		return
	}
	g.emit(Change{Slice: sl})
}

// fillerOp adds or removes a block of plain services, so that the
// dispatch chains cross their flat size: services with an endpoint fill
// the nat table's dispatch, services without one (rejected) the filter
// table's.
func (g *generator) fillerOp() {
	group := g.r.IntN(2)
	prefix := [2]string{"fill", "fill-empty"}[group]
	have := g.filler[group]
	target := have + fillerStep
	if target > fillerMax || have > 0 && g.chance(2) {
		target = have - fillerStep
	}
	for k := have; k < target; k++ {
		name := fmt.Sprintf("%s-%03d", prefix, k)
		g.emit(Change{Service: Service(name, fmt.Sprintf("10.97.%d.%d", group, k+1), Ports(v1.ServicePort{Name: "p", Port: 80, Protocol: v1.ProtocolTCP}))})
		if group == 0 {
			g.emit(Change{Slice: Slice(name, 8080, EP{IP: fmt.Sprintf("10.244.5.%d", k+1), Node: "node-b"})})
		}
	}
	for k := have - 1; k >= target; k-- {
		name := fmt.Sprintf("%s-%03d", prefix, k)
		g.emit(Change{Service: g.w.services[Namespace+"/"+name], Delete: true})
		if group == 0 {
			g.emit(Change{Slice: g.w.slices[Namespace+"/"+name+"-IPv4"], Delete: true})
		}
	}
	g.filler[group] = target
}

// Flows.

// flowKey identifies a flow regardless of its name.
type flowKey struct {
	proto  v1.Protocol
	source string
	dest   string
	port   int
	origin Origin
}

// flowsOf lists flows to every destination the objects of w define: each
// ClusterIP, node port, ExternalIP and load balancer IP port, from a pod on
// this node, the node itself, a client outside (inside and outside the
// load balancer source ranges) and, for ClusterIPs, an endpoint on this
// node (hairpin).
func flowsOf(w *world, env Env) []Flow {
	const pod = "10.244.1.250"
	nodeIP := env.NodeIPs[0].String()
	var out []Flow
	add := func(name string, proto v1.Protocol, src, dst string, port int, origin Origin) {
		out = append(out, Flow{Name: name, Protocol: proto, Source: src, Dest: dst, Port: port, Origin: origin})
	}
	for _, s := range w.sortedServices() {
		cip := ""
		for _, ip := range s.Spec.ClusterIPs {
			if a, err := netip.ParseAddr(ip); err == nil && a.Is4() {
				cip = ip
			}
		}
		if s.Spec.Type == v1.ServiceTypeExternalName || cip == "" {
			continue
		}
		hairpin := ""
		for _, sl := range w.slicesOf(s.Name) {
			if sl.AddressType != discovery.AddressTypeIPv4 {
				continue
			}
			for _, ep := range sl.Endpoints {
				if ep.NodeName != nil && *ep.NodeName == env.NodeName && hairpin == "" {
					hairpin = ep.Addresses[0]
				}
			}
		}
		for _, p := range s.Spec.Ports {
			name := fmt.Sprintf("%s:%s/%s", s.Name, p.Name, p.Protocol)
			port := int(p.Port)
			add(name+" pod to clusterIP", p.Protocol, pod, cip, port, FromNetwork)
			add(name+" node to clusterIP", p.Protocol, nodeIP, cip, port, FromHost)
			add(name+" outside to clusterIP", p.Protocol, extClient, cip, port, FromNetwork)
			if hairpin != "" {
				add(name+" hairpin", p.Protocol, hairpin, cip, port, FromNetwork)
			}
			if p.NodePort != 0 {
				for _, ip := range env.NodeIPs {
					add(name+" outside to node port", p.Protocol, extClient, ip.String(), int(p.NodePort), FromNetwork)
				}
				add(name+" pod to node port", p.Protocol, pod, nodeIP, int(p.NodePort), FromNetwork)
				add(name+" node to node port", p.Protocol, nodeIP, nodeIP, int(p.NodePort), FromHost)
				add(name+" localhost node port", p.Protocol, "127.0.0.1", "127.0.0.1", int(p.NodePort), FromHost)
			}
			for _, ip := range s.Spec.ExternalIPs {
				if a, err := netip.ParseAddr(ip); err == nil && a.Is4() {
					add(name+" outside to external IP", p.Protocol, extClient, ip, port, FromNetwork)
					add(name+" pod to external IP", p.Protocol, pod, ip, port, FromNetwork)
				}
			}
			for _, in := range s.Status.LoadBalancer.Ingress {
				if in.IP == "" {
					continue
				}
				add(name+" outside to LB", p.Protocol, extClient, in.IP, port, FromNetwork)
				add(name+" denied outside to LB", p.Protocol, deniedClient, in.IP, port, FromNetwork)
				add(name+" pod to LB", p.Protocol, pod, in.IP, port, FromNetwork)
				add(name+" node to LB", p.Protocol, nodeIP, in.IP, port, FromHost)
			}
		}
	}
	return out
}

// Object descriptions, for failure reports.

// Describe is a one-line summary of a change.
func (c Change) String() string {
	verb := "set"
	if c.Delete {
		verb = "delete"
	}
	switch {
	case c.Service != nil:
		if c.Delete {
			return fmt.Sprintf("delete service %s", c.Service.Name)
		}
		return fmt.Sprintf("set service %s", describeService(c.Service))
	case c.Slice != nil:
		if c.Delete {
			return fmt.Sprintf("delete slice %s", c.Slice.Name)
		}
		return fmt.Sprintf("set slice %s", describeSlice(c.Slice))
	case c.Node != nil:
		if c.Delete {
			return fmt.Sprintf("delete node %s", c.Node.Name)
		}
		return fmt.Sprintf("%s node %s labels=%v", verb, c.Node.Name, c.Node.Labels)
	}
	return "empty change"
}

func describeService(s *v1.Service) string {
	out := fmt.Sprintf("%s %s clusterIPs=%v", s.Name, s.Spec.Type, s.Spec.ClusterIPs)
	for _, p := range s.Spec.Ports {
		out += fmt.Sprintf(" port[%s %s %d", p.Name, p.Protocol, p.Port)
		if p.NodePort != 0 {
			out += fmt.Sprintf(" np=%d", p.NodePort)
		}
		out += "]"
	}
	if len(s.Spec.ExternalIPs) > 0 {
		out += fmt.Sprintf(" externalIPs=%v", s.Spec.ExternalIPs)
	}
	for _, in := range s.Status.LoadBalancer.Ingress {
		mode := ""
		if in.IPMode != nil {
			mode = "/" + string(*in.IPMode)
		}
		out += fmt.Sprintf(" ingress=%s%s%s", in.IP, in.Hostname, mode)
	}
	if s.Spec.ExternalTrafficPolicy != "" {
		out += " eTP=" + string(s.Spec.ExternalTrafficPolicy)
	}
	if s.Spec.InternalTrafficPolicy != nil {
		out += " iTP=" + string(*s.Spec.InternalTrafficPolicy)
	}
	if s.Spec.HealthCheckNodePort != 0 {
		out += fmt.Sprintf(" hcnp=%d", s.Spec.HealthCheckNodePort)
	}
	if s.Spec.AllocateLoadBalancerNodePorts != nil {
		out += fmt.Sprintf(" allocateNodePorts=%v", *s.Spec.AllocateLoadBalancerNodePorts)
	}
	if s.Spec.SessionAffinity == v1.ServiceAffinityClientIP {
		out += " affinity=ClientIP"
		if c := s.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
			out += fmt.Sprintf("/%ds", *c.ClientIP.TimeoutSeconds)
		}
	}
	if len(s.Spec.LoadBalancerSourceRanges) > 0 {
		out += fmt.Sprintf(" sourceRanges=%v", s.Spec.LoadBalancerSourceRanges)
	}
	if s.Spec.TrafficDistribution != nil {
		out += " trafficDistribution=" + *s.Spec.TrafficDistribution
	}
	keys := make([]string, 0, len(s.Annotations))
	for k := range s.Annotations {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		out += fmt.Sprintf(" annotation[%s=%s]", k, s.Annotations[k])
	}
	return out
}

func describeSlice(sl *discovery.EndpointSlice) string {
	out := fmt.Sprintf("%s (%s of %s) ports=[", sl.Name, sl.AddressType, sl.Labels[discovery.LabelServiceName])
	for k, p := range sl.Ports {
		if k > 0 {
			out += " "
		}
		out += fmt.Sprintf("%s/%s:%d", ptr.Deref(p.Name, ""), ptr.Deref(p.Protocol, ""), ptr.Deref(p.Port, 0))
	}
	out += "] endpoints=["
	for k, ep := range sl.Endpoints {
		if k > 0 {
			out += " "
		}
		c := ep.Conditions
		out += fmt.Sprintf("%s@%s", ep.Addresses[0], ptr.Deref(ep.NodeName, "-"))
		switch {
		case ptr.Deref(c.Ready, true):
		case ptr.Deref(c.Serving, false) && ptr.Deref(c.Terminating, false):
			out += "(serving,terminating)"
		case ptr.Deref(c.Terminating, false):
			out += "(terminating)"
		default:
			out += "(not-ready)"
		}
		if ep.Zone != nil {
			out += "/" + *ep.Zone
		}
		if h := ep.Hints; h != nil {
			out += fmt.Sprintf("{hints zones=%v nodes=%v}", h.ForZones, h.ForNodes)
		}
	}
	return out + "]"
}

// world is a set of objects by kind and "namespace/name".
type world struct {
	services map[string]*v1.Service
	slices   map[string]*discovery.EndpointSlice
	nodes    map[string]*v1.Node
}

func newWorld() *world {
	return &world{services: map[string]*v1.Service{}, slices: map[string]*discovery.EndpointSlice{}, nodes: map[string]*v1.Node{}}
}

func key(m metav1.Object) string { return m.GetNamespace() + "/" + m.GetName() }

// eventHandler is the part of the engine a change is delivered to.
type eventHandler interface {
	OnServiceAdd(*v1.Service)
	OnServiceUpdate(old, svc *v1.Service)
	OnServiceDelete(*v1.Service)
	OnEndpointSliceAdd(*discovery.EndpointSlice)
	OnEndpointSliceUpdate(old, slice *discovery.EndpointSlice)
	OnEndpointSliceDelete(*discovery.EndpointSlice)
	OnNodeAdd(*v1.Node)
	OnNodeUpdate(old, node *v1.Node)
	OnNodeDelete(*v1.Node)
}

// apply records c in w and, when h is not nil, delivers it to h as an
// informer would: an add for a new object, an update with the previous
// object, a delete with the last known object (none for an unknown one).
func (w *world) apply(c Change, h eventHandler) {
	switch {
	case c.Service != nil:
		k := key(c.Service)
		old := w.services[k]
		switch {
		case c.Delete && old == nil:
		case c.Delete:
			delete(w.services, k)
			if h != nil {
				h.OnServiceDelete(old)
			}
		case old == nil:
			w.services[k] = c.Service
			if h != nil {
				h.OnServiceAdd(c.Service)
			}
		default:
			w.services[k] = c.Service
			if h != nil {
				h.OnServiceUpdate(old, c.Service)
			}
		}
	case c.Slice != nil:
		k := key(c.Slice)
		old := w.slices[k]
		switch {
		case c.Delete && old == nil:
		case c.Delete:
			delete(w.slices, k)
			if h != nil {
				h.OnEndpointSliceDelete(old)
			}
		case old == nil:
			w.slices[k] = c.Slice
			if h != nil {
				h.OnEndpointSliceAdd(c.Slice)
			}
		default:
			w.slices[k] = c.Slice
			if h != nil {
				h.OnEndpointSliceUpdate(old, c.Slice)
			}
		}
	case c.Node != nil:
		k := c.Node.Name
		old := w.nodes[k]
		switch {
		case c.Delete && old == nil:
		case c.Delete:
			delete(w.nodes, k)
			if h != nil {
				h.OnNodeDelete(old)
			}
		case old == nil:
			w.nodes[k] = c.Node
			if h != nil {
				h.OnNodeAdd(c.Node)
			}
		default:
			w.nodes[k] = c.Node
			if h != nil {
				h.OnNodeUpdate(old, c.Node)
			}
		}
	}
}

func (w *world) sortedServices() []*v1.Service {
	out := make([]*v1.Service, 0, len(w.services))
	for _, s := range w.services {
		out = append(out, s)
	}
	sort.Slice(out, func(i, j int) bool { return key(out[i]) < key(out[j]) })
	return out
}

func (w *world) slicesOf(service string) []*discovery.EndpointSlice {
	var out []*discovery.EndpointSlice
	for _, sl := range w.slices {
		if sl.Labels[discovery.LabelServiceName] == service {
			out = append(out, sl)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// feed delivers every object of w to h as adds: nodes, services, slices,
// each in name order.
func (w *world) feed(h eventHandler) {
	names := make([]string, 0, len(w.nodes))
	for n := range w.nodes {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		h.OnNodeAdd(w.nodes[n])
	}
	for _, s := range w.sortedServices() {
		h.OnServiceAdd(s)
	}
	names = names[:0]
	for k := range w.slices {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		h.OnEndpointSliceAdd(w.slices[k])
	}
}
