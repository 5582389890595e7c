package trace

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// WriteText prints the report for people: the packet, the verdict in
// Service terms, the endpoints, then each path's rules.
func (rep *Report) WriteText(w io.Writer) error {
	var b strings.Builder
	pk := rep.Packet
	fmt.Fprintf(&b, "packet:  %s %s -> %s port %d, from %s (first packet of a connection)\n", pk.Protocol, pk.Source, pk.Destination, pk.DestinationPort, pk.From)
	fmt.Fprintf(&b, "rules:   kproxy %s mode, %s\n", rep.Mode, rep.Family)
	if rep.Service != "" {
		fmt.Fprintf(&b, "service: %s\n", rep.Service)
	}
	fmt.Fprintf(&b, "verdict: %s\n", rep.Reason)
	if len(rep.Endpoints) > 0 {
		b.WriteString("endpoints:\n")
		for _, e := range rep.Endpoints {
			masq := "no"
			if e.Masquerade {
				masq = "yes"
			}
			fmt.Fprintf(&b, "  %-24s probability %5.1f%%  masquerade %s\n", e.Address, 100*e.Probability, masq)
		}
	}
	if rep.AffinitySeconds > 0 {
		fmt.Fprintf(&b, "affinity: ClientIP, %ds (a later connection from %s goes where its first one went)\n", rep.AffinitySeconds, pk.Source)
	}
	for i, p := range rep.Paths {
		head := p.Verdict
		if p.DNAT != "" {
			head += " to " + p.DNAT
		}
		if p.Masquerade {
			head += ", masqueraded"
		}
		fmt.Fprintf(&b, "path %d (%s):\n", i+1, head)
		for _, s := range p.Steps {
			fmt.Fprintf(&b, "  %s: %s\n", s.Where, s.Rule)
		}
	}
	for _, n := range rep.Notes {
		fmt.Fprintf(&b, "note: %s\n", n)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteJSON prints the report as indented JSON.
func (rep *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}
