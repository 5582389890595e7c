package e2e

import (
	"errors"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/util/retry"

	"github.com/kproxy/kproxy/pkg/netnstest"
	"github.com/kproxy/kproxy/test/cluster"
)

// TestClusterIP: a ClusterIP reaches every replica; pods keep their source
// address, a node's own traffic is masqueraded.
func TestClusterIP(t *testing.T) { inMode(t, testClusterIP) }

func testClusterIP(t *testing.T) {
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 3})
	svc := e.createService("web", map[string]string{"app": "web"})
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	addr := hostPort(svc.Spec.ClusterIP, servicePort)

	cases := []struct {
		name string
		// from returns the request's origin and the source the pods must see.
		from func() (target string, sources []string)
	}{
		{"from a pod on node-1", func() (string, []string) {
			target, ip := e.clientPod("client-1", nodeName(1))
			return target, []string{ip}
		}},
		{"from a pod on node-2", func() (string, []string) {
			target, ip := e.clientPod("client-2", nodeName(2))
			return target, []string{ip}
		}},
		{"from node-3 itself", func() (string, []string) {
			return nodeName(3), e.nodeIPs()
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := e.sub(t)
			from, sources := tc.from()
			s := e.expectTraffic(from, "tcp", addr, 30, expect{all: names(pods, ""), sources: sources})
			t.Logf("%s", s)
		})
	}
}

// TestNodePort: the external client reaches every replica through the
// NodePort of each node, masqueraded to a node address.
func TestNodePort(t *testing.T) { inMode(t, testNodePort) }

func testNodePort(t *testing.T) {
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 3})
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeNodePort))
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	np := svc.Spec.Ports[0].NodePort

	for i := 1; i <= suiteNodes; i++ {
		t.Run(nodeName(i), func(t *testing.T) {
			e := e.sub(t)
			s := e.expectTraffic(cluster.TargetClient, "tcp", hostPort(cluster.NodeIP(i), np), 30,
				expect{all: names(pods, ""), sources: e.nodeIPs()})
			t.Logf("%s", s)
		})
	}
}

// TestExternalIPs: the external client reaches an ExternalIP routed via a
// node.
func TestExternalIPs(t *testing.T) { inMode(t, testExternalIPs) }

func testExternalIPs(t *testing.T) {
	const vip = "10.253.0.3"
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 3})
	svc := e.createService("web", map[string]string{"app": "web"}, func(s *v1.Service) {
		s.Spec.ExternalIPs = []string{vip}
	})
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	e.clientRoute(vip, 1)

	s := e.expectTraffic(cluster.TargetClient, "tcp", hostPort(vip, servicePort), 30,
		expect{all: names(pods, ""), sources: e.nodeIPs()})
	t.Logf("%s", s)
}

// TestLoadBalancer: the external client reaches a LoadBalancer ingress IP
// (status set by hand); loadBalancerSourceRanges that leave the client out
// drop its traffic, ranges that include it let it through.
func TestLoadBalancer(t *testing.T) { inMode(t, testLoadBalancer) }

func testLoadBalancer(t *testing.T) {
	const vip = "10.253.0.4"
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 2})
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeLoadBalancer))
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		s, err := e.k.CoreV1().Services(e.ns).Get(e.ctx, svc.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{IP: vip}}
		_, err = e.k.CoreV1().Services(e.ns).UpdateStatus(e.ctx, s, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("setting the load balancer status: %v", err)
	}
	e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
	e.clientRoute(vip, 2)
	addr := hostPort(vip, servicePort)

	// Steps run in order, each changing the source ranges.
	steps := []struct {
		name    string
		ranges  []string
		dropped bool
	}{
		{name: "no source ranges"},
		{name: "ranges without the client", ranges: []string{"10.254.0.200/32", "192.0.2.0/24"}, dropped: true},
		{name: "ranges with the client", ranges: []string{"192.0.2.0/24", cluster.ClientIP + "/32"}},
		{name: "ranges without the client again", ranges: []string{"10.254.0.0/28"}, dropped: true},
		{name: "a range holding the client", ranges: []string{cluster.SwitchCIDR}},
	}
	for _, step := range steps {
		t.Run(step.name, func(t *testing.T) {
			e := e.sub(t)
			e.updateService(svc.Name, func(s *v1.Service) { s.Spec.LoadBalancerSourceRanges = step.ranges })
			if step.dropped {
				e.expectFailure(cluster.TargetClient, "tcp", addr, netnstest.ErrTimeout)
				return
			}
			s := e.expectTraffic(cluster.TargetClient, "tcp", addr, 20, expect{all: names(pods, ""), sources: e.nodeIPs()})
			t.Logf("%s", s)
		})
		if t.Failed() {
			return
		}
	}
}

// TestSessionAffinity: with ClientIP affinity every request of one client
// reaches the same pod.
func TestSessionAffinity(t *testing.T) { inMode(t, testSessionAffinity) }

func testSessionAffinity(t *testing.T) {
	e := newEnv(t)
	pods := e.deploy(workload{name: "web", replicas: 3})
	// The endpoints exist before the Service: kproxy's first rules for it
	// already hold all three, so affinity is not trivially one pod.
	svc := e.createService("web", map[string]string{"app": "web"}, withType(v1.ServiceTypeNodePort), func(s *v1.Service) {
		s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
	})
	e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
	clientPod, _ := e.clientPod("client", nodeName(2))

	cases := []struct {
		name, from, addr string
	}{
		{"pod to ClusterIP", clientPod, hostPort(svc.Spec.ClusterIP, servicePort)},
		{"client to NodePort on node-1", cluster.TargetClient, hostPort(cluster.NodeIP(1), svc.Spec.Ports[0].NodePort)},
		{"node-3 to ClusterIP", nodeName(3), hostPort(svc.Spec.ClusterIP, servicePort)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := e.sub(t)
			// The first answer pins the pod; then 20 more must agree.
			first := e.expectTraffic(tc.from, "tcp", tc.addr, 1, expect{only: names(pods, "")})
			pinned := first.replies[0].Pod
			s, err := e.sample(tc.from, "tcp", tc.addr, 20)
			if err != nil {
				e.fatalf("requests after the first: %v", err)
			}
			if err := (expect{only: []string{pinned}}).check(s); err != nil {
				e.fatalf("session affinity broken: first reply from %s, then %v", pinned, err)
			}
		})
	}
}

// TestNoEndpointsRejects: a Service whose selector matches nothing
// rejects at once (no timeout) on its ClusterIP and NodePort.
func TestNoEndpointsRejects(t *testing.T) { inMode(t, testNoEndpointsRejects) }

func testNoEndpointsRejects(t *testing.T) {
	e := newEnv(t)
	svc := e.createService("empty", map[string]string{"app": "nothing-matches"}, withType(v1.ServiceTypeNodePort))
	clientPod, _ := e.clientPod("client", nodeName(1))
	cases := []struct {
		name, from, addr string
	}{
		{"pod to ClusterIP", clientPod, hostPort(svc.Spec.ClusterIP, servicePort)},
		{"node-2 to ClusterIP", nodeName(2), hostPort(svc.Spec.ClusterIP, servicePort)},
		{"client to NodePort on node-3", cluster.TargetClient, hostPort(cluster.NodeIP(3), svc.Spec.Ports[0].NodePort)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := e.sub(t)
			e.expectFailure(tc.from, "tcp", tc.addr, netnstest.ErrRefused)
			began := time.Now()
			_, err := e.request(tc.from, "tcp", tc.addr, requestTimeout)
			took := time.Since(began)
			if !errors.Is(err, netnstest.ErrRefused) {
				e.fatalf("want a refusal, got %v", err)
			}
			t.Logf("refused in %s: %v", took.Round(time.Microsecond), err)
		})
	}
}

// TestUDP: a UDP Service reaches every replica, from a pod (source kept)
// and from the external client through a NodePort.
func TestUDP(t *testing.T) { inMode(t, testUDP) }

func testUDP(t *testing.T) {
	e := newEnv(t)
	pods := e.deploy(workload{name: "dns", replicas: 2, ports: []v1.ContainerPort{
		{Name: "udp", ContainerPort: udpEchoPort, Protocol: v1.ProtocolUDP},
	}})
	svc := e.createService("dns", map[string]string{"app": "dns"}, withType(v1.ServiceTypeNodePort), func(s *v1.Service) {
		s.Spec.Ports = []v1.ServicePort{{Name: "udp", Protocol: v1.ProtocolUDP, Port: 53, TargetPort: intstr.FromInt32(udpEchoPort)}}
	})
	e.waitEndpoints(svc.Name, "2 ready", readyCount(2))
	clientPod, clientIP := e.clientPod("client", nodeName(3))

	t.Run("pod to ClusterIP", func(t *testing.T) {
		s := e.sub(t).expectTraffic(clientPod, "udp", hostPort(svc.Spec.ClusterIP, 53), 20,
			expect{all: names(pods, ""), sources: []string{clientIP}})
		t.Logf("%s", s)
	})
	t.Run("client to NodePort on node-2", func(t *testing.T) {
		e := e.sub(t)
		s := e.expectTraffic(cluster.TargetClient, "udp", hostPort(cluster.NodeIP(2), svc.Spec.Ports[0].NodePort), 20,
			expect{all: names(pods, ""), sources: e.nodeIPs()})
		t.Logf("%s", s)
	})
}

// TestServiceUpdates: kproxy follows a Service's port change, its
// Deployment scaling up and down, and its deletion.
func TestServiceUpdates(t *testing.T) { inMode(t, testServiceUpdates) }

func testServiceUpdates(t *testing.T) {
	e := newEnv(t)
	e.deploy(workload{name: "web", replicas: 1})
	svc := e.createService("web", map[string]string{"app": "web"})
	e.waitEndpoints(svc.Name, "1 ready", readyCount(1))
	clientPod, _ := e.clientPod("client", nodeName(2))
	ip := svc.Spec.ClusterIP
	sel := map[string]string{"app": "web"}

	steps := []struct {
		name string
		run  func(e *env)
	}{
		{"serves", func(e *env) {
			pods, _ := e.servingPods(sel)
			e.expectTraffic(clientPod, "tcp", hostPort(ip, servicePort), 5, expect{all: names(pods, "")})
		}},
		{"port changed from 80 to 81", func(e *env) {
			e.updateService(svc.Name, func(s *v1.Service) { s.Spec.Ports[0].Port = 81 })
			e.expectTraffic(clientPod, "tcp", hostPort(ip, 81), 5, expect{})
			e.expectFailure(clientPod, "tcp", hostPort(ip, servicePort), nil)
		}},
		{"scaled up to 3", func(e *env) {
			e.scale("web", 3)
			pods := e.waitPods(sel, 3)
			e.waitEndpoints(svc.Name, "3 ready", readyCount(3))
			e.expectTraffic(clientPod, "tcp", hostPort(ip, 81), 30, expect{all: names(pods, "")})
		}},
		{"scaled down to 1", func(e *env) {
			e.scale("web", 1)
			pods := e.waitPods(sel, 1)
			e.waitEndpoints(svc.Name, "1 ready", readyCount(1))
			e.expectTraffic(clientPod, "tcp", hostPort(ip, 81), 20, expect{all: names(pods, ""), only: names(pods, "")})
		}},
		{"a second port added", func(e *env) {
			e.updateService(svc.Name, func(s *v1.Service) {
				s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: "alt", Protocol: v1.ProtocolTCP, Port: 82, TargetPort: intstr.FromString("tcp")})
			})
			e.expectTraffic(clientPod, "tcp", hostPort(ip, 82), 5, expect{})
			e.expectTraffic(clientPod, "tcp", hostPort(ip, 81), 5, expect{})
		}},
		{"deleted", func(e *env) {
			if err := e.k.CoreV1().Services(e.ns).Delete(e.ctx, svc.Name, metav1.DeleteOptions{}); err != nil {
				e.t.Fatalf("deleting service %s: %v", svc.Name, err)
			}
			for _, port := range []int32{81, 82} {
				e.expectFailure(clientPod, "tcp", hostPort(ip, port), nil)
			}
		}},
	}
	for _, step := range steps {
		if !t.Run(step.name, func(t *testing.T) { step.run(e.sub(t)) }) {
			return
		}
	}
}
