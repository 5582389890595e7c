package nftables

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	clocktesting "k8s.io/utils/clock/testing"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// sinkNFT is a knftables.Interface that, like the real one (execNFT),
// renders each transaction's text (here kept until the next one, a little
// more than execNFT, which streams it to nft) and otherwise remembers only the names of
// the table's objects and the elements of sync-state, so that the heap it
// leaves is about what the real interface leaves (the kernel holds the
// elements, not kproxy).
type sinkNFT struct {
	noRuleListing
	exists    bool
	chains    map[string]bool
	sets      map[string]bool
	isMap     map[string]bool
	syncState map[string]*knftables.Element
	// buf is the last transaction's text.
	buf string
}

func newSinkNFT() *sinkNFT {
	return &sinkNFT{chains: map[string]bool{}, sets: map[string]bool{}, isMap: map[string]bool{}, syncState: map[string]*knftables.Element{}}
}

func (m *sinkNFT) NewTransaction() *knftables.Transaction {
	return knftables.NewFake(knftables.IPv4Family, TableName).NewTransaction()
}

func (m *sinkNFT) Check(context.Context, *knftables.Transaction) error { return nil }

func (m *sinkNFT) Run(_ context.Context, tx *knftables.Transaction) error {
	m.buf = ""
	m.buf = tx.String()
	text := m.buf
	for len(text) > 0 {
		line, rest, _ := strings.Cut(text, "\n")
		text = rest
		// "verb kind family table name rest", split without allocating.
		var f [6]string
		for i := range 5 {
			f[i], line, _ = strings.Cut(line, " ")
		}
		f[5] = line
		verb, kind, name := f[0], f[1], f[4]
		if kind == "element" && name != setSyncState {
			continue
		}
		switch kind + " " + verb {
		case "table add":
			m.exists = true
		case "table delete":
			*m = *newSinkNFT()
		case "chain add":
			m.chains[name] = true
		case "chain delete":
			delete(m.chains, name)
		case "set add", "map add":
			m.sets[name] = true
			m.isMap[name] = kind == "map"
		case "set delete", "map delete":
			delete(m.sets, name)
		case "set flush":
			if name == setSyncState {
				clear(m.syncState)
			}
		case "element add", "element delete":
			body := strings.TrimSuffix(strings.TrimPrefix(f[5], "{ "), " }")
			e := &knftables.Element{Set: name}
			if i := strings.Index(body, ` comment "`); i >= 0 {
				j := strings.Index(body[i+10:], `"`)
				c := body[i+10 : i+10+j]
				e.Comment = &c
				body = body[:i]
			}
			e.Key = strings.Split(body, " . ")
			if verb == "add" {
				m.syncState[body] = e
			} else {
				delete(m.syncState, body)
			}
		}
	}
	return nil
}

func (m *sinkNFT) ListAll(context.Context) (map[string][]string, error) {
	return listAll(m.exists, m.chains, m.sets, m.isMap)
}

func (m *sinkNFT) ListElements(_ context.Context, _ string, name string) ([]*knftables.Element, error) {
	if name != setSyncState {
		return nil, fmt.Errorf("sinkNFT lists only %s, not %s", setSyncState, name)
	}
	var out []*knftables.Element
	for _, e := range m.syncState {
		out = append(out, e)
	}
	return out, nil
}

// heapSampler records the peak of the heap's object bytes (live and not
// yet swept garbage: what the process's heap pages hold) and of the live
// heap the collector marked.
type heapSampler struct {
	stop             chan struct{}
	done             sync.WaitGroup
	mu               sync.Mutex
	peakHeap, peakGC uint64
}

func startHeapSampler() *heapSampler {
	s := &heapSampler{stop: make(chan struct{})}
	s.done.Add(1)
	go func() {
		defer s.done.Done()
		samples := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/gc/heap/live:bytes"}}
		t := time.NewTicker(200 * time.Microsecond)
		defer t.Stop()
		for {
			metrics.Read(samples)
			s.mu.Lock()
			s.peakHeap = max(s.peakHeap, samples[0].Value.Uint64())
			s.peakGC = max(s.peakGC, samples[1].Value.Uint64())
			s.mu.Unlock()
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	}()
	return s
}

// finish stops the sampler and returns its peaks in MiB.
func (s *heapSampler) finish() (heap, gcLive float64) {
	close(s.stop)
	s.done.Wait()
	return float64(s.peakHeap) / (1 << 20), float64(s.peakGC) / (1 << 20)
}

func liveHeapMiB() float64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapAlloc) / (1 << 20)
}

// BenchmarkFullSyncMemory measures the heap of the first full sync of
// proxiertest.Workload(10,000, or the largest size of
// KPROXY_BENCH_SERVICES) through the engine into the backend, over sinkNFT, with the
// Service and EndpointSlice objects held as informers would hold them and
// GOGC=40 as the command sets it; then of the periodic full resync that
// follows. Reported: the heap before the first sync (objects and engine
// fed), its peak during the sync (sampled object bytes, garbage included)
// and the peak live heap the collector marked, the live heap after it, the
// bytes the sync allocated, and the resync's peak. Run it alone
// (-benchtime 1x): the peaks are process-wide.
func BenchmarkFullSyncMemory(b *testing.B) {
	n := 10000
	if os.Getenv("KPROXY_BENCH_SERVICES") != "" {
		sizes := pt.BenchSizes()
		n = sizes[len(sizes)-1]
	}
	b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
		defer debug.SetGCPercent(debug.SetGCPercent(40))
		env := pt.Env{NodeName: "node-a", NodeIPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")},
			ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), Family: v1.IPv4Protocol}
		for b.Loop() {
			services, slices := pt.Workload(n)
			nft := newSinkNFT()
			be, err := New(Options{NFTables: nft, Family: v1.IPv4Protocol, LocalAddresses: func() ([]netip.Addr, error) { return env.NodeIPs, nil }})
			if err != nil {
				b.Fatal(err)
			}
			clk := clocktesting.NewFakeClock(time.Now())
			e := newEngine(b, env, be, clk)
			for i := range services {
				e.OnServiceAdd(services[i])
				e.OnEndpointSliceAdd(slices[i])
			}
			e.OnServiceSynced()
			e.OnEndpointSlicesSynced()
			before := liveHeapMiB()
			var ms0, ms1 runtime.MemStats
			runtime.ReadMemStats(&ms0)
			s := startHeapSampler()
			if err := e.SyncRules(context.Background()); err != nil {
				b.Fatal(err)
			}
			peak, peakLive := s.finish()
			runtime.ReadMemStats(&ms1)
			if st := be.LastSync(); st.Mode != modeReconcile || st.ElementsAdded < n*pt.WorkloadEndpoints {
				b.Fatalf("first sync: %+v", st)
			}
			after := liveHeapMiB()
			if path := os.Getenv("KPROXY_MEM_HEAPPROFILE"); path != "" {
				// The live heap after the first sync (go tool pprof
				// -sample_index=inuse_space).
				f, err := os.Create(path)
				if err != nil {
					b.Fatal(err)
				}
				if err := pprof.WriteHeapProfile(f); err != nil {
					b.Fatal(err)
				}
				f.Close()
			}

			s = startHeapSampler()
			clk.Step(proxier.DefaultFullSyncPeriod)
			if err := e.SyncRules(context.Background()); err != nil {
				b.Fatal(err)
			}
			resyncPeak, _ := s.finish()
			if st := be.LastSync(); !st.Full || st.Operations != 0 {
				b.Fatalf("resync: %+v", st)
			}
			alloc := float64(ms1.TotalAlloc-ms0.TotalAlloc) / (1 << 20)
			b.ReportMetric(before, "before-MiB")
			b.ReportMetric(peak, "peak-heap-MiB")
			b.ReportMetric(peakLive, "peak-live-MiB")
			b.ReportMetric(after, "after-MiB")
			b.ReportMetric(alloc, "alloc-MiB")
			b.ReportMetric(resyncPeak, "resync-peak-heap-MiB")
			b.Logf("n=%d before=%.1fMiB peakHeap=%.1fMiB peakLive=%.1fMiB after=%.1fMiB alloc=%.1fMiB resyncPeak=%.1fMiB textBytes=%d",
				n, before, peak, peakLive, after, alloc, resyncPeak, len(nft.buf))
			runtime.KeepAlive(e)
			runtime.KeepAlive(services)
			runtime.KeepAlive(slices)
		}
	})
}

// TestEndpointRenderings checks that the allocation-free renderings of a
// destination's endpoint slots (hashEndpoints, endpointObjects) match the
// elements bigElems lists: the hash a table's dispatch comments carry and
// the digest must not change with the way they are computed.
func TestEndpointRenderings(t *testing.T) {
	eps := func(s ...string) []netip.AddrPort {
		var out []netip.AddrPort
		for _, a := range s {
			out = append(out, netip.MustParseAddrPort(a))
		}
		return out
	}
	for _, tc := range []struct {
		name string
		dr   destRender
	}{
		{name: "cluster IP, cluster and local slots", dr: destRender{key: destKey{addr: netip.MustParseAddr("10.96.0.1"), proto: "tcp", port: 80},
			eps: [2][]netip.AddrPort{eps("10.244.1.1:8080", "10.244.2.2:8080"), eps("10.244.2.2:8080")}}},
		{name: "node port", dr: destRender{key: destKey{nodePort: true, proto: "udp", port: 30053},
			eps: [2][]netip.AddrPort{eps("10.244.1.1:53", "10.244.2.2:5353", "10.244.3.3:53")}}},
		{name: "IPv6", dr: destRender{key: destKey{addr: netip.MustParseAddr("fd00::1"), proto: "sctp", port: 9},
			eps: [2][]netip.AddrPort{nil, eps("[fd00:10::1]:9000")}}},
		{name: "no endpoints", dr: destRender{key: destKey{addr: netip.MustParseAddr("10.96.0.2"), proto: "tcp", port: 443}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			big := tc.dr.bigElems()
			h := fnvAdd(fnvOffset, "svc-shape\n")
			var digest uint64
			for i := range big {
				h = fnvAdd(h, big[i].id()+big[i].val()+"\n")
				digest ^= elemDigest(&big[i])
			}
			gotHash, gotDigest := tc.dr.hashEndpoints("svc-shape")
			if want := fmt.Sprintf("%016x", h); gotHash != want || gotDigest != digest {
				t.Errorf("hashEndpoints = %s, %x; want %s, %x", gotHash, gotDigest, want, digest)
			}
			var strs stringCache
			objs := tc.dr.endpointObjects(&strs)
			if len(objs) != len(big) {
				t.Fatalf("%d objects, want %d", len(objs), len(big))
			}
			for i := range objs {
				want := big[i].object(true)
				if got := &objs[i]; got.Map != want.Map || !slices.Equal(got.Key, want.Key) || !slices.Equal(got.Value, want.Value) || got.Comment != nil {
					t.Errorf("object %d = %+v, want %+v", i, got, want)
				}
			}
		})
	}
}
