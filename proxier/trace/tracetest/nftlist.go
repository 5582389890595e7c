// Package tracetest helps tests feed kproxy trace with rules rendered into
// fakes: a knftables.Fake printed as `nft list table` prints it, and a
// trace.Source answering `nft list table` with it.
package tracetest

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"
)

// NFTListing answers `nft list table FAMILY TABLE` with the fake's table as
// nft prints it, and fails for any other table as nft does: a
// trace.Source's NFT.
func NFTListing(fake *knftables.Fake, family knftables.Family, table string) func(ctx context.Context, args ...string) ([]byte, error) {
	return func(_ context.Context, args ...string) ([]byte, error) {
		want := []string{"list", "table", string(family), table}
		if strings.Join(args, " ") != strings.Join(want, " ") {
			return nil, errors.New("Error: No such file or directory")
		}
		return []byte(NFTList(fake, family, table)), nil
	}
}

// NFTList prints a fake's table as `nft list table` (nft 1.0) prints it:
// sets, maps and chains in blocks, named priorities, hexadecimal
// constants zero-padded to 32 bits, elements in braces over several
// lines. The real-kernel test reads the real nft's listing instead.
func NFTList(fake *knftables.Fake, family knftables.Family, table string) string {
	fake.RLock()
	defer fake.RUnlock()
	t := fake.Table
	var b strings.Builder
	fmt.Fprintf(&b, "table %s %s {\n", family, table)
	if t.Comment != nil {
		fmt.Fprintf(&b, "\tcomment %q\n", *t.Comment)
	}
	elements := func(elems []*knftables.Element) {
		if len(elems) == 0 {
			return
		}
		var out []string
		for _, e := range elems {
			s := strings.Join(e.Key, " . ")
			if e.Comment != nil {
				s += fmt.Sprintf(" comment %q", *e.Comment)
			}
			if e.Value != nil {
				s += " : " + strings.Join(e.Value, " . ")
			}
			out = append(out, s)
		}
		b.WriteString("\t\telements = { " + strings.Join(out, ",\n\t\t\t     ") + " }\n")
	}
	for _, name := range sortedKeys(t.Sets) {
		s := t.Sets[name]
		fmt.Fprintf(&b, "\tset %s {\n", name)
		if s.TypeOf != "" {
			fmt.Fprintf(&b, "\t\ttypeof %s\n", s.TypeOf)
		} else {
			fmt.Fprintf(&b, "\t\ttype %s\n", s.Type)
		}
		if len(s.Flags) > 0 {
			var fl []string
			for _, f := range s.Flags {
				fl = append(fl, string(f))
			}
			fmt.Fprintf(&b, "\t\tflags %s\n", strings.Join(fl, ","))
		}
		if s.Timeout != nil {
			fmt.Fprintf(&b, "\t\ttimeout %dh\n", int(s.Timeout.Hours()))
		}
		elements(s.Elements)
		b.WriteString("\t}\n\n")
	}
	for _, name := range sortedKeys(t.Maps) {
		m := t.Maps[name]
		fmt.Fprintf(&b, "\tmap %s {\n", name)
		if m.TypeOf != "" {
			fmt.Fprintf(&b, "\t\ttypeof %s\n", m.TypeOf)
		} else {
			fmt.Fprintf(&b, "\t\ttype %s\n", m.Type)
		}
		elements(m.Elements)
		b.WriteString("\t}\n\n")
	}
	for _, name := range sortedKeys(t.Chains) {
		c := t.Chains[name]
		fmt.Fprintf(&b, "\tchain %s {\n", name)
		if c.Hook != nil {
			prio, _ := strconv.Atoi(string(*c.Priority))
			fmt.Fprintf(&b, "\t\ttype %s hook %s priority %s; policy accept;\n", *c.Type, *c.Hook, namedPriority(*c.Hook, prio))
		}
		for _, r := range c.Rules {
			fmt.Fprintf(&b, "\t\t%s\n", nftRuleText(padHex(r.Rule)))
		}
		b.WriteString("\t}\n\n")
	}
	b.WriteString("}\n")
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// namedPriority names a priority as nft prints it in the ip and ip6
// families.
func namedPriority(hook knftables.BaseChainHook, p int) string {
	base := map[knftables.BaseChainHook][]struct {
		name string
		val  int
	}{
		knftables.PreroutingHook:  {{"dstnat", -100}, {"filter", 0}},
		knftables.InputHook:       {{"filter", 0}},
		knftables.ForwardHook:     {{"filter", 0}},
		knftables.OutputHook:      {{"filter", 0}},
		knftables.PostroutingHook: {{"srcnat", 100}, {"filter", 0}},
	}[hook]
	for _, n := range base {
		switch d := p - n.val; {
		case d == 0:
			return n.name
		case d > 0 && d <= 10:
			return fmt.Sprintf("%s + %d", n.name, d)
		case d < 0 && d >= -10:
			return fmt.Sprintf("%s - %d", n.name, -d)
		}
	}
	return strconv.Itoa(p)
}

var hexConst = regexp.MustCompile(`\b0x[0-9a-f]+\b`)

// padHex prints mark constants as nft does: 0x00004000, and a zero they
// are compared with as 0x00000000.
func padHex(r string) string {
	r = hexConst.ReplaceAllStringFunc(r, func(h string) string {
		n, _ := strconv.ParseUint(h[2:], 16, 32)
		return fmt.Sprintf("0x%08x", n)
	})
	if strings.Contains(r, "meta mark & ") {
		r = strings.Replace(r, " != 0 ", " != 0x00000000 ", 1)
	}
	return r
}

var (
	secondsTimeout = regexp.MustCompile(`timeout ([0-9]+)s\b`)
	numgenEqual    = regexp.MustCompile(`numgen random mod ([0-9]+) == ([0-9]+)\b`)
)

// nftRuleText writes a rule as kproxy wrote it (and knftables' fake keeps
// it) the way nft lists it: a timeout in days, hours, minutes and seconds,
// zero parts left out ("timeout 3h" for "timeout 10800s"), and an
// equality without its "==" ("numgen random mod 2 0").
func nftRuleText(rule string) string {
	rule = numgenEqual.ReplaceAllString(rule, "numgen random mod $1 $2")
	return secondsTimeout.ReplaceAllStringFunc(rule, func(m string) string {
		n, err := strconv.Atoi(secondsTimeout.FindStringSubmatch(m)[1])
		if err != nil || n == 0 {
			return m
		}
		var b strings.Builder
		for _, u := range []struct {
			secs int
			name string
		}{{86400, "d"}, {3600, "h"}, {60, "m"}, {1, "s"}} {
			if n >= u.secs {
				fmt.Fprintf(&b, "%d%s", n/u.secs, u.name)
				n %= u.secs
			}
		}
		return "timeout " + b.String()
	})
}
