package iptables

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"strings"
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

// faultTopo is the topology of the TestRealKernel fault tests for one
// iptables backend, with the fault injector between the backend and the
// kernel, and these services: web (be1, be2, node port 30010), empty (no
// endpoints), moving (be2), bad (be1), other (be1) and flip (be1).
type faultTopo struct {
	*realTopo
	faults *faultIPTables
}

func newFaultTopo(t *testing.T, variant string, poisoned ...[]string) *faultTopo {
	t.Helper()
	ft := &faultTopo{}
	ft.realTopo = newRealTopoWith(t, realIPv4, realTopoOptions{variant: variant, wrap: func(i ipt.Interface) ipt.Interface {
		ft.faults = &faultIPTables{Interface: i}
		return ft.faults
	}})
	e := ft.engine
	e.OnServiceAdd(ft.service("web", realWeb, pt.NodePort(30010)))
	e.OnEndpointSliceAdd(ft.slice("web", v1.ProtocolTCP, "be1", "be2"))
	e.OnServiceAdd(ft.service("empty", realEmpty))
	for _, s := range []struct {
		name string
		ip   int
		be   string
	}{{"moving", faultMoving, "be2"}, {"bad", faultBad, "be1"}, {"other", faultOther, "be1"}, {"flip", faultFlip, "be1"}} {
		e.OnServiceAdd(ft.service(s.name, s.ip))
		e.OnEndpointSliceAdd(ft.slice(s.name, v1.ProtocolTCP, s.be))
	}
	ft.faults.poison(poisoned...)
	if st := ft.sync(t); !st.Full {
		t.Fatalf("first sync %+v, want full", st)
	}
	return ft
}

// healthy checks web from a pod and through its node port, and that
// empty is refused.
func (ft *faultTopo) healthy(t *testing.T) {
	t.Helper()
	ft.check(t, realFlow{from: "pod", to: ft.clusterIP(realWeb), want: []string{"be1", "be2"}})
	ft.check(t, realFlow{from: "client", to: ft.nodePort(30010), want: []string{"be1", "be2"}, source: sourceMasqueraded})
	ft.check(t, realFlow{from: "pod", to: ft.clusterIP(realEmpty), refused: true})
}

// faultVariants are the iptables backends the fault tests run with.
var faultVariants = []string{"nft", "legacy"}

// TestRealKernelSetAside: with the real kernel refusing the rules of a
// service port (bad from the start, then moving's change), the others are
// programmed in the same sync, the refused ones keep their last good rules
// (none for bad), a later change of another service is programmed by a
// partial sync, and the full sync programs them once they are accepted.
func TestRealKernelSetAside(t *testing.T) {
	for _, variant := range faultVariants {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			ft := newFaultTopo(t, variant, []string{"ns/bad:p"})
			e := ft.engine
			if got := setAsideNames(ft.last); !slices.Equal(got, []string{"ns/bad:p"}) {
				t.Fatalf("first sync set aside %v, want ns/bad:p", got)
			}
			ft.healthy(t)
			ft.expectTimeout(t, "pod", ft.clusterIP(faultBad))

			ft.faults.poison([]string{"ns/bad:p"}, []string{"ns/moving:p", ft.pods["be3"].addr.String()})
			e.OnEndpointSliceUpdate(nil, ft.slice("moving", v1.ProtocolTCP, "be3"))
			e.OnEndpointSliceUpdate(nil, ft.slice("other", v1.ProtocolTCP, "be2"))
			if st := ft.sync(t); st.Full {
				t.Errorf("sync %+v, want partial", st)
			}
			if got := setAsideNames(ft.last); !slices.Equal(got, []string{"ns/bad:p", "ns/moving:p"}) {
				t.Errorf("set aside %v", got)
			}
			ft.check(t, realFlow{from: "pod", to: ft.clusterIP(faultMoving), want: []string{"be2"}})
			ft.check(t, realFlow{from: "pod", to: ft.clusterIP(faultOther), want: []string{"be2"}})

			// A later change of another service: one partial write.
			e.OnEndpointSliceUpdate(nil, ft.slice("other", v1.ProtocolTCP, "be3"))
			if st := ft.sync(t); st.Full || st.Attempts != 1 {
				t.Errorf("sync %+v, want a partial sync of one attempt", st)
			}
			ft.check(t, realFlow{from: "pod", to: ft.clusterIP(faultOther), want: []string{"be3"}})
			ft.check(t, realFlow{from: "pod", to: ft.clusterIP(faultMoving), want: []string{"be2"}})
			ft.healthy(t)

			// Accepted again: the full sync programs them.
			ft.faults.poison()
			ft.clock.Step(time.Hour)
			if st := ft.sync(t); !st.Full || st.SetAside != 0 {
				t.Errorf("sync %+v, want a full sync setting nothing aside", st)
			}
			ft.check(t, realFlow{from: "pod", to: ft.clusterIP(faultMoving), want: []string{"be3"}})
			ft.check(t, realFlow{from: "pod", to: ft.clusterIP(faultBad), want: []string{"be1"}})
		})
	}
}

// TestRealKernelSecondTableFails: a sync whose second table the kernel
// refuses (the first one committed, as iptables-restore does) leaves a
// service that loses its endpoint, and one that gets it back, either
// delivered or refused, never without an answer; the next sync, full,
// repairs it.
func TestRealKernelSecondTableFails(t *testing.T) {
	for _, variant := range faultVariants {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			ft := newFaultTopo(t, variant)
			e := ft.engine
			for _, step := range []struct {
				name     string
				endpoint bool // flip's endpoint after the step
			}{
				{"the service loses its endpoint", false},
				{"the service gets its endpoint back", true},
			} {
				if step.endpoint {
					e.OnEndpointSliceAdd(ft.slice("flip", v1.ProtocolTCP, "be1"))
				} else {
					e.OnEndpointSliceDelete(ft.slice("flip", v1.ProtocolTCP, "be1"))
				}
				ft.faults.failSecondTable(true)
				if err := e.SyncRules(t.Context()); err == nil {
					t.Fatalf("%s: the sync succeeded although its second table failed", step.name)
				}
				ft.faults.failSecondTable(false)
				ft.expectDecided(t, step.name, "pod", ft.clusterIP(faultFlip), "be1")
				if st := ft.sync(t); !st.Full {
					t.Errorf("%s: the sync after the failure was not full", step.name)
				}
				flow := realFlow{from: "pod", to: ft.clusterIP(faultFlip), want: []string{"be1"}}
				if !step.endpoint {
					flow = realFlow{from: "pod", to: ft.clusterIP(faultFlip), refused: true}
				}
				ft.check(t, flow)
			}
			ft.healthy(t)
		})
	}
}

// TestRealKernelFlushRepaired: iptables -F of nat and of filter, with and
// without -X, is repaired by the first sync once half the canary interval
// has passed since the last check (a node syncing every sync period checks
// at every sync): traffic is DNATed, and refused, again.
func TestRealKernelFlushRepaired(t *testing.T) {
	for _, variant := range faultVariants {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			ft := newFaultTopo(t, variant)
			for _, flush := range []struct {
				table  string
				delete bool
			}{{"nat", false}, {"filter", false}, {"nat", true}, {"filter", true}} {
				ft.node.Run(t, "iptables-"+variant, "-w", "5", "-t", flush.table, "-F")
				if flush.delete {
					ft.node.Run(t, "iptables-"+variant, "-w", "5", "-t", flush.table, "-X")
				}
				if flush.table == "nat" {
					ft.expectTimeout(t, "pod", ft.clusterIP(realWeb))
				} else {
					ft.expectTimeout(t, "pod", ft.clusterIP(realEmpty))
				}
				ft.clock.Step(DefaultCanaryInterval / 2)
				if st := ft.sync(t); !st.Full {
					t.Errorf("after the flush of %s (-X %v) the sync was not full", flush.table, flush.delete)
				}
				ft.healthy(t)
			}
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

// TestRealKernelChainFlushRepaired: someone else flushing one of kproxy's
// chains (a service's cluster chain, its external chain that node-port
// traffic takes, the node-port dispatch) or deleting one rule of
// KPROXY-SERVICES breaks that service's traffic until the first sync once
// half the canary interval has passed since the last check, although
// nothing changed: that sync is full and the traffic flows again.
func TestRealKernelChainFlushRepaired(t *testing.T) {
	for _, variant := range faultVariants {
		t.Run(variant, func(t *testing.T) {
			t.Parallel()
			ft := newFaultTopo(t, variant)
			iptables := func(args ...string) {
				ft.node.Run(t, "iptables-"+variant, append([]string{"-w", "5", "-t", "nat"}, args...)...)
			}
			web := pt.ServicePortNameOf(ft.service("web", realWeb), "p")
			for _, tc := range []struct {
				name   string
				damage func()
				// broken is a flow that fails after the damage.
				from string
				to   netip.AddrPort
			}{
				{name: "-F of web's service chain", damage: func() { iptables("-F", servicePortChain(kindCluster, web)) },
					from: "pod", to: ft.clusterIP(realWeb)},
				{name: "-F of web's external chain", damage: func() { iptables("-F", servicePortChain(kindExternal, web)) },
					from: "client", to: ft.nodePort(30010)},
				{name: "-F of KPROXY-NODEPORTS", damage: func() { iptables("-F", chainNodePorts) },
					from: "client", to: ft.nodePort(30010)},
				{name: "-D of web's rule in KPROXY-SERVICES", damage: func() {
					dst := "-d " + ft.clusterIP(realWeb).Addr().String() + "/"
					for _, line := range strings.Split(ft.node.Run(t, "iptables-"+variant, "-w", "5", "-t", "nat", "-S", chainServices), "\n") {
						if strings.Contains(line, dst) {
							args, err := ipt.SplitArgs(strings.TrimPrefix(line, "-A "+chainServices+" "))
							if err != nil {
								t.Fatal(err)
							}
							iptables(append([]string{"-D", chainServices}, args...)...)
							return
						}
					}
					t.Fatalf("no rule for %s in %s", dst, chainServices)
				}, from: "pod", to: ft.clusterIP(realWeb)},
			} {
				tc.damage()
				ft.expectFailure(t, tc.name, tc.from, tc.to)
				ft.clock.Step(DefaultCanaryInterval / 2)
				if st := ft.sync(t); !st.Full {
					t.Errorf("after the %s the sync was not full", tc.name)
				}
				ft.healthy(t)
			}
		})
	}
}

// expectFailure checks that a request from a sender to addr fails: it
// times out or is refused (by the node itself, for a node port no longer
// DNATed).
func (topo *realTopo) expectFailure(t *testing.T, what, from string, to netip.AddrPort) {
	t.Helper()
	ns, _ := topo.sender(t, from)
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	if reply, err := netnstest.Request(ctx, ns, topo.fam.tcp, to.String()); err == nil {
		t.Errorf("after the %s: request to %s = %q; want it to fail", what, to, reply)
	}
}
