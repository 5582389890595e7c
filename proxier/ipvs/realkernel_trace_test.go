package ipvs

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netnstest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
	"github.com/kproxy/kproxy/proxier/trace"
)

// TestRealKernelTrace: kproxy trace over the node namespace's live IPVS
// state (virtual servers, ipsets, iptables-save) says what a real packet
// from the matching namespace gets, for each kind of flow: a ClusterIP
// delivered (from a pod, unmasqueraded, and from outside, masqueraded), a
// node port, no endpoints (rejected), externalTrafficPolicy Local without
// a local endpoint (dropped), loadBalancerSourceRanges (dropped outside,
// delivered inside).
func TestRealKernelTrace(t *testing.T) {
	r := newRealNode(t, func(name string, ns *netnstest.NS, bind string) { ns.StartEcho(t, "tcp4", bind, name) })
	ctx := t.Context()
	r.engine.OnServiceAdd(pt.Service("web", "10.96.0.40", pt.NodePort(30095)))
	r.engine.OnEndpointSliceAdd(r.slice("web", "be1", "be2"))
	r.engine.OnServiceAdd(pt.Service("none", "10.96.0.41"))
	r.engine.OnServiceAdd(pt.Service("loc", "10.96.0.42", pt.NodePort(30096), pt.ExternalLocal()))
	r.engine.OnEndpointSliceAdd(r.slice("loc", "be2"))
	r.engine.OnServiceAdd(pt.Service("lb", "10.96.0.43", pt.LoadBalancer("203.0.113.7"), pt.SourceRanges("192.0.2.0/25")))
	r.engine.OnEndpointSliceAdd(r.slice("lb", "be2"))
	r.sync()
	r.client.AddRoute(t, netip.MustParsePrefix("203.0.113.0/24"), realNodeAddr.Addr())
	r.pods["pod"].ns.AddRoute(t, netip.MustParsePrefix("203.0.113.0/24"), r.pods["pod"].gateway)

	src := trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{v1.IPv4Protocol: r.ipt}, IPVS: r.ipvs, IPSet: r.sets,
		LocalAddresses: func() ([]netip.Addr, error) { return r.nl.LocalAddresses(ctx) }}
	client := &realPod{ns: r.client, addr: realClientAddr.Addr()}
	nodePort := func(port int) string { return netip.AddrPortFrom(realNodeAddr.Addr(), uint16(port)).String() }
	for _, tc := range []struct {
		name    string
		from    *realPod
		dst     string
		verdict string
		reason  string
	}{
		{name: "ClusterIP from a pod", from: r.pods["pod"], dst: "10.96.0.40:80", verdict: trace.Delivered},
		{name: "ClusterIP from outside the cluster", from: client, dst: "10.96.0.40:80", verdict: trace.Delivered},
		{name: "node port", from: client, dst: nodePort(30095), verdict: trace.Delivered},
		{name: "no endpoints", from: client, dst: "10.96.0.41:80", verdict: trace.Rejected, reason: "has no endpoints"},
		{name: "externalTrafficPolicy Local without a local endpoint", from: client, dst: nodePort(30096), verdict: trace.Dropped,
			reason: "externalTrafficPolicy is Local"},
		{name: "source outside loadBalancerSourceRanges", from: r.pods["pod"], dst: "203.0.113.7:80", verdict: trace.Dropped,
			reason: "outside loadBalancerSourceRanges"},
		{name: "source inside loadBalancerSourceRanges", from: client, dst: "203.0.113.7:80", verdict: trace.Delivered},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ap := netip.MustParseAddrPort(tc.dst)
			rep, err := trace.Run(ctx, trace.Request{Source: tc.from.addr, Destination: ap.Addr(), DestinationPort: int(ap.Port()),
				From: trace.FromExternal, Mode: trace.ModeIPVS}, src)
			if err != nil {
				t.Fatal(err)
			}
			var text strings.Builder
			_ = rep.WriteText(&text)
			t.Logf("kproxy trace:\n%s", text.String())
			if rep.Verdict != tc.verdict || !strings.Contains(rep.Reason, tc.reason) {
				t.Errorf("trace: %s (%s), want %s with %q", rep.Verdict, rep.Reason, tc.verdict, tc.reason)
			}

			// The real packet.
			c, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			be, seen, err := request(c, tc.from.ns, tc.dst)
			var got string
			switch {
			case err == nil:
				got = trace.Delivered
			case errors.Is(err, netnstest.ErrTimeout):
				got = trace.Dropped
			case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, netnstest.ErrRefused):
				got = trace.Rejected
			default:
				t.Fatalf("request to %s: %v", tc.dst, err)
			}
			if got != rep.Verdict {
				t.Fatalf("the real packet was %s (err %v), the trace says %s", got, err, rep.Verdict)
			}
			if got != trace.Delivered {
				return
			}
			pod := r.pods[be]
			if pod == nil {
				t.Fatalf("reached unknown backend %q", be)
			}
			ep := netip.AddrPortFrom(pod.addr, realPort).String()
			host, _, _ := net.SplitHostPort(seen)
			masq := host != tc.from.addr.String()
			found := false
			for _, e := range rep.Endpoints {
				if e.Address == ep {
					found = true
					if e.Masquerade != masq {
						t.Errorf("%s saw %s (masquerade %v); the trace says masquerade %v", ep, seen, masq, e.Masquerade)
					}
				}
			}
			if !found {
				t.Errorf("the real packet reached %s (%s), not one of the trace's endpoints %+v", ep, be, rep.Endpoints)
			}
		})
	}
}
