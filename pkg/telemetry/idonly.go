package telemetry

import (
	"context"
	"encoding/binary"
	"math/rand/v2"

	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/embedded"
	"go.opentelemetry.io/otel/trace/noop"
)

// idOnlyProvider is the tracer provider Setup installs when no span can
// be read: no endpoint, no span processor and the default sampler. An SDK
// provider would then record every span's name, attributes, events and
// links and drop them at End; this one only gives each span the ids an
// SDK provider with ParentBased(AlwaysSample) would — a child keeps its
// parent's trace id, flags and trace state, a root (or WithNewRoot) gets
// a new trace id and is sampled — so trace context still propagates
// across hops and appears in logs. Its spans are not recording
// (IsRecording false), so callers that check skip their attributes too.
type idOnlyProvider struct{ embedded.TracerProvider }

// Tracer implements trace.TracerProvider.
func (idOnlyProvider) Tracer(string, ...trace.TracerOption) trace.Tracer { return idOnlyTracer{} }

type idOnlyTracer struct{ embedded.Tracer }

// Start implements trace.Tracer: a span with fresh ids, child of the span
// in ctx unless the options ask for a new root.
func (idOnlyTracer) Start(ctx context.Context, _ string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	var parent trace.SpanContext
	if cfg := trace.NewSpanStartConfig(opts...); !cfg.NewRoot() {
		parent = trace.SpanContextFromContext(ctx)
	}
	cfg := trace.SpanContextConfig{TraceFlags: trace.FlagsSampled}
	if parent.TraceID().IsValid() {
		cfg.TraceID = parent.TraceID()
		cfg.TraceFlags = parent.TraceFlags() // ParentBased: sampled iff the parent is
		cfg.TraceState = parent.TraceState()
	} else {
		binary.BigEndian.PutUint64(cfg.TraceID[:8], rand.Uint64())
		binary.BigEndian.PutUint64(cfg.TraceID[8:], rand.Uint64())
		cfg.TraceState = parent.TraceState()
	}
	for !cfg.SpanID.IsValid() {
		binary.BigEndian.PutUint64(cfg.SpanID[:], rand.Uint64())
	}
	for !cfg.TraceID.IsValid() { // all zero: 2^-128
		binary.BigEndian.PutUint64(cfg.TraceID[8:], rand.Uint64())
	}
	s := idOnlySpan{sc: trace.NewSpanContext(cfg)}
	return trace.ContextWithSpan(ctx, s), s
}

// idOnlySpan is a span that is not recording, with its own span context.
type idOnlySpan struct {
	noop.Span
	sc trace.SpanContext
}

// SpanContext implements trace.Span.
func (s idOnlySpan) SpanContext() trace.SpanContext { return s.sc }

// TracerProvider implements trace.Span.
func (idOnlySpan) TracerProvider() trace.TracerProvider { return idOnlyProvider{} }
