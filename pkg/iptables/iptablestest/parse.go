package iptablestest

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/kproxy/kproxy/pkg/iptables"
)

// This file holds the rule parser shared by the fake and the packet tracer:
// ParseRule turns the arguments of one rule (everything after "-A chain", as
// iptables.SplitArgs splits a restore line) into a Rule. It supports the
// subset of iptables that kproxy renders, and rejects anything else, so that
// a rendering mistake fails a test instead of passing silently.

// Limits enforced by the kernel or by iptables userspace.
const (
	// MaxChainNameLength is the longest chain name iptables accepts.
	MaxChainNameLength  = 28
	maxRecentNameLength = 200
	maxIPSetNameLength  = 31
	maxLogPrefixLength  = 29
	maxMultiportEntries = 15
	maxInterfaceLength  = 15
)

// Rule is one parsed iptables rule.
type Rule struct {
	// Args are the arguments the rule was parsed from.
	Args []string

	Source       *AddrMatch // -s; nil matches any source
	Destination  *AddrMatch // -d; nil matches any destination
	Protocol     *ProtocolMatch
	InInterface  *InterfaceMatch // -i
	OutInterface *InterfaceMatch // -o

	// Matches are the -m matches in the order they appear; iptables evaluates
	// them in this order after the fields above.
	Matches []Match

	// Target is nil for a rule without -j/-g (it only counts packets).
	Target *Target
}

// String renders the rule's arguments.
func (r *Rule) String() string { return iptables.JoinArgs(r.Args) }

// AddrMatch is -s or -d: (address & Mask) == Addr, possibly negated. Mask
// need not be contiguous.
type AddrMatch struct {
	Addr   netip.Addr // already masked
	Mask   netip.Addr // same family as Addr
	Negate bool
}

// Contains reports whether a matches, negation applied. Addresses of the
// other family never match (and so always match when negated).
func (m *AddrMatch) Contains(a netip.Addr) bool {
	return maskedEqual(a, m.Mask, m.Addr) != m.Negate
}

func maskedEqual(a, mask, want netip.Addr) bool {
	if a.Is4() != want.Is4() || a.Is4() != mask.Is4() {
		return false
	}
	return andAddr(a, mask) == want
}

func andAddr(a, mask netip.Addr) netip.Addr {
	x, m := a.As16(), mask.As16()
	for i := range x {
		x[i] &= m[i]
	}
	r := netip.AddrFrom16(x)
	if a.Is4() {
		return r.Unmap()
	}
	return r
}

// ProtocolMatch is -p.
type ProtocolMatch struct {
	Name   string // "tcp", "udp", "sctp", "icmp", "icmpv6"
	Negate bool
}

// InterfaceMatch is -i or -o; a trailing "+" matches any name with that
// prefix.
type InterfaceMatch struct {
	Name   string
	Negate bool
}

// Matches reports whether iface matches, negation applied. An empty iface
// (no interface) matches no name.
func (m *InterfaceMatch) Matches(iface string) bool {
	var ok bool
	if prefix, wild := strings.CutSuffix(m.Name, "+"); wild {
		ok = iface != "" && strings.HasPrefix(iface, prefix)
	} else {
		ok = iface == m.Name
	}
	return ok != m.Negate
}

// Match is one -m match. The concrete types are *PortMatch,
// *MultiportMatch, *CommentMatch, *AddrTypeMatch, *MarkMatch,
// *ConntrackMatch, *StatisticMatch, *RecentMatch and *SetMatch.
type Match interface {
	// Module is the match module name as written after -m.
	Module() string
	option(opt string, neg bool, next func() (string, error)) (bool, error)
	done(r *Rule) error
}

// PortRange is an inclusive range of ports.
type PortRange struct{ First, Last int }

// Contains reports whether port is in the range.
func (p PortRange) Contains(port int) bool { return port >= p.First && port <= p.Last }

// PortMatch is -m tcp, -m udp or -m sctp (also loaded implicitly by --dport
// or --sport after -p).
type PortMatch struct {
	Protocol          string
	SourcePort        *PortRange
	SourceNegate      bool
	DestinationPort   *PortRange
	DestinationNegate bool
}

func (m *PortMatch) Module() string { return m.Protocol }

func (m *PortMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	var dst **PortRange
	var negp *bool
	switch opt {
	case "--sport", "--source-port":
		dst, negp = &m.SourcePort, &m.SourceNegate
	case "--dport", "--destination-port":
		dst, negp = &m.DestinationPort, &m.DestinationNegate
	default:
		return false, nil
	}
	if *dst != nil {
		return true, fmt.Errorf("multiple %s options", opt)
	}
	v, err := next()
	if err != nil {
		return true, err
	}
	pr, err := parsePortRange(v)
	if err != nil {
		return true, fmt.Errorf("%s: %w", opt, err)
	}
	*dst, *negp = &pr, neg
	return true, nil
}

func (m *PortMatch) done(r *Rule) error {
	if r.Protocol == nil || r.Protocol.Name != m.Protocol || r.Protocol.Negate {
		return fmt.Errorf("match %s is only valid with -p %s", m.Protocol, m.Protocol)
	}
	return nil
}

// MultiportMatch is -m multiport.
type MultiportMatch struct {
	// Direction is "source" (--sports), "destination" (--dports) or "either"
	// (--ports).
	Direction string
	Ports     []PortRange
	Negate    bool
}

func (m *MultiportMatch) Module() string { return "multiport" }

func (m *MultiportMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	var dir string
	switch opt {
	case "--sports", "--source-ports":
		dir = "source"
	case "--dports", "--destination-ports":
		dir = "destination"
	case "--ports":
		dir = "either"
	default:
		return false, nil
	}
	if m.Direction != "" {
		return true, fmt.Errorf("multiport accepts only one of --sports, --dports, --ports")
	}
	v, err := next()
	if err != nil {
		return true, err
	}
	entries := 0
	for _, part := range strings.Split(v, ",") {
		pr, err := parsePortRange(part)
		if err != nil {
			return true, fmt.Errorf("%s: %w", opt, err)
		}
		entries++
		if pr.First != pr.Last || strings.Contains(part, ":") {
			entries++
		}
		m.Ports = append(m.Ports, pr)
	}
	if entries > maxMultiportEntries {
		return true, fmt.Errorf("%s: too many ports (ranges count twice, at most %d)", opt, maxMultiportEntries)
	}
	m.Direction, m.Negate = dir, neg
	return true, nil
}

func (m *MultiportMatch) done(r *Rule) error {
	if m.Direction == "" {
		return fmt.Errorf("multiport needs --sports, --dports or --ports")
	}
	if !hasPortProtocol(r) {
		return fmt.Errorf("multiport needs -p tcp, -p udp or -p sctp")
	}
	return nil
}

// Contains reports whether the packet's ports match, negation applied.
func (m *MultiportMatch) Contains(sport, dport int) bool {
	found := false
	for _, pr := range m.Ports {
		switch m.Direction {
		case "source":
			found = pr.Contains(sport)
		case "destination":
			found = pr.Contains(dport)
		default:
			found = pr.Contains(sport) || pr.Contains(dport)
		}
		if found {
			break
		}
	}
	return found != m.Negate
}

// CommentMatch is -m comment.
type CommentMatch struct {
	Comment string
	set     bool
}

func (m *CommentMatch) Module() string { return "comment" }

func (m *CommentMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	if opt != "--comment" {
		return false, nil
	}
	if neg {
		return true, fmt.Errorf("--comment cannot be negated")
	}
	if m.set {
		return true, fmt.Errorf("multiple --comment options")
	}
	v, err := next()
	if err != nil {
		return true, err
	}
	if len(v) > iptables.MaxCommentLength {
		return true, fmt.Errorf("comment is %d bytes, longer than %d", len(v), iptables.MaxCommentLength)
	}
	m.Comment, m.set = v, true
	return true, nil
}

func (m *CommentMatch) done(*Rule) error {
	if !m.set {
		return fmt.Errorf("comment match needs --comment")
	}
	return nil
}

var addrTypes = map[string]bool{
	"UNSPEC": true, "UNICAST": true, "LOCAL": true, "BROADCAST": true, "ANYCAST": true,
	"MULTICAST": true, "BLACKHOLE": true, "UNREACHABLE": true, "PROHIBIT": true,
	"THROW": true, "NAT": true, "XRESOLVE": true,
}

// AddrTypeMatch is -m addrtype.
type AddrTypeMatch struct {
	SourceTypes       []string
	SourceNegate      bool
	DestinationTypes  []string
	DestinationNegate bool
	LimitIfaceIn      bool
	LimitIfaceOut     bool
}

func (m *AddrTypeMatch) Module() string { return "addrtype" }

func (m *AddrTypeMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	switch opt {
	case "--src-type", "--dst-type":
		dst, negp := &m.SourceTypes, &m.SourceNegate
		if opt == "--dst-type" {
			dst, negp = &m.DestinationTypes, &m.DestinationNegate
		}
		if *dst != nil {
			return true, fmt.Errorf("multiple %s options", opt)
		}
		v, err := next()
		if err != nil {
			return true, err
		}
		for _, t := range strings.Split(v, ",") {
			if !addrTypes[t] {
				return true, fmt.Errorf("%s: unknown address type %q", opt, t)
			}
			*dst = append(*dst, t)
		}
		*negp = neg
	case "--limit-iface-in", "--limit-iface-out":
		if neg {
			return true, fmt.Errorf("%s cannot be negated", opt)
		}
		if opt == "--limit-iface-in" {
			m.LimitIfaceIn = true
		} else {
			m.LimitIfaceOut = true
		}
	default:
		return false, nil
	}
	return true, nil
}

func (m *AddrTypeMatch) done(*Rule) error {
	if m.SourceTypes == nil && m.DestinationTypes == nil {
		return fmt.Errorf("addrtype needs --src-type or --dst-type")
	}
	if m.LimitIfaceIn && m.LimitIfaceOut {
		return fmt.Errorf("addrtype: --limit-iface-in and --limit-iface-out are exclusive")
	}
	return nil
}

// MarkMatch is -m mark --mark Value[/Mask]: (mark & Mask) == Value.
type MarkMatch struct {
	Value, Mask uint32
	Negate      bool
	set         bool
}

func (m *MarkMatch) Module() string { return "mark" }

func (m *MarkMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	if opt != "--mark" {
		return false, nil
	}
	if m.set {
		return true, fmt.Errorf("multiple --mark options")
	}
	v, err := next()
	if err != nil {
		return true, err
	}
	m.Value, m.Mask, err = parseValueMask(v)
	if err != nil {
		return true, fmt.Errorf("--mark: %w", err)
	}
	m.Negate, m.set = neg, true
	return true, nil
}

func (m *MarkMatch) done(*Rule) error {
	if !m.set {
		return fmt.Errorf("mark match needs --mark")
	}
	return nil
}

// Matches reports whether mark matches, negation applied.
func (m *MarkMatch) Matches(mark uint32) bool { return (mark&m.Mask == m.Value) != m.Negate }

var conntrackStates = map[string]bool{
	"INVALID": true, "NEW": true, "ESTABLISHED": true, "RELATED": true, "UNTRACKED": true, "SNAT": true, "DNAT": true,
}

// ConntrackMatch is -m conntrack --ctstate (or the older -m state --state).
type ConntrackMatch struct {
	ModuleName string // "conntrack" or "state"
	States     []string
	Negate     bool
}

func (m *ConntrackMatch) Module() string { return m.ModuleName }

func (m *ConntrackMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	want := "--ctstate"
	if m.ModuleName == "state" {
		want = "--state"
	}
	if opt != want {
		return false, nil
	}
	if m.States != nil {
		return true, fmt.Errorf("multiple %s options", opt)
	}
	v, err := next()
	if err != nil {
		return true, err
	}
	for _, s := range strings.Split(v, ",") {
		if !conntrackStates[s] || (m.ModuleName == "state" && (s == "SNAT" || s == "DNAT")) {
			return true, fmt.Errorf("%s: unknown state %q", opt, s)
		}
		m.States = append(m.States, s)
	}
	m.Negate = neg
	return true, nil
}

func (m *ConntrackMatch) done(*Rule) error {
	if m.States == nil {
		return fmt.Errorf("%s match: only state matching is supported and it needs a state list", m.ModuleName)
	}
	return nil
}

// StatisticMatch is -m statistic.
type StatisticMatch struct {
	Mode        string // "random" or "nth"
	Probability float64
	Every       int
	Packet      int
	Negate      bool
	sawProb     bool
	sawPacket   bool
}

func (m *StatisticMatch) Module() string { return "statistic" }

func (m *StatisticMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	switch opt {
	case "--mode", "--probability", "--every", "--packet":
	default:
		return false, nil
	}
	v, err := next()
	if err != nil {
		return true, err
	}
	switch opt {
	case "--mode":
		if neg {
			return true, fmt.Errorf("--mode cannot be negated")
		}
		if m.Mode != "" {
			return true, fmt.Errorf("multiple --mode options")
		}
		if v != "random" && v != "nth" {
			return true, fmt.Errorf("--mode: unknown mode %q", v)
		}
		m.Mode = v
	case "--probability":
		if m.sawProb {
			return true, fmt.Errorf("multiple --probability options")
		}
		if v == "" || strings.Trim(v, "0123456789.eE+-") != "" {
			return true, fmt.Errorf("--probability: invalid number %q", v)
		}
		p, err := strconv.ParseFloat(v, 64)
		if err != nil || p < 0 || p > 1 {
			return true, fmt.Errorf("--probability: %q is not a number between 0 and 1", v)
		}
		m.Probability, m.sawProb = p, true
		m.Negate = m.Negate || neg
	case "--every":
		if m.Every != 0 {
			return true, fmt.Errorf("multiple --every options")
		}
		n, err := strconv.ParseUint(v, 10, 31)
		if err != nil || n == 0 {
			return true, fmt.Errorf("--every: invalid count %q", v)
		}
		m.Every = int(n)
		m.Negate = m.Negate || neg
	case "--packet":
		if neg {
			return true, fmt.Errorf("--packet cannot be negated")
		}
		if m.sawPacket {
			return true, fmt.Errorf("multiple --packet options")
		}
		n, err := strconv.ParseUint(v, 10, 31)
		if err != nil {
			return true, fmt.Errorf("--packet: invalid number %q", v)
		}
		m.Packet, m.sawPacket = int(n), true
	}
	return true, nil
}

func (m *StatisticMatch) done(*Rule) error {
	switch m.Mode {
	case "random":
		if !m.sawProb || m.Every != 0 || m.sawPacket {
			return fmt.Errorf("statistic --mode random needs --probability (and no --every/--packet)")
		}
	case "nth":
		if m.Every == 0 || m.sawProb {
			return fmt.Errorf("statistic --mode nth needs --every (and no --probability)")
		}
		if m.Packet >= m.Every {
			return fmt.Errorf("statistic: --packet must be smaller than --every")
		}
	default:
		return fmt.Errorf("statistic needs --mode")
	}
	return nil
}

// Threshold is the kernel's fixed-point probability: a random 31-bit
// number below it matches. 0 never matches; 1<<31 always does.
func (m *StatisticMatch) Threshold() uint32 {
	return uint32(m.Probability*(1<<31) + 0.5)
}

// RecentMatch is -m recent.
type RecentMatch struct {
	Name     string
	Command  string // "set", "rcheck", "update" or "remove"
	Negate   bool
	Seconds  int
	Reap     bool
	HitCount int
	RTTL     bool
	Mask     netip.Addr // invalid when not given (all ones)
	Dest     bool       // --rdest: the destination address is recorded/checked
	sawName  bool
	sawSide  bool
}

func (m *RecentMatch) Module() string { return "recent" }

func (m *RecentMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	switch opt {
	case "--set", "--rcheck", "--update", "--remove":
		if m.Command != "" {
			return true, fmt.Errorf("recent accepts only one of --set, --rcheck, --update, --remove")
		}
		m.Command, m.Negate = strings.TrimPrefix(opt, "--"), neg
		return true, nil
	case "--reap", "--rttl", "--rsource", "--rdest":
		if neg {
			return true, fmt.Errorf("%s cannot be negated", opt)
		}
		switch opt {
		case "--reap":
			m.Reap = true
		case "--rttl":
			m.RTTL = true
		default:
			if m.sawSide {
				return true, fmt.Errorf("recent accepts only one of --rsource, --rdest")
			}
			m.sawSide, m.Dest = true, opt == "--rdest"
		}
		return true, nil
	case "--name", "--seconds", "--hitcount", "--mask":
	default:
		return false, nil
	}
	if neg {
		return true, fmt.Errorf("%s cannot be negated", opt)
	}
	v, err := next()
	if err != nil {
		return true, err
	}
	switch opt {
	case "--name":
		if m.sawName {
			return true, fmt.Errorf("multiple --name options")
		}
		if v == "" || len(v) > maxRecentNameLength {
			return true, fmt.Errorf("--name: invalid name %q", v)
		}
		m.Name, m.sawName = v, true
	case "--seconds", "--hitcount":
		n, err := strconv.ParseUint(v, 10, 31)
		if err != nil || n == 0 {
			return true, fmt.Errorf("%s: invalid number %q", opt, v)
		}
		if opt == "--seconds" {
			m.Seconds = int(n)
		} else {
			m.HitCount = int(n)
		}
	case "--mask":
		a, err := netip.ParseAddr(v)
		if err != nil || a.Zone() != "" {
			return true, fmt.Errorf("--mask: invalid mask %q", v)
		}
		m.Mask = a
	}
	return true, nil
}

func (m *RecentMatch) done(*Rule) error {
	if m.Command == "" {
		return fmt.Errorf("recent needs one of --set, --rcheck, --update, --remove")
	}
	if (m.Seconds != 0 || m.HitCount != 0) && m.Command != "rcheck" && m.Command != "update" {
		return fmt.Errorf("recent --seconds/--hitcount need --rcheck or --update")
	}
	if m.Reap && m.Seconds == 0 {
		return fmt.Errorf("recent --reap needs --seconds")
	}
	if !m.sawName {
		m.Name = "DEFAULT"
	}
	return nil
}

// SetMatch is -m set --match-set Name Flags.
type SetMatch struct {
	Name   string
	Flags  []string // "src" or "dst", one per set dimension
	Negate bool
}

func (m *SetMatch) Module() string { return "set" }

func (m *SetMatch) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	if opt != "--match-set" {
		return false, nil
	}
	if m.Name != "" {
		return true, fmt.Errorf("multiple --match-set options")
	}
	name, err := next()
	if err != nil {
		return true, err
	}
	flags, err := next()
	if err != nil {
		return true, err
	}
	if name == "" || len(name) > maxIPSetNameLength || strings.HasPrefix(name, "-") {
		return true, fmt.Errorf("--match-set: invalid set name %q", name)
	}
	for _, f := range strings.Split(flags, ",") {
		if f != "src" && f != "dst" {
			return true, fmt.Errorf("--match-set: invalid flag %q", f)
		}
		m.Flags = append(m.Flags, f)
	}
	if len(m.Flags) > 6 {
		return true, fmt.Errorf("--match-set: too many flags")
	}
	m.Name, m.Negate = name, neg
	return true, nil
}

func (m *SetMatch) done(*Rule) error {
	if m.Name == "" {
		return fmt.Errorf("set match needs --match-set")
	}
	return nil
}

// Target is the rule's -j or -g target with its options.
type Target struct {
	// Name is the target as written: a built-in verdict (ACCEPT, DROP,
	// REJECT, RETURN), an extension (DNAT, SNAT, MASQUERADE, REDIRECT, MARK,
	// CONNMARK, LOG) or a user chain.
	Name string
	// Goto is true for -g.
	Goto bool
	// Chain is true when Name is not a built-in verdict or extension, i.e.
	// a user chain.
	Chain bool

	NAT        *NATOptions        // DNAT --to-destination, SNAT --to-source
	Masquerade *MasqueradeOptions // MASQUERADE, REDIRECT
	Mark       *MarkOptions       // MARK (and CONNMARK's set/and/or/xor forms)
	Reject     *RejectOptions     // REJECT
	Log        *LogOptions        // LOG
	ConnMark   *ConnMarkOptions   // CONNMARK

	sawOpts map[string]bool
}

// NATOptions are DNAT's or SNAT's options.
type NATOptions struct {
	// Addr is invalid when only a port was given.
	Addr netip.Addr
	// FirstPort and LastPort are 0 when no port was given.
	FirstPort, LastPort             int
	Random, RandomFully, Persistent bool
}

// MasqueradeOptions are MASQUERADE's or REDIRECT's options.
type MasqueradeOptions struct {
	FirstPort, LastPort int // --to-ports; 0 when absent
	Random, RandomFully bool
}

// MarkOptions is a MARK target in the kernel's form: the new mark is
// (mark &^ Mask) ^ Value.
type MarkOptions struct{ Value, Mask uint32 }

// Apply computes the new mark.
func (m MarkOptions) Apply(mark uint32) uint32 { return (mark &^ m.Mask) ^ m.Value }

// RejectOptions are REJECT's options. With is "" when --reject-with was not
// given (the family's port-unreachable).
type RejectOptions struct{ With string }

// LogOptions are LOG's options.
type LogOptions struct{ Prefix, Level string }

// ConnMarkOptions are CONNMARK's options.
type ConnMarkOptions struct {
	// Mode is "set" (set/and/or/xor, with Mark), "save" or "restore".
	Mode           string
	Mark           MarkOptions
	NfMask, CtMask uint32
}

// Verdict targets.
var verdictTargets = map[string]bool{"ACCEPT": true, "DROP": true, "RETURN": true}

// Extension targets ParseRule understands.
var extensionTargets = map[string]bool{
	"REJECT": true, "DNAT": true, "SNAT": true, "MASQUERADE": true, "REDIRECT": true,
	"MARK": true, "CONNMARK": true, "LOG": true,
}

// Targets iptables knows that this parser does not: rejected explicitly so
// they are not mistaken for chain names.
var unsupportedTargets = map[string]bool{
	"QUEUE": true, "NFQUEUE": true, "CT": true, "NOTRACK": true, "TPROXY": true, "TRACE": true,
	"CLASSIFY": true, "TCPMSS": true, "NFLOG": true, "ULOG": true, "AUDIT": true, "CHECKSUM": true,
	"DSCP": true, "TOS": true, "TTL": true, "HL": true, "SET": true, "NETMAP": true, "TEE": true,
	"IDLETIMER": true, "LED": true, "SECMARK": true, "CONNSECMARK": true, "SYNPROXY": true,
	"HMARK": true, "RATEEST": true, "CLUSTERIP": true, "ECN": true, "JUMP": true,
}

// IsBuiltinTarget reports whether name is a verdict or extension target
// (so not a user chain).
func IsBuiltinTarget(name string) bool {
	return verdictTargets[name] || extensionTargets[name] || unsupportedTargets[name]
}

func (t *Target) option(opt string, neg bool, next func() (string, error)) (bool, error) {
	if t.Chain || verdictTargets[t.Name] {
		return false, nil
	}
	known := false
	switch t.Name {
	case "DNAT", "SNAT":
		known = opt == "--random" || opt == "--persistent" ||
			(t.Name == "DNAT" && opt == "--to-destination") ||
			(t.Name == "SNAT" && (opt == "--to-source" || opt == "--random-fully"))
	case "MASQUERADE", "REDIRECT":
		known = opt == "--to-ports" || opt == "--random" || (t.Name == "MASQUERADE" && opt == "--random-fully")
	case "MARK":
		known = opt == "--set-xmark" || opt == "--set-mark" || opt == "--and-mark" || opt == "--or-mark" || opt == "--xor-mark"
	case "CONNMARK":
		switch opt {
		case "--set-xmark", "--set-mark", "--and-mark", "--or-mark", "--xor-mark", "--save-mark",
			"--restore-mark", "--nfmask", "--ctmask", "--mask":
			known = true
		}
	case "REJECT":
		known = opt == "--reject-with"
	case "LOG":
		switch opt {
		case "--log-prefix", "--log-level", "--log-tcp-sequence", "--log-tcp-options",
			"--log-ip-options", "--log-uid", "--log-macdecode":
			known = true
		}
	}
	if !known {
		return false, nil
	}
	if neg {
		return true, fmt.Errorf("target option %s cannot be negated", opt)
	}
	if t.sawOpts[opt] {
		return true, fmt.Errorf("multiple %s options", opt)
	}
	if t.sawOpts == nil {
		t.sawOpts = map[string]bool{}
	}
	t.sawOpts[opt] = true
	return true, t.parseOption(opt, next)
}

// targetFlags are target options without a value.
var targetFlags = map[string]bool{
	"--random": true, "--random-fully": true, "--persistent": true, "--log-tcp-sequence": true,
	"--log-tcp-options": true, "--log-ip-options": true, "--log-uid": true, "--log-macdecode": true,
	"--save-mark": true, "--restore-mark": true,
}

func (t *Target) parseOption(opt string, next func() (string, error)) error {
	var v string
	if !targetFlags[opt] {
		var err error
		if v, err = next(); err != nil {
			return err
		}
	}
	switch t.Name {
	case "DNAT", "SNAT":
		if t.NAT == nil {
			t.NAT = &NATOptions{}
		}
		switch opt {
		case "--random":
			t.NAT.Random = true
		case "--random-fully":
			t.NAT.RandomFully = true
		case "--persistent":
			t.NAT.Persistent = true
		default:
			a, first, last, err := parseNATDestination(v)
			if err != nil {
				return fmt.Errorf("%s: %w", opt, err)
			}
			t.NAT.Addr, t.NAT.FirstPort, t.NAT.LastPort = a, first, last
		}
	case "MASQUERADE", "REDIRECT":
		if t.Masquerade == nil {
			t.Masquerade = &MasqueradeOptions{}
		}
		switch opt {
		case "--random":
			t.Masquerade.Random = true
		case "--random-fully":
			t.Masquerade.RandomFully = true
		default:
			first, last, err := parsePortDashRange(v)
			if err != nil {
				return fmt.Errorf("%s: %w", opt, err)
			}
			t.Masquerade.FirstPort, t.Masquerade.LastPort = first, last
		}
	case "MARK":
		if t.Mark != nil {
			return fmt.Errorf("MARK accepts only one of --set-xmark, --set-mark, --and-mark, --or-mark, --xor-mark")
		}
		m, err := parseMarkOption(opt, v)
		if err != nil {
			return err
		}
		t.Mark = &m
	case "CONNMARK":
		if t.ConnMark == nil {
			t.ConnMark = &ConnMarkOptions{NfMask: ^uint32(0), CtMask: ^uint32(0)}
		}
		switch opt {
		case "--save-mark", "--restore-mark":
			if t.ConnMark.Mode != "" {
				return fmt.Errorf("CONNMARK accepts only one action")
			}
			t.ConnMark.Mode = strings.TrimSuffix(strings.TrimPrefix(opt, "--"), "-mark")
		case "--nfmask", "--ctmask", "--mask":
			n, err := parseUint32(v)
			if err != nil {
				return fmt.Errorf("%s: %w", opt, err)
			}
			if opt != "--ctmask" {
				t.ConnMark.NfMask = n
			}
			if opt != "--nfmask" {
				t.ConnMark.CtMask = n
			}
		default:
			if t.ConnMark.Mode != "" {
				return fmt.Errorf("CONNMARK accepts only one action")
			}
			m, err := parseMarkOption(opt, v)
			if err != nil {
				return err
			}
			t.ConnMark.Mode, t.ConnMark.Mark = "set", m
		}
	case "REJECT":
		if !rejectTypes[v].v4 && !rejectTypes[v].v6 {
			return fmt.Errorf("--reject-with: unknown reject type %q", v)
		}
		t.Reject.With = v
	case "LOG":
		switch opt {
		case "--log-prefix":
			if len(v) > maxLogPrefixLength {
				return fmt.Errorf("--log-prefix: longer than %d bytes", maxLogPrefixLength)
			}
			t.Log.Prefix = v
		case "--log-level":
			switch v {
			case "0", "1", "2", "3", "4", "5", "6", "7", "emerg", "alert", "crit", "error", "warning",
				"warn", "notice", "info", "debug":
			default:
				return fmt.Errorf("--log-level: unknown level %q", v)
			}
			t.Log.Level = v
		}
	}
	return nil
}

func (t *Target) done(r *Rule) error {
	switch t.Name {
	case "DNAT", "SNAT":
		if t.NAT == nil || (!t.sawOpts["--to-destination"] && !t.sawOpts["--to-source"]) {
			if t.Name == "DNAT" {
				return fmt.Errorf("DNAT needs --to-destination")
			}
			return fmt.Errorf("SNAT needs --to-source")
		}
		if t.NAT.FirstPort != 0 && !hasPortProtocol(r) {
			return fmt.Errorf("%s with a port needs -p tcp, -p udp or -p sctp", t.Name)
		}
	case "MASQUERADE", "REDIRECT":
		if t.Masquerade == nil {
			t.Masquerade = &MasqueradeOptions{}
		}
		if t.Masquerade.FirstPort != 0 && !hasPortProtocol(r) {
			return fmt.Errorf("%s --to-ports needs -p tcp, -p udp or -p sctp", t.Name)
		}
	case "MARK":
		if t.Mark == nil {
			return fmt.Errorf("MARK needs one of --set-xmark, --set-mark, --and-mark, --or-mark, --xor-mark")
		}
	case "CONNMARK":
		if t.ConnMark == nil || t.ConnMark.Mode == "" {
			return fmt.Errorf("CONNMARK needs an action")
		}
	case "REJECT":
		if t.Reject.With == "tcp-reset" && (r.Protocol == nil || r.Protocol.Name != "tcp" || r.Protocol.Negate) {
			return fmt.Errorf("REJECT --reject-with tcp-reset needs -p tcp")
		}
	}
	return nil
}

type rejectFamilies struct{ v4, v6 bool }

var rejectTypes = map[string]rejectFamilies{
	"icmp-net-unreachable": {v4: true}, "net-unreach": {v4: true},
	"icmp-host-unreachable": {v4: true}, "host-unreach": {v4: true},
	"icmp-port-unreachable": {v4: true}, "port-unreach": {v4: true, v6: true},
	"icmp-proto-unreachable": {v4: true}, "proto-unreach": {v4: true},
	"icmp-net-prohibited": {v4: true}, "net-prohib": {v4: true},
	"icmp-host-prohibited": {v4: true}, "host-prohib": {v4: true},
	"icmp-admin-prohibited": {v4: true}, "admin-prohib": {v4: true},
	"icmp6-no-route": {v6: true}, "no-route": {v6: true},
	"icmp6-adm-prohibited": {v6: true}, "adm-prohibited": {v6: true},
	"icmp6-addr-unreachable": {v6: true}, "addr-unreach": {v6: true},
	"icmp6-port-unreachable": {v6: true},
	"icmp6-policy-fail":      {v6: true}, "policy-fail": {v6: true},
	"icmp6-reject-route": {v6: true}, "reject-route": {v6: true},
	"tcp-reset": {v4: true, v6: true},
}

func hasPortProtocol(r *Rule) bool {
	if r.Protocol == nil || r.Protocol.Negate {
		return false
	}
	switch r.Protocol.Name {
	case "tcp", "udp", "sctp":
		return true
	}
	return false
}

var protocolNames = map[string]string{
	"tcp": "tcp", "udp": "udp", "sctp": "sctp", "icmp": "icmp", "icmpv6": "icmpv6",
	"ipv6-icmp": "icmpv6", "6": "tcp", "17": "udp", "132": "sctp", "1": "icmp", "58": "icmpv6",
}

var matchModules = map[string]func() Match{
	"tcp":       func() Match { return &PortMatch{Protocol: "tcp"} },
	"udp":       func() Match { return &PortMatch{Protocol: "udp"} },
	"sctp":      func() Match { return &PortMatch{Protocol: "sctp"} },
	"multiport": func() Match { return &MultiportMatch{} },
	"comment":   func() Match { return &CommentMatch{} },
	"addrtype":  func() Match { return &AddrTypeMatch{} },
	"mark":      func() Match { return &MarkMatch{} },
	"conntrack": func() Match { return &ConntrackMatch{ModuleName: "conntrack"} },
	"state":     func() Match { return &ConntrackMatch{ModuleName: "state"} },
	"statistic": func() Match { return &StatisticMatch{} },
	"recent":    func() Match { return &RecentMatch{} },
	"set":       func() Match { return &SetMatch{} },
}

// ParseRule parses the arguments of one rule (what follows "-A chain").
// Anything outside the supported subset is an error.
func ParseRule(args []string) (*Rule, error) {
	r := &Rule{Args: append([]string(nil), args...)}
	// ctx is the most recent -m match or the target, which receives the
	// options that follow it.
	var (
		ctxMatch  Match
		ctxTarget bool
		seen      = map[string]bool{}
	)
	i := 0
	next := func(opt string) func() (string, error) {
		return func() (string, error) {
			if i >= len(args) {
				return "", fmt.Errorf("option %s needs a value", opt)
			}
			v := args[i]
			i++
			return v, nil
		}
	}
	for i < len(args) {
		neg := false
		if args[i] == "!" {
			neg = true
			i++
			if i >= len(args) {
				return nil, fmt.Errorf("'!' at the end of the rule")
			}
			if args[i] == "!" {
				return nil, fmt.Errorf("multiple '!' flags not allowed")
			}
		}
		opt := args[i]
		i++
		if !strings.HasPrefix(opt, "-") {
			return nil, fmt.Errorf("unexpected argument %q", opt)
		}
		canon := canonicalGeneralOption(opt)
		switch canon {
		case "-s", "-d", "-p", "-i", "-o", "-j", "-g", "-m":
			if canon != "-m" && seen[canon] {
				return nil, fmt.Errorf("multiple %s flags not allowed", canon)
			}
			if canon == "-j" && seen["-g"] || canon == "-g" && seen["-j"] {
				return nil, fmt.Errorf("only one of -j and -g is allowed")
			}
			seen[canon] = true
			v, err := next(opt)()
			if err != nil {
				return nil, err
			}
			if strings.HasPrefix(v, "!") {
				return nil, fmt.Errorf("%s %s: negation must precede the option ('! %s %s')", opt, v, opt, strings.TrimPrefix(v, "!"))
			}
			if err := r.general(canon, v, neg, &ctxMatch, &ctxTarget); err != nil {
				return nil, fmt.Errorf("%s %s: %w", opt, v, err)
			}
			continue
		}
		handled := false
		var err error
		if ctxTarget {
			handled, err = r.Target.option(opt, neg, next(opt))
		} else if ctxMatch != nil {
			handled, err = ctxMatch.option(opt, neg, next(opt))
		}
		if err != nil {
			return nil, err
		}
		if !handled && (opt == "--sport" || opt == "--dport" || opt == "--source-port" || opt == "--destination-port") &&
			r.Protocol != nil && !r.Protocol.Negate && r.implicitPortMatch() {
			// iptables loads the protocol's match implicitly.
			m := matchModules[r.Protocol.Name]()
			r.Matches = append(r.Matches, m)
			ctxMatch, ctxTarget = m, false
			handled, err = m.option(opt, neg, next(opt))
			if err != nil {
				return nil, err
			}
		}
		if !handled {
			return nil, fmt.Errorf("unknown option %q", opt)
		}
	}
	for _, m := range r.Matches {
		if err := m.done(r); err != nil {
			return nil, err
		}
	}
	if r.Target != nil {
		if err := r.Target.done(r); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// implicitPortMatch reports whether the protocol supports an implicit port
// match and none is loaded yet.
func (r *Rule) implicitPortMatch() bool {
	switch r.Protocol.Name {
	case "tcp", "udp", "sctp":
	default:
		return false
	}
	for _, m := range r.Matches {
		if pm, ok := m.(*PortMatch); ok && pm.Protocol == r.Protocol.Name {
			return false
		}
	}
	return true
}

func canonicalGeneralOption(opt string) string {
	switch opt {
	case "-s", "--source", "--src":
		return "-s"
	case "-d", "--destination", "--dst":
		return "-d"
	case "-p", "--protocol":
		return "-p"
	case "-i", "--in-interface":
		return "-i"
	case "-o", "--out-interface":
		return "-o"
	case "-j", "--jump":
		return "-j"
	case "-g", "--goto":
		return "-g"
	case "-m", "--match":
		return "-m"
	}
	return opt
}

func (r *Rule) general(opt, v string, neg bool, ctxMatch *Match, ctxTarget *bool) error {
	switch opt {
	case "-s", "-d":
		m, err := parseAddrMatch(v)
		if err != nil {
			return err
		}
		m.Negate = neg
		if opt == "-s" {
			r.Source = m
		} else {
			r.Destination = m
		}
	case "-p":
		if v == "all" || v == "0" {
			if neg {
				return fmt.Errorf("'! -p all' matches nothing")
			}
			return nil
		}
		name, ok := protocolNames[v]
		if !ok {
			return fmt.Errorf("unsupported protocol")
		}
		r.Protocol = &ProtocolMatch{Name: name, Negate: neg}
	case "-i", "-o":
		if v == "" || len(v) > maxInterfaceLength || strings.ContainsAny(v, "/ ") {
			return fmt.Errorf("invalid interface name")
		}
		m := &InterfaceMatch{Name: v, Negate: neg}
		if opt == "-i" {
			r.InInterface = m
		} else {
			r.OutInterface = m
		}
	case "-m":
		if neg {
			return fmt.Errorf("-m cannot be negated")
		}
		mk, ok := matchModules[v]
		if !ok {
			return fmt.Errorf("unsupported match module")
		}
		m := mk()
		r.Matches = append(r.Matches, m)
		*ctxMatch, *ctxTarget = m, false
	case "-j", "-g":
		if neg {
			return fmt.Errorf("%s cannot be negated", opt)
		}
		if v == "" {
			return fmt.Errorf("empty target")
		}
		if unsupportedTargets[v] {
			return fmt.Errorf("target %s is not supported", v)
		}
		t := &Target{Name: v, Goto: opt == "-g", Chain: !verdictTargets[v] && !extensionTargets[v]}
		if t.Goto && !t.Chain {
			return fmt.Errorf("-g needs a user chain, not %s", v)
		}
		switch v {
		case "REJECT":
			t.Reject = &RejectOptions{}
		case "LOG":
			t.Log = &LogOptions{}
		}
		r.Target = t
		*ctxMatch, *ctxTarget = nil, true
	}
	return nil
}

func parseAddrMatch(v string) (*AddrMatch, error) {
	addrStr, maskStr, hasMask := strings.Cut(v, "/")
	a, err := netip.ParseAddr(addrStr)
	if err != nil || a.Zone() != "" {
		return nil, fmt.Errorf("invalid address %q", addrStr)
	}
	if a.Is4In6() {
		return nil, fmt.Errorf("IPv4-mapped address %q not supported", addrStr)
	}
	bits := a.BitLen()
	var mask netip.Addr
	switch {
	case !hasMask:
		mask = prefixMask(bits, bits)
	case maskStr != "" && strings.Trim(maskStr, "0123456789") == "":
		n, err := strconv.Atoi(maskStr)
		if err != nil || n > bits || len(maskStr) > 3 {
			return nil, fmt.Errorf("invalid prefix length %q", maskStr)
		}
		mask = prefixMask(bits, n)
	default:
		mask, err = netip.ParseAddr(maskStr)
		if err != nil || mask.Zone() != "" || mask.BitLen() != bits || mask.Is4In6() {
			return nil, fmt.Errorf("invalid mask %q", maskStr)
		}
	}
	return &AddrMatch{Addr: andAddr(a, mask), Mask: mask}, nil
}

func prefixMask(bits, ones int) netip.Addr {
	var b [16]byte
	for i := 0; i < ones; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	if bits == 32 {
		return netip.AddrFrom4([4]byte(b[:4]))
	}
	return netip.AddrFrom16(b)
}

func parsePort(s string) (int, error) {
	if s == "" || len(s) > 5 || strings.Trim(s, "0123456789") != "" {
		return 0, fmt.Errorf("invalid port %q", s)
	}
	n, _ := strconv.Atoi(s)
	if n > 65535 {
		return 0, fmt.Errorf("invalid port %q", s)
	}
	return n, nil
}

// parsePortRange parses "N", "N:M", ":M" or "N:".
func parsePortRange(s string) (PortRange, error) {
	first, last, isRange := strings.Cut(s, ":")
	if !isRange {
		p, err := parsePort(s)
		return PortRange{p, p}, err
	}
	pr := PortRange{0, 65535}
	var err error
	if first != "" {
		if pr.First, err = parsePort(first); err != nil {
			return pr, err
		}
	}
	if last != "" {
		if pr.Last, err = parsePort(last); err != nil {
			return pr, err
		}
	}
	if pr.First > pr.Last {
		return pr, fmt.Errorf("invalid port range %q", s)
	}
	return pr, nil
}

// parsePortDashRange parses "N" or "N-M" (NAT port ranges).
func parsePortDashRange(s string) (int, int, error) {
	first, last, isRange := strings.Cut(s, "-")
	f, err := parsePort(first)
	if err != nil {
		return 0, 0, err
	}
	l := f
	if isRange {
		if l, err = parsePort(last); err != nil {
			return 0, 0, err
		}
	}
	if f == 0 || f > l {
		return 0, 0, fmt.Errorf("invalid port range %q", s)
	}
	return f, l, nil
}

// parseNATDestination parses "ip", "ip:port[-port]", "[ip6]", "[ip6]:port",
// ":port" and a bare IPv6 address.
func parseNATDestination(s string) (netip.Addr, int, int, error) {
	var addrStr, portStr string
	switch {
	case strings.HasPrefix(s, "["):
		end := strings.Index(s, "]")
		if end < 0 {
			return netip.Addr{}, 0, 0, fmt.Errorf("invalid address %q", s)
		}
		addrStr, portStr = s[1:end], s[end+1:]
		if portStr != "" {
			if !strings.HasPrefix(portStr, ":") {
				return netip.Addr{}, 0, 0, fmt.Errorf("invalid address %q", s)
			}
			portStr = portStr[1:]
			if portStr == "" {
				return netip.Addr{}, 0, 0, fmt.Errorf("invalid address %q", s)
			}
		}
	case strings.Count(s, ":") > 1:
		addrStr = s
	default:
		var hasPort bool
		addrStr, portStr, hasPort = strings.Cut(s, ":")
		if hasPort && portStr == "" {
			return netip.Addr{}, 0, 0, fmt.Errorf("invalid address %q", s)
		}
	}
	var a netip.Addr
	if addrStr != "" {
		var err error
		a, err = netip.ParseAddr(addrStr)
		if err != nil || a.Zone() != "" || a.Is4In6() {
			return netip.Addr{}, 0, 0, fmt.Errorf("invalid address %q (address ranges are not supported)", addrStr)
		}
	} else if portStr == "" {
		return netip.Addr{}, 0, 0, fmt.Errorf("empty destination")
	}
	var first, last int
	if portStr != "" {
		var err error
		if first, last, err = parsePortDashRange(portStr); err != nil {
			return netip.Addr{}, 0, 0, err
		}
	}
	return a, first, last, nil
}

// parseUint32 parses a number the way iptables does (strtoul base 0):
// 0x.. hex, 0.. octal, otherwise decimal.
func parseUint32(s string) (uint32, error) {
	base, digits := 10, s
	switch {
	case strings.HasPrefix(s, "0x") || strings.HasPrefix(s, "0X"):
		base, digits = 16, s[2:]
	case len(s) > 1 && s[0] == '0':
		base, digits = 8, s[1:]
	}
	if digits == "" || strings.ContainsAny(digits, "_+-") {
		return 0, fmt.Errorf("invalid number %q", s)
	}
	n, err := strconv.ParseUint(digits, base, 32)
	if err != nil {
		return 0, fmt.Errorf("invalid number %q", s)
	}
	return uint32(n), nil
}

// parseValueMask parses "value[/mask]"; the mask defaults to all ones.
func parseValueMask(s string) (uint32, uint32, error) {
	vs, ms, hasMask := strings.Cut(s, "/")
	v, err := parseUint32(vs)
	if err != nil {
		return 0, 0, err
	}
	m := ^uint32(0)
	if hasMask {
		if m, err = parseUint32(ms); err != nil {
			return 0, 0, err
		}
	}
	return v, m, nil
}

// parseMarkOption converts MARK's option forms into the kernel's xmark form,
// as iptables does.
func parseMarkOption(opt, v string) (MarkOptions, error) {
	switch opt {
	case "--set-xmark", "--set-mark":
		val, mask, err := parseValueMask(v)
		if err != nil {
			return MarkOptions{}, fmt.Errorf("%s: %w", opt, err)
		}
		if opt == "--set-mark" {
			mask |= val
		}
		return MarkOptions{Value: val, Mask: mask}, nil
	default:
		val, err := parseUint32(v)
		if err != nil {
			return MarkOptions{}, fmt.Errorf("%s: %w", opt, err)
		}
		switch opt {
		case "--and-mark":
			return MarkOptions{Value: 0, Mask: ^val}, nil
		case "--or-mark":
			return MarkOptions{Value: val, Mask: val}, nil
		default: // --xor-mark
			return MarkOptions{Value: val, Mask: 0}, nil
		}
	}
}
