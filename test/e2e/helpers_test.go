package e2e

import (
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// The suite's own helpers; these run without a cluster (and without root).

func TestPercentile(t *testing.T) {
	ms := func(ns ...int) []time.Duration {
		var out []time.Duration
		for _, n := range ns {
			out = append(out, time.Duration(n)*time.Millisecond)
		}
		return out
	}
	var fifty []time.Duration
	for i := 1; i <= 50; i++ {
		fifty = append(fifty, time.Duration(i)*time.Millisecond)
	}
	cases := []struct {
		name   string
		sorted []time.Duration
		p      float64
		want   time.Duration
	}{
		{"empty", nil, 50, 0},
		{"one sample", ms(7), 99, 7 * time.Millisecond},
		{"median of four is the second", ms(1, 2, 3, 4), 50, 2 * time.Millisecond},
		{"p99 of fifty is the largest", fifty, 99, 50 * time.Millisecond},
		{"p50 of fifty is the 25th", fifty, 50, 25 * time.Millisecond},
		{"p0 is the smallest", ms(3, 5), 0, 3 * time.Millisecond},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := percentile(tc.sorted, tc.p); got != tc.want {
				t.Errorf("percentile(%v, %v) = %v, want %v", tc.sorted, tc.p, got, tc.want)
			}
		})
	}
}

func TestParseReply(t *testing.T) {
	cases := []struct {
		name    string
		in      string
		want    reply
		wantErr bool
	}{
		{"pod and client", "web-1 10.244.1.5:40000", reply{Pod: "web-1", Source: netip.MustParseAddr("10.244.1.5")}, false},
		{"IPv6 client", "web-2 [fd00::5]:80", reply{Pod: "web-2", Source: netip.MustParseAddr("fd00::5")}, false},
		{"no address", "web-1", reply{}, true},
		{"bad address", "web-1 nowhere", reply{}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseReply(tc.in)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("parseReply(%q) = %+v, %v; want %+v, error %v", tc.in, got, err, tc.want, tc.wantErr)
			}
		})
	}
}

func TestNamespaceName(t *testing.T) {
	label := regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	cases := []struct {
		name, test, prefix string
	}{
		{"plain", "TestClusterIP", "e2e-clusterip-"},
		{"subtest", "TestLoadBalancer/ranges_with_the_client", "e2e-loadbalancer-ranges-with-the-client-"},
		{"long", "Test" + strings.Repeat("Long", 30), "e2e-" + strings.Repeat("long", 10) + "-"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := namespaceName(tc.test)
			if !strings.HasPrefix(got, tc.prefix) || len(got) > 63 || !label.MatchString(got) {
				t.Errorf("namespaceName(%q) = %q, want a DNS label starting %q", tc.test, got, tc.prefix)
			}
			if again := namespaceName(tc.test); again == got {
				t.Errorf("namespaceName(%q) twice gave %q both times", tc.test, got)
			}
		})
	}
}

func TestExpectCheck(t *testing.T) {
	s := samples{replies: []reply{
		{Pod: "a", Source: netip.MustParseAddr("10.0.0.1")},
		{Pod: "b", Source: netip.MustParseAddr("10.0.0.1")},
		{Pod: "a", Source: netip.MustParseAddr("10.0.0.2")},
	}}
	cases := []struct {
		name string
		x    expect
		// wantErr is a substring of the expected error; empty: no error.
		wantErr string
	}{
		{"nothing asked", expect{}, ""},
		{"all seen", expect{all: []string{"a", "b"}}, ""},
		{"one missing", expect{all: []string{"a", "c"}}, "no reply from c"},
		{"only allowed", expect{only: []string{"a", "b"}}, ""},
		{"one not allowed", expect{only: []string{"a"}}, "reply from b"},
		{"sources allowed", expect{sources: []string{"10.0.0.1", "10.0.0.2"}}, ""},
		{"a source not allowed", expect{sources: []string{"10.0.0.1"}}, "saw source 10.0.0.2"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.x.check(s)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Errorf("check = %v, want nil", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("check = %v, want an error with %q", err, tc.wantErr)
			}
		})
	}
}

func TestChildArgs(t *testing.T) {
	args := []string{"-test.v=true", "-test.timeout=30m0s"}
	cases := []struct {
		name             string
		timeout, elapsed time.Duration
		want             []string
		wantErr          bool
	}{
		{"no timeout", 0, time.Minute, args, false},
		{"timeout shortened", 30 * time.Minute, 90 * time.Second, append(slices.Clone(args), "-test.timeout=28m0s"), false},
		{"no time left", time.Minute, 45 * time.Second, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := childArgs(args, tc.timeout, tc.elapsed)
			if (err != nil) != tc.wantErr || !slices.Equal(got, tc.want) {
				t.Errorf("childArgs = %q, %v; want %q, error %v", got, err, tc.want, tc.wantErr)
			}
		})
	}
}
