package kvmem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
)

// Sentinel errors.
var (
	// ErrBusy reports a block whose record shows a write in progress.
	ErrBusy = errors.New("block is being written")
	// ErrClobbered reports a write whose record changed under it.
	ErrClobbered = errors.New("block record changed during the write")
	// ErrLayout reports a layout that cannot describe a KV memory, or one
	// that does not fit the served model or the segment.
	ErrLayout = errors.New("bad kv memory layout")
	// ErrSegment reports a segment that is not a kv memory segment of this
	// format (bad magic, version or size).
	ErrSegment = errors.New("bad kv memory segment")
	// ErrNoCUDA reports a CUDA memory asked of a build without CUDA.
	ErrNoCUDA = errors.New("this gpuworker was built without CUDA (build with -tags cuda)")
	// ErrRange reports a group, block or region outside the memory.
	ErrRange = errors.New("block outside the kv memory")
)

// Writer names who wrote a block, in its record.
type Writer uint8

// The writers.
const (
	// WriterNone is a record never written.
	WriterNone Writer = iota
	// WriterEngine is the engine computing KV.
	WriterEngine
	// WriterWorker is the gpuworker loading a block.
	WriterWorker
)

// RecordSize is the bytes of one block's identity record: 64 words, a
// cache line multiple so records of different blocks share no line.
const RecordSize = recordWords * 8

// RecordRequestIDLen is how much of a request id a record keeps.
const RecordRequestIDLen = reqWords * 8

// The record's words.
const (
	wSeq        = 0
	wGen        = 1
	wTime       = 2
	wMeta       = 3
	wHash       = 4
	hashWords   = (dataplane.MaxHashLen + 7) / 8
	wReq        = wHash + hashWords
	reqWords    = 16
	recordWords = 64
)

// Held is what a record says its block holds.
type Held struct {
	// Hash is the chunk hash; empty when the block holds nothing.
	Hash string
	// RequestID is the writing request, truncated to RecordRequestIDLen.
	RequestID string
	// Generation is the write's generation.
	Generation uint64
	// Completed is when the write completed, in unix nanoseconds.
	Completed int64
	// Writer is who wrote it.
	Writer Writer
}

// Record is one block's identity record: recordWords aligned words of a
// memory both sides map (or of the heap).
type Record struct {
	w *[recordWords]uint64
}

// records views b (a multiple of RecordSize, 8-byte aligned) as records.
func records(b []byte) []uint64 {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Slice((*uint64)(unsafe.Pointer(&b[0])), len(b)/8)
}

// recordAt is record i of words.
func recordAt(words []uint64, i int) Record {
	return Record{w: (*[recordWords]uint64)(words[i*recordWords : (i+1)*recordWords])}
}

// Begin starts a write by w: the sequence goes from even to odd and the
// record holds nothing. It returns the odd sequence for Commit or Abort,
// or ErrBusy when another write is in progress.
func (r Record) Begin(w Writer) (uint64, error) {
	s := atomic.LoadUint64(&r.w[wSeq])
	if s&1 == 1 || !atomic.CompareAndSwapUint64(&r.w[wSeq], s, s+1) {
		return 0, ErrBusy
	}
	atomic.StoreUint64(&r.w[wMeta], uint64(w)<<32)
	return s + 1, nil
}

// Commit ends the write Begin returned seq for: the record holds h (its
// request id truncated) and the sequence goes even. ErrClobbered means the
// record changed during the write (a reset of a write taken for dead): the
// block holds nothing then.
func (r Record) Commit(seq uint64, h Held) error {
	if len(h.Hash) == 0 || len(h.Hash) > dataplane.MaxHashLen {
		r.Abort(seq)
		return fmt.Errorf("hash of %d bytes: %w", len(h.Hash), dataplane.ErrIdentity)
	}
	req := h.RequestID[:min(len(h.RequestID), RecordRequestIDLen)]
	storeText(r.w[wHash:wHash+hashWords], h.Hash)
	storeText(r.w[wReq:wReq+reqWords], req)
	atomic.StoreUint64(&r.w[wGen], h.Generation)
	atomic.StoreUint64(&r.w[wTime], uint64(h.Completed))
	atomic.StoreUint64(&r.w[wMeta], uint64(len(h.Hash))|uint64(len(req))<<16|uint64(h.Writer)<<32)
	if !atomic.CompareAndSwapUint64(&r.w[wSeq], seq, seq+1) {
		return ErrClobbered
	}
	return nil
}

// Abort ends the write Begin returned seq for with the block holding
// nothing.
func (r Record) Abort(seq uint64) {
	atomic.StoreUint64(&r.w[wMeta], atomic.LoadUint64(&r.w[wMeta])&^0xffffffff)
	atomic.CompareAndSwapUint64(&r.w[wSeq], seq, seq+1)
}

// Load returns the record's sequence and what it holds; ok is false while
// a write is in progress (nothing may be read then).
func (r Record) Load() (seq uint64, h Held, ok bool) {
	seq = atomic.LoadUint64(&r.w[wSeq])
	if seq&1 == 1 {
		return seq, Held{}, false
	}
	meta := atomic.LoadUint64(&r.w[wMeta])
	h.Writer = Writer(meta >> 32)
	if n := int(meta & 0xffff); n > 0 && n <= dataplane.MaxHashLen {
		h.Hash = loadText(r.w[wHash:wHash+hashWords], n)
		h.RequestID = loadText(r.w[wReq:wReq+reqWords], min(int(meta>>16&0xffff), RecordRequestIDLen))
		h.Generation = atomic.LoadUint64(&r.w[wGen])
		h.Completed = int64(atomic.LoadUint64(&r.w[wTime]))
	}
	return seq, h, true
}

// Unchanged reports whether the sequence is still seq: no write began
// since the Load that returned it. It is a compare-and-swap of seq with
// itself, a full barrier: every read of the block's bytes before it is
// complete before the sequence is checked.
func (r Record) Unchanged(seq uint64) bool {
	return atomic.CompareAndSwapUint64(&r.w[wSeq], seq, seq)
}

// Seq is the record's sequence now.
func (r Record) Seq() uint64 { return atomic.LoadUint64(&r.w[wSeq]) }

// forceClear resets a record left odd by a writer that died: the sequence
// goes even and the record holds nothing. Only the memory's owner calls it,
// when no other writer can be running.
func (r Record) forceClear() {
	atomic.StoreUint64(&r.w[wMeta], 0)
	s := atomic.LoadUint64(&r.w[wSeq])
	atomic.StoreUint64(&r.w[wSeq], (s|1)+1)
}

// storeText stores s into words, 8 bytes a word (little endian, zero
// padded).
func storeText(words []uint64, s string) {
	var b [8]byte
	for i := 0; i*8 < len(s); i++ {
		clear(b[:])
		copy(b[:], s[i*8:])
		atomic.StoreUint64(&words[i], binary.LittleEndian.Uint64(b[:]))
	}
}

// loadText loads n bytes of text from words.
func loadText(words []uint64, n int) string {
	out := make([]byte, (n+7)/8*8)
	for i := range (n + 7) / 8 {
		binary.LittleEndian.PutUint64(out[i*8:], atomic.LoadUint64(&words[i]))
	}
	return string(out[:n])
}
