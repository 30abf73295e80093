package api

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Values of the result label of kvmesh_lookup_requests_total.
const (
	// ResultHit: answered with external tokens > 0.
	ResultHit = "hit"
	// ResultMiss: answered with 0 external tokens.
	ResultMiss = "miss"
	// ResultPending: answered "not yet".
	ResultPending = "pending"
	// ResultDisabled: lookup is disabled; answered 0.
	ResultDisabled = "disabled"
	// ResultInvalid: the request was refused with a 4xx.
	ResultInvalid = "invalid"
	// ResultPublishFailed: the decision could not be published; 503.
	ResultPublishFailed = "publish_failed"
	// ResultError: an unexpected failure; 500.
	ResultError = "error"
)

var allResults = []string{
	ResultHit, ResultMiss, ResultPending, ResultDisabled, ResultInvalid,
	ResultPublishFailed, ResultError,
}

// metrics are the lookup service's own families.
type metrics struct {
	requests  *prometheus.CounterVec
	hitTokens *prometheus.CounterVec
	asked     *prometheus.CounterVec
	duration  prometheus.Histogram
}

// newMetrics registers the lookup's families on reg, with the series of
// every served model (models) from the start.
func newMetrics(reg prometheus.Registerer, models []string) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_lookup_requests_total",
			Help: "Lookup requests, by result (hit, miss, pending, disabled, invalid, publish_failed, error); a failed store check fails open and is counted in kvmesh_lookup_child_failures_total.",
		}, []string{"result"}),
		hitTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_lookup_hit_tokens_total",
			Help: "External tokens answered by lookups (the chosen connector's counts), by model.",
		}, []string{"model"}),
		asked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_lookup_prompt_tokens_total",
			Help: "Prompt tokens answered lookups asked about beyond the engine's own computed tokens (the denominator of the external hit rate), by model.",
		}, []string{"model"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "kvmesh_lookup_duration_seconds",
			Help:    "Latency of answered lookups (200 responses) in seconds, from request to published decision.",
			Buckets: prometheus.ExponentialBucketsRange(0.0001, 10, 16),
		}),
	}
	if err := telemetry.RegisterAll(reg, m.requests, m.hitTokens, m.asked, m.duration); err != nil {
		return nil, fmt.Errorf("lookup metrics: %w", err)
	}
	for _, r := range allResults {
		m.requests.WithLabelValues(r)
	}
	for _, name := range models {
		m.hitTokens.WithLabelValues(name)
		m.asked.WithLabelValues(name)
	}
	return m, nil
}
