package ipvs

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// jumpRule is a rule in a built-in chain that leads into IPVS mode's chains.
type jumpRule struct {
	table ipt.Table
	chain ipt.Chain
	args  []string
}

func jump(table ipt.Table, chain ipt.Chain, text, target string) jumpRule {
	return jumpRule{table, chain, []string{"-m", "comment", "--comment", text, "-j", target}}
}

// jumpRules are IPVS mode's hooks, in the order they appear.
var jumpRules = []jumpRule{
	jump(ipt.TableNAT, ipt.ChainPrerouting, "kproxy ipvs service portals", chainServices),
	jump(ipt.TableNAT, ipt.ChainOutput, "kproxy ipvs service portals", chainServices),
	jump(ipt.TableNAT, ipt.ChainPostrouting, "kproxy ipvs postrouting rules", chainPostrouting),
	jump(ipt.TableFilter, ipt.ChainInput, "kproxy ipvs input filter", chainInput),
	jump(ipt.TableFilter, ipt.ChainInput, "kproxy ipvs access filter", chainFilter),
	jump(ipt.TableFilter, ipt.ChainForward, "kproxy ipvs forwarding rules", chainForward),
}

// ruleSet is the rule bodies (the text after "-A CHAIN") of every chain,
// per table.
type ruleSet map[ipt.Table]map[string][]string

func (rs ruleSet) count() map[string]int {
	out := map[string]int{}
	for table, chains := range rs {
		n := 0
		for _, rules := range chains {
			n += len(rules)
		}
		out[string(table)] = n
	}
	for _, j := range jumpRules {
		out[string(j.table)]++
	}
	return out
}

// renderRules renders IPVS mode's chains: constant apart from the shortcut
// rules and the service ports' own chains (clusterChain).
func (b *Backend) renderRules(shortcut []string) ruleSet {
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
	for _, p := range b.plans {
		for c, rules := range p.chains {
			nat[c] = rules
		}
	}
	return ruleSet{ipt.TableNAT: nat, ipt.TableFilter: filter}
}

// writeRules writes the chains of rs that differ from what was last
// written (every chain when full), in one iptables-restore, and on a full
// sync also ensures the hooks and deletes IPVS-mode chains rs lacks.
func (b *Backend) writeRules(ctx context.Context, rs ruleSet, full bool, st *SyncStats) error {
	var buf bytes.Buffer
	for _, table := range []ipt.Table{ipt.TableNAT, ipt.TableFilter} {
		var write, del []string
		for chain, rules := range rs[table] {
			if full || b.rules[table][chain] != strings.Join(rules, "\n") {
				write = append(write, chain)
			}
		}
		if !full {
			// A service port's own chain that is no longer wanted.
			for c := range b.rules[table] {
				if _, ok := rs[table][c]; !ok {
					del = append(del, c)
				}
			}
		}
		if full {
			existing, err := b.ipt.ListChains(ctx, table)
			if err != nil {
				return fmt.Errorf("listing %s chains: %w", table, err)
			}
			for _, c := range existing {
				if _, ok := rs[table][c]; IsChain(c) && !ok {
					del = append(del, c)
				}
			}
		}
		if len(write) == 0 && len(del) == 0 {
			continue
		}
		slices.Sort(write)
		slices.Sort(del)
		fmt.Fprintf(&buf, "*%s\n", table)
		for _, c := range append(append([]string{}, write...), del...) {
			fmt.Fprintf(&buf, ":%s - [0:0]\n", c)
		}
		for _, c := range write {
			for _, r := range rs[table][c] {
				fmt.Fprintf(&buf, "-A %s %s\n", c, r)
			}
		}
		for _, c := range del {
			fmt.Fprintf(&buf, "-X %s\n", c)
		}
		buf.WriteString("COMMIT\n")
	}
	if buf.Len() > 0 {
		st.Restores++
		if err := b.ipt.Restore(ctx, buf.Bytes()); err != nil {
			b.rules = nil
			return fmt.Errorf("iptables-restore (%d bytes): %w", buf.Len(), err)
		}
	}
	if full {
		for i := len(jumpRules) - 1; i >= 0; i-- {
			j := jumpRules[i]
			if _, err := b.ipt.EnsureRule(ctx, ipt.Prepend, j.table, j.chain, j.args...); err != nil {
				return fmt.Errorf("ensuring jump from %s/%s: %w", j.table, j.chain, err)
			}
		}
	}
	b.rules = map[ipt.Table]map[string]string{}
	for table, chains := range rs {
		b.rules[table] = map[string]string{}
		for c, rules := range chains {
			b.rules[table][c] = strings.Join(rules, "\n")
		}
	}
	b.ruleCounts = rs.count()
	return nil
}
