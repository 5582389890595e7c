package nftables

import (
	"bufio"
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	"sigs.k8s.io/knftables"

	"github.com/kproxy/kproxy/pkg/proxy"
)

// preWriter writes endpoint slots ahead of a full sync's main
// transaction, in transactions of at most its chunk of elements: the
// destinations the table does not dispatch to yet (add). Nothing leads to
// the slots it writes until the main transaction adds their dispatch
// elements, so traffic still sees the sync as one change, and no
// transaction holds them all. A chunk is written as nft's text
// (writeText), without a knftables object per element.
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
	// headerText is header as nft's input; strs are shared by the chunks
	// built as knftables objects.
	headerText string
	strs       stringCache
	// What was run, for the sync's stats.
	operations, ran, elements int
	kernelTime                time.Duration
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
		written: map[destKey]destInfo{}, refused: map[proxy.ServicePortName]error{}}
}

// add writes dr's slots, unless nft refused its service port's already.
// They wait until a chunk's worth has come.
func (w *preWriter) add(dr *destRender) error {
	n := len(dr.eps[0]) + len(dr.eps[1])
	if _, out := w.refused[dr.owner]; n == 0 || out {
		return nil
	}
	w.pending = append(w.pending, dr)
	w.n += n
	if w.n >= w.chunk {
		return w.flush()
	}
	return nil
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

// flush writes the pending slots.
func (w *preWriter) flush() error {
	if len(w.pending) == 0 {
		return nil
	}
	drs := w.pending
	w.pending, w.n = nil, 0
	if err := w.runChunk(drs); err != nil {
		return fmt.Errorf("endpoint slots: %w", err)
	}
	return nil
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
		maps.Copy(w.refused, bad)
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

// wait writes what is left; it returns the first failure that is not a
// refusal of some service ports' slots (those are in refused). It adds
// what was written to st.
func (w *preWriter) wait(st *SyncStats) error {
	err := w.flush()
	st.ElementsAdded += w.elements
	st.Operations += w.operations
	st.KernelTime += w.kernelTime
	st.Transactions += w.ran
	w.elements, w.operations, w.kernelTime, w.ran = 0, 0, 0, 0
	return err
}
