package healthcheck

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"syscall"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/ktesting"
)

// proxyHealthState is a ProxyHealthChecker whose answer the test sets.
type proxyHealthState struct {
	mu      sync.Mutex
	healthy bool
}

func (p *proxyHealthState) Health() ProxyHealth {
	p.mu.Lock()
	defer p.mu.Unlock()
	return ProxyHealth{Healthy: p.healthy}
}

func (p *proxyHealthState) set(healthy bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.healthy = healthy
}

// freePorts returns n distinct TCP ports free on 127.0.0.1 right now.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	var lns []net.Listener
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	for _, ln := range lns {
		_ = ln.Close()
	}
	return ports
}

// hcAnswer is one health check answer; code 0 means the connection was
// refused (nothing listens).
type hcAnswer struct {
	code      int
	namespace string
	name      string
	endpoints int
	healthy   bool
	weight    string
}

func probe(t *testing.T, host string, port int) hcAnswer {
	t.Helper()
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + net.JoinHostPort(host, strconv.Itoa(port)) + "/")
	if errors.Is(err, syscall.ECONNREFUSED) {
		return hcAnswer{}
	}
	if err != nil {
		t.Fatalf("probing %s:%d: %v", host, port, err)
	}
	defer func() { _ = resp.Body.Close() }()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	var body serviceHealthBody
	if err := json.Unmarshal(data, &body); err != nil {
		t.Fatalf("health check body %q is not JSON: %v", data, err)
	}
	// The field names are kube-proxy's: check them on the raw JSON too.
	var raw map[string]any
	_ = json.Unmarshal(data, &raw)
	for _, key := range []string{"service", "localEndpoints", "serviceProxyHealthy"} {
		if _, ok := raw[key]; !ok {
			t.Errorf("body %s has no %q", data, key)
		}
	}
	return hcAnswer{
		code: resp.StatusCode, namespace: body.Service.Namespace, name: body.Service.Name,
		endpoints: body.LocalEndpoints, healthy: body.ServiceProxyHealthy,
		weight: resp.Header.Get("X-Load-Balancing-Endpoint-Weight"),
	}
}

// ok and unavailable build the expected answers of service ns/name.
func ok(name string, endpoints int) hcAnswer {
	return hcAnswer{code: http.StatusOK, namespace: "ns", name: name, endpoints: endpoints, healthy: true, weight: strconv.Itoa(endpoints)}
}

func unavailable(name string, endpoints int, proxyHealthy bool) hcAnswer {
	return hcAnswer{code: http.StatusServiceUnavailable, namespace: "ns", name: name, endpoints: endpoints, healthy: proxyHealthy, weight: strconv.Itoa(endpoints)}
}

var refused = hcAnswer{}

func svc(name string) types.NamespacedName { return types.NamespacedName{Namespace: "ns", Name: name} }

type services = map[types.NamespacedName]ServiceHealth

// svcEnv is a ServiceHealthServer binding 127.0.0.0/8 addresses, with ports
// free on loopback.
type svcEnv struct {
	t     *testing.T
	s     *ServiceHealthServer
	proxy *proxyHealthState
	ports []int
}

func (env *svcEnv) expect(host string, port int, want hcAnswer) {
	env.t.Helper()
	if got := probe(env.t, host, port); got != want {
		env.t.Errorf("%s:%d answered %+v, want %+v", host, port, got, want)
	}
}

func (env *svcEnv) expectOpen(want map[types.NamespacedName]int) {
	env.t.Helper()
	got := env.s.Services()
	if len(got) != len(want) {
		env.t.Errorf("open health checks %v, want %v", got, want)
		return
	}
	for nn, port := range want {
		if got[nn] != port {
			env.t.Errorf("open health checks %v, want %v", got, want)
		}
	}
}

func TestServiceHealthServer(t *testing.T) {
	v4, v6 := v1.IPv4Protocol, v1.IPv6Protocol
	loopback := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	for _, tc := range []struct {
		name string
		// nodePortAddresses is the option; the node's addresses are
		// 127.0.0.1, 127.0.0.2 and one outside loopback.
		nodePortAddresses []netip.Prefix
		run               func(env *svcEnv)
	}{
		{
			name: "local endpoints answer 200", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 2}})
				env.expect("127.0.0.1", env.ports[0], ok("a", 2))
				env.expectOpen(map[types.NamespacedName]int{svc("a"): env.ports[0]})
			},
		},
		{
			name: "no local endpoint answers 503", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 0}})
				env.expect("127.0.0.1", env.ports[0], unavailable("a", 0, true))
			},
		},
		{
			name: "the count follows the syncs", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 0}})
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 3}})
				env.expect("127.0.0.1", env.ports[0], ok("a", 3))
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 0}})
				env.expect("127.0.0.1", env.ports[0], unavailable("a", 0, true))
			},
		},
		{
			name: "unhealthy proxy answers 503", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.proxy.set(false)
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], unavailable("a", 1, false))
				env.proxy.set(true)
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
			},
		},
		{
			name: "a removed service closes its listener, others stay", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}, svc("b"): {Port: env.ports[1], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
				env.expect("127.0.0.1", env.ports[1], ok("b", 1))
				env.s.Sync(v4, services{svc("b"): {Port: env.ports[1], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], refused)
				env.expect("127.0.0.1", env.ports[1], ok("b", 1))
				env.expectOpen(map[types.NamespacedName]int{svc("b"): env.ports[1]})
			},
		},
		{
			name: "a port change moves the listener", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[1], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], refused)
				env.expect("127.0.0.1", env.ports[1], ok("a", 1))
				// And back, onto the port just released.
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
				env.expect("127.0.0.1", env.ports[1], refused)
			},
		},
		{
			name: "a taken port fails only its service and is retried", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				squatter, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(env.ports[0])))
				if err != nil {
					env.t.Fatal(err)
				}
				want := services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}, svc("b"): {Port: env.ports[1], LocalEndpoints: 1}}
				env.s.Sync(v4, want)
				env.expectOpen(map[types.NamespacedName]int{svc("b"): env.ports[1]})
				env.expect("127.0.0.1", env.ports[1], ok("b", 1))
				_ = squatter.Close()
				env.s.Sync(v4, want)
				env.expectOpen(map[types.NamespacedName]int{svc("a"): env.ports[0], svc("b"): env.ports[1]})
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
			},
		},
		{
			name: "an invalid port fails only its service", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: 70000, LocalEndpoints: 1}, svc("b"): {Port: env.ports[1], LocalEndpoints: 1}})
				env.expectOpen(map[types.NamespacedName]int{svc("b"): env.ports[1]})
			},
		},
		{
			name: "dual-stack: open while either family reports it; a pod counts once", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.s.Sync(v6, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
				env.s.Sync(v4, services{})
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
				env.s.Sync(v6, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 0}})
				env.expect("127.0.0.1", env.ports[0], unavailable("a", 0, true))
				env.s.Sync(v6, services{})
				env.expect("127.0.0.1", env.ports[0], refused)
			},
		},
		{
			name:              "only local addresses inside --nodeport-addresses are bound",
			nodePortAddresses: []netip.Prefix{netip.MustParsePrefix("127.0.0.2/32")},
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expect("127.0.0.2", env.ports[0], ok("a", 1))
				env.expect("127.0.0.1", env.ports[0], refused)
			},
		},
		{
			name: "every matching local address is bound", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
				env.expect("127.0.0.2", env.ports[0], ok("a", 1))
				env.expect("127.0.0.3", env.ports[0], refused)
			},
		},
		{
			name: "without --nodeport-addresses every address is bound",
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], ok("a", 1))
				env.expect("127.0.0.3", env.ports[0], ok("a", 1))
			},
		},
		{
			name:              "no local address inside --nodeport-addresses",
			nodePortAddresses: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expectOpen(map[types.NamespacedName]int{})
				env.expect("127.0.0.1", env.ports[0], refused)
			},
		},
		{
			name: "Close closes every listener; later syncs do nothing", nodePortAddresses: loopback,
			run: func(env *svcEnv) {
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}, svc("b"): {Port: env.ports[1], LocalEndpoints: 0}})
				env.s.Close()
				env.expect("127.0.0.1", env.ports[0], refused)
				env.expect("127.0.0.1", env.ports[1], refused)
				env.s.Sync(v4, services{svc("a"): {Port: env.ports[0], LocalEndpoints: 1}})
				env.expect("127.0.0.1", env.ports[0], refused)
				env.expectOpen(map[types.NamespacedName]int{})
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logger, _ := ktesting.NewTestContext(t)
			var addrs []netip.Addr
			for _, a := range []string{"127.0.0.1", "127.0.0.2", "192.0.2.1"} {
				addrs = append(addrs, netip.MustParseAddr(a))
			}
			env := &svcEnv{t: t, proxy: &proxyHealthState{healthy: true}, ports: freePorts(t, 2)}
			env.s = NewServiceHealthServer(ServiceHealthOptions{
				NodePortAddresses: tc.nodePortAddresses,
				LocalAddresses:    func() ([]netip.Addr, error) { return addrs, nil },
				ProxyHealth:       env.proxy,
				Logger:            logger,
			})
			t.Cleanup(env.s.Close)
			tc.run(env)
		})
	}
}
