package kvmem

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// heapRecord is one record of a one-block heap memory.
func heapRecord(t *testing.T) (Record, *Heap) {
	t.Helper()
	h, err := NewHeap(Layout{Groups: []GroupLayout{{Blocks: 1, Regions: []int64{64}}}})
	if err != nil {
		t.Fatal(err)
	}
	return h.Record(0, 0), h
}

func TestRecordWriteLoad(t *testing.T) {
	rec, _ := heapRecord(t)
	if seq, h, ok := rec.Load(); !ok || seq != 0 || h.Hash != "" {
		t.Fatalf("a fresh record: seq %d, %+v, ok %v", seq, h, ok)
	}
	seq, err := rec.Begin(WriterEngine)
	if err != nil || seq != 1 {
		t.Fatalf("Begin = %d, %v", seq, err)
	}
	if _, err := rec.Begin(WriterWorker); !errors.Is(err, ErrBusy) {
		t.Fatalf("a second Begin: %v, want ErrBusy", err)
	}
	if _, _, ok := rec.Load(); ok {
		t.Fatal("Load during a write must refuse")
	}
	long := strings.Repeat("r", dataplane.MaxRequestIDLen)
	hash := strings.Repeat("ab", dataplane.MaxHashLen/2) + "c"
	if err := rec.Commit(seq, Held{Hash: hash, RequestID: long, Generation: 7, Completed: 42, Writer: WriterEngine}); err != nil {
		t.Fatal(err)
	}
	seq, h, ok := rec.Load()
	want := Held{Hash: hash, RequestID: long[:RecordRequestIDLen], Generation: 7, Completed: 42, Writer: WriterEngine}
	if !ok || seq != 2 || h != want {
		t.Fatalf("after Commit: seq %d, %+v, ok %v; want %+v", seq, h, ok, want)
	}
	if !rec.Unchanged(seq) {
		t.Fatal("Unchanged without a write")
	}
	s, _ := rec.Begin(WriterWorker)
	rec.Abort(s)
	if seq2, h, ok := rec.Load(); !ok || seq2 != 4 || h.Hash != "" || h.Writer != WriterWorker {
		t.Fatalf("after Abort: seq %d, %+v, ok %v", seq2, h, ok)
	}
	if rec.Unchanged(seq) {
		t.Fatal("Unchanged after an aborted write")
	}
}

// TestTornReadRefused is the torn read made deterministic: a reader loads
// the record, the writer rewrites the block (or only begins to) before the
// reader's second check, and the check refuses in every case.
func TestTornReadRefused(t *testing.T) {
	tests := []struct {
		name    string
		between func(r Record)
	}{
		{"rewritten", func(r Record) {
			s, _ := r.Begin(WriterEngine)
			_ = r.Commit(s, Held{Hash: "bb", Writer: WriterEngine})
		}},
		{"rewritten with the same hash", func(r Record) {
			s, _ := r.Begin(WriterEngine)
			_ = r.Commit(s, Held{Hash: "aa", Writer: WriterEngine})
		}},
		{"being written", func(r Record) { _, _ = r.Begin(WriterEngine) }},
		{"evicted", func(r Record) { s, _ := r.Begin(WriterEngine); r.Abort(s) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rec, _ := heapRecord(t)
			s, _ := rec.Begin(WriterEngine)
			if err := rec.Commit(s, Held{Hash: "aa"}); err != nil {
				t.Fatal(err)
			}
			seq, h, ok := rec.Load()
			if !ok || h.Hash != "aa" {
				t.Fatalf("Load = %+v, %v", h, ok)
			}
			tc.between(rec)
			if rec.Unchanged(seq) {
				t.Fatal("the second check accepted a block changed during the read")
			}
		})
	}
}

func TestCommitRejects(t *testing.T) {
	rec, _ := heapRecord(t)
	s, _ := rec.Begin(WriterEngine)
	if err := rec.Commit(s, Held{}); !errors.Is(err, dataplane.ErrIdentity) {
		t.Fatalf("Commit without a hash: %v", err)
	}
	if _, h, ok := rec.Load(); !ok || h.Hash != "" {
		t.Fatalf("a refused Commit left %+v (ok %v)", h, ok)
	}
	s, _ = rec.Begin(WriterWorker)
	rec.forceClear() // the owner reset a write it took for dead
	if err := rec.Commit(s, Held{Hash: "aa"}); !errors.Is(err, ErrClobbered) {
		t.Fatalf("Commit after a reset: %v, want ErrClobbered", err)
	}
}

func TestRecoverWorkerWrites(t *testing.T) {
	h, err := NewHeap(Layout{Groups: []GroupLayout{{Blocks: 3, Regions: []int64{8}}}})
	if err != nil {
		t.Fatal(err)
	}
	w := NewEngineWriter(h)
	if err := w.WriteBytes(0, 0, dataplane.Identity{Hash: "aa"}, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	_, _ = h.Record(0, 1).Begin(WriterWorker) // a worker died mid-load
	_, _ = h.Record(0, 2).Begin(WriterEngine) // the engine's own write in progress
	if n := w.RecoverWorkerWrites(); n != 1 {
		t.Fatalf("RecoverWorkerWrites = %d, want 1", n)
	}
	if _, _, ok := h.Record(0, 1).Load(); !ok {
		t.Fatal("the dead worker's write is still in progress")
	}
	if _, _, ok := h.Record(0, 2).Load(); ok {
		t.Fatal("the engine's write in progress was cleared")
	}
	if _, held, _ := h.Record(0, 0).Load(); held.Hash != "aa" {
		t.Fatalf("a committed block lost its record: %+v", held)
	}
	if err := w.WriteBytes(0, 1, dataplane.Identity{Hash: "bb"}, make([]byte, 8)); err != nil {
		t.Fatalf("the recovered block cannot be written: %v", err)
	}
}
