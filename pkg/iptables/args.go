package iptables

import (
	"fmt"
	"strings"
)

// SplitArgs splits one iptables-restore line into arguments the way
// iptables-restore does: whitespace separates arguments, a double-quoted
// string (which may sit inside a word) is part of one argument, and inside
// quotes a backslash escapes the next character. Outside quotes a backslash
// is an ordinary character.
func SplitArgs(line string) ([]string, error) {
	var (
		args    []string
		cur     strings.Builder
		inWord  bool
		inQuote bool
	)
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case inQuote:
			switch c {
			case '\\':
				if i+1 >= len(line) {
					return nil, fmt.Errorf("unterminated quoted string")
				}
				i++
				cur.WriteByte(line[i])
			case '"':
				inQuote = false
			default:
				cur.WriteByte(c)
			}
		case c == '"':
			inQuote, inWord = true, true
		case isSpace(c):
			if inWord {
				args = append(args, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			inWord = true
			cur.WriteByte(c)
		}
	}
	if inQuote {
		return nil, fmt.Errorf("unterminated quoted string")
	}
	if inWord {
		args = append(args, cur.String())
	}
	return args, nil
}

func isSpace(c byte) bool {
	return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\v' || c == '\f'
}

// QuoteArg renders one argument so that SplitArgs reads it back unchanged:
// plain words stay as they are, anything else is double-quoted with `"` and
// `\` escaped.
func QuoteArg(arg string) string {
	needs := arg == ""
	for i := 0; i < len(arg) && !needs; i++ {
		c := arg[i]
		needs = isSpace(c) || c == '"' || c == '\\' || c == '\''
	}
	if !needs {
		return arg
	}
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(arg); i++ {
		if arg[i] == '"' || arg[i] == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(arg[i])
	}
	b.WriteByte('"')
	return b.String()
}

// JoinArgs renders arguments as one iptables-restore line fragment; it is the
// inverse of SplitArgs.
func JoinArgs(args []string) string {
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = QuoteArg(a)
	}
	return strings.Join(quoted, " ")
}
