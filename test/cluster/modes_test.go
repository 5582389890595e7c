package cluster

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestValidateMode(t *testing.T) {
	tests := []struct {
		name    string
		mode    string
		wantErr bool
	}{
		{name: "iptables", mode: "iptables"},
		{name: "nftables", mode: "nftables"},
		{name: "ipvs", mode: "ipvs"},
		{name: "empty", mode: "", wantErr: true},
		{name: "upper case", mode: "IPTables", wantErr: true},
		{name: "kube-proxy's windows mode", mode: "kernelspace", wantErr: true},
		{name: "typo", mode: "nftable", wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidateMode(tc.mode)
			if (err != nil) != tc.wantErr {
				t.Fatalf("ValidateMode(%q) = %v, want error %t", tc.mode, err, tc.wantErr)
			}
			if err != nil && !strings.Contains(err.Error(), "iptables, nftables, ipvs") {
				t.Errorf("error %q does not list the modes", err)
			}
		})
	}
}

// fakeKproxy is a shell script standing in for kproxy's flag validation:
// it knows iptables, fails on ipvs with an unrelated error, rejects any
// other mode with kproxy's wording and writes --write-config-to.
const fakeKproxy = `#!/bin/sh
out=
mode=iptables
for a in "$@"; do
  case "$a" in
    --proxy-mode=*) mode="${a#--proxy-mode=}" ;;
    --write-config-to=*) out="${a#--write-config-to=}" ;;
  esac
done
case "$mode" in
  iptables) echo "mode: $mode" > "$out" ;;
  ipvs) echo "kproxy: cannot write the config: disk full" >&2; exit 1 ;;
  *) printf 'kproxy: invalid flags:\n--proxy-mode="%s" is not a proxy mode; use iptables or ipvs\n' "$mode" >&2; exit 1 ;;
esac
`

func TestProbeKproxyMode(t *testing.T) {
	dir := t.TempDir()
	kproxy := filepath.Join(dir, "kproxy")
	if err := os.WriteFile(kproxy, []byte(fakeKproxy), 0o755); err != nil {
		t.Fatal(err)
	}
	broken := filepath.Join(dir, "broken")
	if err := os.WriteFile(broken, []byte("#!/bin/sh\necho '--proxy-mode=\"x\" is not a proxy mode' >&2\nexit 1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name        string
		kproxy      string
		mode        string
		wantErr     bool
		wantUnknown bool
	}{
		{name: "known mode", kproxy: kproxy, mode: ModeIPTables},
		{name: "mode rejected by name", kproxy: kproxy, mode: ModeNFTables, wantErr: true, wantUnknown: true},
		{name: "other failure", kproxy: kproxy, mode: ModeIPVS, wantErr: true},
		// iptables fails too: the binary is broken, not old.
		{name: "every mode rejected", kproxy: broken, mode: ModeNFTables, wantErr: true},
		{name: "no binary", kproxy: filepath.Join(dir, "missing"), mode: ModeNFTables, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := probeKproxyMode(context.Background(), tc.kproxy, tc.mode)
			if (err != nil) != tc.wantErr {
				t.Fatalf("probeKproxyMode = %v, want error %t", err, tc.wantErr)
			}
			if got := errors.Is(err, ErrModeUnknownToKproxy); got != tc.wantUnknown {
				t.Errorf("error %v: ErrModeUnknownToKproxy %t, want %t", err, got, tc.wantUnknown)
			}
		})
	}
}

// TestProbeModeRealKproxy probes the real kproxy of $KPC_BIN_DIR: it
// knows iptables, and any other mode is either known or rejected by name
// (never some other failure), so that the e2e suite skips only modes the
// binary does not have.
func TestProbeModeRealKproxy(t *testing.T) {
	binDir := os.Getenv("KPC_BIN_DIR")
	kproxy := filepath.Join(binDir, progKproxy)
	if _, err := os.Stat(kproxy); binDir == "" || err != nil {
		t.Skip("needs KPC_BIN_DIR with the kproxy binary (hack/build-control-plane.sh)")
	}
	for _, mode := range KnownModes() {
		err := probeKproxyMode(context.Background(), kproxy, mode)
		switch {
		case err == nil:
			t.Logf("%s: known", mode)
		case mode != ModeIPTables && errors.Is(err, ErrModeUnknownToKproxy):
			t.Logf("%s: rejected by name: %v", mode, err)
		default:
			t.Errorf("%s: %v", mode, err)
		}
	}
}

func TestKproxyStartedAndSynced(t *testing.T) {
	const (
		start     = `I1201 10:00:00.000000    42 server.go:322] "Starting kproxy" version="dev" node="node-1" mode="nftables" families=1` + "\n"
		oldStart  = `I1201 09:00:00.000000    41 server.go:322] "Starting kproxy" version="dev" node="node-1" mode="iptables" families=1` + "\n"
		synced    = `I1201 10:00:01.000000    42 engine.go:347] "Synced" full=true servicePorts=3` + "\n"
		oldSynced = `I1201 09:00:01.000000    41 engine.go:347] "Synced" full=true servicePorts=3` + "\n"
	)
	old := oldStart + oldSynced
	tests := []struct {
		name       string
		log        string
		offset     int64
		wantSynced bool
		wantErr    bool
	}{
		{name: "nothing yet", log: old, offset: int64(len(old))},
		{name: "started, not synced", log: old + start, offset: int64(len(old))},
		{name: "started and synced", log: old + start + synced, offset: int64(len(old)), wantSynced: true},
		{name: "the previous run's sync does not count", log: old + start, offset: int64(len(oldStart))},
		{name: "another mode", log: old, offset: 0, wantErr: true},
		{name: "log replaced: read from the start", log: start + synced, offset: 1 << 20, wantSynced: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synced, err := kproxyStartedAndSynced([]byte(tc.log), tc.offset, ModeNFTables)
			if (err != nil) != tc.wantErr || synced != tc.wantSynced {
				t.Errorf("= %t, %v; want %t, error %t", synced, err, tc.wantSynced, tc.wantErr)
			}
		})
	}
}
