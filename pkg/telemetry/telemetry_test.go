package telemetry_test

import (
	"context"
	"errors"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestSetupExportsSpansOnShutdown(t *testing.T) {
	tests := []struct {
		name     string
		opts     func(base string) telemetry.Options
		wantPath string
	}{
		{"base endpoint", func(base string) telemetry.Options {
			return telemetry.Options{ServiceName: "kvmesh-test", OTLPEndpoint: base + "/"}
		}, "/v1/traces"},
		{"traces endpoint wins", func(base string) telemetry.Options {
			return telemetry.Options{ServiceName: "kvmesh-test", OTLPEndpoint: "http://127.0.0.1:1",
				OTLPTracesEndpoint: base + "/custom/traces"}
		}, "/custom/traces"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			recv := testenv.StartOTLPReceiver(t)

			ctx := context.Background()
			shutdown, err := telemetry.Setup(ctx, tt.opts(recv.URL()))
			if err != nil {
				t.Fatalf("Setup: %v", err)
			}
			_, span := otel.Tracer("test").Start(ctx, "save-task")
			traceID := span.SpanContext().TraceID()
			span.End()
			if err := shutdown(ctx); err != nil {
				t.Fatalf("shutdown: %v", err)
			}

			spans, errs := recv.Spans()
			if len(errs) > 0 {
				t.Fatalf("receiver errors: %v", errs)
			}
			if len(spans) != 1 {
				t.Fatalf("receiver got %d spans, want 1: %+v", len(spans), spans)
			}
			got := spans[0]
			if got.Path != tt.wantPath || got.Service != "kvmesh-test" || got.Name != "save-task" ||
				got.TraceID != traceID.String() {
				t.Fatalf("received %+v, want path %s service kvmesh-test span save-task trace %s",
					got, tt.wantPath, traceID)
			}
		})
	}
}

func TestSetupWithoutEndpointStillCreatesSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	ctx := context.Background()
	shutdown, err := telemetry.Setup(ctx, telemetry.Options{ServiceName: "kvmesh-test", Version: "1.2.3", SpanProcessor: rec})
	if err != nil {
		t.Fatalf("Setup: %v", err)
	}
	spanCtx, span := otel.Tracer("test").Start(ctx, "lookup")
	if !span.SpanContext().IsValid() {
		t.Fatal("span context is not valid: trace ids would not propagate")
	}

	member, err := baggage.NewMember("tenant", "a")
	if err != nil {
		t.Fatal(err)
	}
	bag, err := baggage.New(member)
	if err != nil {
		t.Fatal(err)
	}
	carrier := propagation.MapCarrier{}
	otel.GetTextMapPropagator().Inject(baggage.ContextWithBaggage(spanCtx, bag), carrier)
	if carrier.Get("traceparent") == "" || carrier.Get("baggage") != "tenant=a" {
		t.Fatalf("propagated headers %v: want traceparent and baggage", carrier)
	}
	extracted := trace.SpanContextFromContext(otel.GetTextMapPropagator().Extract(ctx, carrier))
	if extracted.TraceID() != span.SpanContext().TraceID() {
		t.Fatalf("extracted trace %s, want %s", extracted.TraceID(), span.SpanContext().TraceID())
	}
	span.End()
	if err := shutdown(ctx); err != nil {
		t.Fatalf("shutdown: %v", err)
	}

	ended := rec.Ended()
	if len(ended) != 1 || ended[0].Name() != "lookup" {
		t.Fatalf("recorder got %d spans, want the one named lookup", len(ended))
	}
	attrs := map[string]string{}
	for _, kv := range ended[0].Resource().Attributes() {
		attrs[string(kv.Key)] = kv.Value.Emit()
	}
	if attrs["service.name"] != "kvmesh-test" || attrs["service.version"] != "1.2.3" {
		t.Fatalf("resource attributes %v: want service.name and service.version", attrs)
	}
}

func TestSetupRejectsBadOptions(t *testing.T) {
	tests := []struct {
		name string
		opts telemetry.Options
		want error
	}{
		{"no service name", telemetry.Options{}, telemetry.ErrServiceName},
		{"endpoint without scheme", telemetry.Options{ServiceName: "s", OTLPEndpoint: "collector:4318"}, telemetry.ErrEndpoint},
		{"grpc scheme", telemetry.Options{ServiceName: "s", OTLPTracesEndpoint: "grpc://collector:4317"}, telemetry.ErrEndpoint},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := telemetry.Setup(context.Background(), tt.opts); !errors.Is(err, tt.want) {
				t.Fatalf("Setup error = %v, want %v", err, tt.want)
			}
		})
	}
}
