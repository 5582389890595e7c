package nftables

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/proxier/nftables/nftablestest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// FuzzRender renders arbitrary service ports and their endpoints into the
// strict fake (which refuses what the kernel refuses), traces the ClusterIP
// and checks that it reaches exactly the expected endpoints. The seed
// corpus runs with the unit tests.
func FuzzRender(f *testing.F) {
	pt.FuzzRender(f, func(t *testing.T, c pt.RenderCase) {
		fake := knftables.NewFake(knftables.IPv4Family, TableName)
		local := []netip.Addr{c.NodeIP}
		b, err := New(Options{NFTables: &strictNFT{Fake: fake}, Family: v1.IPv4Protocol,
			LocalAddresses: func() ([]netip.Addr, error) { return local, nil }})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.Sync(context.Background(), c.State, true); err != nil {
			t.Fatalf("sync: %v", err)
		}
		cip := c.Port.ClusterIP
		if cip == local[0] || cip.IsLoopback() || cip.IsUnspecified() {
			return
		}
		outs, err := nftablestest.Trace(fake, nftablestest.Packet{Source: netip.MustParseAddr("10.244.9.9"), Destination: cip,
			Protocol: strings.ToLower(string(c.Port.Protocol)), SourcePort: 1, DestinationPort: c.Port.Port}, nftablestest.Options{LocalAddrs: local})
		if err != nil {
			t.Fatalf("trace: %v", err)
		}
		want := c.WantClusterEndpoints()
		got := sets.New[string]()
		for _, o := range outs {
			if o.DNAT != "" {
				got.Insert(o.DNAT)
			}
		}
		if !got.Equal(want) {
			t.Fatalf("clusterIP reaches %v, want %v", sets.List(got), sets.List(want))
		}
	})
}
