package iptablestest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kproxy/kproxy/pkg/iptables"
)

// restoreText joins lines into restore input.
func restoreText(lines ...string) []byte {
	return []byte(strings.Join(lines, "\n") + "\n")
}

func mustRestore(t *testing.T, f *Fake, lines ...string) {
	t.Helper()
	if err := f.Restore(context.Background(), restoreText(lines...)); err != nil {
		t.Fatalf("Restore: %v", err)
	}
}

// saveAll concatenates SaveInto of every table.
func saveAll(t testing.TB, f *Fake) []byte {
	t.Helper()
	var b bytes.Buffer
	for _, table := range []iptables.Table{iptables.TableFilter, iptables.TableMangle, iptables.TableNAT} {
		data, err := f.SaveInto(context.Background(), table)
		if err != nil {
			t.Fatalf("SaveInto(%s): %v", table, err)
		}
		b.Write(data)
	}
	return b.Bytes()
}

func TestFakeNew(t *testing.T) {
	f := NewFake(iptables.ProtocolIPv4)
	want := map[iptables.Table][]string{
		iptables.TableNAT:    {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
		iptables.TableFilter: {"INPUT", "FORWARD", "OUTPUT"},
		iptables.TableMangle: {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"},
	}
	for table, chains := range want {
		if got := f.Chains(table); !slices.Equal(got, chains) {
			t.Errorf("Chains(%s) = %v, want %v", table, got, chains)
		}
		for _, c := range chains {
			if p := f.Policy(table, iptables.Chain(c)); p != "ACCEPT" {
				t.Errorf("policy of %s/%s = %q, want ACCEPT", table, c, p)
			}
		}
	}
	if f.Protocol() != iptables.ProtocolIPv4 || !f.HasRandomFully() {
		t.Errorf("Protocol() = %v, HasRandomFully() = %v", f.Protocol(), f.HasRandomFully())
	}
	if f.Chains("raw") != nil {
		t.Errorf("unknown table has chains")
	}
}

// fakeState is what a restore test expects afterwards: for each listed
// table/chain its rules; chains listed with nil must not exist.
type fakeState map[string][]string

func checkState(t *testing.T, f *Fake, want fakeState) {
	t.Helper()
	for key, rules := range want {
		table, chain, _ := strings.Cut(key, "/")
		exists := slices.Contains(f.Chains(iptables.Table(table)), chain)
		if rules == nil {
			if exists {
				t.Errorf("chain %s exists, want it absent", key)
			}
			continue
		}
		if !exists {
			t.Errorf("chain %s does not exist", key)
			continue
		}
		got := f.Rules(iptables.Table(table), iptables.Chain(chain))
		if !slices.Equal(got, rules) {
			t.Errorf("rules of %s:\n got %q\nwant %q", key, got, rules)
		}
	}
}

func TestFakeRestore(t *testing.T) {
	setup := []string{
		"*filter",
		":KUBE-A - [0:0]",
		":KUBE-B - [0:0]",
		"-A INPUT -j KUBE-A",
		"-A KUBE-A -s 10.0.0.1 -j ACCEPT",
		"-A KUBE-B -j DROP",
		"COMMIT",
	}
	setupState := fakeState{
		"filter/INPUT":  {"-j KUBE-A"},
		"filter/KUBE-A": {"-s 10.0.0.1 -j ACCEPT"},
		"filter/KUBE-B": {"-j DROP"},
	}
	tests := []struct {
		name     string
		protocol iptables.Protocol
		noSetup  bool
		input    []string
		wantErr  string
		// wantLine is the line number the error must name (0: not checked).
		wantLine int
		want     fakeState
	}{
		{
			name:  "declaring an existing user chain flushes it",
			input: []string{"*filter", ":KUBE-A - [0:0]", "-A KUBE-A -s 10.0.0.2 -j ACCEPT", "COMMIT"},
			want: fakeState{
				"filter/INPUT":  {"-j KUBE-A"},
				"filter/KUBE-A": {"-s 10.0.0.2 -j ACCEPT"},
				"filter/KUBE-B": {"-j DROP"},
			},
		},
		{
			name:  "chains not declared are left alone",
			input: []string{"*filter", "-A KUBE-B -j ACCEPT", "COMMIT"},
			want: fakeState{
				"filter/KUBE-A": {"-s 10.0.0.1 -j ACCEPT"},
				"filter/KUBE-B": {"-j DROP", "-j ACCEPT"},
			},
		},
		{
			name:  "declaring a built-in chain sets the policy without flushing",
			input: []string{"*filter", ":INPUT DROP [0:0]", ":FORWARD - [0:0]", "COMMIT"},
			want:  fakeState{"filter/INPUT": {"-j KUBE-A"}},
		},
		{
			name:  "flush and delete a chain",
			input: []string{"*filter", ":KUBE-B - [0:0]", "-X KUBE-B", "COMMIT"},
			want:  fakeState{"filter/KUBE-B": nil, "filter/KUBE-A": {"-s 10.0.0.1 -j ACCEPT"}},
		},
		{
			name:  "delete a chain after removing its reference",
			input: []string{"*filter", ":KUBE-A - [0:0]", "-X KUBE-A", "-D INPUT -j KUBE-A", "COMMIT"},
			want:  fakeState{"filter/KUBE-A": nil, "filter/INPUT": {}},
		},
		{
			name:     "delete a referenced chain is rejected",
			input:    []string{"*filter", ":KUBE-A - [0:0]", "-X KUBE-A", "COMMIT"},
			wantErr:  "still referenced",
			wantLine: 3,
			want:     setupState,
		},
		{
			name:     "delete a non-empty chain is rejected",
			input:    []string{"*filter", "-X KUBE-B", "COMMIT"},
			wantErr:  "not empty",
			wantLine: 2,
			want:     setupState,
		},
		{
			name:     "delete a chain created and referenced in the same section",
			input:    []string{"*filter", ":KUBE-C - [0:0]", "-A KUBE-B -j KUBE-C", "-X KUBE-C", "COMMIT"},
			wantErr:  "still referenced",
			wantLine: 4,
			want:     fakeState{"filter/KUBE-C": nil, "filter/KUBE-B": {"-j DROP"}},
		},
		{
			name:  "delete and re-create a chain in one section",
			input: []string{"*filter", ":KUBE-B - [0:0]", "-X KUBE-B", ":KUBE-B - [0:0]", "-A KUBE-B -j RETURN", "COMMIT"},
			want:  fakeState{"filter/KUBE-B": {"-j RETURN"}},
		},
		{
			name:    "delete a built-in chain is rejected",
			input:   []string{"*filter", "-X INPUT", "COMMIT"},
			wantErr: "built-in",
			want:    setupState,
		},
		{
			name:    "delete a missing chain is rejected",
			input:   []string{"*filter", "-X KUBE-NOPE", "COMMIT"},
			wantErr: "does not exist",
			want:    setupState,
		},
		{
			name:  "delete all user chains",
			input: []string{"*filter", "-F", "-X", "COMMIT"},
			want:  fakeState{"filter/INPUT": {}, "filter/KUBE-A": nil, "filter/KUBE-B": nil},
		},
		{
			name:     "jump to a missing chain is rejected",
			input:    []string{"*filter", "-A KUBE-B -j KUBE-NOPE", "COMMIT"},
			wantErr:  "chain KUBE-NOPE does not exist",
			wantLine: 2,
			want:     setupState,
		},
		{
			name:     "goto a chain declared later is rejected",
			input:    []string{"*filter", "-A KUBE-B -g KUBE-C", ":KUBE-C - [0:0]", "COMMIT"},
			wantErr:  "chain KUBE-C does not exist",
			wantLine: 2,
			want:     setupState,
		},
		{
			name: "a bad line in the middle changes nothing",
			input: []string{
				"*filter",
				":KUBE-A - [0:0]",
				":KUBE-NEW - [0:0]",
				"-A KUBE-A -j DROP",
				"-A KUBE-NEW -m bogus -j ACCEPT",
				"-A KUBE-B -j ACCEPT",
				"COMMIT",
			},
			wantErr:  "unsupported match",
			wantLine: 5,
			want:     fakeState{"filter/KUBE-A": {"-s 10.0.0.1 -j ACCEPT"}, "filter/KUBE-B": {"-j DROP"}, "filter/KUBE-NEW": nil},
		},
		{
			name: "several tables in one input",
			input: []string{
				"# a comment",
				"*nat",
				":KUBE-SERVICES - [0:0]",
				"-A PREROUTING -j KUBE-SERVICES",
				"COMMIT",
				"*filter",
				":KUBE-A - [0:0]",
				"COMMIT",
				"*mangle",
				"-A PREROUTING -j MARK --set-xmark 0x1/0x1",
				"COMMIT",
			},
			want: fakeState{
				"nat/PREROUTING":    {"-j KUBE-SERVICES"},
				"nat/KUBE-SERVICES": {},
				"filter/KUBE-A":     {},
				"mangle/PREROUTING": {"-j MARK --set-xmark 0x1/0x1"},
			},
		},
		{
			name: "a failing later table keeps earlier committed tables",
			input: []string{
				"*nat",
				":KUBE-SERVICES - [0:0]",
				"COMMIT",
				"*filter",
				":KUBE-A - [0:0]",
				"-A KUBE-A -j KUBE-NOPE",
				"COMMIT",
			},
			wantErr:  "KUBE-NOPE",
			wantLine: 6,
			want:     fakeState{"nat/KUBE-SERVICES": {}, "filter/KUBE-A": {"-s 10.0.0.1 -j ACCEPT"}},
		},
		{
			name:  "quoted comment is one argument",
			input: []string{"*filter", `-A KUBE-B -m comment --comment "ns/svc:p \"x\" cluster IP" -j ACCEPT`, "COMMIT"},
			want:  fakeState{"filter/KUBE-B": {"-j DROP", `-m comment --comment "ns/svc:p \"x\" cluster IP" -j ACCEPT`}},
		},
		{
			name:  "insert at positions and delete by arguments and number",
			input: []string{"*filter", "-I KUBE-B -j ACCEPT", "-I KUBE-B 2 -j RETURN", "-A KUBE-B -s 1.1.1.1", "-D KUBE-B -j DROP", "-D KUBE-B 1", "COMMIT"},
			want:  fakeState{"filter/KUBE-B": {"-j RETURN", "-s 1.1.1.1"}},
		},
		{
			name:    "insert beyond the end is rejected",
			input:   []string{"*filter", "-I KUBE-B 3 -j ACCEPT", "COMMIT"},
			wantErr: "too big",
			want:    setupState,
		},
		{
			name:    "deleting a missing rule is rejected",
			input:   []string{"*filter", "-D KUBE-B -j ACCEPT", "COMMIT"},
			wantErr: "does a matching rule exist",
			want:    setupState,
		},
		{
			name:    "append to a missing chain is rejected",
			input:   []string{"*filter", "-A KUBE-NOPE -j ACCEPT", "COMMIT"},
			wantErr: "does not exist",
			want:    setupState,
		},
		{
			name:    "flush a missing chain is rejected",
			input:   []string{"*filter", "-F KUBE-NOPE", "COMMIT"},
			wantErr: "does not exist",
			want:    setupState,
		},
		{
			name:    "new chain that exists is rejected",
			input:   []string{"*filter", "-N KUBE-A", "COMMIT"},
			wantErr: "already exists",
			want:    setupState,
		},
		{
			name:    "unknown table",
			input:   []string{"*raw", "COMMIT"},
			wantErr: `unknown table "raw"`,
			want:    setupState,
		},
		{
			name:    "missing COMMIT applies nothing",
			input:   []string{"*filter", "-A KUBE-B -j ACCEPT"},
			wantErr: "no COMMIT",
			want:    setupState,
		},
		{
			name:    "rule outside a table",
			input:   []string{"-A INPUT -j ACCEPT"},
			wantErr: "outside a table",
			want:    setupState,
		},
		{
			name:    "policy on a user chain",
			input:   []string{"*filter", ":KUBE-A ACCEPT [0:0]", "COMMIT"},
			wantErr: "cannot set policy",
			want:    setupState,
		},
		{
			name:    "chain name too long",
			input:   []string{"*filter", ":KUBE-SVC-ABCDEFGHIJKLMNOPQRST - [0:0]", "COMMIT"},
			wantErr: "too long",
			want:    setupState,
		},
		{
			name:    "chain named like a target",
			input:   []string{"*filter", ":MASQUERADE - [0:0]", "COMMIT"},
			wantErr: "clashes with a target",
			want:    setupState,
		},
		{
			name:    "jump to a built-in chain",
			input:   []string{"*filter", "-A KUBE-B -j INPUT", "COMMIT"},
			wantErr: "built-in chain",
			want:    setupState,
		},
		{
			name:     "DNAT outside the nat table",
			input:    []string{"*filter", "-A KUBE-B -p tcp -j DNAT --to-destination 1.2.3.4:80", "COMMIT"},
			wantErr:  "only valid in the nat table",
			wantLine: 2,
			want:     setupState,
		},
		{
			name:    "DROP in the nat table",
			input:   []string{"*nat", "-A PREROUTING -j DROP", "COMMIT"},
			wantErr: "not intended for filtering",
			want:    setupState,
		},
		{
			name:     "DNAT reachable from POSTROUTING",
			input:    []string{"*nat", ":KUBE-X - [0:0]", "-A KUBE-X -p tcp -j DNAT --to-destination 1.2.3.4:80", "-A POSTROUTING -j KUBE-X", "COMMIT"},
			wantErr:  "reachable from POSTROUTING",
			wantLine: 3,
			want:     fakeState{"nat/KUBE-X": nil},
		},
		{
			name:     "MASQUERADE reachable from PREROUTING",
			input:    []string{"*nat", ":KUBE-X - [0:0]", "-A KUBE-X -j MASQUERADE", "-A PREROUTING -j KUBE-X", "COMMIT"},
			wantErr:  "only valid from POSTROUTING",
			wantLine: 3,
		},
		{
			name:  "unreachable chains may hold any nat target",
			input: []string{"*nat", ":KUBE-X - [0:0]", "-A KUBE-X -j MASQUERADE", "-A KUBE-X -p tcp -j DNAT --to-destination 1.2.3.4:80", "COMMIT"},
			want:  fakeState{"nat/KUBE-X": {"-j MASQUERADE", "-p tcp -j DNAT --to-destination 1.2.3.4:80"}},
		},
		{
			name:    "REJECT reachable from PREROUTING",
			input:   []string{"*mangle", ":KUBE-X - [0:0]", "-A KUBE-X -j REJECT", "-A PREROUTING -j KUBE-X", "COMMIT"},
			wantErr: "only valid from INPUT,FORWARD,OUTPUT",
		},
		{
			name:     "jump loop reachable from a built-in chain",
			input:    []string{"*filter", ":L1 - [0:0]", ":L2 - [0:0]", "-A L1 -j L2", "-A L2 -j L1", "-A FORWARD -j L1", "COMMIT"},
			wantErr:  "closes a loop",
			wantLine: 5,
			want:     fakeState{"filter/L1": nil},
		},
		{
			name:    "-i in OUTPUT",
			input:   []string{"*filter", "-A OUTPUT -i eth0 -j ACCEPT", "COMMIT"},
			wantErr: "can't use -i with OUTPUT",
		},
		{
			name:    "-t inside restore input",
			input:   []string{"*filter", "-t nat -A INPUT", "COMMIT"},
			wantErr: "-t option",
		},
		{
			name:    "IPv6 address in an IPv4 table",
			input:   []string{"*filter", "-A KUBE-B -s fd00::1 -j ACCEPT", "COMMIT"},
			wantErr: "not an IPv4 value",
			want:    setupState,
		},
		{
			name:     "IPv4 address in an IPv6 table",
			protocol: iptables.ProtocolIPv6,
			noSetup:  true,
			input:    []string{"*nat", "-A OUTPUT -p tcp -j DNAT --to-destination 10.0.0.1:80", "COMMIT"},
			wantErr:  "not an IPv6 value",
		},
		{
			name:     "IPv4 reject type in an IPv6 table",
			protocol: iptables.ProtocolIPv6,
			noSetup:  true,
			input:    []string{"*filter", "-A INPUT -j REJECT --reject-with icmp-port-unreachable", "COMMIT"},
			wantErr:  "not an IPv6 value",
		},
		{
			name:     "REJECT without a type in an IPv6 table",
			protocol: iptables.ProtocolIPv6,
			noSetup:  true,
			input:    []string{"*filter", "-A INPUT -j REJECT", "COMMIT"},
			want:     fakeState{"filter/INPUT": {"-j REJECT"}},
		},
		{
			name:     "IPv6 rules in an IPv6 table",
			protocol: iptables.ProtocolIPv6,
			noSetup:  true,
			input: []string{"*nat", ":KUBE-X - [0:0]", "-A OUTPUT -d ::5/::ff -j KUBE-X",
				"-A KUBE-X -p tcp -j DNAT --to-destination [fd00::1]:80", "COMMIT"},
			want: fakeState{"nat/OUTPUT": {"-d ::5/::ff -j KUBE-X"}},
		},
		{
			name:    "counters before a rule and whitespace are accepted",
			input:   []string{"  *filter", "", "[5:100] -A KUBE-B -j RETURN", "\t# indented comment", "COMMIT\r"},
			want:    fakeState{"filter/KUBE-B": {"-j DROP", "-j RETURN"}},
			wantErr: "",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			protocol := tc.protocol
			if protocol == "" {
				protocol = iptables.ProtocolIPv4
			}
			f := NewFake(protocol)
			if !tc.noSetup {
				mustRestore(t, f, setup...)
			}
			err := f.Restore(context.Background(), restoreText(tc.input...))
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("Restore: %v", err)
				}
			} else {
				if err == nil {
					t.Fatalf("Restore succeeded, want error containing %q", tc.wantErr)
				}
				if !strings.Contains(err.Error(), tc.wantErr) {
					t.Errorf("Restore error = %v, want it to contain %q", err, tc.wantErr)
				}
				var re *RestoreError
				if !errors.As(err, &re) {
					t.Fatalf("error %v is not a *RestoreError", err)
				}
				if re.Line < 1 || re.Line > len(tc.input)+1 || (re.Line <= len(tc.input) && re.Text != strings.TrimRight(tc.input[re.Line-1], "\r")) {
					t.Errorf("error names line %d %q, which is not that line of the input", re.Line, re.Text)
				}
				if tc.wantLine != 0 && re.Line != tc.wantLine {
					t.Errorf("error names line %d, want %d (%v)", re.Line, tc.wantLine, err)
				}
			}
			checkState(t, f, tc.want)
		})
	}
}

func TestFakeRestorePolicy(t *testing.T) {
	f := NewFake(iptables.ProtocolIPv4)
	mustRestore(t, f, "*filter", ":FORWARD DROP [0:0]", "COMMIT")
	if p := f.Policy(iptables.TableFilter, iptables.ChainForward); p != "DROP" {
		t.Errorf("FORWARD policy = %q, want DROP", p)
	}
	mustRestore(t, f, "*filter", ":FORWARD - [0:0]", "COMMIT")
	if p := f.Policy(iptables.TableFilter, iptables.ChainForward); p != "DROP" {
		t.Errorf("FORWARD policy after '-' = %q, want DROP kept", p)
	}
	mustRestore(t, f, "*filter", "-P FORWARD ACCEPT", "COMMIT")
	if p := f.Policy(iptables.TableFilter, iptables.ChainForward); p != "ACCEPT" {
		t.Errorf("FORWARD policy after -P = %q, want ACCEPT", p)
	}
}

func TestFakeRestoreRandomFully(t *testing.T) {
	for _, supported := range []bool{true, false} {
		t.Run(fmt.Sprintf("supported=%t", supported), func(t *testing.T) {
			f := NewFake(iptables.ProtocolIPv4)
			f.RandomFully = supported
			if f.HasRandomFully() != supported {
				t.Fatalf("HasRandomFully() = %t", f.HasRandomFully())
			}
			err := f.Restore(context.Background(), restoreText("*nat", "-A POSTROUTING -j MASQUERADE --random-fully", "COMMIT"))
			if (err == nil) != supported {
				t.Errorf("Restore error = %v with random-fully supported=%t", err, supported)
			}
		})
	}
}

func TestFakeRestoreDepthLimit(t *testing.T) {
	for _, depth := range []int{maxChainDepth, maxChainDepth + 1} {
		t.Run(fmt.Sprintf("depth %d", depth), func(t *testing.T) {
			lines := []string{"*filter"}
			for i := 1; i <= depth; i++ {
				lines = append(lines, fmt.Sprintf(":C%d - [0:0]", i))
			}
			for i := 1; i < depth; i++ {
				lines = append(lines, fmt.Sprintf("-A C%d -j C%d", i, i+1))
			}
			lines = append(lines, "-A INPUT -j C1", "COMMIT")
			err := NewFake(iptables.ProtocolIPv4).Restore(context.Background(), restoreText(lines...))
			if depth <= maxChainDepth && err != nil {
				t.Errorf("Restore: %v", err)
			}
			if depth > maxChainDepth && (err == nil || !strings.Contains(err.Error(), "nest")) {
				t.Errorf("Restore error = %v, want a nesting error", err)
			}
		})
	}
}

func TestFakeRestoreCounters(t *testing.T) {
	f := NewFake(iptables.ProtocolIPv4)
	ctx := context.Background()
	good := restoreText("*filter", ":KUBE-A - [0:0]", "COMMIT")
	bad := restoreText("*filter", "-A NOPE -j ACCEPT", "COMMIT")
	if err := f.Restore(ctx, good); err != nil {
		t.Fatal(err)
	}
	if err := f.Restore(ctx, bad); err == nil {
		t.Fatal("bad restore succeeded")
	}
	if n := f.RestoreCount(); n != 2 {
		t.Errorf("RestoreCount() = %d, want 2", n)
	}
	if got := f.LastRestore(); !bytes.Equal(got, bad) {
		t.Errorf("LastRestore() = %q, want %q", got, bad)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := f.Restore(cancelled, good); !errors.Is(err, context.Canceled) {
		t.Errorf("Restore with a cancelled context = %v", err)
	}
}

func TestFakeSaveIntoRoundTrip(t *testing.T) {
	tests := []struct {
		name     string
		protocol iptables.Protocol
		input    []string
	}{
		{
			name:     "kube-proxy like nat and filter",
			protocol: iptables.ProtocolIPv4,
			input: []string{
				"*nat",
				":KUBE-SERVICES - [0:0]",
				":KUBE-SVC-A - [0:0]",
				":KUBE-SEP-A1 - [0:0]",
				":KUBE-MARK-MASQ - [0:0]",
				"-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
				"-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000",
				"-A KUBE-SERVICES -d 172.30.0.10/32 -p tcp -m comment --comment \"ns/a:http cluster IP\" -m tcp --dport 80 -j KUBE-SVC-A",
				"-A KUBE-SVC-A -m statistic --mode random --probability 0.5 -j KUBE-SEP-A1",
				"-A KUBE-SEP-A1 -s 10.0.1.1/32 -j KUBE-MARK-MASQ",
				"-A KUBE-SEP-A1 -p tcp -m tcp -j DNAT --to-destination 10.0.1.1:8080",
				"-A POSTROUTING -j MASQUERADE --random-fully",
				"COMMIT",
				"*filter",
				":FORWARD DROP [0:0]",
				":KUBE-FORWARD - [0:0]",
				"-A FORWARD -j KUBE-FORWARD",
				"-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP",
				"-A KUBE-FORWARD -m comment --comment \"quote \\\" and \\\\ backslash\" -j ACCEPT",
				"COMMIT",
			},
		},
		{
			name:     "ipv6",
			protocol: iptables.ProtocolIPv6,
			input: []string{
				"*nat",
				":KUBE-X - [0:0]",
				"-A OUTPUT -d ::5/::ff -j KUBE-X",
				"-A KUBE-X -p tcp -j DNAT --to-destination [fd00::1]:80",
				"COMMIT",
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFake(tc.protocol)
			mustRestore(t, f, tc.input...)
			saved := saveAll(t, f)
			g := NewFake(tc.protocol)
			if err := g.Restore(context.Background(), saved); err != nil {
				t.Fatalf("restoring saved output: %v\n%s", err, saved)
			}
			if again := saveAll(t, g); !bytes.Equal(saved, again) {
				t.Errorf("round trip differs:\n%s\n---\n%s", saved, again)
			}
			if got := f.Policy(iptables.TableFilter, iptables.ChainForward); g.Policy(iptables.TableFilter, iptables.ChainForward) != got {
				t.Errorf("policy not restored")
			}
		})
	}
}

func TestFakeSaveIntoFormat(t *testing.T) {
	f := NewFake(iptables.ProtocolIPv4)
	mustRestore(t, f, "*filter", ":KUBE-B - [0:0]", ":KUBE-A - [0:0]", "-A INPUT -j KUBE-B",
		`-A KUBE-A -m comment --comment "a b" -j ACCEPT`, "COMMIT")
	got, err := f.SaveInto(context.Background(), iptables.TableFilter)
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Join([]string{
		"# Generated by kproxy fake iptables (IPv4)",
		"*filter",
		":INPUT ACCEPT [0:0]",
		":FORWARD ACCEPT [0:0]",
		":OUTPUT ACCEPT [0:0]",
		":KUBE-A - [0:0]",
		":KUBE-B - [0:0]",
		"-A INPUT -j KUBE-B",
		`-A KUBE-A -m comment --comment "a b" -j ACCEPT`,
		"COMMIT",
		"# Completed",
		"",
	}, "\n")
	if string(got) != want {
		t.Errorf("SaveInto:\n%s\nwant:\n%s", got, want)
	}
	if _, err := f.SaveInto(context.Background(), "raw"); err == nil {
		t.Errorf("SaveInto(raw) succeeded")
	}
}

func TestFakeInterfaceMethods(t *testing.T) {
	ctx := context.Background()
	f := NewFake(iptables.ProtocolIPv4)
	var ipt iptables.Interface = f

	existed, err := ipt.EnsureChain(ctx, iptables.TableNAT, "KUBE-SERVICES")
	if err != nil || existed {
		t.Fatalf("EnsureChain new = %t, %v", existed, err)
	}
	if existed, err = ipt.EnsureChain(ctx, iptables.TableNAT, "KUBE-SERVICES"); err != nil || !existed {
		t.Fatalf("EnsureChain again = %t, %v", existed, err)
	}
	if existed, err = ipt.EnsureChain(ctx, iptables.TableNAT, iptables.ChainPrerouting); err != nil || !existed {
		t.Fatalf("EnsureChain builtin = %t, %v", existed, err)
	}
	if _, err = ipt.EnsureChain(ctx, "raw", "X"); err == nil {
		t.Errorf("EnsureChain in an unknown table succeeded")
	}
	if _, err = ipt.EnsureChain(ctx, iptables.TableNAT, "BAD NAME"); err == nil {
		t.Errorf("EnsureChain with an invalid name succeeded")
	}
	if ok, err := ipt.ChainExists(ctx, iptables.TableNAT, "KUBE-SERVICES"); err != nil || !ok {
		t.Errorf("ChainExists = %t, %v", ok, err)
	}
	if ok, err := ipt.ChainExists(ctx, iptables.TableFilter, "KUBE-SERVICES"); err != nil || ok {
		t.Errorf("ChainExists in other table = %t, %v", ok, err)
	}

	jump := []string{"-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"}
	if existed, err = ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainOutput, jump...); err != nil || existed {
		t.Fatalf("EnsureRule = %t, %v", existed, err)
	}
	if existed, err = ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainOutput, jump...); err != nil || !existed {
		t.Fatalf("EnsureRule again = %t, %v", existed, err)
	}
	if _, err = ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainOutput, "-s", "10.0.0.1", "-j", "ACCEPT"); err != nil {
		t.Fatal(err)
	}
	if _, err = ipt.EnsureRule(ctx, iptables.Prepend, iptables.TableNAT, iptables.ChainOutput, "-s", "10.0.0.2", "-j", "ACCEPT"); err != nil {
		t.Fatal(err)
	}
	want := []string{"-s 10.0.0.2 -j ACCEPT", `-m comment --comment "kubernetes service portals" -j KUBE-SERVICES`, "-s 10.0.0.1 -j ACCEPT"}
	if got := f.Rules(iptables.TableNAT, iptables.ChainOutput); !slices.Equal(got, want) {
		t.Errorf("rules = %q, want %q", got, want)
	}
	for _, bad := range [][]string{
		{"-j", "KUBE-MISSING"},
		{"-m", "bogus"},
		{"-j", "DROP"}, // DROP in nat
	} {
		if _, err := ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, iptables.ChainOutput, bad...); err == nil {
			t.Errorf("EnsureRule(%q) succeeded", bad)
		}
	}
	if _, err := ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, "KUBE-MISSING", "-j", "ACCEPT"); err == nil {
		t.Errorf("EnsureRule in a missing chain succeeded")
	}
	if _, err := ipt.EnsureRule(ctx, "-X", iptables.TableNAT, iptables.ChainOutput, "-j", "RETURN"); err == nil {
		t.Errorf("EnsureRule with a bad position succeeded")
	}
	if got := f.Rules(iptables.TableNAT, iptables.ChainOutput); !slices.Equal(got, want) {
		t.Errorf("failed EnsureRule calls changed the rules: %q", got)
	}

	// Deleting a referenced chain fails; after the reference goes it works.
	if err := ipt.DeleteChain(ctx, iptables.TableNAT, "KUBE-SERVICES"); err == nil || !strings.Contains(err.Error(), "referenced") {
		t.Errorf("DeleteChain of a referenced chain = %v", err)
	}
	if err := ipt.DeleteRule(ctx, iptables.TableNAT, iptables.ChainOutput, jump...); err != nil {
		t.Fatal(err)
	}
	if err := ipt.DeleteRule(ctx, iptables.TableNAT, iptables.ChainOutput, jump...); err != nil {
		t.Errorf("DeleteRule of an absent rule = %v", err)
	}
	if err := ipt.DeleteRule(ctx, iptables.TableNAT, "KUBE-NONE", "-j", "ACCEPT"); err != nil {
		t.Errorf("DeleteRule in an absent chain = %v", err)
	}
	if _, err := ipt.EnsureRule(ctx, iptables.Append, iptables.TableNAT, "KUBE-SERVICES", "-j", "RETURN"); err != nil {
		t.Fatal(err)
	}
	if err := ipt.DeleteChain(ctx, iptables.TableNAT, "KUBE-SERVICES"); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Errorf("DeleteChain of a non-empty chain = %v", err)
	}
	if err := ipt.FlushChain(ctx, iptables.TableNAT, "KUBE-SERVICES"); err != nil {
		t.Fatal(err)
	}
	if err := ipt.FlushChain(ctx, iptables.TableNAT, "KUBE-NONE"); err != nil {
		t.Errorf("FlushChain of an absent chain = %v", err)
	}
	if err := ipt.DeleteChain(ctx, iptables.TableNAT, "KUBE-SERVICES"); err != nil {
		t.Errorf("DeleteChain = %v", err)
	}
	if err := ipt.DeleteChain(ctx, iptables.TableNAT, "KUBE-SERVICES"); err != nil {
		t.Errorf("DeleteChain of an absent chain = %v", err)
	}
	if err := ipt.DeleteChain(ctx, iptables.TableNAT, iptables.ChainOutput); err == nil {
		t.Errorf("DeleteChain of a built-in chain succeeded")
	}
	chains, err := ipt.ListChains(ctx, iptables.TableNAT)
	if err != nil || !slices.Equal(chains, []string{"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"}) {
		t.Errorf("ListChains = %v, %v", chains, err)
	}
	if _, err := ipt.ListChains(ctx, "raw"); err == nil {
		t.Errorf("ListChains(raw) succeeded")
	}
}

// TestFakeConcurrentUse exercises the mutex under -race.
func TestFakeConcurrentUse(t *testing.T) {
	f := NewFake(iptables.ProtocolIPv4)
	ctx := context.Background()
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 20 {
				chain := fmt.Sprintf("KUBE-%d-%d", i, j)
				if err := f.Restore(ctx, restoreText("*filter", ":"+chain+" - [0:0]", "-A "+chain+" -j ACCEPT", "COMMIT")); err != nil {
					t.Error(err)
					return
				}
				_ = f.Rules(iptables.TableFilter, iptables.Chain(chain))
				_, _ = f.SaveInto(ctx, iptables.TableFilter)
				_, _ = f.Trace(Packet{Source: mustAddr("10.0.0.1"), Destination: mustAddr("10.0.0.2"), Protocol: "tcp", SourcePort: 1, DestinationPort: 2}, TraceOptions{})
			}
		}()
	}
	wg.Wait()
	if n := len(f.Chains(iptables.TableFilter)); n != 3+4*20 {
		t.Errorf("%d chains, want %d", n, 3+4*20)
	}
}

var fuzzSeeds = []string{
	"*filter\n:KUBE-A - [0:0]\n-A INPUT -j KUBE-A\n-A KUBE-A -s 10.0.0.0/8 -m comment --comment \"a b\" -j ACCEPT\nCOMMIT\n",
	"*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-X - [0:0]\n:KUBE-SEP-Y - [0:0]\n-A PREROUTING -j KUBE-SERVICES\n" +
		"-A KUBE-SERVICES -d 172.30.0.1/32 -p tcp -m tcp --dport 443 -j KUBE-SVC-X\n" +
		"-A KUBE-SVC-X -m recent --name KUBE-SEP-Y --rcheck --seconds 10800 --reap -j KUBE-SEP-Y\n" +
		"-A KUBE-SVC-X -m statistic --mode random --probability 0.5 -j KUBE-SEP-Y\n" +
		"-A KUBE-SEP-Y -p tcp -m recent --name KUBE-SEP-Y --set -m tcp -j DNAT --to-destination 10.0.0.5:6443\n" +
		"-A POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n-A POSTROUTING -j MASQUERADE --random-fully\nCOMMIT\n",
	"*filter\n:A - [0:0]\n:B - [0:0]\n-A A -g B\n-X B\nCOMMIT\n",
	"*mangle\n:PREROUTING DROP [1:2]\n-I PREROUTING 1 -m addrtype ! --dst-type LOCAL -j MARK --set-xmark 0x1/0x1\nCOMMIT\n*filter\n-F\n-X\nCOMMIT\n",
	"*filter\n-A INPUT -d 0.0.0.5/0.0.0.255 -m comment --comment \"\\\"x\\\\\" -j REJECT\n-D INPUT 1\nCOMMIT\n",
	"*nat\n-A OUTPUT -d ::5/::ff -j ACCEPT\nCOMMIT\n",
}

// FuzzRestore asserts Restore never panics and that whatever state it leaves
// (sections committed before an error stay) round-trips through SaveInto.
func FuzzRestore(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, protocol := range []iptables.Protocol{iptables.ProtocolIPv4, iptables.ProtocolIPv6} {
			fk := NewFake(protocol)
			_ = fk.Restore(context.Background(), data)
			saved := saveAll(t, fk)
			again := NewFake(protocol)
			if err := again.Restore(context.Background(), saved); err != nil {
				t.Fatalf("%s: restoring SaveInto output failed: %v\ninput:\n%q\nsaved:\n%s", protocol, err, data, saved)
			}
			if resaved := saveAll(t, again); !bytes.Equal(saved, resaved) {
				t.Fatalf("%s: round trip differs:\n%s\n---\n%s", protocol, saved, resaved)
			}
			// Tracing whatever was loaded must not panic (errors are fine).
			src, dst := mustAddr("10.0.0.5"), mustAddr("10.96.0.5")
			if protocol == iptables.ProtocolIPv6 {
				src, dst = mustAddr("fd00::5"), mustAddr("fd00:96::5")
			}
			for _, origin := range []Origin{OriginExternal, OriginLocal} {
				_, _ = fk.Trace(Packet{Source: src, Destination: dst, Protocol: "tcp", SourcePort: 1000, DestinationPort: 80, Origin: origin},
					TraceOptions{LocalAddrs: []netip.Addr{dst}, IPSets: map[string][]string{"S": {"10.96.0.5", "fd00:96::5"}}})
			}
		}
	})
}
