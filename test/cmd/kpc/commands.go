package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/test/cluster"
	"github.com/kproxy/kproxy/test/nodeagent"
)

// run executes kpc with args and returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	cmd := newRootCommand(stdout)
	cmd.SetArgs(args)
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	if err := cmd.Execute(); err != nil {
		var ee *exitError
		if errors.As(err, &ee) {
			return ee.code
		}
		fmt.Fprintln(stderr, "kpc:", err)
		return 1
	}
	return 0
}

// exitError ends kpc with a code and no further message.
type exitError struct{ code int }

func (e *exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// globalOptions are the flags of every subcommand.
type globalOptions struct {
	StateDir string
}

func newRootCommand(stdout io.Writer) *cobra.Command {
	g := &globalOptions{StateDir: cluster.DefaultStateDir()}
	root := &cobra.Command{
		Use:   "kpc",
		Short: "kpc runs a local Kubernetes cluster in network namespaces, with kproxy on every node",
		Long: `kpc runs a real Kubernetes control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) with nodes, pods and an external
client as network namespaces on this machine, and kproxy on every node.
Nothing leaves the machine: the host only reaches the API server over a /30.
See test/LOCAL-CLUSTER.md.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.PersistentFlags().StringVar(&g.StateDir, "state", g.StateDir, "State directory (certificates, kubeconfigs, logs, pids); $KPC_STATE or /run/kpc by default.")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	for _, name := range []string{"v", "vmodule"} {
		root.PersistentFlags().AddGoFlag(klogFlags.Lookup(name))
	}

	root.AddCommand(
		newUpCommand(g, stdout),
		newDownCommand(g, stdout),
		newStatusCommand(g, stdout),
		newKubeconfigCommand(g, stdout),
		newExecCommand(g),
		newKubectlCommand(g),
		newModeCommand(g, stdout),
		newAgentCommand(),
		newDemoCommand(g, stdout),
	)
	return root
}

// signalContext is cancelled by SIGINT or SIGTERM and carries klog's logger.
func signalContext() (context.Context, context.CancelFunc) {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	return klog.NewContext(ctx, klog.Background()), cancel
}

// upOptions are the flags of `kpc up`.
type upOptions struct {
	Nodes      int
	Mode       string
	BinDir     string
	KproxyArgs []string
}

// defaultBinDir is $KPC_BIN_DIR, or the directory of this kpc binary
// (hack/build-control-plane.sh puts kpc with the other programs).
func defaultBinDir() string {
	if d := os.Getenv("KPC_BIN_DIR"); d != "" {
		return d
	}
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	return filepath.Dir(exe)
}

// modeEnv names the default kproxy mode of `kpc up` and `kpc demo`.
const modeEnv = "KPC_MODE"

// defaultMode is $KPC_MODE, or kproxy's default mode.
func defaultMode() string {
	if m := os.Getenv(modeEnv); m != "" {
		return m
	}
	return cluster.DefaultMode
}

// validateMode checks a --mode value (from the flag or $KPC_MODE).
func validateMode(mode string) error {
	if err := cluster.ValidateMode(mode); err != nil {
		return fmt.Errorf("--mode (or $%s): %w", modeEnv, err)
	}
	return nil
}

// rulesCommand shows kproxy's kernel state on a node in mode.
func rulesCommand(mode string) string {
	switch mode {
	case cluster.ModeNFTables:
		return "nft list ruleset"
	case cluster.ModeIPVS:
		return "ipvsadm -Ln"
	default:
		return "iptables-save -t nat"
	}
}

func (o *upOptions) clusterOptions(stateDir string) (cluster.Options, error) {
	if o.Nodes < 1 || o.Nodes > cluster.MaxNodes {
		return cluster.Options{}, fmt.Errorf("--nodes must be within 1..%d, got %d", cluster.MaxNodes, o.Nodes)
	}
	if err := validateMode(o.Mode); err != nil {
		return cluster.Options{}, err
	}
	return cluster.Options{
		Nodes: o.Nodes, Mode: o.Mode, StateDir: stateDir, BinDir: o.BinDir,
		KproxyArgs: o.KproxyArgs,
	}, nil
}

func newUpCommand(g *globalOptions, stdout io.Writer) *cobra.Command {
	o := &upOptions{Nodes: cluster.DefaultNodes, Mode: defaultMode(), BinDir: defaultBinDir()}
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Start a cluster: network, control plane, node agents and kproxy",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts, err := o.clusterOptions(g.StateDir)
			if err != nil {
				return err
			}
			ctx, cancel := signalContext()
			defer cancel()
			began := time.Now()
			c, err := cluster.Up(ctx, opts)
			if err != nil {
				return err
			}
			fmt.Fprintf(stdout, `Cluster up in %[1]s: %[2]d nodes, kproxy --proxy-mode=%[3]s.
  %[8]s kubectl get nodes,pods -A       # kubectl --kubeconfig %[4]s
  %[8]s exec client -- curl -s http://%[5]s:<nodePort>/
  %[8]s exec node-1 -- %[6]s
  %[8]s mode <iptables|nftables|ipvs>   # switch every node's kproxy
  %[8]s status
  %[8]s down
Logs: %[7]s/logs
`, time.Since(began).Round(100*time.Millisecond), opts.Nodes, c.Mode(), c.Kubeconfig(), cluster.NodeIP(1), rulesCommand(c.Mode()), c.StateDir(), selfPath())
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&o.Nodes, "nodes", o.Nodes, "Number of nodes.")
	f.StringVar(&o.Mode, "mode", o.Mode, "kproxy --proxy-mode: "+strings.Join(cluster.KnownModes(), ", ")+" (checked against the kproxy binary and this host before anything starts); $"+modeEnv+" or "+cluster.DefaultMode+" by default.")
	f.StringVar(&o.BinDir, "bin-dir", o.BinDir, "Directory of etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kpc and kproxy (hack/build-control-plane.sh prints it); $KPC_BIN_DIR or kpc's own directory by default.")
	f.StringArrayVar(&o.KproxyArgs, "kproxy-arg", nil, "Extra kproxy flag for every node (repeatable), e.g. --kproxy-arg=--masquerade-all.")
	return cmd
}

func newDownCommand(g *globalOptions, stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "down",
		Short: "Stop the cluster and remove every kpc namespace, link, process and the state directory",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := signalContext()
			defer cancel()
			if err := cluster.Down(ctx, g.StateDir); err != nil {
				return err
			}
			fmt.Fprintln(stdout, "Cluster down.")
			return nil
		},
	}
}

func newStatusCommand(g *globalOptions, stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Show the processes, the API server and the nodes (exit 1 unless all is well)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := cluster.Load(g.StateDir)
			if err != nil {
				return err
			}
			ctx, cancel := signalContext()
			defer cancel()
			s, err := c.Status(ctx)
			if err != nil {
				return err
			}
			printStatus(stdout, s)
			if !s.Healthy() {
				return &exitError{code: 1}
			}
			return nil
		},
	}
}

func printStatus(w io.Writer, s *cluster.Status) {
	fmt.Fprintf(w, "State:      %s\nKubeconfig: %s\nMode:       %s\n", s.StateDir, s.Kubeconfig, s.Mode)
	if s.APIError != "" {
		fmt.Fprintf(w, "API server: NOT ANSWERING: %s\n", s.APIError)
	} else {
		fmt.Fprintln(w, "API server: ok")
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nPROCESS\tPID\tSTATE\tLOG")
	for _, p := range s.Processes {
		state := "running"
		if !p.Running {
			state = "EXITED"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\n", p.Name, p.PID, state, p.Log)
	}
	if len(s.Nodes) > 0 {
		fmt.Fprintln(tw, "\nNODE\tIP\tNETNS\tREADY\tHEARTBEAT")
		for _, n := range s.Nodes {
			hb := "-"
			if !n.Heartbeat.IsZero() {
				hb = time.Since(n.Heartbeat).Round(time.Second).String() + " ago"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%t\t%s\n", n.Name, n.IP, n.NetNS, n.Ready, hb)
		}
	}
	tw.Flush()
}

func newModeCommand(g *globalOptions, stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "mode [iptables|nftables|ipvs]",
		Short: "Print kproxy's mode, or switch kproxy on every node to another mode (no --cleanup: kproxy removes the other modes' rules at start-up)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := cluster.Load(g.StateDir)
			if err != nil {
				return err
			}
			if len(args) == 0 {
				fmt.Fprintln(stdout, c.Mode())
				return nil
			}
			mode := args[0]
			if err := cluster.ValidateMode(mode); err != nil {
				return err
			}
			ctx, cancel := signalContext()
			defer cancel()
			if err := cluster.ProbeMode(ctx, c.BinDir(), mode); err != nil {
				return err
			}
			began := time.Now()
			if err := c.SetMode(ctx, mode); err != nil {
				return err
			}
			fmt.Fprintf(stdout, "kproxy runs --proxy-mode=%s on %s (switched and synced in %s).\n  %s exec node-1 -- %s\n",
				mode, strings.Join(c.NodeNames(), ", "), time.Since(began).Round(100*time.Millisecond), selfPath(), rulesCommand(mode))
			return nil
		},
	}
}

func newKubeconfigCommand(g *globalOptions, stdout io.Writer) *cobra.Command {
	return &cobra.Command{
		Use:   "kubeconfig",
		Short: "Print the path of the host's admin kubeconfig (kubectl --kubeconfig $(kpc kubeconfig) ...)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := cluster.Load(g.StateDir)
			if err != nil {
				return err
			}
			fmt.Fprintln(stdout, c.Kubeconfig())
			return nil
		},
	}
}

// splitExec splits `exec` arguments at the "--" (dash is cobra's
// ArgsLenAtDash) into the target and the command.
func splitExec(args []string, dash int) (string, []string, error) {
	if dash != 1 || len(args) < 2 {
		return "", nil, errors.New("usage: kpc exec <node|client|control-plane|pod|namespace/pod> -- CMD [ARGS...]")
	}
	return args[0], args[1:], nil
}

func newExecCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "exec <target> -- CMD [ARGS...]",
		Short: "Run a command inside a namespace: node-<i>, client, control-plane, <pod> or <namespace>/<pod> (the cluster's kproxy and kubectl first in PATH)",
		Example: `  kpc exec client -- curl -s http://10.254.0.11:30080/
  kpc exec node-1 -- iptables-save -t nat
  kpc exec node-1 -- kproxy trace --src 10.254.0.100 --dst 10.254.0.11 --dport 30080
  kpc exec default/web-7d9c-abcde -- ip addr`,
		RunE: func(cmd *cobra.Command, args []string) error {
			target, command, err := splitExec(args, cmd.ArgsLenAtDash())
			if err != nil {
				return err
			}
			c, err := cluster.Load(g.StateDir)
			if err != nil {
				return err
			}
			ctx, cancel := signalContext()
			defer cancel()
			argv, err := c.CommandArgs(ctx, target, command...)
			if err != nil {
				return err
			}
			path, err := exec.LookPath(argv[0])
			if err != nil {
				return err
			}
			// Become the command: its streams, signals and exit code are
			// kpc's. The cluster's programs (kproxy, kubectl) come first in
			// its PATH.
			return syscall.Exec(path, argv, execEnv(os.Environ(), c.BinDir()))
		},
	}
}

// agentFlags are the flags of `kpc agent`.
type agentFlags struct {
	Kubeconfig     string
	NodeName       string
	NodeIP         string
	PodCIDR        string
	NetNS          string
	MaxGracePeriod time.Duration
}

func (f *agentFlags) options() (nodeagent.Options, error) {
	var errs []error
	ip, err := netip.ParseAddr(f.NodeIP)
	if err != nil {
		errs = append(errs, fmt.Errorf("--node-ip: %w", err))
	}
	cidr, err := netip.ParsePrefix(f.PodCIDR)
	if err != nil {
		errs = append(errs, fmt.Errorf("--pod-cidr: %w", err))
	}
	for name, v := range map[string]string{"--kubeconfig": f.Kubeconfig, "--node-name": f.NodeName, "--netns": f.NetNS} {
		if v == "" {
			errs = append(errs, fmt.Errorf("%s is required", name))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nodeagent.Options{}, err
	}
	return nodeagent.Options{
		Kubeconfig: f.Kubeconfig, NodeName: f.NodeName, NodeIP: ip, PodCIDR: cidr.Masked(),
		NodeNetNS: f.NetNS, MaxGracePeriod: f.MaxGracePeriod,
	}, nil
}

func newAgentCommand() *cobra.Command {
	f := &agentFlags{}
	cmd := &cobra.Command{
		Use:    "agent",
		Short:  "Run the node agent (kubelet stand-in, networking only); `kpc up` starts one per node",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts, err := f.options()
			if err != nil {
				return err
			}
			ctx, cancel := signalContext()
			defer cancel()
			return nodeagent.Run(ctx, opts)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.Kubeconfig, "kubeconfig", "", "Kubeconfig of the node's identity.")
	fs.StringVar(&f.NodeName, "node-name", "", "The Node this agent plays.")
	fs.StringVar(&f.NodeIP, "node-ip", "", "The node's address on the switch.")
	fs.StringVar(&f.PodCIDR, "pod-cidr", "", "The node's podCIDR.")
	fs.StringVar(&f.NetNS, "netns", "", "The node's network namespace name.")
	fs.DurationVar(&f.MaxGracePeriod, "max-grace-period", 0, "Cap of a pod's termination grace period (0: the agent's default).")
	return cmd
}
