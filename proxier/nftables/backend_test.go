package nftables

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/nftables/nftablestest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// fakeTracer traces proxiertest flows through the fake's table and dumps
// it for the property test.
type fakeTracer struct {
	fake  *knftables.Fake
	local []netip.Addr
	// sets are dynamic set contents (affinity entries).
	sets map[string][]string
}

func (f *fakeTracer) Trace(flow pt.Flow) (pt.Result, error) {
	proto := strings.ToLower(string(flow.Protocol))
	if proto == "" {
		proto = "tcp"
	}
	outs, err := nftablestest.Trace(f.fake, nftablestest.Packet{
		Source: netip.MustParseAddr(flow.Source), Destination: netip.MustParseAddr(flow.Dest),
		Protocol: proto, SourcePort: 40000, DestinationPort: flow.Port, Local: flow.Origin == pt.FromHost,
	}, nftablestest.Options{LocalAddrs: f.local, Sets: f.sets})
	if err != nil {
		return pt.Result{}, err
	}
	return toResult(outs)
}

func toResult(outs []nftablestest.Outcome) (pt.Result, error) {
	folded := make([]pt.TracedOutcome, 0, len(outs))
	for _, o := range outs {
		folded = append(folded, pt.TracedOutcome{Verdict: o.Verdict, DNAT: o.DNAT, Masquerade: o.Masquerade})
	}
	return pt.FoldOutcomes(folded)
}

// DumpState is the fake's table with element lines sorted (their order
// carries no meaning; the order of rules does) and slot assignments left
// out (canonicalDump).
func (f *fakeTracer) DumpState() (pt.StateDump, error) {
	return pt.StateDump{State: canonicalDump(f.fake)}, nil
}

func sortedDump(fake *knftables.Fake) string {
	var head, elems []string
	for _, l := range strings.Split(fake.Dump(), "\n") {
		if strings.HasPrefix(l, "add element ") {
			elems = append(elems, l)
		} else if l != "" {
			head = append(head, l)
		}
	}
	slices.Sort(elems)
	return strings.Join(append(head, elems...), "\n") + "\n"
}

func fakeFamily(f v1.IPFamily) knftables.Family {
	if f == v1.IPv6Protocol {
		return knftables.IPv6Family
	}
	return knftables.IPv4Family
}

func newFakeBackend(t testing.TB, env pt.Env) (*Backend, *knftables.Fake) {
	t.Helper()
	fake := knftables.NewFake(fakeFamily(env.Family), TableName)
	local := append([]netip.Addr{}, env.NodeIPs...)
	b, err := New(Options{
		NFTables:          &strictNFT{Fake: fake},
		Family:            env.Family,
		NodePortAddresses: env.NodePortAddresses,
		LocalAddresses:    func() ([]netip.Addr, error) { return local, nil },
		// Small chunks: full syncs write endpoint slots ahead in several
		// transactions (preWriter), as at scale.
		EndpointChunk: 4,
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return b, fake
}

func factory(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
	b, fake := newFakeBackend(t, env)
	return b, &fakeTracer{fake: fake, local: env.NodeIPs}
}

func TestBehaviourCases(t *testing.T) {
	pt.Run(t, factory)
}

func TestNewValidates(t *testing.T) {
	bad := 32
	fake := knftables.NewFake(knftables.IPv4Family, TableName)
	for _, tc := range []struct {
		name string
		opts Options
	}{
		{"no nftables", Options{Family: v1.IPv4Protocol}},
		{"no family", Options{NFTables: fake}},
		{"mark bit out of range", Options{NFTables: fake, Family: v1.IPv4Protocol, MasqueradeBit: &bad}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.opts); err == nil {
				t.Fatal("New succeeded, want an error")
			}
		})
	}
}
