package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"sync"
)

// fakeNetwork is a podNetwork that keeps pod networks as state and opens
// sockets on loopback (ephemeral ports) in the current namespace, so the
// echo servers can be reached without root.
type fakeNetwork struct {
	nodeNS string

	mu sync.Mutex
	// pods maps a pod namespace name to its network.
	pods map[string]podNetConfig
	// veths holds the host ends in the node namespace.
	veths map[string]bool
	// setups counts Setup calls per namespace name.
	setups map[string]int
	// failSetups makes the next Setup calls fail.
	failSetups int
	// sockets maps "<netns> <network> <port>" to the loopback address
	// really bound.
	sockets map[string]string
}

func newFakeNetwork(nodeNS string) *fakeNetwork {
	return &fakeNetwork{
		nodeNS:  nodeNS,
		pods:    map[string]podNetConfig{},
		veths:   map[string]bool{},
		setups:  map[string]int{},
		sockets: map[string]string{},
	}
}

var errInjected = errors.New("injected setup failure")

func (f *fakeNetwork) Setup(_ context.Context, cfg podNetConfig) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failSetups > 0 {
		f.failSetups--
		return errInjected
	}
	if !cfg.Addr.IsValid() || cfg.NetNS == "" || cfg.HostVeth == "" {
		return fmt.Errorf("incomplete pod network %+v", cfg)
	}
	f.setups[cfg.NetNS]++
	f.pods[cfg.NetNS] = cfg // an existing one is replaced, as the real one recreates
	f.veths[cfg.HostVeth] = true
	return nil
}

func (f *fakeNetwork) Teardown(_ context.Context, cfg podNetConfig) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.pods, cfg.NetNS)
	delete(f.veths, cfg.HostVeth)
	return nil
}

func (f *fakeNetwork) HostVeths(context.Context) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.veths)), nil
}

// checkNS fails like opening a missing namespace would.
func (f *fakeNetwork) checkNS(name string) error {
	if _, ok := f.pods[name]; !ok && name != f.nodeNS {
		return fmt.Errorf("opening network namespace %s: no such namespace", name)
	}
	return nil
}

func (f *fakeNetwork) Listen(ctx context.Context, netnsName, network, address string) (net.Listener, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.checkNS(netnsName); err != nil {
		return nil, err
	}
	l, err := (&net.ListenConfig{}).Listen(ctx, "tcp4", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	f.sockets[socketKey(netnsName, network, address)] = l.Addr().String()
	return l, nil
}

func (f *fakeNetwork) ListenPacket(ctx context.Context, netnsName, network, address string) (net.PacketConn, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.checkNS(netnsName); err != nil {
		return nil, err
	}
	pc, err := (&net.ListenConfig{}).ListenPacket(ctx, "udp4", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	f.sockets[socketKey(netnsName, network, address)] = pc.LocalAddr().String()
	return pc, nil
}

func socketKey(netnsName, network, address string) string {
	_, port, _ := net.SplitHostPort(address)
	return netnsName + " " + network + " " + port
}

// socket returns the loopback address standing for port in netnsName.
func (f *fakeNetwork) socket(netnsName, network string, port int) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	addr, ok := f.sockets[socketKey(netnsName, network, fmt.Sprintf(":%d", port))]
	return addr, ok
}

// pod returns the network of namespace name.
func (f *fakeNetwork) pod(name string) (podNetConfig, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	cfg, ok := f.pods[name]
	return cfg, ok
}

func (f *fakeNetwork) setupCount(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.setups[name]
}
