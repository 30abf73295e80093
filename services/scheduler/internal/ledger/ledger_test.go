package ledger_test

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/internal/ledger"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

func model(t testing.TB) *kvcore.Model {
	t.Helper()
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// admit applies an admitted event with seq to (e1, id).
func admit(l *ledger.Ledger, m *kvcore.Model, id, eventID string, seq int64, msgs ...bus.Message) (ledger.Status, error) {
	rec := ledger.Record{Kind: ledger.KindStep, ID: eventID, EngineID: "e1", RequestID: id, Create: true}
	return l.Apply(context.Background(), rec, func(req *requeststate.Request) ([]bus.Message, error) {
		req.Engine(m, m.Name, contract.RequestEvent{Seq: seq, Kind: contract.EventAdmitted, PromptTokens: 48})
		return msgs, nil
	})
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestApplyIsIdempotentAndTransactional(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := model(t)
	l := ledger.New(pool, m)
	msg := bus.Message{Topic: contract.TopicEngineFeedback, Key: "e1", Value: []byte(`{}`)}
	if s, err := admit(l, m, "r1", "ev1", 1, msg); err != nil || s != ledger.Applied {
		t.Fatalf("first apply: %s %v", s, err)
	}
	if s, err := admit(l, m, "r1", "ev1", 1, msg); err != nil || s != ledger.Duplicate {
		t.Fatalf("repeat: %s %v, want duplicate", s, err)
	}
	boom := errors.New("boom")
	_, err := l.Apply(context.Background(), ledger.Record{Kind: ledger.KindStep, ID: "ev2", EngineID: "e1", RequestID: "r1", Create: true},
		func(*requeststate.Request) ([]bus.Message, error) { return []bus.Message{msg}, boom })
	if !errors.Is(err, boom) {
		t.Fatalf("failing apply: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox`); n != 1 {
		t.Fatalf("%d outbox rows, want 1 (the failed apply rolled back)", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM processed_records`); n != 1 {
		t.Fatalf("%d processed ids, want 1", n)
	}
	row, err := l.Get(context.Background(), ledger.Key{EngineID: "e1", RequestID: "r1"})
	if err != nil || row.LastSeq != 1 || row.State != string(requeststate.StateWaiting) {
		t.Fatalf("row %+v, %v", row, err)
	}
	res := ledger.Record{Kind: ledger.KindResult, ID: "x", EngineID: "e1", RequestID: "nope"}
	s, err := l.Apply(context.Background(), res, func(*requeststate.Request) ([]bus.Message, error) {
		t.Fatal("ran on a missing request")
		return nil, nil
	})
	if err != nil || s != ledger.NoRequest {
		t.Fatalf("result for a missing request: %s %v", s, err)
	}
	if _, err := l.Get(context.Background(), ledger.Key{EngineID: "e1", RequestID: "nope"}); !errors.Is(err, ledger.ErrNotFound) {
		t.Fatalf("missing request: %v", err)
	}
}

func TestPurgeKeepsRecentAndUnfinished(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := model(t)
	l := ledger.New(pool, m)
	for _, id := range []string{"old", "recent", "running"} {
		if _, err := admit(l, m, id, "ev-"+id, 1); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `UPDATE trackers SET state = 'done', finished_at = now() - interval '2 hours' WHERE request_id = 'old'`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE trackers SET state = 'done', finished_at = now() WHERE request_id = 'recent'`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE processed_records SET processed_at = now() - interval '2 hours' WHERE request_id = 'old'`); err != nil {
		t.Fatal(err)
	}
	if _, err := admit(l, m, "abandoned", "ev", 1); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE trackers SET updated_at = now() - interval '3 days' WHERE request_id = 'abandoned'`); err != nil {
		t.Fatal(err)
	}
	p, err := l.Purge(ctx, time.Hour, 24*time.Hour)
	if err != nil || p.Trackers != 1 || p.Records != 1 || p.Idle != 1 {
		t.Fatalf("purged %+v, %v; want 1 tracker, 1 idle tracker and 1 record", p, err)
	}
	counts, err := l.CountByState(ctx)
	if err != nil || counts["done"] != 1 || counts["waiting"] != 1 {
		t.Fatalf("counts %v, %v; want the recent and the running request", counts, err)
	}
}

func TestListPagesInKeyOrder(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := model(t)
	l := ledger.New(pool, m)
	for _, id := range []string{"c", "a", "b"} {
		if _, err := admit(l, m, id, "ev", 1); err != nil {
			t.Fatal(err)
		}
	}
	page, err := l.List(context.Background(), ledger.Filter{Limit: 2})
	if err != nil || len(page) != 2 || page[0].RequestID != "a" || page[1].RequestID != "b" {
		t.Fatalf("first page %+v %v", page, err)
	}
	page, err = l.List(context.Background(), ledger.Filter{Limit: 2, After: &ledger.Key{EngineID: "e1", RequestID: "b"}})
	if err != nil || len(page) != 1 || page[0].RequestID != "c" {
		t.Fatalf("second page %+v %v", page, err)
	}
	if page, err = l.List(context.Background(), ledger.Filter{Limit: 5, State: "running"}); err != nil || len(page) != 0 {
		t.Fatalf("state filter %+v %v", page, err)
	}
}

// BenchmarkApply measures one record's transaction: idempotency check,
// row lock, update and one outbox row.
func BenchmarkApply(b *testing.B) {
	pool := dbtest.NewPool(b)
	m := model(b)
	l := ledger.New(pool, m)
	msg := bus.Message{Topic: contract.TopicEngineFeedback, Key: "e1", Value: []byte(`{}`)}
	i := int64(0)
	for b.Loop() {
		i++
		if _, err := admit(l, m, "r", "ev"+time.Duration(i).String(), i, msg); err != nil {
			b.Fatal(err)
		}
	}
}

// TestApplyBatchUnits applies one batch of several units: a unit repeated
// in the batch and one applied before are duplicates, two units changing
// one request see each other's changes in order, a result for a missing
// request changes nothing, and the outbox holds the messages in order.
func TestApplyBatchUnits(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := model(t)
	l := ledger.New(pool, m)
	if _, err := admit(l, m, "r0", "before", 1); err != nil {
		t.Fatal(err)
	}
	var order []string
	change := func(id string, create bool) ledger.Change {
		return ledger.Change{RequestID: id, Create: create, Apply: func(req *requeststate.Request) ([]bus.Message, error) {
			req.LastSeq++
			order = append(order, fmt.Sprint(id, "@", req.LastSeq))
			return []bus.Message{{Topic: contract.TopicEngineFeedback, Key: id, Value: []byte(fmt.Sprintf(`{"n":%d}`, len(order)))}}, nil
		}}
	}
	step := func(id string, changes ...ledger.Change) ledger.Unit {
		return ledger.Unit{Record: ledger.Record{Kind: ledger.KindStep, ID: id, EngineID: "e1"}, Changes: changes}
	}
	units := []ledger.Unit{
		step("s1", change("r1", true), change("r2", true)),
		step("s1", change("r1", true)), // repeated in the batch
		{Record: ledger.Record{Kind: ledger.KindStep, ID: "before", EngineID: "e1", RequestID: "r0"}, Changes: []ledger.Change{change("r0", true)}},
		step("s2", change("r1", true)),
		{Record: ledger.Record{Kind: ledger.KindResult, ID: "x", EngineID: "e1", RequestID: "gone"}, Changes: []ledger.Change{change("gone", false)}},
	}
	st, err := l.ApplyBatch(context.Background(), units)
	if err != nil {
		t.Fatal(err)
	}
	want := []ledger.Status{ledger.Applied, ledger.Duplicate, ledger.Duplicate, ledger.Applied, ledger.NoRequest}
	if !reflect.DeepEqual(st, want) {
		t.Fatalf("statuses %v, want %v", st, want)
	}
	if want := []string{"r1@1", "r2@1", "r1@2"}; !reflect.DeepEqual(order, want) {
		t.Fatalf("changes ran %v, want %v", order, want)
	}
	rows, err := pool.Query(context.Background(), `SELECT key, convert_from(value, 'UTF8') FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var k, v string
		if err := rows.Scan(&k, &v); err != nil {
			t.Fatal(err)
		}
		got = append(got, k+" "+v)
	}
	if want := []string{`r1 {"n":1}`, `r2 {"n":2}`, `r1 {"n":3}`}; !reflect.DeepEqual(got, want) {
		t.Fatalf("outbox %v, want %v", got, want)
	}
	row, err := l.Get(context.Background(), ledger.Key{EngineID: "e1", RequestID: "r1"})
	if err != nil || row.LastSeq != 2 {
		t.Fatalf("r1 stored with last seq %v, %v; want 2", row, err)
	}
}

// TestApplyBatchFold: WithFold sees each transaction's messages whole, in
// the order its changes emitted them — on the locking path (requests
// created) and on the optimistic one (requests held from the first
// batch) — and the outbox holds what it returned.
func TestApplyBatchFold(t *testing.T) {
	pool := dbtest.NewPool(t)
	m := model(t)
	var calls [][]string
	fold := func(msgs []bus.Message) []bus.Message {
		var vals []string
		for _, msg := range msgs {
			vals = append(vals, string(msg.Value))
		}
		calls = append(calls, vals)
		return []bus.Message{{Topic: contract.TopicEngineFeedback, Key: "e1", Value: []byte(strings.Join(vals, "+"))}}
	}
	l := ledger.New(pool, m, ledger.WithFold(fold))
	change := func(id, v string) ledger.Change {
		return ledger.Change{RequestID: id, Create: true, Apply: func(req *requeststate.Request) ([]bus.Message, error) {
			req.LastSeq++
			return []bus.Message{{Topic: contract.TopicEngineFeedback, Key: "e1", Value: []byte(v)}}, nil
		}}
	}
	step := func(id string, changes ...ledger.Change) ledger.Unit {
		return ledger.Unit{Record: ledger.Record{Kind: ledger.KindStep, ID: id, EngineID: "e1"}, Changes: changes}
	}
	ctx := context.Background()
	if _, err := l.ApplyBatch(ctx, []ledger.Unit{step("s1", change("r1", "a"), change("r2", "b")), step("s2", change("r1", "c"))}); err != nil {
		t.Fatal(err)
	}
	if _, err := l.ApplyBatch(ctx, []ledger.Unit{step("s3", change("r2", "d"), change("r1", "e"))}); err != nil {
		t.Fatal(err)
	}
	if want := [][]string{{"a", "b", "c"}, {"d", "e"}}; !reflect.DeepEqual(calls, want) {
		t.Fatalf("fold saw %v, want %v", calls, want)
	}
	var got []string
	rows, err := pool.Query(ctx, `SELECT convert_from(value, 'UTF8') FROM outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			t.Fatal(err)
		}
		got = append(got, v)
	}
	if want := []string{"a+b+c", "d+e"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("outbox %v, want %v", got, want)
	}
}
