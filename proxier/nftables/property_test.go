package nftables

import (
	"testing"

	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestPartialSyncMatchesFullSync: after every batch of random changes, the
// table that partial syncs left is the one a full sync of the same objects
// writes (pt.RunScenario), element for element.
func TestPartialSyncMatchesFullSync(t *testing.T) {
	pt.RunProperties(t, factory, pt.PropertyOptions{})
}

// FuzzPartialSync runs the property test for any seed, for long runs:
//
//	go test -run '^$' -fuzz FuzzPartialSync -fuzztime 5m ./proxier/nftables/
func FuzzPartialSync(f *testing.F) {
	pt.FuzzProperty(f, factory, pt.PropertyOptions{})
}
