// Package ledger is the sender's durable record in PostgreSQL: one
// save_outcomes row per completed save task (the accounting and the
// handler's idempotency key), the dead_letters table, and the outgoing
// messages, all written in one transaction through the outbox.
package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// Sentinel errors.
var (
	// ErrNotFound reports a dead letter id that does not exist.
	ErrNotFound = errors.New("ledger: dead letter not found")
)

// WholeRecord is the slot of a dead letter that covers a whole record
// rather than one group of it.
const WholeRecord = -1

// Text makes s storable in a PostgreSQL text column: NUL characters and
// invalid UTF-8 become U+FFFD.
func Text(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// Storable reports whether s is stored unchanged by Text.
func Storable(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// Source identifies the Kafka record a write comes from.
type Source struct {
	// Topic, Partition and Offset locate the record.
	Topic     string
	Partition int
	Offset    int64
	// Time is the record's timestamp; with the location it identifies one
	// record even across a broker that reuses offsets.
	Time time.Time
	// Key is the record's key.
	Key string
	// Payload is the record's value, kept with each dead letter.
	Payload []byte
}

// DeadLetter is one row of the dead_letters table, in the shape the
// sender's admin API shows.
type DeadLetter = adminapi.DeadLetter

// Message is dead letter d as published on contract.TopicSaveDLQ. Its
// payload is bounded (contract.MaxDeadLetterPayload) so that any dead letter
// can be published; the full payload stays in the dead_letters row d.ID,
// which the message names (payload_ref, GET /v1/dlq/{id}).
func Message(d DeadLetter) (bus.Message, error) {
	id := strconv.FormatInt(d.ID, 10)
	payload, truncated := contract.BoundDeadLetterPayload(d.Payload)
	v, err := json.Marshal(contract.DeadLetterNotice{
		Schema: contract.SchemaDeadLetter, ID: id,
		Reason: d.Reason, Detail: d.Detail, Group: d.Group,
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
		key = "dead-letter-" + strconv.FormatInt(d.ID, 10)
	}
	return bus.Message{Topic: contract.TopicSaveDLQ, Key: key, Value: v, Headers: map[string]string{
		contract.HeaderReason:       d.Reason,
		contract.HeaderOrigTopic:    d.Topic,
		contract.HeaderOrigPart:     strconv.Itoa(d.Partition),
		contract.HeaderOrigOffset:   strconv.FormatInt(d.Offset, 10),
		contract.HeaderPayloadBytes: strconv.Itoa(len(d.Payload)),
	}}, nil
}

// Outcome is one save task's row in save_outcomes.
type Outcome struct {
	// Result is the TransferResult reported for the task.
	Result contract.TransferResult
	// Groups counts the task's groups by outcome (stored, existing,
	// skipped, dead_lettered, failed).
	Groups map[string]int
}

// Entry is everything one handled record leaves behind.
type Entry struct {
	// Source is the record.
	Source Source
	// Outcome is the task's outcome; nil for a record with no usable task id.
	Outcome *Outcome
	// DropIfDone makes a task whose outcome already exists leave nothing at
	// all (a redelivered, decoded task). Without it the dead letters are
	// still written and only the messages are dropped.
	DropIfDone bool
	// DeadLetters are written with ON CONFLICT DO NOTHING on the record's
	// slot; ID, CreatedAt and the source fields are filled in.
	DeadLetters []DeadLetter
	// Messages (transfer result, kv events) are enqueued when the outcome
	// is new (or there is no outcome).
	Messages []bus.Message
}

// Committed says what a Commit wrote.
type Committed struct {
	// Done is set when the task's outcome already existed.
	Done bool
	// DeadLetters are the rows inserted now (not those already present).
	DeadLetters []DeadLetter
}

// Ledger reads and writes the sender's tables.
type Ledger struct {
	pool *pgxpool.Pool
}

// New returns a ledger over pool (migrated to 0003 or later).
func New(pool *pgxpool.Pool) *Ledger { return &Ledger{pool: pool} }

// Done reports whether the task's outcome is recorded.
func (l *Ledger) Done(ctx context.Context, taskID string) (bool, error) {
	var done bool
	err := l.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM save_outcomes WHERE task_id = $1)`, taskID).Scan(&done)
	if err != nil {
		return false, fmt.Errorf("ledger: outcome of %s: %w", taskID, err)
	}
	return done, nil
}

// Commit writes e in one transaction: the outcome row, the dead letters and
// their DLQ messages, and e.Messages, all through the outbox.
func (l *Ledger) Commit(ctx context.Context, e Entry) (Committed, error) {
	var out Committed
	err := pgx.BeginFunc(ctx, l.pool, func(tx pgx.Tx) error {
		out = Committed{}
		fresh := true
		if e.Outcome != nil {
			var err error
			if fresh, err = insertOutcome(ctx, tx, e.Source, e.Outcome); err != nil {
				return err
			}
			if !fresh && e.DropIfDone {
				out.Done = true
				return nil
			}
			out.Done = !fresh
		}
		msgs, err := insertDeadLetters(ctx, tx, e.Source, e.DeadLetters, &out)
		if err != nil {
			return err
		}
		if fresh {
			msgs = append(msgs, e.Messages...)
		}
		return database.Enqueue(ctx, tx, msgs...)
	})
	if err != nil {
		return Committed{}, fmt.Errorf("ledger: commit %s/%d@%d: %w", e.Source.Topic, e.Source.Partition, e.Source.Offset, err)
	}
	return out, nil
}

const insertOutcomeSQL = `
INSERT INTO save_outcomes (task_id, result_id, engine_id, request_id, status,
	groups_stored, groups_existing, groups_skipped, groups_dead_lettered, groups_failed,
	keys_stored, keys_existing, keys_skipped, keys_dead_lettered, keys_failed,
	bytes, topic, partition, "offset", result)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20)
ON CONFLICT (task_id) DO NOTHING`

// insertOutcome inserts the outcome row and reports whether it is new.
func insertOutcome(ctx context.Context, tx pgx.Tx, src Source, o *Outcome) (bool, error) {
	r := o.Result
	body, err := json.Marshal(r)
	if err != nil {
		return false, fmt.Errorf("encode result: %w", err)
	}
	var k [5]int
	for _, g := range r.Groups {
		k[0] += g.Stored
		k[1] += g.Existing
		k[2] += g.Skipped
		k[3] += g.DeadLettered
		k[4] += g.Failed
	}
	tag, err := tx.Exec(ctx, insertOutcomeSQL, r.TaskID, r.ResultID, r.EngineID, r.RequestID, r.Status,
		o.Groups["stored"], o.Groups["existing"], o.Groups["skipped"], o.Groups["dead_lettered"], o.Groups["failed"],
		k[0], k[1], k[2], k[3], k[4], r.Bytes, src.Topic, src.Partition, src.Offset, body)
	if err != nil {
		return false, fmt.Errorf("insert outcome of %s: %w", r.TaskID, err)
	}
	return tag.RowsAffected() == 1, nil
}

const insertDeadLetterSQL = `
INSERT INTO dead_letters (reason, detail, group_index, task_id, engine_id, request_id,
	payload, topic, partition, "offset", record_time, slot)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (topic, partition, "offset", record_time, slot) DO NOTHING
RETURNING id, created_at`

// insertDeadLetters inserts the rows not yet present and returns the DLQ
// messages of those inserted.
func insertDeadLetters(ctx context.Context, tx pgx.Tx, src Source, dls []DeadLetter, out *Committed) ([]bus.Message, error) {
	var msgs []bus.Message
	payload := src.Payload
	if payload == nil {
		payload = []byte{}
	}
	for _, d := range dls {
		d.Reason, d.Detail = Text(d.Reason), Text(d.Detail)
		d.TaskID, d.EngineID, d.RequestID = Text(d.TaskID), Text(d.EngineID), Text(d.RequestID)
		d.Payload, d.Topic, d.Partition, d.Offset, d.RecordTime = payload, src.Topic, src.Partition, src.Offset, src.Time
		d.ReplayStatus = ReplayNone
		err := tx.QueryRow(ctx, insertDeadLetterSQL, d.Reason, d.Detail, d.Group, d.TaskID, d.EngineID, d.RequestID,
			d.Payload, d.Topic, d.Partition, d.Offset, d.RecordTime, d.Slot).Scan(&d.ID, &d.CreatedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // this record's slot is already recorded
		}
		if err != nil {
			return nil, fmt.Errorf("insert dead letter %s: %w", d.Reason, err)
		}
		m, err := Message(d)
		if err != nil {
			return nil, err
		}
		msgs = append(msgs, m)
		out.DeadLetters = append(out.DeadLetters, d)
	}
	return msgs, nil
}
