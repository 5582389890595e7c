package iptables

// chainLocalnetFirewall (filter, jumped to from INPUT and OUTPUT) drops
// packets to 127.0.0.0/8 from other sources while
// net.ipv4.conf.all.route_localnet is 1. kproxy never sets that sysctl (it
// never serves node ports on loopback), but kube-proxy does, and leaves it
// set: a neighbour could then reach services listening on 127.0.0.1 by
// routing packets for 127.0.0.0/8 to the node. kube-proxy guards against
// this with the same rule in its KUBE-FIREWALL chain. The chain exists in
// both families, empty unless needed, so that a restart with the sysctl
// back at 0 just empties it.
const chainLocalnetFirewall = "KPROXY-LOCALNET-FIREWALL"

// localnetFirewall is chainLocalnetFirewall's content: the martian drop
// when Options.RouteLocalnet is set, for IPv4. Connections that conntrack
// already knows or that were DNATed (to a loopback address, by someone else
// on purpose) pass.
func (b *Backend) localnetFirewall() []string {
	if b.ipv6 || !b.opts.RouteLocalnet {
		return nil
	}
	return []string{comment("kproxy: block incoming localnet connections (route_localnet=1)") +
		" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"}
}
