package explain

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/knftables"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/proxy"
	iptbackend "github.com/kproxy/kproxy/proxier/iptables"
	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
	"github.com/kproxy/kproxy/proxier/trace"
	"github.com/kproxy/kproxy/proxier/trace/tracetest"
)

// renderer programs a backend's fake with a node state and returns a
// tracer over what the fake then holds, read as the live tools print it.
type renderer func(t *testing.T, st *proxy.NodeState) Tracer

func localAddrs() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr(testNodeIP)}, nil }

func renderIPTables(t *testing.T, st *proxy.NodeState) Tracer {
	t.Helper()
	fake := iptablestest.NewFake(ipt.ProtocolIPv4)
	b, err := iptbackend.New(iptbackend.Options{IPTables: fake, LocalAddresses: localAddrs})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Sync(t.Context(), st, true); err != nil {
		t.Fatal(err)
	}
	src := trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{v1.IPv4Protocol: fake}, LocalAddresses: localAddrs}
	return func(ctx context.Context, r trace.Request) (*trace.Report, error) { return trace.Run(ctx, r, src) }
}

func renderNFTables(t *testing.T, st *proxy.NodeState) Tracer {
	t.Helper()
	fake := knftables.NewFake(knftables.IPv4Family, nftbackend.TableName)
	b, err := nftbackend.New(nftbackend.Options{NFTables: fake, Family: v1.IPv4Protocol, LocalAddresses: localAddrs})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Sync(t.Context(), st, true); err != nil {
		t.Fatal(err)
	}
	src := trace.Source{NFT: tracetest.NFTListing(fake, knftables.IPv4Family, nftbackend.TableName), LocalAddresses: localAddrs}
	return func(ctx context.Context, r trace.Request) (*trace.Report, error) { return trace.Run(ctx, r, src) }
}

var renderers = []struct {
	mode   string
	render renderer
}{{trace.ModeIPTables, renderIPTables}, {trace.ModeNFTables, renderNFTables}}

// nodeState is the IPv4 state the engine hands the backend for objs.
func nodeState(t *testing.T, objs ...runtime.Object) *proxy.NodeState {
	t.Helper()
	o := testOptions(objs...)
	in, err := read(t.Context(), o)
	if err != nil {
		t.Fatal(err)
	}
	states, _, err := decide(t.Context(), o, in)
	if err != nil {
		t.Fatal(err)
	}
	return states[v1.IPv4Protocol]
}

// TestCompareAgrees: for every case, the rules each backend renders from
// the same objects agree with every decision explained.
func TestCompareAgrees(t *testing.T) {
	for _, r := range renderers {
		t.Run(r.mode, func(t *testing.T) {
			for _, tc := range explainCases() {
				t.Run(tc.name, func(t *testing.T) {
					x, err := Explain(t.Context(), testOptions(tc.svc, tc.slice))
					if err != nil {
						t.Fatal(err)
					}
					x.Compare(t.Context(), r.mode, r.render(t, nodeState(t, tc.svc, tc.slice)))
					for _, p := range x.Ports {
						for _, f := range p.Flows {
							if f.Live == nil || f.Live.Result != Agree {
								t.Errorf("%s %s:%d from %s %s: model %q, live %+v", f.Destination, f.Address, f.Port, f.Source, f.SourceAddress, f.Reason, f.Live)
							}
						}
					}
					if x.Live.Result != Agree || x.Live.Mode != r.mode {
						t.Errorf("live %+v, want agree in %s mode", x.Live, r.mode)
					}
				})
			}
		})
	}
}

// TestCompareMismatch: rules rendered from other objects than the API
// server's (stale rules) are reported plainly.
func TestCompareMismatch(t *testing.T) {
	svc := testService(nodePort)
	current := testSlice(local1, remote2)
	for _, r := range renderers {
		for _, tc := range []struct {
			name   string
			stale  runtime.Object
			flow   string
			detail string
		}{
			{name: "an endpoint gone", stale: testSlice(local1), flow: "ClusterIP/pod",
				detail: "rules deliver to 10.244.1.5:8080, model says deliver to 10.244.1.5:8080, 10.244.2.5:8080: the rules are stale or were changed by someone else"},
			{name: "no endpoints", stale: testSlice(), flow: "NodePort/other",
				detail: "rules reject it (rejected: default/web:http has no endpoints"},
			{name: "policy changed", stale: nil, flow: "NodePort/other",
				detail: "rules drop it (dropped: externalTrafficPolicy is Local and this node has no ready or serving endpoint of default/web), model says deliver to 10.244.1.5:8080, 10.244.2.5:8080"},
		} {
			t.Run(r.mode+"/"+tc.name, func(t *testing.T) {
				x, err := Explain(t.Context(), testOptions(svc, current))
				if err != nil {
					t.Fatal(err)
				}
				objs := []runtime.Object{svc, tc.stale}
				if tc.stale == nil {
					objs = []runtime.Object{testService(etpLocal), testSlice(remote2)}
				}
				x.Compare(t.Context(), r.mode, r.render(t, nodeState(t, objs...)))
				f := flowsByKey(x)[tc.flow]
				if f.Live == nil || f.Live.Result != Mismatch || !strings.Contains(f.Live.Detail, tc.detail) {
					t.Errorf("flow %s: live %+v, want a mismatch with %q", tc.flow, f.Live, tc.detail)
				}
				if x.Live.Result != Mismatch {
					t.Errorf("live %+v, want a mismatch", x.Live)
				}
				var b strings.Builder
				if err := x.WriteText(&b); err != nil {
					t.Fatal(err)
				}
				if !strings.Contains(b.String(), "MISMATCH") {
					t.Errorf("text without MISMATCH:\n%s", b.String())
				}
			})
		}
	}
}

// TestCompareSkipped: without kproxy state for the mode, the decisions
// stand and the comparison is skipped with a reason.
func TestCompareSkipped(t *testing.T) {
	empty := trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{v1.IPv4Protocol: iptablestest.NewFake(ipt.ProtocolIPv4)}, LocalAddresses: localAddrs,
		NFT: func(context.Context, ...string) ([]byte, error) {
			return nil, errors.New("Error: No such file or directory")
		}}
	run := func(ctx context.Context, r trace.Request) (*trace.Report, error) { return trace.Run(ctx, r, empty) }
	for _, tc := range []struct {
		mode, detail string
	}{
		{mode: "", detail: "nothing to compare with: no kproxy state on this node: no IPv4 iptables, nftables or IPVS-mode rules of kproxy found"},
		{mode: trace.ModeIPTables, detail: "nothing to compare with: no kproxy state on this node: no IPv4 iptables rules of kproxy found"},
		{mode: trace.ModeNFTables, detail: "nothing to compare with: no kproxy state on this node: no IPv4 nftables rules of kproxy found"},
		{mode: trace.ModeIPVS, detail: "nothing to compare with: no kproxy state on this node: no IPv4 ipvs rules of kproxy found"},
	} {
		t.Run("mode="+tc.mode, func(t *testing.T) {
			svc, slice := testService(nodePort), testSlice(local1)
			x, err := Explain(t.Context(), testOptions(svc, slice))
			if err != nil {
				t.Fatal(err)
			}
			calls := 0
			x.Compare(t.Context(), tc.mode, func(ctx context.Context, r trace.Request) (*trace.Report, error) {
				calls++
				return run(ctx, r)
			})
			if x.Live.Result != Skipped || !strings.Contains(x.Live.Detail, tc.detail) {
				t.Errorf("live %+v, want skipped with %q", x.Live, tc.detail)
			}
			if calls != 1 {
				t.Errorf("%d traces, want 1 (the family skipped after the first)", calls)
			}
			var b strings.Builder
			if err := x.WriteText(&b); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(b.String(), "live rules: not compared: ") || !strings.Contains(b.String(), "delivered: default/web:http") {
				t.Errorf("text:\n%s", b.String())
			}
		})
	}
}
