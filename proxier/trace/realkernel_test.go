package trace

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/knftables"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/proxier"
	iptbackend "github.com/kproxy/kproxy/proxier/iptables"
	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// The real-kernel tests program a throwaway node namespace with a real
// backend (proxiertest's real-kernel harness builds the topology, starts
// the endpoints and sends every flow as real packets), and answer each
// flow with Run over the namespace's live state: iptables-save in it, or
// `nft list table` in it. The harness fails a flow whose real packets and
// trace disagree.

// realCases are the behaviour cases traced on a real kernel: a ClusterIP,
// node ports, Local policies without a local endpoint, no endpoints, and
// loadBalancerSourceRanges.
var realCases = []string{
	"clusterIP reaches every endpoint; off-cluster sources are masqueraded",
	"node port on every local address, masqueraded, not on localhost",
	"service without endpoints rejects on every destination",
	"externalTrafficPolicy Local without a local endpoint drops external traffic",
	"internalTrafficPolicy Local without a local endpoint drops",
	"loadBalancerSourceRanges admit listed sources and drop the rest",
	"IPv6 clusterIP and node port",
}

// allCaseNames names every case of the shared behaviour table.
func allCaseNames() []string {
	var out []string
	for _, c := range pt.Cases() {
		out = append(out, c.Name)
	}
	return out
}

func runRealCases(t *testing.T, names []string, rk pt.RealKernel) {
	netnstest.RequireRoot(t)
	n := 0
	for _, c := range pt.Cases() {
		if !slices.Contains(names, c.Name) {
			continue
		}
		n++
		t.Run(c.Name, func(t *testing.T) {
			t.Parallel()
			pt.RunCase(t, c, func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
				rc := pt.NewRealCase(t, c, env, rk, nil)
				return rc.Backend(), rc
			})
		})
	}
	if n != len(names) {
		t.Fatalf("found %d of the %d cases by name", n, len(names))
	}
}

// TestRealKernelIPTables: iptables mode, traced over iptables-save in the
// node namespace.
func TestRealKernelIPTables(t *testing.T) {
	runRealCases(t, allCaseNames(), realIPTablesKernel(""))
}

// realIPTablesKernel runs iptables mode; with binary, every flow is also
// traced by that kproxy binary run in the node namespace.
func realIPTablesKernel(binary string) pt.RealKernel {
	return pt.RealKernel{
		NSPrefix:       "tri",
		ForgetAffinity: pt.ForgetRecentLists,
		CheckKernel: func(ctx context.Context, node *netnstest.NS, family v1.IPFamily) error {
			cmd := "iptables"
			if family == v1.IPv6Protocol {
				cmd = "ip6tables"
			}
			if _, err := node.Exec(ctx, cmd, "-w", "5", "-t", "nat", "-S"); err != nil {
				return fmt.Errorf("no %s nat table: %w", family, err)
			}
			return nil
		},
		NewBackend: func(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
			open := func() ipt.Interface {
				i, err := ipt.New(t.Context(), ipt.Options{Protocol: iptProtocol(node.Env.Family), NetNS: node.NS.Name})
				if err != nil {
					t.Fatalf("iptables in %s: %v", node.NS.Name, err)
				}
				t.Cleanup(func() { _ = i.(*ipt.Real).Close() })
				return i
			}
			b, err := iptbackend.New(iptbackend.Options{IPTables: open(), NodePortAddresses: node.Env.NodePortAddresses,
				LocalAddresses: node.LocalAddresses})
			if err != nil {
				t.Fatal(err)
			}
			src := Source{IPTables: map[v1.IPFamily]ipt.Interface{node.Env.Family: open()}, LocalAddresses: node.LocalAddresses}
			return b, &reportTracer{t: t, src: src, check: checkBoth(t, node.NS, binary)}
		},
	}
}

// TestRealKernelNFTables: nftables mode, traced over `nft list table` in
// the node namespace.
func TestRealKernelNFTables(t *testing.T) {
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("nft not installed")
	}
	runRealCases(t, allCaseNames(), realNFTablesKernel(""))
}

// realNFTablesKernel runs nftables mode; with binary, every flow is also
// traced by that kproxy binary run in the node namespace.
func realNFTablesKernel(binary string) pt.RealKernel {
	return pt.RealKernel{
		NSPrefix:       "trn",
		ForgetAffinity: forgetAffinitySets,
		CheckKernel: func(ctx context.Context, node *netnstest.NS, _ v1.IPFamily) error {
			_, err := node.Exec(ctx, "nft", "list", "ruleset")
			return err
		},
		NewBackend: func(t *testing.T, node pt.RealNode) (proxier.Backend, pt.Tracer) {
			var real knftables.Interface
			if err := node.NS.Do(func() error {
				var err error
				real, err = nftbackend.NewInterface(node.Env.Family)
				return err
			}); err != nil {
				t.Fatalf("nft in %s: %v", node.NS.Name, err)
			}
			// Its nft session ends with the test.
			t.Cleanup(func() {
				if c, ok := real.(io.Closer); ok {
					_ = c.Close()
				}
			})
			b, err := nftbackend.New(nftbackend.Options{NFTables: &nsNFT{ns: node.NS, Interface: real}, Family: node.Env.Family,
				NodePortAddresses: node.Env.NodePortAddresses, LocalAddresses: node.LocalAddresses})
			if err != nil {
				t.Fatal(err)
			}
			src := Source{
				NFT: func(ctx context.Context, args ...string) ([]byte, error) {
					out, err := node.NS.Exec(ctx, "nft", args...)
					if err != nil {
						return nil, fmt.Errorf("%w: %s", err, strings.TrimSpace(string(out)))
					}
					return out, nil
				},
				LocalAddresses: node.LocalAddresses,
			}
			t.Cleanup(func() {
				if t.Failed() {
					out, err := node.NS.Exec(context.Background(), "nft", "list", "ruleset")
					t.Logf("nft list ruleset in the node namespace (err %v):\n%s", err, out)
				}
			})
			return b, &reportTracer{t: t, src: src, check: checkBoth(t, node.NS, binary)}
		},
	}
}

// checkBoth checks the reasons and, with binary, that `kproxy trace` run
// in ns reports what Run does.
func checkBoth(t *testing.T, ns *netnstest.NS, binary string) func(f pt.Flow, rep *Report) {
	reason := checkReason(t)
	return func(f pt.Flow, rep *Report) {
		reason(f, rep)
		if binary == "" {
			return
		}
		args := []string{"trace", "--src", f.Source, "--dst", f.Dest, "--dport", strconv.Itoa(f.Port),
			"--proto", strings.ToLower(string(f.Protocol)), "--from", rep.Packet.From}
		out, err := ns.Exec(context.Background(), binary, append(args, "-o", "json")...)
		if err != nil {
			t.Errorf("flow %q: kproxy %s: %v\n%s", f.Name, strings.Join(args, " "), err, out)
			return
		}
		var got Report
		if err := json.Unmarshal(out, &got); err != nil {
			t.Errorf("flow %q: kproxy trace -o json: %v\n%s", f.Name, err, out)
			return
		}
		if got.Verdict != rep.Verdict || got.Reason != rep.Reason || !reflect.DeepEqual(got.Endpoints, rep.Endpoints) {
			t.Errorf("flow %q: kproxy trace says %s %q %+v; Run says %s %q %+v", f.Name, got.Verdict, got.Reason, got.Endpoints,
				rep.Verdict, rep.Reason, rep.Endpoints)
		}
		text, _ := ns.Exec(context.Background(), binary, args...)
		t.Logf("flow %q: kproxy %s\n%s", f.Name, strings.Join(args, " "), text)
	}
}

// TestRealKernelBinary runs the kproxy binary's trace in the node
// namespace of a few cases, in both modes.
func TestRealKernelBinary(t *testing.T) {
	netnstest.RequireRoot(t)
	binary := filepath.Join(t.TempDir(), "kproxy")
	if out, err := exec.Command("go", "build", "-o", binary, "github.com/kproxy/kproxy/cmd/kproxy").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	names := []string{
		"clusterIP reaches every endpoint; off-cluster sources are masqueraded",
		"externalTrafficPolicy Local without a local endpoint drops external traffic",
	}
	t.Run("iptables", func(t *testing.T) { runRealCases(t, names, realIPTablesKernel(binary)) })
	if _, err := exec.LookPath("nft"); err == nil {
		t.Run("nftables", func(t *testing.T) { runRealCases(t, names, realNFTablesKernel(binary)) })
	}
}

// nsNFT runs every call of a real knftables.Interface inside the node
// namespace (nft, started from a thread there, inherits it).
type nsNFT struct {
	knftables.Interface
	ns *netnstest.NS
}

func (n *nsNFT) Run(ctx context.Context, tx *knftables.Transaction) error {
	return n.ns.Do(func() error { return n.Interface.Run(ctx, tx) })
}

func (n *nsNFT) Check(ctx context.Context, tx *knftables.Transaction) error {
	return n.ns.Do(func() error { return n.Interface.Check(ctx, tx) })
}

func (n *nsNFT) ListAll(ctx context.Context) (out map[string][]string, err error) {
	err = n.ns.Do(func() error { out, err = n.Interface.ListAll(ctx); return err })
	return out, err
}

func (n *nsNFT) List(ctx context.Context, objectType string) (out []string, err error) {
	err = n.ns.Do(func() error { out, err = n.Interface.List(ctx, objectType); return err })
	return out, err
}

func (n *nsNFT) ListRules(ctx context.Context, chain string) (out []*knftables.Rule, err error) {
	err = n.ns.Do(func() error { out, err = n.Interface.ListRules(ctx, chain); return err })
	return out, err
}

func (n *nsNFT) ListElements(ctx context.Context, objectType, name string) (out []*knftables.Element, err error) {
	err = n.ns.Do(func() error { out, err = n.Interface.ListElements(ctx, objectType, name); return err })
	return out, err
}

func (n *nsNFT) ListCounters(ctx context.Context) (out []*knftables.Counter, err error) {
	err = n.ns.Do(func() error { out, err = n.Interface.ListCounters(ctx); return err })
	return out, err
}

// forgetAffinitySets empties nftables mode's affinity sets of both
// families (those that exist), so that each flow is a first packet.
func forgetAffinitySets(node *netnstest.NS) error {
	for _, fam := range []string{"ip", "ip6"} {
		for _, proto := range []string{"tcp", "udp", "sctp"} {
			// A set (or table) that does not exist has nothing to forget.
			_, _ = node.Exec(context.Background(), "nft", "flush", "set", fam, nftbackend.TableName, "affinity-"+proto)
		}
	}
	return nil
}
