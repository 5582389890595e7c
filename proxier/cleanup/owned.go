package cleanup

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/kproxy/kproxy/pkg/ipset"
	"github.com/kproxy/kproxy/pkg/ipvs"
)

// ChainPrefix starts every iptables chain kproxy creates, in every proxy
// mode; never "KUBE-", so kproxy coexists with kube-proxy and cleans up
// independently of it.
const ChainPrefix = "KPROXY-"

// IPVSChainPrefix starts every iptables chain of IPVS mode. iptables
// mode's chains never start with it, so each mode recognises its own chains
// and the other mode's leftovers.
const IPVSChainPrefix = ChainPrefix + "IPVS-"

// IsChain reports whether chain is one kproxy creates, in either mode.
func IsChain(chain string) bool { return strings.HasPrefix(chain, ChainPrefix) }

// IsIPVSChain reports whether chain is one IPVS mode creates.
func IsIPVSChain(chain string) bool { return strings.HasPrefix(chain, IPVSChainPrefix) }

// IsIPTablesChain reports whether chain is one iptables mode creates.
func IsIPTablesChain(chain string) bool { return IsChain(chain) && !IsIPVSChain(chain) }

// DefaultDummyDevice is IPVS mode's dummy device, which holds every
// ClusterIP, ExternalIP and LoadBalancer VIP so that packets to them are
// local and reach IPVS (upstream kube-proxy's kube-ipvs0).
const DefaultDummyDevice = "kproxy-ipvs0"

// IPVS mode's ipsets, by their IPv4 names (SetName gives the IPv6 ones).
// Every name starts with "KPROXY-" and fits ipset.MaxNameLength.
const (
	SetClusterIP        = "KPROXY-CLUSTER-IP"             // hash:ip,port: every ClusterIP,proto:port
	SetLoopBack         = "KPROXY-LOOP-BACK"              // hash:ip,port,ip: endpoint,proto:port,endpoint (hairpin)
	SetExternalIP       = "KPROXY-EXTERNAL-IP"            // hash:ip,port: every ExternalIP,proto:port
	SetExternalIPLocal  = "KPROXY-EXTERNAL-IP-LOCAL"      // hash:ip,port: those with externalTrafficPolicy=Local
	SetLoadBalancer     = "KPROXY-LOAD-BALANCER"          // hash:ip,port: every LB VIP,proto:port
	SetLoadBalancerLoc  = "KPROXY-LOAD-BALANCER-LOCAL"    // hash:ip,port: those with externalTrafficPolicy=Local
	SetLoadBalancerFW   = "KPROXY-LOAD-BALANCER-FW"       // hash:ip,port: LB VIPs with loadBalancerSourceRanges
	SetLBSourceCIDR     = "KPROXY-LB-SOURCE-CIDR"         // hash:ip,port,net: VIP,proto:port,allowed range
	SetLBSourceIP       = "KPROXY-LB-SOURCE-IP"           // hash:ip,port,ip: VIP,proto:port,VIP (the node itself)
	SetNodePort         = "KPROXY-NODE-PORT"              // hash:ip,port: node address,proto:node port
	SetNodePortLocal    = "KPROXY-NODE-PORT-LOCAL"        // hash:ip,port: those with externalTrafficPolicy=Local
	SetInternalDrop     = "KPROXY-INTERNAL-DROP"          // hash:ip,port: ClusterIPs of iTP=Local without local endpoints
	SetExternalDrop     = "KPROXY-EXTERNAL-DROP"          // hash:ip,port: external destinations of eTP=Local without local endpoints
	SetNodePortReject   = "KPROXY-NODE-PORT-REJECT"       // hash:ip,port: node ports without endpoints on local addresses outside --nodeport-addresses
	SetHealthCheckNodeP = "KPROXY-HEALTH-CHECK-NODE-PORT" // hash:ip,port: node address,tcp:healthCheckNodePort
	SetIPVSAddresses    = "KPROXY-IPVS-IPS"               // hash:ip: every address kproxy binds to the dummy device
	SetCanary           = "KPROXY-CANARY"                 // hash:ip: one entry, no rule: an external flush of every set empties it
)

// IPVSSet is one ipset of IPVS mode: its IPv4 name, type and comment.
type IPVSSet struct {
	Name    string
	Type    ipset.Type
	Comment string
}

// IPVSSets returns every ipset of IPVS mode.
func IPVSSets() []IPVSSet {
	return []IPVSSet{
		{SetClusterIP, ipset.HashIPPort, "kproxy service cluster IP + port for masquerade purpose"},
		{SetLoopBack, ipset.HashIPPortIP, "kproxy endpoint dst ip:port, source ip for hairpin"},
		{SetExternalIP, ipset.HashIPPort, "kproxy service external IP + port"},
		{SetExternalIPLocal, ipset.HashIPPort, "kproxy service external IP + port with externalTrafficPolicy=Local"},
		{SetLoadBalancer, ipset.HashIPPort, "kproxy service load balancer IP + port"},
		{SetLoadBalancerLoc, ipset.HashIPPort, "kproxy service load balancer IP + port with externalTrafficPolicy=Local"},
		{SetLoadBalancerFW, ipset.HashIPPort, "kproxy service load balancer IP + port with loadBalancerSourceRanges"},
		{SetLBSourceCIDR, ipset.HashIPPortNet, "kproxy service load balancer IP + port + allowed source range"},
		{SetLBSourceIP, ipset.HashIPPortIP, "kproxy service load balancer IP + port + allowed node source"},
		{SetNodePort, ipset.HashIPPort, "kproxy node address + node port"},
		{SetNodePortLocal, ipset.HashIPPort, "kproxy node address + node port with externalTrafficPolicy=Local"},
		{SetInternalDrop, ipset.HashIPPort, "kproxy cluster IP + port without local endpoints (internalTrafficPolicy=Local)"},
		{SetExternalDrop, ipset.HashIPPort, "kproxy external destination without local endpoints (externalTrafficPolicy=Local)"},
		{SetNodePortReject, ipset.HashIPPort, "kproxy node port without endpoints on an address outside nodeport-addresses"},
		{SetHealthCheckNodeP, ipset.HashIPPort, "kproxy node address + health check node port"},
		{SetIPVSAddresses, ipset.HashIP, "kproxy addresses bound to the IPVS dummy device"},
		{SetCanary, ipset.HashIP, "kproxy canary: emptied only by a flush of every set"},
	}
}

// SetName is the name of the IPVS-mode set named name (its IPv4 name) for
// the family: an IPv6 set's name ends in "6".
func SetName(name string, ipv6 bool) string {
	if ipv6 {
		return name + "6"
	}
	return name
}

// IPVSSetNames lists the names of every ipset IPVS mode creates for a
// family.
func IPVSSetNames(ipv6 bool) []string {
	sets := IPVSSets()
	out := make([]string, 0, len(sets))
	for _, s := range sets {
		out = append(out, SetName(s.Name, ipv6))
	}
	return out
}

// VirtualServer identifies an IPVS virtual server.
type VirtualServer struct {
	Address  netip.Addr
	Protocol ipvs.Protocol
	Port     uint16
}

// VirtualServerOf identifies s.
func VirtualServerOf(s *ipvs.Service) VirtualServer {
	return VirtualServer{Address: s.Address, Protocol: s.Protocol, Port: s.Port}
}

// recordSets are the sets whose (address, protocol:port) entries name
// virtual servers: together they record every virtual server kproxy made.
var recordSets = []string{SetClusterIP, SetExternalIP, SetLoadBalancer, SetNodePort}

var setProtocols = map[string]ipvs.Protocol{
	ipset.ProtocolTCP: ipvs.ProtocolTCP, ipset.ProtocolUDP: ipvs.ProtocolUDP, ipset.ProtocolSCTP: ipvs.ProtocolSCTP,
}

// RecordedVirtualServers reads the virtual servers IPVS mode last recorded
// in its sets for a family: they are kproxy's. A sync adds a virtual
// server's entry before creating it and removes the entry after deleting
// it, so the record covers every virtual server kproxy ever left behind.
// A missing set records nothing.
func RecordedVirtualServers(ctx context.Context, sets ipset.Interface, ipv6 bool) (map[VirtualServer]bool, error) {
	out := map[VirtualServer]bool{}
	for _, base := range recordSets {
		name := SetName(base, ipv6)
		entries, err := sets.Entries(ctx, name)
		if errors.Is(err, ipset.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("reading set %s: %w", name, err)
		}
		for _, e := range entries {
			if p, ok := setProtocols[e.Protocol]; ok {
				out[VirtualServer{e.IP, p, e.Port}] = true
			}
		}
	}
	return out, nil
}
