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
//	cd test && flock /tmp/kpc-cluster.lock go test -count=1 -timeout 60m ./e2e/ -v
//
// The suite needs root and skips otherwise (and with -short). It uses the
// programs in $KPC_BIN_DIR, or builds them with hack/build-control-plane.sh.
// Every test works in a Kubernetes namespace of its own, deleted at its end.
//
// So that the cluster goes away even when a test panics or the test timeout
// fires, the test binary supervises copies of itself: the parent takes the
// lock, brings the cluster up and runs the tests in a child process (same
// flags, $KPC_E2E_STATE naming the cluster), then takes the cluster down
// whatever way the child ended; SIGINT and SIGTERM are forwarded to the
// child and end in the same teardown.
//
// Modes: the suite runs in rounds, one per mode of $KPROXY_E2E_MODES
// (default "iptables nftables"; a mode may repeat), all on the same
// cluster, control plane, nodes and pods. The parent probes each mode once
// (cluster.ProbeMode: kproxy validates --proxy-mode=<mode>, and the host
// has nft and nf_tables, or IPVS). A mode the kproxy binary does not know
// (a build from before the mode) or the host cannot run is SKIPPED with a
// loud log line; any other failure, including kproxy failing to start and
// sync in the mode, fails the suite. Between rounds the parent switches
// kproxy on every node to the next mode (cluster.SetMode: stop, start with
// --proxy-mode=<next>, wait for a sync; no --cleanup, kproxy removes the
// other modes' state itself) and runs the tests again in a new child.
// Tests that go through kproxy run in every round as the subtest
// "mode=<mode>" of their top-level test (TestClusterIP/mode=nftables/...):
// write them as func TestX(t *testing.T) { inMode(t, testX) }; newEnv
// refuses to run outside inMode. Tests that do not depend on the mode (the
// suite's own helpers, the manifests' dry run) call runsOnce and run in the
// first round only. The parent ends with one line per round: ok, SKIPPED
// (why) or FAILED (why, and the failed tests). Select tests and modes as
// usual: -run 'TestClusterIP/mode=nftables' with KPROXY_E2E_MODES=nftables.
//
// Environment:
//
//	KPROXY_E2E_MODES  the rounds' modes, in order (default "iptables nftables")
//	KPC_BIN_DIR       the cluster's programs (default: build them)
//	KPC_E2E_STATE_DIR the cluster's state directory (default /run/kpc-e2e)
//	KPC_E2E_LOGS      a directory to copy the cluster's logs into when the suite fails
//	KPC_LATENCY_OUT   where TestNetworkProgrammingLatency writes its JSON summary (set,
//	                  the test measures 50 changes instead of a smoke run's 10);
//	                  "{mode}" in it is replaced by the mode, and without it a run
//	                  of several modes writes <name>-<mode><ext> per mode
package e2e
