package sending

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the sender's Prometheus families.
type Metrics struct {
	tasks       *prometheus.CounterVec
	groups      *prometheus.CounterVec
	deadLetters *prometheus.CounterVec
	pressure    prometheus.Gauge
	skipped     prometheus.Counter
	duplicates  prometheus.Counter
	bytes       prometheus.Counter
}

// NewMetrics registers the sender's families on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		tasks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_sender_tasks_total",
			Help: "Save tasks completed, by status (stored, skipped, dead_lettered, failed; undecodable for records without a task id).",
		}, []string{"status"}),
		groups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_sender_groups_total",
			Help: "Groups of completed save tasks, by outcome (stored, existing, skipped, dead_lettered, failed).",
		}, []string{"outcome"}),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_dead_letters_total",
			Help: "Dead letters written, by reason code.",
		}, []string{"reason"}),
		pressure: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_sender_pressure_mode",
			Help: "1 while the sender is in pressure mode (the store answered no space), else 0.",
		}),
		skipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_skipped_total",
			Help: "Store keys not saved because of store pressure (skipped in pressure mode or answered no space).",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_duplicate_tasks_total",
			Help: "Redelivered save tasks whose outcome was already recorded (nothing re-published).",
		}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_stored_bytes_total",
			Help: "Framed value bytes the gpuworkers stored for the sender.",
		}),
	}
	for _, c := range []prometheus.Collector{m.tasks, m.groups, m.deadLetters, m.pressure, m.skipped, m.duplicates, m.bytes} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("sender metrics: %w", err)
		}
	}
	return m, nil
}
