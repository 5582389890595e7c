package procbench

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
)

// The objects the benchmark creates.
const (
	// Namespace holds every Service and EndpointSlice.
	Namespace = "procbench"
	// EndpointsPerService is the number of ready endpoints of a Service.
	EndpointsPerService = 10
	// EndpointNodes is the number of nodes the endpoints are spread over,
	// whether or not their Node objects exist, so that the Services and
	// EndpointSlices are the same with and without the Nodes.
	EndpointNodes = 5000
	// MaxServices bounds the Services: each node's /24 holds the first
	// addresses of its endpoints (.2 to .41) and the addresses changes
	// put in (firstChangedHost and up).
	MaxServices = 20000
	// ClusterCIDR holds every node's podCIDR, 10.(128+n/256).(n%256).0/24.
	ClusterCIDR = "10.128.0.0/9"
	// servicePort is every Service's port; targetPort the endpoints' port.
	servicePort = 80
	targetPort  = 8080
	// managedBy is the managed-by label of the EndpointSlice controller.
	managedBy = "endpointslice-controller.k8s.io"
	// firstChangedHost is the first host octet of the addresses changes
	// put in; they cycle through firstChangedHost..254.
	firstChangedHost = 100
)

// MeasuredNode is the node kproxy runs as: node 0, whose Node object always
// exists.
var MeasuredNode = NodeName(0)

// NodeName is the name of node n (0-based).
func NodeName(n int) string { return fmt.Sprintf("pbn-%05d", n) }

// ServiceName is the name of Service i (0-based).
func ServiceName(i int) string { return fmt.Sprintf("svc-%05d", i) }

// nodePodCIDR is node n's podCIDR.
func nodePodCIDR(n int) string { return fmt.Sprintf("10.%d.%d.0/24", 128+n/256, n%256) }

// nodeHostIP is node n's InternalIP (the measured node has the address of
// its network namespace instead).
func nodeHostIP(n int) string { return fmt.Sprintf("172.16.%d.%d", n/250, n%250+1) }

// podIP is the address host in node n's podCIDR.
func podIP(n, host int) string { return fmt.Sprintf("10.%d.%d.%d", 128+n/256, n%256, host) }

// endpointNode is the node of endpoint j of Service i.
func endpointNode(i, j int) int { return (i*EndpointsPerService + j) % EndpointNodes }

// endpointIP is the first address of endpoint j of Service i: unique, in
// its node's podCIDR.
func endpointIP(i, j int) string {
	k := i*EndpointsPerService + j
	return podIP(k%EndpointNodes, 2+k/EndpointNodes)
}

// changedIP is the address the change-th change puts in endpoint j of
// Service i: in the same node's podCIDR, never a first address.
func changedIP(i, j, change int) string {
	return podIP(endpointNode(i, j), firstChangedHost+change%(255-firstChangedHost))
}

// zone is node n's zone.
func zone(n int) string { return "us-east-1" + string(rune('a'+n%3)) }

// shortHash is a stable 5-character suffix, like the ones generated names
// get.
func shortHash(s string) string {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	out := strconv.FormatUint(uint64(h.Sum32()), 36)
	for len(out) < 5 {
		out = "0" + out
	}
	return out[len(out)-5:]
}

// uid is a stable UID for a name.
func uid(kind, name string) types.UID {
	h := fnv.New64a()
	_, _ = h.Write([]byte(kind + "/" + name))
	s := h.Sum64()
	return types.UID(fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", uint32(s>>32), uint16(s>>16), uint16(s)&0xfff, uint16(s>>4)&0xfff, s&0xffffffffffff))
}

// serviceObject is Service i: ClusterIP, one TCP port, a selector.
func serviceObject(i int) *v1.Service {
	name := ServiceName(i)
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: Namespace,
			Labels: map[string]string{"app": name, "app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "procbench"},
		},
		Spec: v1.ServiceSpec{
			Type:            v1.ServiceTypeClusterIP,
			Selector:        map[string]string{"app": name},
			SessionAffinity: v1.ServiceAffinityNone,
			Ports: []v1.ServicePort{{
				Name: "http", Protocol: v1.ProtocolTCP, Port: servicePort, TargetPort: intstr.FromInt32(targetPort),
			}},
		},
	}
}

// podName is the name of the Pod behind endpoint j of Service i, which
// the change-th change (0: none yet) replaced.
func podName(i, j, change int) string {
	rs := shortHash(ServiceName(i))
	return fmt.Sprintf("%s-7d9f8c%s-%s", ServiceName(i), rs, shortHash(fmt.Sprintf("%d/%d/%d", i, j, change)))
}

// endpoint is endpoint j of Service i at addr, as the EndpointSlice
// controller writes a ready Pod.
func endpoint(i, j int, addr, pod string) discovery.Endpoint {
	n := endpointNode(i, j)
	return discovery.Endpoint{
		Addresses: []string{addr},
		Conditions: discovery.EndpointConditions{
			Ready: ptr.To(true), Serving: ptr.To(true), Terminating: ptr.To(false),
		},
		NodeName: ptr.To(NodeName(n)),
		Zone:     ptr.To(zone(n)),
		TargetRef: &v1.ObjectReference{
			Kind: "Pod", Namespace: Namespace, Name: pod, UID: uid("Pod", pod),
		},
	}
}

// endpointSliceObject is the EndpointSlice of Service svc (number i) with
// its EndpointsPerService ready endpoints, as the EndpointSlice controller
// writes it; trigger is its last-change-trigger-time.
func endpointSliceObject(svc *v1.Service, i int, trigger time.Time) *discovery.EndpointSlice {
	labels := map[string]string{
		discovery.LabelServiceName: svc.Name,
		discovery.LabelManagedBy:   managedBy,
	}
	for k, v := range svc.Labels {
		labels[k] = v
	}
	eps := make([]discovery.Endpoint, EndpointsPerService)
	for j := range eps {
		eps[j] = endpoint(i, j, endpointIP(i, j), podName(i, j, 0))
	}
	return &discovery.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name:        svc.Name + "-" + shortHash("slice/"+svc.Name),
			Namespace:   Namespace,
			Labels:      labels,
			Annotations: map[string]string{v1.EndpointsLastChangeTriggerTime: trigger.UTC().Format(time.RFC3339Nano)},
			OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "v1", Kind: "Service", Name: svc.Name, UID: svc.UID,
				Controller: ptr.To(true), BlockOwnerDeletion: ptr.To(true),
			}},
		},
		AddressType: discovery.AddressTypeIPv4,
		Endpoints:   eps,
		Ports: []discovery.EndpointPort{{
			Name: ptr.To("http"), Protocol: ptr.To(v1.ProtocolTCP), Port: ptr.To(int32(targetPort)),
		}},
	}
}

// nodeImages are the images every node reports: a realistic mix of system
// and workload images, twenty of them.
var nodeImages = func() []v1.ContainerImage {
	repos := []string{
		"registry.k8s.io/kube-proxy", "registry.k8s.io/pause", "registry.k8s.io/coredns/coredns",
		"docker.io/calico/node", "docker.io/calico/cni", "docker.io/calico/kube-controllers",
		"quay.io/prometheus/node-exporter", "registry.k8s.io/metrics-server/metrics-server",
		"docker.io/library/nginx", "docker.io/library/redis", "docker.io/library/postgres",
		"gcr.io/example-prod/frontend", "gcr.io/example-prod/checkout", "gcr.io/example-prod/cart",
		"gcr.io/example-prod/payments", "gcr.io/example-prod/search", "gcr.io/example-prod/recommendations",
		"docker.io/fluent/fluent-bit", "registry.k8s.io/ingress-nginx/controller", "public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver",
	}
	out := make([]v1.ContainerImage, len(repos))
	for i, r := range repos {
		h := fnv.New64a()
		_, _ = h.Write([]byte(r))
		digest := fmt.Sprintf("%016x%016x%016x%016x", h.Sum64(), h.Sum64()^0x9e3779b97f4a7c15, h.Sum64()*3, h.Sum64()*7)
		out[i] = v1.ContainerImage{
			Names:     []string{r + "@sha256:" + digest, fmt.Sprintf("%s:v1.%d.%d", r, 20+i, i%7)},
			SizeBytes: int64(8_000_000 + i*13_750_000),
		}
	}
	return out
}()

// nodeObject is node n with internalIP, as a kubelet on a cloud VM
// registers itself and reports its status: topology, instance type and
// hostname labels, ten annotations, conditions, addresses, images,
// capacity and allocatable.
func nodeObject(n int, internalIP string, heartbeat metav1.Time) *v1.Node {
	name := NodeName(n)
	z := zone(n)
	instanceID := fmt.Sprintf("i-0%016x", uint64(n)*0x9e3779b97f4a7c1+0x1234567)
	hostname := "ip-" + strings.ReplaceAll(internalIP, ".", "-") + ".ec2.internal"
	capacity := v1.ResourceList{
		v1.ResourceCPU:               resource.MustParse("4"),
		v1.ResourceMemory:            resource.MustParse("16093960Ki"),
		v1.ResourcePods:              resource.MustParse("110"),
		v1.ResourceEphemeralStorage:  resource.MustParse("104845292Ki"),
		"hugepages-1Gi":              resource.MustParse("0"),
		"hugepages-2Mi":              resource.MustParse("0"),
		"attachable-volumes-aws-ebs": resource.MustParse("25"),
	}
	allocatable := capacity.DeepCopy()
	allocatable[v1.ResourceCPU] = resource.MustParse("3920m")
	allocatable[v1.ResourceMemory] = resource.MustParse("15186184Ki")
	allocatable[v1.ResourceEphemeralStorage] = resource.MustParse("95551679124")
	condition := func(t v1.NodeConditionType, s v1.ConditionStatus, reason, msg string) v1.NodeCondition {
		return v1.NodeCondition{Type: t, Status: s, LastHeartbeatTime: heartbeat, LastTransitionTime: heartbeat, Reason: reason, Message: msg}
	}
	return &v1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: name,
			Labels: map[string]string{
				"beta.kubernetes.io/arch":                  "amd64",
				"beta.kubernetes.io/os":                    "linux",
				"beta.kubernetes.io/instance-type":         "m5.xlarge",
				"failure-domain.beta.kubernetes.io/region": "us-east-1",
				"failure-domain.beta.kubernetes.io/zone":   z,
				"kubernetes.io/arch":                       "amd64",
				"kubernetes.io/os":                         "linux",
				"kubernetes.io/hostname":                   name,
				"node.kubernetes.io/instance-type":         "m5.xlarge",
				"topology.kubernetes.io/region":            "us-east-1",
				"topology.kubernetes.io/zone":              z,
				"topology.ebs.csi.aws.com/zone":            z,
				"eks.amazonaws.com/nodegroup":              fmt.Sprintf("pool-%d", n%8),
				"eks.amazonaws.com/capacityType":           "ON_DEMAND",
			},
			Annotations: map[string]string{
				"node.alpha.kubernetes.io/ttl":                           "0",
				"volumes.kubernetes.io/controller-managed-attach-detach": "true",
				"csi.volume.kubernetes.io/nodeid":                        fmt.Sprintf(`{"ebs.csi.aws.com":%q}`, instanceID),
				"alpha.kubernetes.io/provided-node-ip":                   internalIP,
				"projectcalico.org/IPv4Address":                          internalIP + "/20",
				"projectcalico.org/IPv4IPIPTunnelAddr":                   podIP(n, 1),
				"kubeadm.alpha.kubernetes.io/cri-socket":                 "unix:///run/containerd/containerd.sock",
				"cluster-autoscaler.kubernetes.io/scale-down-disabled":   "false",
				"node.kubernetes.io/last-applied-labels":                 "eks.amazonaws.com/nodegroup,eks.amazonaws.com/capacityType",
				"example.com/maintenance-window":                         "sun-02:00-04:00",
			},
		},
		Spec: v1.NodeSpec{
			PodCIDR:    nodePodCIDR(n),
			PodCIDRs:   []string{nodePodCIDR(n)},
			ProviderID: "aws:///" + z + "/" + instanceID,
		},
		Status: v1.NodeStatus{
			Capacity:    capacity,
			Allocatable: allocatable,
			Conditions: []v1.NodeCondition{
				condition(v1.NodeMemoryPressure, v1.ConditionFalse, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
				condition(v1.NodeDiskPressure, v1.ConditionFalse, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
				condition(v1.NodePIDPressure, v1.ConditionFalse, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
				condition(v1.NodeReady, v1.ConditionTrue, "KubeletReady", "kubelet is posting ready status"),
				condition(v1.NodeNetworkUnavailable, v1.ConditionFalse, "CalicoIsUp", "Calico is running on this node"),
			},
			Addresses: []v1.NodeAddress{
				{Type: v1.NodeInternalIP, Address: internalIP},
				{Type: v1.NodeHostName, Address: hostname},
				{Type: v1.NodeInternalDNS, Address: hostname},
			},
			DaemonEndpoints: v1.NodeDaemonEndpoints{KubeletEndpoint: v1.DaemonEndpoint{Port: 10250}},
			NodeInfo: v1.NodeSystemInfo{
				MachineID:               fmt.Sprintf("ec2%029x", n),
				SystemUUID:              string(uid("system", name)),
				BootID:                  string(uid("boot", name)),
				KernelVersion:           "6.1.112-124.190.amzn2023.x86_64",
				OSImage:                 "Amazon Linux 2023.6.20241010",
				ContainerRuntimeVersion: "containerd://1.7.22",
				KubeletVersion:          "v1.37.2",
				OperatingSystem:         "linux",
				Architecture:            "amd64",
			},
			Images: nodeImages,
		},
	}
}

// Objects creates and changes the benchmark's objects through the API and
// keeps the last version of each Service's EndpointSlice.
type Objects struct {
	client kubernetes.Interface
	// workers is how many requests are in flight while populating.
	workers int

	mu       sync.Mutex
	services []*v1.Service
	slices   []*discovery.EndpointSlice
	nodes    int
	changes  int
}

// NewObjects returns an Objects writing through client with workers
// requests in flight.
func NewObjects(client kubernetes.Interface, workers int) *Objects {
	return &Objects{client: client, workers: max(workers, 1)}
}

// Services is the number of Services created.
func (o *Objects) Services() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.services)
}

// Nodes is the number of Node objects created.
func (o *Objects) Nodes() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.nodes
}

// EnsureNamespace creates Namespace.
func (o *Objects) EnsureNamespace(ctx context.Context) error {
	ns := &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: Namespace}}
	if _, err := o.client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("creating namespace %s: %w", Namespace, err)
	}
	return nil
}

// GrowServices creates Services and their EndpointSlices until there are
// n of each.
func (o *Objects) GrowServices(ctx context.Context, n int) error {
	if n > MaxServices {
		return fmt.Errorf("at most %d Services, asked for %d", MaxServices, n)
	}
	o.mu.Lock()
	from := len(o.services)
	if n > from {
		o.services = append(o.services, make([]*v1.Service, n-from)...)
		o.slices = append(o.slices, make([]*discovery.EndpointSlice, n-from)...)
	}
	o.mu.Unlock()
	if n <= from {
		return nil
	}
	now := time.Now()
	return parallel(ctx, o.workers, from, n, func(ctx context.Context, i int) error {
		svc, err := o.client.CoreV1().Services(Namespace).Create(ctx, serviceObject(i), metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("creating Service %s: %w", ServiceName(i), err)
		}
		slice, err := o.client.DiscoveryV1().EndpointSlices(Namespace).Create(ctx, endpointSliceObject(svc, i, now), metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("creating the EndpointSlice of Service %s: %w", svc.Name, err)
		}
		o.mu.Lock()
		o.services[i], o.slices[i] = svc, slice
		o.mu.Unlock()
		return nil
	})
}

// CreateMeasuredNode creates the Node object of MeasuredNode with
// internalIP, the address of kproxy's network namespace.
func (o *Objects) CreateMeasuredNode(ctx context.Context, internalIP string) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.nodes > 0 {
		return nil
	}
	node := nodeObject(0, internalIP, metav1.NewTime(time.Now().Truncate(time.Second)))
	if _, err := o.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("creating node %s: %w", node.Name, err)
	}
	o.nodes = 1
	return nil
}

// GrowNodes creates Node objects until there are n, the measured node
// included (CreateMeasuredNode first).
func (o *Objects) GrowNodes(ctx context.Context, n int) error {
	o.mu.Lock()
	from := o.nodes
	o.mu.Unlock()
	if from == 0 {
		return errors.New("creating nodes: create the measured node first")
	}
	if n > EndpointNodes {
		return fmt.Errorf("at most %d Nodes, asked for %d", EndpointNodes, n)
	}
	if n <= from {
		return nil
	}
	heartbeat := metav1.NewTime(time.Now().Truncate(time.Second))
	var created atomic.Int64
	err := parallel(ctx, o.workers, from, n, func(ctx context.Context, i int) error {
		if _, err := o.client.CoreV1().Nodes().Create(ctx, nodeObject(i, nodeHostIP(i), heartbeat), metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("creating node %s: %w", NodeName(i), err)
		}
		created.Add(1)
		return nil
	})
	o.mu.Lock()
	o.nodes = from + int(created.Load())
	o.mu.Unlock()
	return err
}

// ChangeEndpoint replaces the address of endpoint j of Service i with a
// new Pod's, stamping trigger as the slice's last-change-trigger-time, and
// writes the EndpointSlice. write is called just before the request goes
// out.
func (o *Objects) ChangeEndpoint(ctx context.Context, i, j int, write func() time.Time) error {
	return o.updateSlice(ctx, i, func(slice *discovery.EndpointSlice, change int) {
		slice.Endpoints[j] = endpoint(i, j, changedIP(i, j, change), podName(i, j, change))
		at := write()
		slice.Annotations[v1.EndpointsLastChangeTriggerTime] = at.UTC().Format(time.RFC3339Nano)
	})
}

// AnnotationReceiveOnly is the annotation TouchSlice changes: kproxy
// drops it (an informer transform keeps only the annotations it reads), so
// the event it causes changes nothing kproxy syncs.
const AnnotationReceiveOnly = "procbench.kproxy.io/touched"

// TouchSlice changes only the AnnotationReceiveOnly annotation of Service
// i's EndpointSlice: an update event that kproxy receives, decodes and
// hands to its engines, which find nothing to sync.
func (o *Objects) TouchSlice(ctx context.Context, i int) error {
	return o.updateSlice(ctx, i, func(slice *discovery.EndpointSlice, change int) {
		if slice.Annotations == nil {
			slice.Annotations = map[string]string{}
		}
		slice.Annotations[AnnotationReceiveOnly] = strconv.Itoa(change)
	})
}

// updateSlice writes Service i's EndpointSlice as edit changes a copy of
// it (edit is given the change's sequence number and runs just before the
// request goes out), and keeps what the API server returned.
func (o *Objects) updateSlice(ctx context.Context, i int, edit func(slice *discovery.EndpointSlice, change int)) error {
	o.mu.Lock()
	if i >= len(o.slices) || o.slices[i] == nil {
		o.mu.Unlock()
		return fmt.Errorf("no EndpointSlice for Service %d", i)
	}
	o.changes++
	change := o.changes
	slice := o.slices[i].DeepCopy()
	o.mu.Unlock()

	edit(slice, change)
	got, err := o.client.DiscoveryV1().EndpointSlices(Namespace).Update(ctx, slice, metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("updating EndpointSlice %s: %w", slice.Name, err)
	}
	o.mu.Lock()
	o.slices[i] = got
	o.mu.Unlock()
	return nil
}

// parallel runs fn for every i in [from, to) on workers goroutines and
// returns the first error; an error stops the remaining work.
func parallel(ctx context.Context, workers, from, to int, fn func(ctx context.Context, i int) error) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var next atomic.Int64
	next.Store(int64(from))
	var wg sync.WaitGroup
	for range min(workers, to-from) {
		wg.Go(func() {
			for ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= to {
					return
				}
				if err := fn(ctx, i); err != nil {
					cancel(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return ctx.Err()
}
