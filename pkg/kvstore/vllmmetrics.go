package kvstore

import (
	"context"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Names of the families vLLM's MooncakeStore connector exports for its store
// operations (MooncakeStorePromMetrics in vLLM's
// vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/metrics.py),
// which kvmesh serves next to its own kvmesh_store_* families so that
// dashboards and alerts written for vLLM work on kvmesh. The colon is part
// of vLLM's names; the Prometheus client accepts it in metric names.
const (
	// VLLMMetricOperationTime is the histogram of one operation's duration
	// in seconds.
	VLLMMetricOperationTime = "vllm:mooncake_store_operation_time_seconds"
	// VLLMMetricOperations counts operations.
	VLLMMetricOperations = "vllm:mooncake_store_operation_total"
	// VLLMMetricOperationKeys counts the keys operations touched.
	VLLMMetricOperationKeys = "vllm:mooncake_store_operation_keys_total"
	// VLLMMetricOperationBytes counts the value bytes operations moved.
	VLLMMetricOperationBytes = "vllm:mooncake_store_operation_bytes_total"
	// VLLMMetricOperationFailedKeys counts the keys that failed in
	// operations.
	VLLMMetricOperationFailedKeys = "vllm:mooncake_store_operation_failed_keys_total"
)

// Label names of the vLLM families: vLLM's base labels of every engine
// metric (PrometheusStatLogger's labelnames in vllm/v1/metrics/loggers.py,
// handed to KVConnectorPromMetrics) followed by the operation and its
// status, in vLLM's order.
const (
	// LabelModelName is vLLM's model_name: the served model's name.
	LabelModelName = "model_name"
	// LabelEngine is vLLM's engine label. vLLM puts its engine core index
	// there ("0"); kvmesh puts the engine id ("decode-0").
	LabelEngine = "engine"
	// LabelOperation is the store operation: save_exists, save_put,
	// load_get or lookup_exists.
	LabelOperation = "operation"
	// LabelStatus is the operation's status: one of the OpStatus values.
	LabelStatus = "status"
)

// Status values of the vLLM families' status label, as vLLM's store worker
// records them (vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py).
const (
	// OpStatusOK is an operation whose every key succeeded. An existence
	// check that finds keys absent is ok.
	OpStatusOK = "ok"
	// OpStatusPartialFailure is a Put or Get that answered but failed some
	// keys (a Get of a missing key, a Put refused for space or size); its
	// failed keys are those keys.
	OpStatusPartialFailure = "partial_failure"
	// OpStatusError is an operation that failed as a whole (the store was
	// unreachable, timed out or closed); every key of it counts as failed.
	OpStatusError = "error"
)

// vllmBuckets are vLLM's buckets of VLLMMetricOperationTime, in seconds.
var vllmBuckets = []float64{1e-3, 5e-3, 1e-2, 5e-2, 1e-1, 2e-1, 3e-1, 4e-1, 5e-1, 7.5e-1, 1.0, 1.5, 2.0, 3.0, 4.0}

// vllmLabelNames are the label names of every vLLM family.
var vllmLabelNames = []string{LabelModelName, LabelEngine, LabelOperation, LabelStatus}

// vllmFamilies are the vLLM families of one registry.
type vllmFamilies struct {
	time   *prometheus.HistogramVec
	calls  *prometheus.CounterVec
	keys   *prometheus.CounterVec
	bytes  *prometheus.CounterVec
	failed *prometheus.CounterVec
	// declared holds the vllmSeriesSet values whose series of every status
	// exist.
	declared sync.Map
}

// vllmSeriesSet names the series of one operation under one model and
// engine.
type vllmSeriesSet struct {
	model, engine, operation string
}

// Statuses an operation can end with: an existence check succeeds or fails
// as a whole (an absent key is an answer); a Put, Get or Remove can also
// fail some keys.
var (
	existsStatuses = []string{OpStatusOK, OpStatusError}
	batchStatuses  = []string{OpStatusOK, OpStatusPartialFailure, OpStatusError}
)

// newVLLMFamilies registers the vLLM families on reg, reusing those already
// registered there.
func newVLLMFamilies(reg prometheus.Registerer) (*vllmFamilies, error) {
	counter := func(name, help string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, vllmLabelNames)
	}
	f := &vllmFamilies{
		time: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    VLLMMetricOperationTime,
			Help:    "Histogram of Mooncake store communication time (kvmesh: one batched store call).",
			Buckets: vllmBuckets,
		}, vllmLabelNames),
		calls:  counter(VLLMMetricOperations, "Number of Mooncake store communication operations (kvmesh: batched store calls)."),
		keys:   counter(VLLMMetricOperationKeys, "Number of Mooncake store keys touched by operations."),
		bytes:  counter(VLLMMetricOperationBytes, "Number of bytes transferred by Mooncake store operations (kvmesh: framed value bytes)."),
		failed: counter(VLLMMetricOperationFailedKeys, "Number of Mooncake store keys that failed in operations."),
	}
	var err error
	if f.time, err = telemetry.RegisterOnce(reg, f.time); err != nil {
		return nil, err
	}
	for _, c := range []**prometheus.CounterVec{&f.calls, &f.keys, &f.bytes, &f.failed} {
		if *c, err = telemetry.RegisterOnce(reg, *c); err != nil {
			return nil, err
		}
	}
	return f, nil
}

// vllmOperation is one store operation as vLLM's connector records it
// (MooncakeStoreConnectorStats.record_operation): its name, duration, the
// keys it touched, the value bytes it moved, its status and its failed keys,
// and the statuses an operation of its kind can end with.
type vllmOperation struct {
	name       string
	statuses   []string
	seconds    float64
	keys       int
	bytes      int64
	status     string
	failedKeys int
}

// observe records op under labels l, as vLLM's MooncakeStorePromMetrics.observe
// records one operation record. The first operation of a name under a model
// and engine creates its series of every status at 0 first, so that
// rate() and increase() see the first failure (vLLM creates each series
// with its first record).
func (f *vllmFamilies) observe(l VLLMLabels, op vllmOperation) {
	f.declare(l, op.name, op.statuses)
	values := []string{l.ModelName, l.Engine, op.name, op.status}
	f.time.WithLabelValues(values...).Observe(op.seconds)
	f.calls.WithLabelValues(values...).Inc()
	f.keys.WithLabelValues(values...).Add(float64(op.keys))
	f.bytes.WithLabelValues(values...).Add(float64(op.bytes))
	f.failed.WithLabelValues(values...).Add(float64(op.failedKeys))
}

// declare creates the series of operation under l for each status, at 0,
// once.
func (f *vllmFamilies) declare(l VLLMLabels, operation string, statuses []string) {
	if _, done := f.declared.LoadOrStore(vllmSeriesSet{l.ModelName, l.Engine, operation}, true); done {
		return
	}
	for _, status := range statuses {
		values := []string{l.ModelName, l.Engine, operation, status}
		f.time.WithLabelValues(values...)
		f.calls.WithLabelValues(values...)
		f.keys.WithLabelValues(values...)
		f.bytes.WithLabelValues(values...)
		f.failed.WithLabelValues(values...)
	}
}

// VLLMLabels are the values of vLLM's base labels for the store calls of
// one wrapper or one context.
type VLLMLabels struct {
	// ModelName is the model_name label: the name of the model the service
	// runs (kvcore.Model.Name).
	ModelName string
	// Engine is the engine label: the id of the engine the call serves.
	Engine string
}

// merged returns l with the empty fields taken from def.
func (l VLLMLabels) merged(def VLLMLabels) VLLMLabels {
	if l.ModelName == "" {
		l.ModelName = def.ModelName
	}
	if l.Engine == "" {
		l.Engine = def.Engine
	}
	return l
}

// vllmLabelsKey is the context key of WithVLLMLabels.
type vllmLabelsKey struct{}

// WithVLLMLabels returns a copy of ctx whose store calls through an
// Instrumented store are recorded under l in the vLLM families: the
// non-empty fields of l override those of labels already in ctx and the
// wrapper's own (Instrumented.WithLabels). A service that serves many
// engines sets the engine of each call this way.
func WithVLLMLabels(ctx context.Context, l VLLMLabels) context.Context {
	return context.WithValue(ctx, vllmLabelsKey{}, l.merged(vllmLabelsFrom(ctx)))
}

// vllmLabelsFrom returns the labels WithVLLMLabels put in ctx.
func vllmLabelsFrom(ctx context.Context) VLLMLabels {
	l, _ := ctx.Value(vllmLabelsKey{}).(VLLMLabels)
	return l
}

// vllmStatus is the status label of a call that ended with batchErr or
// with failed per-key errors, as vLLM's store worker decides it.
func vllmStatus(batchErr error, failed int) string {
	switch {
	case batchErr != nil:
		return OpStatusError
	case failed > 0:
		return OpStatusPartialFailure
	default:
		return OpStatusOK
	}
}
