package iptables

import (
	"slices"
	"testing"
)

func TestSplitArgs(t *testing.T) {
	tests := []struct {
		name    string
		line    string
		want    []string
		wantErr bool
	}{
		{name: "plain words", line: "-A  INPUT\t-j ACCEPT", want: []string{"-A", "INPUT", "-j", "ACCEPT"}},
		{name: "quoted string is one argument", line: `-m comment --comment "a b  c"`, want: []string{"-m", "comment", "--comment", "a b  c"}},
		{name: "escaped quote and backslash", line: `--comment "say \"hi\" \\o/"`, want: []string{"--comment", `say "hi" \o/`}},
		{name: "quote inside a word", line: `ab"c d"e`, want: []string{"abc de"}},
		{name: "empty quoted string", line: `x "" y`, want: []string{"x", "", "y"}},
		{name: "backslash outside quotes is literal", line: `a\b`, want: []string{`a\b`}},
		{name: "trailing whitespace", line: "a b \r", want: []string{"a", "b"}},
		{name: "unterminated quote", line: `--comment "abc`, wantErr: true},
		{name: "dangling escape", line: `"abc\`, wantErr: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SplitArgs(tc.line)
			if (err != nil) != tc.wantErr {
				t.Fatalf("SplitArgs(%q) error = %v, wantErr %v", tc.line, err, tc.wantErr)
			}
			if !tc.wantErr && !slices.Equal(got, tc.want) {
				t.Errorf("SplitArgs(%q) = %q, want %q", tc.line, got, tc.want)
			}
		})
	}
}

func TestQuoteArgRoundTrip(t *testing.T) {
	tests := []struct {
		name   string
		args   []string
		joined string
	}{
		{name: "plain", args: []string{"-s", "10.0.0.0/8", "-j", "ACCEPT"}, joined: "-s 10.0.0.0/8 -j ACCEPT"},
		{name: "space", args: []string{"--comment", "ns/svc:http cluster IP"}, joined: `--comment "ns/svc:http cluster IP"`},
		{name: "quotes and backslashes", args: []string{`a"b\c`, "it's"}, joined: `"a\"b\\c" "it's"`},
		{name: "empty", args: []string{""}, joined: `""`},
		{name: "control whitespace", args: []string{"a\tb\rc\vd"}, joined: "\"a\tb\rc\vd\""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			joined := JoinArgs(tc.args)
			if joined != tc.joined {
				t.Errorf("JoinArgs(%q) = %q, want %q", tc.args, joined, tc.joined)
			}
			back, err := SplitArgs(joined)
			if err != nil || !slices.Equal(back, tc.args) {
				t.Errorf("SplitArgs(JoinArgs(%q)) = %q, %v", tc.args, back, err)
			}
		})
	}
}
