package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/util/retry"

	"github.com/kproxy/kproxy/test/cluster"
)

// kproxy's own servers, as the cluster runs it (the flags' defaults).
const (
	// healthzPort serves /healthz and /livez on every address.
	healthzPort = 10256
	// metricsPort serves /metrics and /proxyMode on 127.0.0.1 only.
	metricsPort = 10249
	// toBeDeletedTaint is the Cluster Autoscaler's taint on a node it is
	// about to delete.
	toBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"
	// maxBody bounds what an HTTP answer may hold (/metrics included).
	maxBody = 4 << 20
	// restoreTimeout bounds putting kproxy back as the cluster runs it.
	restoreTimeout = time.Minute
	// eventReasonInvalidTopologyKeys is proxier.EventReasonInvalidTopologyKeys
	// (the proxier package needs modules this one does not require).
	eventReasonInvalidTopologyKeys = "InvalidTopologyKeys"
)

// answer is an HTTP response, read in full.
type answer struct {
	code   int
	header http.Header
	body   []byte
}

func (a answer) String() string {
	return fmt.Sprintf("HTTP %d %s", a.code, strings.TrimSpace(string(a.body)))
}

// get sends GET url from inside from's namespace (an Exec target) over a
// new connection, closed afterwards.
func (e *env) get(from, url string) (answer, error) {
	ns, err := e.netnsOf(from)
	if err != nil {
		return answer{}, err
	}
	tr := &http.Transport{DialContext: ns.Dial, DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(e.ctx, requestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return answer{}, err
	}
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return answer{}, fmt.Errorf("GET %s from %s: reading the body: %w", url, from, err)
	}
	return answer{code: resp.StatusCode, header: resp.Header, body: body}, nil
}

// refused reports whether err is a refused TCP connection: nothing listens.
func refused(err error) bool { return errors.Is(err, syscall.ECONNREFUSED) }

// expectRefused waits until GET url from from is refused, then checks that
// three more are.
func (e *env) expectRefused(from, url string) {
	e.t.Helper()
	check := func() error {
		a, err := e.get(from, url)
		switch {
		case err == nil:
			return fmt.Errorf("answered: %s", a)
		case !refused(err):
			return fmt.Errorf("want a refused connection, got: %w", err)
		}
		return nil
	}
	what := fmt.Sprintf("GET %s from %s is refused", url, from)
	e.eventually(what, programTimeout, check)
	e.consistently(what, 3, check)
}

// proxyHealth is the body of /healthz and /livez (kube-proxy's fields).
type proxyHealth struct {
	LastUpdated  time.Time `json:"lastUpdated"`
	CurrentTime  time.Time `json:"currentTime"`
	NodeEligible *bool     `json:"nodeEligible"`
}

// parseProxyHealth decodes a /healthz or /livez body, which must carry
// lastUpdated and currentTime, with lastUpdated not after currentTime.
func parseProxyHealth(body []byte) (proxyHealth, error) {
	var fieldsOf map[string]json.RawMessage
	if err := json.Unmarshal(body, &fieldsOf); err != nil {
		return proxyHealth{}, fmt.Errorf("body %q is not a JSON object: %w", body, err)
	}
	for _, f := range []string{"lastUpdated", "currentTime"} {
		if _, ok := fieldsOf[f]; !ok {
			return proxyHealth{}, fmt.Errorf("body %s has no %s", body, f)
		}
	}
	var h proxyHealth
	if err := json.Unmarshal(body, &h); err != nil {
		return proxyHealth{}, fmt.Errorf("body %s: %w", body, err)
	}
	if h.CurrentTime.IsZero() {
		return proxyHealth{}, fmt.Errorf("body %s: zero currentTime", body)
	}
	if h.LastUpdated.After(h.CurrentTime) {
		return proxyHealth{}, fmt.Errorf("body %s: lastUpdated after currentTime", body)
	}
	return h, nil
}

// checkHealth GETs a health path (healthz or livez) on addr from from and
// returns an error unless it answers code with a well-formed JSON body;
// eligible, when set, is the nodeEligible /healthz must report.
func (e *env) checkHealth(from, addr, path string, code int, eligible *bool) error {
	url := "http://" + addr + "/" + path
	a, err := e.get(from, url)
	if err != nil {
		return err
	}
	if a.code != code {
		return fmt.Errorf("GET %s: %s, want HTTP %d", url, a, code)
	}
	if ct := a.header.Get("Content-Type"); ct != "application/json" {
		return fmt.Errorf("GET %s: Content-Type %q, want application/json", url, ct)
	}
	h, err := parseProxyHealth(a.body)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	// The nodes and the test share the machine's clock.
	if skew := time.Since(h.CurrentTime); skew > time.Minute || skew < -time.Minute {
		return fmt.Errorf("GET %s: currentTime %s is %s away from now", url, h.CurrentTime, skew)
	}
	if eligible != nil && (h.NodeEligible == nil || *h.NodeEligible != *eligible) {
		return fmt.Errorf("GET %s: nodeEligible %v, want %v (%s)", url, h.NodeEligible, *eligible, a)
	}
	return nil
}

// kproxyLogSynced reports, with an error, whether the kproxy log data
// shows, after offset, a start followed by a sync (offset past the end:
// the log was replaced, read it all).
func kproxyLogSynced(data []byte, offset int64) error {
	if int64(len(data)) < offset {
		offset = 0
	}
	text := string(data[offset:])
	start := strings.Index(text, `"Starting kproxy"`)
	if start < 0 {
		return errors.New("no start logged yet")
	}
	if !strings.Contains(text[start:], `"Synced"`) {
		return errors.New("started, no sync logged yet")
	}
	return nil
}

// kproxyGuard puts kproxy on a node back as the cluster runs it (its own
// flags, nothing extra), running and synced, when the test ends, whatever
// the test left it in.
type kproxyGuard struct {
	e    *env
	node string
	// extra is set while kproxy runs with the test's extra flags or
	// environment.
	extra bool
}

// guardKproxy returns node's guard; its cleanup is registered now.
func (e *env) guardKproxy(node string) *kproxyGuard {
	g := &kproxyGuard{e: e, node: node}
	e.t.Cleanup(func() {
		// The test's context is gone by now.
		ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
		defer cancel()
		if err := g.restore(ctx); err != nil {
			e.t.Errorf("putting kproxy on %s back: %v\n%s", node, err, tailFile(e.c.KproxyLog(node), logTailLines))
		}
	})
	return g
}

// stop stops kproxy (SIGTERM).
func (g *kproxyGuard) stop() {
	g.e.t.Helper()
	if err := g.e.c.StopKproxy(g.e.ctx, g.node); err != nil {
		g.e.fatalf("stopping kproxy on %s: %v", g.node, err)
	}
}

// start starts kproxy with the cluster's flags and extra, and waits for
// its first sync.
func (g *kproxyGuard) start(extra ...string) {
	g.e.t.Helper()
	g.startWith(cluster.KproxyStart{Args: extra})
}

// startWith starts kproxy with the cluster's flags, opts' extra flags and
// environment, and waits for its first sync.
func (g *kproxyGuard) startWith(opts cluster.KproxyStart) {
	g.e.t.Helper()
	offset := logSize(g.e.c.KproxyLog(g.node))
	g.extra = len(opts.Args) > 0 || len(opts.Env) > 0
	if err := g.e.c.StartKproxyWith(g.e.ctx, g.node, opts); err != nil {
		g.e.fatalf("starting kproxy on %s with %q (environment %q): %v", g.node, opts.Args, opts.Env, err)
	}
	g.e.kproxySynced(g.node, offset)
}

// restore restarts kproxy without extra flags when it has some, starts it
// when stopped, and waits for the sync of a new one.
func (g *kproxyGuard) restore(ctx context.Context) error {
	c := g.e.c
	if g.extra {
		if err := c.StopKproxy(ctx, g.node); err != nil {
			return err
		}
		g.extra = false
	}
	if g.e.kproxyRunning(ctx, g.node) {
		return nil
	}
	offset := logSize(c.KproxyLog(g.node))
	if err := c.StartKproxy(ctx, g.node); err != nil {
		return err
	}
	for {
		data, err := os.ReadFile(c.KproxyLog(g.node))
		if err == nil {
			if err = kproxyLogSynced(data, offset); err == nil {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("restarted, but: %w", err)
		case <-time.After(pollInterval):
		}
	}
}

// setNodeTaint adds the NoSchedule taint key to node (with add false:
// removes it), retrying conflicts with the node agent's status updates.
// It uses its own context, so that cleanups can call it.
func (e *env) setNodeTaint(node, key string, add bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := e.k.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		had := slices.ContainsFunc(n.Spec.Taints, func(t v1.Taint) bool { return t.Key == key })
		if had == add {
			return nil
		}
		n.Spec.Taints = slices.DeleteFunc(n.Spec.Taints, func(t v1.Taint) bool { return t.Key == key })
		if add {
			// As the autoscaler sets it: the value is a Unix time.
			n.Spec.Taints = append(n.Spec.Taints, v1.Taint{
				Key: key, Value: strconv.FormatInt(time.Now().Unix(), 10), Effect: v1.TaintEffectNoSchedule,
			})
		}
		_, err = e.k.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
		return err
	})
}

// TestHealthz: every node's /healthz and /livez answer 200 with kube-proxy's
// JSON body to the external client; a stopped kproxy's port refuses, a
// restarted one answers again; while the node is tainted
// ToBeDeletedByClusterAutoscaler /healthz is 503 (nodeEligible false) and
// /livez stays 200.
func TestHealthz(t *testing.T) { inMode(t, testHealthz) }

func testHealthz(t *testing.T) {
	const node = 2
	e := newEnv(t)
	addrOf := func(i int) string { return hostPort(cluster.NodeIP(i), healthzPort) }
	healthy := func(e *env, i int) func() error {
		return func() error {
			if err := e.checkHealth(cluster.TargetClient, addrOf(i), "healthz", http.StatusOK, new(true)); err != nil {
				return err
			}
			return e.checkHealth(cluster.TargetClient, addrOf(i), "livez", http.StatusOK, nil)
		}
	}

	t.Run("every node healthy", func(t *testing.T) {
		e := e.sub(t)
		for i := 1; i <= suiteNodes; i++ {
			e.eventually(nodeName(i)+" healthy", programTimeout, healthy(e, i))
		}
	})
	if t.Failed() {
		return
	}

	t.Run("kproxy stopped and restarted", func(t *testing.T) {
		e := e.sub(t)
		g := e.guardKproxy(nodeName(node))
		g.stop()
		for _, path := range []string{"healthz", "livez"} {
			url := "http://" + addrOf(node) + "/" + path
			a, err := e.get(cluster.TargetClient, url)
			if err == nil || !refused(err) {
				e.fatalf("GET %s with kproxy stopped: %v, %v; want a refused connection", url, a, err)
			}
		}
		g.start()
		e.eventually(nodeName(node)+" healthy after the restart", programTimeout, healthy(e, node))
	})
	if t.Failed() {
		return
	}

	t.Run("node tainted "+toBeDeletedTaint, func(t *testing.T) {
		e := e.sub(t)
		t.Cleanup(func() {
			if err := e.setNodeTaint(nodeName(node), toBeDeletedTaint, false); err != nil {
				t.Errorf("removing the taint of %s: %v", nodeName(node), err)
			}
		})
		if err := e.setNodeTaint(nodeName(node), toBeDeletedTaint, true); err != nil {
			e.fatalf("tainting %s: %v", nodeName(node), err)
		}
		draining := func() error {
			if err := e.checkHealth(cluster.TargetClient, addrOf(node), "healthz", http.StatusServiceUnavailable, new(false)); err != nil {
				return err
			}
			return e.checkHealth(cluster.TargetClient, addrOf(node), "livez", http.StatusOK, nil)
		}
		e.eventually(nodeName(node)+" /healthz 503, /livez 200", programTimeout, draining)
		e.consistently(nodeName(node)+" /healthz 503, /livez 200", 3, draining)
		for i := 1; i <= suiteNodes; i++ {
			if i != node {
				if err := healthy(e, i)(); err != nil {
					e.fatalf("%s while %s is tainted: %v", nodeName(i), nodeName(node), err)
				}
			}
		}

		if err := e.setNodeTaint(nodeName(node), toBeDeletedTaint, false); err != nil {
			e.fatalf("removing the taint of %s: %v", nodeName(node), err)
		}
		e.eventually(nodeName(node)+" healthy once untainted", programTimeout, healthy(e, node))
	})
}

// serviceHealth is the body of a healthCheckNodePort answer.
type serviceHealth struct {
	Service struct {
		Namespace string `json:"namespace"`
		Name      string `json:"name"`
	} `json:"service"`
	LocalEndpoints int `json:"localEndpoints"`
}

// parseServiceHealth decodes a healthCheckNodePort body, which must name
// the service and carry localEndpoints.
func parseServiceHealth(body []byte) (serviceHealth, error) {
	var fieldsOf map[string]json.RawMessage
	if err := json.Unmarshal(body, &fieldsOf); err != nil {
		return serviceHealth{}, fmt.Errorf("body %q is not a JSON object: %w", body, err)
	}
	for _, f := range []string{"service", "localEndpoints"} {
		if _, ok := fieldsOf[f]; !ok {
			return serviceHealth{}, fmt.Errorf("body %s has no %s", body, f)
		}
	}
	var h serviceHealth
	if err := json.Unmarshal(body, &h); err != nil {
		return serviceHealth{}, fmt.Errorf("body %s: %w", body, err)
	}
	if h.Service.Namespace == "" || h.Service.Name == "" {
		return serviceHealth{}, fmt.Errorf("body %s does not name the service", body)
	}
	return h, nil
}

// TestHealthCheckNodePort: a LoadBalancer Service with
// externalTrafficPolicy Local gets a health check on the healthCheckNodePort
// the API server allocated, on every node: 200 with the local endpoint count
// where its pods run, 503 with 0 elsewhere; deleting the Service closes
// the port.
func TestHealthCheckNodePort(t *testing.T) { inMode(t, testHealthCheckNodePort) }

func testHealthCheckNodePort(t *testing.T) {
	const podNode = 2
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 2, node: nodeName(podNode)})
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeLoadBalancer), func(s *v1.Service) {
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	})
	port := svc.Spec.HealthCheckNodePort
	if port == 0 {
		t.Fatalf("the API server allocated no healthCheckNodePort: %+v", svc.Spec)
	}
	e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
	urlOf := func(i int) string { return "http://" + hostPort(cluster.NodeIP(i), port) + "/" }

	for i := 1; i <= suiteNodes; i++ {
		code, local := http.StatusServiceUnavailable, 0
		if i == podNode {
			code, local = http.StatusOK, len(pods)
		}
		t.Run(fmt.Sprintf("%s with %d local endpoints", nodeName(i), local), func(t *testing.T) {
			e := e.sub(t)
			e.eventually(fmt.Sprintf("GET %s answers %d with %d local endpoints", urlOf(i), code, local), programTimeout, func() error {
				a, err := e.get(cluster.TargetClient, urlOf(i))
				if err != nil {
					return err
				}
				h, err := parseServiceHealth(a.body)
				if err != nil {
					return err
				}
				switch {
				case a.code != code || h.LocalEndpoints != local:
					return fmt.Errorf("%s, want HTTP %d with localEndpoints %d", a, code, local)
				case h.Service.Namespace != e.ns || h.Service.Name != svc.Name:
					return fmt.Errorf("%s names service %s/%s, want %s/%s", a, h.Service.Namespace, h.Service.Name, e.ns, svc.Name)
				case a.header.Get("X-Load-Balancing-Endpoint-Weight") != strconv.Itoa(local):
					return fmt.Errorf("X-Load-Balancing-Endpoint-Weight %q, want %d", a.header.Get("X-Load-Balancing-Endpoint-Weight"), local)
				}
				return nil
			})
		})
	}
	if t.Failed() {
		return
	}

	t.Run("service deleted", func(t *testing.T) {
		e := e.sub(t)
		if err := e.k.CoreV1().Services(e.ns).Delete(e.ctx, svc.Name, metav1.DeleteOptions{}); err != nil {
			e.fatalf("deleting service %s: %v", svc.Name, err)
		}
		for i := 1; i <= suiteNodes; i++ {
			e.expectRefused(cluster.TargetClient, urlOf(i))
		}
	})
}

// metricValue returns the value of the one sample of metric name whose
// labels include want, in a Prometheus text exposition; found is false when
// no sample matches, and more than one match is an error.
func metricValue(exposition, name string, want map[string]string) (v float64, found bool, err error) {
	sc := bufio.NewScanner(strings.NewReader(exposition))
	sc.Buffer(make([]byte, 64<<10), maxBody)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		sample, labels, rest, err := parseSampleLine(line)
		if err != nil {
			return 0, false, err
		}
		if sample != name {
			continue
		}
		match := true
		for k, v := range want {
			if labels[k] != v {
				match = false
				break
			}
		}
		if !match {
			continue
		}
		if found {
			return 0, false, fmt.Errorf("more than one sample of %s with labels %v", name, want)
		}
		valueField := strings.Fields(rest)
		if len(valueField) == 0 {
			return 0, false, fmt.Errorf("no value in %q", line)
		}
		if v, err = strconv.ParseFloat(valueField[0], 64); err != nil {
			return 0, false, fmt.Errorf("value of %q: %w", line, err)
		}
		found = true
	}
	return v, found, sc.Err()
}

// parseSampleLine splits `name{k="v",...} value [timestamp]` into the name,
// the labels and what follows them.
func parseSampleLine(line string) (name string, labels map[string]string, rest string, err error) {
	end := strings.IndexAny(line, "{ \t")
	if end < 0 {
		return "", nil, "", fmt.Errorf("no value in %q", line)
	}
	name, rest = line[:end], line[end:]
	labels = map[string]string{}
	if !strings.HasPrefix(rest, "{") {
		return name, labels, rest, nil
	}
	rest = rest[1:]
	for {
		rest = strings.TrimLeft(rest, " ,")
		if strings.HasPrefix(rest, "}") {
			return name, labels, rest[1:], nil
		}
		key, after, ok := strings.Cut(rest, `="`)
		if !ok {
			return "", nil, "", fmt.Errorf("bad labels in %q", line)
		}
		var value strings.Builder
		i := 0
		for ; i < len(after) && after[i] != '"'; i++ {
			if after[i] == '\\' && i+1 < len(after) {
				i++
				switch after[i] {
				case 'n':
					value.WriteByte('\n')
				default:
					value.WriteByte(after[i])
				}
				continue
			}
			value.WriteByte(after[i])
		}
		if i == len(after) {
			return "", nil, "", fmt.Errorf("unterminated label value in %q", line)
		}
		labels[strings.TrimSpace(key)] = value.String()
		rest = after[i+1:]
	}
}

// syncMetrics are the metrics a sync moves, from one scrape.
type syncMetrics struct {
	// lastSync is kubeproxy_sync_proxy_rules_last_timestamp_seconds (IPv4).
	lastSync float64
	// endpointChanges, serviceChanges are the *_changes_total counters.
	endpointChanges, serviceChanges float64
	// syncs counts IPv4 syncs (the sync duration histogram's count).
	syncs float64
	// programmed counts network programming latency observations (IPv4).
	programmed float64
}

func (m syncMetrics) String() string {
	return fmt.Sprintf("last sync %.3f, endpoint changes %v, service changes %v, syncs %v, programming observations %v",
		m.lastSync, m.endpointChanges, m.serviceChanges, m.syncs, m.programmed)
}

// metricsURL is kproxy's metrics server on a node, from inside the node.
func metricsURL(port int, path string) string {
	return "http://" + hostPort("127.0.0.1", int32(port)) + path
}

// scrapeSync reads the sync metrics of kproxy on node from inside the
// node's namespace (the server listens on the node's loopback).
func (e *env) scrapeSync(node string, port int) (syncMetrics, error) {
	a, err := e.get(node, metricsURL(port, "/metrics"))
	if err != nil {
		return syncMetrics{}, err
	}
	if a.code != http.StatusOK {
		return syncMetrics{}, fmt.Errorf("GET /metrics on %s: HTTP %d", node, a.code)
	}
	ipv4 := map[string]string{"ip_family": string(v1.IPv4Protocol)}
	var m syncMetrics
	for _, metric := range []struct {
		name     string
		labels   map[string]string
		dst      *float64
		required bool
	}{
		{"kubeproxy_sync_proxy_rules_last_timestamp_seconds", ipv4, &m.lastSync, true},
		{"kubeproxy_sync_proxy_rules_endpoint_changes_total", nil, &m.endpointChanges, true},
		{"kubeproxy_sync_proxy_rules_service_changes_total", nil, &m.serviceChanges, true},
		{"kubeproxy_sync_proxy_rules_duration_seconds_count", ipv4, &m.syncs, true},
		// A histogram child appears with its first observation.
		{"kubeproxy_network_programming_duration_seconds_count", ipv4, &m.programmed, false},
	} {
		v, found, err := metricValue(string(a.body), metric.name, metric.labels)
		if err != nil {
			return syncMetrics{}, fmt.Errorf("%s on %s: %w", metric.name, node, err)
		}
		if !found && metric.required {
			return syncMetrics{}, fmt.Errorf("%s on %s: no sample with labels %v", metric.name, node, metric.labels)
		}
		*metric.dst = v
	}
	return m, nil
}

// TestMetrics: kproxy's metrics server answers on the node's loopback only;
// /proxyMode names the mode; the last sync time and the endpoint and service
// change counters move as a Deployment behind a new Service is created and
// scaled, and so does the network programming latency histogram.
func TestMetrics(t *testing.T) { inMode(t, testMetrics) }

func testMetrics(t *testing.T) {
	const node = 1
	e := newEnv(t)
	from := nodeName(node)

	t.Run("proxyMode", func(t *testing.T) {
		e := e.sub(t)
		a, err := e.get(from, metricsURL(metricsPort, "/proxyMode"))
		if err != nil {
			e.fatalf("GET /proxyMode in %s: %v", from, err)
		}
		if a.code != http.StatusOK || string(a.body) != e.c.Mode() {
			e.fatalf("GET /proxyMode in %s: %s, want HTTP 200 %q", from, a, e.c.Mode())
		}
	})
	t.Run("not served on the node address", func(t *testing.T) {
		e := e.sub(t)
		url := "http://" + hostPort(cluster.NodeIP(node), metricsPort) + "/metrics"
		if a, err := e.get(cluster.TargetClient, url); err == nil || !refused(err) {
			e.fatalf("GET %s from the client: %v, %v; want a refused connection (127.0.0.1 only)", url, a, err)
		}
	})
	if t.Failed() {
		return
	}

	scrape := func(e *env) syncMetrics {
		e.t.Helper()
		m, err := e.scrapeSync(from, metricsPort)
		if err != nil {
			e.fatalf("scraping kproxy on %s: %v", from, err)
		}
		return m
	}
	// moved waits until a scrape shows every metric of cond moved on from
	// before, and returns it.
	moved := func(e *env, what string, before syncMetrics, cond func(now syncMetrics) []string) syncMetrics {
		e.t.Helper()
		var now syncMetrics
		e.eventually(what, programTimeout, func() error {
			var err error
			if now, err = e.scrapeSync(from, metricsPort); err != nil {
				return err
			}
			if still := cond(now); len(still) > 0 {
				return fmt.Errorf("%s did not move: before %s; now %s", strings.Join(still, ", "), before, now)
			}
			return nil
		})
		if nowSecs := float64(time.Now().UnixNano()) / 1e9; now.lastSync > nowSecs+1 {
			e.fatalf("last sync %.3f is in the future (now %.3f)", now.lastSync, nowSecs)
		}
		return now
	}

	before := scrape(e)
	t.Logf("before: %s", before)
	sel := map[string]string{"app": "web"}
	var created syncMetrics
	t.Run("service and deployment created", func(t *testing.T) {
		e := e.sub(t)
		e.deploy(workload{name: "web", replicas: 1})
		svc := e.createService("web", sel)
		e.waitEndpoints(svc.Name, "1 ready", readyCount(1))
		e.expectTraffic(from, "tcp", hostPort(svc.Spec.ClusterIP, servicePort), 3, expect{})
		created = moved(e, "sync metrics after the creation", before, func(now syncMetrics) []string {
			var still []string
			if now.lastSync <= before.lastSync {
				still = append(still, "last sync")
			}
			if now.serviceChanges <= before.serviceChanges {
				still = append(still, "service changes")
			}
			if now.endpointChanges <= before.endpointChanges {
				still = append(still, "endpoint changes")
			}
			if now.syncs <= before.syncs {
				still = append(still, "syncs")
			}
			return still
		})
		t.Logf("after the creation: %s", created)
	})
	if t.Failed() {
		return
	}

	t.Run("deployment scaled to 3", func(t *testing.T) {
		e := e.sub(t)
		e.scale("web", 3)
		e.waitPods(sel, 3)
		e.waitEndpoints("web", "3 ready", readyCount(3))
		now := moved(e, "sync metrics after the scale", created, func(now syncMetrics) []string {
			var still []string
			if now.lastSync <= created.lastSync {
				still = append(still, "last sync")
			}
			if now.endpointChanges <= created.endpointChanges {
				still = append(still, "endpoint changes")
			}
			// The EndpointSlice controller stamps its changes with
			// endpoints.kubernetes.io/last-change-trigger-time.
			if now.programmed <= before.programmed {
				still = append(still, "network programming observations")
			}
			return still
		})
		t.Logf("after the scale: %s", now)
	})
}

// udpReply is one datagram a UDP client got.
type udpReply struct {
	at time.Time
	// from is the address the datagram came from.
	from string
	r    reply
	err  error
}

// TestUDPConntrackCleanup: a pod sends a request every 50 ms to a UDP
// Service from one socket (so one conntrack entry, refreshed every 50 ms and
// never timing out); when the single backend pod is deleted and the
// Deployment replaces it, the same socket gets answers from the new pod
// within seconds. Only kproxy deleting the entry (DNATed to the old pod's
// address) makes that possible.
func TestUDPConntrackCleanup(t *testing.T) { inMode(t, testUDPConntrackCleanup) }

func testUDPConntrackCleanup(t *testing.T) {
	const (
		clientNode, backendNode = 1, 2
		interval                = 50 * time.Millisecond
		// switchTimeout bounds the move to the new pod: deletion, the new
		// pod starting, the EndpointSlice update and kproxy's sync.
		switchTimeout = 15 * time.Second
		// afterSwitch replies must all come from the new pod.
		afterSwitch = 40
	)
	e := newEnv(t)
	sel := map[string]string{"app": "dns"}
	pods := e.deploy(workload{name: "dns", replicas: 1, node: nodeName(backendNode), ports: []v1.ContainerPort{
		{Name: "udp", ContainerPort: udpEchoPort, Protocol: v1.ProtocolUDP},
	}})
	old := pods[0]
	svc := e.createService("dns", sel, func(s *v1.Service) {
		s.Spec.Ports = []v1.ServicePort{{Name: "udp", Protocol: v1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(udpEchoPort)}}
	})
	e.waitEndpoints(svc.Name, "1 ready", readyCount(1))
	from, _ := e.clientPod("client", nodeName(clientNode))
	addr := hostPort(svc.Spec.ClusterIP, 53)
	e.expectTraffic(from, "udp", addr, 3, expect{all: []string{old.Name}, only: []string{old.Name}})

	ns, err := e.netnsOf(from)
	if err != nil {
		t.Fatal(err)
	}
	// An unconnected socket: ICMP errors (the old pod gone) do not end it.
	pc, err := ns.ListenPacket(e.ctx, "udp4", "0.0.0.0:0")
	if err != nil {
		t.Fatalf("opening a UDP socket in %s: %v", from, err)
	}
	dst := net.UDPAddrFromAddrPort(netip.MustParseAddrPort(addr))
	replies := make(chan udpReply, 1024)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	sent := 0
	wg.Go(func() {
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			if _, err := pc.WriteTo([]byte("ping\n"), dst); err == nil {
				sent++
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	})
	wg.Go(func() {
		buf := make([]byte, 2048)
		for {
			n, src, err := pc.ReadFrom(buf)
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if err != nil {
				continue
			}
			r, perr := parseReply(strings.TrimSuffix(string(buf[:n]), "\n"))
			select {
			case replies <- udpReply{at: time.Now(), from: src.String(), r: r, err: perr}:
			case <-stop:
				return
			}
		}
	})
	halted := false
	halt := func() {
		if !halted {
			halted = true
			close(stop)
			_ = pc.Close()
			wg.Wait()
		}
	}
	defer halt()

	// next returns the next reply, failing after timeout.
	next := func(timeout time.Duration, what string) udpReply {
		t.Helper()
		select {
		case r := <-replies:
			if r.err != nil {
				halt()
				e.fatalf("%s: %v", what, r.err)
			}
			if r.from != addr {
				halt()
				e.fatalf("%s: a reply from %s, want %s (the ClusterIP)", what, r.from, addr)
			}
			return r
		case <-time.After(timeout):
			halt()
			e.fatalf("%s: no reply within %s", what, timeout.Round(time.Millisecond))
		}
		panic("unreachable")
	}

	for i := range 10 {
		if r := next(requestTimeout, fmt.Sprintf("reply %d before the replacement", i+1)); r.r.Pod != old.Name {
			halt()
			e.fatalf("reply %d before the replacement from %s, want %s", i+1, r.r.Pod, old.Name)
		}
	}
	began := time.Now()
	if err := e.k.CoreV1().Pods(e.ns).Delete(e.ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		halt()
		e.fatalf("deleting pod %s: %v", old.Name, err)
	}
	deadline := began.Add(switchTimeout)
	var lastOld time.Time
	var first udpReply
	for {
		r := next(time.Until(deadline), fmt.Sprintf("the same socket reaching the new pod within %s of the deletion "+
			"(a stale conntrack entry keeps it on the old pod's address %s?)", switchTimeout, old.Status.PodIP))
		if r.r.Pod != old.Name {
			first = r
			break
		}
		lastOld = r.at
	}
	for i := range afterSwitch {
		if r := next(requestTimeout, fmt.Sprintf("reply %d after the switch", i+1)); r.r.Pod != first.r.Pod {
			halt()
			e.fatalf("reply %d after the switch to %s came from %s", i+1, first.r.Pod, r.r.Pod)
		}
	}
	halt()
	gap := "none"
	if !lastOld.IsZero() {
		gap = first.at.Sub(lastOld).Round(time.Millisecond).String()
	}
	t.Logf("%d datagrams sent from one socket; %s answered %s after the deletion of %s (last answer of %s %s after it; gap %s)",
		sent, first.r.Pod, first.at.Sub(began).Round(time.Millisecond), old.Name, old.Name,
		lastOld.Sub(began).Round(time.Millisecond), gap)

	got, err := e.k.CoreV1().Pods(e.ns).Get(e.ctx, first.r.Pod, metav1.GetOptions{})
	switch {
	case err != nil:
		e.fatalf("the pod that answered, %s: %v", first.r.Pod, err)
	case got.Labels["app"] != "dns":
		e.fatalf("%s answered, not a pod of the Deployment", first.r.Pod)
	case got.Status.PodIP == old.Status.PodIP:
		e.fatalf("the new pod %s has the old pod's address %s: nothing proven", got.Name, got.Status.PodIP)
	}
}

// TestConfigFile: kproxy started with --config (a KubeProxyConfiguration
// moving the metrics and health servers, with the mode's sync periods) on
// one node, beside the cluster's flags, serves traffic and its servers
// where the file puts them; restarted with the cluster's flags it is back
// on the default ports.
func TestConfigFile(t *testing.T) { inMode(t, testConfigFile) }

func testConfigFile(t *testing.T) {
	const (
		node = 3
		// The file's ports, instead of metricsPort and healthzPort.
		fileMetricsPort = 10349
		fileHealthzPort = 10356
	)
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 2})
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeNodePort))
	e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
	works := func(e *env) {
		e.t.Helper()
		e.expectTraffic(cluster.TargetClient, "tcp", hostPort(cluster.NodeIP(node), svc.Spec.Ports[0].NodePort), 20, expect{all: names(pods, "")})
		e.expectTraffic(nodeName(node), "tcp", hostPort(svc.Spec.ClusterIP, servicePort), 20, expect{all: names(pods, "")})
	}
	// The file says nothing of the kubeconfig and the node name: the
	// cluster's --kubeconfig and --hostname-override give them.
	config := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: %s
clusterCIDR: %s
metricsBindAddress: 127.0.0.1:%d
healthzBindAddress: 0.0.0.0:%d
%s`, e.c.Mode(), cluster.ClusterCIDR, fileMetricsPort, fileHealthzPort, modeConfigSection(e.c.Mode()))
	path := filepath.Join(e.c.StateDir(), e.ns+"-kproxy-config.yaml")
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.Remove(path) })

	g := e.guardKproxy(nodeName(node))
	g.stop()
	offset := logSize(e.c.KproxyLog(nodeName(node)))
	g.start("--config=" + path)

	t.Run("file read without warnings", func(t *testing.T) {
		e := e.sub(t)
		data, err := os.ReadFile(e.c.KproxyLog(nodeName(node)))
		if err != nil {
			t.Fatal(err)
		}
		text := string(data[min(offset, int64(len(data))):])
		if !strings.Contains(text, `"Loaded the config file"`) {
			e.fatalf("the log of kproxy on %s does not show the config file loaded", nodeName(node))
		}
		for line := range strings.SplitSeq(text, "\n") {
			if strings.Contains(line, "config file setting not honoured") {
				t.Errorf("warning: %s", line)
			}
		}
	})
	t.Run("servers on the file's ports", func(t *testing.T) {
		e := e.sub(t)
		e.eventually("/proxyMode on the file's metrics port", programTimeout, func() error {
			a, err := e.get(nodeName(node), metricsURL(fileMetricsPort, "/proxyMode"))
			if err != nil {
				return err
			}
			if a.code != http.StatusOK || string(a.body) != e.c.Mode() {
				return fmt.Errorf("%s, want HTTP 200 %q", a, e.c.Mode())
			}
			return nil
		})
		// Every family's first sync, not only the one kproxySynced saw.
		e.eventually("sync metrics on the file's metrics port", programTimeout, func() error {
			_, err := e.scrapeSync(nodeName(node), fileMetricsPort)
			return err
		})
		e.eventually("/healthz on the file's health port", programTimeout, func() error {
			return e.checkHealth(cluster.TargetClient, hostPort(cluster.NodeIP(node), fileHealthzPort), "healthz", http.StatusOK, new(true))
		})
		e.expectRefused(nodeName(node), metricsURL(metricsPort, "/metrics"))
		e.expectRefused(cluster.TargetClient, "http://"+hostPort(cluster.NodeIP(node), healthzPort)+"/healthz")
	})
	t.Run("services work", func(t *testing.T) { works(e.sub(t)) })
	if t.Failed() {
		return
	}

	t.Run("restored to the cluster's flags", func(t *testing.T) {
		e := e.sub(t)
		g.stop()
		g.start()
		e.eventually("/proxyMode on the default metrics port", programTimeout, func() error {
			_, err := e.scrapeSync(nodeName(node), metricsPort)
			return err
		})
		e.expectRefused(nodeName(node), metricsURL(fileMetricsPort, "/metrics"))
		works(e)
	})
}

// eventCounts sums, per source host, the Count of the Events listed (an
// Event recorded again is the same object with a higher Count).
func eventCounts(events []v1.Event) map[string]int {
	out := map[string]int{}
	for _, ev := range events {
		out[ev.Source.Host] += max(int(ev.Count), 1)
	}
	return out
}

// TestEvents: kproxy records a Normal Starting event on its Node, and one
// Warning event per kproxy on a Service whose topologyKeys annotation is
// malformed: once per change of the problem, never again on the syncs
// that follow, nor on an update that leaves the problem as it is.
func TestEvents(t *testing.T) { inMode(t, testEvents) }

func testEvents(t *testing.T) {
	e := newEnv(t)

	t.Run("Starting on every Node", func(t *testing.T) {
		e := e.sub(t)
		for _, node := range e.c.NodeNames() {
			selector := fields.Set{
				"involvedObject.kind": "Node", "involvedObject.name": node,
				"source": "kproxy", "reason": "Starting",
			}.String()
			e.eventually("a Starting event on Node "+node, programTimeout, func() error {
				list, err := e.k.CoreV1().Events("").List(e.ctx, metav1.ListOptions{FieldSelector: selector})
				if err != nil {
					return err
				}
				for _, ev := range list.Items {
					if ev.Type == v1.EventTypeNormal && ev.Source.Host == node && strings.Contains(ev.Message, "Starting kproxy") {
						return nil
					}
				}
				return fmt.Errorf("%d events match %s, none Normal from host %s saying Starting kproxy: %v", len(list.Items), selector, node, list.Items)
			})
		}
	})

	t.Run("malformed topologyKeys", func(t *testing.T) {
		e := e.sub(t)
		sel := map[string]string{"app": "web"}
		e.deploy(workload{name: "web", replicas: 1})
		svc := e.createService("web", sel, func(s *v1.Service) {
			s.Annotations = map[string]string{"topologyKeys": "{broken"}
		})
		selector := fields.Set{
			"involvedObject.kind": "Service", "involvedObject.name": svc.Name,
			"reason": eventReasonInvalidTopologyKeys,
		}.String()
		warnings := func() ([]v1.Event, error) {
			list, err := e.k.CoreV1().Events(e.ns).List(e.ctx, metav1.ListOptions{FieldSelector: selector})
			if err != nil {
				return nil, err
			}
			for _, ev := range list.Items {
				if ev.Type != v1.EventTypeWarning || ev.Source.Component != "kproxy" {
					return nil, fmt.Errorf("event %s: type %s from %s, want a Warning from kproxy", ev.Name, ev.Type, ev.Source.Component)
				}
			}
			return list.Items, nil
		}
		// perNode checks that each node's kproxy recorded n warnings.
		perNode := func(n int) error {
			events, err := warnings()
			if err != nil {
				return err
			}
			want := map[string]int{}
			for _, node := range e.c.NodeNames() {
				want[node] = n
			}
			if got := eventCounts(events); !maps.Equal(got, want) {
				return fmt.Errorf("warnings per kproxy %v, want %v", got, want)
			}
			return nil
		}
		// syncedTwice waits until every kproxy synced twice more.
		syncedTwice := func(what string) {
			before := map[string]float64{}
			for _, node := range e.c.NodeNames() {
				m, err := e.scrapeSync(node, metricsPort)
				if err != nil {
					e.fatalf("scraping kproxy on %s: %v", node, err)
				}
				before[node] = m.syncs
			}
			// Endpoint changes: a sync on every node at once.
			e.scale("web", 2)
			e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
			e.scale("web", 1)
			e.waitEndpoints(svc.Name, "1 ready", readyCount(1))
			e.eventually("every kproxy synced twice "+what, 2*programTimeout, func() error {
				for _, node := range e.c.NodeNames() {
					m, err := e.scrapeSync(node, metricsPort)
					if err != nil {
						return err
					}
					if m.syncs < before[node]+2 {
						return fmt.Errorf("%s: %v syncs since, want 2", node, m.syncs-before[node])
					}
				}
				return nil
			})
		}

		e.eventually("one warning from each kproxy", programTimeout, func() error { return perNode(1) })
		// An update that keeps the problem (a label) and syncs.
		e.updateService(svc.Name, func(s *v1.Service) { s.Labels = map[string]string{"touched": "yes"} })
		syncedTwice("after the first warning")
		if err := perNode(1); err != nil {
			e.fatalf("after an update keeping the problem and two syncs: %v", err)
		}

		// Another malformed value: another problem, one more warning.
		e.updateService(svc.Name, func(s *v1.Service) {
			s.Annotations["topologyKeys"] = fmt.Sprintf("[%q, %q]", cluster.LabelGroup, cluster.LabelGroup)
		})
		e.eventually("a second warning from each kproxy", programTimeout, func() error { return perNode(2) })
		events, err := warnings()
		if err != nil {
			t.Fatal(err)
		}
		messages := map[string]bool{}
		for _, ev := range events {
			messages[ev.Message] = true
		}
		if len(messages) != 2 {
			t.Errorf("warning messages %v, want one per malformed value", slices.Collect(maps.Keys(messages)))
		}

		// Fixed: nothing more to report.
		e.updateService(svc.Name, func(s *v1.Service) {
			s.Annotations["topologyKeys"] = fmt.Sprintf("[%q]", cluster.LabelGroup)
		})
		syncedTwice("after the fix")
		if err := perNode(2); err != nil {
			e.fatalf("after the fix and two syncs: %v", err)
		}
	})
}

// TestGracefulShutdown: kproxy stopped with SIGTERM logs its orderly stop
// and leaves its rules in place: the external client through the node's
// NodePort, a pod on the node and the node itself still reach the Service
// while no kproxy runs there; a new kproxy takes over.
func TestGracefulShutdown(t *testing.T) { inMode(t, testGracefulShutdown) }

func testGracefulShutdown(t *testing.T) {
	const node = 3
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 2})
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeNodePort))
	e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
	clientPod, _ := e.clientPod("client", nodeName(node))
	clusterIP := hostPort(svc.Spec.ClusterIP, servicePort)
	paths := []struct{ name, from, addr string }{
		{"client to NodePort", cluster.TargetClient, hostPort(cluster.NodeIP(node), svc.Spec.Ports[0].NodePort)},
		{"pod to ClusterIP", clientPod, clusterIP},
		{"node to ClusterIP", nodeName(node), clusterIP},
	}
	for _, p := range paths {
		e.expectTraffic(p.from, "tcp", p.addr, 20, expect{all: names(pods, "")})
	}
	// serviceRules are kproxy's rules on the node that name this test's
	// namespace or its Service's ClusterIP.
	serviceRules := func() []string {
		lines, err := e.kproxyRules(e.ctx, nodeName(node))
		if err != nil {
			e.fatalf("%v", err)
		}
		if !hasKproxyState(e.c.Mode(), lines) {
			e.fatalf("no kproxy chain or table on %s in %s mode", nodeName(node), e.c.Mode())
		}
		return mentions(lines, e.ns, svc.Spec.ClusterIP)
	}
	before := serviceRules()
	if len(before) == 0 {
		e.fatalf("no kproxy rule of %s or %s on %s", e.ns, svc.Spec.ClusterIP, nodeName(node))
	}

	g := e.guardKproxy(nodeName(node))
	offset := logSize(e.c.KproxyLog(nodeName(node)))
	g.stop()
	data, err := os.ReadFile(e.c.KproxyLog(nodeName(node)))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data[min(offset, int64(len(data))):]), "kproxy stopped; rules stay in place") {
		e.fatalf("kproxy on %s did not log an orderly stop after SIGTERM", nodeName(node))
	}
	if after := serviceRules(); !slices.Equal(after, before) {
		e.fatalf("the Service's rules changed when kproxy stopped:\nbefore:\n%s\nafter:\n%s",
			strings.Join(before, "\n"), strings.Join(after, "\n"))
	}
	for _, p := range paths {
		t.Run(p.name+" with kproxy stopped", func(t *testing.T) {
			e := e.sub(t)
			s, err := e.sample(p.from, "tcp", p.addr, 20)
			if err != nil {
				e.fatalf("with kproxy stopped: %v", err)
			}
			if err := (expect{all: names(pods, "")}).check(s); err != nil {
				e.fatalf("with kproxy stopped: %v", err)
			}
		})
	}
	if t.Failed() {
		return
	}

	t.Run("a new kproxy takes over", func(t *testing.T) {
		e := e.sub(t)
		g.start()
		for _, p := range paths {
			e.expectTraffic(p.from, "tcp", p.addr, 20, expect{all: names(pods, "")})
		}
	})
}
