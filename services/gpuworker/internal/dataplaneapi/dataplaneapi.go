// Package dataplaneapi serves a gpuworker's data plane over HTTP: binary
// block writes and reads against the pool, evictions, and puts of pool
// blocks to the store pool. The wire format is pkg/dataplane's; see
// services/gpuworker/API.md. Every write records the block's identity and
// every read or put names the hash it expects: a block that does not hold
// it is refused per block (a not-held frame, a not_held put result), never
// served.
package dataplaneapi

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// putBodyLimit bounds a put request's JSON item list.
const putBodyLimit = 16 << 20

// Handler serves the data-plane routes of one pool.
type Handler struct {
	pool     *pool.Pool
	store    kvstore.Store
	fp       string
	maxBatch int
	metrics  *metrics.Metrics
	// bufs keeps a few put buffers across requests (and across garbage
	// collections, unlike a sync.Pool): framing into memory already
	// faulted in is several times faster than into fresh pages.
	bufs chan *[]byte
	// streams bounds a put's concurrent store calls (put.go).
	streams Streams
	// times records when each key was stored (nil: not recorded), and now
	// is its clock.
	times kvstore.StoreTimes
	now   func() time.Time
	// frameBufs are kept buffers read answers build their frames in.
	frameBufs chan []byte
}

// tracerName is the instrumentation scope of the data-plane spans.
const tracerName = "kvmesh/gpuworker"

// keptBuffers is how many put buffers of up to maxBatch bytes stay
// allocated between requests.
const keptBuffers = 2

// New returns a handler over st (instrumented with the save_put op name).
// maxBatch bounds the value bytes of one store Put; fingerprint is the model's, framed into
// every stored value.
func New(p *pool.Pool, st kvstore.Store, fingerprint string, maxBatch int, m *metrics.Metrics) *Handler {
	return &Handler{pool: p, store: st, fp: fingerprint, maxBatch: maxBatch, metrics: m, bufs: make(chan *[]byte, keptBuffers),
		frameBufs: make(chan []byte, keptFrameBufs)}
}

// WithStoreTimes has h record the time of every key it stores in st
// (kvstore.StoreTimes), so the removal of the key can say the block's age.
// A failed record does not fail the put: the block is stored; it is
// counted (kvmesh_gpuworker_store_times_unrecorded_total).
func (h *Handler) WithStoreTimes(st kvstore.StoreTimes, now func() time.Time) *Handler {
	h.times, h.now = st, now
	return h
}

// Mount adds the routes to r.
func (h *Handler) Mount(r chi.Router) {
	r = r.With(httpserver.QuietAccessLog) // several calls per block batch: successes are logged at debug
	r.With(h.limitWrite).Post(dataplane.PathWrite, h.write)
	r.Post(dataplane.PathRead, h.read)
	r.With(httpserver.BodyLimit(putBodyLimit)).Post(dataplane.PathPut, h.put)
	r.With(httpserver.BodyLimit(putBodyLimit)).Post(dataplane.PathEvict, h.evict)
}

// limitWrite bounds a write body by writeLimit at the time of the request:
// a registered engine memory may hold another number of blocks than the
// pool had when the routes were mounted.
func (h *Handler) limitWrite(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httpserver.BodyLimit(h.writeLimit())(next).ServeHTTP(w, r)
	})
}

// writeLimit bounds a write body: every block of the pool once, framed. The
// body streams into the pool, so nothing larger than a frame header is
// buffered whatever the size.
func (h *Handler) writeLimit() int64 {
	var n int64
	for g, blocks := range h.pool.Blocks() {
		bpb, _ := h.pool.BlockSize(g) // g is a pool group
		n += int64(blocks) * int64(dataplane.FrameHeaderSize+dataplane.MaxHashLen+dataplane.MaxRequestIDLen+bpb)
	}
	return n
}

// writeAnswer is the JSON answer of a successful write.
type writeAnswer struct {
	Blocks int   `json:"blocks"`
	Bytes  int64 `json:"bytes"`
}

// write streams each frame of the body straight into its pool block.
func (h *Handler) write(w http.ResponseWriter, r *http.Request) {
	var ans writeAnswer
	for {
		fh, err := dataplane.ReadFrameHeader(r.Body)
		if errors.Is(err, io.EOF) {
			break
		}
		if err == nil {
			err = h.writeFrame(r.Body, fh)
		}
		if err != nil {
			writeBodyProblem(w, r, fmt.Errorf("frame %d (the frames before it were written): %w", ans.Blocks, err))
			return
		}
		ans.Blocks++
		ans.Bytes += int64(fh.Len)
	}
	_ = httpserver.WriteJSON(w, http.StatusOK, ans) // a failed answer only means the client left
}

// writeFrame reads one frame's data into its block.
func (h *Handler) writeFrame(body io.Reader, fh dataplane.FrameHeader) error {
	bpb, err := h.pool.BlockSize(fh.Group)
	if err != nil {
		return err
	}
	if fh.Len != bpb {
		return fmt.Errorf("group %d block %d: %d bytes for a %d-byte block: %w", fh.Group, fh.Block, fh.Len, bpb, pool.ErrSize)
	}
	if fh.NotHeld {
		return fmt.Errorf("group %d block %d: a write frame flagged not held: %w", fh.Group, fh.Block, dataplane.ErrFrame)
	}
	if err := fh.Identity.Validate(); err != nil {
		return fmt.Errorf("group %d block %d: %w", fh.Group, fh.Block, err)
	}
	return h.pool.Write(fh.Group, fh.Block, fh.Identity, func(dst []byte) error {
		return dataplane.ReadFrameData(body, fh, dst)
	})
}

// writeBodyProblem answers a failed write: 413 past the body limit, else 400.
func writeBodyProblem(w http.ResponseWriter, r *http.Request, err error) {
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		httpserver.WriteProblem(w, r, http.StatusRequestEntityTooLarge, "", err.Error(), nil)
		return
	}
	httpserver.WriteProblem(w, r, http.StatusBadRequest, "", err.Error(), nil)
}

// read answers one frame per asked block, checksummed, in order. Each
// block is copied out of the pool first and its identity record checked
// again after the copy (pool.ReadSegments): only bytes whose record held
// the asked hash throughout are sent. A block that does not hold it, or
// was rewritten during the copy (the engine writes its registered memory
// itself), is answered with a not-held frame (no data, what it holds
// instead). The answer's length is not known before every block has been
// copied (a refused block sends no data): an answer of up to
// readAnswerBytes is built whole and sent with a Content-Length in one
// write; a larger one is chunked, frameFlushSize at a time.
func (h *Handler) read(w http.ResponseWriter, r *http.Request) {
	var req dataplane.ReadRequest
	if err := httpserver.DecodeJSON(w, r, &req); err != nil {
		return
	}
	for i, ref := range req.Blocks {
		err := h.pool.Check(ref.Group, ref.Block)
		if err == nil && (ref.Hash == "" || len(ref.Hash) > dataplane.MaxHashLen) {
			err = fmt.Errorf("hash of %d bytes (1..%d): %w", len(ref.Hash), dataplane.MaxHashLen, dataplane.ErrIdentity)
		}
		if err != nil {
			httpserver.WriteProblem(w, r, http.StatusBadRequest, "", fmt.Sprintf("blocks[%d]: %v", i, err),
				map[string]any{"field": "blocks[" + strconv.Itoa(i) + "]"})
			return
		}
	}
	_, span := otel.Tracer(tracerName).Start(r.Context(), "gpuworker.read", trace.WithAttributes(
		attribute.Int("kvmesh.blocks", len(req.Blocks))))
	defer span.End()
	w.Header().Set("Content-Type", dataplane.ContentTypeFrames)
	// Frames are built in one buffer, each block copied out of the pool
	// and checksummed in one pass straight behind its header's place: one
	// copy of the bytes, and one write (a Content-Length answer) or a
	// chunk and a write per frameFlushSize (a chunked one) rather than
	// per block.
	out := h.frameBuf(h.answerSize(req.Blocks))
	defer func() { h.keepFrameBuf(out) }()
	var sent int64
	refused := 0
	streaming := false // the header went out: the answer is chunked
	for _, ref := range req.Blocks {
		mark := len(out)
		var n int
		err := h.pool.ReadSegments(ref.Group, ref.Block, ref.Hash, func(segs [][]byte, t pool.Tag) error {
			out, n = dataplane.AppendFrameSegments(out[:mark], dataplane.FrameHeader{
				Group: ref.Group, Block: ref.Block, Generation: t.Generation, Identity: t.Identity,
			}, segs)
			return nil
		})
		var nh *pool.NotHeldError
		switch {
		case errors.As(err, &nh):
			refused++
			h.metrics.NotHeld(metrics.OpRead)
			out = dataplane.AppendFrameHeader(out[:mark], dataplane.FrameHeader{
				Group: ref.Group, Block: ref.Block, NotHeld: true, Generation: nh.Held.Generation, Identity: nh.Held.Identity,
			})
			err = nil
		case err == nil:
			sent += int64(n)
		}
		if err != nil {
			if !streaming {
				httpserver.WriteProblem(w, r, http.StatusInternalServerError, "", err.Error(), nil)
			}
			return // a device copy failed (or the client went away); nothing more can be said
		}
		if !streaming && len(out) > readAnswerBytes {
			streaming = true
			w.WriteHeader(http.StatusOK)
		}
		if streaming && len(out) >= frameFlushSize {
			if _, err := w.Write(out); err != nil {
				return // the client went away
			}
			out = out[:0]
		}
	}
	if !streaming {
		w.Header().Set("Content-Length", strconv.Itoa(len(out)))
		w.WriteHeader(http.StatusOK)
	}
	if len(out) > 0 {
		if _, err := w.Write(out); err != nil {
			return // the client went away
		}
	}
	span.SetAttributes(attribute.Int64("kvmesh.bytes", sent), attribute.Int("kvmesh.not_held", refused))
}

// requestIDRoom is the room answerSize leaves for a frame's request id (a
// longer one grows the buffer).
const requestIDRoom = 64

// answerSize is the size of a read answer of refs when every block is
// served (the whole-answer bound when larger), for sizing its buffer.
func (h *Handler) answerSize(refs []dataplane.ReadRef) int {
	n := 0
	for _, ref := range refs {
		bpb, _ := h.pool.BlockSize(ref.Group) // checked by the caller
		n += dataplane.FrameHeaderSize + len(ref.Hash) + requestIDRoom + bpb
		if n > readAnswerBytes {
			return readAnswerBytes + frameFlushSize
		}
	}
	return n
}

// frameBuf returns an empty buffer of at least size bytes of capacity,
// one kept from an earlier answer when there is one: filling memory
// already faulted in is cheaper than fresh pages, and a buffer that
// starts large enough is never copied to grow.
func (h *Handler) frameBuf(size int) []byte {
	select {
	case b := <-h.frameBufs:
		if cap(b) >= size {
			return b[:0]
		}
	default:
	}
	return make([]byte, 0, size)
}

// keepFrameBuf keeps b for a later answer, unless keptFrameBufs are kept
// already or b grew past the whole-answer bound.
func (h *Handler) keepFrameBuf(b []byte) {
	if cap(b) > 2*readAnswerBytes {
		return
	}
	select {
	case h.frameBufs <- b[:0]:
	default:
	}
}

// keptFrameBufs is how many read-answer buffers stay allocated between
// requests (one per pd sub-batch in flight, KVMESH_STORE_STREAMS by
// default).
const keptFrameBufs = 4

// readAnswerBytes bounds the read answers built whole and sent with a
// Content-Length (one write; the client reads a plain body, large reads
// going straight into their destination); a larger answer is chunked. It
// is above a pd sub-batch (KVMESH_STREAM_CHUNK_BYTES, 4 MiB, frame
// headers included).
const readAnswerBytes = 8 << 20

// frameFlushSize is how many bytes of frames a chunked read answer
// gathers before it writes them.
const frameFlushSize = 256 << 10

// evict clears the identity of the listed blocks.
func (h *Handler) evict(w http.ResponseWriter, r *http.Request) {
	var req dataplane.EvictRequest
	if err := httpserver.DecodeJSON(w, r, &req); err != nil {
		return
	}
	for i, ref := range req.Blocks {
		if err := h.pool.Check(ref.Group, ref.Block); err != nil {
			httpserver.WriteProblem(w, r, http.StatusBadRequest, "", fmt.Sprintf("blocks[%d]: %v", i, err),
				map[string]any{"field": "blocks[" + strconv.Itoa(i) + "]"})
			return
		}
	}
	var ans dataplane.EvictResponse
	for _, ref := range req.Blocks {
		if held, _ := h.pool.Evict(ref.Group, ref.Block); held { // checked above
			ans.Evicted++
		}
	}
	_ = httpserver.WriteJSON(w, http.StatusOK, ans)
}
