package e2e

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kproxy/kproxy/test/cluster"
)

// The rounds' own logic; these run without a cluster (and without root).

func TestParseModes(t *testing.T) {
	runsOnce(t)
	tests := []struct {
		name    string
		in      string
		want    []string
		wantErr bool
	}{
		{name: "unset", in: "", want: []string{"iptables", "nftables"}},
		{name: "blank", in: "  ", want: []string{"iptables", "nftables"}},
		{name: "one", in: "nftables", want: []string{"nftables"}},
		{name: "spaces and commas", in: "iptables, nftables ipvs", want: []string{"iptables", "nftables", "ipvs"}},
		{name: "a mode twice", in: "iptables iptables", want: []string{"iptables", "iptables"}},
		{name: "unknown", in: "iptables userspace", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseModes(tc.in)
			if (err != nil) != tc.wantErr {
				t.Fatalf("parseModes(%q) = %v, want error %t", tc.in, err, tc.wantErr)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("parseModes(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
}

func TestParseRoundEnv(t *testing.T) {
	runsOnce(t)
	tests := []struct {
		name               string
		round, once, modes string
		want               roundInfo
		wantErr            bool
	}{
		{name: "unset: one round doing everything", want: roundInfo{index: 1, total: 1, once: true}},
		{name: "second round", round: "2/2", once: "false", modes: "iptables nftables",
			want: roundInfo{index: 2, total: 2, modes: []string{"iptables", "nftables"}}},
		{name: "first round", round: "1/3", once: "true", modes: "iptables",
			want: roundInfo{index: 1, total: 3, once: true, modes: []string{"iptables"}}},
		{name: "index past total", round: "3/2", wantErr: true},
		{name: "no total", round: "2", wantErr: true},
		{name: "bad once", round: "1/1", once: "yes please", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseRoundEnv(tc.round, tc.once, tc.modes)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %t", err, tc.wantErr)
			}
			if err == nil && (got.index != tc.want.index || got.total != tc.want.total || got.once != tc.want.once || !slices.Equal(got.modes, tc.want.modes)) {
				t.Errorf("= %+v, want %+v", got, tc.want)
			}
		})
	}
}

// fakeProbe answers ProbeMode's question from a table and counts calls.
type fakeProbe struct {
	results map[string]error
	calls   map[string]int
}

func (f *fakeProbe) probe(_ context.Context, mode string) error {
	f.calls[mode]++
	return f.results[mode]
}

func TestPlanRounds(t *testing.T) {
	runsOnce(t)
	unknown := fmt.Errorf("%w: kproxy rejects --proxy-mode=nftables", cluster.ErrModeUnknownToKproxy)
	noHost := fmt.Errorf("%w: no /proc/net/ip_vs", cluster.ErrHostLacksMode)
	broken := errors.New("kproxy: exec format error")
	tests := []struct {
		name     string
		modes    []string
		results  map[string]error
		wantRun  []string
		wantSkip []string
		wantFail []string
	}{
		{name: "every mode runs", modes: []string{"iptables", "nftables"}, wantRun: []string{"iptables", "nftables"}},
		{name: "mode unknown to kproxy: skipped", modes: []string{"iptables", "nftables"}, results: map[string]error{"nftables": unknown},
			wantRun: []string{"iptables"}, wantSkip: []string{"nftables"}},
		{name: "host lacks the mode: skipped", modes: []string{"ipvs", "iptables"}, results: map[string]error{"ipvs": noHost},
			wantRun: []string{"iptables"}, wantSkip: []string{"ipvs"}},
		{name: "broken kproxy: failed, not skipped", modes: []string{"iptables", "nftables"}, results: map[string]error{"nftables": broken},
			wantRun: []string{"iptables"}, wantFail: []string{"nftables"}},
		{name: "a mode twice: two rounds", modes: []string{"iptables", "iptables"}, wantRun: []string{"iptables", "iptables"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeProbe{results: tc.results, calls: map[string]int{}}
			rounds := planRounds(context.Background(), tc.modes, f.probe)
			var run, skip, fail []string
			for _, r := range rounds {
				switch {
				case r.skip != nil:
					skip = append(skip, r.mode)
				case r.err != nil:
					fail = append(fail, r.mode)
				}
			}
			for _, r := range runnable(rounds) {
				run = append(run, r.mode)
			}
			if !slices.Equal(run, tc.wantRun) || !slices.Equal(skip, tc.wantSkip) || !slices.Equal(fail, tc.wantFail) {
				t.Errorf("run %q skip %q fail %q; want %q, %q, %q", run, skip, fail, tc.wantRun, tc.wantSkip, tc.wantFail)
			}
			for mode, n := range f.calls {
				if n != 1 {
					t.Errorf("mode %s probed %d times, want once", mode, n)
				}
			}
		})
	}
}

func TestSummary(t *testing.T) {
	runsOnce(t)
	tests := []struct {
		name   string
		rounds []*round
		wantOK bool
		want   []string
	}{
		{
			name: "ok and skipped",
			rounds: []*round{
				{mode: "iptables", ran: true, took: 3 * time.Minute},
				{mode: "nftables", skip: cluster.ErrModeUnknownToKproxy},
			},
			wantOK: true,
			want:   []string{"round 1/2 mode=iptables: ok in 3m0s", "round 2/2 mode=nftables: SKIPPED: the kproxy binary does not know"},
		},
		{
			name: "failed tests listed by their deepest name",
			rounds: []*round{
				{mode: "iptables", ran: true},
				{mode: "nftables", ran: true, err: errors.New("the tests failed (exit code 1)"),
					failed: []string{"TestClusterIP/mode=nftables/pod_to_ClusterIP", "TestClusterIP/mode=nftables", "TestClusterIP"}},
			},
			want: []string{"round 2/2 mode=nftables: FAILED in 0s: the tests failed", "--- FAIL: TestClusterIP/mode=nftables/pod_to_ClusterIP"},
		},
		{
			name:   "mode switch failed",
			rounds: []*round{{mode: "iptables", ran: true}, {mode: "nftables", err: errors.New("switching kproxy: exited")}},
			want:   []string{"round 2/2 mode=nftables: FAILED: switching kproxy: exited"},
		},
		{name: "not run", rounds: []*round{{mode: "iptables"}}, want: []string{"round 1/1 mode=iptables: NOT RUN"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			text, ok := summary(tc.rounds)
			if ok != tc.wantOK {
				t.Errorf("ok = %t, want %t", ok, tc.wantOK)
			}
			for _, w := range tc.want {
				if !strings.Contains(text, w) {
					t.Errorf("summary lacks %q:\n%s", w, text)
				}
			}
			if strings.Count(text, "--- FAIL:") > 1 {
				t.Errorf("parents of failed subtests listed:\n%s", text)
			}
		})
	}
}

func TestFailureScanner(t *testing.T) {
	runsOnce(t)
	out := "=== RUN   TestA\n--- FAIL: TestA (1.00s)\n    --- FAIL: TestA/mode=iptables (1.00s)\n" +
		"\x16--- FAIL: TestB/mode=iptables/sub (0.00s)\n--- PASS: TestC (0.00s)\nFAIL\n--- FAIL: TestD"
	f := &failureScanner{}
	// Written in pieces that split lines.
	for i := 0; i < len(out); i += 7 {
		if _, err := f.Write([]byte(out[i:min(i+7, len(out))])); err != nil {
			t.Fatal(err)
		}
	}
	// TestD's line has not ended: not seen yet.
	if want := []string{"TestA", "TestA/mode=iptables", "TestB/mode=iptables/sub"}; !slices.Equal(f.names, want) {
		t.Errorf("names %q, want %q", f.names, want)
	}
}

func TestLatencyOutPath(t *testing.T) {
	runsOnce(t)
	tests := []struct {
		name, out, mode string
		modes           []string
		want            string
	}{
		{name: "one mode: as given", out: "_output/latency.json", mode: "iptables", modes: []string{"iptables"}, want: "_output/latency.json"},
		{name: "several modes: per mode", out: "_output/latency.json", mode: "nftables", modes: []string{"iptables", "nftables"}, want: "_output/latency-nftables.json"},
		{name: "placeholder", out: "/tmp/{mode}/lat.json", mode: "iptables", modes: []string{"iptables"}, want: "/tmp/iptables/lat.json"},
		{name: "no extension", out: "/tmp/lat", mode: "ipvs", modes: []string{"iptables", "ipvs"}, want: "/tmp/lat-ipvs"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := latencyOutPath(tc.out, tc.mode, tc.modes); got != tc.want {
				t.Errorf("= %q, want %q", got, tc.want)
			}
		})
	}
}

func TestMentions(t *testing.T) {
	runsOnce(t)
	lines := []string{
		`-A KPROXY-SERVICES -d 10.96.1.2/32 -p tcp -m comment --comment "e2e-a/web:tcp cluster IP" -j KPROXY-SVC-X`,
		`-A KPROXY-SERVICES -d 10.96.1.23/32 -p tcp -m comment --comment "e2e-b/web:tcp cluster IP" -j KPROXY-SVC-Y`,
		"\t\telements = { 10.96.1.2 . tcp . 80 : goto service-X,",
		"\t\t\t     10.96.1.23 . tcp . 80 : goto service-Y }",
		"",
	}
	tests := []struct {
		name string
		ns   string
		ips  []string
		want []int
	}{
		{name: "namespace", ns: "e2e-a", want: []int{0}},
		{name: "address, not a longer one", ips: []string{"10.96.1.2"}, want: []int{0, 2}},
		{name: "both", ns: "e2e-b", ips: []string{"10.96.1.2"}, want: []int{0, 1, 2}},
		{name: "neither", ns: "e2e-c", ips: []string{"10.96.9.9"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var want []string
			for _, i := range tc.want {
				want = append(want, lines[i])
			}
			if got := mentions(lines, tc.ns, tc.ips...); !slices.Equal(got, want) {
				t.Errorf("= %q, want %q", got, want)
			}
		})
	}
}

func TestHasKproxyState(t *testing.T) {
	runsOnce(t)
	tests := []struct {
		name  string
		mode  string
		lines []string
		want  bool
	}{
		{name: "iptables chain", mode: "iptables", lines: []string{"*nat", ":KPROXY-SERVICES - [0:0]"}, want: true},
		{name: "iptables without kproxy", mode: "iptables", lines: []string{"*nat", ":PREROUTING ACCEPT [0:0]"}},
		{name: "nftables table", mode: "nftables", lines: []string{"table ip kproxy {", "}"}, want: true},
		{name: "nftables empty", mode: "nftables", lines: []string{""}},
		{name: "ipvs reads iptables", mode: "ipvs", lines: []string{":KPROXY-IPVS-FILTER - [0:0]"}, want: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := hasKproxyState(tc.mode, tc.lines); got != tc.want {
				t.Errorf("= %t, want %t", got, tc.want)
			}
		})
	}
}

func TestModeConfigSection(t *testing.T) {
	runsOnce(t)
	for _, mode := range cluster.KnownModes() {
		t.Run(mode, func(t *testing.T) {
			s := modeConfigSection(mode)
			if !strings.Contains(s, mode+":\n") || !strings.Contains(s, "syncPeriod: 20s") || !strings.Contains(s, "masqueradeBit: 14") {
				t.Errorf("section of %s:\n%s", mode, s)
			}
		})
	}
}

func TestUnderMode(t *testing.T) {
	runsOnce(t)
	for name, want := range map[string]bool{
		"TestClusterIP/mode=iptables":            true,
		"TestClusterIP/mode=nftables/pod_to_VIP": true,
		"TestClusterIP":                          false,
		"TestClusterIP/model=x":                  false,
	} {
		if got := underMode(name); got != want {
			t.Errorf("underMode(%q) = %t, want %t", name, got, want)
		}
	}
}
