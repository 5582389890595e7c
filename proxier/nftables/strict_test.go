package nftables

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"

	"sigs.k8s.io/knftables"
)

// strictNFT is a knftables.Fake that also refuses what the kernel refuses
// and the Fake lets through:
//
//   - adding a map element whose key exists with another value (EEXIST:
//     a changed element must be deleted first);
//   - adding an element of an interval set that overlaps another;
//   - a transaction that leaves a rule or map element pointing at a
//     deleted chain, set or map (EBUSY).
//
// failRuns fails the next runs, as a kernel refusing a transaction would.
//
// refuse makes it refuse, in Run and Check alike, any transaction with a
// line it returns true for, as a kernel refuses an element it cannot take
// (a value an old API server let through, a missing kernel module): the
// error names the line as execNFT does ("(transaction line N)"), unless
// refuseNoLine, when it names nothing.
type strictNFT struct {
	*knftables.Fake
	failRuns int
	// failAt fails the failAt-th run (1-based; 0: none), failIf a run
	// it returns true for.
	failAt int
	failIf func(tx *knftables.Transaction) bool
	// failErr is the error of those failures (nil: an injected one).
	failErr      error
	runs         int
	refuse       func(line string) bool
	refuseNoLine bool
	// refusals counts the transactions refused, checks the Check calls.
	refusals, checks int
}

// refusal is the error of a transaction refuse refuses, or nil.
func (s *strictNFT) refusal(tx *knftables.Transaction) error {
	if s.refuse == nil {
		return nil
	}
	var msgs []string
	for i, line := range strings.Split(tx.String(), "\n") {
		if line == "" || !s.refuse(line) {
			continue
		}
		if s.refuseNoLine {
			return errors.New("Error: Could not process rule: Operation not supported")
		}
		n := i + 1
		msgs = append(msgs, fmt.Sprintf("/dev/stdin:%d:1-%d (transaction line %d): Error: Could not process rule: Operation not supported\n%s", n, len(line), n, line))
	}
	if len(msgs) == 0 {
		return nil
	}
	s.refusals++
	return errors.New(strings.Join(msgs, "\n"))
}

// Check is part of knftables.Interface: the refusals and element checks
// of Run, without running it.
func (s *strictNFT) Check(ctx context.Context, tx *knftables.Transaction) error {
	s.checks++
	if err := s.refusal(tx); err != nil {
		return err
	}
	if err := s.checkElements(tx); err != nil {
		return err
	}
	return s.Fake.Check(ctx, tx)
}

var elemLine = regexp.MustCompile(`^(add|delete) element \S+ \S+ (\S+) \{ (.*) \}$`)
var commentPart = regexp.MustCompile(` comment "[^"]*"`)
var flushLine = regexp.MustCompile(`^(flush|delete) (map|set) \S+ \S+ (\S+)`)

func (s *strictNFT) Run(ctx context.Context, tx *knftables.Transaction) error {
	s.runs++
	if s.runs == s.failAt || (s.failIf != nil && s.failIf(tx)) {
		if s.failErr != nil {
			return s.failErr
		}
		return errors.New("injected transaction failure")
	}
	if s.failRuns > 0 {
		s.failRuns--
		return errors.New("injected transaction failure")
	}
	if err := s.refusal(tx); err != nil {
		return err
	}
	if err := s.checkElements(tx); err != nil {
		return err
	}
	before := s.Fake.Dump()
	if err := s.Fake.Run(ctx, tx); err != nil {
		return err
	}
	if err := s.checkRefs(); err != nil {
		s.restore(before)
		return err
	}
	return nil
}

// checkElements replays the transaction's element operations over the
// current elements.
func (s *strictNFT) checkElements(tx *knftables.Transaction) error {
	s.RLock()
	elems := map[string]map[string]string{}
	interval := map[string]bool{}
	if s.Table != nil {
		for name, m := range s.Table.Maps {
			elems[name] = map[string]string{}
			for _, e := range m.Elements {
				elems[name][strings.Join(e.Key, " . ")] = strings.Join(e.Value, " . ")
			}
		}
		for name, set := range s.Table.Sets {
			elems[name] = map[string]string{}
			for _, e := range set.Elements {
				elems[name][strings.Join(e.Key, " . ")] = ""
			}
			interval[name] = slices.Contains(set.Flags, knftables.IntervalFlag)
		}
	}
	s.RUnlock()
	for _, line := range strings.Split(tx.String(), "\n") {
		if m := flushLine.FindStringSubmatch(line); m != nil {
			elems[m[3]] = map[string]string{}
			continue
		}
		if strings.HasPrefix(line, "add set ") {
			interval[strings.Fields(line)[4]] = strings.Contains(line, "flags interval")
			continue
		}
		m := elemLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		name, body := m[2], commentPart.ReplaceAllString(m[3], "")
		key, value, _ := strings.Cut(body, " : ")
		if elems[name] == nil {
			elems[name] = map[string]string{}
		}
		if m[1] == "delete" {
			delete(elems[name], key)
			continue
		}
		if old, ok := elems[name][key]; ok && old != value {
			return fmt.Errorf("%s: File exists (element %s holds %q)", line, key, old)
		}
		if interval[name] {
			for other := range elems[name] {
				if other != key && overlaps(other, key) {
					return fmt.Errorf("%s: File exists (overlaps %s)", line, other)
				}
			}
		}
		elems[name][key] = value
	}
	return nil
}

// overlaps reports whether two interval-set keys overlap.
func overlaps(a, b string) bool {
	pa, pb := strings.Split(a, " . "), strings.Split(b, " . ")
	if len(pa) != len(pb) {
		return false
	}
	for i := range pa {
		x, err1 := netip.ParsePrefix(withLen(pa[i]))
		y, err2 := netip.ParsePrefix(withLen(pb[i]))
		if err1 != nil || err2 != nil {
			if pa[i] != pb[i] {
				return false
			}
			continue
		}
		if !x.Overlaps(y) {
			return false
		}
	}
	return true
}

func withLen(s string) string {
	if strings.Contains(s, "/") {
		return s
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return netip.PrefixFrom(a, a.BitLen()).String()
	}
	return s
}

// checkRefs verifies that every rule and element points at objects that
// exist.
func (s *strictNFT) checkRefs() error {
	s.RLock()
	defer s.RUnlock()
	t := s.Table
	if t == nil {
		return nil
	}
	target := func(words []string) error {
		for i, w := range words {
			if (w == "goto" || w == "jump") && i+1 < len(words) && t.Chains[words[i+1]] == nil {
				return fmt.Errorf("reference to deleted chain %s: Device or resource busy", words[i+1])
			}
			if strings.HasPrefix(w, "@") {
				if n := w[1:]; t.Sets[n] == nil && t.Maps[n] == nil {
					return fmt.Errorf("reference to deleted set %s: Device or resource busy", n)
				}
			}
		}
		return nil
	}
	for _, c := range t.Chains {
		for _, r := range c.Rules {
			if err := target(strings.Fields(r.Rule)); err != nil {
				return err
			}
		}
	}
	for _, m := range t.Maps {
		for _, e := range m.Elements {
			if err := target(e.Value); err != nil {
				return err
			}
			if len(e.Value) == 1 {
				if err := target(strings.Fields(e.Value[0])); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// restore puts back a dump taken before a refused transaction.
func (s *strictNFT) restore(dump string) {
	tx := s.Fake.NewTransaction()
	tx.Add(&knftables.Table{})
	tx.Delete(&knftables.Table{})
	if err := s.Fake.Run(context.Background(), tx); err != nil {
		panic(err)
	}
	if dump != "" {
		if err := s.Fake.ParseDump(dump); err != nil {
			panic(err)
		}
	}
}
