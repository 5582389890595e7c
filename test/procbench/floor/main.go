// Command floor is the least a client-go agent can do for a one-endpoint
// change in nftables mode: it watches the EndpointSlices of one namespace
// (client-go's typed watch: HTTP/2, TLS, protobuf, the watch decoder) and,
// for every change, writes one transaction of the shape kproxy writes for a
// one-endpoint change (an endpoint slot and a comment element, each deleted
// and added again) to one long-lived `nft -i`, and waits for nft's answer.
// No informer, cache, model, metrics or logging. procbench (RunFloor) runs
// it beside kproxy and counts its CPU per change the same way, so that
// kproxy's figure has a floor measured on the same machine.
//
//	floor --kubeconfig FILE --namespace NS
//
// It prints "ready" once its table is written and the watch is open, and
// runs until killed.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"

	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// table is the floor's own nftables table (never kproxy's).
const table = "kproxy-floor"

// setup makes the table: a data map of endpoint slots and a plain set of
// comment elements, as kproxy's endpoints-tcp and endpoint-slots, with the
// elements every transaction replaces.
const setup = `add table ip ` + table + `
add map ip ` + table + ` slots { type ipv4_addr . inet_service . inet_service : ipv4_addr . inet_service ; }
add set ip ` + table + ` state { type ipv4_addr . inet_proto . inet_service ; }
add element ip ` + table + ` slots { 10.0.0.1 . 80 . 0 : 10.0.0.2 . 8080 }
add element ip ` + table + ` state { 10.0.0.1 . tcp . 80 comment "0" }
`

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	namespace := flag.String("namespace", "default", "namespace whose EndpointSlices are watched")
	flag.Parse()
	if err := run(context.Background(), *kubeconfig, *namespace); err != nil {
		fmt.Fprintln(os.Stderr, "floor:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, kubeconfig, namespace string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	// As kproxy talks to the API server: protobuf, no gzip.
	cfg.ContentType = "application/vnd.kubernetes.protobuf"
	cfg.AcceptContentTypes = "application/vnd.kubernetes.protobuf,application/json"
	cfg.DisableCompression = true
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	// Any earlier table of this name goes first (nft 1.0.6 has no
	// "destroy": add, then delete).
	drop := "add table ip " + table + "\ndelete table ip " + table + "\n"
	mk := exec.Command("nft", "-f", "-")
	mk.Stdin = strings.NewReader(drop + setup)
	if out, err := mk.CombinedOutput(); err != nil {
		return fmt.Errorf("writing the table: %v: %s", err, out)
	}
	defer func() {
		rm := exec.Command("nft", "-f", "-")
		rm.Stdin = strings.NewReader(drop)
		_ = rm.Run()
	}()

	s, err := startSession()
	if err != nil {
		return err
	}
	defer s.close()

	// Watch from now on: a list of one slice gives the resource version.
	slices := client.DiscoveryV1().EndpointSlices(namespace)
	list, err := slices.List(ctx, metav1.ListOptions{Limit: 1})
	if err != nil {
		return fmt.Errorf("listing EndpointSlices: %w", err)
	}
	w, err := slices.Watch(ctx, metav1.ListOptions{ResourceVersion: list.ResourceVersion})
	if err != nil {
		return fmt.Errorf("watching EndpointSlices: %w", err)
	}
	defer w.Stop()
	fmt.Println("ready")

	for ev := range w.ResultChan() {
		if ev.Type == watch.Error {
			return fmt.Errorf("watch error: %v", ev.Object)
		}
		slice, ok := ev.Object.(*discovery.EndpointSlice)
		if !ok || ev.Type != watch.Modified || len(slice.Endpoints) == 0 || len(slice.Endpoints[0].Addresses) == 0 {
			continue
		}
		ip := slice.Endpoints[0].Addresses[0]
		tx := "delete element ip " + table + " slots { 10.0.0.1 . 80 . 0 } ; " +
			"add element ip " + table + " slots { 10.0.0.1 . 80 . 0 : " + ip + " . 8080 } ; " +
			"delete element ip " + table + " state { 10.0.0.1 . tcp . 80 } ; " +
			"add element ip " + table + " state { 10.0.0.1 . tcp . 80 comment " + strconv.Quote(slice.ResourceVersion) + " }"
		if err := s.run(tx); err != nil {
			return err
		}
	}
	return errors.New("the watch ended")
}

// session is one `nft -i`: a transaction is one line, followed by a
// sentinel line nft refuses, whose error on stderr marks the end of the
// transaction's answer (as kproxy's session does).
type session struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *bufio.Reader
	n      int
}

func startSession() (*session, error) {
	cmd := exec.Command("nft", "-i")
	cmd.Env = append(os.Environ(), "HOME=/nonexistent")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &session{cmd: cmd, stdin: stdin, stderr: bufio.NewReader(stderr)}, nil
}

// run writes tx and reads nft's answer up to the sentinel; an error line
// before it is the transaction's.
func (s *session) run(tx string) error {
	s.n++
	sentinel := "floorsentinel" + strconv.Itoa(s.n)
	if _, err := io.WriteString(s.stdin, tx+"\n"+sentinel+"\n"); err != nil {
		return err
	}
	var refused []string
	for {
		line, err := s.stderr.ReadString('\n')
		if err != nil {
			return fmt.Errorf("reading nft: %w", err)
		}
		if strings.TrimSuffix(line, "\n") == sentinel {
			// The sentinel's own report: its error before it, a line
			// of carets after it.
			_, _ = s.stderr.ReadString('\n')
			refused = refused[:max(len(refused)-1, 0)]
			if len(refused) > 0 {
				return fmt.Errorf("nft refused the transaction: %s", strings.Join(refused, " "))
			}
			return nil
		}
		if strings.HasPrefix(line, "Error:") {
			refused = append(refused, strings.TrimSpace(line))
		}
	}
}

func (s *session) close() {
	_ = s.stdin.Close()
	_ = s.cmd.Wait()
}
