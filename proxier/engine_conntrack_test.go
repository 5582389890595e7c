package proxier_test

import (
	"errors"
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"

	"github.com/kproxy/kproxy/pkg/conntrack"
	"github.com/kproxy/kproxy/proxier"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// udpService builds a NodePort service with one port "dns" of protocol
// proto: port 53 at nodePort.
func udpService(name, clusterIP string, proto v1.Protocol, nodePort int32) *v1.Service {
	return pt.Service(name, clusterIP,
		pt.Ports(v1.ServicePort{Name: "dns", Port: 53, Protocol: proto}), pt.NodePort(nodePort))
}

// udpSlice builds the slice of a udpService: port "dns" at 5353.
func udpSlice(name string, proto v1.Protocol, eps ...pt.EP) *discovery.EndpointSlice {
	return pt.SliceWithPorts(name, []discovery.EndpointPort{{Name: ptr.To("dns"), Port: ptr.To[int32](5353), Protocol: ptr.To(proto)}}, eps...)
}

func ctFlow(src, dst, replySrc string) conntrack.Flow {
	s := netip.MustParseAddrPort(src)
	return conntrack.Flow{
		Protocol: v1.ProtocolUDP,
		Original: conntrack.Tuple{Src: s, Dst: netip.MustParseAddrPort(dst)},
		Reply:    conntrack.Tuple{Src: netip.MustParseAddrPort(replySrc), Dst: s},
	}
}

// The flows on the node at the start of every case, by name.
var engineFlows = map[string]conntrack.Flow{
	"dns to ep1":                  ctFlow("10.244.1.9:40001", "10.96.0.53:53", "10.244.2.5:5353"),
	"dns to ep2":                  ctFlow("10.244.1.9:40002", "10.96.0.53:53", "10.244.2.6:5353"),
	"dns NodePort to ep1":         ctFlow("203.0.113.7:40003", "10.0.0.1:30053", "10.244.2.5:5353"),
	"syslog black-holed":          ctFlow("10.244.1.9:40004", "10.96.0.54:53", "10.96.0.54:53"),
	"syslog NodePort black-holed": ctFlow("203.0.113.7:40006", "10.0.0.1:30054", "10.0.0.1:30054"),
	"tcpdns (as UDP) to ep1":      ctFlow("10.244.1.9:40005", "10.96.0.55:53", "10.244.2.5:5353"),
	"tcpdns black-holed":          tcpFlow(conntrack.TCPStateSynSent, "10.244.1.9:40007", "10.96.0.55:53", "10.96.0.55:53"),
	"tcpdns handshake to ep1":     tcpFlow(conntrack.TCPStateSynSent, "10.244.1.9:40008", "10.96.0.55:53", "10.244.2.5:5353"),
}

// tcpFlow is a TCP flow in state.
func tcpFlow(state uint8, src, dst, replySrc string) conntrack.Flow {
	f := ctFlow(src, dst, replySrc)
	f.Protocol, f.TCPState = v1.ProtocolTCP, state
	return f
}

var (
	ep1 = pt.EP{IP: "10.244.2.5", Node: "node-b"}
	ep2 = pt.EP{IP: "10.244.2.6", Node: "node-b"}
	ep3 = pt.EP{IP: "10.244.2.7", Node: "node-b"}
	// ep1Terminating still serves; ep1Gone no longer does.
	ep1Terminating = pt.EP{IP: ep1.IP, Node: ep1.Node, Terminating: true}
	ep1Gone        = pt.EP{IP: ep1.IP, Node: ep1.Node, Terminating: true, NotReady: true}
	ep2Terminating = pt.EP{IP: ep2.IP, Node: ep2.Node, Terminating: true}
)

func TestEngineConntrackCleanup(t *testing.T) {
	for _, tc := range []struct {
		name string
		// dnsEndpoints are the endpoints of service dns at the initial
		// sync; ep1 and ep2 when unset.
		dnsEndpoints []pt.EP
		// change is applied after the initial sync; the case then syncs
		// once more (twice with failFirst).
		change func(e *proxier.Engine)
		// failFirst makes the backend refuse the first sync after change;
		// afterFailure is then applied before the next sync.
		failFirst    bool
		afterFailure func(e *proxier.Engine)
		// failClear makes the conntrack table refuse the first deletion.
		failClear bool
		// repair makes the backend rewrite everything in the sync after
		// change (it found its rules flushed).
		repair      bool
		wantDeleted []string
	}{
		{
			name:   "nothing changed",
			change: func(*proxier.Engine) {},
		},
		{
			name: "endpoint removed",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep2))
			},
			wantDeleted: []string{"dns NodePort to ep1", "dns to ep1"},
		},
		{
			name: "endpoint stops serving",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, pt.EP{IP: ep1.IP, Node: ep1.Node, NotReady: true}, ep2))
			},
			wantDeleted: []string{"dns NodePort to ep1", "dns to ep1"},
		},
		{
			name: "endpoint terminating but still serving keeps its flows",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep1Terminating, ep2))
			},
		},
		{
			name:         "terminating endpoint stops serving",
			dnsEndpoints: []pt.EP{ep1Terminating, ep2},
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep1Gone, ep2))
			},
			wantDeleted: []string{"dns NodePort to ep1", "dns to ep1"},
		},
		{
			name:         "terminating endpoints keep their flows when a ready one arrives",
			dnsEndpoints: []pt.EP{ep1Terminating, ep2Terminating},
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep1Terminating, ep2Terminating, ep3))
			},
		},
		{
			name: "last endpoints removed",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceDelete(udpSlice("dns", v1.ProtocolUDP, ep1, ep2))
			},
			wantDeleted: []string{"dns NodePort to ep1", "dns to ep1", "dns to ep2"},
		},
		{
			name: "service deleted",
			change: func(e *proxier.Engine) {
				e.OnServiceDelete(udpService("dns", "10.96.0.53", v1.ProtocolUDP, 30053))
			},
			wantDeleted: []string{"dns to ep1", "dns to ep2"},
		},
		{
			name: "service gets its first endpoint",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceAdd(udpSlice("syslog", v1.ProtocolUDP, ep1))
			},
			wantDeleted: []string{"syslog NodePort black-holed", "syslog black-holed"},
		},
		{
			name: "TCP service loses an endpoint: nothing",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("tcpdns", v1.ProtocolTCP, ep2))
			},
		},
		{
			name: "failed sync: deleted after the next successful one",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep2))
			},
			failFirst: true,
			// The sync after a failure is full: the flows black-holed
			// meanwhile go too.
			wantDeleted: []string{"dns NodePort to ep1", "dns to ep1", "syslog black-holed", "tcpdns black-holed"},
		},
		{
			name: "failed sync: an endpoint removed, then back and serving, keeps its flows",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep2))
			},
			failFirst: true,
			afterFailure: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep1Terminating, ep2))
			},
			wantDeleted: []string{"syslog black-holed", "tcpdns black-holed"},
		},
		{
			name:        "the backend repairs its flushed rules: the flows black-holed meanwhile, TCP and UDP",
			change:      func(*proxier.Engine) {},
			repair:      true,
			wantDeleted: []string{"syslog black-holed", "tcpdns black-holed"},
		},
		{
			name: "conntrack failure is logged, the sync succeeds",
			change: func(e *proxier.Engine) {
				e.OnEndpointSliceUpdate(nil, udpSlice("dns", v1.ProtocolUDP, ep2))
			},
			failClear: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ct := conntrack.NewFake()
			h := newSyncedHarness(t, func(o *proxier.EngineOptions) { o.Conntrack = ct })
			h.engine.OnServiceAdd(udpService("dns", "10.96.0.53", v1.ProtocolUDP, 30053))
			h.engine.OnServiceAdd(udpService("syslog", "10.96.0.54", v1.ProtocolUDP, 30054))
			h.engine.OnServiceAdd(udpService("tcpdns", "10.96.0.55", v1.ProtocolTCP, 30055))
			dnsEndpoints := tc.dnsEndpoints
			if dnsEndpoints == nil {
				dnsEndpoints = []pt.EP{ep1, ep2}
			}
			h.engine.OnEndpointSliceAdd(udpSlice("dns", v1.ProtocolUDP, dnsEndpoints...))
			h.engine.OnEndpointSliceAdd(udpSlice("tcpdns", v1.ProtocolTCP, ep1, ep2))
			h.sync()
			// The flows appear once the rules are in place (the initial
			// sync found every service newly active and cleaned them).
			for _, f := range engineFlows {
				ct.Add(f)
			}

			tc.change(h.engine)
			if tc.failFirst {
				h.backend.failNextSync(errors.New("iptables-restore failed"))
				if err := h.engine.SyncRules(h.ctx); err == nil {
					t.Fatal("sync succeeded, want the backend's failure")
				}
				if got := len(ct.Flows()); got != len(engineFlows) {
					t.Fatalf("a failed sync deleted flows: %d left of %d", got, len(engineFlows))
				}
				if tc.afterFailure != nil {
					tc.afterFailure(h.engine)
				}
			}
			if tc.repair {
				h.backend.mu.Lock()
				h.backend.repairNext = true
				h.backend.mu.Unlock()
			}
			if tc.failClear {
				ct.FailNextClear(errors.New("netlink: operation not permitted"))
			}
			if r := h.sync(); r.Err != nil {
				t.Fatalf("sync result has error %v", r.Err)
			}

			remaining := map[conntrack.Flow]bool{}
			for _, f := range ct.Flows() {
				remaining[f] = true
			}
			var deleted []string
			for name, f := range engineFlows {
				if !remaining[f] {
					deleted = append(deleted, name)
				}
			}
			slices.Sort(deleted)
			if !slices.Equal(deleted, tc.wantDeleted) {
				t.Errorf("deleted flows %q\nwant              %q", deleted, tc.wantDeleted)
			}
		})
	}
}
