package ipvs

import (
	"context"
	"fmt"
	"net/netip"
	"runtime"
	"sort"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// The standard workloads (docs/design.md, "Testing") (N services with 10 endpoints each,
// one in ten also a NodePort), programmed through the real engine into the
// real IPVS, ipsets, dummy device and iptables of a throwaway network
// namespace inside the VM (the host kernel has no IPVS):
//
//	make bench
//	KPROXY_BENCH_SERVICES="1000 10000" go test -exec "$PWD/hack/ipvs-vm.sh" -run '^$' -bench IPVSSync -benchtime 1x ./proxier/ipvs/

type benchKernel struct {
	ipvs *ipvs.Real
	nl   *netlink.Real
	sets *ipset.Real
	ipt  ipt.Interface
	ns   string
}

func newBenchKernel(b *testing.B) *benchKernel {
	ns := netnstest.New(b, "ipvsbench")
	// A node address for the node ports.
	netnstest.Link(b, ns, netip.MustParsePrefix("10.0.0.1/24"), ns, netip.Prefix{})
	k := &benchKernel{ns: ns.Name}
	var err error
	if k.ipvs, err = ipvs.New(ipvs.Options{NetNS: ns.Name}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = k.ipvs.Close() })
	if k.nl, err = netlink.New(netlink.Options{NetNS: ns.Name}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = k.nl.Close() })
	if k.sets, err = ipset.New(ipset.Options{NetNS: ns.Name}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = k.sets.Close() })
	if k.ipt, err = ipt.New(context.Background(), ipt.Options{Protocol: ipt.ProtocolIPv4, NetNS: ns.Name}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = k.ipt.(*ipt.Real).Close() })
	return k
}

func newBenchRig(b *testing.B, k *benchKernel, svcs []*v1.Service, slices []*discovery.EndpointSlice) (*proxier.Engine, *Backend) {
	backend, err := New(Options{
		IPVS: k.ipvs, Netlink: k.nl, IPSet: k.sets, IPTables: k.ipt, Sysctl: ProcSysctl{NetNS: k.ns},
	})
	if err != nil {
		b.Fatal(err)
	}
	env := pt.DefaultEnv()
	env.NodeName, env.NodeIPs = "node-0", nil
	e := pt.NewEngine(b, backend, pt.EngineOptions{Env: env, Services: svcs, Slices: slices})
	return e, backend
}

// BenchmarkIPVSSync measures, per size: the full sync from empty, the first
// sync of a restarted kproxy over the state the first one left, a
// one-endpoint partial sync and the flush check every partial sync starts
// with (checkIntact; medians of five).
func BenchmarkIPVSSync(b *testing.B) {
	requireVM(b)
	for _, n := range pt.BenchSizes() {
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				k := newBenchKernel(b)
				svcs, slices := pt.Workload(n)
				e, backend := newBenchRig(b, k, svcs, slices)
				full := pt.TimedSync(b, e)
				st := backend.LastSync()

				e2, backend2 := newBenchRig(b, k, svcs, slices)
				restart := pt.TimedSync(b, e2)

				var partials []time.Duration
				for j := 0; j < 5; j++ {
					sl := slices[n-1-j].DeepCopy()
					sl.Endpoints[0].Addresses = []string{fmt.Sprintf("10.250.0.%d", j+1)}
					e2.OnEndpointSliceUpdate(slices[n-1-j], sl)
					partials = append(partials, pt.TimedSync(b, e2))
				}
				sort.Slice(partials, func(i, j int) bool { return partials[i] < partials[j] })
				// The check every partial sync starts with (checkIntact),
				// and its parts, after a collection so that the large
				// heap's marking does not run meanwhile.
				runtime.GC()
				ctx := context.Background()
				check := func(f func(context.Context) string) float64 {
					var ds []time.Duration
					for j := 0; j < 5; j++ {
						start := time.Now()
						if found := f(ctx); found != "" {
							b.Fatalf("check found %s", found)
						}
						ds = append(ds, time.Since(start))
					}
					sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
					return float64(ds[len(ds)/2].Microseconds()) / 1000
				}
				b.ReportMetric(check(backend2.checkIntact), "intact-check-ms")
				b.ReportMetric(check(backend2.checkSets), "check-sets-ms")
				b.ReportMetric(check(backend2.checkVirtualServers), "check-vs-ms")
				b.ReportMetric(check(backend2.checkAddresses), "check-addr-ms")
				b.ReportMetric(full.Seconds(), "full-sync-s")
				b.ReportMetric(restart.Seconds(), "restart-sync-s")
				b.ReportMetric(float64(partials[len(partials)/2].Microseconds())/1000, "partial-sync-ms")
				b.ReportMetric(float64(st.VirtualServers), "virtual-servers")
				b.ReportMetric(float64(st.DestinationsAdded), "real-servers")
			}
		})
	}
}

// BenchmarkCheckIntact measures the flush check every partial sync starts
// with (checkIntact) over the fakes, after a full sync of the standard
// workload: its kernel reads do not grow with the services (one listing of
// set names, the canary set, one virtual server's real servers, one
// address), so neither should this.
//
//	go test -run '^$' -bench CheckIntact ./proxier/ipvs/
func BenchmarkCheckIntact(b *testing.B) {
	for _, n := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("services=%d", n), func(b *testing.B) {
			k := newFakeKernel(b, v1.IPv4Protocol, []netip.Addr{netip.MustParseAddr("10.0.0.1")})
			backend := k.backend(b, Options{})
			env := pt.DefaultEnv()
			env.NodeName, env.NodeIPs = "node-0", nil
			svcs, slices := pt.Workload(n)
			pt.Sync(b, pt.NewEngine(b, backend, pt.EngineOptions{Env: env, Services: svcs, Slices: slices}))
			ctx := context.Background()
			for b.Loop() {
				if found := backend.checkIntact(ctx); found != "" {
					b.Fatal(found)
				}
			}
		})
	}
}
