package database

import (
	"errors"

	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/pkg/bus"
)

// FailReason is why the relay could not publish an outbox row: the row's
// outbox.fail_reason, and the reason label of the relay's failure hook.
// (Records a consumer cannot handle have kvcore.Reason codes instead.)
type FailReason string

// Reasons a row is marked failed. Every reason but ReasonTransient is
// permanent: the row leaves the relay path until an operator retries it.
const (
	// ReasonMessageTooLarge: the message is larger than the relay's
	// maximum message size or the broker's (Kafka error 10).
	ReasonMessageTooLarge FailReason = "message_too_large"
	// ReasonRecordListTooLarge: the broker refused the record batch as
	// larger than its segment size (Kafka error 18).
	ReasonRecordListTooLarge FailReason = "record_list_too_large"
	// ReasonInvalidTopic: the topic name is illegal or internal (Kafka error 17).
	ReasonInvalidTopic FailReason = "invalid_topic"
	// ReasonInvalidRecord: the broker rejected the record itself (Kafka
	// errors 32 and 87: invalid timestamp, invalid record).
	ReasonInvalidRecord FailReason = "invalid_record"
	// ReasonTransient labels a failure the relay retries with per-row
	// backoff (broker down, leader election, timeout, ...). It is never
	// stored as a fail_reason.
	ReasonTransient FailReason = "transient"
)

// permanentCodes maps the Kafka error codes that no retry can cure, because
// they are about the message rather than the broker's state, to reasons.
var permanentCodes = map[kafka.Error]FailReason{
	kafka.MessageSizeTooLarge: ReasonMessageTooLarge,
	kafka.RecordListTooLarge:  ReasonRecordListTooLarge,
	kafka.InvalidTopic:        ReasonInvalidTopic,
	kafka.InvalidTimestamp:    ReasonInvalidRecord,
	kafka.InvalidRecord:       ReasonInvalidRecord,
}

// classify returns the reason of a publish error and whether it is
// permanent. Errors not known to be about the message are transient.
func classify(err error) (reason FailReason, permanent bool) {
	var tooLarge kafka.MessageTooLargeError
	if errors.As(err, &tooLarge) {
		return ReasonMessageTooLarge, true
	}
	var code kafka.Error
	if errors.As(err, &code) {
		if r, ok := permanentCodes[code]; ok {
			return r, true
		}
	}
	if errors.Is(err, bus.ErrNoTopic) {
		return ReasonInvalidTopic, true
	}
	return ReasonTransient, false
}

// perMessage spreads the error of a Publish of n messages over the
// messages: a (wrapped) kafka.WriteErrors with one entry per message gives
// each its own outcome, any other error fails every message.
func perMessage(err error, n int) []error {
	errs := make([]error, n)
	if err == nil {
		return errs
	}
	var werr kafka.WriteErrors
	if errors.As(err, &werr) && len(werr) == n {
		copy(errs, werr)
		return errs
	}
	for i := range errs {
		errs[i] = err
	}
	return errs
}

// messageSize estimates the bytes m takes in a Kafka record, as kafka-go
// counts them against the writer's BatchBytes: key, value, headers and the
// record's fixed fields.
func messageSize(m bus.Message) int64 {
	const recordOverhead, headerOverhead = 32, 10
	n := int64(recordOverhead + len(m.Key) + len(m.Value))
	for k, v := range m.Headers {
		n += int64(headerOverhead + len(k) + len(v))
	}
	return n
}
