package ledger_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// wireCounter counts what a pool sends PostgreSQL: round trips (a query,
// a pipelined batch or a COPY, each one exchange) and statements (every
// query, every statement of a batch, every COPY), keeping their SQL.
type wireCounter struct {
	mu         sync.Mutex
	roundTrips int
	sql        []string
}

var (
	_ pgx.QueryTracer    = (*wireCounter)(nil)
	_ pgx.BatchTracer    = (*wireCounter)(nil)
	_ pgx.CopyFromTracer = (*wireCounter)(nil)
)

func (c *wireCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.roundTrips++
	c.sql = append(c.sql, d.SQL)
	return ctx
}

func (c *wireCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *wireCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.roundTrips++
	return ctx
}

func (c *wireCounter) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sql = append(c.sql, d.SQL)
}

func (c *wireCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (c *wireCounter) TraceCopyFromStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceCopyFromStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.roundTrips++
	c.sql = append(c.sql, "COPY")
	return ctx
}

func (c *wireCounter) TraceCopyFromEnd(context.Context, *pgx.Conn, pgx.TraceCopyFromEndData) {}

// wire is what one call sent.
type wire struct {
	roundTrips, statements, locks, trackerUpdates int
}

func (w wire) String() string {
	return fmt.Sprintf("%d round trips, %d statements (%d locking, %d tracker updates)", w.roundTrips, w.statements, w.locks, w.trackerUpdates)
}

// measure runs fn and returns what it sent.
func (c *wireCounter) measure(fn func()) wire {
	c.mu.Lock()
	c.roundTrips, c.sql = 0, nil
	c.mu.Unlock()
	fn()
	c.mu.Lock()
	defer c.mu.Unlock()
	w := wire{roundTrips: c.roundTrips, statements: len(c.sql)}
	for _, s := range c.sql {
		if strings.Contains(s, "FOR UPDATE") {
			w.locks++
		}
		if strings.HasPrefix(strings.TrimSpace(s), "UPDATE trackers") {
			w.trackerUpdates++
		}
	}
	return w
}

// countingPool is a pool on a fresh migrated database whose connections
// report to the returned counter.
func countingPool(t *testing.T) (*pgxpool.Pool, *wireCounter) {
	t.Helper()
	migrated := dbtest.NewPool(t) // creates and migrates the database
	cfg := migrated.Config()
	c := &wireCounter{}
	cfg.ConnConfig.Tracer = c
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, c
}

// TestRoundTripsPerBatch counts what one ApplyBatch sends PostgreSQL: a
// batch whose requests the ledger holds at their rows' versions (the
// steady state of a running request), and the same batch applied by a
// ledger that holds none of them (another replica, after a restart or a
// rebalance).
func TestRoundTripsPerBatch(t *testing.T) {
	pool, c := countingPool(t)
	m := model(t)
	l := ledger.New(pool, m)
	ctx := context.Background()
	step := 0
	batch := func(l *ledger.Ledger, ids ...string) {
		t.Helper()
		step++
		u := ledger.Unit{Record: ledger.Record{Kind: ledger.KindStep, ID: fmt.Sprint("s", step), EngineID: "e1"}}
		for _, id := range ids {
			u.Changes = append(u.Changes, ledger.Change{RequestID: id, Create: true,
				Apply: func(req *requeststate.Request) ([]bus.Message, error) {
					req.LastSeq++
					return []bus.Message{{Topic: contract.TopicEngineFeedback, Key: id, Value: []byte(`{}`)}}, nil
				}})
		}
		st, err := l.ApplyBatch(ctx, []ledger.Unit{u})
		if err != nil || st[0] != ledger.Applied {
			t.Fatalf("step %d: %v %v", step, st, err)
		}
	}
	batch(l, "r1", "r2") // creates the rows
	batch(l, "r1", "r2") // warms the statement cache
	warm1 := c.measure(func() { batch(l, "r1") })
	warm2 := c.measure(func() { batch(l, "r1", "r2") })
	cold := c.measure(func() { batch(ledger.New(pool, m), "r1") })
	t.Logf("cached, 1 request: %v", warm1)
	t.Logf("cached, 2 requests: %v", warm2)
	t.Logf("not cached, 1 request: %v", cold)
	// BEGIN with the first statements, COMMIT with the writes; requests
	// held at their rows' versions are not locked (their UPDATE is
	// guarded by the version instead).
	for _, w := range []wire{warm1, warm2, cold} {
		if w.roundTrips != 2 {
			t.Errorf("%v, want 2 round trips", w)
		}
	}
	for _, w := range []wire{warm1, warm2} {
		if w.locks != 0 || w.trackerUpdates != 1 {
			t.Errorf("cached: %v, want no locking statement", w)
		}
	}
	if cold.locks != 1 {
		t.Errorf("not cached: %v, want the rows locked", cold)
	}
}
