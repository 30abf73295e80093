package bus

import (
	"context"
	"maps"
	"slices"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
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
