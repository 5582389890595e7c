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

// renderer turns ServiceStates into plans for one family.
type renderer struct {
	ipv6        bool
	scheduler   string
	clusterCIDR netip.Prefix
	// nodePortAddrs are the local addresses that accept node ports.
	nodePortAddrs []netip.Addr
	// localAddrs are every local address of the family but the dummy
	// device's (for source ranges that include the node).
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
	lp := strings.ToLower(string(st.Protocol))
	port := uint16(st.Port)
	p := &servicePlan{}
	ipPort := func(set string, ip netip.Addr, port uint16) {
		p.entries = append(p.entries, setEntry{r.set(set), ipset.Entry{IP: ip, Protocol: lp, Port: port}})
	}
	newVS := func(addr netip.Addr, port uint16, eps []*proxy.Endpoint) {
		vs := &virtualServer{svc: ipvs.Service{Address: addr, Protocol: proto, Port: port, Scheduler: r.scheduler}}
		if st.SessionAffinityClientIP {
			vs.svc.Persistent = true
			vs.svc.Timeout = uint32(st.StickyMaxAgeSeconds)
		}
		for _, ep := range eps {
			if ep.IP.Is6() == r.ipv6 && ep.Port > 0 && ep.Port < 65536 {
				vs.dests = append(vs.dests, destKey{ep.IP, uint16(ep.Port)})
			}
		}
		slices.SortFunc(vs.dests, compareDest)
		vs.dests = slices.Compact(vs.dests)
		p.vs = append(p.vs, vs)
	}
	name := st.Name.String()
	pm := "-p " + lp + " -m " + lp + " --dport "
	external := st.ExternalEndpoints()
	extLocal := st.ExternalPolicyLocal
	// Local external policy without a local endpoint drops external
	// traffic; without any endpoint at all, IPVS itself rejects (a virtual
	// server without real servers answers ICMP port unreachable).
	extDrop := extLocal && st.HasAnyEndpoints && !st.HasLocalEndpoints()
	// Pods and the node reaching a Local external destination use the
	// cluster endpoints, through the ClusterIP (see chainShortcut).
	shortcut := extLocal && len(st.ClusterEndpoints) > 0
	dnat := " -j DNAT --to-destination " + netip.AddrPortFrom(st.ClusterIP, port).String()
	if shortcut && st.InternalPolicyLocal && !st.SessionAffinityClientIP {
		// The ClusterIP virtual server has the local endpoints only: the
		// short-circuited traffic goes to the cluster endpoints through a
		// chain of its own instead, as in iptables mode. (With ClientIP
		// affinity it keeps using the ClusterIP virtual server, whose
		// persistence the statistic rules could not give.)
		chain := clusterChain(st.Name)
		p.chains = map[string][]string{chain: r.clusterRules(st, lp)}
		dnat = " -j " + chain
	}

	// ClusterIP.
	newVS(st.ClusterIP, port, st.InternalEndpoints())
	p.addrs = append(p.addrs, st.ClusterIP)
	ipPort(setClusterIP, st.ClusterIP, port)
	if st.InternalPolicyLocal && st.HasAnyEndpoints && !st.HasLocalEndpoints() {
		ipPort(setInternalDrop, st.ClusterIP, port)
	}

	// ExternalIPs.
	for _, ip := range st.ExternalIPs {
		newVS(ip, port, external)
		p.addrs = append(p.addrs, ip)
		ipPort(setExternalIP, ip, port)
		if extLocal {
			ipPort(setExternalIPLocal, ip, port)
		}
		if extDrop {
			ipPort(setExternalDrop, ip, port)
		}
		if shortcut {
			p.shortcut = append(p.shortcut, comment(name+" external IP")+" -d "+hostPrefix(ip)+" "+pm+strconv.Itoa(st.Port)+dnat)
		}
	}

	// LoadBalancer VIPs.
	for _, ip := range st.LoadBalancerVIPs {
		newVS(ip, port, external)
		p.addrs = append(p.addrs, ip)
		ipPort(setLoadBalancer, ip, port)
		if extLocal {
			ipPort(setLoadBalancerLoc, ip, port)
		}
		if extDrop {
			ipPort(setExternalDrop, ip, port)
		}
		if shortcut {
			p.shortcut = append(p.shortcut, comment(name+" loadbalancer IP")+" -d "+hostPrefix(ip)+" "+pm+strconv.Itoa(st.Port)+dnat)
		}
		if len(st.LoadBalancerSourceRanges) == 0 {
			continue
		}
		ipPort(setLoadBalancerFW, ip, port)
		fromNode := false
		for _, cidr := range st.LoadBalancerSourceRanges {
			for _, n := range splitZero(cidr) {
				p.entries = append(p.entries, setEntry{r.set(setLBSourceCIDR), ipset.Entry{IP: ip, Protocol: lp, Port: port, Net: n}})
			}
			for _, a := range r.localAddrs {
				if cidr.Contains(a) {
					fromNode = true
				}
			}
		}
		if fromNode {
			// The node reaching a VIP bound to a local device uses the VIP
			// as its source address.
			p.entries = append(p.entries, setEntry{r.set(setLBSourceIP), ipset.Entry{IP: ip, Protocol: lp, Port: port, IP2: ip}})
		}
	}

	// NodePort, on every selected node address.
	if st.NodePort > 0 && st.NodePort < 65536 {
		np := uint16(st.NodePort)
		for _, a := range r.nodePortAddrs {
			newVS(a, np, external)
			ipPort(setNodePort, a, np)
			if extLocal {
				ipPort(setNodePortLocal, a, np)
			}
			if extDrop {
				ipPort(setExternalDrop, a, np)
			}
		}
		if shortcut && len(r.nodePortAddrs) > 0 {
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
	for _, a := range p.addrs {
		p.entries = append(p.entries, setEntry{r.set(setIPVSAddresses), ipset.Entry{IP: a}})
	}

	// Hairpin: an endpoint that may reach itself through the service
	// (local, or of unknown node) is masqueraded when it does.
	for _, ep := range st.AllEndpoints {
		if (ep.IsLocal || ep.NodeName == "") && ep.IP.Is6() == r.ipv6 && ep.Port > 0 && ep.Port < 65536 {
			p.entries = append(p.entries, setEntry{r.set(setLoopBack), ipset.Entry{IP: ep.IP, Protocol: lp, Port: uint16(ep.Port), IP2: ep.IP}})
		}
	}
	return p
}

// clusterRules spread new connections evenly over st's cluster endpoints
// of this family.
func (r *renderer) clusterRules(st *proxy.ServiceState, lp string) []string {
	var eps []netip.AddrPort
	for _, ep := range st.ClusterEndpoints {
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
