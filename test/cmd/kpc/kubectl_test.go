package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestSplitKubectlArgs(t *testing.T) {
	tests := []struct {
		name      string
		args      []string
		wantState string
		wantRest  []string
		wantErr   bool
	}{
		{name: "kubectl's arguments only", args: []string{"get", "pods", "-A"}, wantState: "/run/kpc", wantRest: []string{"get", "pods", "-A"}},
		{name: "state with a space", args: []string{"--state", "/s", "-n", "demo", "get", "svc"}, wantState: "/s", wantRest: []string{"-n", "demo", "get", "svc"}},
		{name: "state with an equals sign", args: []string{"--state=/s", "get", "svc"}, wantState: "/s", wantRest: []string{"get", "svc"}},
		{name: "a later state is kubectl's", args: []string{"get", "--state", "/s"}, wantState: "/run/kpc", wantRest: []string{"get", "--state", "/s"}},
		{name: "kubectl's help", args: []string{"--help"}, wantState: "/run/kpc", wantRest: []string{"--help"}},
		{name: "no arguments", wantState: "/run/kpc"},
		{name: "state without a value", args: []string{"--state"}, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			state, rest, err := splitKubectlArgs("/run/kpc", tc.args)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %t", err, tc.wantErr)
			}
			if state != tc.wantState || !slices.Equal(rest, tc.wantRest) {
				t.Errorf("= %q, %q; want %q, %q", state, rest, tc.wantState, tc.wantRest)
			}
		})
	}
}

func TestKubectlArgv(t *testing.T) {
	got := kubectlArgv("/bin/kubectl", "/run/kpc/kubeconfig", []string{"-n", "demo", "get", "svc"})
	want := []string{"/bin/kubectl", "--kubeconfig=/run/kpc/kubeconfig", "-n", "demo", "get", "svc"}
	if !slices.Equal(got, want) {
		t.Errorf("= %q, want %q", got, want)
	}
}

func TestExecEnv(t *testing.T) {
	tests := []struct {
		name    string
		environ []string
		dir     string
		want    []string
	}{
		{name: "bin dir first", environ: []string{"HOME=/root", "PATH=/usr/bin:/bin"}, dir: "/b", want: []string{"HOME=/root", "PATH=/b:/usr/bin:/bin"}},
		{name: "no PATH", environ: []string{"HOME=/root"}, dir: "/b", want: []string{"HOME=/root", "PATH=/b:" + defaultPath}},
		{name: "empty PATH", environ: []string{"PATH="}, dir: "/b", want: []string{"PATH=/b"}},
		{name: "no bin dir", environ: []string{"PATH=/usr/bin"}, want: []string{"PATH=/usr/bin"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := execEnv(tc.environ, tc.dir); !slices.Equal(got, tc.want) {
				t.Errorf("= %q, want %q", got, tc.want)
			}
		})
	}
}

func TestFindProgram(t *testing.T) {
	first, second, empty := t.TempDir(), t.TempDir(), t.TempDir()
	for _, f := range []struct {
		path string
		mode os.FileMode
	}{
		{filepath.Join(first, "kubectl"), 0o644}, // not executable
		{filepath.Join(second, "kubectl"), 0o755},
	} {
		if err := os.WriteFile(f.path, []byte("#!/bin/sh\n"), f.mode); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name    string
		dirs    []string
		want    string
		wantErr string
	}{
		{name: "first executable", dirs: []string{"", first, second}, want: filepath.Join(second, "kubectl")},
		{name: "missing", dirs: []string{empty, first}, wantErr: "run hack/build-control-plane.sh"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := findProgram("kubectl", tc.dirs...)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Errorf("= %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}
