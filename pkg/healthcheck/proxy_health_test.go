package healthcheck

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2/ktesting"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/config"
)

var _ config.NodeHandler = (*ProxyHealthServer)(nil)

const (
	thisNode = "node-a"
	timeout  = time.Minute // 2 x a 30s sync period
)

var epoch = time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)

// probeCounts is a ProbeRecorder that keeps the answers it is told of.
type probeCounts struct {
	mu      sync.Mutex
	healthz map[int]int
	livez   map[int]int
}

func newProbeCounts() *probeCounts {
	return &probeCounts{healthz: map[int]int{}, livez: map[int]int{}}
}

func (p *probeCounts) HealthzResponded(code int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.healthz[code]++
}

func (p *probeCounts) LivezResponded(code int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.livez[code]++
}

func node(name string, edit func(*v1.Node)) *v1.Node {
	n := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
	if edit != nil {
		edit(n)
	}
	return n
}

func deleting(n *v1.Node) {
	ts := metav1.NewTime(epoch)
	n.DeletionTimestamp = &ts
}

func toBeDeleted(n *v1.Node) {
	n.Spec.Taints = append(n.Spec.Taints, v1.Taint{Key: ToBeDeletedTaint, Effect: v1.TaintEffectNoSchedule})
}

func otherTaint(n *v1.Node) {
	n.Spec.Taints = append(n.Spec.Taints, v1.Taint{Key: "node.kubernetes.io/unschedulable", Effect: v1.TaintEffectNoSchedule})
}

// healthEnv is a ProxyHealthServer on a fake clock.
type healthEnv struct {
	clock  *testingclock.FakeClock
	hs     *ProxyHealthServer
	probes *probeCounts
}

func newHealthEnv(t *testing.T) *healthEnv {
	t.Helper()
	env := &healthEnv{clock: testingclock.NewFakeClock(epoch), probes: newProbeCounts()}
	hs, err := NewProxyHealthServer(ProxyHealthOptions{HealthTimeout: timeout, NodeName: thisNode, Clock: env.clock, Recorder: env.probes})
	if err != nil {
		t.Fatal(err)
	}
	env.hs = hs
	return env
}

// get requests path from the handler and returns the code and the decoded
// body.
func (env *healthEnv) get(t *testing.T, path string) (int, map[string]any) {
	t.Helper()
	rec := httptest.NewRecorder()
	env.hs.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s: Content-Type %q, want application/json", path, ct)
	}
	var body map[string]any
	if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil {
		t.Fatalf("%s: body %q is not JSON: %v", path, rec.Body.String(), err)
	}
	return rec.Code, body
}

func TestProxyHealth(t *testing.T) {
	type want struct{ healthz, livez int }
	ok, unavailable := http.StatusOK, http.StatusServiceUnavailable
	v4, v6 := v1.IPv4Protocol, v1.IPv6Protocol
	for _, tc := range []struct {
		name  string
		steps func(env *healthEnv)
		want  want
		// wantFamilies is the healthy flag of each family in "status".
		wantFamilies map[v1.IPFamily]bool
		wantEligible bool
	}{
		{
			name: "fresh start", steps: func(*healthEnv) {},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{}, wantEligible: true,
		},
		{
			name: "queued update not yet late",
			steps: func(env *healthEnv) {
				env.hs.QueuedUpdate(v4)
				env.clock.Step(timeout - time.Second)
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{v4: true}, wantEligible: true,
		},
		{
			name: "queued update not synced within the timeout",
			steps: func(env *healthEnv) {
				env.hs.QueuedUpdate(v4)
				env.clock.Step(timeout)
			},
			want: want{unavailable, unavailable}, wantFamilies: map[v1.IPFamily]bool{v4: false}, wantEligible: true,
		},
		{
			name: "a successful sync clears it",
			steps: func(env *healthEnv) {
				env.hs.QueuedUpdate(v4)
				env.clock.Step(timeout)
				env.hs.Updated(v4, env.clock.Now())
				env.clock.Step(timeout)
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{v4: true}, wantEligible: true,
		},
		{
			name: "a sync that started before the update does not clear it",
			steps: func(env *healthEnv) {
				start := env.clock.Now()
				env.clock.Step(time.Second)
				env.hs.QueuedUpdate(v4)
				env.hs.Updated(v4, start)
				env.clock.Step(timeout)
			},
			want: want{unavailable, unavailable}, wantFamilies: map[v1.IPFamily]bool{v4: false}, wantEligible: true,
		},
		{
			name: "later updates keep the oldest queued time",
			steps: func(env *healthEnv) {
				env.hs.QueuedUpdate(v4)
				env.clock.Step(timeout / 2)
				env.hs.QueuedUpdate(v4)
				env.clock.Step(timeout / 2)
			},
			want: want{unavailable, unavailable}, wantFamilies: map[v1.IPFamily]bool{v4: false}, wantEligible: true,
		},
		{
			name: "dual-stack: one late family makes the proxy unhealthy",
			steps: func(env *healthEnv) {
				env.hs.QueuedUpdate(v4)
				env.hs.QueuedUpdate(v6)
				env.clock.Step(time.Second)
				env.hs.Updated(v4, env.clock.Now())
				env.clock.Step(timeout)
			},
			want: want{unavailable, unavailable}, wantFamilies: map[v1.IPFamily]bool{v4: true, v6: false}, wantEligible: true,
		},
		{
			name: "dual-stack: both synced",
			steps: func(env *healthEnv) {
				env.hs.QueuedUpdate(v4)
				env.hs.QueuedUpdate(v6)
				env.hs.Updated(v4, env.clock.Now())
				env.hs.Updated(v6, env.clock.Now())
				env.clock.Step(2 * timeout)
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{v4: true, v6: true}, wantEligible: true,
		},
		{
			name: "sync loop idle but running: healthy",
			steps: func(env *healthEnv) {
				env.hs.SyncLoopRan(v4)
				for range 10 {
					env.clock.Step(timeout / 2)
					env.hs.SyncLoopRan(v4)
				}
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{v4: true}, wantEligible: true,
		},
		{
			name: "sync loop stuck just under the timeout: healthy",
			steps: func(env *healthEnv) {
				env.hs.SyncLoopRan(v4)
				env.clock.Step(timeout - time.Second)
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{v4: true}, wantEligible: true,
		},
		{
			name: "sync loop stuck with nothing queued",
			steps: func(env *healthEnv) {
				env.hs.Updated(v4, env.clock.Now())
				env.hs.SyncLoopRan(v4)
				env.clock.Step(timeout)
			},
			want: want{unavailable, unavailable}, wantFamilies: map[v1.IPFamily]bool{v4: false}, wantEligible: true,
		},
		{
			name: "sync loop running again after being stuck",
			steps: func(env *healthEnv) {
				env.hs.SyncLoopRan(v4)
				env.clock.Step(2 * timeout)
				env.hs.SyncLoopRan(v4)
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{v4: true}, wantEligible: true,
		},
		{
			name: "dual-stack: one stuck loop makes the proxy unhealthy",
			steps: func(env *healthEnv) {
				env.hs.SyncLoopRan(v4)
				env.hs.SyncLoopRan(v6)
				env.clock.Step(timeout)
				env.hs.SyncLoopRan(v4)
			},
			want: want{unavailable, unavailable}, wantFamilies: map[v1.IPFamily]bool{v4: true, v6: false}, wantEligible: true,
		},
		{
			name:  "node being deleted",
			steps: func(env *healthEnv) { env.hs.OnNodeAdd(node(thisNode, deleting)) },
			want:  want{unavailable, ok}, wantFamilies: map[v1.IPFamily]bool{}, wantEligible: false,
		},
		{
			name:  "node tainted ToBeDeletedByClusterAutoscaler",
			steps: func(env *healthEnv) { env.hs.OnNodeUpdate(node(thisNode, nil), node(thisNode, toBeDeleted)) },
			want:  want{unavailable, ok}, wantFamilies: map[v1.IPFamily]bool{}, wantEligible: false,
		},
		{
			name: "taint removed",
			steps: func(env *healthEnv) {
				env.hs.OnNodeAdd(node(thisNode, toBeDeleted))
				env.hs.OnNodeUpdate(node(thisNode, toBeDeleted), node(thisNode, otherTaint))
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{}, wantEligible: true,
		},
		{
			name: "node deleted",
			steps: func(env *healthEnv) {
				env.hs.OnNodeAdd(node(thisNode, nil))
				env.hs.OnNodeDelete(node(thisNode, nil))
			},
			want: want{unavailable, ok}, wantFamilies: map[v1.IPFamily]bool{}, wantEligible: false,
		},
		{
			name: "other nodes do not matter",
			steps: func(env *healthEnv) {
				env.hs.OnNodeAdd(node("node-b", deleting))
				env.hs.OnNodeAdd(node("node-c", toBeDeleted))
				env.hs.OnNodeDelete(node("node-d", nil))
			},
			want: want{ok, ok}, wantFamilies: map[v1.IPFamily]bool{}, wantEligible: true,
		},
		{
			name: "late update and node being deleted",
			steps: func(env *healthEnv) {
				env.hs.OnNodeAdd(node(thisNode, deleting))
				env.hs.QueuedUpdate(v4)
				env.clock.Step(timeout)
			},
			want: want{unavailable, unavailable}, wantFamilies: map[v1.IPFamily]bool{v4: false}, wantEligible: false,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := newHealthEnv(t)
			tc.steps(env)
			now := env.clock.Now()

			healthzCode, healthz := env.get(t, "/healthz")
			if healthzCode != tc.want.healthz {
				t.Errorf("/healthz = %d, want %d (body %v)", healthzCode, tc.want.healthz, healthz)
			}
			livezCode, livez := env.get(t, "/livez")
			if livezCode != tc.want.livez {
				t.Errorf("/livez = %d, want %d (body %v)", livezCode, tc.want.livez, livez)
			}

			if got, ok := healthz["nodeEligible"].(bool); !ok || got != tc.wantEligible {
				t.Errorf("/healthz nodeEligible = %v, want %v", healthz["nodeEligible"], tc.wantEligible)
			}
			if _, ok := livez["nodeEligible"]; ok {
				t.Errorf("/livez has nodeEligible: %v", livez)
			}
			for path, body := range map[string]map[string]any{"/healthz": healthz, "/livez": livez} {
				if got := parseTime(t, body["currentTime"]); !got.Equal(now) {
					t.Errorf("%s currentTime = %v, want %v", path, got, now)
				}
				healthy := true
				for _, h := range tc.wantFamilies {
					healthy = healthy && h
				}
				if body["healthy"] != healthy {
					t.Errorf("%s healthy = %v, want %v", path, body["healthy"], healthy)
				}
				status, _ := body["status"].(map[string]any)
				if len(status) != len(tc.wantFamilies) {
					t.Errorf("%s status = %v, want families %v", path, status, tc.wantFamilies)
				}
				for f, want := range tc.wantFamilies {
					st, _ := status[string(f)].(map[string]any)
					if st["healthy"] != want {
						t.Errorf("%s status[%s] = %v, want healthy %v", path, f, st, want)
					}
				}
			}
			// A healthy answer says "updated now", as kube-proxy's does.
			if healthzCode == ok {
				if got := parseTime(t, healthz["lastUpdated"]); !got.Equal(now) {
					t.Errorf("healthy /healthz lastUpdated = %v, want the current time %v", got, now)
				}
			}

			env.probes.mu.Lock()
			defer env.probes.mu.Unlock()
			if env.probes.healthz[healthzCode] != 1 || len(env.probes.healthz) != 1 {
				t.Errorf("recorded /healthz answers %v, want one %d", env.probes.healthz, healthzCode)
			}
			if env.probes.livez[livezCode] != 1 || len(env.probes.livez) != 1 {
				t.Errorf("recorded /livez answers %v, want one %d", env.probes.livez, livezCode)
			}
		})
	}
}

func parseTime(t *testing.T, v any) time.Time {
	t.Helper()
	s, ok := v.(string)
	if !ok {
		t.Fatalf("time field %v is not a string", v)
	}
	ts, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		t.Fatalf("time field %q: %v", s, err)
	}
	return ts
}

// TestProxyHealthServe serves on a real loopback listener and stops with
// the context.
func TestProxyHealthServe(t *testing.T) {
	env := newHealthEnv(t)
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	done := make(chan error, 1)
	go func() { done <- env.hs.Serve(ctx, ln) }()

	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	for _, tc := range []struct {
		path string
		want int
	}{
		{path: "/healthz", want: http.StatusOK},
		{path: "/livez", want: http.StatusOK},
		{path: "/metrics", want: http.StatusNotFound},
	} {
		resp, err := client.Get("http://" + addr + tc.path)
		if err != nil {
			t.Fatalf("GET %s: %v", tc.path, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("GET %s = %d, want %d", tc.path, resp.StatusCode, tc.want)
		}
	}

	cancel()
	if err := <-done; err != nil {
		t.Errorf("Serve returned %v after the context ended, want nil", err)
	}
	if conn, err := net.Dial("tcp", addr); err == nil {
		_ = conn.Close()
		t.Errorf("%s still accepts connections after Serve returned", addr)
	}
}

func TestProxyHealthRunBadAddress(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	hs, err := NewProxyHealthServer(ProxyHealthOptions{BindAddress: "127.0.0.1:" + strconv.Itoa(70000), HealthTimeout: timeout, NodeName: thisNode})
	if err != nil {
		t.Fatal(err)
	}
	if err := hs.Run(ctx); err == nil {
		t.Error("Run on port 70000 succeeded")
	}
}

func TestNewProxyHealthServerValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts ProxyHealthOptions
	}{
		{name: "no timeout", opts: ProxyHealthOptions{NodeName: thisNode}},
		{name: "negative timeout", opts: ProxyHealthOptions{NodeName: thisNode, HealthTimeout: -time.Second}},
		{name: "no node name", opts: ProxyHealthOptions{HealthTimeout: timeout}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewProxyHealthServer(tc.opts); err == nil {
				t.Errorf("NewProxyHealthServer(%+v) succeeded", tc.opts)
			}
		})
	}
}
