// Command kpc runs the local cluster of test/LOCAL-CLUSTER.md: a real
// Kubernetes control plane with nodes, pods and an external client as
// network namespaces, and kproxy on every node.
//
//	kpc up [--nodes N] [--mode M]   start a cluster
//	kpc status                      processes, API server and nodes
//	kpc kubeconfig                  the host kubeconfig's path
//	kpc exec <target> -- CMD...     run CMD in a node, client, control-plane or pod namespace
//	kpc kubectl ARGS...             kubectl (built with the control plane) with the cluster's kubeconfig
//	kpc demo                        start a cluster if needed, deploy an echo service, send traffic
//	kpc down                        remove every namespace, link and process
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}
