package procbench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kproxy/kproxy/test/cluster"
)

// Defaults of RunOptions.
const (
	// DefaultChanges is how many one-endpoint changes a run measures.
	DefaultChanges = 30
	// DefaultReceiveOnly is how many receive-only events (TouchSlice)
	// a run measures after its changes.
	DefaultReceiveOnly = 10
	// receiveWindow is how long kproxy's CPU is counted after a
	// receive-only event, and in the idle window before it.
	receiveWindow = 200 * time.Millisecond
	// DefaultSettle spaces the changes beyond kproxy's default
	// --iptables-min-sync-period (1 s): each change is measured from an
	// idle kproxy, not behind the previous one's rate limit.
	DefaultSettle = 1100 * time.Millisecond
	// DefaultFirstSyncTimeout bounds kproxy's start-up to its first full
	// sync.
	DefaultFirstSyncTimeout = 15 * time.Minute
	// changeTimeout bounds one change.
	changeTimeout = 60 * time.Second
	// calibrationScrapes is how many /metrics reads measure the CPU one
	// read costs kproxy.
	calibrationScrapes = 100
	// After a commit the sync ends once the program that committed has
	// exited (iptables-nft-restore frees its cache first: up to 100 ms on
	// a loaded machine): /metrics is read commitPoll after it, then at
	// doubling intervals up to maxCommitPoll. Until a commit is seen it is
	// read every idlePoll, in case notifications were lost.
	commitPoll    = 5 * time.Millisecond
	maxCommitPoll = 80 * time.Millisecond
	idlePoll      = time.Second
	// metricsFallback is how long a change waits for its commit to be
	// seen before kproxy's progress is read from /metrics instead of
	// /healthz (notifications lost).
	metricsFallback = 5 * time.Second
	// noWatcherPoll is how often /metrics is read without kernel
	// notifications.
	noWatcherPoll = 10 * time.Millisecond
	// drain is how long after a change's sync ended its notifications
	// may still be in flight to the watcher.
	drain = 50 * time.Millisecond
	// quiet is how long kproxy is left alone after the /metrics read that
	// checks it is idle before its CPU is read at the start of a change;
	// settled how long after the change's first commit it is read at the
	// end (its sync ends well within it: the rest of a one-transaction
	// partial sync is microseconds of bookkeeping; kproxy's idle work in
	// it is counted too).
	quiet   = 100 * time.Millisecond
	settled = 20 * time.Millisecond
	// stopGrace is how long kproxy may take to exit on SIGTERM.
	stopGrace = 10 * time.Second
)

// Sources of a change's end.
const (
	SourceKernel = "kernel"
	SourceKproxy = "kproxy-metric"
)

// RunOptions configure one measured run of kproxy.
type RunOptions struct {
	// Kproxy is how to run kproxy; Run sets NetNS.
	Kproxy KproxyOptions
	// Objects are the API objects in place (Services, Nodes); changes go
	// through it.
	Objects *Objects
	// Changes, Settle and FirstSyncTimeout default to DefaultChanges,
	// DefaultSettle and DefaultFirstSyncTimeout.
	Changes int
	Settle  time.Duration
	// ReceiveOnly is how many receive-only events are measured after the
	// changes: 0 means DefaultReceiveOnly, negative none.
	ReceiveOnly      int
	FirstSyncTimeout time.Duration
	// Logf reports progress; nil is silent.
	Logf func(format string, args ...any)
}

// Result is one run's measurement.
type Result struct {
	Mode                string `json:"mode"`
	Services            int    `json:"services"`
	EndpointsPerService int    `json:"endpoints_per_service"`
	Nodes               int    `json:"nodes"`
	// Skipped says why the mode was not measured.
	Skipped string `json:"skipped,omitempty"`

	// FirstSyncS is from kproxy's start to the end of its first full sync.
	FirstSyncS float64 `json:"first_sync_s"`
	// Rules is what kproxy reports of its rules after the first sync
	// (kubeproxy_sync_proxy_rules_iptables_total, IPv4, every table).
	Rules int `json:"rules"`

	Changes int `json:"changes"`
	// Change*Ms are from the EndpointSlice write to the kernel's commit of
	// the change (ChangeSource says how the commit was seen).
	ChangeP50Ms     float64   `json:"change_p50_ms"`
	ChangeP90Ms     float64   `json:"change_p90_ms"`
	ChangeMaxMs     float64   `json:"change_max_ms"`
	ChangeSamplesMs []float64 `json:"change_samples_ms"`
	ChangeSource    string    `json:"change_source"`
	// Synced*Ms are from the write to the end of the sync as kproxy
	// records it (kubeproxy_sync_proxy_rules_last_timestamp_seconds).
	SyncedP50Ms float64 `json:"synced_p50_ms"`
	SyncedP90Ms float64 `json:"synced_p90_ms"`
	// KproxyLatencyMeanMs is kproxy's own network programming latency
	// (from the slice's last-change-trigger-time, set at the write), mean.
	KproxyLatencyMeanMs float64 `json:"kproxy_latency_mean_ms"`
	// CommitsPerChange counts nf_tables transactions per change.
	CommitsPerChange float64 `json:"commits_per_change"`

	// CPUMsPerChange is kproxy's own CPU time (utime+stime) per change,
	// from the write to the end of the sync, less the /metrics reads;
	// ChildCPUMsPerChange that of the programs it ran (iptables-restore,
	// nft).
	CPUMsPerChange      float64 `json:"cpu_ms_per_change"`
	ChildCPUMsPerChange float64 `json:"child_cpu_ms_per_change"`
	// CPUP50Ms and ChildCPUP50Ms are the medians of the same per-change
	// figures, and ShareP50 kproxy's share of a change's CPU
	// (kproxy/(kproxy+child)) at the median change by that share: periodic
	// work that falls into a few changes' windows (the canary's
	// nft --check once a sync period, Go's forced collection every two
	// minutes) moves the means but not these. CPUSamplesMs and
	// ChildCPUSamplesMs are the per-change figures, in change order.
	CPUP50Ms          float64   `json:"cpu_p50_ms"`
	ChildCPUP50Ms     float64   `json:"child_cpu_p50_ms"`
	ShareP50          float64   `json:"share_p50"`
	CPUSamplesMs      []float64 `json:"cpu_samples_ms"`
	ChildCPUSamplesMs []float64 `json:"child_cpu_samples_ms"`
	// SwitchesPerChange is how many times kproxy's threads were put on a
	// CPU per change (Usage.Switches; with the /metrics reads when no
	// commit was seen): the wake-ups a change costs.
	SwitchesPerChange float64 `json:"switches_per_change"`
	// AllocKiBPerChange and GCsPerChange are what kproxy's Go runtime
	// allocated and how many collections it completed, per change, from
	// the /metrics read before the changes to the one after them (the
	// benchmark's /healthz and /metrics reads over the changes included).
	AllocKiBPerChange float64 `json:"alloc_kib_per_change"`
	GCsPerChange      float64 `json:"gcs_per_change"`
	// ReceiveOnly* measure events kproxy receives but has nothing to
	// sync for (TouchSlice): its CPU and context switches in the
	// receiveWindow after the write (ReceiveOnlyCPUMs), and in the same
	// window idle just before it (IdleWindowCPUMs), medians over
	// ReceiveOnlyEvents; events with a sync in the window are left out.
	// What kproxy spends to receive one change before any sync: the
	// watch's HTTP/2 read, decoding, the informer and the handlers.
	ReceiveOnlyEvents   int     `json:"receive_only_events"`
	ReceiveOnlyCPUMs    float64 `json:"receive_only_cpu_ms"`
	ReceiveOnlySwitches float64 `json:"receive_only_switches"`
	IdleWindowCPUMs     float64 `json:"idle_window_cpu_ms"`
	IdleWindowSwitches  float64 `json:"idle_window_switches"`
	// ScrapesPerChange and ScrapeCPUMs: /metrics reads per change and the
	// CPU one costs kproxy, measured at idle.
	ScrapesPerChange float64 `json:"scrapes_per_change"`
	ScrapeCPUMs      float64 `json:"scrape_cpu_ms"`
	// FirstSync*CPUS are CPU seconds from the start to the first sync;
	// Total*CPUS to the end of the run.
	FirstSyncCPUS      float64 `json:"first_sync_cpu_s"`
	FirstSyncChildCPUS float64 `json:"first_sync_child_cpu_s"`
	TotalCPUS          float64 `json:"total_cpu_s"`
	TotalChildCPUS     float64 `json:"total_child_cpu_s"`

	// PeakRSSMiB is kproxy's VmHWM at the end; the FirstSync values right
	// after the first sync.
	PeakRSSMiB           float64 `json:"peak_rss_mib"`
	FirstSyncPeakRSSMiB  float64 `json:"first_sync_peak_rss_mib"`
	FirstSyncRSSMiB      float64 `json:"first_sync_rss_mib"`
	NotificationOverflow int     `json:"notification_overflows"`
	Log                  string  `json:"log"`
}

// ErrModeRejected wraps the reason kproxy refuses a proxy mode.
var ErrModeRejected = errors.New("kproxy rejects the mode")

// Run measures one kproxy run against the objects in place: it starts
// kproxy in a fresh NodeNetNS, waits for its first full sync and measures
// opts.Changes one-endpoint changes. A mode kproxy rejects gives a Result
// with Skipped set.
func Run(ctx context.Context, opts RunOptions) (res Result, err error) {
	if opts.Changes <= 0 {
		opts.Changes = DefaultChanges
	}
	if opts.Settle <= 0 {
		opts.Settle = DefaultSettle
	}
	if opts.ReceiveOnly == 0 {
		opts.ReceiveOnly = DefaultReceiveOnly
	}
	if opts.FirstSyncTimeout <= 0 {
		opts.FirstSyncTimeout = DefaultFirstSyncTimeout
	}
	logf := opts.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	res = Result{
		Mode: opts.Kproxy.Mode, Services: opts.Objects.Services(), EndpointsPerService: EndpointsPerService,
		Nodes: opts.Objects.Nodes(), Log: opts.Kproxy.Log,
	}
	if err := CheckMode(ctx, opts.Kproxy); err != nil {
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
		res.Skipped = fmt.Sprintf("%v: %v", ErrModeRejected, err)
		return res, nil
	}

	ns, removeNS, err := createNodeNetNS(ctx)
	if err != nil {
		return res, err
	}
	defer func() {
		if rerr := removeNS(); rerr != nil {
			err = errors.Join(err, fmt.Errorf("removing %s: %w", NodeNetNS, rerr))
		}
	}()
	opts.Kproxy.NetNS = ns

	watcher, werr := WatchCommits(ns)
	if werr != nil {
		logf("no kernel commit notifications (%v): changes end when kproxy records its sync", werr)
	} else {
		watchDone := make(chan error, 1)
		go func() { watchDone <- watcher.Run() }()
		defer func() {
			_ = watcher.Close()
			if werr := <-watchDone; werr != nil {
				err = errors.Join(err, werr)
			}
		}()
	}

	k, err := StartKproxy(opts.Kproxy)
	if err != nil {
		return res, err
	}
	defer func() {
		if serr := k.Stop(stopGrace); serr != nil {
			err = errors.Join(err, serr)
		}
	}()

	first, err := waitFirstSync(ctx, k, opts.FirstSyncTimeout)
	if err != nil {
		return res, err
	}
	u, err := k.Usage()
	if err != nil {
		return res, err
	}
	res.FirstSyncS = first.LastSync.Sub(k.Started).Seconds()
	res.FirstSyncCPUS, res.FirstSyncChildCPUS = u.CPU.Seconds(), u.ChildCPU.Seconds()
	res.FirstSyncPeakRSSMiB, res.FirstSyncRSSMiB = mib(u.HWM), mib(u.RSS)
	if s, err := k.Scrape(ctx); err == nil {
		res.Rules = ruleCount(s)
	}
	logf("%s: first full sync %.2f s after start (%d rules, peak RSS %.1f MiB)", opts.Kproxy.Mode, res.FirstSyncS, res.Rules, res.FirstSyncPeakRSSMiB)

	profile := fmt.Sprintf("%s-%d-%d", opts.Kproxy.Mode, opts.Objects.Services(), opts.Objects.Nodes())
	if err := k.SaveHeapProfile(ctx, profile+"-first.heap"); err != nil {
		logf("%v", err)
	}

	scrapeCost, err := calibrateScrapes(ctx, k)
	if err != nil {
		return res, err
	}
	res.ScrapeCPUMs = ms(scrapeCost)

	var commits, synced []time.Duration
	var cpu, childCPU time.Duration
	var scrapes, transactions int
	var switches int64
	// kproxy's network programming latency over the changes: its
	// histogram's sum and count, read before and after them.
	stBefore, err := k.SyncState(ctx)
	if err != nil {
		return res, err
	}
	source := SourceKproxy
	if watcher != nil {
		source = SourceKernel
	}
	// With a profile directory, a CPU profile covers the changes (and the
	// idle time between them).
	cpuProfile := make(chan error, 1)
	if opts.Kproxy.ProfileDir != "" {
		d := time.Duration(opts.Changes) * (opts.Settle + 500*time.Millisecond)
		go func() { cpuProfile <- k.SaveCPUProfile(ctx, profile+"-changes.cpu", d) }()
	} else {
		cpuProfile <- nil
	}
	n := opts.Objects.Services()
	for c := range opts.Changes {
		// Service i, endpoint j: spread over the Services and endpoints.
		i, j := (c*7919+17)%n, c%EndpointsPerService
		ch, err := measureChange(ctx, k, watcher, opts, i, j)
		if err != nil {
			return res, fmt.Errorf("change %d (Service %s endpoint %d): %w", c+1, ServiceName(i), j, err)
		}
		if ch.commit == 0 {
			source = SourceKproxy
		}
		commits = append(commits, ch.commit)
		synced = append(synced, ch.synced)
		own := ch.cpu - time.Duration(ch.scrapes)*scrapeCost
		cpu += own
		childCPU += ch.childCPU
		res.CPUSamplesMs = append(res.CPUSamplesMs, ms(own))
		res.ChildCPUSamplesMs = append(res.ChildCPUSamplesMs, ms(ch.childCPU))
		switches += ch.switches
		scrapes += ch.scrapes
		transactions += ch.transactions
	}
	if source == SourceKproxy {
		// Without every commit seen, use kproxy's time for all.
		commits = synced
	}
	if opts.ReceiveOnly > 0 {
		if err := measureReceiveOnly(ctx, k, opts, &res); err != nil {
			return res, err
		}
	}
	u, err = k.Usage()
	if err != nil {
		return res, err
	}
	res.Changes = opts.Changes
	res.ChangeSource = source
	sorted := slices.Sorted(slices.Values(commits))
	res.ChangeP50Ms, res.ChangeP90Ms, res.ChangeMaxMs = ms(percentile(sorted, 50)), ms(percentile(sorted, 90)), ms(sorted[len(sorted)-1])
	for _, d := range commits {
		res.ChangeSamplesMs = append(res.ChangeSamplesMs, ms(d))
	}
	sortedSynced := slices.Sorted(slices.Values(synced))
	res.SyncedP50Ms, res.SyncedP90Ms = ms(percentile(sortedSynced, 50)), ms(percentile(sortedSynced, 90))
	stAfter, err := k.SyncState(ctx)
	if err != nil {
		return res, err
	}
	if n := stAfter.NetProgCount - stBefore.NetProgCount; n > 0 {
		res.KproxyLatencyMeanMs = round3((stAfter.NetProgSum - stBefore.NetProgSum) / n * 1000)
	}
	k64 := float64(opts.Changes)
	res.AllocKiBPerChange = round3((stAfter.AllocBytes - stBefore.AllocBytes) / 1024 / k64)
	res.GCsPerChange = round3((stAfter.GCCycles - stBefore.GCCycles) / k64)
	res.CommitsPerChange = round3(float64(transactions) / k64)
	res.CPUMsPerChange = round3(ms(cpu) / k64)
	res.ChildCPUMsPerChange = round3(ms(childCPU) / k64)
	res.SwitchesPerChange = round3(float64(switches) / k64)
	res.CPUP50Ms, res.ChildCPUP50Ms = median(res.CPUSamplesMs), median(res.ChildCPUSamplesMs)
	res.ShareP50 = shareP50(res.CPUSamplesMs, res.ChildCPUSamplesMs)
	res.ScrapesPerChange = round3(float64(scrapes) / k64)
	res.TotalCPUS, res.TotalChildCPUS = u.CPU.Seconds(), u.ChildCPU.Seconds()
	res.PeakRSSMiB = mib(u.HWM)
	if err := <-cpuProfile; err != nil {
		logf("%v", err)
	}
	if err := k.SaveHeapProfile(ctx, profile+"-end.heap"); err != nil {
		logf("%v", err)
	}
	if watcher != nil {
		res.NotificationOverflow = watcher.Overflows()
	}
	return res, nil
}

// waitFirstSync waits for kproxy's first successful full IPv4 sync.
func waitFirstSync(ctx context.Context, k *Kproxy, timeout time.Duration) (syncState, error) {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if exited, werr := k.Exited(); exited {
			return syncState{}, fmt.Errorf("kproxy exited before its first sync (%v); its log ends:\n%s", werr, k.LogTail(15))
		}
		st, err := k.SyncState(ctx)
		if err == nil && st.FullSyncs > 0 && !st.LastSync.IsZero() {
			return st, nil
		}
		if err != nil {
			last = err
		} else {
			last = fmt.Errorf("%v syncs, %v failed", st.Syncs, st.Failures)
		}
		if time.Now().After(deadline) {
			return syncState{}, fmt.Errorf("no first sync within %s (last: %v); kproxy's log ends:\n%s", timeout, last, k.LogTail(15))
		}
		if err := cluster.Sleep(ctx, 100*time.Millisecond); err != nil {
			return syncState{}, err
		}
	}
}

// calibrateScrapes measures the CPU one /metrics read costs kproxy.
func calibrateScrapes(ctx context.Context, k *Kproxy) (time.Duration, error) {
	before, err := k.Usage()
	if err != nil {
		return 0, err
	}
	for range calibrationScrapes {
		if _, err := k.Scrape(ctx); err != nil {
			return 0, fmt.Errorf("reading /metrics: %w", err)
		}
	}
	after, err := k.Usage()
	if err != nil {
		return 0, err
	}
	return (after.CPU - before.CPU) / calibrationScrapes, nil
}

// change is one measured change.
type change struct {
	// commit is from the write to the commit seen in the kernel (0: not
	// seen); synced to the end of the sync kproxy records.
	commit, synced time.Duration
	cpu, childCPU  time.Duration
	switches       int64
	scrapes        int
	transactions   int
}

// errNotYet: the sync carrying the change has not ended yet.
var errNotYet = errors.New("the change is not synced yet")

// measureChange waits until kproxy is idle past opts.Settle, changes
// endpoint j of Service i and waits for the sync that carries the change.
func measureChange(ctx context.Context, k *Kproxy, w *CommitWatcher, opts RunOptions, i, j int) (change, error) {
	var ch change
	// With the kernel's commits seen, kproxy's progress is read from
	// /healthz; /metrics (its counters) only without them, or once a
	// change has waited metricsFallback for its commit.
	var t0 time.Time
	state := func() (syncState, bool, error) {
		if w != nil && (t0.IsZero() || time.Since(t0) < metricsFallback) {
			at, err := k.LastSync(ctx)
			return syncState{LastSync: at}, false, err
		}
		st, err := k.SyncState(ctx)
		return st, true, err
	}
	st0, _, err := state()
	if err != nil {
		return ch, err
	}
	if wait := opts.Settle - time.Since(st0.LastSync); wait > 0 {
		if err := cluster.Sleep(ctx, wait); err != nil {
			return ch, err
		}
	}
	// The read of /metrics above wakes kproxy's runtime (and allocates):
	// let that pass before the change's CPU is counted from u0.
	if err := cluster.Sleep(ctx, quiet); err != nil {
		return ch, err
	}
	u0, err := k.Usage()
	if err != nil {
		return ch, err
	}
	var notify <-chan struct{}
	poll, backoff := noWatcherPoll, time.Duration(0)
	if w != nil {
		notify, poll = w.Notify(), idlePoll
		// Forget commits before the change.
		select {
		case <-notify:
		default:
		}
	}
	if err := opts.Objects.ChangeEndpoint(ctx, i, j, func() time.Time { t0 = time.Now(); return t0 }); err != nil {
		return ch, err
	}

	// Read /metrics (ch.scrapes counts the reads kproxy's CPU time since
	// u0 includes) until kproxy has synced the change.
	deadline := t0.Add(changeTimeout)
	timer := time.NewTimer(poll)
	defer timer.Stop()
	var st syncState
	var u1 Usage
	var u1At time.Time
	scrapesAtU1, sawCommit := 0, false
	for {
		select {
		case <-ctx.Done():
			return ch, ctx.Err()
		case <-notify:
			if !sawCommit {
				// kproxy's CPU is read settled after the commit, before
				// any read of /metrics: if the sync had ended by then,
				// nothing of the benchmark's is in u1-u0.
				sawCommit = true
				if err := cluster.Sleep(ctx, settled); err != nil {
					return ch, err
				}
				if u1, err = k.Usage(); err != nil {
					return ch, err
				}
				u1At, scrapesAtU1 = time.Now(), ch.scrapes
				timer.Reset(0)
				continue
			}
			backoff = commitPoll
			timer.Reset(backoff)
			continue
		case <-timer.C:
		}
		if exited, werr := k.Exited(); exited {
			return ch, fmt.Errorf("kproxy exited (%v); its log ends:\n%s", werr, k.LogTail(15))
		}
		var fromMetrics bool
		st, fromMetrics, err = state()
		if fromMetrics {
			ch.scrapes++
		}
		switch {
		case err != nil || !st.LastSync.After(t0):
		case !fromMetrics && sawCommit:
			// The change's commit was seen and a sync has ended since.
		case fromMetrics && st.EndpointChanges > st0.EndpointChanges && st.Syncs > st0.Syncs:
			// st0 from /healthz has no counters: then any sync that
			// ended after the change counts.
		default:
			err = errNotYet
		}
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			return ch, fmt.Errorf("no sync carrying the change within %s (last state %+v, err %v)", changeTimeout, st, err)
		}
		next := poll
		if backoff > 0 {
			// A commit was seen: back off until the sync ends.
			backoff = min(2*backoff, maxCommitPoll)
			next = backoff
		}
		timer.Reset(next)
	}
	if u1At.IsZero() || st.LastSync.After(u1At) {
		// No commit seen, or the sync ended after u1 was read: count to
		// now, with the /metrics reads since u0 (less their calibrated
		// cost, by the caller).
		if u1, err = k.Usage(); err != nil {
			return ch, err
		}
	} else {
		ch.scrapes = scrapesAtU1
	}
	ch.cpu, ch.childCPU, ch.switches = u1.CPU-u0.CPU, u1.ChildCPU-u0.ChildCPU, u1.Switches-u0.Switches
	ch.synced = st.LastSync.Sub(t0)
	if w != nil {
		if err := cluster.Sleep(ctx, drain); err != nil {
			return ch, err
		}
		evs := w.Since(t0)
		ch.transactions = len(evs)
		ch.commit = lastIPv4Commit(evs, t0)
	}
	return ch, nil
}

// measureReceiveOnly measures opts.ReceiveOnly receive-only events (see
// Result.ReceiveOnlyCPUMs), each after opts.Settle: an idle window, then
// one TouchSlice and the same window after it.
func measureReceiveOnly(ctx context.Context, k *Kproxy, opts RunOptions, res *Result) error {
	var cpu, idle []time.Duration
	var switches, idleSwitches []float64
	n := opts.Objects.Services()
	for c := range opts.ReceiveOnly {
		if err := cluster.Sleep(ctx, opts.Settle); err != nil {
			return err
		}
		last0, err := k.LastSync(ctx)
		if err != nil {
			return err
		}
		if err := cluster.Sleep(ctx, quiet); err != nil {
			return err
		}
		ua, err := k.Usage()
		if err != nil {
			return err
		}
		if err := cluster.Sleep(ctx, receiveWindow); err != nil {
			return err
		}
		ub, err := k.Usage()
		if err != nil {
			return err
		}
		if err := opts.Objects.TouchSlice(ctx, (c*104729+31)%n); err != nil {
			return err
		}
		if err := cluster.Sleep(ctx, receiveWindow); err != nil {
			return err
		}
		uc, err := k.Usage()
		if err != nil {
			return err
		}
		last1, err := k.LastSync(ctx)
		if err != nil {
			return err
		}
		if !last1.Equal(last0) {
			// A periodic sync ran in the windows.
			continue
		}
		res.ReceiveOnlyEvents++
		idle = append(idle, ub.CPU-ua.CPU)
		idleSwitches = append(idleSwitches, float64(ub.Switches-ua.Switches))
		cpu = append(cpu, uc.CPU-ub.CPU)
		switches = append(switches, float64(uc.Switches-ub.Switches))
	}
	if res.ReceiveOnlyEvents > 0 {
		// Medians: a collection that falls into one window would
		// otherwise dominate ten.
		res.ReceiveOnlyCPUMs = ms(percentile(slices.Sorted(slices.Values(cpu)), 50))
		res.IdleWindowCPUMs = ms(percentile(slices.Sorted(slices.Values(idle)), 50))
		res.ReceiveOnlySwitches = round3(median(switches))
		res.IdleWindowSwitches = round3(median(idleSwitches))
	}
	return nil
}

// median is the middle value of v (the lower of the two middle ones).
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	return s[(len(s)-1)/2]
}

// shareP50 is kproxy's share of a change's CPU, own/(own+child), at the
// median change by that share (0 without changes).
func shareP50(own, child []float64) float64 {
	var shares []float64
	for i := range own {
		if total := own[i] + child[i]; total > 0 {
			shares = append(shares, own[i]/total)
		}
	}
	return round3(median(shares))
}

// lastIPv4Commit is the time from t0 to the last commit among evs that
// changed IPv4 rules (a periodic IPv6 sync may commit meanwhile), or 0
// when there is none.
func lastIPv4Commit(evs []CommitEvent, t0 time.Time) time.Duration {
	for k := len(evs) - 1; k >= 0; k-- {
		if evs[k].TouchesIPv4() && !evs[k].Lost {
			return evs[k].At.Sub(t0)
		}
	}
	return 0
}

// ruleCount sums kproxy's IPv4 rule counts over tables.
func ruleCount(s Samples) int {
	const name = "kubeproxy_sync_proxy_rules_iptables_total"
	total := 0
	for _, table := range []string{"filter", "nat", "mangle", "raw"} {
		if v, ok := s.Get(name, "ip_family", "IPv4", "table", table); ok {
			total += int(v)
		}
	}
	return total
}

// percentile is the nearest-rank p-th percentile of sorted durations.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	return sorted[min(max(rank, 1), len(sorted))-1]
}

func ms(d time.Duration) float64 { return round3(float64(d) / float64(time.Millisecond)) }

func mib(bytes int64) float64 { return round3(float64(bytes) / (1 << 20)) }

func round3(f float64) float64 { return math.Round(f*1000) / 1000 }
