package proxier_test

import (
	"context"
	"os"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// changedOnlyBackend is a Backend that does what a partial sync must cost a
// backend at least, and no more: it visits the changed services' states.
type changedOnlyBackend struct{ visited int }

func (b *changedOnlyBackend) Sync(_ context.Context, state *proxy.NodeState, full bool) (proxy.BackendResult, error) {
	if full {
		b.visited += len(state.Services)
		return proxy.BackendResult{}, nil
	}
	b.visited += state.Changed.Len()
	return proxy.BackendResult{}, nil
}

func (b *changedOnlyBackend) Cleanup(context.Context) error { return nil }

// BenchmarkEnginePartialSync measures the engine and the model alone (the
// backend visits only the changed services) over a one-endpoint change per
// sync, at growing numbers of services: a partial sync's cost must not grow
// with them. Shapes: KPROXY_BENCH_SHAPES, else 1000x10, 10000x10 and
// 45000x1.
//
//	go test -run '^$' -bench EnginePartialSync -benchmem ./proxier/
func BenchmarkEnginePartialSync(b *testing.B) {
	shapes := []pt.WorkloadShape{{Services: 1000, Endpoints: 10}, {Services: 10000, Endpoints: 10}, {Services: 45000, Endpoints: 1}}
	if _, ok := os.LookupEnv("KPROXY_BENCH_SHAPES"); ok {
		shapes = pt.BenchShapes()
	}
	for _, s := range shapes {
		b.Run("shape="+s.String(), func(b *testing.B) {
			svcs, sls := pt.ShapedWorkload(s)
			be := &changedOnlyBackend{}
			e, err := proxier.NewEngine(proxier.EngineOptions{
				Family: v1.IPv4Protocol, NodeName: "node-0", Backend: be,
				MinSyncPeriod: time.Second, SyncPeriod: time.Minute,
				Clock: testingclock.NewFakeClock(time.Unix(1_700_000_000, 0)), Logger: klog.Background(),
			})
			if err != nil {
				b.Fatal(err)
			}
			for i := range svcs {
				e.OnServiceAdd(svcs[i])
				e.OnEndpointSliceAdd(sls[i])
			}
			e.OnServiceSynced()
			e.OnEndpointSlicesSynced()
			ctx := context.Background()
			if err := e.SyncRules(ctx); err != nil {
				b.Fatal(err)
			}
			i := 0
			b.ReportAllocs()
			for b.Loop() {
				e.OnEndpointSliceUpdate(pt.ReplaceEndpoint(sls, i))
				i++
				if err := e.SyncRules(ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
