package iptables

import (
	"context"
	"fmt"
	"os/exec"
	"testing"
)

// TestRefused: a restore error is a refusal when it names a line or
// iptables-restore exited with status 1 or 2.
func TestRefused(t *testing.T) {
	exitErr := func(code int) error {
		err := exec.Command("/bin/sh", "-c", fmt.Sprintf("exit %d", code)).Run()
		return fmt.Errorf("running iptables-restore: %w", err)
	}
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{name: "a line named", err: &restoreError{msg: "failed", line: 3, err: exitErr(4)}, want: true},
		{name: "status 1", err: &restoreError{msg: "failed", err: exitErr(1)}, want: true},
		{name: "status 2", err: fmt.Errorf("wrapped: %w", exitErr(2)), want: true},
		{name: "status 4 (the lock)", err: &restoreError{msg: "failed", err: exitErr(4)}},
		{name: "not run", err: context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Refused(tc.err); got != tc.want {
				t.Errorf("Refused(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}
