// Package ledger is the scheduler's PostgreSQL state: one row per request
// (table trackers) and the ids of the records already applied (table
// processed_records). Apply runs one record's change in one transaction —
// idempotency check, row lock, state update and outbox rows together — so a
// crash at any point either applied the record with its tasks or not at all.
package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/tracking"
)

// Record kinds in processed_records.
const (
	KindEvent    = "event"
	KindDecision = "decision"
	KindResult   = "result"
)

// ErrNotFound reports a request the ledger has no row for.
var ErrNotFound = errors.New("ledger: request not found")

// Status says what Apply did with a record.
type Status string

// Apply outcomes.
const (
	// Applied: the change was committed.
	Applied Status = "applied"
	// Duplicate: the record id was applied before; nothing changed.
	Duplicate Status = "duplicate"
	// NoRequest: there is no row for the request and the record may not
	// create one; the record id was recorded, nothing else changed.
	NoRequest Status = "no_request"
)

// Record identifies one consumed record.
type Record struct {
	// Kind is KindEvent, KindDecision or KindResult.
	Kind string
	// ID is the record's event, decision or result id (unique per request).
	ID string
	// EngineID and RequestID name the request.
	EngineID, RequestID string
	// Create lets the record start a request that has no row yet.
	Create bool
}

// ApplyFunc changes a locked request and returns the messages to enqueue.
// An error rolls the transaction back and is returned by Apply.
type ApplyFunc func(req *tracking.Request) ([]bus.Message, error)

// Ledger reads and writes the scheduler's tables.
type Ledger struct {
	pool  *pgxpool.Pool
	model *kvcore.Model
}

// New returns a ledger on pool for requests of model m.
func New(pool *pgxpool.Pool, m *kvcore.Model) *Ledger {
	return &Ledger{pool: pool, model: m}
}

const (
	insertProcessed = `INSERT INTO processed_records (kind, engine_id, request_id, id)
		VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING`
	insertTracker = `INSERT INTO trackers (engine_id, request_id, model, state, tracker, extras)
		VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING`
	lockTracker = `SELECT tracker, extras, last_seq FROM trackers
		WHERE engine_id = $1 AND request_id = $2 FOR UPDATE`
	updateTracker = `UPDATE trackers SET model = $3, state = $4, tracker = $5, extras = $6, last_seq = $7,
		error = NULLIF($8, ''), updated_at = now(),
		finished_at = CASE WHEN $9 THEN coalesce(finished_at, now()) ELSE NULL END
		WHERE engine_id = $1 AND request_id = $2`
)

// Apply applies one record in one transaction: it records rec's id (a
// repeated id is a Duplicate and changes nothing), locks the request's row
// (creating it when rec.Create allows), runs fn on the request, stores the
// result and enqueues fn's messages in the outbox.
func (l *Ledger) Apply(ctx context.Context, rec Record, fn ApplyFunc) (Status, error) {
	tx, err := l.pool.Begin(ctx)
	if err != nil {
		return "", fmt.Errorf("ledger: begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // no-op after commit
	req, status, err := l.lock(ctx, tx, rec)
	if err != nil || status != Applied {
		if err == nil && status == NoRequest {
			err = commit(ctx, tx)
		}
		return status, err
	}
	msgs, err := fn(req)
	if err != nil {
		return "", err
	}
	if err := l.store(ctx, tx, req); err != nil {
		return "", err
	}
	if err := database.Enqueue(ctx, tx, msgs...); err != nil {
		return "", fmt.Errorf("ledger: %w", err)
	}
	return Applied, commit(ctx, tx)
}

func commit(ctx context.Context, tx pgx.Tx) error {
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("ledger: commit: %w", err)
	}
	return nil
}

// lock records rec's id and locks (or creates and locks) the request's
// row, in one round trip.
func (l *Ledger) lock(ctx context.Context, tx pgx.Tx, rec Record) (*tracking.Request, Status, error) {
	batch := &pgx.Batch{}
	batch.Queue(insertProcessed, rec.Kind, rec.EngineID, rec.RequestID, rec.ID)
	if rec.Create {
		fresh := tracking.New(l.model, rec.EngineID, rec.RequestID)
		tb, xb, err := encode(fresh)
		if err != nil {
			return nil, "", err
		}
		batch.Queue(insertTracker, rec.EngineID, rec.RequestID, l.model.Name, string(fresh.State()), tb, xb)
	}
	batch.Queue(lockTracker, rec.EngineID, rec.RequestID)
	br := tx.SendBatch(ctx, batch)
	defer func() { _ = br.Close() }()
	tag, err := br.Exec()
	if err != nil {
		return nil, "", fmt.Errorf("ledger: record %s %s: %w", rec.Kind, rec.ID, err)
	}
	if tag.RowsAffected() == 0 {
		return nil, Duplicate, nil
	}
	if rec.Create {
		if _, err := br.Exec(); err != nil {
			return nil, "", fmt.Errorf("ledger: create %s/%s: %w", rec.EngineID, rec.RequestID, err)
		}
	}
	var tb, xb []byte
	var seq int64
	if err := br.QueryRow().Scan(&tb, &xb, &seq); err != nil {
		if errors.Is(err, pgx.ErrNoRows) {
			return nil, NoRequest, br.Close()
		}
		return nil, "", fmt.Errorf("ledger: lock %s/%s: %w", rec.EngineID, rec.RequestID, err)
	}
	req, err := decode(tb, xb, seq)
	if err != nil {
		return nil, "", err
	}
	return req, Applied, br.Close()
}

// store writes the request back to its locked row.
func (l *Ledger) store(ctx context.Context, tx pgx.Tx, req *tracking.Request) error {
	tb, xb, err := encode(req)
	if err != nil {
		return err
	}
	t := req.Store
	_, err = tx.Exec(ctx, updateTracker, t.EngineID, t.RequestID, t.Model, string(t.State), tb, xb,
		req.LastSeq, t.Error, req.Done())
	if err != nil {
		return fmt.Errorf("ledger: store %s/%s: %w", t.EngineID, t.RequestID, err)
	}
	return nil
}

// encode serialises the two JSON columns of a request.
func encode(req *tracking.Request) (tracker, extras []byte, err error) {
	if tracker, err = kvcore.MarshalTracker(req.Store); err != nil {
		return nil, nil, fmt.Errorf("ledger: %w", err)
	}
	if extras, err = json.Marshal(req.Extras); err != nil {
		return nil, nil, fmt.Errorf("ledger: encode extras of %s/%s: %w", req.Store.EngineID, req.Store.RequestID, err)
	}
	return tracker, extras, nil
}

// decode rebuilds a request from its row.
func decode(tracker, extras []byte, lastSeq int64) (*tracking.Request, error) {
	t, err := kvcore.UnmarshalTracker(tracker)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	req := &tracking.Request{Store: t, LastSeq: lastSeq}
	if err := json.Unmarshal(extras, &req.Extras); err != nil {
		return nil, fmt.Errorf("ledger: decode extras of %s/%s: %w", t.EngineID, t.RequestID, err)
	}
	return req, nil
}

// interval renders d as microseconds for "$n * interval '1 microsecond'".
func interval(d time.Duration) int64 { return d.Microseconds() }
