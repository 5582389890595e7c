package app

import (
	"runtime/debug"

	"k8s.io/klog/v2"
)

// DefaultGCPercent is the garbage collector target kproxy sets when neither
// GOGC nor GOMEMLIMIT is in its environment: a collection starts when the
// heap has grown by half its live size since the last one, not by all of it
// (Go's default, 100). kproxy's heap is mostly long-lived state (informer
// caches, the model) with bursts of short-lived allocation at each sync, so
// the default lets the process peak at about twice its live heap; at 50 the
// peak is about one and a half times. The cost is more collections: at
// 10,000 services, a few more per full sync (tenths of a second of CPU next
// to seconds of iptables-restore) and about one more every few partial
// syncs.
const DefaultGCPercent = 50

// setGCDefaults applies DefaultGCPercent unless the user tuned the garbage
// collector through GOGC or GOMEMLIMIT (looked up with lookupEnv).
func setGCDefaults(logger klog.Logger, lookupEnv func(string) (string, bool)) {
	for _, env := range []string{"GOGC", "GOMEMLIMIT"} {
		if v, set := lookupEnv(env); set {
			logger.V(2).Info("Leaving the garbage collector as the environment sets it", env, v)
			return
		}
	}
	debug.SetGCPercent(DefaultGCPercent)
	logger.V(2).Info("Set the garbage collector target", "gcPercent", DefaultGCPercent)
}
