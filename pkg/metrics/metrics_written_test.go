package metrics

import (
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/proxy"
)

func TestIPTablesLastIsRulesWritten(t *testing.T) {
	for _, tc := range []struct {
		name     string
		result   proxy.SyncResult
		wantLast string
	}{
		{
			name: "backend reports rules written",
			result: proxy.SyncResult{Family: v1.IPv4Protocol,
				RuleCounts: map[string]int{"nat": 1000, "filter": 10}, RulesWritten: map[string]int{"nat": 12, "filter": 0}},
			wantLast: `kubeproxy_sync_proxy_rules_iptables_last{ip_family="IPv4",table="nat"} 12`,
		},
		{
			name:     "backend reports only rules owned",
			result:   proxy.SyncResult{Family: v1.IPv4Protocol, RuleCounts: map[string]int{"nat": 1000, "filter": 10}},
			wantLast: `kubeproxy_sync_proxy_rules_iptables_last{ip_family="IPv4",table="nat"} 1000`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.m.SyncDone(tc.result)
			text := e.exposition(t, "kubeproxy_sync_proxy_rules_iptables_last") + e.exposition(t, "kubeproxy_sync_proxy_rules_iptables_total")
			if !strings.Contains(text, tc.wantLast) {
				t.Errorf("metrics lack %q:\n%s", tc.wantLast, grepLines(text, "iptables_"))
			}
			if !strings.Contains(text, `kubeproxy_sync_proxy_rules_iptables_total{ip_family="IPv4",table="nat"} 1000`) {
				t.Errorf("iptables_total is not the rules owned:\n%s", grepLines(text, "iptables_"))
			}
		})
	}
}

func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) && !strings.HasPrefix(l, "#") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
