package explain

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Sources that stand for "anyone else": documentation addresses, never a
// pod's or a node's.
var (
	otherSourceV4 = netip.MustParseAddr("203.0.113.7")
	otherSourceV6 = netip.MustParseAddr("2001:db8::7")
)

// familyExplainer explains the ports of one IP family.
type familyExplainer struct {
	o      Options
	in     *input
	state  *proxy.NodeState
	nodeIP netip.Addr
	x      *Explanation
}

func (f *familyExplainer) explain() error {
	fam := f.state.Family
	names := proxy.SortedServicePortNames(f.state.Services)
	topo := f.topology()
	var npa *proxy.NodePortAddresses
	if f.o.NodePortAddresses != nil {
		var err error
		if npa, err = f.o.NodePortAddresses(fam, f.nodeIP); err != nil {
			return err
		}
	}
	for _, name := range names {
		st := f.state.Services[name]
		if name.NamespacedName != f.o.Service || !portMatches(name.Port, st.Port, f.o.Port) {
			continue
		}
		raw := f.in.endpoints[fam][name]
		p := f.port(st, raw, topo)
		for _, k := range st.TopologyKeys {
			if v, ok := topo.NodeLabels[k]; ok {
				f.x.NodeLabels[k] = v
			}
		}
		f.flows(p, st, raw, npa)
		f.x.Ports = append(f.x.Ports, p)
	}
	return nil
}

// topology is the node labels the engine decided with.
func (f *familyExplainer) topology() proxy.TopologyInfo {
	nl := proxy.NewNodeLabels(proxy.NodeLabelsOptions{NodeName: f.o.NodeName})
	nl.Set(f.in.node)
	for _, n := range f.in.others {
		nl.Set(n)
	}
	return nl.TopologyInfo()
}

// port describes a service port and its endpoint lists.
func (f *familyExplainer) port(st *proxy.ServiceState, raw []*proxy.Endpoint, topo proxy.TopologyInfo) *Port {
	sp := st.ServicePort
	p := &Port{
		Name: sp.Name.String(), Family: string(f.state.Family), Protocol: string(sp.Protocol), Port: sp.Port,
		ClusterIP: sp.ClusterIP.String(), NodePort: sp.NodePort,
		InternalTrafficPolicy: "Cluster", TrafficDistribution: sp.TrafficDistribution,
		TopologyKeys: sp.TopologyKeys, AffinitySeconds: st.Decisions.AffinitySeconds,
	}
	if sp.InternalPolicyLocal {
		p.InternalTrafficPolicy = "Local"
	}
	if sp.ExternallyAccessible() {
		p.ExternalTrafficPolicy = "Cluster"
		if sp.ExternalPolicyLocal {
			p.ExternalTrafficPolicy = "Local"
		}
	}
	for _, a := range sp.ExternalIPs {
		p.ExternalIPs = append(p.ExternalIPs, a.String())
	}
	for _, a := range sp.LoadBalancerVIPs {
		p.LoadBalancerIPs = append(p.LoadBalancerIPs, a.String())
	}
	for _, r := range sp.LoadBalancerSourceRanges {
		p.LoadBalancerSourceRanges = append(p.LoadBalancerSourceRanges, r.String())
	}
	inCluster := sets.New[string]()
	inLocal := sets.New[string]()
	for _, ep := range st.ClusterEndpoints {
		inCluster.Insert(ep.String())
	}
	for _, ep := range st.LocalEndpoints {
		inLocal.Insert(ep.String())
	}
	for _, ep := range raw {
		p.Endpoints = append(p.Endpoints, Endpoint{
			Address: ep.String(), Node: ep.NodeName, Zone: ep.Zone, State: endpointState(ep), Local: ep.IsLocal,
			ZoneHints: sets.List(ep.ZoneHints), NodeHints: sets.List(ep.NodeHints),
			InCluster: inCluster.Has(ep.String()), InLocal: inLocal.Has(ep.String()),
		})
	}
	d := &st.Decisions
	if d.Uses(proxy.SelectCluster) || (!sp.InternalPolicyLocal && len(raw) > 0) {
		p.Cluster = &Selection{Endpoints: addrs(st.ClusterEndpoints), Why: clusterWhy(proxy.ExplainClusterEndpoints(raw, sp, topo), sp, st, topo)}
	}
	if sp.UsesLocalEndpoints() {
		p.Local = &Selection{Endpoints: addrs(st.LocalEndpoints), Why: localWhy(st)}
	}
	return p
}

func endpointState(ep *proxy.Endpoint) string {
	switch {
	case ep.Ready:
		return "ready"
	case ep.Serving && ep.Terminating:
		return "serving-terminating"
	case ep.Terminating:
		return "terminating"
	}
	return "not-ready"
}

func addrs(eps []*proxy.Endpoint) []string {
	out := []string{}
	for _, ep := range eps {
		out = append(out, ep.String())
	}
	return out
}

// clusterWhy says how the Cluster-policy endpoints were chosen.
func clusterWhy(c proxy.ClusterEndpointsChoice, sp *proxy.ServicePort, st *proxy.ServiceState, topo proxy.TopologyInfo) string {
	var why []string
	ready := "the ready endpoints"
	if c.TerminatingFallback {
		ready = "the serving, terminating endpoints (no endpoint is ready: fallback)"
	}
	switch {
	case len(sp.TopologyKeys) > 0 && c.TopologyKey == proxy.TopologyKeyAny:
		why = append(why, fmt.Sprintf("topologyKeys %s: no key before \"*\" selects an endpoint, \"*\" selects all of %s", keysList(sp.TopologyKeys), ready))
	case len(sp.TopologyKeys) > 0 && c.TopologyKey != "":
		why = append(why, fmt.Sprintf("topologyKeys %s: key %s selects %s on nodes with %s=%s, this node's value", keysList(sp.TopologyKeys), c.TopologyKey, ready, c.TopologyKey, c.TopologyValue))
	case len(sp.TopologyKeys) > 0:
		var vals []string
		for _, k := range sp.TopologyKeys {
			if v, ok := topo.NodeLabels[k]; ok {
				vals = append(vals, k+"="+v)
			} else if k != proxy.TopologyKeyAny {
				vals = append(vals, k+" unset")
			}
		}
		why = append(why, fmt.Sprintf("topologyKeys %s: no key selects an endpoint for this node (%s)", keysList(sp.TopologyKeys), strings.Join(vals, ", ")))
	case c.Hints == "PreferSameZone":
		why = append(why, fmt.Sprintf("topology hints: %s hinted for this node's zone %s", ready, c.Zone))
	case c.Hints == "PreferSameNode":
		why = append(why, fmt.Sprintf("topology hints: %s hinted for this node", ready))
	case len(st.ClusterEndpoints) == 0:
		why = append(why, "none: no endpoint is ready or serving")
	default:
		why = append(why, "every one of "+ready)
	}
	if c.Hints != "" && sp.TrafficDistribution != "" {
		why = append(why, "hints set by the EndpointSlice controller for trafficDistribution "+sp.TrafficDistribution)
	} else if c.Hints == "" && sp.TrafficDistribution != "" && len(sp.TopologyKeys) == 0 {
		why = append(why, "trafficDistribution "+sp.TrafficDistribution+" has no effect here: kproxy follows the hints, and not every ready endpoint has one for this node or zone")
	}
	if c.HintsIgnored != "" {
		why = append(why, "hints ignored: "+c.HintsIgnored)
	}
	return strings.Join(why, "; ")
}

func keysList(keys []string) string { return "[" + strings.Join(keys, ",") + "]" }

// localWhy says how the Local-policy endpoints were chosen.
func localWhy(st *proxy.ServiceState) string {
	switch {
	case len(st.LocalEndpoints) == 0:
		return "none: this node has no ready or serving endpoint"
	case !st.LocalEndpoints[0].Ready:
		return "the serving, terminating endpoints on this node (none here is ready: fallback)"
	}
	return "the ready endpoints on this node"
}

// flows lists the flows of each destination kind and source class the
// port has.
func (f *familyExplainer) flows(p *Port, st *proxy.ServiceState, raw []*proxy.Endpoint, npa *proxy.NodePortAddresses) {
	sp := st.ServicePort
	fam := f.state.Family
	d := &st.Decisions
	opts := f.state.Options
	sources := map[proxy.SourceClass]netip.Addr{}
	if opts.ClusterCIDR.IsValid() {
		sources[proxy.SourcePod] = podSource(f.podCIDR(opts.ClusterCIDR), raw, f.nodeIP)
	} else {
		f.note(fmt.Sprintf("%s: the cluster CIDR is unknown (--cluster-cidr): kproxy cannot tell pods from other sources, a pod's connections get the decisions shown for \"other\"", fam))
	}
	if f.nodeIP.IsValid() {
		sources[proxy.SourceNode] = f.nodeIP
	} else {
		f.note(fmt.Sprintf("%s: this node's primary IP is unknown: connections from the node itself are not shown", fam))
	}
	sources[proxy.SourceOther] = otherSourceV4
	if fam == v1.IPv6Protocol {
		sources[proxy.SourceOther] = otherSourceV6
	}

	for _, kind := range proxy.DestinationKinds {
		if !d.Has(kind) {
			continue
		}
		var dests []netip.Addr
		switch kind {
		case proxy.DestClusterIP:
			dests = []netip.Addr{sp.ClusterIP}
		case proxy.DestNodePort:
			if a := f.nodePortAddress(npa); a.IsValid() {
				dests = []netip.Addr{a}
			} else {
				f.note(fmt.Sprintf("%s: no address of this node serves node ports (--nodeport-addresses %s): NodePort flows are not shown", fam, npa.String()))
			}
		case proxy.DestExternalIP:
			dests = sp.ExternalIPs
		case proxy.DestLoadBalancerIP:
			dests = sp.LoadBalancerVIPs
		}
		port := sp.Port
		if kind == proxy.DestNodePort {
			port = sp.NodePort
		}
		for _, dst := range dests {
			for _, class := range proxy.SourceClasses {
				src, ok := sources[class]
				if !ok {
					continue
				}
				p.Flows = append(p.Flows, f.flow(st, raw, kind, class, src, dst, port))
			}
			if kind == proxy.DestLoadBalancerIP && d.Firewall != nil && !d.Firewall.Allows(sources[proxy.SourceOther], dst) {
				// Also a client the ranges let in.
				if src, ok := inside(d.Firewall.Allowed, opts.ClusterCIDR, fam); ok {
					p.Flows = append(p.Flows, f.flow(st, raw, kind, proxy.SourceOther, src, dst, port))
				}
			}
		}
	}
}

func (f *familyExplainer) note(n string) {
	if !slices.Contains(f.x.Notes, n) {
		f.x.Notes = append(f.x.Notes, n)
	}
}

// nodePortAddress is the node address a NodePort flow goes to: the primary
// IP when it serves node ports, else the first local address that does.
func (f *familyExplainer) nodePortAddress(npa *proxy.NodePortAddresses) netip.Addr {
	if f.nodeIP.IsValid() && npa.Accepts(f.nodeIP) {
		return f.nodeIP
	}
	if f.o.LocalAddresses == nil {
		return netip.Addr{}
	}
	local, err := f.o.LocalAddresses()
	if err != nil {
		return netip.Addr{}
	}
	for _, a := range npa.Select(local) {
		if familyOf(a) == f.state.Family {
			return a
		}
	}
	return netip.Addr{}
}

// podCIDR is this node's pod CIDR of the family when the cluster CIDR
// holds it (a pod here), else the cluster CIDR.
func (f *familyExplainer) podCIDR(cluster netip.Prefix) netip.Prefix {
	cidrs := f.in.node.Spec.PodCIDRs
	if len(cidrs) == 0 && f.in.node.Spec.PodCIDR != "" {
		cidrs = []string{f.in.node.Spec.PodCIDR}
	}
	for _, c := range cidrs {
		p, err := netip.ParsePrefix(c)
		if err == nil && cluster.Contains(p.Addr()) && p.Bits() >= cluster.Bits() {
			return p.Masked()
		}
	}
	return cluster
}

// podSource is an address of the pod CIDR that is no endpoint (a pod
// reaching itself through the service is a hairpin, masqueraded) and not
// the node's; the CIDR's first address is skipped (often the node's
// bridge).
func podSource(cidr netip.Prefix, eps []*proxy.Endpoint, nodeIP netip.Addr) netip.Addr {
	a := cidr.Masked().Addr().Next().Next()
	for range 1024 {
		if !cidr.Contains(a.Next()) {
			break
		}
		taken := a == nodeIP || slices.ContainsFunc(eps, func(ep *proxy.Endpoint) bool { return ep.IP == a })
		if !taken {
			return a
		}
		a = a.Next()
	}
	return a
}

// inside is an address of the first range of family that is outside the
// cluster CIDR: a client outside the cluster that the ranges admit.
func inside(ranges []netip.Prefix, cidr netip.Prefix, fam v1.IPFamily) (netip.Addr, bool) {
	for _, r := range ranges {
		if familyOf(r.Addr()) != fam {
			continue
		}
		a := r.Masked().Addr()
		if r.Bits() < a.BitLen() {
			a = a.Next()
		}
		if !cidr.IsValid() || !cidr.Contains(a) {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// flow is the model's decision for one flow, with its reason.
func (f *familyExplainer) flow(st *proxy.ServiceState, raw []*proxy.Endpoint, kind proxy.DestinationKind, class proxy.SourceClass, src, dst netip.Addr, port int) *Flow {
	sp := st.ServicePort
	d := &st.Decisions
	dec := d.For(kind, class)
	fl := &Flow{
		Destination: kind.String(), Address: dst.String(), Port: port, Protocol: strings.ToLower(string(sp.Protocol)),
		Source: class.String(), SourceAddress: src.String(), family: f.state.Family,
	}
	svc := sp.Name.NamespacedName.String()
	if kind == proxy.DestLoadBalancerIP && d.Firewall != nil && !d.Firewall.Allows(src, dst) {
		fl.Verdict = Dropped
		fl.Reason = fmt.Sprintf("dropped: source %s is outside loadBalancerSourceRanges of %s", src, sp.Name)
		return fl
	}
	switch dec.Verdict {
	case proxy.VerdictDeliver:
		eps := st.Endpoints(dec.Endpoints)
		fl.Verdict = Delivered
		fl.Endpoints = addrs(eps)
		fl.Masquerade = dec.Masquerade
		fl.AffinitySeconds = d.AffinitySeconds
		var which string
		switch {
		case dec.ShortCircuit && class == proxy.SourceNode:
			which = fmt.Sprintf("the %d cluster endpoint(s) (externalTrafficPolicy is Local, but the node itself reaching this address is sent to any endpoint, as if it went out to the load balancer and came back)", len(eps))
		case dec.ShortCircuit:
			which = fmt.Sprintf("the %d cluster endpoint(s) (externalTrafficPolicy is Local, but a pod here reaching this address is sent to any endpoint, as if it went out to the load balancer and came back)", len(eps))
		case dec.Endpoints == proxy.SelectLocal && kind == proxy.DestClusterIP:
			which = fmt.Sprintf("the %d endpoint(s) on this node (internalTrafficPolicy is Local)", len(eps))
		case dec.Endpoints == proxy.SelectLocal:
			which = fmt.Sprintf("the %d endpoint(s) on this node (externalTrafficPolicy is Local, the client's address is kept)", len(eps))
		default:
			which = fmt.Sprintf("the %d cluster endpoint(s)", len(eps))
		}
		masq := fmt.Sprintf("not masqueraded (the endpoint sees %s)", src)
		if dec.Masquerade {
			masq = "masqueraded (the endpoint sees the node as the client)"
			switch {
			case kind == proxy.DestClusterIP && f.state.Options.MasqueradeAll:
				masq += ": --masquerade-all"
			case kind == proxy.DestClusterIP:
				masq += ": the source is outside the cluster CIDR"
			case class == proxy.SourceNode && dec.ShortCircuit:
				masq += ": the node's own source address would not route back"
			default:
				masq += ": externalTrafficPolicy is Cluster"
			}
		}
		fl.Reason = fmt.Sprintf("delivered: %s to one of %s, %s", sp.Name, which, masq)
		if d.AffinitySeconds > 0 {
			fl.Reason += fmt.Sprintf("; ClientIP affinity keeps %s on its endpoint for %ds", src, d.AffinitySeconds)
		}
	case proxy.VerdictDrop:
		fl.Verdict = Dropped
		policy := "externalTrafficPolicy"
		if kind == proxy.DestClusterIP {
			policy = "internalTrafficPolicy"
		}
		fl.Reason = fmt.Sprintf("dropped: %s is Local and this node has no ready or serving endpoint of %s", policy, svc)
	case proxy.VerdictReject:
		fl.Verdict = Rejected
		fl.Reason = rejectReason(sp, raw)
	default:
		fl.Verdict = "none"
		fl.Reason = "kproxy programs nothing for this destination"
	}
	return fl
}

// rejectReason says why a port rejects.
func rejectReason(sp *proxy.ServicePort, raw []*proxy.Endpoint) string {
	usable := 0
	for _, ep := range raw {
		if ep.Ready || (ep.Serving && ep.Terminating) {
			usable++
		}
	}
	switch {
	case len(raw) == 0:
		return fmt.Sprintf("rejected: %s has no endpoints", sp.Name)
	case usable == 0:
		return fmt.Sprintf("rejected: %s has no endpoints ready or serving (%d endpoint(s), none usable)", sp.Name, len(raw))
	case len(sp.TopologyKeys) > 0:
		return fmt.Sprintf("rejected: no endpoint of %s matches its topologyKeys %s from this node", sp.Name, keysList(sp.TopologyKeys))
	}
	return fmt.Sprintf("rejected: no endpoint of %s is usable from this node", sp.Name)
}
