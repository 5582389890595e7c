package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kproxy/kproxy/test/cluster"
)

// endpointOf finds the endpoint of a pod.
func endpointOf(eps []discoveryv1.Endpoint, pod string) (discoveryv1.Endpoint, bool) {
	for _, ep := range eps {
		if ep.TargetRef != nil && ep.TargetRef.Name == pod {
			return ep, true
		}
	}
	return discoveryv1.Endpoint{}, false
}

// TestNotReadyAndTerminating: a not-ready pod gets no traffic; a pod
// being deleted gets no new traffic while ready endpoints remain; when
// every endpoint is terminating, the serving ones still answer.
func TestNotReadyAndTerminating(t *testing.T) { inMode(t, testNotReadyAndTerminating) }

func testNotReadyAndTerminating(t *testing.T) {
	e := newEnv(t)
	sel := map[string]string{"app": "web"}
	pods := e.deploy(workload{name: "web", replicas: 3, graceSeconds: 30})
	svc := e.createService("web", sel)
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	from, _ := e.clientPod("client", nodeName(1))
	addr := hostPort(svc.Spec.ClusterIP, servicePort)
	e.expectTraffic(from, "tcp", addr, 30, expect{all: names(pods, "")})

	t.Run("not ready", func(t *testing.T) {
		e := e.sub(t)
		pod, others := pods[0].Name, names(pods[1:], "")
		e.setPodReadiness(pod, false)
		e.waitEndpoints(svc.Name, pod+" not ready", func(eps []discoveryv1.Endpoint) error {
			ep, ok := endpointOf(eps, pod)
			if !ok || boolOr(ep.Conditions.Ready, true) {
				return fmt.Errorf("%s not yet listed as not ready", pod)
			}
			return readyCount(2)(eps)
		})
		s := e.expectTraffic(from, "tcp", addr, 30, expect{all: others, only: others})
		t.Logf("%s not ready: %s", pod, s)

		e.setPodReadiness(pod, true)
		e.waitEndpoints(svc.Name, pod+" ready again", readyCount(3))
		e.expectTraffic(from, "tcp", addr, 30, expect{all: names(pods, "")})
	})
	if t.Failed() {
		return
	}

	t.Run("terminating with ready endpoints left", func(t *testing.T) {
		e := e.sub(t)
		pod := pods[1].Name
		if err := e.k.CoreV1().Pods(e.ns).Delete(e.ctx, pod, metav1.DeleteOptions{GracePeriodSeconds: new(int64(30))}); err != nil {
			t.Fatalf("deleting pod %s: %v", pod, err)
		}
		e.waitEndpoints(svc.Name, pod+" serving and terminating", func(eps []discoveryv1.Endpoint) error {
			ep, ok := endpointOf(eps, pod)
			if !ok || !boolOr(ep.Conditions.Terminating, false) || !boolOr(ep.Conditions.Serving, false) {
				return fmt.Errorf("%s not yet listed as serving and terminating", pod)
			}
			return nil
		})
		// The Deployment replaces it: three ready pods besides it.
		ready := names(e.waitPods(sel, 3), "")
		s := e.expectTraffic(from, "tcp", addr, 30, expect{all: ready, only: ready})
		got, err := e.k.CoreV1().Pods(e.ns).Get(e.ctx, pod, metav1.GetOptions{})
		if err != nil || got.DeletionTimestamp == nil {
			t.Fatalf("pod %s finished terminating before the check ended (err %v): nothing proven", pod, err)
		}
		t.Logf("%s terminating: %s", pod, s)
	})
	if t.Failed() {
		return
	}

	t.Run("every endpoint terminating", func(t *testing.T) {
		e := e.sub(t)
		e.scale("web", 0)
		var serving []string
		e.waitEndpoints(svc.Name, "none ready, some serving and terminating", func(eps []discoveryv1.Endpoint) error {
			serving = nil
			for _, ep := range eps {
				if boolOr(ep.Conditions.Ready, true) {
					return fmt.Errorf("%v still ready", ep.Addresses)
				}
				if boolOr(ep.Conditions.Serving, false) && boolOr(ep.Conditions.Terminating, false) && ep.TargetRef != nil {
					serving = append(serving, ep.TargetRef.Name)
				}
			}
			if len(serving) == 0 {
				return fmt.Errorf("no serving terminating endpoint")
			}
			return nil
		})
		s := e.expectTraffic(from, "tcp", addr, 10, expect{only: serving})
		t.Logf("all terminating, fallback to %v: %s", serving, s)
		for _, r := range s.replies {
			got, err := e.k.CoreV1().Pods(e.ns).Get(e.ctx, r.Pod, metav1.GetOptions{})
			if err != nil || got.DeletionTimestamp == nil {
				t.Fatalf("pod %s answered but is not terminating (err %v)", r.Pod, err)
			}
		}
	})
}

// kproxySynced waits until kproxy on node logged a start and then a sync
// after offset bytes of its log.
func (e *env) kproxySynced(node string, offset int64) {
	e.t.Helper()
	log := e.c.KproxyLog(node)
	e.eventually("kproxy on "+node+" started and synced", programTimeout, func() error {
		data, err := os.ReadFile(log)
		if err != nil {
			return err
		}
		if int64(len(data)) < offset {
			offset = 0
		}
		text := string(data[offset:])
		start := strings.Index(text, `"Starting kproxy"`)
		if start < 0 {
			return fmt.Errorf("no start logged yet")
		}
		if !strings.Contains(text[start:], `"Synced"`) {
			return fmt.Errorf("started, no sync logged yet")
		}
		return nil
	})
}

// kproxyLeftovers lists what kproxy left on node of every mode's state:
// iptables and ip6tables rules and chains naming kproxy, and nftables
// tables named like kproxy.
func (e *env) kproxyLeftovers(node string) []string {
	e.t.Helper()
	var left []string
	for _, save := range []string{"iptables-save", "ip6tables-save"} {
		if _, err := exec.LookPath(save); err != nil {
			continue
		}
		rules, err := e.c.Exec(e.ctx, node, save)
		if err != nil {
			e.fatalf("%s on %s: %v", save, node, err)
		}
		for line := range strings.SplitSeq(rules, "\n") {
			if strings.Contains(strings.ToLower(line), "kproxy") {
				left = append(left, save+": "+line)
			}
		}
	}
	tables, err := e.nftKproxyTables(e.ctx, node)
	if err != nil {
		e.fatalf("%v", err)
	}
	for _, tbl := range tables {
		left = append(left, "nft: "+tbl)
	}
	return left
}

func logSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// kproxyRunning reports whether the cluster runs kproxy on node.
func (e *env) kproxyRunning(ctx context.Context, node string) bool {
	st, err := e.c.Status(ctx)
	if err != nil {
		return false
	}
	for _, p := range st.Processes {
		if p.Name == "kproxy/"+node {
			return p.Running
		}
	}
	return false
}

// stream is a steady flow of requests and its outcome.
type stream struct {
	name, from, addr string
	// network is "tcp" (when empty) or "udp".
	network string

	mu       sync.Mutex
	ok       int
	failures []string
	// failedAt are the start times of the failed requests.
	failedAt []time.Time
}

// send sends one request and records its outcome.
func (s *stream) send(e *env, timeout time.Duration) {
	network := s.network
	if network == "" {
		network = "tcp"
	}
	began := time.Now()
	_, err := e.request(s.from, network, s.addr, timeout)
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.failures = append(s.failures, fmt.Sprintf("%s: %v", began.Format("15:04:05.000"), err))
		s.failedAt = append(s.failedAt, began)
		return
	}
	s.ok++
}

// run sends a request every interval, each after the last one ended,
// until stop closes or limit requests were sent.
func (s *stream) run(e *env, interval time.Duration, limit int, stop <-chan struct{}) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for range limit {
		s.send(e, requestTimeout)
		select {
		case <-stop:
			return
		case <-tick.C:
		}
	}
}

// TestKproxyRestartUnderTraffic: restarting kproxy on every node, one
// after the other, fails none of a steady flow of requests to a ClusterIP
// (from a pod) and a NodePort (from the external client).
func TestKproxyRestartUnderTraffic(t *testing.T) { inMode(t, testKproxyRestartUnderTraffic) }

func testKproxyRestartUnderTraffic(t *testing.T) {
	const (
		interval    = 20 * time.Millisecond
		maxRequests = 6000 // two minutes at most
	)
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 3})
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeNodePort))
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	from, _ := e.clientPod("client", nodeName(2))
	streams := []*stream{
		{name: "pod on node-2 to ClusterIP", from: from, addr: hostPort(svc.Spec.ClusterIP, servicePort)},
		{name: "client to NodePort on node-1", from: cluster.TargetClient, addr: hostPort(cluster.NodeIP(1), svc.Spec.Ports[0].NodePort)},
	}
	for _, s := range streams {
		e.expectTraffic(s.from, "tcp", s.addr, 20, expect{all: names(pods, "")})
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, s := range streams {
		wg.Go(func() { s.run(e, interval, maxRequests, stop) })
	}
	stopped := false
	halt := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer halt()

	// node-2 handles the ClusterIP, node-1 the NodePort, node-3 neither.
	for _, node := range []string{nodeName(2), nodeName(1), nodeName(3)} {
		offset := logSize(e.c.KproxyLog(node))
		began := time.Now()
		if err := e.c.RestartKproxy(e.ctx, node); err != nil {
			halt()
			e.fatalf("restarting kproxy on %s: %v", node, err)
		}
		e.kproxySynced(node, offset)
		t.Logf("kproxy on %s restarted and synced in %s", node, time.Since(began).Round(time.Millisecond))
		time.Sleep(time.Second) // traffic against the new instance's rules
	}
	halt()

	failed := false
	for _, s := range streams {
		t.Logf("%s: %d requests answered, %d failed", s.name, s.ok, len(s.failures))
		if len(s.failures) > 0 {
			failed = true
			shown := s.failures
			if len(shown) > 10 {
				shown = shown[:10]
			}
			t.Errorf("%s: %d of %d requests failed during the restarts; first:\n  %s",
				s.name, len(s.failures), s.ok+len(s.failures), strings.Join(shown, "\n  "))
		}
		if s.ok == 0 {
			failed = true
			t.Errorf("%s: no request answered", s.name)
		}
	}
	if failed {
		e.fatalf("requests failed while kproxy restarted")
	}
}

// TestCleanup: `kproxy --cleanup`, run twice on a node whose kproxy is
// stopped, leaves no kproxy rule in its iptables and no kproxy table in its
// nftables, whatever the mode; a new kproxy there serves again.
func TestCleanup(t *testing.T) { inMode(t, testCleanup) }

func testCleanup(t *testing.T) {
	const node = 3
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 2})
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeNodePort))
	e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
	nodePort := hostPort(cluster.NodeIP(node), svc.Spec.Ports[0].NodePort)
	clusterIP := hostPort(svc.Spec.ClusterIP, servicePort)
	works := func(e *env) {
		e.t.Helper()
		e.expectTraffic(cluster.TargetClient, "tcp", nodePort, 20, expect{all: names(pods, "")})
		e.expectTraffic(nodeName(node), "tcp", clusterIP, 20, expect{all: names(pods, "")})
	}
	works(e)

	if err := e.c.StopKproxy(e.ctx, nodeName(node)); err != nil {
		e.fatalf("stopping kproxy on %s: %v", nodeName(node), err)
	}
	// Whatever happens, the node gets its kproxy back for the other tests.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if !e.kproxyRunning(ctx, nodeName(node)) {
			if err := e.c.StartKproxy(ctx, nodeName(node)); err != nil {
				t.Errorf("restarting kproxy on %s: %v", nodeName(node), err)
			}
		}
	})

	kproxy := filepath.Join(e.c.BinDir(), "kproxy")
	for round := 1; round <= 2; round++ {
		cmd, err := e.c.Command(e.ctx, nodeName(node), kproxy, "--cleanup")
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.CombinedOutput()
		if err != nil {
			e.fatalf("kproxy --cleanup (round %d) on %s: %v\n%s", round, nodeName(node), err, out)
		}
		t.Logf("kproxy --cleanup, round %d:\n%s", round, strings.TrimSpace(string(out)))
		if left := e.kproxyLeftovers(nodeName(node)); len(left) > 0 {
			e.fatalf("%s after cleanup round %d still has kproxy state:\n%s", nodeName(node), round, strings.Join(left, "\n"))
		}
	}
	// No rules: the NodePort is a closed port on node-3.
	e.expectFailure(cluster.TargetClient, "tcp", nodePort, nil)

	offset := logSize(e.c.KproxyLog(nodeName(node)))
	if err := e.c.StartKproxy(e.ctx, nodeName(node)); err != nil {
		e.fatalf("starting kproxy on %s: %v", nodeName(node), err)
	}
	e.kproxySynced(nodeName(node), offset)
	works(e)
}
