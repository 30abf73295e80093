package ledger_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.Date(2026, 9, 1, 12, 0, 0, 0, time.UTC)

func src(offset int64) ledger.Source {
	return ledger.Source{Topic: contract.TopicSaveTasks, Partition: 1, Offset: offset, Time: t0, Key: "r1", Payload: []byte(`{"x":1}`)}
}

func group(g int) *int { return &g }

func taskEntry(taskID string, offset int64, dls ...deadletter.DeadLetter) ledger.Entry {
	res := contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "save/" + taskID, Kind: contract.TransferSave,
		TaskID: taskID, EngineID: "e1", RequestID: "r1", Status: "dead_lettered", Bytes: 10,
		Groups: []contract.GroupOutcome{{Group: 0, Stored: 2, Existing: 1}, {Group: 1, DeadLettered: 1, Reason: "table_group_count"}}}
	v, _ := json.Marshal(res)
	return ledger.Entry{
		Source:      src(offset),
		Outcome:     &ledger.Outcome{Result: res, Groups: map[string]int{"stored": 1, "dead_lettered": 1}},
		DropIfDone:  true,
		DeadLetters: dls,
		Messages:    []bus.Message{{Topic: contract.TopicTransferResults, Key: "r1", Value: v}},
	}
}

func outboxCount(t *testing.T, pool *pgxpool.Pool, topic string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM outbox WHERE topic = $1", topic).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestCommitIsIdempotentPerTask(t *testing.T) {
	pool := dbtest.NewPool(t)
	l := ledger.New(pool)
	ctx := context.Background()
	dl := deadletter.DeadLetter{Reason: "table_group_count", Detail: "no block list for group 1", Group: group(1), Slot: 0,
		TaskID: "t1", EngineID: "e1", RequestID: "r1"}

	c, err := l.Commit(ctx, taskEntry("t1", 5, dl))
	if err != nil {
		t.Fatal(err)
	}
	if c.Done || len(c.DeadLetters) != 1 || c.DeadLetters[0].ID == 0 {
		t.Fatalf("first commit = %+v, want one new dead letter", c)
	}
	// The same task again, from the same or another offset, leaves nothing.
	for _, off := range []int64{5, 9} {
		c, err = l.Commit(ctx, taskEntry("t1", off, dl))
		if err != nil {
			t.Fatal(err)
		}
		if !c.Done || len(c.DeadLetters) != 0 {
			t.Fatalf("redelivery at %d = %+v, want done with nothing new", off, c)
		}
	}
	if got := outboxCount(t, pool, contract.TopicTransferResults); got != 1 {
		t.Errorf("transfer results enqueued = %d, want 1", got)
	}
	if got := outboxCount(t, pool, contract.TopicSaveDLQ); got != 1 {
		t.Errorf("dlq messages enqueued = %d, want 1", got)
	}
	// The first delivery's outcome and dead letter are the only ones kept.
	var rows int
	var offset int64
	if err := pool.QueryRow(ctx, `SELECT count(*), min("offset") FROM save_outcomes WHERE task_id = 't1'`).Scan(&rows, &offset); err != nil {
		t.Fatal(err)
	}
	if rows != 1 || offset != 5 {
		t.Fatalf("save_outcomes of t1: %d rows, offset %d; want 1 row, from offset 5", rows, offset)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM dead_letters WHERE task_id = 't1'`).Scan(&rows); err != nil || rows != 1 {
		t.Fatalf("dead letters of t1: %d (%v), want 1", rows, err)
	}

	var msg []byte
	if err := pool.QueryRow(ctx, "SELECT value FROM outbox WHERE topic = $1", contract.TopicSaveDLQ).Scan(&msg); err != nil {
		t.Fatal(err)
	}
	var got contract.DeadLetterNotice
	if err := json.Unmarshal(msg, &got); err != nil {
		t.Fatal(err)
	}
	if got.Reason != "table_group_count" || got.Group == nil || *got.Group != 1 || got.TaskID != "t1" ||
		got.Offset != 5 || string(got.Payload) != `{"x":1}` || got.Schema != contract.SchemaDeadLetter {
		t.Errorf("dlq message = %+v", got)
	}
}

func TestWholeRecordDeadLetterDedupedPerDelivery(t *testing.T) {
	pool := dbtest.NewPool(t)
	l := ledger.New(pool)
	ctx := context.Background()
	dl := deadletter.DeadLetter{Reason: "undecodable", Detail: "bad\x00 byte \xff", Slot: deadletter.WholeRecord}
	cases := []struct {
		name    string
		source  ledger.Source
		wantNew int
	}{
		{"first delivery", src(7), 1},
		{"redelivery of the same record", src(7), 0},
		{"same offset after a broker reset (new record time)", func() ledger.Source { s := src(7); s.Time = t0.Add(time.Hour); return s }(), 1},
	}
	for _, tc := range cases {
		c, err := l.Commit(ctx, ledger.Entry{Source: tc.source, DeadLetters: []deadletter.DeadLetter{dl}})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if len(c.DeadLetters) != tc.wantNew {
			t.Errorf("%s: %d new dead letters, want %d", tc.name, len(c.DeadLetters), tc.wantNew)
		}
	}
	if got := outboxCount(t, pool, contract.TopicSaveDLQ); got != 2 {
		t.Errorf("dlq messages = %d, want 2", got)
	}
	rows, err := l.DeadLetters().List(ctx, deadletter.Filter{Reason: "undecodable", Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 2 || rows[0].Detail != "bad\uFFFD byte \uFFFD" || rows[0].Group != nil {
		t.Fatalf("rows = %+v, want 2 with the detail made storable", rows)
	}
}

func TestListFiltersAndPages(t *testing.T) {
	pool := dbtest.NewPool(t)
	l := ledger.New(pool)
	ctx := context.Background()
	for i, d := range []struct{ reason, engine, request string }{
		{"null_block", "e1", "r1"}, {"table_group_count", "e1", "r2"}, {"null_block", "e2", "r3"},
		{"null_block", "e1", "r4"}, {"exists_failed", "e2", "r5"},
	} {
		_, err := l.Commit(ctx, ledger.Entry{Source: src(int64(i)), DeadLetters: []deadletter.DeadLetter{{
			Reason: kvcore.Reason(d.reason), Group: group(0), EngineID: d.engine, RequestID: d.request, TaskID: "t" + d.request}}})
		if err != nil {
			t.Fatal(err)
		}
	}
	requests := func(rows []deadletter.DeadLetter) []string {
		var out []string
		for _, r := range rows {
			out = append(out, r.RequestID)
		}
		return out
	}
	cases := []struct {
		name string
		f    deadletter.Filter
		want []string
	}{
		{"all, newest first", deadletter.Filter{Limit: 10}, []string{"r5", "r4", "r3", "r2", "r1"}},
		{"by reason", deadletter.Filter{Reason: "null_block", Limit: 10}, []string{"r4", "r3", "r1"}},
		{"by engine", deadletter.Filter{EngineID: "e2", Limit: 10}, []string{"r5", "r3"}},
		{"by request", deadletter.Filter{RequestID: "r2", Limit: 10}, []string{"r2"}},
		{"by reason and engine", deadletter.Filter{Reason: "null_block", EngineID: "e1", Limit: 10}, []string{"r4", "r1"}},
		{"first page", deadletter.Filter{Limit: 2}, []string{"r5", "r4"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rows, err := l.DeadLetters().List(ctx, tc.f)
			if err != nil {
				t.Fatal(err)
			}
			if got := requests(rows); !equal(got, tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
	first, _ := l.DeadLetters().List(ctx, deadletter.Filter{Limit: 2})
	next, err := l.DeadLetters().List(ctx, deadletter.Filter{Limit: 2, Before: first[1].ID})
	if err != nil {
		t.Fatal(err)
	}
	if got := requests(next); !equal(got, []string{"r3", "r2"}) {
		t.Fatalf("second page %v", got)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestReplayRecordedOnceSuccessful(t *testing.T) {
	pool := dbtest.NewPool(t)
	l := ledger.New(pool)
	ctx := context.Background()
	c, err := l.Commit(ctx, ledger.Entry{Source: src(1), DeadLetters: []deadletter.DeadLetter{{Reason: "exists_failed", Group: group(0)}}})
	if err != nil {
		t.Fatal(err)
	}
	id := c.DeadLetters[0].ID
	if _, err := l.Get(ctx, id+100); !errors.Is(err, deadletter.ErrNotFound) {
		t.Fatalf("Get(unknown) = %v, want ErrNotFound", err)
	}
	steps := []struct {
		status      string
		wantApplied bool
		wantStatus  string
		wantCount   int
	}{
		{deadletter.ReplayFailed, true, deadletter.ReplayFailed, 1},
		{deadletter.ReplayDone, true, deadletter.ReplayDone, 2},
		{deadletter.ReplayDone, false, deadletter.ReplayDone, 2},
		{deadletter.ReplayFailed, false, deadletter.ReplayDone, 2},
	}
	kv := bus.Message{Topic: contract.TopicKVEvents, Key: "r", Value: []byte(`{}`)}
	for i, s := range steps {
		d, applied, err := l.RecordReplay(ctx, id, s.status, map[string]int{"step": i}, kv)
		if err != nil {
			t.Fatal(err)
		}
		if applied != s.wantApplied || d.ReplayStatus != s.wantStatus || d.ReplayCount != s.wantCount {
			t.Fatalf("step %d: applied %v status %s count %d, want %v %s %d", i, applied, d.ReplayStatus, d.ReplayCount,
				s.wantApplied, s.wantStatus, s.wantCount)
		}
	}
	d, _ := l.Get(ctx, id)
	if string(d.ReplayResult) != `{"step": 1}` {
		t.Errorf("recorded result %s, want the successful replay's", d.ReplayResult)
	}
	if got := outboxCount(t, pool, contract.TopicKVEvents); got != 2 {
		t.Errorf("kv events enqueued %d, want 2 (one per applied replay)", got)
	}
}

func TestStatsSumTheAccounting(t *testing.T) {
	pool := dbtest.NewPool(t)
	l := ledger.New(pool)
	ctx := context.Background()
	for i, id := range []string{"t1", "t2"} {
		e := taskEntry(id, int64(i), deadletter.DeadLetter{Reason: "null_block", Group: group(1), Slot: 0})
		if _, err := l.Commit(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := l.Commit(ctx, ledger.Entry{Source: src(9), DeadLetters: []deadletter.DeadLetter{{Reason: "undecodable", Slot: -1}}}); err != nil {
		t.Fatal(err)
	}
	s, err := l.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	checks := []struct {
		name      string
		got, want int64
	}{
		{"tasks total", s.Tasks["total"], 2},
		{"tasks dead_lettered", s.Tasks["dead_lettered"], 2},
		{"groups stored", s.Groups["stored"], 2},
		{"groups dead_lettered", s.Groups["dead_lettered"], 2},
		{"keys stored", s.Keys["stored"], 4},
		{"keys existing", s.Keys["existing"], 2},
		{"keys dead_lettered", s.Keys["dead_lettered"], 2},
		{"bytes", s.Bytes, 20},
		{"dead letters null_block", s.DeadLetters["null_block"], 2},
		{"dead letters undecodable", s.DeadLetters["undecodable"], 1},
		{"dead letters total", s.DeadLetters["total"], 3},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %d, want %d", c.name, c.got, c.want)
		}
	}
}

// TestHugeDeadLetterMessageIsBounded: the kvmesh.save.dlq message of a
// ~900 KiB payload carries at most contract.MaxDeadLetterPayload bytes of it,
// its size and the dead_letters row it is kept in, whose payload (what
// GET /v1/dlq/{id} serves) is the full original.
func TestHugeDeadLetterMessageIsBounded(t *testing.T) {
	pool := dbtest.NewPool(t)
	l := ledger.New(pool)
	ctx := context.Background()
	huge := bytes.Repeat([]byte{0xff, 0x00, 0x7f}, 900<<10/3)
	e := ledger.Entry{Source: src(3), DeadLetters: []deadletter.DeadLetter{{Reason: "undecodable", Slot: deadletter.WholeRecord}}}
	e.Source.Payload = huge
	c, err := l.Commit(ctx, e)
	if err != nil || len(c.DeadLetters) != 1 {
		t.Fatalf("Commit = %+v, %v; want one dead letter", c, err)
	}
	id := c.DeadLetters[0].ID
	var msg []byte
	if err := pool.QueryRow(ctx, "SELECT value FROM outbox WHERE topic = $1", contract.TopicSaveDLQ).Scan(&msg); err != nil {
		t.Fatal(err)
	}
	// The base64 payload and a few hundred bytes of fields.
	if limit := base64.StdEncoding.EncodedLen(contract.MaxDeadLetterPayload) + 1024; len(msg) > limit {
		t.Errorf("dlq message of %d bytes, want at most %d", len(msg), limit)
	}
	var got contract.DeadLetterNotice
	if err := json.Unmarshal(msg, &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Payload) != contract.MaxDeadLetterPayload || !bytes.HasPrefix(huge, got.Payload) ||
		got.PayloadBytes != len(huge) || !got.PayloadTruncated ||
		got.ID != strconv.FormatInt(id, 10) || got.PayloadRef != "/v1/dlq/"+got.ID {
		t.Errorf("dlq message: %d payload bytes, payload_bytes %d, truncated %v, id %q, ref %q; "+
			"want the first %d bytes, %d, true, %d, /v1/dlq/%d", len(got.Payload), got.PayloadBytes,
			got.PayloadTruncated, got.ID, got.PayloadRef, contract.MaxDeadLetterPayload, len(huge), id, id)
	}
	stored, err := l.Get(ctx, id)
	if err != nil || !bytes.Equal(stored.Payload, huge) {
		t.Errorf("Get(%d) payload of %d bytes (%v), want the full %d", id, len(stored.Payload), err, len(huge))
	}
}
