package conntrack

import (
	"errors"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"
)

// kernelDefaults are a 6.x kernel's values on a small machine.
func kernelDefaults() map[string]int {
	return map[string]int{
		SysctlMax:                   65536,
		SysctlTCPTimeoutEstablished: 432000,
		SysctlTCPTimeoutCloseWait:   60,
		SysctlTCPBeLiberal:          0,
		SysctlUDPTimeout:            30,
		SysctlUDPTimeoutStream:      120,
	}
}

func with(m map[string]int, kv ...any) map[string]int {
	out := maps.Clone(m)
	for i := 0; i < len(kv); i += 2 {
		out[kv[i].(string)] = kv[i+1].(int)
	}
	return out
}

func TestConfigureSysctls(t *testing.T) {
	for _, tc := range []struct {
		name       string
		config     Config
		numCPU     int
		sysctls    map[string]int
		hashSize   int
		readOnly   bool
		wantSys    map[string]int
		wantHash   int
		wantErrSub string
	}{
		{
			name:   "defaults on 2 cores: the minimum wins, hash table raised to a quarter",
			config: DefaultConfig(), numCPU: 2,
			sysctls: kernelDefaults(), hashSize: 16384,
			wantSys:  with(kernelDefaults(), SysctlMax, 131072, SysctlTCPTimeoutEstablished, 86400, SysctlTCPTimeoutCloseWait, 3600),
			wantHash: 32768,
		},
		{
			name:   "defaults on 8 cores: per core wins",
			config: DefaultConfig(), numCPU: 8,
			sysctls: kernelDefaults(), hashSize: 16384,
			wantSys:  with(kernelDefaults(), SysctlMax, 262144, SysctlTCPTimeoutEstablished, 86400, SysctlTCPTimeoutCloseWait, 3600),
			wantHash: 65536,
		},
		{
			name:   "a larger current maximum is never lowered",
			config: DefaultConfig(), numCPU: 2,
			sysctls: with(kernelDefaults(), SysctlMax, 1<<20), hashSize: 16384,
			wantSys:  with(kernelDefaults(), SysctlMax, 1<<20, SysctlTCPTimeoutEstablished, 86400, SysctlTCPTimeoutCloseWait, 3600),
			wantHash: 16384,
		},
		{
			name:   "a large enough hash table is left alone",
			config: DefaultConfig(), numCPU: 2,
			sysctls: kernelDefaults(), hashSize: 65536,
			wantSys:  with(kernelDefaults(), SysctlMax, 131072, SysctlTCPTimeoutEstablished, 86400, SysctlTCPTimeoutCloseWait, 3600),
			wantHash: 65536,
		},
		{
			name:   "max per core 0 leaves the maximum alone, even with a minimum",
			config: Config{Min: 1 << 20}, numCPU: 2,
			sysctls: kernelDefaults(), hashSize: 16384,
			wantSys: kernelDefaults(), wantHash: 16384,
		},
		{
			name: "every parameter",
			config: Config{
				MaxPerCore: 100000, TCPEstablishedTimeout: 2 * time.Hour, TCPCloseWaitTimeout: 90 * time.Second,
				TCPBeLiberal: true, UDPTimeout: 10 * time.Second, UDPStreamTimeout: time.Minute,
			},
			numCPU:  2,
			sysctls: kernelDefaults(), hashSize: 16384,
			wantSys: map[string]int{
				SysctlMax: 200000, SysctlTCPTimeoutEstablished: 7200, SysctlTCPTimeoutCloseWait: 90,
				SysctlTCPBeLiberal: 1, SysctlUDPTimeout: 10, SysctlUDPTimeoutStream: 60,
			},
			wantHash: 50000,
		},
		{
			name:   "zero config changes nothing",
			config: Config{}, numCPU: 2,
			sysctls: kernelDefaults(), hashSize: 16384,
			wantSys: kernelDefaults(), wantHash: 16384,
		},
		{
			name:   "read-only /proc/sys: warnings, no error, nothing changed",
			config: DefaultConfig(), numCPU: 2,
			sysctls: kernelDefaults(), hashSize: 16384, readOnly: true,
			wantSys: kernelDefaults(), wantHash: 16384,
		},
		{
			name:   "nf_conntrack not loaded: warnings, no error",
			config: DefaultConfig(), numCPU: 2,
			sysctls: map[string]int{}, hashSize: 16384,
			wantSys: map[string]int{}, wantHash: 16384,
		},
		{
			name:   "negative value rejected",
			config: Config{MaxPerCore: -1}, numCPU: 2,
			sysctls: kernelDefaults(), hashSize: 16384,
			wantSys: kernelDefaults(), wantHash: 16384,
			wantErrSub: "--conntrack-max-per-core=-1 must not be negative",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			sys := NewFakeSysctl(tc.sysctls)
			sys.SetReadOnly(tc.readOnly)
			params := NewFakeSysctl(map[string]int{ModuleParamHashSize: tc.hashSize})
			err := ConfigureSysctls(ctx, SysctlOptions{Config: tc.config, Sysctl: sys, ModuleParams: params, NumCPU: tc.numCPU})
			switch {
			case tc.wantErrSub == "" && err != nil:
				t.Fatalf("ConfigureSysctls: %v", err)
			case tc.wantErrSub != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErrSub)):
				t.Fatalf("ConfigureSysctls error = %v, want one containing %q", err, tc.wantErrSub)
			}
			if got := sys.Values(); !maps.Equal(got, tc.wantSys) {
				t.Errorf("sysctls = %v\nwant      %v", got, tc.wantSys)
			}
			if got := params.Values()[ModuleParamHashSize]; got != tc.wantHash {
				t.Errorf("hashsize = %d, want %d", got, tc.wantHash)
			}
		})
	}
}

// failingSysctl fails every Set with err.
type failingSysctl struct {
	*FakeSysctl
	err error
}

func (f failingSysctl) Set(string, int) error { return f.err }

func TestConfigureSysctlsUnexpectedError(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	sys := failingSysctl{FakeSysctl: NewFakeSysctl(kernelDefaults()), err: syscall.EINVAL}
	err := ConfigureSysctls(ctx, SysctlOptions{Config: DefaultConfig(), Sysctl: sys, NumCPU: 2})
	if !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("ConfigureSysctls = %v, want EINVAL", err)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		config  Config
		wantErr []string
	}{
		{name: "defaults", config: DefaultConfig()},
		{name: "zero", config: Config{}},
		{
			name: "every value negative",
			config: Config{
				MaxPerCore: -1, Min: -2, TCPEstablishedTimeout: -time.Second, TCPCloseWaitTimeout: -time.Second,
				UDPTimeout: -time.Second, UDPStreamTimeout: -time.Second,
			},
			wantErr: []string{
				"--conntrack-max-per-core=-1", "--conntrack-min=-2", "--conntrack-tcp-timeout-established=-1s",
				"--conntrack-tcp-timeout-close-wait=-1s", "--conntrack-udp-timeout=-1s", "--conntrack-udp-timeout-stream=-1s",
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.config.Validate()
			if len(tc.wantErr) == 0 {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("Validate accepted the config")
			}
			for _, want := range tc.wantErr {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not mention %q", err, want)
				}
			}
		})
	}
}

// TestFileSysctl exercises the real implementation on a directory tree
// shaped like /proc/sys.
func TestFileSysctl(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "net", "netfilter")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "nf_conntrack_max"), []byte("65536\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	s := FileSysctl{Root: root}
	if v, err := s.Get(SysctlMax); err != nil || v != 65536 {
		t.Fatalf("Get = %d, %v; want 65536", v, err)
	}
	if err := s.Set(SysctlMax, 131072); err != nil {
		t.Fatalf("Set: %v", err)
	}
	if v, err := s.Get(SysctlMax); err != nil || v != 131072 {
		t.Fatalf("Get after Set = %d, %v; want 131072", v, err)
	}
	if err := s.Set(SysctlUDPTimeout, 1); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Set of a missing parameter = %v, want not-exist", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "nf_conntrack_udp_timeout")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Set created a missing parameter: %v", err)
	}
	for _, bad := range []string{"", "/etc/passwd", "../x"} {
		if _, err := s.Get(bad); err == nil {
			t.Errorf("Get(%q) succeeded", bad)
		}
	}
}
