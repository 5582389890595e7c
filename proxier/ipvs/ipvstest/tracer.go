// Package ipvstest traces the first packet of a connection through IPVS
// mode's kernel state: netfilter (kproxy's iptables chains of IPVS mode,
// walked by the iptablestest tracer with the ipsets they match) up to local
// delivery or a DNAT to an endpoint, then IPVS (the virtual server at the
// destination sends the packet to its real servers of non-zero weight; one
// without such a real server answers with ICMP port unreachable), then the
// way out of the rewritten packet (nat POSTROUTING decides masquerading for
// packets from outside the node).
//
// The IPVS backend's tests trace their fake kernel with it and `kproxy
// trace` traces the node's live state with it (docs/design.md, "kproxy
// trace").
package ipvstest

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/pkg/ipvs"
)

// Tables are the iptables tables IPVS mode writes.
var Tables = []ipt.Table{ipt.TableNAT, ipt.TableFilter, ipt.TableMangle}

// State is one family's IPVS-mode kernel state.
type State struct {
	// IPTables holds the family's nat, filter and mangle tables: kproxy's
	// chains of IPVS mode and the hooks jumping to them.
	IPTables *iptablestest.Fake
	// Sets are the ipsets' entries by set name, as `ipset list` prints
	// them (SetsOf).
	Sets map[string][]string
	// IPVS holds the virtual servers.
	IPVS ipvs.Interface
	// LocalAddrs are the node's addresses, the dummy device's included.
	LocalAddrs []netip.Addr
}

// Packet is the first packet of a connection.
type Packet struct {
	Source, Destination netip.Addr
	// Protocol is "tcp", "udp" or "sctp".
	Protocol        string
	SourcePort      int
	DestinationPort int
	Origin          iptablestest.Origin
}

// Outcome is one way the state treats the packet.
type Outcome struct {
	// Verdict is "ACCEPT" (delivered: to RealServers, or by netfilter
	// alone to Netfilter.DNAT when VirtualServer is nil and DNAT is set;
	// neither: not handled), "DROP" or "REJECT" (by a rule, or by IPVS
	// when VirtualServer is set: it has no real server to take it).
	Verdict string
	// Netfilter is the way in: the rules met up to local delivery or up
	// to a DNAT to an endpoint.
	Netfilter iptablestest.Outcome
	// VirtualServer is the virtual server that took the packet (nil: none).
	VirtualServer *ipvs.Service
	// RealServers are its real servers of non-zero weight.
	RealServers []RealServer
}

// RealServer is one real server a delivered packet may go to.
type RealServer struct {
	Destination ipvs.Destination
	// Masquerade: the real server sees the node's address as the client.
	Masquerade bool
	// Path is the way out of the packet IPVS rewrote ("table/chain#n"),
	// for packets from outside the node.
	Path []string
}

// SetsOf reads the entries of the named sets from sets (nil names: every
// set), as State.Sets wants them. Absent sets are left out.
func SetsOf(ctx context.Context, sets ipset.Interface, names []string) (map[string][]string, error) {
	if names == nil {
		var err error
		if names, err = sets.ListSets(ctx); err != nil {
			return nil, fmt.Errorf("listing ipsets: %w", err)
		}
	}
	out := map[string][]string{}
	for _, n := range names {
		entries, err := sets.Entries(ctx, n)
		if err != nil {
			if errors.Is(err, ipset.ErrNotExist) {
				continue
			}
			return nil, fmt.Errorf("listing ipset %s: %w", n, err)
		}
		out[n] = []string{}
		for _, e := range entries {
			out[n] = append(out[n], e.String())
		}
	}
	return out, nil
}

// Trace returns every way st treats p.
func Trace(ctx context.Context, st State, p Packet) ([]Outcome, error) {
	if p.SourcePort == 0 {
		p.SourcePort = 40000
	}
	opts := iptablestest.TraceOptions{LocalAddrs: st.LocalAddrs, IPSets: st.Sets}
	nf, err := st.IPTables.Trace(iptablestest.Packet{Source: p.Source, Destination: p.Destination, Protocol: p.Protocol,
		SourcePort: p.SourcePort, DestinationPort: p.DestinationPort, Origin: p.Origin}, opts)
	if err != nil {
		return nil, err
	}
	var out []Outcome
	for _, o := range nf {
		res := Outcome{Verdict: o.Verdict, Netfilter: o}
		if o.Verdict != "ACCEPT" {
			out = append(out, res)
			continue
		}
		to, port := p.Destination, p.DestinationPort
		if o.DNAT != "" {
			ap, err := netip.ParseAddrPort(o.DNAT)
			if err != nil {
				return nil, fmt.Errorf("DNAT to %q: %w", o.DNAT, err)
			}
			to, port = ap.Addr(), int(ap.Port())
		}
		if !isLocal(to, st.LocalAddrs) {
			// Forwarded: DNATed by netfilter itself to an endpoint, or
			// not kproxy's.
			out = append(out, res)
			continue
		}
		vs, dests, err := lookup(ctx, st.IPVS, to, p.Protocol, port)
		if err != nil {
			return nil, err
		}
		if vs == nil {
			out = append(out, res)
			continue
		}
		res.VirtualServer = vs
		if len(dests) == 0 {
			res.Verdict = "REJECT"
			out = append(out, res)
			continue
		}
		for _, d := range dests {
			rs := RealServer{Destination: *d, Masquerade: o.Masquerade}
			if p.Origin == iptablestest.OriginExternal {
				// IPVS sends the rewritten packet out through LOCAL_OUT and
				// POSTROUTING, with the mark it got in PREROUTING.
				if rs.Masquerade, rs.Path, err = postIPVS(ctx, st, p, netip.AddrPortFrom(d.Address, d.Port), o.Mark, opts); err != nil {
					return nil, err
				}
			}
			res.RealServers = append(res.RealServers, rs)
		}
		out = append(out, res)
	}
	return out, nil
}

func isLocal(a netip.Addr, local []netip.Addr) bool {
	if a.IsLoopback() {
		return true
	}
	for _, l := range local {
		if l == a {
			return true
		}
	}
	return false
}

// lookup returns the virtual server at addr:port and its real servers of
// non-zero weight; nil when there is none.
func lookup(ctx context.Context, i ipvs.Interface, addr netip.Addr, proto string, port int) (*ipvs.Service, []*ipvs.Destination, error) {
	svcs, err := i.Services(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("listing IPVS virtual servers: %w", err)
	}
	for _, s := range svcs {
		if s.Address != addr || int(s.Port) != port || !strings.EqualFold(string(s.Protocol), proto) {
			continue
		}
		dests, err := i.Destinations(ctx, s)
		if err != nil {
			return nil, nil, fmt.Errorf("listing the real servers of %s: %w", s, err)
		}
		var out []*ipvs.Destination
		for _, d := range dests {
			if d.Weight > 0 {
				out = append(out, d)
			}
		}
		return s, out, nil
	}
	return nil, nil, nil
}

// postIPVS traces the packet IPVS rewrote to ep: LOCAL_OUT (nat OUTPUT
// does not run again for the connection) and POSTROUTING, with the mark
// from PREROUTING. It reports whether the packet is masqueraded.
func postIPVS(ctx context.Context, st State, p Packet, ep netip.AddrPort, mark uint32, opts iptablestest.TraceOptions) (bool, []string, error) {
	scratch, err := outputPath(ctx, st.IPTables, mark)
	if err != nil {
		return false, nil, err
	}
	outs, err := scratch.Trace(iptablestest.Packet{Source: p.Source, Destination: ep.Addr(), Protocol: p.Protocol, SourcePort: p.SourcePort,
		DestinationPort: int(ep.Port()), Origin: iptablestest.OriginLocal}, opts)
	if err != nil {
		return false, nil, err
	}
	masq := false
	var path []string
	for _, o := range outs {
		if o.Verdict != "ACCEPT" {
			return false, nil, fmt.Errorf("packet to %s after IPVS: %s", ep, o.Verdict)
		}
		masq = masq || o.Masquerade
		path = ownPath(o.Path, mark)
	}
	return masq, path, nil
}

// ownPath is a path through outputPath's copy as a path through the
// ruleset: without the MARK rule outputPath put first in mangle OUTPUT.
func ownPath(path []string, mark uint32) []string {
	if mark == 0 {
		return path
	}
	const prefix = "mangle/OUTPUT#"
	var out []string
	for _, w := range path {
		if n, err := strconv.Atoi(strings.TrimPrefix(w, prefix)); err == nil && strings.HasPrefix(w, prefix) {
			if n == 1 {
				continue
			}
			w = prefix + strconv.Itoa(n-1)
		}
		out = append(out, w)
	}
	return out
}

// outputPath copies the ruleset as the output path of a packet IPVS
// rewrote: mangle OUTPUT sets the mark the packet got on its way in (it
// runs first) and nat OUTPUT is empty.
func outputPath(ctx context.Context, f *iptablestest.Fake, mark uint32) (*iptablestest.Fake, error) {
	out := iptablestest.NewFake(f.Protocol())
	out.RandomFully = f.RandomFully
	for _, table := range Tables {
		data, err := f.SaveInto(ctx, table)
		if err != nil {
			return nil, err
		}
		if err := out.Restore(ctx, data); err != nil {
			return nil, fmt.Errorf("copying the %s table: %w", table, err)
		}
	}
	if err := out.FlushChain(ctx, ipt.TableNAT, ipt.ChainOutput); err != nil {
		return nil, err
	}
	if mark != 0 {
		if _, err := out.EnsureRule(ctx, ipt.Prepend, ipt.TableMangle, ipt.ChainOutput,
			"-j", "MARK", "--set-xmark", fmt.Sprintf("%#x/0xffffffff", mark)); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Deviation is a flow of the shared behaviour cases (package proxiertest)
// whose outcome differs in IPVS mode by design.
type Deviation struct {
	Case, Flow string
	// Want is the outcome in IPVS mode, as proxiertest names verdicts.
	Want string
	Why  string
}

// Deviations are every shared flow IPVS mode answers differently.
var Deviations = []Deviation{
	{
		Case: "clusterIP reaches every endpoint; off-cluster sources are masqueraded", Flow: "other port",
		Want: "rejected",
		Why: "a ClusterIP is a local address on the dummy device in IPVS mode; KPROXY-IPVS-FILTER rejects new " +
			"connections to its ports that no Service uses (upstream's KUBE-IPVS-FILTER), where iptables mode " +
			"leaves the packet to routing",
	},
}
