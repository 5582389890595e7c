package proxy

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
)

func TestParseTopologyKeys(t *testing.T) {
	tooMany := make([]string, maxTopologyKeys+1)
	for i := range tooMany {
		tooMany[i] = fmt.Sprintf("key%d", i)
	}
	tooManyJSON, err := json.Marshal(tooMany)
	if err != nil {
		t.Fatal(err)
	}
	maxJSON, err := json.Marshal(tooMany[:maxTopologyKeys])
	if err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name  string
		value string
		want  []string
		// wantErr is a fragment of the expected error; "" means success.
		wantErr string
	}{
		{name: "empty value", value: ""},
		{name: "blank value", value: "  \t"},
		{name: "empty list", value: "[]"},
		{name: "JSON null", value: "null"},
		{name: "single key", value: `["zone1"]`, want: []string{"zone1"}},
		{
			name:  "valid list with prefixed key and star last",
			value: ` ["zone1", "topology.kubernetes.io/zone", "*"] `,
			want:  []string{"zone1", "topology.kubernetes.io/zone", "*"},
		},
		{name: "star alone", value: `["*"]`, want: []string{"*"}},
		{name: "maximum number of keys", value: string(maxJSON), want: tooMany[:maxTopologyKeys]},
		{name: "star not last", value: `["*", "zone1"]`, wantErr: "must be the last key"},
		{name: "star twice", value: `["*", "*"]`, wantErr: "must be the last key"},
		{name: "empty key", value: `["zone1", ""]`, wantErr: "key 1 is empty"},
		{name: "duplicate key", value: `["zone1", "zone2", "zone1"]`, wantErr: `"zone1" is listed twice`},
		{name: "bad label key", value: `["zone 1"]`, wantErr: "not a valid label key"},
		{name: "bad label key prefix", value: `["-bad-/zone"]`, wantErr: "not a valid label key"},
		{name: "not JSON", value: `zone1`, wantErr: "must be a JSON list"},
		{name: "JSON string instead of list", value: `"zone1"`, wantErr: "must be a JSON list"},
		{name: "list of numbers", value: `[1, 2]`, wantErr: "must be a JSON list"},
		{name: "trailing garbage", value: `["zone1"] x`, wantErr: "must be a JSON list"},
		{name: "too many keys", value: string(tooManyJSON), wantErr: "at most 16"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseTopologyKeys(tc.value)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("ParseTopologyKeys(%q) error = %v, want one containing %q", tc.value, err, tc.wantErr)
				}
				if got != nil {
					t.Errorf("ParseTopologyKeys(%q) = %q with an error, want nil", tc.value, got)
				}
				if !strings.Contains(err.Error(), AnnotationTopologyKeys) {
					t.Errorf("error %q does not name the annotation", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseTopologyKeys(%q) unexpected error: %v", tc.value, err)
			}
			if !slices.Equal(got, tc.want) || (got == nil) != (tc.want == nil) {
				t.Errorf("ParseTopologyKeys(%q) = %#v, want %#v", tc.value, got, tc.want)
			}
		})
	}
}

func FuzzParseTopologyKeys(f *testing.F) {
	for _, seed := range []string{
		"",
		"[]",
		"null",
		`["zone1"]`,
		`["zone1","topology.kubernetes.io/zone","*"]`,
		`["*","zone1"]`,
		`["zone1",""]`,
		`["a","a"]`,
		`["zone 1"]`,
		`["example.com/edge-group"]`,
		`["\u003cbad\u003e"]`,
		`["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]`,
		`{"zone1":true}`,
		`[1]`,
		`["zone1"`,
		"zone1",
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, value string) {
		keys, err := ParseTopologyKeys(value)
		if err != nil {
			if keys != nil {
				t.Fatalf("ParseTopologyKeys(%q) returned keys %q with error %v", value, keys, err)
			}
			return
		}
		if len(keys) > maxTopologyKeys {
			t.Fatalf("ParseTopologyKeys(%q) accepted %d keys", value, len(keys))
		}
		for i, k := range keys {
			if k == "" || (k == TopologyKeyAny && i != len(keys)-1) || slices.Index(keys, k) != i {
				t.Fatalf("ParseTopologyKeys(%q) accepted an invalid list %q", value, keys)
			}
		}
		// A successful parse re-marshals to an equivalent list.
		data, err := json.Marshal(keys)
		if err != nil {
			t.Fatalf("marshal %q: %v", keys, err)
		}
		again, err := ParseTopologyKeys(string(data))
		if err != nil {
			t.Fatalf("re-parse of %s (from %q): %v", data, value, err)
		}
		if !slices.Equal(again, keys) {
			t.Fatalf("re-parse of %s = %q, want %q", data, again, keys)
		}
	})
}
