package telemetry_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// receivedSpan is one span decoded by the in-test OTLP receiver.
type receivedSpan struct {
	path, service, name string
	traceID             []byte
}

// otlpReceiver is an in-test OTLP/HTTP traces endpoint that decodes the
// protobuf export requests it receives.
type otlpReceiver struct {
	mu    sync.Mutex
	spans []receivedSpan
	errs  []error
}

func (o *otlpReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(r)
	var req collectortrace.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(body, &req)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if err != nil || r.Method != http.MethodPost {
		o.errs = append(o.errs, errors.Join(err, errors.New(r.Method+" "+r.URL.Path)))
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	for _, rs := range req.GetResourceSpans() {
		service := ""
		for _, kv := range rs.GetResource().GetAttributes() {
			if kv.GetKey() == "service.name" {
				service = kv.GetValue().GetStringValue()
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				o.spans = append(o.spans, receivedSpan{r.URL.Path, service, s.GetName(), s.GetTraceId()})
			}
		}
	}
	w.Header().Set("Content-Type", "application/x-protobuf")
	w.WriteHeader(http.StatusOK)
}

func readBody(r *http.Request) ([]byte, error) {
	var rd io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			return nil, err
		}
		rd = gz
	}
	return io.ReadAll(rd)
}

func (o *otlpReceiver) snapshot() ([]receivedSpan, []error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]receivedSpan(nil), o.spans...), append([]error(nil), o.errs...)
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
			recv := &otlpReceiver{}
			srv := httptest.NewServer(recv)
			defer srv.Close()

			ctx := context.Background()
			shutdown, err := telemetry.Setup(ctx, tt.opts(srv.URL))
			if err != nil {
				t.Fatalf("Setup: %v", err)
			}
			_, span := otel.Tracer("test").Start(ctx, "save-task")
			traceID := span.SpanContext().TraceID()
			span.End()
			if err := shutdown(ctx); err != nil {
				t.Fatalf("shutdown: %v", err)
			}

			spans, errs := recv.snapshot()
			if len(errs) > 0 {
				t.Fatalf("receiver errors: %v", errs)
			}
			if len(spans) != 1 {
				t.Fatalf("receiver got %d spans, want 1: %+v", len(spans), spans)
			}
			got := spans[0]
			if got.path != tt.wantPath || got.service != "kvmesh-test" || got.name != "save-task" ||
				!bytes.Equal(got.traceID, traceID[:]) {
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
