package intake

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// ExpiryBatch is the most overdue requests one ExpireLoads call applies
// (in one transaction).
const ExpiryBatch = 256

// ExpireLoads gives up on the ranks of multi-rank loads that did not all
// report by their deadline, as of now: up to limit requests with an
// overdue load (earliest deadline first) are applied through
// ledger.ApplyBatch, each as a unit of kind ledger.KindLoadExpiry, so the
// state change and its feedback (finished_recving with every block of the
// load in load_errors and the silent ranks in missing_ranks) commit
// together through the outbox, and a repeated expiry changes nothing. It
// returns how many requests it found overdue (limit: there may be more).
// When the batch fails, each request is applied alone, so one request the
// database refuses does not keep the others waiting.
func (h *Handler) ExpireLoads(ctx context.Context, now time.Time, limit int) (int, error) {
	now = now.UTC().Truncate(time.Microsecond)
	due, err := h.ledger.OverdueLoads(ctx, now, limit)
	if err != nil || len(due) == 0 {
		return 0, err
	}
	units := make([]ledger.Unit, len(due))
	runs := make([]run, len(due))
	for i, o := range due {
		r := &runs[i]
		rec := o.Record()
		r.start = spanStart{name: "scheduler.load_expiry", at: time.Now(), attrs: []attribute.KeyValue{
			attribute.String(telemetry.AttrEngineID, o.EngineID),
			attribute.String(telemetry.AttrRequestID, o.RequestID),
			attribute.String("kvmesh.record", "load expiry "+rec.ID),
		}}
		units[i] = ledger.Unit{Record: rec, Changes: []ledger.Change{{RequestID: o.RequestID,
			Event: requeststate.ExpiryEvent{Now: now, TaskIDs: o.TaskIDs},
			Emit: func(req *requeststate.Request, out requeststate.Outcome) ([]bus.Message, error) {
				h.begin(ctx, r, req)
				r.out = out
				return tracedMessages(r.ctx, out)
			}}}}
	}
	statuses, err := h.applyExpiries(ctx, units)
	for i := range runs {
		r := &runs[i]
		h.begin(ctx, r, nil)
		if statuses[i] == "" {
			r.span.SetStatus(codes.Error, "apply failed")
		} else {
			h.finishSpan(r, statuses[i])
		}
		if statuses[i] == ledger.Applied {
			h.observeExpiry(r, due[i].Key)
		}
		r.span.End()
	}
	return len(due), err
}

// applyExpiries applies units in one transaction or, when that fails,
// one at a time; a unit that failed has status "".
func (h *Handler) applyExpiries(ctx context.Context, units []ledger.Unit) ([]ledger.Status, error) {
	statuses, err := h.ledger.ApplyBatch(ctx, units)
	if err == nil {
		return statuses, nil
	}
	if len(units) == 1 || ctx.Err() != nil {
		return make([]ledger.Status, len(units)), fmt.Errorf("load expiry: %w", err)
	}
	statuses = make([]ledger.Status, len(units))
	var errs []error
	for i, u := range units {
		st, err := h.ledger.ApplyBatch(ctx, []ledger.Unit{u})
		if err != nil {
			errs = append(errs, fmt.Errorf("load expiry of %s/%s: %w", u.Record.EngineID, u.Record.RequestID, err))
			continue
		}
		statuses[i] = st[0]
	}
	return statuses, errors.Join(errs...)
}

// observeExpiry counts and logs what one applied expiry did.
func (h *Handler) observeExpiry(r *run, k ledger.Key) {
	for _, f := range r.out.Feedback {
		h.metrics.feedback.WithLabelValues(string(f.Kind)).Inc()
	}
	for _, e := range r.out.Expired {
		h.metrics.ranksExpired.WithLabelValues(e.Connector).Add(float64(len(e.Missing)))
		h.log.WarnContext(r.ctx, "load ranks did not report by the deadline: load finished with every block in error",
			"engine_id", k.EngineID, "request_id", k.RequestID, "task_id", e.TaskID, "connector", e.Connector,
			"missing_ranks", strings.Join(kvcore.RankNames(e.Missing), ","), "deadline", e.Deadline)
	}
}
