package iptables

import (
	"context"
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
	pt.RunProperties(t, propertyFactory, pt.PropertyOptions{})
}

// FuzzPartialSync runs the property test for any seed, for long runs:
//
//	go test -run '^$' -fuzz FuzzPartialSync -fuzztime 5m ./proxier/iptables/
func FuzzPartialSync(f *testing.F) {
	pt.FuzzProperty(f, propertyFactory, pt.PropertyOptions{})
}
