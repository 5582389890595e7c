package app

import (
	"context"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	metadatafake "k8s.io/client-go/metadata/fake"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// waitUntil polls cond, up to a bound far beyond what a working kproxy
// needs.
func waitUntil(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// runHarness runs kproxy (run) over a fake API server, a fake iptables, a
// fake /proc/sys and a fake conntrack table.
type runHarness struct {
	client *fake.Clientset
	ipt    *iptablestest.Fake
	sys    *conntrack.FakeSysctl
	ct     *conntrack.Fake
	// The IPVS and nftables state a mode starting up cleans (nft is bound
	// to no table).
	ipvs   *ipvs.Fake
	sets   *ipset.Fake
	nl     *netlink.Fake
	nft    *knftables.Fake
	cancel context.CancelFunc
	done   chan error
}

const runNode = "node-a"

// stopRun cancels kproxy and waits for Run to return nil.
func stopRun(t *testing.T, h *runHarness) {
	t.Helper()
	h.cancel()
	select {
	case err := <-h.done:
		if err != nil {
			t.Fatalf("Run returned %v after the context was cancelled, want nil", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after the context was cancelled")
	}
}

func startRun(t *testing.T, ct *conntrack.Fake, objects ...runtime.Object) *runHarness {
	t.Helper()
	return startRunWith(t, ct, nil, objects...)
}

// startRunWith is startRun with options and dependencies adjusted by
// adjust (when not nil) before kproxy starts.
func startRunWith(t *testing.T, ct *conntrack.Fake, adjust func(*Options, *runDeps), objects ...runtime.Object) *runHarness {
	t.Helper()
	_, ctx := ktesting.NewTestContext(t)
	ctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	h := &runHarness{
		client: fake.NewClientset(objects...),
		ipt:    iptablestest.NewFake(ipt.ProtocolIPv4),
		sys: conntrack.NewFakeSysctl(map[string]int{
			conntrack.SysctlMax: 262144, conntrack.SysctlTCPTimeoutEstablished: 432000, conntrack.SysctlTCPTimeoutCloseWait: 60,
			conntrack.SysctlTCPBeLiberal: 0, conntrack.SysctlUDPTimeout: 30, conntrack.SysctlUDPTimeoutStream: 120,
		}),
		ct:     ct,
		ipvs:   ipvs.NewFake(),
		sets:   ipset.NewFake(),
		nl:     netlink.NewFake(),
		nft:    knftables.NewFake("", ""),
		cancel: cancel,
		done:   make(chan error, 1),
	}
	o := NewOptions()
	o.HostnameOverride = runNode
	o.HealthzBindAddress, o.MetricsBindAddress = "", ""
	o.MinSyncPeriod = 0
	deps := runDeps{
		client:       h.client,
		iptables:     map[v1.IPFamily]ipt.Interface{v1.IPv4Protocol: h.ipt},
		sysctl:       h.sys,
		moduleParams: conntrack.NewFakeSysctl(map[string]int{conntrack.ModuleParamHashSize: 65536}),
		conntrack:    ct,
		// No test touches the host's IPVS or nftables.
		cleanupKernel: &kernelCleanup{ipvs: h.ipvs, ipset: h.sets, nl: h.nl, nft: h.nft},
		// The test Nodes have no addresses: do not wait for them.
		nodeIPTimeout: 10 * time.Millisecond,
		// No other nodes' metadata, unless a test adjusts it.
		metadataClient: metadatafake.NewSimpleMetadataClient(metadatafake.NewTestScheme()),
	}
	if adjust != nil {
		adjust(o, &deps)
	}
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	go func() { h.done <- run(ctx, o, deps) }()
	return h
}

// events lists the events kproxy sent, as "Kind/name Type Reason".
func (h *runHarness) events(t *testing.T) []string {
	t.Helper()
	l, err := h.client.CoreV1().Events("").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatalf("listing events: %v", err)
	}
	var out []string
	for _, e := range l.Items {
		if e.Source.Component == EventComponent {
			out = append(out, e.InvolvedObject.Kind+"/"+e.InvolvedObject.Name+" "+e.Type+" "+e.Reason)
		}
	}
	slices.Sort(out)
	return out
}

// serviceRules are the nat rules of the service dispatch chain that name
// the ClusterIP.
func (h *runHarness) serviceRules(clusterIP string) []string {
	var out []string
	for _, r := range h.ipt.Rules(ipt.TableNAT, "KPROXY-SERVICES") {
		if strings.Contains(r, clusterIP) {
			out = append(out, r)
		}
	}
	return out
}

// TestRunStopsOnContextCancel is the SIGTERM path: kproxy programs the
// rules, the context is cancelled (as the signal handler does), Run returns
// nil and the rules stay in place; nothing is cleaned up.
func TestRunStopsOnContextCancel(t *testing.T) {
	dns := pt.Service("dns", "10.96.0.10",
		pt.Ports(v1.ServicePort{Name: "dns", Port: 53, Protocol: v1.ProtocolUDP}),
		pt.Annotation(proxy.AnnotationTopologyKeys, `["zone1"`))
	slice := pt.SliceWithPorts("dns", []discovery.EndpointPort{{Name: ptr.To("dns"), Port: ptr.To[int32](5353), Protocol: ptr.To(v1.ProtocolUDP)}},
		pt.EP{IP: "10.244.2.5", Node: "node-b"})
	blackHoled := conntrack.Flow{
		Protocol: v1.ProtocolUDP,
		Original: conntrack.Tuple{Src: netip.MustParseAddrPort("10.244.1.9:40001"), Dst: netip.MustParseAddrPort("10.96.0.10:53")},
		Reply:    conntrack.Tuple{Src: netip.MustParseAddrPort("10.96.0.10:53"), Dst: netip.MustParseAddrPort("10.244.1.9:40001")},
	}
	h := startRun(t, conntrack.NewFake(blackHoled), dns, slice, pt.Node(runNode, nil), pt.Node("node-b", nil))

	waitUntil(t, func() bool { return len(h.serviceRules("10.96.0.10")) > 0 }, "the service's rules")
	wantEvents := []string{"Node/" + runNode + " Normal Starting", "Service/dns Warning " + proxier.EventReasonInvalidTopologyKeys}
	waitUntil(t, func() bool { return slices.Equal(h.events(t), wantEvents) }, "the start-up and service events")
	// The service was black-holed before kproxy (re)started: its stale
	// entry goes with the first sync.
	waitUntil(t, func() bool { return len(h.ct.Flows()) == 0 }, "the stale conntrack entry's deletion")
	chainsBefore := h.ipt.Chains(ipt.TableNAT)
	rulesBefore := h.serviceRules("10.96.0.10")

	stopRun(t, h)

	if got := h.ipt.Chains(ipt.TableNAT); !slices.Equal(got, chainsBefore) {
		t.Errorf("nat chains after shutdown %v, want them left in place: %v", got, chainsBefore)
	}
	if got := h.serviceRules("10.96.0.10"); len(got) == 0 || !slices.Equal(got, rulesBefore) {
		t.Errorf("service rules after shutdown %q, want them left in place: %q", got, rulesBefore)
	}
	for _, c := range []ipt.Chain{ipt.ChainOutput, ipt.ChainPrerouting} {
		if !slices.ContainsFunc(h.ipt.Rules(ipt.TableNAT, c), func(r string) bool { return strings.Contains(r, "KPROXY-SERVICES") }) {
			t.Errorf("the jump from nat %s to KPROXY-SERVICES is gone after shutdown", c)
		}
	}
	// The conntrack sysctls were applied once at start.
	got := h.sys.Values()
	if got[conntrack.SysctlTCPTimeoutEstablished] != 86400 || got[conntrack.SysctlTCPTimeoutCloseWait] != 3600 || got[conntrack.SysctlMax] != 262144 {
		t.Errorf("sysctls after start %v, want kube-proxy's timeouts and the larger current maximum kept", got)
	}
}
