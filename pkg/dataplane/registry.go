package dataplane

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Worker is one registered gpuworker: an engine rank's pool and where its
// data plane listens.
type Worker struct {
	// EngineID is the engine whose pool the worker holds.
	EngineID string `json:"engine_id"`
	// Rank is the worker's rank within the engine.
	Rank kvcore.Rank `json:"rank"`
	// Addr is the data plane's base URL, e.g. "http://10.0.0.5:8084".
	Addr string `json:"addr"`
	// Devices is the worker's GPU inventory as JSON (GET /v1/devices).
	Devices json.RawMessage `json:"devices,omitempty"`
	// HeartbeatAt is the time of the last heartbeat (database clock).
	HeartbeatAt time.Time `json:"heartbeat_at"`
}

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
		SELECT engine_id, tp, pcp, dcp, pp, addr, devices, heartbeat_at
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
			&w.Addr, &devices, &w.HeartbeatAt); err != nil {
			return nil, fmt.Errorf("find workers of %s: %w", engineID, err)
		}
		w.Devices = devices
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
