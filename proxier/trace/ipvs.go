package trace

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/proxier/cleanup"
	"github.com/kproxy/kproxy/proxier/ipvs/ipvstest"
)

// IPVS mode: the chains and sets whose verdicts mean something particular
// (their names are the IPVS backend's; docs/design.md, "kproxy trace").
const (
	ipvsChainSourceRanges = cleanup.IPVSChainPrefix + "SOURCE-RANGES" // filter: loadBalancerSourceRanges
	ipvsChainNodeFWSrc    = cleanup.IPVSChainPrefix + "NODE-FW-SRC"   // mangle: the node's own, same ranges
	ipvsChainFilter       = cleanup.IPVSChainPrefix + "FILTER"        // filter: other ports of the dummy device's addresses
)

// ipvsKinds name the kind of destination of a virtual server by the set
// that records it.
var ipvsKinds = []struct{ set, kind string }{
	{cleanup.SetClusterIP, "ClusterIP"},
	{cleanup.SetExternalIP, "external IP"},
	{cleanup.SetLoadBalancer, "load-balancer IP"},
	{cleanup.SetNodePort, "node port"},
	{cleanup.SetExternalDrop, "node port"},
	{cleanup.SetNodePortReject, "node port"},
}

// traceIPVS walks IPVS mode's state for r: kproxy's iptables chains of IPVS
// mode (as iptables-save prints them), its ipsets and the IPVS table.
func traceIPVS(ctx context.Context, rep *Report, r Request, src Source, saved *iptablesState, local []netip.Addr) error {
	if src.IPVS == nil || src.IPSet == nil {
		return errors.New("this node's IPVS table or ipsets cannot be read (IPVS mode needs both: is the ip_vs module loaded, and is this root?)")
	}
	fam := src.IPTables[v1.IPFamily(rep.Family)]
	st, err := readIPVSIPTables(ctx, fam, saved.saved)
	if err != nil {
		return err
	}
	ipv6 := r.Destination.Is6()
	names := cleanup.IPVSSetNames(ipv6)
	sets, err := ipvstest.SetsOf(ctx, src.IPSet, names)
	if err != nil {
		return err
	}
	var missing []string
	for _, n := range names {
		if _, ok := sets[n]; !ok {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: kproxy's IPVS-mode chains are there but not its ipsets %s", ErrNoState, strings.Join(missing, ", "))
	}
	origin := iptablestest.OriginExternal
	if r.From == FromNode {
		origin = iptablestest.OriginLocal
	}
	outs, err := ipvstest.Trace(ctx, ipvstest.State{IPTables: st.fake, Sets: sets, IPVS: src.IPVS, LocalAddrs: local},
		ipvstest.Packet{Source: r.Source, Destination: r.Destination, Protocol: r.Protocol, SourcePort: SourcePort,
			DestinationPort: r.DestinationPort, Origin: origin})
	if err != nil {
		return fmt.Errorf("tracing kproxy's %s state of IPVS mode: %w", rep.Family, err)
	}
	if st.foreign > 0 {
		rep.Notes = append(rep.Notes, fmt.Sprintf("%d rules of others in the nat, filter and mangle tables (and the built-in chains' policies) were not evaluated", st.foreign))
	}
	tr := &ipvsTrace{rep: rep, r: r, fake: st.fake, sets: sets, ipv6: ipv6}
	// The Service is named by the rules' comments where they name one (the
	// short circuits of Local external destinations), else by its virtual
	// server: IPVS mode's kernel state does not name Services.
	label := tr.label()
	schedulers := map[string]bool{}
	for _, o := range outs {
		steps := tr.steps(o.Netfilter.Path, o.Netfilter.DNAT)
		switch {
		case o.VirtualServer == nil && (o.Verdict == "DROP" || o.Verdict == "REJECT"):
			p := Path{Verdict: pathVerdict(o.Verdict, ""), Steps: steps, Weight: 1}
			tr.reason(p.Verdict, o.Netfilter.Path, label)
			rep.Paths = append(rep.Paths, p)
		case o.VirtualServer == nil && o.Netfilter.DNAT != "":
			// DNATed by netfilter alone: the short circuit to the
			// cluster endpoints of a Service with both traffic policies
			// Local.
			p := Path{Verdict: Delivered, DNAT: o.Netfilter.DNAT, Masquerade: o.Netfilter.Masquerade, Steps: steps, Weight: 1}
			for _, where := range o.Netfilter.Path {
				if r := iptRuleAt(st.fake, where); r.isDNAT() {
					p.Weight = iptWeight(r.rules, r.n)
				}
			}
			rep.Paths = append(rep.Paths, p)
		case o.VirtualServer == nil:
			rep.Paths = append(rep.Paths, Path{Verdict: NotHandled, Steps: steps, Weight: 1})
		default:
			vs := o.VirtualServer
			sched := vs.Scheduler
			if sched == "" {
				sched = ipvs.DefaultScheduler
			}
			schedulers[sched] = true
			if vs.Persistent {
				rep.AffinitySeconds = int(vs.Timeout)
			}
			vsStep := Step{Where: "ipvs virtual server", Rule: vs.String(), Service: rep.Service}
			if len(o.RealServers) == 0 {
				vsStep.Rule += " (no real server of non-zero weight: IPVS answers ICMP port unreachable)"
				rep.Paths = append(rep.Paths, Path{Verdict: Rejected, Steps: append(steps, vsStep), Weight: 1})
				if rep.Service == "" {
					rep.Service = label
				}
				rep.Reason = rejectNoEndpoints(rep.Service)
				continue
			}
			total := 0
			for _, rs := range o.RealServers {
				total += rs.Destination.Weight
			}
			for _, rs := range o.RealServers {
				d := rs.Destination
				ap := netip.AddrPortFrom(d.Address, d.Port).String()
				p := Path{Verdict: Delivered, DNAT: ap, Masquerade: rs.Masquerade, Weight: float64(d.Weight) / float64(total)}
				p.Steps = append(slices.Clip(steps), vsStep, Step{Where: "ipvs real server", Rule: d.String()})
				p.Steps = append(p.Steps, tr.steps(rs.Path, "")...)
				rep.Paths = append(rep.Paths, p)
			}
		}
	}
	if rep.Service == "" {
		rep.Service = label
		if label != "" {
			rep.Notes = append(rep.Notes, "IPVS mode's kernel state does not name Services: the Service is named by its virtual server")
		}
	}
	var notes []string
	for s := range schedulers {
		notes = append(notes, schedulerNote(s))
	}
	slices.Sort(notes)
	rep.Notes = append(rep.Notes, notes...)
	return nil
}

// schedulerNote says what the probabilities mean for scheduler s.
func schedulerNote(s string) string {
	switch s {
	case "rr", "wrr":
		return fmt.Sprintf("IPVS scheduler %s takes the real servers in turn: a real server's probability is its share of the weights, the share of new connections it gets over time, not a random draw", s)
	default:
		return fmt.Sprintf("IPVS scheduler %s picks a real server by its own rule (connection counts, a hash of the addresses, ...): the probabilities shown are the real servers' shares of the weights, not what this packet will get", s)
	}
}

// ipvsTrace holds what the IPVS paths are explained from.
type ipvsTrace struct {
	rep  *Report
	r    Request
	fake *iptablestest.Fake
	sets map[string][]string
	ipv6 bool
}

// steps are the rules of a netfilter path, each followed by the entries of
// the ipsets it matched; they name the report's Service when a comment
// does.
func (tr *ipvsTrace) steps(path []string, dnat string) []Step {
	var out []Step
	for _, where := range path {
		r := iptRuleAt(tr.fake, where)
		s := r.step()
		if s.Service != "" {
			tr.rep.Service = s.Service
		}
		out = append(out, s)
		for _, m := range setMatches(r.text) {
			if m.negate {
				continue
			}
			if e := tr.entry(m.name, m.flags, dnat); e != "" {
				out = append(out, Step{Where: "ipset " + m.name, Rule: e})
			}
		}
	}
	return out
}

type setMatch struct {
	name, flags string
	negate      bool
}

// setMatches are the -m set matches of a rule.
func setMatches(rule string) []setMatch {
	args, err := ipt.SplitArgs(rule)
	if err != nil {
		return nil
	}
	var out []setMatch
	for i := 0; i+2 < len(args); i++ {
		switch {
		case args[i] == "!" && args[i+1] == "--match-set" && i+3 < len(args):
			out = append(out, setMatch{name: args[i+2], flags: args[i+3], negate: true})
			i += 3
		case args[i] == "--match-set":
			out = append(out, setMatch{name: args[i+1], flags: args[i+2]})
			i += 2
		}
	}
	return out
}

// entry is the entry of set that the packet matches, "" when none does: at
// its destination, or after dnat (an "ip:port").
func (tr *ipvsTrace) entry(set, flags, dnat string) string {
	dsts := []netip.AddrPort{netip.AddrPortFrom(tr.r.Destination, uint16(tr.r.DestinationPort))}
	if ap, err := netip.ParseAddrPort(dnat); err == nil {
		dsts = append(dsts, ap)
	}
	f := strings.Split(flags, ",")
	for _, dst := range dsts {
		addrOf := func(flag string) netip.Addr {
			if flag == "dst" {
				return dst.Addr()
			}
			return tr.r.Source
		}
		for _, e := range tr.sets[set] {
			parts := strings.Split(e, ",")
			if len(parts) != len(f) || !inEntry(parts[0], addrOf(f[0])) {
				continue
			}
			if len(parts) >= 2 {
				port := SourcePort
				if f[1] == "dst" {
					port = int(dst.Port())
				}
				if parts[1] != tr.r.Protocol+":"+strconv.Itoa(port) {
					continue
				}
			}
			if len(parts) == 3 && !inEntry(parts[2], addrOf(f[2])) {
				continue
			}
			return e
		}
	}
	return ""
}

func inEntry(part string, a netip.Addr) bool {
	if p, err := netip.ParsePrefix(part); err == nil {
		return p.Contains(a)
	}
	e, err := netip.ParseAddr(part)
	return err == nil && e == a
}

// holds reports whether set (its IPv4 name) has the entry of the packet's
// destination, protocol and port.
func (tr *ipvsTrace) holds(base string) bool {
	want := tr.r.Destination.String() + "," + tr.r.Protocol + ":" + strconv.Itoa(tr.r.DestinationPort)
	return slices.Contains(tr.sets[cleanup.SetName(base, tr.ipv6)], want)
}

// label names the Service of the packet's destination by its virtual
// server and the kind of destination: "ClusterIP TCP 10.96.0.10:80".
func (tr *ipvsTrace) label() string {
	vs := strings.ToUpper(tr.r.Protocol) + " " + netip.AddrPortFrom(tr.r.Destination, uint16(tr.r.DestinationPort)).String()
	for _, k := range ipvsKinds {
		if tr.holds(k.set) {
			return k.kind + " " + vs
		}
	}
	return ""
}

// reason explains a drop or reject by a rule of IPVS mode: the set its
// last rule matched says which policy caused it.
func (tr *ipvsTrace) reason(verdict string, path []string, label string) {
	rep := tr.rep
	if len(path) == 0 {
		return
	}
	last := iptRuleAt(tr.fake, path[len(path)-1])
	chain := last.chain
	matched := map[string]bool{}
	for _, m := range setMatches(last.text) {
		if !m.negate {
			matched[strings.TrimSuffix(m.name, "6")] = true
		}
	}
	svc := rep.Service
	if svc == "" {
		svc = label
		rep.Service = label
	}
	switch {
	case verdict == Dropped && matched[cleanup.SetInternalDrop]:
		rep.Reason = dropLocal("internalTrafficPolicy", svc)
	case verdict == Dropped && matched[cleanup.SetExternalDrop]:
		rep.Reason = dropLocal("externalTrafficPolicy", svc)
	case verdict == Rejected && matched[cleanup.SetNodePortReject]:
		rep.Reason = rejectNoEndpoints(svc)
	case verdict == Dropped && (chain == ipvsChainSourceRanges || chain == ipvsChainNodeFWSrc):
		rep.Reason = dropSourceRange(tr.r.Source, svc)
	case verdict == Rejected && chain == ipvsChainFilter:
		rep.Service = ""
		rep.Reason = fmt.Sprintf("rejected: no Service uses %s port %d of %s, an address kproxy holds on the IPVS dummy device", tr.r.Protocol,
			tr.r.DestinationPort, tr.r.Destination)
	default:
		rep.Reason = fmt.Sprintf("%s by %s/%s rule %d (%s)", verdict, last.table, chain, last.n, iptComment(last.text))
	}
}
