package deadletter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/text"
)

// Querier runs SQL: a *pgxpool.Pool, or a pgx.Tx to write a dead letter in
// the caller's transaction (the sender writes its rows with the task's
// outcome and outbox messages).
type Querier interface {
	// Exec runs a statement.
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	// QueryRow runs a query returning at most one row.
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Filter selects dead letters for List. Empty fields match everything.
type Filter struct {
	// Reason, EngineID and RequestID match exactly.
	Reason    kvcore.Reason
	EngineID  string
	RequestID string
	// Before returns only ids below it (the cursor); 0 means no bound.
	Before int64
	// Limit bounds the rows returned.
	Limit int
}

// Store reads and writes one service's rows of the dead_letters table
// (migrated to 0010 or later).
type Store struct {
	pool    *pgxpool.Pool
	service string
}

// NewStore returns the store of service's dead letters over pool.
func NewStore(pool *pgxpool.Pool, service string) *Store {
	return &Store{pool: pool, service: service}
}

// Service is the service whose rows the store reads and writes.
func (s *Store) Service() string { return s.service }

const insertSQL = `
INSERT INTO dead_letters (service, reason, detail, group_index, task_id, engine_id, request_id,
	payload, topic, partition, "offset", record_key, headers, record_time, slot)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
ON CONFLICT (service, topic, partition, "offset", record_time, slot) DO NOTHING
RETURNING id, created_at`

// InsertIn writes d through q (the pool or the caller's transaction) and
// returns it with its id, creation time and sanitised text, and whether it
// was written: a dead letter of the same record slot (service, topic,
// partition, offset, record time, slot) already stored is kept and d is
// not written again, so a redelivered record never adds a second copy.
func (s *Store) InsertIn(ctx context.Context, q Querier, d DeadLetter) (DeadLetter, bool, error) {
	d, args, err := s.prepare(d)
	if err != nil {
		return DeadLetter{}, false, err
	}
	return scanInserted(d, q.QueryRow(ctx, insertSQL, args...))
}

// QueueInsert queues on batch the insert InsertIn makes, for a caller that
// sends batch inside its transaction. Once the batch's results are read
// (BatchResults.Close), done is called with d as InsertIn returns it and
// whether it was written; an error done returns becomes the batch's.
func (s *Store) QueueInsert(batch *pgx.Batch, d DeadLetter, done func(d DeadLetter, added bool) error) error {
	d, args, err := s.prepare(d)
	if err != nil {
		return err
	}
	batch.Queue(insertSQL, args...).QueryRow(func(row pgx.Row) error {
		d, added, err := scanInserted(d, row)
		if err != nil {
			return err
		}
		return done(d, added)
	})
	return nil
}

// prepare fills in and sanitises d for the insert and returns the insert's
// arguments.
func (s *Store) prepare(d DeadLetter) (DeadLetter, []any, error) {
	d.Service = s.service
	d.Reason = kvcore.Reason(text.ForPostgres(string(d.Reason)))
	d.Detail, d.Key = text.ForPostgres(d.Detail), text.ForPostgres(d.Key)
	d.TaskID, d.EngineID, d.RequestID = text.ForPostgres(d.TaskID), text.ForPostgres(d.EngineID), text.ForPostgres(d.RequestID)
	d.ReplayStatus = ReplayNone
	if d.Payload == nil {
		d.Payload = []byte{}
	}
	var headers []byte
	if len(d.Headers) > 0 {
		clean := make(map[string]string, len(d.Headers))
		for k, v := range d.Headers {
			clean[text.ForPostgres(k)] = text.ForPostgres(v)
		}
		var err error
		if headers, err = json.Marshal(clean); err != nil {
			return DeadLetter{}, nil, fmt.Errorf("deadletter: encode headers: %w", err)
		}
	}
	return d, []any{d.Service, d.Reason, d.Detail, d.Group, d.TaskID, d.EngineID, d.RequestID,
		d.Payload, d.Topic, d.Partition, d.Offset, d.Key, headers, d.RecordTime, d.Slot}, nil
}

// scanInserted reads the insert's answer for d: its id and creation time,
// or no row when the record's slot is already recorded.
func scanInserted(d DeadLetter, row pgx.Row) (DeadLetter, bool, error) {
	err := row.Scan(&d.ID, &d.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return d, false, nil // this record's slot is already recorded
	}
	if err != nil {
		return DeadLetter{}, false, fmt.Errorf("deadletter: insert %s of %s/%d@%d: %w", d.Reason, d.Topic, d.Partition, d.Offset, err)
	}
	return d, true, nil
}

// Add writes d in its own transaction; see Insert.
func (s *Store) Add(ctx context.Context, d DeadLetter) (DeadLetter, bool, error) {
	return s.InsertIn(ctx, s.pool, d)
}

const columns = `id, service, reason, detail, group_index, task_id, engine_id, request_id, payload,
	topic, partition, "offset", record_key, headers, record_time, slot, created_at, replay_status, replay_count,
	replayed_at, replay_result`

func scan(row pgx.Row) (DeadLetter, error) {
	var d DeadLetter
	var headers, result []byte
	err := row.Scan(&d.ID, &d.Service, &d.Reason, &d.Detail, &d.Group, &d.TaskID, &d.EngineID, &d.RequestID, &d.Payload,
		&d.Topic, &d.Partition, &d.Offset, &d.Key, &headers, &d.RecordTime, &d.Slot, &d.CreatedAt, &d.ReplayStatus, &d.ReplayCount,
		&d.ReplayedAt, &result)
	if err != nil {
		return d, err
	}
	if result != nil {
		d.ReplayResult = json.RawMessage(result)
	}
	if headers != nil {
		if err := json.Unmarshal(headers, &d.Headers); err != nil {
			return d, fmt.Errorf("headers of dead letter %d: %w", d.ID, err)
		}
	}
	return d, nil
}

// List returns the dead letters matching f, newest first.
func (s *Store) List(ctx context.Context, f Filter) ([]DeadLetter, error) {
	where := []string{"service = $1"}
	args := []any{s.service}
	add := func(cond string, v any) {
		args = append(args, v)
		where = append(where, strings.Replace(cond, "?", "$"+strconv.Itoa(len(args)), 1))
	}
	if f.Reason != "" {
		add("reason = ?", f.Reason)
	}
	if f.EngineID != "" {
		add("engine_id = ?", f.EngineID)
	}
	if f.RequestID != "" {
		add("request_id = ?", f.RequestID)
	}
	if f.Before > 0 {
		add("id < ?", f.Before)
	}
	args = append(args, f.Limit)
	q := "SELECT " + columns + " FROM dead_letters WHERE " + strings.Join(where, " AND ") +
		" ORDER BY id DESC LIMIT $" + strconv.Itoa(len(args))
	rows, err := s.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("deadletter: list: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) { return scan(r) })
	if err != nil {
		return nil, fmt.Errorf("deadletter: list: %w", err)
	}
	return out, nil
}

// Get returns one dead letter of the store's service, or an ErrNotFound
// error.
func (s *Store) Get(ctx context.Context, id int64) (DeadLetter, error) {
	d, err := scan(s.pool.QueryRow(ctx, "SELECT "+columns+" FROM dead_letters WHERE id = $1 AND service = $2", id, s.service))
	if errors.Is(err, pgx.ErrNoRows) {
		return DeadLetter{}, fmt.Errorf("dead letter %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return DeadLetter{}, fmt.Errorf("deadletter: get %d: %w", id, err)
	}
	return d, nil
}

// RecordReplay records a replay attempt of dead letter id with its status
// (ReplayDone, ReplayInvalid or ReplayFailed) and result, and enqueues msgs
// through the outbox, in one transaction. A dead letter already replayed
// successfully is left as it is, msgs are not enqueued, and the row is
// returned with applied false.
func (s *Store) RecordReplay(ctx context.Context, id int64, status string, result any, msgs ...bus.Message) (DeadLetter, bool, error) {
	body, err := json.Marshal(result)
	if err != nil {
		return DeadLetter{}, false, fmt.Errorf("deadletter: encode replay result: %w", err)
	}
	var d DeadLetter
	applied := false
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		row, err := scan(tx.QueryRow(ctx, `
			UPDATE dead_letters SET replay_status = $3, replay_count = replay_count + 1,
				replayed_at = now(), replay_result = $4
			WHERE id = $1 AND service = $2 AND replay_status <> 'replayed'
			RETURNING `+columns, id, s.service, status, body))
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err != nil {
			return err
		}
		d, applied = row, true
		return database.Enqueue(ctx, tx, msgs...)
	})
	if err != nil {
		return DeadLetter{}, false, fmt.Errorf("deadletter: record replay of %d: %w", id, err)
	}
	if !applied {
		d, err = s.Get(ctx, id)
	}
	return d, applied, err
}

// MarkReplayed records a successful replay of id with result; see
// RecordReplay.
func (s *Store) MarkReplayed(ctx context.Context, id int64, result ReplayResult, msgs ...bus.Message) (DeadLetter, bool, error) {
	return s.RecordReplay(ctx, id, ReplayDone, result, msgs...)
}

// CountByReason adds the service's dead letters per reason to into.
func (s *Store) CountByReason(ctx context.Context, into map[string]int64) error {
	err := database.CountInto(ctx, s.pool, into, "SELECT reason, count(*) FROM dead_letters WHERE service = $1 GROUP BY reason", s.service)
	if err != nil {
		return fmt.Errorf("deadletter: %w", err)
	}
	return nil
}
