// Package intake is the scheduler's consumer side: it decodes the records of
// kvmesh.engine.events, kvmesh.lookup.decisions and kvmesh.transfer.results,
// applies each in one ledger transaction through the request state machine,
// and turns the outcome into outbox messages (save tasks, load tasks,
// engine feedback).
package intake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/tracking"
)

// Topics are the topics the scheduler consumes.
var Topics = []string{contract.TopicEngineEvents, contract.TopicLookupDecisions, contract.TopicTransferResults}

// Handler applies consumed records.
type Handler struct {
	ledger  *ledger.Ledger
	model   *kvcore.Model
	metrics *Metrics
	log     *slog.Logger
	tracer  trace.Tracer
}

// NewHandler returns a handler applying records to l for model m.
func NewHandler(l *ledger.Ledger, m *kvcore.Model, metrics *Metrics, log *slog.Logger) *Handler {
	return &Handler{ledger: l, model: m, metrics: metrics, log: log, tracer: otel.Tracer("kvmesh/scheduler")}
}

// Handle is the bus.Handler: it applies one record in one transaction.
// Undecodable or invalid records fail permanently (dead-lettered); database
// failures are transient (retried, the offset is not committed).
func (h *Handler) Handle(ctx context.Context, rec bus.Received) error {
	start := time.Now()
	it, err := decode(rec)
	if err != nil {
		h.metrics.records.WithLabelValues(rec.Topic, "invalid").Inc()
		return err
	}
	ctx, span := h.tracer.Start(ctx, "scheduler.apply", trace.WithAttributes(
		attribute.String("messaging.destination.name", rec.Topic),
		attribute.String("kvmesh.engine_id", it.record.EngineID),
		attribute.String("kvmesh.request_id", it.record.RequestID),
		attribute.String("kvmesh.record", it.label),
		attribute.String("kvmesh.model", h.model.Name),
	))
	defer span.End()
	var out tracking.Outcome
	status, err := h.ledger.Apply(ctx, it.record, func(req *tracking.Request) ([]bus.Message, error) {
		out = it.apply(h.model, req)
		return Messages(out)
	})
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "apply failed")
		return bus.Transient(err)
	}
	result := h.observe(rec.Topic, status, out, time.Since(start))
	span.SetAttributes(attribute.String("kvmesh.result", result),
		attribute.Int("kvmesh.saves", len(out.Saves)), attribute.Int("kvmesh.loads", len(out.Loads)))
	h.logOutcome(ctx, it, out)
	return nil
}

// observe counts one applied record and returns its result label.
func (h *Handler) observe(topic string, status ledger.Status, out tracking.Outcome, elapsed time.Duration) string {
	h.metrics.applySeconds.WithLabelValues(topic).Observe(elapsed.Seconds())
	result := resultLabel(status, out)
	h.metrics.records.WithLabelValues(topic, result).Inc()
	switch result {
	case "duplicate":
		h.metrics.duplicates.WithLabelValues(topic, "id").Inc()
	case "stale":
		h.metrics.duplicates.WithLabelValues(topic, "seq").Inc()
	}
	h.metrics.tasks.WithLabelValues("save").Add(float64(len(out.Saves)))
	h.metrics.tasks.WithLabelValues("load").Add(float64(len(out.Loads)))
	for _, f := range out.Feedback {
		h.metrics.feedback.WithLabelValues(string(f.Kind)).Inc()
	}
	if out.Errored {
		h.metrics.errored.Inc()
	}
	if n := len(out.Errors); n > 0 && !out.Errored {
		h.metrics.warnings.Add(float64(n))
	}
	return result
}

// resultLabel is the records_total result of one record.
func resultLabel(status ledger.Status, out tracking.Outcome) string {
	switch {
	case status != ledger.Applied:
		return string(status)
	case out.Stale:
		return "stale"
	case out.Held:
		return "held"
	case out.Ignored != "":
		return "ignored"
	}
	return "applied"
}

// logOutcome logs a request that errored (warn) and other problems (info).
func (h *Handler) logOutcome(ctx context.Context, it item, out tracking.Outcome) {
	if len(out.Errors) == 0 {
		return
	}
	level := slog.LevelInfo
	msg := "record caused a request warning"
	if out.Errored {
		level, msg = slog.LevelWarn, "request errored"
	}
	h.log.Log(ctx, level, msg, "engine_id", it.record.EngineID, "request_id", it.record.RequestID,
		"record", it.label, "error", errors.Join(out.Errors...))
}

// Messages turns an outcome into outbox messages: save tasks keyed by
// request id, load tasks and feedback keyed by engine id.
func Messages(out tracking.Outcome) ([]bus.Message, error) {
	msgs := make([]bus.Message, 0, len(out.Saves)+len(out.Loads)+len(out.Feedback))
	for _, s := range out.Saves {
		m, err := message(contract.TopicSaveTasks, s.RequestID, s)
		if err != nil {
			return nil, err
		}
		msgs = append(msgs, m)
	}
	for _, l := range out.Loads {
		m, err := message(contract.TopicLoadTasks, l.EngineID, l)
		if err != nil {
			return nil, err
		}
		msgs = append(msgs, m)
	}
	for _, f := range out.Feedback {
		m, err := message(contract.TopicEngineFeedback, f.EngineID, f)
		if err != nil {
			return nil, err
		}
		msgs = append(msgs, m)
	}
	return msgs, nil
}

func message(topic, key string, v any) (bus.Message, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return bus.Message{}, fmt.Errorf("encode %s message: %w", topic, err)
	}
	return bus.Message{Topic: topic, Key: key, Value: b}, nil
}

// DeadLetter is the consumer's OnDeadLetter hook: it keeps the record in
// the scheduler's dead-letter table and counts it.
func (h *Handler) DeadLetter(ctx context.Context, rec bus.Received, reason string, cause error) error {
	detail := ""
	if cause != nil {
		detail = cause.Error()
	}
	err := h.ledger.AddDeadLetter(ctx, ledger.DeadLetter{
		Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset, Key: rec.Key,
		Reason: reason, Detail: detail, Payload: rec.Value,
	})
	if err != nil {
		return err
	}
	h.metrics.DeadLettered(rec.Topic, reason)
	return nil
}
