// Package deadletter is kvmesh's one dead-letter design, shared by every
// service that consumes Kafka with a database (sender, scheduler,
// gpuworker): the DeadLetter type, its one stored shape (the dead_letters
// table, one row per dead letter, with the consuming service in its service
// column; migrations 0003 and 0010), the Store that reads and writes it,
// the bus.DeadLetterFunc that records a record the bus consumer gives up on
// (Store.Record), the generic replay of a stored record through the
// consumer's handler (HandlerReplayer), and the wire form published on
// contract.TopicSaveDLQ (Message). Package dlqhttp serves the admin routes
// (GET /v1/dlq, GET /v1/dlq/{id}, POST /v1/dlq/{id}/replay) over a Store.
//
// The flow is the bus consumer's (pkg/bus): classify the handler's error
// (bus.Permanent or transient), retry a transient one with bounded backoff,
// then dead-letter with a kvcore.Reason: OnDeadLetter (here: the store)
// first, then the DLQ topic where the service has one.
package deadletter

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Services that keep dead letters, the values of DeadLetter.Service.
const (
	// ServiceSender: save tasks and save groups (services/sender).
	ServiceSender = "sender"
	// ServiceScheduler: engine steps, transfer results and KV events
	// (services/scheduler).
	ServiceScheduler = "scheduler"
	// ServiceGPUWorker: load tasks (services/gpuworker).
	ServiceGPUWorker = "gpuworker"
)

// WholeRecord is the slot of a dead letter that covers a whole record
// rather than one group of it.
const WholeRecord = -1

// Replay statuses of a dead letter.
const (
	// ReplayNone: never replayed.
	ReplayNone = "none"
	// ReplayDone: replayed successfully; a later replay is a no-op.
	ReplayDone = "replayed"
	// ReplayInvalid: the last replay found the record still invalid.
	ReplayInvalid = "invalid"
	// ReplayFailed: the last replay failed (a dependency unavailable).
	ReplayFailed = "failed"
)

// Sentinel errors.
var (
	// ErrNotFound reports a dead letter id that does not exist (for the
	// store's service).
	ErrNotFound = errors.New("dead letter not found")
	// ErrStillInvalid: a replayed record is still invalid. It is wrapped
	// in an *InvalidError.
	ErrStillInvalid = errors.New("dead letter is still invalid")
	// ErrReplayFailed: the replay did not complete (a dependency
	// unavailable); the attempt is recorded as ReplayFailed.
	ErrReplayFailed = errors.New("replay did not complete")
)

// DeadLetter is one dead letter: a row of the dead_letters table, and the
// head of the admin routes' entries (GET /v1/dlq) in every service.
type DeadLetter struct {
	// ID is assigned by the database.
	ID int64 `json:"id"`
	// Service is the consumer that dead-lettered the record (ServiceSender,
	// ...); the store fills it in.
	Service string `json:"-"`
	// Reason is the stable reason code.
	Reason kvcore.Reason `json:"reason"`
	// Detail explains the reason for operators.
	Detail string `json:"detail"`
	// Group is the KV group the entry is about; nil for a whole record.
	Group *int `json:"group"`
	// TaskID, EngineID and RequestID identify the task when known.
	TaskID    string `json:"task_id"`
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	// Payload is the original record value.
	Payload []byte `json:"payload,omitempty"`
	// Topic, Partition and Offset locate the original record.
	Topic     string `json:"topic"`
	Partition int    `json:"partition"`
	Offset    int64  `json:"offset"`
	// Key is the original record's key (kept by Store.Record; empty for
	// the sender's rows).
	Key string `json:"key,omitempty"`
	// Headers are the original record's headers (kept by Store.Record, so
	// that a replay sees the record as it was delivered).
	Headers map[string]string `json:"-"`
	// RecordTime is the original record's timestamp.
	RecordTime time.Time `json:"record_time"`
	// Slot numbers the dead letters of one record (WholeRecord for all of
	// it).
	Slot int `json:"slot"`
	// CreatedAt is when the row was written.
	CreatedAt time.Time `json:"created_at"`
	// ReplayStatus is ReplayNone, ReplayDone, ReplayInvalid or
	// ReplayFailed.
	ReplayStatus string `json:"replay_status"`
	// ReplayCount counts replay attempts.
	ReplayCount int `json:"replay_count"`
	// ReplayedAt is the time of the last replay attempt.
	ReplayedAt *time.Time `json:"replayed_at,omitempty"`
	// ReplayResult is the recorded result of the last replay attempt.
	ReplayResult json.RawMessage `json:"replay_result,omitempty"`
}

// Entry is a dead letter as GET /v1/dlq (payload omitted) and
// GET /v1/dlq/{id} show it.
type Entry struct {
	DeadLetter
	// PayloadJSON is the payload itself when it is JSON (show only).
	PayloadJSON json.RawMessage `json:"payload_json,omitempty"`
	// PayloadBytes is the payload's size.
	PayloadBytes int `json:"payload_bytes"`
}

// ReplayResult is the result of replaying a dead letter, as recorded with
// it and answered by POST /v1/dlq/{id}/replay.
type ReplayResult struct {
	// Status is, for the sender, the save status of the replayed groups
	// (stored, skipped, dead_lettered, failed) or "invalid"; for a record
	// replayed through its handler (HandlerReplayer), ReplayDone,
	// ReplayInvalid or ReplayFailed.
	Status string `json:"status"`
	// Groups are the replayed groups' outcomes (sender only).
	Groups []contract.GroupOutcome `json:"groups,omitempty"`
	// Bytes counts the value bytes stored (sender only).
	Bytes int64 `json:"bytes"`
	// Reason and Detail explain an invalid or failed replay.
	Reason kvcore.Reason `json:"reason,omitempty"`
	Detail string        `json:"detail,omitempty"`
}

// ReplayAnswer is the answer of POST /v1/dlq/{id}/replay.
type ReplayAnswer struct {
	// ID is the dead letter's id.
	ID int64 `json:"id"`
	// ReplayStatus is the entry's replay status after this call.
	ReplayStatus string `json:"replay_status"`
	// ReplayCount counts the replay attempts recorded.
	ReplayCount int `json:"replay_count"`
	// AlreadyReplayed is set when the entry had been replayed before and
	// this call did nothing.
	AlreadyReplayed bool `json:"already_replayed"`
	// Result is the replay's (or the recorded) result.
	Result ReplayResult `json:"result"`
}

// Replayed is what a replay answers.
type Replayed struct {
	// DeadLetter is the entry after the replay was recorded.
	DeadLetter DeadLetter
	// Result is the replay's result (the recorded one for an entry replayed
	// before).
	Result ReplayResult
	// Already is set when the entry had been replayed successfully before
	// and nothing was done now.
	Already bool
}

// Recorded answers the recorded result of d, an entry replayed before.
func Recorded(d DeadLetter) (Replayed, error) {
	out := Replayed{DeadLetter: d, Already: true}
	if err := json.Unmarshal(d.ReplayResult, &out.Result); err != nil {
		return Replayed{}, fmt.Errorf("dead letter %d: replay result: %w", d.ID, err)
	}
	return out, nil
}

// InvalidError says why a replayed dead letter is still invalid.
type InvalidError struct {
	// Group is the group found invalid (nil: the record as a whole).
	Group *int
	// Reason is the reason code found now.
	Reason kvcore.Reason
	// Detail explains it.
	Detail string
}

// Error describes the fault.
func (e *InvalidError) Error() string {
	return fmt.Sprintf("%s: %s: %s", ErrStillInvalid, e.Reason, e.Detail)
}

// Unwrap returns ErrStillInvalid.
func (e *InvalidError) Unwrap() error { return ErrStillInvalid }
