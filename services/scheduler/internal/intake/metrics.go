package intake

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// Metrics are the scheduler's record-handling metrics.
type Metrics struct {
	records      *prometheus.CounterVec
	duplicates   *prometheus.CounterVec
	tasks        *prometheus.CounterVec
	feedback     *prometheus.CounterVec
	errored      prometheus.Counter
	warnings     prometheus.Counter
	deadLetters  *prometheus.CounterVec
	applySeconds *prometheus.HistogramVec
	ranksExpired *prometheus.CounterVec
}

// NewMetrics registers the record-handling metrics on reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		records: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_records_total",
			Help: "Records consumed, by topic and result (applied, duplicate, stale, held, ignored, no_request, invalid).",
		}, []string{"topic", "result"}),
		duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_duplicates_total",
			Help: "Records ignored as repeats, by topic and by what showed it (id: the record id was applied; seq: an engine event at or below the request's last seq).",
		}, []string{"topic", "by"}),
		tasks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_tasks_emitted_total",
			Help: "Tasks written to the outbox, by kind (save, load) and model.",
		}, []string{"kind", "model"}),
		feedback: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_feedback_total",
			Help: "Engine feedback messages written to the outbox, by kind.",
		}, []string{"kind"}),
		errored: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_requests_errored_total",
			Help: "Requests stopped with an error (e.g. a block table with the wrong group count).",
		}),
		warnings: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_request_warnings_total",
			Help: "Problems with records that did not stop their request (kept as warnings on the request).",
		}),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_dead_letters_total",
			Help: "Records the scheduler could not apply, by topic and reason.",
		}, []string{"topic", "reason"}),
		applySeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvmesh_scheduler_apply_seconds",
			Help:    "Time to apply one record (one PostgreSQL transaction), by topic.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}, []string{"topic"}),
		ranksExpired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_load_ranks_expired_total",
			Help: "Worker ranks given up on: one per rank that had not reported a multi-rank load by its deadline (KVMESH_LOAD_RANK_TIMEOUT), by the connector of the load (store, pd).",
		}, []string{"connector"}),
	}
	if err := telemetry.RegisterAll(reg, m.records, m.duplicates, m.tasks, m.feedback, m.errored, m.warnings, m.deadLetters, m.applySeconds, m.ranksExpired); err != nil {
		return nil, fmt.Errorf("scheduler metrics: %w", err)
	}
	// Every dead-letter and duplicate series exists from the start, at 0,
	// for dashboards, alerts and readers of a replica's repeats.
	for _, topic := range Topics {
		for _, reason := range []kvcore.Reason{kvcore.ReasonUndecodable, kvcore.ReasonInvalidRecord, kvcore.ReasonDatabaseRejected, kvcore.ReasonPartsCorrupt, kvcore.ReasonHandlerPanic, kvcore.ReasonRetriesExhausted} {
			m.deadLetters.WithLabelValues(topic, string(reason))
		}
		m.records.WithLabelValues(topic, "applied")
		for _, by := range []string{"id", "seq"} {
			m.duplicates.WithLabelValues(topic, by)
		}
	}
	for _, connector := range []string{requeststate.ConnectorStore, requeststate.ConnectorPD} {
		m.ranksExpired.WithLabelValues(connector)
	}
	return m, nil
}

// DeadLettered counts one dead-lettered record.
func (m *Metrics) DeadLettered(topic string, reason kvcore.Reason) {
	m.deadLetters.WithLabelValues(topic, string(reason)).Inc()
}
