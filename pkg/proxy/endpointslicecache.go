package proxy

import (
	"cmp"
	"fmt"
	"slices"
	"sync"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
)

// EndpointSliceCacheOptions configures an EndpointSliceCache.
type EndpointSliceCacheOptions struct {
	// Family selects the slices used: IPv4 or IPv6 address type.
	Family v1.IPFamily
	// NodeName is the node kproxy runs on; endpoints on it are local.
	NodeName string
	// Logger receives the cache's messages; klog.Background() when unset.
	Logger klog.Logger
}

// EndpointSliceCache holds, per service, the EndpointSlices of one IP family
// as last applied and as pending, and merges a service's slices into its
// per-port endpoint lists. It is safe for concurrent use.
type EndpointSliceCache struct {
	family      v1.IPFamily
	addressType discovery.AddressType
	nodeName    string
	logger      klog.Logger

	mu       sync.Mutex
	services map[types.NamespacedName]*sliceTracker
	// pending names the services with pending updates, so that
	// checking changes out costs the changes, not every service.
	pending sets.Set[types.NamespacedName]
}

// sliceTracker holds one service's slices: applied is what the last Apply
// saw, sorted by slice name (most services have one slice: a map would
// cost ten times its size), pending the updates since, by slice name (nil
// when none).
type sliceTracker struct {
	applied []namedSlice
	pending map[string]*sliceInfo
}

type namedSlice struct {
	name string
	info *sliceInfo
}

// find returns the applied slice called name.
func (t *sliceTracker) find(name string) (*sliceInfo, bool) {
	i, ok := slices.BinarySearchFunc(t.applied, name, func(e namedSlice, n string) int { return cmp.Compare(e.name, n) })
	if !ok {
		return nil, false
	}
	return t.applied[i].info, true
}

// set makes info the applied slice called name; nil removes it.
func (t *sliceTracker) set(name string, info *sliceInfo) {
	i, ok := slices.BinarySearchFunc(t.applied, name, func(e namedSlice, n string) int { return cmp.Compare(e.name, n) })
	switch {
	case ok && info == nil:
		t.applied = slices.Delete(t.applied, i, i+1)
	case ok:
		t.applied[i].info = info
	case info != nil:
		t.applied = slices.Insert(t.applied, i, namedSlice{name, info})
	}
}

// sliceInfo is the part of an EndpointSlice that matters to the dataplane.
type sliceInfo struct {
	ports []slicePort
	// endpoints are one per usable endpoint, in slice order, with the
	// first port's number: the endpoints of that port (most slices have
	// one) are these very objects, which are never modified.
	endpoints []*Endpoint
	remove    bool
	// problems are what the slice held that kproxy skipped (invalid
	// ports and endpoints), for reporting each once; not part of equal.
	problems []EndpointSliceProblem
}

type slicePort struct {
	name     string
	protocol v1.Protocol
	port     int
}

// endpointsChange is one service's endpoints before and after its pending
// slice updates.
type endpointsChange struct {
	previous EndpointsMap
	current  EndpointsMap
}

// NewEndpointSliceCache returns an empty cache.
func NewEndpointSliceCache(opts EndpointSliceCacheOptions) *EndpointSliceCache {
	logger := opts.Logger
	if logger.GetSink() == nil {
		logger = klog.Background()
	}
	addressType := discovery.AddressTypeIPv4
	if opts.Family == v1.IPv6Protocol {
		addressType = discovery.AddressTypeIPv6
	}
	return &EndpointSliceCache{
		family:      opts.Family,
		addressType: addressType,
		nodeName:    opts.NodeName,
		logger:      logger.WithValues("ipFamily", opts.Family),
		services:    make(map[types.NamespacedName]*sliceTracker),
		pending:     sets.New[types.NamespacedName](),
	}
}

// Handles reports whether the cache takes slices of this address type.
func (c *EndpointSliceCache) Handles(slice *discovery.EndpointSlice) bool {
	return slice != nil && slice.AddressType == c.addressType
}

// endpointSliceServiceName returns the service a slice belongs to.
func endpointSliceServiceName(slice *discovery.EndpointSlice) (types.NamespacedName, error) {
	name := slice.Labels[discovery.LabelServiceName]
	if name == "" {
		return types.NamespacedName{}, fmt.Errorf("EndpointSlice %s/%s has no %s label", slice.Namespace, slice.Name, discovery.LabelServiceName)
	}
	if slice.Namespace == "" || slice.Name == "" {
		return types.NamespacedName{}, fmt.Errorf("EndpointSlice %q of service %q has no namespace or name", slice.Name, name)
	}
	return types.NamespacedName{Namespace: slice.Namespace, Name: name}, nil
}

// serviceOfSlice finds the service that the slice namespace/name belongs
// to, applied or pending, by looking at every service of the namespace: for
// deletions only, which are rare.
func (c *EndpointSliceCache) serviceOfSlice(namespace, name string) (types.NamespacedName, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for nn, tracker := range c.services {
		if nn.Namespace != namespace {
			continue
		}
		if _, ok := tracker.find(name); ok {
			return nn, true
		}
		if _, ok := tracker.pending[name]; ok {
			return nn, true
		}
	}
	return types.NamespacedName{}, false
}

// updatePending records an update (or, with remove, a deletion) of slice. It
// returns the slice's service, whether the pending state of that service
// changed, whether the service now has pending changes, and the problems of
// the slice that its previous version (pending, else applied) did not have.
// Updates that restore the applied state drop the pending entry, so a slice
// added and removed between two Applies leaves nothing behind.
func (c *EndpointSliceCache) updatePending(slice *discovery.EndpointSlice, remove bool) (nn types.NamespacedName, changed, pending bool, newProblems []EndpointSliceProblem, err error) {
	nn, err = endpointSliceServiceName(slice)
	if err != nil && remove && slice.Labels[discovery.LabelServiceName] == "" {
		// A deletion the informer found on a relist carries its cached
		// object, which has no labels (config.EndpointSliceConfig
		// releases them): find the slice's service among those known.
		var found bool
		if nn, found = c.serviceOfSlice(slice.Namespace, slice.Name); found {
			err = nil
		}
	}
	if err != nil {
		return nn, false, false, nil, err
	}
	info := c.newSliceInfo(slice, remove)

	c.mu.Lock()
	defer c.mu.Unlock()
	tracker, ok := c.services[nn]
	if !ok {
		tracker = &sliceTracker{}
		c.services[nn] = tracker
	}
	applied, isApplied := tracker.find(slice.Name)
	old, isPending := tracker.pending[slice.Name]
	switch {
	case isPending:
		newProblems = problemsNotIn(info.problems, old.problems)
	case isApplied:
		newProblems = problemsNotIn(info.problems, applied.problems)
	default:
		newProblems = problemsNotIn(info.problems, nil)
	}

	switch {
	case isPending && old.equal(info):
		changed = false
		// The next update compares its problems with this version's.
		old.problems = info.problems
	case (!isApplied && remove) || (isApplied && applied.equal(info)):
		// Back to the applied state.
		changed = isPending
		delete(tracker.pending, slice.Name)
		if isApplied {
			applied.problems = info.problems
		}
	default:
		changed = true
		if tracker.pending == nil {
			tracker.pending = map[string]*sliceInfo{}
		}
		tracker.pending[slice.Name] = info
	}
	pending = len(tracker.pending) > 0
	if pending {
		c.pending.Insert(nn)
	} else {
		c.pending.Delete(nn)
		if len(tracker.applied) == 0 {
			delete(c.services, nn)
		}
	}
	return nn, changed, pending, newProblems, nil
}

// pendingServices names the services with pending slice updates.
func (c *EndpointSliceCache) pendingServices() sets.Set[string] {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(sets.Set[string], c.pending.Len())
	for nn := range c.pending {
		out.Insert(nn.String())
	}
	return out
}

// checkoutChanges moves every pending update to applied and returns, per
// service, its endpoints before and after. It visits only the services with
// pending updates.
func (c *EndpointSliceCache) checkoutChanges() map[types.NamespacedName]*endpointsChange {
	c.mu.Lock()
	defer c.mu.Unlock()
	changes := make(map[types.NamespacedName]*endpointsChange, c.pending.Len())
	for nn := range c.pending {
		tracker, ok := c.services[nn]
		if !ok || len(tracker.pending) == 0 {
			continue
		}
		change := &endpointsChange{previous: c.endpointsMapOf(nn, tracker.applied)}
		for name, info := range tracker.pending {
			if info.remove {
				info = nil
			}
			tracker.set(name, info)
		}
		tracker.pending = nil
		if len(tracker.applied) == 0 {
			delete(c.services, nn)
		}
		change.current = c.endpointsMapOf(nn, tracker.applied)
		changes[nn] = change
	}
	// A new set rather than clear: a map keeps the size of its largest
	// burst (the initial sync's every service), and clearing or ranging
	// over it would cost that size on every sync.
	c.pending = sets.New[types.NamespacedName]()
	return changes
}

// EndpointsMap returns the applied endpoints of one service.
func (c *EndpointSliceCache) EndpointsMap(nn types.NamespacedName) EndpointsMap {
	c.mu.Lock()
	defer c.mu.Unlock()
	tracker, ok := c.services[nn]
	if !ok {
		return EndpointsMap{}
	}
	return c.endpointsMapOf(nn, tracker.applied)
}

// endpointsMapOf merges the slices of one service. Slices are visited in name
// order; an endpoint (IP and port) seen twice keeps its first occurrence,
// unless that one is terminating and the later one is not (an IP reused by a
// new pod while the old one terminates). Lists are sorted by IP then port;
// ports without endpoints are omitted.
func (c *EndpointSliceCache) endpointsMapOf(nn types.NamespacedName, applied []namedSlice) EndpointsMap {
	// A service has a port or two: a list beats a map.
	type portList struct {
		name ServicePortName
		eps  []*Endpoint
	}
	var ports []portList
	for _, s := range applied {
		for _, p := range s.info.ports {
			spn := ServicePortName{NamespacedName: nn, Port: p.name, Protocol: p.protocol}
			i := slices.IndexFunc(ports, func(l portList) bool { return l.name == spn })
			if i < 0 {
				ports = append(ports, portList{name: spn, eps: make([]*Endpoint, 0, len(s.info.endpoints))})
				i = len(ports) - 1
			}
			for _, tmpl := range s.info.endpoints {
				ep := tmpl
				if ep.Port != p.port {
					cp := *tmpl
					cp.Port = p.port
					ep = &cp
				}
				ports[i].eps = append(ports[i].eps, ep)
			}
		}
	}
	out := make(EndpointsMap, len(ports))
	for _, l := range ports {
		if len(l.eps) == 0 {
			continue
		}
		// A stable sort keeps duplicates in slice order, next to each other.
		list := l.eps
		slices.SortStableFunc(list, compareEndpoints)
		kept := 0
		for _, ep := range list {
			if kept > 0 && compareEndpoints(list[kept-1], ep) == 0 {
				if list[kept-1].Terminating && !ep.Terminating {
					list[kept-1] = ep
				}
				continue
			}
			list[kept] = ep
			kept++
		}
		clear(list[kept:])
		out[l.name] = slices.Clip(list[:kept])
	}
	return out
}

func compareEndpoints(a, b *Endpoint) int {
	if c := a.IP.Compare(b.IP); c != 0 {
		return c
	}
	return cmp.Compare(a.Port, b.Port)
}

// Reasons of the EndpointSliceProblems the cache reports; kproxy uses them
// as the reasons of the Warning events it puts on EndpointSlices.
const (
	// EndpointSliceProblemInvalidEndpoint: an endpoint's address is not an
	// IP address, is of the other family, or is one no endpoint may have;
	// kproxy skips the endpoint.
	EndpointSliceProblemInvalidEndpoint = "InvalidEndpoint"
	// EndpointSliceProblemInvalidPort: a port's number or protocol cannot
	// be programmed; kproxy skips the port.
	EndpointSliceProblemInvalidPort = "InvalidEndpointPort"
)

// EndpointSliceProblem is one thing in an EndpointSlice that kproxy skips;
// the same shape as a ServiceProblem.
type EndpointSliceProblem = ServiceProblem

// newSliceInfo extracts what the dataplane needs from a slice. Ports with
// a number out of range or a protocol other than TCP, UDP or SCTP, and
// endpoints whose address is not an IP address of the family or is a
// special address (unspecified, loopback, link-local, multicast,
// broadcast), are dropped and listed in the info's problems: each affects
// nothing else. Ports without a number are dropped silently (the API allows
// them, meaning every port, which a service proxy cannot use).
func (c *EndpointSliceCache) newSliceInfo(slice *discovery.EndpointSlice, remove bool) *sliceInfo {
	info := &sliceInfo{remove: remove}
	if remove {
		return info
	}
	logger := c.logger.WithValues("endpointSlice", klog.KObj(slice))
	problem := func(reason, format string, args ...any) {
		info.problems = append(info.problems, EndpointSliceProblem{Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	for _, p := range slice.Ports {
		// The API server defaults a missing name to "" and protocol to TCP.
		name := ""
		if p.Name != nil {
			name = *p.Name
		}
		if p.Port == nil {
			logger.V(2).Info("Ignoring EndpointSlice port without a number", "portName", name)
			continue
		}
		if !validPortNumber(*p.Port) {
			problem(EndpointSliceProblemInvalidPort, "port %q: %d is out of range 1-65535; kproxy skips this port", name, *p.Port)
			continue
		}
		protocol := v1.ProtocolTCP
		if p.Protocol != nil && *p.Protocol != "" {
			protocol = *p.Protocol
		}
		if !validProtocol(protocol) {
			problem(EndpointSliceProblemInvalidPort, "port %q: protocol %q is not TCP, UDP or SCTP; kproxy skips this port", name, protocol)
			continue
		}
		info.ports = append(info.ports, slicePort{name: name, protocol: protocol, port: int(*p.Port)})
	}
	slices.SortFunc(info.ports, func(a, b slicePort) int {
		return cmp.Or(cmp.Compare(a.name, b.name), cmp.Compare(a.protocol, b.protocol), cmp.Compare(a.port, b.port))
	})
	firstPort := 0
	if len(info.ports) > 0 {
		firstPort = info.ports[0].port
	}
	info.endpoints = make([]*Endpoint, 0, len(slice.Endpoints))
	for i := range slice.Endpoints {
		e := &slice.Endpoints[i]
		if len(e.Addresses) == 0 {
			logger.V(2).Info("Ignoring endpoint without an address")
			continue
		}
		addr, ok := parseAddrSloppy(e.Addresses[0])
		if !ok {
			problem(EndpointSliceProblemInvalidEndpoint, "endpoint %q is not an IP address; kproxy skips it", e.Addresses[0])
			continue
		}
		if f := familyOfAddr(addr); f != c.family {
			problem(EndpointSliceProblemInvalidEndpoint, "endpoint %q is an %s address in a slice of address type %s; kproxy skips it", e.Addresses[0], f, slice.AddressType)
			continue
		}
		if why := specialAddrProblem(addr); why != "" {
			problem(EndpointSliceProblemInvalidEndpoint, "endpoint %q is %s; kproxy skips it", e.Addresses[0], why)
			continue
		}
		ready := e.Conditions.Ready == nil || *e.Conditions.Ready
		ep := &Endpoint{
			IP:          addr,
			Port:        firstPort,
			Ready:       ready,
			Serving:     true, // nil serving means serving, as upstream reads it
			Terminating: e.Conditions.Terminating != nil && *e.Conditions.Terminating,
		}
		if e.Conditions.Serving != nil {
			ep.Serving = *e.Conditions.Serving
		}
		if e.NodeName != nil {
			ep.NodeName = *e.NodeName
			ep.IsLocal = c.nodeName != "" && ep.NodeName == c.nodeName
		}
		if e.Zone != nil {
			ep.Zone = *e.Zone
		}
		if e.Hints != nil {
			if len(e.Hints.ForZones) > 0 {
				ep.ZoneHints = sets.New[string]()
				for _, z := range e.Hints.ForZones {
					ep.ZoneHints.Insert(z.Name)
				}
			}
			if len(e.Hints.ForNodes) > 0 {
				ep.NodeHints = sets.New[string]()
				for _, n := range e.Hints.ForNodes {
					ep.NodeHints.Insert(n.Name)
				}
			}
		}
		info.endpoints = append(info.endpoints, ep)
	}
	return info
}

func (s *sliceInfo) equal(o *sliceInfo) bool {
	if s == nil || o == nil {
		return s == o
	}
	return s.remove == o.remove &&
		slices.Equal(s.ports, o.ports) &&
		slices.EqualFunc(s.endpoints, o.endpoints, func(a, b *Endpoint) bool { return a.equal(b) })
}

// equal compares every field of two endpoints.
func (e *Endpoint) equal(o *Endpoint) bool {
	if e == nil || o == nil {
		return e == o
	}
	return e.IP == o.IP &&
		e.Port == o.Port &&
		e.Ready == o.Ready &&
		e.Serving == o.Serving &&
		e.Terminating == o.Terminating &&
		e.NodeName == o.NodeName &&
		e.Zone == o.Zone &&
		e.IsLocal == o.IsLocal &&
		hintsEqual(e.ZoneHints, o.ZoneHints) &&
		hintsEqual(e.NodeHints, o.NodeHints)
}

func hintsEqual(a, b sets.Set[string]) bool {
	if (a == nil) != (b == nil) {
		return false
	}
	return a.Equal(b)
}

// equal reports whether two endpoint maps are the same; nil equals empty.
func (m EndpointsMap) equal(o EndpointsMap) bool {
	if len(m) != len(o) {
		return false
	}
	for name, eps := range m {
		oeps, ok := o[name]
		if !ok || !slices.EqualFunc(eps, oeps, func(a, b *Endpoint) bool { return a.equal(b) }) {
			return false
		}
	}
	return true
}
