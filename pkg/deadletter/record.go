package deadletter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// FromRecord is the whole-record dead letter of rec with reason and the
// text of cause (empty for nil): its value, key, headers and location.
func FromRecord(rec bus.Received, reason kvcore.Reason, cause error) DeadLetter {
	d := DeadLetter{
		Reason: reason, Slot: WholeRecord, Payload: rec.Value,
		Topic: rec.Topic, Partition: rec.Partition, Offset: rec.Offset, Key: rec.Key, RecordTime: rec.Time,
	}
	if cause != nil {
		d.Detail = cause.Error()
	}
	if len(rec.Headers) > 0 {
		d.Headers = maps.Clone(rec.Headers)
	}
	return d
}

// Received is the original record of d, as the consumer delivered it.
func (d DeadLetter) Received() bus.Received {
	return bus.Received{
		Message:   bus.Message{Topic: d.Topic, Key: d.Key, Value: d.Payload, Headers: maps.Clone(d.Headers)},
		Partition: d.Partition,
		Offset:    d.Offset,
		Time:      d.RecordTime,
	}
}

// Record is a bus.DeadLetterFunc: it stores rec as a whole-record dead
// letter of the store's service, then calls each of also (metrics, logs)
// with the row and the error. Recording the same record twice keeps one
// row (the second call's d has no ID), and also is called each time, as
// the consumer gave up on the delivery each time.
func (s *Store) Record(also ...func(ctx context.Context, d DeadLetter, cause error)) bus.DeadLetterFunc {
	return func(ctx context.Context, rec bus.Received, reason kvcore.Reason, cause error) error {
		d, _, err := s.Add(ctx, FromRecord(rec, reason, cause))
		if err != nil {
			return err
		}
		for _, f := range also {
			f(ctx, d, cause)
		}
		return nil
	}
}

// HandlerReplayer replays a service's dead letters by handing each stored
// record, as it was delivered (value, key, headers, location), to the
// consumer's handler once more: success records ReplayDone, a permanent
// failure (bus.Permanent) ReplayInvalid with its reason, any other failure
// ReplayFailed. It serves the scheduler's and the gpuworker's replay
// route; the sender replays its own way (its save groups).
type HandlerReplayer struct {
	store  *Store
	handle bus.Handler
	mu     sync.Mutex // one replay at a time
}

// NewHandlerReplayer returns the replayer of store's dead letters through
// handle.
func NewHandlerReplayer(store *Store, handle bus.Handler) *HandlerReplayer {
	return &HandlerReplayer{store: store, handle: handle}
}

// Replay replays dead letter id. An entry already replayed successfully is
// a no-op answering its recorded result. Errors: ErrNotFound; an
// *InvalidError (ErrStillInvalid) when the handler still fails
// permanently; ErrReplayFailed when it fails otherwise; both recorded.
func (r *HandlerReplayer) Replay(ctx context.Context, id int64) (Replayed, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	d, err := r.store.Get(ctx, id)
	if err != nil {
		return Replayed{}, err
	}
	if d.ReplayStatus == ReplayDone {
		return Recorded(d)
	}
	herr := r.invoke(ctx, d.Received())
	if herr != nil && ctx.Err() != nil {
		return Replayed{}, fmt.Errorf("replay of dead letter %d: %w", id, ctx.Err())
	}
	status, res := ReplayDone, ReplayResult{Status: ReplayDone}
	var pe *bus.PermanentError
	switch {
	case herr == nil:
	case errors.As(herr, &pe):
		status = ReplayInvalid
		res = ReplayResult{Status: ReplayInvalid, Reason: pe.Reason, Detail: herr.Error()}
	default:
		status = ReplayFailed
		res = ReplayResult{Status: ReplayFailed, Reason: kvcore.ReasonRetriesExhausted, Detail: herr.Error()}
	}
	row, applied, err := r.store.RecordReplay(ctx, id, status, res)
	if err != nil {
		return Replayed{}, err
	}
	if !applied {
		return Recorded(row)
	}
	out := Replayed{DeadLetter: row, Result: res}
	switch status {
	case ReplayInvalid:
		return out, &InvalidError{Group: d.Group, Reason: res.Reason, Detail: res.Detail}
	case ReplayFailed:
		return out, fmt.Errorf("dead letter %d: %w: %w", id, ErrReplayFailed, herr)
	}
	return out, nil
}

// invoke calls the handler, turning a panic into a permanent failure with
// reason kvcore.ReasonHandlerPanic.
func (r *HandlerReplayer) invoke(ctx context.Context, rec bus.Received) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = bus.Permanent(kvcore.ReasonHandlerPanic, fmt.Errorf("handler panicked: %v", v))
		}
	}()
	return r.handle(ctx, rec)
}

// Message is dead letter d as published on contract.TopicSaveDLQ (the
// sender's DLQ topic). Its payload is bounded (contract.MaxDeadLetterPayload)
// so that any dead letter can be published; the full payload stays in the
// dead_letters row d.ID, which the message names (payload_ref,
// GET /v1/dlq/{id}).
func Message(d DeadLetter) (bus.Message, error) {
	id := strconv.FormatInt(d.ID, 10)
	payload, truncated := contract.BoundDeadLetterPayload(d.Payload)
	v, err := json.Marshal(contract.DeadLetterNotice{
		Schema: contract.SchemaDeadLetter, ID: id,
		Reason: string(d.Reason), Detail: d.Detail, Group: d.Group,
		TaskID: d.TaskID, EngineID: d.EngineID, RequestID: d.RequestID,
		Topic: d.Topic, Partition: d.Partition, Offset: d.Offset,
		Payload: payload, PayloadBytes: len(d.Payload), PayloadTruncated: truncated,
		PayloadRef: "/v1/dlq/" + id,
	})
	if err != nil {
		return bus.Message{}, fmt.Errorf("encode dead letter: %w", err)
	}
	key := d.RequestID
	if key == "" {
		key = "dead-letter-" + id
	}
	return bus.Message{Topic: contract.TopicSaveDLQ, Key: key, Value: v, Headers: map[string]string{
		contract.HeaderReason:       string(d.Reason),
		contract.HeaderOrigTopic:    d.Topic,
		contract.HeaderOrigPart:     strconv.Itoa(d.Partition),
		contract.HeaderOrigOffset:   strconv.FormatInt(d.Offset, 10),
		contract.HeaderPayloadBytes: strconv.Itoa(len(d.Payload)),
	}}, nil
}
