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
// The fault suite (TestFaults, faults_test.go) hits one node (node-1) with
// the faults of issue 10 while steady traffic flows through it: about 50
// requests/s, each with a 2 s deadline and sent whether or not the last one
// answered, to a TCP ClusterIP and a UDP ClusterIP from a pod on node-1 and
// to a NodePort of node-1 from the external client; every failed request
// counts. The backends run on node-2. Before the scenarios it creates 200
// selectorless Services of 10 ports each (2,000 service ports) with their
// EndpointSlices, and restarts node-1's kproxy with
// --iptables-sync-period=10s (both modes read it), a kernel-call deadline of
// 5s when kproxy --help names a flag for one, and testdata/shims/faultshim
// first on its PATH as iptables-restore, ip6tables-restore and nft: the
// shim runs the real tool with the same input, logs each restore, and on
// the scenarios' demand hangs (while a file exists) or refuses an input
// naming a marker the way the real tool refuses a line (same exit status
// and message format, naming the line). Scenarios, each summed up in one
// line "FAULT <mode> <scenario>: failed=F sent=S reprogrammed=T health=H
// target=... pass|FAIL":
//   - kill9-mid-full-sync: kproxy restarted (in nftables mode with a
//     canary element deleted first: a kproxy adopts an intact table and
//     writes nothing), then killed with SIGKILL as the second
//     iptables-restore (nft -f) of its first full sync starts;
//     a probe Service is created and kproxy started again. Then a kproxy
//     of reference (cluster.ScratchKproxy: the node's flags and Node, in a
//     namespace of its own) syncs the same objects from nothing, and the
//     node's rules, normalised, must equal its rules.
//   - apiserver-outage: etcd and the API server stopped for 30 s; right
//     after they are back a probe Service is created: programmed within
//     min-sync-period (1s) plus 2s.
//   - flush: `iptables -t nat -F`, then -F plus -X (iptables mode); `nft
//     flush table ip kproxy`, then `nft flush chain ip kproxy services`
//     (nftables mode), in node-1's namespace: repaired within one sync
//     period plus 2s. Requests fail until then; the count is reported.
//   - xtables-lock (iptables mode): kproxy on node-1 switched to
//     iptables-legacy (the legacy tools first on its PATH; the nf_tables
//     backend's rules removed), /run/xtables.lock held for 10 s, a probe
//     Service created meanwhile: programmed within one sync period of the
//     release. Afterwards the legacy rules are removed.
//   - poisoned-service: restores naming a new Service are refused; once
//     one was, another Service's endpoint moves from one backend to the
//     other: programmed within min-sync-period plus 2s; the poison stays
//     two sync periods and more, /healthz must stay 200.
//   - hung-restore: restores hang for the deadline plus 5s (15 s without
//     a deadline flag) while a probe Service waits to be programmed: the
//     hung restore must be killed by then, and the probe programmed within
//     one sync period once the hang ends.
//
// Every scenario but flush must fail no request. "Reprogrammed" is the
// time from the end of the fault (the kill, the change made after the API
// server returned, the flush, the lock's release, the endpoint change, the
// end of the hang) until kproxy logged an IPv4 sync after it and the
// probe answers (flush: until every rule of before the flush is back; poisoned-service: until the moved Service answers from its new
// endpoint only). Health is what node-1's /healthz answered, polled every
// 250 ms, as its changes: "200,503@21.3s,200@40.1s". Every scenario
// puts back what it changed (kproxy's flags, PATH and backend, the control
// plane, the lock, the shims' files) even when it fails. With
// KPC_FAULTS_OUT set the lines are also written as JSON.
//
// Environment:
//
//	KPROXY_E2E_MODES  the rounds' modes, in order (default "iptables nftables")
//	KPROXY_E2E_FAULTS TestFaults' scenarios (space-separated names, or "all";
//	                  default "all", see defaultFaults)
//	KPC_BIN_DIR       the cluster's programs (default: build them)
//	KPC_E2E_STATE_DIR the cluster's state directory (default /run/kpc-e2e)
//	KPC_E2E_LOGS      a directory to copy the cluster's logs into when the suite fails
//	KPC_LATENCY_OUT   where TestNetworkProgrammingLatency writes its JSON summary (set,
//	                  the test measures 50 changes instead of a smoke run's 10);
//	                  "{mode}" in it is replaced by the mode, and without it a run
//	                  of several modes writes <name>-<mode><ext> per mode
//	KPC_FAULTS_OUT    where TestFaults writes its scenarios' results as JSON
//	                  ("{mode}" and several modes as for KPC_LATENCY_OUT)
package e2e
