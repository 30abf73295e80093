package bus

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
	"github.com/kvmesh/kvmesh/pkg/text"
)

// maxReasonText bounds the error text carried in contract.HeaderReasonText.
const maxReasonText = 1024

// deadLetter records rec as a dead letter with reason, retrying with backoff
// until that succeeds, and reports whether it did: false means ctx ended
// first, and rec must not be committed.
func (c *Consumer) deadLetter(ctx context.Context, span trace.Span, rec Received, reason kvcore.Reason, cause error) bool {
	attempt := 0
	_, err := retry.Do(ctx, c.cfg.Retry.Backoff, func() (struct{}, error) {
		attempt++
		err := c.sendDeadLetter(ctx, rec, reason, cause)
		if err != nil && ctx.Err() != nil {
			return struct{}{}, retry.Permanent(err)
		}
		return struct{}{}, err
	}, func(err error, delay time.Duration) {
		c.cfg.Logger.Error("dead-lettering failed; retrying, offset not committed",
			c.recordAttrs(rec, "reason", reason, "attempt", attempt, "delay", delay, "error", err)...)
	})
	if err != nil {
		return false
	}
	span.AddEvent("dead_lettered", trace.WithAttributes(attribute.String("reason", string(reason))))
	c.cfg.Logger.Warn("record dead-lettered", c.recordAttrs(rec, "reason", reason, "error", cause)...)
	if c.cfg.Hooks.DeadLettered != nil {
		c.cfg.Hooks.DeadLettered(rec.Topic, reason)
	}
	return true
}

// sendDeadLetter runs the OnDeadLetter hook, then publishes to the DLQ topic.
func (c *Consumer) sendDeadLetter(ctx context.Context, rec Received, reason kvcore.Reason, cause error) error {
	if c.cfg.OnDeadLetter != nil {
		if err := c.cfg.OnDeadLetter(ctx, rec, reason, cause); err != nil {
			return fmt.Errorf("dead-letter hook: %w", err)
		}
	}
	if c.cfg.DLQTopic == "" {
		return nil
	}
	return c.cfg.Producer.Publish(ctx, DeadLetterMessage(c.cfg.DLQTopic, rec, reason, cause))
}

// DeadLetterMessage returns the dead letter of rec for topic dlq: the
// original key, value and headers, plus the reason code, the error text and
// the record's original topic, partition and offset (contract.HeaderReason,
// HeaderReasonText, HeaderOrigTopic, HeaderOrigPart, HeaderOrigOffset). The
// original trace headers are dropped: the dead letter continues the trace
// of the context it is published with (the consumer span that gave up).
//
// The value is bounded, so that the dead letter of any record can be
// published: a value over contract.MaxDeadLetterPayload bytes is cut to its
// first MaxDeadLetterPayload bytes and contract.HeaderPayloadTruncated is
// set. contract.HeaderPayloadBytes always gives the original value's size;
// the original headers name the full record.
func DeadLetterMessage(dlq string, rec Received, reason kvcore.Reason, cause error) Message {
	headers := make(map[string]string, len(rec.Headers)+7)
	maps.Copy(headers, rec.Headers)
	delete(headers, contract.HeaderTraceparent)
	delete(headers, contract.HeaderTracestate)
	headers[contract.HeaderReason] = string(reason)
	if cause != nil {
		headers[contract.HeaderReasonText] = text.Truncate(cause.Error(), maxReasonText)
	}
	headers[contract.HeaderOrigTopic] = rec.Topic
	headers[contract.HeaderOrigPart] = strconv.Itoa(rec.Partition)
	headers[contract.HeaderOrigOffset] = strconv.FormatInt(rec.Offset, 10)
	headers[contract.HeaderPayloadBytes] = strconv.Itoa(len(rec.Value))
	value, truncated := contract.BoundDeadLetterPayload(rec.Value)
	if truncated {
		headers[contract.HeaderPayloadTruncated] = "true"
	}
	return Message{Topic: dlq, Key: rec.Key, Value: value, Headers: headers}
}
