package metrics

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/proxy"
)

func newModeEnv(t *testing.T, mode string) *env {
	t.Helper()
	e := &env{clock: testingclock.NewFakeClock(epoch), pending: &pendingState{}}
	m, err := New(Options{Mode: mode, Version: "v1.2.3", Clock: e.clock, PendingChanges: e.pending.get})
	if err != nil {
		t.Fatal(err)
	}
	e.m = m
	return e
}

// TestNFTablesMetrics checks kube-proxy's nftables counters: a failed sync
// counts as an nftables sync failure in nftables mode only, a failed
// nftables cleanup in any mode, and nftables mode counts no iptables rules.
func TestNFTablesMetrics(t *testing.T) {
	type sample struct {
		name   string
		labels map[string]string
		want   float64
	}
	failed := func(family v1.IPFamily, full bool) proxy.SyncResult {
		return proxy.SyncResult{Family: family, Full: full, Duration: time.Millisecond, Err: errors.New("nft: exit status 1")}
	}
	ok := proxy.SyncResult{Family: v4, Full: true, Duration: time.Millisecond, RuleCounts: map[string]int{"nat": 3}}
	for _, tc := range []struct {
		name   string
		mode   string
		run    func(m *Metrics)
		want   []sample
		absent []sample
	}{
		{
			name: "nftables mode: failed syncs are nftables sync failures",
			mode: "nftables",
			run: func(m *Metrics) {
				m.SyncDone(failed(v4, true))
				m.SyncDone(failed(v4, false))
				m.SyncDone(failed(v6, false))
			},
			want: []sample{
				{"kubeproxy_sync_proxy_rules_nftables_sync_failures_total", fam(v4), 2},
				{"kubeproxy_sync_proxy_rules_nftables_sync_failures_total", fam(v6), 1},
				{"kubeproxy_sync_proxy_rules_duration_seconds", fam(v4), 2},
			},
			absent: []sample{
				{name: "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", labels: fam(v4)},
				{name: "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total", labels: fam(v4)},
				{name: "kubeproxy_sync_proxy_rules_last_timestamp_seconds", labels: fam(v4)},
			},
		},
		{
			name: "nftables mode: a successful sync counts no iptables rules",
			mode: "nftables",
			run:  func(m *Metrics) { m.SyncDone(ok) },
			want: []sample{
				{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", fam(v4), float64(epoch.Unix())},
				{"kubeproxy_sync_full_proxy_rules_duration_seconds", fam(v4), 1},
			},
			absent: []sample{
				{name: "kubeproxy_sync_proxy_rules_iptables_total", labels: map[string]string{"table": "nat", "ip_family": "IPv4"}},
				{name: "kubeproxy_sync_proxy_rules_iptables_last", labels: map[string]string{"table": "nat", "ip_family": "IPv4"}},
				{name: "kubeproxy_sync_proxy_rules_nftables_sync_failures_total", labels: fam(v4)},
			},
		},
		{
			name: "nftables mode: cleanup failures",
			mode: "nftables",
			run: func(m *Metrics) {
				m.NFTablesCleanupFailed(v6)
				m.NFTablesCleanupFailed(v6)
			},
			want:   []sample{{"kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total", fam(v6), 2}},
			absent: []sample{{name: "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total", labels: fam(v4)}},
		},
		{
			name: "iptables mode: failed syncs are restore failures only",
			mode: "iptables",
			run:  func(m *Metrics) { m.SyncDone(failed(v4, true)) },
			want: []sample{{"kubeproxy_sync_proxy_rules_iptables_restore_failures_total", fam(v4), 1}},
			absent: []sample{
				{name: "kubeproxy_sync_proxy_rules_nftables_sync_failures_total", labels: fam(v4)},
			},
		},
		{
			name: "ipvs mode: a failed removal of kproxy's nftables table counts",
			mode: "ipvs",
			run:  func(m *Metrics) { m.NFTablesCleanupFailed(v4) },
			want: []sample{{"kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total", fam(v4), 1}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newModeEnv(t, tc.mode)
			tc.run(e.m)
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

// TestNFTablesHelpTexts pins the nftables counters' help texts to
// kube-proxy's.
func TestNFTablesHelpTexts(t *testing.T) {
	e := newModeEnv(t, "nftables")
	e.m.SyncDone(proxy.SyncResult{Family: v4, Err: errors.New("failed")})
	e.m.NFTablesCleanupFailed(v4)
	for name, help := range map[string]string{
		"kubeproxy_sync_proxy_rules_nftables_sync_failures_total":    "Cumulative proxy nftables sync failures",
		"kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total": "Cumulative proxy nftables cleanup failures",
	} {
		mf := e.family(t, name)
		if mf == nil {
			t.Errorf("%s is not exported", name)
			continue
		}
		if mf.GetHelp() != help {
			t.Errorf("%s help = %q, want %q", name, mf.GetHelp(), help)
		}
	}
}

// TestProxyModeAnswersTheMode checks /proxyMode and the build info in
// every mode.
func TestProxyModeAnswersTheMode(t *testing.T) {
	for _, mode := range []string{"iptables", "ipvs", "nftables"} {
		t.Run(mode, func(t *testing.T) {
			e := newModeEnv(t, mode)
			rec := httptest.NewRecorder()
			e.m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/proxyMode", nil))
			if rec.Code != http.StatusOK || rec.Body.String() != mode {
				t.Errorf("GET /proxyMode = %d %q, want 200 %q", rec.Code, rec.Body.String(), mode)
			}
			if got := e.value(t, "kproxy_build_info", map[string]string{"version": "v1.2.3", "mode": mode}); got != 1 {
				t.Errorf("kproxy_build_info{mode=%q} = %v, want 1", mode, got)
			}
		})
	}
}
