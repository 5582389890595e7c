package app

import (
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/kproxy/kproxy/pkg/conntrack"
)

func TestConntrackFlags(t *testing.T) {
	for _, tc := range []struct {
		name     string
		args     []string
		want     conntrack.Config
		wantErrs []string
	}{
		{
			name: "kube-proxy's defaults",
			want: conntrack.Config{MaxPerCore: 32768, Min: 131072, TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour},
		},
		{
			name: "every flag",
			args: []string{
				"--conntrack-max-per-core=0", "--conntrack-min=0", "--conntrack-tcp-timeout-established=2h",
				"--conntrack-tcp-timeout-close-wait=0", "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout=30s",
				"--conntrack-udp-timeout-stream=2m",
			},
			want: conntrack.Config{TCPEstablishedTimeout: 2 * time.Hour, TCPBeLiberal: true, UDPTimeout: 30 * time.Second, UDPStreamTimeout: 2 * time.Minute},
		},
		{
			name: "negative values rejected",
			args: []string{
				"--conntrack-max-per-core=-1", "--conntrack-min=-1", "--conntrack-tcp-timeout-established=-1s",
				"--conntrack-tcp-timeout-close-wait=-1s", "--conntrack-udp-timeout=-1s", "--conntrack-udp-timeout-stream=-1s",
			},
			want: conntrack.Config{
				MaxPerCore: -1, Min: -1, TCPEstablishedTimeout: -time.Second, TCPCloseWaitTimeout: -time.Second,
				UDPTimeout: -time.Second, UDPStreamTimeout: -time.Second,
			},
			wantErrs: []string{
				"--conntrack-max-per-core=-1 must not be negative", "--conntrack-min=-1 must not be negative",
				"--conntrack-tcp-timeout-established=-1s", "--conntrack-tcp-timeout-close-wait=-1s",
				"--conntrack-udp-timeout=-1s", "--conntrack-udp-timeout-stream=-1s",
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := parseOptions(t, tc.args...)
			if o.Conntrack != tc.want {
				t.Errorf("Conntrack = %+v, want %+v", o.Conntrack, tc.want)
			}
			err := o.Validate()
			if len(tc.wantErrs) == 0 {
				if err != nil {
					t.Errorf("Validate: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("Validate accepted the flags")
			}
			for _, want := range tc.wantErrs {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Validate() = %q, want it to mention %q", err, want)
				}
			}
		})
	}
}

func TestServiceEventRecorder(t *testing.T) {
	rec := record.NewFakeRecorder(1)
	for _, tc := range []struct {
		family v1.IPFamily
		want   bool
	}{{v1.IPv4Protocol, true}, {v1.IPv6Protocol, false}} {
		t.Run(string(tc.family), func(t *testing.T) {
			if got := serviceEventRecorder(tc.family, rec); (got != nil) != tc.want {
				t.Errorf("serviceEventRecorder(%s) = %v, want a recorder: %v", tc.family, got, tc.want)
			}
		})
	}
}
