package iptables

import (
	"context"
	"fmt"
	"testing"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// dumpingTracer is the behaviour cases' tracer that also dumps the fake's
// state for the property test: the nat and filter tables, which on a fresh
// fake hold nothing but kproxy's rules.
type dumpingTracer struct{ fakeTracer }

func (d *dumpingTracer) DumpState() (pt.StateDump, error) {
	s, err := pt.DumpIPTables(context.Background(), d.fake, ipt.TableNAT, ipt.TableFilter)
	return pt.StateDump{State: s}, err
}

func propertyFactory(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
	b, fake := newFakeBackend(t, env)
	return b, &dumpingTracer{fakeTracer{fake: fake, local: env.NodeIPs}}
}

// TestPartialSyncMatchesFullSync: after every batch of random changes, the
// rules that partial syncs left are those a full sync of the same objects
// writes (pt.RunScenario).
func TestPartialSyncMatchesFullSync(t *testing.T) {
	seeds, steps := pt.PropertyRuns()
	for seed := 1; seed <= seeds; seed++ {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			pt.RunProperty(t, uint64(seed), steps, propertyFactory, pt.PropertyOptions{})
		})
	}
	for _, sc := range pt.PropertyRegressions() {
		t.Run(sc.Name, func(t *testing.T) { pt.RunScenario(t, sc, propertyFactory, pt.PropertyOptions{}) })
	}
}

// FuzzPartialSync runs the property test for any seed, for long runs:
//
//	go test -run '^$' -fuzz FuzzPartialSync -fuzztime 5m ./proxier/iptables/
func FuzzPartialSync(f *testing.F) {
	f.Add(uint64(1000), uint8(30))
	f.Add(uint64(1001), uint8(30))
	f.Fuzz(func(t *testing.T, seed uint64, steps uint8) {
		pt.RunProperty(t, seed, 1+int(steps)%120, propertyFactory, pt.PropertyOptions{})
	})
}
