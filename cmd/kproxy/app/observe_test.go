package app

import (
	"context"
	"errors"
	"maps"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/healthcheck"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/metrics"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	iptbackend "github.com/kproxy/kproxy/proxier/iptables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// gaugeOrCounter reads one sample of name with labels from m, or -1.
func gaugeOrCounter(t *testing.T, m *metrics.Metrics, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := m.Registry().Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, s := range mf.GetMetric() {
			if labelsEqual(s, labels) {
				if s.GetCounter() != nil {
					return s.GetCounter().GetValue()
				}
				return s.GetGauge().GetValue()
			}
		}
	}
	return -1
}

func labelsEqual(m *dto.Metric, want map[string]string) bool {
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	return maps.Equal(got, want)
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	return ln.Addr().(*net.TCPAddr).Port
}

// TestAfterSync checks how one sync result reaches the metrics, the proxy
// health and the service health checks.
func TestAfterSync(t *testing.T) {
	const timeout = time.Minute
	lb := types.NamespacedName{Namespace: "ns", Name: "lb"}
	v4 := map[string]string{"ip_family": "IPv4"}
	for _, tc := range []struct {
		name string
		// results are fed in order, each after the clock moved on by step.
		results     func(port int, now time.Time) []proxier.SyncResult
		step        time.Duration
		wantHealthy bool
		wantOpen    bool
		wantFailed  float64
	}{
		{
			name: "successful sync opens the health check",
			results: func(port int, now time.Time) []proxier.SyncResult {
				return []proxier.SyncResult{{Family: v1.IPv4Protocol, Start: now, HealthCheckServices: map[types.NamespacedName]proxier.HealthCheckService{lb: {Port: port, LocalEndpoints: 1}}}}
			},
			step: timeout, wantHealthy: true, wantOpen: true, wantFailed: -1,
		},
		{
			name: "failing syncs make the proxy unhealthy after the timeout",
			results: func(port int, now time.Time) []proxier.SyncResult {
				return []proxier.SyncResult{{Family: v1.IPv4Protocol, Start: now, Err: errors.New("restore failed")}}
			},
			step: timeout, wantHealthy: false, wantOpen: false, wantFailed: 1,
		},
		{
			name: "a success after a failure heals",
			results: func(port int, now time.Time) []proxier.SyncResult {
				return []proxier.SyncResult{
					{Family: v1.IPv4Protocol, Start: now, Err: errors.New("restore failed")},
					{Family: v1.IPv4Protocol, Start: now.Add(timeout), HealthCheckServices: map[types.NamespacedName]proxier.HealthCheckService{lb: {Port: port}}},
				}
			},
			step: timeout, wantHealthy: true, wantOpen: true, wantFailed: 1,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			clk := testingclock.NewFakeClock(time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC))
			m, err := metrics.New(metrics.Options{Mode: ModeIPTables, Version: Version, Clock: clk})
			if err != nil {
				t.Fatal(err)
			}
			health, err := healthcheck.NewProxyHealthServer(healthcheck.ProxyHealthOptions{HealthTimeout: timeout, NodeName: "node-a", Clock: clk, Recorder: m})
			if err != nil {
				t.Fatal(err)
			}
			svcHealth := healthcheck.NewServiceHealthServer(healthcheck.ServiceHealthOptions{
				NodePortAddresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")},
				LocalAddresses:    func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil },
				ProxyHealth:       health, Logger: logger,
			})
			defer svcHealth.Close()
			port := freePort(t)
			for _, r := range tc.results(port, clk.Now()) {
				clk.SetTime(r.Start)
				afterSync(r, m, health, svcHealth)
				clk.Step(tc.step)
			}
			if got := health.Health().Healthy; got != tc.wantHealthy {
				t.Errorf("healthy = %v, want %v", got, tc.wantHealthy)
			}
			if _, open := svcHealth.Services()[lb]; open != tc.wantOpen {
				t.Errorf("health check open = %v, want %v", open, tc.wantOpen)
			}
			if tc.wantOpen {
				conn, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
				if err != nil {
					t.Errorf("health check port does not accept connections: %v", err)
				} else {
					_ = conn.Close()
				}
			}
			if got := gaugeOrCounter(t, m, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", v4); got != tc.wantFailed {
				t.Errorf("restore failures = %v, want %v", got, tc.wantFailed)
			}
		})
	}
}

// TestBackendRuleCounts checks that the rule counts of a sync result come
// from the iptables backend's last sync.
func TestBackendRuleCounts(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	b, err := iptbackend.New(iptbackend.Options{
		IPTables:       iptablestest.NewFake(ipt.ProtocolIPv4),
		LocalAddresses: func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("192.0.2.1")}, nil },
	})
	if err != nil {
		t.Fatal(err)
	}
	var results []proxier.SyncResult
	e, err := proxier.NewEngine(proxier.EngineOptions{
		Family: v1.IPv4Protocol, NodeName: "node-a", Backend: b, SyncPeriod: time.Minute,
		OnSync: func(r proxier.SyncResult) { results = append(results, r) },
	})
	if err != nil {
		t.Fatal(err)
	}
	e.OnServiceAdd(pt.Service("web", "10.96.0.10"))
	e.OnEndpointSliceAdd(pt.Slice("web", 8080, pt.EP{IP: "10.244.1.5", Node: "node-b"}))
	e.OnServiceSynced()
	e.OnEndpointSlicesSynced()
	if err := e.SyncRules(ctx); err != nil {
		t.Fatal(err)
	}
	st := b.LastSync()
	want := map[string]int{"nat": st.NATRules, "filter": st.FilterRules}
	if got := results[len(results)-1].RuleCounts; !maps.Equal(got, want) || st.NATRules == 0 {
		t.Errorf("rule counts = %v, want %v (from LastSync, nat non-zero)", got, want)
	}
}

func TestPendingChanges(t *testing.T) {
	newEngine := func(fam v1.IPFamily) *proxier.Engine {
		e, err := proxier.NewEngine(proxier.EngineOptions{Family: fam, NodeName: "node-a", Backend: nopBackend{}, SyncPeriod: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	v4, v6 := newEngine(v1.IPv4Protocol), newEngine(v1.IPv6Protocol)
	meta := proxier.NewMetaProxier(v4, v6)
	dualStack := func(s *v1.Service) {
		s.Spec.ClusterIPs = append(s.Spec.ClusterIPs, "fd00::10")
		s.Spec.IPFamilies = []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol}
	}
	meta.OnServiceAdd(pt.Service("web", "10.96.0.10", dualStack))
	meta.OnServiceAdd(pt.Service("db6", "fd00::11", pt.IPv6()))
	meta.OnEndpointSliceAdd(pt.Slice("web", 8080, pt.EP{IP: "10.244.1.5", Node: "node-b"}))
	meta.OnEndpointSliceAdd(pt.Slice("web", 8080, pt.EP{IP: "fd00:10:244::5", Node: "node-b"}))
	if s4, _ := v4.PendingChanges(); s4.Len() != 1 {
		t.Fatalf("IPv4 engine tracks %v, want the dual-stack service only", s4)
	}
	services, endpoints := pendingChanges([]*proxier.Engine{v4, v6})
	// A service counts once even when both families track it.
	if services != 2 || endpoints != 1 {
		t.Errorf("pending = %d services, %d endpoints; want 2 and 1", services, endpoints)
	}
}

type nopBackend struct{}

func (nopBackend) Sync(context.Context, *proxy.NodeState, bool) (proxy.BackendResult, error) {
	return proxy.BackendResult{}, nil
}
func (nopBackend) Cleanup(context.Context) error { return nil }
