package kvstore

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// tracerName is the instrumentation scope of the store spans.
const tracerName = "github.com/kvmesh/kvmesh/pkg/kvstore"

// Names of the store metric families, after the store connector's own
// (operation latency, keys per operation, failed keys by status).
const (
	MetricOpDuration = "kvmesh_store_op_duration_seconds"
	MetricKeys       = "kvmesh_store_keys_total"
	MetricFailedKeys = "kvmesh_store_failed_keys_total"
)

// Failure statuses of MetricFailedKeys. A whole-batch failure counts every
// key of the batch under the batch's status; a per-key error counts that key.
const (
	StatusNotFound    = "not_found"
	StatusNoSpace     = "no_space"
	StatusTooLarge    = "too_large"
	StatusUnavailable = "unavailable"
	StatusTimeout     = "timeout"
	StatusCanceled    = "canceled"
	StatusClosed      = "closed"
	StatusError       = "error"
)

// Metrics are the store metric families of one registry: kvmesh's own
// (MetricOpDuration, MetricKeys, MetricFailedKeys) and vLLM's MooncakeStore
// connector families (VLLMMetricOperationTime and the other VLLMMetric
// names). Create them once per registry with NewMetrics and share them
// between Instrument wrappers.
type Metrics struct {
	duration *prometheus.HistogramVec
	keys     *prometheus.CounterVec
	failed   *prometheus.CounterVec
	vllm     *vllmFamilies
}

// NewMetrics registers the store families, kvmesh's and vLLM's, on reg.
// Families already registered there (another NewMetrics on the same
// registry) are reused.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	duration := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    MetricOpDuration,
		Help:    "Latency of one batched store operation in seconds, by operation.",
		Buckets: prometheus.ExponentialBucketsRange(0.0001, 10, 16),
	}, []string{"op"})
	keys := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricKeys,
		Help: "Keys sent to the store, by operation.",
	}, []string{"op"})
	failed := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricFailedKeys,
		Help: "Keys whose store operation failed, by operation and status.",
	}, []string{"op", "status"})
	var err error
	if duration, err = telemetry.RegisterOnce(reg, duration); err != nil {
		return nil, err
	}
	if keys, err = telemetry.RegisterOnce(reg, keys); err != nil {
		return nil, err
	}
	if failed, err = telemetry.RegisterOnce(reg, failed); err != nil {
		return nil, err
	}
	vllm, err := newVLLMFamilies(reg)
	if err != nil {
		return nil, err
	}
	return &Metrics{duration: duration, keys: keys, failed: failed, vllm: vllm}, nil
}

// OpNames are the op label values under which an instrumented store records
// each batch method, such as "lookup_exists" for the lookup service's
// existence checks. An empty name takes the method's: exists, put, get,
// remove.
type OpNames struct {
	// Exists labels Exists calls.
	Exists string
	// Put labels Put calls.
	Put string
	// Get labels Get calls.
	Get string
	// Remove labels Remove calls.
	Remove string
}

func (o OpNames) withDefaults() OpNames {
	def := func(s *string, d string) {
		if *s == "" {
			*s = d
		}
	}
	def(&o.Exists, "exists")
	def(&o.Put, "put")
	def(&o.Get, "get")
	def(&o.Remove, "remove")
	return o
}

// Instrumented is a Store that records every batch call of the Store it
// wraps: one latency observation per call (whole round-trip, failed or
// not), the number of keys, and the failed keys by status, and one client
// span per call named "store <op>" (child of the span in the call's
// context) carrying the op, key count, value bytes and failed keys. Ping and
// Close pass through unrecorded. An Exists answer of "absent" is not a failure; a
// Get or Remove of a missing key counts as failed with status not_found.
//
// Each call is also one operation record of vLLM's MooncakeStore connector
// families, labelled with the wrapper's VLLMLabels (WithLabels) overridden
// by those of the call's context (WithVLLMLabels), the op name as operation,
// and a status as vLLM's store worker sets it
// (vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py):
// error with every key failed when the call failed as a whole,
// partial_failure with the failed keys counted when some keys failed, else
// ok. Its bytes are the value bytes a Put sent (failed items included, as
// vLLM counts a batch's sizes) or a Get returned; an Exists moves none.
type Instrumented struct {
	next Store
	m    *Metrics
	// ops are the op names of the calls; named are those Instrument was
	// given (without the defaults).
	ops, named OpNames
	labels     VLLMLabels
}

var _ Store = (*Instrumented)(nil)

// Instrument wraps s so that its calls are recorded in m under ops. The
// key and failed-key series of every op named in ops (the service's own
// operations, such as save_put) exist from the start, at 0, so that
// dashboards and alerts see them before the first failure.
func Instrument(s Store, m *Metrics, ops OpNames) *Instrumented {
	for _, op := range []string{ops.Exists, ops.Put, ops.Get, ops.Remove} {
		if op == "" {
			continue
		}
		m.keys.WithLabelValues(op)
		for _, status := range failureStatuses {
			m.failed.WithLabelValues(op, status)
		}
	}
	return &Instrumented{next: s, m: m, ops: ops.withDefaults(), named: ops}
}

// WithLabels returns a wrapper of the same store and ops whose calls are
// recorded in the vLLM families under l, except where the call's context
// carries labels of its own (WithVLLMLabels). When l names both the model
// and the engine (a gpuworker serves one engine), the vLLM series of every
// op named in Instrument's ops exist from the start, at 0, for each status
// the op can end with; a service whose engine differs per call gets its
// series with each engine's first call.
func (s *Instrumented) WithLabels(l VLLMLabels) *Instrumented {
	out := *s
	out.labels = l
	if l.ModelName == "" || l.Engine == "" {
		return &out
	}
	for _, d := range []struct {
		op       string
		statuses []string
	}{
		{s.named.Exists, existsStatuses},
		{s.named.Put, batchStatuses},
		{s.named.Get, batchStatuses},
		{s.named.Remove, batchStatuses},
	} {
		if d.op != "" {
			s.m.vllm.declare(l, d.op, d.statuses)
		}
	}
	return &out
}

// failureStatuses are the values of FailureStatus.
var failureStatuses = []string{StatusNotFound, StatusNoSpace, StatusTooLarge, StatusUnavailable,
	StatusTimeout, StatusCanceled, StatusClosed, StatusError}

// Exists implements Store.
func (s *Instrumented) Exists(ctx context.Context, keys []string) ([]bool, error) {
	c := s.begin(ctx, s.ops.Exists, len(keys), existsStatuses)
	found, err := s.next.Exists(c.ctx, keys)
	if err == nil {
		c.span.SetAttributes(attribute.Int("kvmesh.store.found", countTrue(found)))
	}
	s.end(c, 0, err, nil)
	return found, err
}

// Put implements Store.
func (s *Instrumented) Put(ctx context.Context, items []Item) ([]error, error) {
	c := s.begin(ctx, s.ops.Put, len(items), batchStatuses)
	errs, err := s.next.Put(c.ctx, items)
	var n int64
	for _, it := range items {
		n += int64(len(it.Value))
	}
	s.end(c, n, err, errs)
	return errs, err
}

// Get implements Store.
func (s *Instrumented) Get(ctx context.Context, keys []string) ([][]byte, []error, error) {
	c := s.begin(ctx, s.ops.Get, len(keys), batchStatuses)
	values, errs, err := s.next.Get(c.ctx, keys)
	var n int64
	for _, v := range values {
		n += int64(len(v))
	}
	s.end(c, n, err, errs)
	return values, errs, err
}

// GetEach implements ValueVisitor when the wrapped store does; otherwise
// it calls Get and hands each value to use. It counts what Get counts.
func (s *Instrumented) GetEach(ctx context.Context, keys []string, use func(i int, value []byte) error) ([]error, error) {
	c := s.begin(ctx, s.ops.Get, len(keys), batchStatuses)
	var n int64
	counted := func(i int, v []byte) error {
		n += int64(len(v))
		return use(i, v)
	}
	errs, err := GetEach(c.ctx, s.next, keys, counted)
	s.end(c, n, err, errs)
	return errs, err
}

// GetEach gets keys from st and calls use(i, value) for each present key
// in input order: through st's own GetEach when it is a ValueVisitor, or
// through Get otherwise. use's error becomes that key's error.
func GetEach(ctx context.Context, st Store, keys []string, use func(i int, value []byte) error) ([]error, error) {
	if v, ok := st.(ValueVisitor); ok {
		return v.GetEach(ctx, keys, use)
	}
	return getEachOf(ctx, st.Get, keys, use)
}

// Remove implements Store.
func (s *Instrumented) Remove(ctx context.Context, keys []string) ([]error, error) {
	c := s.begin(ctx, s.ops.Remove, len(keys), batchStatuses)
	errs, err := s.next.Remove(c.ctx, keys)
	s.end(c, 0, err, errs)
	return errs, err
}

// Ping implements Store.
func (s *Instrumented) Ping(ctx context.Context) error { return s.next.Ping(ctx) }

// Close implements Store.
func (s *Instrumented) Close() error { return s.next.Close() }

// call is one recorded store call in progress.
type call struct {
	ctx   context.Context
	span  trace.Span
	op    string
	n     int
	start time.Time
	// statuses are the vLLM statuses a call of its method can end with.
	statuses []string
}

// begin starts the span of one call of op over n keys, a call of a method
// that can end with statuses.
func (s *Instrumented) begin(ctx context.Context, op string, n int, statuses []string) call {
	ctx, span := otel.Tracer(tracerName).Start(ctx, "store "+op, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("db.system.name", "redis"),
			attribute.String("kvmesh.store.op", op), attribute.Int("kvmesh.store.keys", n)))
	return call{ctx: ctx, span: span, op: op, n: n, start: time.Now(), statuses: statuses}
}

// end records c's metrics and ends its span; bytes is the value bytes the
// call moved.
func (s *Instrumented) end(c call, bytes int64, batchErr error, keyErrs []error) {
	defer c.span.End()
	took := time.Since(c.start).Seconds()
	s.m.duration.WithLabelValues(c.op).Observe(took)
	s.m.keys.WithLabelValues(c.op).Add(float64(c.n))
	failedKeys := c.n
	if batchErr == nil {
		failedKeys = countErrs(keyErrs)
	}
	s.m.vllm.observe(vllmLabelsFrom(c.ctx).merged(s.labels), vllmOperation{
		name: c.op, statuses: c.statuses, seconds: took, keys: c.n, bytes: bytes,
		status: vllmStatus(batchErr, failedKeys), failedKeys: failedKeys,
	})
	if bytes > 0 {
		c.span.SetAttributes(attribute.Int64("kvmesh.bytes", bytes))
	}
	if batchErr != nil {
		status := FailureStatus(batchErr)
		if c.n > 0 {
			s.m.failed.WithLabelValues(c.op, status).Add(float64(c.n))
		}
		c.span.RecordError(batchErr)
		c.span.SetStatus(codes.Error, status)
		return
	}
	for _, err := range keyErrs {
		if keyFailed(err) {
			s.m.failed.WithLabelValues(c.op, FailureStatus(err)).Inc()
		}
	}
	if failedKeys > 0 {
		c.span.SetAttributes(attribute.Int("kvmesh.store.failed_keys", failedKeys))
	}
}

// keyFailed says whether a per-key error is a failure: a Put of a key
// already present (ErrExists) wrote nothing because nothing was needed.
func keyFailed(err error) bool { return err != nil && !errors.Is(err, ErrExists) }

// countErrs counts the failed keys of a call's per-key errors.
func countErrs(errs []error) int {
	n := 0
	for _, err := range errs {
		if keyFailed(err) {
			n++
		}
	}
	return n
}

// countTrue counts the true answers of an Exists call.
func countTrue(found []bool) int {
	n := 0
	for _, f := range found {
		if f {
			n++
		}
	}
	return n
}

// FailureStatus names the status label of a store error: one of the
// Status constants.
func FailureStatus(err error) string {
	switch {
	case errors.Is(err, ErrNotFound):
		return StatusNotFound
	case errors.Is(err, ErrNoSpace):
		return StatusNoSpace
	case errors.Is(err, ErrTooLarge):
		return StatusTooLarge
	case errors.Is(err, ErrClosed):
		return StatusClosed
	case errors.Is(err, context.DeadlineExceeded):
		return StatusTimeout
	case errors.Is(err, context.Canceled):
		return StatusCanceled
	case errors.Is(err, ErrUnavailable):
		return StatusUnavailable
	default:
		return StatusError
	}
}
