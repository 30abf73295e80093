package kvstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

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

// Metrics are the store metric families of one registry. Create them once
// per registry with NewMetrics and share them between Instrument wrappers.
type Metrics struct {
	duration *prometheus.HistogramVec
	keys     *prometheus.CounterVec
	failed   *prometheus.CounterVec
}

// NewMetrics registers the store families on reg. Families already
// registered there (another NewMetrics on the same registry) are reused.
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
	if duration, err = registerOnce(reg, duration); err != nil {
		return nil, err
	}
	if keys, err = registerOnce(reg, keys); err != nil {
		return nil, err
	}
	if failed, err = registerOnce(reg, failed); err != nil {
		return nil, err
	}
	return &Metrics{duration: duration, keys: keys, failed: failed}, nil
}

// registerOnce adds c to reg, or returns the equal collector already there.
func registerOnce[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	return c, fmt.Errorf("kvstore: register metrics: %w", err)
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
// not), the number of keys, and the failed keys by status. Ping and Close
// pass through unrecorded. An Exists answer of "absent" is not a failure; a
// Get or Remove of a missing key counts as failed with status not_found.
type Instrumented struct {
	next Store
	m    *Metrics
	ops  OpNames
}

var _ Store = (*Instrumented)(nil)

// Instrument wraps s so that its calls are recorded in m under ops.
func Instrument(s Store, m *Metrics, ops OpNames) *Instrumented {
	return &Instrumented{next: s, m: m, ops: ops.withDefaults()}
}

// Exists implements Store.
func (s *Instrumented) Exists(ctx context.Context, keys []string) ([]bool, error) {
	start := time.Now()
	found, err := s.next.Exists(ctx, keys)
	s.record(s.ops.Exists, start, len(keys), err, nil)
	return found, err
}

// Put implements Store.
func (s *Instrumented) Put(ctx context.Context, items []Item) ([]error, error) {
	start := time.Now()
	errs, err := s.next.Put(ctx, items)
	s.record(s.ops.Put, start, len(items), err, errs)
	return errs, err
}

// Get implements Store.
func (s *Instrumented) Get(ctx context.Context, keys []string) ([][]byte, []error, error) {
	start := time.Now()
	values, errs, err := s.next.Get(ctx, keys)
	s.record(s.ops.Get, start, len(keys), err, errs)
	return values, errs, err
}

// Remove implements Store.
func (s *Instrumented) Remove(ctx context.Context, keys []string) ([]error, error) {
	start := time.Now()
	errs, err := s.next.Remove(ctx, keys)
	s.record(s.ops.Remove, start, len(keys), err, errs)
	return errs, err
}

// Ping implements Store.
func (s *Instrumented) Ping(ctx context.Context) error { return s.next.Ping(ctx) }

// Close implements Store.
func (s *Instrumented) Close() error { return s.next.Close() }

// record observes one call of op over n keys that started at start.
func (s *Instrumented) record(op string, start time.Time, n int, batchErr error, keyErrs []error) {
	s.m.duration.WithLabelValues(op).Observe(time.Since(start).Seconds())
	s.m.keys.WithLabelValues(op).Add(float64(n))
	if batchErr != nil {
		if n > 0 {
			s.m.failed.WithLabelValues(op, FailureStatus(batchErr)).Add(float64(n))
		}
		return
	}
	for _, err := range keyErrs {
		if err != nil {
			s.m.failed.WithLabelValues(op, FailureStatus(err)).Inc()
		}
	}
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
