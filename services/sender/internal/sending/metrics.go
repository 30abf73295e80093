package sending

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// Results of a dead-letter replay, the result label of
// kvmesh_dlq_replays_total.
const (
	// ReplayReplayed: the entry was valid now and every key was saved.
	ReplayReplayed = "replayed"
	// ReplayAlready: the entry had been replayed before; nothing was done.
	ReplayAlready = "already"
	// ReplayInvalid: the entry is still invalid for the current model.
	ReplayInvalid = "invalid"
	// ReplayFailed: the entry was valid but the save did not complete.
	ReplayFailed = "failed"
	// ReplayDryRun: a dry run answered what a replay would do.
	ReplayDryRun = "dry_run"
	// ReplayError: the replay could not be attempted (entry missing,
	// database unavailable).
	ReplayError = "error"
)

// replayResults are the result label values, exported from the start.
var replayResults = []string{ReplayReplayed, ReplayAlready, ReplayInvalid, ReplayFailed, ReplayDryRun, ReplayError}

// deadLetterReasons are the reason codes the sender dead-letters with,
// exported at 0 from the start so that dashboards and alerts see every
// series before the first dead letter.
var deadLetterReasons = []string{
	string(kvcore.ReasonUndecodable), string(kvcore.ReasonHandlerPanic), string(kvcore.ReasonRetriesExhausted), string(kvcore.ReasonPlanFailed),
	string(kvcore.ReasonModelUnknown), string(kvcore.ReasonTokenRangeInvalid), string(kvcore.ReasonTableGroupCount),
	string(kvcore.ReasonGroupOutOfRange), string(kvcore.ReasonGroupMissing), string(kvcore.ReasonGroupDuplicate),
	string(kvcore.ReasonHashCountMismatch), string(kvcore.ReasonTokenIDsInvalid), string(kvcore.ReasonHashInvalid), string(kvcore.ReasonChunksMismatch),
	string(kvcore.ReasonTableTooShort), string(kvcore.ReasonNullBlock), string(kvcore.ReasonBlockOutOfRange),
	string(kvcore.ReasonExistsFailed), string(kvcore.ReasonPutFailed), string(kvcore.ReasonBlockNotHeld),
}

// Metrics are the sender's Prometheus families.
type Metrics struct {
	tasks       *prometheus.CounterVec
	groups      *prometheus.CounterVec
	deadLetters *prometheus.CounterVec
	pressure    prometheus.Gauge
	skipped     prometheus.Counter
	duplicates  prometheus.Counter
	bytes       *prometheus.CounterVec
	replays     *prometheus.CounterVec
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
			Help: "1 while some request is under store pressure (a put of it was answered no space and no put has succeeded since), else 0.",
		}),
		skipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_skipped_total",
			Help: "Store keys not saved: skipped for store pressure (while their request was under pressure, or answered no space) or for their tenant's quota (kvmesh_sender_quota_skipped_blocks_total has those by tenant); their request saves them again later.",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_duplicate_tasks_total",
			Help: "Redelivered save tasks whose outcome was already recorded (nothing re-published).",
		}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_sender_stored_bytes_total",
			Help: "Framed value bytes the gpuworkers stored for the sender, by model.",
		}, []string{"model"}),
		replays: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_dlq_replays_total",
			Help: "Dead-letter replay requests, by result (replayed, already, invalid, failed, dry_run, error).",
		}, []string{"result"}),
	}
	if err := telemetry.RegisterAll(reg, m.tasks, m.groups, m.deadLetters, m.pressure, m.skipped, m.duplicates, m.bytes, m.replays); err != nil {
		return nil, fmt.Errorf("sender metrics: %w", err)
	}
	for _, r := range deadLetterReasons {
		m.deadLetters.WithLabelValues(r)
	}
	for _, r := range replayResults {
		m.replays.WithLabelValues(r)
	}
	for _, st := range []string{"stored", "skipped", "dead_lettered", "failed", string(kvcore.ReasonUndecodable)} {
		m.tasks.WithLabelValues(st)
	}
	for _, o := range []string{"stored", "existing", "skipped", "dead_lettered", "failed"} {
		m.groups.WithLabelValues(o)
	}
	return m, nil
}

// countReplay counts one replay request with result.
func (m *Metrics) countReplay(result string) {
	m.replays.WithLabelValues(result).Inc()
}

// countOutcome counts a committed outcome: the task by its status and its
// groups by their outcomes.
func (m *Metrics) countOutcome(o *ledger.Outcome) {
	m.tasks.WithLabelValues(o.Result.Status).Inc()
	for name, n := range o.Groups {
		m.groups.WithLabelValues(name).Add(float64(n))
	}
}
