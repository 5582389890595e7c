package proxiertest

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/kproxy/kproxy/proxier"
)

// NewClock returns a fake clock at the instant the tests start from.
func NewClock() *testingclock.FakeClock {
	return testingclock.NewFakeClock(time.Unix(1_700_000_000, 0))
}

// DefaultEnv is the node of the behaviour cases by default: IPv4 node-a
// with the node IP 10.0.0.1 and the cluster CIDR 10.244.0.0/16.
func DefaultEnv() Env {
	c := Case{}
	return c.env()
}

// EngineOptions configures NewEngine.
type EngineOptions struct {
	// Env gives the engine its family, node name, masquerade-all, cluster
	// CIDR and node IP (the first of NodeIPs; unknown when there is none).
	Env Env
	// Clock defaults to NewClock().
	Clock clock.WithTicker
	// OnSync is passed on to the engine.
	OnSync func(proxier.SyncResult)
	// Logger is passed on to the engine (zero: klog).
	Logger klog.Logger
	// Nodes, Services and Slices are added, in that order, before the
	// service and EndpointSlice caches are marked synced.
	Nodes    []*v1.Node
	Services []*v1.Service
	Slices   []*discovery.EndpointSlice
}

// NewEngine builds a real engine over backend as the tests run it: syncs at
// least a second and at most 30s apart, the objects of opts added and the
// service and EndpointSlice caches marked synced. It syncs nothing.
func NewEngine(tb testing.TB, backend proxier.Backend, opts EngineOptions) *proxier.Engine {
	tb.Helper()
	env := opts.Env
	var nodeIP netip.Addr
	if len(env.NodeIPs) > 0 {
		nodeIP = env.NodeIPs[0]
	}
	clk := opts.Clock
	if clk == nil {
		clk = NewClock()
	}
	e, err := proxier.NewEngine(proxier.EngineOptions{
		Family: env.Family, NodeName: env.NodeName, Backend: backend,
		MasqueradeAll: env.MasqueradeAll, ClusterCIDR: env.ClusterCIDR, NodeIP: nodeIP,
		MinSyncPeriod: time.Second, SyncPeriod: 30 * time.Second,
		Clock: clk, OnSync: opts.OnSync, Logger: opts.Logger,
	})
	if err != nil {
		tb.Fatalf("NewEngine: %v", err)
	}
	for _, n := range opts.Nodes {
		e.OnNodeAdd(n)
	}
	for _, s := range opts.Services {
		e.OnServiceAdd(s)
	}
	for _, s := range opts.Slices {
		e.OnEndpointSliceAdd(s)
	}
	e.OnServiceSynced()
	e.OnEndpointSlicesSynced()
	return e
}

// Sync runs one sync of e and fails tb when it fails.
func Sync(tb testing.TB, e *proxier.Engine) {
	tb.Helper()
	if err := e.SyncRules(context.Background()); err != nil {
		tb.Fatalf("sync: %v", err)
	}
}

// TimedSync is Sync, timed.
func TimedSync(tb testing.TB, e *proxier.Engine) time.Duration {
	tb.Helper()
	start := time.Now()
	Sync(tb, e)
	return time.Since(start)
}

// NumberedService is service i of the sync tests ("s0000" on): ClusterIP
// 10.96.x.y, port 80 and a node port 30000+i, one endpoint on node-b at
// 10.244.(2+x).y:8080.
func NumberedService(i int) (*v1.Service, *discovery.EndpointSlice) {
	name := fmt.Sprintf("s%04d", i)
	return Service(name, fmt.Sprintf("10.96.%d.%d", i/250, i%250+1), NodePort(int32(30000+i))),
		Slice(name, 8080, EP{IP: fmt.Sprintf("10.244.%d.%d", 2+i/250, i%250+1), Node: "node-b"})
}

// AddNumberedServices adds services 0 to n-1 (NumberedService) to e.
func AddNumberedServices(e *proxier.Engine, n int) {
	for i := 0; i < n; i++ {
		s, sl := NumberedService(i)
		e.OnServiceAdd(s)
		e.OnEndpointSliceAdd(sl)
	}
}
