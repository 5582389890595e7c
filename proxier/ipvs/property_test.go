package ipvs

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// propertyTracer is the behaviour cases' tracer that also dumps the fake
// kernel for the property test and simulates connections on its real
// servers.
type propertyTracer struct {
	tracer
	// clock is the backend's: each simulated step lets time pass, so that
	// real servers that keep their connections reach the graceful
	// termination timeout.
	clock *testingclock.FakeClock
}

// DumpState dumps every fake: IPVS virtual servers and real servers, ipset
// sets and entries, the devices and the addresses bound to them, and the
// nat and filter tables.
//
// Real servers at weight 0 are where partial syncs legitimately differ
// from a full sync: a real server kproxy no longer wants keeps its
// connections at weight 0 until they end or the graceful termination
// timeout passes, while a fresh kernel has no connection and a full sync
// there never creates it. So a real server at weight 0 with open
// connections is a leftover (reported, not compared); one at weight 0
// without connections is compared like any other (the sync that saw its
// connections end must have deleted it: a fresh kernel lacks it, so it
// shows as a difference). Every other real server, at any weight, is
// compared, so one that is wanted again must be back at weight 1.
func (p *propertyTracer) DumpState() (pt.StateDump, error) {
	ctx := context.Background()
	k := p.k
	var state, leftovers strings.Builder
	rules, err := pt.DumpIPTables(ctx, k.ipt, ipt.TableNAT, ipt.TableFilter)
	if err != nil {
		return pt.StateDump{}, err
	}
	state.WriteString(rules)
	svcs, err := k.ipvs.Services(ctx)
	if err != nil {
		return pt.StateDump{}, err
	}
	for _, s := range svcs {
		vs := fmt.Sprintf("ipvs %s %s", s.Protocol, netip.AddrPortFrom(s.Address, s.Port))
		fmt.Fprintf(&state, "%s scheduler=%s persistent=%v timeout=%d\n", vs, s.Scheduler, s.Persistent, s.Timeout)
		dests, err := k.ipvs.Destinations(ctx, s)
		if err != nil {
			return pt.StateDump{}, err
		}
		for _, d := range dests {
			line := fmt.Sprintf("%s -> %s weight=%d", vs, netip.AddrPortFrom(d.Address, d.Port), d.Weight)
			if conns := d.ActiveConnections + d.InactiveConnections; d.Weight == 0 && conns > 0 {
				fmt.Fprintf(&leftovers, "%s connections=%d\n", line, conns)
				continue
			}
			state.WriteString(line + "\n")
		}
	}
	names, err := k.sets.ListSets(ctx)
	if err != nil {
		return pt.StateDump{}, err
	}
	for _, n := range names {
		set, _ := k.sets.Get(n)
		fmt.Fprintf(&state, "ipset %s %s ipv6=%v\n", n, set.Type, set.IPv6)
		entries, err := k.sets.Entries(ctx, n)
		if err != nil {
			return pt.StateDump{}, err
		}
		for _, e := range entries {
			fmt.Fprintf(&state, "ipset %s %s\n", n, e)
		}
	}
	for _, dev := range k.nl.Devices() {
		addrs, err := k.nl.ListBoundAddresses(ctx, dev)
		if err != nil && !errors.Is(err, netlink.ErrNotExist) {
			return pt.StateDump{}, err
		}
		fmt.Fprintf(&state, "device %s dummy=%v\n", dev, k.nl.IsDummy(dev))
		for _, a := range addrs {
			fmt.Fprintf(&state, "device %s %s\n", dev, a)
		}
	}
	return pt.StateDump{State: state.String(), Leftovers: leftovers.String()}, nil
}

// SimulateConnections gives about one real server in four a new number of
// connections (often none: they end), and lets two minutes pass.
func (p *propertyTracer) SimulateConnections(r *rand.Rand) error {
	ctx := context.Background()
	svcs, err := p.k.ipvs.Services(ctx)
	if err != nil {
		return err
	}
	for _, s := range svcs {
		dests, err := p.k.ipvs.Destinations(ctx, s)
		if err != nil {
			return err
		}
		for _, d := range dests {
			if r.IntN(4) != 0 {
				continue
			}
			active, inactive := r.IntN(3), r.IntN(2)
			if r.IntN(2) == 0 {
				active, inactive = 0, 0
			}
			if err := p.k.ipvs.SetConnections(s, d, active, inactive); err != nil {
				return err
			}
		}
	}
	p.clock.Step(2 * time.Minute)
	return nil
}

func propertyFactory(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
	k := newFakeKernel(t, env.Family, env.NodeIPs)
	clock := testingclock.NewFakeClock(time.Unix(1_700_000_000, 0))
	b := k.backend(t, Options{NodePortAddresses: env.NodePortAddresses, Clock: clock})
	return b, &propertyTracer{tracer: tracer{k}, clock: clock}
}

// propertyOptions: IPVS mode's tracer copies the ruleset for every flow, so
// fewer flows are traced per step than in iptables mode.
var propertyOptions = pt.PropertyOptions{FlowsPerStep: 4}

// TestPartialSyncMatchesFullSync: after every batch of random changes, the
// kernel state that partial syncs left is the one a full sync of the same
// objects makes on a fresh kernel (pt.RunScenario; see DumpState for real
// servers at weight 0).
func TestPartialSyncMatchesFullSync(t *testing.T) {
	pt.RunProperties(t, propertyFactory, propertyOptions)
}

// FuzzPartialSync runs the property test for any seed, for long runs:
//
//	go test -run '^$' -fuzz FuzzPartialSync -fuzztime 5m ./proxier/ipvs/
func FuzzPartialSync(f *testing.F) {
	pt.FuzzProperty(f, propertyFactory, propertyOptions)
}
