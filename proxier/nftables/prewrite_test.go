package nftables

import (
	"bufio"
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestFreshTableWritesSlotsAhead: the first sync into a table that is not
// there writes the endpoint slots in chunks ahead of its main transaction
// (preWriter), and leaves the table a one-transaction sync writes,
// element for element; a failed chunk fails the sync, and the next one
// repairs the table.
func TestFreshTableWritesSlotsAhead(t *testing.T) {
	ctx := context.Background()
	env := pt.DefaultEnv()
	// Twelve services, three endpoints each, with node ports; two more
	// claim the same external IP and port with other endpoints (the
	// smaller name owns it).
	var svcs []*v1.Service
	var sls []*discovery.EndpointSlice
	for i := 0; i < 12; i++ {
		name := fmt.Sprintf("s%02d", i)
		svcs = append(svcs, pt.Service(name, fmt.Sprintf("10.96.0.%d", i+1), pt.NodePort(int32(30000+i))))
		sls = append(sls, pt.Slice(name, 8080,
			pt.EP{IP: fmt.Sprintf("10.244.1.%d", 3*i+1), Node: "node-b"},
			pt.EP{IP: fmt.Sprintf("10.244.1.%d", 3*i+2), Node: "node-b"},
			pt.EP{IP: fmt.Sprintf("10.244.1.%d", 3*i+3), Node: "node-b"}))
	}
	for i, name := range []string{"zz-claims", "aa-claims"} {
		svcs = append(svcs, pt.Service(name, fmt.Sprintf("10.96.1.%d", i+1), pt.ExternalIPs("203.0.113.9")))
		sls = append(sls, pt.Slice(name, 8080, pt.EP{IP: fmt.Sprintf("10.244.2.%d", i+1), Node: "node-b"}))
	}

	// want is the table of one sync in one transaction.
	ref, refFake := newFakeBackend(t, env)
	ref.opts.EndpointChunk = 1 << 20
	pt.Sync(t, pt.NewEngine(t, ref, pt.EngineOptions{Env: env, Services: svcs, Slices: sls}))
	if st := ref.LastSync(); st.Transactions != 1 {
		t.Fatalf("reference sync ran %d transactions, want 1", st.Transactions)
	}
	want := sortedDump(refFake)

	for _, tc := range []struct {
		name  string
		chunk int
		// failAt fails the n-th transaction (1-based; 0: none);
		// failMain the main one.
		failAt   int
		failMain bool
		// wantTxs are the transactions of a sync that succeeds: one
		// per destination with a chunk of 1 (27 have slots: 12
		// ClusterIPs and 12 node ports, 2 ClusterIPs and the claimed
		// external IP once), and the main one.
		wantTxs     int
		wantMoreTxs bool
	}{
		{name: "one destination per chunk", chunk: 1, wantTxs: 28},
		{name: "chunks of four slots", chunk: 4, wantMoreTxs: true},
		{name: "everything fits one chunk: one transaction", chunk: 1000, wantTxs: 1},
		{name: "second chunk fails", chunk: 4, failAt: 2},
		{name: "main transaction fails", chunk: 4, failMain: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fake := knftables.NewFake(fakeFamily(env.Family), TableName)
			strict := &strictNFT{Fake: fake, failAt: tc.failAt}
			if tc.failMain {
				failed := false
				strict.failIf = func(tx *knftables.Transaction) bool {
					fail := !failed && strings.Contains(tx.String(), "add chain")
					failed = failed || fail
					return fail
				}
			}
			b, err := New(Options{NFTables: strict, Family: env.Family, NodePortAddresses: env.NodePortAddresses,
				LocalAddresses: func() ([]netip.Addr, error) { return env.NodeIPs, nil }, EndpointChunk: tc.chunk})
			if err != nil {
				t.Fatal(err)
			}
			e := pt.NewEngine(t, b, pt.EngineOptions{Env: env, Services: svcs, Slices: sls})
			err = e.SyncRules(ctx)
			if tc.failAt > 0 || strict.failIf != nil {
				if err == nil {
					t.Fatalf("sync succeeded with transaction %d failing", tc.failAt)
				}
				// The next sync rebuilds the table.
				pt.Sync(t, e)
				if st := b.LastSync(); st.Mode != modeRebuild {
					t.Errorf("sync after the failure was %s, want %s", st.Mode, modeRebuild)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				st := b.LastSync()
				if tc.wantMoreTxs && st.Transactions < 3 || !tc.wantMoreTxs && st.Transactions != tc.wantTxs {
					t.Errorf("%d transactions, want %d (more than 2: %v)", st.Transactions, tc.wantTxs, tc.wantMoreTxs)
				}
			}
			if got := sortedDump(fake); got != want {
				t.Errorf("table differs from one written in one transaction:\n%s\nwant\n%s", got, want)
			}
			// A full sync over it finds nothing to do.
			b2, err := New(Options{NFTables: &strictNFT{Fake: fake}, Family: env.Family, NodePortAddresses: env.NodePortAddresses,
				LocalAddresses: func() ([]netip.Addr, error) { return env.NodeIPs, nil }, EndpointChunk: tc.chunk})
			if err != nil {
				t.Fatal(err)
			}
			pt.Sync(t, pt.NewEngine(t, b2, pt.EngineOptions{Env: env, Services: svcs, Slices: sls}))
			if st := b2.LastSync(); st.Operations != 0 {
				t.Errorf("restart over the table: %d operations, want none", st.Operations)
			}
		})
	}
}

// TestPreWriterText: the text the preWriter writes for a chunk is what
// execNFT sends nft for the same chunk built as knftables objects (its
// element commands merged), in both families.
func TestPreWriterText(t *testing.T) {
	ap := netip.MustParseAddrPort
	for _, tc := range []struct {
		name string
		ipv6 bool
		drs  []*destRender
	}{
		{name: "ipv4: ClusterIP, node port, local slots, empty, other protocol", drs: []*destRender{
			{key: destKey{addr: netip.MustParseAddr("10.96.0.1"), proto: "tcp", port: 80},
				eps: [2][]netip.AddrPort{{ap("10.244.0.1:8080"), ap("10.244.0.2:8080")}, {ap("10.244.0.2:8080")}}},
			{key: destKey{addr: netip.MustParseAddr("10.96.0.2"), proto: "tcp", port: 443},
				eps: [2][]netip.AddrPort{{ap("10.244.0.3:8443")}}},
			{key: destKey{nodePort: true, proto: "tcp", port: 30080},
				eps: [2][]netip.AddrPort{{ap("10.244.0.1:8080")}, {ap("10.244.0.1:8080"), ap("10.244.0.9:65535")}}},
			{key: destKey{addr: netip.MustParseAddr("10.96.0.3"), proto: "udp", port: 53}},
			{key: destKey{addr: netip.MustParseAddr("10.96.0.3"), proto: "udp", port: 53},
				eps: [2][]netip.AddrPort{{ap("10.244.0.4:53")}}},
			{key: destKey{addr: netip.MustParseAddr("10.96.0.4"), proto: "tcp", port: 80},
				eps: [2][]netip.AddrPort{{ap("10.244.0.5:80")}}},
		}},
		{name: "ipv6", ipv6: true, drs: []*destRender{
			{key: destKey{addr: netip.MustParseAddr("fd00:96::1"), proto: "sctp", port: 9},
				eps: [2][]netip.AddrPort{{ap("[fd00:244::1]:9"), ap("[fd00:244::a]:10")}}},
			{key: destKey{nodePort: true, proto: "sctp", port: 30009},
				eps: [2][]netip.AddrPort{nil, {ap("[fd00:244::1]:9")}}},
		}},
		{name: "no slots at all"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := pt.DefaultEnv()
			family := knftables.IPv4Family
			if tc.ipv6 {
				env.Family, family = v1.IPv6Protocol, knftables.IPv6Family
			}
			b, err := New(Options{NFTables: knftables.NewFake(family, TableName), Family: env.Family,
				LocalAddresses: func() ([]netip.Addr, error) { return nil, nil }})
			if err != nil {
				t.Fatal(err)
			}
			l := b.layoutFor(&proxy.NodeState{})
			var header []knftables.Object
			header = append(header, &knftables.Table{Comment: knftables.PtrTo("rules for kproxy")})
			for _, sd := range l.sets() {
				if sd.big {
					header = append(header, sd.object())
				}
			}
			w := newPreWriter(context.Background(), b, header)
			var got strings.Builder
			bw := bufio.NewWriter(&got)
			if err := w.writeText(bw, tc.drs); err != nil {
				t.Fatal(err)
			}
			if err := bw.Flush(); err != nil {
				t.Fatal(err)
			}
			if want := mergedText(w.build(tc.drs).String()); got.String() != want {
				t.Errorf("text:\n%s\nwant (the transaction's, merged):\n%s", got.String(), want)
			}
		})
	}
}
