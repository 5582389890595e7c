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
	mustRestore(t, f, "*filter", ":FORWARD DROP [0:0]", "COMMIT")
	if p := f.Policy(iptables.TableFilter, iptables.ChainForward); p != "DROP" {
		t.Errorf("FORWARD policy = %q after setting DROP", p)
	}
	if p := f.Policy(iptables.TableFilter, "KUBE-NONE"); p != "" {
		t.Errorf("policy of a missing chain = %q, want none", p)
	}
}

// TestFakeRestoreErrors checks what the fake's Restore errors say: a
// *RestoreError naming the input line the fake blames, with that line's
// text. What a failed Restore leaves behind is checked against the kernel by
// the Interface cases in package iptables; the kernel may blame another line
// (iptables-nft names the rule whose addition completes a bad jump graph,
// iptables-legacy the COMMIT).
func TestFakeRestoreErrors(t *testing.T) {
	setup := []string{
		"*filter",
		":KUBE-A - [0:0]",
		":KUBE-B - [0:0]",
		"-A INPUT -j KUBE-A",
		"-A KUBE-A -s 10.0.0.1 -j ACCEPT",
		"-A KUBE-B -j DROP",
		"COMMIT",
	}
	tests := []struct {
		name     string
		protocol iptables.Protocol
		input    []string
		wantErr  string
		// wantLine is the line number the error must name (0: not checked).
		wantLine int
		// committed is set when a section before the error was applied.
		committed bool
	}{
		{
			name:     "delete a referenced chain",
			input:    []string{"*filter", ":KUBE-A - [0:0]", "-X KUBE-A", "COMMIT"},
			wantErr:  "still referenced",
			wantLine: 3,
		},
		{
			name:     "delete a non-empty chain",
			input:    []string{"*filter", "-X KUBE-B", "COMMIT"},
			wantErr:  "not empty",
			wantLine: 2,
		},
		{
			name:     "delete a chain created and referenced in the same section",
			input:    []string{"*filter", ":KUBE-C - [0:0]", "-A KUBE-B -j KUBE-C", "-X KUBE-C", "COMMIT"},
			wantErr:  "still referenced",
			wantLine: 4,
		},
		{
			name:     "delete a jump to a chain deleted before",
			input:    []string{"*filter", ":KUBE-A - [0:0]", "-X KUBE-A", "-D INPUT -j KUBE-A", "COMMIT"},
			wantErr:  "chain KUBE-A does not exist",
			wantLine: 4,
		},
		{name: "delete a built-in chain", input: []string{"*filter", "-X INPUT", "COMMIT"}, wantErr: "built-in"},
		{name: "delete a missing chain", input: []string{"*filter", "-X KUBE-NOPE", "COMMIT"}, wantErr: "does not exist"},
		{
			name:     "jump to a missing chain",
			input:    []string{"*filter", "-A KUBE-B -j KUBE-NOPE", "COMMIT"},
			wantErr:  "chain KUBE-NOPE does not exist",
			wantLine: 2,
		},
		{
			name:     "goto a chain declared later",
			input:    []string{"*filter", "-A KUBE-B -g KUBE-C", ":KUBE-C - [0:0]", "COMMIT"},
			wantErr:  "chain KUBE-C does not exist",
			wantLine: 2,
		},
		{
			name:     "a bad line in the middle",
			input:    []string{"*filter", ":KUBE-NEW - [0:0]", "-A KUBE-A -j DROP", "-A KUBE-NEW -m bogus -j ACCEPT", "COMMIT"},
			wantErr:  "unsupported match",
			wantLine: 4,
		},
		{
			name:      "a failing later table",
			input:     []string{"*nat", ":KUBE-SERVICES - [0:0]", "COMMIT", "*filter", ":KUBE-A - [0:0]", "-A KUBE-A -j KUBE-NOPE", "COMMIT"},
			wantErr:   "KUBE-NOPE",
			wantLine:  6,
			committed: true,
		},
		{name: "insert beyond the end", input: []string{"*filter", "-I KUBE-B 3 -j ACCEPT", "COMMIT"}, wantErr: "too big"},
		{name: "delete a missing rule", input: []string{"*filter", "-D KUBE-B -j ACCEPT", "COMMIT"}, wantErr: "does a matching rule exist"},
		{name: "append to a missing chain", input: []string{"*filter", "-A KUBE-NOPE -j ACCEPT", "COMMIT"}, wantErr: "does not exist"},
		{name: "flush a missing chain", input: []string{"*filter", "-F KUBE-NOPE", "COMMIT"}, wantErr: "does not exist"},
		{name: "-N of an existing chain", input: []string{"*filter", "-N KUBE-A", "COMMIT"}, wantErr: "already exists"},
		{name: "-N of a target name", input: []string{"*filter", "-N MASQUERADE", "COMMIT"}, wantErr: "clashes with a target"},
		// The fake models the nat, filter and mangle tables only.
		{name: "a table the fake does not model", input: []string{"*raw", "COMMIT"}, wantErr: `unknown table "raw"`},
		{name: "missing COMMIT", input: []string{"*filter", "-A KUBE-B -j ACCEPT"}, wantErr: "no COMMIT"},
		{name: "a rule outside a table", input: []string{"-A INPUT -j ACCEPT"}, wantErr: "outside a table"},
		// iptables-legacy refuses a policy on a user chain, iptables-nft
		// ignores it; the fake refuses it.
		{name: "a policy on a user chain", input: []string{"*filter", ":KUBE-A ACCEPT [0:0]", "COMMIT"}, wantErr: "cannot set policy"},
		{name: "a chain name too long", input: []string{"*filter", ":KUBE-SVC-ABCDEFGHIJKLMNOPQRST - [0:0]", "COMMIT"}, wantErr: "too long"},
		{name: "a jump to a built-in chain", input: []string{"*filter", "-A KUBE-B -j INPUT", "COMMIT"}, wantErr: "built-in chain"},
		{
			name:     "DNAT outside the nat table",
			input:    []string{"*filter", "-A KUBE-B -p tcp -j DNAT --to-destination 1.2.3.4:80", "COMMIT"},
			wantErr:  "only valid in the nat table",
			wantLine: 2,
		},
		{name: "DROP in the nat table", input: []string{"*nat", "-A PREROUTING -j DROP", "COMMIT"}, wantErr: "not intended for filtering"},
		{
			name:     "DNAT reachable from POSTROUTING",
			input:    []string{"*nat", ":KUBE-X - [0:0]", "-A KUBE-X -p tcp -j DNAT --to-destination 1.2.3.4:80", "-A POSTROUTING -j KUBE-X", "COMMIT"},
			wantErr:  "reachable from POSTROUTING",
			wantLine: 3,
		},
		{
			name:     "MASQUERADE reachable from PREROUTING",
			input:    []string{"*nat", ":KUBE-X - [0:0]", "-A KUBE-X -j MASQUERADE", "-A PREROUTING -j KUBE-X", "COMMIT"},
			wantErr:  "only valid from POSTROUTING",
			wantLine: 3,
		},
		{
			name:    "REJECT reachable from PREROUTING",
			input:   []string{"*mangle", ":KUBE-X - [0:0]", "-A KUBE-X -j REJECT", "-A PREROUTING -j KUBE-X", "COMMIT"},
			wantErr: "only valid from INPUT,FORWARD,OUTPUT",
		},
		{
			name:     "a jump loop reachable from a built-in chain",
			input:    []string{"*filter", ":L1 - [0:0]", ":L2 - [0:0]", "-A L1 -j L2", "-A L2 -j L1", "-A FORWARD -j L1", "COMMIT"},
			wantErr:  "closes a loop",
			wantLine: 5,
		},
		{name: "-i in OUTPUT", input: []string{"*filter", "-A OUTPUT -i eth0 -j ACCEPT", "COMMIT"}, wantErr: "can't use -i with OUTPUT", wantLine: 2},
		{name: "-t inside restore input", input: []string{"*filter", "-t nat -A INPUT", "COMMIT"}, wantErr: "-t option"},
		{name: "IPv6 address in an IPv4 table", input: []string{"*filter", "-A KUBE-B -s fd00::1 -j ACCEPT", "COMMIT"}, wantErr: "not an IPv4 value"},
		{
			name:     "IPv4 address in an IPv6 table",
			protocol: iptables.ProtocolIPv6,
			input:    []string{"*nat", "-A OUTPUT -p tcp -j DNAT --to-destination 10.0.0.1:80", "COMMIT"},
			wantErr:  "not an IPv6 value",
		},
		{
			name:     "IPv4 reject type in an IPv6 table",
			protocol: iptables.ProtocolIPv6,
			input:    []string{"*filter", "-A INPUT -j REJECT --reject-with icmp-port-unreachable", "COMMIT"},
			wantErr:  "not an IPv6 value",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFake(iptables.ProtocolIPv4)
			if tc.protocol != "" {
				f = NewFake(tc.protocol)
			} else {
				mustRestore(t, f, setup...)
			}
			before := saveAll(t, f)
			err := f.Restore(context.Background(), restoreText(tc.input...))
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
			if re.Line < 1 || re.Line > len(tc.input)+1 || (re.Line <= len(tc.input) && re.Text != tc.input[re.Line-1]) {
				t.Errorf("error names line %d %q, which is not that line of the input", re.Line, re.Text)
			}
			if tc.wantLine != 0 && re.Line != tc.wantLine {
				t.Errorf("error names line %d, want %d (%v)", re.Line, tc.wantLine, err)
			}
			if !tc.committed {
				if after := saveAll(t, f); !bytes.Equal(after, before) {
					t.Errorf("a failed Restore changed the fake:\n%s\nwas:\n%s", after, before)
				}
			}
		})
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

// TestFakeRefusal: rules refused by SetRefusal fail their table as the
// kernel does, blamed on their own line or, with atCommit, on the table's
// COMMIT; tables committed before stay; EnsureRule is refused too.
func TestFakeRefusal(t *testing.T) {
	input := restoreText("*nat", ":A - [0:0]", "-A A -j RETURN", "COMMIT",
		"*filter", ":B - [0:0]", "-A B -s 10.0.0.9/32 -j RETURN", "-A B -j RETURN", "COMMIT")
	for _, tc := range []struct {
		name     string
		atCommit bool
		wantLine int
	}{
		{name: "the rule's line", wantLine: 7},
		{name: "the COMMIT line", atCommit: true, wantLine: 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := NewFake(iptables.ProtocolIPv4)
			f.SetRefusal(func(table iptables.Table, chain iptables.Chain, args []string) error {
				if table == iptables.TableFilter && slices.Contains(args, "10.0.0.9/32") {
					return errors.New("no")
				}
				return nil
			}, tc.atCommit)
			err := f.Restore(context.Background(), input)
			if line, ok := iptables.FailedLine(err); !ok || line != tc.wantLine || !iptables.Refused(err) {
				t.Fatalf("Restore: %v; line %d, %v; want %d", err, line, ok, tc.wantLine)
			}
			if f.Rules(iptables.TableNAT, "A") == nil || f.Rules(iptables.TableFilter, "B") != nil {
				t.Errorf("want nat committed and filter unchanged")
			}
			if _, err := f.EnsureRule(context.Background(), iptables.Append, iptables.TableFilter, iptables.ChainInput, "-s", "10.0.0.9/32", "-j", "DROP"); err == nil {
				t.Error("EnsureRule of a refused rule succeeded")
			}
			f.SetRefusal(nil, false)
			if err := f.Restore(context.Background(), input); err != nil {
				t.Errorf("Restore after the refusal was lifted: %v", err)
			}
		})
	}
}
