package bus_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

func spanOfKind(spans []sdktrace.ReadOnlySpan, kind trace.SpanKind) sdktrace.ReadOnlySpan {
	for _, s := range spans {
		if s.SpanKind() == kind {
			return s
		}
	}
	return nil
}

func TestTraceContextFlowsFromProducerToConsumer(t *testing.T) {
	const topic, group = "bus.test.trace", "trace"
	rec := testenv.RecordSpans(t)
	e := newEnv(t)
	e.topics(topic)

	var headers seen[map[string]string]
	e.run(e.consumerConfig(group, topic), func(_ context.Context, m bus.Received) error {
		headers.add(m.Headers)
		return nil
	})
	e.publish(e.producer(), bus.Message{Topic: topic, Key: "req-1", Value: []byte("{}")})
	eventually(t, "the consumer span", func() bool { return spanOfKind(rec.Ended(), trace.SpanKindConsumer) != nil })

	spans := rec.Ended()
	producer, consumer := spanOfKind(spans, trace.SpanKindProducer), spanOfKind(spans, trace.SpanKindConsumer)
	if producer == nil {
		t.Fatalf("no producer span among %d spans", len(spans))
	}
	if producer.Name() != "send "+topic || consumer.Name() != "process "+topic {
		t.Errorf("span names %q, %q", producer.Name(), consumer.Name())
	}
	if consumer.SpanContext().TraceID() != producer.SpanContext().TraceID() {
		t.Fatalf("consumer trace %s != producer trace %s", consumer.SpanContext().TraceID(), producer.SpanContext().TraceID())
	}
	if consumer.Parent().SpanID() != producer.SpanContext().SpanID() {
		t.Errorf("consumer parent %s, want the producer span %s", consumer.Parent().SpanID(), producer.SpanContext().SpanID())
	}
	links := consumer.Links()
	if len(links) != 1 || links[0].SpanContext.SpanID() != producer.SpanContext().SpanID() {
		t.Errorf("consumer links %v, want one link to the producer span", links)
	}
	if tp := headers.snapshot()[0][contract.HeaderTraceparent]; tp == "" {
		t.Errorf("record headers carry no %s", contract.HeaderTraceparent)
	}
}

func TestPublishContinuesTheCallersTrace(t *testing.T) {
	const topic = "bus.test.trace-parent"
	rec := testenv.RecordSpans(t)
	e := newEnv(t)
	e.topics(topic)

	ctx, parent := otel.Tracer("test").Start(e.ctx, "request")
	if err := e.producer().Publish(ctx, bus.Message{Topic: topic, Value: []byte("x")}); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	parent.End()

	producer := spanOfKind(rec.Ended(), trace.SpanKindProducer)
	if producer == nil || producer.Parent().SpanID() != parent.SpanContext().SpanID() {
		t.Fatalf("producer span %v is not a child of the caller's span", producer)
	}
	// ExtractContext on the published headers yields the producer span.
	got := e.readAll(topic, 1)[0]
	h := map[string]string{}
	for _, kv := range got.Headers {
		h[kv.Key] = string(kv.Value)
	}
	sc := trace.SpanContextFromContext(bus.ExtractContext(context.Background(), h))
	if sc.SpanID() != producer.SpanContext().SpanID() || !sc.IsRemote() {
		t.Fatalf("extracted span context %v, want the producer span", sc)
	}
}

func TestPublishKeepsACarriedTraceAndLinksIt(t *testing.T) {
	const topic = "bus.test.trace-carried"
	rec := testenv.RecordSpans(t)
	e := newEnv(t)
	e.topics(topic)

	_, request := otel.Tracer("test").Start(e.ctx, "request")
	request.End()
	carried := map[string]string{}
	bus.InjectHeaders(trace.ContextWithSpan(e.ctx, request), carried)
	ctx, relay := otel.Tracer("test").Start(e.ctx, "relay")
	err := e.producer().Publish(ctx,
		bus.Message{Topic: topic, Key: "a", Value: []byte("carried"), Headers: carried},
		bus.Message{Topic: topic, Key: "b", Value: []byte("plain")})
	relay.End()
	if err != nil {
		t.Fatalf("Publish: %v", err)
	}

	producer := spanOfKind(rec.Ended(), trace.SpanKindProducer)
	if producer == nil {
		t.Fatal("no producer span")
	}
	links := producer.Links()
	if len(links) != 1 || links[0].SpanContext.SpanID() != request.SpanContext().SpanID() {
		t.Errorf("producer span links %v, want one link to the carried span", links)
	}
	want := map[string]trace.SpanID{"a": request.SpanContext().SpanID(), "b": producer.SpanContext().SpanID()}
	for _, got := range e.readAll(topic, 2) {
		h := map[string]string{}
		for _, kv := range got.Headers {
			h[kv.Key] = string(kv.Value)
		}
		sc := trace.SpanContextFromContext(bus.ExtractContext(context.Background(), h))
		if sc.SpanID() != want[string(got.Key)] {
			t.Errorf("record %s carries span %s, want %s", got.Key, sc.SpanID(), want[string(got.Key)])
		}
	}
}

// TestPublishWithoutASpanIsAChildOfTheFirstCarriedTrace publishes, as the
// outbox relay does, from a context without a span: a batch of two messages
// carrying the contexts of two requests and one carrying none. The producer
// span must join the first request's trace as a child of its span, link to
// the second, and leave the plain message without a trace context rather
// than pull it into the first request's trace.
func TestPublishWithoutASpanIsAChildOfTheFirstCarriedTrace(t *testing.T) {
	const topic = "bus.test.trace-batch"
	rec := testenv.RecordSpans(t)
	e := newEnv(t)
	e.topics(topic)

	carriedBy := func(name string) (trace.SpanContext, map[string]string) {
		_, s := otel.Tracer("test").Start(e.ctx, name)
		s.End()
		h := map[string]string{}
		bus.InjectHeaders(trace.ContextWithSpan(e.ctx, s), h)
		return s.SpanContext(), h
	}
	first, firstHeaders := carriedBy("request-1")
	second, secondHeaders := carriedBy("request-2")
	if first.TraceID() == second.TraceID() {
		t.Fatal("the two requests share a trace; the test needs two")
	}
	err := e.producer().Publish(e.ctx,
		bus.Message{Topic: topic, Key: "a", Value: []byte("1"), Headers: firstHeaders},
		bus.Message{Topic: topic, Key: "b", Value: []byte("2"), Headers: secondHeaders},
		bus.Message{Topic: topic, Key: "c", Value: []byte("plain")},
		bus.Message{Topic: topic, Key: "d", Value: []byte("1 again"), Headers: firstHeaders})
	if err != nil {
		t.Fatalf("Publish: %v", err)
	}

	producer := spanOfKind(rec.Ended(), trace.SpanKindProducer)
	if producer == nil {
		t.Fatal("no producer span")
	}
	if producer.Parent().SpanID() != first.SpanID() || producer.SpanContext().TraceID() != first.TraceID() {
		t.Errorf("producer span parent %s in trace %s, want the first request's span %s in trace %s",
			producer.Parent().SpanID(), producer.SpanContext().TraceID(), first.SpanID(), first.TraceID())
	}
	links := producer.Links()
	if len(links) != 1 || links[0].SpanContext.SpanID() != second.SpanID() {
		t.Errorf("producer span links %v, want one link, to the second request's span %s", links, second.SpanID())
	}
	want := map[string]string{"a": first.SpanID().String(), "b": second.SpanID().String(), "c": "", "d": first.SpanID().String()}
	for _, got := range e.readAll(topic, 4) {
		h := map[string]string{}
		for _, kv := range got.Headers {
			h[kv.Key] = string(kv.Value)
		}
		var span string
		if bus.CarriesTrace(h) {
			span = trace.SpanContextFromContext(bus.ExtractContext(context.Background(), h)).SpanID().String()
		}
		if span != want[string(got.Key)] {
			t.Errorf("record %s carries span %q, want %q", got.Key, span, want[string(got.Key)])
		}
	}
}

// TestPublishWithoutAnyTraceStartsOne checks that a publish with neither a
// span in ctx nor a carried context starts a new trace, rooted at its
// producer span, and carries it in the record.
func TestPublishWithoutAnyTraceStartsOne(t *testing.T) {
	const topic = "bus.test.trace-root"
	rec := testenv.RecordSpans(t)
	e := newEnv(t)
	e.topics(topic)
	e.publish(e.producer(), bus.Message{Topic: topic, Key: "k", Value: []byte("x")})

	producer := spanOfKind(rec.Ended(), trace.SpanKindProducer)
	if producer == nil || producer.Parent().IsValid() || len(producer.Links()) != 0 {
		t.Fatalf("producer span %v: want a root without links", producer)
	}
	got := e.readAll(topic, 1)[0]
	h := map[string]string{}
	for _, kv := range got.Headers {
		h[kv.Key] = string(kv.Value)
	}
	if sc := trace.SpanContextFromContext(bus.ExtractContext(context.Background(), h)); sc.SpanID() != producer.SpanContext().SpanID() {
		t.Errorf("record carries span %s, want the producer span %s", sc.SpanID(), producer.SpanContext().SpanID())
	}
}
