package app

import (
	"context"
	"net/netip"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	netutils "k8s.io/utils/net"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// Waiting for this node's Node object and its addresses at start-up, as
// kube-proxy does: at most defaultNodeIPTimeout, polling every
// nodeIPPollInterval.
const (
	defaultNodeIPTimeout = 30 * time.Second
	nodeIPPollInterval   = time.Second
)

// nodeIPs are this node's primary IP per family; a family without one is
// absent.
type nodeIPs map[v1.IPFamily]netip.Addr

// detectNodeIPs finds this node's primary IP of each family as kube-proxy
// does: --bind-address when it is a specific address (for its family),
// else the Node object's addresses (the first InternalIP, else the first
// ExternalIP, and the first address of the other family in the same
// order). It waits up to timeout for the Node to exist with an address;
// without one it goes on with what it has, possibly nothing. Loopback
// addresses count as unknown. It logs what it found.
func detectNodeIPs(ctx context.Context, client kubernetes.Interface, nodeName, bindAddress string, timeout time.Duration) nodeIPs {
	logger := klog.FromContext(ctx)
	var out nodeIPs
	var node *v1.Node
	var lastErr error
	poll := func(ctx context.Context) (bool, error) {
		n, err := client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		switch {
		case err == nil:
			node, lastErr = n, nil
			return len(nodeAddressIPs(n)) > 0, nil
		case apierrors.IsNotFound(err):
			lastErr = nil
		default:
			lastErr = err
		}
		return false, nil
	}
	if err := wait.PollUntilContextTimeout(ctx, nodeIPPollInterval, timeout, true, poll); err != nil {
		switch {
		case lastErr != nil:
			logger.Error(lastErr, "Cannot read this node's Node object; going on without its addresses", "node", nodeName)
		case node == nil:
			logger.Info("Timed out waiting for this node's Node object; going on without its addresses", "node", nodeName, "timeout", timeout)
		default:
			logger.Info("This node's Node object has no InternalIP or ExternalIP address", "node", klog.KObj(node))
		}
	}
	out = primaryNodeIPs(node, bindAddress)
	if len(out) == 0 {
		logger.Info("Cannot determine this node's primary IP; if one is needed (--nodeport-addresses=primary), set --bind-address")
	} else {
		logger.Info("Detected this node's primary IPs", "nodeIPs", out)
	}
	return out
}

// primaryNodeIPs are this node's primary IP of each family, from its Node
// object (nil: none) and bindAddress, as detectNodeIPs describes.
func primaryNodeIPs(node *v1.Node, bindAddress string) nodeIPs {
	out := nodeIPs{}
	if node != nil {
		for _, ip := range nodeAddressIPs(node) {
			fam := familyOf(ip)
			if _, ok := out[fam]; !ok {
				out[fam] = ip
			}
		}
	}
	if ip := parseIPSloppy(bindAddress); ip.IsValid() && !ip.IsUnspecified() {
		out[familyOf(ip)] = ip
	}
	for fam, ip := range out {
		if ip.IsLoopback() {
			delete(out, fam)
		}
	}
	return out
}

// nodeAddressIPs are the Node's InternalIPs then its ExternalIPs.
func nodeAddressIPs(node *v1.Node) []netip.Addr {
	var out []netip.Addr
	for _, typ := range []v1.NodeAddressType{v1.NodeInternalIP, v1.NodeExternalIP} {
		for _, a := range node.Status.Addresses {
			if a.Type != typ {
				continue
			}
			if ip := parseIPSloppy(a.Address); ip.IsValid() {
				out = append(out, ip)
			}
		}
	}
	return out
}

// parseIPSloppy parses an IP address as Kubernetes does (leading zeros in
// IPv4 octets allowed), unmapping IPv4-mapped IPv6 addresses; the zero
// Addr when s is not one.
func parseIPSloppy(s string) netip.Addr {
	ip := netutils.ParseIPSloppy(s)
	if ip == nil {
		return netip.Addr{}
	}
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap()
}

// logNodePortAddresses says, at start-up, what a family's
// --nodeport-addresses amount to when that differs from what the flag
// seems to say.
func logNodePortAddresses(logger klog.Logger, npa *proxy.NodePortAddresses) {
	if npa.PrimaryUnknown() {
		logger.Info("Warning: --nodeport-addresses has \"primary\" but this node's primary IP of the family is unknown",
			"family", npa.Family(), "nodePortAddresses", npa.String())
	}
	if npa.ContainsExplicitLoopback() {
		logger.Info("--nodeport-addresses names loopback addresses: kproxy never serves NodePorts on them",
			"family", npa.Family(), "nodePortAddresses", npa.String())
	}
	logger.V(2).Info("NodePort addresses", "family", npa.Family(), "nodePortAddresses", npa.String())
}
