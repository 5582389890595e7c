package trace

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/knftables"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/proxier"
	iptbackend "github.com/kproxy/kproxy/proxier/iptables"
	nftbackend "github.com/kproxy/kproxy/proxier/nftables"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
	"github.com/kproxy/kproxy/proxier/trace/tracetest"
)

// reportTracer answers proxiertest's flows with Run over a Source, so that
// the shared behaviour cases check the whole trace: reading the text the
// live tools print, tracing it and folding the outcome.
type reportTracer struct {
	t     testing.TB
	src   Source
	mode  string
	check func(f pt.Flow, rep *Report)
}

func (rt *reportTracer) Trace(f pt.Flow) (pt.Result, error) {
	rep, err := Run(context.Background(), requestOf(f, rt.mode), rt.src)
	if err != nil {
		return pt.Result{}, err
	}
	if rt.check != nil {
		rt.check(f, rep)
	}
	return resultOf(rep)
}

// requestOf is the Request of a flow: from the node for FromHost flows,
// from outside (pod or other host, the same path) for the others.
func requestOf(f pt.Flow, mode string) Request {
	from := FromExternal
	if f.Origin == pt.FromHost {
		from = FromNode
	}
	proto := strings.ToLower(string(f.Protocol))
	return Request{Source: netip.MustParseAddr(f.Source), Destination: netip.MustParseAddr(f.Dest),
		Protocol: proto, DestinationPort: f.Port, From: from, Mode: mode}
}

// resultOf folds a report as proxiertest folds a tracer's outcomes.
func resultOf(rep *Report) (pt.Result, error) {
	res := pt.Result{Endpoints: map[string]bool{}}
	switch rep.Verdict {
	case Delivered:
		res.Verdict = pt.Delivered
		total := 0.0
		for _, e := range rep.Endpoints {
			res.Endpoints[e.Address] = e.Masquerade
			total += e.Probability
		}
		if total < 0.999 || total > 1.001 {
			return res, fmt.Errorf("endpoint probabilities add up to %v: %+v", total, rep.Endpoints)
		}
	case Rejected:
		res.Verdict = pt.Rejected
	case Dropped:
		res.Verdict = pt.Dropped
	case NotHandled:
		res.Verdict = pt.NotHandled
	default:
		return res, fmt.Errorf("verdict %q: %s", rep.Verdict, rep.Reason)
	}
	return res, nil
}

// checkReason: every drop and reject is explained in Service terms.
func checkReason(t testing.TB) func(f pt.Flow, rep *Report) {
	return func(f pt.Flow, rep *Report) {
		switch rep.Verdict {
		case Rejected:
			if !strings.HasPrefix(rep.Reason, "rejected: ") || !strings.Contains(rep.Reason, " has no endpoints") || rep.Service == "" {
				t.Errorf("flow %q: reject reason %q (service %q)", f.Name, rep.Reason, rep.Service)
			}
		case Dropped:
			if !strings.HasPrefix(rep.Reason, "dropped: ") || rep.Service == "" ||
				!(strings.Contains(rep.Reason, "TrafficPolicy is Local") || strings.Contains(rep.Reason, "loadBalancerSourceRanges")) {
				t.Errorf("flow %q: drop reason %q (service %q)", f.Name, rep.Reason, rep.Service)
			}
		case Delivered:
			if rep.Service == "" || !strings.Contains(rep.Reason, rep.Service) {
				t.Errorf("flow %q: delivered without naming the service: %q", f.Name, rep.Reason)
			}
		}
	}
}

func iptProtocol(f v1.IPFamily) ipt.Protocol {
	if f == v1.IPv6Protocol {
		return ipt.ProtocolIPv6
	}
	return ipt.ProtocolIPv4
}

func nftFamily(f v1.IPFamily) knftables.Family {
	if f == v1.IPv6Protocol {
		return knftables.IPv6Family
	}
	return knftables.IPv4Family
}

// TestBehaviourCasesIPTables: iptables mode's rules, rendered into the
// fake iptables and read back as iptables-save prints them.
func TestBehaviourCasesIPTables(t *testing.T) {
	pt.Run(t, func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
		fake := iptablestest.NewFake(iptProtocol(env.Family))
		local := append([]netip.Addr{}, env.NodeIPs...)
		b, err := iptbackend.New(iptbackend.Options{IPTables: fake, NodePortAddresses: env.NodePortAddresses,
			LocalAddresses: func() ([]netip.Addr, error) { return local, nil }})
		if err != nil {
			t.Fatal(err)
		}
		src := Source{IPTables: map[v1.IPFamily]ipt.Interface{env.Family: fake},
			LocalAddresses: func() ([]netip.Addr, error) { return local, nil }}
		return b, &reportTracer{t: t, src: src, check: checkReason(t)}
	})
}

// TestBehaviourCasesNFTables: nftables mode's table, rendered into the
// fake and printed as `nft list table` prints it.
func TestBehaviourCasesNFTables(t *testing.T) {
	pt.Run(t, func(t *testing.T, env pt.Env) (proxier.Backend, pt.Tracer) {
		fam := nftFamily(env.Family)
		fake := knftables.NewFake(fam, nftbackend.TableName)
		local := append([]netip.Addr{}, env.NodeIPs...)
		b, err := nftbackend.New(nftbackend.Options{NFTables: fake, Family: env.Family, NodePortAddresses: env.NodePortAddresses,
			LocalAddresses: func() ([]netip.Addr, error) { return local, nil }})
		if err != nil {
			t.Fatal(err)
		}
		src := Source{NFT: listingOf(fake, fam), LocalAddresses: func() ([]netip.Addr, error) { return local, nil }}
		return b, &reportTracer{t: t, src: src, check: checkReason(t)}
	})
}

// listingOf answers `nft list table FAMILY kproxy` with the fake's table
// as nft prints it, and fails for any other table as nft does.
func listingOf(fake *knftables.Fake, fam knftables.Family) func(ctx context.Context, args ...string) ([]byte, error) {
	return tracetest.NFTListing(fake, fam, nftbackend.TableName)
}
