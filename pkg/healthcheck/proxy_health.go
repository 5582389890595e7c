// Package healthcheck serves kproxy's health over HTTP with kube-proxy's
// contract: /healthz and /livez on --healthz-bind-address, and one
// healthCheckNodePort listener per LoadBalancer service with
// externalTrafficPolicy Local.
package healthcheck

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
)

// ToBeDeletedTaint is the taint the Cluster Autoscaler puts on a node it is
// about to delete; /healthz fails while it is present so that load balancers
// drain the node first.
const ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// ProbeRecorder counts the answers of /healthz and /livez by HTTP status
// code (kubeproxy_proxy_healthz_total, kubeproxy_proxy_livez_total).
type ProbeRecorder interface {
	HealthzResponded(code int)
	LivezResponded(code int)
}

// ProxierHealth is the health of the proxier of one IP family.
type ProxierHealth struct {
	LastUpdated time.Time `json:"lastUpdated"`
	Healthy     bool      `json:"healthy"`
}

// ProxyHealth is the body of /healthz and /livez, as kube-proxy writes it.
type ProxyHealth struct {
	// LastUpdated is the latest successful sync of any family; when the
	// proxy is healthy the handlers report the current time instead, as
	// kube-proxy does for compatibility with older clients.
	LastUpdated time.Time `json:"lastUpdated"`
	CurrentTime time.Time `json:"currentTime"`
	// NodeEligible is set in /healthz answers only.
	NodeEligible *bool `json:"nodeEligible,omitempty"`
	// Healthy is true when every family's proxier is healthy.
	Healthy bool                          `json:"healthy"`
	Status  map[v1.IPFamily]ProxierHealth `json:"status,omitempty"`
}

// ProxyHealthOptions configures a ProxyHealthServer.
type ProxyHealthOptions struct {
	// BindAddress is the "ip:port" Run listens on (--healthz-bind-address).
	BindAddress string
	// HealthTimeout is how long a queued update may wait for a successful
	// sync before the proxy is unhealthy; kube-proxy uses 2 x syncPeriod.
	// It also bounds how long a sync loop may go without finishing a run
	// (SyncLoopRan) before it counts as stuck.
	HealthTimeout time.Duration
	// NodeName is this node: only its Node events count.
	NodeName string
	// Recorder, when set, counts probe answers.
	Recorder ProbeRecorder
	Clock    clock.PassiveClock
}

// familyState is what the server knows of one family's proxier.
type familyState struct {
	lastUpdated time.Time
	// oldestQueued is when the oldest update not yet applied was queued;
	// zero when none is pending.
	oldestQueued time.Time
	// loopRan is when the sync loop last started or finished a run; zero
	// until the loop reports (SyncLoopRan).
	loopRan time.Time
}

// ProxyHealthServer tracks the proxiers' progress and this node's
// eligibility, and answers /healthz and /livez. It implements
// config.NodeHandler to follow this node's deletion.
type ProxyHealthServer struct {
	opts  ProxyHealthOptions
	clock clock.PassiveClock

	mu       sync.Mutex
	families map[v1.IPFamily]*familyState
	// nodeEligible is true until an event of this node says it is being
	// deleted or tainted for deletion.
	nodeEligible bool
}

// NewProxyHealthServer validates opts; it starts nothing.
func NewProxyHealthServer(opts ProxyHealthOptions) (*ProxyHealthServer, error) {
	if opts.HealthTimeout <= 0 {
		return nil, fmt.Errorf("proxy health: timeout must be positive, got %v", opts.HealthTimeout)
	}
	if opts.NodeName == "" {
		return nil, errors.New("proxy health: NodeName is required")
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	return &ProxyHealthServer{
		opts:         opts,
		clock:        opts.Clock,
		families:     map[v1.IPFamily]*familyState{},
		nodeEligible: true,
	}, nil
}

func (hs *ProxyHealthServer) family(f v1.IPFamily) *familyState {
	st, ok := hs.families[f]
	if !ok {
		st = &familyState{}
		hs.families[f] = st
	}
	return st
}

// QueuedUpdate records that the proxier of family has a change to apply.
// Only the oldest pending change matters: later calls keep its time.
func (hs *ProxyHealthServer) QueuedUpdate(family v1.IPFamily) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	st := hs.family(family)
	if st.oldestQueued.IsZero() {
		st.oldestQueued = hs.clock.Now()
	}
}

// Updated records a successful sync of family that started at syncStart:
// the changes queued up to syncStart are applied. A change queued after it
// may have missed that sync and stays pending; it asked for another sync,
// which clears it.
func (hs *ProxyHealthServer) Updated(family v1.IPFamily, syncStart time.Time) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	st := hs.family(family)
	st.lastUpdated = hs.clock.Now()
	if !st.oldestQueued.After(syncStart) {
		st.oldestQueued = time.Time{}
	}
}

// SyncLoopRan records that the sync loop of family is alive: it started,
// or one of its runs ended, whatever the outcome (a sync, a failure, or
// nothing to do yet). A loop that has reported once and then goes
// HealthTimeout without reporting is stuck, say in a hung kernel call, and
// its family is unhealthy even with no update queued: the loop runs at
// least once per sync period when idle.
func (hs *ProxyHealthServer) SyncLoopRan(family v1.IPFamily) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	hs.family(family).loopRan = hs.clock.Now()
}

// Health reports the proxiers' health, ignoring the node's eligibility: a
// family is unhealthy when a change has waited HealthTimeout or longer, or
// when its sync loop has not finished a run for HealthTimeout or longer.
func (hs *ProxyHealthServer) Health() ProxyHealth {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	now := hs.clock.Now()
	h := ProxyHealth{CurrentTime: now, Healthy: true, Status: map[v1.IPFamily]ProxierHealth{}}
	for f, st := range hs.families {
		healthy := st.oldestQueued.IsZero() || now.Sub(st.oldestQueued) < hs.opts.HealthTimeout
		if !st.loopRan.IsZero() && now.Sub(st.loopRan) >= hs.opts.HealthTimeout {
			healthy = false
		}
		h.Status[f] = ProxierHealth{LastUpdated: st.lastUpdated, Healthy: healthy}
		h.Healthy = h.Healthy && healthy
		if st.lastUpdated.After(h.LastUpdated) {
			h.LastUpdated = st.lastUpdated
		}
	}
	return h
}

// NodeEligible reports whether this node may take traffic: it is not being
// deleted and not tainted ToBeDeletedByClusterAutoscaler.
func (hs *ProxyHealthServer) NodeEligible() bool {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	return hs.nodeEligible
}

func (hs *ProxyHealthServer) setNodeEligible(eligible bool) {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	hs.nodeEligible = eligible
}

func nodeEligible(node *v1.Node) bool {
	if node.DeletionTimestamp != nil {
		return false
	}
	for _, t := range node.Spec.Taints {
		if t.Key == ToBeDeletedTaint {
			return false
		}
	}
	return true
}

// OnNodeAdd implements config.NodeHandler; other nodes are ignored.
func (hs *ProxyHealthServer) OnNodeAdd(node *v1.Node) {
	if node.Name == hs.opts.NodeName {
		hs.setNodeEligible(nodeEligible(node))
	}
}

// OnNodeUpdate implements config.NodeHandler.
func (hs *ProxyHealthServer) OnNodeUpdate(_, node *v1.Node) { hs.OnNodeAdd(node) }

// OnNodeDelete implements config.NodeHandler: once this node is gone it is
// no longer eligible.
func (hs *ProxyHealthServer) OnNodeDelete(node *v1.Node) {
	if node.Name == hs.opts.NodeName {
		hs.setNodeEligible(false)
	}
}

// OnNodeSynced implements config.NodeHandler.
func (hs *ProxyHealthServer) OnNodeSynced() {}

// Handler serves /healthz and /livez.
func (hs *ProxyHealthServer) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", hs.serveHealthz)
	mux.HandleFunc("/livez", hs.serveLivez)
	return mux
}

func (hs *ProxyHealthServer) serveHealthz(w http.ResponseWriter, _ *http.Request) {
	h := hs.Health()
	eligible := hs.NodeEligible()
	h.NodeEligible = &eligible
	code := hs.write(w, h, h.Healthy && eligible)
	if hs.opts.Recorder != nil {
		hs.opts.Recorder.HealthzResponded(code)
	}
}

func (hs *ProxyHealthServer) serveLivez(w http.ResponseWriter, _ *http.Request) {
	h := hs.Health()
	code := hs.write(w, h, h.Healthy)
	if hs.opts.Recorder != nil {
		hs.opts.Recorder.LivezResponded(code)
	}
}

// write answers with h and 200 when healthy, else 503, and returns the
// code.
func (hs *ProxyHealthServer) write(w http.ResponseWriter, h ProxyHealth, healthy bool) int {
	code := http.StatusServiceUnavailable
	if healthy {
		code = http.StatusOK
		// kube-proxy reports a healthy proxy as updated just now.
		h.LastUpdated = h.CurrentTime
	}
	body, err := json.Marshal(h)
	if err != nil {
		// Unreachable: every field marshals.
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return http.StatusInternalServerError
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	_, _ = w.Write(body)
	return code
}

// Run listens on BindAddress and serves until ctx is done.
func (hs *ProxyHealthServer) Run(ctx context.Context) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", hs.opts.BindAddress)
	if err != nil {
		return fmt.Errorf("proxy health server: %w", err)
	}
	return hs.Serve(ctx, ln)
}

// Serve serves on ln until ctx is done, then closes ln.
func (hs *ProxyHealthServer) Serve(ctx context.Context, ln net.Listener) error {
	klog.FromContext(ctx).Info("Serving proxy health", "address", ln.Addr().String())
	return serve(ctx, ln, hs.Handler())
}

// serve runs an HTTP server with handler on ln until ctx is done.
func serve(ctx context.Context, ln net.Listener, handler http.Handler) error {
	srv := newHTTPServer(handler)
	stop := context.AfterFunc(ctx, func() { _ = srv.Close() })
	defer stop()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving on %s: %w", ln.Addr(), err)
	}
	return nil
}

func newHTTPServer(handler http.Handler) *http.Server {
	return &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
}
