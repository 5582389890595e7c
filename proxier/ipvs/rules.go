package ipvs

import (
	"context"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// jumpRules are IPVS mode's hooks, in the order they appear.
var jumpRules = []ipt.JumpRule{
	ipt.Jump(ipt.TableNAT, ipt.ChainPrerouting, "kproxy ipvs service portals", chainServices),
	ipt.Jump(ipt.TableNAT, ipt.ChainOutput, "kproxy ipvs service portals", chainServices),
	ipt.Jump(ipt.TableNAT, ipt.ChainPostrouting, "kproxy ipvs postrouting rules", chainPostrouting),
	ipt.Jump(ipt.TableFilter, ipt.ChainInput, "kproxy ipvs input filter", chainInput),
	ipt.Jump(ipt.TableFilter, ipt.ChainInput, "kproxy ipvs access filter", chainFilter),
	ipt.Jump(ipt.TableFilter, ipt.ChainForward, "kproxy ipvs forwarding rules", chainForward),
	ipt.Jump(ipt.TableMangle, ipt.ChainOutput, "kproxy ipvs node firewall", chainNodeFirewall),
}

// ipvsTables are the tables IPVS mode writes. mangle holds one check: IPVS
// takes the node's own packets at LOCAL_OUT, after mangle and nat OUTPUT
// and before any filter chain, so loadBalancerSourceRanges are enforced
// for them there (the filter INPUT check never sees them).
var ipvsTables = []ipt.Table{ipt.TableNAT, ipt.TableFilter, ipt.TableMangle}

// ruleCounts counts the rules of rs and the hooks, by table.
func ruleCounts(rs *ipt.RuleSet) map[string]int {
	out := map[string]int{}
	for _, table := range ipvsTables {
		out[string(table)] = rs.RuleCount(table)
	}
	for _, j := range jumpRules {
		out[string(j.Table)]++
	}
	return out
}

// renderRules renders IPVS mode's chains: constant apart from the shortcut
// rules and the service ports' own chains (clusterChain), which come from
// the plans, a plan of override replacing the port's own (nil: none).
func (b *Backend) renderRules(override map[proxy.ServicePortName]*servicePlan) *ipt.RuleSet {
	shortcut := b.shortcutRules(override)
	set := func(base string) string { return setName(base, b.ipv6) }
	match := func(base, flags string) string { return "-m set --match-set " + set(base) + " " + flags }
	masq := "-j MASQUERADE"
	if b.ipt.HasRandomFully() {
		masq += " --random-fully"
	}
	mark := b.masqMark + "/" + b.masqMark

	var services []string
	cip := comment("kproxy service cluster IP + port for masquerade purpose") + " " + match(setClusterIP, "dst,dst")
	cidr := b.decisionOpts.ClusterCIDR
	switch m := proxy.ClusterIPMasquerade(b.decisionOpts); {
	case m[proxy.SourcePod] && m[proxy.SourceOther]:
		services = append(services, cip+" -j "+chainMarkMasq)
	case m[proxy.SourceOther]:
		services = append(services, cip+" ! -s "+cidr.String()+" -j "+chainMarkMasq)
	}
	services = append(services,
		comment("kproxy service external IPs")+" "+match(setExternalIP, "dst,dst")+" -j "+chainExternal,
		comment("kproxy service load balancer IPs")+" "+match(setLoadBalancer, "dst,dst")+" -j "+chainExternal,
		comment("kproxy service node ports")+" "+match(setNodePort, "dst,dst")+" -j "+chainExternal,
	)
	external := []string{
		comment("kproxy external IPs with externalTrafficPolicy=Local") + " " + match(setExternalIPLocal, "dst,dst") + " -g " + chainExtLocal,
		comment("kproxy load balancer IPs with externalTrafficPolicy=Local") + " " + match(setLoadBalancerLoc, "dst,dst") + " -g " + chainExtLocal,
		comment("kproxy node ports with externalTrafficPolicy=Local") + " " + match(setNodePortLocal, "dst,dst") + " -g " + chainExtLocal,
		comment("masquerade traffic for external destinations") + " -j " + chainMarkMasq,
	}
	// loadBalancerSourceRanges are checked before any short circuit: a
	// source they do not allow falls through, not DNATed, to the filter's
	// drop.
	extLocal := []string{
		comment("kproxy load balancer IPs with source ranges") + " " + match(setLoadBalancerFW, "dst,dst") + " -g " + chainExtLocalFW,
		"-g " + chainExtLocalSrc,
	}
	extLocalFW := []string{
		comment("kproxy allowed source ranges") + " " + match(setLBSourceCIDR, "dst,dst,src") + " -g " + chainExtLocalSrc,
		comment("kproxy node reaching its own load balancer IP") + " " + match(setLBSourceIP, "dst,dst,src") + " -g " + chainExtLocalSrc,
	}
	var extLocalSrc []string
	if cidr.IsValid() {
		extLocalSrc = append(extLocalSrc, comment("pod traffic for Local external destinations uses the cluster endpoints")+
			" -s "+cidr.String()+" -j "+chainShortcut)
	}
	extLocalSrc = append(extLocalSrc,
		comment("masquerade LOCAL traffic for Local external destinations")+" -m addrtype --src-type LOCAL -j "+chainMarkMasq,
		comment("LOCAL traffic for Local external destinations uses the cluster endpoints")+" -m addrtype --src-type LOCAL -j "+chainShortcut,
	)
	post := []string{
		comment("kproxy hairpin: endpoints reaching themselves via a service") + " " + match(setLoopBack, "dst,dst,src") + " " + masq,
		"-m mark ! --mark " + mark + " -j RETURN",
		"-j MARK --xor-mark " + b.masqMark,
		comment("kproxy service traffic requiring SNAT") + " " + masq,
	}
	nat := map[string][]string{
		chainServices:    services,
		chainExternal:    external,
		chainExtLocal:    extLocal,
		chainExtLocalFW:  extLocalFW,
		chainExtLocalSrc: extLocalSrc,
		chainShortcut:    shortcut,
		chainPostrouting: post,
		chainMarkMasq:    {"-j MARK --or-mark " + b.masqMark},
	}
	filter := map[string][]string{
		chainInput: {
			comment("kproxy cluster IPs without local endpoints (internalTrafficPolicy=Local)") + " " + match(setInternalDrop, "dst,dst") + " -j DROP",
			comment("kproxy external destinations without local endpoints (externalTrafficPolicy=Local)") + " " + match(setExternalDrop, "dst,dst") + " -j DROP",
			comment("kproxy node ports without endpoints on addresses outside nodeport-addresses") + " " + match(setNodePortReject, "dst,dst") + " -j REJECT",
			comment("kproxy load balancer source ranges") + " -m conntrack --ctstate NEW " + match(setLoadBalancerFW, "dst,dst") + " -j " + chainSourceRanges,
			comment("kproxy health check node ports") + " " + match(setHealthCheckNodeP, "dst,dst") + " -j ACCEPT",
		},
		chainSourceRanges: {
			comment("kproxy allowed source ranges") + " " + match(setLBSourceCIDR, "dst,dst,src") + " -j RETURN",
			comment("kproxy node reaching its own load balancer IP") + " " + match(setLBSourceIP, "dst,dst,src") + " -j RETURN",
			comment("kproxy load balancer traffic from other sources") + " -j DROP",
		},
		// New connections to a dummy-device address at a port that is
		// not a service's are rejected (the entries of these sets are
		// exactly the virtual servers on the dummy device; node ports are
		// on other addresses). Health check node ports are on node
		// addresses and cannot match; they RETURN as upstream's do.
		chainFilter: {
			comment("kproxy cluster IPs") + " " + match(setClusterIP, "dst,dst") + " -j RETURN",
			comment("kproxy external IPs") + " " + match(setExternalIP, "dst,dst") + " -j RETURN",
			comment("kproxy load balancer IPs") + " " + match(setLoadBalancer, "dst,dst") + " -j RETURN",
			comment("kproxy health check node ports") + " " + match(setHealthCheckNodeP, "dst,dst") + " -j RETURN",
			comment("kproxy: other ports of addresses on the IPVS dummy device") + " -m conntrack --ctstate NEW " +
				match(setIPVSAddresses, "dst") + " -j REJECT",
		},
		chainForward: {
			comment("kproxy: drop invalid conntrack state") + " -m conntrack --ctstate INVALID -j DROP",
			comment("kproxy forwarding rules") + " -m mark --mark " + mark + " -j ACCEPT",
			comment("kproxy forwarding conntrack rule") + " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
		},
	}
	for n, p := range b.plans {
		if _, ok := override[n]; !ok {
			for c, rules := range p.chains {
				nat[c] = rules
			}
		}
	}
	for _, p := range override {
		if p != nil {
			for c, rules := range p.chains {
				nat[c] = rules
			}
		}
	}
	// The node's own new connections to a LoadBalancer IP with source
	// ranges, from a source the ranges do not allow, are dropped before
	// IPVS takes them (see ipvsTables).
	mangle := map[string][]string{
		chainNodeFirewall: {
			comment("kproxy load balancer IPs with source ranges, from this node") + " -m conntrack --ctstate NEW " +
				match(setLoadBalancerFW, "dst,dst") + " -j " + chainNodeFirewallSrc,
		},
		chainNodeFirewallSrc: {
			comment("kproxy allowed source ranges") + " " + match(setLBSourceCIDR, "dst,dst,src") + " -j RETURN",
			comment("kproxy node reaching its own load balancer IP") + " " + match(setLBSourceIP, "dst,dst,src") + " -j RETURN",
			comment("kproxy load balancer traffic from other sources") + " -j DROP",
		},
	}
	return &ipt.RuleSet{Shared: map[ipt.Table]map[string][]string{ipt.TableNAT: nat, ipt.TableFilter: filter, ipt.TableMangle: mangle}}
}

// writeRules writes the chains of rs that differ from what was last
// written (every chain when full), in one iptables-restore, and on a full
// sync also deletes the IPVS-mode chains rs lacks and ensures the hooks.
func (b *Backend) writeRules(ctx context.Context, rs *ipt.RuleSet, full bool, st *SyncStats) error {
	ws, err := b.writer.Write(ctx, rs, full)
	st.Restores += ws.Restores
	if err != nil {
		return err
	}
	if full {
		if err := ipt.EnsureJumpRules(ctx, b.ipt, jumpRules); err != nil {
			return err
		}
	}
	b.ruleCounts = ruleCounts(rs)
	return nil
}
