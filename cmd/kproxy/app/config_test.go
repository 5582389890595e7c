package app

import (
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/scheme"
)

// configFlags parses args as kproxy's command line, with stand-ins for
// klog's -v and --vmodule (klog's own flags would change process-wide
// logging).
func configFlags(t *testing.T, args ...string) (*Options, *pflag.FlagSet) {
	t.Helper()
	o := NewOptions()
	fs := pflag.NewFlagSet("kproxy", pflag.ContinueOnError)
	o.AddFlags(fs)
	fs.StringP("v", "v", "0", "klog verbosity (stand-in)")
	fs.String("vmodule", "", "klog vmodule (stand-in)")
	if err := fs.Parse(args); err != nil {
		t.Fatalf("parsing %v: %v", args, err)
	}
	return o, fs
}

// configMapData returns data[key] of the ConfigMap in a YAML file.
func configMapData(t *testing.T, path, key string) string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(raw, nil, nil)
	if err != nil {
		t.Fatalf("decoding %s: %v", path, err)
	}
	cm, ok := obj.(*v1.ConfigMap)
	if !ok {
		t.Fatalf("%s holds a %T, want a ConfigMap", path, obj)
	}
	data, ok := cm.Data[key]
	if !ok {
		t.Fatalf("ConfigMap %s/%s in %s has no %q", cm.Namespace, cm.Name, path, key)
	}
	return data
}

func warningFields(ws []ConfigWarning) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.Field
	}
	return out
}

// TestDecodeProxyConfig checks what decoding accepts, warns about and
// refuses, on real files (testdata) and small ones.
func TestDecodeProxyConfig(t *testing.T) {
	kubeadm := configMapData(t, filepath.Join("testdata", "kubeadm-kube-proxy-configmap.yaml"), "config.conf")
	defaults, err := os.ReadFile(filepath.Join("testdata", "kube-proxy-defaults.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	const header = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
	for _, tc := range []struct {
		name string
		data string
		// wantWarnings are the warned fields, in order.
		wantWarnings []string
		// wantErr, when set, is a substring of the error.
		wantErr string
		// check inspects the decoded configuration.
		check func(t *testing.T, clusterCIDR, kubeconfig string)
	}{
		{
			name: "kubeadm's kube-proxy ConfigMap", data: kubeadm,
			check: func(t *testing.T, clusterCIDR, kubeconfig string) {
				if clusterCIDR != "10.244.0.0/16" || kubeconfig != "/var/lib/kube-proxy/kubeconfig.conf" {
					t.Errorf("clusterCIDR %q, kubeconfig %q", clusterCIDR, kubeconfig)
				}
			},
		},
		{name: "kube-proxy's defaults written out", data: string(defaults)},
		{name: "header only", data: header},
		{
			name: "JSON", data: `{"apiVersion":"kubeproxy.config.k8s.io/v1alpha1","kind":"KubeProxyConfiguration","clusterCIDR":"10.1.0.0/16"}`,
			check: func(t *testing.T, clusterCIDR, _ string) {
				if clusterCIDR != "10.1.0.0/16" {
					t.Errorf("clusterCIDR %q", clusterCIDR)
				}
			},
		},
		{
			name:         "unknown fields are warnings; the rest is read",
			data:         header + "clusterCIDR: 10.2.0.0/16\nclusterCIRD: 10.3.0.0/16\niptables:\n  masqueradeAlll: true\n",
			wantWarnings: []string{"clusterCIRD", "iptables.masqueradeAlll"},
			check: func(t *testing.T, clusterCIDR, _ string) {
				if clusterCIDR != "10.2.0.0/16" {
					t.Errorf("clusterCIDR %q", clusterCIDR)
				}
			},
		},
		{
			name:         "duplicate fields are warnings; the last wins",
			data:         header + "clusterCIDR: 10.2.0.0/16\nclusterCIDR: 10.4.0.0/16\n",
			wantWarnings: []string{"clusterCIDR"},
			check: func(t *testing.T, clusterCIDR, _ string) {
				if clusterCIDR != "10.4.0.0/16" {
					t.Errorf("clusterCIDR %q", clusterCIDR)
				}
			},
		},
		{name: "another kind", data: "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n", wantErr: "KubeletConfiguration"},
		{name: "another version", data: "apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n", wantErr: "v1beta1"},
		{name: "no apiVersion", data: "kind: KubeProxyConfiguration\nmode: iptables\n", wantErr: "'apiVersion' is missing"},
		{name: "no kind", data: "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nmode: iptables\n", wantErr: "'Kind' is missing"},
		{name: "empty file", data: "", wantErr: "decoding"},
		{name: "not YAML", data: header + "mode: [iptables\n", wantErr: "decoding"},
		{name: "wrong type", data: header + "iptables:\n  syncPeriod: [30s]\n", wantErr: "decoding"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, warnings, err := DecodeProxyConfig([]byte(tc.data))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("DecodeProxyConfig() error = %v, want one mentioning %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("DecodeProxyConfig() = %v", err)
			}
			if got := warningFields(warnings); !slices.Equal(got, tc.wantWarnings) {
				t.Errorf("warnings %v, want fields %v", warnings, tc.wantWarnings)
			}
			if tc.check != nil {
				tc.check(t, cfg.ClusterCIDR, cfg.ClientConnection.Kubeconfig)
			}
		})
	}
}

// TestApplyProxyConfig maps files (and command lines) onto Options: every
// supported field, zero values meaning the default, flags given on the
// command line winning, and the warnings and errors of what kproxy does not
// support.
func TestApplyProxyConfig(t *testing.T) {
	const header = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
	kubeadm := configMapData(t, filepath.Join("testdata", "kubeadm-kube-proxy-configmap.yaml"), "config.conf")
	defaults, err := os.ReadFile(filepath.Join("testdata", "kube-proxy-defaults.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	everything := header + `
clientConnection:
  kubeconfig: /etc/kproxy/kubeconfig
hostnameOverride: node-a
bindAddress: 10.0.0.5
mode: iptables
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
healthzBindAddress: 127.0.0.1:20256
metricsBindAddress: 0.0.0.0:20249
configSyncPeriod: 5m
nodePortAddresses: [10.0.0.0/8, "fd00::/64", primary]
iptables:
  masqueradeAll: true
  masqueradeBit: 12
  syncPeriod: 1m
  minSyncPeriod: 2s
ipvs:
  scheduler: wrr
  strictARP: true
  tcpTimeout: 900s
  tcpFinTimeout: 120s
  udpTimeout: 5m
  excludeCIDRs: [10.8.0.0/16, "fd08::/64"]
  syncPeriod: 20s
  minSyncPeriod: 500ms
conntrack:
  maxPerCore: 65536
  min: 262144
  tcpEstablishedTimeout: 2h
  tcpCloseWaitTimeout: 30m
  tcpBeLiberal: true
  udpTimeout: 30s
  udpStreamTimeout: 300s
logging:
  verbosity: 4
  vmodule:
  - filePattern: proxier*
    verbosity: 6
`
	for _, tc := range []struct {
		name string
		file string
		args []string
		// want adjusts the defaults to the expected options.
		want func(o *Options)
		// wantFlags are the expected values of flags ("v", "vmodule").
		wantFlags map[string]string
		// wantWarnings are the warned fields, in order.
		wantWarnings []string
		// wantErrs are substrings of the error; none means no error.
		wantErrs []string
	}{
		{
			name: "kubeadm's ConfigMap: its kubeconfig and cluster CIDR, defaults elsewhere",
			file: kubeadm,
			want: func(o *Options) {
				o.Kubeconfig = "/var/lib/kube-proxy/kubeconfig.conf"
				o.ClusterCIDR = "10.244.0.0/16"
			},
		},
		{
			name: "kube-proxy's defaults written out",
			file: string(defaults),
			want: func(o *Options) {
				o.Kubeconfig = "/var/lib/kube-proxy/kubeconfig.conf"
				o.ClusterCIDR = "10.244.0.0/16"
				o.MetricsBindAddress = "0.0.0.0:10249"
			},
			// kube-proxy serves NodePorts on localhost by default; kproxy never does.
			wantWarnings: []string{"iptables.localhostNodePorts"},
		},
		{
			name: "kube-proxy's defaults written out in nftables mode",
			file: strings.Replace(string(defaults), "\nmode: iptables\n", "\nmode: nftables\n", 1),
			want: func(o *Options) {
				o.ProxyMode = ModeNFTables
				o.Kubeconfig = "/var/lib/kube-proxy/kubeconfig.conf"
				o.ClusterCIDR = "10.244.0.0/16"
				o.MetricsBindAddress = "0.0.0.0:10249"
			},
			// Only iptables mode reads iptables.localhostNodePorts.
		},
		{
			name:      "every supported field",
			file:      everything,
			want:      everythingOptions,
			wantFlags: map[string]string{"v": "4", "vmodule": "proxier*=6"},
		},
		{
			name: "flags given on the command line win over every field",
			file: everything,
			args: []string{
				"--kubeconfig=/flag/kubeconfig", "--hostname-override=node-b", "--bind-address=0.0.0.0", "--proxy-mode=iptables",
				"--cluster-cidr=10.9.0.0/16", "--healthz-bind-address=", "--metrics-bind-address=127.0.0.1:10249",
				"--config-sync-period=1m", "--nodeport-addresses=192.168.0.0/16", "--masquerade-all=false",
				"--iptables-masquerade-bit=3", "--iptables-sync-period=10s", "--iptables-min-sync-period=0",
				"--ipvs-scheduler=rr", "--ipvs-strict-arp=false", "--ipvs-tcp-timeout=0", "--ipvs-tcpfin-timeout=1s",
				"--ipvs-udp-timeout=2s", "--ipvs-exclude-cidrs=10.7.0.0/16", "--ipvs-sync-period=1m", "--ipvs-min-sync-period=0",
				"--conntrack-max-per-core=1", "--conntrack-min=2", "--conntrack-tcp-timeout-established=3s",
				"--conntrack-tcp-timeout-close-wait=4s", "--conntrack-tcp-be-liberal=false", "--conntrack-udp-timeout=5s",
				"--conntrack-udp-timeout-stream=6s",
				"-v=1", "--vmodule=x=2",
			},
			want: func(o *Options) {
				o.Kubeconfig = "/flag/kubeconfig"
				o.HostnameOverride = "node-b"
				o.ClusterCIDR = "10.9.0.0/16"
				o.HealthzBindAddress = ""
				o.ConfigSyncPeriod = time.Minute
				o.NodePortAddresses = []string{"192.168.0.0/16"}
				o.MasqueradeBit = 3
				o.SyncPeriod = 10 * time.Second
				o.MinSyncPeriod = 0
			},
			wantFlags: map[string]string{"v": "1", "vmodule": "x=2"},
		},
		{
			name: "flags not given leave the file's values",
			file: everything,
			args: []string{"--hostname-override=node-b"},
			want: func(o *Options) {
				everythingOptions(o)
				o.HostnameOverride = "node-b"
			},
			wantFlags: map[string]string{"v": "4", "vmodule": "proxier*=6"},
		},
		{
			name: "zero values mean the default, not zero",
			file: header + "iptables:\n  syncPeriod: 0s\n  minSyncPeriod: 0s\n  masqueradeBit: null\nconfigSyncPeriod: 0s\nhealthzBindAddress: \"\"\nmetricsBindAddress: \"\"\nmode: \"\"\n",
			args: []string{"--iptables-sync-period=45s"},
			want: func(o *Options) { o.SyncPeriod = 45 * time.Second },
		},
		{
			name: "conntrack: an explicit 0 leaves the kernel's value, null the default",
			file: header + "conntrack:\n  maxPerCore: 0\n  min: null\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: null\n",
			want: func(o *Options) {
				o.Conntrack.MaxPerCore = 0
				o.Conntrack.TCPEstablishedTimeout = 0
			},
		},
		{
			name: "masquerade bit 0 is a value",
			file: header + "iptables:\n  masqueradeBit: 0\n",
			want: func(o *Options) { o.MasqueradeBit = 0 },
		},
		{
			name: "bind addresses without a port get kube-proxy's ports",
			file: header + "healthzBindAddress: 10.0.0.1\nmetricsBindAddress: \"::\"\n",
			want: func(o *Options) {
				o.HealthzBindAddress = "10.0.0.1:10256"
				o.MetricsBindAddress = "[::]:10249"
			},
		},
		{
			name: "ipvs mode is passed on",
			file: header + "mode: ipvs\n",
			want: func(o *Options) { o.ProxyMode = ModeIPVS },
		},
		{
			name: "nftables mode is passed on",
			file: header + "mode: nftables\n",
			want: func(o *Options) { o.ProxyMode = ModeNFTables },
		},
		{
			name: "nftables mode reads the nftables block",
			file: header + "mode: nftables\nnftables:\n  masqueradeBit: 12\n  masqueradeAll: true\n  syncPeriod: 1m\n  minSyncPeriod: 2s\n" +
				"iptables:\n  masqueradeBit: 14\n  syncPeriod: 30s\n  minSyncPeriod: 1s\n  localhostNodePorts: true\n",
			want: func(o *Options) {
				o.ProxyMode = ModeNFTables
				o.MasqueradeBit = 12
				o.MasqueradeAll = true
				o.SyncPeriod = time.Minute
				o.MinSyncPeriod = 2 * time.Second
			},
		},
		{
			name: "nftables mode: a set iptables block is ignored, with a warning",
			file: header + "mode: nftables\nnftables:\n  syncPeriod: 1m\niptables:\n  masqueradeBit: 3\n  masqueradeAll: true\n  syncPeriod: 5s\n",
			want: func(o *Options) {
				o.ProxyMode = ModeNFTables
				o.SyncPeriod = time.Minute
			},
			wantWarnings: []string{"iptables"},
		},
		{
			name: "nftables mode: zero values in the nftables block mean the default",
			file: header + "mode: nftables\nnftables:\n  masqueradeBit: null\n  syncPeriod: 0s\n  minSyncPeriod: 0s\n",
			want: func(o *Options) { o.ProxyMode = ModeNFTables },
		},
		{
			name: "nftables mode: masquerade bit 0 is a value",
			file: header + "mode: nftables\nnftables:\n  masqueradeBit: 0\n",
			want: func(o *Options) {
				o.ProxyMode = ModeNFTables
				o.MasqueradeBit = 0
			},
		},
		{
			name: "nftables mode: flags given on the command line win over the nftables block",
			file: header + "mode: nftables\nnftables:\n  masqueradeBit: 12\n  masqueradeAll: true\n  syncPeriod: 1m\n  minSyncPeriod: 2s\n",
			args: []string{"--iptables-masquerade-bit=3", "--masquerade-all=false", "--iptables-sync-period=10s", "--iptables-min-sync-period=0"},
			want: func(o *Options) {
				o.ProxyMode = ModeNFTables
				o.MasqueradeBit = 3
				o.SyncPeriod = 10 * time.Second
				o.MinSyncPeriod = 0
			},
		},
		{
			name: "--proxy-mode=nftables over a file in iptables mode: the nftables block is read",
			file: header + "mode: iptables\niptables:\n  syncPeriod: 5s\nnftables:\n  syncPeriod: 1m\n  masqueradeBit: 10\n",
			args: []string{"--proxy-mode=nftables"},
			want: func(o *Options) {
				o.ProxyMode = ModeNFTables
				o.SyncPeriod = time.Minute
				o.MasqueradeBit = 10
			},
			wantWarnings: []string{"iptables"},
		},
		{
			name:         "--proxy-mode=iptables over a file in nftables mode: the iptables block is read",
			file:         header + "mode: nftables\niptables:\n  syncPeriod: 5s\nnftables:\n  syncPeriod: 1m\n",
			args:         []string{"--proxy-mode=iptables"},
			want:         func(o *Options) { o.SyncPeriod = 5 * time.Second },
			wantWarnings: []string{"nftables"},
		},
		{
			name: "ipvs mode reads the iptables block's masquerade settings, not the nftables block",
			file: header + "mode: ipvs\niptables:\n  masqueradeBit: 9\nnftables:\n  masqueradeBit: 10\n",
			want: func(o *Options) {
				o.ProxyMode = ModeIPVS
				o.MasqueradeBit = 9
			},
			wantWarnings: []string{"nftables"},
		},
		{name: "kernelspace mode is refused", file: header + "mode: kernelspace\n", wantErrs: []string{"mode", "Windows"}},
		{name: "an unknown mode is refused", file: header + "mode: userspace\n", wantErrs: []string{"mode", `"userspace" is not a proxy mode`, "iptables, ipvs or nftables"}},
		{
			name: "a refused mode is refused even under --proxy-mode",
			file: header + "mode: kernelspace\n", args: []string{"--proxy-mode=iptables"},
			wantErrs: []string{`"kernelspace" is kube-proxy's Windows mode`},
		},
		{
			name:         "nodePortAddresses keywords are kept as they are; localhost warns",
			file:         header + "nodePortAddresses: [10.0.0.0/8, localhost, primary, all]\n",
			want:         func(o *Options) { o.NodePortAddresses = []string{"10.0.0.0/8", "localhost", "primary", "all"} },
			wantWarnings: []string{"nodePortAddresses"},
		},
		{
			name: "nodePortAddresses primary, as kube-proxy's nftables mode default",
			file: header + "nodePortAddresses: [primary]\n",
			want: func(o *Options) { o.NodePortAddresses = []string{"primary"} },
		},
		{
			name: "profiling and the API content type",
			file: header + "enableProfiling: true\nclientConnection: {contentType: application/json}\n",
			want: func(o *Options) { o.Profiling = true; o.KubeAPIContentType = "application/json" },
		},
		{
			name: "bindAddress is this node's primary IP",
			file: header + "bindAddress: fd00::5\n",
			want: func(o *Options) { o.BindAddress = "fd00::5" },
		},
		{
			name: "unsupported settings warn and change nothing",
			file: header + `
bindAddressHardFail: true
showHiddenMetricsForVersion: "1.36"
oomScoreAdj: -500
portRange: 30000-32767
featureGates: {Zeta: true, Alpha: false}
clientConnection: {qps: 50, burst: 100, acceptContentTypes: application/json}
detectLocalMode: NodeCIDR
detectLocal: {bridgeInterface: cbr0}
iptables: {localhostNodePorts: true}
nftables: {syncPeriod: 10s}
logging: {format: json, flushFrequency: 1s}
winkernel: {networkName: l2bridge}
windowsRunAsService: true
`,
			wantWarnings: []string{
				"clientConnection.qps", "clientConnection.burst", "clientConnection.acceptContentTypes",
				"bindAddressHardFail", "showHiddenMetricsForVersion", "oomScoreAdj", "portRange",
				"featureGates.Alpha", "featureGates.Zeta",
				"iptables.localhostNodePorts", "nftables", "detectLocalMode", "detectLocal",
				"logging.format", "logging.flushFrequency", "winkernel", "windowsRunAsService",
			},
		},
		{
			name: "kube-proxy's defaults of unsupported settings do not warn",
			file: header + `
bindAddress: "::"
oomScoreAdj: -999
clientConnection: {qps: 5, burst: 10, contentType: application/vnd.kubernetes.protobuf}
detectLocalMode: ClusterCIDR
iptables: {localhostNodePorts: false}
nftables: {syncPeriod: 30s, minSyncPeriod: 1s, masqueradeBit: 14}
logging: {format: text, flushFrequency: 5s}
`,
			want: func(o *Options) { o.BindAddress = "::" },
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, decodeWarnings, err := DecodeProxyConfig([]byte(tc.file))
			if err != nil {
				t.Fatalf("DecodeProxyConfig() = %v", err)
			}
			if len(decodeWarnings) > 0 {
				t.Fatalf("decoding warned: %v", decodeWarnings)
			}
			o, fs := configFlags(t, tc.args...)
			warnings, err := o.ApplyProxyConfig(cfg, fs)
			if len(tc.wantErrs) > 0 {
				if err == nil {
					t.Fatalf("ApplyProxyConfig() accepted the file")
				}
				for _, want := range tc.wantErrs {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("ApplyProxyConfig() = %q, want it to mention %q", err, want)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("ApplyProxyConfig() = %v", err)
			}
			want, _ := configFlags(t, tc.args...)
			if tc.want != nil {
				tc.want(want)
			}
			if !reflect.DeepEqual(o, want) {
				t.Errorf("options\n got %+v\nwant %+v", o, want)
			}
			if got := warningFields(warnings); !slices.Equal(got, tc.wantWarnings) {
				t.Errorf("warnings %v, want fields %v", warnings, tc.wantWarnings)
			}
			for flag, value := range tc.wantFlags {
				if got := fs.Lookup(flag).Value.String(); got != value {
					t.Errorf("-%s = %q, want %q", flag, got, value)
				}
			}
			if err := o.Validate(); err != nil {
				t.Errorf("the applied options do not validate: %v", err)
			}
		})
	}
}

// TestProxyConfigRoundTrip writes options as a config file and reads them
// back: the file must load without warnings into the same options.
func TestProxyConfigRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		// wantWarnings are the fields ProxyConfig cannot express.
		wantWarnings []string
		// lost adjusts the written options to what reads back.
		lost func(o *Options)
	}{
		{name: "defaults"},
		{
			name: "every field a file expresses",
			args: []string{
				"--kubeconfig=/k", "--hostname-override=n",
				"--cluster-cidr=10.244.0.0/16,fd00::/56", "--healthz-bind-address=[::]:1", "--metrics-bind-address=0.0.0.0:2",
				"--config-sync-period=3m", "--nodeport-addresses=10.0.0.0/8,primary", "--bind-address=10.0.0.5", "--masquerade-all",
				"--iptables-masquerade-bit=0", "--iptables-sync-period=40s", "--iptables-min-sync-period=3s", "-v=5",
				"--proxy-mode=ipvs", "--ipvs-scheduler=sh", "--ipvs-strict-arp", "--ipvs-tcp-timeout=1s", "--ipvs-tcpfin-timeout=2s",
				"--ipvs-udp-timeout=3s", "--ipvs-exclude-cidrs=10.1.0.0/16,fd01::/64", "--ipvs-sync-period=50s", "--ipvs-min-sync-period=4s",
				"--conntrack-max-per-core=0", "--conntrack-min=7", "--conntrack-tcp-timeout-established=0",
				"--conntrack-tcp-timeout-close-wait=8s", "--conntrack-tcp-be-liberal", "--conntrack-udp-timeout=9s",
				"--conntrack-udp-timeout-stream=10s",
			},
		},
		{
			name: "nftables mode: the nftables block",
			args: []string{
				"--proxy-mode=nftables", "--masquerade-all", "--iptables-masquerade-bit=0", "--iptables-sync-period=40s",
				"--iptables-min-sync-period=3s", "--cluster-cidr=10.244.0.0/16",
			},
		},
		{
			name:         "nftables mode: a min sync period of 0",
			args:         []string{"--proxy-mode=nftables", "--iptables-min-sync-period=0"},
			wantWarnings: []string{"nftables.minSyncPeriod"},
			lost: func(o *Options) {
				o.ProxyMode = ModeNFTables
			},
		},
		{
			name:         "what a file cannot express",
			args:         []string{"--master=https://a", "--service-proxy-name=x", "--iptables-restore-batch-chains=7", "--healthz-bind-address=", "--metrics-bind-address=", "--iptables-min-sync-period=0"},
			wantWarnings: []string{"healthzBindAddress", "metricsBindAddress", "iptables.minSyncPeriod", "--master", "--service-proxy-name", "--iptables-restore-batch-chains"},
			lost: func(o *Options) {
				*o = *NewOptions()
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, fs := configFlags(t, tc.args...)
			cfg, warnings := o.ProxyConfig(fs)
			if got := warningFields(warnings); !slices.Equal(got, tc.wantWarnings) {
				t.Errorf("ProxyConfig() warnings %v, want fields %v", warnings, tc.wantWarnings)
			}
			path := filepath.Join(t.TempDir(), "config.yaml")
			if err := WriteProxyConfig(path, cfg); err != nil {
				t.Fatal(err)
			}
			read, readWarnings, err := LoadProxyConfig(path)
			if err != nil {
				t.Fatalf("LoadProxyConfig() = %v", err)
			}
			back, backFlags := configFlags(t)
			applyWarnings, err := back.ApplyProxyConfig(read, backFlags)
			if err != nil {
				t.Fatalf("ApplyProxyConfig() = %v", err)
			}
			if all := append(readWarnings, applyWarnings...); len(all) > 0 {
				t.Errorf("reading the written file warned: %v", all)
			}
			want := o
			if tc.lost != nil {
				want = NewOptions()
				tc.lost(want)
			}
			if !reflect.DeepEqual(back, want) {
				t.Errorf("read back\n got %+v\nwant %+v", back, want)
			}
			if got, want := backFlags.Lookup("v").Value.String(), fs.Lookup("v").Value.String(); got != want {
				t.Errorf("-v read back as %q, want %q", got, want)
			}
		})
	}
}

// TestDeployConfigMapLoads loads hack/deploy's ConfigMap the way the
// DaemonSet runs kproxy: --config=<its config.conf> --hostname-override.
func TestDeployConfigMapLoads(t *testing.T) {
	data := configMapData(t, filepath.Join("..", "..", "..", "hack", "deploy", "02-configmap.yaml"), "config.conf")
	path := filepath.Join(t.TempDir(), "config.conf")
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	o, fs := configFlags(t, "--config="+path, "--hostname-override=node-a")
	cfg, warnings, err := LoadProxyConfig(o.ConfigFile)
	if err != nil {
		t.Fatal(err)
	}
	applyWarnings, err := o.ApplyProxyConfig(cfg, fs)
	if err != nil {
		t.Fatal(err)
	}
	if all := append(warnings, applyWarnings...); len(all) > 0 {
		t.Errorf("the deployed config warns: %v", all)
	}
	if err := o.Validate(); err != nil {
		t.Fatalf("the deployed config does not validate: %v", err)
	}
	want := NewOptions()
	want.ConfigFile = path
	want.HostnameOverride = "node-a"
	want.ClusterCIDR = "10.244.0.0/16"
	if !reflect.DeepEqual(o, want) {
		t.Errorf("options\n got %+v\nwant %+v", o, want)
	}
}

// TestMainConfigFile runs the command with --config and --write-config-to:
// the written file shows the file under the command line's flags, and bad
// files fail before anything else happens.
func TestMainConfigFile(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const header = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
	good := write("good.yaml", header+"clusterCIDR: 10.244.0.0/16\niptables:\n  syncPeriod: 1m\n  masqueradeBit: 10\nunknownField: 1\n")
	for _, tc := range []struct {
		name string
		args []string
		// wantWritten are lines the written file must hold.
		wantWritten []string
		// wantErrs are substrings of stderr for a failing run.
		wantErrs []string
	}{
		{
			name:        "file under flags",
			args:        []string{"--config=" + good, "--iptables-masquerade-bit=12"},
			wantWritten: []string{"clusterCIDR: 10.244.0.0/16", "  syncPeriod: 1m0s", "  masqueradeBit: 12", "mode: iptables"},
		},
		{name: "missing file", args: []string{"--config=" + filepath.Join(dir, "nope.yaml")}, wantErrs: []string{"reading the config file", "nope.yaml"}},
		{
			name:        "nftables mode",
			args:        []string{"--config=" + write("nft.yaml", header+"mode: nftables\nnftables:\n  syncPeriod: 1m\n  masqueradeBit: 10\n"), "--iptables-min-sync-period=2s"},
			wantWritten: []string{"mode: nftables", "nftables:", "  syncPeriod: 1m0s", "  masqueradeBit: 10", "  minSyncPeriod: 2s"},
		},
		{name: "kernelspace mode", args: []string{"--config=" + write("win.yaml", header+"mode: kernelspace\n")}, wantErrs: []string{"win.yaml", `mode: "kernelspace" is kube-proxy's Windows mode`}},
		{
			name:     "invalid value from the file",
			args:     []string{"--config=" + write("bit.yaml", header+"iptables:\n  masqueradeBit: 40\n")},
			wantErrs: []string{"invalid configuration (flags and config file", "bit.yaml", "--iptables-masquerade-bit=40"},
		},
		{name: "not a KubeProxyConfiguration", args: []string{"--config=" + write("kubelet.yaml", "apiVersion: v1\nkind: ConfigMap\n")}, wantErrs: []string{"kubelet.yaml", "ConfigMap"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "effective.yaml")
			code, _, stderr := runMain(append(tc.args, "--write-config-to="+out)...)
			if len(tc.wantErrs) > 0 {
				if code == 0 {
					t.Fatalf("exit code 0, want a failure")
				}
				for _, want := range tc.wantErrs {
					if !strings.Contains(stderr, want) {
						t.Errorf("stderr %q, want it to mention %q", stderr, want)
					}
				}
				if _, err := os.Stat(out); err == nil {
					t.Errorf("a failing run wrote %s", out)
				}
				return
			}
			if code != 0 {
				t.Fatalf("exit code %d, stderr %q", code, stderr)
			}
			written, err := os.ReadFile(out)
			if err != nil {
				t.Fatal(err)
			}
			lines := strings.Split(string(written), "\n")
			for _, want := range tc.wantWritten {
				if !slices.Contains(lines, want) {
					t.Errorf("written file lacks %q:\n%s", want, written)
				}
			}
		})
	}
}

// everythingOptions are the options set by the configuration file
// "everything" of TestApplyProxyConfig.
func everythingOptions(o *Options) {
	o.Kubeconfig = "/etc/kproxy/kubeconfig"
	o.HostnameOverride = "node-a"
	o.BindAddress = "10.0.0.5"
	o.ClusterCIDR = "10.244.0.0/16,fd00:10:244::/56"
	o.HealthzBindAddress = "127.0.0.1:20256"
	o.MetricsBindAddress = "0.0.0.0:20249"
	o.ConfigSyncPeriod = 5 * time.Minute
	o.NodePortAddresses = []string{"10.0.0.0/8", "fd00::/64", "primary"}
	o.MasqueradeAll = true
	o.MasqueradeBit = 12
	o.SyncPeriod = time.Minute
	o.MinSyncPeriod = 2 * time.Second
	o.IPVSScheduler = "wrr"
	o.IPVSStrictARP = true
	o.IPVSTCPTimeout = 900 * time.Second
	o.IPVSTCPFinTimeout = 120 * time.Second
	o.IPVSUDPTimeout = 5 * time.Minute
	o.IPVSExcludeCIDRs = []string{"10.8.0.0/16", "fd08::/64"}
	o.IPVSSyncPeriod = 20 * time.Second
	o.IPVSMinSyncPeriod = 500 * time.Millisecond
	o.Conntrack.MaxPerCore = 65536
	o.Conntrack.Min = 262144
	o.Conntrack.TCPEstablishedTimeout = 2 * time.Hour
	o.Conntrack.TCPCloseWaitTimeout = 30 * time.Minute
	o.Conntrack.TCPBeLiberal = true
	o.Conntrack.UDPTimeout = 30 * time.Second
	o.Conntrack.UDPStreamTimeout = 300 * time.Second
}
