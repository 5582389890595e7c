package explain

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
)

// WriteText prints the explanation for people: per port, its settings, its
// endpoints and the lists chosen from them, then each flow's verdict and
// reason with the live rules' agreement.
func (x *Explanation) WriteText(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "service: %s on node %s", x.Service, x.Node)
	if len(x.NodeLabels) > 0 {
		var l []string
		for _, k := range slices.Sorted(maps.Keys(x.NodeLabels)) {
			l = append(l, k+"="+x.NodeLabels[k])
		}
		fmt.Fprintf(&b, " (%s)", strings.Join(l, ", "))
	}
	b.WriteString("\n")
	for _, p := range x.Ports {
		fmt.Fprintf(&b, "\nport %s: %s %s port %d, ClusterIP %s", p.Name, p.Family, p.Protocol, p.Port, p.ClusterIP)
		if p.NodePort != 0 {
			fmt.Fprintf(&b, ", NodePort %d", p.NodePort)
		}
		if len(p.ExternalIPs) > 0 {
			fmt.Fprintf(&b, ", externalIPs %s", strings.Join(p.ExternalIPs, ","))
		}
		if len(p.LoadBalancerIPs) > 0 {
			fmt.Fprintf(&b, ", load balancer %s", strings.Join(p.LoadBalancerIPs, ","))
		}
		b.WriteString("\n")
		pol := "  internalTrafficPolicy " + p.InternalTrafficPolicy
		if p.ExternalTrafficPolicy != "" {
			pol += ", externalTrafficPolicy " + p.ExternalTrafficPolicy
		}
		if p.TrafficDistribution != "" {
			pol += ", trafficDistribution " + p.TrafficDistribution
		}
		if len(p.TopologyKeys) > 0 {
			pol += ", topologyKeys " + keysList(p.TopologyKeys)
		}
		if p.AffinitySeconds > 0 {
			pol += fmt.Sprintf(", ClientIP affinity %ds", p.AffinitySeconds)
		}
		if len(p.LoadBalancerSourceRanges) > 0 {
			pol += ", loadBalancerSourceRanges " + strings.Join(p.LoadBalancerSourceRanges, ",")
		}
		b.WriteString(pol + "\n")
		fmt.Fprintf(&b, "  endpoints (%d):\n", len(p.Endpoints))
		for _, e := range p.Endpoints {
			where := e.Node
			if where == "" {
				where = "(no node)"
			}
			if e.Zone != "" {
				where += " " + e.Zone
			}
			var used []string
			if e.InCluster {
				used = append(used, "cluster")
			}
			if e.InLocal {
				used = append(used, "local")
			}
			if len(used) == 0 {
				used = append(used, "-")
			}
			hints := ""
			if len(e.ZoneHints) > 0 {
				hints += " zone-hints=" + strings.Join(e.ZoneHints, ",")
			}
			if len(e.NodeHints) > 0 {
				hints += " node-hints=" + strings.Join(e.NodeHints, ",")
			}
			fmt.Fprintf(&b, "    %-22s %-20s %-19s used: %s%s\n", e.Address, where, e.State, strings.Join(used, ","), hints)
		}
		for _, l := range []struct {
			name string
			sel  *Selection
		}{{"cluster endpoints:", p.Cluster}, {"local endpoints:  ", p.Local}} {
			switch {
			case l.sel == nil:
			case len(l.sel.Endpoints) == 0:
				fmt.Fprintf(&b, "  %s %s\n", l.name, l.sel.Why)
			default:
				fmt.Fprintf(&b, "  %s %s: %s\n", l.name, strings.Join(l.sel.Endpoints, ", "), l.sel.Why)
			}
		}
		b.WriteString("  decisions:\n")
		for _, f := range p.Flows {
			fmt.Fprintf(&b, "    %s %s from %s %s:\n      %s\n", f.Destination, hostPort(f.Address, f.Port), f.Source, f.SourceAddress, f.Reason)
			if f.Live != nil {
				switch f.Live.Result {
				case Agree:
					fmt.Fprintf(&b, "      live %s rules: agree\n", f.Live.Mode)
				case Mismatch:
					fmt.Fprintf(&b, "      live %s rules: MISMATCH: %s\n", f.Live.Mode, f.Live.Detail)
				}
			}
		}
	}
	for _, n := range x.Notes {
		fmt.Fprintf(&b, "\nnote: %s", n)
	}
	if len(x.Notes) > 0 {
		b.WriteString("\n")
	}
	if l := x.Live; l != nil {
		mode := l.Mode
		if mode == "" {
			mode = "kproxy"
		}
		switch l.Result {
		case Agree:
			fmt.Fprintf(&b, "\nlive rules (%s mode): agree with every decision (%d flows traced)\n", mode, l.Agree)
		case Mismatch:
			fmt.Fprintf(&b, "\nlive rules (%s mode): MISMATCH on %d of %d flows: the rules are stale or were changed by someone else\n", mode, l.Mismatch, l.Agree+l.Mismatch)
		case Failed:
			fmt.Fprintf(&b, "\nlive rules: could not be compared: %s\n", l.Detail)
		default:
			fmt.Fprintf(&b, "\nlive rules: not compared: %s\n", l.Detail)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func hostPort(addr string, port int) string {
	if strings.Contains(addr, ":") {
		return fmt.Sprintf("[%s]:%d", addr, port)
	}
	return fmt.Sprintf("%s:%d", addr, port)
}

// WriteJSON prints the explanation as indented JSON.
func (x *Explanation) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(x)
}
