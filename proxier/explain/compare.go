package explain

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/kproxy/kproxy/proxier/trace"
)

// Results of a live comparison.
const (
	// Agree: the rules do with the packet what the model decides.
	Agree = "agree"
	// Mismatch: they do something else; the rules are stale or were
	// changed by someone else.
	Mismatch = "mismatch"
	// Skipped: nothing to compare with (no kproxy state for the mode on
	// this node, or the mode cannot be traced).
	Skipped = "skipped"
	// Failed: the rules could not be read or traced.
	Failed = "failed"
)

// Tracer traces one packet over the node's live rules: trace.Run over the
// node's trace.Source, or over rules rendered into fakes in tests.
type Tracer func(ctx context.Context, r trace.Request) (*trace.Report, error)

// LiveCheck is what the node's rules do with a flow's packet, next to the
// model's decision.
type LiveCheck struct {
	// Result is Agree, Mismatch, Skipped or Failed.
	Result string `json:"result"`
	// Mode is the proxy mode whose rules were traced.
	Mode string `json:"mode,omitempty"`
	// Verdict, Endpoints and Reason are the trace's.
	Verdict   string   `json:"verdict,omitempty"`
	Endpoints []string `json:"endpoints,omitempty"`
	Reason    string   `json:"reason,omitempty"`
	// Detail says what differs, or why nothing was compared.
	Detail string `json:"detail,omitempty"`
}

// Live sums up the comparison of every flow.
type Live struct {
	// Result is Mismatch when any flow mismatches, else Failed when any
	// failed, else Agree when any agreed, else Skipped.
	Result string `json:"result"`
	Mode   string `json:"mode,omitempty"`
	// Counts of flows per result.
	Agree, Mismatch, Skipped, Failed int            `json:"-"`
	Counts                           map[string]int `json:"counts"`
	// Detail says why the comparison was skipped or failed.
	Detail string `json:"detail,omitempty"`
}

// Compare traces every flow over the node's rules of mode ("" for the mode
// whose state the node holds) and records whether they agree with the
// model. A family whose rules cannot be read (no kproxy state, a mode that
// cannot be traced) is skipped after its first flow.
func (x *Explanation) Compare(ctx context.Context, mode string, tr Tracer) {
	live := &Live{Mode: mode, Counts: map[string]int{}}
	skip := map[string]*LiveCheck{}
	for _, p := range x.Ports {
		for _, fl := range p.Flows {
			if c := skip[p.Family]; c != nil {
				cc := *c
				fl.Live = &cc
			} else {
				fl.Live = check(ctx, fl, mode, tr)
				if fl.Live.Result == Skipped || fl.Live.Result == Failed {
					skip[p.Family] = fl.Live
				}
			}
			c := fl.Live
			live.Counts[c.Result]++
			if c.Mode != "" {
				live.Mode = c.Mode
			}
			if (c.Result == Skipped || c.Result == Failed) && !strings.Contains(live.Detail, c.Detail) {
				live.Detail = strings.TrimPrefix(live.Detail+"; "+c.Detail, "; ")
			}
		}
	}
	live.Agree, live.Mismatch, live.Skipped, live.Failed = live.Counts[Agree], live.Counts[Mismatch], live.Counts[Skipped], live.Counts[Failed]
	switch {
	case live.Mismatch > 0:
		live.Result = Mismatch
	case live.Failed > 0:
		live.Result = Failed
	case live.Agree > 0:
		live.Result = Agree
	default:
		live.Result = Skipped
	}
	x.Live = live
}

// requestOf is the trace request of a flow.
func requestOf(fl *Flow, mode string) trace.Request {
	from := trace.FromExternal
	switch fl.Source {
	case SourcePod:
		from = trace.FromPod
	case SourceNode:
		from = trace.FromNode
	}
	return trace.Request{
		Source: netip.MustParseAddr(fl.SourceAddress), Destination: netip.MustParseAddr(fl.Address),
		Protocol: fl.Protocol, DestinationPort: fl.Port, From: from, Mode: mode,
	}
}

// check traces one flow and compares.
func check(ctx context.Context, fl *Flow, mode string, tr Tracer) *LiveCheck {
	rep, err := tr(ctx, requestOf(fl, mode))
	switch {
	case errors.Is(err, trace.ErrNoState):
		return &LiveCheck{Result: Skipped, Mode: mode, Detail: fmt.Sprintf("nothing to compare with: %v", err)}
	case err != nil:
		return &LiveCheck{Result: Failed, Mode: mode, Detail: "tracing the node's rules: " + err.Error()}
	}
	c := &LiveCheck{Mode: rep.Mode, Verdict: rep.Verdict, Reason: rep.Reason}
	masq := map[bool]bool{}
	for _, e := range rep.Endpoints {
		c.Endpoints = append(c.Endpoints, e.Address)
		masq[e.Masquerade] = true
	}
	slices.Sort(c.Endpoints)
	want := slices.Clone(fl.Endpoints)
	slices.Sort(want)

	var diffs []string
	switch {
	case rep.Verdict != fl.Verdict:
		diffs = append(diffs, fmt.Sprintf("rules %s, model says %s", rulesSay(rep, c.Endpoints), modelSays(fl)))
	case fl.Verdict == Delivered && !slices.Equal(c.Endpoints, want):
		diffs = append(diffs, fmt.Sprintf("rules deliver to %s, model says deliver to %s", listOr(c.Endpoints), listOr(want)))
	}
	if len(diffs) == 0 && fl.Verdict == Delivered {
		if len(masq) > 1 || masq[!fl.Masquerade] {
			diffs = append(diffs, fmt.Sprintf("rules masquerade: %s, model says masquerade: %s", yesNo(masq[true], len(masq) > 1), yesNo(fl.Masquerade, false)))
		}
		if rep.AffinitySeconds != fl.AffinitySeconds {
			diffs = append(diffs, fmt.Sprintf("rules keep ClientIP affinity %ds, model says %ds", rep.AffinitySeconds, fl.AffinitySeconds))
		}
	}
	if len(diffs) == 0 {
		c.Result = Agree
		return c
	}
	c.Result = Mismatch
	c.Detail = strings.Join(diffs, "; ") + ": the rules are stale or were changed by someone else"
	return c
}

func rulesSay(rep *trace.Report, eps []string) string {
	switch rep.Verdict {
	case trace.Delivered:
		return "deliver to " + listOr(eps)
	case trace.Dropped:
		return "drop it (" + rep.Reason + ")"
	case trace.Rejected:
		return "reject it (" + rep.Reason + ")"
	case trace.NotHandled:
		return "do not handle it (no kproxy rule matches)"
	}
	return rep.Verdict + " (" + rep.Reason + ")"
}

func modelSays(fl *Flow) string {
	if fl.Verdict == Delivered {
		return "deliver to " + listOr(fl.Endpoints)
	}
	return fl.Reason
}

func listOr(eps []string) string {
	if len(eps) == 0 {
		return "no endpoint"
	}
	return strings.Join(eps, ", ")
}

func yesNo(b, some bool) string {
	switch {
	case some:
		return "for some endpoints"
	case b:
		return "yes"
	}
	return "no"
}
