// Package procbench measures the real kproxy process against a real API
// server: the local cluster's control plane (etcd and kube-apiserver only,
// test/LOCAL-CLUSTER.md) holds N Services of one port with 10 ready
// endpoints each, and optionally thousands of realistic Node objects; kproxy,
// built from this repository, runs in a throwaway network namespace of its
// own on the cluster's switch and programs that namespace's kernel only.
//
// Per run (proxy mode, Services, Nodes) it reports the time from kproxy's
// start to the end of its first full sync, the time of one-endpoint changes
// from the EndpointSlice write to the kernel's commit of the change, kproxy's
// CPU time per change and its peak RSS (VmHWM).
//
// The commit of a change is observed in the kernel: a netlink socket in
// kproxy's namespace subscribed to nf_tables' notifications receives, at the
// end of every committed transaction (iptables-nft-restore's and nft's
// alike), a new-generation message. The commit time is when the first
// message of that transaction's notifications was received, because the
// kernel queues them all at the commit. Once the commit is seen, kproxy's
// /healthz (the time it records after each sync, a few hundred bytes) is
// read to know that the sync has ended; /metrics, whose rendering costs
// kproxy about 2 ms of CPU and garbage that brings its collections forward
// into later changes, is read before and after the changes (network
// programming latency), and per change only without the notifications (a
// legacy iptables backend, where the time kproxy records after the sync is
// used, with its endpoint change and sync counters) or when a commit is not
// seen within 5 s.
//
// TestProcessBenchmark runs it when KPROXY_PROCBENCH=1 (`make bench`); the
// rest of the package's tests are plain unit tests.
package procbench
