package trace

import (
	"fmt"
	"net/netip"
	"regexp"
	"strconv"
	"strings"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
	"github.com/kproxy/kproxy/proxier/nftables/nftablestest"
	"sigs.k8s.io/knftables"
)

// Chains of iptables mode whose drops mean something particular (their
// names are the iptables backend's; docs/design.md, "kproxy trace").
const (
	iptFilterServices   = "KPROXY-SERVICES"          // filter: ClusterIP verdicts
	iptFilterFirewall   = "KPROXY-FIREWALL"          // loadBalancerSourceRanges drops
	iptFilterExternal   = "KPROXY-EXTERNAL-SERVICES" // external IP and LB IP verdicts
	iptFilterNodePorts  = "KPROXY-EXT-NODEPORTS"     // node port verdicts
	iptNoEndpoints      = " has no endpoints"
	iptNoLocalEndpoints = " has no local endpoints"
	iptNotAccepted      = " traffic not accepted by "
)

var (
	probabilityFlag = regexp.MustCompile(`--probability ([0-9.]+)`)
	secondsFlag     = regexp.MustCompile(`--seconds ([0-9]+)`)
	// numgenMod: a random slot (in a map key) or, followed by "== 0", a
	// random choice of one rule.
	numgenMod     = regexp.MustCompile(`numgen random mod ([0-9]+)( == 0)?`)
	affinityChain = regexp.MustCompile(`-aff([0-9]+)\b`)
)

// traceIPTables walks the iptables state for r.
func traceIPTables(rep *Report, r Request, st *iptablesState, local []netip.Addr) error {
	origin := iptablestest.OriginExternal
	if r.From == FromNode {
		origin = iptablestest.OriginLocal
	}
	outs, err := st.fake.Trace(iptablestest.Packet{
		Source: r.Source, Destination: r.Destination, Protocol: r.Protocol,
		SourcePort: SourcePort, DestinationPort: r.DestinationPort, Origin: origin,
	}, iptablestest.TraceOptions{LocalAddrs: local})
	if err != nil {
		return fmt.Errorf("tracing kproxy's %s rules: %w", rep.Family, err)
	}
	if st.foreign > 0 {
		rep.Notes = append(rep.Notes, fmt.Sprintf("%d rules of others in the nat and filter tables (and the built-in chains' policies) were not evaluated", st.foreign))
	}
	for _, o := range outs {
		p := Path{Masquerade: o.Masquerade, DNAT: o.DNAT, Weight: 1}
		var last iptRule
		for _, where := range o.Path {
			r := iptRuleAt(st.fake, where)
			s := r.step()
			if s.Service != "" {
				rep.Service = s.Service
			}
			p.Steps = append(p.Steps, s)
			last = r
			if r.isDNAT() {
				p.Weight = iptWeight(r.rules, r.n)
				if m := secondsFlag.FindStringSubmatch(strings.Join(r.rules, "\n")); m != nil && strings.Contains(strings.Join(r.rules, "\n"), "--rsource") {
					rep.AffinitySeconds, _ = strconv.Atoi(m[1])
				}
			}
		}
		p.Verdict = pathVerdict(o.Verdict, o.DNAT)
		if p.Verdict == Dropped || p.Verdict == Rejected {
			c := iptComment(last.text)
			svc := serviceOf(c)
			switch {
			case p.Verdict == Rejected && strings.Contains(c, iptNoEndpoints):
				rep.Reason = rejectNoEndpoints(svc)
			case p.Verdict == Dropped && strings.Contains(c, iptNoLocalEndpoints) && last.chain == iptFilterServices:
				rep.Reason = dropLocal("internalTrafficPolicy", svc)
			case p.Verdict == Dropped && strings.Contains(c, iptNoLocalEndpoints) && (last.chain == iptFilterExternal || last.chain == iptFilterNodePorts):
				rep.Reason = dropLocal("externalTrafficPolicy", svc)
			case p.Verdict == Dropped && (last.chain == iptFilterFirewall || strings.Contains(c, iptNotAccepted)):
				rep.Reason = dropSourceRange(r.Source, svc)
			default:
				rep.Reason = fmt.Sprintf("%s by %s/%s rule %d (%s)", p.Verdict, last.table, last.chain, last.n, c)
			}
		}
		rep.Paths = append(rep.Paths, p)
	}
	return nil
}

// iptRule is the rule of an iptables path at "table/chain#n" (n is
// 1-based), with the rules of its chain.
type iptRule struct {
	table, chain string
	n            int
	// text is the rule ("" when the chain has no such rule).
	text  string
	rules []string
}

func iptRuleAt(fake *iptablestest.Fake, where string) iptRule {
	tc, num, _ := strings.Cut(where, "#")
	r := iptRule{}
	r.table, r.chain, _ = strings.Cut(tc, "/")
	r.n, _ = strconv.Atoi(num)
	r.rules = fake.Rules(ipt.Table(r.table), ipt.Chain(r.chain))
	if r.n >= 1 && r.n <= len(r.rules) {
		r.text = r.rules[r.n-1]
	}
	return r
}

// step is the rule as a report shows it, with the Service its comment
// names.
func (r iptRule) step() Step {
	return Step{Where: fmt.Sprintf("%s/%s rule %d", r.table, r.chain, r.n), Rule: "-A " + r.chain + " " + r.text,
		Service: serviceOf(iptComment(r.text))}
}

func (r iptRule) isDNAT() bool { return strings.Contains(r.text, "-j DNAT") }

// pathVerdict is a path's verdict from a tracer's final verdict (iptables'
// "DROP", nftables' "drop", ...) and its DNAT.
func pathVerdict(verdict, dnat string) string {
	switch {
	case strings.EqualFold(verdict, "drop"):
		return Dropped
	case strings.EqualFold(verdict, "reject"):
		return Rejected
	case dnat != "":
		return Delivered
	}
	return NotHandled
}

// iptComment is the --comment of a rule, "" without one.
func iptComment(rule string) string {
	args, err := ipt.SplitArgs(rule)
	if err != nil {
		return ""
	}
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--comment" {
			return args[i+1]
		}
	}
	return ""
}

// iptWeight is the chance that the n-th rule (1-based) of a chain of
// endpoint rules is the one taken: its own --probability (1 without one)
// times the chance that every random rule before it was not.
func iptWeight(rules []string, n int) float64 {
	w := 1.0
	for i := 0; i < n && i < len(rules); i++ {
		m := probabilityFlag.FindStringSubmatch(rules[i])
		if m == nil {
			continue
		}
		p, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			continue
		}
		if i == n-1 {
			w *= p
		} else {
			w *= 1 - p
		}
	}
	return w
}

// Maps and chains of nftables mode the trace explains (the nftables
// backend's names; docs/design.md, "kproxy trace").
const (
	nftServiceIPs          = "service-ips"
	nftNoEndpointServices  = "no-endpoint-services"
	nftNoEndpointNodePorts = "no-endpoint-nodeports"
	nftFirewallIPs         = "firewall-ips"
	nftFirewallCheck       = "firewall-check"
)

// traceNFTables walks kproxy's nftables table for r.
func traceNFTables(rep *Report, r Request, fake *knftables.Fake, local []netip.Addr) error {
	outs, err := nftablestest.Trace(fake, nftablestest.Packet{
		Source: r.Source, Destination: r.Destination, Protocol: r.Protocol,
		SourcePort: SourcePort, DestinationPort: r.DestinationPort, Local: r.From == FromNode,
	}, nftablestest.Options{LocalAddrs: local, RecordPath: true})
	if err != nil {
		return fmt.Errorf("tracing kproxy's %s table: %w", rep.Family, err)
	}
	dispatchKey := []string{r.Destination.String(), r.Protocol, strconv.Itoa(r.DestinationPort)}
	for _, o := range outs {
		p := Path{Masquerade: o.Masquerade, DNAT: o.DNAT, Weight: 1}
		var lastRule nftablestest.Step
		var lastMap *nftablestest.Step
		for i := range o.Path {
			s := o.Path[i]
			if s.Map != "" {
				text := "{ " + strings.Join(s.Key, " . ") + " }"
				if len(s.Value) > 0 {
					text += " : " + strings.Join(s.Value, " . ")
				}
				if s.Comment != "" {
					text += " # " + s.Comment
				}
				st := Step{Where: "map " + s.Map, Rule: text, Service: lastServiceOf(s.Comment)}
				if st.Service != "" {
					rep.Service = st.Service
				}
				p.Steps = append(p.Steps, st)
				lastMap = &o.Path[i]
				if strings.HasPrefix(s.Map, "endpoints-") || strings.HasPrefix(s.Map, "nodeport-endpoints-") {
					// The DNAT of lastRule found its endpoint.
					p.Weight = nftWeight(fake, lastRule.Chain, lastRule.Rule)
				}
				continue
			}
			p.Steps = append(p.Steps, Step{Where: fmt.Sprintf("chain %s rule %d", s.Chain, s.Rule), Rule: s.Text})
			lastRule = s

			if m := affinityChain.FindStringSubmatch(s.Chain); m != nil {
				rep.AffinitySeconds, _ = strconv.Atoi(m[1])
			}
		}
		p.Verdict = pathVerdict(o.Verdict, o.DNAT)
		if p.Verdict == Dropped || p.Verdict == Rejected {
			svc := ""
			if lastMap != nil {
				svc = lastServiceOf(lastMap.Comment)
			}
			if svc == "" {
				svc = nftServiceAt(fake, nftServiceIPs, dispatchKey)
			}
			if svc != "" {
				rep.Service = svc
			}
			fromMap := ""
			if lastMap != nil && lastMap.Chain == "" {
				fromMap = lastMap.Map
			}
			switch {
			case lastRule.Chain == nftFirewallCheck:
				rep.Reason = dropSourceRange(r.Source, svc)
			case p.Verdict == Rejected && (fromMap == nftNoEndpointServices || fromMap == nftNoEndpointNodePorts):
				rep.Reason = rejectNoEndpoints(svc)
			case p.Verdict == Dropped && fromMap == nftNoEndpointNodePorts:
				rep.Reason = dropLocal("externalTrafficPolicy", svc)
			case p.Verdict == Dropped && fromMap == nftNoEndpointServices && strings.Contains(lastMap.Comment, nftbackend.CommentInternalLocal):
				rep.Reason = dropLocal("internalTrafficPolicy", svc)
			case p.Verdict == Dropped && fromMap == nftNoEndpointServices && strings.Contains(lastMap.Comment, nftbackend.CommentExternalLocal):
				rep.Reason = dropLocal("externalTrafficPolicy", svc)
			case p.Verdict == Dropped && fromMap == nftNoEndpointServices:
				// A table of an older kproxy, whose element's comment does
				// not name the policy: guess from the kind of address. A
				// ClusterIP whose internalTrafficPolicy is Local and that
				// has no local endpoint delivers no one; an external
				// address whose externalTrafficPolicy is Local usually
				// still delivers the node and pods (to every endpoint),
				// or is a load-balancer IP.
				if nftServiceAt(fake, nftServiceIPs, dispatchKey) != "" || nftInSet(fake, nftFirewallIPs, dispatchKey) {
					rep.Reason = dropLocal("externalTrafficPolicy", svc)
				} else {
					rep.Reason = dropLocal("internalTrafficPolicy", svc)
				}
			default:
				rep.Reason = fmt.Sprintf("%s by chain %s rule %d (%s)", p.Verdict, lastRule.Chain, lastRule.Rule, lastRule.Text)
			}
		}
		rep.Paths = append(rep.Paths, p)
	}
	return nil
}

// lastServiceOf is the last "namespace/name[:port]" field of a comment
// (dispatch elements' comments start with other fields).
func lastServiceOf(comment string) string {
	f := strings.Fields(comment)
	for i := len(f) - 1; i >= 0; i-- {
		if s := serviceOf(f[i]); s != "" {
			return s
		}
	}
	return ""
}

// nftServiceAt is the Service port named by the element of map at key.
func nftServiceAt(fake *knftables.Fake, m string, key []string) string {
	fake.RLock()
	defer fake.RUnlock()
	if fake.Table == nil || fake.Table.Maps[m] == nil {
		return ""
	}
	e := fake.Table.Maps[m].FindElement(key...)
	if e == nil || e.Comment == nil {
		return ""
	}
	return lastServiceOf(*e.Comment)
}

func nftInSet(fake *knftables.Fake, s string, key []string) bool {
	fake.RLock()
	defer fake.RUnlock()
	return fake.Table != nil && fake.Table.Sets[s] != nil && fake.Table.Sets[s].FindElement(key...) != nil
}

// nftWeight is the chance that the n-th rule (1-based) of chain, a DNAT,
// is the one taken and, when it picks a random slot of a map, that each
// slot is: its own random choice times the chance that every random
// choice before it in the chain was not taken.
func nftWeight(fake *knftables.Fake, chain string, n int) float64 {
	fake.RLock()
	defer fake.RUnlock()
	c := fake.Table.Chains[chain]
	if c == nil {
		return 1
	}
	w := 1.0
	for i := 0; i < n && i < len(c.Rules); i++ {
		m := numgenMod.FindStringSubmatch(c.Rules[i].Rule)
		if m == nil {
			continue
		}
		mod, err := strconv.Atoi(m[1])
		if err != nil || mod < 1 {
			continue
		}
		switch {
		case i == n-1:
			w /= float64(mod)
		case m[2] != "":
			w *= 1 - 1/float64(mod)
		}
	}
	return w
}
