// Package explain answers "what does kproxy do with this Service on this
// node, and why?": it reads a Service, its EndpointSlices and the Nodes once
// from the API server, runs them through the engine exactly as the agent
// does (proxier.Engine, with a backend that keeps the state it is given
// instead of programming the kernel), and says, per destination kind
// (ClusterIP, NodePort, ExternalIP, LoadBalancer IP) and source class (a pod,
// the node itself, anyone else), where a new connection goes and why, in
// Service terms. Compare then traces the same flows over the node's live
// rules (package proxier/trace) and reports whether they agree.
//
// See docs/design.md, "kproxy explain".
package explain

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"

	"github.com/kproxy/kproxy/config"
	"github.com/kproxy/kproxy/pkg/proxy"
	"github.com/kproxy/kproxy/proxier"
)

// Options say what to explain and how this node's kproxy is configured:
// the agent's settings that the decisions depend on.
type Options struct {
	Client   kubernetes.Interface
	NodeName string
	Service  types.NamespacedName
	// Port selects one port of the Service by name or number; "" explains
	// every port.
	Port string
	// ServiceProxyName is the agent's --service-proxy-name.
	ServiceProxyName string
	// MasqueradeAll and ClusterCIDRs (by family; absent: unknown) are the
	// agent's --masquerade-all and --cluster-cidr.
	MasqueradeAll bool
	ClusterCIDRs  map[v1.IPFamily]netip.Prefix
	// NodeIPs returns this node's primary IP per family as the agent finds
	// it (the Node's addresses, or --bind-address); nil: the Node's first
	// InternalIP, else ExternalIP, of each family.
	NodeIPs func(node *v1.Node) map[v1.IPFamily]netip.Addr
	// NodePortAddresses returns the node-port addresses of a family
	// (--nodeport-addresses) given the primary IP; nil: every address.
	NodePortAddresses func(family v1.IPFamily, nodeIP netip.Addr) (*proxy.NodePortAddresses, error)
	// LocalAddresses lists the node's addresses, to find one that serves
	// node ports when the primary IP does not; nil: none.
	LocalAddresses func() ([]netip.Addr, error)
	Logger         klog.Logger
}

// Verdicts of a flow: those of trace.Report.
const (
	Delivered = "delivered"
	Dropped   = "dropped"
	Rejected  = "rejected"
)

// Source classes of a flow: proxy.SourceClass's names.
const (
	SourcePod   = "pod"
	SourceNode  = "node"
	SourceOther = "other"
)

// Explanation is what kproxy decides for one Service on one node.
type Explanation struct {
	Service string `json:"service"`
	Node    string `json:"node"`
	// NodeLabels are this node's labels that the decisions read: its zone
	// and the values of the Service's topologyKeys.
	NodeLabels map[string]string `json:"nodeLabels,omitempty"`
	Ports      []*Port           `json:"ports"`
	// Notes are caveats: Warning events the agent would send about the
	// Service, sources that could not be shown.
	Notes []string `json:"notes,omitempty"`
	// Live is the comparison with the node's rules; nil before Compare.
	Live *Live `json:"live,omitempty"`
}

// Port is the decision for one service port of one IP family.
type Port struct {
	Name                     string   `json:"name"`
	Family                   string   `json:"family"`
	Protocol                 string   `json:"protocol"`
	Port                     int      `json:"port"`
	ClusterIP                string   `json:"clusterIP"`
	NodePort                 int      `json:"nodePort,omitempty"`
	ExternalIPs              []string `json:"externalIPs,omitempty"`
	LoadBalancerIPs          []string `json:"loadBalancerIPs,omitempty"`
	LoadBalancerSourceRanges []string `json:"loadBalancerSourceRanges,omitempty"`
	InternalTrafficPolicy    string   `json:"internalTrafficPolicy"`
	ExternalTrafficPolicy    string   `json:"externalTrafficPolicy,omitempty"`
	TrafficDistribution      string   `json:"trafficDistribution,omitempty"`
	TopologyKeys             []string `json:"topologyKeys,omitempty"`
	AffinitySeconds          int      `json:"affinitySeconds,omitempty"`
	// Endpoints are every endpoint of the port's EndpointSlices.
	Endpoints []Endpoint `json:"endpoints"`
	// Cluster and Local are the endpoint lists that deliveries balance
	// over; nil when no decision uses them.
	Cluster *Selection `json:"cluster,omitempty"`
	Local   *Selection `json:"local,omitempty"`
	Flows   []*Flow    `json:"flows"`
}

// Endpoint is one endpoint of a port, as the model sees it.
type Endpoint struct {
	Address string `json:"address"`
	Node    string `json:"node,omitempty"`
	Zone    string `json:"zone,omitempty"`
	// State is "ready", "serving-terminating", "terminating" or
	// "not-ready".
	State string `json:"state"`
	// Local: on this node.
	Local     bool     `json:"local"`
	ZoneHints []string `json:"zoneHints,omitempty"`
	NodeHints []string `json:"nodeHints,omitempty"`
	// InCluster and InLocal: chosen for the Cluster, Local list.
	InCluster bool `json:"inCluster"`
	InLocal   bool `json:"inLocal"`
}

// Selection is an endpoint list and why it holds what it holds.
type Selection struct {
	Endpoints []string `json:"endpoints"`
	Why       string   `json:"why"`
}

// Flow is a new connection of one source class to one address of a port,
// and what the model decides for it.
type Flow struct {
	// Destination is the kind: ClusterIP, NodePort, ExternalIP,
	// LoadBalancerIP.
	Destination string `json:"destination"`
	Address     string `json:"address"`
	Port        int    `json:"port"`
	Protocol    string `json:"protocol"`
	// Source is the class (pod, node, other) and SourceAddress the address
	// that stands for it.
	Source        string `json:"source"`
	SourceAddress string `json:"sourceAddress"`
	// Verdict is Delivered, Dropped or Rejected.
	Verdict string `json:"verdict"`
	// Endpoints a delivery balances over.
	Endpoints  []string `json:"endpoints,omitempty"`
	Masquerade bool     `json:"masquerade"`
	// AffinitySeconds is the ClientIP affinity of a delivery (0: none).
	AffinitySeconds int `json:"affinitySeconds,omitempty"`
	// Reason says the verdict in Service terms.
	Reason string `json:"reason"`
	// Live is what the node's rules do with the same packet; nil before
	// Compare.
	Live *LiveCheck `json:"live,omitempty"`

	family v1.IPFamily
}

// Explain reads the Service, its EndpointSlices and Nodes once and returns
// what this node's kproxy decides for it.
func Explain(ctx context.Context, o Options) (*Explanation, error) {
	in, err := read(ctx, o)
	if err != nil {
		return nil, err
	}
	states, notes, err := decide(ctx, o, in)
	if err != nil {
		return nil, err
	}
	x := &Explanation{Service: o.Service.String(), Node: o.NodeName, Notes: notes}
	x.NodeLabels = map[string]string{}
	if z, ok := in.node.Labels[v1.LabelTopologyZone]; ok {
		x.NodeLabels[v1.LabelTopologyZone] = z
	}
	nodeIPs := primaryIPs(o, in.node)
	for _, fam := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
		ns := states[fam]
		if ns == nil {
			continue
		}
		fx := familyExplainer{o: o, in: in, state: ns, nodeIP: nodeIPs[fam], x: x}
		if err := fx.explain(); err != nil {
			return nil, err
		}
	}
	if len(x.Ports) == 0 {
		return nil, fmt.Errorf("service %s has no port %q", o.Service, o.Port)
	}
	slices.SortStableFunc(x.Ports, func(a, b *Port) int { return strings.Compare(a.Name, b.Name) })
	return x, nil
}

// input is what was read from the API server.
type input struct {
	svc    *v1.Service
	slices []*discovery.EndpointSlice
	node   *v1.Node
	// others are the other Nodes, listed when a port uses topologyKeys.
	others []*v1.Node
	// endpoints are each port's endpoints, by family, as the engine's
	// endpoint tracker builds them.
	endpoints map[v1.IPFamily]proxy.EndpointsMap
}

// read lists the Service (list with a field selector: kube-proxy's
// identity may list Services but not get them), its EndpointSlices, this
// Node and, for topologyKeys, every Node; and rejects Services this kproxy
// does not handle.
func read(ctx context.Context, o Options) (*input, error) {
	if o.Client == nil {
		return nil, errors.New("explain: no API client")
	}
	if errs := validateName(o.Service); len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	list, err := o.Client.CoreV1().Services(o.Service.Namespace).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", o.Service.Name).String(),
	})
	if err != nil {
		return nil, fmt.Errorf("reading service %s: %w", o.Service, err)
	}
	var svc *v1.Service
	for i := range list.Items {
		if list.Items[i].Name == o.Service.Name {
			svc = &list.Items[i]
		}
	}
	if svc == nil {
		return nil, fmt.Errorf("service %s not found", o.Service)
	}
	sel, err := config.ServiceSelector(o.ServiceProxyName)
	if err != nil {
		return nil, err
	}
	if !sel.Matches(labels.Set(svc.Labels)) {
		name, has := svc.Labels[config.LabelServiceProxyName]
		mine := "Services without that label"
		if o.ServiceProxyName != "" {
			mine = fmt.Sprintf("only Services labelled %s=%s", config.LabelServiceProxyName, o.ServiceProxyName)
		}
		if has {
			return nil, fmt.Errorf("service %s is labelled %s=%q: another proxy handles it (this kproxy handles %s, see --service-proxy-name)", o.Service, config.LabelServiceProxyName, name, mine)
		}
		return nil, fmt.Errorf("service %s has no %s label: this kproxy handles %s (--service-proxy-name)", o.Service, config.LabelServiceProxyName, mine)
	}
	if skip, why := proxy.ShouldSkipService(svc); skip {
		switch why {
		case "ExternalName":
			return nil, fmt.Errorf("service %s is of type ExternalName (%s): it is a DNS name, kproxy programs nothing for it", o.Service, svc.Spec.ExternalName)
		case "headless":
			return nil, fmt.Errorf("service %s is headless (clusterIP None): clients reach its pods directly, kproxy programs nothing for it", o.Service)
		default:
			return nil, fmt.Errorf("service %s is not handled by kproxy: %s", o.Service, why)
		}
	}
	if o.Port != "" && !hasPort(svc, o.Port) {
		var ports []string
		for _, p := range svc.Spec.Ports {
			ports = append(ports, portLabel(p))
		}
		return nil, fmt.Errorf("service %s has no port %q (its ports: %s)", o.Service, o.Port, strings.Join(ports, ", "))
	}
	in := &input{svc: svc, endpoints: map[v1.IPFamily]proxy.EndpointsMap{}}

	sliceSel := config.EndpointSliceSelector().DeepCopySelector()
	nameReq, err := labels.NewRequirement(discovery.LabelServiceName, "=", []string{svc.Name})
	if err != nil {
		return nil, err
	}
	sliceSel = sliceSel.Add(*nameReq)
	sl, err := o.Client.DiscoveryV1().EndpointSlices(svc.Namespace).List(ctx, metav1.ListOptions{LabelSelector: sliceSel.String()})
	if err != nil {
		return nil, fmt.Errorf("listing the EndpointSlices of %s: %w", o.Service, err)
	}
	for i := range sl.Items {
		if sliceSel.Matches(labels.Set(sl.Items[i].Labels)) {
			in.slices = append(in.slices, &sl.Items[i])
		}
	}

	node, err := o.Client.CoreV1().Nodes().Get(ctx, o.NodeName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return nil, fmt.Errorf("node %q not found: run kproxy explain on a node of the cluster, or give its name with --hostname-override", o.NodeName)
	case err != nil:
		return nil, fmt.Errorf("reading node %s: %w", o.NodeName, err)
	}
	in.node = node
	if keys, _ := proxy.ParseTopologyKeys(svc.Annotations[proxy.AnnotationTopologyKeys]); len(keys) > 0 {
		nodes, err := o.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			return nil, fmt.Errorf("listing the nodes' labels for the topologyKeys of %s: %w", o.Service, err)
		}
		for i := range nodes.Items {
			if nodes.Items[i].Name != o.NodeName {
				in.others = append(in.others, &nodes.Items[i])
			}
		}
	}
	return in, nil
}

func validateName(nn types.NamespacedName) []error {
	var errs []error
	if nn.Namespace == "" || nn.Name == "" {
		errs = append(errs, fmt.Errorf("service %q: want NAMESPACE/NAME[:PORT]", nn.String()))
	}
	return errs
}

// ParseServiceArg parses "NAMESPACE/NAME[:PORT]", PORT a port name or
// number.
func ParseServiceArg(s string) (types.NamespacedName, string, error) {
	bad := fmt.Errorf("service %q: want NAMESPACE/NAME[:PORT] (PORT a port name or number)", s)
	ns, rest, ok := strings.Cut(s, "/")
	if !ok || ns == "" || strings.Contains(rest, "/") {
		return types.NamespacedName{}, "", bad
	}
	name, port, _ := strings.Cut(rest, ":")
	if name == "" || (strings.Contains(rest, ":") && port == "") {
		return types.NamespacedName{}, "", bad
	}
	return types.NamespacedName{Namespace: ns, Name: name}, port, nil
}

// hasPort reports whether svc has a port of that name or number.
func hasPort(svc *v1.Service, port string) bool {
	for _, p := range svc.Spec.Ports {
		if portMatches(p.Name, int(p.Port), port) {
			return true
		}
	}
	return false
}

func portMatches(name string, number int, want string) bool {
	return want == "" || name == want || strconv.Itoa(number) == want
}

func portLabel(p v1.ServicePort) string {
	if p.Name == "" {
		return strconv.Itoa(int(p.Port))
	}
	return fmt.Sprintf("%s (%d)", p.Name, p.Port)
}

// stateBackend is the engine's backend for explain: it keeps the node
// state of the last sync and programs nothing.
type stateBackend struct{ state *proxy.NodeState }

func (b *stateBackend) Sync(_ context.Context, st *proxy.NodeState, _ bool) (proxy.BackendResult, error) {
	b.state = st
	return proxy.BackendResult{}, nil
}

func (b *stateBackend) Cleanup(context.Context) error { return nil }

// decide runs the objects through an engine per family, as the agent's
// informers would deliver them, and returns the node state each engine
// would hand its backend; notes are the Warning events the engine would
// send about the Service and its slices.
func decide(ctx context.Context, o Options, in *input) (map[v1.IPFamily]*proxy.NodeState, []string, error) {
	logger := o.Logger
	if logger.GetSink() == nil {
		logger = klog.Background()
	}
	nodeIPs := primaryIPs(o, in.node)
	out := map[v1.IPFamily]*proxy.NodeState{}
	recorder := record.NewFakeRecorder(1000)
	for _, fam := range []v1.IPFamily{v1.IPv4Protocol, v1.IPv6Protocol} {
		if ports, _ := proxy.ParseService(in.svc, fam); len(ports) == 0 {
			continue
		}
		b := &stateBackend{}
		eo := proxier.EngineOptions{
			Family: fam, NodeName: o.NodeName, Backend: b, SyncPeriod: time.Hour,
			MasqueradeAll: o.MasqueradeAll, ClusterCIDR: o.ClusterCIDRs[fam], NodeIP: nodeIPs[fam],
			Logger: logger, FamilyEventRecorder: recorder,
		}
		if len(out) == 0 {
			// The Service's own warnings from one engine only.
			eo.EventRecorder = recorder
		}
		e, err := proxier.NewEngine(eo)
		if err != nil {
			return nil, nil, err
		}
		e.OnServiceAdd(in.svc)
		for _, s := range in.slices {
			e.OnEndpointSliceAdd(s)
		}
		e.OnNodeAdd(in.node)
		for _, n := range in.others {
			e.OnNodeAdd(n)
		}
		e.OnServiceSynced()
		e.OnEndpointSlicesSynced()
		e.OnNodeSynced()
		if err := e.SyncRules(ctx); err != nil {
			return nil, nil, fmt.Errorf("computing the %s decisions: %w", fam, err)
		}
		if b.state == nil {
			return nil, nil, fmt.Errorf("computing the %s decisions: the engine did not sync", fam)
		}
		out[fam] = b.state

		// The raw endpoints, from the engine's own tracker type.
		t := proxy.NewEndpointsChangeTracker(proxy.EndpointsChangeTrackerOptions{Family: fam, NodeName: o.NodeName, Logger: logger})
		for _, s := range in.slices {
			t.EndpointSliceUpdate(s, false)
		}
		m := proxy.EndpointsMap{}
		t.Apply(m)
		in.endpoints[fam] = m
	}
	if len(out) == 0 {
		return nil, nil, fmt.Errorf("service %s has no ClusterIP kproxy can use", o.Service)
	}
	var notes []string
	for len(recorder.Events) > 0 {
		notes = append(notes, "the agent warns: "+<-recorder.Events)
	}
	return out, notes, nil
}

// primaryIPs are this node's primary IPs as the agent finds them.
func primaryIPs(o Options, node *v1.Node) map[v1.IPFamily]netip.Addr {
	if o.NodeIPs != nil {
		return o.NodeIPs(node)
	}
	out := map[v1.IPFamily]netip.Addr{}
	for _, typ := range []v1.NodeAddressType{v1.NodeInternalIP, v1.NodeExternalIP} {
		for _, a := range node.Status.Addresses {
			ip, err := netip.ParseAddr(a.Address)
			if a.Type != typ || err != nil || ip.IsLoopback() {
				continue
			}
			ip = ip.Unmap()
			if _, ok := out[familyOf(ip)]; !ok {
				out[familyOf(ip)] = ip
			}
		}
	}
	return out
}

func familyOf(a netip.Addr) v1.IPFamily {
	if a.Unmap().Is4() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}
