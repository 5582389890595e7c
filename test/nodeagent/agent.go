// Package nodeagent is the local cluster's kubelet stand-in, networking only.
//
// One agent runs per node. It keeps the Node's Ready condition fresh and
// plays every Pod bound to the node: a network namespace with a veth and an
// address from the node's podCIDR, a built-in echo server on every
// containerPort, and a Pod status that reports it Running and Ready (unless
// the annotation kpc.kproxy.io/ready is "false"). A deleted Pod keeps
// serving for its grace period (capped), then the agent removes its
// namespace and deletes the Pod object.
//
// Pod network, per pod with UID u (uid8 = the first 8 characters of u):
//
//	pod namespace kpc-p-<uid8>:  lo up; eth0 with <podIP>/<podCIDR bits>; default dev eth0
//	node namespace:              vp<uid8> up, proxy_arp=1; <podIP>/32 dev vp<uid8>
//
// Echo servers answer "<pod-name> <client-ip:port>\n": once per TCP
// connection (then close), as the body of a 200 response on TCP ports named
// http*, and once per UDP datagram.
//
// The agent must run in the host's mount namespace (start it with
// `nsenter --net=/run/netns/<node>`, not `ip netns exec`, which gives the
// process a private mount namespace where new named namespaces stay
// invisible to everyone else); Run checks this. It addresses every
// namespace by name, so the network namespace it runs in does not matter
// beyond reaching the API server.
//
// When its context ends the agent stops the echo servers and leaves pod
// namespaces and veths in place: a restarted agent recreates the namespace
// of each running pod (keeping its podIP), removes those whose pod is gone,
// and finishes pods deleted meanwhile at once (their grace period is not
// resumed); `kpc down` removes whatever remains.
package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
)

const (
	// ReadyAnnotation set to "false" on a Pod makes the agent report it
	// not Ready (its servers keep answering); any other value or none
	// means Ready.
	ReadyAnnotation = "kpc.kproxy.io/ready"
	// DefaultPodNetNSPrefix starts the name of every pod namespace.
	DefaultPodNetNSPrefix = "kpc-p-"
	// HostVethPrefix starts the name of the node end of every pod veth.
	HostVethPrefix = "vp"
	// HeartbeatInterval is how often the agent posts the Node's Ready
	// condition.
	HeartbeatInterval = 10 * time.Second
	// DefaultMaxGracePeriod caps the termination grace period.
	DefaultMaxGracePeriod = 30 * time.Second

	// uidPrefixLen is how many characters of the pod UID name its
	// namespace and veth.
	uidPrefixLen = 8
	// workers is the number of pods set up or torn down concurrently.
	workers = 4
	// clientQPS and clientBurst lift client-go's default rate limit
	// (5 QPS), which would throttle status updates of many pods.
	clientQPS   = 50
	clientBurst = 100
)

// Options configures Run.
type Options struct {
	// Kubeconfig is the path of the kubeconfig; ignored when Client is set.
	Kubeconfig string
	// NodeName is the Node this agent plays.
	NodeName string
	// NodeIP is the node's address on the switch, reported as hostIP.
	NodeIP netip.Addr
	// PodCIDR is the node's pod range (10.244.<i>.0/24); pod addresses
	// are allocated from its .2 upwards.
	PodCIDR netip.Prefix
	// NodeNetNS is the node's named network namespace, where the host
	// ends of pod veths and the routes to pods live.
	NodeNetNS string
	// MaxGracePeriod caps a pod's termination grace period;
	// DefaultMaxGracePeriod when zero.
	MaxGracePeriod time.Duration
	// PodNetNSPrefix starts pod namespace names; DefaultPodNetNSPrefix
	// when empty (tests use their own so `kpc down` never meets them).
	PodNetNSPrefix string
	// Client, when set, is used instead of a client built from
	// Kubeconfig (tests).
	Client kubernetes.Interface
}

// complete validates o and fills in defaults.
func (o *Options) complete() error {
	var errs []error
	if o.NodeName == "" {
		errs = append(errs, errors.New("NodeName is required"))
	}
	if !o.NodeIP.IsValid() {
		errs = append(errs, errors.New("NodeIP is required"))
	}
	if !o.PodCIDR.IsValid() {
		errs = append(errs, errors.New("PodCIDR is required"))
	}
	if o.NodeNetNS == "" {
		errs = append(errs, errors.New("NodeNetNS is required"))
	}
	if o.Client == nil && o.Kubeconfig == "" {
		errs = append(errs, errors.New("Kubeconfig or Client is required"))
	}
	if o.MaxGracePeriod < 0 {
		errs = append(errs, fmt.Errorf("MaxGracePeriod %v is negative", o.MaxGracePeriod))
	}
	if o.MaxGracePeriod == 0 {
		o.MaxGracePeriod = DefaultMaxGracePeriod
	}
	if o.PodNetNSPrefix == "" {
		o.PodNetNSPrefix = DefaultPodNetNSPrefix
	}
	return errors.Join(errs...)
}

// PodNetNSName is the namespace of the pod with uid under the default
// prefix (what `kpc exec <pod>` enters).
func PodNetNSName(uid types.UID) string {
	return DefaultPodNetNSPrefix + uid8(uid)
}

// HostVethName is the node end of the veth of the pod with uid.
func HostVethName(uid types.UID) string {
	return HostVethPrefix + uid8(uid)
}

// uid8 is the first uidPrefixLen characters of uid.
func uid8(uid types.UID) string {
	s := string(uid)
	if len(s) > uidPrefixLen {
		s = s[:uidPrefixLen]
	}
	return s
}

// isHostVeth reports whether name looks like a pod veth's node end.
func isHostVeth(name string) bool {
	return strings.HasPrefix(name, HostVethPrefix) && len(name) == len(HostVethPrefix)+uidPrefixLen
}

// Run plays the node until ctx ends, then stops the echo servers and
// returns nil (pod namespaces stay; see the package documentation). It
// returns an error when it cannot start.
func Run(ctx context.Context, opts Options) error {
	if err := opts.complete(); err != nil {
		return fmt.Errorf("node agent options: %w", err)
	}
	client := opts.Client
	if client == nil {
		cfg, err := clientcmd.BuildConfigFromFlags("", opts.Kubeconfig)
		if err != nil {
			return fmt.Errorf("loading kubeconfig %s: %w", opts.Kubeconfig, err)
		}
		cfg.QPS, cfg.Burst = clientQPS, clientBurst
		cfg.UserAgent = "kpc-agent/" + opts.NodeName
		if client, err = kubernetes.NewForConfig(cfg); err != nil {
			return fmt.Errorf("creating client: %w", err)
		}
	}
	nw, err := newIPNetwork(opts.NodeNetNS)
	if err != nil {
		return err
	}
	a, err := newAgent(opts, client, nw, clock.RealClock{})
	if err != nil {
		return err
	}
	return a.run(ctx)
}

// agentClock is the clock the agent reads, ticks and schedules with.
type agentClock interface {
	clock.WithTicker
	AfterFunc(d time.Duration, f func()) clock.Timer
}

// agent plays one node.
type agent struct {
	opts   Options
	client kubernetes.Interface
	net    podNetwork
	clock  agentClock
	ipam   *ipAllocator
	queue  workqueue.TypedRateLimitingInterface[string]
	pods   corelisters.PodLister

	mu sync.Mutex
	// running holds the pods set up on this node by namespace/name.
	running map[string]*podRuntime
	// recovered holds, by namespace/name, the pods whose address recover
	// reserved and that have not started since.
	recovered map[string]types.UID
}

// podRuntime is a pod the agent has set up.
type podRuntime struct {
	uid         types.UID
	ip          netip.Addr
	hostNetwork bool
	// net is the pod's network (unset for host-network pods).
	net     podNetConfig
	servers *echoServers
	started time.Time

	// terminatingSince is when the agent first saw the deletion (zero
	// until then); deleteAt is when the grace period ends.
	terminatingSince time.Time
	deleteAt         time.Time
	timer            clock.Timer
}

// newAgent returns an agent for completed opts.
func newAgent(opts Options, client kubernetes.Interface, nw podNetwork, clk agentClock) (*agent, error) {
	ipam, err := newIPAllocator(opts.PodCIDR)
	if err != nil {
		return nil, err
	}
	return &agent{
		opts:   opts,
		client: client,
		net:    nw,
		clock:  clk,
		ipam:   ipam,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "kpc-agent-pods"},
		),
		running:   map[string]*podRuntime{},
		recovered: map[string]types.UID{},
	}, nil
}

// run is Run after setup.
func (a *agent) run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithName("nodeagent").WithValues("node", a.opts.NodeName)
	ctx = klog.NewContext(ctx, logger)

	factory := informers.NewSharedInformerFactoryWithOptions(a.client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", a.opts.NodeName).String()
		}))
	podInformer := factory.Core().V1().Pods()
	a.pods = podInformer.Lister()
	if _, err := podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    a.enqueue,
		UpdateFunc: func(_, obj any) { a.enqueue(obj) },
		DeleteFunc: a.enqueue,
	}); err != nil {
		return fmt.Errorf("adding pod event handler: %w", err)
	}

	// Deferred calls run in reverse: stop the queue, cancel ctx (ending
	// the heartbeat and the informers on early returns), wait for the
	// informers, wait for the goroutines.
	var wg sync.WaitGroup
	defer wg.Wait()
	defer factory.Shutdown()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer a.queue.ShutDown()

	wg.Go(func() { a.heartbeat(ctx) })
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), podInformer.Informer().HasSynced) {
		return nil // ctx ended
	}
	a.recover(ctx)
	logger.Info("Node agent started", "podCIDR", a.opts.PodCIDR, "nodeNetNS", a.opts.NodeNetNS)

	for range workers {
		wg.Go(func() {
			for a.processNext(ctx) {
			}
		})
	}
	<-ctx.Done()
	a.queue.ShutDown()
	wg.Wait()
	a.stopAll(ctx)
	logger.Info("Node agent stopped; pod namespaces stay")
	return nil
}

// enqueue queues the key of a pod on this node (the fake clientset of
// tests ignores the field selector).
func (a *agent) enqueue(obj any) {
	if pod, ok := obj.(*v1.Pod); ok && pod.Spec.NodeName != a.opts.NodeName {
		return
	}
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		return
	}
	a.queue.Add(key)
}

// heartbeat posts the Node's Ready condition now and every
// HeartbeatInterval until ctx ends.
func (a *agent) heartbeat(ctx context.Context) {
	logger := klog.FromContext(ctx)
	t := a.clock.NewTicker(HeartbeatInterval)
	defer t.Stop()
	for {
		if err := a.updateNodeStatus(ctx); err != nil && ctx.Err() == nil {
			logger.Error(err, "Posting node status")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		}
	}
}

// recover reserves the addresses of pods already running on the node, so
// none is handed out twice, and removes the namespaces of pods that are
// gone (found through their veths in the node namespace).
func (a *agent) recover(ctx context.Context) {
	logger := klog.FromContext(ctx)
	pods, err := a.pods.List(labels.Everything())
	if err != nil {
		logger.Error(err, "Listing pods")
	}
	live := map[string]bool{}
	for _, pod := range pods {
		if pod.Spec.NodeName != a.opts.NodeName {
			continue
		}
		live[uid8(pod.UID)] = true
		if pod.Spec.HostNetwork || pod.Status.PodIP == "" || podTerminal(pod) {
			continue
		}
		ip, err := netip.ParseAddr(pod.Status.PodIP)
		if err != nil || !a.opts.PodCIDR.Contains(ip) {
			continue
		}
		if err := a.ipam.reserve(pod.UID, ip); err != nil {
			logger.Error(err, "Recovering pod address", "pod", klog.KObj(pod))
			continue
		}
		if key, err := cache.MetaNamespaceKeyFunc(pod); err == nil {
			a.mu.Lock()
			a.recovered[key] = pod.UID
			a.mu.Unlock()
		}
		logger.V(2).Info("Recovered pod address", "pod", klog.KObj(pod), "ip", ip)
	}
	veths, err := a.net.HostVeths(ctx)
	if err != nil {
		logger.Error(err, "Listing pod veths")
	}
	for _, veth := range veths {
		id := strings.TrimPrefix(veth, HostVethPrefix)
		if live[id] {
			continue
		}
		cfg := podNetConfig{NetNS: a.opts.PodNetNSPrefix + id, HostVeth: veth}
		if err := a.net.Teardown(ctx, cfg); err != nil {
			logger.Error(err, "Removing orphaned pod network", "netns", cfg.NetNS)
			continue
		}
		logger.Info("Removed orphaned pod network", "netns", cfg.NetNS, "veth", veth)
	}
}

// processNext syncs one queued pod; false when the queue shut down.
func (a *agent) processNext(ctx context.Context) bool {
	key, quit := a.queue.Get()
	if quit {
		return false
	}
	defer a.queue.Done(key)
	if err := a.syncPod(ctx, key); err != nil {
		if ctx.Err() == nil {
			klog.FromContext(ctx).Error(err, "Syncing pod, will retry", "pod", key)
		}
		a.queue.AddRateLimited(key)
		return true
	}
	a.queue.Forget(key)
	return true
}

// syncPod brings the pod at key to its desired state: set up and reported
// while it exists, serving through its grace period once deleted, torn down
// and deleted after it, torn down when it vanished.
func (a *agent) syncPod(ctx context.Context, key string) error {
	logger := klog.FromContext(ctx).WithValues("pod", key)
	ctx = klog.NewContext(ctx, logger)
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil // never queued by enqueue
	}
	pod, err := a.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) || (err == nil && pod.Spec.NodeName != a.opts.NodeName) {
		pod, err = nil, nil
	}
	if err != nil {
		return fmt.Errorf("getting pod from cache: %w", err)
	}

	rt := a.runtime(key)
	gone := pod == nil || podTerminal(pod)
	if rt != nil && (gone || pod.UID != rt.uid) {
		logger.Info("Pod gone, tearing down", "uid", rt.uid)
		if err := a.teardown(ctx, key, rt); err != nil {
			return err
		}
		rt = nil
	}
	a.releaseRecovered(key, pod)
	if gone {
		return nil
	}

	if rt == nil {
		if pod.DeletionTimestamp != nil {
			// Not running here (deleted before it started, already torn
			// down, or running under an earlier agent): never (re)start a
			// deleted pod; finish it at once.
			if !pod.Spec.HostNetwork {
				if err := a.net.Teardown(ctx, a.podNetConfig(pod.UID, netip.Addr{})); err != nil {
					return fmt.Errorf("removing pod network: %w", err)
				}
				a.ipam.release(pod.UID)
				a.mu.Lock()
				delete(a.recovered, key)
				a.mu.Unlock()
			}
			return a.deletePod(ctx, pod)
		}
		if rt, err = a.startPod(ctx, key, pod); err != nil {
			return err
		}
	}

	if pod.DeletionTimestamp != nil {
		if done := a.trackTermination(ctx, key, pod, rt); done {
			if err := a.teardown(ctx, key, rt); err != nil {
				return err
			}
			return a.deletePod(ctx, pod)
		}
	}
	patched, err := a.syncPodStatus(ctx, pod, rt)
	if err != nil {
		return err
	}
	if patched {
		logger.V(2).Info("Updated pod status", "ip", rt.ip, "ready", podReady(pod))
	}
	return nil
}

// podTerminal reports whether the pod has finished (the agent never
// finishes pods itself, but someone may set the phase).
func podTerminal(pod *v1.Pod) bool {
	return pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
}

// releaseRecovered frees the address recover reserved for the pod at key
// when that pod is gone, finished or replaced before it started.
func (a *agent) releaseRecovered(key string, pod *v1.Pod) {
	a.mu.Lock()
	defer a.mu.Unlock()
	uid, ok := a.recovered[key]
	if !ok || (pod != nil && pod.UID == uid && !podTerminal(pod)) {
		return
	}
	delete(a.recovered, key)
	a.ipam.release(uid)
}

// runtime returns the running pod at key, or nil.
func (a *agent) runtime(key string) *podRuntime {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.running[key]
}

// podNetConfig is the network of the pod with uid and address ip.
func (a *agent) podNetConfig(uid types.UID, ip netip.Addr) podNetConfig {
	cfg := podNetConfig{NetNS: a.opts.PodNetNSPrefix + uid8(uid), HostVeth: HostVethName(uid)}
	if ip.IsValid() {
		cfg.Addr = netip.PrefixFrom(ip, a.opts.PodCIDR.Bits())
	}
	return cfg
}

// startPod sets up the pod's network and echo servers and records it. A
// pod that already reports an address in the podCIDR keeps it when free.
func (a *agent) startPod(ctx context.Context, key string, pod *v1.Pod) (*podRuntime, error) {
	logger := klog.FromContext(ctx)
	rt := &podRuntime{uid: pod.UID, started: a.clock.Now(), hostNetwork: pod.Spec.HostNetwork}
	if pod.Status.StartTime != nil {
		rt.started = pod.Status.StartTime.Time
	}
	netnsName := a.opts.NodeNetNS
	if rt.hostNetwork {
		rt.ip = a.opts.NodeIP
	} else {
		if prev, err := netip.ParseAddr(pod.Status.PodIP); err == nil && a.ipam.reserve(pod.UID, prev) == nil {
			rt.ip = prev
		} else {
			ip, err := a.ipam.allocate(pod.UID)
			if err != nil {
				return nil, err
			}
			rt.ip = ip
		}
		rt.net = a.podNetConfig(pod.UID, rt.ip)
		if err := a.net.Setup(ctx, rt.net); err != nil {
			a.ipam.release(pod.UID)
			return nil, fmt.Errorf("setting up pod network: %w", err)
		}
		netnsName = rt.net.NetNS
	}
	servers, err := startEchoServers(ctx, a.net, netnsName, pod.Name, podPorts(pod))
	if err != nil {
		if !rt.hostNetwork {
			err = errors.Join(err, a.net.Teardown(ctx, rt.net))
			a.ipam.release(pod.UID)
		}
		return nil, err
	}
	rt.servers = servers
	a.mu.Lock()
	a.running[key] = rt
	delete(a.recovered, key) // the runtime owns the address now
	a.mu.Unlock()
	logger.Info("Pod started", "uid", pod.UID, "ip", rt.ip, "netns", netnsName)
	return rt, nil
}

// gracePeriod is how long a deleted pod keeps running: its
// deletionGracePeriodSeconds, else its terminationGracePeriodSeconds, else
// the API default, capped at limit.
func gracePeriod(pod *v1.Pod, limit time.Duration) time.Duration {
	secs := int64(v1.DefaultTerminationGracePeriodSeconds)
	switch {
	case pod.DeletionGracePeriodSeconds != nil:
		secs = *pod.DeletionGracePeriodSeconds
	case pod.Spec.TerminationGracePeriodSeconds != nil:
		secs = *pod.Spec.TerminationGracePeriodSeconds
	}
	return min(max(time.Duration(secs)*time.Second, 0), limit)
}

// trackTermination records when the agent first saw the pod's deletion,
// (re)arms a timer that requeues the pod when its grace period ends (a
// later delete may shorten it), and reports whether it has ended.
func (a *agent) trackTermination(ctx context.Context, key string, pod *v1.Pod, rt *podRuntime) bool {
	now := a.clock.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	grace := gracePeriod(pod, a.opts.MaxGracePeriod)
	if rt.terminatingSince.IsZero() {
		rt.terminatingSince = now
		klog.FromContext(ctx).Info("Pod terminating", "gracePeriod", grace)
	}
	deadline := rt.terminatingSince.Add(grace)
	if !now.Before(deadline) {
		return true
	}
	if rt.timer == nil || !deadline.Equal(rt.deleteAt) {
		if rt.timer != nil {
			rt.timer.Stop()
		}
		rt.deleteAt = deadline
		rt.timer = a.clock.AfterFunc(deadline.Sub(now), func() { a.queue.Add(key) })
	}
	return false
}

// teardown stops the pod's servers, removes its network, frees its
// address and forgets it. On error the pod stays recorded, so a retry
// tears down again.
func (a *agent) teardown(ctx context.Context, key string, rt *podRuntime) error {
	rt.servers.Stop()
	a.mu.Lock()
	if rt.timer != nil {
		rt.timer.Stop()
	}
	a.mu.Unlock()
	if !rt.hostNetwork {
		if err := a.net.Teardown(ctx, rt.net); err != nil {
			return fmt.Errorf("removing pod network: %w", err)
		}
		a.ipam.release(rt.uid)
	}
	a.mu.Lock()
	if a.running[key] == rt {
		delete(a.running, key)
	}
	a.mu.Unlock()
	klog.FromContext(ctx).Info("Pod stopped", "uid", rt.uid, "ip", rt.ip)
	return nil
}

// deletePod deletes the pod object at once, only if it is still the same
// pod; a pod already gone or replaced is fine.
func (a *agent) deletePod(ctx context.Context, pod *v1.Pod) error {
	uid := pod.UID
	err := a.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: new(int64(0)),
		Preconditions:      &metav1.Preconditions{UID: &uid},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("deleting pod: %w", err)
	}
	klog.FromContext(ctx).V(2).Info("Deleted pod object", "uid", uid)
	return nil
}

// stopAll stops the servers and timers of every pod, leaving their
// namespaces.
func (a *agent) stopAll(ctx context.Context) {
	a.mu.Lock()
	running := a.running
	a.running = map[string]*podRuntime{}
	a.mu.Unlock()
	for _, rt := range running {
		if rt.timer != nil {
			rt.timer.Stop()
		}
		rt.servers.Stop()
	}
	klog.FromContext(ctx).V(2).Info("Stopped pod servers", "pods", len(running))
}
