package nftables

import (
	"strings"
	"testing"
)

func TestMergeElements(t *testing.T) {
	for _, tc := range []struct {
		name     string
		in, want []string
	}{
		{
			name: "empty",
		},
		{
			name: "a run of adds on one map",
			in: []string{
				"add element ip kproxy m { 10.0.0.1 . tcp . 80 : goto c1 }",
				"add element ip kproxy m { 10.0.0.2 . tcp . 80 : goto c2 }",
				"add element ip kproxy m { 10.0.0.3 . udp . 53 : goto c1 }",
			},
			want: []string{
				"add element ip kproxy m { 10.0.0.1 . tcp . 80 : goto c1, 10.0.0.2 . tcp . 80 : goto c2, 10.0.0.3 . udp . 53 : goto c1 }",
			},
		},
		{
			name: "a run of deletes, then adds, on one set",
			in: []string{
				"delete element ip kproxy s { 10.0.0.1 }",
				"delete element ip kproxy s { 10.0.0.2 }",
				"add element ip kproxy s { 10.0.0.2 }",
				"add element ip kproxy s { 10.0.0.3 }",
			},
			want: []string{
				"delete element ip kproxy s { 10.0.0.1, 10.0.0.2 }",
				"add element ip kproxy s { 10.0.0.2, 10.0.0.3 }",
			},
		},
		{
			name: "interleaved verbs keep their order",
			in: []string{
				"add element ip kproxy m { 1 : 2 }",
				"delete element ip kproxy m { 3 }",
				"add element ip kproxy m { 4 : 5 }",
				"create element ip kproxy m { 6 : 7 }",
				"create element ip kproxy m { 8 : 9 }",
			},
			want: []string{
				"add element ip kproxy m { 1 : 2 }",
				"delete element ip kproxy m { 3 }",
				"add element ip kproxy m { 4 : 5 }",
				"create element ip kproxy m { 6 : 7, 8 : 9 }",
			},
		},
		{
			name: "different maps are not merged",
			in: []string{
				"add element ip kproxy m1 { 1 : 2 }",
				"add element ip kproxy m2 { 1 : 2 }",
				"add element ip kproxy m1 { 3 : 4 }",
				"add element ip kproxy m1 { 5 : 6 }",
			},
			want: []string{
				"add element ip kproxy m1 { 1 : 2 }",
				"add element ip kproxy m2 { 1 : 2 }",
				"add element ip kproxy m1 { 3 : 4, 5 : 6 }",
			},
		},
		{
			name: "same map name in another table or family is another map",
			in: []string{
				"add element ip kproxy m { 1 : 2 }",
				"add element ip other m { 3 : 4 }",
				"add element ip6 kproxy m { 5 : 6 }",
			},
			want: []string{
				"add element ip kproxy m { 1 : 2 }",
				"add element ip other m { 3 : 4 }",
				"add element ip6 kproxy m { 5 : 6 }",
			},
		},
		{
			name: "a flush or a delete between ends the run",
			in: []string{
				"add element ip kproxy m { 1 : 2 }",
				"flush map ip kproxy m",
				"add element ip kproxy m { 3 : 4 }",
				"add element ip kproxy m { 5 : 6 }",
				"delete chain ip kproxy c",
				"add element ip kproxy m { 7 : 8 }",
			},
			want: []string{
				"add element ip kproxy m { 1 : 2 }",
				"flush map ip kproxy m",
				"add element ip kproxy m { 3 : 4, 5 : 6 }",
				"delete chain ip kproxy c",
				"add element ip kproxy m { 7 : 8 }",
			},
		},
		{
			name: "comments stay with their elements",
			in: []string{
				`add element ip kproxy m { 10.0.0.1 . tcp . 80 comment "ns/a:http, }" : goto c }`,
				`add element ip kproxy m { 10.0.0.2 . tcp . 80 : goto c }`,
				`add element ip kproxy m { 10.0.0.3 . tcp . 80 comment "ns/b" : goto c }`,
				`add element ip kproxy s { 10.0.0.0/8 comment "x" }`,
			},
			want: []string{
				`add element ip kproxy m { 10.0.0.1 . tcp . 80 comment "ns/a:http, }" : goto c, 10.0.0.2 . tcp . 80 : goto c, 10.0.0.3 . tcp . 80 comment "ns/b" : goto c }`,
				`add element ip kproxy s { 10.0.0.0/8 comment "x" }`,
			},
		},
		{
			name: "IPv6",
			in: []string{
				"add element ip6 kproxy m { fd00::1 . tcp . 80 : goto c }",
				"add element ip6 kproxy m { fd00::2 . tcp . 80 : goto c }",
				"delete element ip6 kproxy m { fd00::3 . tcp . 80 }",
			},
			want: []string{
				"add element ip6 kproxy m { fd00::1 . tcp . 80 : goto c, fd00::2 . tcp . 80 : goto c }",
				"delete element ip6 kproxy m { fd00::3 . tcp . 80 }",
			},
		},
		{
			name: "concatenations and intervals",
			in: []string{
				"add element ip kproxy fw { 10.0.0.1 . tcp . 80 . 192.168.0.0/16 }",
				"add element ip kproxy fw { 10.0.0.1 . tcp . 80 . 10.1.0.1-10.1.0.9 }",
				"add element ip kproxy eps { 7 . 0 : 10.2.0.1 . 8080 }",
				"add element ip kproxy eps { 7 . 1 : 10.2.0.2 . 8080 }",
			},
			want: []string{
				"add element ip kproxy fw { 10.0.0.1 . tcp . 80 . 192.168.0.0/16, 10.0.0.1 . tcp . 80 . 10.1.0.1-10.1.0.9 }",
				"add element ip kproxy eps { 7 . 0 : 10.2.0.1 . 8080, 7 . 1 : 10.2.0.2 . 8080 }",
			},
		},
		{
			name: "rules and objects pass through",
			in: []string{
				"add table ip kproxy { comment \"rules for kproxy\" ; }",
				"add map ip kproxy m { type ipv4_addr : verdict ; }",
				"add rule ip kproxy c ip daddr { 10.0.0.1, 10.0.0.2 } accept",
				"add rule ip kproxy c ip daddr { 10.0.0.3 } accept",
				"destroy element ip kproxy m { 1 }",
				"destroy element ip kproxy m { 2 }",
			},
			want: []string{
				"add table ip kproxy { comment \"rules for kproxy\" ; }",
				"add map ip kproxy m { type ipv4_addr : verdict ; }",
				"add rule ip kproxy c ip daddr { 10.0.0.1, 10.0.0.2 } accept",
				"add rule ip kproxy c ip daddr { 10.0.0.3 } accept",
				"destroy element ip kproxy m { 1 }",
				"destroy element ip kproxy m { 2 }",
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in, want := joinLines(tc.in), joinLines(tc.want)
			if got := mergedText(in); got != want {
				t.Errorf("merged:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

func TestMergeElementsUnterminated(t *testing.T) {
	// A last line without its newline is not a complete command: it is
	// left as it is.
	in := "add element ip kproxy m { 1 : 2 }\nadd element ip kproxy m { 3 : 4 }"
	want := "add element ip kproxy m { 1 : 2 }\nadd element ip kproxy m { 3 : 4 }"
	if got := mergedText(in); got != want {
		t.Errorf("merged %q, want %q", got, want)
	}
}

func TestOriginalLine(t *testing.T) {
	in := joinLines([]string{
		"add table ip kproxy",
		"add element ip kproxy m { 10.0.0.1 : goto c }",
		"add element ip kproxy m { 10.0.0.2 : goto c }",
		"add element ip kproxy m { 10.0.0.3 : goto c }",
		"flush chain ip kproxy c",
	})
	merged := mergedText(in)
	mergedLine := nthLine(merged, 2)
	for _, tc := range []struct {
		name      string
		line, col int
		want      int
	}{
		{name: "an unmerged command", line: 1, col: 1, want: 1},
		{name: "the merged command's head", line: 2, col: 1, want: 2},
		{name: "the first element", line: 2, col: strings.Index(mergedLine, "10.0.0.1") + 1, want: 2},
		{name: "the second element", line: 2, col: strings.Index(mergedLine, "10.0.0.2") + 1, want: 3},
		{name: "inside the third element", line: 2, col: strings.Index(mergedLine, "10.0.0.3") + 5, want: 4},
		{name: "the command after the merged one", line: 3, col: 1, want: 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, text, ok := originalLine(in, tc.line, tc.col)
			if !ok || got != tc.want || text != nthLine(in, tc.want) {
				t.Errorf("originalLine(%d, %d) = %d, %q, %v; want %d, %q", tc.line, tc.col, got, text, ok, tc.want, nthLine(in, tc.want))
			}
		})
	}
	if _, _, ok := originalLine(in, 9, 1); ok {
		t.Errorf("originalLine found a line past the end")
	}
}

func TestMapPositions(t *testing.T) {
	in := joinLines([]string{
		"add element ip t m2 { 1.2.3.10 : 5.6.7.8 . 80 }",
		"add element ip t m2 { 1.2.3.10 : 5.6.7.8 . 81 }",
	})
	stderr := "/dev/stdin:1:49-56: Error: Could not process rule: File exists\n" +
		"add element ip t m2 { 1.2.3.10 : 5.6.7.8 . 80, 1.2.3.10 : 5.6.7.8 . 81 }\n" +
		"                                                ^^^^^^^^\n"
	want := "/dev/stdin:1:49-56 (transaction line 2): Error: Could not process rule: File exists\n" +
		"add element ip t m2 { 1.2.3.10 : 5.6.7.8 . 81 }\n"
	if got := mapPositions(stderr, in); got != want {
		t.Errorf("mapPositions:\n%s\nwant:\n%s", got, want)
	}
}

func joinLines(lines []string) string {
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(l + "\n")
	}
	return b.String()
}
