package bus

import (
	"context"
	"fmt"
	"maps"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// tracerName names the tracer of bus spans.
const tracerName = "github.com/kvmesh/kvmesh/pkg/bus"

// DefaultBatchTimeout is how long the producer waits to fill a batch before
// sending it. kafka-go's own default of 1 s would make every synchronous
// publish of a control message take a second.
const DefaultBatchTimeout = 500 * time.Microsecond

// Producer publishes Messages to Kafka, each to its own topic, partitioned by
// key (murmur2, as the Java client does) so that one key's records keep their
// order, acknowledged by all in-sync replicas. It is safe for concurrent use.
type Producer struct {
	writer    *kafka.Writer
	transport *kafka.Transport
	tracer    tracerSource
}

// ProducerOption configures NewProducer: the With functions below, and
// WithSecurity.
type ProducerOption interface {
	applyProducer(*producerConfig)
}

// producerOptionFunc is a ProducerOption that is a function.
type producerOptionFunc func(*producerConfig)

func (f producerOptionFunc) applyProducer(c *producerConfig) { f(c) }

type producerConfig struct {
	batchTimeout time.Duration
	batchSize    int
	balancer     kafka.Balancer
	autoCreate   bool
	clientID     string
	tp           trace.TracerProvider
	security     Security
}

// WithBatchTimeout sets how long a publish waits to fill a batch (default
// DefaultBatchTimeout).
func WithBatchTimeout(d time.Duration) ProducerOption {
	return producerOptionFunc(func(c *producerConfig) { c.batchTimeout = d })
}

// WithBatchSize sets how many messages fill a batch (default kafka-go's,
// 100). A full batch is sent at once; with 1 every publish is sent without
// waiting for the batch timeout, which a synchronous publish on a
// request's critical path wants (a sub-millisecond timer may take a
// millisecond to fire on an idle process).
func WithBatchSize(n int) ProducerOption {
	return producerOptionFunc(func(c *producerConfig) { c.batchSize = n })
}

// WithBalancer replaces the murmur2 key balancer.
func WithBalancer(b kafka.Balancer) ProducerOption {
	return producerOptionFunc(func(c *producerConfig) { c.balancer = b })
}

// WithAutoTopicCreation lets publishing to an unknown topic create it, where
// the broker allows it. By default topics come from EnsureTopics.
func WithAutoTopicCreation() ProducerOption {
	return producerOptionFunc(func(c *producerConfig) { c.autoCreate = true })
}

// WithClientID sets the Kafka client id the producer reports to brokers.
func WithClientID(id string) ProducerOption {
	return producerOptionFunc(func(c *producerConfig) { c.clientID = id })
}

// WithTracerProvider sets the tracer provider of publish spans; by default
// the global one at the time of each publish.
func WithTracerProvider(tp trace.TracerProvider) ProducerOption {
	return producerOptionFunc(func(c *producerConfig) { c.tp = tp })
}

// Writer limits: a failed write is given up after about two seconds.
const (
	producerMaxAttempts = 3
	producerDialTimeout = 2 * time.Second
)

// NewProducer returns a producer for the brokers. It connects lazily, on the
// first publish, with the TLS and SASL settings given by WithSecurity (by
// default plaintext without authentication); TLS files are read now.
func NewProducer(brokers []string, opts ...ProducerOption) (*Producer, error) {
	if len(brokers) == 0 {
		return nil, fmt.Errorf("%w: no brokers", ErrInvalidConfig)
	}
	cfg := producerConfig{batchTimeout: DefaultBatchTimeout, balancer: kafka.Murmur2Balancer{}}
	for _, o := range opts {
		o.applyProducer(&cfg)
	}
	if cfg.batchTimeout <= 0 || cfg.batchSize < 0 || cfg.balancer == nil {
		return nil, fmt.Errorf("%w: batch timeout must be positive, batch size not negative and balancer set", ErrInvalidConfig)
	}
	if err := cfg.security.Validate(); err != nil {
		return nil, err
	}
	transport, err := cfg.security.Transport()
	if err != nil {
		return nil, err
	}
	transport.ClientID, transport.DialTimeout = cfg.clientID, producerDialTimeout
	w := &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Balancer:     cfg.balancer,
		BatchTimeout: cfg.batchTimeout,
		BatchSize:    cfg.batchSize,
		RequiredAcks: kafka.RequireAll,
		// Every caller retries a failed publish itself (the outbox relay, the
		// consumer loop, an engine answered 503), so the writer gives up
		// quickly instead of retrying in the background for ~10 s, which
		// also kept Close from returning within a service's stop limit.
		MaxAttempts:            producerMaxAttempts,
		WriteBackoffMin:        50 * time.Millisecond,
		WriteBackoffMax:        500 * time.Millisecond,
		AllowAutoTopicCreation: cfg.autoCreate,
		Transport:              transport,
	}
	return &Producer{writer: w, transport: transport, tracer: tracerSource{tp: cfg.tp}}, nil
}

// Publish writes msgs and returns once the brokers acknowledged all of them.
// It starts one producer span per call and writes that span's trace context
// into the headers of every message that does not carry one already (the
// caller's header maps are not modified).
//
// The span is a child of the span that produced the messages: the span in
// ctx, or, where ctx has none (the outbox relay publishes rows of many
// requests from a context of its own), the trace context carried by the
// first message that carries one, so that the span sits inside that
// message's trace instead of starting a one-span trace. A message that
// carries its own trace context keeps it, and the span links to every
// carried context other than its parent, so a batch joining several
// requests is reachable from each of their traces. When the parent is
// borrowed from a message, the messages without a trace context of their
// own are sent without one (they do not belong to that message's request);
// a record that should not start a new trace must be published with a ctx
// or headers that carry its trace.
func (p *Producer) Publish(ctx context.Context, msgs ...Message) error {
	if len(msgs) == 0 {
		return nil
	}
	for i, m := range msgs {
		if m.Topic == "" {
			return fmt.Errorf("bus: publish message %d: %w", i, ErrNoTopic)
		}
	}
	parent, links, borrowed := publishParent(ctx, msgs)
	spanCtx, span := p.tracer.get().Start(parent, publishSpanName(msgs), trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(publishAttributes(msgs)...), trace.WithLinks(links...))
	defer span.End()

	records := make([]kafka.Message, len(msgs))
	for i, m := range msgs {
		records[i] = toRecord(spanCtx, m, !borrowed)
	}
	if err := p.writer.WriteMessages(spanCtx, records...); err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "publish failed")
		return fmt.Errorf("bus: publish %d message(s): %w", len(msgs), err)
	}
	return nil
}

// publishParent returns the context to start the producer span of msgs
// under, the links it gets, and whether its parent was borrowed from a
// message's carried trace context (ctx holds no span). The parent is ctx's
// span when it has one; otherwise the first carried span context, if any.
// The links are the carried span contexts other than the parent, each once.
func publishParent(ctx context.Context, msgs []Message) (context.Context, []trace.Link, bool) {
	carried := carriedSpanContexts(msgs)
	parent, borrowed := trace.SpanContextFromContext(ctx), false
	if !parent.IsValid() && len(carried) > 0 {
		parent, borrowed = carried[0].SpanContext, true
		ctx = trace.ContextWithRemoteSpanContext(ctx, parent)
	}
	var links []trace.Link
	seen := map[trace.SpanID]bool{parent.SpanID(): parent.IsValid()}
	for _, l := range carried {
		if id := l.SpanContext.SpanID(); !seen[id] {
			seen[id] = true
			links = append(links, l)
		}
	}
	return ctx, links, borrowed
}

// toRecord converts m to a kafka-go message. With inject set, a message
// without a trace context of its own gets ctx's.
func toRecord(ctx context.Context, m Message, inject bool) kafka.Message {
	headers := make(map[string]string, len(m.Headers)+2)
	maps.Copy(headers, m.Headers)
	if inject && !CarriesTrace(headers) {
		InjectHeaders(ctx, headers)
	}
	var key []byte
	if m.Key != "" {
		key = []byte(m.Key)
	}
	return kafka.Message{Topic: m.Topic, Key: key, Value: m.Value, Headers: toKafkaHeaders(headers)}
}

// publishSpanName follows the messaging conventions: "send {topic}", or just
// "send" when one publish spans several topics.
func publishSpanName(msgs []Message) string {
	for _, m := range msgs[1:] {
		if m.Topic != msgs[0].Topic {
			return "send"
		}
	}
	return "send " + msgs[0].Topic
}

func publishAttributes(msgs []Message) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
		semconv.MessagingDestinationName(msgs[0].Topic),
	}
	if len(msgs) > 1 {
		attrs = append(attrs, semconv.MessagingBatchMessageCount(len(msgs)))
	} else if msgs[0].Key != "" {
		attrs = append(attrs, semconv.MessagingKafkaMessageKey(msgs[0].Key))
	}
	return attrs
}

// Close flushes pending writes and releases the producer's connections.
func (p *Producer) Close() error {
	err := p.writer.Close()
	p.transport.CloseIdleConnections()
	if err != nil {
		return fmt.Errorf("bus: close producer: %w", err)
	}
	return nil
}

// tracerSource yields the tracer of a configured provider, or of the global
// provider at the time of the call so that a provider installed after the
// producer or consumer was built still applies.
type tracerSource struct{ tp trace.TracerProvider }

func (s tracerSource) get() trace.Tracer {
	tp := s.tp
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(tracerName)
}
