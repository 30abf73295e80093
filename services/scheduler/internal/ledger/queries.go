package ledger

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// Key names one request.
type Key struct {
	// EngineID is the engine.
	EngineID string `json:"e"`
	// RequestID is the engine's request id.
	RequestID string `json:"r"`
}

// Filter selects requests for List.
type Filter struct {
	// EngineID, when set, keeps one engine's requests.
	EngineID string
	// State, when set, keeps requests in that state.
	State string
	// After, when set, starts after this key (key order).
	After *Key
	// Limit is the page size (at least 1).
	Limit int
}

// Row is one request's full row.
type Row struct {
	adminapi.RequestSummary
	req *requeststate.Request
}

// Request returns the row's request state, its trackers' hash chain and
// block tables included, as Apply sees it.
func (r *Row) Request() (*requeststate.Request, error) { return r.req, nil }

const listColumns = `engine_id, request_id, model, state, coalesce(error, ''), last_seq,
	coalesce((tracker->>'token_len')::int, 0), coalesce((tracker->>'num_saved_tokens')::int, 0),
	coalesce(jsonb_array_length(extras->'tasks'), 0), created_at, updated_at, finished_at`

// List returns up to f.Limit requests in (engine id, request id) order.
func (l *Ledger) List(ctx context.Context, f Filter) ([]adminapi.RequestSummary, error) {
	var after Key
	if f.After != nil {
		after = *f.After
	}
	rows, err := l.pool.Query(ctx, `SELECT `+listColumns+` FROM trackers
		WHERE ($1 = '' OR engine_id = $1) AND ($2 = '' OR state = $2)
		  AND (NOT $3 OR (engine_id, request_id) > ($4, $5))
		ORDER BY engine_id, request_id LIMIT $6`,
		f.EngineID, f.State, f.After != nil, after.EngineID, after.RequestID, max(f.Limit, 1))
	if err != nil {
		return nil, fmt.Errorf("ledger: list: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (adminapi.RequestSummary, error) {
		var s adminapi.RequestSummary
		err := row.Scan(&s.EngineID, &s.RequestID, &s.Model, &s.State, &s.Error, &s.LastSeq,
			&s.TokenLen, &s.NumSavedTokens, &s.TasksPending, &s.CreatedAt, &s.UpdatedAt, &s.FinishedAt)
		return s, err
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: list: %w", err)
	}
	return out, nil
}

// Get returns one request's row, or ErrNotFound.
func (l *Ledger) Get(ctx context.Context, k Key) (*Row, error) {
	var r Row
	s := &r.RequestSummary
	// One snapshot for the row and its segments.
	tx, err := l.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, fmt.Errorf("ledger: get %s/%s: %w", k.EngineID, k.RequestID, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var tb, xb, pb []byte
	var created time.Time
	err = tx.QueryRow(ctx, `SELECT `+listColumns+`, tracker, extras, parts, created_at FROM trackers
		WHERE engine_id = $1 AND request_id = $2`, k.EngineID, k.RequestID).
		Scan(&s.EngineID, &s.RequestID, &s.Model, &s.State, &s.Error, &s.LastSeq, &s.TokenLen,
			&s.NumSavedTokens, &s.TasksPending, &s.CreatedAt, &s.UpdatedAt, &s.FinishedAt, &tb, &xb, &pb, &created)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, fmt.Errorf("%s/%s: %w", k.EngineID, k.RequestID, ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("ledger: get %s/%s: %w", k.EngineID, k.RequestID, err)
	}
	b := &batchTx{l: l, conn: tx.Conn(), reqs: map[Key]*loaded{}} // reads in tx
	if err := b.adopt(k, tb, xb, s.LastSeq, pb, created); err != nil {
		return nil, err
	}
	if err := b.loadParts(ctx); err != nil {
		return nil, err
	}
	r.req = b.reqs[k].req
	return &r, nil
}

// Purged counts what Purge deleted.
type Purged struct {
	// Trackers is the number of finished requests deleted.
	Trackers int64
	// Idle is the number of unfinished requests deleted for inactivity.
	Idle int64
	// Records is the number of processed-record ids deleted.
	Records int64
}

// Purge deletes requests finished more than retention ago, unfinished
// requests not updated for idle (their engine is gone), and the ids of
// records processed more than retention ago (by the database clock).
func (l *Ledger) Purge(ctx context.Context, retention, idle time.Duration) (Purged, error) {
	var p Purged
	tag, err := l.pool.Exec(ctx, `DELETE FROM trackers
		WHERE finished_at < now() - $1 * interval '1 microsecond'`, interval(retention))
	if err != nil {
		return p, fmt.Errorf("ledger: purge trackers: %w", err)
	}
	p.Trackers = tag.RowsAffected()
	tag, err = l.pool.Exec(ctx, `DELETE FROM trackers
		WHERE finished_at IS NULL AND updated_at < now() - $1 * interval '1 microsecond'`, interval(idle))
	if err != nil {
		return p, fmt.Errorf("ledger: purge idle trackers: %w", err)
	}
	p.Idle = tag.RowsAffected()
	tag, err = l.pool.Exec(ctx, `DELETE FROM processed_records
		WHERE processed_at < now() - $1 * interval '1 microsecond'`, interval(retention))
	if err != nil {
		return p, fmt.Errorf("ledger: purge processed records: %w", err)
	}
	p.Records = tag.RowsAffected()
	return p, nil
}

// CountByState returns the number of requests in each state.
func (l *Ledger) CountByState(ctx context.Context) (map[string]int64, error) {
	rows, err := l.pool.Query(ctx, `SELECT state, count(*) FROM trackers GROUP BY state`)
	if err != nil {
		return nil, fmt.Errorf("ledger: count trackers: %w", err)
	}
	out := map[string]int64{}
	var state string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&state, &n}, func() error {
		out[state] = n
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: count trackers: %w", err)
	}
	return out, nil
}
