package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kproxy/kproxy/test/cluster"
)

// The suite runs in rounds, one per mode of $KPROXY_E2E_MODES, on one
// cluster: between rounds the supervising parent switches kproxy on every
// node to the next mode (cluster.SetMode) and runs the tests again in a new
// child process. Mode-dependent tests (everything that sends traffic
// through kproxy or looks at it) run in every round as the subtest
// "mode=<mode>" of their top-level test (inMode); the others run in the
// first round only (runsOnce).
const (
	// modesEnv lists the modes of the rounds, in order; a mode may repeat.
	modesEnv = "KPROXY_E2E_MODES"
	// defaultModes are the rounds when modesEnv is unset or blank.
	defaultModes = "iptables nftables"
	// roundEnv tells the child its round: "<index>/<total>".
	roundEnv = "KPC_E2E_ROUND"
	// onceEnv tells the child whether mode-independent tests run in its
	// round ("true" in the first round that runs).
	onceEnv = "KPC_E2E_ONCE"
	// runModesEnv tells the child the modes of every round that runs.
	runModesEnv = "KPC_E2E_RUN_MODES"
	// minRoundTime is the least time left of -timeout worth switching
	// modes and starting a round for.
	minRoundTime = 2 * time.Minute
)

// roundInfo is the child's round. Outside a child (tests listed, or
// skipped for want of root) it is one round doing everything.
type roundInfo struct {
	index, total int
	// once: the mode-independent tests run in this round.
	once bool
	// modes are the modes of every round of the run that runs.
	modes []string
}

// thisRound is set by TestMain in the child, from the parent's environment.
var thisRound = roundInfo{index: 1, total: 1, once: true}

// parseRoundEnv reads the child's round from its environment values.
func parseRoundEnv(round, once, modes string) (roundInfo, error) {
	r := roundInfo{index: 1, total: 1, once: true, modes: strings.Fields(modes)}
	if round != "" {
		i, n, ok := strings.Cut(round, "/")
		var err1, err2 error
		r.index, err1 = strconv.Atoi(i)
		r.total, err2 = strconv.Atoi(n)
		if !ok || err1 != nil || err2 != nil || r.index < 1 || r.index > r.total {
			return roundInfo{}, fmt.Errorf("$%s=%q: want <index>/<total>", roundEnv, round)
		}
	}
	if once != "" {
		b, err := strconv.ParseBool(once)
		if err != nil {
			return roundInfo{}, fmt.Errorf("$%s=%q: %w", onceEnv, once, err)
		}
		r.once = b
	}
	return r, nil
}

// parseModes parses $KPROXY_E2E_MODES: modes separated by spaces or
// commas, each one of cluster.KnownModes; blank means defaultModes.
func parseModes(s string) ([]string, error) {
	fields := strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' || r == '\t' || r == '\n' })
	if len(fields) == 0 {
		fields = strings.Fields(defaultModes)
	}
	for _, m := range fields {
		if err := cluster.ValidateMode(m); err != nil {
			return nil, fmt.Errorf("$%s: %w", modesEnv, err)
		}
	}
	return fields, nil
}

// inMode runs a mode-dependent test as its subtest "mode=<mode>" (kproxy's
// mode in this round), so that its name, its namespace and its failures
// say the mode.
func inMode(t *testing.T, test func(t *testing.T)) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
	if suiteCluster == nil {
		t.Fatal("no cluster: the suite's TestMain did not bring one up")
	}
	t.Run("mode="+suiteCluster.Mode(), test)
}

// runsOnce marks a test that does not depend on kproxy's mode: it runs in
// the first round only.
func runsOnce(t *testing.T) {
	t.Helper()
	if !thisRound.once {
		t.Skipf("mode-independent: runs in the first round only (this is round %d/%d)", thisRound.index, thisRound.total)
	}
}

// underMode reports whether a test name is inside inMode's subtest.
func underMode(name string) bool { return strings.Contains(name, "/mode=") }

// round is one pass of the tests in one mode, as the parent plans and
// runs it.
type round struct {
	mode string
	// skip says why kproxy or this host cannot run the mode: the round
	// is skipped, loudly.
	skip error
	// err says why the round failed: its probe, the mode switch, or the
	// tests themselves.
	err error
	// ran: the tests ran (whatever their outcome); took is how long.
	ran  bool
	took time.Duration
	// failed lists the failed tests.
	failed []string
}

// planRounds probes each distinct mode of modes once: a mode that kproxy
// does not know (ErrModeUnknownToKproxy) or this host cannot run
// (ErrHostLacksMode) is skipped; any other probe failure fails its rounds.
func planRounds(ctx context.Context, modes []string, probe func(context.Context, string) error) []*round {
	probed := map[string]error{}
	var out []*round
	for _, m := range modes {
		err, ok := probed[m]
		if !ok {
			err = probe(ctx, m)
			probed[m] = err
		}
		r := &round{mode: m}
		switch {
		case err == nil:
		case errors.Is(err, cluster.ErrModeUnknownToKproxy), errors.Is(err, cluster.ErrHostLacksMode):
			r.skip = err
		default:
			r.err = fmt.Errorf("probing mode %s: %w", m, err)
		}
		out = append(out, r)
	}
	return out
}

// runnable returns the rounds to run: neither skipped nor failed already.
func runnable(rounds []*round) []*round {
	var out []*round
	for _, r := range rounds {
		if r.skip == nil && r.err == nil {
			out = append(out, r)
		}
	}
	return out
}

// roundModes lists the distinct modes of rounds, in order.
func roundModes(rounds []*round) []string {
	var out []string
	for _, r := range rounds {
		if !slices.Contains(out, r.mode) {
			out = append(out, r.mode)
		}
	}
	return out
}

// loudSkip prints a skipped mode so that nobody misses it.
func loudSkip(r *round) {
	bar := strings.Repeat("#", 78)
	fmt.Fprintf(os.Stderr, "e2e: %s\ne2e: # SKIPPING mode=%s: %v\ne2e: %s\n", bar, r.mode, r.skip, bar)
}

// summary describes every round's outcome, one line each, and reports
// whether every round that was not skipped passed.
func summary(rounds []*round) (string, bool) {
	var b strings.Builder
	ok := true
	for i, r := range rounds {
		fmt.Fprintf(&b, "e2e: round %d/%d mode=%s: ", i+1, len(rounds), r.mode)
		switch {
		case r.skip != nil:
			fmt.Fprintf(&b, "SKIPPED: %v\n", r.skip)
		case r.err != nil:
			ok = false
			fmt.Fprintf(&b, "FAILED")
			if r.ran {
				fmt.Fprintf(&b, " in %s", r.took.Round(time.Second))
			}
			fmt.Fprintf(&b, ": %v\n", r.err)
			for _, name := range leafNames(r.failed) {
				fmt.Fprintf(&b, "e2e:     --- FAIL: %s\n", name)
			}
		case r.ran:
			fmt.Fprintf(&b, "ok in %s\n", r.took.Round(time.Second))
		default:
			ok = false
			fmt.Fprintf(&b, "NOT RUN\n")
		}
	}
	return b.String(), ok
}

// leafNames drops the names of tests that are parents of another name.
func leafNames(names []string) []string {
	var out []string
	for _, n := range names {
		if !slices.ContainsFunc(names, func(o string) bool { return strings.HasPrefix(o, n+"/") }) && !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out
}

// failureScanner collects the names of the failed tests from a test
// binary's output ("--- FAIL: <name> (...)", plain, -v or test2json).
type failureScanner struct {
	partial []byte
	names   []string
}

func (f *failureScanner) Write(p []byte) (int, error) {
	f.partial = append(f.partial, p...)
	for {
		i := bytes.IndexByte(f.partial, '\n')
		if i < 0 {
			break
		}
		f.line(string(f.partial[:i]))
		f.partial = f.partial[i+1:]
	}
	return len(p), nil
}

func (f *failureScanner) line(l string) {
	// test2json's framing byte is 0x16 (^V).
	rest, ok := strings.CutPrefix(strings.TrimLeft(l, " \t\x16"), "--- FAIL: ")
	if !ok {
		return
	}
	if name, _, _ := strings.Cut(rest, " "); name != "" {
		f.names = append(f.names, name)
	}
}

// latencyOutPath is where TestNetworkProgrammingLatency writes its
// summary in mode: out with "{mode}" replaced, or, when the run covers
// several modes, out with "-<mode>" before its extension.
func latencyOutPath(out, mode string, modes []string) string {
	if strings.Contains(out, "{mode}") {
		return strings.ReplaceAll(out, "{mode}", mode)
	}
	if len(modes) <= 1 {
		return out
	}
	ext := filepath.Ext(out)
	return strings.TrimSuffix(out, ext) + "-" + mode + ext
}

// kproxyRules returns kproxy's kernel state on node in the cluster's mode,
// a line each, without counters: iptables-save (iptables and ipvs modes),
// or the listing of every nftables table named like kproxy (nftables).
func (e *env) kproxyRules(ctx context.Context, node string) ([]string, error) {
	if e.c.Mode() != cluster.ModeNFTables {
		out, err := e.c.Exec(ctx, node, "iptables-save")
		if err != nil {
			return nil, fmt.Errorf("iptables-save on %s: %w", node, err)
		}
		return strings.Split(out, "\n"), nil
	}
	tables, err := e.nftKproxyTables(ctx, node)
	if err != nil {
		return nil, err
	}
	var lines []string
	for _, tbl := range tables {
		out, err := e.c.Exec(ctx, node, append([]string{"nft", "--stateless", "list"}, strings.Fields(tbl)...)...)
		if err != nil {
			return nil, fmt.Errorf("nft list %s on %s: %w", tbl, node, err)
		}
		lines = append(lines, strings.Split(out, "\n")...)
	}
	return lines, nil
}

// hasKproxyState reports whether kproxyRules found kproxy's own chains or
// tables at all.
func hasKproxyState(mode string, lines []string) bool {
	for _, l := range lines {
		l = strings.TrimSpace(l)
		if mode == cluster.ModeNFTables && strings.HasPrefix(l, "table ") ||
			mode != cluster.ModeNFTables && strings.HasPrefix(l, ":KPROXY-") {
			return true
		}
	}
	return false
}

// nftKproxyTables lists node's nftables tables whose name mentions
// kproxy, as "table <family> <name>"; none when nft is missing.
func (e *env) nftKproxyTables(ctx context.Context, node string) ([]string, error) {
	if _, err := exec.LookPath("nft"); err != nil {
		return nil, nil
	}
	out, err := e.c.Exec(ctx, node, "nft", "list", "tables")
	if err != nil {
		return nil, fmt.Errorf("nft list tables on %s: %w", node, err)
	}
	var tables []string
	for l := range strings.SplitSeq(out, "\n") {
		l = strings.TrimSpace(l)
		if strings.HasPrefix(l, "table ") && strings.Contains(strings.ToLower(l), "kproxy") {
			tables = append(tables, l)
		}
	}
	return tables, nil
}

// mentions returns the lines that name the namespace ns ("<ns>/") or one
// of the addresses ips (as a whole address).
func mentions(lines []string, ns string, ips ...string) []string {
	var res []*regexp.Regexp
	for _, ip := range ips {
		if ip != "" {
			res = append(res, regexp.MustCompile(`(^|[^0-9.])`+regexp.QuoteMeta(ip)+`($|[^0-9])`))
		}
	}
	var out []string
	for _, l := range lines {
		if strings.TrimSpace(l) == "" {
			continue
		}
		if ns != "" && strings.Contains(l, ns+"/") || slices.ContainsFunc(res, func(re *regexp.Regexp) bool { return re.MatchString(l) }) {
			out = append(out, l)
		}
	}
	return out
}

// modeConfigSection is the KubeProxyConfiguration section of mode's own
// settings: masquerade bit and sync periods.
func modeConfigSection(mode string) string {
	const periods = "  minSyncPeriod: 2s\n  syncPeriod: 20s\n"
	switch mode {
	case cluster.ModeNFTables:
		return "nftables:\n  masqueradeBit: 14\n" + periods
	case cluster.ModeIPVS:
		// IPVS mode takes its masquerade bit from the iptables section.
		return "iptables:\n  masqueradeBit: 14\nipvs:\n" + periods
	default:
		return "iptables:\n  masqueradeBit: 14\n" + periods
	}
}
