package deadletter_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/migrations"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// record is a consumed record at offset.
func record(offset int64) bus.Received {
	return bus.Received{
		Message: bus.Message{Topic: "kvmesh.engine.steps", Key: "e1", Value: []byte(`{"x":1}`),
			Headers: map[string]string{"kvmesh-engine-id": "e1"}},
		Partition: 2, Offset: offset, Time: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
	}
}

// Record keeps one row per record and service, with the record's key and
// headers, and each service sees only its own rows.
func TestRecordListGet(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	sched := deadletter.NewStore(pool, deadletter.ServiceScheduler)
	worker := deadletter.NewStore(pool, deadletter.ServiceGPUWorker)
	calls := 0
	hook := sched.Record(func(context.Context, deadletter.DeadLetter, error) { calls++ })
	for range 2 { // a redelivery keeps one row
		if err := hook(ctx, record(7), kvcore.ReasonUndecodable, errors.New("bad\x00 byte")); err != nil {
			t.Fatal(err)
		}
	}
	if err := worker.Record()(ctx, record(7), kvcore.ReasonInvalidRecord, nil); err != nil {
		t.Fatal(err)
	}
	if calls != 2 {
		t.Errorf("hook called %d times, want each delivery (2)", calls)
	}
	rows, err := sched.List(ctx, deadletter.Filter{Limit: 10})
	if err != nil || len(rows) != 1 {
		t.Fatalf("scheduler rows %+v, %v; want one", rows, err)
	}
	d := rows[0]
	if d.Service != deadletter.ServiceScheduler || d.Reason != kvcore.ReasonUndecodable || d.Detail != "bad\uFFFD byte" ||
		d.Key != "e1" || d.Headers["kvmesh-engine-id"] != "e1" || d.Slot != deadletter.WholeRecord ||
		d.Offset != 7 || d.Partition != 2 || d.ReplayStatus != deadletter.ReplayNone || string(d.Payload) != `{"x":1}` {
		t.Errorf("row %+v", d)
	}
	if got := d.Received(); got.Key != "e1" || got.Offset != 7 || !got.Time.Equal(record(7).Time) || got.Headers["kvmesh-engine-id"] != "e1" {
		t.Errorf("Received() = %+v", got)
	}
	if _, err := worker.Get(ctx, d.ID); !errors.Is(err, deadletter.ErrNotFound) {
		t.Errorf("another service's Get = %v, want ErrNotFound", err)
	}
	if rows, _ := sched.List(ctx, deadletter.Filter{Reason: kvcore.ReasonInvalidRecord, Limit: 10}); len(rows) != 0 {
		t.Errorf("reason filter returned %+v", rows)
	}
	counts := map[string]int64{}
	if err := worker.CountByReason(ctx, counts); err != nil || counts["invalid_record"] != 1 || len(counts) != 1 {
		t.Errorf("gpuworker counts %v, %v", counts, err)
	}
}

// HandlerReplayer records replayed, invalid and failed attempts and answers
// an entry replayed before from its record.
func TestHandlerReplayer(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	store := deadletter.NewStore(pool, deadletter.ServiceGPUWorker)
	var answer error
	var seen []bus.Received
	r := deadletter.NewHandlerReplayer(store, func(_ context.Context, rec bus.Received) error {
		seen = append(seen, rec)
		return answer
	})
	d, _, err := store.Add(ctx, deadletter.FromRecord(record(1), kvcore.ReasonUndecodable, nil))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Replay(ctx, d.ID+1000); !errors.Is(err, deadletter.ErrNotFound) {
		t.Errorf("unknown id: %v", err)
	}

	answer = bus.Permanent(kvcore.ReasonUndecodable, errors.New("still bad"))
	var invalid *deadletter.InvalidError
	if _, err := r.Replay(ctx, d.ID); !errors.As(err, &invalid) || invalid.Reason != kvcore.ReasonUndecodable {
		t.Fatalf("permanent failure: %v, want an InvalidError", err)
	}
	answer = errors.New("store down")
	out, err := r.Replay(ctx, d.ID)
	if !errors.Is(err, deadletter.ErrReplayFailed) || out.DeadLetter.ReplayStatus != deadletter.ReplayFailed || out.DeadLetter.ReplayCount != 2 {
		t.Fatalf("transient failure: %+v, %v", out, err)
	}
	answer = nil
	out, err = r.Replay(ctx, d.ID)
	if err != nil || out.Already || out.DeadLetter.ReplayStatus != deadletter.ReplayDone || out.Result.Status != deadletter.ReplayDone {
		t.Fatalf("success: %+v, %v", out, err)
	}
	out, err = r.Replay(ctx, d.ID)
	if err != nil || !out.Already || out.DeadLetter.ReplayCount != 3 || len(seen) != 3 {
		t.Fatalf("second success: %+v, %v, handler calls %d; want the recorded result, no call", out, err, len(seen))
	}
	if seen[0].Key != "e1" || string(seen[0].Value) != `{"x":1}` || seen[0].Headers["kvmesh-engine-id"] != "e1" {
		t.Errorf("handler got %+v, want the stored record", seen[0])
	}
}

// Migration 0010 moves the scheduler's rows into dead_letters, and its
// down migration moves them back.
func TestMigrationMovesSchedulerRows(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	// Down to 0009: undo 0010 and every migration after it.
	var version int
	if err := pool.QueryRow(ctx, `SELECT version FROM schema_version`).Scan(&version); err != nil {
		t.Fatal(err)
	}
	if _, err := database.MigrateDown(ctx, pool, migrations.FS, version-9); err != nil {
		t.Fatalf("down: %v", err)
	}
	_, err := pool.Exec(ctx, `INSERT INTO scheduler_dead_letters (topic, partition, "offset", key, reason, detail, payload)
		VALUES ('kvmesh.engine.steps', 1, 42, 'e9', 'invalid_record', 'no request id', NULL)`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := database.Migrate(ctx, pool, migrations.FS); err != nil {
		t.Fatalf("up: %v", err)
	}
	rows, err := deadletter.NewStore(pool, deadletter.ServiceScheduler).List(ctx, deadletter.Filter{Limit: 10})
	if err != nil || len(rows) != 1 {
		t.Fatalf("scheduler rows %+v, %v", rows, err)
	}
	if d := rows[0]; d.Key != "e9" || d.Offset != 42 || d.Reason != kvcore.ReasonInvalidRecord || d.Detail != "no request id" || d.Slot != deadletter.WholeRecord {
		t.Errorf("moved row %+v", d)
	}
}

// TestAnyTextIsStored: a record whose key, headers or error text hold NUL
// or invalid UTF-8 is still recorded (with U+FFFD in their place), so a
// consumer is never stuck on its dead letter; its payload is kept as is.
func TestAnyTextIsStored(t *testing.T) {
	t.Parallel()
	pool := dbtest.NewPool(t)
	ctx := context.Background()
	s := deadletter.NewStore(pool, deadletter.ServiceScheduler)
	rec := record(9)
	rec.Key, rec.Value = "k\x00\xff", []byte{0, 0xff}
	rec.Headers = map[string]string{"h\x00": "v\xff"}
	for range 2 {
		if err := s.Record()(ctx, rec, kvcore.ReasonUndecodable, errors.New("bad \x00 byte")); err != nil {
			t.Fatalf("Record: %v", err)
		}
	}
	rows, err := s.List(ctx, deadletter.Filter{Limit: 10})
	if err != nil || len(rows) != 1 {
		t.Fatalf("rows %+v, %v; want one", rows, err)
	}
	d := rows[0]
	if d.Key != "k\uFFFD\uFFFD" || d.Detail != "bad \uFFFD byte" || string(d.Payload) != "\x00\xff" || d.Headers["h\uFFFD"] != "v\uFFFD" {
		t.Errorf("stored key %q, detail %q, payload %q, headers %v", d.Key, d.Detail, d.Payload, d.Headers)
	}
}
