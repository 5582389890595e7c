package app

import (
	"runtime/debug"
	"sync"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/proxier"
)

// DefaultGCPercent is the garbage collector target kproxy sets, once every
// family's first sync has succeeded, when neither GOGC nor GOMEMLIMIT is in
// its environment. Go's default (100) lets the heap grow to about twice its
// live size before a collection; at 30 the peak is about 1.3 times. The
// cost is more collections between changes: measured with the process
// benchmark at 10,000 Services x 10 endpoints in nftables mode
// (test/procbench, six runs in turn, 2026-12-07), a steady target of 30
// against 40 lowered the peak RSS from 145-148 to 139-141 MiB and left
// kproxy's CPU per change where it was (0.62-0.68 against 0.62-0.63 ms at
// the median; collections per change 0.00 either way).
const DefaultGCPercent = 30

// StartupGCPercent is the target from start-up until every family's first
// sync has succeeded. The process peaks while its informers list every
// object and the first sync renders the whole table, and that happens
// once: a tighter target there costs some collection in the first sync
// and nothing per change afterwards. Measured as above: the first sync's
// peak RSS is 138-142 MiB at 20 and 149-152 MiB at 40 (whose first syncs
// were 0.5-0.8 s faster in the same runs: 2.2-2.4 against 2.9-3.1 s, the
// informers' lists included).
const StartupGCPercent = 20

// gcTuner holds the collector at StartupGCPercent until every awaited
// family has synced once, then sets DefaultGCPercent. A nil *gcTuner (the
// user set GOGC or GOMEMLIMIT) does nothing.
type gcTuner struct {
	logger     klog.Logger
	setPercent func(int) int // debug.SetGCPercent

	mu      sync.Mutex
	waiting sets.Set[v1.IPFamily] // nil until await
	done    bool
}

// setGCDefaults applies StartupGCPercent and returns the tuner that moves
// to DefaultGCPercent after the first syncs, unless the user tuned the
// collector through GOGC or GOMEMLIMIT (looked up with lookupEnv): then it
// returns nil and leaves the collector alone. setPercent is
// debug.SetGCPercent (nil: that).
func setGCDefaults(logger klog.Logger, lookupEnv func(string) (string, bool), setPercent func(int) int) *gcTuner {
	for _, env := range []string{"GOGC", "GOMEMLIMIT"} {
		if v, set := lookupEnv(env); set {
			logger.V(2).Info("Leaving the garbage collector as the environment sets it", env, v)
			return nil
		}
	}
	if setPercent == nil {
		setPercent = debug.SetGCPercent
	}
	setPercent(StartupGCPercent)
	logger.V(2).Info("Set the garbage collector's start-up target", "gcPercent", StartupGCPercent)
	return &gcTuner{logger: logger, setPercent: setPercent}
}

// await names the families whose first successful sync ends the start-up
// target.
func (g *gcTuner) await(families sets.Set[v1.IPFamily]) {
	if g == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.waiting = families.Clone()
	g.finishLocked()
}

// synced takes a sync's result (the engines' OnSync).
func (g *gcTuner) synced(r proxier.SyncResult) {
	if g == nil || r.Err != nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.waiting == nil {
		return
	}
	g.waiting.Delete(r.Family)
	g.finishLocked()
}

func (g *gcTuner) finishLocked() {
	if g.done || g.waiting == nil || g.waiting.Len() > 0 {
		return
	}
	g.done = true
	g.setPercent(DefaultGCPercent)
	g.logger.V(2).Info("First syncs done: set the garbage collector's target", "gcPercent", DefaultGCPercent)
}
