package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
	"github.com/kproxy/kproxy/pkg/netlink"
	ipvsbackend "github.com/kproxy/kproxy/proxier/ipvs"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
	"github.com/kproxy/kproxy/proxier/trace"
)

// fakeTraceNode is a node for kproxy trace: iptables fakes by family with
// the given restore input, and nft answering with listing (or failing
// when it is empty).
func fakeTraceNode(t *testing.T, v4Rules string, listing string) traceSource {
	return func(ctx context.Context, family v1.IPFamily, _ time.Duration) (trace.Source, func()) {
		src := trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{},
			LocalAddresses: func() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("10.0.0.1")}, nil }}
		if family == v1.IPv4Protocol {
			f := iptablestest.NewFake(ipt.ProtocolIPv4)
			if v4Rules != "" {
				if err := f.Restore(ctx, []byte(v4Rules)); err != nil {
					t.Fatal(err)
				}
			}
			src.IPTables[family] = f
		}
		src.NFT = func(context.Context, ...string) ([]byte, error) {
			if listing == "" {
				return nil, errors.New("Error: No such file or directory")
			}
			return []byte(listing), nil
		}
		return src, func() {}
	}
}

// iptablesModeRules: one ClusterIP service with one endpoint, and one
// without endpoints, as iptables mode writes them.
const iptablesModeRules = `*nat
:KPROXY-SERVICES - [0:0]
:KPROXY-SVC-AAAAAAAAAAAAAAAA - [0:0]
-A PREROUTING -m comment --comment "kproxy service portals" -j KPROXY-SERVICES
-A OUTPUT -m comment --comment "kproxy service portals" -j KPROXY-SERVICES
-A KPROXY-SERVICES -m comment --comment "default/web:http cluster IP" -p tcp -m tcp -d 10.96.0.10/32 --dport 80 -j KPROXY-SVC-AAAAAAAAAAAAAAAA
-A KPROXY-SVC-AAAAAAAAAAAAAAAA -m comment --comment default/web:http -p tcp -m tcp -j DNAT --to-destination 10.244.1.5:8080
COMMIT
*filter
:KPROXY-SERVICES - [0:0]
-A OUTPUT -m comment --comment "kproxy service portals" -j KPROXY-SERVICES
-A FORWARD -m comment --comment "kproxy service portals" -j KPROXY-SERVICES
-A INPUT -m comment --comment "kproxy service portals" -j KPROXY-SERVICES
-A KPROXY-SERVICES -m comment --comment "default/empty:http has no endpoints" -p tcp -m tcp -d 10.96.0.11/32 --dport 80 -j REJECT
COMMIT
`

func TestTraceCommand(t *testing.T) {
	for _, tc := range []struct {
		name     string
		args     []string
		node     traceSource
		wantErr  string
		wantOut  []string
		wantJSON string // the verdict, with -o json
	}{
		{name: "addresses of two families", args: []string{"--src", "10.0.0.9", "--dst", "fd00::1", "--dport", "80"},
			wantErr: "are of different IP families"},
		{name: "port out of range", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "65536"},
			wantErr: "--dport 65536 is out of range 1-65535"},
		{name: "not an address", args: []string{"--src", "pod-a", "--dst", "10.96.0.10", "--dport", "80"},
			wantErr: `--src "pod-a" is not an IP address`},
		{name: "missing destination", args: []string{"--src", "10.0.0.9", "--dport", "80"}, wantErr: "--dst is required"},
		{name: "bad protocol", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "80", "--proto", "icmp"},
			wantErr: `--proto "icmp"`},
		{name: "bad output", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "80", "-o", "yaml"},
			wantErr: `-o "yaml"`},
		{name: "bad mode", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "80", "--proxy-mode", "userspace"},
			wantErr: `--proxy-mode "userspace": want iptables, nftables or ipvs`},
		{name: "IPVS mode asked for on an iptables-mode node", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "80", "--proxy-mode", "ipvs"},
			node: fakeTraceNode(t, iptablesModeRules, ""), wantErr: "no kproxy state on this node: no IPv4 ipvs rules of kproxy found"},
		{name: "no state on the node", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "80"},
			node: fakeTraceNode(t, "", ""), wantErr: "no kproxy state on this node: no IPv4 iptables, nftables or IPVS-mode rules of kproxy found"},
		{name: "no state of the mode asked for", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "80", "--proxy-mode", "nftables"},
			node: fakeTraceNode(t, iptablesModeRules, ""), wantErr: "no IPv4 nftables rules of kproxy found"},
		{name: "IPVS mode's chains", args: []string{"--src", "10.0.0.9", "--dst", "10.96.0.10", "--dport", "80"},
			node: fakeTraceNode(t, "*nat\n:KPROXY-IPVS-SERVICES - [0:0]\nCOMMIT\n", ""), wantErr: "IPVS table or ipsets cannot be read"},
		{name: "IPVS mode detected", args: []string{"--src", "10.244.1.9", "--dst", "10.96.0.10", "--dport", "80", "--from", "pod"},
			node: fakeIPVSTraceNode(t),
			wantOut: []string{"rules:   kproxy ipvs mode, IPv4", "service: ClusterIP TCP 10.96.0.10:80",
				"verdict: delivered: ClusterIP TCP 10.96.0.10:80 to one of 2 endpoint(s), not masqueraded",
				"10.244.1.5:8080          probability  50.0%  masquerade no", "ipvs virtual server: TCP 10.96.0.10:80 rr",
				"ipset KPROXY-CLUSTER-IP: 10.96.0.10,tcp:80", "note: IPVS scheduler rr takes the real servers in turn"}},
		{name: "IPVS mode: no endpoints", args: []string{"--src", "10.244.1.9", "--dst", "10.96.0.11", "--dport", "80", "--proxy-mode", "ipvs", "-o", "json"},
			node: fakeIPVSTraceNode(t), wantJSON: trace.Rejected},
		{name: "delivered", args: []string{"--src", "10.244.1.9", "--dst", "10.96.0.10", "--dport", "80", "--from", "pod"},
			node: fakeTraceNode(t, iptablesModeRules, ""),
			wantOut: []string{"service: default/web:http", "verdict: delivered: default/web:http to one of 1 endpoint(s), not masqueraded",
				"10.244.1.5:8080          probability 100.0%  masquerade no", "nat/KPROXY-SERVICES rule 1:"}},
		{name: "rejected", args: []string{"--src", "10.0.0.1", "--dst", "10.96.0.11", "--dport", "80"},
			node:    fakeTraceNode(t, iptablesModeRules, ""),
			wantOut: []string{"from node", "verdict: rejected: default/empty:http has no endpoints"}},
		{name: "json", args: []string{"--src", "10.0.0.1", "--dst", "10.96.0.11", "--dport", "80", "-o", "json"},
			node: fakeTraceNode(t, iptablesModeRules, ""), wantJSON: trace.Rejected},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			node := tc.node
			if node == nil {
				node = func(context.Context, v1.IPFamily, time.Duration) (trace.Source, func()) {
					t.Fatal("the command read the node despite bad flags")
					return trace.Source{}, nil
				}
			}
			cmd := newTraceCommand(&out, node)
			cmd.SetArgs(tc.args)
			cmd.SetOut(&out)
			cmd.SetErr(&out)
			err := cmd.Execute()
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range tc.wantOut {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
			if tc.wantJSON != "" {
				var rep trace.Report
				if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
					t.Fatalf("%v:\n%s", err, out.String())
				}
				if rep.Verdict != tc.wantJSON {
					t.Errorf("verdict %q, want %q", rep.Verdict, tc.wantJSON)
				}
			}
		})
	}
}

// TestMainTraceExitCode: a bad trace request exits non-zero through Main.
func TestMainTraceExitCode(t *testing.T) {
	var out, errOut bytes.Buffer
	if code := Main([]string{"trace", "--src", "10.0.0.1", "--dst", "10.96.0.1", "--dport", "0"}, &out, &errOut); code == 0 {
		t.Fatalf("exit code 0, want non-zero; stderr %s", errOut.String())
	}
	if !strings.Contains(errOut.String(), "--dport 0 is out of range") {
		t.Errorf("stderr %q", errOut.String())
	}
}

// fakeIPVSTraceNode is a node in IPVS mode: the IPVS backend renders two
// ClusterIP services (one with two endpoints, one without) into fakes.
func fakeIPVSTraceNode(t *testing.T) traceSource {
	env := pt.DefaultEnv()
	fakeIPVS, nl, sets, fipt := ipvs.NewFake(), netlink.NewFake(), ipset.NewFake(), iptablestest.NewFake(ipt.ProtocolIPv4)
	if err := nl.AddDevice("eth0", env.NodeIPs...); err != nil {
		t.Fatal(err)
	}
	b, err := ipvsbackend.New(ipvsbackend.Options{IPVS: fakeIPVS, Netlink: nl, IPSet: sets, IPTables: fipt,
		Sysctl: ipvsbackend.NewFakeSysctl(nil)})
	if err != nil {
		t.Fatal(err)
	}
	e := pt.NewEngine(t, b, pt.EngineOptions{Env: env,
		Services: []*v1.Service{pt.Service("web", "10.96.0.10"), pt.Service("empty", "10.96.0.11")},
		Slices: []*discovery.EndpointSlice{pt.Slice("web", 8080, pt.EP{IP: "10.244.1.5", Node: "node-b"},
			pt.EP{IP: "10.244.2.5", Node: "node-b"})}})
	pt.Sync(t, e)
	return func(ctx context.Context, family v1.IPFamily, _ time.Duration) (trace.Source, func()) {
		return trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{v1.IPv4Protocol: fipt}, IPVS: fakeIPVS, IPSet: sets,
			LocalAddresses: func() ([]netip.Addr, error) { return nl.LocalAddresses(ctx) }}, func() {}
	}
}
