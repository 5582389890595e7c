package procbench

import (
	"bufio"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Samples are the samples of a Prometheus text exposition, keyed by series:
// the metric name and its labels sorted by name, `name{a="1",b="2"}`.
type Samples map[string]float64

// ParseSamples parses the Prometheus text format (what kproxy's /metrics
// serves): comments are skipped, a trailing timestamp is ignored.
func ParseSamples(text string) (Samples, error) {
	out := Samples{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for line := 1; sc.Scan(); line++ {
		l := strings.TrimSpace(sc.Text())
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		var name, labels, rest string
		if i := strings.IndexByte(l, '{'); i >= 0 {
			j := strings.LastIndexByte(l, '}')
			if j < i {
				return nil, fmt.Errorf("line %d: unbalanced braces: %q", line, l)
			}
			name, labels, rest = l[:i], l[i+1:j], l[j+1:]
		} else {
			f := strings.SplitN(l, " ", 2)
			if len(f) != 2 {
				return nil, fmt.Errorf("line %d: no value: %q", line, l)
			}
			name, rest = f[0], f[1]
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			return nil, fmt.Errorf("line %d: no value: %q", line, l)
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil {
			return nil, fmt.Errorf("line %d: value %q: %w", line, fields[0], err)
		}
		pairs, err := parseLabels(labels)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", line, err)
		}
		out[seriesKey(name, pairs)] = v
	}
	return out, sc.Err()
}

// parseLabels parses `a="1",b="2"` into name, value pairs.
func parseLabels(s string) ([][2]string, error) {
	var out [][2]string
	for s = strings.TrimSpace(s); s != ""; {
		eq := strings.IndexByte(s, '=')
		if eq < 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			return nil, fmt.Errorf("malformed labels %q", s)
		}
		name := strings.TrimSpace(s[:eq])
		var val strings.Builder
		i := eq + 2
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
				switch s[i] {
				case 'n':
					val.WriteByte('\n')
				default:
					val.WriteByte(s[i])
				}
				continue
			}
			val.WriteByte(s[i])
		}
		if i >= len(s) {
			return nil, fmt.Errorf("unterminated label value in %q", s)
		}
		out = append(out, [2]string{name, val.String()})
		s = strings.TrimLeft(strings.TrimSpace(s[i+1:]), ",")
		s = strings.TrimSpace(s)
	}
	return out, nil
}

// seriesKey renders a series with its labels sorted by name.
func seriesKey(name string, pairs [][2]string) string {
	if len(pairs) == 0 {
		return name
	}
	pairs = slices.Clone(pairs)
	slices.SortFunc(pairs, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	var b strings.Builder
	b.WriteString(name)
	b.WriteByte('{')
	for i, p := range pairs {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%s=%q", p[0], p[1])
	}
	b.WriteByte('}')
	return b.String()
}

// Get returns the sample of name with the given labels (name, value,
// name, value...), and whether there is one.
func (s Samples) Get(name string, labels ...string) (float64, bool) {
	var pairs [][2]string
	for i := 0; i+1 < len(labels); i += 2 {
		pairs = append(pairs, [2]string{labels[i], labels[i+1]})
	}
	v, ok := s[seriesKey(name, pairs)]
	return v, ok
}

// The kproxy metrics (kube-proxy's names) the benchmark reads.
const (
	metricSyncs           = "kubeproxy_sync_proxy_rules_duration_seconds_count"
	metricFullSyncs       = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
	metricLastSync        = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
	metricEndpointChanges = "kubeproxy_sync_proxy_rules_endpoint_changes_total"
	metricNetProgCount    = "kubeproxy_network_programming_duration_seconds_count"
	metricNetProgSum      = "kubeproxy_network_programming_duration_seconds_sum"
	metricRestoreFailures = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
	metricAllocBytes      = "go_memstats_alloc_bytes_total"
	metricGCCycles        = "go_gc_duration_seconds_count"
)

// syncState is what the benchmark follows of kproxy's IPv4 syncs.
type syncState struct {
	// Syncs and FullSyncs count sync attempts.
	Syncs, FullSyncs float64
	// LastSync is when the last successful sync ended (kproxy takes it
	// after the kernel accepted the rules); zero before the first.
	LastSync time.Time
	// EndpointChanges counts the per-Service endpoint changes synced.
	EndpointChanges float64
	// NetProgCount and NetProgSum are kproxy's own network programming
	// latency histogram: trigger time to the end of the sync.
	NetProgCount, NetProgSum float64
	// Failures counts failed syncs.
	Failures float64
	// AllocBytes and GCCycles are the Go runtime's: bytes allocated and
	// collections completed since the start.
	AllocBytes, GCCycles float64
}

// syncStateOf extracts the IPv4 sync state from samples.
func syncStateOf(s Samples) syncState {
	const fam = "ip_family"
	get := func(name string, labels ...string) float64 {
		v, _ := s.Get(name, labels...)
		return v
	}
	st := syncState{
		Syncs:           get(metricSyncs, fam, "IPv4"),
		FullSyncs:       get(metricFullSyncs, fam, "IPv4"),
		EndpointChanges: get(metricEndpointChanges),
		NetProgCount:    get(metricNetProgCount, fam, "IPv4"),
		NetProgSum:      get(metricNetProgSum, fam, "IPv4"),
		Failures:        get(metricRestoreFailures, fam, "IPv4"),
		AllocBytes:      get(metricAllocBytes),
		GCCycles:        get(metricGCCycles),
	}
	if v := get(metricLastSync, fam, "IPv4"); v > 0 {
		sec, frac := math.Modf(v)
		st.LastSync = time.Unix(int64(sec), int64(math.Round(frac*1e9)))
	}
	return st
}
