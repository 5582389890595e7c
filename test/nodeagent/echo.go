package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// echoWriteTimeout bounds writing one reply.
const echoWriteTimeout = 5 * time.Second

// portSpec is one socket a pod serves.
type portSpec struct {
	Name     string
	Protocol v1.Protocol
	Port     int32
}

// http reports whether the port serves HTTP (a TCP port named http*).
func (p portSpec) http() bool {
	return p.Protocol == v1.ProtocolTCP && strings.HasPrefix(p.Name, "http")
}

// podPorts returns the ports to serve for pod: every containerPort of every
// container, TCP when the protocol is empty, once per protocol and port.
// SCTP ports are skipped.
func podPorts(pod *v1.Pod) []portSpec {
	type key struct {
		proto v1.Protocol
		port  int32
	}
	seen := map[key]bool{}
	var ports []portSpec
	for _, c := range pod.Spec.Containers {
		for _, cp := range c.Ports {
			proto := cp.Protocol
			if proto == "" {
				proto = v1.ProtocolTCP
			}
			k := key{proto, cp.ContainerPort}
			if proto == v1.ProtocolSCTP || seen[k] {
				continue
			}
			seen[k] = true
			ports = append(ports, portSpec{Name: cp.Name, Protocol: proto, Port: cp.ContainerPort})
		}
	}
	return ports
}

// echoReply is the answer to every connection, request and datagram.
func echoReply(podName string, client net.Addr) string {
	return podName + " " + client.String() + "\n"
}

// echoServers are the servers of one pod.
type echoServers struct {
	closers []func()
	wg      sync.WaitGroup
	once    sync.Once
}

// startEchoServers opens a socket for every port inside netnsName through
// nw and serves it until Stop. On error the servers already started are
// stopped.
func startEchoServers(ctx context.Context, nw podNetwork, netnsName, podName string, ports []portSpec) (*echoServers, error) {
	logger := klog.FromContext(ctx)
	s := &echoServers{}
	for _, p := range ports {
		addr := net.JoinHostPort("", strconv.Itoa(int(p.Port)))
		switch p.Protocol {
		case v1.ProtocolTCP:
			l, err := nw.Listen(ctx, netnsName, "tcp", addr)
			if err != nil {
				s.Stop()
				return nil, fmt.Errorf("listening on TCP port %d in %s: %w", p.Port, netnsName, err)
			}
			if p.http() {
				srv := &http.Server{
					Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
						w.Header().Set("Content-Type", "text/plain; charset=utf-8")
						_, _ = fmt.Fprint(w, podName+" "+r.RemoteAddr+"\n")
					}),
					ReadHeaderTimeout: echoWriteTimeout,
				}
				s.wg.Go(func() { _ = srv.Serve(l) })
				s.closers = append(s.closers, func() { _ = srv.Close() })
			} else {
				s.wg.Go(func() { serveLines(l, podName, &s.wg) })
				s.closers = append(s.closers, func() { _ = l.Close() })
			}
		case v1.ProtocolUDP:
			pc, err := nw.ListenPacket(ctx, netnsName, "udp", addr)
			if err != nil {
				s.Stop()
				return nil, fmt.Errorf("listening on UDP port %d in %s: %w", p.Port, netnsName, err)
			}
			s.wg.Go(func() { serveDatagrams(pc, podName) })
			s.closers = append(s.closers, func() { _ = pc.Close() })
		default:
			continue
		}
		logger.V(4).Info("Serving", "netns", netnsName, "protocol", p.Protocol, "port", p.Port, "http", p.http())
	}
	return s, nil
}

// Stop closes every socket and waits for the servers to end. Safe to call
// more than once.
func (s *echoServers) Stop() {
	s.once.Do(func() {
		for _, c := range slices.Backward(s.closers) {
			c()
		}
		s.wg.Wait()
	})
}

// serveLines writes one reply line to every accepted connection, then
// closes it, until l is closed.
func serveLines(l net.Listener, podName string, wg *sync.WaitGroup) {
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		wg.Go(func() {
			defer c.Close()
			_ = c.SetWriteDeadline(time.Now().Add(echoWriteTimeout))
			_, _ = c.Write([]byte(echoReply(podName, c.RemoteAddr())))
		})
	}
}

// serveDatagrams answers every datagram until pc is closed.
func serveDatagrams(pc net.PacketConn, podName string) {
	buf := make([]byte, 64<<10)
	for {
		_, from, err := pc.ReadFrom(buf)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue // e.g. an ICMP error reported on the socket
		}
		_, _ = pc.WriteTo([]byte(echoReply(podName, from)), from)
	}
}
