package e2e

import (
	"maps"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
)

// The suite's own helpers; these run without a cluster (and without root).

func TestPercentile(t *testing.T) {
	runsOnce(t)
	ms := func(ns ...int) []time.Duration {
		var out []time.Duration
		for _, n := range ns {
			out = append(out, time.Duration(n)*time.Millisecond)
		}
		return out
	}
	var fifty []time.Duration
	for i := 1; i <= 50; i++ {
		fifty = append(fifty, time.Duration(i)*time.Millisecond)
	}
	cases := []struct {
		name   string
		sorted []time.Duration
		p      float64
		want   time.Duration
	}{
		{"empty", nil, 50, 0},
		{"one sample", ms(7), 99, 7 * time.Millisecond},
		{"median of four is the second", ms(1, 2, 3, 4), 50, 2 * time.Millisecond},
		{"p99 of fifty is the largest", fifty, 99, 50 * time.Millisecond},
		{"p50 of fifty is the 25th", fifty, 50, 25 * time.Millisecond},
		{"p0 is the smallest", ms(3, 5), 0, 3 * time.Millisecond},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := percentile(tc.sorted, tc.p); got != tc.want {
				t.Errorf("percentile(%v, %v) = %v, want %v", tc.sorted, tc.p, got, tc.want)
			}
		})
	}
}

func TestParseReply(t *testing.T) {
	runsOnce(t)
	cases := []struct {
		name    string
		in      string
		want    reply
		wantErr bool
	}{
		{"pod and client", "web-1 10.244.1.5:40000", reply{Pod: "web-1", Source: netip.MustParseAddr("10.244.1.5")}, false},
		{"IPv6 client", "web-2 [fd00::5]:80", reply{Pod: "web-2", Source: netip.MustParseAddr("fd00::5")}, false},
		{"no address", "web-1", reply{}, true},
		{"bad address", "web-1 nowhere", reply{}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseReply(tc.in)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("parseReply(%q) = %+v, %v; want %+v, error %v", tc.in, got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestNamespaceName(t *testing.T) {
	runsOnce(t)
	label := regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	cases := []struct {
		name, test, prefix string
	}{
		{"plain", "TestClusterIP", "e2e-clusterip-"},
		{"subtest", "TestLoadBalancer/ranges_with_the_client", "e2e-loadbalancer-ranges-with-the-client-"},
		{"long", "Test" + strings.Repeat("Long", 30), "e2e-" + strings.Repeat("long", 10) + "-"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := namespaceName(tc.test)
			if !strings.HasPrefix(got, tc.prefix) || len(got) > 63 || !label.MatchString(got) {
				t.Errorf("namespaceName(%q) = %q, want a DNS label starting %q", tc.test, got, tc.prefix)
			}
			if again := namespaceName(tc.test); again == got {
				t.Errorf("namespaceName(%q) twice gave %q both times", tc.test, got)
			}
		})
	}
}

func TestExpectCheck(t *testing.T) {
	runsOnce(t)
	s := samples{replies: []reply{
		{Pod: "a", Source: netip.MustParseAddr("10.0.0.1")},
		{Pod: "b", Source: netip.MustParseAddr("10.0.0.1")},
		{Pod: "a", Source: netip.MustParseAddr("10.0.0.2")},
	}}
	cases := []struct {
		name string
		x    expect
		// wantErr is a substring of the expected error; empty: no error.
		wantErr string
	}{
		{"nothing asked", expect{}, ""},
		{"all seen", expect{all: []string{"a", "b"}}, ""},
		{"one missing", expect{all: []string{"a", "c"}}, "no reply from c"},
		{"only allowed", expect{only: []string{"a", "b"}}, ""},
		{"one not allowed", expect{only: []string{"a"}}, "reply from b"},
		{"sources allowed", expect{sources: []string{"10.0.0.1", "10.0.0.2"}}, ""},
		{"a source not allowed", expect{sources: []string{"10.0.0.1"}}, "saw source 10.0.0.2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.x.check(s)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Errorf("check = %v, want nil", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("check = %v, want an error with %q", err, tc.wantErr)
			}
		})
	}
}

func TestChildArgs(t *testing.T) {
	runsOnce(t)
	args := []string{"-test.v=true", "-test.timeout=30m0s"}
	cases := []struct {
		name             string
		timeout, elapsed time.Duration
		want             []string
		wantErr          bool
	}{
		{"no timeout", 0, time.Minute, args, false},
		{"timeout shortened", 30 * time.Minute, 90 * time.Second, append(slices.Clone(args), "-test.timeout=28m0s"), false},
		{"no time left", time.Minute, 45 * time.Second, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := childArgs(args, tc.timeout, tc.elapsed)
			if (err != nil) != tc.wantErr || !slices.Equal(got, tc.want) {
				t.Errorf("childArgs = %q, %v; want %q, error %v", got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestMetricValue(t *testing.T) {
	runsOnce(t)
	const exposition = `# HELP kubeproxy_sync_proxy_rules_last_timestamp_seconds The last time proxy rules were successfully synced
# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge
kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.7e+09
kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv6"} 1.6e+09
kubeproxy_sync_proxy_rules_endpoint_changes_total 42
kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.001"} 3
kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 17 1700000000000
kproxy_build_info{mode="iptables",version="v1 \"dev\", x"} 1
`
	cases := []struct {
		name      string
		metric    string
		labels    map[string]string
		want      float64
		wantFound bool
		wantErr   bool
	}{
		{name: "labelled", metric: "kubeproxy_sync_proxy_rules_last_timestamp_seconds", labels: map[string]string{"ip_family": "IPv6"}, want: 1.6e9, wantFound: true},
		{name: "no labels", metric: "kubeproxy_sync_proxy_rules_endpoint_changes_total", want: 42, wantFound: true},
		{name: "with a timestamp", metric: "kubeproxy_sync_proxy_rules_duration_seconds_count", labels: map[string]string{"ip_family": "IPv4"}, want: 17, wantFound: true},
		{name: "escaped label value", metric: "kproxy_build_info", labels: map[string]string{"version": `v1 "dev", x`}, want: 1, wantFound: true},
		{name: "a prefix of a name is not the name", metric: "kubeproxy_sync_proxy_rules_duration_seconds"},
		{name: "no sample with the labels", metric: "kubeproxy_sync_proxy_rules_last_timestamp_seconds", labels: map[string]string{"ip_family": "IPv5"}},
		{name: "more than one match", metric: "kubeproxy_sync_proxy_rules_last_timestamp_seconds", wantErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, found, err := metricValue(exposition, tc.metric, tc.labels)
			if (err != nil) != tc.wantErr || found != tc.wantFound || got != tc.want {
				t.Errorf("metricValue(%s, %v) = %v, %v, %v; want %v, %v, error %v", tc.metric, tc.labels, got, found, err, tc.want, tc.wantFound, tc.wantErr)
			}
		})
	}
}

func TestParseProxyHealth(t *testing.T) {
	runsOnce(t)
	cases := []struct {
		name         string
		body         string
		wantEligible *bool
		wantErr      bool
	}{
		{name: "healthz", body: `{"lastUpdated":"2026-01-02T03:04:05Z","currentTime":"2026-01-02T03:04:05Z","nodeEligible":false,"healthy":true}`, wantEligible: new(false)},
		{name: "livez", body: `{"lastUpdated":"2026-01-02T03:04:00Z","currentTime":"2026-01-02T03:04:05Z","healthy":false}`},
		{name: "no lastUpdated", body: `{"currentTime":"2026-01-02T03:04:05Z"}`, wantErr: true},
		{name: "no currentTime", body: `{"lastUpdated":"2026-01-02T03:04:05Z"}`, wantErr: true},
		{name: "updated in the future", body: `{"lastUpdated":"2026-01-02T03:04:06Z","currentTime":"2026-01-02T03:04:05Z"}`, wantErr: true},
		{name: "not JSON", body: `ok`, wantErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseProxyHealth([]byte(tc.body))
			if (err != nil) != tc.wantErr {
				t.Fatalf("parseProxyHealth(%s) error %v, want error %v", tc.body, err, tc.wantErr)
			}
			if err == nil && (got.NodeEligible == nil) != (tc.wantEligible == nil) ||
				got.NodeEligible != nil && tc.wantEligible != nil && *got.NodeEligible != *tc.wantEligible {
				t.Errorf("parseProxyHealth(%s).NodeEligible = %v, want %v", tc.body, got.NodeEligible, tc.wantEligible)
			}
		})
	}
}

func TestParseServiceHealth(t *testing.T) {
	runsOnce(t)
	cases := []struct {
		name      string
		body      string
		wantCount int
		wantErr   bool
	}{
		{name: "with endpoints", body: `{"service":{"namespace":"ns","name":"web"},"localEndpoints":2,"serviceProxyHealthy":true}`, wantCount: 2},
		{name: "without", body: `{"service":{"namespace":"ns","name":"web"},"localEndpoints":0}`},
		{name: "no count", body: `{"service":{"namespace":"ns","name":"web"}}`, wantErr: true},
		{name: "no service name", body: `{"service":{"namespace":"ns"},"localEndpoints":1}`, wantErr: true},
		{name: "not JSON", body: `health check closed`, wantErr: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseServiceHealth([]byte(tc.body))
			if (err != nil) != tc.wantErr || got.LocalEndpoints != tc.wantCount {
				t.Errorf("parseServiceHealth(%s) = %+v, %v; want localEndpoints %d, error %v", tc.body, got, err, tc.wantCount, tc.wantErr)
			}
		})
	}
}

func TestKproxyLogSynced(t *testing.T) {
	runsOnce(t)
	const earlier = `I1 "Starting kproxy" node="node-1"` + "\n" + `I2 "Synced" full=true` + "\n"
	cases := []struct {
		name    string
		log     string
		offset  int64
		wantErr bool
	}{
		{name: "started and synced", log: earlier},
		{name: "only an earlier run synced", log: earlier + `I3 "Starting kproxy"` + "\n", offset: int64(len(earlier)), wantErr: true},
		{name: "not started", log: earlier, offset: int64(len(earlier)), wantErr: true},
		{name: "a sync before the start does not count", log: `I2 "Synced"` + "\n" + `I3 "Starting kproxy"` + "\n", wantErr: true},
		{name: "a replaced log is read from the start", log: earlier, offset: 1 << 20},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := kproxyLogSynced([]byte(tc.log), tc.offset); (err != nil) != tc.wantErr {
				t.Errorf("kproxyLogSynced = %v, want error %v", err, tc.wantErr)
			}
		})
	}
}

func TestEventCounts(t *testing.T) {
	runsOnce(t)
	ev := func(host string, count int32) v1.Event {
		return v1.Event{Source: v1.EventSource{Component: "kproxy", Host: host}, Count: count}
	}
	got := eventCounts([]v1.Event{ev("node-1", 1), ev("node-2", 3), ev("node-1", 0), ev("node-3", 1)})
	if want := map[string]int{"node-1": 2, "node-2": 3, "node-3": 1}; !maps.Equal(got, want) {
		t.Errorf("eventCounts = %v, want %v", got, want)
	}
}
