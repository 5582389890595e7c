package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

const (
	// latencyChanges is how many changes TestNetworkProgrammingLatency
	// measures, alternating between its two kinds, when it writes its
	// summary ($KPC_LATENCY_OUT: make bench).
	latencyChanges = 50
	// latencySmokeChanges is how many it makes otherwise: every change
	// must still work, in every mode, without two minutes per round.
	latencySmokeChanges = 10
	// latencyPoll is how often a new probe starts.
	latencyPoll = 10 * time.Millisecond
	// latencyProbeTimeout bounds one probe; probes overlap, so a probe
	// whose SYN went nowhere does not hide a later one that succeeds.
	latencyProbeTimeout = time.Second
	// latencyLimit is the sanity bound of one change.
	latencyLimit = 30 * time.Second
	// latencySettle spaces the changes beyond kproxy's default
	// --iptables-min-sync-period (1 s), so each is measured from an idle
	// kproxy rather than behind the previous change's rate limit.
	latencySettle = 1100 * time.Millisecond
)

// Kinds of measured change.
const (
	changeService  = "new-service"
	changeEndpoint = "new-endpoint"
)

// latencySummary is what KPC_LATENCY_OUT receives.
type latencySummary struct {
	Mode    string                 `json:"mode"`
	Changes int                    `json:"changes"`
	P50ms   float64                `json:"p50_ms"`
	P99ms   float64                `json:"p99_ms"`
	MinMs   float64                `json:"min_ms"`
	MaxMs   float64                `json:"max_ms"`
	ByKind  map[string]kindSummary `json:"by_kind"`
	Samples map[string][]float64   `json:"samples_ms"`
	Notes   map[string]string      `json:"notes"`
}

type kindSummary struct {
	Changes int     `json:"changes"`
	P50ms   float64 `json:"p50_ms"`
	P99ms   float64 `json:"p99_ms"`
	MaxMs   float64 `json:"max_ms"`
}

// percentile is the nearest-rank p-th percentile of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	return sorted[min(max(rank, 1), len(sorted))-1]
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/float64(time.Microsecond)) / 1000 }

// TestNetworkProgrammingLatency measures the time from an API change to
// the first request kproxy carries because of it, over latencyChanges
// (latencySmokeChanges unless $KPC_LATENCY_OUT asks for the numbers)
// changes of two kinds, alternately: a new Service for pods already
// running, and a Deployment scaled from 0 to 1 behind an existing Service
// (which includes starting the pod). It reports p50 and p99 and writes them
// as JSON to $KPC_LATENCY_OUT when set (a file per mode when the run has
// several: latencyOutPath). It asserts no timing, only that every change
// works within latencyLimit.
func TestNetworkProgrammingLatency(t *testing.T) { inMode(t, testNetworkProgrammingLatency) }

func testNetworkProgrammingLatency(t *testing.T) {
	e := newEnv(t)
	out := os.Getenv("KPC_LATENCY_OUT")
	changes := latencySmokeChanges
	if out != "" {
		changes = latencyChanges
	}
	e.deploy(workload{name: "web", replicas: 2})
	from, _ := e.clientPod("client", nodeName(2))
	// One Deployment at 0 replicas, behind its own Service, per endpoint
	// change: none waits for another's pod to go away.
	var scaled []string
	for i := 1; i < changes; i += 2 {
		name := fmt.Sprintf("scaled-%d", i)
		e.deploy(workload{name: name, replicas: 0})
		svc := e.createService(name, map[string]string{"app": name})
		scaled = append(scaled, hostPort(svc.Spec.ClusterIP, servicePort))
	}

	byKind := map[string][]time.Duration{}
	for i := range changes {
		var kind, addr string
		var began time.Time
		if i%2 == 0 {
			kind = changeService
			time.Sleep(latencySettle)
			began = time.Now()
			svc := e.createService(fmt.Sprintf("svc-%d", i), map[string]string{"app": "web"})
			addr = hostPort(svc.Spec.ClusterIP, servicePort)
		} else {
			kind, addr = changeEndpoint, scaled[i/2]
			// Rejected: kproxy has the Service, without endpoints.
			e.eventually("Service "+addr+" rejecting before its scale-up", programTimeout, func() error {
				_, err := e.request(from, "tcp", addr, requestTimeout)
				if !errors.Is(err, netnstest.ErrRefused) {
					return fmt.Errorf("want a refusal, got %v", err)
				}
				return nil
			})
			time.Sleep(latencySettle)
			began = time.Now()
			e.scale(fmt.Sprintf("scaled-%d", i), 1)
		}
		took, err := e.firstSuccess(from, addr, began)
		if err != nil {
			e.fatalf("change %d (%s): %v", i+1, kind, err)
		}
		byKind[kind] = append(byKind[kind], took)
		t.Logf("change %2d %-12s %s", i+1, kind, took.Round(100*time.Microsecond))
	}

	sum := summarize(byKind)
	sum.Mode = e.c.Mode()
	t.Logf("%s mode: network programming latency over %d changes: p50 %.1f ms, p99 %.1f ms (min %.1f, max %.1f)",
		sum.Mode, sum.Changes, sum.P50ms, sum.P99ms, sum.MinMs, sum.MaxMs)
	for _, kind := range []string{changeService, changeEndpoint} {
		k := sum.ByKind[kind]
		t.Logf("  %-12s %2d changes: p50 %.1f ms, p99 %.1f ms, max %.1f ms", kind, k.Changes, k.P50ms, k.P99ms, k.MaxMs)
	}
	if out != "" {
		out = latencyOutPath(out, sum.Mode, thisRound.modes)
		data, err := json.MarshalIndent(sum, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(out, append(data, '\n'), 0o644); err != nil {
			t.Fatalf("writing %s: %v", out, err)
		}
		t.Logf("wrote %s", out)
	}
}

// summarize computes the percentiles, overall and per kind.
func summarize(byKind map[string][]time.Duration) latencySummary {
	sum := latencySummary{
		ByKind:  map[string]kindSummary{},
		Samples: map[string][]float64{},
		Notes: map[string]string{
			changeService:  "Service created for running pods -> first request through its ClusterIP",
			changeEndpoint: "Deployment scaled 0 -> 1 behind a Service -> first request reaching the new pod (includes pod start-up)",
			"method":       fmt.Sprintf("a probe from a pod every %s from the API call on; changes spaced by %s", latencyPoll, latencySettle),
		},
	}
	var all []time.Duration
	for kind, ds := range byKind {
		sorted := slices.Sorted(slices.Values(ds))
		all = append(all, ds...)
		sum.ByKind[kind] = kindSummary{
			Changes: len(ds), P50ms: ms(percentile(sorted, 50)), P99ms: ms(percentile(sorted, 99)), MaxMs: ms(sorted[len(sorted)-1]),
		}
		for _, d := range ds {
			sum.Samples[kind] = append(sum.Samples[kind], ms(d))
		}
	}
	slices.Sort(all)
	sum.Changes = len(all)
	if len(all) > 0 {
		sum.P50ms, sum.P99ms = ms(percentile(all, 50)), ms(percentile(all, 99))
		sum.MinMs, sum.MaxMs = ms(all[0]), ms(all[len(all)-1])
	}
	return sum
}

// firstSuccess starts a probe (one TCP request from inside from's
// namespace) every latencyPoll and returns the time from began to the end
// of the first probe that got a reply.
func (e *env) firstSuccess(from, addr string, began time.Time) (time.Duration, error) {
	ns, err := e.netnsOf(from)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(e.ctx, latencyLimit)
	var wg sync.WaitGroup
	defer func() {
		cancel()
		wg.Wait()
	}()
	success := make(chan time.Time, 1)
	var lastErr atomic.Pointer[error]
	tick := time.NewTicker(latencyPoll)
	defer tick.Stop()
	for {
		wg.Go(func() {
			pctx, pcancel := context.WithTimeout(ctx, latencyProbeTimeout)
			defer pcancel()
			if _, err := netnstest.Request(pctx, ns, "tcp", addr); err != nil {
				lastErr.Store(&err)
				return
			}
			select {
			case success <- time.Now():
			default:
			}
		})
		select {
		case at := <-success:
			return at.Sub(began), nil
		case <-ctx.Done():
			last := "none"
			if p := lastErr.Load(); p != nil {
				last = (*p).Error()
			}
			return 0, fmt.Errorf("no request through %s within %s of the change; last error: %s", addr, latencyLimit, last)
		case <-tick.C:
		}
	}
}
