package cluster

import (
	"fmt"
	"path/filepath"
	"strings"
)

// Program names: binaries in the bin directory and process names in the
// pids file (node processes are "<program>/<node>").
const (
	progEtcd              = "etcd"
	progAPIServer         = "kube-apiserver"
	progControllerManager = "kube-controller-manager"
	progScheduler         = "kube-scheduler"
	progKpc               = "kpc"
	progKproxy            = "kproxy"
	progAgent             = "agent"
)

// requiredBinaries must all be in the bin directory.
var requiredBinaries = []string{progEtcd, progAPIServer, progControllerManager, progScheduler, progKpc, progKproxy}

// controlPlaneBinaries are what Options.ControlPlaneOnly needs.
var controlPlaneBinaries = []string{progEtcd, progAPIServer}

// controllers are the kube-controller-manager controllers the local cluster
// runs. There is no node lifecycle controller: nodes are never tainted or
// evicted, and their Ready condition is whatever the node agent says.
var controllers = []string{
	"endpointslice-controller",
	"endpointslice-mirroring-controller",
	"deployment-controller",
	"replicaset-controller",
	"garbage-collector-controller",
	"namespace-controller",
}

// disabledAdmission are default admission plugins the local cluster turns
// off: ServiceAccount needs a token controller and service accounts in
// every namespace; TaintNodesByCondition taints new nodes not-ready, and
// only the node lifecycle controller (not run) would lift the taint.
var disabledAdmission = []string{"ServiceAccount", "TaintNodesByCondition"}

// layout names the files of a state directory.
type layout struct{ dir string }

func (l layout) path(parts ...string) string {
	return filepath.Join(append([]string{l.dir}, parts...)...)
}

func (l layout) marker() string         { return l.path(".kpc-state") }
func (l layout) stateFile() string      { return l.path("state.json") }
func (l layout) pidsFile() string       { return l.path("pids") }
func (l layout) tokenFile() string      { return l.path("tokens.csv") }
func (l layout) pki(name string) string { return l.path("pki", name) }
func (l layout) logFile(name string) string {
	return l.path("logs", strings.ReplaceAll(name, "/", "-")+".log")
}
func (l layout) etcdData() string           { return l.path("etcd") }
func (l layout) hostKubeconfig() string     { return l.path("kubeconfig") }
func (l layout) cpKubeconfig() string       { return l.path("control-plane.kubeconfig") }
func (l layout) nodeDir(node string) string { return l.path("nodes", node) }
func (l layout) agentKubeconfig(node string) string {
	return filepath.Join(l.nodeDir(node), "agent.kubeconfig")
}
func (l layout) kproxyKubeconfig(node string) string {
	return filepath.Join(l.nodeDir(node), "kproxy.kubeconfig")
}

func etcdArgs(l layout) []string {
	return []string{
		"--name=kpc",
		"--data-dir=" + l.etcdData(),
		"--listen-client-urls=http://127.0.0.1:2379",
		"--advertise-client-urls=http://127.0.0.1:2379",
		"--listen-peer-urls=http://127.0.0.1:2380",
		"--initial-advertise-peer-urls=http://127.0.0.1:2380",
		"--initial-cluster=kpc=http://127.0.0.1:2380",
		"--listen-metrics-urls=http://127.0.0.1:2381",
		// A throwaway cluster: speed over durability.
		"--unsafe-no-fsync",
		"--log-level=warn",
	}
}

func apiServerArgs(l layout) []string {
	return []string{
		"--etcd-servers=http://127.0.0.1:2379",
		"--bind-address=0.0.0.0",
		fmt.Sprintf("--secure-port=%d", APIServerPort),
		"--advertise-address=" + ControlPlaneIP,
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--cert-dir=" + l.pki("apiserver"),
		"--tls-cert-file=" + l.pki("apiserver.crt"),
		"--tls-private-key-file=" + l.pki("apiserver.key"),
		"--client-ca-file=" + l.pki("ca.crt"),
		"--token-auth-file=" + l.tokenFile(),
		"--authorization-mode=Node,RBAC",
		"--service-account-key-file=" + l.pki("sa.pub"),
		"--service-account-signing-key-file=" + l.pki("sa.key"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--disable-admission-plugins=" + strings.Join(disabledAdmission, ","),
		"--allow-privileged=true",
		"--profiling=false",
		"--v=1",
	}
}

func controllerManagerArgs(l layout) []string {
	return []string{
		"--kubeconfig=" + l.cpKubeconfig(),
		"--controllers=" + strings.Join(controllers, ","),
		"--cluster-cidr=" + ClusterCIDR,
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--leader-elect=false",
		"--use-service-account-credentials=false",
		"--cert-dir=" + l.pki("controller-manager"),
		"--profiling=false",
		"--v=1",
	}
}

func schedulerArgs(l layout) []string {
	return []string{
		"--kubeconfig=" + l.cpKubeconfig(),
		"--leader-elect=false",
		"--cert-dir=" + l.pki("scheduler"),
		"--profiling=false",
		"--v=1",
	}
}

// KproxyArgs are the arguments of kproxy on node i in a cluster with this
// state directory and mode, before any extra flags (`kpc up --kproxy-arg`).
func KproxyArgs(stateDir string, i int, mode string) []string {
	return kproxyArgs(layout{stateDir}, i, mode, nil)
}

// kproxyArgs runs kproxy as a DaemonSet would on node i; extra flags come
// last so they override.
func kproxyArgs(l layout, i int, mode string, extra []string) []string {
	args := []string{
		"--kubeconfig=" + l.kproxyKubeconfig(NodeName(i)),
		"--hostname-override=" + NodeName(i),
		"--cluster-cidr=" + ClusterCIDR,
		"--proxy-mode=" + mode,
		"-v=2",
	}
	return append(args, extra...)
}

// AgentArgs are the arguments of `kpc` that run node i's agent in a
// cluster with this state directory.
func AgentArgs(stateDir string, i int) []string { return agentArgs(layout{stateDir}, i) }

// agentArgs runs `kpc agent` for node i.
func agentArgs(l layout, i int) []string {
	return []string{
		"agent",
		"--kubeconfig=" + l.agentKubeconfig(NodeName(i)),
		"--node-name=" + NodeName(i),
		"--node-ip=" + NodeIP(i),
		"--pod-cidr=" + NodePodCIDR(i),
		"--netns=" + NodeNetNS(i),
		"-v=2",
	}
}
