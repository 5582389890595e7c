package app

import (
	"runtime/debug"
	"testing"

	"k8s.io/klog/v2"
)

func TestSetGCDefaults(t *testing.T) {
	// debug.SetGCPercent returns the previous setting: read it by setting
	// it, and restore it after the test.
	gcPercent := func() int {
		p := debug.SetGCPercent(100)
		debug.SetGCPercent(p)
		return p
	}
	saved := gcPercent()
	t.Cleanup(func() { debug.SetGCPercent(saved) })
	for _, tc := range []struct {
		name string
		env  map[string]string
		want int
	}{
		{name: "nothing set: kproxy's default", want: DefaultGCPercent},
		{name: "GOGC set: left alone", env: map[string]string{"GOGC": "200"}, want: 123},
		{name: "GOGC=off set: left alone", env: map[string]string{"GOGC": "off"}, want: 123},
		{name: "GOMEMLIMIT set: left alone", env: map[string]string{"GOMEMLIMIT": "100MiB"}, want: 123},
	} {
		t.Run(tc.name, func(t *testing.T) {
			debug.SetGCPercent(123) // as the runtime would have read the environment
			setGCDefaults(klog.Background(), func(k string) (string, bool) {
				v, ok := tc.env[k]
				return v, ok
			})
			if got := gcPercent(); got != tc.want {
				t.Errorf("GC percent %d, want %d", got, tc.want)
			}
		})
	}
}
