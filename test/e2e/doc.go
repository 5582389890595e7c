// Package e2e is kproxy's end-to-end suite: real Services, EndpointSlices and
// Pods on the local cluster of test/LOCAL-CLUSTER.md (a real kube-apiserver,
// EndpointSlice controller and scheduler; nodes and pods are network
// namespaces), and real packets sent from inside those namespaces.
//
// TestMain brings up one three-node cluster for the whole suite and takes it
// down at the end. It holds /tmp/kpc-cluster.lock meanwhile, so it never
// collides with `make demo` or another run; wrap it as well when running by
// hand:
//
//	cd test && flock /tmp/kpc-cluster.lock go test -count=1 -timeout 30m ./e2e/ -v
//
// The suite needs root and skips otherwise (and with -short). It uses the
// programs in $KPC_BIN_DIR, or builds them with hack/build-control-plane.sh.
// Every test works in a Kubernetes namespace of its own, deleted at its end.
//
// So that the cluster goes away even when a test panics or the test timeout
// fires, the test binary supervises a copy of itself: the parent takes the
// lock, brings the cluster up and runs the tests in a child process (same
// flags, $KPC_E2E_STATE naming the cluster), then takes the cluster down
// whatever way the child ended; SIGINT and SIGTERM are forwarded to the
// child and end in the same teardown.
//
// Environment:
//
//	KPC_BIN_DIR       the cluster's programs (default: build them)
//	KPC_E2E_STATE_DIR the cluster's state directory (default /run/kpc-e2e)
//	KPC_E2E_LOGS      a directory to copy the cluster's logs into when the suite fails
//	KPC_LATENCY_OUT   where TestNetworkProgrammingLatency writes its JSON summary
package e2e
