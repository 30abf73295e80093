package api

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/httpserver"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Worker states of GET /v1/workers.
const (
	// WorkerAlive: the last heartbeat is newer than the stale-after age;
	// the sender routes puts through this worker.
	WorkerAlive = "alive"
	// WorkerStale: the last heartbeat is older; the sender treats the
	// worker as gone.
	WorkerStale = "stale"
)

// WorkerRegistry reads the gpuworker registry (the PostgreSQL table
// workers) that the sender routes puts through.
type WorkerRegistry struct {
	pool       *pgxpool.Pool
	staleAfter time.Duration
}

// NewWorkerRegistry returns the registry over pool; a worker whose last
// heartbeat is older than staleAfter is stale (KVMESH_WORKER_STALE_AFTER).
func NewWorkerRegistry(pool *pgxpool.Pool, staleAfter time.Duration) *WorkerRegistry {
	return &WorkerRegistry{pool: pool, staleAfter: staleAfter}
}

// Worker is one registered gpuworker as GET /v1/workers shows it.
type Worker struct {
	// EngineID and Rank identify the worker.
	EngineID string      `json:"engine_id"`
	Rank     kvcore.Rank `json:"rank"`
	// Addr is the base URL of its HTTP API and data plane.
	Addr string `json:"addr"`
	// RegisteredAt and HeartbeatAt are the registration and the last
	// heartbeat (database clock).
	RegisteredAt time.Time `json:"registered_at"`
	HeartbeatAt  time.Time `json:"heartbeat_at"`
	// HeartbeatAgeSeconds is the age of the last heartbeat.
	HeartbeatAgeSeconds float64 `json:"heartbeat_age_seconds"`
	// State is WorkerAlive or WorkerStale; Alive says the same as a boolean.
	State string `json:"state"`
	Alive bool   `json:"alive"`
	// Devices is the GPU inventory the worker registered with.
	Devices json.RawMessage `json:"devices"`
}

// WorkerFilter selects and pages workers.
type WorkerFilter struct {
	// EngineID keeps one engine's workers ("" all).
	EngineID string
	// State keeps WorkerAlive or WorkerStale workers ("" both).
	State string
	// After continues after this worker (nil: from the start).
	After *WorkerCursor
	// Limit bounds the rows returned.
	Limit int
}

// WorkerCursor is the position of a worker in the list order (engine id,
// then tp, pcp, dcp, pp).
type WorkerCursor struct {
	EngineID string `json:"e"`
	TP       int    `json:"t"`
	PCP      int    `json:"c"`
	DCP      int    `json:"d"`
	PP       int    `json:"p"`
}

const listWorkersSQL = `
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
// order.
func (g *WorkerRegistry) List(ctx context.Context, f WorkerFilter) ([]Worker, error) {
	var after WorkerCursor
	if f.After != nil {
		after = *f.After
	}
	rows, err := g.pool.Query(ctx, listWorkersSQL, g.staleAfter.Seconds(), f.EngineID, f.State,
		f.After != nil, after.EngineID, after.TP, after.PCP, after.DCP, after.PP, max(f.Limit, 1))
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Worker, error) {
		var w Worker
		var devices []byte
		err := row.Scan(&w.EngineID, &w.Rank.TP, &w.Rank.PCP, &w.Rank.DCP, &w.Rank.PP, &w.Addr, &devices,
			&w.RegisteredAt, &w.HeartbeatAt, &w.HeartbeatAgeSeconds, &w.Alive)
		w.Devices, w.State = devices, WorkerStale
		if w.Alive {
			w.State = WorkerAlive
		}
		return w, err
	})
	if err != nil {
		return nil, fmt.Errorf("list workers: %w", err)
	}
	return out, nil
}

// WorkerPage is one page of GET /v1/workers.
type WorkerPage struct {
	// Items are the workers in (engine id, tp, pcp, dcp, pp) order.
	Items []Worker `json:"items"`
	// NextCursor fetches the next page; absent on the last one.
	NextCursor string `json:"next_cursor,omitempty"`
	// StaleAfterSeconds is the heartbeat age past which a worker is stale.
	StaleAfterSeconds float64 `json:"stale_after_seconds"`
}

func (a *API) listWorkers(w http.ResponseWriter, r *http.Request) {
	f := WorkerFilter{EngineID: r.URL.Query().Get("engine_id"), State: r.URL.Query().Get("state")}
	if f.State != "" && f.State != WorkerAlive && f.State != WorkerStale {
		httpserver.BadParameter(w, r, "state", fmt.Sprintf("state %q is not %s or %s", f.State, WorkerAlive, WorkerStale))
		return
	}
	var ok bool
	if f.Limit, ok = httpserver.PageLimit(w, r); !ok {
		return
	}
	var c WorkerCursor
	present, ok := httpserver.PageCursor(w, r, &c)
	if !ok {
		return
	}
	if present {
		if c.EngineID == "" {
			httpserver.BadParameter(w, r, httpserver.ParamCursor, "cursor names no worker")
			return
		}
		f.After = &c
	}
	want := f.Limit
	f.Limit++ // one more tells whether a next page exists
	rows, err := a.workers.List(r.Context(), f)
	if err != nil {
		a.internal(w, r, err)
		return
	}
	page := WorkerPage{Items: rows, StaleAfterSeconds: a.workers.staleAfter.Seconds()}
	if len(rows) > want {
		page.Items = rows[:want]
		last := rows[want-1]
		page.NextCursor = httpserver.EncodeCursor(WorkerCursor{EngineID: last.EngineID,
			TP: last.Rank.TP, PCP: last.Rank.PCP, DCP: last.Rank.DCP, PP: last.Rank.PP})
	}
	a.write(w, http.StatusOK, page)
}
