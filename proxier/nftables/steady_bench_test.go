package nftables

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/netnstest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// BenchmarkNFTablesChangeSteady measures one-endpoint changes in a steady
// state: b.N partial syncs in a row through the real nft session of a
// namespace, at each shape of KPROXY_BENCH_SHAPES, nothing else writing to
// the table between them (BenchmarkNFTablesSync replays every change
// through "nft -f" between its 20 samples, which makes the session's nft
// reload its cache for the next one). It reports the CPU per change of
// this process (kproxy: the engine, the backend and the Go runtime that
// runs them, RUSAGE_SELF) and of nft (the session's, from
// /proc/<pid>/schedstat, and any nft run meanwhile), kproxy's share of
// their sum, and this process's context switches per change.
//
//	KPROXY_BENCH_SHAPES="1000x10 10000x10" go test -run '^$' -bench NFTablesChangeSteady -benchtime 1000x ./proxier/nftables/
func BenchmarkNFTablesChangeSteady(b *testing.B) {
	requireBenchNFT(b)
	for _, s := range pt.BenchShapes() {
		b.Run("shape="+s.String(), func(b *testing.B) {
			ns := netnstest.New(b, "nftst")
			real, err := newNSNFT(b, ns, v1.IPv4Protocol)
			if err != nil {
				b.Fatal(err)
			}
			n := &benchNFT{nsNFT: real}
			svcs, sls := pt.ShapedWorkload(s)
			be, e := startBench(b, real, svcs, sls)
			if err := e.SyncRules(context.Background()); err != nil {
				b.Fatal(err)
			}
			runtime.GC()
			// The first change starts the session.
			changeEndpoint(b, be, e, sls, 0)
			switches := contextSwitches()
			nftBefore := n.sessionCPU() + rusage(b, syscall.RUSAGE_CHILDREN)
			self := rusage(b, syscall.RUSAGE_SELF)
			i := 1
			for b.Loop() {
				changeEndpoint(b, be, e, sls, i)
				i++
			}
			self = rusage(b, syscall.RUSAGE_SELF) - self
			nftCPU := n.sessionCPU() + rusage(b, syscall.RUSAGE_CHILDREN) - nftBefore
			changes := float64(i - 1)
			b.ReportMetric(ms(self)/changes, "kproxy-cpu-ms/change")
			b.ReportMetric(ms(nftCPU)/changes, "nft-cpu-ms/change")
			b.ReportMetric(100*float64(self)/float64(self+nftCPU), "kproxy-cpu-%")
			b.ReportMetric(float64(contextSwitches()-switches)/changes, "ctxsw/change")
		})
	}
}

// contextSwitches is the number of context switches of the process's
// threads so far (voluntary and not).
func contextSwitches() int {
	var n int
	tasks, _ := filepath.Glob("/proc/self/task/*/status")
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		for l := range strings.SplitSeq(string(b), "\n") {
			for _, k := range []string{"voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"} {
				if v, ok := strings.CutPrefix(l, k); ok {
					c, _ := strconv.Atoi(strings.TrimSpace(v))
					n += c
				}
			}
		}
	}
	return n
}
