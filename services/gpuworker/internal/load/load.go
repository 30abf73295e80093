// Package load is the gpuworker's receiving side: it consumes load tasks for
// its engine, gets each listed block from the store pool (or, for a pd load,
// from the prefill engine's worker), verifies it and writes it into the pool,
// and always publishes the load's result with the blocks that failed.
package load

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/metrics"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/pool"
)

// Outcomes of a load task, as counted in kvmesh_gpuworker_loads_total.
const (
	OutcomeOK           = "ok"
	OutcomeLoadErrors   = "load_errors"
	OutcomeUnplanned    = "unplanned"
	OutcomeIgnored      = "ignored"
	OutcomeDeadLettered = "dead_lettered"
	// OutcomeStale is a task consumed more than Config.MaxAge after it was
	// published: nothing is loaded and every block is reported as a load
	// error.
	OutcomeStale = "stale"
)

// ConnectorPD is the connector name of a disaggregated-prefill load.
const ConnectorPD = "pd"

// Sentinel errors.
var (
	// ErrInvalidTask reports a load-task payload that does not decode
	// strictly or lacks its schema or identifying fields.
	ErrInvalidTask = errors.New("invalid load task")
	// ErrNotPlanned reports a task whose blocks cannot be mapped.
	ErrNotPlanned = errors.New("load task cannot be planned")
	// ErrSourceNotHeld reports a pd source block that no longer holds the
	// chunk (its worker restarted, or the engine evicted or reused it).
	ErrSourceNotHeld = errors.New("pd source block does not hold the chunk")
	// ErrStaleTask reports a load task older than Config.MaxAge.
	ErrStaleTask = errors.New("load task too old to load")
)

// Publisher publishes records (bus.Producer).
type Publisher interface {
	Publish(ctx context.Context, msgs ...bus.Message) error
}

// RemoteFinder returns a data-plane client for a rank of another engine.
type RemoteFinder func(ctx context.Context, engineID string, r kvcore.Rank) (*dataplane.Client, error)

// Config wires a Loader.
type Config struct {
	// Model is the served model.
	Model *kvcore.Model
	// Keys builds store keys.
	Keys kvcore.KeyBuilder
	// EngineID and Rank name the pool this worker holds.
	EngineID string
	Rank     kvcore.Rank
	// Pool receives the blocks.
	Pool *pool.Pool
	// Store is the store pool (instrumented with the load_get op name).
	Store kvstore.Store
	// Publisher publishes transfer results.
	Publisher Publisher
	// Remote finds another engine's worker, for pd loads.
	Remote RemoteFinder
	// RemoteFailed, when set, is told the engine id of a pd source whose
	// read failed as a whole (the request or its stream), so that a finder
	// that caches where the engine's ranks listen looks them up again.
	RemoteFailed func(engineID string)
	// MaxBatchBytes bounds the value bytes one store Get (or remote read)
	// brings into memory.
	MaxBatchBytes int
	// Streams is how many sub-batches of one load (store Gets, or remote
	// reads of a pd load) are in flight at once; zero means
	// DefaultStreams. Each sub-batch's values are verified and copied
	// into the pool as soon as it arrives, while the others transfer.
	Streams int
	// ChunkBytes bounds the value bytes of one sub-batch (at most
	// MaxBatchBytes; zero means DefaultChunkBytes). A load holds at most
	// Streams × ChunkBytes of fetched values.
	ChunkBytes int
	// Metrics counts loads and store operations.
	Metrics *metrics.Metrics
	// Log receives one line per load.
	Log *slog.Logger
	// MaxAge bounds how long after its publication a task is still
	// loaded. An older one — history a new rank's consumer group reads
	// from the topic's beginning, or a redelivery long after the
	// scheduler failed the load closed (KVMESH_LOAD_RANK_TIMEOUT) — may
	// name blocks the engine has since reused for other content, so it is
	// refused (OutcomeStale) with every block a load error. Zero loads
	// every task.
	MaxAge time.Duration
	// Now is the clock MaxAge is measured with (nil: time.Now).
	Now func() time.Time
}

// Defaults of Config fields left at zero.
const (
	// DefaultStreams is the default Config.Streams.
	DefaultStreams = 4
	// DefaultChunkBytes is the default Config.ChunkBytes.
	DefaultChunkBytes = 4 << 20
)

// Loader handles load tasks.
type Loader struct {
	cfg    Config
	fp     string
	tracer trace.Tracer
}

// New returns a loader.
func New(cfg Config) *Loader {
	if cfg.Streams <= 0 {
		cfg.Streams = DefaultStreams
	}
	if cfg.ChunkBytes <= 0 {
		cfg.ChunkBytes = DefaultChunkBytes
	}
	if cfg.MaxBatchBytes > 0 {
		cfg.ChunkBytes = min(cfg.ChunkBytes, cfg.MaxBatchBytes)
	}
	return &Loader{cfg: cfg, fp: cfg.Model.Fingerprint(), tracer: otel.Tracer("kvmesh/gpuworker")}
}

// Handle is the bus handler for kvmesh.load.tasks: tasks of other engines
// are skipped before decoding when the record key tells, after otherwise;
// an undecodable task is dead-lettered; a task whose Ranks do not list
// this worker's rank is skipped (see Assigned); every other task is loaded
// and its result published (a publish failure is transient: the redelivered task is
// loaded again and republished with the same result id).
func (l *Loader) Handle(ctx context.Context, m bus.Received) error {
	if m.Key != "" && m.Key != l.cfg.EngineID {
		l.cfg.Metrics.Load(OutcomeIgnored, 0, 0)
		return nil
	}
	task, err := DecodeTask(m.Value)
	if err != nil {
		return bus.Permanent(kvcore.ReasonUndecodable, err)
	}
	if task.EngineID != l.cfg.EngineID {
		l.cfg.Metrics.Load(OutcomeIgnored, 0, 0)
		return nil
	}
	if !l.Assigned(task) {
		l.cfg.Metrics.Load(OutcomeIgnored, 0, 0)
		l.cfg.Log.DebugContext(ctx, "load task skipped: this rank is not one of its ranks", "task_id", task.TaskID,
			"request_id", task.RequestID, "rank", l.cfg.Rank.String(), "ranks", kvcore.RankNames(task.Ranks))
		return nil
	}
	var res contract.TransferResult
	if l.stale(m.Time) {
		res = l.refuseStale(ctx, task, m.Time)
	} else {
		res = l.Load(ctx, task)
	}
	if err := ctx.Err(); err != nil {
		return err // stopping: the task is not committed and will be redelivered
	}
	value, err := json.Marshal(res)
	if err != nil {
		return bus.Permanent("unencodable_result", err)
	}
	if err := l.cfg.Publisher.Publish(ctx, bus.Message{
		Topic: contract.TopicTransferResults, Key: task.RequestID, Value: value,
	}); err != nil {
		return bus.Transient(fmt.Errorf("publish load result of task %s: %w", task.TaskID, err))
	}
	return nil
}

// DecodeTask decodes a load-task payload strictly.
func DecodeTask(value []byte) (*kvcore.LoadTask, error) {
	dec := json.NewDecoder(bytes.NewReader(value))
	dec.DisallowUnknownFields()
	var t kvcore.LoadTask
	if err := dec.Decode(&t); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidTask, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: data after the task", ErrInvalidTask)
	}
	switch {
	case t.Schema != kvcore.SchemaLoadTask:
		return nil, fmt.Errorf("%w: schema %q, want %q", ErrInvalidTask, t.Schema, kvcore.SchemaLoadTask)
	case t.TaskID == "" || t.RequestID == "" || t.EngineID == "":
		return nil, fmt.Errorf("%w: task_id, request_id and engine_id are required", ErrInvalidTask)
	}
	return &t, nil
}

// Assigned reports whether this worker's rank loads task: every rank does
// when the task lists no Ranks, otherwise only the ranks it lists.
func (l *Loader) Assigned(task *kvcore.LoadTask) bool {
	return len(task.Ranks) == 0 || slices.Contains(task.Ranks, l.cfg.Rank)
}

// reportRank is the rank a load result names: this worker's, whenever the
// task lists Ranks or the engine has more than one worker rank (the
// scheduler waits for one result per rank); nil for a single-rank engine's
// task without Ranks, whose result has always named no rank.
func (l *Loader) reportRank(task *kvcore.LoadTask) *kvcore.Rank {
	if len(task.Ranks) == 0 && l.cfg.Model.WorldSize() <= 1 {
		return nil
	}
	r := l.cfg.Rank
	return &r
}

// ResultID is the result id of rank r's load of a task: the same on every
// redelivery, different per rank.
func ResultID(taskID string, r kvcore.Rank) string {
	return "load:" + taskID + ":" + r.String()
}

// Load moves the task's blocks into the pool and returns its result; it
// never fails as a whole: whatever could not be loaded is a load error.
// The result names this worker's rank on a multi-rank engine or when the
// task lists Ranks.
func (l *Loader) Load(ctx context.Context, task *kvcore.LoadTask) contract.TransferResult {
	ctx, span := l.tracer.Start(ctx, "gpuworker.load", trace.WithAttributes(
		attribute.String(telemetry.AttrEngineID, task.EngineID),
		attribute.String(telemetry.AttrRequestID, task.RequestID),
		attribute.String("kvmesh.task_id", task.TaskID),
		attribute.String("kvmesh.connector", task.Connector),
	))
	defer span.End()
	start := time.Now()
	var res outcome
	if task.Connector == ConnectorPD && task.Remote != nil {
		res = l.loadRemote(ctx, task)
	} else {
		res = l.loadStore(ctx, task)
	}
	l.record(ctx, span, task, res, time.Since(start))
	return l.result(task, res)
}

// stale reports whether a task recorded at t is older than MaxAge.
func (l *Loader) stale(t time.Time) bool {
	if l.cfg.MaxAge <= 0 || t.IsZero() {
		return false
	}
	now := time.Now
	if l.cfg.Now != nil {
		now = l.cfg.Now
	}
	return now().Sub(t) > l.cfg.MaxAge
}

// refuseStale answers a stale task without touching the pool: every block
// it lists is a load error, so a request still waiting on it recomputes.
func (l *Loader) refuseStale(ctx context.Context, task *kvcore.LoadTask, recorded time.Time) contract.TransferResult {
	res := outcome{failed: newBlockSet(kvcore.ListedBlocks(l.cfg.Model, task)),
		firstErr: fmt.Errorf("%w: published %s, more than %s ago", ErrStaleTask, recorded.UTC().Format(time.RFC3339Nano), l.cfg.MaxAge)}
	l.cfg.Metrics.Load(OutcomeStale, len(res.failed.list), 0)
	l.cfg.Log.InfoContext(ctx, "stale load task refused", "task_id", task.TaskID, "request_id", task.RequestID,
		"rank", l.cfg.Rank.String(), "load_errors", len(res.failed.list), "err", res.firstErr)
	return l.result(task, res)
}

// result is the transfer result of a task's outcome.
func (l *Loader) result(task *kvcore.LoadTask, res outcome) contract.TransferResult {
	return contract.TransferResult{
		Schema:     contract.SchemaTransferResult,
		ResultID:   ResultID(task.TaskID, l.cfg.Rank),
		Kind:       contract.TransferLoad,
		TaskID:     task.TaskID,
		EngineID:   task.EngineID,
		RequestID:  task.RequestID,
		Rank:       l.reportRank(task),
		Status:     "done",
		LoadErrors: res.failed.list,
		Bytes:      res.bytes,
		TierBlocks: res.tierBlocks,
	}
}

// connectorLabel is the connector label of a load task: pd for a load from
// another engine's worker, else store.
func connectorLabel(task *kvcore.LoadTask) string {
	if task.Remote != nil {
		return "pd"
	}
	return "store"
}

// record puts a load's outcome on its span, in the metrics and in the log
// (debug when clean, warn with the first cause otherwise).
func (l *Loader) record(ctx context.Context, span trace.Span, task *kvcore.LoadTask, res outcome, took time.Duration) {
	kind := OutcomeOK
	switch {
	case res.planErr != nil:
		kind = OutcomeUnplanned
		span.SetAttributes(attribute.String("kvmesh.reason", res.planErr.Error()))
	case len(res.failed.list) > 0:
		kind = OutcomeLoadErrors
	}
	span.SetAttributes(attribute.Int("kvmesh.load_errors", len(res.failed.list)), attribute.Int64("kvmesh.bytes", res.bytes))
	l.cfg.Metrics.Load(kind, len(res.failed.list), res.bytes)
	l.cfg.Metrics.LoadTime(connectorLabel(task), took)
	level := slog.LevelDebug
	if kind != OutcomeOK {
		level = slog.LevelWarn
	}
	l.cfg.Log.Log(ctx, level, "load done", "task_id", task.TaskID, "request_id", task.RequestID, "rank", l.cfg.Rank.String(),
		"connector", task.Connector, "outcome", kind, "load_errors", len(res.failed.list), "bytes", res.bytes,
		"duration_ms", took.Milliseconds(), "plan_error", errString(res.planErr), "first_error", errString(res.firstErr))
}

// outcome is what one load did.
type outcome struct {
	// failed are the load errors, in order.
	failed *blockSet
	// bytes counts the block bytes written.
	bytes int64
	// tierBlocks counts the blocks read from the capacity tier.
	tierBlocks int
	// planErr is set when the task could not be planned.
	planErr error
	// firstErr is the first per-block or batch failure, for the log.
	firstErr error
}

// fail records block b as a load error caused by err.
func (o *outcome) fail(b kvcore.BlockID, err error) {
	o.failed.add(b)
	if o.firstErr == nil {
		o.firstErr = err
	}
}

// unplanned is the outcome of a task that cannot be planned.
func unplanned(m *kvcore.Model, task *kvcore.LoadTask, err error) outcome {
	return outcome{failed: newBlockSet(kvcore.ListedBlocks(m, task)), planErr: err}
}

// loadStore gets the task's keys from the store into the pool, in
// sub-batches, Streams of them at once.
func (l *Loader) loadStore(ctx context.Context, task *kvcore.LoadTask) outcome {
	if task.Model != l.cfg.Model.Name {
		return unplanned(l.cfg.Model, task, fmt.Errorf("model %q, worker serves %q: %w", task.Model, l.cfg.Model.Name, ErrNotPlanned))
	}
	items, err := kvcore.PlanLoad(l.cfg.Model, l.cfg.Keys, task, l.cfg.Rank)
	if err != nil {
		return unplanned(l.cfg.Model, task, fmt.Errorf("%w: %w", ErrNotPlanned, err))
	}
	res := outcome{failed: newBlockSet(nil)}
	errs := make([]error, len(items))
	var written atomic.Int64
	var reads kvtier.ReadCounts
	ctx = kvtier.CountReads(ctx, &reads)
	l.eachBatch(len(items), func(i int) int64 { return l.cfg.Model.Groups[items[i].Group].BytesPerBlock }, func(lo, hi int) {
		written.Add(l.getBatch(ctx, task.RequestID, items[lo:hi], errs[lo:hi]))
	})
	res.bytes, res.tierBlocks = written.Load(), int(reads.FromTier.Load())
	for i, it := range items {
		if errs[i] != nil {
			res.fail(it.Block, errs[i])
		}
	}
	return res
}

// eachBatch cuts n items into sub-batches of at most ChunkBytes of
// expected values (at least one item each; size(i) is item i's block
// bytes, the value overhead added) and calls do with each sub-batch's
// bounds, at most Streams at once; it returns when every call has.
func (l *Loader) eachBatch(n int, size func(i int) int64, do func(lo, hi int)) {
	overhead := int64(dataplane.ValueOverhead(len(l.fp)))
	var g errgroup.Group
	g.SetLimit(l.cfg.Streams)
	for lo := 0; lo < n; {
		hi, total := lo, int64(0)
		for hi < n && (hi == lo || total+size(hi)+overhead <= int64(l.cfg.ChunkBytes)) {
			total += size(hi) + overhead
			hi++
		}
		from, to := lo, hi
		g.Go(func() error { // waits while Streams sub-batches are in flight
			do(from, to)
			return nil
		})
		lo = hi
	}
	_ = g.Wait() // do reports through its own results
}

// getBatch gets one batch of keys with one store Get, verifies each value
// and writes it into its block as it arrives (kvstore.GetEach: a store
// that can hands the values over in a reused buffer, so no value is
// allocated); errs[i] records why item i failed. It returns the payload
// bytes written.
func (l *Loader) getBatch(ctx context.Context, requestID string, items []kvcore.TransferItem, errs []error) int64 {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.Key
	}
	var got, written int64
	keyErrs, err := kvstore.GetEach(ctx, l.cfg.Store, keys, func(i int, value []byte) error {
		got += int64(len(value))
		if err := l.place(requestID, items[i], value); err != nil {
			l.cfg.Metrics.Rejected(err)
			return err
		}
		written += l.cfg.Model.Groups[items[i].Group].BytesPerBlock
		return nil
	})
	l.cfg.Metrics.StoreBytes(metrics.OpLoadGet, got)
	if err != nil {
		for i := range errs {
			errs[i] = err
		}
		return 0
	}
	copy(errs, keyErrs)
	return written
}

// place verifies a stored value completely, then writes its payload into
// the item's block as the chunk's content (its hash, the loading request);
// a value that fails any check writes nothing.
func (l *Loader) place(requestID string, it kvcore.TransferItem, value []byte) error {
	payload, err := dataplane.DecodeValue(l.fp, value)
	if err != nil {
		return fmt.Errorf("key %s: %w", it.Key, err)
	}
	if bpb := l.cfg.Model.Groups[it.Group].BytesPerBlock; int64(len(payload)) != bpb { // before the block is touched
		return fmt.Errorf("key %s: group %d: %d bytes for a %d-byte block: %w", it.Key, it.Group, len(payload), bpb, pool.ErrSize)
	}
	return l.cfg.Pool.WriteSegments(it.Group, it.Block, dataplane.Identity{Hash: it.Hash, RequestID: requestID}, func(segs [][]byte) error {
		return copySegments(segs, payload)
	})
}

// copySegments copies payload into a block's segments in order; payload
// must be exactly as long as the segments together (pool.ErrSize).
//
// The checksum is verified before this copy rather than fused with it: a
// value that fails any check must leave its block untouched (the write
// clears the block's identity before the first byte changes), and the
// value, just read from the socket, is still in cache for the copy.
func copySegments(segs [][]byte, payload []byte) error {
	size := 0
	for _, s := range segs {
		size += len(s)
	}
	if size != len(payload) {
		return fmt.Errorf("%d bytes for a %d-byte block: %w", len(payload), size, pool.ErrSize)
	}
	for _, s := range segs {
		payload = payload[copy(s, payload):]
	}
	return nil
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
