package cluster

import (
	"slices"
	"strings"
	"testing"
)

// flagValue returns the value of --name=value in args, and whether it is
// there.
func flagValue(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func TestControlPlaneArgs(t *testing.T) {
	l := layout{"/run/kpc"}
	tests := []struct {
		name string
		args []string
		want map[string]string
	}{
		{
			name: "etcd keeps its data in the state directory, on loopback",
			args: etcdArgs(l),
			want: map[string]string{"data-dir": "/run/kpc/etcd", "listen-client-urls": "http://127.0.0.1:2379"},
		},
		{
			name: "kube-apiserver",
			args: apiServerArgs(l),
			want: map[string]string{
				"etcd-servers":                     "http://127.0.0.1:2379",
				"service-cluster-ip-range":         "10.96.0.0/16",
				"secure-port":                      "6443",
				"bind-address":                     "0.0.0.0",
				"advertise-address":                "10.254.0.2",
				"authorization-mode":               "Node,RBAC",
				"token-auth-file":                  "/run/kpc/tokens.csv",
				"service-account-key-file":         "/run/kpc/pki/sa.pub",
				"service-account-signing-key-file": "/run/kpc/pki/sa.key",
				"disable-admission-plugins":        "ServiceAccount,TaintNodesByCondition",
				"allow-privileged":                 "true",
				"tls-cert-file":                    "/run/kpc/pki/apiserver.crt",
			},
		},
		{
			name: "kube-controller-manager: no node lifecycle, no leader election",
			args: controllerManagerArgs(l),
			want: map[string]string{
				"kubeconfig":                      "/run/kpc/control-plane.kubeconfig",
				"controllers":                     "endpointslice-controller,endpointslice-mirroring-controller,deployment-controller,replicaset-controller,garbage-collector-controller,namespace-controller",
				"cluster-cidr":                    "10.244.0.0/16",
				"service-cluster-ip-range":        "10.96.0.0/16",
				"leader-elect":                    "false",
				"use-service-account-credentials": "false",
			},
		},
		{
			name: "kube-scheduler",
			args: schedulerArgs(l),
			want: map[string]string{"kubeconfig": "/run/kpc/control-plane.kubeconfig", "leader-elect": "false"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for name, want := range tc.want {
				if got, ok := flagValue(tc.args, name); !ok || got != want {
					t.Errorf("--%s = %q (present %t), want %q", name, got, ok, want)
				}
			}
			for _, a := range tc.args {
				if strings.HasPrefix(a, "--cert-dir=") && !strings.HasPrefix(a, "--cert-dir=/run/kpc/") {
					t.Errorf("%s writes certificates outside the state directory", a)
				}
			}
		})
	}
}

func TestKproxyArgs(t *testing.T) {
	l := layout{"/s"}
	tests := []struct {
		name  string
		i     int
		mode  string
		extra []string
		want  []string
	}{
		{
			name: "as the DaemonSet runs it",
			i:    1, mode: "iptables",
			want: []string{"--kubeconfig=/s/nodes/node-1/kproxy.kubeconfig", "--hostname-override=node-1",
				"--cluster-cidr=10.244.0.0/16", "--proxy-mode=iptables", "-v=2"},
		},
		{
			name: "extra flags last, so they win",
			i:    2, mode: "ipvs", extra: []string{"--masquerade-all", "-v=4"},
			want: []string{"--kubeconfig=/s/nodes/node-2/kproxy.kubeconfig", "--hostname-override=node-2",
				"--cluster-cidr=10.244.0.0/16", "--proxy-mode=ipvs", "-v=2", "--masquerade-all", "-v=4"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := kproxyArgs(l, tc.i, tc.mode, tc.extra); !slices.Equal(got, tc.want) {
				t.Errorf("kproxyArgs = %q, want %q", got, tc.want)
			}
			// The exported form (what `kpc demo` prints kproxy commands
			// from) is the same before the extra flags.
			if got, want := KproxyArgs(l.dir, tc.i, tc.mode), tc.want[:len(tc.want)-len(tc.extra)]; !slices.Equal(got, want) {
				t.Errorf("KproxyArgs = %q, want %q", got, want)
			}
		})
	}
}

func TestLayout(t *testing.T) {
	l := layout{"/run/kpc"}
	tests := []struct{ name, got, want string }{
		{name: "node process log", got: l.logFile("kproxy/node-1"), want: "/run/kpc/logs/kproxy-node-1.log"},
		{name: "control plane log", got: l.logFile("etcd"), want: "/run/kpc/logs/etcd.log"},
		{name: "host kubeconfig", got: l.hostKubeconfig(), want: "/run/kpc/kubeconfig"},
		{name: "agent kubeconfig", got: l.agentKubeconfig("node-2"), want: "/run/kpc/nodes/node-2/agent.kubeconfig"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.got != tc.want {
				t.Errorf("= %q, want %q", tc.got, tc.want)
			}
		})
	}
}
