package ipvs

import (
	"crypto/sha256"
	"encoding/base32"
	"net/netip"
	"strings"

	"github.com/kproxy/kproxy/pkg/ipset"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// DefaultDummyDevice is the dummy device that holds every ClusterIP,
// ExternalIP and LoadBalancer VIP, so that packets to them are local and
// reach IPVS (upstream kube-proxy's kube-ipvs0).
const DefaultDummyDevice = cleanup.DefaultDummyDevice

// ChainPrefix starts every iptables chain of IPVS mode (see package
// cleanup, which names what each mode owns).
const ChainPrefix = cleanup.IPVSChainPrefix

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
	// mangle
	chainNodeFirewall    = ChainPrefix + "NODE-FW"     // from OUTPUT: the node's own traffic to LB IPs with source ranges
	chainNodeFirewallSrc = ChainPrefix + "NODE-FW-SRC" // allowed sources return, the rest is dropped
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

// ipset names (their IPv4 names; setName gives the family's), defined
// with their types in package cleanup.
const (
	setClusterIP        = cleanup.SetClusterIP
	setLoopBack         = cleanup.SetLoopBack
	setExternalIP       = cleanup.SetExternalIP
	setExternalIPLocal  = cleanup.SetExternalIPLocal
	setLoadBalancer     = cleanup.SetLoadBalancer
	setLoadBalancerLoc  = cleanup.SetLoadBalancerLoc
	setLoadBalancerFW   = cleanup.SetLoadBalancerFW
	setLBSourceCIDR     = cleanup.SetLBSourceCIDR
	setLBSourceIP       = cleanup.SetLBSourceIP
	setNodePort         = cleanup.SetNodePort
	setNodePortLocal    = cleanup.SetNodePortLocal
	setInternalDrop     = cleanup.SetInternalDrop
	setExternalDrop     = cleanup.SetExternalDrop
	setNodePortReject   = cleanup.SetNodePortReject
	setHealthCheckNodeP = cleanup.SetHealthCheckNodeP
	setIPVSAddresses    = cleanup.SetIPVSAddresses
	setCanary           = cleanup.SetCanary
)

// canaryEntry is the one entry of the canary set, which no rule matches:
// every sync keeps it, and a flush of every set (ipset flush) removes it
// (checkIntact).
func canaryEntry(ipv6 bool) setEntry {
	ip := netip.AddrFrom4([4]byte{127, 0, 0, 1})
	if ipv6 {
		ip = netip.IPv6Loopback()
	}
	return setEntry{setName(setCanary, ipv6), ipset.Entry{IP: ip}}
}

// setName is the name of base for the family.
func setName(base string, ipv6 bool) string { return cleanup.SetName(base, ipv6) }
