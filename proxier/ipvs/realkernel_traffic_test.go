package ipvs

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/healthcheck"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// Helpers of the real-kernel fault tests (realkernel_faults_test.go):
// steady traffic that counts every failed request, an IPVS interface that
// refuses, hangs or dies at the kernel-interface boundary, proxy health fed
// as kproxy feeds it, and a dump of kproxy's kernel state to compare two
// nodes.

// trafficInterval is the pause between two requests of one target.
const trafficInterval = 20 * time.Millisecond

// trafficRequestTimeout bounds one request: a rule that forwards answers
// in milliseconds even on the emulated CPU.
const trafficRequestTimeout = 3 * time.Second

// trafficTarget is one flow of steady traffic: requests from a namespace to
// an address, answered by one of the named backends.
type trafficTarget struct {
	from *netnstest.NS
	addr string
	want []string
}

// setWant changes the backends target i (in startTraffic's order) may
// reach.
func (tr *traffic) setWant(i int, want ...string) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	tr.want[i] = want
}

// failedRequest is one request that failed.
type failedRequest struct {
	start, end time.Time
	target     string
	err        string
}

// traffic sends requests to its targets, each from its own goroutine every
// trafficInterval, and counts them.
type traffic struct {
	mu     sync.Mutex
	want   [][]string
	sent   int
	failed []failedRequest
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// startTraffic starts the traffic; it stops at t's end at the latest.
func startTraffic(t *testing.T, targets ...trafficTarget) *traffic {
	ctx, cancel := context.WithCancel(context.Background())
	tr := &traffic{cancel: cancel}
	for _, tg := range targets {
		tr.want = append(tr.want, tg.want)
	}
	for i, tg := range targets {
		tr.wg.Go(func() {
			for ctx.Err() == nil {
				start := time.Now()
				rctx, rcancel := context.WithTimeout(ctx, trafficRequestTimeout)
				be, _, err := request(rctx, tg.from, tg.addr)
				rcancel()
				if ctx.Err() != nil {
					return // stopped: not counted
				}
				tr.mu.Lock()
				if want := tr.want[i]; err == nil && !slices.Contains(want, be) {
					err = fmt.Errorf("reached %q, want one of %v", be, want)
				}
				tr.sent++
				if err != nil {
					tr.failed = append(tr.failed, failedRequest{start: start, end: time.Now(), target: tg.from.Name + " -> " + tg.addr, err: err.Error()})
				}
				tr.mu.Unlock()
				select {
				case <-ctx.Done():
				case <-time.After(trafficInterval):
				}
			}
		})
	}
	t.Cleanup(tr.stop)
	return tr
}

// stop stops the traffic and waits for its requests.
func (tr *traffic) stop() {
	tr.cancel()
	tr.wg.Wait()
}

// counts returns the requests sent and failed so far.
func (tr *traffic) counts() (sent, failed int) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.sent, len(tr.failed)
}

// failures returns the failed requests that started at or after from (zero:
// all).
func (tr *traffic) failures(from time.Time) []failedRequest {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	var out []failedRequest
	for _, f := range tr.failed {
		if !f.start.Before(from) {
			out = append(out, f)
		}
	}
	return out
}

// waitSent waits until n more requests have been sent, so that a check of
// the traffic covers what just happened.
func (tr *traffic) waitSent(t *testing.T, n int) {
	t.Helper()
	before, _ := tr.counts()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if sent, _ := tr.counts(); sent >= before+n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("traffic stalled: fewer than %d requests in 30s", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// expectNoFailures fails t when a request failed.
func (tr *traffic) expectNoFailures(t *testing.T, what string) {
	t.Helper()
	sent, failed := tr.counts()
	t.Logf("%s: traffic sent %d, failed %d", what, sent, failed)
	for i, f := range tr.failures(time.Time{}) {
		if i == 10 {
			t.Errorf("... and %d more", failed-10)
			break
		}
		t.Errorf("%s: request %s failed at +%v: %s", what, f.target, time.Since(f.start).Round(time.Millisecond), f.err)
	}
}

// ipvsChange names a change faultIPVS may refuse, hang or count.
type ipvsChange struct {
	op  string // "AddService", "UpdateService", "DeleteService", "AddDestination", ...
	svc *ipvs.Service
	dst *ipvs.Destination // nil for the service's own ops
}

// hangMode says whether and how a change hangs.
type hangMode int

const (
	noHang hangMode = iota
	// hangBefore: the request never reaches the kernel, and nothing
	// answers.
	hangBefore
	// hangAfter: the kernel makes the change but its answer never comes.
	hangAfter
)

// faultIPVS is the real IPVS interface with faults injected where kproxy
// meets the kernel: a change it refuses fails as the kernel would refuse it;
// a change that hangs runs under a deadline.Guard with the kernel-call
// timeout, as the real interface runs its netlink requests, and is
// abandoned at its deadline (the real interface then closes its socket,
// which ends the request: here abandoning releases it); onChange sees every
// change before it is made (a test kills the agent there). Listings pass
// through.
type faultIPVS struct {
	ipvs.Interface
	// timeout is the kernel-call timeout of the hanging changes.
	timeout time.Duration
	guard   deadline.Guard

	mu       sync.Mutex
	refuse   func(ipvsChange) error
	hang     func(ipvsChange) hangMode
	onChange func(n int, c ipvsChange)
	changes  int
}

func (f *faultIPVS) set(refuse func(ipvsChange) error, hang func(ipvsChange) hangMode, onChange func(int, ipvsChange)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse, f.hang, f.onChange = refuse, hang, onChange
}

// refuseAddress refuses every addition and update of the virtual servers
// at addr, and of their real servers, with the kernel's "invalid argument"
// (as a kernel refuses a value it cannot take; deleting what it never made
// fails as the real kernel says).
func refuseAddress(addr string) func(ipvsChange) error {
	a := netip.MustParseAddr(addr)
	ops := []string{"AddService", "UpdateService", "AddDestination", "UpdateDestination"}
	return func(c ipvsChange) error {
		if c.svc.Address != a || !slices.Contains(ops, c.op) {
			return nil
		}
		return fmt.Errorf("IPVS %s %s: %w", c.op, c.svc, syscall.EINVAL)
	}
}

func (f *faultIPVS) change(ctx context.Context, c ipvsChange, do func(ctx context.Context) error) error {
	f.mu.Lock()
	f.changes++
	n, refuse, hang, onChange := f.changes, f.refuse, f.hang, f.onChange
	f.mu.Unlock()
	if onChange != nil {
		onChange(n, c)
	}
	if refuse != nil {
		if err := refuse(c); err != nil {
			return err
		}
	}
	mode := noHang
	if hang != nil {
		mode = hang(c)
	}
	if mode == noHang {
		return do(ctx)
	}
	release := make(chan struct{})
	return f.guard.Do(ctx, "IPVS "+c.op, f.timeout, func(context.Context) error {
		if mode == hangAfter {
			_ = do(context.Background())
		}
		<-release
		return nil
	}, func() { close(release) })
}

func (f *faultIPVS) AddService(ctx context.Context, svc *ipvs.Service) error {
	return f.change(ctx, ipvsChange{op: "AddService", svc: svc}, func(ctx context.Context) error { return f.Interface.AddService(ctx, svc) })
}

func (f *faultIPVS) UpdateService(ctx context.Context, svc *ipvs.Service) error {
	return f.change(ctx, ipvsChange{op: "UpdateService", svc: svc}, func(ctx context.Context) error { return f.Interface.UpdateService(ctx, svc) })
}

func (f *faultIPVS) DeleteService(ctx context.Context, svc *ipvs.Service) error {
	return f.change(ctx, ipvsChange{op: "DeleteService", svc: svc}, func(ctx context.Context) error { return f.Interface.DeleteService(ctx, svc) })
}

func (f *faultIPVS) AddDestination(ctx context.Context, svc *ipvs.Service, dst *ipvs.Destination) error {
	return f.change(ctx, ipvsChange{op: "AddDestination", svc: svc, dst: dst}, func(ctx context.Context) error {
		return f.Interface.AddDestination(ctx, svc, dst)
	})
}

func (f *faultIPVS) UpdateDestination(ctx context.Context, svc *ipvs.Service, dst *ipvs.Destination) error {
	return f.change(ctx, ipvsChange{op: "UpdateDestination", svc: svc, dst: dst}, func(ctx context.Context) error {
		return f.Interface.UpdateDestination(ctx, svc, dst)
	})
}

func (f *faultIPVS) DeleteDestination(ctx context.Context, svc *ipvs.Service, dst *ipvs.Destination) error {
	return f.change(ctx, ipvsChange{op: "DeleteDestination", svc: svc, dst: dst}, func(ctx context.Context) error {
		return f.Interface.DeleteDestination(ctx, svc, dst)
	})
}

// realHealth is proxy health fed by sync results as kproxy feeds it: a
// failed sync is an update still queued, a successful one applies them.
type realHealth struct {
	hs *healthcheck.ProxyHealthServer
}

// healthTimeout is 2 x the engine's sync period (pt.NewEngine: 30s), as
// kproxy sets it.
const healthTimeout = 60 * time.Second

func newRealHealth(t *testing.T) *realHealth {
	hs, err := healthcheck.NewProxyHealthServer(healthcheck.ProxyHealthOptions{HealthTimeout: healthTimeout, NodeName: realNodeName})
	if err != nil {
		t.Fatal(err)
	}
	return &realHealth{hs: hs}
}

func (h *realHealth) onSync(r proxier.SyncResult) {
	if r.Err != nil {
		h.hs.QueuedUpdate(r.Family)
		return
	}
	h.hs.Updated(r.Family, r.Start)
}

// status is what /healthz answers.
func (h *realHealth) status() int {
	rec := httptest.NewRecorder()
	h.hs.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	return rec.Code
}

func (h *realHealth) expectHealthy(t *testing.T, when string) {
	t.Helper()
	if code := h.status(); code != http.StatusOK {
		t.Errorf("%s: /healthz answered %d, want 200", when, code)
	}
}

// syncResult runs one sync of r's engine with ctx and returns its result
// (recorded by the agent's onSync into *last) and how long it took.
func syncWith(ctx context.Context, r *realNode, last *proxier.SyncResult) (proxier.SyncResult, time.Duration) {
	*last = proxier.SyncResult{}
	start := time.Now()
	err := r.engine.SyncRules(ctx)
	took := time.Since(start)
	res := *last
	if res.Err == nil && err != nil {
		res.Err = err
	}
	return res, took
}

// addFiller adds filler service i to r's engine: ClusterIP fillerIP(i)
// port 80, its endpoint be1 or be2 (alternately) unless backends are given.
func (r *realNode) addFiller(i int, backends ...string) {
	name := fmt.Sprintf("f%03d", i)
	if len(backends) == 0 {
		backends = []string{[]string{"be1", "be2"}[i%2]}
	}
	r.engine.OnServiceAdd(pt.Service(name, fillerIP(i)))
	r.engine.OnEndpointSliceUpdate(nil, r.slice(name, backends...))
}

func fillerIP(i int) string { return fmt.Sprintf("10.97.%d.%d", i/250, i%250+1) }

// kernelState is kproxy's state in the node namespace, normalized so that
// two nodes given the same Services compare equal: the virtual and real
// servers (ipvsadm -Sn), the set entries (ipset save, entries only), the
// iptables rules of nat, filter and mangle without counters, and the
// dummy device's addresses; each sorted.
func (r *realNode) kernelState(t *testing.T) map[string][]string {
	t.Helper()
	ctx := context.Background()
	out := map[string][]string{}
	lines := func(b string, keep func(string) (string, bool)) []string {
		var ls []string
		for _, l := range strings.Split(b, "\n") {
			if l = strings.TrimSpace(l); l == "" {
				continue
			}
			if l, ok := keep(l); ok {
				ls = append(ls, l)
			}
		}
		slices.Sort(ls)
		return ls
	}
	all := func(l string) (string, bool) { return l, true }
	out["ipvs"] = lines(r.node.Run(t, "ipvsadm", "-Sn"), all)
	out["ipset"] = lines(r.node.Run(t, "ipset", "save"), func(l string) (string, bool) {
		return l, strings.HasPrefix(l, "add ") || strings.HasPrefix(l, "create ") && !strings.Contains(l, "hashsize")
	})
	var sets []string
	for _, l := range strings.Split(r.node.Run(t, "ipset", "list", "-n"), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			sets = append(sets, l)
		}
	}
	slices.Sort(sets)
	out["ipset names"] = sets
	counters := regexp.MustCompile(`\[\d+:\d+\]`)
	for _, table := range []string{"nat", "filter", "mangle"} {
		b, err := r.node.Exec(ctx, "iptables-save", "-t", table)
		if err != nil {
			t.Fatalf("iptables-save -t %s: %v\n%s", table, err, b)
		}
		out["iptables "+table] = lines(string(b), func(l string) (string, bool) {
			return counters.ReplaceAllString(l, "[]"), !strings.HasPrefix(l, "#")
		})
	}
	out["addresses"] = lines((r.node.Run(t, "ip", "-o", "-4", "addr", "show", "dev", DefaultDummyDevice)), func(l string) (string, bool) {
		f := strings.Fields(l)
		if len(f) < 4 {
			return "", false
		}
		return f[3], true
	})
	return out
}

// diffStates describes how a differs from b, "" when equal.
func diffStates(a, b map[string][]string) string {
	var out []string
	keys := make([]string, 0, len(a))
	for k := range a {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		onlyA, onlyB := minus(a[k], b[k]), minus(b[k], a[k])
		for _, l := range onlyA {
			out = append(out, fmt.Sprintf("%s: only after restart: %s", k, l))
		}
		for _, l := range onlyB {
			out = append(out, fmt.Sprintf("%s: only after a clean sync: %s", k, l))
		}
	}
	return strings.Join(out, "\n")
}

func minus(a, b []string) []string {
	var out []string
	for _, l := range a {
		if !slices.Contains(b, l) {
			out = append(out, l)
		}
	}
	return out
}
