package main

import (
	"bytes"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"

	"github.com/kproxy/kproxy/test/cluster"
)

func TestSplitExec(t *testing.T) {
	tests := []struct {
		name       string
		args       []string
		dash       int
		wantTarget string
		wantCmd    []string
		wantErr    bool
	}{
		{name: "target and command", args: []string{"node-1", "ip", "-4", "addr"}, dash: 1, wantTarget: "node-1", wantCmd: []string{"ip", "-4", "addr"}},
		{name: "pod with namespace", args: []string{"default/web", "curl", "-s", "x"}, dash: 1, wantTarget: "default/web", wantCmd: []string{"curl", "-s", "x"}},
		{name: "no dash", args: []string{"node-1", "ip"}, dash: -1, wantErr: true},
		{name: "no command after the dash", args: []string{"node-1"}, dash: 1, wantErr: true},
		{name: "no target before the dash", args: []string{"ip", "addr"}, dash: 0, wantErr: true},
		{name: "two targets", args: []string{"node-1", "node-2", "ip"}, dash: 2, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			target, cmd, err := splitExec(tc.args, tc.dash)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %t", err, tc.wantErr)
			}
			if target != tc.wantTarget || !slices.Equal(cmd, tc.wantCmd) {
				t.Errorf("= %q, %q; want %q, %q", target, cmd, tc.wantTarget, tc.wantCmd)
			}
		})
	}
}

// parseUp parses `kpc up` flags the way the command does.
func parseUp(t *testing.T, args ...string) (*upOptions, error) {
	t.Helper()
	g := &globalOptions{StateDir: "/run/kpc"}
	cmd := newUpCommand(g, &bytes.Buffer{})
	if err := cmd.ParseFlags(args); err != nil {
		return nil, err
	}
	o := &upOptions{}
	o.Nodes, _ = cmd.Flags().GetInt("nodes")
	o.Mode, _ = cmd.Flags().GetString("mode")
	o.BinDir, _ = cmd.Flags().GetString("bin-dir")
	o.KproxyArgs, _ = cmd.Flags().GetStringArray("kproxy-arg")
	return o, nil
}

func TestUpFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		// modeEnv is $KPC_MODE.
		modeEnv string
		want    cluster.Options
		wantErr bool
	}{
		{
			name: "defaults",
			want: cluster.Options{Nodes: 2, Mode: "iptables", StateDir: "/run/kpc", BinDir: "/bin"},
		},
		{
			name: "nftables mode",
			args: []string{"--mode", "nftables"},
			want: cluster.Options{Nodes: 2, Mode: "nftables", StateDir: "/run/kpc", BinDir: "/bin"},
		},
		{
			name:    "mode from KPC_MODE",
			modeEnv: "nftables",
			want:    cluster.Options{Nodes: 2, Mode: "nftables", StateDir: "/run/kpc", BinDir: "/bin"},
		},
		{
			name:    "the flag beats KPC_MODE",
			args:    []string{"--mode=iptables"},
			modeEnv: "nftables",
			want:    cluster.Options{Nodes: 2, Mode: "iptables", StateDir: "/run/kpc", BinDir: "/bin"},
		},
		{name: "unknown mode", args: []string{"--mode=userspace"}, wantErr: true},
		{name: "unknown mode in KPC_MODE", modeEnv: "nft", wantErr: true},
		{
			name: "nodes, mode and kproxy flags",
			args: []string{"--nodes", "3", "--mode=ipvs", "--kproxy-arg=--masquerade-all", "--kproxy-arg", "--nodeport-addresses=10.254.0.0/24,10.253.0.0/24"},
			want: cluster.Options{Nodes: 3, Mode: "ipvs", StateDir: "/run/kpc", BinDir: "/bin",
				KproxyArgs: []string{"--masquerade-all", "--nodeport-addresses=10.254.0.0/24,10.253.0.0/24"}},
		},
		{name: "zero nodes", args: []string{"--nodes=0"}, wantErr: true},
		{name: "too many nodes", args: []string{"--nodes=90"}, wantErr: true},
		{name: "empty mode", args: []string{"--mode="}, wantErr: true},
		{name: "not a number", args: []string{"--nodes=two"}, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("KPC_BIN_DIR", "/bin")
			t.Setenv(modeEnv, tc.modeEnv)
			o, err := parseUp(t, tc.args...)
			var got cluster.Options
			if err == nil {
				got, err = o.clusterOptions("/run/kpc")
			}
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %t", err, tc.wantErr)
			}
			if tc.wantErr {
				return
			}
			if got.Nodes != tc.want.Nodes || got.Mode != tc.want.Mode || got.StateDir != tc.want.StateDir ||
				got.BinDir != tc.want.BinDir || !slices.Equal(got.KproxyArgs, tc.want.KproxyArgs) {
				t.Errorf("options %+v, want %+v", got, tc.want)
			}
		})
	}
}

// TestAgentArgsFromUp checks that the arguments `kpc up` gives each node
// agent parse into the options the node agent needs.
func TestAgentArgsFromUp(t *testing.T) {
	tests := []struct {
		name string
		i    int
	}{
		{name: "node 1", i: 1},
		{name: "node 7", i: 7},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			args := cluster.AgentArgs("/run/kpc", tc.i)
			if args[0] != "agent" {
				t.Fatalf("args %q do not start with the agent command", args)
			}
			root := newRootCommand(&bytes.Buffer{})
			cmd, rest, err := root.Find(args)
			if err != nil || cmd.Name() != "agent" {
				t.Fatalf("finding the agent command in %q: %v", args, err)
			}
			if err := cmd.ParseFlags(rest); err != nil {
				t.Fatalf("parsing %q: %v", rest, err)
			}
			f := agentFlagsOf(t, cmd)
			opts, err := f.options()
			if err != nil {
				t.Fatalf("options: %v", err)
			}
			if opts.NodeName != cluster.NodeName(tc.i) || opts.NodeNetNS != cluster.NodeNetNS(tc.i) {
				t.Errorf("node %q netns %q", opts.NodeName, opts.NodeNetNS)
			}
			if opts.NodeIP != netip.MustParseAddr(cluster.NodeIP(tc.i)) {
				t.Errorf("node IP %v, want %s", opts.NodeIP, cluster.NodeIP(tc.i))
			}
			if opts.PodCIDR != netip.MustParsePrefix(cluster.NodePodCIDR(tc.i)) {
				t.Errorf("podCIDR %v, want %s", opts.PodCIDR, cluster.NodePodCIDR(tc.i))
			}
			if want := filepath.Join("/run/kpc/nodes", cluster.NodeName(tc.i), "agent.kubeconfig"); opts.Kubeconfig != want {
				t.Errorf("kubeconfig %q, want %q", opts.Kubeconfig, want)
			}
		})
	}
}

// agentFlagsOf reads the agent's flags back from a parsed command.
func agentFlagsOf(t *testing.T, cmd *cobra.Command) *agentFlags {
	t.Helper()
	fs := cmd.Flags()
	f := &agentFlags{}
	var err error
	for name, dst := range map[string]*string{
		"kubeconfig": &f.Kubeconfig, "node-name": &f.NodeName, "node-ip": &f.NodeIP,
		"pod-cidr": &f.PodCIDR, "netns": &f.NetNS,
	} {
		if *dst, err = fs.GetString(name); err != nil {
			t.Fatalf("flag --%s: %v", name, err)
		}
	}
	if f.MaxGracePeriod, err = fs.GetDuration("max-grace-period"); err != nil {
		t.Fatalf("flag --max-grace-period: %v", err)
	}
	return f
}

func TestRulesCommand(t *testing.T) {
	for _, mode := range cluster.KnownModes() {
		t.Run(mode, func(t *testing.T) {
			cmd := rulesCommand(mode)
			if cmd == "" || (mode == cluster.ModeNFTables) != strings.HasPrefix(cmd, "nft ") {
				t.Errorf("rulesCommand(%s) = %q", mode, cmd)
			}
		})
	}
}

func TestAgentFlagErrors(t *testing.T) {
	valid := agentFlags{Kubeconfig: "/k", NodeName: "node-1", NodeIP: "10.254.0.11", PodCIDR: "10.244.1.0/24", NetNS: "kpc-node-1"}
	tests := []struct {
		name    string
		mutate  func(*agentFlags)
		wantErr string
	}{
		{name: "valid", mutate: func(*agentFlags) {}},
		{name: "bad node IP", mutate: func(f *agentFlags) { f.NodeIP = "10.254.0" }, wantErr: "--node-ip"},
		{name: "bad pod CIDR", mutate: func(f *agentFlags) { f.PodCIDR = "10.244.1.0" }, wantErr: "--pod-cidr"},
		{name: "no kubeconfig", mutate: func(f *agentFlags) { f.Kubeconfig = "" }, wantErr: "--kubeconfig"},
		{name: "no netns", mutate: func(f *agentFlags) { f.NetNS = "" }, wantErr: "--netns"},
		{name: "grace period kept", mutate: func(f *agentFlags) { f.MaxGracePeriod = 5 * time.Second }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := valid
			tc.mutate(&f)
			opts, err := f.options()
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("options: %v", err)
				}
				if opts.MaxGracePeriod != f.MaxGracePeriod {
					t.Errorf("grace period %v, want %v", opts.MaxGracePeriod, f.MaxGracePeriod)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("err = %v, want one naming %s", err, tc.wantErr)
			}
		})
	}
}

func TestCommandsWithoutCluster(t *testing.T) {
	t.Setenv(modeEnv, "")
	state := filepath.Join(t.TempDir(), "none")
	tests := []struct {
		name     string
		args     []string
		wantCode int
		wantErr  string
	}{
		{name: "status", args: []string{"status", "--state", state}, wantCode: 1, wantErr: "no local cluster is up"},
		{name: "kubeconfig", args: []string{"kubeconfig", "--state", state}, wantCode: 1, wantErr: "no local cluster is up"},
		{name: "exec", args: []string{"exec", "--state", state, "client", "--", "true"}, wantCode: 1, wantErr: "no local cluster is up"},
		{name: "exec without a dash", args: []string{"exec", "--state", state, "client", "true"}, wantCode: 1, wantErr: "usage: kpc exec"},
		{name: "unknown command", args: []string{"upp"}, wantCode: 1, wantErr: "unknown command"},
		{name: "kubectl", args: []string{"kubectl", "--state", state, "get", "pods"}, wantCode: 1, wantErr: "no local cluster is up"},
		{name: "kubectl, state before it", args: []string{"--state", state, "kubectl", "get", "pods"}, wantCode: 1, wantErr: "no local cluster is up"},
		{name: "mode", args: []string{"mode", "--state", state}, wantCode: 1, wantErr: "no local cluster is up"},
		{name: "mode switch", args: []string{"mode", "--state", state, "nftables"}, wantCode: 1, wantErr: "no local cluster is up"},
		{name: "two modes", args: []string{"mode", "--state", state, "iptables", "nftables"}, wantCode: 1, wantErr: "accepts at most 1 arg"},
		{name: "demo with an unknown mode", args: []string{"demo", "--state", state, "--mode=nft"}, wantCode: 1, wantErr: `"nft" is not a kproxy proxy mode`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := run(tc.args, &stdout, &stderr); code != tc.wantCode {
				t.Errorf("exit code %d, want %d (stderr %q)", code, tc.wantCode, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.wantErr) {
				t.Errorf("stderr %q, want it to contain %q", stderr.String(), tc.wantErr)
			}
		})
	}
}
