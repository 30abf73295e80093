package ledger_test

import (
	"bytes"
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// onePool is a pool of one connection on a fresh migrated database, so a
// connection left inside a transaction would be seen by the next call.
func onePool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	cfg := dbtest.NewPool(t).Config()
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// The transaction's BEGIN travels with its first statements and its
// COMMIT with its writes: a write PostgreSQL refuses skips the COMMIT,
// the batch's transaction is rolled back — the tracker, the processed id
// and the outbox rows with it — and the connection is left outside any
// transaction.
func TestFailedWriteRollsBackThePipelinedTransaction(t *testing.T) {
	pool := onePool(t)
	m := model(t)
	l := ledger.New(pool, m)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE FUNCTION refuse_boom() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN IF NEW.key = 'boom' THEN RAISE EXCEPTION 'refused' USING ERRCODE = 'P0001'; END IF; RETURN NEW; END $$;
		CREATE TRIGGER refuse_boom BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION refuse_boom()`); err != nil {
		t.Fatal(err)
	}
	if _, err := admit(l, m, "r1", "ev1", 1); err != nil {
		t.Fatal(err)
	}
	bump := func(id, key string) (ledger.Status, error) {
		return l.Apply(ctx, ledger.Record{Kind: ledger.KindStep, ID: id, EngineID: "e1", RequestID: "r1"},
			func(req *requeststate.Request) ([]bus.Message, error) {
				req.LastSeq++
				return []bus.Message{{Topic: contract.TopicEngineFeedback, Key: key, Value: []byte(`{}`)}}, nil
			})
	}
	for range 2 { // the request cached, then not (a failed apply drops it)
		_, err := bump("bad", "boom")
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); !ok || pgErr.Code != "P0001" {
			t.Fatalf("refused write: %v, want the trigger's error", err)
		}
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if s := c.Conn().PgConn().TxStatus(); s != 'I' {
			t.Fatalf("the connection's transaction status is %q after a failed apply, want idle", s)
		}
		c.Release()
		if n := pool.Stat().NewConnsCount(); n != 1 {
			t.Fatalf("%d connections opened, want 1: the rolled-back one is reused", n)
		}
		if n := count(t, pool, `SELECT count(*) FROM processed_records WHERE id = 'bad'`); n != 0 {
			t.Fatal("the failed apply's record id was committed")
		}
		if n := count(t, pool, `SELECT count(*) FROM outbox`); n != 0 {
			t.Fatalf("%d outbox rows after a failed apply", n)
		}
		if n := count(t, pool, `SELECT last_seq::int FROM trackers WHERE request_id = 'r1'`); n != 1 {
			t.Fatalf("last seq %d after a failed apply, want 1", n)
		}
	}
	if st, err := bump("good", "r1"); err != nil || st != ledger.Applied {
		t.Fatalf("apply after a failed one: %s %v", st, err)
	}
	if n := count(t, pool, `SELECT last_seq::int FROM trackers WHERE request_id = 'r1'`); n != 2 {
		t.Fatalf("last seq %d, want 2", n)
	}
}

// Messages too large for one array parameter are copied into the outbox
// between the writes and the COMMIT, in the same transaction.
func TestLargeMessagesAreCopiedInTheTransaction(t *testing.T) {
	pool := onePool(t)
	m := model(t)
	l := ledger.New(pool, m)
	ctx := context.Background()
	if _, err := admit(l, m, "r1", "ev1", 1); err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte("x"), database.CopyThreshold+1)
	for _, id := range []string{"a", "b"} { // cached, then applied again at the committed version
		st, err := l.Apply(ctx, ledger.Record{Kind: ledger.KindStep, ID: id, EngineID: "e1", RequestID: "r1"},
			func(req *requeststate.Request) ([]bus.Message, error) {
				req.LastSeq++
				return []bus.Message{{Topic: contract.TopicEngineFeedback, Key: "r1", Value: big}}, nil
			})
		if err != nil || st != ledger.Applied {
			t.Fatalf("apply %s: %s %v", id, st, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox WHERE octet_length(value) > $1`, database.CopyThreshold); n != 2 {
		t.Fatalf("%d large outbox rows, want 2", n)
	}
	if n := count(t, pool, `SELECT last_seq::int FROM trackers WHERE request_id = 'r1'`); n != 3 {
		t.Fatalf("last seq %d, want 3", n)
	}
}
