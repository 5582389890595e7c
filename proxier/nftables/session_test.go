package nftables

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/knftables"
)

func TestSessionLine(t *testing.T) {
	cases := []struct {
		name, text string
		merge      bool
		want       string
	}{
		{name: "empty", text: "", want: ""},
		{name: "one command", text: "add table ip kproxy\n", want: "add table ip kproxy"},
		{name: "commands joined", text: "add table ip kproxy\nflush chain ip kproxy c\n", want: "add table ip kproxy; flush chain ip kproxy c"},
		{
			name:  "elements merged",
			text:  "add element ip kproxy s { 10.0.0.1 }\nadd element ip kproxy s { 10.0.0.2 }\ndelete element ip kproxy s { 10.0.0.3 }\n",
			merge: true,
			want:  "add element ip kproxy s { 10.0.0.1, 10.0.0.2 }; delete element ip kproxy s { 10.0.0.3 }",
		},
		{
			name: "elements unmerged",
			text: "add element ip kproxy s { 10.0.0.1 }\nadd element ip kproxy s { 10.0.0.2 }\n",
			want: "add element ip kproxy s { 10.0.0.1 }; add element ip kproxy s { 10.0.0.2 }",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := sessionLine(tc.text, tc.merge); got != tc.want {
				t.Errorf("sessionLine = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestSessionRefused(t *testing.T) {
	cases := []struct {
		name, out string
		want      bool
	}{
		{name: "nothing", out: "", want: false},
		{name: "a warning", out: "Warning: something\n", want: false},
		{name: "an error", out: "Error: Could not process rule: No such file or directory\ndelete element ip kproxy s { 10.0.0.9 }\n                        ^\n", want: true},
		{name: "an error with a position", out: "/dev/stdin:1:2-3: Error: syntax error\n", want: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := sessionRefused(tc.out); got != tc.want {
				t.Errorf("sessionRefused(%q) = %v, want %v", tc.out, got, tc.want)
			}
		})
	}
}

// TestRealSession runs transactions through the nft session in a
// namespace, in order: each step's kernel state is the next one's start.
func TestRealSession(t *testing.T) {
	ns := requireNFT(t)
	n, err := newNSNFT(t, ns, v1.IPv4Protocol)
	if err != nil {
		t.Fatal(err)
	}
	e, ok := n.real.(*execNFT)
	if !ok || e.noSession {
		t.Fatalf("the real interface is %T, not an execNFT with a session", n.real)
	}
	e.sessionRuns = 4
	ctx := context.Background()
	elements := func() string {
		t.Helper()
		return ns.Run(t, "nft", "list", "set", "ip", TableName, "s")
	}
	add := func(tx *knftables.Transaction, verb string, addrs ...string) {
		for _, a := range addrs {
			el := &knftables.Element{Set: "s", Key: []string{a}}
			if verb == "delete" {
				tx.Delete(el)
			} else {
				tx.Add(el)
			}
		}
	}
	alive := func(pid int) bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return false
		}
		i := strings.LastIndexByte(string(b), ')')
		return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
	}
	var pid int
	steps := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"a first transaction starts the session", func(t *testing.T) {
			tx := n.NewTransaction()
			tx.Add(&knftables.Table{})
			tx.Add(&knftables.Set{Name: "s", Type: "ipv4_addr"})
			add(tx, "add", "10.0.0.1", "10.0.0.2")
			if err := n.Run(ctx, tx); err != nil {
				t.Fatal(err)
			}
			if pid = e.sessionPID(); pid == 0 {
				t.Fatal("no session runs")
			}
			if got := elements(); !strings.Contains(got, "10.0.0.1, 10.0.0.2") {
				t.Errorf("set after the transaction:\n%s", got)
			}
		}},
		{"a refused transaction changes nothing and names its line", func(t *testing.T) {
			tx := n.NewTransaction()
			add(tx, "add", "10.0.0.3")
			add(tx, "delete", "10.0.0.99")
			err := n.Run(ctx, tx)
			if !knftables.IsNotFound(err) || !strings.Contains(err.Error(), "10.0.0.99") {
				t.Fatalf("err = %v, want not found, naming 10.0.0.99", err)
			}
			if got := elements(); strings.Contains(got, "10.0.0.3") {
				t.Errorf("a refused transaction added 10.0.0.3:\n%s", got)
			}
			if got := e.sessionPID(); got != 0 {
				t.Errorf("session pid %d, want none (a refusal ends it)", got)
			}
			if alive(pid) {
				t.Errorf("the refused session %d still runs", pid)
			}
		}},
		{"a large transaction runs through nft -f", func(t *testing.T) {
			tx := n.NewTransaction()
			for i := range 30000 {
				add(tx, "add", fmt.Sprintf("10.1.%d.%d", i>>8, i&255))
			}
			if err := n.Run(ctx, tx); err != nil {
				t.Fatal(err)
			}
			if e.sessionPID() != 0 {
				t.Errorf("a session ran it")
			}
			if got := elements(); !strings.Contains(got, "10.1.117.47") {
				t.Errorf("set misses 10.1.117.47")
			}
		}},
		{"a session ends after its runs", func(t *testing.T) {
			tx := n.NewTransaction()
			add(tx, "add", "10.0.0.4")
			if err := n.Run(ctx, tx); err != nil {
				t.Fatal(err)
			}
			pid = e.sessionPID()
			for i := range 4 {
				tx := n.NewTransaction()
				add(tx, "add", fmt.Sprintf("10.0.1.%d", i))
				if err := n.Run(ctx, tx); err != nil {
					t.Fatal(err)
				}
			}
			got := e.sessionPID()
			if got == pid || got == 0 {
				t.Fatalf("session pid %d after 5 runs, want a new one (was %d)", got, pid)
			}
			if alive(pid) {
				t.Errorf("the old session %d still runs", pid)
			}
			pid = got
		}},
		{"a killed session is replaced and nothing is lost", func(t *testing.T) {
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			for end := time.Now().Add(5 * time.Second); alive(pid) && time.Now().Before(end); {
				time.Sleep(10 * time.Millisecond)
			}
			tx := n.NewTransaction()
			add(tx, "add", "10.0.2.1")
			if err := n.Run(ctx, tx); err != nil {
				t.Fatal(err)
			}
			if got := elements(); !strings.Contains(got, "10.0.2.1") {
				t.Errorf("set misses 10.0.2.1")
			}
			tx = n.NewTransaction()
			add(tx, "add", "10.0.2.2")
			if err := n.Run(ctx, tx); err != nil {
				t.Fatal(err)
			}
			if got := e.sessionPID(); got == 0 || got == pid {
				t.Errorf("session pid %d, want a new one", got)
			}
			pid = e.sessionPID()
		}},
		{"Close ends the session", func(t *testing.T) {
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			if alive(pid) || e.sessionPID() != 0 {
				t.Errorf("session %d still runs after Close", pid)
			}
		}},
	}
	for _, st := range steps {
		if !t.Run(st.name, st.run) {
			break
		}
	}
}

// TestRealSessionUnsupported: an nft whose interactive mode does not work
// fails the session's handshake having run nothing; the transaction, and
// every later one, runs through nft -f.
func TestRealSessionUnsupported(t *testing.T) {
	ns := requireNFT(t)
	n, err := newNSNFT(t, ns, v1.IPv4Protocol)
	if err != nil {
		t.Fatal(err)
	}
	e := n.real.(*execNFT)
	script := filepath.Join(t.TempDir(), "nft")
	body := "#!/bin/sh\nif [ \"$1\" = -i ]; then echo 'nft: interactive CLI not supported in this build' >&2; exit 1; fi\nexec " + e.path + " \"$@\"\n"
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	e.path = script
	ctx := context.Background()
	for i, addr := range []string{"10.0.0.1", "10.0.0.2"} {
		tx := n.NewTransaction()
		if i == 0 {
			tx.Add(&knftables.Table{})
			tx.Add(&knftables.Set{Name: "s", Type: "ipv4_addr"})
		}
		tx.Add(&knftables.Element{Set: "s", Key: []string{addr}})
		if err := n.Run(ctx, tx); err != nil {
			t.Fatalf("transaction %d: %v", i, err)
		}
	}
	if !e.noSession || e.sessionPID() != 0 {
		t.Errorf("noSession %v, session pid %d: want sessions off", e.noSession, e.sessionPID())
	}
	if got := ns.Run(t, "nft", "list", "set", "ip", TableName, "s"); !strings.Contains(got, "10.0.0.1, 10.0.0.2") {
		t.Errorf("set:\n%s", got)
	}
}
