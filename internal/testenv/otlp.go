package testenv

import (
	"compress/gzip"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// ExportedSpan is one span received by an OTLPReceiver, flattened for
// assertions: ids in lower-case hex, attribute values as strings.
type ExportedSpan struct {
	// Path is the URL path the export was posted to.
	Path string
	// Service is the resource's service.name.
	Service string
	// Name is the span name.
	Name string
	// TraceID, SpanID and ParentID are hex ids; ParentID is empty for a
	// root span.
	TraceID, SpanID, ParentID string
	// Kind is the span kind (OTLP numbering: 1 internal, 2 server, 3 client,
	// 4 producer, 5 consumer).
	Kind int
	// Attrs are the span's attributes, each value as its string form.
	Attrs map[string]string
	// Error is set when the span's status is error; Status is its message.
	Error  bool
	Status string
	// Links are the span ids of the span's links.
	Links []string
	// Start is when the span started.
	Start time.Time
}

// OTLPReceiver is an in-test OTLP/HTTP traces endpoint: services started
// with OTEL_EXPORTER_OTLP_ENDPOINT set to its URL export their spans to it.
type OTLPReceiver struct {
	srv   *httptest.Server
	mu    sync.Mutex
	spans []ExportedSpan
	errs  []error
}

// StartOTLPReceiver starts a receiver for the rest of the test.
func StartOTLPReceiver(t testing.TB) *OTLPReceiver {
	t.Helper()
	o := &OTLPReceiver{}
	o.srv = httptest.NewServer(o)
	t.Cleanup(o.srv.Close)
	return o
}

// URL is the receiver's base URL, for OTEL_EXPORTER_OTLP_ENDPOINT.
func (o *OTLPReceiver) URL() string { return o.srv.URL }

// Spans returns the spans received so far and any malformed exports.
func (o *OTLPReceiver) Spans() ([]ExportedSpan, []error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]ExportedSpan(nil), o.spans...), append([]error(nil), o.errs...)
}

// ServeHTTP decodes one protobuf export request.
func (o *OTLPReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
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
		service := attrMap(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				o.spans = append(o.spans, flatten(r.URL.Path, service, s))
			}
		}
	}
	w.Header().Set("Content-Type", "application/x-protobuf")
	w.WriteHeader(http.StatusOK)
}

func flatten(path, service string, s *tracepb.Span) ExportedSpan {
	out := ExportedSpan{
		Path: path, Service: service, Name: s.GetName(),
		TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()),
		ParentID: hex.EncodeToString(s.GetParentSpanId()), Kind: int(s.GetKind()),
		Attrs:  attrMap(s.GetAttributes()),
		Error:  s.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR,
		Status: s.GetStatus().GetMessage(),
		Start:  time.Unix(0, int64(s.GetStartTimeUnixNano())),
	}
	for _, l := range s.GetLinks() {
		out.Links = append(out.Links, hex.EncodeToString(l.GetSpanId()))
	}
	return out
}

// attrMap renders OTLP attributes as strings.
func attrMap(kvs []*commonpb.KeyValue) map[string]string {
	out := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		out[kv.GetKey()] = anyString(kv.GetValue())
	}
	return out
}

// anyString renders one OTLP value; arrays as [a b c].
func anyString(v *commonpb.AnyValue) string {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_IntValue:
		return fmt.Sprint(x.IntValue)
	case *commonpb.AnyValue_BoolValue:
		return fmt.Sprint(x.BoolValue)
	case *commonpb.AnyValue_DoubleValue:
		return fmt.Sprint(x.DoubleValue)
	case *commonpb.AnyValue_ArrayValue:
		parts := make([]string, 0, len(x.ArrayValue.GetValues()))
		for _, e := range x.ArrayValue.GetValues() {
			parts = append(parts, anyString(e))
		}
		return "[" + strings.Join(parts, " ") + "]"
	default:
		return v.String()
	}
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
