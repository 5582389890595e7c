package app

import (
	"errors"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/proxier"
)

func TestSetGCDefaults(t *testing.T) {
	for _, tc := range []struct {
		name      string
		env       map[string]string
		wantTuner bool
		want      int
	}{
		{name: "nothing set: the start-up target", wantTuner: true, want: StartupGCPercent},
		{name: "GOGC set: left alone", env: map[string]string{"GOGC": "200"}, want: 123},
		{name: "GOGC=off set: left alone", env: map[string]string{"GOGC": "off"}, want: 123},
		{name: "GOMEMLIMIT set: left alone", env: map[string]string{"GOMEMLIMIT": "100MiB"}, want: 123},
	} {
		t.Run(tc.name, func(t *testing.T) {
			percent := 123 // as the runtime would have read the environment
			g := setGCDefaults(klog.Background(), func(k string) (string, bool) {
				v, ok := tc.env[k]
				return v, ok
			}, func(p int) int { old := percent; percent = p; return old })
			if (g != nil) != tc.wantTuner {
				t.Errorf("tuner %v, want one: %v", g, tc.wantTuner)
			}
			if percent != tc.want {
				t.Errorf("GC percent %d, want %d", percent, tc.want)
			}
			// A nil tuner takes syncs and does nothing.
			g.await(sets.New(v1.IPv4Protocol))
			g.synced(proxier.SyncResult{Family: v1.IPv4Protocol})
			if g == nil && percent != tc.want {
				t.Errorf("a nil tuner changed the GC percent to %d", percent)
			}
		})
	}
}

func TestGCTunerAfterFirstSyncs(t *testing.T) {
	ok := func(f v1.IPFamily) proxier.SyncResult { return proxier.SyncResult{Family: f} }
	failed := func(f v1.IPFamily) proxier.SyncResult {
		return proxier.SyncResult{Family: f, Err: errors.New("nft: no")}
	}
	v4, v6 := v1.IPv4Protocol, v1.IPv6Protocol
	for _, tc := range []struct {
		name     string
		families []v1.IPFamily
		before   []proxier.SyncResult // results before await
		after    []proxier.SyncResult
		want     int
	}{
		{name: "one family synced", families: []v1.IPFamily{v4}, after: []proxier.SyncResult{ok(v4)}, want: DefaultGCPercent},
		{name: "not synced yet", families: []v1.IPFamily{v4}, want: StartupGCPercent},
		{name: "only failed syncs", families: []v1.IPFamily{v4}, after: []proxier.SyncResult{failed(v4), failed(v4)}, want: StartupGCPercent},
		{name: "failed then synced", families: []v1.IPFamily{v4}, after: []proxier.SyncResult{failed(v4), ok(v4)}, want: DefaultGCPercent},
		{name: "dual-stack: one family synced", families: []v1.IPFamily{v4, v6}, after: []proxier.SyncResult{ok(v4), ok(v4)}, want: StartupGCPercent},
		{name: "dual-stack: both synced", families: []v1.IPFamily{v4, v6}, after: []proxier.SyncResult{ok(v6), failed(v4), ok(v4)}, want: DefaultGCPercent},
		{name: "a sync before await does not count", families: []v1.IPFamily{v4}, before: []proxier.SyncResult{ok(v4)}, want: StartupGCPercent},
		{name: "no engines: steady at once", families: nil, want: DefaultGCPercent},
	} {
		t.Run(tc.name, func(t *testing.T) {
			percent, calls := 100, 0
			g := setGCDefaults(klog.Background(), func(string) (string, bool) { return "", false },
				func(p int) int { old := percent; percent = p; calls++; return old })
			for _, r := range tc.before {
				g.synced(r)
			}
			g.await(sets.New(tc.families...))
			for _, r := range tc.after {
				g.synced(r)
			}
			if percent != tc.want {
				t.Errorf("GC percent %d, want %d", percent, tc.want)
			}
			// Later syncs never touch the collector again.
			steady, before := percent == DefaultGCPercent, calls
			g.synced(ok(v4))
			g.synced(ok(v6))
			if steady && calls != before {
				t.Errorf("%d more SetGCPercent calls after the steady target", calls-before)
			}
		})
	}
}
