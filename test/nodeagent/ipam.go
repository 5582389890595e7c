package nodeagent

import (
	"errors"
	"fmt"
	"net/netip"
	"sync"

	"k8s.io/apimachinery/pkg/types"
)

// errRangeFull is returned by allocate when every address is taken.
var errRangeFull = errors.New("no free pod address")

// ipAllocator hands out pod addresses from a node's podCIDR: from the
// network address + 2 (the .1 stays unused, as a gateway would hold it) to
// the last address before broadcast. It allocates next-fit, so a released
// address is reused only after the rest of the range, which keeps stale
// conntrack entries and endpoint caches from meeting a new pod at once.
// The API server is the persistent record: a restarted agent reserves the
// podIP of every pod already on the node before allocating.
type ipAllocator struct {
	cidr        netip.Prefix
	first, last netip.Addr

	mu    sync.Mutex
	owner map[netip.Addr]types.UID
	byUID map[types.UID]netip.Addr
	// next is where the search for a free address starts.
	next netip.Addr
}

// newIPAllocator returns an allocator for the IPv4 range cidr, which must
// leave at least one address (/30 or larger).
func newIPAllocator(cidr netip.Prefix) (*ipAllocator, error) {
	cidr = cidr.Masked()
	if !cidr.Addr().Is4() || cidr.Bits() > 30 {
		return nil, fmt.Errorf("pod CIDR %s: need an IPv4 prefix of /30 or larger", cidr)
	}
	first := cidr.Addr().Next().Next()
	last := first
	for n := last.Next(); cidr.Contains(n.Next()); n = n.Next() {
		last = n
	}
	return &ipAllocator{
		cidr:  cidr,
		first: first,
		last:  last,
		owner: map[netip.Addr]types.UID{},
		byUID: map[types.UID]netip.Addr{},
		next:  first,
	}, nil
}

// inRange reports whether ip may be allocated.
func (a *ipAllocator) inRange(ip netip.Addr) bool {
	return a.cidr.Contains(ip) && ip.Compare(a.first) >= 0 && ip.Compare(a.last) <= 0
}

// allocate returns uid's address, taking a free one if uid holds none.
func (a *ipAllocator) allocate(uid types.UID) (netip.Addr, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if ip, ok := a.byUID[uid]; ok {
		return ip, nil
	}
	ip := a.next
	for {
		if _, taken := a.owner[ip]; !taken {
			a.take(uid, ip)
			return ip, nil
		}
		ip = a.after(ip)
		if ip == a.next {
			return netip.Addr{}, fmt.Errorf("%w in %s", errRangeFull, a.cidr)
		}
	}
}

// reserve records ip as uid's address (recovering a running pod). It fails
// when ip is outside the range or held by another pod, or when uid already
// holds a different address.
func (a *ipAllocator) reserve(uid types.UID, ip netip.Addr) error {
	if !a.inRange(ip) {
		return fmt.Errorf("address %s is outside the allocatable range %s-%s", ip, a.first, a.last)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if owner, taken := a.owner[ip]; taken {
		if owner == uid {
			return nil
		}
		return fmt.Errorf("address %s already belongs to pod %s", ip, owner)
	}
	if held, ok := a.byUID[uid]; ok {
		return fmt.Errorf("pod %s already holds address %s", uid, held)
	}
	a.owner[ip] = uid
	a.byUID[uid] = ip
	return nil
}

// release frees uid's address, if any.
func (a *ipAllocator) release(uid types.UID) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if ip, ok := a.byUID[uid]; ok {
		delete(a.byUID, uid)
		delete(a.owner, ip)
	}
}

// take records the allocation and moves the search start past ip.
func (a *ipAllocator) take(uid types.UID, ip netip.Addr) {
	a.owner[ip] = uid
	a.byUID[uid] = ip
	a.next = a.after(ip)
}

// after returns the address following ip in the range, wrapping around.
func (a *ipAllocator) after(ip netip.Addr) netip.Addr {
	if ip == a.last {
		return a.first
	}
	return ip.Next()
}
