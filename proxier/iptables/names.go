package iptables

import (
	"crypto/sha256"
	"encoding/base32"
	"strings"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier/cleanup"
)

// Every chain kproxy owns starts with chainPrefix (see package cleanup).
const chainPrefix = cleanup.ChainPrefix

// Chains shared by all services.
const (
	// nat
	chainServices    = "KPROXY-SERVICES"    // dispatch on destination address (nat and filter)
	chainNodePorts   = "KPROXY-NODEPORTS"   // dispatch on protocol and port (nat); health-check accepts (filter)
	chainPostrouting = "KPROXY-POSTROUTING" // hairpin and mark-driven masquerade
	chainMarkMasq    = "KPROXY-MARK-MASQ"
	chainHairpin     = "KPROXY-HAIRPIN" // dispatch on source address: endpoints reaching themselves
	chainCanary      = "KPROXY-CANARY"  // one rule; empty or absent means someone flushed the table
	// filter
	chainExternalServices = "KPROXY-EXTERNAL-SERVICES" // reject/drop for external destinations
	chainExternalNodePort = "KPROXY-EXT-NODEPORTS"     // reject/drop for node ports
	chainFirewall         = "KPROXY-FIREWALL"          // loadBalancerSourceRanges drops
	chainForward          = "KPROXY-FORWARD"
)

// Per-service-port chain kinds.
const (
	kindCluster  = "SVC" // cluster-policy endpoints
	kindLocal    = "SVL" // local-policy endpoints
	kindExternal = "EXT" // external-destination handling
	kindFirewall = "FW"  // loadBalancerSourceRanges
)

// servicePortChain names a per-service-port chain: the prefix, the kind and
// 16 base32 characters of a hash of the port name and protocol (27 characters
// at most; iptables allows 28).
func servicePortChain(kind string, name proxy.ServicePortName) string {
	return servicePortChains(name).chain(kind)
}

// portChainHash is the hash part of a service port's chain names.
type portChainHash [16]byte

// servicePortChains hashes a service port's name once for all its chains.
func servicePortChains(name proxy.ServicePortName) portChainHash {
	sum := sha256.Sum256([]byte(name.String() + "/" + strings.ToLower(string(name.Protocol))))
	var enc [56]byte
	base32.StdEncoding.Encode(enc[:], sum[:])
	return portChainHash(enc[:16])
}

// chain is the port's chain of kind.
func (h portChainHash) chain(kind string) string {
	return chainPrefix + kind + "-" + string(h[:])
}

// recentName is the -m recent list of one endpoint of one service port, for
// session affinity.
func recentName(name proxy.ServicePortName, ep *proxy.Endpoint) string {
	sum := sha256.Sum256([]byte(name.String() + "/" + strings.ToLower(string(name.Protocol)) + "/" + ep.String()))
	return "KPROXY-AFF-" + base32.StdEncoding.EncodeToString(sum[:])[:16]
}

// isOwnedChain reports whether chain is one kproxy creates, in either mode.
func isOwnedChain(chain string) bool { return cleanup.IsChain(chain) }
