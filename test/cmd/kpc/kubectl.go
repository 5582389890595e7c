package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/kproxy/kproxy/test/cluster"
)

// kubectlProgram is kubectl's file name in a bin directory
// (hack/build-control-plane.sh builds it with the control plane).
const kubectlProgram = "kubectl"

// newKubectlCommand is `kpc kubectl ARGS...`: the cluster's kubectl with
// the host's admin kubeconfig, so that no kubectl and no $KUBECONFIG are
// needed on the machine.
func newKubectlCommand(g *globalOptions) *cobra.Command {
	return &cobra.Command{
		Use:   "kubectl [--state DIR] ARGS...",
		Short: "Run kubectl (built with the control plane) against the cluster: kpc kubectl get pods -A",
		Example: `  kpc kubectl get nodes,pods -A -o wide
  kpc kubectl -n demo get svc,endpointslices
  kpc kubectl --state /tmp/other-kpc get nodes`,
		// Every argument is kubectl's (its -n, -o, -v, --help ...), but for a
		// leading --state.
		DisableFlagParsing: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			state, rest, err := splitKubectlArgs(g.StateDir, args)
			if err != nil {
				return err
			}
			c, err := cluster.Load(state)
			if err != nil {
				return err
			}
			kubectl, err := findProgram(kubectlProgram, c.BinDir(), defaultBinDir())
			if err != nil {
				return err
			}
			argv := kubectlArgv(kubectl, c.Kubeconfig(), rest)
			// Become kubectl: its streams, signals and exit code are kpc's.
			return syscall.Exec(kubectl, argv, os.Environ())
		},
	}
}

// splitKubectlArgs takes kpc's own --state (before any of kubectl's
// arguments: flag parsing is off for `kpc kubectl`) out of args; state is
// the default.
func splitKubectlArgs(state string, args []string) (string, []string, error) {
	for len(args) > 0 {
		switch a := args[0]; {
		case a == "--state":
			if len(args) < 2 {
				return "", nil, errors.New("--state needs a directory")
			}
			state, args = args[1], args[2:]
		case strings.HasPrefix(a, "--state="):
			state, args = strings.TrimPrefix(a, "--state="), args[1:]
		default:
			return state, args, nil
		}
	}
	return state, args, nil
}

// kubectlArgv runs kubectl with kubeconfig; a --kubeconfig in args comes
// later and wins.
func kubectlArgv(kubectl, kubeconfig string, args []string) []string {
	return append([]string{kubectl, "--kubeconfig=" + kubeconfig}, args...)
}

// findProgram is the first executable name in dirs (empty ones skipped).
func findProgram(name string, dirs ...string) (string, error) {
	var tried []string
	for _, d := range dirs {
		if d == "" {
			continue
		}
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return p, nil
		}
		tried = append(tried, p)
	}
	return "", fmt.Errorf("no %s at %s: run hack/build-control-plane.sh (make demo does), which builds it with the control plane",
		name, strings.Join(tried, " or "))
}

// execEnv is environ with dir first in PATH, so that `kpc exec node-1 --
// kproxy ...` runs the cluster's own kproxy (and kubectl).
func execEnv(environ []string, dir string) []string {
	if dir == "" {
		return environ
	}
	out := make([]string, 0, len(environ)+1)
	rest, found := "", false
	for _, kv := range environ {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			rest, found = v, true
			continue
		}
		out = append(out, kv)
	}
	if !found {
		rest = defaultPath
	}
	if rest == "" {
		return append(out, "PATH="+dir)
	}
	return append(out, "PATH="+dir+":"+rest)
}

// defaultPath stands in for an unset PATH, which would otherwise mean
// the C library's default search path.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
