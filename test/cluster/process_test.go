package cluster

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"syscall"
	"testing"
	"time"
)

func TestPidsRoundTrip(t *testing.T) {
	tests := []struct {
		name  string
		procs []process
	}{
		{name: "empty"},
		{name: "control plane and nodes", procs: []process{
			{Name: "etcd", PID: 100, StartTime: 12345},
			{Name: "kproxy/node-1", PID: 4242, StartTime: 99},
			{Name: "agent/node-12", PID: 7, StartTime: 0},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parsePids(formatPids(tc.procs))
			if err != nil {
				t.Fatalf("parsePids: %v", err)
			}
			if !slices.Equal(got, tc.procs) {
				t.Errorf("round trip = %+v, want %+v", got, tc.procs)
			}
		})
	}
}

func TestParsePidsErrors(t *testing.T) {
	tests := []struct{ name, data string }{
		{name: "missing start time", data: "etcd 100\n"},
		{name: "pid not a number", data: "etcd x 1\n"},
		{name: "init's pid", data: "etcd 1 1\n"},
		{name: "bad start time", data: "etcd 100 -1\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got, err := parsePids([]byte(tc.data)); err == nil {
				t.Errorf("parsePids(%q) = %+v, want an error", tc.data, got)
			}
		})
	}
}

func TestParseProcStat(t *testing.T) {
	// Field 22 is the start time; the name may hold spaces and ')'.
	tail := " 1 1 0 -1 4194560 100 0 0 0 10 5 0 0 20 0 1 0 0 777 1000 10 18446744073709551615"
	tests := []struct {
		name      string
		data      string
		wantState byte
		wantStart uint64
		wantErr   bool
	}{
		{name: "plain", data: "42 (etcd) S" + tail, wantState: 'S', wantStart: 777},
		{name: "name with spaces and parens", data: "42 (a b) (c)) R" + tail, wantState: 'R', wantStart: 777},
		{name: "zombie", data: "42 (kproxy) Z" + tail, wantState: 'Z', wantStart: 777},
		{name: "truncated", data: "42 (etcd) S 1 1", wantErr: true},
		{name: "no name", data: "42 etcd S", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			state, start, err := parseProcStat([]byte(tc.data))
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %t", err, tc.wantErr)
			}
			if !tc.wantErr && (state != tc.wantState || start != tc.wantStart) {
				t.Errorf("= %c, %d; want %c, %d", state, start, tc.wantState, tc.wantStart)
			}
		})
	}
}

func TestParseNSLink(t *testing.T) {
	tests := []struct {
		name   string
		link   string
		want   uint64
		wantOK bool
	}{
		{name: "net", link: "net:[4026531840]", want: 4026531840, wantOK: true},
		{name: "other kind", link: "mnt:[4026531841]"},
		{name: "malformed", link: "net:[x]"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseNSLink(tc.link)
			if ok != tc.wantOK || got != tc.want {
				t.Errorf("parseNSLink(%q) = %d, %t; want %d, %t", tc.link, got, ok, tc.want, tc.wantOK)
			}
		})
	}
}

func TestLaunchCommand(t *testing.T) {
	tests := []struct {
		name string
		l    launch
		want []string
	}{
		{
			name: "namespace with its own /sys",
			l:    launch{NetNS: "kpc-node-1", Argv: []string{"/bin/kproxy", "-v=2"}},
			want: []string{"ip", "netns", "exec", "kpc-node-1", "/bin/kproxy", "-v=2"},
		},
		{
			name: "network only, host mounts",
			l:    launch{NetNS: "kpc-node-1", NetOnly: true, Argv: []string{"/bin/kpc", "agent"}},
			want: []string{"nsenter", "--net=/run/netns/kpc-node-1", "--", "/bin/kpc", "agent"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.l.command(); !slices.Equal(got, tc.want) {
				t.Errorf("command() = %q, want %q", got, tc.want)
			}
		})
	}
}

// startGroup starts a shell leading its own process group with a child
// that ignores SIGTERM when ignoreTerm is set.
func startGroup(t *testing.T, ignoreTerm bool) (process, *exec.Cmd) {
	t.Helper()
	script := "sleep 300 & wait"
	if ignoreTerm {
		script = "trap '' TERM; sleep 300 & wait; wait"
	}
	cmd := exec.Command("sh", "-c", script)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting sh: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
	})
	_, st, err := procStat(cmd.Process.Pid)
	if err != nil {
		t.Fatalf("stat: %v", err)
	}
	return process{Name: "sh", PID: cmd.Process.Pid, StartTime: st}, cmd
}

func TestStop(t *testing.T) {
	tests := []struct {
		name       string
		ignoreTerm bool
	}{
		{name: "exits on SIGTERM"},
		{name: "killed after the grace period", ignoreTerm: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := startGroup(t, tc.ignoreTerm)
			if !p.alive() {
				t.Fatalf("started process is not alive")
			}
			if err := stop(context.Background(), []process{p}, 200*time.Millisecond); err != nil {
				t.Fatalf("stop: %v", err)
			}
			if p.alive() {
				t.Errorf("process %d still alive after stop", p.PID)
			}
		})
	}
}

func TestAliveChecksStartTime(t *testing.T) {
	self := os.Getpid()
	_, st, err := procStat(self)
	if err != nil {
		t.Fatalf("stat self: %v", err)
	}
	tests := []struct {
		name string
		p    process
		want bool
	}{
		{name: "same start time", p: process{PID: self, StartTime: st}, want: true},
		{name: "unknown start time", p: process{PID: self}, want: true},
		{name: "pid reused by another program", p: process{PID: self, StartTime: st + 1}},
		{name: "no such pid", p: process{PID: 1 << 30}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.p.alive(); got != tc.want {
				t.Errorf("alive() = %t, want %t", got, tc.want)
			}
		})
	}
}

func TestStopSkipsReusedPid(t *testing.T) {
	p, _ := startGroup(t, false)
	// A record of this pid from an older boot-relative start time is a
	// different process: stop must leave it running.
	stale := p
	stale.StartTime++
	if err := stop(context.Background(), []process{stale}, 100*time.Millisecond); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if !p.alive() {
		t.Errorf("stop killed a process whose pid only matched a stale record")
	}
}
