package bus

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// commitTimeout bounds one offset commit, including the last ones made while
// Run stops.
const commitTimeout = 5 * time.Second

// Consumer runs a Handler (or a BatchHandler) over the records of a
// consumer group. By default it handles one record at a time, so each
// partition's records (and so each key's) are handled in offset order; run
// more members of the group (more Consumers, one Run each) to handle
// partitions in parallel, set ConsumerConfig.Concurrency to overlap records
// of different keys, or use NewBatchConsumer to handle many records per
// call. A record's offset is committed only after its handler returned nil
// or the record was dead-lettered, so a crash or stop never skips a record.
type Consumer struct {
	cfg ConsumerConfig
	// handler handles one record; for a batch consumer it is the batch
	// handler over a batch of one.
	handler Handler
	// batch is the batch handler of a batch consumer, else nil.
	batch  BatchHandler
	tracer tracerSource
	// dialer connects the reader with cfg.Security; nil for kafka-go's
	// default (plaintext, no SASL).
	dialer  *kafka.Dialer
	running atomic.Bool
}

// NewConsumer checks cfg and returns a consumer; Run starts consuming.
func NewConsumer(cfg ConsumerConfig, h Handler) (*Consumer, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: nil handler", ErrInvalidConfig)
	}
	return newConsumer(cfg, h)
}

// newConsumer defaults and checks cfg and returns a consumer of h.
func newConsumer(cfg ConsumerConfig, h Handler) (*Consumer, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	c := &Consumer{cfg: cfg, handler: h, tracer: tracerSource{tp: cfg.TracerProvider}}
	if !cfg.Security.isZero() {
		d, err := cfg.Security.Dialer()
		if err != nil {
			return nil, err
		}
		c.dialer = d
	}
	rc := c.readerConfig()
	if err := rc.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return c, nil
}

// readerConfig maps the consumer's config to kafka-go's.
func (c *Consumer) readerConfig() kafka.ReaderConfig {
	rc := kafka.ReaderConfig{
		Brokers:           c.cfg.Brokers,
		Dialer:            c.dialer,
		GroupID:           c.cfg.GroupID,
		GroupTopics:       c.cfg.Topics,
		MaxWait:           c.cfg.MaxWait,
		CommitInterval:    c.cfg.CommitInterval,
		SessionTimeout:    c.cfg.SessionTimeout,
		HeartbeatInterval: c.cfg.HeartbeatInterval,
		RebalanceTimeout:  c.cfg.RebalanceTimeout,
		JoinGroupBackoff:  c.cfg.JoinGroupBackoff,
		StartOffset:       kafka.FirstOffset,
		ErrorLogger:       kafka.LoggerFunc(c.logReaderError),
		// Deal all partitions of all topics out over all members
		// (spreadBalancer); range only for a group with older members.
		GroupBalancers: []kafka.GroupBalancer{spreadBalancer{}, kafka.RangeGroupBalancer{}},
	}
	if c.cfg.SyncCommit {
		rc.CommitInterval = 0 // kafka-go: zero means synchronous commits
	}
	if c.cfg.StartAtLatest {
		rc.StartOffset = kafka.LastOffset
	}
	return rc
}

func (c *Consumer) logReaderError(format string, args ...any) {
	c.cfg.Logger.Warn("kafka reader error", "group", c.cfg.GroupID, "detail", fmt.Sprintf(format, args...))
}

// Run joins the group and handles records until ctx ends, then commits the
// offsets of the records already handled, leaves the group and returns nil.
// A record whose handling ctx interrupted is not committed: the group
// delivers it again. A failed fetch (the broker or the group coordinator
// unreachable) is waited out (fetchFailed), never returned: a Kafka outage
// does not stop the service. Run returns an error only if closing the
// reader fails; it must not be called again while running.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return ErrAlreadyRunning
	}
	defer c.running.Store(false)

	r := kafka.NewReader(c.readerConfig())
	var err error
	switch {
	case c.batch != nil:
		err = c.consumeBatches(ctx, r)
	case c.cfg.Concurrency > 1:
		err = c.consumeConcurrently(ctx, r)
	default:
		err = c.consume(ctx, r)
	}
	if cerr := r.Close(); cerr != nil {
		err = errors.Join(err, fmt.Errorf("bus: close reader: %w", cerr))
	}
	return err
}

// consume fetches, settles and commits records one at a time until ctx ends.
func (c *Consumer) consume(ctx context.Context, r *kafka.Reader) error {
	var failures int
	for {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil || !c.fetchFailed(ctx, err, &failures) {
				return nil
			}
			continue
		}
		c.fetched(&failures)
		if !c.settle(ctx, received(m)) {
			return nil
		}
		c.commit(ctx, r, m)
	}
}

// fetchFailed waits out a failed fetch with the retry policy's bounded
// backoff, counting the failures in a row: kafka-go's reader keeps
// reconnecting to the brokers and rejoining the group on its own, and hands
// each error it meets to FetchMessage, which may be called again. It
// reports false when ctx ended while waiting.
func (c *Consumer) fetchFailed(ctx context.Context, err error, failures *int) bool {
	*failures++
	d := c.cfg.Retry.Backoff.Delay(*failures)
	c.cfg.Logger.Warn("kafka fetch failed; fetching again", "group", c.cfg.GroupID, "failures", *failures,
		"retry_in", d.String(), "error", err)
	return retry.Sleep(ctx, d) == nil
}

// fetched notes a fetch that succeeded, logging the end of an outage.
func (c *Consumer) fetched(failures *int) {
	if *failures > 0 {
		c.cfg.Logger.Info("kafka fetch recovered", "group", c.cfg.GroupID, "failures", *failures)
		*failures = 0
	}
}

// received converts a kafka-go record to a Received.
func received(m kafka.Message) Received {
	return Received{
		Message:   Message{Topic: m.Topic, Key: string(m.Key), Value: m.Value, Headers: fromKafkaHeaders(m.Headers)},
		Partition: m.Partition,
		Offset:    m.Offset,
		Time:      m.Time,
	}
}

// commit marks msgs as done, in one request. It runs even when ctx has just
// ended, bounded by commitTimeout, because their effects are durable. A
// failed commit only means they may be delivered again, so it is logged and
// consumption goes on; a later commit on each partition covers them. It
// reports whether the commit succeeded.
func (c *Consumer) commit(ctx context.Context, r *kafka.Reader, msgs ...kafka.Message) bool {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if err := r.CommitMessages(cctx, msgs...); err != nil {
		m := msgs[len(msgs)-1]
		c.cfg.Logger.Warn("offset commit failed; the records may be delivered again",
			"group", c.cfg.GroupID, "records", len(msgs), "topic", m.Topic, "partition", m.Partition, "offset", m.Offset,
			"error", err)
		return false
	}
	return true
}

// settle handles rec until it succeeded or was dead-lettered, and reports
// whether it may be committed: false means ctx ended first.
func (c *Consumer) settle(ctx context.Context, rec Received) bool {
	ctx, span := c.startSpan(ctx, rec)
	defer span.End()
	reason, err := c.handleWithRetry(ctx, span, rec)
	return c.finish(ctx, span, rec, reason, err)
}

// finish settles rec after its handling ended with err (nil: success) and
// dead-letter reason, under rec's span, and reports whether rec may be
// committed: false means ctx ended first.
func (c *Consumer) finish(ctx context.Context, span trace.Span, rec Received, reason kvcore.Reason, err error) bool {
	if err == nil {
		return true
	}
	if ctx.Err() != nil {
		span.SetStatus(codes.Error, "interrupted")
		return false
	}
	span.RecordError(err)
	span.SetStatus(codes.Error, string(reason))
	return c.deadLetter(ctx, span, rec, reason, err)
}

// startSpan starts the consumer span of rec: a child of the producer's span
// found in the record headers, and linked to it.
func (c *Consumer) startSpan(ctx context.Context, rec Received) (context.Context, trace.Span) {
	parent := ExtractContext(ctx, rec.Headers)
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingDestinationName(rec.Topic),
		semconv.MessagingDestinationPartitionID(strconv.Itoa(rec.Partition)),
		semconv.MessagingKafkaOffset(int(rec.Offset)),
		semconv.MessagingConsumerGroupName(c.cfg.GroupID),
	}
	if rec.Key != "" {
		attrs = append(attrs, semconv.MessagingKafkaMessageKey(rec.Key))
	}
	opts := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...)}
	if sc := trace.SpanContextFromContext(parent); sc.IsValid() && sc.IsRemote() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: sc}))
	}
	return c.tracer.get().Start(parent, "process "+rec.Topic, opts...)
}

// handleWithRetry calls the handler until it succeeds, fails permanently,
// exhausts the retry policy or ctx ends, waiting the policy's backoff
// between calls. On failure it returns the dead-letter reason with the last
// error; an interrupted attempt returns no reason.
func (c *Consumer) handleWithRetry(ctx context.Context, span trace.Span, rec Received) (kvcore.Reason, error) {
	attempt := 0
	var reason kvcore.Reason
	_, err := retry.Do(ctx, c.cfg.Retry.Backoff, func() (struct{}, error) {
		attempt++
		start := time.Now()
		err := c.invoke(ctx, rec)
		if err == nil {
			c.observe(rec.Topic, OutcomeOK, start)
			return struct{}{}, nil
		}
		if ctx.Err() != nil {
			c.observe(rec.Topic, OutcomeInterrupted, start)
			return struct{}{}, retry.Permanent(err)
		}
		r, permanent := classify(err)
		if permanent || c.cfg.Retry.Exhausted(attempt) {
			c.observe(rec.Topic, OutcomeFailed, start)
			reason = r
			return struct{}{}, retry.Permanent(err)
		}
		c.observe(rec.Topic, OutcomeRetry, start)
		return struct{}{}, err
	}, func(err error, delay time.Duration) {
		span.AddEvent("retry", trace.WithAttributes(attribute.Int("attempt", attempt), attribute.String("error", err.Error())))
		c.cfg.Logger.Info("handler failed; retrying", c.recordAttrs(rec, "attempt", attempt, "delay", delay, "error", err)...)
	})
	if err != nil && reason == "" && ctx.Err() != nil {
		return "", ctx.Err()
	}
	return reason, err
}

// invoke calls the handler, turning a panic into a permanent failure with
// reason kvcore.ReasonHandlerPanic.
func (c *Consumer) invoke(ctx context.Context, rec Received) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = c.panicked(v, "handler panicked", c.recordAttrs(rec)...)
		}
	}()
	return c.handler(ctx, rec)
}

// panicked logs a handler panic v (msg, attrs, the panic and its stack) and
// returns it as a permanent failure with reason kvcore.ReasonHandlerPanic.
func (c *Consumer) panicked(v any, msg string, attrs ...any) error {
	c.cfg.Logger.Error(msg, append(attrs, "panic", fmt.Sprint(v), "stack", string(debug.Stack()))...)
	return Permanent(kvcore.ReasonHandlerPanic, fmt.Errorf("%w: %v", errPanic, v))
}

func (c *Consumer) observe(topic string, o Outcome, start time.Time) {
	if c.cfg.Hooks.Handled != nil {
		c.cfg.Hooks.Handled(topic, o, time.Since(start))
	}
}

// recordAttrs returns log attributes naming rec, followed by extra.
func (c *Consumer) recordAttrs(rec Received, extra ...any) []any {
	return append([]any{
		slog.String("group", c.cfg.GroupID), slog.String("topic", rec.Topic),
		slog.Int("partition", rec.Partition), slog.Int64("offset", rec.Offset), slog.String("key", rec.Key),
	}, extra...)
}
