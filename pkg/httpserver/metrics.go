package httpserver

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Names of the HTTP metrics every server exports.
const (
	MetricRequests = "kvmesh_http_requests_total"
	MetricDuration = "kvmesh_http_request_duration_seconds"
)

// httpMetrics counts and times requests by method, route pattern and status.
type httpMetrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

// newHTTPMetrics registers the HTTP metrics and the Go and process
// collectors on reg. Collectors already registered there (another Server
// sharing the registry) are reused.
func newHTTPMetrics(reg *prometheus.Registry) (*httpMetrics, error) {
	labels := []string{"method", "route", "code"}
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricRequests,
		Help: "HTTP requests served, by method, route pattern and status code.",
	}, labels)
	duration := prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    MetricDuration,
		Help:    "HTTP request latency in seconds, by method, route pattern and status code.",
		Buckets: prometheus.DefBuckets,
	}, labels)
	var err error
	if requests, err = telemetry.RegisterOnce(reg, requests); err != nil {
		return nil, err
	}
	if duration, err = telemetry.RegisterOnce(reg, duration); err != nil {
		return nil, err
	}
	if _, err = telemetry.RegisterOnce(reg, collectors.NewGoCollector()); err != nil {
		return nil, err
	}
	if _, err = telemetry.RegisterOnce(reg, collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, err
	}
	return &httpMetrics{requests: requests, duration: duration}, nil
}

// observe records one request.
func (m *httpMetrics) observe(method, route string, status int, elapsed time.Duration) {
	code := strconv.Itoa(status)
	m.requests.WithLabelValues(method, route, code).Inc()
	m.duration.WithLabelValues(method, route, code).Observe(elapsed.Seconds())
}
