package trace

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"sigs.k8s.io/knftables"
)

// This file reads kproxy's nftables table as `nft list table` prints it
// into a knftables.Fake, which the nftables tracer (package nftablestest)
// walks. Only what the tracer needs is kept: base chains with their type,
// hook and priority, every rule, and every element of every set and map
// except the dynamic sets (session affinity entries: a first packet finds
// none).

// ParseNFTList reads the output of `nft list table FAMILY kproxy` into a
// fake bound to that family and table.
func ParseNFTList(text string, family knftables.Family, table string) (*knftables.Fake, error) {
	fake := knftables.NewFake(family, table)
	tx := fake.NewTransaction()
	tx.Add(&knftables.Table{})
	var rules, elems []knftables.Object
	lines := strings.Split(text, "\n")
	depth := 0
	var chain, set string
	var isMap, dynamic bool
	var setObj knftables.Object
	sawTable := false
	for i := 0; i < len(lines); i++ {
		line := strings.TrimSpace(lines[i])
		lineNo := i + 1
		bad := func(format string, args ...any) error {
			return fmt.Errorf("nft list line %d %q: %s", lineNo, line, fmt.Sprintf(format, args...))
		}
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
			continue
		case line == "}":
			if depth == 0 {
				return nil, bad("unbalanced }")
			}
			if depth == 2 && setObj != nil {
				tx.Add(setObj)
				setObj = nil
			}
			depth--
			chain, set = "", ""
			continue
		}
		switch depth {
		case 0:
			f := strings.Fields(line)
			if len(f) != 4 || f[0] != "table" || f[3] != "{" {
				return nil, bad("expected a table")
			}
			if knftables.Family(f[1]) != family || f[2] != table {
				return nil, bad("table %s %s, want %s %s", f[1], f[2], family, table)
			}
			sawTable = true
			depth = 1
		case 1:
			f := strings.Fields(line)
			switch {
			case len(f) == 3 && f[0] == "chain" && f[2] == "{":
				chain = f[1]
				depth = 2
				c := &knftables.Chain{Name: chain}
				// The chain's header, if any, is its first line.
				if i+1 < len(lines) {
					if h := strings.TrimSpace(lines[i+1]); strings.HasPrefix(h, "type ") && strings.Contains(h, " hook ") {
						if err := parseChainHeader(c, h, family); err != nil {
							return nil, fmt.Errorf("nft list line %d %q: %w", lineNo+1, h, err)
						}
						i++
					}
				}
				tx.Add(c)
			case len(f) == 3 && (f[0] == "set" || f[0] == "map") && f[2] == "{":
				set, isMap, dynamic = f[1], f[0] == "map", false
				if isMap {
					setObj = &knftables.Map{Name: set}
				} else {
					setObj = &knftables.Set{Name: set}
				}
				depth = 2
			case f[0] == "comment" || f[0] == "flags":
				// the table's comment or flags
			case len(f) >= 2 && f[len(f)-1] == "{":
				// another kind of object (counter, flowtable): skip it
				depth = 2
			default:
				return nil, bad("unexpected line in the table")
			}
		case 2:
			if chain != "" {
				r := strings.TrimSpace(normalizeRule(line))
				rules = append(rules, &knftables.Rule{Chain: chain, Rule: r})
				continue
			}
			if set == "" {
				continue // inside a skipped object
			}
			key, rest, _ := strings.Cut(line, " ")
			switch key {
			case "type", "typeof":
				setType(setObj, key, rest)
			case "flags":
				for _, fl := range strings.Split(rest, ",") {
					fl = strings.TrimSpace(fl)
					if fl == string(knftables.DynamicFlag) {
						dynamic = true
					}
					setFlags(setObj, knftables.SetFlag(fl))
				}
			case "elements":
				// "elements = { a, b,\n c }": up to the closing brace
				// outside quotes.
				body := strings.TrimSpace(strings.TrimPrefix(rest, "="))
				for !closedBrace(body) {
					i++
					if i >= len(lines) {
						return nil, bad("elements without their closing brace")
					}
					body += " " + strings.TrimSpace(lines[i])
				}
				body = strings.TrimSpace(body)
				body = strings.TrimSuffix(strings.TrimPrefix(body, "{"), "}")
				if dynamic {
					continue
				}
				for _, e := range splitOutsideQuotes(body, ',') {
					el, err := parseElement(strings.TrimSpace(e), set, isMap)
					if err != nil {
						return nil, bad("%v", err)
					}
					if el != nil {
						elems = append(elems, el)
					}
				}
			default:
				// size, timeout, policy, counter, auto-merge, ...
			}
		default:
			return nil, bad("nesting too deep")
		}
	}
	if !sawTable {
		return nil, fmt.Errorf("no table %s %s in the listing", family, table)
	}
	if depth != 0 {
		return nil, fmt.Errorf("the listing ends inside a block")
	}
	for _, r := range rules {
		tx.Add(r)
	}
	for _, e := range elems {
		tx.Add(e)
	}
	if err := fake.Run(context.Background(), tx); err != nil {
		return nil, fmt.Errorf("loading the listed table: %w", err)
	}
	return fake, nil
}

// parseChainHeader reads "type nat hook prerouting priority dstnat; policy
// accept;".
func parseChainHeader(c *knftables.Chain, h string, family knftables.Family) error {
	for _, part := range strings.Split(h, ";") {
		f := strings.Fields(part)
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "type":
			if len(f) < 6 || f[2] != "hook" || f[4] != "priority" {
				return fmt.Errorf("bad chain header")
			}
			t := knftables.BaseChainType(f[1])
			hook := knftables.BaseChainHook(f[3])
			prio, err := knftables.ParsePriority(family, strings.Join(f[5:], ""))
			if err != nil {
				return err
			}
			p := knftables.BaseChainPriority(strconv.Itoa(prio))
			c.Type, c.Hook, c.Priority = &t, &hook, &p
		case "policy":
			if len(f) != 2 {
				return fmt.Errorf("bad policy")
			}
			pol := knftables.BaseChainPolicy(f[1])
			c.Policy = &pol
		case "device", "flags", "comment":
		default:
			return fmt.Errorf("unknown chain property %q", f[0])
		}
	}
	return nil
}

func setType(o knftables.Object, key, v string) {
	switch s := o.(type) {
	case *knftables.Set:
		if key == "type" {
			s.Type = v
		} else {
			s.TypeOf = v
		}
	case *knftables.Map:
		if key == "type" {
			s.Type = v
		} else {
			s.TypeOf = v
		}
	}
}

func setFlags(o knftables.Object, fl knftables.SetFlag) {
	switch s := o.(type) {
	case *knftables.Set:
		s.Flags = append(s.Flags, fl)
	case *knftables.Map:
		s.Flags = append(s.Flags, fl)
	}
}

// hexNumber is a hexadecimal constant, which nft prints zero-padded to the
// width of its field (0x00004000).
var hexNumber = regexp.MustCompile(`\b0x[0-9a-f]+\b`)

// normalizeRule turns a rule as nft lists it back into the way kproxy
// writes it: constants without padding, a zero compared without hex.
func normalizeRule(r string) string {
	if i := strings.Index(r, " # handle "); i >= 0 {
		r = r[:i]
	}
	r = hexNumber.ReplaceAllStringFunc(r, func(h string) string {
		n, err := strconv.ParseUint(h[2:], 16, 64)
		if err != nil {
			return h
		}
		return fmt.Sprintf("%#x", n)
	})
	r = strings.ReplaceAll(r, " != 0x0", " != 0")
	// nft lists "numgen random mod 2 == 0" without its "==".
	r = numgenZero.ReplaceAllString(r, "numgen random mod $1 == 0")
	return r
}

// numgenZero is a random choice of one rule as nft lists it.
var numgenZero = regexp.MustCompile(`numgen random mod ([0-9]+) 0\b`)

// closedBrace reports whether s holds a "{" and its matching "}", outside
// quotes.
func closedBrace(s string) bool {
	depth, opened, quoted := 0, false, false
	for _, r := range s {
		switch {
		case r == '"':
			quoted = !quoted
		case quoted:
		case r == '{':
			depth++
			opened = true
		case r == '}':
			depth--
			if opened && depth == 0 {
				return true
			}
		}
	}
	return false
}

func splitOutsideQuotes(s string, sep rune) []string {
	var out []string
	start, quoted := 0, false
	for i, r := range s {
		switch {
		case r == '"':
			quoted = !quoted
		case r == sep && !quoted:
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	if rest := strings.TrimSpace(s[start:]); rest != "" {
		out = append(out, s[start:])
	}
	return out
}

// parseElement reads `KEY [timeout T] [expires T] [comment "C"] [: VALUE]`.
func parseElement(e, set string, isMap bool) (*knftables.Element, error) {
	if e == "" {
		return nil, nil
	}
	var comment *string
	keyPart, value := e, ""
	// The comment sits between key and value; it may hold ':'.
	if i := strings.Index(e, ` comment "`); i >= 0 {
		j := strings.Index(e[i+10:], `"`)
		if j < 0 {
			return nil, fmt.Errorf("element %q: unterminated comment", e)
		}
		c := e[i+10 : i+10+j]
		comment = &c
		keyPart = e[:i]
		value = strings.TrimSpace(e[i+10+j+1:])
	} else if k, v, ok := strings.Cut(e, " : "); ok {
		keyPart, value = k, ": "+v
	}
	keyPart = stripElementOptions(keyPart)
	el := &knftables.Element{Key: splitConcat(keyPart), Comment: comment}
	if isMap {
		v, ok := strings.CutPrefix(value, ":")
		if !ok {
			return nil, fmt.Errorf("map element %q has no value", e)
		}
		el.Map = set
		el.Value = splitConcat(strings.TrimSpace(v))
	} else {
		el.Set = set
	}
	return el, nil
}

// stripElementOptions drops "timeout 3h expires 2h59m" and counters from a
// key.
func stripElementOptions(k string) string {
	for _, opt := range []string{" timeout ", " expires ", " counter "} {
		if i := strings.Index(k, opt); i >= 0 {
			k = k[:i]
		}
	}
	return strings.TrimSpace(k)
}

func splitConcat(s string) []string {
	parts := strings.Split(s, " . ")
	for i := range parts {
		parts[i] = strings.TrimSpace(parts[i])
	}
	return parts
}
