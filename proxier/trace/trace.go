// Package trace answers "where does this packet go?" on a live node: it
// reads kproxy's rules as the kernel holds them (iptables-save of the
// packet's family in iptables mode, `nft list table` of kproxy's table in
// nftables mode, the IPVS virtual servers, kproxy's ipsets and its
// iptables chains of IPVS mode in IPVS mode), walks them for the first
// packet of a connection with the packet tracers the backends' tests use
// (pkg/iptables/iptablestest, proxier/nftables/nftablestest and
// proxier/ipvs/ipvstest), and says what happens in Service terms:
// the rules met, the Service they belong to (from the comments kproxy
// writes), and the outcome: DNAT to which endpoints with what probability,
// masquerade, session affinity, drop or reject, and why.
//
// It only reads. See docs/design.md, "kproxy trace".
package trace

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/ipset"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/ipvs"
	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
)

// Proxy modes.
const (
	ModeIPTables = "iptables"
	ModeNFTables = "nftables"
	ModeIPVS     = "ipvs"
)

// Source classes of a traced packet (Request.From).
const (
	// FromPod: a pod's packet, arriving on one of the node's interfaces.
	FromPod = "pod"
	// FromNode: a process of the node itself sends it.
	FromNode = "node"
	// FromExternal: another host's packet, arriving on an interface.
	FromExternal = "external"
)

// SourcePort is the source port of every traced packet: kproxy's rules
// never look at it.
const SourcePort = 40000

// Request is the packet to trace.
type Request struct {
	Source, Destination netip.Addr
	// Protocol is "tcp", "udp" or "sctp"; default "tcp".
	Protocol        string
	DestinationPort int
	// From is FromPod, FromNode or FromExternal; "" means FromNode when
	// Source is one of the node's addresses, else FromExternal.
	From string
	// Mode is ModeIPTables, ModeNFTables or ModeIPVS; "" finds the mode
	// whose state the node holds.
	Mode string
}

// Source is where the node's live state is read.
type Source struct {
	// IPTables are the node's iptables by family (absent: not usable).
	IPTables map[v1.IPFamily]ipt.Interface
	// NFT runs the nft command with args and returns its standard
	// output; nil when nft is not usable.
	NFT func(ctx context.Context, args ...string) ([]byte, error)
	// LocalAddresses lists the node's addresses (in IPVS mode, the dummy
	// device's included).
	LocalAddresses func() ([]netip.Addr, error)
	// IPVS and IPSet are the node's IPVS table and ipsets (nil: not
	// usable), read in IPVS mode.
	IPVS  ipvs.Interface
	IPSet ipset.Interface
}

// Verdicts of a Report.
const (
	Delivered  = "delivered"
	Rejected   = "rejected"
	Dropped    = "dropped"
	NotHandled = "not-handled"
)

// Report is what happens to the first packet of the connection.
type Report struct {
	Mode   string `json:"mode"`
	Family string `json:"family"`
	// Packet restates the request, From resolved.
	Packet PacketInfo `json:"packet"`
	// Verdict is Delivered, Rejected, Dropped or NotHandled.
	Verdict string `json:"verdict"`
	// Service is the Service port the packet is for ("namespace/name:port"),
	// "" when no rule names one.
	Service string `json:"service,omitempty"`
	// Reason says the verdict in Service terms, one line.
	Reason string `json:"reason"`
	// Endpoints are where a delivered packet may go.
	Endpoints []Endpoint `json:"endpoints,omitempty"`
	// AffinitySeconds is the ClientIP session affinity timeout (0: none).
	AffinitySeconds int `json:"affinitySeconds,omitempty"`
	// Paths are the ways through the rules, one per distinct outcome.
	Paths []Path `json:"paths"`
	// Notes are caveats about what was read.
	Notes []string `json:"notes,omitempty"`
}

// PacketInfo is the traced packet.
type PacketInfo struct {
	Source          string `json:"source"`
	Destination     string `json:"destination"`
	Protocol        string `json:"protocol"`
	DestinationPort int    `json:"destinationPort"`
	From            string `json:"from"`
}

// Endpoint is one destination of a delivered packet.
type Endpoint struct {
	// Address is "ip:port" ("[ip]:port" for IPv6).
	Address     string  `json:"address"`
	Probability float64 `json:"probability"`
	// Masquerade: the endpoint sees the node's address as the client.
	Masquerade bool `json:"masquerade"`
}

// Path is one way through the rules and where it ends.
type Path struct {
	// Verdict is Delivered (DNAT), Rejected, Dropped or NotHandled.
	Verdict    string  `json:"verdict"`
	DNAT       string  `json:"dnat,omitempty"`
	Masquerade bool    `json:"masquerade"`
	Steps      []Step  `json:"steps"`
	Weight     float64 `json:"probability"`
}

// Step is one rule (or map element) the packet met.
type Step struct {
	// Where: "nat/KPROXY-SERVICES rule 3" (iptables), "chain services
	// rule 1" or "map service-ips" (nftables).
	Where string `json:"where"`
	// Rule is the rule or element text.
	Rule string `json:"rule"`
	// Service is the Service port the rule or element names, if any.
	Service string `json:"service,omitempty"`
}

// ErrNoState: the node holds no kproxy state for the mode and family.
var ErrNoState = errors.New("no kproxy state on this node")

// Validate checks r and fills its defaults.
func (r *Request) Validate() error {
	var errs []error
	if !r.Source.IsValid() {
		errs = append(errs, errors.New("--src: an IP address is required"))
	}
	if !r.Destination.IsValid() {
		errs = append(errs, errors.New("--dst: an IP address is required"))
	}
	if r.Source.IsValid() && r.Destination.IsValid() && r.Source.Unmap().Is4() != r.Destination.Unmap().Is4() {
		errs = append(errs, fmt.Errorf("--src %s and --dst %s are of different IP families", r.Source, r.Destination))
	}
	r.Source, r.Destination = r.Source.Unmap(), r.Destination.Unmap()
	if r.DestinationPort < 1 || r.DestinationPort > 65535 {
		errs = append(errs, fmt.Errorf("--dport %d is out of range 1-65535", r.DestinationPort))
	}
	r.Protocol = strings.ToLower(r.Protocol)
	if r.Protocol == "" {
		r.Protocol = "tcp"
	}
	switch r.Protocol {
	case "tcp", "udp", "sctp":
	default:
		errs = append(errs, fmt.Errorf("--proto %q: want tcp, udp or sctp", r.Protocol))
	}
	switch r.From {
	case "", FromPod, FromNode, FromExternal:
	default:
		errs = append(errs, fmt.Errorf("--from %q: want pod, node or external", r.From))
	}
	switch r.Mode {
	case "", ModeIPTables, ModeNFTables, ModeIPVS:
	default:
		errs = append(errs, fmt.Errorf("--proxy-mode %q: want iptables, nftables or ipvs", r.Mode))
	}
	return errors.Join(errs...)
}

// Run traces r over the node's live state.
func Run(ctx context.Context, r Request, src Source) (*Report, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	family := v1.IPv4Protocol
	if r.Destination.Is6() {
		family = v1.IPv6Protocol
	}
	var local []netip.Addr
	if src.LocalAddresses != nil {
		var err error
		if local, err = src.LocalAddresses(); err != nil {
			return nil, fmt.Errorf("listing the node's addresses: %w", err)
		}
	}
	isLocal := r.Source.IsLoopback() || slices.Contains(local, r.Source)
	if r.From == "" {
		r.From = FromExternal
		if isLocal {
			r.From = FromNode
		}
	}

	// What each mode left on the node, for this family.
	var ipts *iptablesState
	var nftText []byte
	var found []string
	var readErrs []error
	if r.Mode != ModeNFTables && src.IPTables[family] != nil {
		st, err := readIPTables(ctx, src.IPTables[family])
		if err != nil {
			readErrs = append(readErrs, err)
		} else {
			ipts = st
			if st.iptablesMode {
				found = append(found, ModeIPTables)
			}
			if st.ipvsMode && r.Mode == "" {
				found = append(found, ModeIPVS)
			}
		}
	}
	nftFamily := knftables.IPv4Family
	if family == v1.IPv6Protocol {
		nftFamily = knftables.IPv6Family
	}
	if (r.Mode == "" || r.Mode == ModeNFTables) && src.NFT != nil {
		out, err := src.NFT(ctx, "list", "table", string(nftFamily), nftbackend.TableName)
		if err == nil {
			nftText = out
			found = append(found, ModeNFTables)
		} else if r.Mode == ModeNFTables {
			readErrs = append(readErrs, fmt.Errorf("nft list table %s %s: %w", nftFamily, nftbackend.TableName, err))
		}
	}
	mode := r.Mode
	switch {
	case mode == "" && len(found) == 1:
		mode = found[0]
	case mode == "" && len(found) > 1:
		return nil, fmt.Errorf("this node holds the %s state of several proxy modes (%s): pass --proxy-mode", family, strings.Join(found, ", "))
	}
	switch {
	case mode == "" || (mode == ModeIPTables && (ipts == nil || !ipts.iptablesMode)) || (mode == ModeNFTables && nftText == nil) ||
		(mode == ModeIPVS && (ipts == nil || !ipts.ipvsMode)):
		what := "iptables, nftables or IPVS-mode"
		if mode != "" {
			what = mode
		}
		return nil, errors.Join(append([]error{fmt.Errorf("%w: no %s %s rules of kproxy found", ErrNoState, family, what)}, readErrs...)...)
	}

	rep := &Report{Mode: mode, Family: string(family), Packet: PacketInfo{
		Source: r.Source.String(), Destination: r.Destination.String(), Protocol: r.Protocol,
		DestinationPort: r.DestinationPort, From: r.From,
	}}
	if r.From == FromNode && !isLocal {
		rep.Notes = append(rep.Notes, fmt.Sprintf("%s is not one of this node's addresses: the node sends from it only if it gets it", r.Source))
	}
	var err error
	switch mode {
	case ModeIPTables:
		err = traceIPTables(rep, r, ipts, local)
	case ModeIPVS:
		err = traceIPVS(ctx, rep, r, src, ipts, local)
	default:
		var fake *knftables.Fake
		if fake, err = ParseNFTList(string(nftText), nftFamily, nftbackend.TableName); err == nil {
			err = traceNFTables(rep, r, fake, local)
		}
	}
	if err != nil {
		return nil, err
	}
	conclude(rep, r)
	return rep, nil
}

// conclude folds the paths into the report's verdict, endpoints and reason.
func conclude(rep *Report, r Request) {
	verdicts := map[string]bool{}
	eps := map[string]*Endpoint{}
	for _, p := range rep.Paths {
		verdicts[p.Verdict] = true
		if p.Verdict != Delivered {
			continue
		}
		e := eps[p.DNAT]
		if e == nil {
			e = &Endpoint{Address: p.DNAT}
			eps[p.DNAT] = e
		}
		e.Probability += p.Weight
		e.Masquerade = e.Masquerade || p.Masquerade
	}
	for _, e := range eps {
		rep.Endpoints = append(rep.Endpoints, *e)
	}
	slices.SortFunc(rep.Endpoints, func(a, b Endpoint) int { return strings.Compare(a.Address, b.Address) })
	switch {
	case len(verdicts) > 1:
		var vs []string
		for v := range verdicts {
			vs = append(vs, v)
		}
		slices.Sort(vs)
		rep.Verdict = "mixed"
		rep.Reason = "the rules give this packet several outcomes (" + strings.Join(vs, ", ") + "), which kproxy never writes: they are not kproxy's, or changed"
		return
	case len(verdicts) == 0:
		rep.Verdict = NotHandled
	default:
		for v := range verdicts {
			rep.Verdict = v
		}
	}
	svc := rep.Service
	if svc == "" {
		svc = "the Service"
	}
	switch rep.Verdict {
	case Delivered:
		masq := ""
		switch n := countMasq(rep.Endpoints); {
		case n == len(rep.Endpoints):
			masq = ", masqueraded (the endpoint sees the node as the client)"
		case n > 0:
			masq = ", masqueraded to some endpoints (hairpin: a pod reaching itself)"
		default:
			masq = ", not masqueraded (the endpoint sees " + r.Source.String() + ")"
		}
		rep.Reason = fmt.Sprintf("delivered: %s to one of %d endpoint(s)%s", svc, len(rep.Endpoints), masq)
		if rep.AffinitySeconds > 0 {
			rep.Reason += fmt.Sprintf("; ClientIP affinity keeps %s on the chosen endpoint for %ds", r.Source, rep.AffinitySeconds)
		}
	case NotHandled:
		if rep.Reason == "" {
			rep.Reason = fmt.Sprintf("not handled: no Service of kproxy's rules matches %s %s port %d; the packet goes on unchanged",
				r.Protocol, r.Destination, r.DestinationPort)
		}
	}
}

func countMasq(eps []Endpoint) int {
	n := 0
	for _, e := range eps {
		if e.Masquerade {
			n++
		}
	}
	return n
}

// serviceOf returns the Service port a comment names: its first field
// "namespace/name[:port]" (not an address prefix).
func serviceOf(comment string) string {
	for _, f := range strings.Fields(comment) {
		if !strings.Contains(f, "/") {
			continue
		}
		if _, err := netip.ParsePrefix(f); err == nil {
			continue
		}
		return f
	}
	return ""
}

// serviceName drops the port of "namespace/name:port" (a Service named
// otherwise is kept whole).
func serviceName(sp string) string {
	if i := strings.LastIndex(sp, ":"); strings.Contains(sp, "/") && i > strings.Index(sp, "/") {
		return sp[:i]
	}
	return sp
}

// Reasons for drops and rejects, in Service terms.
func rejectNoEndpoints(svc string) string {
	return fmt.Sprintf("rejected: %s has no endpoints (no ready or serving endpoint anywhere)", svc)
}

func dropLocal(policy, svc string) string {
	return fmt.Sprintf("dropped: %s is Local and this node has no ready or serving endpoint of %s", policy, serviceName(svc))
}

func dropSourceRange(src netip.Addr, svc string) string {
	return fmt.Sprintf("dropped: source %s is outside loadBalancerSourceRanges of %s", src, svc)
}
