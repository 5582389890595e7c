// Package cluster runs the local cluster of test/LOCAL-CLUSTER.md: a real
// Kubernetes control plane, nodes and an external client, each in a network
// namespace of its own, with kproxy on every node. `kpc` and the e2e suite
// drive it through this package.
package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// ErrNotUp is returned when a state directory holds no running cluster.
var ErrNotUp = errors.New("no local cluster is up")

// ErrAlreadyUp is returned by Up when a cluster already runs.
var ErrAlreadyUp = errors.New("a local cluster is already up")

// DefaultMode is kproxy's default --proxy-mode.
const DefaultMode = ModeIPTables

// DefaultNodes is the default number of nodes.
const DefaultNodes = 2

// Bounds of Up's waits.
const (
	apiReadyTimeout  = 3 * time.Minute
	bootstrapTimeout = time.Minute
	agentTimeout     = time.Minute
	// stopGrace is how long a stopped kproxy may take to exit.
	stopGrace = 10 * time.Second
	// downGrace is how long Down lets processes exit before SIGKILL: the
	// cluster is thrown away, nodes and controllers exit at once, and the
	// API server and etcd would take 20 s draining their clients.
	downGrace = time.Second
)

// DefaultStateDir is $KPC_STATE, or /run/kpc.
func DefaultStateDir() string {
	if d := os.Getenv("KPC_STATE"); d != "" {
		return d
	}
	return "/run/kpc"
}

// Options configure Up.
type Options struct {
	// Nodes is the number of nodes (default 2).
	Nodes int
	// Mode is kproxy's --proxy-mode (default iptables).
	Mode string
	// StateDir holds certificates, kubeconfigs, logs and the pids file
	// (default DefaultStateDir()).
	StateDir string
	// BinDir holds etcd, kube-apiserver, kube-controller-manager,
	// kube-scheduler, kpc and kproxy (hack/build-control-plane.sh).
	BinDir string
	// KproxyArgs are extra kproxy flags for every node.
	KproxyArgs []string
	// ControlPlaneOnly starts etcd and kube-apiserver only: no controller
	// manager, scheduler, Node objects, node agents or kproxy. The network
	// and every node's kubeconfigs are made as usual, for a caller that
	// runs its own kproxy (test/procbench).
	ControlPlaneOnly bool
}

// state is what state.json records of a running cluster.
type state struct {
	Nodes      int      `json:"nodes"`
	Mode       string   `json:"mode"`
	BinDir     string   `json:"binDir"`
	KproxyArgs []string `json:"kproxyArgs,omitempty"`
	// ControlPlaneOnly is Options.ControlPlaneOnly.
	ControlPlaneOnly bool `json:"controlPlaneOnly,omitempty"`
	// NodeKproxyArgs are the extra flags of StartKproxy per node, kept
	// for RestartKproxy.
	NodeKproxyArgs map[string][]string `json:"nodeKproxyArgs,omitempty"`
	// NodeKproxyEnv is the extra environment of StartKproxyWith per
	// node, kept for RestartKproxy.
	NodeKproxyEnv map[string][]string `json:"nodeKproxyEnv,omitempty"`
}

// Cluster is a running local cluster.
type Cluster struct {
	l      layout
	client kubernetes.Interface

	mu    sync.Mutex
	st    state
	procs []process
}

// Up builds the network, starts the control plane, creates the Node
// objects and starts the node agent and kproxy on every node. It fails with
// ErrAlreadyUp when a cluster runs; leftovers of a crashed run are removed
// first. When Up fails it stops what it started and keeps the logs in the
// state directory.
func Up(ctx context.Context, opts Options) (*Cluster, error) {
	logger := klog.FromContext(ctx)
	if opts.Nodes == 0 {
		opts.Nodes = DefaultNodes
	}
	if opts.Mode == "" {
		opts.Mode = DefaultMode
	}
	if opts.StateDir == "" {
		opts.StateDir = DefaultStateDir()
	}
	if err := validateNodes(opts.Nodes); err != nil {
		return nil, err
	}
	if err := ValidateMode(opts.Mode); err != nil {
		return nil, err
	}
	stateDir, err := filepath.Abs(opts.StateDir)
	if err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	required := requiredBinaries
	if opts.ControlPlaneOnly {
		required = controlPlaneBinaries
	}
	binDir, err := checkBinDir(opts.BinDir, required...)
	if err != nil {
		return nil, err
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("the local cluster needs root (network namespaces)")
	}
	// Before anything is made: a kproxy or host that cannot run the mode
	// fails here, not after the control plane is up.
	if err := ProbeMode(ctx, binDir, opts.Mode); err != nil {
		return nil, fmt.Errorf("--proxy-mode=%s: %w", opts.Mode, err)
	}
	l := layout{stateDir}
	if err := checkNotUp(l); err != nil {
		return nil, err
	}
	if leftovers(l) {
		logger.Info("Removing what a previous run left", "stateDir", stateDir)
		if err := Down(ctx, stateDir); err != nil {
			return nil, fmt.Errorf("removing leftovers of a previous run: %w", err)
		}
	}
	if entries, err := os.ReadDir(l.dir); err == nil && len(entries) > 0 {
		return nil, fmt.Errorf("state directory %s is not empty and not a kpc one; choose another", l.dir)
	}

	c := &Cluster{l: l, st: state{
		Nodes: opts.Nodes, Mode: opts.Mode, BinDir: binDir,
		KproxyArgs: slices.Clone(opts.KproxyArgs), NodeKproxyArgs: map[string][]string{},
		ControlPlaneOnly: opts.ControlPlaneOnly,
	}}
	if err := c.up(ctx); err != nil {
		logger.Info("Up failed; stopping what it started", "err", err)
		if derr := c.abort(context.WithoutCancel(ctx)); derr != nil {
			err = fmt.Errorf("%w\n(and cleaning up: %v)", err, derr)
		}
		return nil, fmt.Errorf("%w\n(logs kept in %s; `kpc down` removes them)", err, c.l.path("logs"))
	}
	return c, nil
}

func (c *Cluster) up(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	began := time.Now()
	if err := c.writeFiles(); err != nil {
		return err
	}
	client, err := clientFor(c.l.hostKubeconfig())
	if err != nil {
		return err
	}
	c.client = client
	if err := c.saveState(); err != nil {
		return err
	}

	if err := setupNetwork(ctx, c.st.Nodes); err != nil {
		return err
	}
	logger.Info("Network ready", "nodes", c.st.Nodes, "elapsed", time.Since(began).Round(time.Millisecond))

	cp := func(name string, args []string) launch {
		return launch{Name: name, NetNS: ControlPlaneNetNS, Argv: append([]string{c.bin(name)}, args...), Log: c.l.logFile(name)}
	}
	if err := c.startAll(ctx, cp(progEtcd, etcdArgs(c.l)), cp(progAPIServer, apiServerArgs(c.l))); err != nil {
		return err
	}
	if err := c.waitAPIReady(ctx); err != nil {
		return err
	}
	logger.Info("API server ready", "elapsed", time.Since(began).Round(time.Millisecond))
	if c.st.ControlPlaneOnly {
		if err := c.waitNamespace(ctx, metav1.NamespaceDefault); err != nil {
			return err
		}
		logger.Info("Control plane up", "kubeconfig", c.Kubeconfig(), "elapsed", time.Since(began).Round(time.Millisecond))
		return nil
	}
	if err := c.startAll(ctx,
		cp(progControllerManager, controllerManagerArgs(c.l)),
		cp(progScheduler, schedulerArgs(c.l))); err != nil {
		return err
	}

	if err := c.waitNamespace(ctx, metav1.NamespaceDefault); err != nil {
		return err
	}
	heartbeat := metav1.NewTime(time.Now().Add(-time.Minute).Truncate(time.Second))
	for i := 1; i <= c.st.Nodes; i++ {
		if err := c.createNode(ctx, i, heartbeat); err != nil {
			return err
		}
	}
	offsets := map[string]int64{}
	for i := 1; i <= c.st.Nodes; i++ {
		offsets[NodeName(i)] = fileSize(c.KproxyLog(NodeName(i)))
		if err := c.startAll(ctx, c.agentLaunch(i), c.kproxyLaunch(i, nil)); err != nil {
			return err
		}
	}
	if err := c.waitAgents(ctx, heartbeat); err != nil {
		return err
	}
	if err := c.waitKproxies(ctx, offsets); err != nil {
		return err
	}
	if err := c.checkRunning(); err != nil {
		return err
	}
	logger.Info("Cluster up", "nodes", c.st.Nodes, "mode", c.st.Mode, "kubeconfig", c.Kubeconfig(),
		"elapsed", time.Since(began).Round(time.Millisecond))
	return nil
}

// abort stops a half-started cluster and keeps the state directory's logs.
func (c *Cluster) abort(ctx context.Context) error {
	c.mu.Lock()
	procs := slices.Clone(c.procs)
	c.mu.Unlock()
	err := teardown(ctx, procs, downGrace)
	for _, f := range []string{c.l.stateFile(), c.l.pidsFile()} {
		if rerr := os.Remove(f); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = errors.Join(err, rerr)
		}
	}
	return err
}

// checkBinDir checks that dir holds every program of required (all of
// requiredBinaries when none is named) and returns it absolute.
func checkBinDir(dir string, required ...string) (string, error) {
	if len(required) == 0 {
		required = requiredBinaries
	}
	if dir == "" {
		return "", errors.New("no bin directory: run hack/build-control-plane.sh and pass the directory it prints")
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", fmt.Errorf("bin directory: %w", err)
	}
	var missing []string
	for _, b := range required {
		if fi, err := os.Stat(filepath.Join(abs, b)); err != nil || fi.Mode()&0o111 == 0 {
			missing = append(missing, b)
		}
	}
	if len(missing) > 0 {
		return "", fmt.Errorf("bin directory %s lacks %s: run hack/build-control-plane.sh", abs, strings.Join(missing, ", "))
	}
	return abs, nil
}

// checkNotUp fails with ErrAlreadyUp when the state directory's cluster
// runs, or when anything runs in the control plane namespace (a cluster of
// another state directory: namespace names are machine-wide).
func checkNotUp(l layout) error {
	if procs, err := readPids(l); err == nil {
		for _, p := range procs {
			if p.Name == progAPIServer && p.alive() {
				return fmt.Errorf("%w (state %s; `kpc down` first)", ErrAlreadyUp, l.dir)
			}
		}
	}
	if netnsExists(ControlPlaneNetNS) {
		procs, err := processesInNetNS([]string{ControlPlaneNetNS})
		if err != nil {
			return err
		}
		if len(procs) > 0 {
			return fmt.Errorf("%w: processes run in netns %s (another state directory? `kpc down` with its --state)", ErrAlreadyUp, ControlPlaneNetNS)
		}
	}
	return nil
}

// leftovers reports whether anything of a previous run remains.
func leftovers(l layout) bool {
	if _, err := os.Stat(l.marker()); err == nil {
		return true
	}
	names, _ := kpcNetNS()
	return len(names) > 0 || hostLinkExists()
}

// writeFiles creates the state directory with the key material, the token
// file and every kubeconfig.
func (c *Cluster) writeFiles() error {
	l := c.l
	for _, d := range []string{l.dir, l.path("pki"), l.path("logs"), l.path("nodes")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("creating %s: %w", d, err)
		}
	}
	if err := os.WriteFile(l.marker(), []byte("kpc state directory: `kpc down` removes it\n"), 0o600); err != nil {
		return fmt.Errorf("writing the state marker: %w", err)
	}
	p, err := newPKI(time.Now())
	if err != nil {
		return err
	}
	files := map[string][]byte{
		l.pki("ca.crt"): p.CACert, l.pki("ca.key"): p.CAKey,
		l.pki("apiserver.crt"): p.ServerCert, l.pki("apiserver.key"): p.ServerKey,
		l.pki("sa.key"): p.ServiceAccountKey, l.pki("sa.pub"): p.ServiceAccountPub,
	}

	admin, err := newIdentity(adminUser, "system:masters")
	if err != nil {
		return err
	}
	kproxy, err := newIdentity(kproxyUser)
	if err != nil {
		return err
	}
	ids := []identity{admin, kproxy}
	if files[l.hostKubeconfig()], err = kubeconfigFor(apiServerURL(ControlPlaneHostSideIP), p.CACert, admin.User, admin.Token); err != nil {
		return err
	}
	if files[l.cpKubeconfig()], err = kubeconfigFor(apiServerURL("127.0.0.1"), p.CACert, admin.User, admin.Token); err != nil {
		return err
	}
	inCluster := apiServerURL(ControlPlaneIP)
	for i := 1; i <= c.st.Nodes; i++ {
		node := NodeName(i)
		if err := os.MkdirAll(l.nodeDir(node), 0o700); err != nil {
			return fmt.Errorf("creating %s: %w", l.nodeDir(node), err)
		}
		agent, err := newIdentity(agentUser(node), "system:nodes", "system:masters")
		if err != nil {
			return err
		}
		ids = append(ids, agent)
		if files[l.agentKubeconfig(node)], err = kubeconfigFor(inCluster, p.CACert, agent.User, agent.Token); err != nil {
			return err
		}
		if files[l.kproxyKubeconfig(node)], err = kubeconfigFor(inCluster, p.CACert, kproxy.User, kproxy.Token); err != nil {
			return err
		}
	}
	if files[l.tokenFile()], err = tokenFile(ids); err != nil {
		return err
	}
	for path, data := range files {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			return fmt.Errorf("writing %s: %w", path, err)
		}
	}
	return nil
}

func newIdentity(user string, groups ...string) (identity, error) {
	tok, err := newToken()
	if err != nil {
		return identity{}, err
	}
	uid := "kpc-" + strings.NewReplacer(":", "-").Replace(user)
	return identity{Token: tok, User: user, UID: uid, Groups: groups}, nil
}

func clientFor(kubeconfig string) (kubernetes.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", kubeconfig, err)
	}
	cfg.UserAgent = "kpc"
	cfg.QPS, cfg.Burst = 100, 200
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("building a client from %s: %w", kubeconfig, err)
	}
	return client, nil
}

func (c *Cluster) bin(name string) string { return filepath.Join(c.st.BinDir, name) }

// startAll starts each launch and records it in the pids file.
func (c *Cluster) startAll(ctx context.Context, ls ...launch) error {
	for _, l := range ls {
		p, err := start(ctx, l)
		if err != nil {
			return err
		}
		c.mu.Lock()
		c.procs = append(c.procs, p)
		err = c.savePidsLocked()
		c.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

func (c *Cluster) agentLaunch(i int) launch {
	name := progAgent + "/" + NodeName(i)
	return launch{
		Name: name, NetNS: NodeNetNS(i), NetOnly: true,
		Argv: append([]string{c.bin(progKpc)}, agentArgs(c.l, i)...),
		Log:  c.l.logFile(name),
	}
}

func (c *Cluster) kproxyLaunch(i int, extra []string, env ...string) launch {
	name := progKproxy + "/" + NodeName(i)
	c.mu.Lock()
	args := kproxyArgs(c.l, i, c.st.Mode, append(slices.Clone(c.st.KproxyArgs), extra...))
	c.mu.Unlock()
	return launch{
		Name: name, NetNS: NodeNetNS(i),
		Argv: append([]string{c.bin(progKproxy)}, args...),
		Log:  c.l.logFile(name),
		Env:  slices.Clone(env),
	}
}

// exited returns an error for the first recorded process of names that no
// longer runs, quoting the end of its log.
func (c *Cluster) exited(names ...string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.procs {
		if (len(names) == 0 || slices.Contains(names, p.Name)) && !p.alive() {
			log := c.l.logFile(p.Name)
			return fmt.Errorf("%s exited; its log %s ends:\n%s", p.Name, log, TailFile(log, 15))
		}
	}
	return nil
}

func (c *Cluster) checkRunning() error { return c.exited() }

// waitAPIReady polls the API server's /readyz from the host.
func (c *Cluster) waitAPIReady(ctx context.Context) error {
	ca, err := os.ReadFile(c.l.pki("ca.crt"))
	if err != nil {
		return fmt.Errorf("reading the CA: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	hc := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	defer hc.CloseIdleConnections()
	url := apiServerURL(ControlPlaneHostSideIP) + "/readyz"
	deadline := time.Now().Add(apiReadyTimeout)
	last := "no answer yet"
	for {
		if err := c.exited(progEtcd, progAPIServer); err != nil {
			return err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := hc.Do(req)
		if err == nil {
			body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(body)))
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("API server not ready after %s (last: %s); see %s and %s",
				apiReadyTimeout, last, c.l.logFile(progAPIServer), c.l.logFile(progEtcd))
		}
		if err := Sleep(ctx, 250*time.Millisecond); err != nil {
			return fmt.Errorf("waiting for the API server: %w", err)
		}
	}
}

func (c *Cluster) waitNamespace(ctx context.Context, name string) error {
	deadline := time.Now().Add(bootstrapTimeout)
	for {
		_, err := c.client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("namespace %s not created after %s: %w; see %s", name, bootstrapTimeout, err, c.l.logFile(progAPIServer))
		}
		if err := Sleep(ctx, 200*time.Millisecond); err != nil {
			return fmt.Errorf("waiting for namespace %s: %w", name, err)
		}
	}
}

// nodeObject is node i as the local cluster creates it; heartbeat is its
// Ready condition's initial time.
func nodeObject(i int, heartbeat metav1.Time) *v1.Node {
	resources := v1.ResourceList{
		v1.ResourceCPU:    resource.MustParse("4"),
		v1.ResourceMemory: resource.MustParse("8Gi"),
		v1.ResourcePods:   resource.MustParse("110"),
	}
	return &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: NodeName(i), Labels: NodeLabels(i)},
		Spec:       v1.NodeSpec{PodCIDR: NodePodCIDR(i), PodCIDRs: []string{NodePodCIDR(i)}},
		Status: v1.NodeStatus{
			Capacity:    resources,
			Allocatable: resources.DeepCopy(),
			Addresses: []v1.NodeAddress{
				{Type: v1.NodeInternalIP, Address: NodeIP(i)},
				{Type: v1.NodeHostName, Address: NodeName(i)},
			},
			Conditions: []v1.NodeCondition{{
				Type: v1.NodeReady, Status: v1.ConditionTrue,
				LastHeartbeatTime: heartbeat, LastTransitionTime: heartbeat,
				Reason: "KpcNodeCreated", Message: "created by kpc up; the node agent keeps it fresh",
			}},
			NodeInfo: v1.NodeSystemInfo{OperatingSystem: "linux", Architecture: NodeLabels(i)["kubernetes.io/arch"]},
		},
	}
}

func (c *Cluster) createNode(ctx context.Context, i int, heartbeat metav1.Time) error {
	want := nodeObject(i, heartbeat)
	got, err := c.client.CoreV1().Nodes().Create(ctx, want, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("creating node %s: %w", want.Name, err)
	}
	// Whether create keeps the status is the API server's choice: set it.
	got.Status = want.Status
	if _, err := c.client.CoreV1().Nodes().UpdateStatus(ctx, got, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("setting the status of node %s: %w", want.Name, err)
	}
	return nil
}

// waitAgents waits until every node agent has renewed its node's Ready
// condition past the heartbeat Up set.
func (c *Cluster) waitAgents(ctx context.Context, heartbeat metav1.Time) error {
	deadline := time.Now().Add(agentTimeout)
	for i := 1; i <= c.st.Nodes; {
		node := NodeName(i)
		if err := c.exited(progAgent+"/"+node, progKproxy+"/"+node); err != nil {
			return err
		}
		n, err := c.client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err == nil {
			if cond := readyCondition(n); cond != nil && cond.LastHeartbeatTime.After(heartbeat.Time) {
				i++
				continue
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the node agent of %s did not renew its Ready condition within %s; see %s",
				node, agentTimeout, c.l.logFile(progAgent+"/"+node))
		}
		if err := Sleep(ctx, 200*time.Millisecond); err != nil {
			return fmt.Errorf("waiting for the node agents: %w", err)
		}
	}
	return nil
}

func readyCondition(n *v1.Node) *v1.NodeCondition {
	for i := range n.Status.Conditions {
		if n.Status.Conditions[i].Type == v1.NodeReady {
			return &n.Status.Conditions[i]
		}
	}
	return nil
}

// Sleep waits d, or until ctx is done (then its error).
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Load returns the cluster running with this state directory, or an error
// wrapping ErrNotUp.
func Load(stateDir string) (*Cluster, error) {
	if stateDir == "" {
		stateDir = DefaultStateDir()
	}
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	l := layout{abs}
	data, err := os.ReadFile(l.stateFile())
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w (state %s)", ErrNotUp, abs)
	}
	if err != nil {
		return nil, fmt.Errorf("reading the cluster state: %w", err)
	}
	c := &Cluster{l: l}
	if err := json.Unmarshal(data, &c.st); err != nil {
		return nil, fmt.Errorf("parsing %s: %w", l.stateFile(), err)
	}
	if c.st.NodeKproxyArgs == nil {
		c.st.NodeKproxyArgs = map[string][]string{}
	}
	if c.procs, err = readPids(l); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if c.client, err = clientFor(l.hostKubeconfig()); err != nil {
		return nil, err
	}
	return c, nil
}

func readPids(l layout) ([]process, error) {
	data, err := os.ReadFile(l.pidsFile())
	if err != nil {
		return nil, err
	}
	procs, err := parsePids(data)
	if err != nil {
		return nil, fmt.Errorf("parsing %s: %w", l.pidsFile(), err)
	}
	return procs, nil
}

// writeAtomic replaces path with data.
func writeAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("replacing %s: %w", path, err)
	}
	return nil
}

// refreshLocked re-reads the pids and state files: another process with
// this cluster loaded (the e2e suite's parent and its test processes, kpc
// commands) may have started or stopped a kproxy since this one read them.
func (c *Cluster) refreshLocked() error {
	procs, err := readPids(c.l)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	data, err := os.ReadFile(c.l.stateFile())
	if err != nil {
		return fmt.Errorf("reading the cluster state: %w", err)
	}
	var st state
	if err := json.Unmarshal(data, &st); err != nil {
		return fmt.Errorf("parsing %s: %w", c.l.stateFile(), err)
	}
	if st.NodeKproxyArgs == nil {
		st.NodeKproxyArgs = map[string][]string{}
	}
	c.procs, c.st = procs, st
	return nil
}

func (c *Cluster) savePidsLocked() error { return writeAtomic(c.l.pidsFile(), formatPids(c.procs)) }

func (c *Cluster) saveState() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.saveStateLocked()
}

func (c *Cluster) saveStateLocked() error {
	data, err := json.MarshalIndent(c.st, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding the cluster state: %w", err)
	}
	return writeAtomic(c.l.stateFile(), append(data, '\n'))
}

// StateDir is the cluster's state directory.
func (c *Cluster) StateDir() string { return c.l.dir }

// BinDir is the directory of the cluster's programs (kproxy included).
func (c *Cluster) BinDir() string { return c.st.BinDir }

// Mode is kproxy's --proxy-mode (SetMode changes it).
func (c *Cluster) Mode() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.st.Mode
}

// Kubeconfig is the path of the admin kubeconfig usable from the host.
func (c *Cluster) Kubeconfig() string { return c.l.hostKubeconfig() }

// Client is an admin client of the cluster's API server.
func (c *Cluster) Client() kubernetes.Interface { return c.client }

// NodeNames lists the nodes: node-1..node-N.
func (c *Cluster) NodeNames() []string {
	out := make([]string, c.st.Nodes)
	for i := range out {
		out[i] = NodeName(i + 1)
	}
	return out
}

// Log is the log file of a process: "etcd", "kube-apiserver",
// "kube-controller-manager", "kube-scheduler", "agent/<node>" or
// "kproxy/<node>".
func (c *Cluster) Log(name string) string { return c.l.logFile(name) }

// KproxyKubeconfig is the kubeconfig kproxy on node uses: kube-proxy's
// identity and the API server's address on the switch.
func (c *Cluster) KproxyKubeconfig(node string) (string, error) {
	if _, err := c.node(node); err != nil {
		return "", err
	}
	return c.l.kproxyKubeconfig(node), nil
}

// KproxyLog is the log file of kproxy on node; restarts append to it.
func (c *Cluster) KproxyLog(node string) string { return c.l.logFile(progKproxy + "/" + node) }

// node returns the index of a node name.
func (c *Cluster) node(name string) (int, error) {
	i, ok := nodeIndex(name, c.st.Nodes)
	if !ok {
		return 0, fmt.Errorf("no node %q (nodes: %s)", name, strings.Join(c.NodeNames(), ", "))
	}
	return i, nil
}

// StopKproxy stops kproxy on node (SIGTERM, then SIGKILL after a grace
// period). Stopping a stopped kproxy does nothing.
func (c *Cluster) StopKproxy(ctx context.Context, node string) error {
	if _, err := c.node(node); err != nil {
		return err
	}
	name := progKproxy + "/" + node
	c.mu.Lock()
	if err := c.refreshLocked(); err != nil {
		c.mu.Unlock()
		return err
	}
	var mine []process
	for _, p := range c.procs {
		if p.Name == name {
			mine = append(mine, p)
		}
	}
	c.mu.Unlock()
	if err := stop(ctx, mine, stopGrace); err != nil {
		return fmt.Errorf("stopping kproxy on %s: %w", node, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.procs = slices.DeleteFunc(c.procs, func(p process) bool { return p.Name == name })
	return c.savePidsLocked()
}

// StartKproxy starts kproxy on node with extraArgs after the cluster's
// flags (later flags win); RestartKproxy reuses them. It fails when kproxy
// already runs there.
func (c *Cluster) StartKproxy(ctx context.Context, node string, extraArgs ...string) error {
	return c.StartKproxyWith(ctx, node, KproxyStart{Args: extraArgs})
}

// KproxyStart is how StartKproxyWith starts kproxy beyond the cluster's
// flags.
type KproxyStart struct {
	// Args come after the cluster's flags (later flags win).
	Args []string
	// Env is added to kproxy's environment ("NAME=value"; PATH, for
	// instance, to put tools of a test's own before the node's).
	Env []string
}

// StartKproxyWith starts kproxy on node with opts; RestartKproxy reuses
// them. It fails when kproxy already runs there.
func (c *Cluster) StartKproxyWith(ctx context.Context, node string, opts KproxyStart) error {
	extraArgs := opts.Args
	i, err := c.node(node)
	if err != nil {
		return err
	}
	name := progKproxy + "/" + node
	c.mu.Lock()
	if err := c.refreshLocked(); err != nil {
		c.mu.Unlock()
		return err
	}
	for _, p := range c.procs {
		if p.Name == name && p.alive() {
			c.mu.Unlock()
			return fmt.Errorf("kproxy already runs on %s (pid %d)", node, p.PID)
		}
	}
	c.procs = slices.DeleteFunc(c.procs, func(p process) bool { return p.Name == name })
	c.st.NodeKproxyArgs[node] = slices.Clone(extraArgs)
	if c.st.NodeKproxyEnv == nil {
		c.st.NodeKproxyEnv = map[string][]string{}
	}
	c.st.NodeKproxyEnv[node] = slices.Clone(opts.Env)
	err = c.saveStateLocked()
	c.mu.Unlock()
	if err != nil {
		return err
	}
	return c.startAll(ctx, c.kproxyLaunch(i, extraArgs, opts.Env...))
}

// RestartKproxy stops kproxy on node and starts it again with the flags
// and environment it last started with.
func (c *Cluster) RestartKproxy(ctx context.Context, node string) error {
	if err := c.StopKproxy(ctx, node); err != nil {
		return err
	}
	c.mu.Lock()
	opts := KproxyStart{Args: slices.Clone(c.st.NodeKproxyArgs[node]), Env: slices.Clone(c.st.NodeKproxyEnv[node])}
	c.mu.Unlock()
	return c.StartKproxyWith(ctx, node, opts)
}

// Down stops the cluster and removes everything it made; see Down.
func (c *Cluster) Down(ctx context.Context) error { return Down(ctx, c.l.dir) }

// Down stops every process recorded in stateDir's pids file and any other
// process inside a kpc-* network namespace, deletes every kpc-* namespace
// and the host link, and removes the state directory. It succeeds when
// there is nothing to remove, so it is safe to run twice or after a crash.
func Down(ctx context.Context, stateDir string) error {
	if stateDir == "" {
		stateDir = DefaultStateDir()
	}
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return fmt.Errorf("state directory: %w", err)
	}
	l := layout{abs}
	procs, err := readPids(l)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		klog.FromContext(ctx).Info("Ignoring an unreadable pids file", "err", err)
	}
	errs := []error{teardown(ctx, procs, downGrace)}
	errs = append(errs, removeStateDir(l))
	return errors.Join(errs...)
}

// teardown stops procs and anything else in a kpc namespace, then deletes
// the namespaces and the host link.
func teardown(ctx context.Context, procs []process, grace time.Duration) error {
	var errs []error
	if err := stop(ctx, procs, grace); err != nil {
		errs = append(errs, err)
	}
	names, err := kpcNetNS()
	if err != nil {
		errs = append(errs, err)
	}
	stray, err := processesInNetNS(names)
	if err != nil {
		errs = append(errs, err)
	}
	if len(stray) > 0 {
		names := make([]string, 0, len(stray))
		for _, p := range stray {
			names = append(names, fmt.Sprintf("%s (pid %d)", p.Name, p.PID))
		}
		klog.FromContext(ctx).Info("Stopping processes left in kpc namespaces", "processes", names)
		if err := terminate(ctx, stray, grace, false); err != nil {
			errs = append(errs, err)
		}
	}
	if err := teardownNetwork(ctx); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// removeStateDir removes a state directory that kpc made (it holds the
// marker) or that is empty; anything else is left alone.
func removeStateDir(l layout) error {
	if _, err := os.Stat(l.marker()); err == nil {
		if err := os.RemoveAll(l.dir); err != nil {
			return fmt.Errorf("removing %s: %w", l.dir, err)
		}
		return nil
	}
	if err := os.Remove(l.dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		if errors.Is(err, syscall.ENOTEMPTY) || errors.Is(err, syscall.EEXIST) {
			return fmt.Errorf("state directory %s is not a kpc one (no %s); left alone", l.dir, filepath.Base(l.marker()))
		}
		return fmt.Errorf("removing %s: %w", l.dir, err)
	}
	return nil
}

// ProcessStatus is one recorded process.
type ProcessStatus struct {
	Name    string
	PID     int
	Running bool
	Log     string
}

// NodeStatus is one node as the API server sees it.
type NodeStatus struct {
	Name  string
	NetNS string
	IP    string
	// Ready is the Ready condition; Heartbeat its last renewal.
	Ready     bool
	Heartbeat time.Time
}

// Status is a snapshot of the cluster.
type Status struct {
	StateDir   string
	Mode       string
	Kubeconfig string
	Processes  []ProcessStatus
	// APIError is empty when the API server answered.
	APIError string
	Nodes    []NodeStatus
}

// Healthy reports whether every process runs and the API answers.
func (s *Status) Healthy() bool {
	for _, p := range s.Processes {
		if !p.Running {
			return false
		}
	}
	return s.APIError == ""
}

// Status reports the processes, the API server and the nodes.
func (c *Cluster) Status(ctx context.Context) (*Status, error) {
	c.mu.Lock()
	if err := c.refreshLocked(); err != nil {
		c.mu.Unlock()
		return nil, err
	}
	s := &Status{StateDir: c.l.dir, Mode: c.st.Mode, Kubeconfig: c.Kubeconfig()}
	for _, p := range c.procs {
		s.Processes = append(s.Processes, ProcessStatus{Name: p.Name, PID: p.PID, Running: p.alive(), Log: c.l.logFile(p.Name)})
	}
	c.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	nodes, err := c.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		s.APIError = err.Error()
		return s, nil
	}
	for _, n := range nodes.Items {
		ns := NodeStatus{Name: n.Name}
		if i, ok := nodeIndex(n.Name, c.st.Nodes); ok {
			ns.NetNS, ns.IP = NodeNetNS(i), NodeIP(i)
		}
		if cond := readyCondition(&n); cond != nil {
			ns.Ready = cond.Status == v1.ConditionTrue
			ns.Heartbeat = cond.LastHeartbeatTime.Time
		}
		s.Nodes = append(s.Nodes, ns)
	}
	return s, nil
}
