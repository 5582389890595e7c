package iptables

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// renderedService is everything one service port contributes to the
// ruleset. Rule bodies are the text after "-A CHAIN".
type renderedService struct {
	// natChains are the port's own chains (SVC, SVL, EXT, FW) in nat.
	natChains map[string][]string
	// natServices go into the nat dispatch tree keyed on destination;
	// natNodePorts into the nat node-port tree.
	natServices  []dispatchRule
	natNodePorts []dispatchRule
	// filterServices reject or drop ClusterIP traffic without endpoints;
	// filterExternal the same for ExternalIPs and LoadBalancer VIPs.
	filterServices []dispatchRule
	filterExternal []dispatchRule
	// filterExtNodePorts reject or drop node-port traffic without endpoints.
	filterExtNodePorts []string
	// filterFirewall drops LoadBalancer traffic not accepted by the FW chain.
	filterFirewall []string
	// filterHealthCheck accepts the health-check node port.
	filterHealthCheck []string
	// hairpin lists endpoints that may reach themselves through the service
	// (local, or of unknown node): such traffic is masqueraded.
	hairpin []netip.Addr
}

// comment is the shared comment match.
var comment = ipt.Comment

// renderer turns ServiceStates into rules for one family. It only draws
// the decisions of the model (proxy.ServiceDecisions): which chain a
// destination jumps to, which source classes get their own rules, which
// verdict the filter table gives what was not DNATed.
type renderer struct {
	ipv6 bool
	// clusterCIDR renders proxy.SourcePod ("-s clusterCIDR"); invalid when
	// unknown, and then the model never tells pods apart.
	clusterCIDR netip.Prefix
}

func protoMatch(p string) string { return "-p " + p + " -m " + p }

func hostAddr(ip netip.Addr) string {
	if ip.Is6() {
		return ip.String() + "/128"
	}
	return ip.String() + "/32"
}

// classMatch is the match of one source class, given the classes tested
// before it: a pod is a source in the cluster CIDR, the node a locally
// generated packet from outside it, anything else the rest.
func (r *renderer) classMatch(c proxy.SourceClass) string {
	switch c {
	case proxy.SourcePod:
		return "-s " + r.clusterCIDR.String()
	case proxy.SourceNode:
		return "-m addrtype --src-type LOCAL"
	}
	return ""
}

// filterVerdict is the filter table's verdict for connections to one
// destination that the nat table did not DNAT: the non-delivering verdict
// of its decisions (Other's first), or "" when every class is delivered.
func filterVerdict(d *proxy.ServiceDecisions, kind proxy.DestinationKind) (target, why string) {
	for _, c := range []proxy.SourceClass{proxy.SourceOther, proxy.SourceNode, proxy.SourcePod} {
		switch d.For(kind, c).Verdict {
		case proxy.VerdictDrop:
			return "DROP", " has no local endpoints"
		case proxy.VerdictReject:
			return "REJECT", " has no endpoints"
		}
	}
	return "", ""
}

// delivers reports whether some source class is delivered to kind.
func delivers(d *proxy.ServiceDecisions, kind proxy.DestinationKind) bool {
	for _, c := range proxy.SourceClasses {
		if d.For(kind, c).Verdict == proxy.VerdictDeliver {
			return true
		}
	}
	return false
}

func (r *renderer) render(st *proxy.ServiceState) *renderedService {
	out := &renderedService{natChains: map[string][]string{}}
	d := &st.Decisions
	name := st.Name
	nameStr := name.String()
	proto := strings.ToLower(string(st.Protocol))
	pm := protoMatch(proto)
	port := strconv.Itoa(st.Port)

	policyChain := map[proxy.EndpointSelection]string{
		proxy.SelectCluster: servicePortChain(kindCluster, name),
		proxy.SelectLocal:   servicePortChain(kindLocal, name),
	}
	extChain := servicePortChain(kindExternal, name)
	fwChain := servicePortChain(kindFirewall, name)

	// The external kinds share one decision row (and so one EXT chain):
	// the first one the port has.
	extKind, hasExt := proxy.DestinationKind(0), false
	for _, k := range proxy.DestinationKinds[1:] {
		if d.Has(k) {
			extKind, hasExt = k, true
			break
		}
	}
	usesExtChain := hasExt && delivers(d, extKind)
	usesFWChain := usesExtChain && d.Firewall != nil && d.Has(proxy.DestLoadBalancerIP)
	lbChain := extChain
	if usesFWChain {
		lbChain = fwChain
	}

	// ClusterIP: every class goes to the same policy chain (only
	// masquerading differs by class, inside that chain).
	cip := d.For(proxy.DestClusterIP, proxy.SourceOther)
	cipMatch := comment(nameStr+" cluster IP") + " " + pm + " -d " + hostAddr(st.ClusterIP) + " --dport " + port
	if cip.Verdict == proxy.VerdictDeliver {
		out.natServices = append(out.natServices, dispatchRule{addrBucket(st.ClusterIP), cipMatch + " -j " + policyChain[cip.Endpoints]})
	}
	if target, why := filterVerdict(d, proxy.DestClusterIP); target != "" {
		out.filterServices = append(out.filterServices, dispatchRule{addrBucket(st.ClusterIP),
			comment(nameStr+why) + " " + pm + " -d " + hostAddr(st.ClusterIP) + " --dport " + port + " -j " + target})
	}

	// ExternalIPs and LoadBalancer IPs.
	extTarget, extWhy := "", ""
	if hasExt {
		extTarget, extWhy = filterVerdict(d, extKind)
	}
	for _, a := range []struct {
		kind  proxy.DestinationKind
		ips   []netip.Addr
		what  string
		chain string
	}{
		{proxy.DestExternalIP, st.ExternalIPs, " external IP", extChain},
		{proxy.DestLoadBalancerIP, st.LoadBalancerVIPs, " loadbalancer IP", lbChain},
	} {
		for _, ip := range a.ips {
			m := pm + " -d " + hostAddr(ip) + " --dport " + port
			if usesExtChain {
				out.natServices = append(out.natServices, dispatchRule{addrBucket(ip), comment(nameStr+a.what) + " " + m + " -j " + a.chain})
			}
			if a.kind == proxy.DestLoadBalancerIP && usesFWChain {
				out.filterFirewall = append(out.filterFirewall, comment(nameStr+" traffic not accepted by "+fwChain)+" "+m+" -j DROP")
			}
			if extTarget != "" {
				out.filterExternal = append(out.filterExternal, dispatchRule{addrBucket(ip), comment(nameStr+extWhy) + " " + m + " -j " + extTarget})
			}
		}
	}

	// NodePort.
	if d.Has(proxy.DestNodePort) {
		np := strconv.Itoa(st.NodePort)
		if usesExtChain {
			out.natNodePorts = append(out.natNodePorts, dispatchRule{portBucket(st.Protocol, st.NodePort),
				comment(nameStr) + " " + pm + " --dport " + np + " -j " + extChain})
		}
		if extTarget != "" {
			out.filterExtNodePorts = append(out.filterExtNodePorts,
				comment(nameStr+extWhy)+" -m addrtype --dst-type LOCAL "+pm+" --dport "+np+" -j "+extTarget)
		}
	}
	if st.HealthCheckNodePort != 0 {
		out.filterHealthCheck = append(out.filterHealthCheck,
			comment(nameStr+" health check node port")+" -m tcp -p tcp --dport "+strconv.Itoa(st.HealthCheckNodePort)+" -j ACCEPT")
	}

	// Policy chains, each with its endpoints; the ClusterIP's masquerade
	// rules go first in the chain the ClusterIP jumps to.
	for _, sel := range []proxy.EndpointSelection{proxy.SelectCluster, proxy.SelectLocal} {
		if !d.Uses(sel) {
			continue
		}
		var rules []string
		if cip.Verdict == proxy.VerdictDeliver && cip.Endpoints == sel {
			rules = r.clusterIPMasquerade(d, cipMatch)
		}
		out.natChains[policyChain[sel]] = append(rules, r.endpointRules(st, st.Endpoints(sel))...)
	}

	// External destinations: the classes that differ from everyone else's
	// decision get their own rules (pods, then the node), then the rest.
	if usesExtChain {
		var ext []string
		other := d.For(extKind, proxy.SourceOther)
		for _, c := range proxy.SourceClasses {
			dec := d.For(extKind, c)
			if c != proxy.SourceOther && dec == other {
				continue
			}
			match, what := r.classMatch(c), c.String()+" traffic for "+nameStr+" external destinations"
			if match != "" {
				match += " "
			}
			if dec.Masquerade {
				ext = append(ext, comment("masquerade "+what)+" "+match+"-j "+chainMarkMasq)
			}
			if dec.Verdict == proxy.VerdictDeliver {
				ext = append(ext, comment(what)+" "+match+"-j "+policyChain[dec.Endpoints])
			}
		}
		out.natChains[extChain] = ext
	}

	// loadBalancerSourceRanges.
	if usesFWChain {
		c := comment(nameStr + " loadbalancer IP")
		var fw []string
		for _, cidr := range d.Firewall.Allowed {
			fw = append(fw, c+" -s "+cidr.String()+" -j "+extChain)
		}
		if d.Firewall.AllowVIPSource {
			for _, ip := range st.LoadBalancerVIPs {
				fw = append(fw, c+" -s "+hostAddr(ip)+" -j "+extChain)
			}
		}
		fw = append(fw, comment("other traffic to "+nameStr+" will be dropped by "+chainFirewall))
		out.natChains[fwChain] = fw
	}

	for _, ep := range d.Hairpin {
		out.hairpin = append(out.hairpin, ep.IP)
	}
	return out
}

// clusterIPMasquerade renders the masquerade decisions of the ClusterIP's
// source classes as few rules as possible: none, one for everyone, one for
// everything outside the cluster CIDR, or one per class.
func (r *renderer) clusterIPMasquerade(d *proxy.ServiceDecisions, cipMatch string) []string {
	pod := d.For(proxy.DestClusterIP, proxy.SourcePod).Masquerade
	node := d.For(proxy.DestClusterIP, proxy.SourceNode).Masquerade
	other := d.For(proxy.DestClusterIP, proxy.SourceOther).Masquerade
	switch {
	case pod && node && other:
		return []string{cipMatch + " -j " + chainMarkMasq}
	case !pod && !node && !other:
		return nil
	case !pod && node && other:
		return []string{cipMatch + " ! -s " + r.clusterCIDR.String() + " -j " + chainMarkMasq}
	}
	var rules []string
	if pod {
		rules = append(rules, cipMatch+" -s "+r.clusterCIDR.String()+" -j "+chainMarkMasq)
	}
	if node {
		rules = append(rules, cipMatch+" ! -s "+r.clusterCIDR.String()+" -m addrtype --src-type LOCAL -j "+chainMarkMasq)
	}
	if other {
		rules = append(rules, cipMatch+" ! -s "+r.clusterCIDR.String()+" -m addrtype ! --src-type LOCAL -j "+chainMarkMasq)
	}
	return rules
}

// endpointRules renders a policy chain's endpoints: session affinity, then
// random balancing with DNAT inline.
//
// Upstream kube-proxy gives every endpoint its own chain (KUBE-SEP-*). kproxy
// does not: the hairpin mark moves to POSTROUTING (see renderedService.hairpin)
// and "-m recent --set" combines with DNAT in one rule, so a service port
// costs one chain, not one per endpoint. iptables-nft's restore time grows
// with the square of the chains in a batch, so this is what keeps a 10,000
// service first sync fast.
func (r *renderer) endpointRules(st *proxy.ServiceState, eps []*proxy.Endpoint) []string {
	proto := strings.ToLower(string(st.Protocol))
	pm := protoMatch(proto)
	var rules []string
	c := comment(st.Name.String())
	affinity := st.Decisions.AffinitySeconds
	if affinity > 0 {
		seconds := strconv.Itoa(affinity)
		for _, ep := range eps {
			rules = append(rules, c+" -m recent --name "+recentName(st.Name, ep)+" --update --seconds "+seconds+" --reap --rsource "+
				pm+" -j DNAT --to-destination "+ep.AddrString())
		}
	}
	n := len(eps)
	for i, ep := range eps {
		rule := c
		if i < n-1 {
			rule += " -m statistic --mode random --probability " + probability(n-i)
		}
		if affinity > 0 {
			rule += " -m recent --name " + recentName(st.Name, ep) + " --set --rsource"
		}
		rules = append(rules, rule+" "+pm+" -j DNAT --to-destination "+ep.AddrString())
	}
	return rules
}

// probability is 1/n with ten decimals, as upstream writes it.
func probability(n int) string {
	return fmt.Sprintf("%0.10f", 1.0/float64(n))
}

// natChainsLookup reports whether the (possibly nil) rendered service has
// chain.
func (rs *renderedService) natChainsLookup(chain string) ([]string, bool) {
	if rs == nil {
		return nil, false
	}
	rules, ok := rs.natChains[chain]
	return rules, ok
}
