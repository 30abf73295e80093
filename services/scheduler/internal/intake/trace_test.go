package intake_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/intake"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
)

// traceFixture is a handler on a fresh database with every span recorded,
// and the traces of the requests the test plays.
type traceFixture struct {
	t      *testing.T
	h      *intake.Handler
	l      *ledger.Ledger
	m      *kvcore.Model
	rec    *tracetest.SpanRecorder
	traces map[string]trace.SpanContext // request id → the span its producer traced it under
}

func newTraceFixture(t *testing.T, requests ...string) *traceFixture {
	t.Helper()
	rec := testenv.RecordSpans(t)
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	metrics, err := intake.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	models, err := kvcore.NewModels("", m)
	if err != nil {
		t.Fatal(err)
	}
	l := ledger.New(dbtest.NewPool(t), m)
	f := &traceFixture{t: t, h: intake.NewHandler(l, models, metrics, slog.New(slog.NewTextHandler(io.Discard, nil)), intake.Options{}),
		l: l, m: m, rec: rec, traces: map[string]trace.SpanContext{}}
	for _, id := range requests {
		_, span := otel.Tracer("test").Start(context.Background(), "request "+id)
		f.traces[id] = span.SpanContext()
		span.End()
	}
	return f
}

// headers are the trace headers of request id's trace.
func (f *traceFixture) headers(id string) map[string]string {
	h := map[string]string{}
	bus.InjectHeaders(trace.ContextWithSpanContext(context.Background(), f.traces[id]), h)
	return h
}

// decision is a lookup decision record of request id, traced under its
// request's span.
func (f *traceFixture) decision(id string) bus.Received {
	v, err := json.Marshal(contract.LookupDecision{Schema: contract.SchemaLookupDecision, DecisionID: "d-" + id,
		EngineID: "e1", RequestID: id, Model: f.m.Name, NumTokens: 64})
	if err != nil {
		f.t.Fatal(err)
	}
	return bus.Received{Message: bus.Message{Topic: contract.TopicLookupDecisions, Key: id, Value: v, Headers: f.headers(id)}}
}

// step is an engine step record admitting each request; an event carries
// its request's traceparent when traced[id]. The record's own headers are
// the engine step's trace (shared by its requests).
func (f *traceFixture) step(stepID string, seq int64, engine trace.SpanContext, traced map[string]bool, ids ...string) bus.Received {
	st := contract.EngineStep{Schema: contract.SchemaEngineStep, StepID: stepID, EngineID: "e1", Model: f.m.Name}
	for _, id := range ids {
		ev := contract.RequestEvent{RequestID: id, Seq: seq, Kind: contract.EventAdmitted, PromptTokens: 64,
			BlockHashes: []string{fmt.Sprintf("%064x", 1)}}
		if traced[id] {
			ev.Traceparent = f.headers(id)[contract.HeaderTraceparent]
		}
		st.Requests = append(st.Requests, ev)
	}
	v, err := json.Marshal(st)
	if err != nil {
		f.t.Fatal(err)
	}
	h := map[string]string{}
	bus.InjectHeaders(trace.ContextWithSpanContext(context.Background(), engine), h)
	return bus.Received{Message: bus.Message{Topic: contract.TopicEngineSteps, Key: "e1", Value: v, Headers: h}}
}

// handle applies recs as one batch under a consumer span of its own (as
// bus.Consumer does) and returns that span's context.
func (f *traceFixture) handle(recs ...bus.Received) trace.SpanContext {
	f.t.Helper()
	ctx, span := otel.Tracer("test").Start(context.Background(), "process", trace.WithNewRoot())
	defer span.End()
	if err := f.h.HandleBatch(ctx, recs); err != nil {
		f.t.Fatalf("HandleBatch: %v", err)
	}
	return span.SpanContext()
}

// applies returns the scheduler.apply spans of request id, in order.
func (f *traceFixture) applies(id string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range f.rec.Ended() {
		if s.Name() != "scheduler.apply" {
			continue
		}
		for _, kv := range s.Attributes() {
			if kv.Key == "kvmesh.request_id" && kv.Value.AsString() == id {
				out = append(out, s)
			}
		}
	}
	return out
}

// linksTo reports whether s links to sc.
func linksTo(s sdktrace.ReadOnlySpan, sc trace.SpanContext) bool {
	for _, l := range s.Links() {
		if l.SpanContext.SpanID() == sc.SpanID() {
			return true
		}
	}
	return false
}

// TestBatchedApplySpansStayInTheirRequestsTraces: a batch of records of
// several requests is applied in one transaction, under one consumer span
// of its own trace; the apply span of each change must be in its own
// request's trace — an event's traceparent, a decision's headers, or the
// trace its tracker keeps from an earlier record — linked to the batch's
// span, never its child; a request never traced is a trace of its own. A
// record consumed alone stays under its consumer span, in its trace.
func TestBatchedApplySpansStayInTheirRequestsTraces(t *testing.T) {
	f := newTraceFixture(t, "a", "b", "engine")
	engine := f.traces["engine"]

	// a: traced by its event; b: by its decision, applied first in the
	// same batch, its event untraced; c: never traced.
	batch := f.handle(f.decision("b"), f.step("e1/1", 1, engine, map[string]bool{"a": true}, "a", "b", "c"))
	cases := []struct {
		request string
		want    trace.SpanContext // the parent; invalid: a root of its own trace
		n       int
	}{
		{"a", f.traces["a"], 1},
		{"b", f.traces["b"], 2},
		{"c", trace.SpanContext{}, 1},
	}
	for _, tc := range cases {
		spans := f.applies(tc.request)
		if len(spans) != tc.n {
			t.Fatalf("request %s: %d apply spans, want %d", tc.request, len(spans), tc.n)
		}
		for _, s := range spans {
			got := s.SpanContext().TraceID()
			switch {
			case got == batch.TraceID() || got == engine.TraceID():
				t.Errorf("request %s: apply span in the trace of shared work (batch %v, engine %v)", tc.request,
					got == batch.TraceID(), got == engine.TraceID())
			case tc.want.IsValid() && (got != tc.want.TraceID() || s.Parent().SpanID() != tc.want.SpanID()):
				t.Errorf("request %s: apply span in trace %s under %s, want trace %s under %s", tc.request,
					got, s.Parent().SpanID(), tc.want.TraceID(), tc.want.SpanID())
			case !tc.want.IsValid() && s.Parent().IsValid():
				t.Errorf("request %s (never traced): apply span has parent %s, want a root", tc.request, s.Parent().SpanID())
			}
			if !linksTo(s, batch) {
				t.Errorf("request %s: apply span does not link to the batch's span", tc.request)
			}
		}
	}

	// b's tracker keeps its trace: a later untraced event of b, in
	// another batch, is in b's trace.
	row, err := f.l.Get(context.Background(), ledger.Key{EngineID: "e1", RequestID: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if req, _ := row.Request(); req.Traceparent != f.headers("b")[contract.HeaderTraceparent] {
		t.Fatalf("b's tracker keeps trace context %q, want its decision's", req.Traceparent)
	}
	f.handle(f.step("e1/2", 2, engine, nil, "b", "a"))
	for _, id := range []string{"a", "b"} {
		spans := f.applies(id)
		last := spans[len(spans)-1]
		if last.SpanContext().TraceID() != f.traces[id].TraceID() {
			t.Errorf("request %s: untraced later event applied in trace %s, want its request's %s",
				id, last.SpanContext().TraceID(), f.traces[id].TraceID())
		}
	}

	// A record consumed alone: its consumer span is in the request's
	// trace, and the apply span is its child.
	f.traces["d"] = f.traces["a"]
	ctx, consumer := otel.Tracer("test").Start(trace.ContextWithRemoteSpanContext(context.Background(), f.traces["a"]), "process "+contract.TopicLookupDecisions)
	if err := f.h.HandleBatch(ctx, []bus.Received{f.decision("d")}); err != nil {
		t.Fatal(err)
	}
	consumer.End()
	if spans := f.applies("d"); len(spans) != 1 || spans[0].Parent().SpanID() != consumer.SpanContext().SpanID() {
		t.Fatalf("decision consumed alone: apply spans %d, want one under its consumer span", len(spans))
	}
}
