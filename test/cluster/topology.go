package cluster

import (
	"fmt"
	"runtime"
	"strings"
)

// Names and addresses of the topology described in test/LOCAL-CLUSTER.md.
const (
	// NetNSPrefix starts the name of every network namespace the local
	// cluster creates; Down removes every namespace named so.
	NetNSPrefix = "kpc-"
	// SwitchNetNS holds the bridge joining nodes, client and control plane.
	SwitchNetNS = "kpc-sw"
	// ControlPlaneNetNS holds etcd and the Kubernetes control plane.
	ControlPlaneNetNS = "kpc-cp"
	// ClientNetNS is the external client, outside the cluster.
	ClientNetNS = "kpc-client"
	// PodNetNSPrefix starts a pod's namespace name; the rest is the first
	// eight characters of the Pod's UID.
	PodNetNSPrefix = "kpc-p-"
	// HostLink is the host end of the veth pair to the control plane.
	HostLink = "kpc-host"

	// ClusterCIDR holds every node's podCIDR (10.244.<i>.0/24).
	ClusterCIDR = "10.244.0.0/16"
	// ServiceCIDR is the Service ClusterIP range.
	ServiceCIDR = "10.96.0.0/16"
	// KubernetesServiceIP is the first ClusterIP, the API server's Service.
	KubernetesServiceIP = "10.96.0.1"
	// ExternalVIPCIDR is where tests take ExternalIPs and LoadBalancer IPs.
	ExternalVIPCIDR = "10.253.0.0/24"

	// SwitchCIDR is the subnet on the switch.
	SwitchCIDR = "10.254.0.0/24"
	// ControlPlaneIP is the control plane's address on the switch.
	ControlPlaneIP = "10.254.0.2"
	// ClientIP is the external client's address.
	ClientIP = "10.254.0.100"
	// DeadGatewayIP is the default gateway of nodes and client: nobody holds
	// it, so unrouted traffic dies on the switch.
	DeadGatewayIP = "10.254.0.254"
	// DeadGatewayMAC is the permanent neighbour entry for DeadGatewayIP: a
	// locally administered address no interface has.
	DeadGatewayMAC = "02:00:0a:fe:00:fe"
	// HostIP is the host's end of the /30 to the control plane.
	HostIP = "10.254.1.1"
	// ControlPlaneHostSideIP is the control plane's end of that /30; the
	// host kubeconfig points at it.
	ControlPlaneHostSideIP = "10.254.1.2"
	// HostLinkPrefixLen is the prefix length of the host /30.
	HostLinkPrefixLen = 30

	// APIServerPort is the API server's secure port.
	APIServerPort = 6443

	// MaxNodes bounds --nodes: node addresses are 10.254.0.(10+i) below
	// the client's .100.
	MaxNodes = 89

	// Labels the local cluster sets on its nodes.
	LabelZone     = "topology.kubernetes.io/zone"
	LabelHostname = "kubernetes.io/hostname"
	LabelGroup    = "kpc.kproxy.io/group"
)

// NodeName is the name of node i (1-based).
func NodeName(i int) string { return fmt.Sprintf("node-%d", i) }

// NodeNetNS is the network namespace of node i.
func NodeNetNS(i int) string { return fmt.Sprintf("kpc-node-%d", i) }

// NodeIP is node i's address on the switch.
func NodeIP(i int) string { return fmt.Sprintf("10.254.0.%d", 10+i) }

// NodePodCIDR is node i's podCIDR.
func NodePodCIDR(i int) string { return fmt.Sprintf("10.244.%d.0/24", i) }

// NodeZone is node i's topology.kubernetes.io/zone: zone-a for odd nodes,
// zone-b for even ones.
func NodeZone(i int) string { return "zone-" + string(rune('a'+(i-1)%2)) }

// NodeLabels are node i's labels.
func NodeLabels(i int) map[string]string {
	return map[string]string{
		LabelHostname:        NodeName(i),
		LabelZone:            NodeZone(i),
		LabelGroup:           fmt.Sprintf("g%d", i%2),
		"kubernetes.io/os":   "linux",
		"kubernetes.io/arch": runtime.GOARCH,
	}
}

// PodNetNS is the network namespace of the Pod with this UID.
func PodNetNS(uid string) string {
	if len(uid) > 8 {
		uid = uid[:8]
	}
	return PodNetNSPrefix + uid
}

// nodeIndex returns i for "node-<i>" within 1..nodes.
func nodeIndex(name string, nodes int) (int, bool) {
	rest, ok := strings.CutPrefix(name, "node-")
	if !ok {
		return 0, false
	}
	var i int
	if _, err := fmt.Sscanf(rest, "%d", &i); err != nil || fmt.Sprint(i) != rest {
		return 0, false
	}
	return i, i >= 1 && i <= nodes
}

// validateNodes checks a node count.
func validateNodes(n int) error {
	if n < 1 || n > MaxNodes {
		return fmt.Errorf("nodes must be within 1..%d, got %d", MaxNodes, n)
	}
	return nil
}
