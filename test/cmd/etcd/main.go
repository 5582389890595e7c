// Command etcd is etcd's server, built from go.etcd.io/etcd/server/v3 at the
// version the Kubernetes module graph pins, for the local cluster.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
