package dataplaneapi

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// Defaults of Streams fields left at zero.
const (
	// DefaultStoreStreams is the default Streams.N.
	DefaultStoreStreams = 4
	// DefaultStreamChunkBytes is the default Streams.ChunkBytes.
	DefaultStreamChunkBytes = 4 << 20
)

// Streams is how puts move their batches: as sub-batches of at most
// ChunkBytes framed bytes, each framed into its own buffer and stored with
// its own store call, at most N at once over all the handler's puts (N
// framing buffers circulate). Framing one sub-batch overlaps sending
// others, the first byte leaves once one sub-batch is framed, and the
// handler holds at most N × ChunkBytes of framed values.
type Streams struct {
	// N is how many sub-batches are in flight at once (each on its own
	// store connection).
	N int
	// ChunkBytes bounds the framed value bytes of one sub-batch (one item
	// larger than it goes alone).
	ChunkBytes int
}

// withDefaults fills zero fields and caps ChunkBytes at maxBatch.
func (s Streams) withDefaults(maxBatch int) Streams {
	if s.N <= 0 {
		s.N = DefaultStoreStreams
	}
	if s.ChunkBytes <= 0 {
		s.ChunkBytes = DefaultStreamChunkBytes
	}
	if maxBatch > 0 {
		s.ChunkBytes = min(s.ChunkBytes, maxBatch)
	}
	return s
}

// WithStreams sets how puts stream (zero fields: the defaults) and gives
// the handler Streams.N framing buffers, shared by all puts (see buffer);
// it returns h. It must be called before the routes serve.
func (h *Handler) WithStreams(s Streams) *Handler {
	h.streams = s.withDefaults(h.maxBatch)
	h.bufs = make(chan *[]byte, h.streams.N)
	for range h.streams.N {
		h.bufs <- new([]byte) // allocated on first use, at the chunk size
	}
	return h
}

// put frames the listed blocks and stores them, streamed in sub-batches
// (see Streams). Per-item results do not depend on how the items were cut;
// a whole-batch store error of any sub-batch answers 503.
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
	stored, err := h.putAll(ctx, req.Items, valid, results)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "store unavailable")
		httpserver.WriteProblem(w, r, http.StatusServiceUnavailable, "store unavailable", err.Error(), nil)
		return
	}
	span.SetAttributes(attribute.Int64("kvmesh.bytes", stored), attribute.Int("kvmesh.failed_items", failedItems(results)))
	_ = httpserver.WriteJSON(w, http.StatusOK, dataplane.PutResponse{Results: results, Bytes: stored})
}

// putAll stores the items at valid in sub-batches, at most Streams.N at
// once, filling their results (each sub-batch its own indices). It returns
// the framed bytes stored, or the first whole-batch store error, which
// cancels the sub-batches still in flight and stops new ones.
func (h *Handler) putAll(ctx context.Context, items []dataplane.PutItem, valid []int, results []dataplane.PutResult) (int64, error) {
	st := h.streams.withDefaults(h.maxBatch)
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(st.N)
	var stored atomic.Int64
	for len(valid) > 0 && ctx.Err() == nil {
		n, size := h.nextBatch(items, valid, st.ChunkBytes)
		idx := valid[:n]
		valid = valid[n:]
		g.Go(func() error { // waits while N sub-batches are in flight
			bytes, err := h.putBatch(ctx, items, idx, size, results)
			stored.Add(bytes)
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return 0, err
	}
	return stored.Load(), nil
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

// nextBatch is how many of the valid items the next sub-batch carries (at
// least one, at most limit framed bytes unless one item alone is larger)
// and their framed size.
func (h *Handler) nextBatch(items []dataplane.PutItem, valid []int, limit int) (n, size int) {
	overhead := dataplane.ValueOverhead(len(h.fp))
	for n < len(valid) {
		bpb, _ := h.pool.BlockSize(items[valid[n]].Group) // checked by put
		if n > 0 && size+overhead+bpb > limit {
			break
		}
		size += overhead + bpb
		n++
	}
	return n, size
}

// putBatch frames the items at idx into one buffer, copying and
// checksumming each block's segments in one pass, and stores them in one
// Put, filling their results. A block that does not hold its item's hash,
// before or after the copy, is not sent: its result is PutNotHeld. It
// returns the framed bytes stored, or the store's whole-batch error.
func (h *Handler) putBatch(ctx context.Context, items []dataplane.PutItem, idx []int, size int, results []dataplane.PutResult) (int64, error) {
	bp, err := h.buffer(ctx, max(size, h.streams.ChunkBytes)) // one size, so kept buffers fit any sub-batch
	if err != nil {
		return 0, err
	}
	defer h.release(bp)
	buf := (*bp)[:0]
	batch := make([]kvstore.Item, 0, len(idx))
	framed := make([]int, 0, len(idx))
	for _, i := range idx {
		it := items[i]
		at := len(buf)
		err := h.pool.ReadSegments(it.Group, it.Block, it.Hash, func(segs [][]byte, _ pool.Tag) error {
			buf = dataplane.AppendValueSegments(buf, h.fp, segs)
			return nil
		})
		if err != nil { // the range was checked by put: the block does not hold the hash
			buf = buf[:at] // discard a copy the identity check refused afterwards
			h.metrics.NotHeld(metrics.OpPut)
			results[i] = dataplane.PutResult{Status: dataplane.PutNotHeld, Error: err.Error()}
			continue
		}
		batch = append(batch, kvstore.Item{Key: it.Key, Value: buf[at:len(buf):len(buf)]})
		framed = append(framed, i)
	}
	*bp = buf[:0] // keep a buffer that grew
	if len(batch) == 0 {
		return 0, nil
	}
	errs, err := h.store.Put(ctx, batch)
	if err != nil {
		return 0, fmt.Errorf("store put of %d keys: %w", len(batch), err)
	}
	var stored int64
	keys := make([]string, 0, len(framed))
	for j, i := range framed {
		results[i] = putResult(errs[j])
		if errs[j] == nil {
			stored += int64(len(batch[j].Value))
			keys = append(keys, batch[j].Key)
		}
	}
	h.metrics.StoreBytes(metrics.OpSavePut, stored)
	h.RecordStored(ctx, keys)
	return stored, nil
}

// RecordStored records now as the store time of keys, when h keeps store
// times; a failure is counted, never the caller's. The handler's puts call
// it, and so does the capacity tier's promotion of blocks back into Redis
// (kvtier.Tier.OnPromoted), so a promoted block's removal has its age.
func (h *Handler) RecordStored(ctx context.Context, keys []string) {
	if h.times == nil || len(keys) == 0 {
		return
	}
	if err := h.times.MarkStored(ctx, keys, h.now()); err != nil {
		h.metrics.StoreTimesUnrecorded(len(keys))
	}
}

// buffer returns one of the handler's framing buffers with at least size
// bytes of capacity. With WithStreams the handler owns exactly Streams.N
// buffers, shared by every put: a sub-batch waits (or ctx ends) until one
// is free, so the worker's framed values never exceed N × ChunkBytes
// however many puts run at once, and no buffer is allocated and faulted in
// afresh once they have grown. Without WithStreams a kept buffer is used
// when one is free, else a new one.
func (h *Handler) buffer(ctx context.Context, size int) (*[]byte, error) {
	if h.streams.N == 0 {
		select {
		case bp := <-h.bufs:
			if cap(*bp) >= size {
				return bp, nil
			}
		default:
		}
		b := make([]byte, 0, size)
		return &b, nil
	}
	select {
	case bp := <-h.bufs:
		if cap(*bp) < size {
			*bp = make([]byte, 0, size)
		}
		return bp, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for a framing buffer: %w", ctx.Err())
	}
}

// release hands bp back for a later sub-batch (without WithStreams: keeps
// it unless enough are kept already).
func (h *Handler) release(bp *[]byte) {
	select {
	case h.bufs <- bp:
	default: // only without WithStreams: with it, exactly N circulate
	}
}

// putResult maps a per-key store error to a PutResult.
func putResult(err error) dataplane.PutResult {
	switch {
	case err == nil:
		return dataplane.PutResult{Status: dataplane.PutStored}
	case errors.Is(err, kvstore.ErrExists):
		return dataplane.PutResult{Status: dataplane.PutExisting}
	case errors.Is(err, kvstore.ErrNoSpace):
		return dataplane.PutResult{Status: dataplane.PutNoSpace, Error: err.Error()}
	}
	return dataplane.PutResult{Status: dataplane.PutFailed, Error: err.Error()}
}
