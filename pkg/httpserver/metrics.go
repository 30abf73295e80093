package httpserver

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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
	if requests, err = register(reg, requests); err != nil {
		return nil, err
	}
	if duration, err = register(reg, duration); err != nil {
		return nil, err
	}
	if _, err = register(reg, collectors.NewGoCollector()); err != nil {
		return nil, err
	}
	if _, err = register(reg, collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		return nil, err
	}
	return &httpMetrics{requests: requests, duration: duration}, nil
}

// register adds c to reg, or returns the equal collector already there.
func register[C prometheus.Collector](reg *prometheus.Registry, c C) (C, error) {
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
	return c, fmt.Errorf("httpserver: register metrics: %w", err)
}

// observe records one request.
func (m *httpMetrics) observe(method, route string, status int, elapsed time.Duration) {
	code := strconv.Itoa(status)
	m.requests.WithLabelValues(method, route, code).Inc()
	m.duration.WithLabelValues(method, route, code).Observe(elapsed.Seconds())
}
