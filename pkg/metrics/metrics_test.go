package metrics

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/healthcheck"
	"github.com/kproxy/kproxy/pkg/proxy"
)

var epoch = time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)

const v4, v6 = v1.IPv4Protocol, v1.IPv6Protocol

// pendingState is what the PendingChanges option reads; the test sets it.
type pendingState struct {
	mu                  sync.Mutex
	services, endpoints int
}

func (p *pendingState) get() (int, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.services, p.endpoints
}

func (p *pendingState) set(services, endpoints int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.services, p.endpoints = services, endpoints
}

type env struct {
	clock   *testingclock.FakeClock
	pending *pendingState
	m       *Metrics
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{clock: testingclock.NewFakeClock(epoch), pending: &pendingState{}}
	m, err := New(Options{Mode: "iptables", Version: "v1.2.3", Clock: e.clock, PendingChanges: e.pending.get})
	if err != nil {
		t.Fatal(err)
	}
	e.m = m
	return e
}

// value reads one sample: a counter or gauge value, or a histogram's sample
// count. It fails the test when the metric has no such sample.
func (e *env) value(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	mf := e.family(t, name)
	if mf == nil {
		t.Fatalf("metric %s is not exported", name)
	}
	for _, m := range mf.GetMetric() {
		if !labelsMatch(m, labels) {
			continue
		}
		switch {
		case m.GetCounter() != nil:
			return m.GetCounter().GetValue()
		case m.GetGauge() != nil:
			return m.GetGauge().GetValue()
		case m.GetHistogram() != nil:
			return float64(m.GetHistogram().GetSampleCount())
		}
	}
	t.Fatalf("metric %s has no sample with labels %v", name, labels)
	return 0
}

// has reports whether name has a sample with labels.
func (e *env) has(t *testing.T, name string, labels map[string]string) bool {
	t.Helper()
	mf := e.family(t, name)
	if mf == nil {
		return false
	}
	return slices.ContainsFunc(mf.GetMetric(), func(m *dto.Metric) bool { return labelsMatch(m, labels) })
}

func (e *env) family(t *testing.T, name string) *dto.MetricFamily {
	t.Helper()
	mfs, err := e.m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf
		}
	}
	return nil
}

// exposition is the text format of metric name, as /metrics serves it.
// (prometheus/testutil would do, but it needs a module absent from go.sum.)
func (e *env) exposition(t *testing.T, name string) string {
	t.Helper()
	mf := e.family(t, name)
	if mf == nil {
		t.Fatalf("metric %s is not exported", name)
	}
	var buf strings.Builder
	if err := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain)).Encode(mf); err != nil {
		t.Fatal(err)
	}
	return buf.String()
}

func labelsMatch(m *dto.Metric, want map[string]string) bool {
	if len(m.GetLabel()) != len(want) {
		return false
	}
	for _, l := range m.GetLabel() {
		if v, ok := want[l.GetName()]; !ok || v != l.GetValue() {
			return false
		}
	}
	return true
}

func fam(f v1.IPFamily) map[string]string { return map[string]string{"ip_family": string(f)} }

func TestSyncMetrics(t *testing.T) {
	type sample struct {
		name   string
		labels map[string]string
		want   float64
	}
	// syncAt is a successful result of a sync of family that started d ago.
	syncAt := func(e *env, family v1.IPFamily, full bool, d time.Duration) proxy.SyncResult {
		return proxy.SyncResult{Family: family, Full: full, Start: e.clock.Now().Add(-d), Duration: d}
	}
	for _, tc := range []struct {
		name string
		run  func(e *env)
		want []sample
		// absent are samples that must not exist.
		absent []sample
	}{
		{
			name: "a full sync",
			run: func(e *env) {
				r := syncAt(e, v4, true, 300*time.Millisecond)
				r.ServiceChanges, r.EndpointChanges = 2, 3
				r.NoLocalEndpointsInternal, r.NoLocalEndpointsExternal = 1, 4
				r.RuleCounts = map[string]int{"nat": 120, "filter": 7}
				e.m.SyncDone(r)
			},
			want: []sample{
				{"kubeproxy_sync_proxy_rules_duration_seconds", fam(v4), 1},
				{"kubeproxy_sync_full_proxy_rules_duration_seconds", fam(v4), 1},
				{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", fam(v4), float64(epoch.Unix())},
				{"kubeproxy_sync_proxy_rules_service_changes_total", nil, 2},
				{"kubeproxy_sync_proxy_rules_endpoint_changes_total", nil, 3},
				{"kubeproxy_sync_proxy_rules_no_local_endpoints_total", map[string]string{"traffic_policy": "internal", "ip_family": "IPv4"}, 1},
				{"kubeproxy_sync_proxy_rules_no_local_endpoints_total", map[string]string{"traffic_policy": "external", "ip_family": "IPv4"}, 4},
				{"kubeproxy_sync_proxy_rules_iptables_total", map[string]string{"table": "nat", "ip_family": "IPv4"}, 120},
				{"kubeproxy_sync_proxy_rules_iptables_total", map[string]string{"table": "filter", "ip_family": "IPv4"}, 7},
				{"kubeproxy_sync_proxy_rules_iptables_last", map[string]string{"table": "nat", "ip_family": "IPv4"}, 120},
				{"kubeproxy_sync_proxy_rules_iptables_last", map[string]string{"table": "filter", "ip_family": "IPv4"}, 7},
			},
			absent: []sample{
				{name: "kubeproxy_sync_partial_proxy_rules_duration_seconds", labels: fam(v4)},
				{name: "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", labels: fam(v4)},
				{name: "kubeproxy_network_programming_duration_seconds", labels: fam(v4)},
			},
		},
		{
			name: "partial syncs add up",
			run: func(e *env) {
				for range 3 {
					r := syncAt(e, v4, false, 10*time.Millisecond)
					r.ServiceChanges, r.EndpointChanges = 1, 2
					e.m.SyncDone(r)
					e.clock.Step(time.Second)
				}
			},
			want: []sample{
				{"kubeproxy_sync_proxy_rules_duration_seconds", fam(v4), 3},
				{"kubeproxy_sync_partial_proxy_rules_duration_seconds", fam(v4), 3},
				{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", fam(v4), float64(epoch.Add(2 * time.Second).Unix())},
				{"kubeproxy_sync_proxy_rules_service_changes_total", nil, 3},
				{"kubeproxy_sync_proxy_rules_endpoint_changes_total", nil, 6},
			},
			absent: []sample{{name: "kubeproxy_sync_full_proxy_rules_duration_seconds", labels: fam(v4)}},
		},
		{
			name: "failed syncs count as restore failures and leave the last timestamp",
			run: func(e *env) {
				e.m.SyncDone(syncAt(e, v4, true, time.Millisecond))
				e.clock.Step(time.Minute)
				failed := syncAt(e, v4, false, time.Millisecond)
				failed.Err = errors.New("iptables-restore: exit status 1")
				failed.TriggerTimes = []time.Time{epoch}
				e.m.SyncDone(failed)
				failed.Full = true
				e.m.SyncDone(failed)
			},
			want: []sample{
				{"kubeproxy_sync_proxy_rules_iptables_restore_failures_total", fam(v4), 2},
				{"kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", fam(v4), 1},
				{"kubeproxy_sync_proxy_rules_duration_seconds", fam(v4), 3},
				{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", fam(v4), float64(epoch.Unix())},
			},
			absent: []sample{{name: "kubeproxy_network_programming_duration_seconds", labels: fam(v4)}},
		},
		{
			name: "set-aside service ports by family, kept by a failed sync",
			run: func(e *env) {
				r := syncAt(e, v4, false, time.Millisecond)
				r.SetAside = map[proxy.ServicePortName]error{
					{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "a"}, Port: "p", Protocol: v1.ProtocolSCTP}: errors.New("no sctp"),
					{NamespacedName: types.NamespacedName{Namespace: "ns", Name: "b"}, Port: "p", Protocol: v1.ProtocolSCTP}: errors.New("no sctp"),
				}
				e.m.SyncDone(r)
				e.m.SyncDone(syncAt(e, v6, false, time.Millisecond))
				failed := syncAt(e, v4, false, time.Millisecond)
				failed.Err = errors.New("iptables-restore: exit status 1")
				e.m.SyncDone(failed)
			},
			want: []sample{
				{"kproxy_sync_proxy_rules_set_aside_services", fam(v4), 2},
				{"kproxy_sync_proxy_rules_set_aside_services", fam(v6), 0},
			},
		},
		{
			name: "set-aside ports cleared by a later sync",
			run: func(e *env) {
				r := syncAt(e, v4, false, time.Millisecond)
				r.SetAside = map[proxy.ServicePortName]error{{Port: "p"}: errors.New("no")}
				e.m.SyncDone(r)
				e.m.SyncDone(syncAt(e, v4, false, time.Millisecond))
			},
			want: []sample{{"kproxy_sync_proxy_rules_set_aside_services", fam(v4), 0}},
		},
		{
			name: "panics are counted, not as restore failures",
			run: func(e *env) {
				e.m.SyncDone(syncAt(e, v4, true, time.Millisecond))
				for range 2 {
					r := syncAt(e, v4, true, time.Millisecond)
					r.Err, r.Panicked = errors.New("panic: boom"), true
					e.m.SyncDone(r)
				}
			},
			want: []sample{
				{"kproxy_sync_panics_total", fam(v4), 2},
				{"kubeproxy_sync_proxy_rules_duration_seconds", fam(v4), 3},
			},
			absent: []sample{{name: "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", labels: fam(v4)}},
		},
		{
			name: "network programming latency per applied trigger time",
			run: func(e *env) {
				r := syncAt(e, v4, false, time.Millisecond)
				r.TriggerTimes = []time.Time{epoch.Add(-3 * time.Second), epoch.Add(-90 * time.Second)}
				e.m.SyncDone(r)
			},
			want: []sample{{"kubeproxy_network_programming_duration_seconds", fam(v4), 2}},
		},
		{
			name: "families are labelled apart",
			run: func(e *env) {
				e.m.SyncDone(syncAt(e, v4, true, time.Millisecond))
				e.clock.Step(time.Second)
				r := syncAt(e, v6, true, time.Millisecond)
				r.RuleCounts = map[string]int{"nat": 5, "filter": 1}
				e.m.SyncDone(r)
			},
			want: []sample{
				{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", fam(v4), float64(epoch.Unix())},
				{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", fam(v6), float64(epoch.Add(time.Second).Unix())},
				{"kubeproxy_sync_proxy_rules_iptables_total", map[string]string{"table": "nat", "ip_family": "IPv6"}, 5},
			},
			absent: []sample{{name: "kubeproxy_sync_proxy_rules_iptables_total", labels: map[string]string{"table": "nat", "ip_family": "IPv4"}}},
		},
		{
			name: "queued syncs",
			run: func(e *env) {
				e.m.SyncQueued(v4, epoch.Add(5*time.Second))
				e.m.SyncQueued(v6, epoch.Add(7*time.Second))
				e.m.SyncQueued(v4, epoch.Add(9*time.Second))
			},
			want: []sample{
				{"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", fam(v4), float64(epoch.Add(9 * time.Second).Unix())},
				{"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds", fam(v6), float64(epoch.Add(7 * time.Second).Unix())},
			},
		},
		{
			name: "pending changes are read at scrape time",
			run:  func(e *env) { e.pending.set(4, 9) },
			want: []sample{
				{"kubeproxy_sync_proxy_rules_service_changes_pending", nil, 4},
				{"kubeproxy_sync_proxy_rules_endpoint_changes_pending", nil, 9},
			},
		},
		{
			name: "build info",
			run:  func(*env) {},
			want: []sample{
				{"kproxy_build_info", map[string]string{"version": "v1.2.3", "mode": "iptables"}, 1},
				{"kubeproxy_sync_proxy_rules_service_changes_pending", nil, 0},
				{"kubeproxy_sync_proxy_rules_service_changes_total", nil, 0},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			tc.run(e)
			for _, s := range tc.want {
				if got := e.value(t, s.name, s.labels); got != s.want {
					t.Errorf("%s%v = %v, want %v", s.name, s.labels, got, s.want)
				}
			}
			for _, s := range tc.absent {
				if e.has(t, s.name, s.labels) {
					t.Errorf("%s%v exists, want no such sample", s.name, s.labels)
				}
			}
		})
	}
}

// TestHelpTextsAndBuckets pins the exposition of the sync histograms and
// the network programming buckets to kube-proxy's.
func TestHelpTextsAndBuckets(t *testing.T) {
	e := newEnv(t)
	e.m.SyncDone(proxy.SyncResult{Family: v4, Full: true, Duration: 3 * time.Millisecond})
	const want = `
# HELP kubeproxy_sync_full_proxy_rules_duration_seconds SyncProxyRules latency in seconds for full resyncs
# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.001"} 0
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.002"} 0
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.004"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.008"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.016"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.032"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.064"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.128"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.256"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.512"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="1.024"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="2.048"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="4.096"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="8.192"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="16.384"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="+Inf"} 1
kubeproxy_sync_full_proxy_rules_duration_seconds_sum{ip_family="IPv4"} 0.003
kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1
`
	if got := e.exposition(t, "kubeproxy_sync_full_proxy_rules_duration_seconds"); got != strings.TrimPrefix(want, "\n") {
		t.Errorf("exposition:\n%s\nwant:\n%s", got, want)
	}

	helps := map[string]string{
		"kubeproxy_sync_proxy_rules_duration_seconds":                        "SyncProxyRules latency in seconds",
		"kubeproxy_sync_partial_proxy_rules_duration_seconds":                "SyncProxyRules latency in seconds for partial resyncs",
		"kubeproxy_sync_proxy_rules_last_timestamp_seconds":                  "The last time proxy rules were successfully synced",
		"kubeproxy_sync_proxy_rules_endpoint_changes_pending":                "Pending proxy rules Endpoint changes",
		"kubeproxy_sync_proxy_rules_endpoint_changes_total":                  "Cumulative proxy rules Endpoint changes",
		"kubeproxy_sync_proxy_rules_service_changes_pending":                 "Pending proxy rules Service changes",
		"kubeproxy_sync_proxy_rules_service_changes_total":                   "Cumulative proxy rules Service changes",
		"kubeproxy_sync_proxy_rules_no_local_endpoints_total":                "Number of services with a Local traffic policy and no endpoints",
		"kubeproxy_sync_proxy_rules_iptables_total":                          "Total number of iptables rules owned by kube-proxy",
		"kubeproxy_sync_proxy_rules_iptables_last":                           "Number of iptables rules written by kube-proxy in last sync",
		"kubeproxy_sync_proxy_rules_iptables_restore_failures_total":         "Cumulative proxy iptables restore failures",
		"kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total": "Cumulative proxy iptables partial restore failures",
		"kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds":           "The last time a sync of proxy rules was queued",
		"kubeproxy_network_programming_duration_seconds":                     "In Cluster Network Programming Latency in seconds",
		"kubeproxy_proxy_healthz_total":                                      "Cumulative proxy healthz HTTP status",
		"kubeproxy_proxy_livez_total":                                        "Cumulative proxy livez HTTP status",
	}
	// Make every vector export a sample so that its family is gathered.
	e.m.SyncDone(proxy.SyncResult{Family: v4, RuleCounts: map[string]int{"nat": 1}, TriggerTimes: []time.Time{epoch}})
	e.m.SyncDone(proxy.SyncResult{Family: v4, Err: errors.New("failed")})
	e.m.SyncQueued(v4, epoch)
	e.m.HealthzResponded(http.StatusOK)
	e.m.LivezResponded(http.StatusOK)
	for name, help := range helps {
		mf := e.family(t, name)
		if mf == nil {
			t.Errorf("%s is not exported", name)
			continue
		}
		if mf.GetHelp() != help {
			t.Errorf("%s help = %q, want %q", name, mf.GetHelp(), help)
		}
	}

	// 0; 0.25s and 0.5s; every second to 59s; every 5s to 115s; every 30s
	// to 5 minutes.
	wantBuckets := []float64{0, 0.25, 0.5}
	for s := 1; s <= 59; s++ {
		wantBuckets = append(wantBuckets, float64(s))
	}
	for s := 60; s <= 115; s += 5 {
		wantBuckets = append(wantBuckets, float64(s))
	}
	for s := 120; s <= 300; s += 30 {
		wantBuckets = append(wantBuckets, float64(s))
	}
	var got []float64
	for _, b := range e.family(t, "kubeproxy_network_programming_duration_seconds").GetMetric()[0].GetHistogram().GetBucket() {
		got = append(got, b.GetUpperBound())
	}
	if !slices.Equal(got, wantBuckets) {
		t.Errorf("network programming buckets = %v, want %v", got, wantBuckets)
	}
}

func TestProbeCounters(t *testing.T) {
	e := newEnv(t)
	clk := testingclock.NewFakeClock(epoch)
	hs, err := healthcheck.NewProxyHealthServer(healthcheck.ProxyHealthOptions{
		HealthTimeout: time.Minute, NodeName: "node-a", Clock: clk, Recorder: e.m,
	})
	if err != nil {
		t.Fatal(err)
	}
	get := func(path string) {
		hs.Handler().ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, path, nil))
	}
	get("/healthz")
	get("/livez")
	hs.QueuedUpdate(v4)
	clk.Step(time.Minute)
	get("/healthz")
	get("/healthz")
	get("/livez")
	for _, s := range []struct {
		name, code string
		want       float64
	}{
		{"kubeproxy_proxy_healthz_total", "200", 1},
		{"kubeproxy_proxy_healthz_total", "503", 2},
		{"kubeproxy_proxy_livez_total", "200", 1},
		{"kubeproxy_proxy_livez_total", "503", 1},
	} {
		if got := e.value(t, s.name, map[string]string{"code": s.code}); got != s.want {
			t.Errorf("%s{code=%s} = %v, want %v", s.name, s.code, got, s.want)
		}
	}
}

func TestHandler(t *testing.T) {
	e := newEnv(t)
	e.m.SyncDone(proxy.SyncResult{Family: v4, Full: true, Duration: time.Millisecond})
	for _, tc := range []struct {
		path         string
		wantCode     int
		wantBody     []string
		wantBodyIsEq bool
	}{
		{path: "/proxyMode", wantCode: http.StatusOK, wantBody: []string{"iptables"}, wantBodyIsEq: true},
		{path: "/metrics", wantCode: http.StatusOK, wantBody: []string{
			`kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1`,
			`kproxy_build_info{mode="iptables",version="v1.2.3"} 1`,
			"kubeproxy_sync_proxy_rules_endpoint_changes_pending 0",
			"go_goroutines ",
			"process_start_time_seconds ",
		}},
		{path: "/healthz", wantCode: http.StatusNotFound},
		{path: "/debug/pprof/", wantCode: http.StatusNotFound},
	} {
		t.Run(tc.path, func(t *testing.T) {
			rec := httptest.NewRecorder()
			e.m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, tc.path, nil))
			if rec.Code != tc.wantCode {
				t.Fatalf("GET %s = %d, want %d", tc.path, rec.Code, tc.wantCode)
			}
			body := rec.Body.String()
			if tc.wantBodyIsEq && body != tc.wantBody[0] {
				t.Errorf("GET %s body = %q, want %q", tc.path, body, tc.wantBody[0])
			}
			for _, want := range tc.wantBody {
				if !strings.Contains(body, want) {
					t.Errorf("GET %s body does not contain %q:\n%s", tc.path, want, body)
				}
			}
		})
	}
}

// TestProfiling: /debug/pprof/ is served only with Options.Profiling.
func TestProfiling(t *testing.T) {
	m, err := New(Options{Mode: "nftables", Profiling: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap?debug=1", "/debug/pprof/cmdline"} {
		rec := httptest.NewRecorder()
		m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		if rec.Code != http.StatusOK {
			t.Errorf("GET %s = %d, want 200", path, rec.Code)
		}
	}
}

// TestServe serves on a real loopback listener and stops with the context.
func TestServe(t *testing.T) {
	e := newEnv(t)
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	done := make(chan error, 1)
	go func() { done <- e.m.Serve(ctx, ln) }()

	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + addr + "/proxyMode")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if string(body) != "iptables" {
		t.Errorf("/proxyMode = %q, want iptables", body)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve returned %v after the context ended, want nil", err)
	}
	if err := e.m.Run(ctx, "127.0.0.1:70000"); err == nil {
		t.Error("Run on port 70000 succeeded")
	}
}

// TestNoGlobalState checks that two Metrics coexist and count apart.
func TestNoGlobalState(t *testing.T) {
	a, b := newEnv(t), newEnv(t)
	a.m.SyncDone(proxy.SyncResult{Family: v4, ServiceChanges: 5})
	if got := b.value(t, "kubeproxy_sync_proxy_rules_service_changes_total", nil); got != 0 {
		t.Errorf("second registry counted %v service changes of the first", got)
	}
	if got := a.value(t, "kubeproxy_sync_proxy_rules_service_changes_total", nil); got != 5 {
		t.Errorf("service changes = %v, want 5", got)
	}
	mfs, err := prometheus.DefaultGatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if strings.HasPrefix(mf.GetName(), "kubeproxy_") || strings.HasPrefix(mf.GetName(), "kproxy_") {
			t.Errorf("%s is registered globally", mf.GetName())
		}
	}
}
