package database_test

import (
	"testing"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
)

// spanNamed returns the ended span called name in trace id, or nil.
func spanNamed(rec *tracetest.SpanRecorder, id trace.TraceID, name string) sdktrace.ReadOnlySpan {
	for _, s := range rec.Ended() {
		if s.SpanContext().TraceID() == id && s.Name() == name {
			return s
		}
	}
	return nil
}

func TestQueriesJoinTheCallersTraceOnly(t *testing.T) {
	rec := testenv.RecordSpans(t)
	pool := dbtest.NewPool(t)
	ctx, root := otel.Tracer("test").Start(t.Context(), "root")
	var one int
	if err := pool.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		t.Fatal(err)
	}
	root.End()
	if err := pool.QueryRow(t.Context(), "SELECT 2").Scan(&one); err != nil {
		t.Fatal(err)
	}

	id := root.SpanContext().TraceID()
	q := spanNamed(rec, id, "postgres SELECT")
	if q == nil || q.Parent().SpanID() != root.SpanContext().SpanID() {
		t.Fatalf("no postgres SELECT span under the caller's span: %v", q)
	}
	for _, s := range rec.Ended() {
		if s.SpanContext().TraceID() != id {
			t.Errorf("untraced query started trace %s with span %q", s.SpanContext().TraceID(), s.Name())
		}
	}
}

func TestRelayPublishContinuesTheEnqueuersTrace(t *testing.T) {
	rec := testenv.RecordSpans(t)
	pool := dbtest.NewPool(t)
	ctx, root := otel.Tracer("test").Start(t.Context(), "request")
	enqueue(t, ctx, pool, bus.Message{Topic: "kvmesh.test", Key: "k"})
	root.End()
	pub := &fakePublisher{}
	startRelay(t, pool, pub)
	waitFor(t, "the message", func() bool { return len(pub.published()) == 1 })

	id := root.SpanContext().TraceID()
	var relay sdktrace.ReadOnlySpan
	waitFor(t, "the relay span", func() bool {
		relay = spanNamed(rec, id, "outbox publish kvmesh.test")
		return relay != nil
	})
	if relay.Parent().SpanID() != root.SpanContext().SpanID() {
		t.Errorf("relay span's parent = %s, want the enqueuing span %s", relay.Parent().SpanID(), root.SpanContext().SpanID())
	}
	carried := trace.SpanContextFromContext(bus.ExtractContext(t.Context(), pub.published()[0].Headers))
	if carried.TraceID() != id || carried.SpanID() != relay.SpanContext().SpanID() {
		t.Errorf("published record carries %s/%s, want %s/%s", carried.TraceID(), carried.SpanID(), id, relay.SpanContext().SpanID())
	}
	if spanNamed(rec, id, "postgres batch") == nil && spanNamed(rec, id, "postgres INSERT") == nil {
		t.Error("the enqueue's database call has no span in the request's trace")
	}
}
