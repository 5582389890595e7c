package iptables

import "strings"

// MaxCommentLength is the kernel's limit for the text of -m comment.
const MaxCommentLength = 255

// Comment renders a quoted "-m comment" match for text, reduced to
// printable ASCII without quotes or backslashes (the only characters that
// survive iptables-restore parsing unchanged; API names never hold others)
// and truncated to the kernel's limit, so that a rule reads back exactly as
// kproxy wrote it.
func Comment(text string) string {
	text = strings.Map(func(r rune) rune {
		if r < 0x20 || r > 0x7e || r == '"' || r == '\\' {
			return '_'
		}
		return r
	}, text)
	if len(text) > MaxCommentLength {
		text = text[:MaxCommentLength]
	}
	return `-m comment --comment "` + text + `"`
}
