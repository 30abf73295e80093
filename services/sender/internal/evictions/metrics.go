package evictions

import (
	"fmt"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Reasons a removal notification was not mapped, the reason label of
// kvmesh_sender_evictions_unmapped_total.
const (
	// unmappedForeign: a well-formed store key of another deployment,
	// model or model layout (fingerprint) sharing the store pool.
	unmappedForeign = "foreign"
	// unmappedMalformed: a key that is not a kvmesh store key at all.
	unmappedMalformed = "malformed"
)

// Metrics are the watcher's Prometheus families.
type Metrics struct {
	removed  *prometheus.CounterVec
	age      *prometheus.HistogramVec
	ageless  *prometheus.CounterVec
	unlogged prometheus.Counter
	unmapped *prometheus.CounterVec
	gaps     prometheus.Counter
	cleared  prometheus.Counter
	leader   prometheus.Gauge
}

// NewMetrics registers the watcher's families on reg, every label value
// exported at 0 from the start.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		removed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_sender_block_removed_total",
			Help: "Store keys published as BlockRemoved on kvmesh.kv.events, by cause: the Redis event that removed them (evicted, expired, del), or quota (a del a tenant quota made).",
		}, []string{"cause"}),
		age: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvmesh_sender_removed_block_age_seconds",
			Help:    "Age of each block published as BlockRemoved (seconds since a gpuworker stored it), by cause and tenant (\"\" for none).",
			Buckets: []float64{1, 10, 60, 300, 900, 3600, 4 * 3600, 24 * 3600, 7 * 24 * 3600},
		}, []string{"cause", "tenant"}),
		ageless: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_sender_removed_blocks_without_age_total",
			Help: "Blocks published as BlockRemoved whose age is not known (no store time in the store's index: stored before it began, its write failed, or the index was removed), by cause.",
		}, []string{"cause"}),
		unlogged: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_removals_unlogged_total",
			Help: "BlockRemoved records published but not written to the removals log (GET /v1/removals), e.g. with PostgreSQL out of reach.",
		}),
		unmapped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_sender_evictions_unmapped_total",
			Help: "Redis removal notifications not published, by reason (foreign: another deployment's or model's key; malformed: not a kvmesh store key).",
		}, []string{"reason"}),
		gaps: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_evictions_gaps_total",
			Help: "Times the removal watcher lost its Redis subscription: removals until it resubscribed were not announced (pub/sub is at-most-once).",
		}),
		cleared: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvmesh_sender_evictions_cleared_total",
			Help: "AllBlocksCleared events published because the store was found flushed.",
		}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_sender_evictions_leader",
			Help: "1 while this sender replica is the one that watches the store's removals, else 0.",
		}),
	}
	if err := telemetry.RegisterAll(reg, m.removed, m.age, m.ageless, m.unlogged, m.unmapped, m.gaps, m.cleared, m.leader); err != nil {
		return nil, fmt.Errorf("eviction watcher metrics: %w", err)
	}
	for _, c := range append(slices.Clone(causes), CauseQuota) {
		m.removed.WithLabelValues(c)
		m.ageless.WithLabelValues(c)
		m.age.WithLabelValues(c, "") // the tenant-less key space's; tenants' appear with their first removal
	}
	for _, r := range []string{unmappedForeign, unmappedMalformed} {
		m.unmapped.WithLabelValues(r)
	}
	return m, nil
}

// countRemoved counts the blocks of one published batch: removed by cause,
// and each known age by cause and tenant.
func (m *Metrics) countRemoved(cause string, pb *pendingBatch) {
	m.removed.WithLabelValues(cause).Add(float64(len(pb.hashes)))
	if pb.ages == nil {
		m.ageless.WithLabelValues(cause).Add(float64(len(pb.hashes)))
		return
	}
	age := m.age.WithLabelValues(cause, pb.tenant)
	for _, a := range pb.ages {
		if a < 0 {
			m.ageless.WithLabelValues(cause).Inc()
			continue
		}
		age.Observe(a)
	}
}
