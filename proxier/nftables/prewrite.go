package nftables

import (
	"context"
	"fmt"
	"time"

	"sigs.k8s.io/knftables"
)

// preWriter writes endpoint slots ahead of a full sync's main transaction,
// in transactions of at most its chunk of elements, while the sync goes on:
// nft runs one chunk (in a goroutine of the preWriter's, one transaction at
// a time) while the sync renders and builds the next, so a full sync's own
// CPU hides behind nft's instead of adding to it. Nothing leads to the
// slots it writes until the main transaction adds their dispatch elements,
// so traffic still sees the sync as one change.
//
// Two sources feed it: a fresh table's destinations as the services render
// (offer), and a full sync's destinations the table does not dispatch to
// yet (add). At most two chunks exist at once: the one nft runs and the one
// being built.
type preWriter struct {
	b   *Backend
	ctx context.Context
	// chunk is the most elements a transaction adds.
	chunk int
	// header are the objects each transaction adds first (the table and
	// the endpoints maps when they may not exist yet; adding them again
	// changes nothing).
	header []knftables.Object
	// pending are the destinations whose slots the next transaction
	// adds, n their number of slots.
	pending []*destRender
	n       int
	strs    stringCache
	// emitted are the destinations offer wrote, with the hash and counts
	// of the slots written: the main transaction treats them as the
	// table's (and rewrites one whose owner turned out to be another).
	emitted map[destKey]destInfo
	// elements counts the elements added.
	elements int

	// work carries built transactions to the goroutine that runs them;
	// done closes when it has stopped (work closed, or a failure: err).
	work chan *knftables.Transaction
	done chan struct{}
	// Written by the goroutine, read after done.
	err             error
	operations, ran int
	kernelTime      time.Duration
}

func newPreWriter(ctx context.Context, b *Backend, header []knftables.Object) *preWriter {
	return &preWriter{b: b, ctx: ctx, chunk: b.endpointChunk(), header: header, emitted: map[destKey]destInfo{}}
}

// offer writes dr's slots unless a destination of the same key was
// written already (two services claiming one address and port: the main
// transaction settles which one owns it).
func (w *preWriter) offer(dr *destRender) error {
	if _, ok := w.emitted[dr.key]; ok {
		return nil
	}
	w.emitted[dr.key] = destInfo{hash: dr.hash, counts: dr.counts()}
	return w.add(dr)
}

// add writes dr's slots. They wait until a chunk's worth has come.
func (w *preWriter) add(dr *destRender) error {
	n := len(dr.eps[0]) + len(dr.eps[1])
	if n == 0 {
		return nil
	}
	w.pending = append(w.pending, dr)
	w.n += n
	if w.n >= w.chunk {
		return w.flush()
	}
	return nil
}

// unstarted gives back what offer and add were given when not one chunk
// came of it (nothing was written): a small table's slots go in its main
// transaction, which needs no other.
func (w *preWriter) unstarted() bool {
	if w.work != nil {
		return false
	}
	w.pending, w.n = nil, 0
	clear(w.emitted)
	return true
}

// flush hands a transaction of the pending slots to the goroutine that
// runs them, starting it the first time; it waits while that goroutine
// still runs the previous one.
func (w *preWriter) flush() error {
	if len(w.pending) == 0 {
		return nil
	}
	tx := w.b.nft.NewTransaction()
	for _, o := range w.header {
		tx.Add(o)
	}
	for _, dr := range w.pending {
		objs := dr.endpointObjects(&w.strs)
		for i := range objs {
			tx.Add(&objs[i])
		}
	}
	w.elements += w.n
	w.pending, w.n = nil, 0
	if w.work == nil {
		w.work = make(chan *knftables.Transaction)
		w.done = make(chan struct{})
		go w.run()
	}
	select {
	case w.work <- tx:
		return nil
	case <-w.done:
		return w.err
	}
}

func (w *preWriter) run() {
	defer close(w.done)
	for tx := range w.work {
		w.operations += tx.NumOperations()
		start := w.b.clock.Now()
		err := w.b.nft.Run(w.ctx, tx)
		w.kernelTime += w.b.clock.Since(start)
		w.ran++
		if err != nil {
			w.err = fmt.Errorf("endpoint slots: %w", err)
			return
		}
	}
}

// wait writes what is left and waits for every transaction to have run;
// it returns the first failure. It adds what was written to st.
func (w *preWriter) wait(st *SyncStats) error {
	err := w.flush()
	if w.work != nil {
		close(w.work)
		<-w.done
		w.work = nil
	}
	st.ElementsAdded += w.elements
	st.Operations += w.operations
	st.KernelTime += w.kernelTime
	st.Transactions += w.ran
	w.elements, w.operations, w.kernelTime, w.ran = 0, 0, 0, 0
	if err != nil {
		return err
	}
	return w.err
}

// stop ends the goroutine without writing what is left (a sync that
// failed before its main transaction); idempotent.
func (w *preWriter) stop() {
	w.pending, w.n = nil, 0
	if w.work != nil {
		close(w.work)
		<-w.done
		w.work = nil
	}
}
