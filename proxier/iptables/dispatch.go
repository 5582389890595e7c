package iptables

import (
	"fmt"
	"net/netip"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
)

// Upstream kube-proxy matches services one rule after another in
// KUBE-SERVICES, so the first packet to the 10,000th service walks 10,000
// rules. kproxy keeps the walk short with a two-level dispatch tree: a rule
// lives in a leaf chain chosen by a small key (the low byte of the
// destination address, or the protocol and high bits of a node port), and
// the root and level-1 chains hold at most 16 jumps each (per protocol for
// node ports). Addresses of ClusterIPs are allocated at random, so the low
// byte spreads services evenly: at 10,000 services a packet walks about
// 16 + 16 + 40 rules instead of 10,000. Small rule sets stay flat in the root
// chain, where they are easiest to read.

// flatDispatchMax is the number of rules up to which a dispatch chain stays flat.
const flatDispatchMax = 64

// dispatchRule is one rule of a dispatch tree: its body (the rule after
// "-A CHAIN") and its bucket, computed by the tree's bucketer.
type dispatchRule struct {
	bucket bucket
	body   string
}

// bucket places a rule in the tree: l1 and l2 identify the level-1 and
// leaf chains.
type bucket struct {
	l1, l2 int
}

// bucketer maps keys to buckets and buckets to chain suffixes and matches.
type bucketer interface {
	l1Suffix(l1 int) string
	l2Suffix(l2 int) string
	l1Match(l1 int) string
	l2Match(l2 int) string
}

// addrBucketer dispatches on the low byte of the destination address: level 1
// on its low four bits, level 2 on the whole byte. iptables accepts
// non-contiguous masks (-d 0.0.0.5/0.0.0.255), in both families.
type addrBucketer struct {
	ipv6 bool
	// source dispatches on the source address instead.
	source bool
}

func (a addrBucketer) flag() string {
	if a.source {
		return "-s "
	}
	return "-d "
}

func addrBucket(ip netip.Addr) bucket {
	s := ip.AsSlice()
	b := int(s[len(s)-1])
	return bucket{l1: b & 0xf, l2: b}
}

func (a addrBucketer) l1Suffix(l1 int) string { return fmt.Sprintf("%x", l1) }
func (a addrBucketer) l2Suffix(l2 int) string { return fmt.Sprintf("%02x", l2) }
func (a addrBucketer) l1Match(l1 int) string {
	if a.ipv6 {
		return a.flag() + fmt.Sprintf("::%x/::f", l1)
	}
	return a.flag() + fmt.Sprintf("0.0.0.%d/0.0.0.15", l1)
}
func (a addrBucketer) l2Match(l2 int) string {
	if a.ipv6 {
		return a.flag() + fmt.Sprintf("::%x/::ff", l2)
	}
	return a.flag() + fmt.Sprintf("0.0.0.%d/0.0.0.255", l2)
}

// portBucketer dispatches node ports on protocol and port: level 1 on the
// port's high byte (a 256-port range), level 2 on a 16-port range.
type portBucketer struct{}

var protoLetters = map[v1.Protocol]int{v1.ProtocolTCP: 0, v1.ProtocolUDP: 1, v1.ProtocolSCTP: 2}
var protoByIndex = []string{"tcp", "udp", "sctp"}

func portBucket(proto v1.Protocol, port int) bucket {
	p := protoLetters[proto]
	return bucket{l1: p<<8 | port>>8, l2: p<<12 | port>>4}
}

func (portBucketer) l1Suffix(l1 int) string {
	return fmt.Sprintf("%c%02x", "TUS"[l1>>8], l1&0xff)
}
func (portBucketer) l2Suffix(l2 int) string {
	return fmt.Sprintf("%c%03x", "TUS"[l2>>12], l2&0xfff)
}
func (portBucketer) l1Match(l1 int) string {
	proto := protoByIndex[l1>>8]
	lo := (l1 & 0xff) << 8
	return fmt.Sprintf("-p %s -m %s --dport %d:%d", proto, proto, lo, lo+255)
}
func (portBucketer) l2Match(l2 int) string {
	proto := protoByIndex[l2>>12]
	lo := (l2 & 0xfff) << 4
	return fmt.Sprintf("-p %s -m %s --dport %d:%d", proto, proto, lo, lo+15)
}

// dispatchTree renders one dispatch tree: a root chain, optional level-1 and
// leaf chains, and optional tail rules that always end the root chain.
type dispatchTree struct {
	root     string
	bucketer bucketer
}

// render returns every chain of the tree with its rule bodies. rules must
// be in a deterministic order (the caller sorts services by name). Chains
// that would be empty are omitted, except the root, which always exists.
func (t dispatchTree) render(rules []dispatchRule, tail []string) map[string][]string {
	out := map[string][]string{}
	if len(rules) <= flatDispatchMax {
		root := make([]string, 0, len(rules)+len(tail))
		for _, r := range rules {
			root = append(root, r.body)
		}
		out[t.root] = append(root, tail...)
		return out
	}
	leaves := map[int][]string{}
	l1Children := map[int]map[int]bool{}
	for _, r := range rules {
		leaves[r.bucket.l2] = append(leaves[r.bucket.l2], r.body)
		if l1Children[r.bucket.l1] == nil {
			l1Children[r.bucket.l1] = map[int]bool{}
		}
		l1Children[r.bucket.l1][r.bucket.l2] = true
	}
	var root []string
	for _, l1 := range sortedKeys(l1Children) {
		l1Chain := t.root + "-" + t.bucketer.l1Suffix(l1)
		root = append(root, t.bucketer.l1Match(l1)+" -j "+l1Chain)
		var l1Rules []string
		for _, l2 := range sortedKeys(l1Children[l1]) {
			leaf := t.root + "-" + t.bucketer.l2Suffix(l2)
			l1Rules = append(l1Rules, t.bucketer.l2Match(l2)+" -j "+leaf)
			out[leaf] = leaves[l2]
		}
		out[l1Chain] = l1Rules
	}
	out[t.root] = append(root, tail...)
	return out
}

func sortedKeys[V any](m map[int]V) []int {
	keys := make([]int, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	return keys
}

// isDispatchChainOf reports whether chain belongs to the tree rooted at root.
func isDispatchChainOf(root, chain string) bool {
	return chain == root || strings.HasPrefix(chain, root+"-")
}
