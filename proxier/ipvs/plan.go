package ipvs

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// vsKey identifies a virtual server.
type vsKey struct {
	addr  netip.Addr
	proto ipvs.Protocol
	port  uint16
}

func keyOf(s *ipvs.Service) vsKey { return vsKey{s.Address, s.Protocol, s.Port} }

func (k vsKey) String() string {
	return string(k.proto) + " " + netip.AddrPortFrom(k.addr, k.port).String()
}

// destKey identifies a real server within a virtual server.
type destKey struct {
	addr netip.Addr
	port uint16
}

func (d destKey) String() string { return netip.AddrPortFrom(d.addr, d.port).String() }

// virtualServer is a virtual server kproxy wants, with its real servers
// (all of weight 1).
type virtualServer struct {
	svc   ipvs.Service
	dests []destKey // sorted, unique
}

// sameProps reports whether the kernel's service has the scheduler and
// persistence kproxy wants.
func (v *virtualServer) sameProps(k *ipvs.Service) bool {
	sched := k.Scheduler
	if sched == "" {
		sched = ipvs.DefaultScheduler
	}
	return sched == v.svc.Scheduler && k.Persistent == v.svc.Persistent && k.Timeout == v.svc.Timeout
}

// setEntry is one entry of one set (full name).
type setEntry struct {
	set   string
	entry ipset.Entry
}

// servicePlan is everything one service port needs from the kernel.
type servicePlan struct {
	vs    []*virtualServer
	addrs []netip.Addr // bound to the dummy device
	// entries are the port's set entries (a set entry may be shared by
	// several ports: the backend counts references).
	entries []setEntry
	// shortcut are rule bodies for chainShortcut (nat).
	shortcut []string
	// chains are the port's own nat chains (clusterChain), by name.
	chains map[string][]string
}

// renderer turns ServiceStates into plans for one family. It draws the
// model's decisions (proxy.ServiceDecisions) as virtual servers, set
// entries and short-circuit rules; the constant rules of rules.go say how
// each set is treated.
type renderer struct {
	ipv6      bool
	scheduler string
	// nodePortAddrs are the local addresses that accept node ports.
	nodePortAddrs []netip.Addr
	// localAddrs are every local address of the family but the dummy
	// device's: an ExternalIP or LoadBalancer IP that is one of them is
	// never bound to the dummy device (it would capture the node's own
	// address for IPVS, and the filter would then reject every other
	// port of it: sshd, the kubelet).
	localAddrs []netip.Addr
}

var ipvsProtocols = map[v1.Protocol]ipvs.Protocol{
	v1.ProtocolTCP: ipvs.ProtocolTCP, v1.ProtocolUDP: ipvs.ProtocolUDP, v1.ProtocolSCTP: ipvs.ProtocolSCTP,
}

func (r *renderer) set(base string) string { return setName(base, r.ipv6) }

// render returns st's plan; nil for a protocol IPVS cannot carry.
func (r *renderer) render(st *proxy.ServiceState) *servicePlan {
	proto, ok := ipvsProtocols[st.Protocol]
	if !ok {
		return nil
	}
	d := &st.Decisions
	lp := strings.ToLower(string(st.Protocol))
	port := uint16(st.Port)
	p := &servicePlan{}
	ipPort := func(set string, ip netip.Addr, port uint16) {
		p.entries = append(p.entries, setEntry{r.set(set), ipset.Entry{IP: ip, Protocol: lp, Port: port}})
	}
	// newVS adds the virtual server of one destination: its real servers
	// are the endpoints everyone else (proxy.SourceOther) is delivered to;
	// none when they are dropped or rejected (IPVS answers a virtual server
	// without real servers with ICMP port unreachable).
	newVS := func(kind proxy.DestinationKind, addr netip.Addr, port uint16) {
		vs := &virtualServer{svc: ipvs.Service{Address: addr, Protocol: proto, Port: port, Scheduler: r.scheduler}}
		if d.AffinitySeconds > 0 {
			vs.svc.Persistent = true
			vs.svc.Timeout = uint32(d.AffinitySeconds)
		}
		if dec := d.For(kind, proxy.SourceOther); dec.Verdict == proxy.VerdictDeliver {
			for _, ep := range st.Endpoints(dec.Endpoints) {
				if ep.IP.Is6() == r.ipv6 && ep.Port > 0 && ep.Port < 65536 {
					vs.dests = append(vs.dests, destKey{ep.IP, uint16(ep.Port)})
				}
			}
		}
		slices.SortFunc(vs.dests, compareDest)
		vs.dests = slices.Compact(vs.dests)
		p.vs = append(p.vs, vs)
	}
	// kindSets adds the per-destination set entries that the decisions of
	// kind call for: "Local" (everyone else keeps the client address; pods
	// and the node are handled by KPROXY-IPVS-EXT-LOCAL) and "drop".
	kindSets := func(kind proxy.DestinationKind, localSet, dropSet string, ip netip.Addr, port uint16) {
		other := d.For(kind, proxy.SourceOther)
		if localSet != "" && !other.Masquerade && other.Verdict != proxy.VerdictReject {
			ipPort(localSet, ip, port)
		}
		if other.Verdict == proxy.VerdictDrop {
			ipPort(dropSet, ip, port)
		}
	}
	name := st.Name.String()
	pm := "-p " + lp + " -m " + lp + " --dport "
	// shortcut is the target of the pods' and the node's short circuit
	// to the cluster endpoints: the ClusterIP virtual server when it has
	// those endpoints, else a chain of the port's own that balances over
	// them. (With ClientIP affinity it keeps using the ClusterIP virtual
	// server, whose persistence the statistic rules could not give.)
	cip := d.For(proxy.DestClusterIP, proxy.SourceOther)
	dnat := " -j DNAT --to-destination " + netip.AddrPortFrom(st.ClusterIP, port).String()
	shortcuts := func(kind proxy.DestinationKind) bool {
		return d.For(kind, proxy.SourcePod).ShortCircuit || d.For(kind, proxy.SourceNode).ShortCircuit
	}
	anyShortcut := shortcuts(proxy.DestNodePort) || shortcuts(proxy.DestExternalIP) || shortcuts(proxy.DestLoadBalancerIP)
	if anyShortcut && !(cip.Verdict == proxy.VerdictDeliver && cip.Endpoints == proxy.SelectCluster) && d.AffinitySeconds == 0 {
		chain := clusterChain(st.Name)
		p.chains = map[string][]string{chain: r.clusterRules(st, lp)}
		dnat = " -j " + chain
	}
	var bound []netip.Addr
	bind := func(ip netip.Addr) {
		if !slices.Contains(r.localAddrs, ip) {
			bound = append(bound, ip)
		}
	}

	// ClusterIP.
	newVS(proxy.DestClusterIP, st.ClusterIP, port)
	bind(st.ClusterIP)
	ipPort(setClusterIP, st.ClusterIP, port)
	kindSets(proxy.DestClusterIP, "", setInternalDrop, st.ClusterIP, port)

	// ExternalIPs.
	for _, ip := range st.ExternalIPs {
		newVS(proxy.DestExternalIP, ip, port)
		bind(ip)
		ipPort(setExternalIP, ip, port)
		kindSets(proxy.DestExternalIP, setExternalIPLocal, setExternalDrop, ip, port)
		if shortcuts(proxy.DestExternalIP) {
			p.shortcut = append(p.shortcut, comment(name+" external IP")+" -d "+hostPrefix(ip)+" "+pm+strconv.Itoa(st.Port)+dnat)
		}
	}

	// LoadBalancer VIPs.
	for _, ip := range st.LoadBalancerVIPs {
		newVS(proxy.DestLoadBalancerIP, ip, port)
		bind(ip)
		ipPort(setLoadBalancer, ip, port)
		kindSets(proxy.DestLoadBalancerIP, setLoadBalancerLoc, setExternalDrop, ip, port)
		if shortcuts(proxy.DestLoadBalancerIP) {
			p.shortcut = append(p.shortcut, comment(name+" loadbalancer IP")+" -d "+hostPrefix(ip)+" "+pm+strconv.Itoa(st.Port)+dnat)
		}
		if d.Firewall == nil {
			continue
		}
		ipPort(setLoadBalancerFW, ip, port)
		for _, cidr := range d.Firewall.Allowed {
			for _, n := range splitZero(cidr) {
				p.entries = append(p.entries, setEntry{r.set(setLBSourceCIDR), ipset.Entry{IP: ip, Protocol: lp, Port: port, Net: n}})
			}
		}
		if d.Firewall.AllowVIPSource {
			p.entries = append(p.entries, setEntry{r.set(setLBSourceIP), ipset.Entry{IP: ip, Protocol: lp, Port: port, IP2: ip}})
		}
	}

	// NodePort, on every selected node address.
	if d.Has(proxy.DestNodePort) && st.NodePort > 0 && st.NodePort < 65536 {
		np := uint16(st.NodePort)
		for _, a := range r.nodePortAddrs {
			newVS(proxy.DestNodePort, a, np)
			ipPort(setNodePort, a, np)
			kindSets(proxy.DestNodePort, setNodePortLocal, setExternalDrop, a, np)
		}
		// The node port's drop or reject holds on every local address,
		// also those that do not accept node ports (as iptables mode's
		// "-m addrtype --dst-type LOCAL" rule).
		if v := d.For(proxy.DestNodePort, proxy.SourceOther).Verdict; v == proxy.VerdictDrop || v == proxy.VerdictReject {
			for _, a := range r.localAddrs {
				if slices.Contains(r.nodePortAddrs, a) {
					continue
				}
				if v == proxy.VerdictDrop {
					ipPort(setExternalDrop, a, np)
				} else {
					ipPort(setNodePortReject, a, np)
				}
			}
		}
		if shortcuts(proxy.DestNodePort) && len(r.nodePortAddrs) > 0 {
			p.shortcut = append(p.shortcut, comment(name+" node port")+" -m set --match-set "+r.set(setNodePortLocal)+" dst,dst "+
				pm+strconv.Itoa(st.NodePort)+dnat)
		}
	}
	if st.HealthCheckNodePort > 0 && st.HealthCheckNodePort < 65536 {
		for _, a := range r.nodePortAddrs {
			p.entries = append(p.entries, setEntry{r.set(setHealthCheckNodeP), ipset.Entry{IP: a, Protocol: ipset.ProtocolTCP, Port: uint16(st.HealthCheckNodePort)}})
		}
	}

	// Every address bound to the dummy device, for the filter that
	// rejects its other ports.
	p.addrs = bound
	for _, a := range p.addrs {
		p.entries = append(p.entries, setEntry{r.set(setIPVSAddresses), ipset.Entry{IP: a}})
	}

	for _, ep := range d.Hairpin {
		if ep.IP.Is6() == r.ipv6 && ep.Port > 0 && ep.Port < 65536 {
			p.entries = append(p.entries, setEntry{r.set(setLoopBack), ipset.Entry{IP: ep.IP, Protocol: lp, Port: uint16(ep.Port), IP2: ep.IP}})
		}
	}
	return p
}

// clusterRules spread new connections evenly over the endpoints of the
// short circuit (the cluster endpoints) of this family.
func (r *renderer) clusterRules(st *proxy.ServiceState, lp string) []string {
	var eps []netip.AddrPort
	for _, ep := range st.Endpoints(proxy.SelectCluster) {
		if ep.IP.Is6() == r.ipv6 && ep.Port > 0 && ep.Port < 65536 {
			eps = append(eps, netip.AddrPortFrom(ep.IP, uint16(ep.Port)))
		}
	}
	c := comment(st.Name.String() + " cluster endpoints")
	rules := make([]string, 0, len(eps))
	for i, ep := range eps {
		rule := c
		if n := len(eps) - i; n > 1 {
			rule += fmt.Sprintf(" -m statistic --mode random --probability %0.10f", 1.0/float64(n))
		}
		rules = append(rules, rule+" -p "+lp+" -m "+lp+" -j DNAT --to-destination "+ep.String())
	}
	return rules
}

// splitZero splits a /0 prefix, which ipset refuses, into two halves.
func splitZero(p netip.Prefix) []netip.Prefix {
	p = p.Masked()
	if p.Bits() != 0 {
		return []netip.Prefix{p}
	}
	if p.Addr().Is4() {
		return []netip.Prefix{netip.MustParsePrefix("0.0.0.0/1"), netip.MustParsePrefix("128.0.0.0/1")}
	}
	return []netip.Prefix{netip.MustParsePrefix("::/1"), netip.MustParsePrefix("8000::/1")}
}

func compareDest(a, b destKey) int {
	if c := a.addr.Compare(b.addr); c != 0 {
		return c
	}
	return int(a.port) - int(b.port)
}

func hostPrefix(ip netip.Addr) string {
	return netip.PrefixFrom(ip, ip.BitLen()).String()
}

// comment is the shared comment match.
var comment = ipt.Comment
