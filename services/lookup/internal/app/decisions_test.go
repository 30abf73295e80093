package app_test

import (
	"context"
	"reflect"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestDecisionPublishedWithTraceContext checks that an answered lookup's
// decision is on kvmesh.lookup.decisions, keyed by request id, equal to
// the answer, with a traceparent continuing the engine's trace, and that
// the lookup span carries the request's attributes.
func TestDecisionPublishedWithTraceContext(t *testing.T) {
	rec := testenv.RecordSpans(t)
	env := servicetest.NewEnv(t)
	seed := newSeeder(t, env.RedisURL)
	s := startLookup(t, env, map[string]string{
		"KVMESH_MODEL": writeSpec(t, specDense), "KVMESH_LOOKUP_CONNECTORS": "pd,store",
	})
	decisions := readDecisions(t, env.Brokers)
	toks := tokens(48, 201)
	seed.put(t, groupKeys(s.keys(), 0, kvcore.HashChain(toks, 16, nil), 0, 1)...)

	const engineTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	req := body("req-trace-1", toks, 16)
	req["kv_transfer_params"] = &contract.PDSource{EngineID: "prefill-0", BlockTable: kvcore.BlockTable{{1, 2, 3}}, Tokens: 48}
	res := s.post(t, req, map[string]string{"traceparent": "00-" + engineTrace + "-00f067aa0ba902b7-01"})
	answer := decodeDecision(t, res)

	got, msg := decisions.await(t, "req-trace-1")
	if !reflect.DeepEqual(got, answer) {
		t.Fatalf("published decision\n%+v\ndiffers from the answer\n%+v", got, answer)
	}
	spec := &kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 32}
	wantChildren := []contract.ChildDecision{{Name: "pd", Tokens: 16, Spec: spec}, {Name: "store", Tokens: 16, Spec: spec}}
	if got.Chosen != "pd" || got.ExternalTokens != 16 || !reflect.DeepEqual(got.Children, wantChildren) || got.PD == nil {
		t.Errorf("decision chosen %q external %d children %s pd %s; want pd, 16, %s, the source",
			got.Chosen, got.ExternalTokens, asJSON(got.Children), asJSON(got.PD), asJSON(wantChildren))
	}
	tp := header(msg, contract.HeaderTraceparent)
	sc, err := traceOf(tp)
	if err != nil || sc.TraceID().String() != engineTrace {
		t.Fatalf("record traceparent %q (%v), want one in the engine's trace %s", tp, err, engineTrace)
	}
	span := endedSpan(t, rec, "lookup")
	if span.SpanContext().TraceID().String() != engineTrace {
		t.Errorf("lookup span in trace %s, want %s", span.SpanContext().TraceID(), engineTrace)
	}
	want := map[attribute.Key]attribute.Value{
		"kvmesh.engine_id":       attribute.StringValue("engine-0"),
		"kvmesh.request_id":      attribute.StringValue("req-trace-1"),
		"kvmesh.model":           attribute.StringValue("test-model"),
		"kvmesh.tokens":          attribute.IntValue(48),
		"kvmesh.hit_tokens":      attribute.IntValue(32),
		"kvmesh.external_tokens": attribute.IntValue(16),
		"kvmesh.chosen":          attribute.StringValue("pd"),
	}
	attrs := map[attribute.Key]attribute.Value{}
	for _, kv := range span.Attributes() {
		attrs[kv.Key] = kv.Value
	}
	for k, v := range want {
		if attrs[k] != v {
			t.Errorf("lookup span %s = %v, want %v", k, attrs[k].Emit(), v.Emit())
		}
	}
}

// traceOf parses a W3C traceparent.
func traceOf(traceparent string) (trace.SpanContext, error) {
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": traceparent})
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return sc, errInvalidTraceparent
	}
	return sc, nil
}

// endedSpan polls the recorder for an ended span named name.
func endedSpan(t *testing.T, rec *tracetest.SpanRecorder, name string) sdktrace.ReadOnlySpan {
	t.Helper()
	var found sdktrace.ReadOnlySpan
	eventually(t, "span "+name, func() bool {
		for _, s := range rec.Ended() {
			if s.Name() == name {
				found = s
				return true
			}
		}
		return false
	})
	return found
}
