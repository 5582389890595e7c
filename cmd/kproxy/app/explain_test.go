package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"

	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/iptables/iptablestest"
	"github.com/kproxy/kproxy/proxier"
	"github.com/kproxy/kproxy/proxier/explain"
	iptbackend "github.com/kproxy/kproxy/proxier/iptables"
	"github.com/kproxy/kproxy/proxier/trace"
)

const explainNodeIP = "10.0.0.1"

func explainLocal() ([]netip.Addr, error) {
	return []netip.Addr{netip.MustParseAddr(explainNodeIP)}, nil
}

func explainObjects(endpointIPs ...string) []runtime.Object {
	node := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{v1.LabelTopologyZone: "zone-a"}},
		Status:     v1.NodeStatus{Addresses: []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: explainNodeIP}}},
	}
	svc := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "web"},
		Spec: v1.ServiceSpec{
			Type: v1.ServiceTypeNodePort, ClusterIP: "10.96.0.10", ClusterIPs: []string{"10.96.0.10"},
			ExternalTrafficPolicy: v1.ServiceExternalTrafficPolicyLocal, HealthCheckNodePort: 31000,
			Ports: []v1.ServicePort{{Name: "http", Port: 80, NodePort: 30080, TargetPort: intstr.FromInt32(8080), Protocol: v1.ProtocolTCP}},
		},
	}
	slice := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "web-1", Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: new("http"), Port: new(int32(8080)), Protocol: new(v1.ProtocolTCP)}},
	}
	for _, ip := range endpointIPs {
		slice.Endpoints = append(slice.Endpoints, discovery.Endpoint{
			Addresses: []string{ip}, Conditions: discovery.EndpointConditions{Ready: new(true)}, NodeName: new("node-2"),
		})
	}
	external := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "db"},
		Spec:       v1.ServiceSpec{Type: v1.ServiceTypeExternalName, ExternalName: "db.example.com"},
	}
	return []runtime.Object{node, svc, slice, external}
}

// renderedNode is a node whose iptables hold what iptables mode writes for
// objs (nil: no kproxy rules).
func renderedNode(t *testing.T, objs []runtime.Object) traceSource {
	fakeIPT := iptablestest.NewFake(ipt.ProtocolIPv4)
	if objs != nil {
		b, err := iptbackend.New(iptbackend.Options{IPTables: fakeIPT, LocalAddresses: explainLocal})
		if err != nil {
			t.Fatal(err)
		}
		e, err := proxier.NewEngine(proxier.EngineOptions{Family: v1.IPv4Protocol, NodeName: "node-1", Backend: b, SyncPeriod: time.Hour,
			ClusterCIDR: netip.MustParsePrefix("10.244.0.0/16"), NodeIP: netip.MustParseAddr(explainNodeIP)})
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			switch o := o.(type) {
			case *v1.Service:
				e.OnServiceAdd(o)
			case *discovery.EndpointSlice:
				e.OnEndpointSliceAdd(o)
			case *v1.Node:
				e.OnNodeAdd(o)
			}
		}
		e.OnServiceSynced()
		e.OnEndpointSlicesSynced()
		if err := e.SyncRules(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	return func(context.Context, v1.IPFamily, time.Duration) (trace.Source, func()) {
		return trace.Source{IPTables: map[v1.IPFamily]ipt.Interface{v1.IPv4Protocol: fakeIPT}, LocalAddresses: explainLocal,
			NFT: func(context.Context, ...string) ([]byte, error) {
				return nil, errors.New("Error: No such file or directory")
			}}, func() {}
	}
}

func TestExplainCommand(t *testing.T) {
	base := []string{"--hostname-override=node-1", "--cluster-cidr=10.244.0.0/16"}
	for _, tc := range []struct {
		name     string
		args     []string
		rules    []runtime.Object // the node's rules are kproxy's for these; nil: none
		wantErr  string
		wantCode int
		wantOut  []string
	}{
		{name: "malformed name", args: []string{"web"}, wantErr: `service "web": want NAMESPACE/NAME[:PORT]`, wantCode: 1},
		{name: "bad output", args: []string{"default/web", "-o", "yaml"}, wantErr: `-o "yaml": want text or json`, wantCode: 1},
		{name: "bad cluster CIDR", args: []string{"default/web", "--cluster-cidr=10.244.0.0"}, wantErr: "--cluster-cidr", wantCode: 1},
		{name: "bad mode", args: []string{"default/web", "--proxy-mode=userspace"}, wantErr: `--proxy-mode="userspace" is not a proxy mode`, wantCode: 1},
		{name: "not found", args: []string{"default/nope"}, wantErr: "service default/nope not found", wantCode: 1},
		{name: "ExternalName", args: []string{"default/db"}, wantErr: "is of type ExternalName", wantCode: 1},
		{name: "port not found", args: []string{"default/web:grpc"}, wantErr: `has no port "grpc"`, wantCode: 1},
		{name: "no rules on the node", args: []string{"default/web"},
			wantOut: []string{"dropped: externalTrafficPolicy is Local and this node has no ready or serving endpoint of default/web",
				"live rules: not compared: nothing to compare with: no kproxy state on this node"}},
		{name: "rules agree", args: []string{"default/web:80"}, rules: explainObjects("10.244.2.5"),
			wantOut: []string{"live iptables rules: agree", "live rules (iptables mode): agree with every decision (6 flows traced)"}},
		{name: "stale rules", args: []string{"default/web:http", "--proxy-mode=iptables"}, rules: explainObjects(),
			wantErr: "the live iptables rules of this node disagree with kproxy's decisions for default/web on 6 flow(s)", wantCode: exitMismatch,
			wantOut: []string{"MISMATCH: rules reject it (rejected: default/web:http has no endpoints (no ready or serving endpoint anywhere)), model says deliver to 10.244.2.5:8080"}},
		{name: "ipvs mode", args: []string{"default/web", "--proxy-mode=ipvs"}, rules: explainObjects("10.244.2.5"),
			wantOut: []string{"live rules: not compared: nothing to compare with: no kproxy state on this node: no IPv4 ipvs rules of kproxy found"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			cmd := newExplainCommand(&out, explainDeps{
				client: fake.NewClientset(explainObjects("10.244.2.5")...), open: renderedNode(t, tc.rules), localAddresses: explainLocal,
			})
			cmd.SetArgs(append(append([]string{}, base...), tc.args...))
			err := cmd.Execute()
			code := 0
			if err != nil {
				code = exitCode(err)
			}
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) || code != tc.wantCode {
				t.Fatalf("error %v (exit %d), want %q (exit %d)\n%s", err, code, tc.wantErr, tc.wantCode, out.String())
			}
			for _, w := range tc.wantOut {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output without %q:\n%s", w, out.String())
				}
			}
		})
	}
}

func TestExplainCommandJSON(t *testing.T) {
	var out bytes.Buffer
	cmd := newExplainCommand(&out, explainDeps{
		client: fake.NewClientset(explainObjects("10.244.2.5")...), open: renderedNode(t, explainObjects("10.244.2.5")), localAddresses: explainLocal,
	})
	cmd.SetArgs([]string{"default/web", "-o", "json", "--hostname-override=node-1", "--cluster-cidr=10.244.0.0/16"})
	if err := cmd.Execute(); err != nil {
		t.Fatal(err)
	}
	var x explain.Explanation
	if err := json.Unmarshal(out.Bytes(), &x); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if x.Live == nil || x.Live.Result != explain.Agree || len(x.Ports) != 1 || len(x.Ports[0].Flows) != 6 {
		t.Fatalf("explanation %+v", x)
	}
}

func TestExitCode(t *testing.T) {
	if got := exitCode(errors.New("x")); got != 1 {
		t.Errorf("plain error: %d", got)
	}
	if got := exitCode(fmt.Errorf("wrapped: %w", &exitError{code: exitMismatch, err: errors.New("x")})); got != exitMismatch {
		t.Errorf("mismatch: %d", got)
	}
}
