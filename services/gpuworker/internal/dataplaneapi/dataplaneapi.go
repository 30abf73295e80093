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
	"slices"
	"strconv"

	"github.com/go-chi/chi/v5"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
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
	return &Handler{pool: p, store: st, fp: fingerprint, maxBatch: maxBatch, metrics: m, bufs: make(chan *[]byte, keptBuffers)}
}

// Mount adds the routes to r.
func (h *Handler) Mount(r chi.Router) {
	r.With(httpserver.BodyLimit(h.writeLimit())).Post(dataplane.PathWrite, h.write)
	r.Post(dataplane.PathRead, h.read)
	r.With(httpserver.BodyLimit(putBodyLimit)).Post(dataplane.PathPut, h.put)
	r.With(httpserver.BodyLimit(putBodyLimit)).Post(dataplane.PathEvict, h.evict)
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

// read answers one frame per asked block, checksummed, in order. Each block
// is sent under its read lock (no copy), so a write or load of that block
// waits until it is on the wire; a block that does not hold the asked hash
// is answered with a not-held frame (no data, what it holds instead).
// Content-Length is not known in advance (a refused block sends no data),
// so the answer is chunked.
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
	w.WriteHeader(http.StatusOK)
	hdr := make([]byte, 0, dataplane.FrameHeaderSize+2*dataplane.MaxHashLen)
	var sent int64
	refused := 0
	for _, ref := range req.Blocks {
		err := h.pool.Read(ref.Group, ref.Block, ref.Hash, func(src []byte, tag pool.Tag) error {
			hdr = dataplane.AppendFrameHeader(hdr[:0], dataplane.FrameHeader{
				Group: ref.Group, Block: ref.Block, Len: len(src), Checksum: dataplane.Checksum(src),
				Generation: tag.Generation, Identity: tag.Identity,
			})
			if _, err := w.Write(hdr); err != nil {
				return err
			}
			sent += int64(len(src))
			_, err := w.Write(src)
			return err
		})
		var nh *pool.NotHeldError
		if errors.As(err, &nh) {
			refused++
			h.metrics.NotHeld(metrics.OpRead)
			hdr = dataplane.AppendFrameHeader(hdr[:0], dataplane.FrameHeader{
				Group: ref.Group, Block: ref.Block, NotHeld: true, Generation: nh.Held.Generation, Identity: nh.Held.Identity,
			})
			_, err = w.Write(hdr)
		}
		if err != nil {
			return // the client went away; nothing more can be said to it
		}
	}
	span.SetAttributes(attribute.Int64("kvmesh.bytes", sent), attribute.Int("kvmesh.not_held", refused))
}

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

// put frames the listed blocks and stores them, in batches of at most
// maxBatch value bytes.
func (h *Handler) put(w http.ResponseWriter, r *http.Request) {
	var req dataplane.PutRequest
	if err := httpserver.DecodeJSON(w, r, &req); err != nil {
		return
	}
	results := make([]dataplane.PutResult, len(req.Items))
	var valid []int
	for i, it := range req.Items {
		switch err := h.pool.Check(it.Group, it.Block); {
		case err != nil:
			results[i] = dataplane.PutResult{Status: dataplane.PutFailed, Error: err.Error()}
		case it.Key == "":
			results[i] = dataplane.PutResult{Status: dataplane.PutFailed, Error: "empty store key"}
		case it.Hash == "":
			h.metrics.NotHeld(metrics.OpPut)
			results[i] = dataplane.PutResult{Status: dataplane.PutNotHeld, Error: "no block hash: the block's content cannot be proven"}
		default:
			valid = append(valid, i)
		}
	}
	ctx, span := otel.Tracer(tracerName).Start(r.Context(), "gpuworker.put", trace.WithAttributes(
		attribute.Int("kvmesh.items", len(req.Items)), attribute.IntSlice("kvmesh.groups", putGroups(req.Items))))
	defer span.End()
	r = r.WithContext(ctx)
	var stored int64
	for len(valid) > 0 {
		n, size := h.nextBatch(req.Items, valid)
		bytes, err := h.putBatch(r, req.Items, valid[:n], size, results)
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, "store unavailable")
			httpserver.WriteProblem(w, r, http.StatusServiceUnavailable, "store unavailable", err.Error(), nil)
			return
		}
		stored += bytes
		valid = valid[n:]
	}
	span.SetAttributes(attribute.Int64("kvmesh.bytes", stored), attribute.Int("kvmesh.failed_items", failedItems(results)))
	_ = httpserver.WriteJSON(w, http.StatusOK, dataplane.PutResponse{Results: results, Bytes: stored})
}

// putGroups lists the distinct groups of items, in first-seen order.
func putGroups(items []dataplane.PutItem) []int {
	var out []int
	for _, it := range items {
		if !slices.Contains(out, it.Group) {
			out = append(out, it.Group)
		}
	}
	return out
}

// failedItems counts the results that are not stored (failed or no space).
func failedItems(results []dataplane.PutResult) int {
	n := 0
	for _, r := range results {
		if r.Status != dataplane.PutStored {
			n++
		}
	}
	return n
}

// nextBatch is how many of the valid items the next Put carries (at least
// one) and their framed size.
func (h *Handler) nextBatch(items []dataplane.PutItem, valid []int) (n, size int) {
	overhead := dataplane.ValueOverhead(len(h.fp))
	for n < len(valid) {
		bpb, _ := h.pool.BlockSize(items[valid[n]].Group) // checked by put
		if n > 0 && size+overhead+bpb > h.maxBatch {
			break
		}
		size += overhead + bpb
		n++
	}
	return n, size
}

// putBatch frames the items at idx into one buffer and stores them in one
// Put, filling their results. A block that does not hold its item's hash
// is not framed: its result is PutNotHeld. It returns the framed bytes
// stored, or the store's whole-batch error.
func (h *Handler) putBatch(r *http.Request, items []dataplane.PutItem, idx []int, size int, results []dataplane.PutResult) (int64, error) {
	bp := h.buffer(size)
	defer h.release(bp)
	buf := (*bp)[:0]
	batch := make([]kvstore.Item, 0, len(idx))
	framed := make([]int, 0, len(idx))
	for _, i := range idx {
		it := items[i]
		err := h.pool.Read(it.Group, it.Block, it.Hash, func(src []byte, _ pool.Tag) error {
			at := len(buf)
			buf = dataplane.AppendValue(buf, h.fp, src)
			batch = append(batch, kvstore.Item{Key: it.Key, Value: buf[at:len(buf):len(buf)]})
			return nil
		})
		if err != nil { // the range was checked by put: the block does not hold the hash
			h.metrics.NotHeld(metrics.OpPut)
			results[i] = dataplane.PutResult{Status: dataplane.PutNotHeld, Error: err.Error()}
			continue
		}
		framed = append(framed, i)
	}
	if len(batch) == 0 {
		return 0, nil
	}
	errs, err := h.store.Put(r.Context(), batch)
	if err != nil {
		return 0, fmt.Errorf("store put of %d keys: %w", len(batch), err)
	}
	var stored int64
	for j, i := range framed {
		results[i] = putResult(errs[j])
		if errs[j] == nil {
			stored += int64(len(batch[j].Value))
		}
	}
	h.metrics.StoreBytes(metrics.OpSavePut, stored)
	return stored, nil
}

// buffer returns a kept buffer of at least size bytes capacity, or a new one.
func (h *Handler) buffer(size int) *[]byte {
	select {
	case bp := <-h.bufs:
		if cap(*bp) >= size {
			return bp
		}
	default:
	}
	b := make([]byte, 0, size)
	return &b
}

// release keeps bp for a later put unless enough are kept already.
func (h *Handler) release(bp *[]byte) {
	select {
	case h.bufs <- bp:
	default:
	}
}

// putResult maps a per-key store error to a PutResult.
func putResult(err error) dataplane.PutResult {
	switch {
	case err == nil:
		return dataplane.PutResult{Status: dataplane.PutStored}
	case errors.Is(err, kvstore.ErrNoSpace):
		return dataplane.PutResult{Status: dataplane.PutNoSpace, Error: err.Error()}
	}
	return dataplane.PutResult{Status: dataplane.PutFailed, Error: err.Error()}
}
