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

// WorkloadShape is the size of a workload built by ShapedWorkload:
// Services services with Endpoints endpoints each.
type WorkloadShape struct {
	Services, Endpoints int
}

// String writes the shape as ParseWorkloadShapes reads it ("10000x10").
func (s WorkloadShape) String() string { return fmt.Sprintf("%dx%d", s.Services, s.Endpoints) }

// ParseWorkloadShapes parses shapes separated by spaces or commas:
// "10000x10 45000x1 5000x50"; a bare number n is n x WorkloadEndpoints.
func ParseWorkloadShapes(v string) ([]WorkloadShape, error) {
	var out []WorkloadShape
	for _, f := range strings.FieldsFunc(v, func(r rune) bool { return r == ' ' || r == ',' || r == '\t' || r == '\n' }) {
		svcs, eps, found := strings.Cut(f, "x")
		s := WorkloadShape{Endpoints: WorkloadEndpoints}
		var err error
		if s.Services, err = strconv.Atoi(svcs); err != nil || s.Services <= 0 {
			return nil, fmt.Errorf("workload shape %q: want <services>x<endpoints>", f)
		}
		if found {
			if s.Endpoints, err = strconv.Atoi(eps); err != nil || s.Endpoints <= 0 {
				return nil, fmt.Errorf("workload shape %q: want <services>x<endpoints>", f)
			}
		}
		out = append(out, s)
	}
	return out, nil
}

// BenchShapes parses KPROXY_BENCH_SHAPES (ParseWorkloadShapes; default
// "1000x10"): the workload shapes the shape-aware benchmarks program. An
// unparsable value panics: a benchmark run with a typo should not measure
// something else.
func BenchShapes() []WorkloadShape {
	v := os.Getenv("KPROXY_BENCH_SHAPES")
	if v == "" {
		v = "1000x10"
	}
	out, err := ParseWorkloadShapes(v)
	if err != nil {
		panic(fmt.Sprintf("KPROXY_BENCH_SHAPES: %v", err))
	}
	return out
}

// ShapedWorkload builds a workload like Workload's at any shape: ClusterIP
// services (one in ten also a NodePort, node ports 30000 + i/10, beyond the
// default node port range past 27,680 services) with s.Endpoints endpoints
// each, spread over 1,000 nodes named node-0..node-999. Unlike Workload's,
// whose ClusterIPs repeat beyond about 20,000 services, every ClusterIP is
// distinct: they are spread over 10.96.0.0/12 (up to 1,048,576 services),
// and endpoint addresses count up from 10.128.0.0.
func ShapedWorkload(s WorkloadShape) ([]*v1.Service, []*discovery.EndpointSlice) {
	svcs := make([]*v1.Service, 0, s.Services)
	slices := make([]*discovery.EndpointSlice, 0, s.Services)
	for i := 0; i < s.Services; i++ {
		name := fmt.Sprintf("svc-%05d", i)
		// An odd multiplier is a bijection modulo 2^20.
		h := (uint32(i)*2654435761 + 7) & 0xfffff
		ip := fmt.Sprintf("10.%d.%d.%d", 96+h>>16, (h>>8)&0xff, h&0xff)
		var opts []SvcOpt
		if i%10 == 0 {
			opts = append(opts, NodePort(int32(30000+i/10)))
		}
		svcs = append(svcs, Service(name, ip, opts...))
		eps := make([]EP, 0, s.Endpoints)
		for j := 0; j < s.Endpoints; j++ {
			k := i*s.Endpoints + j
			eps = append(eps, EP{IP: fmt.Sprintf("10.%d.%d.%d", 128+k>>16, (k>>8)&0xff, k&0xff), Node: fmt.Sprintf("node-%d", k%1000)})
		}
		slices = append(slices, Slice(name, 8080, eps...))
	}
	return svcs, slices
}

// ReplaceEndpoint is the benchmarks' one-endpoint change number i: the
// first endpoint of a slice picked from sls (spread over them) gets a new
// address. It stores the new slice in sls and returns the old and new ones
// for OnEndpointSliceUpdate.
func ReplaceEndpoint(sls []*discovery.EndpointSlice, i int) (old, updated *discovery.EndpointSlice) {
	k := (i * 7919) % len(sls)
	old = sls[k]
	updated = old.DeepCopy()
	updated.Endpoints[0].Addresses = []string{fmt.Sprintf("10.250.%d.%d", i/250%250, i%250+1)}
	sls[k] = updated
	return old, updated
}
