package nodeagent

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"
)

const (
	testNode    = "node-1"
	testNodeNS  = "kpt-fake-node"
	testPodNS   = "default"
	testNetPfx  = "kpt-fake-p-"
	pollTimeout = 30 * time.Second
)

var (
	testNodeIP  = netip.MustParseAddr("10.254.0.11")
	testPodCIDR = netip.MustParsePrefix("10.244.1.0/24")
	testStart   = time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
)

// testEnv is an agent running against a fake clientset, a fake clock and a
// given network.
type testEnv struct {
	client *fake.Clientset
	clock  *testingclock.FakeClock
	agent  *agent
}

func testOptions(client kubernetes.Interface, nodeNS, netPrefix string) Options {
	return Options{
		NodeName:       testNode,
		NodeIP:         testNodeIP,
		PodCIDR:        testPodCIDR,
		NodeNetNS:      nodeNS,
		MaxGracePeriod: 20 * time.Second,
		PodNetNSPrefix: netPrefix,
		Client:         client,
	}
}

// startAgent runs an agent until the test ends; objs seed the clientset
// (a Node object is always added).
func startAgent(t *testing.T, nw podNetwork, nodeNS, netPrefix string, objs ...runtime.Object) *testEnv {
	t.Helper()
	objs = append(objs, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: testNode}})
	env := &testEnv{client: fake.NewClientset(objs...), clock: testingclock.NewFakeClock(testStart)}
	opts := testOptions(env.client, nodeNS, netPrefix)
	if err := opts.complete(); err != nil {
		t.Fatal(err)
	}
	a, err := newAgent(opts, env.client, nw, env.clock)
	if err != nil {
		t.Fatal(err)
	}
	env.agent = a
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent run: %v", err)
		}
	})
	return env
}

// waitFor polls cond until it holds; the timeout only bounds a failing
// test.
func waitFor(t *testing.T, what string, cond func() (bool, error)) {
	t.Helper()
	var last error
	err := wait.PollUntilContextTimeout(t.Context(), 5*time.Millisecond, pollTimeout, true, func(context.Context) (bool, error) {
		ok, err := cond()
		last = err
		return ok, nil
	})
	if err != nil {
		t.Fatalf("waiting for %s: %v (last error: %v)", what, err, last)
	}
}

type podOpt func(*v1.Pod)

func withAnnotation(k, v string) podOpt {
	return func(p *v1.Pod) {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[k] = v
	}
}

func withPodIP(ip string) podOpt {
	return func(p *v1.Pod) {
		p.Status.Phase = v1.PodRunning
		p.Status.PodIP = ip
		p.Status.PodIPs = []v1.PodIP{{IP: ip}}
	}
}

func onNode(node string) podOpt { return func(p *v1.Pod) { p.Spec.NodeName = node } }

func terminating(graceSeconds int64) podOpt {
	return func(p *v1.Pod) {
		p.DeletionTimestamp = new(metav1.NewTime(testStart))
		p.DeletionGracePeriodSeconds = new(graceSeconds)
	}
}

// testPod is a pod on testNode serving TCP 8080, HTTP 8081 and UDP 5353.
func testPod(name string, uid types.UID, opts ...podOpt) *v1.Pod {
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: testPodNS, Name: name, UID: uid},
		Spec: v1.PodSpec{
			NodeName: testNode,
			Containers: []v1.Container{{
				Name:  "echo",
				Image: "kpc/echo",
				Ports: []v1.ContainerPort{
					{Name: "tcp", ContainerPort: 8080},
					{Name: "http", ContainerPort: 8081},
					{Name: "udp", ContainerPort: 5353, Protocol: v1.ProtocolUDP},
				},
			}},
		},
		Status: v1.PodStatus{Phase: v1.PodPending},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

func (e *testEnv) getPod(name string) (*v1.Pod, error) {
	return e.client.CoreV1().Pods(testPodNS).Get(context.Background(), name, metav1.GetOptions{})
}

// waitRunning waits until the pod reports Running with an IP and Ready
// status want, and returns it.
func (e *testEnv) waitRunning(t *testing.T, name string, want v1.ConditionStatus) *v1.Pod {
	t.Helper()
	var pod *v1.Pod
	waitFor(t, fmt.Sprintf("pod %s running with Ready=%s", name, want), func() (bool, error) {
		var err error
		pod, err = e.getPod(name)
		if err != nil {
			return false, err
		}
		return pod.Status.Phase == v1.PodRunning && pod.Status.PodIP != "" && readyStatus(pod) == want, nil
	})
	return pod
}

func readyStatus(pod *v1.Pod) v1.ConditionStatus {
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodReady {
			return c.Status
		}
	}
	return ""
}

// waitGone waits until the pod object is deleted.
func (e *testEnv) waitGone(t *testing.T, name string) {
	t.Helper()
	waitFor(t, "pod "+name+" deleted", func() (bool, error) {
		_, err := e.getPod(name)
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
}

// waitTerminating waits until the agent has armed the grace timer of the
// pod at key and returns when the grace period ends.
func (e *testEnv) waitTerminating(t *testing.T, key string) time.Time {
	t.Helper()
	var deadline time.Time
	waitFor(t, "agent tracking the deletion of "+key, func() (bool, error) {
		e.agent.mu.Lock()
		defer e.agent.mu.Unlock()
		if rt := e.agent.running[key]; rt != nil && rt.timer != nil {
			deadline = rt.deleteAt
			return true, nil
		}
		return false, nil
	})
	return deadline
}

// markDeleted sets the deletion fields on the stored pod, as the API server
// does for a graceful delete.
func (e *testEnv) markDeleted(t *testing.T, name string, graceSeconds int64) {
	t.Helper()
	pod, err := e.getPod(name)
	if err != nil {
		t.Fatal(err)
	}
	terminating(graceSeconds)(pod)
	if _, err := e.client.CoreV1().Pods(testPodNS).Update(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (e *testEnv) setAnnotation(t *testing.T, name, key, value string) {
	t.Helper()
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%q}}}`, key, value)
	if _, err := e.client.CoreV1().Pods(testPodNS).Patch(context.Background(), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// request sends one request and returns the reply line: a TCP line, an
// HTTP GET body (status 200 required) or a UDP datagram.
func request(ctx context.Context, dial func(ctx context.Context, network, addr string) (net.Conn, error), kind, addr string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	switch kind {
	case "http":
		client := &http.Client{Transport: &http.Transport{DialContext: dial, DisableKeepAlives: true}}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/", nil)
		if err != nil {
			return "", err
		}
		resp, err := client.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return "", err
		}
		if resp.StatusCode != http.StatusOK {
			return "", fmt.Errorf("HTTP status %d", resp.StatusCode)
		}
		return strings.TrimSuffix(string(body), "\n"), nil
	case "tcp", "udp":
		c, err := dial(ctx, kind, addr)
		if err != nil {
			return "", err
		}
		defer c.Close()
		dl, _ := ctx.Deadline()
		_ = c.SetDeadline(dl)
		if kind == "udp" {
			if _, err := c.Write([]byte("ping")); err != nil {
				return "", err
			}
			buf := make([]byte, 1024)
			n, err := c.Read(buf)
			if err != nil {
				return "", err
			}
			return strings.TrimSuffix(string(buf[:n]), "\n"), nil
		}
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			return "", err
		}
		return strings.TrimSuffix(line, "\n"), nil
	}
	return "", fmt.Errorf("unknown request kind %q", kind)
}

var plainDial = (&net.Dialer{}).DialContext

// checkEcho asserts the fake pod's three servers answer "<name> <client>"
// on their loopback stand-ins.
func checkEcho(t *testing.T, nw *fakeNetwork, netnsName, podName string) {
	t.Helper()
	for _, tc := range []struct {
		kind, network string
		port          int
	}{{"tcp", "tcp", 8080}, {"http", "tcp", 8081}, {"udp", "udp", 5353}} {
		addr, ok := nw.socket(netnsName, tc.network, tc.port)
		if !ok {
			t.Errorf("no %s socket for port %d in %s", tc.network, tc.port, netnsName)
			continue
		}
		got, err := request(t.Context(), plainDial, tc.kind, addr)
		if err != nil {
			t.Errorf("%s request to %s: %v", tc.kind, addr, err)
			continue
		}
		name, client, ok := strings.Cut(got, " ")
		if !ok || name != podName || !strings.HasPrefix(client, "127.0.0.1:") {
			t.Errorf("%s reply %q, want %q followed by the client address", tc.kind, got, podName)
		}
	}
}

// checkClosed asserts nothing answers on the fake pod's TCP port any more.
func checkClosed(t *testing.T, nw *fakeNetwork, netnsName string) {
	t.Helper()
	addr, ok := nw.socket(netnsName, "tcp", 8080)
	if !ok {
		t.Fatalf("no tcp socket recorded for %s", netnsName)
	}
	if got, err := request(t.Context(), plainDial, "tcp", addr); err == nil {
		t.Errorf("server in %s still answers: %q", netnsName, got)
	}
}

func TestPodLifecycle(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	env := startAgent(t, nw, testNodeNS, testNetPfx,
		testPod("web-1", "aaaaaaaa-0001"),
		testPod("elsewhere", "bbbbbbbb-0001", onNode("node-2")),
	)

	pod := env.waitRunning(t, "web-1", v1.ConditionTrue)
	if pod.Status.PodIP != "10.244.1.2" || pod.Status.HostIP != testNodeIP.String() {
		t.Errorf("podIP %s hostIP %s, want 10.244.1.2 and %s", pod.Status.PodIP, pod.Status.HostIP, testNodeIP)
	}
	if cs := pod.Status.ContainerStatuses; len(cs) != 1 || !cs[0].Ready || cs[0].State.Running == nil {
		t.Errorf("container statuses %+v, want one running and ready", cs)
	}
	netnsName := testNetPfx + "aaaaaaaa"
	cfg, ok := nw.pod(netnsName)
	if !ok || cfg.Addr != netip.MustParsePrefix("10.244.1.2/24") || cfg.HostVeth != "vpaaaaaaaa" {
		t.Fatalf("pod network = %+v (exists %v), want 10.244.1.2/24 on vpaaaaaaaa", cfg, ok)
	}
	checkEcho(t, nw, netnsName, "web-1")

	// A pod of another node is left alone.
	if other, err := env.getPod("elsewhere"); err != nil || other.Status.Phase != v1.PodPending {
		t.Errorf("pod of node-2: %v, phase %v; want untouched", err, other.Status.Phase)
	}
	if _, ok := nw.pod(testNetPfx + "bbbbbbbb"); ok {
		t.Error("network created for a pod of node-2")
	}

	// Readiness follows the annotation.
	env.setAnnotation(t, "web-1", ReadyAnnotation, "false")
	pod = env.waitRunning(t, "web-1", v1.ConditionFalse)
	if cs := pod.Status.ContainerStatuses; len(cs) != 1 || cs[0].Ready {
		t.Errorf("container statuses %+v, want not ready", cs)
	}
	checkEcho(t, nw, netnsName, "web-1") // a not-ready pod still serves
	env.setAnnotation(t, "web-1", ReadyAnnotation, "true")
	env.waitRunning(t, "web-1", v1.ConditionTrue)

	// A second pod gets the next address.
	if _, err := env.client.CoreV1().Pods(testPodNS).Create(t.Context(), testPod("web-2", "cccccccc-0001"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if pod := env.waitRunning(t, "web-2", v1.ConditionTrue); pod.Status.PodIP != "10.244.1.3" {
		t.Errorf("second pod IP %s, want 10.244.1.3", pod.Status.PodIP)
	}

	// Deletion: the pod keeps serving through its grace period.
	env.markDeleted(t, "web-1", 5)
	deadline := env.waitTerminating(t, testPodNS+"/web-1")
	if want := testStart.Add(5 * time.Second); !deadline.Equal(want) {
		t.Errorf("grace deadline %v, want %v", deadline, want)
	}
	if _, err := env.getPod("web-1"); err != nil {
		t.Fatalf("pod deleted before its grace period ended: %v", err)
	}
	checkEcho(t, nw, netnsName, "web-1")
	env.clock.Step(5 * time.Second)
	env.waitGone(t, "web-1")
	if _, ok := nw.pod(netnsName); ok {
		t.Error("pod network still exists after deletion")
	}
	checkClosed(t, nw, netnsName)
	if _, ok := nw.pod(testNetPfx + "cccccccc"); !ok {
		t.Error("network of web-2 removed with web-1")
	}

	// The freed address is reused once the rest of the range is used, not
	// at once: the next pod gets .4.
	if _, err := env.client.CoreV1().Pods(testPodNS).Create(t.Context(), testPod("web-3", "dddddddd-0001"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if pod := env.waitRunning(t, "web-3", v1.ConditionTrue); pod.Status.PodIP != "10.244.1.4" {
		t.Errorf("third pod IP %s, want 10.244.1.4", pod.Status.PodIP)
	}
}

func TestGraceCappedAndShortened(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	env := startAgent(t, nw, testNodeNS, testNetPfx, testPod("slow", "aaaaaaaa-0002"))
	env.waitRunning(t, "slow", v1.ConditionTrue)

	env.markDeleted(t, "slow", 600)
	// MaxGracePeriod of the test agent is 20s.
	if deadline := env.waitTerminating(t, testPodNS+"/slow"); !deadline.Equal(testStart.Add(20 * time.Second)) {
		t.Errorf("grace deadline %v, want the 20s cap", deadline)
	}
	env.clock.Step(2 * time.Second)

	// A second delete with a shorter grace period wins.
	env.markDeleted(t, "slow", 3)
	waitFor(t, "the shorter deadline", func() (bool, error) {
		env.agent.mu.Lock()
		defer env.agent.mu.Unlock()
		rt := env.agent.running[testPodNS+"/slow"]
		return rt != nil && rt.deleteAt.Equal(testStart.Add(3*time.Second)), nil
	})
	if _, err := env.getPod("slow"); err != nil {
		t.Fatalf("pod deleted early: %v", err)
	}
	env.clock.Step(time.Second)
	env.waitGone(t, "slow")
	if _, ok := nw.pod(testNetPfx + "aaaaaaaa"); ok {
		t.Error("pod network still exists")
	}
}

func TestVanishedPodCleanedUp(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	env := startAgent(t, nw, testNodeNS, testNetPfx, testPod("gone", "aaaaaaaa-0003"))
	env.waitRunning(t, "gone", v1.ConditionTrue)
	netnsName := testNetPfx + "aaaaaaaa"
	// Force deletion: the object disappears without a grace period.
	if err := env.client.CoreV1().Pods(testPodNS).Delete(t.Context(), "gone", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "pod network removed", func() (bool, error) {
		_, ok := nw.pod(netnsName)
		return !ok, nil
	})
	checkClosed(t, nw, netnsName)
	if err := env.agent.ipam.reserve("someone-else", netip.MustParseAddr("10.244.1.2")); err != nil {
		t.Errorf("address of the vanished pod not released: %v", err)
	}
}

func TestReplacedPodRestarted(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	env := startAgent(t, nw, testNodeNS, testNetPfx, testPod("sts-0", "aaaaaaaa-0004"))
	env.waitRunning(t, "sts-0", v1.ConditionTrue)
	// The same name comes back with a new UID before the agent saw the
	// old one go: delete and create again.
	pods := env.client.CoreV1().Pods(testPodNS)
	if err := pods.Delete(t.Context(), "sts-0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Create(t.Context(), testPod("sts-0", "eeeeeeee-0004"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "new incarnation running", func() (bool, error) {
		pod, err := env.getPod("sts-0")
		if err != nil {
			return false, err
		}
		_, oldExists := nw.pod(testNetPfx + "aaaaaaaa")
		_, newExists := nw.pod(testNetPfx + "eeeeeeee")
		return pod.Status.PodIP != "" && !oldExists && newExists, nil
	})
	checkEcho(t, nw, testNetPfx+"eeeeeeee", "sts-0")
}

func TestRestartRecoversState(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	// Left by an earlier agent: two running pods, the network of one of
	// them, and the network of a pod that is gone.
	for _, cfg := range []podNetConfig{
		{NetNS: testNetPfx + "aaaaaaaa", HostVeth: "vpaaaaaaaa", Addr: netip.MustParsePrefix("10.244.1.2/24")},
		{NetNS: testNetPfx + "99999999", HostVeth: "vp99999999", Addr: netip.MustParsePrefix("10.244.1.9/24")},
	} {
		if err := nw.Setup(t.Context(), cfg); err != nil {
			t.Fatal(err)
		}
	}
	env := startAgent(t, nw, testNodeNS, testNetPfx,
		testPod("old-1", "aaaaaaaa-0005", withPodIP("10.244.1.2")),
		testPod("old-2", "bbbbbbbb-0005", withPodIP("10.244.1.3")),
		testPod("new", "cccccccc-0005"),
		testPod("deleted-while-down", "dddddddd-0005", withPodIP("10.244.1.5"), terminating(30)),
	)
	if pod := env.waitRunning(t, "new", v1.ConditionTrue); pod.Status.PodIP != "10.244.1.4" {
		t.Errorf("new pod IP %s, want 10.244.1.4 (.2 and .3 recovered, .5 held until its pod is finished)", pod.Status.PodIP)
	}
	for name, ip := range map[string]string{"old-1": "10.244.1.2", "old-2": "10.244.1.3"} {
		pod := env.waitRunning(t, name, v1.ConditionTrue)
		if pod.Status.PodIP != ip {
			t.Errorf("%s IP %s, want its old %s", name, pod.Status.PodIP, ip)
		}
	}
	// old-1's leftover namespace was recreated (a second setup), old-2
	// got one.
	if n := nw.setupCount(testNetPfx + "aaaaaaaa"); n != 2 {
		t.Errorf("setups of old-1's namespace = %d, want 2 (leftover, then recreated)", n)
	}
	if cfg, ok := nw.pod(testNetPfx + "bbbbbbbb"); !ok || cfg.Addr.Addr().String() != "10.244.1.3" {
		t.Errorf("old-2 network = %+v (exists %v)", cfg, ok)
	}
	if _, ok := nw.pod(testNetPfx + "99999999"); ok {
		t.Error("orphaned namespace of a gone pod not removed")
	}
	// A pod deleted while no agent ran is finished at once, not restarted.
	env.waitGone(t, "deleted-while-down")
	if n := nw.setupCount(testNetPfx + "dddddddd"); n != 0 {
		t.Errorf("deleted pod was set up %d times", n)
	}
}

func TestSetupFailureRetried(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	nw.failSetups = 2
	env := startAgent(t, nw, testNodeNS, testNetPfx, testPod("flaky", "aaaaaaaa-0006"))
	// Each failed attempt gave its address back and next-fit moved on:
	// .2 and .3 were tried, the third attempt gets .4.
	pod := env.waitRunning(t, "flaky", v1.ConditionTrue)
	if pod.Status.PodIP != "10.244.1.4" {
		t.Errorf("pod IP %s, want 10.244.1.4 after two failed attempts", pod.Status.PodIP)
	}
	if err := env.agent.ipam.reserve("x", netip.MustParseAddr("10.244.1.2")); err != nil {
		t.Errorf("address of a failed attempt not released: %v", err)
	}
	checkEcho(t, nw, testNetPfx+"aaaaaaaa", "flaky")
}

func TestNodeHeartbeat(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	env := startAgent(t, nw, testNodeNS, testNetPfx)
	readyAt := func(heartbeat time.Time) func() (bool, error) {
		return func() (bool, error) {
			node, err := env.client.CoreV1().Nodes().Get(t.Context(), testNode, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			for _, c := range node.Status.Conditions {
				if c.Type == v1.NodeReady {
					if c.Status != v1.ConditionTrue {
						return false, fmt.Errorf("Ready is %s", c.Status)
					}
					if !c.LastTransitionTime.Time.Equal(testStart) {
						return false, fmt.Errorf("transition time %v, want %v", c.LastTransitionTime, testStart)
					}
					return c.LastHeartbeatTime.Time.Equal(heartbeat), nil
				}
			}
			return false, errors.New("no Ready condition")
		}
	}
	waitFor(t, "Ready at start", readyAt(testStart))
	env.clock.Step(HeartbeatInterval)
	waitFor(t, "fresh heartbeat", readyAt(testStart.Add(HeartbeatInterval)))
	env.clock.Step(HeartbeatInterval)
	waitFor(t, "second heartbeat", readyAt(testStart.Add(2*HeartbeatInterval)))
}

func TestOptionsComplete(t *testing.T) {
	client := fake.NewClientset()
	tests := []struct {
		name    string
		mutate  func(*Options)
		wantErr string
	}{
		{name: "valid"},
		{name: "no node name", mutate: func(o *Options) { o.NodeName = "" }, wantErr: "NodeName"},
		{name: "no node IP", mutate: func(o *Options) { o.NodeIP = netip.Addr{} }, wantErr: "NodeIP"},
		{name: "no pod CIDR", mutate: func(o *Options) { o.PodCIDR = netip.Prefix{} }, wantErr: "PodCIDR"},
		{name: "no node netns", mutate: func(o *Options) { o.NodeNetNS = "" }, wantErr: "NodeNetNS"},
		{name: "no client", mutate: func(o *Options) { o.Client = nil }, wantErr: "Kubeconfig"},
		{name: "negative grace", mutate: func(o *Options) { o.MaxGracePeriod = -time.Second }, wantErr: "negative"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			o := testOptions(client, testNodeNS, "")
			o.MaxGracePeriod = 0
			if tc.mutate != nil {
				tc.mutate(&o)
			}
			err := o.complete()
			if tc.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if o.MaxGracePeriod != DefaultMaxGracePeriod || o.PodNetNSPrefix != DefaultPodNetNSPrefix {
					t.Errorf("defaults not applied: %+v", o)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("complete() = %v, want an error about %s", err, tc.wantErr)
			}
		})
	}
}

// TestRecoveredAddressReleased drives recover and syncPod directly over a
// hand-filled cache: an address recovered for a pod must be freed when
// that pod goes away before the agent starts it.
func TestRecoveredAddressReleased(t *testing.T) {
	const key = testPodNS + "/old"
	recoveredIP := netip.MustParseAddr("10.244.1.7")
	tests := []struct {
		name string
		// then is the pod at key when the agent syncs it (nil: gone).
		then *v1.Pod
	}{
		{name: "vanished", then: nil},
		{name: "finished", then: testPod("old", "aaaaaaaa-0007", withPodIP("10.244.1.7"), func(p *v1.Pod) { p.Status.Phase = v1.PodFailed })},
		{name: "replaced by a new pod of the same name", then: testPod("old", "bbbbbbbb-0007")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			nw := newFakeNetwork(testNodeNS)
			indexer := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{})
			old := testPod("old", "aaaaaaaa-0007", withPodIP(recoveredIP.String()))
			if err := indexer.Add(old); err != nil {
				t.Fatal(err)
			}
			var objs []runtime.Object
			if tc.then != nil {
				objs = append(objs, tc.then)
			}
			client := fake.NewClientset(objs...)
			opts := testOptions(client, testNodeNS, testNetPfx)
			if err := opts.complete(); err != nil {
				t.Fatal(err)
			}
			a, err := newAgent(opts, client, nw, testingclock.NewFakeClock(testStart))
			if err != nil {
				t.Fatal(err)
			}
			a.pods = corelisters.NewPodLister(indexer)
			a.recover(ctx)
			if err := a.ipam.reserve("probe", recoveredIP); err == nil {
				t.Fatal("recover did not reserve the running pod's address")
			}

			if err := indexer.Delete(old); err != nil {
				t.Fatal(err)
			}
			if tc.then != nil {
				if err := indexer.Add(tc.then); err != nil {
					t.Fatal(err)
				}
			}
			if err := a.syncPod(ctx, key); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { a.stopAll(ctx) })
			a.mu.Lock()
			_, still := a.recovered[key]
			a.mu.Unlock()
			if still {
				t.Error("pod still recorded as recovered")
			}
			if got, ok := a.ipam.byUID["aaaaaaaa-0007"]; ok {
				t.Errorf("old pod still holds %s", got)
			}
		})
	}
}

func TestHostNetworkPod(t *testing.T) {
	nw := newFakeNetwork(testNodeNS)
	hostPod := testPod("host", "aaaaaaaa-0008", func(p *v1.Pod) { p.Spec.HostNetwork = true })
	env := startAgent(t, nw, testNodeNS, testNetPfx, hostPod)
	pod := env.waitRunning(t, "host", v1.ConditionTrue)
	if pod.Status.PodIP != testNodeIP.String() {
		t.Errorf("podIP %s, want the node's %s", pod.Status.PodIP, testNodeIP)
	}
	if _, ok := nw.pod(testNetPfx + "aaaaaaaa"); ok {
		t.Error("a namespace was created for a host-network pod")
	}
	checkEcho(t, nw, testNodeNS, "host") // served in the node namespace
	env.markDeleted(t, "host", 0)
	env.waitGone(t, "host")
	checkClosed(t, nw, testNodeNS)
	// The node address never entered the pod range.
	if err := env.agent.ipam.reserve("x", netip.MustParseAddr("10.244.1.2")); err != nil {
		t.Errorf("pod range touched by a host-network pod: %v", err)
	}
}
