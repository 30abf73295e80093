package app_test

import (
	"net/http"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
	"github.com/kvmesh/kvmesh/services/sender/internal/api"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// trackedSave drives request id's tracker with one engine step, writes the
// blocks of the save it emits into the engine's pool, publishes it and
// waits for its result, which it reports to the tracker as the scheduler
// does (the skipped and failed keys summed over the groups).
func (s *stack) trackedSave(t *testing.T, tr *requeststate.Tracker, step kvcore.Step) (*kvcore.SaveTask, contract.TransferResult) {
	t.Helper()
	eff := tr.Step(s.model, step)
	if eff.Err != nil || len(eff.Saves) != 1 {
		t.Fatalf("step %+v of %s: %v, %d saves; want one", step, tr.RequestID, eff.Err, len(eff.Saves))
	}
	task := &eff.Saves[0]
	s.writeBlocks(t, task)
	s.publish(t, task)
	res := s.got.result(t, task.TaskID)
	rep := kvcore.SaveReport{Status: kvcore.SaveStatus(res.Status)}
	for _, g := range res.Groups {
		rep.Skipped += g.Skipped
		rep.Failed += g.Failed
	}
	if eff := tr.OnSaveReport(s.model, task.TaskID, rep); eff.Err != nil {
		t.Fatal(eff.Err)
	}
	return task, res
}

// Scenario 66 against real redis-server with a small maxmemory and
// noeviction (puts answer OOM, "no space"): the store is filled; request
// a's first save is answered no space and its second is skipped by the
// gate (a is under pressure), both counted and reported skipped; room is
// made; request b's save is put and stored while a is still under pressure
// (before issue 14 every request was skipped until a probe went through);
// b's put lets a go, and a's next save, built by its tracker from the
// skipped results, covers [0,64) — the skipped ranges included — and
// stores every key with the pool's bytes. vLLM: worker.py
// KVCacheStoreSendingThread (_mark_request_skipped_for_pressure,
// _should_skip_request, _clear_store_pressure, _saved_offset).
func TestS66_PressureScopedToTheRequest(t *testing.T) {
	tiny := testenv.StartRedis(t, "--maxmemory", "3mb", "--maxmemory-policy", "noeviction").URL()
	s := newStack(t, stackOptions{engines: []string{"e1"}, workerRedis: tiny, senderRedis: tiny,
		config: func(c *app.Config) { c.ProbeEvery = 1000 }}) // and an hour's cool-down: no probe in this test
	stats := func() api.Stats {
		var st api.Stats
		if code := s.do(t, http.MethodGet, "/v1/stats", "", &st); code != http.StatusOK {
			t.Fatalf("stats: %d", code)
		}
		return st
	}
	// Fill the store until a put answers no space.
	var res contract.TransferResult
	for i := 0; res.Status != "skipped"; i++ {
		if i == 20 {
			t.Fatal("the tiny store never answered no space")
		}
		task := s.task(t, "e1", "s66-fill-"+itoa(i), 0, 32, kvcore.BlockID(2*i%40))
		s.publish(t, task)
		res = s.got.result(t, task.TaskID)
	}

	m := s.model
	a := requeststate.NewTracker(m, "e1", "s66-a")
	var hashes []string
	for _, h := range kvcore.HashChain(tokensFor(s.prefix+"s66-a", 64), m.HashBlockSize, nil) {
		hashes = append(hashes, h.Hex())
	}
	a.OnAdmit(hashes, 64)
	tableA := kvcore.BlockTable{{44, 45, 46, 47}, {44, 45, 46, 47}}

	// skippedOnly reports whether res put nothing and skipped at least one
	// key under store pressure.
	skippedOnly := func(res contract.TransferResult) bool {
		var skipped int
		for _, g := range res.Groups {
			if g.Stored != 0 || g.Failed != 0 || g.DeadLettered != 0 || (g.Skipped > 0 && g.Reason != "store_pressure") {
				return false
			}
			skipped += g.Skipped
		}
		return res.Status == "skipped" && skipped > 0
	}
	// The full store answers a's first save no space (the key the store
	// may still take before it is over its limit aside).
	a1, r1 := s.trackedSave(t, a, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tableA})
	if a1.Start != 0 || a1.End != 32 || r1.Status != "skipped" || groupOf(r1, 0).Skipped+groupOf(r1, 1).Skipped == 0 {
		t.Fatalf("a's first save [%d,%d): %+v; want [0,32) answered no space", a1.Start, a1.End, r1)
	}
	a2, r2 := s.trackedSave(t, a, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48})
	if a2.Start != 0 || a2.End != 48 || !skippedOnly(r2) {
		t.Fatalf("a's second save [%d,%d): %+v; want [0,48) skipped without a put", a2.Start, a2.End, r2)
	}
	if st := stats(); !st.Pressure.Active || st.Pressure.SkippedTasks != 1 {
		t.Fatalf("pressure %+v; want on, one task skipped by the gate (a's second)", st.Pressure)
	}
	if want := []requeststate.SaveSpan{{TaskID: a2.TaskID, Start: 0, End: 48}}; !reflect.DeepEqual(a.Unsaved, want) || a.Reports.Skipped != 2 {
		t.Fatalf("a's tracker: unsaved %+v reports %+v; want %+v (the second save covered the first's range)", a.Unsaved, a.Reports, want)
	}

	// Room again: b's save is put (a is still under pressure) and stored.
	if err := redisFlush(t, tiny); err != nil {
		t.Fatal(err)
	}
	b := s.task(t, "e1", "s66-b", 0, 32, 50)
	s.publish(t, b)
	if rb := s.got.result(t, b.TaskID); rb.Status != "stored" || groupOf(rb, 0).Stored != 2 || groupOf(rb, 0).Skipped != 0 {
		t.Fatalf("b's save %+v; want stored, not skipped", rb)
	}
	s.checkStored(t, b, 0)
	if st := stats(); st.Pressure.Active || st.Pressure.SkippedTasks != 1 {
		t.Fatalf("after b's put: pressure %+v; want off", st.Pressure)
	}

	// a's next save covers the ranges its skipped saves left.
	a3, r3 := s.trackedSave(t, a, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64})
	if a3.Start != 0 || a3.End != 64 || r3.Status != "stored" || groupOf(r3, 0).Stored != 4 || groupOf(r3, 0).Existing != 0 || groupOf(r3, 1).Stored != 1 {
		t.Fatalf("a's third save [%d,%d): %+v; want [0,64) storing all 4+1 keys", a3.Start, a3.End, r3)
	}
	s.checkStored(t, a3, 0)
	s.checkStored(t, a3, 1)
	if n := s.missing(t, s.keys(t, a1, 0)); n != 0 {
		t.Fatalf("%d of a's first save's keys still missing", n)
	}
	if len(a.Unsaved) != 0 || a.NumSavedTokens != 64 || a.Reports != (kvcore.SaveCounts{Stored: 1, Skipped: 2}) {
		t.Fatalf("a's tracker: unsaved %+v saved %d reports %+v", a.Unsaved, a.NumSavedTokens, a.Reports)
	}
	s.checkMetrics(t, "kvmesh_sender_pressure_mode 0", "kvmesh_sender_skipped_total", `kvmesh_sender_tasks_total{status="skipped"}`)
}
