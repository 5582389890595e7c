// Package proxier holds the Proxier interface and the engine shared by every
// backend: it folds informer events into the model, decides per node what
// each service must do, and hands the result to a Backend from a
// bounded-frequency sync loop.
package proxier

import (
	"context"

	"github.com/kproxy/kproxy/config"
	"github.com/kproxy/kproxy/pkg/proxy"
)

// Proxier receives every informer event and keeps the node's rules in step.
type Proxier interface {
	config.ServiceHandler
	config.EndpointSliceHandler
	config.NodeHandler
	config.OtherNodesHandler
	// Sync requests a sync as soon as the runner allows.
	Sync()
	// SyncLoop runs the sync loop until ctx is done.
	SyncLoop(ctx context.Context)
}

// Backend programs the kernel for one IP family.
type Backend interface {
	// Sync makes the kernel match state. With full false only the services
	// in state.Changed need rewriting; full true rewrites everything and
	// removes what kproxy owns and no longer wants.
	Sync(ctx context.Context, state *proxy.NodeState, full bool) (proxy.BackendResult, error)
	// Cleanup removes everything this backend ever created, idempotently.
	Cleanup(ctx context.Context) error
}
