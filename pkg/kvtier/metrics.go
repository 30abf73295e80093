package kvtier

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Metric names of the tier (one set per service registry).
const (
	// MetricWrites counts write-behind copies by result: stored, failed,
	// dropped (the queue was full or the process was closing).
	MetricWrites = "kvmesh_tier_writes_total"
	// MetricWriteBytes counts the value bytes stored in the bucket.
	MetricWriteBytes = "kvmesh_tier_write_bytes_total"
	// MetricQueueBytes is the value bytes waiting to be written behind.
	MetricQueueBytes = "kvmesh_tier_write_queue_bytes"
	// MetricReads counts blocks read from the bucket by result: hit (the
	// reader accepted it), rejected (the reader's checks refused it),
	// miss, error.
	MetricReads = "kvmesh_tier_reads_total"
	// MetricReadBytes counts the value bytes read from the bucket.
	MetricReadBytes = "kvmesh_tier_read_bytes_total"
	// MetricPromoted counts blocks put back into Redis after a tier hit,
	// by result: stored, failed.
	MetricPromoted = "kvmesh_tier_promoted_total"
	// MetricConfirms counts the existence checks of keys Redis does not
	// hold, by result: present, absent, error (counted absent).
	MetricConfirms = "kvmesh_tier_confirms_total"
	// MetricOpDuration is the latency of one object call, by op.
	MetricOpDuration = "kvmesh_tier_op_duration_seconds"
)

// Metrics are the tier's metric families on one registry.
type Metrics struct {
	writes, reads, promoted, confirms *prometheus.CounterVec
	writeBytes, readBytes             prometheus.Counter
	queue                             prometheus.Gauge
	duration                          *prometheus.HistogramVec
}

// NewMetrics registers the tier families on reg (reusing those already
// there).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		writes:     prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricWrites, Help: "Blocks written behind Redis into the object tier, by result (stored, failed, dropped)."}, []string{"result"}),
		reads:      prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricReads, Help: "Blocks read from the object tier, by result (hit, rejected, miss, error)."}, []string{"result"}),
		promoted:   prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricPromoted, Help: "Blocks put back into Redis after a verified object-tier hit, by result (stored, failed)."}, []string{"result"}),
		confirms:   prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricConfirms, Help: "Existence checks in the object tier of keys Redis does not hold, by result (present, absent, error)."}, []string{"result"}),
		writeBytes: prometheus.NewCounter(prometheus.CounterOpts{Name: MetricWriteBytes, Help: "Value bytes stored in the object tier."}),
		readBytes:  prometheus.NewCounter(prometheus.CounterOpts{Name: MetricReadBytes, Help: "Value bytes read from the object tier."}),
		queue:      prometheus.NewGauge(prometheus.GaugeOpts{Name: MetricQueueBytes, Help: "Value bytes waiting to be written behind Redis into the object tier."}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: MetricOpDuration, Help: "Latency of one object-tier call in seconds, by op (put, get, head, remove).",
			Buckets: prometheus.ExponentialBucketsRange(0.0002, 10, 14)}, []string{"op"}),
	}
	var errs []error
	var err error
	for _, c := range []**prometheus.CounterVec{&m.writes, &m.reads, &m.promoted, &m.confirms} {
		*c, err = telemetry.RegisterOnce(reg, *c)
		errs = append(errs, err)
	}
	m.writeBytes, err = telemetry.RegisterOnce(reg, m.writeBytes)
	errs = append(errs, err)
	m.readBytes, err = telemetry.RegisterOnce(reg, m.readBytes)
	errs = append(errs, err)
	m.queue, err = telemetry.RegisterOnce(reg, m.queue)
	errs = append(errs, err)
	m.duration, err = telemetry.RegisterOnce(reg, m.duration)
	errs = append(errs, err)
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	for _, r := range []string{"stored", "failed", "dropped"} {
		m.writes.WithLabelValues(r)
	}
	for _, r := range []string{"hit", "rejected", "miss", "error"} {
		m.reads.WithLabelValues(r)
	}
	for _, r := range []string{"stored", "failed"} {
		m.promoted.WithLabelValues(r)
	}
	for _, r := range []string{"present", "absent", "error"} {
		m.confirms.WithLabelValues(r)
	}
	return m, nil
}
