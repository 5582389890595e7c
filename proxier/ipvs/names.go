package ipvs

import (
	"crypto/sha256"
	"encoding/base32"
	"strings"

	"github.com/kproxy/kproxy/pkg/ipset"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// DefaultDummyDevice is the dummy device that holds every ClusterIP,
// ExternalIP and LoadBalancer VIP, so that packets to them are local and
// reach IPVS (upstream kube-proxy's kube-ipvs0).
const DefaultDummyDevice = "kproxy-ipvs0"

// ChainPrefix starts every iptables chain of IPVS mode. The iptables
// backend's chains start with "KPROXY-" too but never with this prefix, so
// each mode recognises its own chains and the other mode's leftovers.
const ChainPrefix = "KPROXY-IPVS-"

// IsChain reports whether chain is one IPVS mode creates.
func IsChain(chain string) bool { return strings.HasPrefix(chain, ChainPrefix) }

// iptables chains of IPVS mode. The rule set is constant: only the ipsets it
// matches change with services (except chainShortcut, which holds one DNAT
// rule per external destination of an externalTrafficPolicy=Local service).
const (
	// nat
	chainServices    = ChainPrefix + "SERVICES"      // from PREROUTING and OUTPUT: masquerade marks
	chainExternal    = ChainPrefix + "EXTERNAL"      // external destinations (ExternalIPs, LB VIPs, node ports)
	chainExtLocal    = ChainPrefix + "EXT-LOCAL"     // external destinations with externalTrafficPolicy=Local
	chainExtLocalFW  = ChainPrefix + "EXT-LOCAL-FW"  // LB IPs with source ranges: allowed sources go on to chainExtLocalSrc
	chainExtLocalSrc = ChainPrefix + "EXT-LOCAL-SRC" // pods and the node to Local external destinations: to chainShortcut
	chainShortcut    = ChainPrefix + "SHORTCUT"      // pods and the node to Local external destinations: to the ClusterIP
	chainPostrouting = ChainPrefix + "POSTROUTING"   // hairpin and mark-driven masquerade
	chainMarkMasq    = ChainPrefix + "MARK-MASQ"
	// filter
	chainInput        = ChainPrefix + "INPUT"         // drops before IPVS (LOCAL_IN runs after filter INPUT)
	chainSourceRanges = ChainPrefix + "SOURCE-RANGES" // loadBalancerSourceRanges
	chainForward      = ChainPrefix + "FORWARD"
	// chainFilter rejects new connections to an address on the dummy
	// device at a port no Service uses (upstream's KUBE-IPVS-FILTER): the
	// VIPs are local addresses, so a host process listening on a wildcard
	// address would otherwise answer on every VIP.
	chainFilter = ChainPrefix + "FILTER"
)

// clusterChain names the nat chain that spreads pods' and the node's
// traffic to the Local external destinations of a service port with both
// traffic policies Local over its cluster endpoints: 13 base32 characters
// of a hash of the port name and protocol (28 characters in all, the
// kernel's limit).
func clusterChain(name proxy.ServicePortName) string {
	sum := sha256.Sum256([]byte(name.String() + "/" + strings.ToLower(string(name.Protocol))))
	return ChainPrefix + "CL-" + base32.StdEncoding.EncodeToString(sum[:])[:13]
}

// ipset names. Every set kproxy creates starts with "KPROXY-"; an IPv6
// set's name ends in "6". Names stay within ipset.MaxNameLength.
const (
	setClusterIP        = "KPROXY-CLUSTER-IP"             // hash:ip,port: every ClusterIP,proto:port
	setLoopBack         = "KPROXY-LOOP-BACK"              // hash:ip,port,ip: endpoint,proto:port,endpoint (hairpin)
	setExternalIP       = "KPROXY-EXTERNAL-IP"            // hash:ip,port: every ExternalIP,proto:port
	setExternalIPLocal  = "KPROXY-EXTERNAL-IP-LOCAL"      // hash:ip,port: those with externalTrafficPolicy=Local
	setLoadBalancer     = "KPROXY-LOAD-BALANCER"          // hash:ip,port: every LB VIP,proto:port
	setLoadBalancerLoc  = "KPROXY-LOAD-BALANCER-LOCAL"    // hash:ip,port: those with externalTrafficPolicy=Local
	setLoadBalancerFW   = "KPROXY-LOAD-BALANCER-FW"       // hash:ip,port: LB VIPs with loadBalancerSourceRanges
	setLBSourceCIDR     = "KPROXY-LB-SOURCE-CIDR"         // hash:ip,port,net: VIP,proto:port,allowed range
	setLBSourceIP       = "KPROXY-LB-SOURCE-IP"           // hash:ip,port,ip: VIP,proto:port,VIP (the node itself)
	setNodePort         = "KPROXY-NODE-PORT"              // hash:ip,port: node address,proto:node port
	setNodePortLocal    = "KPROXY-NODE-PORT-LOCAL"        // hash:ip,port: those with externalTrafficPolicy=Local
	setInternalDrop     = "KPROXY-INTERNAL-DROP"          // hash:ip,port: ClusterIPs of iTP=Local without local endpoints
	setExternalDrop     = "KPROXY-EXTERNAL-DROP"          // hash:ip,port: external destinations of eTP=Local without local endpoints
	setHealthCheckNodeP = "KPROXY-HEALTH-CHECK-NODE-PORT" // hash:ip,port: node address,tcp:healthCheckNodePort
	setIPVSAddresses    = "KPROXY-IPVS-IPS"               // hash:ip: every address kproxy binds to the dummy device
)

// setDef is one set IPVS mode uses, for one family.
type setDef struct {
	base    string
	typ     ipset.Type
	comment string
}

// setDefs are every set of IPVS mode.
var setDefs = []setDef{
	{setClusterIP, ipset.HashIPPort, "kproxy service cluster IP + port for masquerade purpose"},
	{setLoopBack, ipset.HashIPPortIP, "kproxy endpoint dst ip:port, source ip for hairpin"},
	{setExternalIP, ipset.HashIPPort, "kproxy service external IP + port"},
	{setExternalIPLocal, ipset.HashIPPort, "kproxy service external IP + port with externalTrafficPolicy=Local"},
	{setLoadBalancer, ipset.HashIPPort, "kproxy service load balancer IP + port"},
	{setLoadBalancerLoc, ipset.HashIPPort, "kproxy service load balancer IP + port with externalTrafficPolicy=Local"},
	{setLoadBalancerFW, ipset.HashIPPort, "kproxy service load balancer IP + port with loadBalancerSourceRanges"},
	{setLBSourceCIDR, ipset.HashIPPortNet, "kproxy service load balancer IP + port + allowed source range"},
	{setLBSourceIP, ipset.HashIPPortIP, "kproxy service load balancer IP + port + allowed node source"},
	{setNodePort, ipset.HashIPPort, "kproxy node address + node port"},
	{setNodePortLocal, ipset.HashIPPort, "kproxy node address + node port with externalTrafficPolicy=Local"},
	{setInternalDrop, ipset.HashIPPort, "kproxy cluster IP + port without local endpoints (internalTrafficPolicy=Local)"},
	{setExternalDrop, ipset.HashIPPort, "kproxy external destination without local endpoints (externalTrafficPolicy=Local)"},
	{setHealthCheckNodeP, ipset.HashIPPort, "kproxy node address + health check node port"},
	{setIPVSAddresses, ipset.HashIP, "kproxy addresses bound to the IPVS dummy device"},
}

// setName is the name of base for the family.
func setName(base string, ipv6 bool) string {
	if ipv6 {
		return base + "6"
	}
	return base
}

// SetNames lists the names of every ipset IPVS mode creates for a family.
func SetNames(ipv6 bool) []string {
	out := make([]string, 0, len(setDefs))
	for _, d := range setDefs {
		out = append(out, setName(d.base, ipv6))
	}
	return out
}
