package nftablestest

import "testing"

func TestValidTimeout(t *testing.T) {
	cases := []struct {
		name, in string
		want     bool
	}{
		{name: "knftables seconds", in: "10800s", want: true},
		{name: "nft hours", in: "3h", want: true},
		{name: "nft compound", in: "1d2h3m4s", want: true},
		{name: "nft milliseconds", in: "1s500ms", want: true},
		{name: "empty", in: "", want: false},
		{name: "no unit", in: "10800", want: false},
		{name: "no number", in: "h", want: false},
		{name: "unknown unit", in: "3w", want: false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := validTimeout(tc.in); got != tc.want {
				t.Errorf("validTimeout(%q) = %v, want %v", tc.in, got, tc.want)
			}
		})
	}
}
