package iptables

import (
	"context"
	"errors"
	"strings"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// setAsideSearch is one sync's search for the service ports whose rules
// the kernel refuses (docs/design.md, "Set-aside services"). Each attempt
// writes the whole rule set (the writers carry only what differs from what
// they last applied); a refused attempt leaves the tables it did not reach
// as they were.
type setAsideSearch struct {
	b *Backend
	p *syncPlan
	// excluded are the ports set aside so far, with what they get instead.
	excluded map[proxy.ServicePortName]fallback
	// refusals are the errors that set them aside.
	refusals map[proxy.ServicePortName]error
	full     fullWrites
	stats    ipt.WriteStats
	attempts int
	// cur is the rendering of the last accepted attempt; failed reports
	// that the last attempt failed.
	cur    map[proxy.ServicePortName]*renderedService
	failed bool
	// owners map chains and rule texts to the candidate that renders
	// them, built on the first failure.
	owners map[string]proxy.ServicePortName
}

// try writes the plan with the current exclusions.
func (s *setAsideSearch) try(ctx context.Context) error {
	s.attempts++
	cur := s.b.with(s.p, s.excluded)
	st, err := s.b.write(ctx, s.p, cur, s.excluded, &s.full)
	s.stats.Add(st)
	s.failed = err != nil
	if err == nil {
		s.cur = cur
	}
	return err
}

// run writes the plan, setting aside what the kernel refuses, and returns
// the rendering the kernel now holds. A failure that no candidate port
// explains is returned.
func (s *setAsideSearch) run(ctx context.Context) (map[proxy.ServicePortName]*renderedService, error) {
	s.full = fullWrites{nat: s.p.full, filter: s.p.full}
	err := s.try(ctx)
	for err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		if !ipt.Refused(err) {
			return nil, err // it failed to run: nothing to set aside
		}
		name, ok := s.blame(err)
		if !ok {
			if err := s.bisect(ctx, err); err != nil {
				return nil, err
			}
			break
		}
		// The port's new rules were refused: it gets its last good ones;
		// when those are refused too, none.
		switch s.excluded[name] {
		case 0:
			s.excluded[name] = s.fallbackOf(name)
		case keepOld:
			s.excluded[name] = keepNone
		default:
			return nil, err // refused without rules of its own: not its doing
		}
		s.refusals[name] = err
		err = s.try(ctx)
	}
	return s.cur, nil
}

// fallbackOf is what a port set aside gets first: its last good rules when
// it has any.
func (s *setAsideSearch) fallbackOf(name proxy.ServicePortName) fallback {
	if _, ok := s.b.services[name]; ok {
		return keepOld
	}
	return keepNone
}

// blame returns the candidate port whose rule or chain iptables-restore
// named, when it named one of a candidate's.
func (s *setAsideSearch) blame(err error) (proxy.ServicePortName, bool) {
	var ae *ipt.ApplyError
	if !errors.As(err, &ae) || ae.Line == 0 {
		return proxy.ServicePortName{}, false
	}
	args, perr := ipt.SplitArgs(ae.Text)
	if perr != nil || len(args) == 0 {
		return proxy.ServicePortName{}, false
	}
	var chain string
	switch {
	case strings.HasPrefix(args[0], ":"):
		chain = args[0][1:]
	case len(args) >= 2 && strings.HasPrefix(args[0], "-"):
		chain = args[1]
	default:
		return proxy.ServicePortName{}, false // COMMIT, a table line
	}
	owners := s.ownerIndex()
	if name, ok := owners[chain]; ok {
		return name, true
	}
	if args[0] == "-A" {
		if name, ok := owners[strings.TrimPrefix(ae.Text, "-A "+chain+" ")]; ok {
			return name, true
		}
	}
	return proxy.ServicePortName{}, false
}

// ownerIndex maps the chains of every candidate port and the rules it
// contributes to shared chains (now, or in the last sync's filter rules,
// which a sync keeps while nat changes) to the port. Rules contributed by
// several ports (hairpin masquerades) are no one's.
func (s *setAsideSearch) ownerIndex() map[string]proxy.ServicePortName {
	if s.owners != nil {
		return s.owners
	}
	s.owners = map[string]proxy.ServicePortName{}
	shared := map[string]bool{}
	add := func(key string, name proxy.ServicePortName) {
		if prev, ok := s.owners[key]; ok && prev != name {
			shared[key] = true
		}
		s.owners[key] = name
	}
	for name := range s.p.candidates {
		h := servicePortChains(name)
		for _, kind := range []string{kindCluster, kindLocal, kindExternal, kindFirewall} {
			add(h.chain(kind), name)
		}
		for _, rs := range []*renderedService{s.p.next[name], s.b.services[name]} {
			if rs == nil {
				continue
			}
			f := rs.filter()
			for _, list := range [][]dispatchRule{rs.natServices, rs.natNodePorts, f.services, f.external} {
				for _, r := range list {
					add(r.body, name)
				}
			}
			for _, list := range [][]string{f.extNodePorts, f.firewall, f.healthCheck} {
				for _, r := range list {
					add(r, name)
				}
			}
		}
	}
	for key := range shared {
		delete(s.owners, key)
	}
	return s.owners
}

// suspects are the candidate ports not set aside yet that the failed
// restore concerned: those whose chains it wrote, or, when it wrote a
// shared chain, every port with rules in that table.
func (s *setAsideSearch) suspects(err error) []proxy.ServicePortName {
	var open []proxy.ServicePortName
	for _, name := range proxy.SortedServicePortNames(s.p.next) {
		if s.p.candidates[name] && s.excluded[name] == 0 {
			open = append(open, name)
		}
	}
	var ae *ipt.ApplyError
	if !errors.As(err, &ae) {
		return open
	}
	owners := s.ownerIndex()
	concerned := map[proxy.ServicePortName]bool{}
	sharedIn := map[ipt.Table]bool{}
	for _, m := range []map[ipt.Table][]string{ae.Written, ae.Deleted} {
		for table, chains := range m {
			for _, c := range chains {
				if name, ok := owners[c]; ok && table == ipt.TableNAT {
					concerned[name] = true
				} else {
					sharedIn[table] = true
				}
			}
		}
	}
	if sharedIn[ipt.TableNAT] {
		return open
	}
	var out []proxy.ServicePortName
	for _, name := range open {
		hasFilter := func(rs *renderedService) bool { return rs != nil && !rs.filter().empty() }
		if concerned[name] || sharedIn[ipt.TableFilter] && (hasFilter(s.p.next[name]) || hasFilter(s.b.services[name])) {
			out = append(out, name)
		}
	}
	return out
}

// bisect finds the ports to set aside when the refusal named no line of a
// candidate's (iptables-legacy-restore names the COMMIT of a table the
// kernel refused): it checks that the rule set is accepted with every
// suspect set aside, then brings the suspects back half by half.
func (s *setAsideSearch) bisect(ctx context.Context, failure error) error {
	suspects := s.suspects(failure)
	if len(suspects) == 0 {
		return failure
	}
	for _, name := range suspects {
		s.excluded[name] = s.fallbackOf(name)
	}
	// When the suspects' last good rules are refused too (the kernel
	// changed), they start without rules, and the ones found keep their
	// last good rules afterwards if those are accepted.
	withoutRules := false
	if err := s.try(ctx); err != nil {
		if ctx.Err() != nil {
			return err
		}
		for _, name := range suspects {
			s.excluded[name] = keepNone
		}
		if err := s.try(ctx); err != nil {
			return failure // not the suspects' doing
		}
		withoutRules = true
	}
	half := len(suspects) / 2
	for _, g := range [][]proxy.ServicePortName{suspects[:half], suspects[half:]} {
		if err := s.refine(ctx, g); err != nil {
			return err
		}
	}
	if withoutRules {
		for _, name := range suspects {
			if s.excluded[name] != keepNone || s.fallbackOf(name) != keepOld {
				continue
			}
			s.excluded[name] = keepOld
			if err := s.try(ctx); err != nil {
				if ctx.Err() != nil {
					return err
				}
				s.excluded[name] = keepNone
			}
		}
	}
	if s.failed {
		if err := s.try(ctx); err != nil {
			return err
		}
	}
	return nil
}

// refine brings back the ports of group, which are set aside, and sets
// aside again those whose rules are refused, half by half.
func (s *setAsideSearch) refine(ctx context.Context, group []proxy.ServicePortName) error {
	if len(group) == 0 {
		return nil
	}
	saved := make([]fallback, len(group))
	for i, name := range group {
		saved[i] = s.excluded[name]
		delete(s.excluded, name)
	}
	err := s.try(ctx)
	if err == nil {
		return nil
	}
	if ctx.Err() != nil {
		return err
	}
	for i, name := range group {
		s.excluded[name] = saved[i]
	}
	if len(group) == 1 {
		s.refusals[group[0]] = err
		return nil
	}
	half := len(group) / 2
	if err := s.refine(ctx, group[:half]); err != nil {
		return err
	}
	return s.refine(ctx, group[half:])
}
