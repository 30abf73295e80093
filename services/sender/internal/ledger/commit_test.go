package ledger_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// counter is a pgx tracer counting what a pool sends: each query and each
// batch is one round trip (once the connection's statement cache is warm),
// and each query and batch statement one statement.
type counter struct {
	mu                     sync.Mutex
	roundTrips, statements int
}

func (c *counter) add(rt, st int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.roundTrips += rt
	c.statements += st
}

func (c *counter) take() (rt, st int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	rt, st = c.roundTrips, c.statements
	c.roundTrips, c.statements = 0, 0
	return rt, st
}

func (c *counter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.add(1, 1)
	return ctx
}
func (*counter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *counter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	c.add(1, 0)
	return ctx
}
func (c *counter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) { c.add(0, 1) }
func (*counter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData)       {}

// countingPool is a one-connection pool on pool's database whose queries c
// counts.
func countingPool(t *testing.T, pool *pgxpool.Pool, c *counter) *pgxpool.Pool {
	t.Helper()
	cfg := pool.Config()
	cfg.ConnConfig.Tracer = c
	cfg.MaxConns = 1
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// TestCommitRoundTrips counts what a save task costs PostgreSQL on the
// sender's save path, the Commit of its entry (there is no check before
// it), with a warm statement cache: the same with publish on commit (whose
// deferred sent marks go through a pool of their own here).
func TestCommitRoundTrips(t *testing.T) {
	for _, direct := range []bool{false, true} {
		t.Run(map[bool]string{false: "relay", true: "publish_on_commit"}[direct], func(t *testing.T) {
			base := dbtest.NewPool(t)
			var opts []ledger.Option
			if direct {
				opts = append(opts, ledger.WithDirect(runDirect(t, base, &recorder{})))
			}
			commitRoundTrips(t, base, opts...)
		})
	}
}

func commitRoundTrips(t *testing.T, base *pgxpool.Pool, opts ...ledger.Option) {
	var c counter
	l := ledger.New(countingPool(t, base, &c), opts...)
	ctx := context.Background()
	dl := func() deadletter.DeadLetter {
		return deadletter.DeadLetter{Reason: "table_group_count", Group: group(1), Slot: 0}
	}
	withKV := func(e ledger.Entry) ledger.Entry {
		e.Messages = append(e.Messages, bus.Message{Topic: contract.TopicKVEvents, Key: "ns", Value: []byte(`{}`)})
		return e
	}
	clean := func(id string, off int64) ledger.Entry {
		e := withKV(taskEntry(id, off))
		e.Outcome.Result.Status = "stored"
		return e
	}
	cases := []struct {
		name   string
		entry  func(i int) ledger.Entry
		rt, st int // the most this path may cost now
	}{
		{"stored, result and a kv event", func(i int) ledger.Entry { return clean("c"+string(rune('a'+i)), int64(100+i)) }, 1, 1},
		{"redelivered stored task", func(int) ledger.Entry { return clean("ca", 100) }, 1, 1},
		{"one group dead-lettered", func(i int) ledger.Entry { return withKV(taskEntry("d"+string(rune('a'+i)), int64(200+i), dl())) }, 2, 5},
		{"redelivered dead-lettered task (rolled back)", func(int) ledger.Entry { return withKV(taskEntry("da", 250, dl())) }, 2, 4},
		{"whole record dead-lettered, no task", func(i int) ledger.Entry {
			return ledger.Entry{Source: src(int64(300 + i)), DeadLetters: []deadletter.DeadLetter{{Reason: "undecodable", Slot: deadletter.WholeRecord}}}
		}, 2, 4},
	}
	for _, tc := range cases {
		// The first commit of each kind prepares its statements.
		if _, err := l.Commit(ctx, tc.entry(0)); err != nil {
			t.Fatal(err)
		}
		c.take()
		if _, err := l.Commit(ctx, tc.entry(1)); err != nil {
			t.Fatal(err)
		}
		rt, st := c.take()
		t.Logf("%s: Commit = %d round trips, %d statements", tc.name, rt, st)
		if rt > tc.rt || st > tc.st {
			t.Errorf("%s: %d round trips, %d statements; want at most %d, %d", tc.name, rt, st, tc.rt, tc.st)
		}
	}
}

// TestRedeliveredCleanTaskCommitsOncePublishesOnce: a task without dead
// letters (the one-statement path), delivered three times from two
// offsets, is recorded and enqueued once, and the later commits say done.
func TestRedeliveredCleanTaskCommitsOncePublishesOnce(t *testing.T) {
	pool := dbtest.NewPool(t)
	l := ledger.New(pool)
	ctx := context.Background()
	entry := func(off int64) ledger.Entry {
		e := taskEntry("t1", off)
		e.Outcome.Result.Status = "stored"
		e.Messages = append(e.Messages, bus.Message{Topic: contract.TopicKVEvents, Key: "ns", Value: []byte(`{"e":1}`)},
			bus.Message{Topic: contract.TopicKVEvents, Key: "ns", Value: []byte(`{"e":2}`)})
		return e
	}
	for i, off := range []int64{5, 5, 9} {
		for _, drop := range []bool{true, false} {
			e := entry(off)
			e.DropIfDone = drop
			c, err := l.Commit(ctx, e)
			if err != nil {
				t.Fatal(err)
			}
			if first := i == 0 && drop; c.Done == first || len(c.DeadLetters) != 0 {
				t.Fatalf("delivery %d (drop %v) = %+v, want done %v", i, drop, c, !first)
			}
		}
	}
	if got := outboxCount(t, pool, contract.TopicTransferResults); got != 1 {
		t.Errorf("transfer results enqueued = %d, want 1", got)
	}
	var values []string
	rows, _ := pool.Query(ctx, "SELECT convert_from(value, 'UTF8') FROM outbox WHERE topic = $1 ORDER BY id", contract.TopicKVEvents)
	values, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(values) != 2 || values[0] != `{"e":1}` || values[1] != `{"e":2}` {
		t.Errorf("kv events enqueued %q (%v), want the two in order", values, err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM save_outcomes WHERE task_id = 't1' AND "offset" = 5`).Scan(&n); err != nil || n != 1 {
		t.Errorf("outcome rows of the first delivery = %d (%v), want 1", n, err)
	}
	var headers map[string]string
	if err := pool.QueryRow(ctx, "SELECT headers FROM outbox ORDER BY id LIMIT 1").Scan(&headers); err != nil || headers == nil {
		t.Errorf("headers %v (%v), want an object", headers, err)
	}
}

// TestFailedCommitLeavesNothing: when the outbox insert fails in the
// database (a trigger refuses it) or before it is sent (a message with no
// topic), neither the outcome nor the dead letters are left, on either
// path, and the ledger commits the entry once the fault is gone.
func TestFailedCommitLeavesNothing(t *testing.T) {
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
		CREATE FUNCTION refuse_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'outbox refused'; END; $$;
		CREATE TRIGGER refuse_outbox BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION refuse_outbox()`)
	if err != nil {
		t.Fatal(err)
	}
	var c counter
	l := ledger.New(countingPool(t, pool, &c)) // one connection: a leaked transaction would show
	dl := deadletter.DeadLetter{Reason: "table_group_count", Group: group(1), Slot: 0}
	entries := map[string]ledger.Entry{
		"one statement": taskEntry("t1", 1),
		"transaction":   taskEntry("t2", 2, dl),
	}
	noTopic := func(e ledger.Entry) ledger.Entry {
		e.Messages = append(append([]bus.Message(nil), e.Messages...), bus.Message{Key: "x"})
		return e
	}
	count := func(table string) int {
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for name, e := range entries {
		if _, err := l.Commit(ctx, e); err == nil || !strings.Contains(err.Error(), "outbox refused") {
			t.Fatalf("%s: commit with the outbox refused: %v, want its error", name, err)
		}
		if _, err := l.Commit(ctx, noTopic(e)); err == nil {
			t.Fatalf("%s: commit of a message with no topic succeeded", name)
		}
		for _, table := range []string{"save_outcomes", "dead_letters", "outbox"} {
			if n := count(table); n != 0 {
				t.Fatalf("%s: %d rows left in %s after failed commits", name, n, table)
			}
		}
	}
	if _, err := pool.Exec(ctx, "DROP TRIGGER refuse_outbox ON outbox"); err != nil {
		t.Fatal(err)
	}
	for name, e := range entries {
		c, err := l.Commit(ctx, e)
		if err != nil || c.Done {
			t.Fatalf("%s: commit after the fault = %+v, %v", name, c, err)
		}
	}
	if o, d, m := count("save_outcomes"), count("dead_letters"), count("outbox"); o != 2 || d != 1 || m != 3 {
		t.Errorf("after the retries: %d outcomes, %d dead letters, %d messages; want 2, 1, 3 (two results, one DLQ notice)", o, d, m)
	}
}

// batchSizes is a pgx tracer recording the size of each batch sent.
type batchSizes struct {
	counter
	sizes []int
}

func (b *batchSizes) TraceBatchStart(ctx context.Context, c *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	b.mu.Lock()
	b.sizes = append(b.sizes, d.Batch.Len())
	b.mu.Unlock()
	return b.counter.TraceBatchStart(ctx, c, d)
}

// TestGroupCommitIsolatesABadEntry: entries that arrive while a commit is
// in flight are committed together in one transaction; when one of them
// fails, the group falls back to one commit each, so only the bad entry
// fails, and every other is recorded and enqueued once.
func TestGroupCommitIsolatesABadEntry(t *testing.T) {
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
		CREATE FUNCTION outbox_test_hook() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.key = 'slow' THEN PERFORM pg_sleep(0.3); END IF;
			IF NEW.key = 'bad' THEN RAISE EXCEPTION 'bad entry'; END IF;
			RETURN NEW;
		END; $$;
		CREATE TRIGGER outbox_test_hook BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION outbox_test_hook()`)
	if err != nil {
		t.Fatal(err)
	}
	var tr batchSizes
	cfg := pool.Config()
	cfg.ConnConfig.Tracer = &tr
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	l := ledger.New(p)
	entry := func(id, key string) ledger.Entry {
		e := taskEntry(id, 1)
		e.Outcome.Result.Status = "stored"
		e.Messages[0].Key = key
		return e
	}
	// The slow commit is in flight while the others arrive.
	slow := make(chan error, 1)
	go func() { _, err := l.Commit(ctx, entry("slow", "slow")); slow <- err }()
	// Wait, polling with a deadline, until its statement sleeps in the
	// trigger: the commit is then in flight.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var sleeping int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event = 'PgSleep'`).Scan(&sleeping); err != nil {
			t.Fatal(err)
		}
		if sleeping > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the slow commit never reached its trigger")
		}
	}
	ids := []string{"a", "b", "bad", "c", "a"} // "a" twice: recorded once
	errs := make([]error, len(ids))
	done := make([]bool, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := "r1"
			if id == "bad" {
				key = "bad"
			}
			c, err := l.Commit(ctx, entry(id, key))
			errs[i], done[i] = err, c.Done
		}()
	}
	wg.Wait()
	if err := <-slow; err != nil {
		t.Fatal(err)
	}
	doneA := 0
	for i, id := range ids {
		switch {
		case id == "bad":
			if errs[i] == nil || !strings.Contains(errs[i].Error(), "bad entry") {
				t.Errorf("bad entry: %v, want its own error", errs[i])
			}
		case errs[i] != nil:
			t.Errorf("entry %s: %v, want committed despite the bad one", id, errs[i])
		case done[i]:
			doneA++
		}
	}
	if doneA != 1 {
		t.Errorf("%d commits of a said done, want 1 (the second)", doneA)
	}
	var outcomes, results int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM save_outcomes").Scan(&outcomes); err != nil {
		t.Fatal(err)
	}
	results = outboxCount(t, pool, contract.TopicTransferResults)
	if outcomes != 4 || results != 4 {
		t.Errorf("%d outcomes, %d results; want 4 each (slow, a, b, c)", outcomes, results)
	}
	grouped := false
	tr.mu.Lock()
	for _, n := range tr.sizes {
		grouped = grouped || n > 3 // BEGIN, two entries or more, COMMIT
	}
	tr.mu.Unlock()
	if !grouped {
		t.Errorf("batches %v: the entries that waited were not committed together", tr.sizes)
	}
}
