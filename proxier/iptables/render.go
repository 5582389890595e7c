package iptables

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// renderedService is everything one service port contributes to the
// ruleset but the rules of its own chains, which are rendered again from
// state when the writer needs them (renderer.natChains): at 10,000 services
// those rules are most of the rule set's text, and keeping them between
// syncs would double kproxy's memory. Rule bodies are the text after
// "-A CHAIN".
type renderedService struct {
	// state is the service port the rules were rendered from.
	state *proxy.ServiceState
	// natChains names the port's own chains (SVC, SVL, EXT, FW) in nat,
	// sorted.
	natChains []string
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

// filterRules is what one service port contributes to the filter table:
// the verdicts for its traffic that nat did not DNAT, and its health-check
// port. No filter rule matches a DNATed packet (they all match the
// service's own destinations), which is what makes the order of a sync's
// restores safe (docs/design.md, "Atomic syncs across tables").
type filterRules struct {
	services, external                  []dispatchRule
	extNodePorts, firewall, healthCheck []string
}

// filter returns the port's filter contributions.
func (rs *renderedService) filter() filterRules {
	return filterRules{services: rs.filterServices, external: rs.filterExternal,
		extNodePorts: rs.filterExtNodePorts, firewall: rs.filterFirewall, healthCheck: rs.filterHealthCheck}
}

// empty reports whether the port has no filter rule.
func (f filterRules) empty() bool {
	return len(f.services)+len(f.external)+len(f.extNodePorts)+len(f.firewall)+len(f.healthCheck) == 0
}

// subsetOf reports whether o holds every rule of f.
func (f filterRules) subsetOf(o filterRules) bool {
	return subset(f.services, o.services) && subset(f.external, o.external) &&
		subset(f.extNodePorts, o.extNodePorts) && subset(f.firewall, o.firewall) &&
		subset(f.healthCheck, o.healthCheck)
}

func subset[T comparable](a, b []T) bool {
	for _, x := range a {
		if !slices.Contains(b, x) {
			return false
		}
	}
	return true
}

// union is f's rules followed by those of o that f lacks.
func (f filterRules) union(o filterRules) filterRules {
	return filterRules{
		services: unionOf(f.services, o.services), external: unionOf(f.external, o.external),
		extNodePorts: unionOf(f.extNodePorts, o.extNodePorts), firewall: unionOf(f.firewall, o.firewall),
		healthCheck: unionOf(f.healthCheck, o.healthCheck),
	}
}

func unionOf[T comparable](a, b []T) []T {
	out := a
	for _, x := range b {
		if !slices.Contains(a, x) {
			out = append(slices.Clip(out), x)
		}
	}
	return out
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

// portLayout is what both halves of a port's rendering (render and
// natChains) derive from its decisions: its chains and which of them it
// uses.
type portLayout struct {
	st      *proxy.ServiceState
	d       *proxy.ServiceDecisions
	nameStr string
	pm      string // protocol match
	port    string
	// policyChain is the chain of each endpoint selection.
	policyChain       [proxy.SelectLocal + 1]string
	extChain, fwChain string
	// lbChain is where LoadBalancer IPs jump: fwChain when it is used.
	lbChain string
	// The external kinds share one decision row (and so one EXT chain):
	// the first one the port has.
	extKind      proxy.DestinationKind
	hasExt       bool
	usesExtChain bool
	usesFWChain  bool
	// cip is the ClusterIP decision of SourceOther; cipMatch its match.
	cip      proxy.Decision
	cipMatch string
}

// layout works out st's portLayout.
func (r *renderer) layout(st *proxy.ServiceState) *portLayout {
	l := &portLayout{st: st, d: &st.Decisions, nameStr: st.Name.String(), port: strconv.Itoa(st.Port)}
	d := l.d
	l.pm = protoMatch(strings.ToLower(string(st.Protocol)))
	h := servicePortChains(st.Name)
	l.policyChain[proxy.SelectCluster] = h.chain(kindCluster)
	l.policyChain[proxy.SelectLocal] = h.chain(kindLocal)
	l.extChain = h.chain(kindExternal)
	l.fwChain = h.chain(kindFirewall)
	for _, k := range proxy.DestinationKinds[1:] {
		if d.Has(k) {
			l.extKind, l.hasExt = k, true
			break
		}
	}
	l.usesExtChain = l.hasExt && delivers(d, l.extKind)
	l.usesFWChain = l.usesExtChain && d.Firewall != nil && d.Has(proxy.DestLoadBalancerIP)
	l.lbChain = l.extChain
	if l.usesFWChain {
		l.lbChain = l.fwChain
	}
	// ClusterIP: every class goes to the same policy chain (only
	// masquerading differs by class, inside that chain).
	l.cip = d.For(proxy.DestClusterIP, proxy.SourceOther)
	l.cipMatch = comment(l.nameStr+" cluster IP") + " " + l.pm + " -d " + hostAddr(st.ClusterIP) + " --dport " + l.port
	return l
}

// render renders what a port contributes to the shared chains, and names
// its own chains.
func (r *renderer) render(st *proxy.ServiceState) *renderedService {
	l := r.layout(st)
	out := &renderedService{state: st}
	chains := r.natChains(l, false)
	out.natChains = make([]string, 0, len(chains))
	for _, c := range chains {
		out.natChains = append(out.natChains, c.Name)
	}
	d := l.d
	nameStr, pm, port := l.nameStr, l.pm, l.port

	if l.cip.Verdict == proxy.VerdictDeliver {
		out.natServices = append(out.natServices, dispatchRule{addrBucket(st.ClusterIP), l.cipMatch + " -j " + l.policyChain[l.cip.Endpoints]})
	}
	if target, why := filterVerdict(d, proxy.DestClusterIP); target != "" {
		out.filterServices = append(out.filterServices, dispatchRule{addrBucket(st.ClusterIP),
			comment(nameStr+why) + " " + pm + " -d " + hostAddr(st.ClusterIP) + " --dport " + port + " -j " + target})
	}

	// ExternalIPs and LoadBalancer IPs.
	extTarget, extWhy := "", ""
	if l.hasExt {
		extTarget, extWhy = filterVerdict(d, l.extKind)
	}
	for _, a := range []struct {
		kind  proxy.DestinationKind
		ips   []netip.Addr
		what  string
		chain string
	}{
		{proxy.DestExternalIP, st.ExternalIPs, " external IP", l.extChain},
		{proxy.DestLoadBalancerIP, st.LoadBalancerVIPs, " loadbalancer IP", l.lbChain},
	} {
		for _, ip := range a.ips {
			m := pm + " -d " + hostAddr(ip) + " --dport " + port
			if l.usesExtChain {
				out.natServices = append(out.natServices, dispatchRule{addrBucket(ip), comment(nameStr+a.what) + " " + m + " -j " + a.chain})
			}
			if a.kind == proxy.DestLoadBalancerIP && l.usesFWChain {
				out.filterFirewall = append(out.filterFirewall, comment(nameStr+" traffic not accepted by "+l.fwChain)+" "+m+" -j DROP")
			}
			if extTarget != "" {
				out.filterExternal = append(out.filterExternal, dispatchRule{addrBucket(ip), comment(nameStr+extWhy) + " " + m + " -j " + extTarget})
			}
		}
	}

	// NodePort.
	if d.Has(proxy.DestNodePort) {
		np := strconv.Itoa(st.NodePort)
		if l.usesExtChain {
			out.natNodePorts = append(out.natNodePorts, dispatchRule{portBucket(st.Protocol, st.NodePort),
				comment(nameStr) + " " + pm + " --dport " + np + " -j " + l.extChain})
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

	for _, ep := range d.Hairpin {
		out.hairpin = append(out.hairpin, ep.IP)
	}
	return out
}

// natChains renders the port's own chains in nat, sorted by name: with
// their rules, or their names only when withRules is false.
func (r *renderer) natChains(l *portLayout, withRules bool) []ipt.ChainRules {
	st, d := l.st, l.d
	var out []ipt.ChainRules

	// Policy chains, each with its endpoints; the ClusterIP's masquerade
	// rules go first in the chain the ClusterIP jumps to.
	for _, sel := range []proxy.EndpointSelection{proxy.SelectCluster, proxy.SelectLocal} {
		if !d.Uses(sel) {
			continue
		}
		c := ipt.ChainRules{Name: l.policyChain[sel]}
		if withRules {
			if l.cip.Verdict == proxy.VerdictDeliver && l.cip.Endpoints == sel {
				c.Rules = r.clusterIPMasquerade(d, l.cipMatch)
			}
			c.Rules = r.appendEndpointRules(c.Rules, st, st.Endpoints(sel))
		}
		out = append(out, c)
	}

	// External destinations: the classes that differ from everyone else's
	// decision get their own rules (pods, then the node), then the rest.
	if l.usesExtChain {
		c := ipt.ChainRules{Name: l.extChain}
		if withRules {
			other := d.For(l.extKind, proxy.SourceOther)
			for _, class := range proxy.SourceClasses {
				dec := d.For(l.extKind, class)
				if class != proxy.SourceOther && dec == other {
					continue
				}
				match, what := r.classMatch(class), class.String()+" traffic for "+l.nameStr+" external destinations"
				if match != "" {
					match += " "
				}
				if dec.Masquerade {
					c.Rules = append(c.Rules, comment("masquerade "+what)+" "+match+"-j "+chainMarkMasq)
				}
				if dec.Verdict == proxy.VerdictDeliver {
					c.Rules = append(c.Rules, comment(what)+" "+match+"-j "+l.policyChain[dec.Endpoints])
				}
			}
		}
		out = append(out, c)
	}

	// loadBalancerSourceRanges.
	if l.usesFWChain {
		c := ipt.ChainRules{Name: l.fwChain}
		if withRules {
			lb := comment(l.nameStr + " loadbalancer IP")
			for _, cidr := range d.Firewall.Allowed {
				c.Rules = append(c.Rules, lb+" -s "+cidr.String()+" -j "+l.extChain)
			}
			if d.Firewall.AllowVIPSource {
				for _, ip := range st.LoadBalancerVIPs {
					c.Rules = append(c.Rules, lb+" -s "+hostAddr(ip)+" -j "+l.extChain)
				}
			}
			c.Rules = append(c.Rules, comment("other traffic to "+l.nameStr+" will be dropped by "+chainFirewall))
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b ipt.ChainRules) int { return strings.Compare(a.Name, b.Name) })
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

// appendEndpointRules appends the rules of a policy chain's endpoints: session affinity, then
// random balancing with DNAT inline.
//
// Upstream kube-proxy gives every endpoint its own chain (KUBE-SEP-*). kproxy
// does not: the hairpin mark moves to POSTROUTING (see renderedService.hairpin)
// and "-m recent --set" combines with DNAT in one rule, so a service port
// costs one chain, not one per endpoint. iptables-nft's restore time grows
// with the square of the chains in a batch, so this is what keeps a 10,000
// service first sync fast.
func (r *renderer) appendEndpointRules(rules []string, st *proxy.ServiceState, eps []*proxy.Endpoint) []string {
	pm := protoMatch(strings.ToLower(string(st.Protocol)))
	c := comment(st.Name.String())
	affinity := st.Decisions.AffinitySeconds
	// Each rule is one concatenation, so one allocation: at 10,000
	// services these rules are most of a full sync's allocations.
	if affinity > 0 {
		seconds := strconv.Itoa(affinity)
		for _, ep := range eps {
			rules = append(rules, c+" -m recent --name "+recentName(st.Name, ep)+" --update --seconds "+seconds+" --reap --rsource "+
				pm+" -j DNAT --to-destination "+ep.AddrString())
		}
	}
	n := len(eps)
	for i, ep := range eps {
		probFlag, prob, recentFlag, recent, set := "", "", "", "", ""
		if i < n-1 {
			probFlag, prob = " -m statistic --mode random --probability ", probability(n-i)
		}
		if affinity > 0 {
			recentFlag, recent, set = " -m recent --name ", recentName(st.Name, ep), " --set --rsource"
		}
		rules = append(rules, c+probFlag+prob+recentFlag+recent+set+" "+pm+" -j DNAT --to-destination "+ep.AddrString())
	}
	return rules
}

// probabilities are 1/n with ten decimals, as upstream writes them, for
// the usual endpoint counts.
var probabilities = func() []string {
	out := make([]string, 128)
	for n := 1; n < len(out); n++ {
		out[n] = fmt.Sprintf("%0.10f", 1.0/float64(n))
	}
	return out
}()

// probability is 1/n with ten decimals, as upstream writes it.
func probability(n int) string {
	if n < len(probabilities) {
		return probabilities[n]
	}
	return fmt.Sprintf("%0.10f", 1.0/float64(n))
}
