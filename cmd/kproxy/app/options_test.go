package app

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"

	"github.com/kproxy/kproxy/pkg/conntrack"
)

// parseOptions parses args as kproxy's flags over the defaults.
func parseOptions(t *testing.T, args ...string) *Options {
	t.Helper()
	o := NewOptions()
	fs := pflag.NewFlagSet("kproxy", pflag.ContinueOnError)
	o.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parsing %v: %v", args, err)
	}
	return o
}

func TestOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		// wantErrs are substrings the error must hold; none means valid.
		wantErrs []string
	}{
		{name: "defaults"},
		{name: "empty proxy mode means the default", args: []string{"--proxy-mode="}},
		{name: "iptables mode", args: []string{"--proxy-mode=iptables"}},
		{name: "ipvs mode", args: []string{"--proxy-mode=ipvs"}},
		{name: "nftables mode", args: []string{"--proxy-mode=nftables"}},
		{name: "nftables mode with the masquerade and sync flags", args: []string{
			"--proxy-mode=nftables", "--iptables-masquerade-bit=0", "--masquerade-all", "--iptables-sync-period=1m", "--iptables-min-sync-period=0",
		}},
		{name: "every ipvs flag", args: []string{
			"--proxy-mode=ipvs", "--ipvs-scheduler=mh", "--ipvs-strict-arp", "--ipvs-tcp-timeout=900s", "--ipvs-tcpfin-timeout=2m",
			"--ipvs-udp-timeout=0", "--ipvs-exclude-cidrs=10.0.0.0/8,fd00::/64", "--ipvs-sync-period=1m", "--ipvs-min-sync-period=1m",
		}},
		{name: "masquerade bit 0", args: []string{"--iptables-masquerade-bit=0"}},
		{name: "masquerade bit 31", args: []string{"--iptables-masquerade-bit=31"}},
		{name: "min sync period 0", args: []string{"--iptables-min-sync-period=0"}},
		{name: "min sync period equal to sync period", args: []string{"--iptables-min-sync-period=10s", "--iptables-sync-period=10s"}},
		{name: "single-stack cluster CIDR", args: []string{"--cluster-cidr=10.244.0.0/16"}},
		{name: "dual-stack cluster CIDRs", args: []string{"--cluster-cidr=10.244.0.0/16, fd00:10:244::/56"}},
		{name: "nodeport addresses", args: []string{"--nodeport-addresses=10.0.0.0/8,fd00::/64", "--nodeport-addresses=192.168.0.0/16"}},
		{name: "nodeport addresses primary", args: []string{"--nodeport-addresses=primary"}},
		{name: "nodeport addresses: every keyword and CIDRs", args: []string{"--nodeport-addresses=primary,localhost,all,10.0.0.0/8,fd00::/64"}},
		{name: "nodeport addresses with leading zeros, as kube-proxy", args: []string{"--nodeport-addresses=010.000.000.000/8"}},
		{name: "bind address IPv4", args: []string{"--bind-address=10.0.0.5"}},
		{name: "bind address IPv6", args: []string{"--bind-address=fd00::5"}},
		{name: "bind address unspecified", args: []string{"--bind-address=::"}},
		{name: "bind address empty", args: []string{"--bind-address="}},
		{name: "health and metrics disabled", args: []string{"--healthz-bind-address=", "--metrics-bind-address="}},
		{name: "IPv6 bind addresses", args: []string{"--healthz-bind-address=[::]:10256", "--metrics-bind-address=[::1]:10249"}},
		{name: "bind address port 0", args: []string{"--healthz-bind-address=127.0.0.1:0", "--metrics-bind-address=0.0.0.0:65535"}},
		{name: "every other flag", args: []string{
			"--kubeconfig=/k", "--master=https://x", "--hostname-override=n", "--cleanup", "--masquerade-all",
			"--config-sync-period=1m", "--service-proxy-name=p", "--iptables-restore-batch-chains=10",
		}},

		{name: "bogus proxy mode", args: []string{"--proxy-mode=bogus"}, wantErrs: []string{`--proxy-mode="bogus"`, "use iptables, ipvs or nftables"}},
		{name: "mode names are lower case", args: []string{"--proxy-mode=NFTables"}, wantErrs: []string{`--proxy-mode="NFTables" is not a proxy mode`}},
		{name: "kernelspace mode", args: []string{"--proxy-mode=kernelspace"}, wantErrs: []string{`--proxy-mode="kernelspace" is not a proxy mode`}},
		{
			name:     "nftables mode: the sync flags are validated",
			args:     []string{"--proxy-mode=nftables", "--iptables-min-sync-period=1m", "--iptables-sync-period=30s", "--iptables-masquerade-bit=32"},
			wantErrs: []string{"--iptables-min-sync-period=1m0s must not exceed --iptables-sync-period=30s", "--iptables-masquerade-bit=32"},
		},
		{name: "bad ipvs scheduler", args: []string{"--proxy-mode=ipvs", "--ipvs-scheduler=fastest"}, wantErrs: []string{`--ipvs-scheduler="fastest"`, "rr, wrr"}},
		{name: "ipvs timeout not in seconds", args: []string{"--ipvs-tcp-timeout=1500ms"}, wantErrs: []string{"--ipvs-tcp-timeout=1.5s", "whole number of seconds"}},
		{name: "negative ipvs udp timeout", args: []string{"--ipvs-udp-timeout=-5s"}, wantErrs: []string{"--ipvs-udp-timeout=-5s"}},
		{name: "ipvs sync period 0", args: []string{"--ipvs-sync-period=0"}, wantErrs: []string{"--ipvs-sync-period=0s must be greater than 0"}},
		{name: "negative ipvs min sync period", args: []string{"--ipvs-min-sync-period=-1s"}, wantErrs: []string{"--ipvs-min-sync-period=-1s"}},
		{
			name:     "ipvs min sync period above sync period",
			args:     []string{"--ipvs-min-sync-period=1m", "--ipvs-sync-period=30s"},
			wantErrs: []string{"--ipvs-min-sync-period=1m0s must not exceed --ipvs-sync-period=30s"},
		},
		{name: "ipvs exclude CIDR garbage", args: []string{"--ipvs-exclude-cidrs=10.0.0.0/8,lan"}, wantErrs: []string{"--ipvs-exclude-cidrs", `"lan"`}},
		{name: "masquerade bit -1", args: []string{"--iptables-masquerade-bit=-1"}, wantErrs: []string{"--iptables-masquerade-bit=-1", "[0, 31]"}},
		{name: "masquerade bit 32", args: []string{"--iptables-masquerade-bit=32"}, wantErrs: []string{"--iptables-masquerade-bit=32"}},
		{name: "sync period 0", args: []string{"--iptables-sync-period=0"}, wantErrs: []string{"--iptables-sync-period=0s"}},
		{name: "negative sync period", args: []string{"--iptables-sync-period=-1s"}, wantErrs: []string{"--iptables-sync-period=-1s"}},
		{name: "negative min sync period", args: []string{"--iptables-min-sync-period=-1s"}, wantErrs: []string{"--iptables-min-sync-period=-1s"}},
		{
			name:     "min sync period above sync period",
			args:     []string{"--iptables-min-sync-period=1m", "--iptables-sync-period=30s"},
			wantErrs: []string{"--iptables-min-sync-period=1m0s must not exceed --iptables-sync-period=30s"},
		},
		{name: "cluster CIDR without a length", args: []string{"--cluster-cidr=10.244.0.0"}, wantErrs: []string{"--cluster-cidr", `"10.244.0.0"`}},
		{name: "cluster CIDR garbage", args: []string{"--cluster-cidr=pods"}, wantErrs: []string{"--cluster-cidr", `"pods"`}},
		{name: "cluster CIDR with an empty entry", args: []string{"--cluster-cidr=10.244.0.0/16,"}, wantErrs: []string{"--cluster-cidr"}},
		{name: "two IPv4 cluster CIDRs", args: []string{"--cluster-cidr=10.244.0.0/16,10.245.0.0/16"}, wantErrs: []string{"--cluster-cidr", "more than one IPv4"}},
		{name: "two IPv6 cluster CIDRs", args: []string{"--cluster-cidr=fd00::/64,fd01::/64"}, wantErrs: []string{"--cluster-cidr", "more than one IPv6"}},
		{name: "nodeport address without a length", args: []string{"--nodeport-addresses=10.0.0.1"}, wantErrs: []string{"--nodeport-addresses", `"10.0.0.1"`}},
		{name: "nodeport address garbage", args: []string{"--nodeport-addresses=10.0.0.0/8,primary-ish"}, wantErrs: []string{"--nodeport-addresses", `"primary-ish"`}},
		{name: "nodeport address keyword twice", args: []string{"--nodeport-addresses=primary,10.0.0.0/8", "--nodeport-addresses=primary"}, wantErrs: []string{"--nodeport-addresses", `"primary" is given more than once`}},
		{name: "nodeport address keyword in capitals", args: []string{"--nodeport-addresses=ALL"}, wantErrs: []string{"--nodeport-addresses", `"ALL"`, "keywords"}},
		{name: "bind address with a port", args: []string{"--bind-address=10.0.0.5:80"}, wantErrs: []string{`--bind-address="10.0.0.5:80" is not an IP address`}},
		{name: "bind address host name", args: []string{"--bind-address=node-a"}, wantErrs: []string{`--bind-address="node-a"`}},
		{name: "config sync period 0", args: []string{"--config-sync-period=0"}, wantErrs: []string{"--config-sync-period=0s"}},
		{name: "batch chains 0", args: []string{"--iptables-restore-batch-chains=0"}, wantErrs: []string{"--iptables-restore-batch-chains=0"}},
		{name: "healthz address without a port", args: []string{"--healthz-bind-address=0.0.0.0"}, wantErrs: []string{`--healthz-bind-address="0.0.0.0"`, "with a port"}},
		{name: "healthz address with a host name", args: []string{"--healthz-bind-address=localhost:10256"}, wantErrs: []string{"--healthz-bind-address", `"localhost" is not an IP address`}},
		{name: "healthz port out of range", args: []string{"--healthz-bind-address=0.0.0.0:65536"}, wantErrs: []string{"--healthz-bind-address", `"65536" is not a port number`}},
		{name: "metrics address with a port name", args: []string{"--metrics-bind-address=127.0.0.1:http"}, wantErrs: []string{"--metrics-bind-address", `"http" is not a port number`}},
		{name: "metrics address with an empty port", args: []string{"--metrics-bind-address=127.0.0.1:"}, wantErrs: []string{"--metrics-bind-address", `"" is not a port number`}},
		{name: "metrics IPv6 address without brackets", args: []string{"--metrics-bind-address=::1:10249"}, wantErrs: []string{"--metrics-bind-address", "with a port"}},
		{
			name: "every problem is reported at once",
			args: []string{"--proxy-mode=bogus", "--iptables-masquerade-bit=40", "--iptables-sync-period=0", "--config-sync-period=0", "--cluster-cidr=x",
				"--nodeport-addresses=y,all,all", "--bind-address=z", "--kube-api-content-type=text/yaml"},
			wantErrs: []string{
				"--proxy-mode", "--iptables-masquerade-bit=40", "--iptables-sync-period=0s", "--config-sync-period=0s",
				"--cluster-cidr", `--nodeport-addresses: "y"`, `--nodeport-addresses: the keyword "all"`, "--bind-address",
				"--kube-api-content-type",
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := parseOptions(t, tc.args...).Validate()
			if len(tc.wantErrs) == 0 {
				if err != nil {
					t.Fatalf("Validate() = %v, want no error", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() accepted %v", tc.args)
			}
			for _, want := range tc.wantErrs {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("Validate() = %q, want it to mention %q", err, want)
				}
			}
		})
	}
}

func TestNewOptionsDefaults(t *testing.T) {
	got := parseOptions(t)
	want := &Options{
		ProxyMode: ModeIPTables, BindAddress: "0.0.0.0", MasqueradeBit: 14, SyncPeriod: 30 * time.Second, MinSyncPeriod: time.Second,
		ConfigSyncPeriod: 15 * time.Minute, IPTablesBatchChain: 1000, KubeAPIContentType: "application/vnd.kubernetes.protobuf",
		HealthzBindAddress: "0.0.0.0:10256", MetricsBindAddress: "127.0.0.1:10249",
		Conntrack:     conntrack.Config{MaxPerCore: 32768, Min: 131072, TCPEstablishedTimeout: 24 * time.Hour, TCPCloseWaitTimeout: time.Hour},
		IPVSScheduler: "rr", IPVSSyncPeriod: 30 * time.Second,
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("defaults = %+v, want kube-proxy's %+v", got, want)
	}
	if err := got.Validate(); err != nil {
		t.Errorf("defaults do not validate: %v", err)
	}
}

func TestClusterCIDRs(t *testing.T) {
	for _, tc := range []struct {
		name  string
		value string
		want  map[v1.IPFamily]netip.Prefix
	}{
		{name: "unset", value: "", want: map[v1.IPFamily]netip.Prefix{}},
		{name: "blank", value: "  ", want: map[v1.IPFamily]netip.Prefix{}},
		{name: "IPv4 with host bits is masked", value: "10.244.1.7/16", want: map[v1.IPFamily]netip.Prefix{
			v1.IPv4Protocol: netip.MustParsePrefix("10.244.0.0/16"),
		}},
		{name: "dual-stack, v6 first, spaces", value: " fd00:10:244::/56 , 10.244.0.0/16 ", want: map[v1.IPFamily]netip.Prefix{
			v1.IPv4Protocol: netip.MustParsePrefix("10.244.0.0/16"),
			v1.IPv6Protocol: netip.MustParsePrefix("fd00:10:244::/56"),
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := NewOptions()
			o.ClusterCIDR = tc.value
			got, err := o.clusterCIDRs()
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("clusterCIDRs() = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestNodePortAddressesPerFamily(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mode   string
		values []string
		nodeIP map[v1.IPFamily]string
		want   map[v1.IPFamily]string
	}{
		{name: "unset", want: map[v1.IPFamily]string{v1.IPv4Protocol: "IPv4: all", v1.IPv6Protocol: "IPv6: all"}},
		{
			name: "unset in nftables mode: primary", mode: ModeNFTables,
			nodeIP: map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1"},
			want:   map[v1.IPFamily]string{v1.IPv4Protocol: "IPv4: 10.0.0.1/32", v1.IPv6Protocol: "IPv6: all"},
		},
		{
			name: "set in nftables mode: as given", mode: ModeNFTables, values: []string{"10.0.0.0/8"},
			nodeIP: map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1"},
			want:   map[v1.IPFamily]string{v1.IPv4Protocol: "IPv4: 10.0.0.0/8", v1.IPv6Protocol: "IPv6: all"},
		},
		{
			name: "one family: the other one matches all", values: []string{"10.0.0.5/8", " ", "192.168.1.0/24"},
			want: map[v1.IPFamily]string{v1.IPv4Protocol: "IPv4: 10.0.0.0/8,192.168.1.0/24", v1.IPv6Protocol: "IPv6: all"},
		},
		{
			name: "primary with node IPs of both families", values: []string{"primary"},
			nodeIP: map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1", v1.IPv6Protocol: "fd00::1"},
			want:   map[v1.IPFamily]string{v1.IPv4Protocol: "IPv4: 10.0.0.1/32", v1.IPv6Protocol: "IPv6: fd00::1/128"},
		},
		{
			name: "primary on a single-stack node", values: []string{"primary"},
			nodeIP: map[v1.IPFamily]string{v1.IPv4Protocol: "10.0.0.1"},
			want:   map[v1.IPFamily]string{v1.IPv4Protocol: "IPv4: 10.0.0.1/32", v1.IPv6Protocol: "IPv6: all"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := NewOptions()
			o.NodePortAddresses = tc.values
			if tc.mode != "" {
				o.ProxyMode = tc.mode
			}
			for fam, want := range tc.want {
				var ip netip.Addr
				if s, ok := tc.nodeIP[fam]; ok {
					ip = netip.MustParseAddr(s)
				}
				got, err := o.nodePortAddresses(fam, ip)
				if err != nil {
					t.Fatal(err)
				}
				if got.String() != want {
					t.Errorf("%s: %s, want %s", fam, got, want)
				}
			}
		})
	}
}

func TestSyncPeriodsFollowTheMode(t *testing.T) {
	for _, tc := range []struct {
		name              string
		args              []string
		wantSync, wantMin time.Duration
	}{
		{name: "iptables mode", args: []string{"--iptables-sync-period=10s", "--ipvs-sync-period=20s"}, wantSync: 10 * time.Second, wantMin: time.Second},
		{name: "ipvs mode", args: []string{"--proxy-mode=ipvs", "--iptables-sync-period=10s", "--ipvs-sync-period=20s", "--ipvs-min-sync-period=2s"},
			wantSync: 20 * time.Second, wantMin: 2 * time.Second},
		{name: "ipvs mode defaults", args: []string{"--proxy-mode=ipvs"}, wantSync: 30 * time.Second, wantMin: 0},
		{name: "nftables mode reads the iptables flags, as kube-proxy", args: []string{"--proxy-mode=nftables", "--iptables-sync-period=10s", "--iptables-min-sync-period=3s", "--ipvs-sync-period=20s"},
			wantSync: 10 * time.Second, wantMin: 3 * time.Second},
		{name: "nftables mode defaults", args: []string{"--proxy-mode=nftables"}, wantSync: 30 * time.Second, wantMin: time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sync, min := parseOptions(t, tc.args...).syncPeriods()
			if sync != tc.wantSync || min != tc.wantMin {
				t.Errorf("syncPeriods() = %v, %v; want %v, %v", sync, min, tc.wantSync, tc.wantMin)
			}
		})
	}
}
