// Command kproxy is a Kubernetes node dataplane agent: a kube-proxy
// replacement that programs iptables (and, later, IPVS) for every Service.
package main

import (
	"os"

	"github.com/kproxy/kproxy/cmd/kproxy/app"
)

func main() {
	os.Exit(app.Main(os.Args[1:], os.Stdout, os.Stderr))
}
