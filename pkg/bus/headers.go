package bus

import (
	"context"
	"maps"
	"slices"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/contract"
)

// InjectHeaders writes the trace context of ctx (W3C traceparent and
// tracestate with the global propagator) into headers, which must be non-nil.
// The outbox relay uses it to carry a request's trace through Postgres.
func InjectHeaders(ctx context.Context, headers map[string]string) {
	otel.GetTextMapPropagator().Inject(ctx, propagation.MapCarrier(headers))
}

// ExtractContext returns ctx carrying the remote trace context found in
// headers (with the global propagator), or ctx itself when there is none.
func ExtractContext(ctx context.Context, headers map[string]string) context.Context {
	if len(headers) == 0 {
		return ctx
	}
	return otel.GetTextMapPropagator().Extract(ctx, propagation.MapCarrier(headers))
}

// CarriesTrace reports whether headers already carry a W3C trace context.
func CarriesTrace(headers map[string]string) bool {
	_, ok := headers[contract.HeaderTraceparent]
	return ok
}

// carriedSpanContexts returns the valid span contexts carried by msgs.
func carriedSpanContexts(msgs []Message) []trace.Link {
	var links []trace.Link
	for _, m := range msgs {
		if !CarriesTrace(m.Headers) {
			continue
		}
		if sc := trace.SpanContextFromContext(ExtractContext(context.Background(), m.Headers)); sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	return links
}

// toKafkaHeaders converts headers to kafka-go's form, sorted by key so that
// records are byte-for-byte reproducible.
func toKafkaHeaders(headers map[string]string) []kafka.Header {
	if len(headers) == 0 {
		return nil
	}
	out := make([]kafka.Header, 0, len(headers))
	for _, k := range slices.Sorted(maps.Keys(headers)) {
		out = append(out, kafka.Header{Key: k, Value: []byte(headers[k])})
	}
	return out
}

// fromKafkaHeaders converts kafka-go headers to a map; of repeated keys the
// last one wins, as in most Kafka clients' "last header" lookups.
func fromKafkaHeaders(headers []kafka.Header) map[string]string {
	out := make(map[string]string, len(headers))
	for _, h := range headers {
		out[h.Key] = string(h.Value)
	}
	return out
}

// ParseTraceparent parses a W3C traceparent (the contract's trace context
// format, whatever propagator the process installed); the span context is
// invalid when s is empty or does not parse.
func ParseTraceparent(s string) trace.SpanContext {
	if s == "" {
		return trace.SpanContext{}
	}
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{contract.HeaderTraceparent: s})
	return trace.SpanContextFromContext(ctx)
}
