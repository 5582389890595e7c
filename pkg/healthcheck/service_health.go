package healthcheck

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"

	"github.com/kproxy/kproxy/pkg/netlink"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// ServiceHealth is what the health check of one service needs: its
// healthCheckNodePort and its number of local Ready endpoints.
type ServiceHealth struct {
	Port           int
	LocalEndpoints int
}

// ProxyHealthChecker reports the proxy's own health; a ServiceHealthServer
// answers 503 while the proxy is unhealthy, as kube-proxy does.
type ProxyHealthChecker interface {
	Health() ProxyHealth
}

// ServiceHealthOptions configures a ServiceHealthServer.
type ServiceHealthOptions struct {
	// NodePortAddresses restricts the listeners to the local addresses
	// inside these prefixes (--nodeport-addresses, both families); empty
	// means every address.
	NodePortAddresses []netip.Prefix
	// LocalAddresses lists the node's addresses; nil uses the host's
	// interfaces.
	LocalAddresses func() ([]netip.Addr, error)
	// ProxyHealth, when set, makes every service answer 503 while the
	// proxy is unhealthy.
	ProxyHealth ProxyHealthChecker
	Logger      klog.Logger
}

// ServiceHealthServer runs one HTTP listener per service with a
// healthCheckNodePort (per node address when NodePortAddresses is set). A
// service answers 200 while it has local endpoints, 503 otherwise, so that
// a cloud load balancer sends traffic only to nodes with local endpoints.
type ServiceHealthServer struct {
	opts   ServiceHealthOptions
	logger klog.Logger

	mu sync.Mutex
	// byFamily is the last Sync of each IP family.
	byFamily map[v1.IPFamily]map[types.NamespacedName]ServiceHealth
	// services are the open health checks.
	services map[types.NamespacedName]*hcInstance
	closed   bool
	wg       sync.WaitGroup
}

// hcInstance is one service's open health check.
type hcInstance struct {
	listeners []net.Listener
	port      int
	endpoints int
	servers   []*http.Server
}

// NewServiceHealthServer returns a server with no listener open; listeners
// open and close as Sync reports services.
func NewServiceHealthServer(opts ServiceHealthOptions) *ServiceHealthServer {
	logger := opts.Logger
	if logger.GetSink() == nil {
		logger = klog.Background()
	}
	if opts.LocalAddresses == nil {
		opts.LocalAddresses = netlink.HostAddresses
	}
	return &ServiceHealthServer{
		opts:     opts,
		logger:   logger.WithName("service-health"),
		byFamily: map[v1.IPFamily]map[types.NamespacedName]ServiceHealth{},
		services: map[types.NamespacedName]*hcInstance{},
	}
}

// Sync makes the health checks match the services the proxier of family
// reports. A service keeps its listener while any family reports it; its
// endpoint count is the largest any family reports (a dual-stack pod counts
// once, not once per family). A listener that cannot open is logged and
// retried on the next Sync; other services are not affected.
func (s *ServiceHealthServer) Sync(family v1.IPFamily, services map[types.NamespacedName]ServiceHealth) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.byFamily[family] = services

	want := map[types.NamespacedName]ServiceHealth{}
	for _, f := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
		for nn, svc := range s.byFamily[f] {
			if cur, ok := want[nn]; ok {
				cur.LocalEndpoints = max(cur.LocalEndpoints, svc.LocalEndpoints)
				want[nn] = cur
				continue
			}
			want[nn] = svc
		}
	}

	for nn, inst := range s.services {
		if svc, ok := want[nn]; !ok || svc.Port != inst.port {
			s.logger.V(2).Info("Closing health check", "service", nn, "port", inst.port)
			s.closeInstance(nn, inst)
			delete(s.services, nn)
		}
	}
	for nn, svc := range want {
		if inst, ok := s.services[nn]; ok {
			inst.endpoints = svc.LocalEndpoints
			continue
		}
		inst, err := s.open(nn, svc.Port)
		if err != nil {
			s.logger.Error(err, "Failed to open health check; retrying on the next sync", "service", nn, "port", svc.Port)
			continue
		}
		inst.endpoints = svc.LocalEndpoints
		s.services[nn] = inst
	}
}

// addresses lists the hosts the listeners of a service bind to: "" (every
// address) without NodePortAddresses, else the matching local addresses.
func (s *ServiceHealthServer) addresses() ([]string, error) {
	if len(s.opts.NodePortAddresses) == 0 {
		return []string{""}, nil
	}
	local, err := s.opts.LocalAddresses()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, a := range local {
		// An IPv6 link-local address cannot be bound without its zone.
		if a.Is6() && a.IsLinkLocalUnicast() && a.Zone() == "" {
			continue
		}
		for _, p := range s.opts.NodePortAddresses {
			if p.Contains(a) {
				out = append(out, a.String())
				break
			}
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no local address inside --nodeport-addresses %v", s.opts.NodePortAddresses)
	}
	return out, nil
}

// open starts the listeners of one service; on error none stays open.
func (s *ServiceHealthServer) open(nn types.NamespacedName, port int) (*hcInstance, error) {
	if port <= 0 || port > 65535 {
		return nil, fmt.Errorf("health check port %d out of range", port)
	}
	hosts, err := s.addresses()
	if err != nil {
		return nil, err
	}
	inst := &hcInstance{port: port}
	handler := &hcHandler{server: s, name: nn}
	var lc net.ListenConfig
	for _, host := range hosts {
		addr := net.JoinHostPort(host, strconv.Itoa(port))
		ln, err := lc.Listen(context.Background(), "tcp", addr)
		if err != nil {
			s.closeInstance(nn, inst)
			return nil, fmt.Errorf("listening on %s: %w", addr, err)
		}
		srv := newHTTPServer(handler)
		inst.servers = append(inst.servers, srv)
		inst.listeners = append(inst.listeners, ln)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				s.logger.Error(err, "Health check server failed", "service", nn, "address", addr)
			}
		}()
		s.logger.V(2).Info("Opened health check", "service", nn, "address", ln.Addr().String())
	}
	return inst, nil
}

func (s *ServiceHealthServer) closeInstance(nn types.NamespacedName, inst *hcInstance) {
	for _, srv := range inst.servers {
		if err := srv.Close(); err != nil {
			s.logger.Error(err, "Failed to close health check listener", "service", nn, "port", inst.port)
		}
	}
	// Close the listening sockets too, synchronously: http.Server.Close only
	// reaches a listener once its Serve goroutine has registered it, and the
	// port must refuse connections when Sync returns.
	for _, ln := range inst.listeners {
		_ = ln.Close()
	}
}

// Services returns the open health checks and their ports.
func (s *ServiceHealthServer) Services() map[types.NamespacedName]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[types.NamespacedName]int, len(s.services))
	for nn, inst := range s.services {
		out[nn] = inst.port
	}
	return out
}

// Close closes every listener and waits for the servers to stop; later
// Syncs do nothing.
func (s *ServiceHealthServer) Close() {
	s.mu.Lock()
	s.closed = true
	for nn, inst := range s.services {
		s.closeInstance(nn, inst)
	}
	s.services = map[types.NamespacedName]*hcInstance{}
	s.mu.Unlock()
	s.wg.Wait()
}

// endpoints returns the local endpoint count of an open health check.
func (s *ServiceHealthServer) endpoints(nn types.NamespacedName) (int, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	inst, ok := s.services[nn]
	if !ok {
		return 0, false
	}
	return inst.endpoints, true
}

// serviceHealthBody is the JSON answer of a service health check, with
// kube-proxy's field names.
type serviceHealthBody struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints      int  `json:"localEndpoints"`
	ServiceProxyHealthy bool `json:"serviceProxyHealthy"`
}

type hcHandler struct {
	server *ServiceHealthServer
	name   types.NamespacedName
}

func (h *hcHandler) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	count, ok := h.server.endpoints(h.name)
	if !ok {
		// The listener is closing.
		http.Error(w, "health check closed", http.StatusServiceUnavailable)
		return
	}
	proxyHealthy := true
	if h.server.opts.ProxyHealth != nil {
		proxyHealthy = h.server.opts.ProxyHealth.Health().Healthy
	}
	var body serviceHealthBody
	body.Service.Namespace, body.Service.Name = h.name.Namespace, h.name.Name
	body.LocalEndpoints = count
	body.ServiceProxyHealthy = proxyHealthy
	data, err := json.Marshal(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("X-Load-Balancing-Endpoint-Weight", strconv.Itoa(count))
	w.WriteHeader(statusFor(count, proxyHealthy))
	_, _ = w.Write(data)
}

// statusFor is 200 with local endpoints and a healthy proxy, else 503.
func statusFor(localEndpoints int, proxyHealthy bool) int {
	if localEndpoints > 0 && proxyHealthy {
		return http.StatusOK
	}
	return http.StatusServiceUnavailable
}
