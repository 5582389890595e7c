package nftables

import (
	"bufio"
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
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
	// headerText is header as nft's input; strs are the goroutine's, for
	// the chunks it builds as knftables objects.
	headerText string
	strs       stringCache
	// emitted are the destinations offer took, with the hash and counts
	// of their slots: the main transaction treats them as the table's
	// (and rewrites one whose owner turned out to be another) until wait
	// says which were written.
	emitted map[destKey]destInfo
	// started: a chunk was handed to the goroutine.
	started bool

	// work carries built chunks to the goroutine that runs them; done
	// closes when it has stopped (work closed, or a failure: err).
	work chan []*destRender
	done chan struct{}
	// Written by the goroutine, read after done.
	err                       error
	operations, ran, elements int
	kernelTime                time.Duration

	// mu guards written and refused, which the goroutine fills while
	// add reads refused.
	mu sync.Mutex
	// written are the destinations whose slots a transaction wrote, with
	// their hash and counts: the table's now.
	written map[destKey]destInfo
	// refused are the service ports whose slots nft refused, and why: no
	// chunk writes their destinations after that (set-aside service
	// ports, docs/design.md "Set-aside service ports in nftables mode").
	refused map[proxy.ServicePortName]error
}

// textTx is a transaction of endpoint slots that kproxy writes as nft's
// input itself (write), and the same as knftables objects (build), built
// only when needed: by an interface that cannot take text, or to find what
// nft refused.
type textTx struct {
	write func(w *bufio.Writer) error
	build func() *knftables.Transaction
}

// textRunner is a knftables.Interface that runs a textTx from its text
// (execNFT).
type textRunner interface {
	runText(ctx context.Context, t *textTx) error
}

func newPreWriter(ctx context.Context, b *Backend, header []knftables.Object) *preWriter {
	tx := b.nft.NewTransaction()
	for _, o := range header {
		tx.Add(o)
	}
	return &preWriter{b: b, ctx: ctx, chunk: b.endpointChunk(), header: header, headerText: tx.String(),
		emitted: map[destKey]destInfo{}, written: map[destKey]destInfo{}, refused: map[proxy.ServicePortName]error{}}
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

// add writes dr's slots, unless nft refused its service port's already.
// They wait until a chunk's worth has come.
func (w *preWriter) add(dr *destRender) error {
	n := len(dr.eps[0]) + len(dr.eps[1])
	if n == 0 || w.isRefused(dr.owner) {
		return nil
	}
	w.pending = append(w.pending, dr)
	w.n += n
	if w.n >= w.chunk {
		return w.flush()
	}
	return nil
}

func (w *preWriter) isRefused(name proxy.ServicePortName) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	_, ok := w.refused[name]
	return ok
}

// unstarted gives back what offer and add were given when not one chunk
// came of it (nothing was written): a small table's slots go in its main
// transaction, which needs no other.
func (w *preWriter) unstarted() bool {
	if w.started {
		return false
	}
	w.pending, w.n = nil, 0
	clear(w.emitted)
	return true
}

// build is the transaction of the slots of drs as knftables objects.
func (w *preWriter) build(drs []*destRender) *knftables.Transaction {
	tx := w.b.nft.NewTransaction()
	for _, o := range w.header {
		tx.Add(o)
	}
	for _, dr := range drs {
		objs := dr.endpointObjects(&w.strs)
		for i := range objs {
			tx.Add(&objs[i])
		}
	}
	return tx
}

// writeText writes the transaction of the slots of drs as nft's input:
// what execNFT sends for build(drs) (the same commands, each run of
// elements of one map merged into one command), without building a
// knftables object or a string per element.
func (w *preWriter) writeText(bw *bufio.Writer, drs []*destRender) error {
	if _, err := bw.WriteString(w.headerText); err != nil {
		return err
	}
	family, table := w.b.fam.ip, TableName
	open := "" // the map of the open command, "" when none is open
	var buf []byte
	for _, dr := range drs {
		if len(dr.eps[0])+len(dr.eps[1]) == 0 {
			continue
		}
		set := dr.key.endpointsMap()
		if set != open {
			if open != "" {
				buf = append(buf, " }\n"...)
			}
			buf = append(buf, "add element "...)
			buf = append(buf, family...)
			buf = append(buf, ' ')
			buf = append(buf, table...)
			buf = append(buf, ' ')
			buf = append(buf, set...)
			buf = append(buf, " { "...)
			open = set
		} else {
			buf = append(buf, ", "...)
		}
		buf = dr.appendEndpointElements(buf)
		if _, err := bw.Write(buf); err != nil {
			return err
		}
		buf = buf[:0]
	}
	if open != "" {
		_, err := bw.WriteString(" }\n")
		return err
	}
	return nil
}

// flush hands the pending slots to the goroutine that writes them,
// starting it if it is not running; it waits while that goroutine still
// runs the previous chunk.
func (w *preWriter) flush() error {
	if len(w.pending) == 0 {
		return nil
	}
	c := w.pending
	w.pending, w.n = nil, 0
	if w.work == nil {
		w.work = make(chan []*destRender)
		w.done = make(chan struct{})
		w.err = nil
		w.started = true
		go w.run(w.work, w.done)
	}
	select {
	case w.work <- c:
		return nil
	case <-w.done:
		return w.err
	}
}

func (w *preWriter) run(work <-chan []*destRender, done chan<- struct{}) {
	defer close(done)
	for drs := range work {
		if err := w.runChunk(drs); err != nil {
			w.err = fmt.Errorf("endpoint slots: %w", err)
			return
		}
	}
}

// runChunk writes the slots of drs in one transaction: as text when the
// interface takes it (textRunner), else, and to find what nft refused, as
// knftables objects. When nft refuses some destinations' slots, their
// service ports are refused and the chunk runs again without them.
func (w *preWriter) runChunk(drs []*destRender) error {
	if tr, ok := w.b.nft.(textRunner); ok {
		err := w.timed(func() error {
			return tr.runText(w.ctx, &textTx{
				write: func(bw *bufio.Writer) error { return w.writeText(bw, drs) },
				build: func() *knftables.Transaction { return w.build(drs) },
			})
		}, drs)
		if err == nil || notARefusal(w.ctx, err) {
			return err
		}
		// Refused: the same as a transaction, whose error names its
		// lines.
	}
	tx := w.build(drs)
	for {
		err := w.timed(func() error { return w.b.nft.Run(w.ctx, tx) }, drs)
		if err == nil {
			return nil
		}
		bad, ferr := w.refusedIn(drs, tx, err)
		if ferr != nil {
			return ferr
		}
		w.mu.Lock()
		for name, e := range bad {
			w.refused[name] = e
		}
		w.mu.Unlock()
		drs = slices.DeleteFunc(slices.Clone(drs), func(dr *destRender) bool { _, out := bad[dr.owner]; return out })
		if len(drs) == 0 {
			return nil
		}
		tx = w.build(drs)
	}
}

// timed runs one transaction of the slots of drs (run), counting it; when
// it succeeds the slots are the table's.
func (w *preWriter) timed(run func() error, drs []*destRender) error {
	elements := 0
	for _, dr := range drs {
		elements += len(dr.eps[0]) + len(dr.eps[1])
	}
	w.operations += len(w.header) + elements
	start := w.b.clock.Now()
	err := run()
	w.kernelTime += w.b.clock.Since(start)
	w.ran++
	if err != nil {
		return err
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, dr := range drs {
		w.written[dr.key] = destInfo{hash: dr.hash, counts: dr.counts()}
	}
	w.elements += elements
	return nil
}

// refusedIn finds the service ports whose slots in drs nft refused (err):
// from the lines err names, else by bisection. The header's refusal is
// the error.
func (w *preWriter) refusedIn(drs []*destRender, tx *knftables.Transaction, err error) (map[proxy.ServicePortName]error, error) {
	if notARefusal(w.ctx, err) {
		return nil, err
	}
	locate := func(i int) opRef {
		if i < len(w.header) {
			return opRef{kind: refShared}
		}
		i -= len(w.header)
		for _, dr := range drs {
			if n := len(dr.eps[0]) + len(dr.eps[1]); i < n {
				return opRef{kind: refDest, dest: dr.key}
			} else {
				i -= n
			}
		}
		return opRef{kind: refShared}
	}
	ti := newTouchIndex()
	var units []proxy.ServicePortName
	for _, dr := range drs {
		ti.dests[dr.key] = addName(ti.dests[dr.key], dr.owner)
		units = addName(units, dr.owner)
	}
	all := func(proxy.ServicePortName) bool { return true }
	refused, shared, ok := hintedRefusals(err, tx.NumOperations(), locate, ti, all)
	if shared {
		return nil, err
	}
	if ok {
		return refused, nil
	}
	slices.SortFunc(units, proxy.ServicePortName.Compare)
	return bisectRefused(w.ctx, w.b.nft, units, err, func(accepted []proxy.ServicePortName) *knftables.Transaction {
		return w.build(slices.DeleteFunc(slices.Clone(drs), func(dr *destRender) bool { return !slices.Contains(accepted, dr.owner) }))
	})
}

// wait writes what is left and waits for every transaction to have run;
// it returns the first failure that is not a refusal of some service
// ports' slots (those are in refused). It adds what was written to st.
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
