package sim

import (
	"context"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// maxStepBytes bounds the encoded request events of one step record, so
// that a record stays well below the producer's and the broker's 1 MiB
// message limit whatever the prompts' lengths: an admitted event of a 32K
// prompt carries 2048 block hashes, and a step that admits several such
// requests would not fit one record. A step whose events exceed it is
// split over several records, as one of more than contract.MaxStepRequests
// events is; an event larger than the bound on its own travels alone.
const maxStepBytes = 768 << 10

// stepSpanLinks bounds the request spans one step span links to.
const stepSpanLinks = 128

// outbox collects one step's request events in the order the engine
// produced them.
type outbox struct {
	events []contract.RequestEvent
	reqs   []*request // reqs[i] produced events[i]
}

func newOutbox() *outbox { return &outbox{} }

func (o *outbox) empty() bool { return len(o.events) == 0 }

// of returns the events of request r, in order.
func (o *outbox) of(r *request) []contract.RequestEvent {
	var out []contract.RequestEvent
	for i, q := range o.reqs {
		if q == r {
			out = append(out, o.events[i])
		}
	}
	return out
}

// event appends the request's next event, numbered by the request's own
// sequence and carrying the request's trace context.
func (e *engine) event(o *outbox, r *request, ev contract.RequestEvent) {
	r.seq++
	ev.RequestID, ev.Seq, ev.Traceparent = r.id, r.seq, r.traceparent
	o.events = append(o.events, ev)
	o.reqs = append(o.reqs, r)
}

// stepRecords builds the records of step number step of engine engineID
// from events, in order: one record, or several when the events are more
// than contract.MaxStepRequests or encode to more than maxBytes. The step
// id is "<engine>/<run tag>/<step>" for a step of one record and
// "<engine>/<run tag>/<step>.<part>" (part from 1) for each record of a
// split step, so it is unique per engine across runs (the run tag is) and
// the same when the step is published again after a failure.
func stepRecords(engineID, model, runTag string, step int64, events []contract.RequestEvent, maxEvents, maxBytes int) []contract.EngineStep {
	var parts [][]contract.RequestEvent
	start, bytes := 0, 0
	for i, ev := range events {
		n := len(mustJSON(ev)) + 1 // and its comma
		if i > start && (i-start >= maxEvents || bytes+n > maxBytes) {
			parts = append(parts, events[start:i])
			start, bytes = i, 0
		}
		bytes += n
	}
	if start < len(events) {
		parts = append(parts, events[start:])
	}
	base := fmt.Sprintf("%s/%s/%d", engineID, runTag, step)
	out := make([]contract.EngineStep, len(parts))
	for i, p := range parts {
		id := base
		if len(parts) > 1 {
			id = fmt.Sprintf("%s.%d", base, i+1)
		}
		out[i] = contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: id, EngineID: engineID, Model: model, Step: step,
			NullBlockID: declaredNullBlockID(), Requests: p}
	}
	return out
}

// publish sends the step's events as engine step records, keyed by the
// engine id (so that they stay in order on one partition), in one call
// retried for the request timeout; a retry publishes the same records
// (the same step ids), which the scheduler applies once. The records are
// published in a sim.step span under the engine's span that links to the
// requests' spans; each request event carries its request's own trace
// context (RequestEvent.Traceparent), which the scheduler continues.
func (e *engine) publish(ctx context.Context, o *outbox) error {
	if o.empty() {
		return nil
	}
	e.steps++
	recs := stepRecords(e.id, e.model.Name, e.runTag, e.steps, o.events, contract.MaxStepRequests, maxStepBytes)
	msgs := make([]bus.Message, len(recs))
	for i, rec := range recs {
		msgs[i] = bus.Message{Topic: contract.TopicEngineSteps, Key: e.id, Value: mustJSON(rec)}
	}
	sctx, span := e.stepSpan(ctx, o, len(recs))
	defer span.End()
	if err := retryFor(sctx, e.timeout, func() error { return e.pub.Publish(sctx, msgs...) }); err != nil {
		span.RecordError(err)
		return fmt.Errorf("engine %s: publish step %d (%d records): %w", e.id, e.steps, len(recs), err)
	}
	e.stats.engine(e.id, func(c *EngineCounts) { c.Steps++; c.StepRecords += len(recs); c.Events += len(o.events) })
	return nil
}

// stepSpan starts the span of one step's publish: a child of the engine's
// span (when the engine runs one), linked to the spans of the step's
// requests.
func (e *engine) stepSpan(ctx context.Context, o *outbox, records int) (context.Context, trace.Span) {
	if e.span != nil {
		ctx = trace.ContextWithSpan(ctx, e.span)
	}
	var links []trace.Link
	seen := map[*request]bool{}
	for _, r := range o.reqs {
		if seen[r] || r.ctx == nil || len(links) == stepSpanLinks {
			continue
		}
		seen[r] = true
		if l := trace.LinkFromContext(r.ctx); l.SpanContext.IsValid() {
			links = append(links, l)
		}
	}
	return otel.Tracer(tracerName).Start(ctx, "sim.step", trace.WithLinks(links...), trace.WithAttributes(
		attribute.String(telemetry.AttrEngineID, e.id), attribute.Int64("kvmesh.step", e.steps),
		attribute.Int("kvmesh.step_events", len(o.events)), attribute.Int("kvmesh.step_records", records),
	))
}

// traceparent renders the W3C trace context of ctx (the global
// propagator's traceparent), or "" when ctx carries none or no propagator
// is installed.
func traceparent(ctx context.Context) string {
	if ctx == nil {
		return ""
	}
	c := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(ctx, c)
	return c[contract.HeaderTraceparent]
}
