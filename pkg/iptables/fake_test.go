package iptables_test

import (
	"testing"

	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
)

func TestFakeInterface(t *testing.T) {
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			for _, c := range interfaceCases(f) {
				t.Run(c.name, func(t *testing.T) {
					runCase(t, t.Context(), iptablestest.NewFake(f.protocol), c)
				})
			}
		})
	}
}
