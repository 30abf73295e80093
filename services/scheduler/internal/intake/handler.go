// Package intake is the scheduler's consumer side: it decodes the records of
// kvmesh.engine.steps, kvmesh.lookup.decisions and kvmesh.transfer.results,
// applies a batch of them in one ledger transaction through the request
// state machine, and turns the outcomes into outbox messages (save tasks,
// load tasks, engine feedback).
package intake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// Topics are the topics the scheduler consumes.
var Topics = []string{contract.TopicEngineSteps, contract.TopicLookupDecisions, contract.TopicTransferResults}

// Handler applies consumed records.
type Handler struct {
	ledger  *ledger.Ledger
	metrics *Metrics
	log     *slog.Logger
	tracer  trace.Tracer
	rules   rules
}

// Options are the operator's choices about what intake keeps.
type Options struct {
	// DropTokenIDs drops the token ids of every admitted event
	// (KVMESH_KV_EVENTS_TOKEN_IDS=false): they are neither stored with the
	// request nor put on its save tasks, so its BlockStored events carry
	// token_ids [] and token-keyed routers cannot index its blocks. A
	// malformed list still dead-letters its step.
	DropTokenIDs bool
}

// NewHandler returns a handler applying records to l for the served
// models.
func NewHandler(l *ledger.Ledger, models *kvcore.Models, metrics *Metrics, log *slog.Logger, opts Options) *Handler {
	for _, name := range models.Names() { // every served model's task series exist from the start
		for _, kind := range []string{"save", "load"} {
			metrics.tasks.WithLabelValues(kind, name)
		}
	}
	return &Handler{ledger: l, metrics: metrics, log: log, tracer: otel.Tracer("kvmesh/scheduler"),
		rules: rules{models: models, dropTokenIDs: opts.DropTokenIDs}}
}

// HandleBatch is the bus.BatchHandler: it decodes every record and applies
// the decodable ones in one ledger transaction (ledger.ApplyBatch). The
// records that cannot be decoded or are invalid fail permanently, alone
// (bus.RecordErrors: the consumer dead-letters them and commits the
// others). A failed transaction fails the whole batch: a database outage
// is transient (retried), data PostgreSQL rejects is permanent, and the
// consumer then applies the records one at a time to find the one at fault.
func (h *Handler) HandleBatch(ctx context.Context, recs []bus.Received) error {
	b := h.decodeBatch(recs)
	if len(b.items) > 0 {
		if err := h.apply(ctx, b); err != nil {
			return err
		}
	}
	if len(b.failed) > 0 {
		return b.failed
	}
	return nil
}

// batch is one consumed batch, decoded: its items, in record order, and
// the records that failed to decode, by index.
type batch struct {
	start  time.Time
	items  []item
	failed bus.RecordErrors
	// units are the items' ledger units and runs[i][j] the span and
	// outcome of item i's change j (prepare).
	units []ledger.Unit
	runs  [][]run
}

// decodeBatch decodes every record of a batch, counting those that fail.
func (h *Handler) decodeBatch(recs []bus.Received) batch {
	b := batch{start: time.Now(), items: make([]item, 0, len(recs)), failed: bus.RecordErrors{}}
	for i, rec := range recs {
		it, err := decode(rec, h.rules)
		if err != nil {
			h.metrics.records.WithLabelValues(rec.Topic, "invalid").Inc()
			b.failed[i] = err
			continue
		}
		b.items = append(b.items, it)
	}
	return b
}

// run is one change of a batch: its span, started once the change's
// request is locked (begin), and what applying it did.
type run struct {
	ctx  context.Context
	span trace.Span
	out  requeststate.Outcome
	// start is how the span starts: its name, attributes and start time,
	// and the trace context the record gave the request.
	start spanStart
}

// spanStart is what a change's span starts with.
type spanStart struct {
	name        string
	attrs       []attribute.KeyValue
	at          time.Time
	traceparent string
}

// apply applies a batch's items in one transaction and observes them.
func (h *Handler) apply(ctx context.Context, b batch) error {
	h.prepare(ctx, &b)
	items, start, runs := b.items, b.start, b.runs
	statuses, err := h.ledger.ApplyBatch(ctx, b.units)
	elapsed := time.Since(start)
	for i, it := range items {
		for j := range runs[i] {
			r := &runs[i][j]
			h.begin(ctx, r, nil) // a change that found no request, or a duplicate
			if err != nil {
				r.span.RecordError(err)
				r.span.SetStatus(codes.Error, "apply failed")
			} else {
				h.finishSpan(r, statuses[i])
				h.logOutcome(r.ctx, it, it.changes[j], r.out)
			}
			r.span.End()
		}
		if err == nil {
			h.observe(it.topic, statuses[i], runs[i], elapsed/time.Duration(len(items)))
		}
	}
	if err != nil {
		return classifyApply(err)
	}
	return nil
}

// prepare builds the ledger units of a batch's items, one change per
// request event: the change's typed event, which the ledger applies
// through requeststate.Request.Apply, and its Emit, which starts the
// change's span once its request is locked and turns the outcome into
// outbox messages.
func (h *Handler) prepare(ctx context.Context, b *batch) {
	b.units = make([]ledger.Unit, len(b.items))
	b.runs = make([][]run, len(b.items))
	for i, it := range b.items {
		b.runs[i] = make([]run, len(it.changes))
		b.units[i] = ledger.Unit{Record: it.record, Changes: make([]ledger.Change, len(it.changes))}
		for j, c := range it.changes {
			r := &b.runs[i][j]
			r.start = h.applyStart(it.topic, it, c, b.start)
			b.units[i].Changes[j] = ledger.Change{RequestID: c.requestID, Create: c.create, Event: c.event,
				Emit: func(req *requeststate.Request, out requeststate.Outcome) ([]bus.Message, error) {
					h.begin(ctx, r, req)
					r.out = out
					return tracedMessages(r.ctx, out)
				}}
		}
	}
}

// classifyApply sorts a failed transaction: data PostgreSQL refuses
// (SQLSTATE class 22, data exception, or 23, integrity constraint) and a
// tracker whose stored parts disagree with its row are permanent (retrying
// cannot help, and the record must not stall its partition); anything else
// (an outage, a deadlock, a timeout) is transient.
func classifyApply(err error) error {
	if pe, ok := errors.AsType[*pgconn.PgError](err); ok && (strings.HasPrefix(pe.Code, "22") || strings.HasPrefix(pe.Code, "23")) {
		return bus.Permanent(kvcore.ReasonDatabaseRejected, err)
	}
	if errors.Is(err, ledger.ErrPartsCorrupt) {
		return bus.Permanent(kvcore.ReasonPartsCorrupt, err)
	}
	return bus.Transient(err)
}

// applyStart is how the span of one change of a consumed record starts.
func (h *Handler) applyStart(topic string, it item, c change, at time.Time) spanStart {
	attrs := []attribute.KeyValue{
		attribute.String("messaging.destination.name", topic),
		attribute.String(telemetry.AttrEngineID, it.record.EngineID),
		attribute.String(telemetry.AttrRequestID, c.requestID),
		attribute.String("kvmesh.record", it.label),
	}
	if c.label != it.label {
		attrs = append(attrs, attribute.String("kvmesh.change", c.label))
	}
	return spanStart{name: "scheduler.apply", attrs: attrs, at: at, traceparent: c.traceparent}
}

// begin starts r's span, once, in its request's trace: a child of the
// trace context the record gave the request, else of the one the
// request's tracker keeps (req is the locked request; nil when the change
// found none), else the root of a trace of its own. Work shared by the
// requests of a batch — the consumer span of ctx, under which the
// transaction runs — is linked, never the parent, unless it is in the
// request's trace itself (a record consumed alone: its consumer span, a
// child of the producer's, is the parent). A tracker that keeps no trace
// context yet keeps the record's, so the request's later records that
// carry none (an engine that does not trace, a load expiry) join the
// trace.
func (h *Handler) begin(ctx context.Context, r *run, req *requeststate.Request) {
	if r.span != nil {
		return
	}
	given := bus.ParseTraceparent(r.start.traceparent)
	parent := given
	if !parent.IsValid() && req != nil {
		parent = bus.ParseTraceparent(req.Traceparent)
	}
	opts := []trace.SpanStartOption{trace.WithTimestamp(r.start.at), trace.WithAttributes(r.start.attrs...)}
	shared := trace.SpanContextFromContext(ctx)
	switch {
	case shared.IsValid() && parent.IsValid() && shared.TraceID() == parent.TraceID():
		// The consumer span of a record consumed alone, in its trace.
	case parent.IsValid():
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
		opts = append(opts, linkTo(shared)...)
	default:
		opts = append(opts, trace.WithNewRoot())
		opts = append(opts, linkTo(shared)...)
	}
	r.ctx, r.span = h.tracer.Start(ctx, r.start.name, opts...)
	if req != nil {
		r.span.SetAttributes(attribute.String("kvmesh.model", req.Store.Model))
	}
	if req != nil && req.Traceparent == "" && given.IsValid() {
		req.Traceparent = r.start.traceparent
	}
}

// linkTo is the option linking a span to sc, when sc is a span.
func linkTo(sc trace.SpanContext) []trace.SpanStartOption {
	if !sc.IsValid() {
		return nil
	}
	return []trace.SpanStartOption{trace.WithLinks(trace.Link{SpanContext: sc})}
}

// finishSpan records a committed change's result on its span.
func (h *Handler) finishSpan(r *run, status ledger.Status) {
	r.span.SetAttributes(attribute.String("kvmesh.result", resultLabel(status, r.out)),
		attribute.Int("kvmesh.saves", len(r.out.Saves)), attribute.Int("kvmesh.loads", len(r.out.Loads)))
}

// tracedMessages is Messages with the trace context of ctx (the change's
// span) in every message's headers.
func tracedMessages(ctx context.Context, out requeststate.Outcome) ([]bus.Message, error) {
	msgs, err := Messages(out)
	if err != nil {
		return nil, err
	}
	for i := range msgs {
		msgs[i].Headers = map[string]string{}
		bus.InjectHeaders(ctx, msgs[i].Headers)
	}
	return msgs, nil
}

// observe counts one applied record (its changes' outcomes together).
func (h *Handler) observe(topic string, status ledger.Status, runs []run, elapsed time.Duration) {
	h.metrics.applySeconds.WithLabelValues(topic).Observe(elapsed.Seconds())
	if status != ledger.Applied || len(runs) == 0 {
		h.countResult(topic, string(status))
	}
	for i := range runs {
		out := runs[i].out
		if status == ledger.Applied {
			h.countResult(topic, resultLabel(status, out))
		}
		for _, t := range out.Saves {
			h.metrics.tasks.WithLabelValues("save", t.Model).Inc()
		}
		for _, t := range out.Loads {
			h.metrics.tasks.WithLabelValues("load", t.Model).Inc()
		}
		for _, f := range out.Feedback {
			h.metrics.feedback.WithLabelValues(string(f.Kind)).Inc()
		}
		if out.Errored {
			h.metrics.errored.Inc()
		}
		if n := len(out.Errors); n > 0 && !out.Errored {
			h.metrics.warnings.Add(float64(n))
		}
	}
}

// countResult counts one record (or one change of a step) by result.
func (h *Handler) countResult(topic, result string) {
	h.metrics.records.WithLabelValues(topic, result).Inc()
	switch result {
	case "duplicate":
		h.metrics.duplicates.WithLabelValues(topic, "id").Inc()
	case "stale":
		h.metrics.duplicates.WithLabelValues(topic, "seq").Inc()
	}
}

// resultLabel is the records_total result of one record.
func resultLabel(status ledger.Status, out requeststate.Outcome) string {
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
func (h *Handler) logOutcome(ctx context.Context, it item, c change, out requeststate.Outcome) {
	if len(out.Errors) == 0 {
		return
	}
	level := slog.LevelInfo
	msg := "record caused a request warning"
	if out.Errored {
		level, msg = slog.LevelWarn, "request errored"
	}
	h.log.Log(ctx, level, msg, "engine_id", it.record.EngineID, "request_id", c.requestID,
		"record", it.label, "change", c.label, "error", errors.Join(out.Errors...))
}

// Messages turns an outcome into outbox messages: save tasks keyed by
// request id, load tasks and feedback keyed by engine id.
func Messages(out requeststate.Outcome) ([]bus.Message, error) {
	msgs := make([]bus.Message, 0, len(out.Saves)+len(out.Loads)+len(out.Feedback))
	// Tasks are written by their own encoders (kvcore's AppendJSON: the
	// bytes encoding/json would write, in one pass).
	for i := range out.Saves {
		s := &out.Saves[i]
		msgs = append(msgs, bus.Message{Topic: contract.TopicSaveTasks, Key: s.RequestID, Value: s.MarshalJSONFast()})
	}
	for i := range out.Loads {
		l := &out.Loads[i]
		msgs = append(msgs, bus.Message{Topic: contract.TopicLoadTasks, Key: l.EngineID, Value: l.AppendJSON(make([]byte, 0, 1024))})
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
