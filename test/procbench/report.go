package procbench

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// Report is the JSON the benchmark writes.
type Report struct {
	Generated time.Time         `json:"generated"`
	Host      map[string]string `json:"host"`
	Method    map[string]string `json:"method"`
	Runs      []Result          `json:"runs"`
	// Floors are the floor program's runs (floor.go).
	Floors []FloorResult `json:"floors,omitempty"`
}

// NewReport returns a report of runs with the host's description and the
// method's.
func NewReport(runs []Result, notes map[string]string) Report {
	host := map[string]string{"cpus": fmt.Sprint(runtime.NumCPU())}
	if data, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		host["kernel"] = strings.TrimSpace(string(data))
	}
	method := map[string]string{
		"objects": fmt.Sprintf("N ClusterIP Services of one TCP port, each with one EndpointSlice of %d ready endpoints "+
			"(managed-by and service-name labels, owner reference, trigger-time annotation, node and zone), "+
			"endpoints spread over %d nodes; the Node objects of realistic size when present", EndpointsPerService, EndpointNodes),
		"api":        "the local cluster's etcd and kube-apiserver only, in their network namespace",
		"kproxy":     "the real kproxy binary in a network namespace of its own on the cluster's switch, default sync periods",
		"change":     "one endpoint's address (a new Pod) in one Service's EndpointSlice, written with an Update; changes spaced so that kproxy is idle past its minimum sync period",
		"change_end": "the kernel commit: the first notification of the last nf_tables transaction changing IPv4 rules before kproxy's sync ended, received on a netlink socket in kproxy's namespace",
		"synced":     "the time kproxy records after the sync: /healthz's IPv4 lastUpdated once the commit is seen, else kubeproxy_sync_proxy_rules_last_timestamp_seconds",
		"cpu":        "run time of kproxy's threads (/proc/<pid>/task/*/schedstat, ns, summed over the changes) from before the change to 20 ms after its commit, before any read of kproxy's endpoints (without a commit seen: to the sync's end, less the calibrated cost of the /metrics reads); child CPU is cutime+cstime (iptables-restore, nft -f) plus the run time of running children (the nft -i session)",
		"rss":        "VmHWM of kproxy (/proc/<pid>/status)",
	}
	for k, v := range notes {
		method[k] = v
	}
	return Report{Generated: time.Now().UTC().Truncate(time.Second), Host: host, Method: method, Runs: runs}
}

// Write writes the report as indented JSON to path, creating its directory.
func (r Report) Write(path string) error {
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding the report: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("creating the report's directory: %w", err)
	}
	if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

// TableHeader is the header of TableLine's table.
func TableHeader() string {
	return fmt.Sprintf("%-9s %8s %6s %10s %10s %10s %11s %11s %11s %11s %9s %10s %10s %7s %9s",
		"mode", "services", "nodes", "first-sync", "change-p50", "change-p90", "cpu/change", "child/chg", "cpu-p50", "child-p50", "share-p50", "switch/chg", "alloc/chg", "gc/chg", "peak-rss")
}

// TableLine renders one run under TableHeader.
func TableLine(r Result) string {
	if r.Skipped != "" {
		return fmt.Sprintf("%-9s %8d %6d skipped: %s", r.Mode, r.Services, r.Nodes, r.Skipped)
	}
	return fmt.Sprintf("%-9s %8d %6d %8.2f s %7.1f ms %7.1f ms %8.2f ms %8.2f ms %8.2f ms %8.2f ms %8.1f%% %10.1f %6.0f KiB %7.2f %5.0f MiB",
		r.Mode, r.Services, r.Nodes, r.FirstSyncS, r.ChangeP50Ms, r.ChangeP90Ms,
		r.CPUMsPerChange, r.ChildCPUMsPerChange, r.CPUP50Ms, r.ChildCPUP50Ms, 100*r.ShareP50,
		r.SwitchesPerChange, r.AllocKiBPerChange, r.GCsPerChange, r.PeakRSSMiB)
}
