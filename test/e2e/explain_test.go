package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/test/cluster"
)

// TestExplain: `kproxy explain`, run on a node as an operator would (the
// agent's flags, in the node's namespace), says what the traffic the suite
// observes shows, for each traffic policy and topology setting, and finds
// the node's live rules in agreement. One set of backends serves every
// Service: two pods on node-1 (zone-a, group g1), one on node-2 (zone-b,
// g0), none on node-3 (zone-a, g1); clients are pods on node-1 and node-3
// and the external client.
func TestExplain(t *testing.T) { inMode(t, testExplain) }

func testExplain(t *testing.T) {
	e := newEnv(t)
	sel := map[string]string{"svc": "explain"}
	byNode := e.perNode("be", sel, 2, 1, 0)
	keys, _ := json.Marshal([]string{cluster.LabelGroup})
	web := e.createService("web", sel)
	etp := e.createService("etp", sel, withType(v1.ServiceTypeNodePort), func(s *v1.Service) {
		s.Spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyLocal
	})
	itp := e.createService("itp", sel, func(s *v1.Service) {
		s.Spec.InternalTrafficPolicy = new(v1.ServiceInternalTrafficPolicyLocal)
	})
	zonal := e.createService("zonal", sel, func(s *v1.Service) {
		s.Spec.TrafficDistribution = new(v1.ServiceTrafficDistributionPreferSameZone)
	})
	grouped := e.createService("grouped", sel, func(s *v1.Service) {
		s.Annotations = map[string]string{"topologyKeys": string(keys)}
	})
	empty := e.createService("empty", map[string]string{"svc": "nothing"})
	for _, s := range []*v1.Service{web, etp, itp, grouped} {
		e.waitEndpoints(s.Name, "3 ready", readyCount(3))
	}
	e.waitEndpoints(zonal.Name, "3 ready, hinted for their zones", func(eps []discoveryv1.Endpoint) error {
		if err := readyCount(3)(eps); err != nil {
			return err
		}
		for _, ep := range eps {
			if ep.Hints == nil || len(ep.Hints.ForZones) == 0 {
				return fmt.Errorf("endpoint %v has no zone hint", ep.Addresses)
			}
		}
		return nil
	})
	client1, ip1 := e.clientPod("client-1", nodeName(1))
	client3, _ := e.clientPod("client-3", nodeName(3))
	all := names(append(append([]v1.Pod{}, byNode[0]...), byNode[1]...), "")
	onNode1 := names(byNode[0], "")
	// endpoint address -> pod name
	podAt := map[string]string{}
	for _, pods := range byNode {
		for _, p := range pods {
			podAt[hostPort(p.Status.PodIP, echoPort)] = p.Name
		}
	}

	cases := []struct {
		name string
		// node runs kproxy explain on svc; the flow is the decision for
		// kind from source class.
		node        int
		svc         *v1.Service
		kind, class string
		// verdict, the pods of the endpoints and a part of the reason.
		verdict string
		pods    []string
		reason  string
		// traffic checks the same flow with real packets, after the
		// decision: it answers from exactly pods, or fails.
		traffic func(e *env)
	}{
		{name: "Cluster policy: every endpoint", node: 1, svc: web, kind: "ClusterIP", class: "pod",
			verdict: "delivered", pods: all, reason: "not masqueraded",
			traffic: func(e *env) {
				e.expectTraffic(client1, "tcp", hostPort(web.Spec.ClusterIP, servicePort), 30, expect{all: all, only: all, sources: []string{ip1}})
			}},
		{name: "externalTrafficPolicy Local on a node without endpoints", node: 3, svc: etp, kind: "NodePort", class: "other",
			verdict: "dropped", reason: "dropped: externalTrafficPolicy is Local and this node has no ready or serving endpoint of " + e.ns + "/etp",
			traffic: func(e *env) {
				e.expectFailure(cluster.TargetClient, "tcp", hostPort(cluster.NodeIP(3), etp.Spec.Ports[0].NodePort), netnstest.ErrTimeout)
			}},
		{name: "externalTrafficPolicy Local on a node with endpoints", node: 1, svc: etp, kind: "NodePort", class: "other",
			verdict: "delivered", pods: onNode1, reason: "externalTrafficPolicy is Local, the client's address is kept",
			traffic: func(e *env) {
				e.expectTraffic(cluster.TargetClient, "tcp", hostPort(cluster.NodeIP(1), etp.Spec.Ports[0].NodePort), 20,
					expect{all: onNode1, only: onNode1, sources: []string{cluster.ClientIP}})
			}},
		{name: "internalTrafficPolicy Local on a node without endpoints", node: 3, svc: itp, kind: "ClusterIP", class: "pod",
			verdict: "dropped", reason: "dropped: internalTrafficPolicy is Local",
			traffic: func(e *env) {
				e.expectFailure(client3, "tcp", hostPort(itp.Spec.ClusterIP, servicePort), netnstest.ErrTimeout)
			}},
		{name: "internalTrafficPolicy Local on a node with endpoints", node: 1, svc: itp, kind: "ClusterIP", class: "pod",
			verdict: "delivered", pods: onNode1, reason: "internalTrafficPolicy is Local",
			traffic: func(e *env) {
				e.expectTraffic(client1, "tcp", hostPort(itp.Spec.ClusterIP, servicePort), 20, expect{all: onNode1, only: onNode1})
			}},
		{name: "trafficDistribution PreferSameZone", node: 3, svc: zonal, kind: "ClusterIP", class: "pod",
			verdict: "delivered", pods: onNode1, reason: "",
			traffic: func(e *env) {
				e.expectTraffic(client3, "tcp", hostPort(zonal.Spec.ClusterIP, servicePort), 20, expect{all: onNode1, only: onNode1})
			}},
		{name: "topologyKeys", node: 3, svc: grouped, kind: "ClusterIP", class: "pod",
			verdict: "delivered", pods: onNode1,
			traffic: func(e *env) {
				e.expectTraffic(client3, "tcp", hostPort(grouped.Spec.ClusterIP, servicePort), 20, expect{all: onNode1, only: onNode1})
			}},
		{name: "no endpoints", node: 1, svc: empty, kind: "ClusterIP", class: "pod",
			verdict: "rejected", reason: "rejected: " + e.ns + "/empty:tcp has no endpoints",
			traffic: func(e *env) {
				e.expectFailure(client1, "tcp", hostPort(empty.Spec.ClusterIP, servicePort), netnstest.ErrRefused)
			}},
	}
	// Why the endpoint lists hold what they hold, per Service.
	clusterWhy := map[string]string{
		"zonal":   "topology hints: the ready endpoints hinted for this node's zone " + cluster.NodeZone(3),
		"grouped": "key " + cluster.LabelGroup + " selects the ready endpoints on nodes with " + cluster.LabelGroup + "=",
		"web":     "every one of the ready endpoints",
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := e.sub(t)
			// The traffic first: once it shows the decision, kproxy has
			// programmed the Service and its rules must agree.
			tc.traffic(e)
			var x *explanation
			e.eventually("kproxy explain agrees with the live rules", 10*time.Second, func() error {
				var err error
				x, err = e.explain(tc.node, tc.svc.Name)
				if err != nil {
					return err
				}
				switch {
				case x.Live == nil:
					return errors.New("no live comparison")
				case e.c.Mode() == cluster.ModeIPVS && x.Live.Result == "skipped" && strings.Contains(x.Live.Detail, "not available in ipvs mode"):
				case x.Live.Result != "agree":
					return fmt.Errorf("live rules: %+v", *x.Live)
				}
				return nil
			})
			if t.Failed() {
				return
			}
			if len(x.Ports) != 1 {
				t.Fatalf("%d ports", len(x.Ports))
			}
			p := x.Ports[0]
			var fl *explainFlow
			for _, f := range p.Flows {
				if f.Destination == tc.kind && f.Source == tc.class {
					fl = f
				}
			}
			if fl == nil {
				t.Fatalf("no %s flow from %s: %+v", tc.kind, tc.class, p.Flows)
			}
			var pods []string
			for _, ep := range fl.Endpoints {
				pods = append(pods, podAt[ep])
			}
			slices.Sort(pods)
			want := slices.Clone(tc.pods)
			slices.Sort(want)
			if fl.Verdict != tc.verdict || !slices.Equal(pods, want) || !strings.Contains(fl.Reason, tc.reason) {
				t.Errorf("%s: %s to %v (%s), want %s to %v (reason with %q)", nodeName(tc.node), fl.Verdict, pods, fl.Reason, tc.verdict, want, tc.reason)
			}
			if w := clusterWhy[tc.svc.Name]; w != "" && (p.Cluster == nil || !strings.Contains(p.Cluster.Why, w)) {
				t.Errorf("cluster endpoints %+v, want a reason with %q", p.Cluster, w)
			}
			t.Logf("%s on %s: %s %s from %s: %s (live %s: %s)", tc.svc.Name, nodeName(tc.node), fl.Destination, fl.Address, fl.Source, fl.Reason, fl.Live.Mode, fl.Live.Result)
		})
	}

	t.Run("text output", func(t *testing.T) {
		e := e.sub(t)
		out, err := e.explainRaw(3, etp.Name, "-o", "text")
		if err != nil {
			t.Fatal(err)
		}
		live := "live rules (" + e.c.Mode() + " mode): agree"
		if e.c.Mode() == cluster.ModeIPVS {
			live = "live comparison not available in ipvs mode"
		}
		for _, w := range []string{"dropped: externalTrafficPolicy is Local", live} {
			if !strings.Contains(out, w) {
				t.Errorf("output without %q:\n%s", w, out)
			}
		}
		t.Logf("kproxy explain %s/%s on %s:\n%s", e.ns, etp.Name, nodeName(3), out)
	})
	t.Run("not found", func(t *testing.T) {
		e := e.sub(t)
		_, err := e.explainRaw(1, "nope", "-o", "text")
		if err == nil || !strings.Contains(err.Error(), "service "+e.ns+"/nope not found") || !strings.Contains(err.Error(), "exit status 1") {
			t.Errorf("error %v, want not found with exit status 1", err)
		}
	})
}

// explanation is what the test reads of kproxy explain -o json (the
// proxier/explain package's Explanation).
type explanation struct {
	Ports []struct {
		Cluster *struct {
			Endpoints []string `json:"endpoints"`
			Why       string   `json:"why"`
		} `json:"cluster"`
		Flows []*explainFlow `json:"flows"`
	} `json:"ports"`
	Live *struct {
		Result string `json:"result"`
		Mode   string `json:"mode"`
		Detail string `json:"detail"`
	} `json:"live"`
}

type explainFlow struct {
	Destination string   `json:"destination"`
	Address     string   `json:"address"`
	Source      string   `json:"source"`
	Verdict     string   `json:"verdict"`
	Endpoints   []string `json:"endpoints"`
	Reason      string   `json:"reason"`
	Live        *struct {
		Result string `json:"result"`
		Mode   string `json:"mode"`
		Detail string `json:"detail"`
	} `json:"live"`
}

// explain runs kproxy explain -o json for a Service of the test's
// namespace on node i.
func (e *env) explain(i int, svc string) (*explanation, error) {
	out, err := e.explainRaw(i, svc, "-o", "json")
	var exit interface{ ExitCode() int }
	if err != nil && !(errors.As(err, &exit) && exit.ExitCode() == 2) {
		return nil, err
	}
	var x explanation
	if jerr := json.Unmarshal([]byte(out), &x); jerr != nil {
		return nil, fmt.Errorf("kproxy explain's output: %w\n%s", jerr, out)
	}
	return &x, nil
}

// explainRaw runs kproxy explain on node i, with the flags the cluster
// gives the node's agent.
func (e *env) explainRaw(i int, svc string, args ...string) (string, error) {
	node := nodeName(i)
	kc, err := e.c.KproxyKubeconfig(node)
	if err != nil {
		return "", err
	}
	argv := append([]string{filepath.Join(e.c.BinDir(), "kproxy"), "explain", e.ns + "/" + svc,
		"--kubeconfig=" + kc, "--hostname-override=" + node, "--cluster-cidr=" + cluster.ClusterCIDR,
		"--proxy-mode=" + e.c.Mode()}, args...)
	return e.c.Exec(e.ctx, node, argv...)
}
