package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
)

// Replay statuses of a dead letter.
const (
	// ReplayNone: never replayed.
	ReplayNone = "none"
	// ReplayDone: replayed successfully; a later replay is a no-op.
	ReplayDone = "replayed"
	// ReplayInvalid: the last replay found the payload still invalid.
	ReplayInvalid = "invalid"
	// ReplayFailed: the last replay failed (store or worker unavailable).
	ReplayFailed = "failed"
)

// Filter selects dead letters for List. Empty fields match everything.
type Filter struct {
	// Reason, EngineID and RequestID match exactly.
	Reason, EngineID, RequestID string
	// Before returns only ids below it (the cursor); 0 means no bound.
	Before int64
	// Limit bounds the rows returned.
	Limit int
}

const deadLetterColumns = `id, reason, detail, group_index, task_id, engine_id, request_id, payload,
	topic, partition, "offset", record_time, slot, created_at, replay_status, replay_count,
	replayed_at, replay_result`

func scanDeadLetter(row pgx.Row) (DeadLetter, error) {
	var d DeadLetter
	var result []byte
	err := row.Scan(&d.ID, &d.Reason, &d.Detail, &d.Group, &d.TaskID, &d.EngineID, &d.RequestID, &d.Payload,
		&d.Topic, &d.Partition, &d.Offset, &d.RecordTime, &d.Slot, &d.CreatedAt, &d.ReplayStatus, &d.ReplayCount,
		&d.ReplayedAt, &result)
	if result != nil {
		d.ReplayResult = json.RawMessage(result)
	}
	return d, err
}

// List returns the dead letters matching f, newest first.
func (l *Ledger) List(ctx context.Context, f Filter) ([]DeadLetter, error) {
	var where []string
	var args []any
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
	q := "SELECT " + deadLetterColumns + " FROM dead_letters"
	if len(where) > 0 {
		q += " WHERE " + strings.Join(where, " AND ")
	}
	args = append(args, f.Limit)
	q += " ORDER BY id DESC LIMIT $" + strconv.Itoa(len(args))
	rows, err := l.pool.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("ledger: list dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (DeadLetter, error) { return scanDeadLetter(r) })
	if err != nil {
		return nil, fmt.Errorf("ledger: list dead letters: %w", err)
	}
	return out, nil
}

// Get returns one dead letter, or an ErrNotFound error.
func (l *Ledger) Get(ctx context.Context, id int64) (DeadLetter, error) {
	d, err := scanDeadLetter(l.pool.QueryRow(ctx, "SELECT "+deadLetterColumns+" FROM dead_letters WHERE id = $1", id))
	if errors.Is(err, pgx.ErrNoRows) {
		return DeadLetter{}, fmt.Errorf("dead letter %d: %w", id, ErrNotFound)
	}
	if err != nil {
		return DeadLetter{}, fmt.Errorf("ledger: get dead letter %d: %w", id, err)
	}
	return d, nil
}

// RecordReplay records a replay attempt of dead letter id with its status
// and result and enqueues msgs, in one transaction. A dead letter already
// replayed successfully is left as it is, msgs are not enqueued, and the
// row is returned with applied false.
func (l *Ledger) RecordReplay(ctx context.Context, id int64, status string, result any, msgs ...bus.Message) (DeadLetter, bool, error) {
	body, err := json.Marshal(result)
	if err != nil {
		return DeadLetter{}, false, fmt.Errorf("ledger: encode replay result: %w", err)
	}
	var d DeadLetter
	applied := false
	err = pgx.BeginFunc(ctx, l.pool, func(tx pgx.Tx) error {
		row, err := scanDeadLetter(tx.QueryRow(ctx, `
			UPDATE dead_letters SET replay_status = $2, replay_count = replay_count + 1,
				replayed_at = now(), replay_result = $3
			WHERE id = $1 AND replay_status <> 'replayed'
			RETURNING `+deadLetterColumns, id, status, body))
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
		return DeadLetter{}, false, fmt.Errorf("ledger: record replay of %d: %w", id, err)
	}
	if !applied {
		d, err = l.Get(ctx, id)
	}
	return d, applied, err
}

// Stats sums the accounting.
type Stats = adminapi.Accounting

const statsSQL = `
SELECT count(*), COALESCE(sum(groups_stored), 0), COALESCE(sum(groups_existing), 0),
	COALESCE(sum(groups_skipped), 0), COALESCE(sum(groups_dead_lettered), 0), COALESCE(sum(groups_failed), 0),
	COALESCE(sum(keys_stored), 0), COALESCE(sum(keys_existing), 0), COALESCE(sum(keys_skipped), 0),
	COALESCE(sum(keys_dead_lettered), 0), COALESCE(sum(keys_failed), 0), COALESCE(sum(bytes), 0)
FROM save_outcomes`

// Stats returns the totals of save_outcomes and dead_letters.
func (l *Ledger) Stats(ctx context.Context) (Stats, error) {
	s := Stats{Tasks: map[string]int64{}, Groups: map[string]int64{}, Keys: map[string]int64{}, DeadLetters: map[string]int64{}}
	var total int64
	var g, k [5]int64
	err := l.pool.QueryRow(ctx, statsSQL).Scan(&total, &g[0], &g[1], &g[2], &g[3], &g[4],
		&k[0], &k[1], &k[2], &k[3], &k[4], &s.Bytes)
	if err != nil {
		return Stats{}, fmt.Errorf("ledger: stats: %w", err)
	}
	for i, name := range []string{"stored", "existing", "skipped", "dead_lettered", "failed"} {
		s.Groups[name], s.Keys[name] = g[i], k[i]
	}
	s.Tasks["total"] = total
	if err := l.countBy(ctx, "SELECT status, count(*) FROM save_outcomes GROUP BY status", s.Tasks); err != nil {
		return Stats{}, err
	}
	if err := l.countBy(ctx, "SELECT reason, count(*) FROM dead_letters GROUP BY reason", s.DeadLetters); err != nil {
		return Stats{}, err
	}
	var dlTotal int64
	for _, n := range s.DeadLetters {
		dlTotal += n
	}
	s.DeadLetters["total"] = dlTotal
	return s, nil
}

// countBy adds the (name, count) rows of q to into.
func (l *Ledger) countBy(ctx context.Context, q string, into map[string]int64) error {
	rows, err := l.pool.Query(ctx, q)
	if err != nil {
		return fmt.Errorf("ledger: stats: %w", err)
	}
	var name string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&name, &n}, func() error {
		into[name] = n
		return nil
	})
	if err != nil {
		return fmt.Errorf("ledger: stats: %w", err)
	}
	return nil
}
