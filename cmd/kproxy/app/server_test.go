package app

import (
	"bytes"
	"os"
	"strings"
	"testing"
)

// runMain runs Main and returns its exit code and output.
func runMain(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = Main(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestMainVersion(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
	}{
		{name: "version alone", args: []string{"--version"}},
		// Like kube-proxy, --version prints and exits before anything else
		// is looked at.
		{name: "version with other flags", args: []string{"--version", "--proxy-mode=ipvs"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runMain(tc.args...)
			if code != 0 {
				t.Fatalf("exit code %d, stderr %q", code, stderr)
			}
			if want := "kproxy " + Version + "\n"; stdout != want {
				t.Errorf("stdout = %q, want %q", stdout, want)
			}
			if stderr != "" {
				t.Errorf("stderr = %q, want nothing", stderr)
			}
		})
	}
}

// TestMainRejectsBadFlags checks that bad command lines fail before kproxy
// touches the API server or the kernel: the errors are the flag errors, and
// none of these cases needs root, an API server or iptables.
func TestMainRejectsBadFlags(t *testing.T) {
	for _, tc := range []struct {
		name     string
		args     []string
		wantErrs []string
	}{
		{
			name:     "masquerade bit out of range",
			args:     []string{"--iptables-masquerade-bit=40"},
			wantErrs: []string{"invalid flags", "--iptables-masquerade-bit=40 must be within [0, 31]"},
		},
		{
			name:     "bad value with cleanup",
			args:     []string{"--cleanup", "--iptables-masquerade-bit=40"},
			wantErrs: []string{"invalid flags", "--iptables-masquerade-bit=40"},
		},
		{
			name:     "ipvs mode with a bad scheduler",
			args:     []string{"--proxy-mode=ipvs", "--ipvs-scheduler=best", "--kubeconfig=/nonexistent"},
			wantErrs: []string{"invalid flags", `--ipvs-scheduler="best" is not an IPVS scheduler`},
		},
		{
			name:     "zero sync period",
			args:     []string{"--iptables-sync-period=0s"},
			wantErrs: []string{"--iptables-sync-period=0s must be greater than 0"},
		},
		{
			name:     "bad healthz bind address",
			args:     []string{"--healthz-bind-address=localhost"},
			wantErrs: []string{"invalid flags", `--healthz-bind-address="localhost" must be an IP address with a port`},
		},
		{
			name:     "two IPv4 cluster CIDRs",
			args:     []string{"--cluster-cidr=10.0.0.0/8,10.1.0.0/16"},
			wantErrs: []string{"--cluster-cidr: more than one IPv4 CIDR"},
		},
		{
			name:     "unparsable duration",
			args:     []string{"--iptables-sync-period=often"},
			wantErrs: []string{`invalid argument "often" for "--iptables-sync-period"`},
		},
		{
			name:     "unparsable integer",
			args:     []string{"--iptables-masquerade-bit=high"},
			wantErrs: []string{`invalid argument "high" for "--iptables-masquerade-bit"`},
		},
		{
			name:     "unknown flag",
			args:     []string{"--bogus-flag"},
			wantErrs: []string{"unknown flag: --bogus-flag"},
		},
		{
			name:     "positional argument",
			args:     []string{"extra"},
			wantErrs: []string{`unknown command "extra"`},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, stdout, stderr := runMain(tc.args...)
			if code == 0 {
				t.Fatalf("exit code 0 for %v; stdout %q, stderr %q", tc.args, stdout, stderr)
			}
			if !strings.HasPrefix(stderr, "kproxy: ") {
				t.Errorf("stderr = %q, want it to start with \"kproxy: \"", stderr)
			}
			for _, want := range tc.wantErrs {
				if !strings.Contains(stderr, want) {
					t.Errorf("stderr = %q, want it to contain %q", stderr, want)
				}
			}
			// Nothing past flag handling ran: no API client, no iptables.
			for _, bad := range []string{"API client", "iptables (IPv4)", "cleanup:"} {
				if strings.Contains(stderr, bad) {
					t.Errorf("stderr = %q: kproxy went past flag checks (%q)", stderr, bad)
				}
			}
			if stdout != "" {
				t.Errorf("stdout = %q, want nothing", stdout)
			}
		})
	}
}

func TestMainHelp(t *testing.T) {
	code, stdout, stderr := runMain("--help")
	if code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr)
	}
	for _, flag := range []string{
		"--kubeconfig", "--master", "--hostname-override", "--proxy-mode", "--cleanup", "--cluster-cidr",
		"--masquerade-all", "--iptables-masquerade-bit", "--iptables-sync-period", "--iptables-min-sync-period",
		"--nodeport-addresses", "--config-sync-period", "--service-proxy-name", "--version",
		"--healthz-bind-address", "--metrics-bind-address",
		"--ipvs-scheduler", "--ipvs-strict-arp", "--ipvs-tcp-timeout", "--ipvs-tcpfin-timeout", "--ipvs-udp-timeout",
		"--ipvs-exclude-cidrs", "--ipvs-sync-period", "--ipvs-min-sync-period",
		"-v, --v", "--vmodule",
	} {
		if !strings.Contains(stdout, flag+" ") {
			t.Errorf("--help does not list %s:\n%s", flag, stdout)
		}
	}
}

func TestNodeName(t *testing.T) {
	host, err := os.Hostname()
	if err != nil {
		t.Skipf("no hostname: %v", err)
	}
	for _, tc := range []struct {
		name     string
		override string
		want     string
		wantErr  bool
	}{
		{name: "override is used as is", override: "node-a", want: "node-a"},
		{name: "override is lowercased", override: "Node-A.Example.COM", want: "node-a.example.com"},
		{name: "override is trimmed", override: "  node-b\t\n", want: "node-b"},
		{name: "no override uses the hostname", override: "", want: strings.ToLower(strings.TrimSpace(host))},
		{name: "blank override is an error", override: "   ", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := NewOptions()
			o.HostnameOverride = tc.override
			got, err := nodeName(o)
			if tc.wantErr {
				if err == nil {
					t.Fatalf("nodeName() = %q, want an error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("nodeName() = %q, want %q", got, tc.want)
			}
		})
	}
}

// TestMainIPVSUnavailable checks that --proxy-mode=ipvs on a kernel without
// IPVS fails before touching the API server, names what is missing and does
// not fall back to iptables mode.
func TestMainIPVSUnavailable(t *testing.T) {
	if ipvsLoaded() || os.Getenv("KPROXY_IN_VM") == "1" {
		t.Skip("this kernel has IPVS")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (kproxy tries to load ip_vs)")
	}
	code, stdout, stderr := runMain("--proxy-mode=ipvs", "--kubeconfig=/nonexistent", "--hostname-override=node-a",
		"--healthz-bind-address=", "--metrics-bind-address=")
	if code == 0 {
		t.Fatalf("exit code 0; stderr %q", stderr)
	}
	for _, want := range []string{"--proxy-mode=ipvs", "IPVS", "ip_vs"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("stderr = %q, want it to name %q", stderr, want)
		}
	}
	for _, bad := range []string{"API client", "Starting kproxy"} {
		if strings.Contains(stderr+stdout, bad) {
			t.Errorf("kproxy went on without IPVS (%q in the output)", bad)
		}
	}
}
