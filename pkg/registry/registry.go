// Package registry owns the gpuworker registry, the PostgreSQL table
// workers: a gpuworker registers its engine rank and data-plane address and
// heartbeats; the sender and the gpuworkers find the live worker of an
// engine rank; the sender's admin API lists every registration, alive or
// stale, page by page. pkg/dataplane is the transport to the workers found
// here.
package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// DefaultStaleAfter is the default heartbeat age past which a worker is
// stale (KVMESH_WORKER_STALE_AFTER in the sender and the gpuworker).
const DefaultStaleAfter = 30 * time.Second

// ErrNoWorker reports that no live gpuworker is registered for an engine
// (or rank).
var ErrNoWorker = errors.New("no live gpuworker for engine")

// Worker is one row of the workers table: an engine rank's pool, where its
// data plane listens, and its heartbeat. It is the very struct the sender's
// GET /v1/workers serves (adminapi.Worker), so a row and its JSON are stated
// once. Register reads EngineID, Rank, Addr and Devices; Find and List fill
// every field.
type Worker = adminapi.Worker

// Register records a worker, replacing an earlier registration of the same
// engine and rank, and counts as a heartbeat. Nil Devices is stored as {}.
func Register(ctx context.Context, pool *pgxpool.Pool, w Worker) error {
	devices := w.Devices
	if len(devices) == 0 {
		devices = json.RawMessage(`{}`)
	}
	_, err := pool.Exec(ctx, `
		INSERT INTO workers (engine_id, tp, pcp, dcp, pp, addr, devices)
		VALUES ($1, $2, $3, $4, $5, $6, $7)
		ON CONFLICT (engine_id, tp, pcp, dcp, pp) DO UPDATE
		SET addr = EXCLUDED.addr, devices = EXCLUDED.devices,
		    registered_at = now(), heartbeat_at = now()`,
		w.EngineID, w.Rank.TP, w.Rank.PCP, w.Rank.DCP, w.Rank.PP, w.Addr, []byte(devices))
	if err != nil {
		return fmt.Errorf("register worker %s %+v: %w", w.EngineID, w.Rank, err)
	}
	return nil
}

// Heartbeat marks a registered worker alive now. A worker that is not
// registered (e.g. removed by an operator) gets an ErrNoWorker error, so the
// caller registers again.
func Heartbeat(ctx context.Context, pool *pgxpool.Pool, engineID string, r kvcore.Rank) error {
	tag, err := pool.Exec(ctx, `
		UPDATE workers SET heartbeat_at = now()
		WHERE engine_id = $1 AND tp = $2 AND pcp = $3 AND dcp = $4 AND pp = $5`,
		engineID, r.TP, r.PCP, r.DCP, r.PP)
	if err != nil {
		return fmt.Errorf("heartbeat worker %s %+v: %w", engineID, r, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("heartbeat worker %s %+v: not registered: %w", engineID, r, ErrNoWorker)
	}
	return nil
}

// Find returns the live workers of an engine (heartbeat newer than maxAge by
// the database clock), one per rank, ordered by pp, tp, pcp, dcp. No live
// worker is an ErrNoWorker error.
func Find(ctx context.Context, pool *pgxpool.Pool, engineID string, maxAge time.Duration) ([]Worker, error) {
	rows, err := pool.Query(ctx, `
		SELECT engine_id, tp, pcp, dcp, pp, addr, devices, registered_at, heartbeat_at,
			greatest(extract(epoch FROM now() - heartbeat_at), 0)::float8
		FROM workers
		WHERE engine_id = $1 AND heartbeat_at > now() - make_interval(secs => $2)
		ORDER BY pp, tp, pcp, dcp`,
		engineID, maxAge.Seconds())
	if err != nil {
		return nil, fmt.Errorf("find workers of %s: %w", engineID, err)
	}
	defer rows.Close()
	var out []Worker
	for rows.Next() {
		var w Worker
		var devices []byte
		if err := rows.Scan(&w.EngineID, &w.Rank.TP, &w.Rank.PCP, &w.Rank.DCP, &w.Rank.PP,
			&w.Addr, &devices, &w.RegisteredAt, &w.HeartbeatAt, &w.HeartbeatAgeSeconds); err != nil {
			return nil, fmt.Errorf("find workers of %s: %w", engineID, err)
		}
		// Find returns only live workers.
		w.Devices, w.State, w.Alive = devices, adminapi.WorkerAlive, true
		out = append(out, w)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("find workers of %s: %w", engineID, err)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("engine %q: %w", engineID, ErrNoWorker)
	}
	return out, nil
}

// FindRank returns the live worker of one engine rank, or an ErrNoWorker
// error.
func FindRank(ctx context.Context, pool *pgxpool.Pool, engineID string, r kvcore.Rank, maxAge time.Duration) (Worker, error) {
	ws, err := Find(ctx, pool, engineID, maxAge)
	if err != nil {
		return Worker{}, err
	}
	for _, w := range ws {
		if w.Rank == r {
			return w, nil
		}
	}
	return Worker{}, fmt.Errorf("engine %q rank %+v: %w", engineID, r, ErrNoWorker)
}

// Deregister removes a worker's registration (on a clean stop). Removing a
// worker that is not registered is not an error.
func Deregister(ctx context.Context, pool *pgxpool.Pool, engineID string, r kvcore.Rank) error {
	_, err := pool.Exec(ctx, `
		DELETE FROM workers
		WHERE engine_id = $1 AND tp = $2 AND pcp = $3 AND dcp = $4 AND pp = $5`,
		engineID, r.TP, r.PCP, r.DCP, r.PP)
	if err != nil {
		return fmt.Errorf("deregister worker %s %+v: %w", engineID, r, err)
	}
	return nil
}

// View lists the registry as operators see it: every registration, alive
// or stale by the age of its last heartbeat.
type View struct {
	pool       *pgxpool.Pool
	staleAfter time.Duration
}

// NewView returns the view over pool; a worker whose last heartbeat is
// older than staleAfter is stale (KVMESH_WORKER_STALE_AFTER).
func NewView(pool *pgxpool.Pool, staleAfter time.Duration) *View {
	return &View{pool: pool, staleAfter: staleAfter}
}

// StaleAfter is the heartbeat age past which a worker is stale.
func (v *View) StaleAfter() time.Duration { return v.staleAfter }

// Filter selects and pages workers for List.
type Filter struct {
	// EngineID keeps one engine's workers ("" all).
	EngineID string
	// State keeps adminapi.WorkerAlive or adminapi.WorkerStale workers
	// ("" both).
	State string
	// After continues after this worker (nil: from the start).
	After *Cursor
	// Limit bounds the rows returned.
	Limit int
}

// Cursor is the position of a worker in the list order (engine id, then
// tp, pcp, dcp, pp).
type Cursor struct {
	EngineID string `json:"e"`
	TP       int    `json:"t"`
	PCP      int    `json:"c"`
	DCP      int    `json:"d"`
	PP       int    `json:"p"`
}

// CursorOf is the cursor that continues after w.
func CursorOf(w Worker) Cursor {
	return Cursor{EngineID: w.EngineID, TP: w.Rank.TP, PCP: w.Rank.PCP, DCP: w.Rank.DCP, PP: w.Rank.PP}
}

const listSQL = `
SELECT engine_id, tp, pcp, dcp, pp, addr, devices, registered_at, heartbeat_at,
	greatest(extract(epoch FROM now() - heartbeat_at), 0)::float8,
	heartbeat_at > now() - make_interval(secs => $1)
FROM workers
WHERE ($2 = '' OR engine_id = $2)
  AND ($3 = '' OR (heartbeat_at > now() - make_interval(secs => $1)) = ($3 = 'alive'))
  AND (NOT $4 OR (engine_id, tp, pcp, dcp, pp) > ($5, $6, $7, $8, $9))
ORDER BY engine_id, tp, pcp, dcp, pp
LIMIT $10`

// List returns up to f.Limit workers in (engine id, tp, pcp, dcp, pp)
// order, as the sender's GET /v1/workers shows them.
func (v *View) List(ctx context.Context, f Filter) ([]Worker, error) {
	var after Cursor
	if f.After != nil {
		after = *f.After
	}
	rows, err := v.pool.Query(ctx, listSQL, v.staleAfter.Seconds(), f.EngineID, f.State,
		f.After != nil, after.EngineID, after.TP, after.PCP, after.DCP, after.PP, max(f.Limit, 1))
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Worker, error) {
		var w Worker
		var devices []byte
		err := row.Scan(&w.EngineID, &w.Rank.TP, &w.Rank.PCP, &w.Rank.DCP, &w.Rank.PP, &w.Addr, &devices,
			&w.RegisteredAt, &w.HeartbeatAt, &w.HeartbeatAgeSeconds, &w.Alive)
		w.Devices, w.State = devices, adminapi.WorkerStale
		if w.Alive {
			w.State = adminapi.WorkerAlive
		}
		return w, err
	})
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	return out, nil
}
