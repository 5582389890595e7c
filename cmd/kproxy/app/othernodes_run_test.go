package app

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	metadatafake "k8s.io/client-go/metadata/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/kproxy/kproxy/pkg/conntrack"
	ipt "github.com/kproxy/kproxy/pkg/iptables"
	"github.com/kproxy/kproxy/pkg/proxy"
	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

const siteLabel = "example.com/site"

// otherNodesMetadata is a metadata fake holding node-b (site s1, as this
// node) and node-c (site s2), as the API server sends node metadata.
func otherNodesMetadata(t *testing.T) *metadatafake.FakeMetadataClient {
	t.Helper()
	scheme := metadatafake.NewTestScheme()
	if err := metav1.AddMetaToScheme(scheme); err != nil {
		t.Fatal(err)
	}
	var objs []runtime.Object
	for name, site := range map[string]string{runNode: "s1", "node-b": "s1", "node-c": "s2"} {
		objs = append(objs, &metav1.PartialObjectMetadata{
			TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Node"},
			ObjectMeta: metav1.ObjectMeta{
				Name: name, Labels: map[string]string{siteLabel: site},
				Annotations: map[string]string{"node.alpha.kubernetes.io/ttl": "0"},
			},
		})
	}
	return metadatafake.NewSimpleMetadataClient(scheme, objs...)
}

// nodeRequests lists the list and watch requests for nodes a fake
// received, as "verb fieldSelector".
func nodeRequests(actions []k8stesting.Action) []string {
	var out []string
	for _, a := range actions {
		if a.GetResource().Resource != "nodes" {
			continue
		}
		switch a := a.(type) {
		case k8stesting.ListAction:
			out = append(out, "list "+a.GetListRestrictions().Fields.String())
		case k8stesting.WatchAction:
			out = append(out, "watch "+a.GetWatchRestrictions().Fields.String())
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// natMentions reports whether any nat rule names ip.
func (h *runHarness) natMentions(ip string) bool {
	for _, c := range h.ipt.Chains(ipt.TableNAT) {
		for _, r := range h.ipt.Rules(ipt.TableNAT, ipt.Chain(c)) {
			if strings.Contains(r, ip) {
				return true
			}
		}
	}
	return false
}

// TestRunWatchesOtherNodesOnlyForTopologyKeys runs kproxy over fakes of
// the API server: without a topologyKeys Service it lists and watches its
// own Node only and never asks for the other nodes; with one it watches
// the other nodes' metadata and their labels reach the engine, and the
// service follows its annotation coming and going.
func TestRunWatchesOtherNodesOnlyForTopologyKeys(t *testing.T) {
	// node-b runs in this node's site, node-c in another.
	const inSite, otherSite = "10.244.2.5", "10.244.3.5"
	slice := pt.Slice("web", 8080, pt.EP{IP: inSite, Node: "node-b"}, pt.EP{IP: otherSite, Node: "node-c"})
	thisNode := pt.Node(runNode, map[string]string{siteLabel: "s1"})
	ownNodeOnly := []string{"list metadata.name=" + runNode, "watch metadata.name=" + runNode}
	otherNodes := []string{"list metadata.name!=" + runNode, "watch metadata.name!=" + runNode}
	for _, tc := range []struct {
		name string
		svc  *v1.Service
		// wantOtherSite is whether node-c's endpoint is programmed.
		wantOtherSite bool
		// wantMetadata are the node requests of the metadata client.
		wantMetadata []string
	}{
		{name: "no topologyKeys", svc: pt.Service("web", "10.96.0.10"), wantOtherSite: true},
		{
			name:          "topologyKeys any only",
			svc:           pt.Service("web", "10.96.0.10", pt.Annotation(proxy.AnnotationTopologyKeys, `["*"]`)),
			wantOtherSite: true,
		},
		{
			name:         "topologyKeys on a node label",
			svc:          pt.Service("web", "10.96.0.10", pt.Annotation(proxy.AnnotationTopologyKeys, fmt.Sprintf("[%q]", siteLabel))),
			wantMetadata: otherNodes,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			metadataClient := otherNodesMetadata(t)
			// The typed fake holds this node only, as the API server
			// answers its field selector (the fake ignores field
			// selectors): the other nodes' labels can only come through
			// the metadata client.
			h := startRunWith(t, conntrack.NewFake(), func(_ *Options, deps *runDeps) { deps.metadataClient = metadataClient },
				tc.svc, slice, thisNode)
			waitUntil(t, func() bool { return h.natMentions(inSite) }, "node-b's endpoint to be programmed")
			if got := h.natMentions(otherSite); got != tc.wantOtherSite {
				t.Errorf("node-c's endpoint programmed = %v, want %v", got, tc.wantOtherSite)
			}
			if got := nodeRequests(h.client.Actions()); !slices.Equal(got, ownNodeOnly) {
				t.Errorf("typed client node requests %q, want %q", got, ownNodeOnly)
			}
			if got := nodeRequests(metadataClient.Actions()); !slices.Equal(got, tc.wantMetadata) {
				t.Errorf("metadata client node requests %q, want %q", got, tc.wantMetadata)
			}
		})
	}

	t.Run("annotation comes and goes", func(t *testing.T) {
		metadataClient := otherNodesMetadata(t)
		plain := pt.Service("web", "10.96.0.10")
		h := startRunWith(t, conntrack.NewFake(), func(_ *Options, deps *runDeps) { deps.metadataClient = metadataClient },
			plain, slice, thisNode)
		waitUntil(t, func() bool { return h.natMentions(inSite) && h.natMentions(otherSite) }, "both endpoints")

		services := h.client.CoreV1().Services(plain.Namespace)
		topo := pt.Service("web", "10.96.0.10", pt.Annotation(proxy.AnnotationTopologyKeys, fmt.Sprintf("[%q]", siteLabel)))
		if _, err := services.Update(context.Background(), topo, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, func() bool { return h.natMentions(inSite) && !h.natMentions(otherSite) }, "node-c's endpoint to go")

		if _, err := services.Update(context.Background(), plain, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, func() bool { return h.natMentions(inSite) && h.natMentions(otherSite) }, "node-c's endpoint back")

		if _, err := services.Update(context.Background(), topo, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		// Whether the watch stopped and started again in between is up to
		// timing here; config's TestOtherNodesConfigStartStop checks it.
		waitUntil(t, func() bool { return h.natMentions(inSite) && !h.natMentions(otherSite) }, "node-c's endpoint to go again")
	})
}
