package kvmem

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// EngineWriter is the engine's side of a host memory it owns: it writes
// computed KV straight into blocks and evicts them, keeping every block's
// identity record by the protocol (package doc).
type EngineWriter struct {
	mem Memory
	gen atomic.Uint64
}

// NewEngineWriter writes into mem (host addressable). Generations start at
// the current time in nanoseconds.
func NewEngineWriter(mem Memory) *EngineWriter {
	w := &EngineWriter{mem: mem}
	w.gen.Store(uint64(time.Now().UnixNano()))
	return w
}

// CheckBlock reports whether (group, block) lies in layout l.
func CheckBlock(l Layout, group, block int) error {
	if group < 0 || group >= len(l.Groups) {
		return fmt.Errorf("group %d of %d: %w", group, len(l.Groups), ErrRange)
	}
	if n := l.Groups[group].Blocks; block < 0 || block >= n {
		return fmt.Errorf("group %d block %d of %d: %w", group, block, n, ErrRange)
	}
	return nil
}

// Write fills one block with the content id names: the record goes odd,
// fill gets the block's regions, and only when fill succeeds does the
// record hold id, with a new generation and the completion time. A failed
// fill leaves the block holding nothing and is returned.
func (w *EngineWriter) Write(group, block int, id dataplane.Identity, fill func(segs [][]byte) error) error {
	if err := id.Validate(); err != nil {
		return err
	}
	if err := CheckBlock(w.mem.Layout(), group, block); err != nil {
		return err
	}
	segs := w.mem.Regions(group, block)
	if segs == nil {
		return fmt.Errorf("the engine writer needs host memory, not %s: %w", w.mem.Kind(), ErrLayout)
	}
	rec := w.mem.Record(group, block)
	seq, err := rec.Begin(WriterEngine)
	if err != nil {
		return fmt.Errorf("group %d block %d: %w", group, block, err)
	}
	if err := fill(segs); err != nil {
		rec.Abort(seq)
		return err
	}
	return rec.Commit(seq, Held{Hash: id.Hash, RequestID: id.RequestID, Generation: w.gen.Add(1),
		Completed: time.Now().UnixNano(), Writer: WriterEngine})
}

// WriteBytes writes a contiguous block's bytes (its regions in order).
func (w *EngineWriter) WriteBytes(group, block int, id dataplane.Identity, data []byte) error {
	if err := CheckBlock(w.mem.Layout(), group, block); err != nil {
		return err
	}
	gl := w.mem.Layout().Groups[group]
	if int64(len(data)) != gl.BlockBytes() {
		return fmt.Errorf("group %d: %d bytes for a %d-byte block: %w", group, len(data), gl.BlockBytes(), ErrRange)
	}
	return w.Write(group, block, id, func(segs [][]byte) error {
		at := 0
		for _, s := range segs {
			at += copy(s, data[at:])
		}
		return nil
	})
}

// Evict clears one block's record (the engine dropped its content); it
// reports whether the block held something.
func (w *EngineWriter) Evict(group, block int) (bool, error) {
	if err := CheckBlock(w.mem.Layout(), group, block); err != nil {
		return false, err
	}
	rec := w.mem.Record(group, block)
	_, h, _ := rec.Load()
	seq, err := rec.Begin(WriterEngine)
	if err != nil {
		return false, fmt.Errorf("group %d block %d: %w", group, block, err)
	}
	rec.Abort(seq)
	return h.Hash != "", nil
}

// RecoverWorkerWrites clears the records a gpuworker left mid-write (it
// died during a load) so the blocks can be written again. The engine calls
// it before registering the memory with a new gpuworker, when no
// gpuworker writes into it; it returns how many records it cleared.
func (w *EngineWriter) RecoverWorkerWrites() int {
	n := 0
	for g, gl := range w.mem.Layout().Groups {
		for b := range gl.Blocks {
			rec := w.mem.Record(g, b)
			if meta := atomic.LoadUint64(&rec.w[wMeta]); rec.Seq()&1 == 1 && Writer(meta>>32) == WriterWorker {
				rec.forceClear()
				n++
			}
		}
	}
	return n
}
