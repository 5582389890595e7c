package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/test/cluster"
)

// demoOptions are the flags of `kpc demo`.
type demoOptions struct {
	Nodes    int
	Replicas int
	Requests int
	BinDir   string
	// Mode is kproxy's mode; a running cluster in another mode is
	// switched to it only when set explicitly (the flag or $KPC_MODE).
	Mode         string
	ModeExplicit bool
}

const demoNamespace = "demo"

func newDemoCommand(g *globalOptions, stdout io.Writer) *cobra.Command {
	o := &demoOptions{Nodes: 2, Replicas: 3, Requests: 12, Mode: defaultMode()}
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Start a cluster (if needed), deploy an echo service and show kproxy routing real requests",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := validateMode(o.Mode); err != nil {
				return err
			}
			o.ModeExplicit = cmd.Flags().Changed("mode") || os.Getenv(modeEnv) != ""
			ctx, cancel := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer cancel()
			return runDemo(ctx, g, o, stdout)
		},
	}
	cmd.Flags().IntVar(&o.Nodes, "nodes", o.Nodes, "Nodes of a new cluster.")
	cmd.Flags().IntVar(&o.Replicas, "replicas", o.Replicas, "Replicas of the echo Deployment.")
	cmd.Flags().IntVar(&o.Requests, "requests", o.Requests, "Requests sent from each vantage point.")
	cmd.Flags().StringVar(&o.BinDir, "bin-dir", defaultBinDir(), "Directory of the cluster's programs; $KPC_BIN_DIR or kpc's own directory by default.")
	cmd.Flags().StringVar(&o.Mode, "mode", o.Mode, "kproxy --proxy-mode ("+strings.Join(cluster.KnownModes(), ", ")+"); a running cluster is switched to it when given; $"+modeEnv+" or "+cluster.DefaultMode+" by default.")
	return cmd
}

func runDemo(ctx context.Context, g *globalOptions, o *demoOptions, w io.Writer) error {
	c, err := cluster.Load(g.StateDir)
	if errors.Is(err, cluster.ErrNotUp) {
		fmt.Fprintf(w, "==> Starting a %d-node cluster (control plane, nodes and pods are network namespaces), kproxy in %s mode\n", o.Nodes, o.Mode)
		c, err = cluster.Up(ctx, cluster.Options{Nodes: o.Nodes, Mode: o.Mode, StateDir: g.StateDir, BinDir: o.BinDir})
	}
	if err != nil {
		return err
	}
	if o.ModeExplicit && c.Mode() != o.Mode {
		fmt.Fprintf(w, "==> Switching kproxy on every node from %s to %s mode\n", c.Mode(), o.Mode)
		if err := cluster.ProbeMode(ctx, c.BinDir(), o.Mode); err != nil {
			return err
		}
		if err := c.SetMode(ctx, o.Mode); err != nil {
			return err
		}
	}
	client := c.Client()
	fmt.Fprintf(w, "==> Cluster up: nodes %s, each running kproxy (%s mode)\n", strings.Join(c.NodeNames(), ", "), c.Mode())

	if err := demoObjects(ctx, client, o.Replicas); err != nil {
		return err
	}
	fmt.Fprintf(w, "==> Created Deployment %s/echo (%d replicas) and Service %s/echo (ClusterIP + NodePort), and a client pod\n",
		demoNamespace, o.Replicas, demoNamespace)
	svc, pods, err := waitDemoReady(ctx, client, o.Replicas)
	if err != nil {
		return err
	}
	nodePort := svc.Spec.Ports[0].NodePort
	fmt.Fprintf(w, "==> Service echo: ClusterIP %s:80, NodePort %d; endpoints:\n", svc.Spec.ClusterIP, nodePort)
	for _, p := range pods {
		fmt.Fprintf(w, "      %-28s %-15s on %s\n", p.Name, p.Status.PodIP, p.Spec.NodeName)
	}

	clientPod, err := client.CoreV1().Pods(demoNamespace).Get(ctx, "client", metav1.GetOptions{})
	if err != nil {
		return err
	}
	podNS, err := c.NetNS(ctx, demoNamespace+"/client")
	if err != nil {
		return err
	}
	ok := true
	ok = demoTraffic(ctx, w, fmt.Sprintf("pod %s/client (%s, on %s) -> ClusterIP %s:80", demoNamespace, clientPod.Status.PodIP, clientPod.Spec.NodeName, svc.Spec.ClusterIP),
		podNS, net.JoinHostPort(svc.Spec.ClusterIP, "80"), o.Requests) && ok
	for i := range c.NodeNames() {
		addr := net.JoinHostPort(cluster.NodeIP(i+1), fmt.Sprint(nodePort))
		ok = demoTraffic(ctx, w, fmt.Sprintf("external client (%s, outside the cluster) -> NodePort %s", cluster.ClientIP, addr),
			cluster.ClientNetNS, addr, o.Requests) && ok
	}

	node := slices.Index(c.NodeNames(), clientPod.Spec.NodeName) + 1
	if node == 0 {
		return fmt.Errorf("the client pod runs on %q, not a node of this cluster (%s)", clientPod.Spec.NodeName, strings.Join(c.NodeNames(), ", "))
	}
	printTryIt(w, tryItValues{
		Kpc: selfPath(), Mode: c.Mode(), Service: svc, ClientPod: clientPod,
		AgentFlags:       explainFlags(cluster.KproxyArgs(c.StateDir(), node, c.Mode())),
		ExternalClientIP: cluster.ClientIP,
	})
	if !ok {
		return errors.New("some demo requests failed (see above); kproxy logs are in " + c.StateDir())
	}
	return nil
}

// tryItValues are the running demo's values the "try it yourself" commands
// carry, so that each runs as printed.
type tryItValues struct {
	// Kpc is kpc's own path.
	Kpc  string
	Mode string
	// Service is the echo Service (its ClusterIP, port and node port).
	Service *v1.Service
	// ClientPod is the client pod: its node is where the commands look,
	// its address the source of the traced packet.
	ClientPod *v1.Pod
	// AgentFlags are the flags that make a kproxy command on the client
	// pod's node see what the agent there sees (explainFlags).
	AgentFlags []string
	// ExternalClientIP is the external client's address.
	ExternalClientIP string
}

// tryItLine is one command of the "try it yourself" block.
type tryItLine struct {
	Command string
	Comment string
}

// tryItCommands are the commands the demo suggests: kubectl through kpc,
// kproxy's rules, `kproxy trace` of the demo's two flows and `kproxy
// explain` of its Service on the client pod's node, as kproxy runs there
// (--kubeconfig, --hostname-override).
func tryItCommands(v tryItValues) []tryItLine {
	kpc, node, svc := v.Kpc, v.ClientPod.Spec.NodeName, v.Service
	port := svc.Spec.Ports[0]
	onNode := fmt.Sprintf("%s exec %s -- ", kpc, node)
	lines := []tryItLine{
		{Command: fmt.Sprintf("%s kubectl -n %s get pods,svc,endpointslices -o wide", kpc, svc.Namespace), Comment: "kubectl, built with the control plane"},
		{Command: onNode + demoRulesHint(v.Mode), Comment: "kproxy's rules on " + node},
	}
	if traceReads(v.Mode) {
		lines = append(lines,
			tryItLine{
				Command: onNode + fmt.Sprintf("kproxy trace --src %s --dst %s --dport %d --from pod", v.ClientPod.Status.PodIP, svc.Spec.ClusterIP, port.Port),
				Comment: fmt.Sprintf("the path of %s/%s's packet to the ClusterIP through %s's rules", v.ClientPod.Namespace, v.ClientPod.Name, node),
			},
			tryItLine{
				Command: onNode + fmt.Sprintf("kproxy trace --src %s --dst %s --dport %d", v.ExternalClientIP, v.ClientPod.Status.HostIP, port.NodePort),
				Comment: "the external client's packet to " + node + "'s NodePort",
			})
	}
	switchComment := "switch every node's kproxy to another mode"
	if !traceReads(v.Mode) {
		switchComment += " (kproxy trace reads iptables and nftables modes)"
	}
	lines = append(lines,
		tryItLine{
			Command: onNode + strings.Join(append([]string{"kproxy", "explain", svc.Namespace + "/" + svc.Name}, v.AgentFlags...), " "),
			Comment: "what kproxy decides for the Service on " + node + ", and whether the rules agree",
		},
		tryItLine{Command: kpc + " exec client -- ip route", Comment: "the external client"},
		tryItLine{Command: fmt.Sprintf("%s mode %s", kpc, otherMode(v.Mode)), Comment: switchComment},
		tryItLine{Command: kpc + " status"},
	)
	return lines
}

// explainFlags are the flags of kproxy's agent arguments that `kproxy
// explain` takes to act as that agent: the API server and identity
// (--kubeconfig) and the node (--hostname-override); the last of each, as
// for the agent.
func explainFlags(agentArgs []string) []string {
	var out []string
	// --cluster-cidr: without it kproxy cannot tell pods from other
	// sources, and explain's decisions would not be the agent's.
	for _, name := range []string{"--kubeconfig", "--hostname-override", "--cluster-cidr"} {
		for i := len(agentArgs) - 1; i >= 0; i-- {
			if strings.HasPrefix(agentArgs[i], name+"=") {
				out = append(out, agentArgs[i])
				break
			}
		}
	}
	return out
}

// traceReads says whether `kproxy trace` reads the state of mode.
func traceReads(mode string) bool {
	return mode == cluster.ModeIPTables || mode == cluster.ModeNFTables
}

// printTryIt prints the "try it yourself" block, each command on a line of
// its own with its comment on the next, so that a line pastes as is.
func printTryIt(w io.Writer, v tryItValues) {
	fmt.Fprintf(w, "\n==> kproxy routed every request above through the rules it wrote on each node.\nTry it yourself (each command runs as printed; kproxy and kubectl come with the cluster):\n")
	for _, l := range tryItCommands(v) {
		if l.Comment != "" {
			fmt.Fprintf(w, "  # %s\n", l.Comment)
		}
		fmt.Fprintf(w, "  %s\n", l.Command)
	}
	fmt.Fprintf(w, "Tear it all down (namespaces, links, processes):\n  %s down        # or: make demo-down\n", v.Kpc)
}

// selfPath is kpc's own path, for commands printed to be pasted.
func selfPath() string {
	if exe, err := os.Executable(); err == nil {
		return exe
	}
	return "kpc"
}

// demoRulesHint is the demo's command showing kproxy's rules in mode.
func demoRulesHint(mode string) string {
	if mode == cluster.ModeIPTables {
		return rulesCommand(mode) + " | grep KPROXY"
	}
	return rulesCommand(mode)
}

// otherMode suggests a mode to switch to from mode.
func otherMode(mode string) string {
	if mode == cluster.ModeIPTables {
		return cluster.ModeNFTables
	}
	return cluster.ModeIPTables
}

// demoTraffic sends requests from a namespace and prints which pods answered.
func demoTraffic(ctx context.Context, w io.Writer, title, netns, addr string, n int) bool {
	fmt.Fprintf(w, "\n==> %s, %d requests\n", title, n)
	answered := map[string]int{}
	seen := map[string]string{}
	failed := 0
	ns := &netnstest.NS{Name: netns}
	// The API says the endpoints are ready; kproxy programs them within its
	// minimum sync period. Wait for the first answer before counting.
	if waited, err := waitAnswer(ctx, ns, addr, demoProgramWait); err != nil {
		fmt.Fprintf(w, "      no answer within %s: %v\n", demoProgramWait, err)
	} else if waited > 0 {
		fmt.Fprintf(w, "      (first answer after %.1f s: kproxy's sync after the endpoints became ready)\n", waited.Seconds())
	}
	for i := 0; i < n; i++ {
		rctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		reply, err := netnstest.Request(rctx, ns, "tcp", addr)
		cancel()
		if err != nil {
			failed++
			fmt.Fprintf(w, "      request %d failed: %v\n", i+1, err)
			continue
		}
		f := strings.Fields(reply)
		if len(f) < 2 {
			failed++
			continue
		}
		answered[f[0]]++
		seen[f[0]] = f[1]
	}
	names := make([]string, 0, len(answered))
	for p := range answered {
		names = append(names, p)
	}
	sort.Strings(names)
	for _, p := range names {
		fmt.Fprintf(w, "      %-28s answered %2d times (it saw the client as %s)\n", p, answered[p], seen[p])
	}
	return failed == 0 && len(names) > 0
}

// demoProgramWait bounds how long the demo waits for an address to answer
// at all (kproxy syncs within --iptables-min-sync-period of a change).
const demoProgramWait = 30 * time.Second

// waitAnswer sends requests to addr from ns until one is answered, for at
// most limit; it returns how long that took (0 when the first one was).
func waitAnswer(ctx context.Context, ns *netnstest.NS, addr string, limit time.Duration) (time.Duration, error) {
	start := time.Now()
	for attempt := 0; ; attempt++ {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := netnstest.Request(rctx, ns, "tcp", addr)
		cancel()
		if err == nil {
			if attempt == 0 {
				return 0, nil
			}
			return time.Since(start), nil
		}
		if time.Since(start) >= limit || ctx.Err() != nil {
			return time.Since(start), err
		}
		select {
		case <-ctx.Done():
			return time.Since(start), ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func demoObjects(ctx context.Context, client kubernetes.Interface, replicas int) error {
	ns := &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: demoNamespace}}
	if _, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating namespace: %w", err)
	}
	labels := map[string]string{"app": "echo"}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "echo", Namespace: demoNamespace},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(int32(replicas)),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: v1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: v1.PodSpec{Containers: []v1.Container{{
					Name: "echo", Image: "kpc.local/echo",
					Ports: []v1.ContainerPort{{Name: "echo", ContainerPort: 8080, Protocol: v1.ProtocolTCP}},
				}}},
			},
		},
	}
	if _, err := client.AppsV1().Deployments(demoNamespace).Create(ctx, dep, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating deployment: %w", err)
	}
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "echo", Namespace: demoNamespace},
		Spec: v1.ServiceSpec{
			Type:     v1.ServiceTypeNodePort,
			Selector: labels,
			Ports:    []v1.ServicePort{{Name: "echo", Port: 80, TargetPort: intstr.FromString("echo"), Protocol: v1.ProtocolTCP}},
		},
	}
	if _, err := client.CoreV1().Services(demoNamespace).Create(ctx, svc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating service: %w", err)
	}
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "client", Namespace: demoNamespace},
		Spec:       v1.PodSpec{Containers: []v1.Container{{Name: "client", Image: "kpc.local/client"}}},
	}
	if _, err := client.CoreV1().Pods(demoNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating client pod: %w", err)
	}
	return nil
}

// waitDemoReady waits for every replica to be a ready endpoint and the client
// pod to run.
func waitDemoReady(ctx context.Context, client kubernetes.Interface, replicas int) (*v1.Service, []v1.Pod, error) {
	var svc *v1.Service
	var pods []v1.Pod
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		var err error
		if svc, err = client.CoreV1().Services(demoNamespace).Get(ctx, "echo", metav1.GetOptions{}); err != nil {
			return false, nil
		}
		slices, err := client.DiscoveryV1().EndpointSlices(demoNamespace).List(ctx, metav1.ListOptions{LabelSelector: discovery.LabelServiceName + "=echo"})
		if err != nil {
			return false, nil
		}
		ready := 0
		for _, s := range slices.Items {
			for _, e := range s.Endpoints {
				if e.Conditions.Ready != nil && *e.Conditions.Ready {
					ready++
				}
			}
		}
		cp, err := client.CoreV1().Pods(demoNamespace).Get(ctx, "client", metav1.GetOptions{})
		if err != nil || cp.Status.PodIP == "" {
			return false, nil
		}
		list, err := client.CoreV1().Pods(demoNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app=echo"})
		if err != nil {
			return false, nil
		}
		pods = list.Items
		return ready == replicas, nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("waiting for %d ready echo endpoints and the client pod: %w", replicas, err)
	}
	sort.Slice(pods, func(i, j int) bool { return pods[i].Name < pods[j].Name })
	return svc, pods, nil
}
