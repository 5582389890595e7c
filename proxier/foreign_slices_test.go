package proxier_test

import (
	"maps"
	"slices"
	"testing"

	pt "github.com/kproxy/kproxy/proxier/proxiertest"
)

// TestEngineSliceWithoutService checks that an EndpointSlice whose Service
// the engine does not have (a Service of another proxy: kproxy, like
// kube-proxy, watches every non-headless slice but only its own Services)
// programs nothing, and that its endpoints apply once the Service arrives.
func TestEngineSliceWithoutService(t *testing.T) {
	web := pt.Service("web", "10.96.0.10")
	other := pt.Service("other", "10.96.0.20")
	webSlice := pt.Slice("web", 8080, pt.EP{IP: "10.244.1.1", Node: thisNode})
	otherSlice := pt.Slice("other", 8080, pt.EP{IP: "10.244.1.2", Node: thisNode})
	otherSliceMoved := pt.Slice("other", 8080, pt.EP{IP: "10.244.1.3", Node: thisNode})

	h := newSyncedHarness(t, nil)
	h.engine.OnServiceAdd(web)
	h.engine.OnEndpointSliceAdd(webSlice)
	h.engine.OnEndpointSliceAdd(otherSlice)
	h.sync()
	wantPorts := func(want ...string) {
		t.Helper()
		got := slices.Sorted(maps.Keys(h.backend.programmed()))
		if !slices.Equal(got, want) {
			t.Errorf("programmed service ports %v, want %v", got, want)
		}
	}
	wantPorts("ns/web:p")

	// Changes of the slice alone still program nothing.
	h.engine.OnEndpointSliceUpdate(otherSlice, otherSliceMoved)
	h.sync()
	wantPorts("ns/web:p")
	h.engine.OnEndpointSliceDelete(otherSliceMoved)
	h.sync()
	wantPorts("ns/web:p")

	// The Service arriving (say, relabelled for this proxy) picks up the
	// endpoints the engine already holds.
	h.engine.OnEndpointSliceAdd(otherSliceMoved)
	h.sync()
	h.engine.OnServiceAdd(other)
	h.sync()
	wantPorts("ns/other:p", "ns/web:p")
	if got := h.backend.programmed()["ns/other:p"].Cluster; !slices.Equal(got, []string{"10.244.1.3:8080"}) {
		t.Errorf("ns/other:p cluster endpoints %v, want [10.244.1.3:8080]", got)
	}

	// And it leaving takes its rules away again; the slice stays inert.
	h.engine.OnServiceDelete(other)
	h.sync()
	wantPorts("ns/web:p")
}
