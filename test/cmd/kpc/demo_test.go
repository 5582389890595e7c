package main

import (
	"bytes"
	"io"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kproxy/kproxy/cmd/kproxy/app"
	"github.com/kproxy/kproxy/test/cluster"
)

// demoValues are a running demo's values: the echo Service and the client
// pod on node-2, as the API server reports them.
func demoValues(mode string) tryItValues {
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "echo", Namespace: demoNamespace},
		Spec: v1.ServiceSpec{
			Type: v1.ServiceTypeNodePort, ClusterIP: "10.96.0.77",
			Ports: []v1.ServicePort{{Name: "echo", Port: 80, NodePort: 30123, Protocol: v1.ProtocolTCP}},
		},
	}
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "client", Namespace: demoNamespace},
		Spec:       v1.PodSpec{NodeName: cluster.NodeName(2)},
		Status:     v1.PodStatus{PodIP: "10.244.2.5", HostIP: cluster.NodeIP(2)},
	}
	return tryItValues{
		Kpc: "/src/test/_cache/bin/0123456789ab/kpc", Mode: mode, Service: svc, ClientPod: pod,
		AgentFlags:       explainFlags(cluster.KproxyArgs("/run/kpc", 2, mode)),
		ExternalClientIP: cluster.ClientIP,
	}
}

// TestTryItCommands checks that the demo's "try it" commands carry the
// running demo's values: the client pod's node, its address, the Service's
// ClusterIP, port and node port, and the flags kproxy runs with there.
func TestTryItCommands(t *testing.T) {
	const kpc = "/src/test/_cache/bin/0123456789ab/kpc"
	kubectl := kpc + " kubectl -n demo get pods,svc,endpointslices -o wide"
	tracePod := kpc + " exec node-2 -- kproxy trace --src 10.244.2.5 --dst 10.96.0.77 --dport 80 --from pod"
	traceNodePort := kpc + " exec node-2 -- kproxy trace --src 10.254.0.100 --dst 10.254.0.12 --dport 30123"
	explain := kpc + " exec node-2 -- kproxy explain demo/echo --kubeconfig=/run/kpc/nodes/node-2/kproxy.kubeconfig --hostname-override=node-2 --cluster-cidr=10.244.0.0/16"
	tests := []struct {
		name string
		mode string
		want []string
	}{
		{
			name: "iptables",
			mode: cluster.ModeIPTables,
			want: []string{kubectl, kpc + " exec node-2 -- iptables-save -t nat | grep KPROXY", tracePod, traceNodePort, explain,
				kpc + " exec client -- ip route", kpc + " mode nftables", kpc + " status"},
		},
		{
			name: "nftables",
			mode: cluster.ModeNFTables,
			want: []string{kubectl, kpc + " exec node-2 -- nft list ruleset", tracePod, traceNodePort, explain,
				kpc + " exec client -- ip route", kpc + " mode iptables", kpc + " status"},
		},
		{
			name: "ipvs: no trace",
			mode: cluster.ModeIPVS,
			want: []string{kubectl, kpc + " exec node-2 -- ipvsadm -Ln", explain,
				kpc + " exec client -- ip route", kpc + " mode iptables", kpc + " status"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, l := range tryItCommands(demoValues(tc.mode)) {
				got = append(got, l.Command)
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("commands:\n  %s\nwant:\n  %s", strings.Join(got, "\n  "), strings.Join(tc.want, "\n  "))
			}
		})
	}
}

// TestTryItCommandsParse runs every printed command's arguments through
// kpc's own command line and, for a kproxy command, kproxy's: each must be
// one they accept. `kproxy explain` is checked once kproxy has it.
func TestTryItCommandsParse(t *testing.T) {
	for _, mode := range []string{cluster.ModeIPTables, cluster.ModeNFTables, cluster.ModeIPVS} {
		v := demoValues(mode)
		for _, l := range tryItCommands(v) {
			t.Run(mode+"/"+strings.TrimPrefix(l.Command, v.Kpc+" "), func(t *testing.T) {
				line, _, _ := strings.Cut(l.Command, "|")
				f := strings.Fields(line)
				if f[0] != v.Kpc {
					t.Fatalf("%q does not start with kpc's path %s", l.Command, v.Kpc)
				}
				cmd, rest, err := newRootCommand(io.Discard).Find(f[1:])
				if err != nil || cmd == cmd.Root() {
					t.Fatalf("no kpc command in %q: %v", l.Command, err)
				}
				if cmd.DisableFlagParsing {
					return
				}
				if err := cmd.ParseFlags(rest); err != nil {
					t.Fatalf("kpc %s flags %q: %v", cmd.Name(), rest, err)
				}
				if cmd.Args != nil {
					if err := cmd.Args(cmd, cmd.Flags().Args()); err != nil {
						t.Fatalf("kpc %s arguments: %v", cmd.Name(), err)
					}
				}
				if cmd.Name() != "exec" {
					return
				}
				target, command, err := splitExec(cmd.Flags().Args(), cmd.Flags().ArgsLenAtDash())
				if err != nil {
					t.Fatalf("kpc exec %q: %v", rest, err)
				}
				if command[0] != "kproxy" {
					return
				}
				if want := v.ClientPod.Spec.NodeName; target != want {
					t.Errorf("kproxy runs on %s, want the client pod's node %s", target, want)
				}
				kcmd, krest, err := app.NewCommand(io.Discard).Find(command[1:])
				if err != nil || kcmd.Name() != command[1] {
					if command[1] == "explain" {
						t.Skipf("this kproxy has no explain command yet (%v)", err)
					}
					t.Fatalf("no kproxy %s command: %v", command[1], err)
				}
				if err := kcmd.ParseFlags(krest); err != nil {
					t.Fatalf("kproxy %s flags %q: %v", kcmd.Name(), krest, err)
				}
			})
		}
	}
}

// TestExplainFlags checks that explain gets the agent's own --kubeconfig,
// --hostname-override and --cluster-cidr (the last of each, as for the
// agent) and nothing else.
func TestExplainFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{
			name: "the cluster's kproxy on node 3",
			args: cluster.KproxyArgs("/tmp/state", 3, cluster.ModeNFTables),
			want: []string{"--kubeconfig=/tmp/state/nodes/node-3/kproxy.kubeconfig", "--hostname-override=node-3", "--cluster-cidr=10.244.0.0/16"},
		},
		{
			name: "a later flag wins",
			args: []string{"--kubeconfig=/a", "--hostname-override=n1", "--proxy-mode=iptables", "--kubeconfig=/b"},
			want: []string{"--kubeconfig=/b", "--hostname-override=n1"},
		},
		{
			name: "none",
			args: []string{"--proxy-mode=iptables", "-v=2"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := explainFlags(tc.args); !slices.Equal(got, tc.want) {
				t.Errorf("= %q, want %q", got, tc.want)
			}
		})
	}
}

// TestPrintTryIt checks the printed block: every command on a line of its
// own (pastable as is), the tear-down last.
func TestPrintTryIt(t *testing.T) {
	v := demoValues(cluster.ModeNFTables)
	var b bytes.Buffer
	printTryIt(&b, v)
	out := b.String()
	lines := strings.Split(out, "\n")
	for _, l := range tryItCommands(v) {
		if !slices.Contains(lines, "  "+l.Command) {
			t.Errorf("no line %q in\n%s", "  "+l.Command, out)
		}
	}
	if !strings.Contains(out, "  "+v.Kpc+" down") {
		t.Errorf("no tear-down command in\n%s", out)
	}
}
