package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Targets of Exec besides nodes and pods.
const (
	TargetClient       = "client"
	TargetControlPlane = "control-plane"
)

// target is what an Exec target names: a namespace directly, or a Pod
// whose namespace the API tells.
type target struct {
	NetNS        string
	PodNamespace string
	PodName      string
}

// parseTarget resolves a target without the API: "client",
// "control-plane" (or "cp"), a node name of a cluster of n nodes, or else a
// Pod as "<namespace>/<name>" or "<name>" in default.
func parseTarget(s string, n int) (target, error) {
	switch s {
	case "":
		return target{}, errors.New("empty target: want a node name, client, control-plane or a pod")
	case TargetClient:
		return target{NetNS: ClientNetNS}, nil
	case TargetControlPlane, "cp":
		return target{NetNS: ControlPlaneNetNS}, nil
	}
	if i, ok := nodeIndex(s, n); ok {
		return target{NetNS: NodeNetNS(i)}, nil
	}
	ns, name, found := strings.Cut(s, "/")
	if !found {
		ns, name = metav1.NamespaceDefault, s
	}
	if ns == "" || name == "" || strings.Contains(name, "/") {
		return target{}, fmt.Errorf("bad target %q: want a node name, client, control-plane, <pod> or <namespace>/<pod>", s)
	}
	return target{PodNamespace: ns, PodName: name}, nil
}

// NetNS returns the network namespace of target: a node name, "client",
// "control-plane", or a Pod ("<namespace>/<name>", or "<name>" in default).
func (c *Cluster) NetNS(ctx context.Context, targetName string) (string, error) {
	t, err := parseTarget(targetName, c.st.Nodes)
	if err != nil {
		return "", err
	}
	if t.NetNS != "" {
		return t.NetNS, nil
	}
	pod, err := c.client.CoreV1().Pods(t.PodNamespace).Get(ctx, t.PodName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return "", fmt.Errorf("no node, client or pod %q (nodes: %s; pods as <namespace>/<name>)",
			targetName, strings.Join(c.NodeNames(), ", "))
	}
	if err != nil {
		return "", fmt.Errorf("looking up pod %s/%s: %w", t.PodNamespace, t.PodName, err)
	}
	ns := PodNetNS(string(pod.UID))
	if !netnsExists(ns) {
		return "", fmt.Errorf("pod %s/%s has no network namespace %s yet (phase %s, node %q)",
			pod.Namespace, pod.Name, ns, pod.Status.Phase, pod.Spec.NodeName)
	}
	return ns, nil
}

// CommandArgs returns the argv that runs cmd inside target's network
// namespace (see NetNS).
func (c *Cluster) CommandArgs(ctx context.Context, targetName string, cmd ...string) ([]string, error) {
	if len(cmd) == 0 {
		return nil, errors.New("no command")
	}
	ns, err := c.NetNS(ctx, targetName)
	if err != nil {
		return nil, err
	}
	return append([]string{"ip", "netns", "exec", ns}, cmd...), nil
}

// Command returns an unstarted command running cmd inside target's network
// namespace, for callers that need its streams.
func (c *Cluster) Command(ctx context.Context, targetName string, cmd ...string) (*exec.Cmd, error) {
	argv, err := c.CommandArgs(ctx, targetName, cmd...)
	if err != nil {
		return nil, err
	}
	return exec.CommandContext(ctx, argv[0], argv[1:]...), nil
}

// Exec runs cmd inside target's network namespace and returns its
// standard output; on failure the error carries its standard error.
func (c *Cluster) Exec(ctx context.Context, targetName string, cmd ...string) (string, error) {
	ec, err := c.Command(ctx, targetName, cmd...)
	if err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	ec.Stdout, ec.Stderr = &stdout, &stderr
	if err := ec.Run(); err != nil {
		return stdout.String(), fmt.Errorf("%s in %s: %w: %s", strings.Join(cmd, " "), targetName, err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}
