package proxiertest

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// WorkloadEndpoints is the endpoints per service of the standard workloads.
const WorkloadEndpoints = 10

// BenchSizes parses KPROXY_BENCH_SERVICES ("1000 10000"; default 1000): the
// numbers of services the benchmarks program.
func BenchSizes() []int {
	v := os.Getenv("KPROXY_BENCH_SERVICES")
	if v == "" {
		v = "1000"
	}
	var out []int
	for _, f := range strings.Fields(v) {
		if n, err := strconv.Atoi(f); err == nil && n > 0 {
			out = append(out, n)
		}
	}
	return out
}

// Workload builds the standard workload (docs/design.md, "Testing"): n ClusterIP services
// (one in ten also a NodePort) with WorkloadEndpoints endpoints each, spread
// over 1,000 nodes named node-0..node-999. ClusterIPs are spread over a /16
// as an allocator would.
func Workload(n int) ([]*v1.Service, []*discovery.EndpointSlice) {
	svcs := make([]*v1.Service, 0, n)
	slices := make([]*discovery.EndpointSlice, 0, n)
	for i := 0; i < n; i++ {
		name := fmt.Sprintf("svc-%05d", i)
		h := uint32(i)*2654435761 + 7
		ip := fmt.Sprintf("10.96.%d.%d", (h>>8)&0xff, h&0xff|1)
		var opts []SvcOpt
		if i%10 == 0 {
			opts = append(opts, NodePort(int32(30000+i/10)))
		}
		svcs = append(svcs, Service(name, ip, opts...))
		eps := make([]EP, 0, WorkloadEndpoints)
		for j := 0; j < WorkloadEndpoints; j++ {
			k := i*WorkloadEndpoints + j
			eps = append(eps, EP{IP: fmt.Sprintf("10.%d.%d.%d", 128+k>>16, (k>>8)&0xff, k&0xff), Node: fmt.Sprintf("node-%d", k%1000)})
		}
		slices = append(slices, Slice(name, 8080, eps...))
	}
	return svcs, slices
}
