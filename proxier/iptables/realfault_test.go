package iptables

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/netnstest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// Services of TestRealKernelFaults: ClusterIP number.
const (
	faultMoving = 30 // be2; then be3, refused: keeps be2
	faultBad    = 60 // refused from the start: no rules
	faultOther  = 70 // be1, then be2, then be3
	faultFlip   = 80 // be1, loses it and gets it back while a table fails
)

// TestRealKernelFaults runs, against the real kernel with iptables-nft
// and with iptables-legacy, and real packets: service ports whose rules the
// kernel refuses (set aside, the others programmed), syncs whose second
// table fails (every service delivered or refused, never left hanging),
// and flushes of nat and filter, with and without -X (repaired by the next
// sync once the canary interval has passed).
func TestRealKernelFaults(t *testing.T) {
	for _, variant := range []string{"nft", "legacy"} {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			var faults *faultIPTables
			topo := newRealTopoWith(t, realIPv4, realTopoOptions{variant: variant, wrap: func(i ipt.Interface) ipt.Interface {
				faults = &faultIPTables{Interface: i}
				return faults
			}})
			e := topo.engine
			e.OnServiceAdd(topo.service("web", realWeb, pt.NodePort(30010)))
			e.OnEndpointSliceAdd(topo.slice("web", v1.ProtocolTCP, "be1", "be2"))
			e.OnServiceAdd(topo.service("empty", realEmpty))
			e.OnServiceAdd(topo.service("moving", faultMoving))
			e.OnEndpointSliceAdd(topo.slice("moving", v1.ProtocolTCP, "be2"))
			e.OnServiceAdd(topo.service("bad", faultBad))
			e.OnEndpointSliceAdd(topo.slice("bad", v1.ProtocolTCP, "be1"))
			e.OnServiceAdd(topo.service("other", faultOther))
			e.OnEndpointSliceAdd(topo.slice("other", v1.ProtocolTCP, "be1"))
			e.OnServiceAdd(topo.service("flip", faultFlip))
			e.OnEndpointSliceAdd(topo.slice("flip", v1.ProtocolTCP, "be1"))
			faults.poison([]string{"ns/bad:p"})
			if st := topo.sync(t); !st.Full || !slices.Equal(setAsideNames(topo.last), []string{"ns/bad:p"}) {
				t.Fatalf("first sync %+v set aside %v, want a full sync setting aside ns/bad:p", st, setAsideNames(topo.last))
			}
			healthy := func(t *testing.T) {
				t.Helper()
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(realWeb), want: []string{"be1", "be2"}})
				topo.check(t, realFlow{from: "client", to: topo.nodePort(30010), want: []string{"be1", "be2"}, source: sourceMasqueraded})
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(realEmpty), refused: true})
			}
			healthy(t)
			topo.expectTimeout(t, "pod", topo.clusterIP(faultBad))

			t.Run("a refused change keeps the last good rules, other changes are programmed", func(t *testing.T) {
				faults.poison([]string{"ns/bad:p"}, []string{"ns/moving:p", topo.pods["be3"].addr.String()})
				e.OnEndpointSliceUpdate(nil, topo.slice("moving", v1.ProtocolTCP, "be3"))
				e.OnEndpointSliceUpdate(nil, topo.slice("other", v1.ProtocolTCP, "be2"))
				if st := topo.sync(t); st.Full {
					t.Errorf("sync %+v, want partial", st)
				}
				if got := setAsideNames(topo.last); !slices.Equal(got, []string{"ns/bad:p", "ns/moving:p"}) {
					t.Errorf("set aside %v", got)
				}
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(faultMoving), want: []string{"be2"}})
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(faultOther), want: []string{"be2"}})

				// A later change of another service: one partial write.
				e.OnEndpointSliceUpdate(nil, topo.slice("other", v1.ProtocolTCP, "be3"))
				if st := topo.sync(t); st.Full || st.Attempts != 1 {
					t.Errorf("sync %+v, want a partial sync of one attempt", st)
				}
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(faultOther), want: []string{"be3"}})
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(faultMoving), want: []string{"be2"}})
				healthy(t)

				// Accepted again: the full sync programs them.
				faults.poison()
				topo.clock.Step(time.Hour)
				if st := topo.sync(t); !st.Full || st.SetAside != 0 {
					t.Errorf("sync %+v, want a full sync setting nothing aside", st)
				}
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(faultMoving), want: []string{"be3"}})
				topo.check(t, realFlow{from: "pod", to: topo.clusterIP(faultBad), want: []string{"be1"}})
			})

			t.Run("the second table fails", func(t *testing.T) {
				for _, step := range []struct {
					name  string
					slice bool // flip's endpoint after the step
				}{
					{"the service loses its endpoint", false},
					{"the service gets its endpoint back", true},
				} {
					if step.slice {
						e.OnEndpointSliceAdd(topo.slice("flip", v1.ProtocolTCP, "be1"))
					} else {
						e.OnEndpointSliceDelete(topo.slice("flip", v1.ProtocolTCP, "be1"))
					}
					faults.failSecondTable(true)
					if err := e.SyncRules(t.Context()); err == nil {
						t.Fatalf("%s: the sync succeeded although its second table failed", step.name)
					}
					faults.failSecondTable(false)
					topo.expectDecided(t, step.name, "pod", topo.clusterIP(faultFlip), "be1")
					if st := topo.sync(t); !st.Full {
						t.Errorf("%s: the sync after the failure was not full", step.name)
					}
					flow := realFlow{from: "pod", to: topo.clusterIP(faultFlip), want: []string{"be1"}}
					if !step.slice {
						flow = realFlow{from: "pod", to: topo.clusterIP(faultFlip), refused: true}
					}
					topo.check(t, flow)
				}
				healthy(t)
			})

			t.Run("flushes are repaired by the next sync", func(t *testing.T) {
				for _, flush := range [][]string{
					{"-t", "nat", "-F"},
					{"-t", "filter", "-F"},
					{"-t", "nat", "-F", "-X"},
					{"-t", "filter", "-F", "-X"},
				} {
					args := append([]string{"-w", "5"}, flush[:3]...)
					topo.node.Run(t, "iptables-"+variant, args...)
					if len(flush) == 4 {
						topo.node.Run(t, "iptables-"+variant, "-w", "5", "-t", flush[1], "-X")
					}
					if flush[1] == "nat" {
						topo.expectTimeout(t, "pod", topo.clusterIP(realWeb))
					} else {
						topo.expectTimeout(t, "pod", topo.clusterIP(realEmpty))
					}
					topo.clock.Step(30 * time.Second)
					if st := topo.sync(t); !st.Full {
						t.Errorf("after %v the sync was not full", flush)
					}
					healthy(t)
				}
			})
		})
	}
}

// expectTimeout checks that a request from a sender to addr is handled by
// nobody: it leaves the node and is lost. (A short wait is enough: a rule
// would answer at once.)
func (topo *realTopo) expectTimeout(t *testing.T, from string, to netip.AddrPort) {
	t.Helper()
	ns, _ := topo.sender(t, from)
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	if reply, err := netnstest.Request(ctx, ns, topo.fam.tcp, to.String()); !errors.Is(err, netnstest.ErrTimeout) {
		t.Errorf("request to %s = %q, %v; want a timeout", to, reply, err)
	}
}

// expectDecided checks that requests to addr are either delivered to want
// or refused, never left without an answer.
func (topo *realTopo) expectDecided(t *testing.T, what, from string, to netip.AddrPort, want string) {
	t.Helper()
	ns, _ := topo.sender(t, from)
	for i := 0; i < 5; i++ {
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		reply, err := netnstest.Request(ctx, ns, topo.fam.tcp, to.String())
		cancel()
		switch {
		case errors.Is(err, netnstest.ErrRefused):
		case err != nil:
			t.Fatalf("%s: request %d to %s: %v; want it delivered to %s or refused", what, i+1, to, err, want)
		default:
			if name, _ := parseEchoReply(t, reply); name != want {
				t.Fatalf("%s: request %d to %s reached %s, want %s or a refusal", what, i+1, to, name, want)
			}
		}
	}
}
