package iptables

import (
	"context"
	"net/netip"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// FuzzRender renders arbitrary service ports and their endpoints, applies
// them to the fake iptables (which parses every rule and rejects jumps to
// missing chains) and checks that the ClusterIP reaches exactly the
// expected endpoints. The seed corpus runs in `make test`.
func FuzzRender(f *testing.F) {
	pt.FuzzRender(f, func(t *testing.T, c pt.RenderCase) {
		fake := iptablestest.NewFake(ipt.ProtocolIPv4)
		b, err := New(Options{IPTables: fake,
			LocalAddresses: func() ([]netip.Addr, error) { return []netip.Addr{c.NodeIP}, nil }})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Sync(context.Background(), c.State, true); err != nil {
			t.Fatalf("sync: %v", err)
		}
		cip := c.Port.ClusterIP
		if cip == c.NodeIP || cip.IsLoopback() {
			return
		}
		outs, err := fake.Trace(iptablestest.Packet{Source: netip.MustParseAddr("10.244.9.9"), Destination: cip, Protocol: toLower(c.Port.Protocol),
			SourcePort: 1, DestinationPort: c.Port.Port}, iptablestest.TraceOptions{LocalAddrs: []netip.Addr{c.NodeIP}})
		if err != nil {
			t.Fatalf("trace: %v", err)
		}
		want := c.WantClusterEndpoints()
		got := sets.New(iptablestest.Endpoints(outs)...)
		if !got.Equal(want) {
			t.Fatalf("clusterIP reaches %v, want %v", sets.List(got), sets.List(want))
		}
	})
}

func toLower(p v1.Protocol) string {
	switch p {
	case v1.ProtocolUDP:
		return "udp"
	case v1.ProtocolSCTP:
		return "sctp"
	}
	return "tcp"
}
