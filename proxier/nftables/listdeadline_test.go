package nftables

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/deadline"
	"github.com/kproxy/kproxy/pkg/netnstest"
)

// hungLister is a knftables.Fake whose listings block, ignoring their
// context as knftables' netlink listings do, until release is closed.
type hungLister struct {
	*knftables.Fake
	release chan struct{}
}

func (h hungLister) List(ctx context.Context, objectType string) ([]string, error) {
	<-h.release
	return h.Fake.List(ctx, objectType)
}

func (h hungLister) ListElements(ctx context.Context, objectType, name string) ([]*knftables.Element, error) {
	<-h.release
	return h.Fake.ListElements(ctx, objectType, name)
}

func TestListingsHaveADeadline(t *testing.T) {
	const timeout = 100 * time.Millisecond
	ctx := context.Background()
	fake := knftables.NewFake(knftables.IPv4Family, TableName)
	hung := hungLister{Fake: fake, release: make(chan struct{})}
	n := &execNFT{Interface: hung, timeout: timeout}

	for _, tc := range []struct {
		name string
		list func() error
	}{
		{"a hung List times out", func() error { _, err := n.List(ctx, "chain"); return err }},
		{"a listing while one is abandoned fails at once", func() error { _, err := n.ListElements(ctx, "map", "m"); return err }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			began := time.Now()
			err := tc.list()
			if !deadline.IsTimeout(err) {
				t.Fatalf("error %v, want a deadline error", err)
			}
			if took := time.Since(began); took > timeout+2*time.Second {
				t.Errorf("returned after %s, want about %s", took, timeout)
			}
		})
	}
	close(hung.release)
	// Once the abandoned call returned, listings work again, and a missing
	// table is still reported as knftables reports it.
	var err error
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if _, err = n.List(ctx, "chain"); !deadline.IsTimeout(err) {
			break
		}
	}
	if !knftables.IsNotFound(err) {
		t.Errorf("List of a missing table after the hang: %v, want knftables' not-found error", err)
	}
	if _, err := n.ListAll(ctx); !knftables.IsNotFound(err) {
		t.Errorf("ListAll of a missing table: %v, want knftables' not-found error", err)
	}
}

// TestRealListingsUnderDeadline runs the listings through the deadline's
// goroutine against the real kernel: the test binary runs itself again with
// the whole process in a throwaway namespace (as the agent's threads are
// all in the node's), creates kproxy's table there with nft and lists it.
func TestRealListingsUnderDeadline(t *testing.T) {
	if os.Getenv(listingChildEnv) == "1" {
		listingChild(t)
		return
	}
	netnstest.RequireRoot(t)
	ns := netnstest.New(t, "nftls")
	cmd := exec.CommandContext(t.Context(), "ip", "netns", "exec", ns.Name, os.Args[0], "-test.run=^TestRealListingsUnderDeadline$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), listingChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "listed under the deadline") {
		t.Fatalf("the listing child in %s: %v\n%s", ns.Name, err, out)
	}
}

const listingChildEnv = "KPROXY_NFT_LISTING_CHILD"

func listingChild(t *testing.T) {
	ctx := t.Context()
	iface, err := NewInterface(v1.IPv4Protocol)
	if err != nil {
		t.Skipf("no nft: %v", err)
	}
	n := iface.(*execNFT)
	if _, err := n.ListAll(ctx); err == nil {
		t.Fatal("ListAll before the table exists succeeded")
	}
	tx := n.NewTransaction()
	tx.Add(&knftables.Table{})
	tx.Add(&knftables.Chain{Name: "c1"})
	tx.Add(&knftables.Set{Name: "s1", Type: "ipv4_addr"})
	tx.Add(&knftables.Element{Set: "s1", Key: []string{"10.0.0.1"}})
	tx.Add(&knftables.Element{Set: "s1", Key: []string{"10.0.0.2"}})
	if err := n.Run(ctx, tx); err != nil {
		t.Fatalf("creating the table: %v", err)
	}
	chains, err := n.List(ctx, "chain")
	if err != nil || !slices.Equal(chains, []string{"c1"}) {
		t.Fatalf("List(chain) = %q, %v; want [c1]", chains, err)
	}
	elems, err := n.ListElements(ctx, "set", "s1")
	if err != nil || len(elems) != 2 {
		t.Fatalf("ListElements(set s1) = %d elements, %v; want 2", len(elems), err)
	}
	all, err := n.ListAll(ctx)
	if err != nil || !slices.Equal(all["set"], []string{"s1"}) {
		t.Fatalf("ListAll = %v, %v", all, err)
	}
	t.Log("listed under the deadline")
}
