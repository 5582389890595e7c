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

// renderer turns ServiceStates into rules for one family.
type renderer struct {
	ipv6          bool
	masqueradeAll bool
	// clusterCIDR: traffic to a ClusterIP from outside it is masqueraded;
	// invalid (zero) when unknown.
	clusterCIDR netip.Prefix
	// nodeIPs are this node's addresses (for loadBalancerSourceRanges that
	// include the node).
	nodeIPs []netip.Addr
}

// comment is the shared comment match.
var comment = ipt.Comment

func protoMatch(p string) string { return "-p " + p + " -m " + p }

func hostAddr(ip netip.Addr) string {
	if ip.Is6() {
		return ip.String() + "/128"
	}
	return ip.String() + "/32"
}

func (r *renderer) render(st *proxy.ServiceState) *renderedService {
	out := &renderedService{natChains: map[string][]string{}}
	name := st.Name
	nameStr := name.String()
	proto := strings.ToLower(string(st.Protocol))
	pm := protoMatch(proto)
	port := strconv.Itoa(st.Port)

	clusterChain := servicePortChain(kindCluster, name)
	localChain := servicePortChain(kindLocal, name)
	extChain := servicePortChain(kindExternal, name)
	fwChain := servicePortChain(kindFirewall, name)

	hasEndpoints := st.HasAnyEndpoints
	usesClusterChain := len(st.ClusterEndpoints) > 0 && st.UsesClusterEndpoints()
	usesLocalChain := len(st.LocalEndpoints) > 0 && st.UsesLocalEndpoints()

	internalChain, hasInternal := clusterChain, hasEndpoints && usesClusterChain
	if st.InternalPolicyLocal {
		internalChain, hasInternal = localChain, hasEndpoints && usesLocalChain
	}
	externalPolicyChain, hasExternal := clusterChain, hasEndpoints && usesClusterChain
	if st.ExternalPolicyLocal {
		externalPolicyChain, hasExternal = localChain, hasEndpoints && usesLocalChain
	}
	usesExtChain := hasEndpoints && st.ExternallyAccessible()
	usesFWChain := hasEndpoints && len(st.LoadBalancerVIPs) > 0 && len(st.LoadBalancerSourceRanges) > 0
	lbChain := extChain
	if usesFWChain {
		lbChain = fwChain
	}

	// Filter verdicts for traffic that has nowhere to go: REJECT when the
	// service has no endpoints at all, DROP when only a Local policy leaves
	// it without one.
	internalTarget, internalComment := "REJECT", nameStr+" has no endpoints"
	externalTarget, externalComment := "REJECT", nameStr+" has no endpoints"
	if hasEndpoints {
		internalTarget, internalComment = "DROP", nameStr+" has no local endpoints"
		externalTarget, externalComment = "DROP", nameStr+" has no local endpoints"
	}

	// ClusterIP.
	cipMatch := comment(nameStr+" cluster IP") + " " + pm + " -d " + hostAddr(st.ClusterIP) + " --dport " + port
	if hasInternal {
		out.natServices = append(out.natServices, dispatchRule{addrBucket(st.ClusterIP), cipMatch + " -j " + internalChain})
	} else {
		out.filterServices = append(out.filterServices, dispatchRule{addrBucket(st.ClusterIP),
			comment(internalComment) + " " + pm + " -d " + hostAddr(st.ClusterIP) + " --dport " + port + " -j " + internalTarget})
	}

	// ExternalIPs.
	for _, ip := range st.ExternalIPs {
		m := pm + " -d " + hostAddr(ip) + " --dport " + port
		if hasEndpoints {
			out.natServices = append(out.natServices, dispatchRule{addrBucket(ip), comment(nameStr+" external IP") + " " + m + " -j " + extChain})
		}
		if !hasExternal {
			out.filterExternal = append(out.filterExternal, dispatchRule{addrBucket(ip), comment(externalComment) + " " + m + " -j " + externalTarget})
		}
	}

	// LoadBalancer VIPs.
	for _, ip := range st.LoadBalancerVIPs {
		m := pm + " -d " + hostAddr(ip) + " --dport " + port
		if hasEndpoints {
			out.natServices = append(out.natServices, dispatchRule{addrBucket(ip), comment(nameStr+" loadbalancer IP") + " " + m + " -j " + lbChain})
		}
		if usesFWChain {
			out.filterFirewall = append(out.filterFirewall, comment(nameStr+" traffic not accepted by "+fwChain)+" "+m+" -j DROP")
		}
		if !hasExternal {
			out.filterExternal = append(out.filterExternal, dispatchRule{addrBucket(ip), comment(externalComment) + " " + m + " -j " + externalTarget})
		}
	}

	// NodePort.
	if st.NodePort != 0 {
		np := strconv.Itoa(st.NodePort)
		if hasEndpoints {
			out.natNodePorts = append(out.natNodePorts, dispatchRule{portBucket(st.Protocol, st.NodePort),
				comment(nameStr) + " " + pm + " --dport " + np + " -j " + extChain})
		}
		if !hasExternal {
			out.filterExtNodePorts = append(out.filterExtNodePorts,
				comment(externalComment)+" -m addrtype --dst-type LOCAL "+pm+" --dport "+np+" -j "+externalTarget)
		}
	}
	if st.HealthCheckNodePort != 0 {
		out.filterHealthCheck = append(out.filterHealthCheck,
			comment(nameStr+" health check node port")+" -m tcp -p tcp --dport "+strconv.Itoa(st.HealthCheckNodePort)+" -j ACCEPT")
	}

	// Policy chains, each with its endpoints.
	if usesClusterChain {
		out.natChains[clusterChain] = r.endpointRules(st, st.ClusterEndpoints, !st.InternalPolicyLocal && hasInternal, cipMatch)
	}
	if usesLocalChain {
		out.natChains[localChain] = r.endpointRules(st, st.LocalEndpoints, st.InternalPolicyLocal && hasInternal, cipMatch)
	}

	// External destinations.
	if usesExtChain {
		var ext []string
		if !st.ExternalPolicyLocal {
			ext = append(ext, comment("masquerade traffic for "+nameStr+" external destinations")+" -j "+chainMarkMasq)
		} else if usesClusterChain {
			// Pods and the node itself reaching an external destination are
			// subject to neither policy (as if they went out to a load
			// balancer and came back): they use the cluster endpoints.
			if r.clusterCIDR.IsValid() {
				ext = append(ext, comment("pod traffic for "+nameStr+" external destinations")+" -s "+r.clusterCIDR.String()+" -j "+clusterChain)
			}
			ext = append(ext,
				comment("masquerade LOCAL traffic for "+nameStr+" external destinations")+" -m addrtype --src-type LOCAL -j "+chainMarkMasq,
				comment("route LOCAL traffic for "+nameStr+" external destinations")+" -m addrtype --src-type LOCAL -j "+clusterChain)
		}
		if hasExternal {
			ext = append(ext, "-j "+externalPolicyChain)
		}
		out.natChains[extChain] = ext
	}

	// loadBalancerSourceRanges.
	if usesFWChain {
		c := comment(nameStr + " loadbalancer IP")
		var fw []string
		allowFromNode := false
		for _, cidr := range st.LoadBalancerSourceRanges {
			fw = append(fw, c+" -s "+cidr.String()+" -j "+extChain)
			for _, ip := range r.nodeIPs {
				if cidr.Contains(ip) {
					allowFromNode = true
				}
			}
		}
		if allowFromNode {
			// A node reaching a VIP that is also a local address uses the
			// VIP as its source.
			for _, ip := range st.LoadBalancerVIPs {
				fw = append(fw, c+" -s "+hostAddr(ip)+" -j "+extChain)
			}
		}
		fw = append(fw, comment("other traffic to "+nameStr+" will be dropped by "+chainFirewall))
		out.natChains[fwChain] = fw
	}

	// Hairpin: an endpoint reaching itself through the service must be
	// masqueraded or it would answer itself directly.
	for _, ep := range st.AllEndpoints {
		if ep.IsLocal || ep.NodeName == "" {
			out.hairpin = append(out.hairpin, ep.IP)
		}
	}
	return out
}

// endpointRules renders a policy chain: the masquerade rule for ClusterIP
// traffic from outside the cluster (when this chain serves ClusterIP
// traffic), session affinity, then random balancing with DNAT inline.
//
// Upstream kube-proxy gives every endpoint its own chain (KUBE-SEP-*). kproxy
// does not: the hairpin mark moves to POSTROUTING (see renderedService.hairpin)
// and "-m recent --set" combines with DNAT in one rule, so a service port
// costs one chain, not one per endpoint. iptables-nft's restore time grows
// with the square of the chains in a batch, so this is what keeps a 10,000
// service first sync fast.
func (r *renderer) endpointRules(st *proxy.ServiceState, eps []*proxy.Endpoint, servesClusterIP bool, cipMatch string) []string {
	proto := strings.ToLower(string(st.Protocol))
	pm := protoMatch(proto)
	nameStr := st.Name.String()
	var rules []string
	if servesClusterIP {
		if r.masqueradeAll {
			rules = append(rules, cipMatch+" -j "+chainMarkMasq)
		} else if r.clusterCIDR.IsValid() {
			rules = append(rules, cipMatch+" ! -s "+r.clusterCIDR.String()+" -j "+chainMarkMasq)
		}
	}
	c := comment(nameStr)
	if st.SessionAffinityClientIP {
		seconds := strconv.Itoa(st.StickyMaxAgeSeconds)
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
		if st.SessionAffinityClientIP {
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
