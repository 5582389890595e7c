package config

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	runtimeapi "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// benchNodes is the cluster size of BenchmarkNodeCache.
const benchNodes = 5000

// realisticNode is a Node of a busy cluster: a dozen labels, twenty
// annotations, managed fields of three managers, and a status with
// conditions, addresses, capacity and eight images: about 4 KiB of JSON
// (reported as json-bytes/node).
func realisticNode(i int) *v1.Node {
	name := fmt.Sprintf("node-%05d", i)
	labels := map[string]string{
		v1.LabelHostname: name, v1.LabelOSStable: "linux", v1.LabelArchStable: "amd64",
		v1.LabelInstanceTypeStable: "m6i.2xlarge", v1.LabelTopologyZone: fmt.Sprintf("zone-%d", i%3),
		v1.LabelTopologyRegion: "region-1", "node-role.kubernetes.io/worker": "",
		"example.com/site": fmt.Sprintf("site-%d", i%50), "example.com/pool": "general",
		"example.com/rack": fmt.Sprintf("rack-%d", i%200), "example.com/team": "platform",
		"example.com/generation": "7",
	}
	annotations := map[string]string{
		"node.alpha.kubernetes.io/ttl":                           "0",
		"volumes.kubernetes.io/controller-managed-attach-detach": "true",
		"csi.volume.kubernetes.io/nodeid":                        fmt.Sprintf(`{"ebs.csi.aws.com":"i-%017d"}`, i),
	}
	for a := range 17 {
		annotations[fmt.Sprintf("example.com/annotation-%02d", a)] = fmt.Sprintf("value-%d-%d-padding-padding", i, a)
	}
	fields := func(manager string) metav1.ManagedFieldsEntry {
		return metav1.ManagedFieldsEntry{
			Manager: manager, Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "v1",
			FieldsType: "FieldsV1",
			FieldsV1:   &metav1.FieldsV1{Raw: []byte(`{"f:metadata":{"f:annotations":{".":{},"f:node.alpha.kubernetes.io/ttl":{}},"f:labels":{".":{},"f:kubernetes.io/arch":{},"f:kubernetes.io/hostname":{},"f:kubernetes.io/os":{}}},"f:status":{"f:conditions":{"k:{\"type\":\"Ready\"}":{"f:lastHeartbeatTime":{}}}}}`)},
		}
	}
	now := metav1.NewTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	var conditions []v1.NodeCondition
	for _, c := range []v1.NodeConditionType{v1.NodeReady, v1.NodeMemoryPressure, v1.NodeDiskPressure, v1.NodePIDPressure, v1.NodeNetworkUnavailable} {
		conditions = append(conditions, v1.NodeCondition{
			Type: c, Status: v1.ConditionFalse, LastHeartbeatTime: now, LastTransitionTime: now,
			Reason: "KubeletHasSufficientResources", Message: "kubelet has sufficient resources available",
		})
	}
	var images []v1.ContainerImage
	for img := range 8 {
		images = append(images, v1.ContainerImage{
			Names:     []string{fmt.Sprintf("registry.example.com/team/app-%02d@sha256:%064d", img, img), fmt.Sprintf("registry.example.com/team/app-%02d:v1.%d", img, img)},
			SizeBytes: int64(img+1) << 20,
		})
	}
	resources := v1.ResourceList{
		v1.ResourceCPU: resource.MustParse("8"), v1.ResourceMemory: resource.MustParse("32Gi"),
		v1.ResourcePods: resource.MustParse("110"), v1.ResourceEphemeralStorage: resource.MustParse("100Gi"),
	}
	return &v1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, UID: types.UID("uid-0000-0000-" + name), ResourceVersion: fmt.Sprint(1000 + i), Labels: labels, Annotations: annotations,
			ManagedFields:     []metav1.ManagedFieldsEntry{fields("kubelet"), fields("kube-controller-manager"), fields("cloud-node-manager")},
			CreationTimestamp: now,
		},
		Spec: v1.NodeSpec{PodCIDR: "10.244.0.0/24", PodCIDRs: []string{"10.244.0.0/24"}, ProviderID: "aws:///zone/i-" + name},
		Status: v1.NodeStatus{
			Capacity: resources, Allocatable: resources, Conditions: conditions, Images: images,
			Addresses: []v1.NodeAddress{
				{Type: v1.NodeInternalIP, Address: fmt.Sprintf("10.0.%d.%d", i/250, i%250+1)},
				{Type: v1.NodeHostName, Address: name}, {Type: v1.NodeInternalDNS, Address: name + ".ec2.internal"},
			},
			DaemonEndpoints: v1.NodeDaemonEndpoints{KubeletEndpoint: v1.DaemonEndpoint{Port: 10250}},
			NodeInfo: v1.NodeSystemInfo{
				MachineID: fmt.Sprintf("%032d", i), SystemUUID: fmt.Sprintf("%032d", i), BootID: fmt.Sprintf("%032d", i),
				KernelVersion: "6.1.0-28-cloud-amd64", OSImage: "Debian GNU/Linux 12 (bookworm)",
				ContainerRuntimeVersion: "containerd://2.0.0", KubeletVersion: "v1.37.2", OperatingSystem: "linux", Architecture: "amd64",
			},
		},
	}
}

// nodeLabelsHandler feeds a proxy.NodeLabels as an engine does, so that
// the benchmark counts the labels the engine keeps besides the caches.
type nodeLabelsHandler struct{ labels *proxy.NodeLabels }

func (h nodeLabelsHandler) OnNodeAdd(n *v1.Node)        { h.labels.Set(n) }
func (h nodeLabelsHandler) OnNodeUpdate(_, n *v1.Node)  { h.labels.Set(n) }
func (h nodeLabelsHandler) OnNodeDelete(n *v1.Node)     { h.labels.Delete(n.Name) }
func (h nodeLabelsHandler) OnNodeSynced()               {}
func (h nodeLabelsHandler) OnOtherNodesPending(_ bool)  {}
func (h nodeLabelsHandler) known(name string) (ok bool) { _, ok = h.labels.Get(name); return ok }

// heapAfterGC is the live heap after a full collection.
func heapAfterGC() (live, allocated uint64) {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc, m.TotalAlloc
}

// BenchmarkNodeCache measures the heap kproxy's Node watching retains with
// benchNodes realistic Nodes in the cluster, in-process over fake clients:
//
//   - full-informer: what kproxy did before, a Node informer of every node,
//     untrimmed;
//   - this-node: the Node informer of this node only, trimmed (a cluster
//     without topologyKeys Services);
//   - this-node+topology-metadata: plus OtherNodesConfig's metadata-only
//     watch of the other nodes, started by a topologyKeys Service.
//
// Every path feeds a proxy.NodeLabels, as an engine does. retained-MiB is
// the live heap after the caches synced minus the live heap before (the
// fake API server's objects are in both); alloc-MiB is what syncing
// allocated in all. Run it with -benchtime=1x or a few iterations.
func BenchmarkNodeCache(b *testing.B) {
	nodes := make([]runtimeapi.Object, 0, benchNodes+1)
	metas := make([]*metav1.PartialObjectMetadata, 0, benchNodes+1)
	for i := range benchNodes {
		n := realisticNode(i)
		if i == 0 {
			n.Name, n.Labels[v1.LabelHostname] = testNode, testNode
		}
		nodes = append(nodes, n)
		metas = append(metas, &metav1.PartialObjectMetadata{
			TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
			ObjectMeta: *n.ObjectMeta.DeepCopy(),
		})
	}
	encoded, err := json.Marshal(nodes[1])
	if err != nil {
		b.Fatal(err)
	}
	encodedMeta, err := json.Marshal(metas[1])
	if err != nil {
		b.Fatal(err)
	}
	client := fake.NewClientset(nodes...)
	// The API server applies the field selector of this node's informer;
	// the fake does not, so that informer gets a fake holding this node
	// only.
	thisNodeClient := fake.NewClientset(nodes[0])
	metadataClient := newMetadataClient(metas...)
	lastNode := fmt.Sprintf("node-%05d", benchNodes-1)
	ctx := klog.NewContext(context.Background(), klog.Background().V(1))

	paths := []struct {
		name string
		// start starts the caches feeding h and returns once they synced,
		// with a function stopping them.
		start func(b *testing.B, h nodeLabelsHandler) (stop func())
		// wantOthers is whether the other nodes' labels are known.
		wantOthers bool
	}{
		{
			name: "full-informer",
			start: func(b *testing.B, h nodeLabelsHandler) func() {
				factory := informers.NewSharedInformerFactory(client, 0)
				return runNodeConfig(ctx, b, factory, h)
			},
			wantOthers: true,
		},
		{
			name: "this-node",
			start: func(b *testing.B, h nodeLabelsHandler) func() {
				return runThisNode(ctx, b, thisNodeClient, h)
			},
		},
		{
			name: "this-node+topology-metadata",
			start: func(b *testing.B, h nodeLabelsHandler) func() {
				stopThisNode := runThisNode(ctx, b, thisNodeClient, h)
				cfg, err := NewOtherNodesConfig(ctx, OtherNodesOptions{Client: metadataClient, NodeName: testNode})
				if err != nil {
					b.Fatal(err)
				}
				cfg.RegisterEventHandler(h)
				runCtx, cancel := context.WithCancel(ctx)
				done := make(chan struct{})
				go func() {
					defer close(done)
					cfg.Run(runCtx)
				}()
				cfg.OnServiceAdd(newService("ns", "topo", withTopologyKeys(`["example.com/site"]`)))
				for !h.known(lastNode) {
					time.Sleep(time.Millisecond)
				}
				return func() {
					cancel()
					<-done
					stopThisNode()
				}
			},
			wantOthers: true,
		},
	}
	for _, path := range paths {
		b.Run(path.name, func(b *testing.B) {
			var retained, allocated float64
			for b.Loop() {
				liveBefore, allocBefore := heapAfterGC()
				h := nodeLabelsHandler{labels: proxy.NewNodeLabels(proxy.NodeLabelsOptions{NodeName: testNode})}
				stop := path.start(b, h)
				liveAfter, allocAfter := heapAfterGC()
				if got := h.known(lastNode); got != path.wantOthers || !h.known(testNode) {
					b.Fatalf("this node known %v, other nodes known %v; want true, %v", h.known(testNode), got, path.wantOthers)
				}
				runtime.KeepAlive(h)
				stop()
				retained += float64(int64(liveAfter) - int64(liveBefore))
				allocated += float64(allocAfter - allocBefore)
			}
			const mib = 1 << 20
			b.ReportMetric(retained/float64(b.N)/mib, "retained-MiB")
			b.ReportMetric(allocated/float64(b.N)/mib, "alloc-MiB")
			b.ReportMetric(float64(len(encoded)), "json-bytes/node")
			b.ReportMetric(float64(len(encodedMeta)), "json-metadata-bytes/node")
		})
	}
}

// runThisNode runs the Node informer of NewInformerFactories (this node
// only) into h until synced.
func runThisNode(ctx context.Context, b *testing.B, client *fake.Clientset, h nodeLabelsHandler) func() {
	f, err := NewInformerFactories(InformerOptions{Client: client, NodeName: testNode})
	if err != nil {
		b.Fatal(err)
	}
	return runNodeConfig(ctx, b, f.Nodes, h)
}

// runNodeConfig runs a NodeConfig over factory's Node informer into h until
// synced.
func runNodeConfig(ctx context.Context, b *testing.B, factory informers.SharedInformerFactory, h nodeLabelsHandler) func() {
	cfg, err := NewNodeConfig(ctx, factory.Core().V1().Nodes(), 0)
	if err != nil {
		b.Fatal(err)
	}
	cfg.RegisterEventHandler(h)
	ctx, cancel := context.WithCancel(ctx)
	factory.Start(ctx.Done())
	cfg.Run(ctx)
	return func() {
		cancel()
		factory.Shutdown()
	}
}
