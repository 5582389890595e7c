package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/test/cluster"
	"github.com/kproxy/kproxy/test/nodeagent"
)

// Ports of the echo workloads and their Services.
const (
	// echoPort is the TCP containerPort of every echo workload.
	echoPort = 8080
	// udpEchoPort is the UDP containerPort of UDP workloads.
	udpEchoPort = 5353
	// servicePort is the port Services expose by default.
	servicePort = 80
	// echoImage is ignored by the node agent, which serves every
	// containerPort itself.
	echoImage = "kpc.local/echo"
)

// Bounds of the suite's waits.
const (
	// podTimeout bounds pods becoming Running and Ready.
	podTimeout = 90 * time.Second
	// programTimeout bounds kproxy acting on an API change.
	programTimeout = 30 * time.Second
	// requestTimeout is the deadline of a request expected to succeed.
	requestTimeout = 2 * time.Second
	// dropTimeout is the deadline of a request expected to be dropped.
	dropTimeout = 700 * time.Millisecond
	// pollInterval paces the retries of eventually.
	pollInterval = 200 * time.Millisecond
	// logTailLines is how much of each kproxy log a failure quotes.
	logTailLines = 25
)

// env is one test's view of the shared cluster: its own Kubernetes
// namespace, deleted when the test ends.
type env struct {
	t   *testing.T
	ctx context.Context
	c   *cluster.Cluster
	k   kubernetes.Interface
	ns  string

	// netns caches Exec target -> network namespace name.
	netns *sync.Map
}

// sub is e for a subtest: failures go to t.
func (e *env) sub(t *testing.T) *env {
	c := *e
	c.t = t
	return &c
}

// newEnv creates the test's namespace (deleted in t.Cleanup, after a dump
// of its objects when the test failed).
func newEnv(t *testing.T) *env {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
	if suiteCluster == nil {
		t.Fatal("no cluster: the suite's TestMain did not bring one up")
	}
	if !underMode(t.Name()) {
		t.Fatalf("%s uses the cluster's kproxy, so it runs in every mode: call it as inMode(t, test) (modes_test.go)", t.Name())
	}
	e := &env{
		t: t, ctx: t.Context(), c: suiteCluster, k: suiteCluster.Client(),
		ns:    namespaceName(t.Name()),
		netns: &sync.Map{},
	}
	_, err := e.k.CoreV1().Namespaces().Create(e.ctx, &v1.Namespace{
		ObjectMeta: metav1.ObjectMeta{Name: e.ns, Labels: map[string]string{"kpc.kproxy.io/e2e": "true"}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating namespace %s: %v", e.ns, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if t.Failed() {
			t.Logf("objects of namespace %s at the failure:\n%s", e.ns, e.dump(ctx))
		}
		if err := e.k.CoreV1().Namespaces().Delete(ctx, e.ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("deleting namespace %s: %v", e.ns, err)
		}
	})
	return e
}

var nonDNS = regexp.MustCompile(`[^a-z0-9]+`)

// namespaceName is "e2e-<test name>-<random>", a valid DNS label.
func namespaceName(test string) string {
	base := strings.Trim(nonDNS.ReplaceAllString(strings.ToLower(strings.TrimPrefix(test, "Test")), "-"), "-")
	if len(base) > 40 {
		base = strings.TrimRight(base[:40], "-")
	}
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	return "e2e-" + base + "-" + hex.EncodeToString(b)
}

// nodeName is cluster.NodeName, for brevity.
func nodeName(i int) string { return cluster.NodeName(i) }

// fatalf fails the test with the tails of every kproxy log and kproxy's
// rules of this test's namespace on every node.
func (e *env) fatalf(format string, args ...any) {
	e.t.Helper()
	e.t.Fatalf("%s\n%s", fmt.Sprintf(format, args...), e.diagnostics())
}

// diagnostics quotes the mode, the end of each kproxy log and kproxy's
// rules (kproxyRules) that mention this test's namespace, per node.
func (e *env) diagnostics() string {
	var b strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	mode := e.c.Mode()
	fmt.Fprintf(&b, "--- kproxy mode: %s\n", mode)
	for _, node := range e.c.NodeNames() {
		fmt.Fprintf(&b, "--- %s: end of %s\n%s", node, e.c.KproxyLog(node), tailFile(e.c.KproxyLog(node), logTailLines))
		lines, err := e.kproxyRules(ctx, node)
		if err != nil {
			fmt.Fprintf(&b, "--- %s: %v\n", node, err)
			continue
		}
		rules := mentions(lines, e.ns)
		if len(rules) > 60 {
			rules = append(rules[:60], fmt.Sprintf("... (%d more)", len(rules)-60))
		}
		fmt.Fprintf(&b, "--- %s: %s rules mentioning %s/ (%d of %d lines)\n%s\n", node, mode, e.ns, len(rules), len(lines), strings.Join(rules, "\n"))
	}
	return b.String()
}

// tailFile returns the last n lines of path.
func tailFile(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)\n", err)
	}
	lines := strings.SplitAfter(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "") + "\n"
}

// dump describes the namespace's pods, Services and EndpointSlices.
func (e *env) dump(ctx context.Context) string {
	var b strings.Builder
	if pods, err := e.k.CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, p := range pods.Items {
			fmt.Fprintf(&b, "pod %s node=%s ip=%s phase=%s ready=%v terminating=%v\n",
				p.Name, p.Spec.NodeName, p.Status.PodIP, p.Status.Phase, podReady(&p), p.DeletionTimestamp != nil)
		}
	}
	if svcs, err := e.k.CoreV1().Services(e.ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, s := range svcs.Items {
			fmt.Fprintf(&b, "service %s type=%s clusterIP=%s ports=%v externalIPs=%v lb=%v\n",
				s.Name, s.Spec.Type, s.Spec.ClusterIP, s.Spec.Ports, s.Spec.ExternalIPs, s.Status.LoadBalancer.Ingress)
		}
	}
	if slices, err := e.k.DiscoveryV1().EndpointSlices(e.ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, s := range slices.Items {
			fmt.Fprintf(&b, "endpointslice %s (service %s)\n", s.Name, s.Labels[discoveryv1.LabelServiceName])
			for _, ep := range s.Endpoints {
				fmt.Fprintf(&b, "  %s\n", describeEndpoint(ep))
			}
		}
	}
	return b.String()
}

func describeEndpoint(ep discoveryv1.Endpoint) string {
	var node, zone, target string
	if ep.NodeName != nil {
		node = *ep.NodeName
	}
	if ep.Zone != nil {
		zone = *ep.Zone
	}
	if ep.TargetRef != nil {
		target = ep.TargetRef.Name
	}
	var hints []string
	if ep.Hints != nil {
		for _, z := range ep.Hints.ForZones {
			hints = append(hints, z.Name)
		}
	}
	return fmt.Sprintf("%v pod=%s node=%s zone=%s ready=%v serving=%v terminating=%v hints=%v",
		ep.Addresses, target, node, zone, boolOr(ep.Conditions.Ready, true), boolOr(ep.Conditions.Serving, true),
		boolOr(ep.Conditions.Terminating, false), hints)
}

func boolOr(p *bool, def bool) bool {
	if p == nil {
		return def
	}
	return *p
}

// eventually polls cond until it returns nil, failing the test with its
// last error and the diagnostics after timeout.
func (e *env) eventually(what string, timeout time.Duration, cond func() error) {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			e.fatalf("%s: not so within %s; last: %v", what, timeout, err)
		}
		select {
		case <-e.ctx.Done():
			e.t.Fatalf("%s: %v (last: %v)", what, e.ctx.Err(), err)
		case <-time.After(pollInterval):
		}
	}
}

// consistently checks cond n times in a row, pollInterval apart.
func (e *env) consistently(what string, n int, cond func() error) {
	e.t.Helper()
	for i := range n {
		if err := cond(); err != nil {
			e.fatalf("%s: failed at check %d of %d: %v", what, i+1, n, err)
		}
		time.Sleep(pollInterval)
	}
}

// workload is a Deployment of echo pods.
type workload struct {
	name     string
	replicas int32
	// node pins the pods (spec.nodeName); empty lets the scheduler choose.
	node string
	// labels are added to the pods' app=<name>.
	labels map[string]string
	// ports default to TCP echoPort named "tcp".
	ports []v1.ContainerPort
	// graceSeconds is terminationGracePeriodSeconds (1 when zero).
	graceSeconds int64
}

func (w workload) podLabels() map[string]string {
	l := map[string]string{"app": w.name}
	maps.Copy(l, w.labels)
	return l
}

// deploy creates the Deployment and waits until its pods run and are
// ready; it returns them sorted by name.
func (e *env) deploy(w workload) []v1.Pod {
	e.t.Helper()
	ports := w.ports
	if ports == nil {
		ports = []v1.ContainerPort{{Name: "tcp", ContainerPort: echoPort, Protocol: v1.ProtocolTCP}}
	}
	grace := w.graceSeconds
	if grace == 0 {
		grace = 1
	}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: w.name, Namespace: e.ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: new(w.replicas),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": w.name}},
			Template: v1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: w.podLabels()},
				Spec: v1.PodSpec{
					NodeName:                      w.node,
					TerminationGracePeriodSeconds: new(grace),
					Containers:                    []v1.Container{{Name: "echo", Image: echoImage, Ports: ports}},
				},
			},
		},
	}
	if _, err := e.k.AppsV1().Deployments(e.ns).Create(e.ctx, d, metav1.CreateOptions{}); err != nil {
		e.t.Fatalf("creating deployment %s: %v", w.name, err)
	}
	return e.waitPods(map[string]string{"app": w.name}, int(w.replicas))
}

// scale sets a Deployment's replicas.
func (e *env) scale(name string, replicas int32) {
	e.t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		s, err := e.k.AppsV1().Deployments(e.ns).GetScale(e.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		s.Spec.Replicas = replicas
		_, err = e.k.AppsV1().Deployments(e.ns).UpdateScale(e.ctx, name, s, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		e.t.Fatalf("scaling deployment %s to %d: %v", name, replicas, err)
	}
}

func podReady(p *v1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == v1.PodReady {
			return c.Status == v1.ConditionTrue
		}
	}
	return false
}

// servingPods lists the running, ready, not terminating pods matching sel,
// sorted by name.
func (e *env) servingPods(sel map[string]string) ([]v1.Pod, error) {
	list, err := e.k.CoreV1().Pods(e.ns).List(e.ctx, metav1.ListOptions{LabelSelector: labels.SelectorFromSet(sel).String()})
	if err != nil {
		return nil, err
	}
	var out []v1.Pod
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil && p.Status.Phase == v1.PodRunning && p.Status.PodIP != "" && podReady(&p) {
			out = append(out, p)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

// waitPods waits until exactly n pods matching sel serve, and returns them.
func (e *env) waitPods(sel map[string]string, n int) []v1.Pod {
	e.t.Helper()
	var pods []v1.Pod
	e.eventually(fmt.Sprintf("%d ready pods %v", n, sel), podTimeout, func() error {
		var err error
		if pods, err = e.servingPods(sel); err != nil {
			return err
		}
		if len(pods) != n {
			return fmt.Errorf("%d ready pods: %v", len(pods), podNames(pods))
		}
		return nil
	})
	return pods
}

func podNames(pods []v1.Pod) []string {
	out := make([]string, len(pods))
	for i, p := range pods {
		out[i] = p.Name
	}
	return out
}

// clientPod runs a pod without ports on node (to send requests from) and
// returns its Exec target ("<namespace>/<name>") and address.
func (e *env) clientPod(name, node string) (target, ip string) {
	e.t.Helper()
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns, Labels: map[string]string{"role": "client"}},
		Spec: v1.PodSpec{
			NodeName:                      node,
			TerminationGracePeriodSeconds: new(int64(1)),
			Containers:                    []v1.Container{{Name: "client", Image: echoImage}},
		},
	}
	if _, err := e.k.CoreV1().Pods(e.ns).Create(e.ctx, p, metav1.CreateOptions{}); err != nil {
		e.t.Fatalf("creating client pod %s: %v", name, err)
	}
	e.eventually("client pod "+name+" running", podTimeout, func() error {
		got, err := e.k.CoreV1().Pods(e.ns).Get(e.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if got.Status.Phase != v1.PodRunning || got.Status.PodIP == "" {
			return fmt.Errorf("phase %s, ip %q", got.Status.Phase, got.Status.PodIP)
		}
		ip = got.Status.PodIP
		return nil
	})
	return e.ns + "/" + name, ip
}

// svcOption adjusts a Service before it is created.
type svcOption func(*v1.Service)

// createService creates a Service selecting sel, with one TCP port
// servicePort -> echoPort named "tcp" unless options change it.
func (e *env) createService(name string, sel map[string]string, opts ...svcOption) *v1.Service {
	e.t.Helper()
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns},
		Spec: v1.ServiceSpec{
			Selector: sel,
			Ports: []v1.ServicePort{{
				Name: "tcp", Protocol: v1.ProtocolTCP, Port: servicePort, TargetPort: intstr.FromInt32(echoPort),
			}},
		},
	}
	for _, o := range opts {
		o(s)
	}
	got, err := e.k.CoreV1().Services(e.ns).Create(e.ctx, s, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatalf("creating service %s: %v", name, err)
	}
	return got
}

func withType(t v1.ServiceType) svcOption {
	return func(s *v1.Service) { s.Spec.Type = t }
}

// updateService applies mutate to the current Service, retrying conflicts.
func (e *env) updateService(name string, mutate func(*v1.Service)) *v1.Service {
	e.t.Helper()
	var got *v1.Service
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		s, err := e.k.CoreV1().Services(e.ns).Get(e.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		mutate(s)
		got, err = e.k.CoreV1().Services(e.ns).Update(e.ctx, s, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		e.t.Fatalf("updating service %s: %v", name, err)
	}
	return got
}

// endpoints returns the endpoints of every EndpointSlice of a Service.
func (e *env) endpoints(svc string) ([]discoveryv1.Endpoint, error) {
	list, err := e.k.DiscoveryV1().EndpointSlices(e.ns).List(e.ctx, metav1.ListOptions{
		LabelSelector: discoveryv1.LabelServiceName + "=" + svc,
	})
	if err != nil {
		return nil, err
	}
	var out []discoveryv1.Endpoint
	for _, s := range list.Items {
		out = append(out, s.Endpoints...)
	}
	return out, nil
}

// waitEndpoints waits until cond accepts the Service's endpoints.
func (e *env) waitEndpoints(svc, what string, cond func([]discoveryv1.Endpoint) error) []discoveryv1.Endpoint {
	e.t.Helper()
	var eps []discoveryv1.Endpoint
	e.eventually(fmt.Sprintf("endpoints of %s: %s", svc, what), podTimeout, func() error {
		var err error
		if eps, err = e.endpoints(svc); err != nil {
			return err
		}
		if err := cond(eps); err != nil {
			var desc []string
			for _, ep := range eps {
				desc = append(desc, describeEndpoint(ep))
			}
			return fmt.Errorf("%w; endpoints: %v", err, desc)
		}
		return nil
	})
	return eps
}

// readyCount is a waitEndpoints condition: exactly n ready endpoints.
func readyCount(n int) func([]discoveryv1.Endpoint) error {
	return func(eps []discoveryv1.Endpoint) error {
		ready := 0
		for _, ep := range eps {
			if boolOr(ep.Conditions.Ready, true) {
				ready++
			}
		}
		if ready != n {
			return fmt.Errorf("%d ready endpoints, want %d", ready, n)
		}
		return nil
	}
}

// reply is what an echo server answered.
type reply struct {
	// Pod is the name of the pod that answered.
	Pod string
	// Source is the client address the pod saw.
	Source netip.Addr
}

func parseReply(s string) (reply, error) {
	pod, addr, ok := strings.Cut(s, " ")
	if !ok {
		return reply{}, fmt.Errorf("unexpected reply %q", s)
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return reply{}, fmt.Errorf("unexpected reply %q: %w", s, err)
	}
	return reply{Pod: pod, Source: ap.Addr()}, nil
}

// netnsOf resolves an Exec target (node name, "client" or
// "<namespace>/<pod>") to its network namespace.
func (e *env) netnsOf(from string) (*netnstest.NS, error) {
	if name, ok := e.netns.Load(from); ok {
		return &netnstest.NS{Name: name.(string)}, nil
	}
	name, err := e.c.NetNS(e.ctx, from)
	if err != nil {
		return nil, err
	}
	e.netns.Store(from, name)
	return &netnstest.NS{Name: name}, nil
}

// request sends one request from inside from's namespace to addr
// ("ip:port") over network ("tcp" or "udp").
func (e *env) request(from, network, addr string, timeout time.Duration) (reply, error) {
	ns, err := e.netnsOf(from)
	if err != nil {
		return reply{}, err
	}
	ctx, cancel := context.WithTimeout(e.ctx, timeout)
	defer cancel()
	out, err := netnstest.Request(ctx, ns, network, addr)
	if err != nil {
		return reply{}, err
	}
	return parseReply(out)
}

// samples are the replies of several requests.
type samples struct {
	replies []reply
}

// pods counts the replies per pod.
func (s samples) pods() map[string]int {
	out := map[string]int{}
	for _, r := range s.replies {
		out[r.Pod]++
	}
	return out
}

// sources lists the distinct client addresses the pods saw.
func (s samples) sources() []netip.Addr {
	var out []netip.Addr
	for _, r := range s.replies {
		if !slices.Contains(out, r.Source) {
			out = append(out, r.Source)
		}
	}
	return out
}

func (s samples) String() string {
	return fmt.Sprintf("%d replies: pods %v, sources %v", len(s.replies), s.pods(), s.sources())
}

// sample sends n requests and fails at the first error.
func (e *env) sample(from, network, addr string, n int) (samples, error) {
	var s samples
	for range n {
		r, err := e.request(from, network, addr, requestTimeout)
		if err != nil {
			return s, fmt.Errorf("after %d replies: %w", len(s.replies), err)
		}
		s.replies = append(s.replies, r)
	}
	return s, nil
}

// expect describes what a batch of replies must show.
type expect struct {
	// all must each answer at least once.
	all []string
	// only, when set, are the only pods allowed to answer.
	only []string
	// sources, when set, are the only client addresses pods may see.
	sources []string
}

// check returns an error when s misses e.
func (x expect) check(s samples) error {
	var problems []string
	seen := s.pods()
	for _, p := range x.all {
		if seen[p] == 0 {
			problems = append(problems, "no reply from "+p)
		}
	}
	if x.only != nil {
		for p := range seen {
			if !slices.Contains(x.only, p) {
				problems = append(problems, fmt.Sprintf("reply from %s, only %v allowed", p, x.only))
			}
		}
	}
	if x.sources != nil {
		for _, a := range s.sources() {
			if !slices.Contains(x.sources, a.String()) {
				problems = append(problems, fmt.Sprintf("a pod saw source %s, want one of %v", a, x.sources))
			}
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("%s (%s)", strings.Join(problems, "; "), s)
	}
	return nil
}

// expectTraffic waits until a batch of n requests from from to addr
// satisfies x: kproxy may still be programming the change.
func (e *env) expectTraffic(from, network, addr string, n int, x expect) samples {
	e.t.Helper()
	var last samples
	e.eventually(fmt.Sprintf("%d %s requests from %s to %s", n, network, from, addr), programTimeout, func() error {
		s, err := e.sample(from, network, addr, n)
		if err != nil {
			return err
		}
		last = s
		return x.check(s)
	})
	return last
}

// expectFailure waits until a request from from to addr fails with class
// (netnstest.ErrTimeout or netnstest.ErrRefused; nil accepts either),
// then checks that three more fail the same way.
func (e *env) expectFailure(from, network, addr string, class error) {
	e.t.Helper()
	timeout := dropTimeout
	if class == netnstest.ErrRefused {
		timeout = requestTimeout
	}
	check := func() error {
		r, err := e.request(from, network, addr, timeout)
		switch {
		case err == nil:
			return fmt.Errorf("%s answered (saw source %s)", r.Pod, r.Source)
		case class == nil && (errors.Is(err, netnstest.ErrTimeout) || errors.Is(err, netnstest.ErrRefused)):
			return nil
		case class != nil && errors.Is(err, class):
			return nil
		default:
			return fmt.Errorf("want %v, got: %w", classOrAny(class), err)
		}
	}
	what := fmt.Sprintf("%s %s from %s fails with %v", network, addr, from, classOrAny(class))
	e.eventually(what, programTimeout, check)
	e.consistently(what, 3, check)
}

func classOrAny(class error) string {
	if class == nil {
		return "a timeout or a refusal"
	}
	return class.Error()
}

// hostPort joins an address and a port.
func hostPort(ip string, port int32) string {
	return net.JoinHostPort(ip, strconv.Itoa(int(port)))
}

// clientRoute routes vip (in cluster.ExternalVIPCIDR) from the external
// client via node i, until the test ends.
func (e *env) clientRoute(vip string, node int) {
	e.t.Helper()
	dst := vip + "/32"
	if _, err := e.c.Exec(e.ctx, cluster.TargetClient, "ip", "route", "replace", dst, "via", cluster.NodeIP(node)); err != nil {
		e.t.Fatalf("routing %s via %s in the client: %v", dst, nodeName(node), err)
	}
	e.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := e.c.Exec(ctx, cluster.TargetClient, "ip", "route", "del", dst); err != nil {
			e.t.Errorf("removing the client's route to %s: %v", dst, err)
		}
	})
}

// setPodReadiness sets or clears the node agent's readiness annotation.
func (e *env) setPodReadiness(pod string, ready bool) {
	e.t.Helper()
	value := "null"
	if !ready {
		value = `"false"`
	}
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%s}}}`, nodeagent.ReadyAnnotation, value)
	if _, err := e.k.CoreV1().Pods(e.ns).Patch(e.ctx, pod, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		e.t.Fatalf("setting the readiness of pod %s to %v: %v", pod, ready, err)
	}
}

// nodeIPs are the addresses of every node.
func (e *env) nodeIPs() []string {
	var out []string
	for i := range e.c.NodeNames() {
		out = append(out, cluster.NodeIP(i+1))
	}
	return out
}

// names returns the names of pods on node (all pods when node is empty).
func names(pods []v1.Pod, node string) []string {
	var out []string
	for _, p := range pods {
		if node == "" || p.Spec.NodeName == node {
			out = append(out, p.Name)
		}
	}
	return out
}
