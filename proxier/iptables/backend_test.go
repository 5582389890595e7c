package iptables

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// fakeTracer traces proxiertest flows through the fake iptables.
type fakeTracer struct {
	fake  *iptablestest.Fake
	local []netip.Addr
}

func (f *fakeTracer) Trace(flow pt.Flow) (pt.Result, error) {
	return traceFlow(f.fake, f.local, flow, nil)
}

func traceFlow(fake *iptablestest.Fake, local []netip.Addr, flow pt.Flow, recent map[string][]netip.Addr) (pt.Result, error) {
	origin := iptablestest.OriginExternal
	if flow.Origin == pt.FromHost {
		origin = iptablestest.OriginLocal
	}
	proto := strings.ToLower(string(flow.Protocol))
	if proto == "" {
		proto = "tcp"
	}
	outs, err := fake.Trace(iptablestest.Packet{
		Source: netip.MustParseAddr(flow.Source), Destination: netip.MustParseAddr(flow.Dest),
		Protocol: proto, SourcePort: 40000, DestinationPort: flow.Port, Origin: origin,
	}, iptablestest.TraceOptions{LocalAddrs: local, Recent: recent})
	if err != nil {
		return pt.Result{}, err
	}
	res := pt.Result{Endpoints: map[string]bool{}}
	verdicts := map[pt.Verdict]bool{}
	for _, o := range outs {
		var v pt.Verdict
		switch {
		case o.Verdict == "DROP":
			v = pt.Dropped
		case o.Verdict == "REJECT":
			v = pt.Rejected
		case o.DNAT != "":
			v = pt.Delivered
			if prev, seen := res.Endpoints[o.DNAT]; seen && prev != o.Masquerade {
				return res, fmt.Errorf("endpoint %s reached both with and without masquerade", o.DNAT)
			}
			res.Endpoints[o.DNAT] = o.Masquerade
		default:
			v = pt.NotHandled
		}
		res.Masquerade = res.Masquerade || o.Masquerade
		verdicts[v] = true
	}
	if len(verdicts) != 1 {
		return res, fmt.Errorf("flow has mixed outcomes %v", outs)
	}
	for v := range verdicts {
		res.Verdict = v
	}
	return res, nil
}

func newFakeBackend(t testing.TB, env pt.Env) (*Backend, *iptablestest.Fake) {
	proto := ipt.ProtocolIPv4
	if env.Family == v1.IPv6Protocol {
		proto = ipt.ProtocolIPv6
	}
	fake := iptablestest.NewFake(proto)
	fake.RandomFully = true
	local := append([]netip.Addr{}, env.NodeIPs...)
	b, err := New(Options{
		IPTables:          fake,
		NodePortAddresses: env.NodePortAddresses,
		LocalAddresses:    func() ([]netip.Addr, error) { return local, nil },
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return b, fake
}

func TestBehaviourCases(t *testing.T) {
	pt.Run(t, func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
		b, fake := newFakeBackend(t, env)
		return b, &fakeTracer{fake: fake, local: env.NodeIPs}
	})
}

func TestNewValidates(t *testing.T) {
	bad := 32
	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"no iptables", Options{}},
		{"mark bit out of range", Options{IPTables: iptablestest.NewFake(ipt.ProtocolIPv4), MasqueradeBit: &bad}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.opts); err == nil {
				t.Fatal("New succeeded, want an error")
			}
		})
	}
}

var _ = context.Background
