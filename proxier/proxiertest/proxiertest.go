// Package proxiertest holds the behaviour cases every kproxy backend must
// pass: Services, EndpointSlices and Nodes go through the real engine (change
// trackers, CategorizeEndpoints) into the backend under test, which runs
// against fake kernel interfaces; a packet tracer over the fakes then says
// where each flow ends up.
package proxiertest

import (
	"fmt"
	"net/netip"
	"sort"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"

	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
)

// Origin says where a traced packet comes from.
type Origin int

const (
	// FromNetwork: the packet arrives on one of the node's interfaces (from
	// a pod or from another host).
	FromNetwork Origin = iota
	// FromHost: a process on the node itself sends it.
	FromHost
)

// Verdict is what finally happens to a flow.
type Verdict string

const (
	// Delivered: DNATed to one of Result.Endpoints.
	Delivered Verdict = "delivered"
	// NotHandled: accepted but not a service destination (no DNAT).
	NotHandled Verdict = "not-handled"
	Rejected   Verdict = "rejected"
	Dropped    Verdict = "dropped"
)

// Flow is one packet to trace and what must happen to it.
type Flow struct {
	Name     string
	Source   string
	Dest     string
	Protocol v1.Protocol // default TCP
	Port     int
	Origin   Origin
	// Want is the verdict; for Delivered, WantEndpoints lists every
	// endpoint ("ip:port") the flow may reach and WantMasquerade whether it
	// is SNATed (for every endpoint). WantHairpin names endpoints reached
	// with masquerade when the others are not.
	Want           Verdict
	WantEndpoints  []string
	WantMasquerade bool
	WantHairpin    []string
}

// Result is a traced flow: every possible outcome folded together.
type Result struct {
	Verdict Verdict
	// Endpoints maps each reachable endpoint to whether it is masqueraded.
	Endpoints map[string]bool
	// Masquerade for a non-delivered flow.
	Masquerade bool
}

// Env is what a case configures.
type Env struct {
	NodeName      string
	NodeIPs       []netip.Addr
	ClusterCIDR   netip.Prefix
	MasqueradeAll bool
	// NodePortAddresses: nil means all local addresses.
	NodePortAddresses *proxy.NodePortAddresses
	Family            v1.IPFamily
}

// Tracer traces flows through a backend's fake kernel state.
type Tracer interface {
	Trace(f Flow) (Result, error)
}

// Factory builds the backend under test and its tracer for one case.
type Factory func(t *testing.T, env Env) (proxier.Backend, Tracer)

// Case is one behaviour case.
type Case struct {
	Name     string
	Family   v1.IPFamily // default IPv4
	NodeName string      // default "node-a"
	NodeIPs  []string    // default 10.0.0.1 (or fd00::1)
	// NodeIP is this node's primary IP (for the keyword "primary" of
	// NodePortAddresses); default the first of NodeIPs, "none" for unknown.
	NodeIP            string
	ClusterCIDR       string // default 10.244.0.0/16 (or fd00:244::/64)
	MasqueradeAll     bool
	NodePortAddresses []string
	Nodes             []*v1.Node
	Services          []*v1.Service
	Slices            []*discovery.EndpointSlice
	Flows             []Flow
}

func (c *Case) env() Env {
	e := Env{NodeName: c.NodeName, MasqueradeAll: c.MasqueradeAll, Family: c.Family}
	if e.Family == "" {
		e.Family = v1.IPv4Protocol
	}
	if e.NodeName == "" {
		e.NodeName = "node-a"
	}
	ips, cidr := c.NodeIPs, c.ClusterCIDR
	if len(ips) == 0 {
		ips = []string{"10.0.0.1"}
		if e.Family == v1.IPv6Protocol {
			ips = []string{"fd00::1"}
		}
	}
	if cidr == "" {
		cidr = "10.244.0.0/16"
		if e.Family == v1.IPv6Protocol {
			cidr = "fd00:244::/64"
		}
	}
	for _, ip := range ips {
		e.NodeIPs = append(e.NodeIPs, netip.MustParseAddr(ip))
	}
	if cidr != "none" {
		e.ClusterCIDR = netip.MustParsePrefix(cidr)
	}
	if c.NodePortAddresses != nil {
		var primary netip.Addr
		switch c.NodeIP {
		case "":
			primary = e.NodeIPs[0]
		case "none":
		default:
			primary = netip.MustParseAddr(c.NodeIP)
		}
		npa, err := proxy.NewNodePortAddresses(e.Family, c.NodePortAddresses, primary)
		if err != nil {
			panic(fmt.Sprintf("case %q: %v", c.Name, err))
		}
		e.NodePortAddresses = npa
	}
	return e
}

// Run runs every case against the backend factory.
func Run(t *testing.T, factory Factory) {
	for _, c := range Cases() {
		t.Run(c.Name, func(t *testing.T) {
			RunCase(t, c, factory)
		})
	}
}

// RunCase programs one case through a real engine and checks its flows.
func RunCase(t *testing.T, c Case, factory Factory) {
	t.Helper()
	env := c.env()
	backend, tracer := factory(t, env)
	engine := NewEngine(t, backend, EngineOptions{Env: env, Nodes: c.Nodes, Services: c.Services, Slices: c.Slices})
	Sync(t, engine)
	CheckFlows(t, tracer, c.Flows)
}

// CheckFlows traces each flow and compares it with what it wants.
func CheckFlows(t *testing.T, tracer Tracer, flows []Flow) {
	t.Helper()
	for _, f := range flows {
		if f.Protocol == "" {
			f.Protocol = v1.ProtocolTCP
		}
		got, err := tracer.Trace(f)
		if err != nil {
			t.Errorf("flow %q: trace: %v", f.Name, err)
			continue
		}
		if msg := compare(f, got); msg != "" {
			t.Errorf("flow %q (%s %s -> %s:%d): %s", f.Name, f.Protocol, f.Source, f.Dest, f.Port, msg)
		}
	}
}

func compare(f Flow, got Result) string {
	if got.Verdict != f.Want {
		return fmt.Sprintf("verdict %s, want %s (endpoints %v)", got.Verdict, f.Want, got.Endpoints)
	}
	if f.Want != Delivered {
		return ""
	}
	var eps []string
	for ep := range got.Endpoints {
		eps = append(eps, ep)
	}
	sort.Strings(eps)
	want := append([]string{}, f.WantEndpoints...)
	sort.Strings(want)
	if strings.Join(eps, ",") != strings.Join(want, ",") {
		return fmt.Sprintf("endpoints %v, want %v", eps, want)
	}
	hairpin := map[string]bool{}
	for _, h := range f.WantHairpin {
		hairpin[h] = true
	}
	for ep, masq := range got.Endpoints {
		wantMasq := f.WantMasquerade || hairpin[ep]
		if masq != wantMasq {
			return fmt.Sprintf("endpoint %s masquerade %v, want %v", ep, masq, wantMasq)
		}
	}
	return ""
}
