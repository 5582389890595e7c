package iptables

import (
	"context"
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
	folded := make([]pt.TracedOutcome, 0, len(outs))
	for _, o := range outs {
		folded = append(folded, pt.TracedOutcome{Verdict: o.Verdict, DNAT: o.DNAT, Masquerade: o.Masquerade})
	}
	return pt.FoldOutcomes(folded)
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
