package ipvs

import (
	"context"

	"github.com/kproxy/kproxy/proxier/cleanup"
)

// Cleanup implements proxier.Backend with cleanup.Cleanup: every mode's
// iptables chains, then IPVS mode's ipsets, virtual servers and dummy
// device. The backend's own record of virtual servers counts as ownership
// too.
func (b *Backend) Cleanup(ctx context.Context) error {
	ours := make(map[cleanup.VirtualServer]bool, len(b.ours))
	for k := range b.ours {
		ours[cleanup.VirtualServer{Address: k.addr, Protocol: k.proto, Port: k.port}] = true
	}
	err := cleanup.Cleanup(ctx, cleanup.Options{
		IPTables: b.ipt, IPVS: b.ipvs, IPSet: b.ipset, Netlink: b.nl, DummyDevice: b.device, OwnedVirtualServers: ours,
	})
	b.ours = map[vsKey]bool{}
	b.terminating = map[vsKey]*termVS{}
	b.reset()
	b.nodePortAddrs, b.localAddrs = nil, nil
	return err
}
