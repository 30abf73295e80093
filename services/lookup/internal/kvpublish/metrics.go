package kvpublish

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Reasons a decoded record is not published, the reason label of
// kvmesh_lookup_kv_events_zmq_skipped_total.
const (
	// SkipForeign: a record without kvmesh's headers (no model or key
	// space to check it against).
	SkipForeign = "foreign"
	// SkipModel: a record of another model.
	SkipModel = "model"
	// SkipDeployment: a record of another deployment (key prefix) of the
	// model, or one whose keys are not store keys.
	SkipDeployment = "deployment"
	// SkipTenant: a record of another tenant's key space.
	SkipTenant = "tenant"
)

var skipReasons = []string{SkipForeign, SkipModel, SkipDeployment, SkipTenant}

// Metrics are the publisher's Prometheus families.
type Metrics struct {
	published      prometheus.Counter
	skipped        *prometheus.CounterVec
	decodeFailures prometheus.Counter
	replays        prometheus.Counter
	seq            prometheus.Gauge
	clearedBlocks  prometheus.Counter
	held           *prometheus.CounterVec
}

// NewMetrics registers the publisher's families on reg, every label value
// exported at 0 from the start.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		published: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_lookup_kv_events_zmq_published_total",
			Help: "KV-event batches (kvmesh.kv.events records) published on the ZMQ PUB socket.",
		}),
		skipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_lookup_kv_events_zmq_skipped_total",
			Help: "kvmesh.kv.events records not published, by reason (foreign: no kvmesh headers; model: another model; deployment: another key prefix; tenant: another tenant's key space).",
		}, []string{"reason"}),
		decodeFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_lookup_kv_events_zmq_decode_failures_total",
			Help: "kvmesh.kv.events records that could not be decoded (logged with topic, partition and offset, then skipped).",
		}),
		replays: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_lookup_kv_events_zmq_replay_requests_total",
			Help: "Replay requests answered on the ZMQ ROUTER socket.",
		}),
		seq: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_lookup_kv_events_zmq_next_seq",
			Help: "Sequence number the next published batch gets (batches published since the publisher started).",
		}),
		clearedBlocks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_lookup_kv_events_zmq_cleared_blocks_total",
			Help: "Block hashes announced removed after an AllBlocksCleared (KVMESH_LOOKUP_KV_EVENTS_ZMQ_CLEAR_AS_REMOVED), for routers that ignore AllBlocksCleared.",
		}),
		held: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_lookup_kv_events_zmq_held_total",
			Help: "BlockStored events held until their parent block was announced, by outcome (released: after their parent; expired: published anyway after the hold; dropped: a block of theirs was removed meanwhile).",
		}, []string{"outcome"}),
	}
	if err := telemetry.RegisterAll(reg, m.published, m.skipped, m.decodeFailures, m.replays, m.seq, m.clearedBlocks, m.held); err != nil {
		return nil, fmt.Errorf("kv events zmq publisher metrics: %w", err)
	}
	for _, r := range skipReasons {
		m.skipped.WithLabelValues(r)
	}
	for _, o := range heldOutcomes {
		m.held.WithLabelValues(o)
	}
	return m, nil
}
