package ledger_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// tp2 is the hybrid preset at tensor parallel 2.
func tp2(t *testing.T) *kvcore.Model {
	t.Helper()
	m := model(t)
	m.Parallel.TP = 2
	return m
}

// issueLoad applies, as one record, the events that make (e1, id) issue a
// 32-token store load to its two ranks, and returns the load task.
func issueLoad(t *testing.T, l *ledger.Ledger, m *kvcore.Model, id string) kvcore.LoadTask {
	t.Helper()
	var loads []kvcore.LoadTask
	tbl := kvcore.BlockTable{blocks(0, 3), blocks(100, 3)}
	d := contract.LookupDecision{Schema: contract.SchemaLookupDecision, DecisionID: "d1", EngineID: "e1", RequestID: id,
		Model: m.Name, NumTokens: 48, Chosen: requeststate.ConnectorStore, ExternalTokens: 32,
		Children: []contract.ChildDecision{{Name: requeststate.ConnectorStore, Tokens: 32, Spec: &kvcore.LoadSpec{KVPoolCachedTokens: 32}}}}
	_, err := l.Apply(context.Background(), ledger.Record{Kind: ledger.KindStep, ID: "load-" + id, EngineID: "e1", RequestID: id, Create: true},
		func(req *requeststate.Request) ([]bus.Message, error) {
			req.Engine(m, m.Name, contract.RequestEvent{Seq: 1, Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hexChain(3)})
			req.Decision(m, d)
			req.Engine(m, m.Name, contract.RequestEvent{Seq: 2, Kind: contract.EventAllocated, ExternalTokens: 32, BlockTable: tbl, DecisionID: "d1"})
			o := req.Engine(m, m.Name, contract.RequestEvent{Seq: 3, Kind: contract.EventScheduled, Step: &kvcore.Step{Kind: kvcore.StepPendingLoad}})
			loads = o.Loads
			return nil, nil
		})
	if err != nil || len(loads) != 1 || len(loads[0].Ranks) != 2 {
		t.Fatalf("issue load: %v, loads %+v; want one load for 2 ranks", err, loads)
	}
	return loads[0]
}

// loadDeadline reads the request's load_deadline (nil: NULL) and the
// deadline of its store tracker's first load wait.
func loadDeadline(t *testing.T, pool *pgxpool.Pool, id string) (*time.Time, time.Time) {
	t.Helper()
	var col *time.Time
	var waits []requeststate.LoadWait
	err := pool.QueryRow(context.Background(), `SELECT load_deadline, coalesce(tracker->'load_waits', '[]')
		FROM trackers WHERE request_id = $1`, id).Scan(&col, &waits)
	if err != nil {
		t.Fatal(err)
	}
	if len(waits) == 0 {
		return col, time.Time{}
	}
	return col, waits[0].Deadline
}

// TestLoadDeadlineStoredAndExpired: storing a multi-rank load stamps its
// wait with now + the rank timeout and load_deadline with the same
// instant; OverdueLoads finds it only once that passed; the expiry unit
// clears it, and applying it again is a duplicate.
func TestLoadDeadlineStoredAndExpired(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := tp2(t)
	l := ledger.New(pool, m, ledger.WithLoadRankTimeout(time.Minute))
	before := time.Now()
	task := issueLoad(t, l, m, "r1")
	col, wait := loadDeadline(t, pool, "r1")
	if col == nil || !col.Equal(wait) || wait.Before(before.Add(time.Minute-time.Second)) || wait.After(time.Now().Add(time.Minute)) {
		t.Fatalf("load_deadline %v, wait deadline %v; want both about now + 1m", col, wait)
	}
	ctx := context.Background()
	if due, err := l.OverdueLoads(ctx, wait.Add(-time.Microsecond), 10); err != nil || len(due) != 0 {
		t.Fatalf("overdue before the deadline: %+v %v", due, err)
	}
	due, err := l.OverdueLoads(ctx, wait, 10)
	if err != nil || len(due) != 1 || !slices.Equal(due[0].TaskIDs, []string{task.TaskID}) || !due[0].Deadline.Equal(wait) {
		t.Fatalf("overdue at the deadline: %+v %v; want %s", due, err, task.TaskID)
	}
	var fb []contract.EngineFeedback
	unit := ledger.Unit{Record: due[0].Record(), Changes: []ledger.Change{{RequestID: "r1",
		Apply: func(req *requeststate.Request) ([]bus.Message, error) {
			fb = append(fb, req.ExpireLoads(wait, due[0].TaskIDs).Feedback...)
			return nil, nil
		}}}}
	for i, want := range []ledger.Status{ledger.Applied, ledger.Duplicate} {
		st, err := l.ApplyBatch(ctx, []ledger.Unit{unit})
		if err != nil || st[0] != want {
			t.Fatalf("expiry %d: %v %v, want %s", i+1, st, err, want)
		}
	}
	if len(fb) != 1 || !slices.Equal(fb[0].MissingRanks, []kvcore.Rank{{TP: 0}, {TP: 1}}) {
		t.Fatalf("feedback %+v, want one finished_recving missing both ranks", fb)
	}
	if col, _ := loadDeadline(t, pool, "r1"); col != nil {
		t.Fatalf("load_deadline %v after the expiry, want NULL", col)
	}
}

// TestLoadDeadlineKeepsTheFirstStamp: storing the request again (another
// record) keeps the wait's deadline.
func TestLoadDeadlineKeepsTheFirstStamp(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := tp2(t)
	l := ledger.New(pool, m, ledger.WithLoadRankTimeout(time.Minute))
	task := issueLoad(t, l, m, "r1")
	first, _ := loadDeadline(t, pool, "r1")
	r0 := kvcore.Rank{TP: 0}
	_, err := l.Apply(context.Background(), ledger.Record{Kind: ledger.KindResult, ID: "res0", EngineID: "e1", RequestID: "r1"},
		func(req *requeststate.Request) ([]bus.Message, error) {
			req.Result(m, contract.TransferResult{Kind: contract.TransferLoad, TaskID: task.TaskID, Rank: &r0})
			return nil, nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if col, wait := loadDeadline(t, pool, "r1"); first == nil || col == nil || !col.Equal(*first) || !wait.Equal(*first) {
		t.Fatalf("load_deadline %v (wait %v) after rank 0's result, want the first stamp %v", col, wait, first)
	}
}

// TestLoadDeadlineMigration reverts migration 0008 (the column and its
// index go) and applies it again.
func TestLoadDeadlineMigration(t *testing.T) {
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	has := func() (column, index bool) {
		t.Helper()
		err := pool.QueryRow(ctx, `SELECT
			EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = 'trackers' AND column_name = 'load_deadline'),
			to_regclass('trackers_load_deadline_idx') IS NOT NULL`).Scan(&column, &index)
		if err != nil {
			t.Fatal(err)
		}
		return column, index
	}
	if c, i := has(); !c || !i {
		t.Fatalf("migrated schema: column %v, index %v; want both", c, i)
	}
	if _, err := database.MigrateDown(ctx, pool, migrations.FS, migrationsFrom(t, "0008")); err != nil {
		t.Fatal(err)
	}
	if c, i := has(); c || i {
		t.Fatalf("after down: column %v, index %v; want neither", c, i)
	}
	if _, err := database.Migrate(ctx, pool, migrations.FS); err != nil {
		t.Fatal(err)
	}
	if c, i := has(); !c || !i {
		t.Fatalf("after up again: column %v, index %v; want both", c, i)
	}
	m := tp2(t)
	issueLoad(t, ledger.New(pool, m), m, "r1")
	if col, _ := loadDeadline(t, pool, "r1"); col == nil {
		t.Fatal("load_deadline not written after migrating up again")
	}
}
