// Package metrics exports kproxy's Prometheus metrics under kube-proxy's
// names, help texts, labels and buckets, so that dashboards and alerts made
// for kube-proxy work unchanged. Every metric lives in the Metrics' own
// registry; nothing is registered globally.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/kproxy/kproxy/pkg/proxy"
)

const subsystem = "kubeproxy"

// modeNFTables is nftables mode's name (--proxy-mode): a failed sync
// counts as an nftables sync failure rather than an iptables-restore
// failure, and no iptables rules are counted.
const modeNFTables = "nftables"

// Label names, as kube-proxy uses them.
const (
	labelIPFamily      = "ip_family"
	labelTable         = "table"
	labelTrafficPolicy = "traffic_policy"
	labelCode          = "code"
)

// Options configures Metrics.
type Options struct {
	// Mode is the proxy mode ("iptables", "ipvs", "nftables"), for
	// /proxyMode and build info; it also picks the failure counter of a
	// failed sync.
	Mode    string
	Version string
	// PendingChanges, when set, is read at every scrape for the
	// *_changes_pending gauges: the number of services with Service,
	// respectively EndpointSlice, changes not yet applied.
	PendingChanges func() (services, endpoints int)
	Clock          clock.PassiveClock
	// Profiling serves Go's profiles under /debug/pprof/ beside the
	// metrics (kube-proxy's enableProfiling, --profiling).
	Profiling bool
}

// Metrics holds kproxy's metrics and the registry they are exported from.
type Metrics struct {
	opts     Options
	clock    clock.PassiveClock
	registry *prometheus.Registry

	syncDuration        *prometheus.HistogramVec
	syncFullDuration    *prometheus.HistogramVec
	syncPartialDuration *prometheus.HistogramVec
	lastSync            *prometheus.GaugeVec
	lastQueued          *prometheus.GaugeVec
	networkProgramming  *prometheus.HistogramVec
	endpointChanges     prometheus.Counter
	serviceChanges      prometheus.Counter
	noLocalEndpoints    *prometheus.GaugeVec
	iptablesTotal       *prometheus.GaugeVec
	iptablesLast        *prometheus.GaugeVec
	restoreFailures     *prometheus.CounterVec
	partialFailures     *prometheus.CounterVec
	nftSyncFailures     *prometheus.CounterVec
	nftCleanupFailures  *prometheus.CounterVec
	healthz             *prometheus.CounterVec
	livez               *prometheus.CounterVec
	buildInfo           *prometheus.GaugeVec
	setAside            *prometheus.GaugeVec
	syncPanics          *prometheus.CounterVec
}

// syncBuckets are kube-proxy's buckets for sync durations: 1ms to ~16s.
func syncBuckets() []float64 { return prometheus.ExponentialBuckets(0.001, 2, 15) }

// networkProgrammingBuckets are kube-proxy's buckets for network
// programming latency: 0, then 0.25s and 0.5s, every second to 59s, every
// 5s to 115s, every 30s to 5min.
func networkProgrammingBuckets() []float64 {
	out := []float64{0}
	out = append(out, prometheus.LinearBuckets(0.25, 0.25, 2)...)
	out = append(out, prometheus.LinearBuckets(1, 1, 59)...)
	out = append(out, prometheus.LinearBuckets(60, 5, 12)...)
	return append(out, prometheus.LinearBuckets(120, 30, 7)...)
}

// New creates the metrics and registers them, with the Go runtime and
// process collectors, in a new registry.
func New(opts Options) (*Metrics, error) {
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	m := &Metrics{opts: opts, clock: opts.Clock, registry: prometheus.NewRegistry()}
	histogram := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Subsystem: subsystem, Name: name, Help: help, Buckets: buckets}, []string{labelIPFamily})
	}
	gauge := func(name, help string, labels ...string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Subsystem: subsystem, Name: name, Help: help}, labels)
	}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Subsystem: subsystem, Name: name, Help: help}, labels)
	}

	m.syncDuration = histogram("sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds", syncBuckets())
	m.syncFullDuration = histogram("sync_full_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for full resyncs", syncBuckets())
	m.syncPartialDuration = histogram("sync_partial_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds for partial resyncs", syncBuckets())
	m.lastSync = gauge("sync_proxy_rules_last_timestamp_seconds", "The last time proxy rules were successfully synced", labelIPFamily)
	m.lastQueued = gauge("sync_proxy_rules_last_queued_timestamp_seconds", "The last time a sync of proxy rules was queued", labelIPFamily)
	m.networkProgramming = histogram("network_programming_duration_seconds", "In Cluster Network Programming Latency in seconds", networkProgrammingBuckets())
	m.endpointChanges = prometheus.NewCounter(prometheus.CounterOpts{
		Subsystem: subsystem, Name: "sync_proxy_rules_endpoint_changes_total", Help: "Cumulative proxy rules Endpoint changes",
	})
	m.serviceChanges = prometheus.NewCounter(prometheus.CounterOpts{
		Subsystem: subsystem, Name: "sync_proxy_rules_service_changes_total", Help: "Cumulative proxy rules Service changes",
	})
	m.noLocalEndpoints = gauge("sync_proxy_rules_no_local_endpoints_total", "Number of services with a Local traffic policy and no endpoints", labelTrafficPolicy, labelIPFamily)
	m.iptablesTotal = gauge("sync_proxy_rules_iptables_total", "Total number of iptables rules owned by kube-proxy", labelTable, labelIPFamily)
	m.iptablesLast = gauge("sync_proxy_rules_iptables_last", "Number of iptables rules written by kube-proxy in last sync", labelTable, labelIPFamily)
	m.restoreFailures = counter("sync_proxy_rules_iptables_restore_failures_total", "Cumulative proxy iptables restore failures", labelIPFamily)
	m.partialFailures = counter("sync_proxy_rules_iptables_partial_restore_failures_total", "Cumulative proxy iptables partial restore failures", labelIPFamily)
	m.nftSyncFailures = counter("sync_proxy_rules_nftables_sync_failures_total", "Cumulative proxy nftables sync failures", labelIPFamily)
	m.nftCleanupFailures = counter("sync_proxy_rules_nftables_cleanup_failures_total", "Cumulative proxy nftables cleanup failures", labelIPFamily)
	m.healthz = counter("proxy_healthz_total", "Cumulative proxy healthz HTTP status", labelCode)
	m.livez = counter("proxy_livez_total", "Cumulative proxy livez HTTP status", labelCode)
	m.buildInfo = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kproxy_build_info", Help: "A metric with a constant '1' value labeled by the kproxy version and proxy mode",
	}, []string{"version", "mode"})
	m.buildInfo.WithLabelValues(opts.Version, opts.Mode).Set(1)
	// kproxy's own, without kube-proxy counterparts (docs/design.md, "Sync
	// loop under failure").
	m.setAside = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "kproxy_sync_proxy_rules_set_aside_services",
		Help: "Number of service ports whose rules the kernel refused, set aside with their last good rules while everything else is programmed",
	}, []string{labelIPFamily})
	m.syncPanics = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kproxy_sync_panics_total",
		Help: "Cumulative syncs that panicked; each was recovered and counted as a failed sync",
	}, []string{labelIPFamily})

	pending := func() (services, endpoints int) {
		if opts.PendingChanges == nil {
			return 0, 0
		}
		return opts.PendingChanges()
	}
	endpointsPending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Subsystem: subsystem, Name: "sync_proxy_rules_endpoint_changes_pending", Help: "Pending proxy rules Endpoint changes",
	}, func() float64 { _, n := pending(); return float64(n) })
	servicesPending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Subsystem: subsystem, Name: "sync_proxy_rules_service_changes_pending", Help: "Pending proxy rules Service changes",
	}, func() float64 { n, _ := pending(); return float64(n) })

	for _, c := range []prometheus.Collector{
		m.syncDuration, m.syncFullDuration, m.syncPartialDuration, m.lastSync, m.lastQueued,
		m.networkProgramming, m.endpointChanges, m.serviceChanges, endpointsPending, servicesPending,
		m.noLocalEndpoints, m.iptablesTotal, m.iptablesLast, m.restoreFailures, m.partialFailures,
		m.nftSyncFailures, m.nftCleanupFailures,
		m.healthz, m.livez, m.buildInfo, m.setAside, m.syncPanics,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		if err := m.registry.Register(c); err != nil {
			return nil, fmt.Errorf("registering metrics: %w", err)
		}
	}
	return m, nil
}

// Registry is the registry every metric is exported from.
func (m *Metrics) Registry() *prometheus.Registry { return m.registry }

func seconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

// SyncQueued records that a sync of family was asked for at when.
func (m *Metrics) SyncQueued(family v1.IPFamily, when time.Time) {
	m.lastQueued.WithLabelValues(string(family)).Set(seconds(when))
}

// SyncDone records one sync attempt. Every attempt counts in the duration
// histograms; a panicked one counts in kproxy_sync_panics_total only; a
// failed one counts as an nftables sync failure in nftables mode, else as
// a restore failure (and a partial restore failure when partial); the rest
// is recorded only for successful syncs, as kube-proxy does, including the
// number of set-aside service ports. nftables mode counts no iptables
// rules.
func (m *Metrics) SyncDone(r proxy.SyncResult) {
	family := string(r.Family)
	d := r.Duration.Seconds()
	m.syncDuration.WithLabelValues(family).Observe(d)
	if r.Full {
		m.syncFullDuration.WithLabelValues(family).Observe(d)
	} else {
		m.syncPartialDuration.WithLabelValues(family).Observe(d)
	}
	m.serviceChanges.Add(float64(r.ServiceChanges))
	m.endpointChanges.Add(float64(r.EndpointChanges))
	if r.Panicked {
		m.syncPanics.WithLabelValues(family).Inc()
		return
	}
	if r.Err != nil {
		if m.opts.Mode == modeNFTables {
			m.nftSyncFailures.WithLabelValues(family).Inc()
			return
		}
		m.restoreFailures.WithLabelValues(family).Inc()
		if !r.Full {
			m.partialFailures.WithLabelValues(family).Inc()
		}
		return
	}
	now := m.clock.Now()
	for _, t := range r.TriggerTimes {
		m.networkProgramming.WithLabelValues(family).Observe(max(now.Sub(t).Seconds(), 0))
	}
	m.noLocalEndpoints.WithLabelValues("internal", family).Set(float64(r.NoLocalEndpointsInternal))
	m.noLocalEndpoints.WithLabelValues("external", family).Set(float64(r.NoLocalEndpointsExternal))
	m.lastSync.WithLabelValues(family).Set(seconds(now))
	m.setAside.WithLabelValues(family).Set(float64(len(r.SetAside)))
	if m.opts.Mode == modeNFTables {
		return
	}
	for table, n := range r.RuleCounts {
		m.iptablesTotal.WithLabelValues(table, family).Set(float64(n))
		if r.RulesWritten == nil {
			// The backend cannot tell what it wrote: report what it owns.
			m.iptablesLast.WithLabelValues(table, family).Set(float64(n))
		}
	}
	for table, n := range r.RulesWritten {
		m.iptablesLast.WithLabelValues(table, family).Set(float64(n))
	}
}

// NFTablesCleanupFailed counts one failed removal of nftables state of
// family: a stale chain in nftables mode, or kproxy's nftables table when
// another mode starts.
func (m *Metrics) NFTablesCleanupFailed(family v1.IPFamily) {
	m.nftCleanupFailures.WithLabelValues(string(family)).Inc()
}

// HealthzResponded counts one /healthz answer (healthcheck.ProbeRecorder).
func (m *Metrics) HealthzResponded(code int) { m.healthz.WithLabelValues(strconv.Itoa(code)).Inc() }

// LivezResponded counts one /livez answer (healthcheck.ProbeRecorder).
func (m *Metrics) LivezResponded(code int) { m.livez.WithLabelValues(strconv.Itoa(code)).Inc() }

// Handler serves /metrics and /proxyMode, and /debug/pprof/ when
// Options.Profiling is set.
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{Registry: m.registry}))
	mux.HandleFunc("/proxyMode", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		_, _ = fmt.Fprint(w, m.opts.Mode)
	})
	if m.opts.Profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
}

// Run listens on addr (--metrics-bind-address) and serves until ctx is
// done.
func (m *Metrics) Run(ctx context.Context, addr string) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics server: %w", err)
	}
	return m.Serve(ctx, ln)
}

// Serve serves on ln until ctx is done, then closes ln.
func (m *Metrics) Serve(ctx context.Context, ln net.Listener) error {
	klog.FromContext(ctx).Info("Serving metrics", "address", ln.Addr().String())
	srv := &http.Server{Handler: m.Handler(), ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { _ = srv.Close() })
	defer stop()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving metrics on %s: %w", ln.Addr(), err)
	}
	return nil
}
