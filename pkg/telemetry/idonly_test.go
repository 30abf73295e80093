package telemetry_test

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// TestSetupWithoutReadersGivesIDsOnly: with no endpoint, span processor or
// sampler, spans record nothing but get the ids, flags and trace state an
// SDK provider with its default sampler (ParentBased(AlwaysSample)) gives.
func TestSetupWithoutReadersGivesIDsOnly(t *testing.T) {
	ctx := context.Background()
	shutdown, err := telemetry.Setup(ctx, telemetry.Options{ServiceName: "kvmesh-test"})
	if err != nil {
		t.Fatalf("Setup: %v", err)
	}
	defer func() {
		if err := shutdown(ctx); err != nil {
			t.Fatalf("shutdown: %v", err)
		}
	}()
	sdk := sdktrace.NewTracerProvider()
	defer func() { _ = sdk.Shutdown(ctx) }()
	ts, err := trace.ParseTraceState("vendor=x")
	if err != nil {
		t.Fatal(err)
	}
	parent := func(flags trace.TraceFlags) context.Context {
		return trace.ContextWithRemoteSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
			TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5}, TraceFlags: flags, TraceState: ts}))
	}
	cases := []struct {
		name string
		ctx  context.Context
		opts []trace.SpanStartOption
	}{
		{"root", ctx, nil},
		{"sampled parent", parent(trace.FlagsSampled), []trace.SpanStartOption{trace.WithAttributes(attribute.String("a", "b"))}},
		{"unsampled parent", parent(0), nil},
		{"new root under a parent", parent(trace.FlagsSampled), []trace.SpanStartOption{trace.WithNewRoot()}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sctx, span := otel.Tracer("test").Start(c.ctx, "op", c.opts...)
			_, want := sdk.Tracer("test").Start(c.ctx, "op", c.opts...)
			got, ws := span.SpanContext(), want.SpanContext()
			if span.IsRecording() {
				t.Error("span records: nothing would read it")
			}
			if !got.IsValid() || got.SpanID() == ws.SpanID() {
				t.Fatalf("span context %v: want a valid one with fresh ids", got)
			}
			if sameTrace, wantSame := got.TraceID() == trace.SpanContextFromContext(c.ctx).TraceID(), ws.TraceID() == trace.SpanContextFromContext(c.ctx).TraceID(); sameTrace != wantSame {
				t.Errorf("keeps the parent's trace id: %v, the SDK: %v", sameTrace, wantSame)
			}
			if got.TraceFlags() != ws.TraceFlags() || got.TraceState().String() != ws.TraceState().String() || got.IsRemote() {
				t.Errorf("flags %v state %q remote %v, the SDK's: %v %q %v", got.TraceFlags(), got.TraceState(), got.IsRemote(), ws.TraceFlags(), ws.TraceState(), ws.IsRemote())
			}
			if !trace.SpanContextFromContext(sctx).Equal(got) {
				t.Error("the returned context does not carry the span")
			}
			carrier := propagation.MapCarrier{}
			otel.GetTextMapPropagator().Inject(sctx, carrier)
			back := trace.SpanContextFromContext(otel.GetTextMapPropagator().Extract(ctx, carrier))
			if back.TraceID() != got.TraceID() || back.SpanID() != got.SpanID() || back.TraceFlags() != got.TraceFlags() {
				t.Errorf("propagated %v, want %v", carrier, got)
			}
			_, child := span.TracerProvider().Tracer("x").Start(sctx, "child")
			if child.SpanContext().TraceID() != got.TraceID() {
				t.Error("a child of the span is not in its trace")
			}
			span.End()
		})
	}
}
