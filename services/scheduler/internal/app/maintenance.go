package app

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"

	"github.com/kvmesh/kvmesh/services/scheduler/internal/api"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/intake"
)

// gauges are the metrics the maintenance task refreshes.
type gauges struct {
	trackers *prometheus.GaugeVec
	backlog  prometheus.Gauge
	failed   prometheus.Gauge
	purged   *prometheus.CounterVec
}

func newGauges(reg prometheus.Registerer) (*gauges, error) {
	g := &gauges{
		trackers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvmesh_scheduler_trackers",
			Help: "Request trackers in PostgreSQL, by state (refreshed every maintenance interval).",
		}, []string{"state"}),
		backlog: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_outbox_backlog",
			Help: "Outbox rows not yet published (refreshed every maintenance interval).",
		}),
		failed: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvmesh_outbox_failed",
			Help: "Outbox rows that can never be published and left the relay path, listed by GET /v1/outbox/failed (refreshed every maintenance interval).",
		}),
		purged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_scheduler_purged_total",
			Help: "Rows deleted by the retention purge, by table (trackers, idle_trackers, processed_records, outbox).",
		}, []string{"table"}),
	}
	if err := telemetry.RegisterAll(reg, g.trackers, g.backlog, g.failed, g.purged); err != nil {
		return nil, fmt.Errorf("scheduler metrics: %w", err)
	}
	return g, nil
}

// maintain refreshes the gauges and purges expired rows every
// MaintenanceInterval, and expires overdue multi-rank loads every
// expiryInterval, both starting at once, until ctx ends. A failed round is
// logged and the next one tries again.
func (a *App) maintain(ctx context.Context) error {
	t := time.NewTicker(a.cfg.MaintenanceInterval)
	defer t.Stop()
	e := time.NewTicker(a.expiryInterval())
	defer e.Stop()
	a.maintainRound(ctx)
	a.expireRound(ctx)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			a.maintainRound(ctx)
		case <-e.C:
			a.expireRound(ctx)
		}
	}
}

// expiryInterval is how often overdue loads are looked for:
// min(MaintenanceInterval, LoadRankTimeout/2), so a load whose ranks went
// silent is finished at most about 1.5 timeouts after it was issued.
func (a *App) expiryInterval() time.Duration {
	return max(min(a.cfg.MaintenanceInterval, a.cfg.LoadRankTimeout/2), time.Millisecond)
}

// maintainRound runs maintainOnce, logging a failure.
func (a *App) maintainRound(ctx context.Context) {
	if err := a.maintainOnce(ctx); err != nil && ctx.Err() == nil {
		a.deps.Log.WarnContext(ctx, "maintenance round failed", "err", err)
	}
}

// maxExpiryBatches bounds the batches of overdue loads one expiry round
// applies; the rest wait for the next round.
const maxExpiryBatches = 16

// expireRound runs ExpireLoads, logging a failure.
func (a *App) expireRound(ctx context.Context) {
	if _, err := a.ExpireLoads(ctx, time.Now()); err != nil && ctx.Err() == nil {
		a.deps.Log.WarnContext(ctx, "load expiry round failed", "err", err)
	}
}

// ExpireLoads runs one expiry round as of now, what the maintenance task
// does every min(KVMESH_MAINTENANCE_INTERVAL, KVMESH_LOAD_RANK_TIMEOUT/2):
// the multi-rank loads whose deadline passed are finished fail-closed
// (intake.Handler.ExpireLoads), batch after batch while batches come back
// full. It returns how many requests were found overdue.
func (a *App) ExpireLoads(ctx context.Context, now time.Time) (int, error) {
	total := 0
	for range maxExpiryBatches {
		n, err := a.handler.ExpireLoads(ctx, now, intake.ExpiryBatch)
		total += n
		if err != nil || n < intake.ExpiryBatch {
			return total, err
		}
	}
	return total, nil
}

// maintainOnce runs one round: counts, backlog, purge.
func (a *App) maintainOnce(ctx context.Context) error {
	counts, err := a.ledger.CountByState(ctx)
	if err != nil {
		return err
	}
	for _, s := range api.States {
		a.gauges.trackers.WithLabelValues(string(s)).Set(float64(counts[string(s)]))
	}
	backlog, err := a.relay.Backlog(ctx)
	if err != nil {
		return err
	}
	a.gauges.backlog.Set(float64(backlog))
	failed, err := a.relay.FailedCount(ctx)
	if err != nil {
		return err
	}
	a.gauges.failed.Set(float64(failed))
	p, err := a.ledger.Purge(ctx, a.cfg.TrackerRetention, a.cfg.TrackerIdleTimeout)
	if err != nil {
		return err
	}
	sent, err := a.relay.PurgeSent(ctx, a.cfg.TrackerRetention)
	if err != nil {
		return err
	}
	a.gauges.purged.WithLabelValues("trackers").Add(float64(p.Trackers))
	a.gauges.purged.WithLabelValues("idle_trackers").Add(float64(p.Idle))
	a.gauges.purged.WithLabelValues("processed_records").Add(float64(p.Records))
	a.gauges.purged.WithLabelValues("outbox").Add(float64(sent))
	if p.Trackers+p.Idle+p.Records+sent > 0 {
		a.deps.Log.InfoContext(ctx, "retention purge", "trackers", p.Trackers, "idle_trackers", p.Idle,
			"processed_records", p.Records, "outbox", sent)
	}
	return nil
}
