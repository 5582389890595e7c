package ipvs

import (
	"context"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kproxy/kproxy/pkg/netnstest"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestRealKernelFlushRepaired removes kproxy's state with the real tools,
// as an operator or a firewall reload would, and runs one sync with
// nothing changed: it must find the damage, be full, and leave the
// services working (docs/design.md, "IPVS mode under faults").
func TestRealKernelFlushRepaired(t *testing.T) {
	r := newRealNode(t, func(name string, ns *netnstest.NS, bind string) { ns.StartEcho(t, "tcp4", bind, name) })
	ctx := t.Context()
	r.engine.OnServiceAdd(pt.Service("web", "10.96.0.10", pt.NodePort(30080)))
	r.engine.OnEndpointSliceAdd(r.slice("web", "be1", "be2"))
	r.sync()
	works := func(t *testing.T) {
		t.Helper()
		for _, c := range []struct {
			from *netnstest.NS
			addr string
		}{
			{r.pods["pod"].ns, "10.96.0.10:80"},
			{r.client, netip.AddrPortFrom(realNodeAddr.Addr(), 30080).String()},
		} {
			if be, _, err := request(ctx, c.from, c.addr); err != nil || (be != "be1" && be != "be2") {
				t.Errorf("request to %s: backend %q, error %v", c.addr, be, err)
			}
		}
	}
	works(t)
	for _, tc := range []struct {
		name  string
		cmds  [][]string
		found string
	}{
		{name: "ipvsadm -C", cmds: [][]string{{"ipvsadm", "-C"}}, found: "IPVS virtual server"},
		{name: "ipset flush", cmds: [][]string{{"ipset", "flush"}}, found: "was flushed"},
		{
			name: "iptables -F of every table, then ipset destroy",
			cmds: [][]string{
				{"iptables", "-t", "nat", "-F"}, {"iptables", "-t", "filter", "-F"}, {"iptables", "-t", "mangle", "-F"},
				{"ipset", "destroy"},
			},
			found: "is gone",
		},
		{name: "ip addr flush dev " + DefaultDummyDevice, cmds: [][]string{{"ip", "addr", "flush", "dev", DefaultDummyDevice}}, found: "was missing"},
		{name: "ip link del " + DefaultDummyDevice, cmds: [][]string{{"ip", "link", "del", DefaultDummyDevice}}, found: "is gone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, cmd := range tc.cmds {
				if out, err := r.node.Exec(ctx, cmd[0], cmd[1:]...); err != nil {
					t.Fatalf("%s: %v\n%s", strings.Join(cmd, " "), err, out)
				}
			}
			start := time.Now()
			r.sync()
			st := r.backend.LastSync()
			t.Logf("repaired in %v by a full sync that found: %s", time.Since(start).Round(time.Millisecond), st.Repaired)
			if !st.Full || !strings.Contains(st.Repaired, tc.found) {
				t.Errorf("sync after %s: full %v, found %q; want a full sync that found %q", tc.name, st.Full, st.Repaired, tc.found)
			}
			works(t)
			r.sync()
			if st := r.backend.LastSync(); st.Full || st.Repaired != "" {
				t.Errorf("the sync after the repair: full %v, found %q", st.Full, st.Repaired)
			}
		})
	}
	r.backend.initialized = false
	r.sync()
	if err := r.backend.Cleanup(context.Background()); err != nil {
		t.Fatal(err)
	}
	r.checkNothingOurs("after cleanup", 0)
}
