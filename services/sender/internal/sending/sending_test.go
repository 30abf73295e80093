package sending_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/sending"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestValidTaskStoredOnceAndReported(t *testing.T) {
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
	task := saveTask(f.model, "r1", 0, 64, 3)
	value := encode(t, task)
	f.handle(t, value)

	res, ok := f.outcome(t, task.TaskID)
	if !ok {
		t.Fatal("no outcome recorded")
	}
	want := []contract.GroupOutcome{{Group: 0, Stored: 4}, {Group: 1, Stored: 1}}
	if res.Status != "stored" || !equalGroups(res.Groups, want) || res.ResultID != "save/"+task.TaskID {
		t.Fatalf("result = %+v, want stored %+v", res, want)
	}
	// Group 0 (MLA) stores every chunk; group 1 (Mamba) only the state at 64.
	for g, blocks := range map[int][]kvcore.BlockID{0: {3, 4, 5, 6}, 1: {6}} {
		keys := f.keysOf(t, task, g)
		values, errs, err := f.store.Get(context.Background(), keys)
		if err != nil {
			t.Fatal(err)
		}
		for i, v := range values {
			if errs[i] != nil {
				t.Fatalf("group %d key %s: %v", g, keys[i], errs[i])
			}
			payload, err := dataplane.DecodeValue(f.model.Fingerprint(), v)
			if err != nil || !bytes.Equal(payload, blockBytes(f.model, g, blocks[i])) {
				t.Fatalf("group %d key %d holds the wrong block (err %v)", g, i, err)
			}
		}
	}
	events, _ := f.kvRecords(t)
	if len(events) != 2 {
		t.Fatalf("%d kv events, want one per group", len(events))
	}
	if ev := events[0]; ev.Kind() != contract.BlockStored || len(ev.Keys()) != 4 || *ev.Batch.Events[0].GroupIdx != 0 {
		t.Fatalf("kv event %+v", ev)
	}

	// Redelivered (same or another record): nothing new is published.
	f.handle(t, value)
	f.handle(t, value)
	if n := len(f.outbox(t, contract.TopicTransferResults)); n != 1 {
		t.Fatalf("%d transfer results after redelivery, want 1", n)
	}
	if n := len(f.outbox(t, contract.TopicKVEvents)); n != 2 {
		t.Fatalf("%d kv events after redelivery, want 2", n)
	}
}

func equalGroups(a, b []contract.GroupOutcome) bool {
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

// The seed's crash input: a 1-group table for the 2-group model.
func TestSeedCrashInputDeadLettersGroupOneAndStoresGroupZero(t *testing.T) {
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
	task := saveTask(f.model, "seed", 0, 32, 0)
	task.BlockTable = task.BlockTable[:1]
	rec := f.handle(t, encode(t, task))

	res, _ := f.outcome(t, task.TaskID)
	if res.Status != "dead_lettered" || len(res.Groups) != 2 || res.Groups[0].Stored != 2 ||
		res.Groups[1].DeadLettered != 1 || res.Groups[1].Reason != "table_group_count" {
		t.Fatalf("result = %+v", res)
	}
	dls := f.deadLetters(t, rec.Offset)
	if len(dls) != 1 || dls[0].Reason != "table_group_count" || dls[0].Group == nil || *dls[0].Group != 1 ||
		!bytes.Equal(dls[0].Payload, rec.Value) || dls[0].TaskID != task.TaskID {
		t.Fatalf("dead letters = %+v", dls)
	}
	if n := len(f.outbox(t, contract.TopicSaveDLQ)); n != 1 {
		t.Fatalf("%d dlq messages, want 1", n)
	}
	next := saveTask(f.model, "next", 0, 32, 8)
	f.handle(t, encode(t, next))
	if res, _ := f.outcome(t, next.TaskID); res.Status != "stored" {
		t.Fatalf("next task %+v, want stored", res)
	}
}

func TestPartialSaves(t *testing.T) {
	cases := []struct {
		name       string
		start, end int
		present    int // group-0 keys stored beforehand
		want       []contract.GroupOutcome
	}{
		{"saved offset 32 of 64 puts hash blocks 2 and 3 only", 32, 64, 0,
			[]contract.GroupOutcome{{Group: 0, Stored: 2}, {Group: 1, Stored: 1}}},
		{"present keys are not put again", 0, 64, 3,
			[]contract.GroupOutcome{{Group: 0, Stored: 1, Existing: 3}, {Group: 1, Stored: 1}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
			task := saveTask(f.model, "r", tc.start, tc.end, 0)
			full := saveTask(f.model, "r", 0, tc.end, 0)
			for _, k := range f.keysOf(t, full, 0)[:tc.present] {
				if _, err := f.store.Put(context.Background(), []kvstore.Item{{Key: k, Value: []byte("x")}}); err != nil {
					t.Fatal(err)
				}
			}
			f.handle(t, encode(t, task))
			res, _ := f.outcome(t, task.TaskID)
			if !equalGroups(res.Groups, tc.want) {
				t.Fatalf("groups %+v, want %+v", res.Groups, tc.want)
			}
			if tc.start == 32 {
				keys := f.keysOf(t, task, 0)
				if len(keys) != 2 || keys[0] != f.keys.KeyHex(kvcore.Rank{}, 0, task.BlockHashes[2]) ||
					keys[1] != f.keys.KeyHex(kvcore.Rank{}, 0, task.BlockHashes[3]) {
					t.Fatalf("keys %v, want hash blocks 2 and 3", keys)
				}
			}
		})
	}
}

func TestStoreAndWorkerFailures(t *testing.T) {
	cases := []struct {
		name        string
		closedStore bool
		workerDown  int
		wantStatus  string
		wantReason  string
		wantDL      int // dead-letter rows
	}{
		{"existence check keeps failing: dead-lettered", true, 0, "dead_lettered", "exists_failed", 2},
		{"worker down twice: retried, stored", false, 2, "stored", "", 0},
		{"worker down for every retry: failed and dead-lettered", false, 10, "failed", "put_failed", 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			store := kvstore.NewMemory(kvstore.MemoryOptions{})
			f := newFixture(t, dbtest.NewPool(t), store)
			if tc.closedStore {
				_ = store.Close()
			}
			f.worker.setDown(tc.workerDown)
			task := saveTask(f.model, "r", 0, 32, 0)
			rec := f.handle(t, encode(t, task))
			res, _ := f.outcome(t, task.TaskID)
			if res.Status != tc.wantStatus || res.Groups[0].Reason != tc.wantReason {
				t.Fatalf("result %+v, want %s/%s", res, tc.wantStatus, tc.wantReason)
			}
			dls := f.deadLetters(t, rec.Offset)
			if len(dls) != tc.wantDL {
				t.Fatalf("%d dead letters, want %d: %+v", len(dls), tc.wantDL, dls)
			}
			for _, d := range dls {
				if d.Reason != kvcore.Reason(tc.wantReason) || d.Group == nil {
					t.Errorf("dead letter %+v, want reason %s with a group", d, tc.wantReason)
				}
			}
		})
	}
}

func TestPressureModeSkipsUntilAPutSucceeds(t *testing.T) {
	// Room for one task's values and a half.
	m := mustModel(t)
	var taskBytes int
	for g, grp := range m.Groups {
		n := len(m.SaveChunks(g, 0, 32))
		key := kvcore.KeysOf(m).KeyHex(kvcore.Rank{}, g, saveTask(m, "a", 0, 32, 0).BlockHashes[0])
		taskBytes += n * (len(key) + int(grp.BytesPerBlock) + dataplane.ValueOverhead(len(m.Fingerprint())))
	}
	store := kvstore.NewMemory(kvstore.MemoryOptions{CapacityBytes: int64(taskBytes * 3 / 2), NoEviction: true})
	f := newFixture(t, dbtest.NewPool(t), store, func(o *sending.Options) { o.ProbeEvery = 2 })
	fill := saveTask(f.model, "fill", 0, 32, 50)
	f.handle(t, encode(t, fill))
	if res, _ := f.outcome(t, fill.TaskID); res.Status != "stored" {
		t.Fatalf("first task %+v, want stored", res)
	}
	// status handles a save of request id (the n-th of that request).
	status := func(id string, n int, base kvcore.BlockID) contract.TransferResult {
		task := saveTask(f.model, id, 0, 32, base)
		task.TaskID = fmt.Sprintf("%s-%d", task.TaskID, n)
		f.handle(t, encode(t, task))
		res, _ := f.outcome(t, task.TaskID)
		return res
	}
	first := status("a", 1, 0)
	if first.Status != "skipped" || f.p.Pressure().Active != true {
		t.Fatalf("second task %+v, pressure %+v: want skipped (no space) and pressure on", first, f.p.Pressure())
	}
	// Request a is under pressure: its next saves are skipped without a put.
	for n := 2; n <= 3; n++ {
		if res := status("a", n, kvcore.BlockID(10*n)); res.Status != "skipped" || res.Groups[0].Stored != 0 {
			t.Fatalf("save %d of a under pressure: %+v, want skipped", n, res)
		}
	}
	if p := f.p.Pressure(); p.SkippedTasks != 2 || !p.Active || p.Requests != 1 {
		t.Fatalf("pressure %+v, want two tasks skipped by the gate, one request under pressure", p)
	}
	// Request b is not (issue 14: pressure is scoped to the request): its
	// save is put, and the full store answers it no space.
	if res := status("b", 1, 40); res.Status != "skipped" || res.Groups[0].Reason != string(kvcore.ReasonStorePressure) || f.p.Pressure().SkippedTasks != 2 || f.p.Pressure().Requests != 2 {
		t.Fatalf("b's save %+v, pressure %+v: want put and answered no space, no gate skip", res, f.p.Pressure())
	}
	// Free the store: the next put stores and ends pressure mode.
	a := saveTask(f.model, "a", 0, 32, 0)
	keys := append(append(f.keysOf(t, fill, 0), f.keysOf(t, fill, 1)...), append(f.keysOf(t, a, 0), f.keysOf(t, a, 1)...)...)
	if _, err := store.Remove(context.Background(), keys); err != nil {
		t.Fatal(err)
	}
	if res := status("c", 1, 44); res.Status != "stored" || f.p.Pressure().Active || f.p.Pressure().Requests != 0 {
		t.Fatalf("after space returned: %+v, pressure %+v", res, f.p.Pressure())
	}
}

func TestBrokenRecords(t *testing.T) {
	pool := dbtest.NewPool(t)
	f := newFixture(t, pool, kvstore.NewMemory(kvstore.MemoryOptions{}))
	valid := encode(t, saveTask(f.model, "p", 0, 32, 0))
	cases := []struct {
		name        string
		value       []byte
		hook        kvcore.Reason // "" delivers as the consumer does; else the bus dead-letter hook with this reason
		wantReason  kvcore.Reason
		wantOutcome bool
	}{
		{"garbage", []byte{0xff, 0x00, 'x'}, "", "undecodable", false},
		{"unknown field, ids readable", []byte(`{"task_id":"u1","engine_id":"e1","request_id":"r9","junk":1}`), "", "undecodable", true},
		{"NUL in request id", []byte(`{"schema":"kvmesh.save_task.v1","task_id":"u2","engine_id":"e1","request_id":"r\u0000","model":"m"}`), "", "undecodable", false},
		{"handler panicked", valid, kvcore.ReasonHandlerPanic, kvcore.ReasonHandlerPanic, true},
		{"retries exhausted", []byte(`{"task_id":"u3","engine_id":"e1","request_id":"r3"}`), kvcore.ReasonRetriesExhausted, kvcore.ReasonRetriesExhausted, true},
	}
	var pe *bus.PermanentError
	if err := f.p.Handle(context.Background(), f.record([]byte("not json"))); !errors.As(err, &pe) || pe.Reason != kvcore.ReasonUndecodable {
		t.Fatalf("Handle of an undecodable record = %v, want a permanent %s failure for the consumer to dead-letter", err, kvcore.ReasonUndecodable)
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec := f.record(tc.value)
			run := func() {
				if tc.hook == "" {
					f.deliver(t, rec)
					return
				}
				if err := f.p.DeadLetter(context.Background(), rec, tc.hook, errors.New("boom")); err != nil {
					t.Fatal(err)
				}
			}
			run()
			run() // a redelivery adds nothing
			dls := f.deadLetters(t, rec.Offset)
			if len(dls) != 1 || dls[0].Reason != tc.wantReason || dls[0].Group != nil || !bytes.Equal(dls[0].Payload, tc.value) {
				t.Fatalf("dead letters %+v, want one whole-record %s", dls, tc.wantReason)
			}
			var ids struct {
				TaskID string `json:"task_id"`
			}
			_ = json.Unmarshal(tc.value, &ids)
			res, ok := f.outcome(t, ids.TaskID)
			if ok != tc.wantOutcome {
				t.Fatalf("outcome recorded %v, want %v", ok, tc.wantOutcome)
			}
			if ok && (res.Status != "dead_lettered" || len(res.Groups) != len(f.model.Groups)) {
				t.Fatalf("outcome %+v, want every group dead-lettered", res)
			}
		})
	}
}

func TestEveryInvalidGroupDeadLetteredWithItsReason(t *testing.T) {
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}))
	cases := []struct {
		name   string
		mutate func(*kvcore.SaveTask)
		want   map[int]kvcore.Reason // group → reason; absent groups are stored
	}{
		{"null block in group 1", func(t *kvcore.SaveTask) { t.BlockTable[1][1] = kvcore.NullBlock },
			map[int]kvcore.Reason{1: kvcore.ReasonNullBlock}},
		{"group 0 table too short", func(t *kvcore.SaveTask) { t.BlockTable[0] = t.BlockTable[0][:1] },
			map[int]kvcore.Reason{0: kvcore.ReasonTableTooShort}},
		{"another model", func(t *kvcore.SaveTask) { t.Model = "other" },
			map[int]kvcore.Reason{0: kvcore.ReasonModelUnknown, 1: kvcore.ReasonModelUnknown}},
		{"empty table", func(t *kvcore.SaveTask) { t.BlockTable = kvcore.BlockTable{} },
			map[int]kvcore.Reason{0: kvcore.ReasonTableGroupCount, 1: kvcore.ReasonTableGroupCount}},
		{"entry for group 5", func(t *kvcore.SaveTask) { t.Groups = append(t.Groups, kvcore.GroupChunks{Group: 5}) },
			map[int]kvcore.Reason{5: kvcore.ReasonGroupOutOfRange}},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			task := saveTask(f.model, "inv"+string(rune('a'+i)), 0, 32, 0)
			tc.mutate(task)
			rec := f.handle(t, encode(t, task))
			res, _ := f.outcome(t, task.TaskID)
			for _, g := range res.Groups {
				reason, bad := tc.want[g.Group]
				if bad && (g.DeadLettered == 0 || g.Reason != string(reason)) || !bad && g.DeadLettered != 0 {
					t.Errorf("group %+v, want reason %q", g, reason)
				}
			}
			if n := len(f.deadLetters(t, rec.Offset)); n != len(tc.want) {
				t.Errorf("%d dead letters, want %d", n, len(tc.want))
			}
		})
	}
}

func TestReplay(t *testing.T) {
	pool := dbtest.NewPool(t)
	broken := kvstore.NewMemory(kvstore.MemoryOptions{})
	_ = broken.Close()
	down := newFixture(t, pool, broken)
	ctx := context.Background()

	seed := saveTask(down.model, "seed", 0, 32, 0)
	seed.BlockTable = seed.BlockTable[:1]
	seedRec := down.handle(t, encode(t, seed))
	failed := saveTask(down.model, "flaky", 0, 32, 4)
	failedRec := down.handle(t, encode(t, failed))

	// A sender whose store works again replays the entries.
	up := newFixture(t, pool, kvstore.NewMemory(kvstore.MemoryOptions{}))
	seedDL := down.deadLetters(t, seedRec.Offset)
	if len(seedDL) != 2 || seedDL[0].Reason != "table_group_count" || seedDL[1].Reason != "exists_failed" {
		t.Fatalf("seed dead letters %+v, want group 1 invalid and group 0 exists_failed", seedDL)
	}
	_, err := up.p.Replay(ctx, seedDL[0].ID)
	var invalid *deadletter.InvalidError
	if !errors.As(err, &invalid) || invalid.Reason != "table_group_count" || *invalid.Group != 1 {
		t.Fatalf("replay of the seed's group 1 = %v, want still invalid (table_group_count)", err)
	}
	if _, err := up.p.Replay(ctx, 999999); !errors.Is(err, deadletter.ErrNotFound) {
		t.Fatalf("replay of an unknown id = %v", err)
	}

	dls := down.deadLetters(t, failedRec.Offset)
	var group1 deadletter.DeadLetter
	for _, d := range dls {
		if d.Reason == "exists_failed" && *d.Group == 1 {
			group1 = d
		}
	}
	first, err := up.p.Replay(ctx, group1.ID)
	if err != nil {
		t.Fatal(err)
	}
	if first.Already || first.Result.Status != "stored" || first.DeadLetter.ReplayStatus != deadletter.ReplayDone ||
		len(first.Result.Groups) != 1 || first.Result.Groups[0].Stored != 1 {
		t.Fatalf("first replay %+v", first)
	}
	if _, errs, _ := up.store.Get(ctx, up.keysOf(t, failed, 1)); errs[0] != nil {
		t.Fatalf("replayed key not in the store: %v", errs[0])
	}
	if _, errs, _ := up.store.Get(ctx, up.keysOf(t, failed, 0)); errs[0] == nil {
		t.Fatal("group 0 was stored by a replay of group 1")
	}
	again, err := up.p.Replay(ctx, group1.ID)
	if err != nil || !again.Already || again.DeadLetter.ReplayCount != 1 || again.Result.Groups[0].Stored != 1 {
		t.Fatalf("second replay %+v, %v: want a no-op answering the recorded result", again, err)
	}
	if puts := up.worker.puts; puts != 1 {
		t.Fatalf("%d put requests, want 1", puts)
	}
}

func TestSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	f := newFixture(t, dbtest.NewPool(t), kvstore.NewMemory(kvstore.MemoryOptions{}),
		func(o *sending.Options) { o.TracerProvider = tp })
	task := saveTask(f.model, "traced", 0, 32, 0)
	task.BlockTable = task.BlockTable[:1]
	f.handle(t, encode(t, task))

	spans := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		spans[s.Name()] = s
	}
	for _, name := range []string{"sender.validate", "sender.exists", "sender.put"} {
		s, ok := spans[name]
		if !ok {
			t.Fatalf("no %s span; got %v", name, spans)
		}
		attrs := map[attribute.Key]attribute.Value{}
		for _, a := range s.Attributes() {
			attrs[a.Key] = a.Value
		}
		if attrs["kvmesh.engine_id"].AsString() != "e1" || attrs["kvmesh.request_id"].AsString() != "traced" {
			t.Errorf("%s attributes %v", name, attrs)
		}
		if name != "sender.validate" && fmt.Sprint(attrs["kvmesh.groups"].AsInt64Slice()) != "[0]" {
			t.Errorf("%s groups %v, want [0]", name, attrs["kvmesh.groups"])
		}
	}
	events := spans["sender.validate"].Events()
	if len(events) != 1 || events[0].Name != "group_invalid" ||
		fmt.Sprint(events[0].Attributes) != fmt.Sprint([]attribute.KeyValue{attribute.Int("kvmesh.group", 1), attribute.String("kvmesh.reason", "table_group_count")}) {
		t.Fatalf("validate events %+v", events)
	}
	dl, ok := spans["sender.dead_letter"]
	if !ok {
		t.Fatal("no sender.dead_letter span")
	}
	attrs := map[attribute.Key]attribute.Value{}
	for _, a := range dl.Attributes() {
		attrs[a.Key] = a.Value
	}
	if attrs["kvmesh.reason"].AsString() != "table_group_count" || attrs["kvmesh.group"].AsInt64() != 1 ||
		attrs["kvmesh.dead_letter_id"].AsInt64() == 0 || dl.Status().Code != codes.Error {
		t.Errorf("dead-letter span attributes %v status %v", attrs, dl.Status())
	}
}
