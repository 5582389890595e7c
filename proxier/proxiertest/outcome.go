package proxiertest

import (
	"fmt"
	"strings"
)

// TracedOutcome is one way a traced packet may end, as a fake kernel's
// tracer reports it.
type TracedOutcome struct {
	// Verdict is the final verdict as the ruleset spells it: drop and
	// reject (in either case) are Dropped and Rejected; any other accepts.
	Verdict string
	// DNAT is the endpoint ("ip:port") the packet is DNATed to, "" for none.
	DNAT       string
	Masquerade bool
}

// FoldOutcomes folds every way a flow may end into its Result. The
// outcomes must agree on the verdict, and an endpoint must be reached
// either always or never masqueraded.
func FoldOutcomes(outs []TracedOutcome) (Result, error) {
	res := Result{Endpoints: map[string]bool{}}
	verdicts := map[Verdict]bool{}
	for _, o := range outs {
		var v Verdict
		switch {
		case strings.EqualFold(o.Verdict, "drop"):
			v = Dropped
		case strings.EqualFold(o.Verdict, "reject"):
			v = Rejected
		case o.DNAT != "":
			v = Delivered
			if prev, seen := res.Endpoints[o.DNAT]; seen && prev != o.Masquerade {
				return res, fmt.Errorf("endpoint %s reached both with and without masquerade", o.DNAT)
			}
			res.Endpoints[o.DNAT] = o.Masquerade
		default:
			v = NotHandled
		}
		res.Masquerade = res.Masquerade || o.Masquerade
		verdicts[v] = true
	}
	if len(verdicts) != 1 {
		return res, fmt.Errorf("flow has mixed outcomes %+v", outs)
	}
	for v := range verdicts {
		res.Verdict = v
	}
	return res, nil
}
