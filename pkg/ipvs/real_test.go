package ipvs

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	mobyipvs "github.com/moby/ipvs"
	"golang.org/x/sys/unix"

	"github.com/kproxy/kproxy/pkg/netnstest"
)

// requireVM skips unless the test runs inside the IPVS VM
// (hack/ipvs-vm.sh sets KPROXY_IN_VM=1): this machine's kernel has no IPVS.
func requireVM(t *testing.T) {
	t.Helper()
	if os.Getenv("KPROXY_IN_VM") != "1" {
		t.Skip("needs IPVS: run with go test -exec hack/ipvs-vm.sh (sets KPROXY_IN_VM=1)")
	}
	netnstest.RequireRoot(t)
}

// newReal opens a Real on a fresh namespace's IPVS table.
func newReal(t *testing.T) (*Real, *netnstest.NS) {
	t.Helper()
	ns := netnstest.New(t, "ipvs")
	r, err := New(Options{NetNS: ns.Name})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r, ns
}

func TestRealInterface(t *testing.T) {
	requireVM(t)
	for _, c := range interfaceCases() {
		t.Run(c.name, func(t *testing.T) {
			r, _ := newReal(t)
			runCase(t, t.Context(), r, c)
		})
	}
}

func TestRealTimeouts(t *testing.T) {
	requireVM(t)
	for _, c := range timeoutsCases() {
		t.Run(c.name, func(t *testing.T) {
			r, _ := newReal(t)
			runTimeoutsCase(t, t.Context(), r, c)
		})
	}
}

// Each namespace has its own table, and ipvsadm sees what Real wrote.
func TestRealNamespaces(t *testing.T) {
	requireVM(t)
	ctx := t.Context()
	a, nsA := newReal(t)
	b, _ := newReal(t)
	if err := a.AddService(ctx, tcp4()); err != nil {
		t.Fatal(err)
	}
	if err := a.AddDestination(ctx, tcp4(), &Destination{Address: ep4a, Port: 8080, Weight: 1}); err != nil {
		t.Fatal(err)
	}
	if got := dumpTable(t, ctx, b); len(got) != 0 {
		t.Errorf("other namespace sees %q, want an empty table", got)
	}
	if got := dumpTable(t, ctx, a); len(got) != 2 {
		t.Errorf("own namespace sees %q, want the service and its destination", got)
	}
	// /proc/net/ip_vs inside the namespace lists the service (hex address
	// 0A60000A:0050 is 10.96.0.10:80).
	out := nsA.Run(t, "cat", "/proc/net/ip_vs")
	if !strings.Contains(out, "0A60000A:0050") || !strings.Contains(out, "0A010001:1F90") {
		t.Errorf("/proc/net/ip_vs in %s lacks the service or destination:\n%s", nsA.Name, out)
	}
}

// Services made by someone else are listed like kproxy's own, except the
// firewall-mark services this package does not model.
func TestRealForeignServices(t *testing.T) {
	requireVM(t)
	r, ns := newReal(t)
	other, err := mobyipvs.New(filepath.Join(netnsDir, ns.Name))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	for _, s := range []*mobyipvs.Service{
		{AddressFamily: unix.AF_INET, Protocol: unix.IPPROTO_TCP, Address: net.ParseIP("10.0.0.1").To4(), Port: 80, SchedName: "wlc", Netmask: 0xffffffff},
		{AddressFamily: unix.AF_INET, FWMark: 7, SchedName: "rr", Netmask: 0xffffffff},
	} {
		if err := other.NewService(s); err != nil {
			t.Fatalf("adding %+v: %v", s, err)
		}
	}
	got := dumpTable(t, t.Context(), r)
	if want := []string{"TCP 10.0.0.1:80 wlc"}; !slices.Equal(got, want) {
		t.Errorf("table %q, want %q", got, want)
	}
}

func TestRealCheckScheduler(t *testing.T) {
	requireVM(t)
	for _, c := range []struct {
		name    string
		wantErr error
	}{
		{"rr", nil},
		{"wrr", nil},
		{"sh", nil},
		{"nosuch", ErrSchedulerUnavailable},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := CheckScheduler(c.name)
			if !errors.Is(err, c.wantErr) {
				t.Fatalf("CheckScheduler(%q) = %v, want %v", c.name, err, c.wantErr)
			}
			if err != nil && !strings.Contains(err.Error(), "ip_vs_"+c.name) {
				t.Errorf("error %q does not name the module ip_vs_%s", err, c.name)
			}
		})
	}
}

// On a kernel without IPVS (this machine's own) New and CheckScheduler fail
// with ErrUnavailable and a message naming the ip_vs module.
func TestWithoutIPVS(t *testing.T) {
	if ipvsPresent() {
		t.Skip("this kernel has IPVS")
	}
	for _, c := range []struct {
		name string
		call func() error
	}{
		{"New", func() error {
			r, err := New(Options{})
			if err == nil {
				r.Close()
			}
			return err
		}},
		{"CheckScheduler", func() error { return CheckScheduler("rr") }},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.call()
			if !errors.Is(err, ErrUnavailable) {
				t.Fatalf("error %v, want ErrUnavailable", err)
			}
			if !strings.Contains(err.Error(), "kernel module ip_vs not loaded") {
				t.Errorf("error %q does not say the ip_vs module is missing", err)
			}
			t.Logf("error: %v", err)
		})
	}
}

func TestCheckSchedulerRejectsBadNames(t *testing.T) {
	for _, name := range []string{"", "RR", "rr;x", "../x", "averyveryverylongname"} {
		t.Run(name, func(t *testing.T) {
			err := CheckScheduler(name)
			if err == nil || errors.Is(err, ErrUnavailable) {
				t.Errorf("CheckScheduler(%q) = %v, want a name error before any kernel check", name, err)
			}
		})
	}
}
