package bus

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/retry"
)

// BatchHandler processes a batch of records, for a consumer made by
// NewBatchConsumer. A batch may span partitions and topics; the records of
// one partition are in offset order. It returns:
//
//   - nil once the effects of every record are durable: the consumer
//     commits the whole batch;
//   - RecordErrors when the effects of every record except the listed ones
//     are durable: each listed record with a permanent error is
//     dead-lettered, and each with another error is handled again alone;
//   - any other error for a failure of the whole batch, with nothing of it
//     applied: the batch is retried with the consumer's retry.Policy, and
//     once the policy gives up or the error is permanent, each record is
//     handled alone, as a batch of one, with its own retries and
//     dead-lettering, so that one poison record cannot hold up the others.
//
// Records handled alone are handled in their batch order, after the other
// records of their batch were applied (for RecordErrors); a handler that
// needs a key's records applied strictly in order should list the later
// records of a failed record's key as failed too. A panic counts as a
// permanent failure of the whole batch. A BatchHandler must be idempotent:
// delivery is at least once.
type BatchHandler func(ctx context.Context, recs []Received) error

// RecordErrors is the error a BatchHandler returns when some records of its
// batch failed and the effects of all the others are durable: it maps the
// index in the batch of each failed record to its error, classified as a
// Handler's error is (Permanent: dead-lettered with its reason; anything
// else: handled again alone, retried, and dead-lettered with
// kvcore.ReasonRetriesExhausted if it keeps failing). Entries with a nil error
// count as successes, so an empty RecordErrors means success. A RecordErrors
// with an index outside the batch counts as a failure of the whole batch.
// The consumer finds it with errors.As, so it may be wrapped.
type RecordErrors map[int]error

// Error lists the failed records by index, in index order.
func (e RecordErrors) Error() string {
	parts := make([]string, 0, len(e))
	for _, i := range slices.Sorted(maps.Keys(e)) {
		parts = append(parts, fmt.Sprintf("record %d: %v", i, e[i]))
	}
	return fmt.Sprintf("bus: %d record(s) of the batch failed: %s", len(parts), strings.Join(parts, "; "))
}

// NewBatchConsumer checks cfg and returns a consumer that hands h batches
// of up to cfg.BatchSize records; Run starts consuming. cfg.Concurrency
// must be 0 or 1: a batch consumer handles one batch at a time.
//
// Tracing: each batch gets one consumer span, "process <topic>" (or
// "process" when the batch spans topics), the root of a new trace and
// linked to the producer span of each record, and h runs under it. A record
// handled alone, or dead-lettered from a RecordErrors, gets its own
// consumer span, as in single-record mode: a child of its producer's span.
// Hooks.Handled is called per record; see Hooks.
func NewBatchConsumer(cfg ConsumerConfig, h BatchHandler) (*Consumer, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: nil batch handler", ErrInvalidConfig)
	}
	if cfg.Concurrency > 1 {
		return nil, fmt.Errorf("%w: a batch consumer takes no concurrency (%d)", ErrInvalidConfig, cfg.Concurrency)
	}
	c, err := newConsumer(cfg, h.Single())
	if err != nil {
		return nil, err
	}
	c.batch = h
	return c, nil
}

// Single is h as a Handler of one record: h over a batch of one, whose
// RecordErrors entry is the record's error. The consumer handles a record
// of a failed batch alone this way; a dead letter's replay
// (deadletter.HandlerReplayer) hands its record to it too.
func (h BatchHandler) Single() Handler {
	return func(ctx context.Context, rec Received) error {
		return errorOfOne(h(ctx, []Received{rec}))
	}
}

// errorOfOne is the error of the only record of a batch of one, given the
// handler's answer err.
func errorOfOne(err error) error {
	var re RecordErrors
	if err == nil || !errors.As(err, &re) {
		return err
	}
	for i, e := range re {
		if e != nil && i != 0 {
			return err // an index outside the batch: a failure of the batch
		}
	}
	return re[0]
}

// failures returns the failed records listed by err, by index, and whether
// err lists them (it is a valid RecordErrors for a batch of n records).
func failures(err error, n int) (map[int]error, bool) {
	var re RecordErrors
	if !errors.As(err, &re) {
		return nil, false
	}
	out := make(map[int]error, len(re))
	for i, e := range re {
		if e == nil {
			continue
		}
		if i < 0 || i >= n {
			return nil, false
		}
		out[i] = e
	}
	return out, true
}

// consumeBatches gathers, settles and commits batches until ctx ends; a
// failed fetch is waited out (fetchFailed) after the records gathered
// before it are settled.
func (c *Consumer) consumeBatches(ctx context.Context, r *kafka.Reader) error {
	var failures int
	for {
		msgs, err := c.gather(ctx, r)
		if ctx.Err() != nil {
			return nil // a batch gathered while stopping is not handled
		}
		if len(msgs) > 0 {
			c.fetched(&failures)
			if !c.settleBatch(ctx, msgs) {
				return nil
			}
			c.commit(ctx, r, msgs...)
		}
		if err != nil && !c.fetchFailed(ctx, err, &failures) {
			return nil
		}
	}
}

// gather fetches the next batch: the first record waiting as long as it
// takes, then more until the batch holds BatchSize records or BatchLinger
// has passed since the first arrived. kafka-go's FetchMessage returns a
// record only when it returns no error, and one whose context ends leaves
// the buffered records in the reader, so the deadline loses nothing. A
// reader error after the first record is returned with the records
// gathered before it.
func (c *Consumer) gather(ctx context.Context, r *kafka.Reader) ([]kafka.Message, error) {
	first, err := r.FetchMessage(ctx)
	if err != nil {
		return nil, err
	}
	msgs := []kafka.Message{first}
	lctx, cancel := context.WithTimeout(ctx, c.cfg.BatchLinger)
	defer cancel()
	for len(msgs) < c.cfg.BatchSize {
		m, err := r.FetchMessage(lctx)
		if err != nil {
			if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
				return msgs, nil
			}
			return msgs, err
		}
		msgs = append(msgs, m)
	}
	return msgs, nil
}

// settleBatch handles msgs until the effects of each record are durable or
// the record was dead-lettered, and reports whether the batch may be
// committed: false means ctx ended first.
func (c *Consumer) settleBatch(ctx context.Context, msgs []kafka.Message) bool {
	recs := make([]Received, len(msgs))
	for i, m := range msgs {
		recs[i] = received(m)
	}
	if len(recs) == 1 {
		return c.settle(ctx, recs[0])
	}
	bctx, span := c.startBatchSpan(ctx, recs)
	defer span.End()
	failed, err := c.handleBatchWithRetry(bctx, span, recs)
	switch {
	case ctx.Err() != nil:
		span.SetStatus(codes.Error, "interrupted")
		return false
	case err != nil:
		span.RecordError(err)
		span.SetStatus(codes.Error, "batch failed; records handled alone")
		c.cfg.Logger.Warn("batch failed; handling its records one at a time",
			"group", c.cfg.GroupID, "records", len(recs), "error", err)
		for _, rec := range recs {
			if !c.settle(ctx, rec) {
				return false
			}
		}
		return true
	}
	for _, i := range slices.Sorted(maps.Keys(failed)) {
		if !c.settleFailed(ctx, recs[i], failed[i]) {
			return false
		}
	}
	if len(failed) > 0 {
		span.SetStatus(codes.Error, fmt.Sprintf("%d record(s) failed", len(failed)))
	}
	return true
}

// settleFailed settles rec, which a batch reported failed with err: a
// permanent error dead-letters it at once, another is handled again alone.
func (c *Consumer) settleFailed(ctx context.Context, rec Received, err error) bool {
	reason, permanent := classify(err)
	if !permanent {
		return c.settle(ctx, rec)
	}
	ctx, span := c.startSpan(ctx, rec)
	defer span.End()
	return c.finish(ctx, span, rec, reason, err)
}

// handleBatchWithRetry calls the batch handler until it succeeds or lists
// its failed records (returned, with a nil error), fails permanently,
// exhausts the retry policy or ctx ends, waiting the policy's backoff
// between calls. A non-nil error means the batch failed as a whole (or ctx
// ended) and nothing of it is durable.
func (c *Consumer) handleBatchWithRetry(ctx context.Context, span trace.Span, recs []Received) (map[int]error, error) {
	attempt := 0
	failed, err := retry.Do(ctx, c.cfg.Retry.Backoff, func() (map[int]error, error) {
		attempt++
		start := time.Now()
		err := c.invokeBatch(ctx, recs)
		if err == nil {
			c.observeBatch(recs, nil, OutcomeOK, start)
			return nil, nil
		}
		if ctx.Err() != nil {
			c.observeBatch(recs, nil, OutcomeInterrupted, start)
			return nil, retry.Permanent(err)
		}
		if failed, ok := failures(err, len(recs)); ok {
			c.observeBatch(recs, failed, OutcomeOK, start)
			return failed, nil
		}
		c.observeBatch(recs, nil, OutcomeRetry, start)
		if _, permanent := classify(err); permanent || c.cfg.Retry.Exhausted(attempt) {
			return nil, retry.Permanent(err)
		}
		return nil, err
	}, func(err error, delay time.Duration) {
		span.AddEvent("retry", trace.WithAttributes(attribute.Int("attempt", attempt), attribute.String("error", err.Error())))
		c.cfg.Logger.Info("batch handler failed; retrying", "group", c.cfg.GroupID, "records", len(recs),
			"attempt", attempt, "delay", delay, "error", err)
	})
	if err != nil {
		return nil, err
	}
	return failed, nil
}

// invokeBatch calls the batch handler, turning a panic into a permanent
// failure with reason kvcore.ReasonHandlerPanic.
func (c *Consumer) invokeBatch(ctx context.Context, recs []Received) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = c.panicked(v, "batch handler panicked", "group", c.cfg.GroupID, "records", len(recs))
		}
	}()
	return c.batch(ctx, recs)
}

// observeBatch reports one batch attempt to Hooks.Handled for each record:
// outcome, except for the records in failed: OutcomeFailed for a permanent
// error (the record is dead-lettered), OutcomeRetry for another.
func (c *Consumer) observeBatch(recs []Received, failed map[int]error, outcome Outcome, start time.Time) {
	if c.cfg.Hooks.Handled == nil {
		return
	}
	elapsed := time.Since(start)
	for i, rec := range recs {
		o := outcome
		if err, ok := failed[i]; ok {
			o = OutcomeRetry
			if _, permanent := classify(err); permanent {
				o = OutcomeFailed
			}
		}
		c.cfg.Hooks.Handled(rec.Topic, o, elapsed)
	}
}

// startBatchSpan starts the consumer span of a batch: the root of a new
// trace, linked once to each distinct producer span the records carry.
func (c *Consumer) startBatchSpan(ctx context.Context, recs []Received) (context.Context, trace.Span) {
	topic := recs[0].Topic
	links := make([]trace.Link, 0, len(recs))
	seen := make(map[trace.SpanID]bool, len(recs))
	for _, rec := range recs {
		if rec.Topic != topic {
			topic = ""
		}
		if !CarriesTrace(rec.Headers) {
			continue
		}
		sc := trace.SpanContextFromContext(ExtractContext(ctx, rec.Headers))
		if sc.IsValid() && sc.IsRemote() && !seen[sc.SpanID()] {
			seen[sc.SpanID()] = true
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKafka,
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingOperationName("process"),
		semconv.MessagingConsumerGroupName(c.cfg.GroupID),
		semconv.MessagingBatchMessageCount(len(recs)),
	}
	name := "process"
	if topic != "" {
		name += " " + topic
		attrs = append(attrs, semconv.MessagingDestinationName(topic))
	}
	return c.tracer.get().Start(ctx, name, trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attrs...), trace.WithLinks(links...))
}
