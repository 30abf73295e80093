package database

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// FailedRow is an outbox row that could not be published and left the
// relay path (see Relay): its message without the value, and why.
type FailedRow struct {
	// ID is the row's outbox id.
	ID int64 `json:"id"`
	// Topic and Key are the message's.
	Topic string `json:"topic"`
	Key   string `json:"key"`
	// Headers are the message's headers as enqueued (trace context included).
	Headers map[string]string `json:"headers"`
	// ValueBytes is the size of the message's value.
	ValueBytes int64 `json:"value_bytes"`
	// Attempts counts the publish attempts, the failed one included.
	Attempts int `json:"attempts"`
	// Reason is the failure's reason code (ReasonMessageTooLarge, ...).
	Reason FailReason `json:"reason"`
	// LastError is the error text of the failed attempt.
	LastError string `json:"last_error"`
	// CreatedAt is when the row was enqueued, FailedAt when it was failed.
	CreatedAt time.Time `json:"created_at"`
	FailedAt  time.Time `json:"failed_at"`
}

const (
	listFailed = `SELECT id, topic, key, headers, COALESCE(octet_length(value), 0), attempts,
		    fail_reason, COALESCE(last_error, ''), created_at, failed_at
		FROM outbox
		WHERE failed_at IS NOT NULL AND sent_at IS NULL AND id > $1
		ORDER BY id LIMIT $2`
	countFailed = `SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL AND sent_at IS NULL`
	retryFailed = `UPDATE outbox SET failed_at = NULL, fail_reason = NULL, next_attempt_at = NULL
		WHERE id = $1 AND failed_at IS NOT NULL AND sent_at IS NULL`
	rowExists = `SELECT EXISTS (SELECT 1 FROM outbox WHERE id = $1)`
)

// FailedRows returns at most limit failed rows with ids above after, in id
// order.
func (r *Relay) FailedRows(ctx context.Context, after int64, limit int) ([]FailedRow, error) {
	rows, _ := r.pool.Query(ctx, listFailed, after, limit)
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (FailedRow, error) {
		var f FailedRow
		err := row.Scan(&f.ID, &f.Topic, &f.Key, &f.Headers, &f.ValueBytes, &f.Attempts,
			&f.Reason, &f.LastError, &f.CreatedAt, &f.FailedAt)
		return f, err
	})
	if err != nil {
		return nil, fmt.Errorf("database: list failed outbox rows: %w", err)
	}
	return out, nil
}

// FailedCount returns the number of failed outbox rows.
func (r *Relay) FailedCount(ctx context.Context) (int64, error) {
	var n int64
	if err := r.pool.QueryRow(ctx, countFailed).Scan(&n); err != nil {
		return 0, fmt.Errorf("database: count failed outbox rows: %w", err)
	}
	return n, nil
}

// RetryFailed puts failed row id back on the relay path, for an operator who
// removed the cause (raised the broker's message size, created the topic).
// The relay publishes it next, after any row of its key already published:
// a retried row is out of order with respect to those. It returns
// ErrOutboxRowNotFound when no row has that id and ErrOutboxRowNotFailed
// when the row is pending or sent.
func (r *Relay) RetryFailed(ctx context.Context, id int64) error {
	tag, err := r.pool.Exec(ctx, retryFailed, id)
	if err != nil {
		return fmt.Errorf("database: retry outbox row %d: %w", id, err)
	}
	if tag.RowsAffected() == 1 {
		return nil
	}
	var exists bool
	if err := r.pool.QueryRow(ctx, rowExists, id).Scan(&exists); err != nil {
		return fmt.Errorf("database: retry outbox row %d: %w", id, err)
	}
	if !exists {
		return fmt.Errorf("database: outbox row %d: %w", id, ErrOutboxRowNotFound)
	}
	return fmt.Errorf("database: outbox row %d: %w", id, ErrOutboxRowNotFailed)
}
