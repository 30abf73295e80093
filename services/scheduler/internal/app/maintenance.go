package app

import (
	"context"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/telemetry"

	"github.com/kvmesh/kvmesh/services/scheduler/internal/api"
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
// MaintenanceInterval, starting at once, until ctx ends. A failed round is
// logged and the next one tries again.
func (a *App) maintain(ctx context.Context) error {
	t := time.NewTicker(a.cfg.MaintenanceInterval)
	defer t.Stop()
	for {
		if err := a.maintainOnce(ctx); err != nil && ctx.Err() == nil {
			a.deps.Log.WarnContext(ctx, "maintenance round failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
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
