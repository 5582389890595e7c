package ipset

import (
	"errors"
	"fmt"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kproxy/kproxy/pkg/netlink"
)

// libraryCall fails as the netlink library's ipset calls do: it asserts
// that err is an errno.
func libraryCall(err error) func() error {
	return func() error {
		if err != nil {
			if n := int(err.(syscall.Errno)); n < 0 {
				return fmt.Errorf("negative errno %d", n)
			}
		}
		return err
	}
}

func TestCall(t *testing.T) {
	cases := []struct {
		name            string
		err             error
		wantErr         bool
		wantInterrupted bool
		wantErrno       error
	}{{
		name: "success",
	}, {
		name:      "errno",
		err:       unix.ENOENT,
		wantErr:   true,
		wantErrno: unix.ENOENT,
	}, {
		name:            "interrupted dump",
		err:             netlink.ErrDumpInterrupted,
		wantErr:         true,
		wantInterrupted: true,
	}, {
		name:    "other non-errno failure",
		err:     errors.New("Wrong sender portid 7, expected 0"),
		wantErr: true,
	}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := call(libraryCall(tc.err))
			if (err != nil) != tc.wantErr {
				t.Fatalf("call: error %v, want error %v", err, tc.wantErr)
			}
			if got := errors.Is(err, netlink.ErrDumpInterrupted); got != tc.wantInterrupted {
				t.Errorf("call: error %v is ErrDumpInterrupted: %v, want %v", err, got, tc.wantInterrupted)
			}
			if tc.wantErrno != nil && !errors.Is(err, tc.wantErrno) {
				t.Errorf("call: error %v is not %v", err, tc.wantErrno)
			}
		})
	}
}
