package e2e

// The fault-injection suite (issue 10): kernel faults, flushes, outages and
// a killed agent on one node while steady traffic flows through it. See
// "The fault suite" in doc.go for what each scenario does and measures.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"

	"github.com/kproxy/kproxy/test/cluster"
)

// The fault suite's shape and bounds.
const (
	// faultNodeIndex is the node the faults hit: the client pods run
	// there and the external client's NodePort traffic goes there; the
	// backends run on backendNodeIndex.
	faultNodeIndex   = 1
	backendNodeIndex = 2
	// bulkServices of bulkPorts ports each (2,000 service ports, kproxy's
	// unit of rules: a Service chain and its endpoints' chains each) are
	// created before the scenarios: scenario 1 kills kproxy while it
	// syncs them all; the others run among them. Ten ports a Service keep
	// the objects to create few (the local API server takes 30 a second
	// on a busy machine).
	bulkServices = 200
	bulkPorts    = 10
	// faultSyncPeriod is the fault node's --iptables-sync-period (which
	// nftables mode takes too) during the suite: a flush must be repaired
	// within one.
	faultSyncPeriod = 10 * time.Second
	// faultMinSyncPeriod is kproxy's default --iptables-min-sync-period,
	// which the suite keeps.
	faultMinSyncPeriod = time.Second
	// syncAllowance is what a target grants a sync beyond the periods:
	// the sync itself, the watch delivering the change, and the probe's
	// polling.
	syncAllowance = 2 * time.Second
	// faultDeadline is the kernel-call deadline the suite gives kproxy
	// when it has a flag for one (deadlineFlagRE).
	faultDeadline = 5 * time.Second
	// minSyncBytes is the least input of a restore that the first sync of
	// every Service writes (kproxy's probes at its start write less).
	minSyncBytes = 4096
	// faultInterval paces each of the three streams: 50 requests/s in all.
	faultInterval = 60 * time.Millisecond
	// faultRequestTimeout is each steady request's deadline: the suite's
	// for a request expected to succeed (a busy machine delays a few
	// answers past a second).
	faultRequestTimeout = requestTimeout
	// healthPollInterval paces the /healthz poll.
	healthPollInterval = 250 * time.Millisecond
	// reprogramWait bounds every wait for the node to be programmed
	// again: past it the time is reported as never.
	reprogramWait = 45 * time.Second
	// flushWait bounds the wait for a flush's repair: past it kproxy is
	// restarted so that the scenarios that follow find the node programmed.
	flushWait = 3 * faultSyncPeriod
	// apiOutage is how long the API server and etcd stay stopped.
	apiOutage = 30 * time.Second
	// lockHold is how long the xtables lock is held.
	lockHold = 10 * time.Second
	// xtablesLock is iptables-legacy's lock, one file for every network
	// namespace of the machine.
	xtablesLock = "/run/xtables.lock"
	// faultsOutEnv names the JSON summary file (see doc.go).
	faultsOutEnv = "KPC_FAULTS_OUT"
)

// syncedIPv4 is how kproxy logs (at -v=2) an IPv4 sync that succeeded.
const syncedIPv4 = `"Synced" ipFamily="IPv4"`

// deadlineFlagRE finds, in kproxy --help, a duration flag bounding kernel
// calls: its name says timeout or deadline and is not one of the
// conntrack, IPVS or config settings.
var deadlineFlagRE = regexp.MustCompile(`(?m)^\s+--([a-z0-9-]*(?:timeout|deadline)[a-z0-9-]*) duration\b.*?(?:\(default ([^)]+)\))?$`)

// faultResult is one scenario's summary line, and its JSON record.
type faultResult struct {
	Mode     string `json:"mode"`
	Scenario string `json:"scenario"`
	Failed   int    `json:"failed"`
	Sent     int    `json:"sent"`
	// Reprogrammed is the time until the node was fully programmed
	// again, in seconds (see doc.go); -1 when it was not within
	// reprogramWait.
	Reprogrammed float64 `json:"reprogrammedSeconds"`
	// Target says what the scenario must show.
	Target string `json:"target"`
	// Health is /healthz on the node meanwhile: the codes in order, each
	// with the time it was first seen.
	Health string `json:"health"`
	Pass   bool   `json:"pass"`
	// Notes are the scenario's other findings (failures first).
	Notes []string `json:"notes,omitempty"`
}

func (r faultResult) line() string {
	reprog := "never"
	if r.Reprogrammed >= 0 {
		reprog = fmt.Sprintf("%.1fs", r.Reprogrammed)
	}
	verdict := "pass"
	if !r.Pass {
		verdict = "FAIL"
	}
	return fmt.Sprintf("FAULT %s %s: failed=%d sent=%d reprogrammed=%s health=%s target=%q %s",
		r.Mode, r.Scenario, r.Failed, r.Sent, reprog, r.Health, r.Target, verdict)
}

// faultBed is what every scenario shares: the workload, the Services the
// steady traffic goes to, the bulk Services, and kproxy on the fault node
// running with the shims on its PATH.
type faultBed struct {
	e    *env
	node string
	mode string
	// fast creates many objects quickly (the suite's client is rate
	// limited for everyday use).
	fast kubernetes.Interface
	// pods are the backends (both on backendNodeIndex).
	pods []v1.Pod
	// client is the client pod on the fault node.
	client  string
	streams []*stream
	// shift is the Service whose endpoints move in the poisoned scenario.
	shift *v1.Service
	// dir holds the shims' control files and logs (KPC_FAULT_DIR);
	// shimDir the shims, first on kproxy's PATH.
	dir, shimDir string
	// start is how kproxy runs on the fault node during the suite.
	start cluster.KproxyStart
	guard *kproxyGuard
	// deadlineFlag is kproxy's kernel-call deadline flag; empty when it
	// has none.
	deadlineFlag string

	mu      sync.Mutex
	results []faultResult
}

// defaultFaults are the scenarios `make test` runs: every one. (Until
// 2026-12-02 only the API server outage and the flushes ran by default: a
// few steady TCP requests failed a minute after each flush, until kproxy
// learnt to delete the flows black-holed while its rules were missing,
// docs/design.md "Black-holed flows".)
const defaultFaults = "all"

// faultSelected says whether KPROXY_E2E_FAULTS (space-separated scenario
// names, or "all"; default defaultFaults) selects the scenario.
func faultSelected(name string) bool {
	sel := os.Getenv("KPROXY_E2E_FAULTS")
	if sel == "" {
		sel = defaultFaults
	}
	for _, f := range strings.Fields(sel) {
		if f == "all" || f == name {
			return true
		}
	}
	return false
}

// TestFaults runs the fault scenarios on one node under steady traffic and
// reports each one (doc.go, "The fault suite").
func TestFaults(t *testing.T) { inMode(t, testFaults) }

func testFaults(t *testing.T) {
	began := time.Now()
	f := newFaultBed(newEnv(t))
	t.Logf("fault bed ready in %s", time.Since(began).Round(100*time.Millisecond))
	for _, sc := range []struct {
		name string
		run  func(t *testing.T)
	}{
		{"kill9-mid-full-sync", f.killMidSync},
		{"apiserver-outage", f.apiServerOutage},
		{"flush", f.flush},
		{"xtables-lock", f.xtablesLock},
		{"poisoned-service", f.poisonedService},
		{"hung-restore", f.hungRestore},
	} {
		if !faultSelected(sc.name) {
			t.Logf("scenario %s not selected (KPROXY_E2E_FAULTS=%q; the default set is %q, \"all\" runs every one)", sc.name, os.Getenv("KPROXY_E2E_FAULTS"), defaultFaults)
			continue
		}
		t.Run(sc.name, sc.run)
	}
	var lines []string
	for _, r := range f.results {
		lines = append(lines, r.line())
	}
	t.Logf("fault suite in %s mode, %s:\n%s", f.mode, time.Since(began).Round(time.Second), strings.Join(lines, "\n"))
}

// newFaultBed deploys the backends, the three steady Services, the client
// pod and the bulk Services, and restarts kproxy on the fault node with
// the shims on its PATH and the suite's sync period.
func newFaultBed(e *env) *faultBed {
	t := e.t
	f := &faultBed{e: e, node: nodeName(faultNodeIndex), mode: e.c.Mode()}
	cfg, err := clientcmd.BuildConfigFromFlags("", e.c.Kubeconfig())
	if err != nil {
		t.Fatal(err)
	}
	cfg.QPS, cfg.Burst = 1000, 2000
	if f.fast, err = kubernetes.NewForConfig(cfg); err != nil {
		t.Fatal(err)
	}

	sel := map[string]string{"app": "web"}
	f.pods = e.deploy(workload{name: "web", replicas: 2, node: nodeName(backendNodeIndex), ports: []v1.ContainerPort{
		{Name: "tcp", ContainerPort: echoPort, Protocol: v1.ProtocolTCP},
		{Name: "udp", ContainerPort: udpEchoPort, Protocol: v1.ProtocolUDP},
	}})
	tcp := e.createService("steady-tcp", sel)
	udp := e.createService("steady-udp", sel, func(s *v1.Service) {
		s.Spec.Ports = []v1.ServicePort{{Name: "udp", Protocol: v1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(udpEchoPort)}}
	})
	np := e.createService("steady-nodeport", sel, withType(v1.ServiceTypeNodePort))
	f.client, _ = e.clientPod("client", f.node)
	f.streams = []*stream{
		{name: "TCP ClusterIP from a pod", from: f.client, addr: hostPort(tcp.Spec.ClusterIP, servicePort)},
		{name: "UDP ClusterIP from a pod", from: f.client, addr: hostPort(udp.Spec.ClusterIP, 53), network: "udp"},
		{name: "NodePort from the client", from: cluster.TargetClient, addr: hostPort(cluster.NodeIP(faultNodeIndex), np.Spec.Ports[0].NodePort)},
	}
	for _, s := range []*v1.Service{tcp, udp, np} {
		e.waitEndpoints(s.Name, "2 ready", readyCount(2))
	}
	f.shift = f.selectorless(e, "shift", f.pods[:1])

	bulkBegan := time.Now()
	last := f.createBulk(bulkServices)
	t.Logf("%d bulk Services of %d ports and their EndpointSlices created in %s", bulkServices, bulkPorts, time.Since(bulkBegan).Round(100*time.Millisecond))

	// The shims: kproxy's restores go through testdata/shims/faultshim.
	f.dir = filepath.Join(e.c.StateDir(), "faults-"+e.ns)
	f.shimDir = filepath.Join(f.dir, "bin")
	if err := os.MkdirAll(f.shimDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(f.dir) })
	shim, err := filepath.Abs(filepath.Join("testdata", "shims", "faultshim"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tool := range []string{"iptables-restore", "ip6tables-restore", "nft"} {
		if err := os.Symlink(shim, filepath.Join(f.shimDir, tool)); err != nil {
			t.Fatal(err)
		}
	}
	f.start = cluster.KproxyStart{
		Args: []string{"--iptables-sync-period=" + faultSyncPeriod.String()},
		Env:  f.shimEnv(f.shimDir, os.Getenv("PATH")),
	}
	if flag, def := kproxyDeadlineFlag(e); flag != "" {
		f.deadlineFlag = flag
		f.start.Args = append(f.start.Args, fmt.Sprintf("--%s=%s", flag, faultDeadline))
		t.Logf("kproxy bounds kernel calls with --%s (default %s); the suite sets %s", flag, def, faultDeadline)
	}
	f.guard = e.guardKproxy(f.node)
	f.guard.stop()
	f.guard.startWith(f.start)

	for _, s := range f.streams {
		e.expectTraffic(s.from, cmp.Or(s.network, "tcp"), s.addr, 10, expect{all: names(f.pods, "")})
	}
	// The last bulk Service programmed: the node holds them all.
	e.expectTraffic(f.client, "tcp", hostPort(last.Spec.ClusterIP, servicePort), 3, expect{})
	return f
}

// shimEnv is the environment of a kproxy whose PATH starts with dir, the
// tools it wraps found on realPath.
func (f *faultBed) shimEnv(dir, realPath string) []string {
	return []string{
		"PATH=" + dir + ":" + realPath,
		"KPC_FAULT_DIR=" + f.dir,
		"KPC_FAULT_REAL_PATH=" + realPath,
	}
}

// kproxyDeadlineFlag returns the name and default of kproxy's kernel-call
// deadline flag, from its --help; "" when it has none.
func kproxyDeadlineFlag(e *env) (name, def string) {
	out, err := exec.CommandContext(e.ctx, filepath.Join(e.c.BinDir(), "kproxy"), "--help").CombinedOutput()
	if err != nil {
		e.t.Fatalf("kproxy --help: %v\n%s", err, out)
	}
	for _, m := range deadlineFlagRE.FindAllStringSubmatch(string(out), -1) {
		if strings.HasPrefix(m[1], "conntrack-") || strings.HasPrefix(m[1], "ipvs-") || strings.HasPrefix(m[1], "config-") {
			continue
		}
		return m[1], m[2]
	}
	return "", ""
}

// selectorless creates a Service without a selector and its EndpointSlice
// with the TCP port of pods: only kproxy's watch stands between its
// creation and its rules (no controller).
func (f *faultBed) selectorless(e *env, name string, pods []v1.Pod) *v1.Service {
	e.t.Helper()
	svc, err := f.createSelectorless(e.ctx, name, pods)
	if err != nil {
		e.t.Fatal(err)
	}
	return svc
}

func (f *faultBed) createSelectorless(ctx context.Context, name string, pods []v1.Pod) (*v1.Service, error) {
	svc, err := f.fast.CoreV1().Services(f.e.ns).Create(ctx, selectorlessService(f.e.ns, name, 1), metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("creating service %s: %w", name, err)
	}
	if _, err := f.fast.DiscoveryV1().EndpointSlices(f.e.ns).Create(ctx, endpointSliceFor(svc, pods), metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("creating the EndpointSlice of %s: %w", name, err)
	}
	return svc, nil
}

// selectorlessService is a Service without a selector with ports TCP
// ports: servicePort named "tcp", then servicePort+1 "p1" and on, all to
// echoPort.
func selectorlessService(ns, name string, ports int) *v1.Service {
	svc := &v1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}
	for i := range max(ports, 1) {
		portName := "tcp"
		if i > 0 {
			portName = fmt.Sprintf("p%d", i)
		}
		svc.Spec.Ports = append(svc.Spec.Ports, v1.ServicePort{
			Name: portName, Protocol: v1.ProtocolTCP, Port: servicePort + int32(i), TargetPort: intstr.FromInt32(echoPort),
		})
	}
	return svc
}

// endpointSliceFor is the EndpointSlice of a selectorless Service with
// pods' addresses, ready.
func endpointSliceFor(svc *v1.Service, pods []v1.Pod) *discoveryv1.EndpointSlice {
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name: svc.Name, Namespace: svc.Namespace,
			Labels: map[string]string{discoveryv1.LabelServiceName: svc.Name, discoveryv1.LabelManagedBy: "e2e.kpc.kproxy.io"},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
	}
	for _, p := range svc.Spec.Ports {
		slice.Ports = append(slice.Ports, discoveryv1.EndpointPort{Name: new(p.Name), Protocol: new(p.Protocol), Port: new(p.TargetPort.IntVal)})
	}
	for _, p := range pods {
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{p.Status.PodIP},
			Conditions: discoveryv1.EndpointConditions{Ready: new(true), Serving: new(true), Terminating: new(false)},
			NodeName:   new(p.Spec.NodeName),
			TargetRef:  &v1.ObjectReference{Kind: "Pod", Namespace: p.Namespace, Name: p.Name, UID: p.UID},
		})
	}
	return slice
}

// setEndpoints points a selectorless Service's EndpointSlice at pods.
func (f *faultBed) setEndpoints(e *env, svc *v1.Service, pods []v1.Pod) {
	e.t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		cur, err := f.fast.DiscoveryV1().EndpointSlices(e.ns).Get(e.ctx, svc.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		want := endpointSliceFor(svc, pods)
		cur.Endpoints = want.Endpoints
		_, err = f.fast.DiscoveryV1().EndpointSlices(e.ns).Update(e.ctx, cur, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		e.t.Fatalf("updating the endpoints of %s: %v", svc.Name, err)
	}
}

// createBulk creates n selectorless Services of bulkPorts ports, each with
// both backends as endpoints, in parallel, and returns the last one.
func (f *faultBed) createBulk(n int) *v1.Service {
	const workers = 16
	e := f.e
	ctx, cancel := context.WithCancelCause(e.ctx)
	defer cancel(nil)
	next := make(chan int)
	var wg sync.WaitGroup
	var last *v1.Service
	var mu sync.Mutex
	for range workers {
		wg.Go(func() {
			for i := range next {
				name := fmt.Sprintf("bulk-%03d", i)
				svc, err := f.fast.CoreV1().Services(e.ns).Create(ctx, selectorlessService(e.ns, name, bulkPorts), metav1.CreateOptions{})
				if err == nil {
					_, err = f.fast.DiscoveryV1().EndpointSlices(e.ns).Create(ctx, endpointSliceFor(svc, f.pods), metav1.CreateOptions{})
				}
				if err != nil {
					cancel(fmt.Errorf("creating %s: %w", name, err))
					return
				}
				if i == n-1 {
					mu.Lock()
					last = svc
					mu.Unlock()
				}
			}
		})
	}
	for i := range n {
		select {
		case next <- i:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
	}
	close(next)
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		e.t.Fatalf("creating the bulk Services: %v", err)
	}
	return last
}

// reachable sends one TCP request from the client pod to svc's ClusterIP.
func (f *faultBed) reachable(svc *v1.Service) func() error {
	return func() error {
		_, err := f.e.request(f.client, "tcp", hostPort(svc.Spec.ClusterIP, servicePort), faultRequestTimeout)
		return err
	}
}

// kproxyLog returns the fault node's kproxy log from offset on.
func (f *faultBed) kproxyLog(offset int64) string {
	data, err := os.ReadFile(f.e.c.KproxyLog(f.node))
	if err != nil || int64(len(data)) < offset {
		return ""
	}
	return string(data[offset:])
}

// waitProgrammed polls until cond holds and, with synced, kproxy logged a
// successful sync after logOffset; it returns the time since from, or -1
// after reprogramWait (with the last reason).
func (f *faultBed) waitProgrammed(from time.Time, logOffset int64, synced bool, cond func() error) (time.Duration, error) {
	return f.waitProgrammedFor(reprogramWait, from, logOffset, synced, cond)
}

// waitProgrammedFor is waitProgrammed giving up after wait.
func (f *faultBed) waitProgrammedFor(wait time.Duration, from time.Time, logOffset int64, synced bool, cond func() error) (time.Duration, error) {
	deadline := time.Now().Add(wait)
	var last error
	for {
		last = nil
		if synced && !strings.Contains(f.kproxyLog(logOffset), syncedIPv4) {
			last = errors.New("kproxy logged no sync yet")
		} else if err := cond(); err != nil {
			last = err
		}
		if last == nil {
			return time.Since(from), nil
		}
		if time.Now().After(deadline) || f.e.ctx.Err() != nil {
			return -1, last
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// faultRun is one scenario: the steady traffic and the health poll run
// from begin to end.
type faultRun struct {
	f       *faultBed
	t       *testing.T
	res     faultResult
	began   time.Time
	streams []*stream
	stop    chan struct{}
	wg      sync.WaitGroup
	health  healthPoll
	ended   bool
}

// begin starts a scenario's traffic and health poll; end (deferred by
// begin's caller through report) stops them.
func (f *faultBed) begin(t *testing.T, scenario, target string) *faultRun {
	r := &faultRun{f: f, t: t, began: time.Now(), stop: make(chan struct{}),
		res: faultResult{Mode: f.mode, Scenario: scenario, Target: target, Reprogrammed: -1, Pass: true}}
	for _, s := range f.streams {
		r.streams = append(r.streams, &stream{name: s.name, from: s.from, addr: s.addr, network: s.network})
	}
	e := f.e.sub(t)
	for _, s := range r.streams {
		r.wg.Go(func() { s.steady(e, faultInterval, faultRequestTimeout, r.stop) })
	}
	url := "http://" + hostPort(cluster.NodeIP(faultNodeIndex), healthzPort) + "/healthz"
	r.wg.Go(func() { r.health.run(e, url, r.began, r.stop) })
	t.Cleanup(r.end)
	return r
}

// steady sends a request every interval, each in its own goroutine (a
// request that hangs does not slow the others), until stop closes.
func (s *stream) steady(e *env, interval, timeout time.Duration, stop <-chan struct{}) {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		wg.Go(func() { s.send(e, timeout) })
		select {
		case <-stop:
			return
		case <-tick.C:
		}
	}
}

// end stops the traffic and the health poll and counts the requests.
func (r *faultRun) end() {
	if r.ended {
		return
	}
	r.ended = true
	close(r.stop)
	r.wg.Wait()
	var shown []string
	for _, s := range r.streams {
		s.mu.Lock()
		r.res.Failed += len(s.failures)
		r.res.Sent += s.ok + len(s.failures)
		if len(s.failures) > 0 {
			first := s.failures[:min(3, len(s.failures))]
			shown = append(shown, fmt.Sprintf("%s: %d of %d failed, from +%.1fs to +%.1fs; first: %s", s.name, len(s.failures), s.ok+len(s.failures),
				slices.MinFunc(s.failedAt, time.Time.Compare).Sub(r.began).Seconds(), slices.MaxFunc(s.failedAt, time.Time.Compare).Sub(r.began).Seconds(),
				strings.Join(first, "; ")))
		}
		s.mu.Unlock()
	}
	r.res.Health = r.health.summary()
	if len(shown) > 0 {
		r.t.Logf("failed requests (the scenario began at %s):\n  %s", r.began.Format("15:04:05.000"), strings.Join(shown, "\n  "))
	}
}

// lastFailure is when the last failed request started (zero: none).
func (r *faultRun) lastFailure() time.Time {
	var last time.Time
	for _, s := range r.streams {
		s.mu.Lock()
		for _, at := range s.failedAt {
			if at.After(last) {
				last = at
			}
		}
		s.mu.Unlock()
	}
	return last
}

// fail records a missed target: the scenario fails, the test goes on.
func (r *faultRun) fail(format string, args ...any) {
	r.t.Helper()
	msg := fmt.Sprintf(format, args...)
	r.res.Pass = false
	r.res.Notes = append(r.res.Notes, msg)
	r.t.Errorf("%s", msg)
}

// note records a finding that is not a failure.
func (r *faultRun) note(format string, args ...any) {
	r.t.Helper()
	msg := fmt.Sprintf(format, args...)
	r.res.Notes = append(r.res.Notes, msg)
	r.t.Logf("%s", msg)
}

// reprogrammed records the time until the node was programmed again.
func (r *faultRun) reprogrammed(d time.Duration, why error) {
	if d < 0 {
		r.res.Reprogrammed = -1
		r.note("not programmed again in time: %v", why)
		return
	}
	r.res.Reprogrammed = d.Seconds()
}

// report ends the scenario, checks that no request failed when zeroFailed,
// and logs and records its line.
func (r *faultRun) report(zeroFailed bool) {
	r.t.Helper()
	r.end()
	if zeroFailed && r.res.Failed > 0 {
		r.fail("%d of %d steady requests failed; want none", r.res.Failed, r.res.Sent)
	}
	if r.res.Sent == 0 {
		r.fail("no steady request was sent")
	}
	r.t.Log(r.res.line())
	f := r.f
	f.mu.Lock()
	f.results = append(f.results, r.res)
	results := slices.Clone(f.results)
	f.mu.Unlock()
	if out := os.Getenv(faultsOutEnv); out != "" {
		path := latencyOutPath(out, f.mode, thisRound.modes)
		data, err := json.MarshalIndent(results, "", "  ")
		if err == nil {
			err = os.WriteFile(path, append(data, '\n'), 0o644)
		}
		if err != nil {
			r.t.Errorf("writing %s: %v", path, err)
		}
	}
}

// healthPoll polls /healthz and keeps what it answered.
type healthPoll struct {
	mu      sync.Mutex
	samples []healthSample
}

type healthSample struct {
	at     time.Duration
	answer string
}

func (h *healthPoll) run(e *env, url string, began time.Time, stop <-chan struct{}) {
	tick := time.NewTicker(healthPollInterval)
	defer tick.Stop()
	for {
		answer := "refused"
		a, err := e.get(cluster.TargetClient, url)
		switch {
		case err == nil:
			answer = strconv.Itoa(a.code)
		case !refused(err):
			answer = "no answer"
		}
		h.mu.Lock()
		h.samples = append(h.samples, healthSample{at: time.Since(began), answer: answer})
		h.mu.Unlock()
		select {
		case <-stop:
			return
		case <-tick.C:
		}
	}
}

// summary is "200" when every answer was 200, else each change in order
// with the time it was first seen: "200, 503@21.2s, 200@40.1s".
func (h *healthPoll) summary() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var parts []string
	prev := ""
	for i, s := range h.samples {
		if s.answer == prev {
			continue
		}
		prev = s.answer
		if i == 0 {
			parts = append(parts, s.answer)
		} else {
			parts = append(parts, fmt.Sprintf("%s@%.1fs", s.answer, s.at.Seconds()))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ",")
}

// allOK reports whether every health answer was 200.
func (h *healthPoll) allOK() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range h.samples {
		if s.answer != "200" {
			return false
		}
	}
	return len(h.samples) > 0
}

// calls reads the shims' call log from offset on: one entry per line,
// "<time> <pid> <event> <tool> ...".
func (f *faultBed) calls(offset int64) []string {
	data, err := os.ReadFile(filepath.Join(f.dir, "calls.log"))
	if err != nil || int64(len(data)) < offset {
		return nil
	}
	return strings.Split(strings.TrimSpace(string(data[offset:])), "\n")
}

func (f *faultBed) callsSize() int64 { return logSize(filepath.Join(f.dir, "calls.log")) }

// restoreTool is the tool of the mode's IPv4 restores.
func (f *faultBed) restoreTool() string {
	if f.mode == cluster.ModeNFTables {
		return "nft"
	}
	return "iptables-restore"
}

// countCalls counts the entries of event by the mode's restore tool.
func (f *faultBed) countCalls(lines []string, event string) int {
	n := 0
	for _, l := range lines {
		fields := strings.Fields(l)
		if len(fields) >= 4 && fields[2] == event && fields[3] == f.restoreTool() {
			n++
		}
	}
	return n
}

// bigRestores counts the restores started with at least minSyncBytes of
// input: a sync's, not kproxy's probes of the tools at its start.
func (f *faultBed) bigRestores(lines []string) int {
	n := 0
	for _, l := range lines {
		fields := strings.Fields(l)
		if len(fields) < 5 || fields[2] != "start" || fields[3] != f.restoreTool() {
			continue
		}
		size, err := strconv.Atoi(strings.TrimPrefix(fields[4], "bytes="))
		if err == nil && size >= minSyncBytes && !strings.Contains(l, "--check") {
			n++
		}
	}
	return n
}

// --- Scenario 1: kill -9 in the middle of a full sync ---

// killMidSync restarts kproxy on the fault node (SIGTERM, start; in
// nftables mode with a canary element deleted first, so that the first
// sync rebuilds the table rather than adopt it), kills it with SIGKILL
// once the first full sync of every Service has started its second
// restore (its first, when a sync has one), creates a probe Service
// while no kproxy runs, and starts kproxy again. Reprogrammed: from the
// kill until the new kproxy synced and the probe answers. Then the node's
// rules must be those of a kproxy of reference that synced the same
// objects from nothing (cluster.ScratchKproxy).
func (f *faultBed) killMidSync(t *testing.T) {
	e := f.e.sub(t)
	r := f.begin(t, "kill9-mid-full-sync", "0 failed; rules after the restart equal a clean sync's")
	defer r.report(true)

	var killedAt time.Time
	var killLog int64
	killed := false
	for attempt := 1; attempt <= 3 && !killed; attempt++ {
		// The second restore of the first sync; the first when a sync
		// turned out to have only one.
		killAt := 2
		if attempt > 1 {
			killAt = 1
		}
		if err := e.c.StopKproxy(e.ctx, f.node); err != nil {
			e.fatalf("stopping kproxy on %s: %v", f.node, err)
		}
		if f.mode == cluster.ModeNFTables {
			// A kproxy starting on its own intact table adopts it and
			// writes nothing: without a canary element (one that no
			// packet matches) its first sync rebuilds the table, the
			// endpoint slots written ahead in transactions of their own.
			if _, err := e.c.Exec(e.ctx, f.node, "nft", "delete", "element", "ip", "kproxy", "hairpin-endpoints", "{ 0.0.0.0 . 0.0.0.0 }"); err != nil {
				e.fatalf("deleting a canary element on %s: %v", f.node, err)
			}
		}
		callsOff, logOff := f.callsSize(), logSize(e.c.KproxyLog(f.node))
		if err := e.c.StartKproxyWith(e.ctx, f.node, f.start); err != nil {
			e.fatalf("starting kproxy on %s: %v", f.node, err)
		}
		restartedAt := time.Now()
		for !strings.Contains(f.kproxyLog(logOff), syncedIPv4) {
			if f.bigRestores(f.calls(callsOff)) >= killAt {
				killLog = logSize(e.c.KproxyLog(f.node))
				if err := e.c.KillKproxy(e.ctx, f.node); err != nil {
					e.fatalf("%v", err)
				}
				killedAt = time.Now()
				break
			}
			if time.Since(restartedAt) > programTimeout {
				e.fatalf("kproxy on %s neither synced nor ran %d restores within %s", f.node, killAt, programTimeout)
			}
			time.Sleep(2 * time.Millisecond)
		}
		calls := f.calls(callsOff)
		if !killedAt.IsZero() && !strings.Contains(f.kproxyLog(logOff), syncedIPv4) {
			killed = true
			r.note("killed %s after the restart, as restore %d of its first sync started (attempt %d)",
				killedAt.Sub(restartedAt).Round(time.Millisecond), killAt, attempt)
			t.Logf("the shims' calls since the restart:\n%s", strings.Join(calls, "\n"))
			break
		}
		t.Logf("attempt %d: the first sync ended before restore %d started; the shims' calls:\n%s", attempt, killAt, strings.Join(calls, "\n"))
		if !killedAt.IsZero() {
			// Killed just after the sync: start it again.
			killedAt = time.Time{}
			if err := e.c.StartKproxyWith(e.ctx, f.node, f.start); err != nil {
				e.fatalf("starting kproxy on %s: %v", f.node, err)
			}
		}
		e.kproxySynced(f.node, logOff)
	}
	if !killed {
		r.fail("could not kill kproxy in the middle of its first sync in 3 attempts")
		return
	}

	probe := f.selectorless(e, "probe-kill", f.pods)
	if err := e.c.StartKproxyWith(e.ctx, f.node, f.start); err != nil {
		e.fatalf("starting kproxy on %s after the kill: %v", f.node, err)
	}
	r.reprogrammed(f.waitProgrammed(killedAt, killLog, true, f.reachable(probe)))
	time.Sleep(time.Second)
	r.end()

	// The node's rules against a clean sync of the same objects.
	got, err := f.normalizedRules(e.ctx, func(argv ...string) (string, error) { return e.c.Exec(e.ctx, f.node, argv...) })
	if err != nil {
		e.fatalf("%v", err)
	}
	want, err := f.referenceRules(e)
	if err != nil {
		r.fail("the rules of reference: %v", err)
		return
	}
	if diff := lineDiff(want, got); diff != "" {
		r.fail("the rules after the restart differ from a clean sync's (%d and %d lines; - clean, + node):\n%s", len(want), len(got), diff)
	} else {
		r.note("rules after the restart equal a clean sync's (%d lines)", len(got))
	}
}

// referenceRules starts a kproxy of reference for the fault node (its
// flags, no shims), waits for its first sync and returns its rules,
// normalised.
func (f *faultBed) referenceRules(e *env) ([]string, error) {
	ref, err := e.c.StartScratchKproxy(e.ctx, f.node, f.start.Args...)
	if err != nil {
		return nil, err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := ref.Close(ctx); err != nil {
			e.t.Errorf("removing the kproxy of reference: %v", err)
		}
	}()
	deadline := time.Now().Add(2 * programTimeout)
	for {
		data, _ := os.ReadFile(ref.Log())
		if strings.Contains(string(data), syncedIPv4) {
			break
		}
		if !ref.Running() {
			return nil, fmt.Errorf("the kproxy of reference exited:\n%s", tailFile(ref.Log(), logTailLines))
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("the kproxy of reference did not sync within %s:\n%s", 2*programTimeout, tailFile(ref.Log(), logTailLines))
		}
		time.Sleep(pollInterval)
	}
	return f.normalizedRules(e.ctx, func(argv ...string) (string, error) {
		out, err := exec.CommandContext(e.ctx, "ip", append([]string{"netns", "exec", cluster.ScratchNetNS}, argv...)...).Output()
		if err != nil {
			return "", fmt.Errorf("%s in %s: %w", strings.Join(argv, " "), cluster.ScratchNetNS, err)
		}
		return string(out), nil
	})
}

// normalizedRules lists kproxy's rules through run (a command in some
// namespace) in the bed's mode, normalised (normalizeIPTablesSave,
// normalizeNFT).
func (f *faultBed) normalizedRules(ctx context.Context, run func(argv ...string) (string, error)) ([]string, error) {
	if f.mode == cluster.ModeNFTables {
		out, err := run("nft", "--stateless", "list", "table", "ip", "kproxy")
		if err != nil {
			return nil, err
		}
		return normalizeNFT(out), nil
	}
	out, err := run("iptables-save")
	if err != nil {
		return nil, err
	}
	return normalizeIPTablesSave(out), nil
}

// normalizeIPTablesSave keeps kproxy's chains and the rules that are in
// them or jump to them, grouped per table and chain in name order (the
// order iptables-save prints chains in depends on their history), rules in
// their order, without counters and comments of iptables-save's own.
func normalizeIPTablesSave(text string) []string {
	type chain struct {
		decl  string
		rules []string
	}
	tables := map[string]map[string]*chain{}
	var table string
	get := func(name string) *chain {
		if tables[table] == nil {
			tables[table] = map[string]*chain{}
		}
		if tables[table][name] == nil {
			tables[table][name] = &chain{}
		}
		return tables[table][name]
	}
	for line := range strings.SplitSeq(text, "\n") {
		line = strings.TrimSpace(line)
		switch {
		case line == "" || strings.HasPrefix(line, "#") || line == "COMMIT":
		case strings.HasPrefix(line, "*"):
			table = line[1:]
		case strings.HasPrefix(line, ":"):
			name, policy, _ := strings.Cut(line[1:], " ")
			policy, _, _ = strings.Cut(policy, " ")
			if strings.HasPrefix(name, "KPROXY") {
				get(name).decl = ":" + name + " " + policy
			}
		case strings.HasPrefix(line, "-A "):
			name, _, _ := strings.Cut(line[3:], " ")
			if strings.HasPrefix(name, "KPROXY") || strings.Contains(line, "KPROXY") || strings.Contains(strings.ToLower(line), "kproxy") {
				c := get(name)
				c.rules = append(c.rules, line)
			}
		}
	}
	var out []string
	for _, t := range sortedKeys(tables) {
		for _, name := range sortedKeys(tables[t]) {
			c := tables[t][name]
			out = append(out, "*"+t+" "+cmp.Or(c.decl, ":"+name+" (built-in)"))
			out = append(out, c.rules...)
		}
	}
	return out
}

// normalizeNFT normalises `nft --stateless list table`: its sets, maps
// and chains in name order (nft prints them in creation order), each
// set's and map's elements sorted (nft prints a hash's in bucket order),
// the elements of sets that traffic fills (dynamic, timeout) dropped,
// chains' rules in their order.
func normalizeNFT(text string) []string {
	type block struct {
		header string
		lines  []string
	}
	var blocks []block
	var cur *block
	var elements strings.Builder
	inElements, dynamic := false, false
	flushElements := func() {
		if cur == nil {
			return
		}
		body := strings.TrimSpace(elements.String())
		elements.Reset()
		body = strings.TrimPrefix(body, "elements = {")
		body = strings.TrimSuffix(body, "}")
		if dynamic {
			return
		}
		var elems []string
		for el := range strings.SplitSeq(body, ",") {
			if el = strings.Join(strings.Fields(el), " "); el != "" {
				elems = append(elems, el)
			}
		}
		slices.Sort(elems)
		for _, el := range elems {
			cur.lines = append(cur.lines, "element "+el)
		}
	}
	for raw := range strings.SplitSeq(text, "\n") {
		line := strings.TrimSpace(raw)
		switch {
		case inElements:
			elements.WriteString(" " + line)
			if strings.HasSuffix(line, "}") {
				inElements = false
				flushElements()
			}
		case line == "" || strings.HasPrefix(line, "table ") || strings.HasPrefix(line, "#"):
		case cur == nil && strings.HasSuffix(line, "{"):
			blocks = append(blocks, block{header: strings.TrimSuffix(line, " {")})
			cur = &blocks[len(blocks)-1]
			dynamic = false
		case cur == nil:
			// The table's own lines (its comment, flags) and its "}".
			if line != "}" {
				blocks = append(blocks, block{header: "table: " + line})
			}
		case line == "}":
			cur = nil
		case strings.HasPrefix(line, "elements = {"):
			elements.WriteString(line)
			if strings.HasSuffix(line, "}") {
				flushElements()
			} else {
				inElements = true
			}
		default:
			if strings.HasPrefix(line, "flags ") && strings.Contains(line, "dynamic") || strings.HasPrefix(line, "timeout ") {
				dynamic = true
			}
			cur.lines = append(cur.lines, line)
		}
	}
	slices.SortStableFunc(blocks, func(a, b block) int { return strings.Compare(a.header, b.header) })
	var out []string
	for _, b := range blocks {
		out = append(out, b.header)
		for _, l := range b.lines {
			out = append(out, "  "+l)
		}
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// lineDiff returns the lines only in want ("-") or only in got ("+"), at
// most 40 of them, or "" when both hold the same lines in the same order.
func lineDiff(want, got []string) string {
	if slices.Equal(want, got) {
		return ""
	}
	count := map[string]int{}
	for _, l := range want {
		count[l]++
	}
	for _, l := range got {
		count[l]--
	}
	var out []string
	for _, l := range want {
		if count[l] > 0 {
			out = append(out, "- "+l)
			count[l]--
		}
	}
	for _, l := range got {
		if count[l] < 0 {
			out = append(out, "+ "+l)
			count[l]++
		}
	}
	if len(out) == 0 {
		return "(the same lines in another order)"
	}
	if len(out) > 40 {
		out = append(out[:40], fmt.Sprintf("... (%d more)", len(out)-40))
	}
	return strings.Join(out, "\n")
}

// missingLines lists the lines of before that now lacks, but for the
// nftables sync-state canary, whose digest changes with any other change
// that lands meanwhile (those add lines, which do not count).
func missingLines(before, now []string) []string {
	have := map[string]int{}
	for _, l := range now {
		have[l]++
	}
	var out []string
	for _, l := range before {
		if have[l] > 0 {
			have[l]--
			continue
		}
		if !strings.Contains(l, "kproxy canary layout=") {
			out = append(out, l)
		}
	}
	return out
}

// --- Scenario 2: the API server and etcd stopped for 30 s ---

// apiServerOutage stops the API server and etcd for apiOutage, starts
// them, and right after creates a probe Service. Reprogrammed: from its
// creation until kproxy synced and it answers.
func (f *faultBed) apiServerOutage(t *testing.T) {
	e := f.e.sub(t)
	limit := faultMinSyncPeriod + syncAllowance
	r := f.begin(t, "apiserver-outage", fmt.Sprintf("0 failed; a change after the return programmed within %s", limit))
	defer r.report(true)
	t.Cleanup(func() {
		if !e.c.ControlPlaneRunning() {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			if err := e.c.StartControlPlane(ctx); err != nil {
				t.Errorf("starting the control plane again: %v", err)
			}
		}
	})
	time.Sleep(time.Second)
	stopBegan := time.Now()
	if err := e.c.StopControlPlane(e.ctx); err != nil {
		e.fatalf("stopping the control plane: %v", err)
	}
	stopped := time.Now()
	time.Sleep(time.Until(stopped.Add(apiOutage)))
	if err := e.c.StartControlPlane(e.ctx); err != nil {
		e.fatalf("starting the control plane again: %v", err)
	}
	back := time.Now()
	r.note("API server stopped in %s, down %s, ready again %s after its start",
		stopped.Sub(stopBegan).Round(100*time.Millisecond), back.Sub(stopped).Round(100*time.Millisecond), time.Since(stopped.Add(apiOutage)).Round(100*time.Millisecond))
	logOff := logSize(e.c.KproxyLog(f.node))
	var probe *v1.Service
	e.eventually("creating the probe Service after the outage", programTimeout, func() (err error) {
		probe, err = f.createSelectorless(e.ctx, "probe-api", f.pods)
		return err
	})
	created := time.Now()
	d, why := f.waitProgrammed(created, logOff, true, f.reachable(probe))
	r.reprogrammed(d, why)
	if d < 0 || d > limit {
		r.fail("the change made after the API server returned was programmed after %s; want within %s", fmtDur(d), limit)
	}
	time.Sleep(time.Second)
	r.end()
	if d < 0 {
		f.resync(e)
	}
}

func fmtDur(d time.Duration) string {
	if d < 0 {
		return "never"
	}
	return d.Round(100 * time.Millisecond).String()
}

// resync restarts kproxy on the fault node as the suite runs it and waits
// until it synced and the steady Services answer: a scenario whose fault
// kproxy did not repair leaves the node so for the next ones otherwise.
func (f *faultBed) resync(e *env) {
	e.t.Helper()
	e.t.Logf("restarting kproxy on %s: the node must be programmed for the scenarios that follow", f.node)
	if err := e.c.StopKproxy(e.ctx, f.node); err != nil {
		e.fatalf("%v", err)
	}
	offset := logSize(e.c.KproxyLog(f.node))
	if err := e.c.StartKproxyWith(e.ctx, f.node, f.start); err != nil {
		e.fatalf("%v", err)
	}
	if d, why := f.waitProgrammed(time.Now(), offset, true, func() error { return nil }); d < 0 {
		e.fatalf("kproxy on %s did not sync after a restart: %v", f.node, why)
	}
	for _, s := range f.streams {
		e.expectTraffic(s.from, cmp.Or(s.network, "tcp"), s.addr, 5, expect{})
	}
}

// --- Scenario 3: an external flush ---

// flush empties the node's rules the way configuration tools do, inside
// the node's network namespace, once per variant. Reprogrammed: from the
// flush until every rule of before it is back.
func (f *faultBed) flush(t *testing.T) {
	variants := []struct {
		name string
		cmds [][]string
	}{
		{"iptables -t nat -F", [][]string{{"iptables", "-t", "nat", "-F"}}},
		{"iptables -t nat -F -X", [][]string{{"iptables", "-t", "nat", "-F"}, {"iptables", "-t", "nat", "-X"}}},
	}
	if f.mode == cluster.ModeNFTables {
		variants = []struct {
			name string
			cmds [][]string
		}{
			{"nft flush table", [][]string{{"nft", "flush", "table", "ip", "kproxy"}}},
			{"nft flush chain services", [][]string{{"nft", "flush", "chain", "ip", "kproxy", "services"}}},
		}
	}
	limit := faultSyncPeriod + syncAllowance
	for _, v := range variants {
		t.Run(strings.ReplaceAll(v.name, " ", "_"), func(t *testing.T) {
			e := f.e.sub(t)
			onNode := func(argv ...string) (string, error) { return e.c.Exec(e.ctx, f.node, argv...) }
			before, err := f.normalizedRules(e.ctx, onNode)
			if err != nil {
				e.fatalf("%v", err)
			}
			r := f.begin(t, "flush: "+v.name, fmt.Sprintf("repaired within one sync period (%s) plus %s", faultSyncPeriod, syncAllowance))
			defer r.report(false)
			time.Sleep(time.Second)
			flushed := time.Now()
			for _, argv := range v.cmds {
				if _, err := onNode(argv...); err != nil {
					e.fatalf("%v", err)
				}
			}
			d, why := f.waitProgrammedFor(flushWait, flushed, 0, false, func() error {
				now, err := f.normalizedRules(e.ctx, onNode)
				if err != nil {
					return err
				}
				if missing := missingLines(before, now); len(missing) > 0 {
					return fmt.Errorf("%d rules of before the flush not back, first: %s", len(missing), strings.Join(missing[:min(10, len(missing))], "\n"))
				}
				return nil
			})
			r.reprogrammed(d, why)
			if d < 0 || d > limit {
				r.fail("repaired after %s; want within %s", fmtDur(d), limit)
			}
			time.Sleep(time.Second)
			r.end()
			if d < 0 {
				// The scenarios that follow need a programmed node.
				f.resync(e)
			}
			if last := r.lastFailure(); !last.IsZero() {
				r.note("the last failed request started %s after the flush", last.Sub(flushed).Round(100*time.Millisecond))
			}
		})
	}
}

// --- Scenario 4: the xtables lock held with iptables-legacy ---

// xtablesLock runs kproxy on the fault node with iptables-legacy (its
// iptables tools first on PATH: kproxy picks the backend from `iptables
// --version`), holds /run/xtables.lock for lockHold and creates a probe
// Service meanwhile. Reprogrammed: from the release until kproxy synced
// and the probe answers.
func (f *faultBed) xtablesLock(t *testing.T) {
	if f.mode != cluster.ModeIPTables {
		t.Skipf("iptables mode only (the xtables lock is iptables-legacy's); this is %s mode", f.mode)
	}
	e := f.e.sub(t)
	multi, err := exec.LookPath("xtables-legacy-multi")
	if err != nil {
		t.Skipf("no iptables-legacy here: %v", err)
	}
	legacyDir := filepath.Join(f.dir, "legacy")
	if err := os.MkdirAll(legacyDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tool := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"} {
		if err := os.Symlink(multi, filepath.Join(legacyDir, tool)); err != nil && !errors.Is(err, os.ErrExist) {
			t.Fatal(err)
		}
	}
	kproxyBin := filepath.Join(e.c.BinDir(), "kproxy")
	// cleanupWith runs kproxy --cleanup on the node with env (none: the
	// node's own tools).
	cleanupWith := func(ctx context.Context, env []string) error {
		cmd, err := e.c.Command(ctx, f.node, kproxyBin, "--cleanup")
		if err != nil {
			return err
		}
		cmd.Env = append(os.Environ(), env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("kproxy --cleanup: %w\n%s", err, out)
		}
		return nil
	}
	legacyEnv := f.shimEnv(f.shimDir, legacyDir+":"+os.Getenv("PATH"))
	// Whatever happens: the legacy rules go, kproxy runs as the suite runs it.
	restored := false
	restore := func(ctx context.Context) error {
		if restored {
			return nil
		}
		restored = true
		if err := e.c.StopKproxy(ctx, f.node); err != nil {
			return err
		}
		if err := cleanupWith(ctx, []string{"PATH=" + legacyDir + ":" + os.Getenv("PATH")}); err != nil {
			return err
		}
		offset := logSize(e.c.KproxyLog(f.node))
		if err := e.c.StartKproxyWith(ctx, f.node, f.start); err != nil {
			return err
		}
		for {
			if strings.Contains(f.kproxyLog(offset), syncedIPv4) {
				return nil
			}
			if err := cluster.Sleep(ctx, pollInterval); err != nil {
				return fmt.Errorf("kproxy did not sync after the legacy scenario: %w", err)
			}
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
		defer cancel()
		if err := restore(ctx); err != nil {
			t.Errorf("putting kproxy on %s back after the legacy scenario: %v", f.node, err)
		}
	})
	if err := e.c.StopKproxy(e.ctx, f.node); err != nil {
		e.fatalf("%v", err)
	}
	// The nf_tables backend's rules go first: traffic must depend on the
	// legacy rules alone.
	if err := cleanupWith(e.ctx, nil); err != nil {
		e.fatalf("%v", err)
	}
	legacyStart := cluster.KproxyStart{Args: f.start.Args, Env: legacyEnv}
	offset := logSize(e.c.KproxyLog(f.node))
	if err := e.c.StartKproxyWith(e.ctx, f.node, legacyStart); err != nil {
		e.fatalf("%v", err)
	}
	e.kproxySynced(f.node, offset)
	if !strings.Contains(f.kproxyLog(offset), `"mode"="legacy"`) && !strings.Contains(f.kproxyLog(offset), `mode="legacy"`) {
		t.Logf("kproxy's log does not name the legacy backend (it logs it at -v=2 or more only, perhaps)")
	}
	for _, s := range f.streams {
		e.expectTraffic(s.from, cmp.Or(s.network, "tcp"), s.addr, 10, expect{all: names(f.pods, "")})
	}
	if out, err := e.c.Exec(e.ctx, f.node, "iptables-legacy-save", "-t", "nat"); err != nil || !strings.Contains(out, ":KPROXY-") {
		e.fatalf("no kproxy chain in the legacy nat table (err %v)", err)
	}

	r := f.begin(t, "xtables-lock", "0 failed; a change made while the lock is held programmed within one sync period of its release")
	defer r.report(true)
	time.Sleep(time.Second)
	lock, err := os.OpenFile(xtablesLock, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		e.fatalf("%v", err)
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		e.fatalf("locking %s: %v", xtablesLock, err)
	}
	locked := time.Now()
	released := false
	release := func() {
		if !released {
			released = true
			_ = unix.Flock(int(lock.Fd()), unix.LOCK_UN)
		}
	}
	defer release()
	time.Sleep(time.Second)
	probe := f.selectorless(e, "probe-lock", f.pods)
	time.Sleep(time.Until(locked.Add(lockHold)))
	if f.reachable(probe)() == nil {
		r.note("the probe answered while the lock was held")
	}
	logOff := logSize(e.c.KproxyLog(f.node))
	release()
	releasedAt := time.Now()
	d, why := f.waitProgrammed(releasedAt, logOff, true, f.reachable(probe))
	r.reprogrammed(d, why)
	if d < 0 || d > faultSyncPeriod {
		r.fail("the change made while the lock was held was programmed %s after the release; want within %s", fmtDur(d), faultSyncPeriod)
	}
	if n := strings.Count(f.kproxyLog(offset), "xtables lock"); n > 0 {
		r.note("kproxy logged the xtables lock %d times", n)
	}
	time.Sleep(time.Second)
	r.end()
	if err := restore(e.ctx); err != nil {
		e.fatalf("putting kproxy on %s back: %v", f.node, err)
	}
}

// --- Scenario 5: a poisoned Service ---

// poisonedService makes the fault node's restores refuse every input that
// mentions a new Service (the shims' poison marker: its name, as rule and
// element comments carry it), creates it, and once a restore was refused
// moves the shift Service's endpoint from one backend to the other.
// Reprogrammed: from that change until the shift Service answers from the
// new backend only. The poison stays for two sync periods and more, while
// /healthz is polled.
func (f *faultBed) poisonedService(t *testing.T) {
	e := f.e.sub(t)
	limit := faultMinSyncPeriod + syncAllowance
	r := f.begin(t, "poisoned-service", fmt.Sprintf("0 failed; the other change programmed within %s; health 200", limit))
	defer r.report(true)
	from, to := f.pods[0].Name, f.pods[1].Name
	shiftAddr := hostPort(f.shift.Spec.ClusterIP, servicePort)
	e.expectTraffic(f.client, "tcp", shiftAddr, 5, expect{all: []string{from}, only: []string{from}})

	poisonFile := filepath.Join(f.dir, "poison")
	name := "poison"
	marker := e.ns + "/" + name + ":"
	if err := os.WriteFile(poisonFile, []byte(marker+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = os.Remove(poisonFile)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = f.fast.CoreV1().Services(e.ns).Delete(ctx, name, metav1.DeleteOptions{})
		_ = f.fast.DiscoveryV1().EndpointSlices(e.ns).Delete(ctx, name, metav1.DeleteOptions{})
	})
	callsOff := f.callsSize()
	poisonedAt := time.Now()
	f.selectorless(e, name, f.pods)
	e.eventually("a restore refused for the poisoned Service", programTimeout, func() error {
		if f.countCalls(f.calls(callsOff), "refused") == 0 {
			return errors.New("no refused restore yet")
		}
		return nil
	})
	changed := time.Now()
	f.setEndpoints(e, f.shift, f.pods[1:])
	d, why := f.waitProgrammed(changed, 0, false, func() error {
		s, err := e.sample(f.client, "tcp", shiftAddr, 5)
		if err != nil {
			return err
		}
		return expect{only: []string{to}}.check(s)
	})
	r.reprogrammed(d, why)
	if d < 0 || d > limit {
		r.fail("the other Service's change was programmed after %s despite the poisoned one; want within %s", fmtDur(d), limit)
	}
	// Two sync periods and more with the poison in place.
	time.Sleep(time.Until(poisonedAt.Add(2*faultSyncPeriod + 5*time.Second)))
	calls := f.calls(callsOff)
	r.note("%d restores refused, %d run, while the poisoned Service existed", f.countCalls(calls, "refused"), f.countCalls(calls, "start"))
	r.end()
	if !r.health.allOK() {
		r.fail("/healthz answered %s while the only fault was the poisoned Service; want 200 throughout", r.res.Health)
	}

	// The poison goes; kproxy must sync again.
	logOff := logSize(e.c.KproxyLog(f.node))
	if err := os.Remove(poisonFile); err != nil {
		t.Fatal(err)
	}
	if err := f.fast.CoreV1().Services(e.ns).Delete(e.ctx, name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if d, why := f.waitProgrammed(time.Now(), logOff, true, func() error { return nil }); d < 0 {
		r.fail("kproxy did not sync again once the poisoned Service was gone: %v", why)
	}
	f.setEndpoints(e, f.shift, f.pods[:1])
}

// --- Scenario 6: a hung restore ---

// hungRestore makes the fault node's restores hang (the shims wait while
// the hang file exists) for longer than kproxy's kernel-call deadline and
// creates a probe Service, whose sync hangs. kproxy must kill the hung
// restore at its deadline; once the hang ends it must program the probe.
// Reprogrammed: from the end of the hang until kproxy synced and the
// probe answers.
func (f *faultBed) hungRestore(t *testing.T) {
	e := f.e.sub(t)
	hold := faultDeadline + 5*time.Second
	if f.deadlineFlag == "" {
		hold = 15 * time.Second
	}
	r := f.begin(t, "hung-restore", fmt.Sprintf("0 failed; the hung restore killed at kproxy's deadline (%s); programming resumes within one sync period", faultDeadline))
	defer r.report(true)
	if f.deadlineFlag == "" {
		r.fail("kproxy has no kernel-call deadline flag (kproxy --help names no timeout or deadline flag for kernel calls): a hung restore is never killed")
	}
	hangFile := filepath.Join(f.dir, "hang")
	if err := os.WriteFile(hangFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(hangFile) })
	callsOff := f.callsSize()
	time.Sleep(500 * time.Millisecond)
	probe := f.selectorless(e, "probe-hang", f.pods)
	e.eventually("a restore hanging", programTimeout, func() error {
		if f.countCalls(f.calls(callsOff), "hang") == 0 {
			return errors.New("no restore hanging yet")
		}
		return nil
	})
	hungAt := time.Now()
	time.Sleep(time.Until(hungAt.Add(hold)))
	// Which hung restores still run past the deadline and a margin, each
	// counted from its own start (kproxy retries a killed one at once,
	// and the retry hangs too)?
	hungSince := map[string]time.Time{}
	for _, l := range f.calls(callsOff) {
		fields := strings.Fields(l)
		if len(fields) < 3 || fields[2] != "hang" {
			continue
		}
		if sec, err := strconv.ParseFloat(fields[0], 64); err == nil {
			hungSince[fields[1]] = time.Unix(0, int64(sec*1e9))
		}
	}
	var overdue []string
	for p, since := range hungSince {
		if pid, err := strconv.Atoi(p); err == nil && unix.Kill(pid, 0) == nil && time.Since(since) > faultDeadline+2*time.Second {
			overdue = append(overdue, fmt.Sprintf("%s (hung %s)", p, fmtDur(time.Since(since))))
		}
	}
	if len(overdue) > 0 {
		r.fail("hung restores %s still ran past kproxy's deadline (%s) and a 2s margin", strings.Join(overdue, ", "), faultDeadline)
	} else {
		r.note("every hung restore was killed within kproxy's deadline (%s) and a 2s margin", faultDeadline)
	}
	logOff := logSize(e.c.KproxyLog(f.node))
	if err := os.Remove(hangFile); err != nil {
		t.Fatal(err)
	}
	releasedAt := time.Now()
	d, why := f.waitProgrammed(releasedAt, logOff, true, f.reachable(probe))
	r.reprogrammed(d, why)
	if d < 0 || d > faultSyncPeriod {
		r.fail("programming resumed %s after the hang ended; want within %s", fmtDur(d), faultSyncPeriod)
	}
	r.note("%d restores hung", f.countCalls(f.calls(callsOff), "hang"))
	time.Sleep(time.Second)
}
