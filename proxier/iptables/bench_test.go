package iptables

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	testingclock "k8s.io/utils/clock/testing"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// The standard workloads (docs/design.md, "Testing"): N services with 10 endpoints each
// (one in ten also a NodePort), programmed through the real engine into the
// real iptables-restore inside a throwaway network namespace.
//
//	make bench                      # 1,000 and 10,000 services
//	KPROXY_BENCH_SERVICES=1000 go test -run '^$' -bench Sync -benchtime 1x ./proxier/iptables/

type benchRig struct {
	engine  *proxier.Engine
	backend *Backend
	clock   *testingclock.FakeClock
}

func newBenchRig(tb testing.TB, iface ipt.Interface, svcs []*v1.Service, slices []*discovery.EndpointSlice) *benchRig {
	clk := pt.NewClock()
	b, err := New(Options{
		IPTables:       iface,
		LocalAddresses: func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("10.0.0.1")}, nil },
	})
	if err != nil {
		tb.Fatal(err)
	}
	env := pt.DefaultEnv()
	env.NodeName, env.NodeIPs = "node-0", nil
	e := pt.NewEngine(tb, b, pt.EngineOptions{Env: env, Clock: clk, Services: svcs, Slices: slices})
	return &benchRig{engine: e, backend: b, clock: clk}
}

// resetPeakRSS starts a new peak resident memory measurement (Linux resets
// VmHWM when "5" is written to clear_refs).
func resetPeakRSS(tb testing.TB) {
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		tb.Logf("cannot reset the peak RSS: %v", err)
	}
}

func peakRSSMiB() float64 {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "VmHWM:") {
			f := strings.Fields(line)
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}

// BenchmarkSync measures, per size: the full sync from empty, the first
// sync after a restart over existing rules, a one-endpoint partial sync,
// rules generated, the rules a first packet walks to the last service, and
// memory.
func BenchmarkSync(b *testing.B) {
	netnstest.RequireRoot(b)
	for _, n := range pt.BenchSizes() {
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				benchOnce(b, n)
			}
		})
	}
}

func benchOnce(b *testing.B, n int) {
	ctx := context.Background()
	ns := netnstest.New(b, "bench")
	iface, err := ipt.New(ctx, ipt.Options{Protocol: ipt.ProtocolIPv4, NetNS: ns.Name})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := iface.(*ipt.Real).Close(); err != nil {
			b.Error(err)
		}
	})
	svcs, slices := pt.Workload(n)

	runtime.GC()
	rig := newBenchRig(b, iface, svcs, slices)
	full := pt.TimedSync(b, rig.engine)
	st := rig.backend.LastSync()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heapMiB := float64(ms.HeapInuse) / (1 << 20)

	// Restart: a new kproxy over the rules the old one left.
	restart := newBenchRig(b, iface, svcs, slices)
	restartDur := pt.TimedSync(b, restart.engine)

	// One endpoint changes in one service, five times.
	var partials, partialRestores []time.Duration
	for k := 0; k < 5; k++ {
		sl := slices[n-1-k].DeepCopy()
		sl.Endpoints[0].Addresses = []string{fmt.Sprintf("10.250.0.%d", k+1)}
		restart.engine.OnEndpointSliceUpdate(slices[n-1-k], sl)
		partials = append(partials, pt.TimedSync(b, restart.engine))
		partialRestores = append(partialRestores, restart.backend.LastSync().RestoreTime)
	}
	sort.Slice(partialRestores, func(i, j int) bool { return partialRestores[i] < partialRestores[j] })
	sort.Slice(partials, func(i, j int) bool { return partials[i] < partials[j] })
	partialSt := restart.backend.LastSync()

	// Rules walked: the same state in the fake, traced to every service; the
	// worst case is reported (upstream walks one rule per service before
	// reaching the last one).
	fake := iptablestest.NewFake(ipt.ProtocolIPv4)
	frig := newBenchRig(b, fake, svcs, slices)
	pt.TimedSync(b, frig.engine)
	maxWalk := 0
	for i := 0; i < n; i += max(1, n/200) {
		outs, err := fake.Trace(iptablestest.Packet{Source: netip.MustParseAddr("10.244.1.9"), Destination: netip.MustParseAddr(svcs[i].Spec.ClusterIP),
			Protocol: "tcp", SourcePort: 1, DestinationPort: 80}, iptablestest.TraceOptions{LocalAddrs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}})
		if err != nil {
			b.Fatal(err)
		}
		for _, o := range outs {
			maxWalk = max(maxWalk, natWalk(o))
		}
	}

	b.ReportMetric(full.Seconds(), "full-sync-s")
	b.ReportMetric(restartDur.Seconds(), "restart-sync-s")
	b.ReportMetric(float64(partials[len(partials)/2].Microseconds())/1000, "partial-sync-ms")
	b.ReportMetric(float64(st.NATRules+st.FilterRules), "rules")
	b.ReportMetric(float64(st.Restores), "full-restores")
	b.ReportMetric(float64(partialSt.ChainsWritten), "partial-chains")
	b.ReportMetric(float64(partialRestores[len(partialRestores)/2].Microseconds())/1000, "partial-restore-ms")
	b.ReportMetric(float64(maxWalk), "max-dispatch-walk")
	b.ReportMetric(heapMiB, "heap-MiB")
	b.ReportMetric(peakRSSMiB(), "peak-rss-MiB")
	b.Logf("n=%d full=%v restart=%v partial(median of 5)=%v rules nat=%d filter=%d restores=%d maxwalk=%d heap=%.0fMiB peakRSS=%.0fMiB",
		n, full, restartDur, partials[len(partials)/2], st.NATRules, st.FilterRules, st.Restores, maxWalk, heapMiB, peakRSSMiB())
}

// natWalk counts the nat PREROUTING rules an outcome evaluated up to its DNAT:
// the dispatch walk.
func natWalk(o iptablestest.Outcome) int {
	return o.RulesEvaluated
}

// BenchmarkPartialSyncCPU measures kproxy's own work in a one-endpoint
// partial sync (the engine and rendering, with the fake iptables), without
// iptables-restore.
func BenchmarkPartialSyncCPU(b *testing.B) {
	for _, n := range pt.BenchSizes() {
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
			svcs, slices := pt.Workload(n)
			rig := newBenchRig(b, iptablestest.NewFake(ipt.ProtocolIPv4), svcs, slices)
			pt.TimedSync(b, rig.engine)
			prev := slices[n-1]
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				sl := prev.DeepCopy()
				sl.Endpoints[0].Addresses = []string{fmt.Sprintf("10.250.%d.%d", (i>>8)&0xff, i&0xff)}
				rig.engine.OnEndpointSliceUpdate(prev, sl)
				prev = sl
				pt.TimedSync(b, rig.engine)
			}
		})
	}
}

// BenchmarkMemory reports the peak resident memory of one kproxy engine
// doing the first full sync at each size, with the Service and EndpointSlice
// objects held as kproxy's informer caches would hold them, its live heap
// after that sync, and the peak of the periodic full resync that follows
// (over the rules the first one wrote, as after a restart). Run it in its
// own process (make bench does), since the peak is process-wide.
func BenchmarkMemory(b *testing.B) {
	netnstest.RequireRoot(b)
	sizes := pt.BenchSizes()
	n := sizes[len(sizes)-1]
	b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			ns := netnstest.New(b, "mem")
			iface, err := ipt.New(context.Background(), ipt.Options{Protocol: ipt.ProtocolIPv4, NetNS: ns.Name})
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() {
				if err := iface.(*ipt.Real).Close(); err != nil {
					b.Error(err)
				}
			})
			svcs, slices := pt.Workload(n)
			rig := newBenchRig(b, iface, svcs, slices)
			pt.TimedSync(b, rig.engine)
			firstPeak := peakRSSMiB()
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			live := float64(ms.HeapInuse) / (1 << 20)

			resetPeakRSS(b)
			rig.clock.Step(proxier.DefaultFullSyncPeriod)
			pt.TimedSync(b, rig.engine)
			if !rig.backend.LastSync().Full {
				b.Fatal("the resync was not full")
			}
			b.ReportMetric(firstPeak, "peak-rss-MiB")
			b.ReportMetric(live, "live-heap-MiB")
			b.ReportMetric(peakRSSMiB(), "resync-peak-rss-MiB")
			b.Logf("n=%d peakRSS=%.0fMiB liveHeap=%.0fMiB resyncPeakRSS=%.0fMiB", n, firstPeak, live, peakRSSMiB())
			// The engine and the objects are what a running kproxy holds.
			runtime.KeepAlive(rig)
			runtime.KeepAlive(svcs)
			runtime.KeepAlive(slices)
		}
	})
}

// cpuTime is the CPU time, user and system, of this process and of its
// children that ended.
func cpuTime() time.Duration {
	var total time.Duration
	for _, who := range []int{syscall.RUSAGE_SELF, syscall.RUSAGE_CHILDREN} {
		var ru syscall.Rusage
		if err := syscall.Getrusage(who, &ru); err == nil {
			total += time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		}
	}
	return total
}

// BenchmarkFlushCheck measures, per size and iptables backend, the flush
// check a partial sync makes at most every half canary interval (every
// chain's use count read, docs/design.md "Flush detection"), its wall and
// CPU time, next to a one-endpoint partial sync, over the rules of the
// standard workload in the real kernel.
//
//	KPROXY_BENCH_SERVICES=10000 go test -run '^$' -bench FlushCheck -benchtime 1x ./proxier/iptables/
func BenchmarkFlushCheck(b *testing.B) {
	netnstest.RequireRoot(b)
	for _, n := range pt.BenchSizes() {
		for _, variant := range []string{"nft", "legacy"} {
			b.Run(fmt.Sprintf("services=%d/%s", n, variant), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					benchFlushCheck(b, n, variant)
				}
			})
		}
	}
}

func benchFlushCheck(b *testing.B, n int, variant string) {
	ctx := context.Background()
	ns := netnstest.New(b, "flush")
	iface, err := ipt.New(ctx, ipt.Options{Protocol: ipt.ProtocolIPv4, NetNS: ns.Name, Variant: variant})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := iface.(*ipt.Real).Close(); err != nil {
			b.Error(err)
		}
	})
	svcs, slices := pt.Workload(n)
	rig := newBenchRig(b, iface, svcs, slices)
	full := pt.TimedSync(b, rig.engine)
	median := func(d []time.Duration) time.Duration {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return d[len(d)/2]
	}
	var checks, checkCPUs, partials []time.Duration
	for k := 0; k < 5; k++ {
		start, cpu0 := time.Now(), cpuTime()
		damaged, err := rig.backend.flushed(ctx)
		checks = append(checks, time.Since(start))
		checkCPUs = append(checkCPUs, cpuTime()-cpu0)
		if err != nil || len(damaged) > 0 {
			b.Fatalf("flush check: %v, %v", damaged, err)
		}
		sl := slices[n-1-k].DeepCopy()
		sl.Endpoints[0].Addresses = []string{fmt.Sprintf("10.250.0.%d", k+1)}
		rig.engine.OnEndpointSliceUpdate(slices[n-1-k], sl)
		partials = append(partials, pt.TimedSync(b, rig.engine))
	}
	// The check of the netns wrapper's own cost: one iptables run that
	// reads nothing.
	start := time.Now()
	if _, err := ns.Exec(ctx, "iptables-"+variant, "--version"); err != nil {
		b.Fatal(err)
	}
	exec := time.Since(start)
	b.ReportMetric(float64(median(checks).Microseconds())/1000, "check-ms")
	b.ReportMetric(float64(median(checkCPUs).Microseconds())/1000, "check-cpu-ms")
	b.ReportMetric(float64(median(partials).Microseconds())/1000, "partial-sync-ms")
	b.ReportMetric(full.Seconds(), "full-sync-s")
	b.Logf("n=%d %s: flush check (median of 5) %v, CPU %v (kproxy and its children), one-endpoint partial sync %v, full sync %v; one `ip netns exec iptables --version` %v",
		n, variant, median(checks), median(checkCPUs), median(partials), full, exec)
}
