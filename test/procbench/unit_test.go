package procbench

import (
	"encoding/binary"
	"encoding/json"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestParseSamples(t *testing.T) {
	const text = `# HELP kubeproxy_sync_proxy_rules_duration_seconds SyncProxyRules latency in seconds
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram
kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="+Inf"} 7
kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv4"} 7
kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family="IPv6"} 2
kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family="IPv4"} 1
kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.7646123456789012e+09
kubeproxy_sync_proxy_rules_endpoint_changes_total 12
kubeproxy_network_programming_duration_seconds_sum{ip_family="IPv4"} 0.75
kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"} 3
kubeproxy_sync_proxy_rules_iptables_total{ip_family="IPv4",table="nat"} 40
kubeproxy_sync_proxy_rules_iptables_total{table="filter",ip_family="IPv4"} 2
weird{a="x\"y,z",b="2"} 5 1700000000000
`
	s, err := ParseSamples(text)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name   string
		metric string
		labels []string
		want   float64
		ok     bool
	}{
		{name: "labelled", metric: metricSyncs, labels: []string{"ip_family", "IPv6"}, want: 2, ok: true},
		{name: "bucket with +Inf", metric: "kubeproxy_sync_proxy_rules_duration_seconds_bucket", labels: []string{"le", "+Inf", "ip_family", "IPv4"}, want: 7, ok: true},
		{name: "no labels", metric: metricEndpointChanges, want: 12, ok: true},
		{name: "labels in any order", metric: "kubeproxy_sync_proxy_rules_iptables_total", labels: []string{"table", "filter", "ip_family", "IPv4"}, want: 2, ok: true},
		{name: "escaped quote and comma, timestamp", metric: "weird", labels: []string{"b", "2", "a", `x"y,z`}, want: 5, ok: true},
		{name: "missing", metric: metricSyncs, labels: []string{"ip_family", "IPv5"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := s.Get(tc.metric, tc.labels...)
			if got != tc.want || ok != tc.ok {
				t.Errorf("Get = %v, %v; want %v, %v", got, ok, tc.want, tc.ok)
			}
		})
	}
	st := syncStateOf(s)
	want := syncState{Syncs: 7, FullSyncs: 1, EndpointChanges: 12, NetProgCount: 3, NetProgSum: 0.75}
	if got := st.LastSync.UnixMicro(); got != 1764612345678901 {
		t.Errorf("LastSync = %v (%d µs)", st.LastSync, got)
	}
	st.LastSync = time.Time{}
	if st != want {
		t.Errorf("syncStateOf = %+v, want %+v", st, want)
	}
	if got := ruleCount(s); got != 42 {
		t.Errorf("ruleCount = %d, want 42", got)
	}
}

func TestParseSamplesErrors(t *testing.T) {
	for _, tc := range []struct{ name, text string }{
		{name: "no value", text: "metric\n"},
		{name: "bad value", text: "metric abc\n"},
		{name: "unterminated labels", text: `metric{a="1} 3` + "\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := ParseSamples(tc.text); err == nil {
				t.Errorf("ParseSamples(%q) succeeded", tc.text)
			}
		})
	}
}

func TestParseProc(t *testing.T) {
	// A command name with a space and a parenthesis; utime 150, stime 30,
	// cutime 20, cstime 7 ticks.
	stat := []byte("4242 (kp (x) y) S 1 4242 4242 0 -1 4194560 1000 0 0 0 150 30 20 7 20 0 12 0 99 1000000 5000 18446744073709551615\n")
	u, err := parseStatCPU(stat)
	if err != nil {
		t.Fatal(err)
	}
	if u.CPU != 1800*time.Millisecond || u.ChildCPU != 270*time.Millisecond {
		t.Errorf("CPU %v, child %v; want 1.8s, 270ms", u.CPU, u.ChildCPU)
	}
	status := []byte("Name:\tkproxy\nVmPeak:\t  900000 kB\nVmHWM:\t   51200 kB\nVmRSS:\t   40960 kB\nThreads:\t9\n")
	hwm, rss, err := parseStatusMemory(status)
	if err != nil {
		t.Fatal(err)
	}
	if hwm != 50<<20 || rss != 40<<20 {
		t.Errorf("HWM %d, RSS %d; want 50 MiB, 40 MiB", hwm, rss)
	}
	for _, tc := range []struct {
		name string
		err  func() error
	}{
		{name: "stat without name", err: func() error { _, err := parseStatCPU([]byte("1 kproxy S 1")); return err }},
		{name: "short stat", err: func() error { _, err := parseStatCPU([]byte("1 (kproxy) S 1 2 3")); return err }},
		{name: "status without memory", err: func() error { _, _, err := parseStatusMemory([]byte("Name:\tkthreadd\n")); return err }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.err() == nil {
				t.Error("no error")
			}
		})
	}
}

// nlmsg renders one netlink message of type typ with an nfgenmsg of
// family and the given attributes.
func nlmsg(typ uint16, family uint8, attrs ...[]byte) []byte {
	payload := []byte{family, 0, 0, 0}
	for _, a := range attrs {
		payload = append(payload, a...)
		for len(payload)%4 != 0 {
			payload = append(payload, 0)
		}
	}
	b := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(payload))
	binary.NativeEndian.PutUint32(b[0:4], uint32(unix.NLMSG_HDRLEN+len(payload)))
	binary.NativeEndian.PutUint16(b[4:6], typ)
	return append(b, payload...)
}

func nlattr(typ uint16, v []byte) []byte {
	b := make([]byte, 4, 4+len(v))
	binary.NativeEndian.PutUint16(b[0:2], uint16(4+len(v)))
	binary.NativeEndian.PutUint16(b[2:4], typ)
	return append(b, v...)
}

func be32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

func TestNetlinkParsing(t *testing.T) {
	newRule := uint16(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWRULE)
	datagram := slices.Concat(
		nlmsg(newRule, unix.NFPROTO_IPV4, nlattr(1, []byte("nat\x00"))),
		nlmsg(newGenType, unix.AF_UNSPEC,
			nlattr(unix.NFTA_GEN_ID, be32(77)),
			nlattr(unix.NFTA_GEN_PROC_PID, be32(4242)),
			nlattr(unix.NFTA_GEN_PROC_NAME, []byte("iptables-nft-re\x00"))),
	)
	msgs := splitNetlink(datagram)
	if len(msgs) != 2 || msgs[0].typ != newRule || msgs[1].typ != newGenType {
		t.Fatalf("splitNetlink = %+v", msgs)
	}
	ev := parseNewGen(msgs[1].payload)
	if ev.Gen != 77 || ev.PID != 4242 || ev.Proc != "iptables-nft-re" {
		t.Errorf("parseNewGen = %+v", ev)
	}
	if got := splitNetlink(datagram[:len(datagram)-3]); len(got) != 1 {
		t.Errorf("a truncated tail: %d messages, want 1", len(got))
	}

	for _, tc := range []struct {
		name     string
		families uint32
		lost     bool
		want     bool
	}{
		{name: "ip", families: 1 << unix.NFPROTO_IPV4, want: true},
		{name: "inet", families: 1 << unix.NFPROTO_INET, want: true},
		{name: "ip6 only", families: 1 << unix.NFPROTO_IPV6},
		{name: "ip with notifications lost", families: 1 << unix.NFPROTO_IPV4, lost: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t0 := time.Unix(100, 0)
			evs := []CommitEvent{
				{At: t0.Add(5 * time.Millisecond), Families: 1 << unix.NFPROTO_IPV4},
				{At: t0.Add(9 * time.Millisecond), Families: tc.families, Lost: tc.lost},
			}
			want := 5 * time.Millisecond
			if tc.want {
				want = 9 * time.Millisecond
			}
			if got := lastIPv4Commit(evs, t0); got != want {
				t.Errorf("lastIPv4Commit = %v, want %v", got, want)
			}
		})
	}
}

func TestObjects(t *testing.T) {
	seen := map[string]bool{}
	cluster := netip.MustParsePrefix(ClusterCIDR)
	for i := range MaxServices {
		for j := range EndpointsPerService {
			ip := endpointIP(i, j)
			if seen[ip] {
				t.Fatalf("endpoint %d of Service %d: address %s used twice", j, i, ip)
			}
			seen[ip] = true
		}
	}
	for _, tc := range []struct{ i, j, change int }{{0, 0, 1}, {9999, 9, 30}, {MaxServices - 1, 3, 154}, {17, 2, 155}} {
		n := endpointNode(tc.i, tc.j)
		podCIDR := netip.MustParsePrefix(nodePodCIDR(n))
		for _, ip := range []string{endpointIP(tc.i, tc.j), changedIP(tc.i, tc.j, tc.change)} {
			a := netip.MustParseAddr(ip)
			if !podCIDR.Contains(a) || !cluster.Contains(a) {
				t.Errorf("%s is not in node %d's podCIDR %s within %s", ip, n, podCIDR, ClusterCIDR)
			}
		}
		if seen[changedIP(tc.i, tc.j, tc.change)] {
			t.Errorf("changed address %s is a first address", changedIP(tc.i, tc.j, tc.change))
		}
	}

	svc := serviceObject(42)
	svc.UID = uid("Service", svc.Name)
	slice := endpointSliceObject(svc, 42, time.Now())
	if slice.Labels["kubernetes.io/service-name"] != svc.Name || slice.Labels["endpointslice.kubernetes.io/managed-by"] != managedBy {
		t.Errorf("slice labels %v", slice.Labels)
	}
	if len(slice.Endpoints) != EndpointsPerService || !*slice.Endpoints[3].Conditions.Ready {
		t.Errorf("slice endpoints %+v", slice.Endpoints)
	}
	node := nodeObject(12, nodeHostIP(12), metav1.Now())
	data, err := json.Marshal(node)
	if err != nil {
		t.Fatal(err)
	}
	if len(data) < 4000 || len(node.Labels) < 10 || len(node.Annotations) != 10 || len(node.Status.Images) != 20 {
		t.Errorf("node of %d bytes, %d labels, %d annotations, %d images: not a realistic size",
			len(data), len(node.Labels), len(node.Annotations), len(node.Status.Images))
	}
	if node.Labels["topology.kubernetes.io/zone"] != zone(12) {
		t.Errorf("node zone label %q", node.Labels["topology.kubernetes.io/zone"])
	}
}

func TestParseConfig(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     map[string]string
		want    []Step
		modes   []string
		floor   bool
		wantErr bool
	}{
		{
			name:  "defaults",
			want:  []Step{{1000, 1}, {10000, 1}, {10000, 5000}},
			modes: []string{"iptables", "nftables"},
			floor: true,
		},
		{
			name:  "one size, no nodes, one mode: no floor without nftables",
			env:   map[string]string{EnvServices: "1000", EnvNodes: "0", EnvModes: "iptables"},
			want:  []Step{{1000, 1}},
			modes: []string{"iptables"},
		},
		{
			name:  "sizes sorted and deduplicated",
			env:   map[string]string{EnvServices: "500 100 500", EnvNodes: "200"},
			want:  []Step{{100, 1}, {500, 1}, {500, 200}},
			modes: []string{"iptables", "nftables"},
			floor: true,
		},
		{
			name:  "floor left out",
			env:   map[string]string{EnvFloor: "0"},
			want:  []Step{{1000, 1}, {10000, 1}, {10000, 5000}},
			modes: []string{"iptables", "nftables"},
		},
		{name: "bad size", env: map[string]string{EnvServices: "ten"}, wantErr: true},
		{name: "too many services", env: map[string]string{EnvServices: "50000"}, wantErr: true},
		{name: "too many nodes", env: map[string]string{EnvNodes: "9000"}, wantErr: true},
		{name: "bad changes", env: map[string]string{EnvChanges: "0"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseConfig(func(k string) string { return tc.env[k] })
			if tc.wantErr {
				if err == nil {
					t.Errorf("no error; config %+v", c)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := c.Steps(); !slices.Equal(got, tc.want) {
				t.Errorf("Steps = %v, want %v", got, tc.want)
			}
			if !slices.Equal(c.Modes, tc.modes) {
				t.Errorf("Modes = %v, want %v", c.Modes, tc.modes)
			}
			if c.Floor != tc.floor {
				t.Errorf("Floor = %v, want %v", c.Floor, tc.floor)
			}
		})
	}
}

func TestFloorLine(t *testing.T) {
	f := FloorResult{Services: 10000, Changes: 60, CPUP50Ms: 0.25, CPUMeanMs: 0.3, ChildCPUP50Ms: 0.5, SwitchesP50: 3}
	for _, tc := range []struct {
		name string
		r    *Result
		want string
	}{
		{name: "alone", want: "floor, 10000 Services: own CPU p50 0.25 ms (mean 0.30), its nft's 0.50 ms, 3 switches, over 60 changes"},
		{name: "beside kproxy", r: &Result{CPUP50Ms: 0.5, ChildCPUP50Ms: 0.75, ShareP50: 0.4},
			want: "floor, 10000 Services: own CPU p50 0.25 ms (mean 0.30), its nft's 0.50 ms, 3 switches, over 60 changes; " +
				"with kproxy's nft (0.75 ms) its share would be 25.0%, kproxy's is 40.0% (own CPU p50 0.50 ms)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := FloorLine(f, tc.r); got != tc.want {
				t.Errorf("FloorLine =\n%s\nwant\n%s", got, tc.want)
			}
		})
	}
}

func TestTableLine(t *testing.T) {
	r := Result{Mode: "iptables", Services: 10000, Nodes: 5000, FirstSyncS: 12.345, ChangeP50Ms: 401.2, ChangeP90Ms: 455.9,
		CPUMsPerChange: 120.5, ChildCPUMsPerChange: 210.25, CPUP50Ms: 118.25, ChildCPUP50Ms: 205.5, ShareP50: 0.365, SwitchesPerChange: 151.2, AllocKiBPerChange: 2048.5, GCsPerChange: 0.33, PeakRSSMiB: 301.4}
	if got, want := len(TableLine(r)), len(TableHeader()); got != want {
		t.Errorf("line of %d characters under a header of %d:\n%s\n%s", got, want, TableHeader(), TableLine(r))
	}
}

// TestReadUsageCountsLiveChildren: a running child's CPU is in ChildCPU
// before it is waited for (as the nft -i session's is), and the process's
// own CPU is read to the nanosecond from its threads' schedstat.
func TestReadUsageCountsLiveChildren(t *testing.T) {
	self, switches, ok := threadsRunTime(os.Getpid())
	if !ok || self <= 0 || switches <= 0 {
		t.Fatalf("threadsRunTime(self) = %v, %d, %v", self, switches, ok)
	}
	before, err := readUsage(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// A child that spins (in the shell itself, no subprocess) and then
	// waits to be killed.
	cmd := exec.Command("sh", "-c", `i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; exec sleep 60`)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	var after Usage
	for deadline := time.Now().Add(10 * time.Second); ; {
		if after, err = readUsage(os.Getpid()); err != nil {
			t.Fatal(err)
		}
		if after.ChildCPU-before.ChildCPU >= 50*time.Millisecond {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a running child's CPU is not counted: ChildCPU %v -> %v", before.ChildCPU, after.ChildCPU)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if after.CPU < before.CPU {
		t.Errorf("CPU went back: %v -> %v", before.CPU, after.CPU)
	}
}

func TestParseHealthzLastSync(t *testing.T) {
	at := time.Date(2026, 12, 2, 13, 40, 1, 123456789, time.UTC)
	for _, tc := range []struct {
		name, body string
		want       time.Time
		wantErr    bool
	}{
		{"healthy, two families", `{"lastUpdated":"2026-12-02T13:45:00Z","currentTime":"2026-12-02T13:45:00Z","healthy":true,"status":{"IPv4":{"lastUpdated":"2026-12-02T13:40:01.123456789Z","healthy":true},"IPv6":{"lastUpdated":"2026-12-02T13:39:00Z","healthy":true}}}`, at, false},
		{"before the first sync", `{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false,"status":{"IPv4":{"lastUpdated":"0001-01-01T00:00:00Z","healthy":false}}}`, time.Time{}, false},
		{"no IPv4 proxier", `{"healthy":true,"status":{"IPv6":{"lastUpdated":"2026-12-02T13:39:00Z","healthy":true}}}`, time.Time{}, false},
		{"not JSON", `404 page not found`, time.Time{}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseHealthzLastSync([]byte(tc.body))
			if (err != nil) != tc.wantErr || !got.Equal(tc.want) {
				t.Fatalf("parseHealthzLastSync = %v, %v; want %v (error %v)", got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		name string
		v    []float64
		want float64
	}{
		{name: "one", v: []float64{3}, want: 3},
		{name: "odd", v: []float64{9, 1, 5}, want: 5},
		{name: "even takes the lower middle", v: []float64{4, 1, 3, 2}, want: 2},
		{name: "none", v: nil, want: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := median(tc.v); got != tc.want {
				t.Errorf("median(%v) = %v, want %v", tc.v, got, tc.want)
			}
		})
	}
}

func TestShareP50(t *testing.T) {
	for _, tc := range []struct {
		name       string
		own, child []float64
		want       float64
	}{
		{name: "none", want: 0},
		{name: "one change", own: []float64{1}, child: []float64{3}, want: 0.25},
		// The median change by share, not the share of the medians: a
		// canary in one window moves neither.
		{name: "an outlier moves nothing", own: []float64{1, 1, 5}, child: []float64{9, 4, 45}, want: 0.1},
		{name: "a change with no CPU is left out", own: []float64{0, 1}, child: []float64{0, 1}, want: 0.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := shareP50(tc.own, tc.child); got != tc.want {
				t.Errorf("shareP50(%v, %v) = %v, want %v", tc.own, tc.child, got, tc.want)
			}
		})
	}
}
