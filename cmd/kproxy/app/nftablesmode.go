package app

import (
	"context"
	"fmt"
	"net/netip"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/netlink"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
)

// nftablesFor returns nftables mode's interfaces, bound to kproxy's table
// of each usable family. IPv4 is required: without the nft command or the
// kernel's nf_tables the error says so (kproxy never falls back to another
// mode); IPv6 is optional, as in iptables mode.
func nftablesFor(ctx context.Context, o *Options, deps runDeps) (map[v1.IPFamily]knftables.Interface, error) {
	if deps.nftables != nil {
		return deps.nftables, nil
	}
	out := map[v1.IPFamily]knftables.Interface{}
	v4, err := nftbackend.NewInterfaceWith(nftbackend.InterfaceOptions{Family: v1.IPv4Protocol, Timeout: o.KernelCallTimeout})
	if err != nil {
		return nil, fmt.Errorf("--proxy-mode=nftables needs the nft command (nftables v1.0.1 or later) and the kernel's nf_tables: %w", err)
	}
	out[v1.IPv4Protocol] = v4
	v6, err := nftbackend.NewInterfaceWith(nftbackend.InterfaceOptions{Family: v1.IPv6Protocol, Timeout: o.KernelCallTimeout})
	if err != nil {
		klog.FromContext(ctx).Info("IPv6 nftables is not usable; running IPv4 only", "err", err)
	} else {
		out[v1.IPv6Protocol] = v6
	}
	return out, nil
}

// newNFTablesBackend builds the nftables backend of one family.
func newNFTablesBackend(o *Options, family v1.IPFamily, nft knftables.Interface, nodePortAddresses *proxy.NodePortAddresses,
	localAddresses func() ([]netip.Addr, error)) (proxier.Backend, error) {
	if localAddresses == nil {
		localAddresses = netlink.HostAddresses
	}
	bit := o.MasqueradeBit
	b, err := nftbackend.New(nftbackend.Options{
		NFTables: nft, Family: family, MasqueradeBit: &bit, NodePortAddresses: nodePortAddresses, LocalAddresses: localAddresses,
		// The periodic sync checks the canaries: a flushed or deleted
		// table is repaired within one sync period.
		CanaryInterval: o.SyncPeriod,
	})
	if err != nil {
		return nil, fmt.Errorf("nftables backend (%s): %w", family, err)
	}
	return b, nil
}
