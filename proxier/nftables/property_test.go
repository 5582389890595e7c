package nftables

import (
	"fmt"
	"testing"

	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestPartialSyncMatchesFullSync: after every batch of random changes, the
// table that partial syncs left is the one a full sync of the same objects
// writes (pt.RunScenario), element for element.
func TestPartialSyncMatchesFullSync(t *testing.T) {
	seeds, steps := pt.PropertyRuns()
	for seed := 1; seed <= seeds; seed++ {
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) {
			pt.RunProperty(t, uint64(seed), steps, factory, pt.PropertyOptions{})
		})
	}
	for _, sc := range pt.PropertyRegressions() {
		t.Run(sc.Name, func(t *testing.T) { pt.RunScenario(t, sc, factory, pt.PropertyOptions{}) })
	}
}

// FuzzPartialSync runs the property test for any seed, for long runs:
//
//	go test -run '^$' -fuzz FuzzPartialSync -fuzztime 5m ./proxier/nftables/
func FuzzPartialSync(f *testing.F) {
	f.Add(uint64(1000), uint8(30))
	f.Add(uint64(1001), uint8(30))
	f.Fuzz(func(t *testing.T, seed uint64, steps uint8) {
		pt.RunProperty(t, seed, 1+int(steps)%120, factory, pt.PropertyOptions{})
	})
}
