package app_test

import (
	"net/http"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// TestScenarios drives docs/architecture.md scenarios 3–13, 20 and 21
// through Kafka against one running scheduler (two-group model: full
// attention + Mamba, bs 16, hash 16). Scenarios 3–6 are the lookup's: here
// they arrive as lookup decisions carrying those LoadSpecs, and the test
// checks the tasks the scheduler derives from them.
func TestScenarios(t *testing.T) {
	h := newMesh(t, meshOptions{})
	cases := []struct {
		name string
		run  func(t *testing.T, h *mesh)
	}{
		{"S03_lookup_hits_become_loads", s03},
		{"S04_two_groups_all_or_nothing", s04},
		{"S06_need_and_load_spec", s06},
		{"S07_48_tokens_can_load_vs_not", s07},
		{"S08_pending_accepted_load_one_load_no_save", s08},
		{"S09_rejected_load_emits_nothing_finish_frees", s09},
		{"S10_decode_step_no_save", s10},
		{"S11_running_reaches_48_saves", s11},
		{"S12_preempted_resets_finish_frees_now", s12},
		{"S13_resumed", s13},
		{"S20_finish_waits_for_inflight_save", s20},
		{"S21_multiconnector", s21},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, h.on(t))
		})
	}
}

// on returns a copy of h whose failures are reported on t.
func (h *mesh) on(t *testing.T) *mesh {
	c := *h
	c.t = t
	return &c
}

// acceptedLoad runs lookup (store child, spec), allocation and one pending
// step, and returns the single load task.
func acceptedLoad(t *testing.T, h *mesh, spec kvcore.LoadSpec, tbl kvcore.BlockTable) (*request, kvcore.LoadTask) {
	t.Helper()
	r := h.request("load")
	r.admit(48)
	need := spec.KVPoolCachedTokens - spec.VLLMCachedTokens
	r.decide("d1", "store", need, storeChild(need, &spec))
	r.allocate(need, tbl, "d1")
	r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	loads := r.waitLoads(1)
	r.settled()
	if n := len(r.loads()); n != 1 || len(r.saves()) != 0 {
		t.Fatalf("%d loads and %d saves, want 1 and 0", n, len(r.saves()))
	}
	return r, loads[0]
}

// checkLoad asserts a load's range, groups, table and key.
func checkLoad(t *testing.T, h *mesh, r *request, l kvcore.LoadTask, start, end int, tbl kvcore.BlockTable) {
	t.Helper()
	if l.Start != start || l.End != end || l.Connector != "store" || l.EngineID != r.engine {
		t.Fatalf("load [%d,%d) via %s for %s, want [%d,%d) via store for %s", l.Start, l.End, l.Connector, l.EngineID, start, end, r.engine)
	}
	if !reflect.DeepEqual(l.Groups, h.model.LoadGroups(start, end)) || !reflect.DeepEqual(l.BlockTable, tbl) {
		t.Fatalf("load groups %+v table %v", l.Groups, l.BlockTable)
	}
	if keys := h.out.keys(contract.TopicLoadTasks, r.id); len(keys) != 1 || keys[0] != r.engine {
		t.Fatalf("load task keys %v, want the engine id %s", keys, r.engine)
	}
}

// s03: 48 tokens, exists [1,1,0] → 32; 32 tokens → 16 (full-hit rule);
// 33 tokens → 32.
func s03(t *testing.T, h *mesh) {
	for _, c := range []struct {
		name string
		hit  int
	}{{"48_tokens_110", 32}, {"32_tokens_full_hit", 16}, {"33_tokens", 32}} {
		t.Run(c.name, func(t *testing.T) {
			h := h.on(t)
			r, l := acceptedLoad(t, h, kvcore.LoadSpec{KVPoolCachedTokens: c.hit}, table(0, 3))
			checkLoad(t, h, r, l, 0, c.hit, table(0, 3))
		})
	}
}

// s04: two groups, 33 tokens all present → 32 (the Mamba group loads only
// its last chunk); one group's chunk missing → 0: no load, the prompt saves.
func s04(t *testing.T, h *mesh) {
	r, l := acceptedLoad(t, h, kvcore.LoadSpec{KVPoolCachedTokens: 32}, table(0, 3))
	checkLoad(t, h, r, l, 0, 32, table(0, 3))
	want := []kvcore.GroupChunks{
		{Group: 0, Chunks: []kvcore.Chunk{{Start: 0, End: 16}, {Start: 16, End: 32}}},
		{Group: 1, Chunks: []kvcore.Chunk{{Start: 16, End: 32}}},
	}
	if !reflect.DeepEqual(l.Groups, want) {
		t.Fatalf("groups %+v, want %+v", l.Groups, want)
	}

	r = h.request("s04miss")
	r.admit(33)
	r.decide("d1", "", 0, storeChild(0, nil))
	r.allocate(0, table(0, 3), "d1")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 33, Table: table(0, 3)})
	saves := r.waitSaves(1)
	r.settled()
	if len(r.loads()) != 0 || len(r.saves()) != 1 || saves[0].Start != 0 || saves[0].End != 32 {
		t.Fatalf("miss: %d loads, saves %+v", len(r.loads()), saves)
	}
}

// s06: hit 32, 48 tokens, computed 16 → need 16, LoadSpec(16, 32): the load
// is [16,32). Computed 32, hit 32 → no LoadSpec: no load. 12 tokens → 0:
// nothing at all.
func s06(t *testing.T, h *mesh) {
	t.Run("computed_16", func(t *testing.T) {
		h := h.on(t)
		r, l := acceptedLoad(t, h, kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 32}, table(0, 3))
		checkLoad(t, h, r, l, 16, 32, table(0, 3))
	})
	t.Run("computed_32_no_spec", func(t *testing.T) {
		h := h.on(t)
		r := h.request("s06b")
		r.admit(48)
		r.decide("d1", "", 0, storeChild(0, nil))
		r.allocate(0, table(0, 3), "d1")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
		r.waitSaves(1)
		d := r.settled()
		if len(r.loads()) != 0 || d.Tracker.Load.Spec != nil || !d.Tracker.Load.LookedUp {
			t.Fatalf("%d loads, load state %+v", len(r.loads()), d.Tracker.Load)
		}
	})
	t.Run("12_tokens", func(t *testing.T) {
		h := h.on(t)
		r := h.request("s06c")
		r.admit(12)
		r.decide("d1", "", 0, storeChild(0, nil))
		r.allocate(0, table(0, 1), "d1")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 12, Table: table(0, 1)})
		r.settled()
		if n := h.outboxCount(contract.TopicSaveTasks, r.id) + h.outboxCount(contract.TopicLoadTasks, r.id); n != 0 {
			t.Fatalf("%d tasks for a 12-token request", n)
		}
	})
}

// s07: 48 tokens with can_load → a load, no save, saved 0; without → a
// save of 48, no load.
func s07(t *testing.T, h *mesh) {
	for _, accept := range []bool{true, false} {
		r := h.request("s07")
		r.admit(48)
		r.decide("d1", "store", 32, storeChild(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
		external := 0
		if accept {
			external = 32
		}
		r.allocate(external, table(0, 3), "d1")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
		if accept {
			r.waitLoads(1)
		} else {
			r.waitSaves(1)
		}
		d := r.settled()
		saves, loads := r.saves(), r.loads()
		switch {
		case accept && (len(saves) != 0 || len(loads) != 1 || d.NumSavedTokens != 0 || loads[0].End != 32):
			t.Fatalf("can_load: saves %+v loads %+v saved %d", saves, loads, d.NumSavedTokens)
		case !accept && (len(saves) != 1 || len(loads) != 0 || d.NumSavedTokens != 48 || saves[0].End != 48):
			t.Fatalf("no can_load: saves %+v loads %+v saved %d", saves, loads, d.NumSavedTokens)
		}
	}
}

// s08: pending load with can_load → one load, no save; a second pending
// step adds nothing.
func s08(t *testing.T, h *mesh) {
	r, l := acceptedLoad(t, h, kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 48}, table(0, 4))
	checkLoad(t, h, r, l, 16, 48, table(0, 4))
	if len(l.BlockHashes) != 3 {
		t.Fatalf("load carries %d hashes, want 3", len(l.BlockHashes))
	}
	r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	r.settled()
	if len(r.loads()) != 1 || len(r.saves()) != 0 {
		t.Fatalf("after a second pending step: %d loads, %d saves", len(r.loads()), len(r.saves()))
	}
}

// s09: the seed's crash path. A pending load whose LoadSpec was rejected
// (can_load false), with an empty table on a two-group model, emits
// nothing; the request's finish frees at once.
func s09(t *testing.T, h *mesh) {
	r := h.request("s09")
	r.admit(48)
	r.decide("d1", "store", 32, storeChild(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	r.allocate(0, kvcore.BlockTable{}, "d1")
	for range 3 {
		r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	}
	d := r.settled()
	if s := d.Tracker.Load.Spec; s == nil || s.CanLoad || s.KVPoolCachedTokens != 32 {
		t.Fatalf("load spec %+v, want kept with can_load false", s)
	}
	for _, topic := range outputs {
		if n := h.outboxCount(topic, r.id); n != 0 {
			t.Fatalf("%d %s rows for a rejected load", n, topic)
		}
	}
	if d.State != string(requeststate.StateWaiting) || d.Error != "" {
		t.Fatalf("state %s error %q", d.State, d.Error)
	}
	r.finish()
	f := r.waitFeedback(kvcore.FeedbackFinishedSending)
	r.settled()
	if !f.Immediate || len(r.saves())+len(r.loads()) != 0 || len(r.feedback()) != 1 {
		t.Fatalf("finish: %+v, %d saves, %d loads, %d feedback", f, len(r.saves()), len(r.loads()), len(r.feedback()))
	}
}

// s10: decode step, tracker 44 saved 32, new block → no save, table grows.
func s10(t *testing.T, h *mesh) {
	r := h.request("s10")
	r.admit(44)
	r.allocate(0, table(0, 2), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 44, Table: table(0, 2)})
	s := r.waitSaves(1)
	if s[0].Start != 0 || s[0].End != 32 {
		t.Fatalf("save %+v, want [0,32)", s[0])
	}
	r.step(kvcore.Step{Kind: kvcore.StepDecode, Tokens: 45, Table: kvcore.BlockTable{{2}, {102}}})
	d := r.settled()
	if len(r.saves()) != 1 || !reflect.DeepEqual(d.Tracker.Table, table(0, 3)) || d.NumSavedTokens != 32 {
		t.Fatalf("decode: %d saves, table %v, saved %d", len(r.saves()), d.Tracker.Table, d.NumSavedTokens)
	}
}

// s11: a running request reaching 48 tokens saves [32,48).
func s11(t *testing.T, h *mesh) {
	r := h.request("s11")
	r.admit(64)
	r.allocate(0, table(0, 2), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)})
	r.step(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: kvcore.BlockTable{{2}, {102}}})
	s := r.waitSaves(2)
	d := r.settled()
	want := []kvcore.GroupChunks{
		{Group: 0, Chunks: []kvcore.Chunk{{Start: 32, End: 48}}},
		{Group: 1, Chunks: []kvcore.Chunk{{Start: 32, End: 48}}},
	}
	if len(s) != 2 || s[1].Start != 32 || s[1].End != 48 || !reflect.DeepEqual(s[1].Groups, want) || d.NumSavedTokens != 48 {
		t.Fatalf("saves %+v, saved %d", s, d.NumSavedTokens)
	}
}

// s12: preempted → tracker reset; finish → free now.
func s12(t *testing.T, h *mesh) {
	r := h.request("s12")
	r.admit(48)
	r.decide("d1", "", 0, storeChild(0, nil))
	r.allocate(0, table(0, 3), "d1")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
	r.saved(r.waitSaves(1)[0])
	r.preempt()
	d := r.settled()
	eventually(t, "the save result", func() bool { d, _ = r.detail(); return len(d.Tasks) == 0 })
	if d.State != string(requeststate.StatePreempted) || d.Tracker.Table != nil || d.TokenLen != 0 || !reflect.DeepEqual(d.Tracker.Load, adminapi.TrackerLoad{}) {
		t.Fatalf("not reset: %+v", d.Tracker)
	}
	r.finish()
	if f := r.waitFeedback(kvcore.FeedbackFinishedSending); !f.Immediate {
		t.Fatalf("finish %+v, want immediate", f)
	}
}

// s13: resumed with can_load → a load, no save; resumed without → save 48;
// resumed replaces a stale table.
func s13(t *testing.T, h *mesh) {
	preempted := func(t *testing.T) *request {
		r := h.on(t).request("s13")
		r.admit(48)
		r.allocate(0, table(0, 1), "")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 10, Table: table(0, 1)})
		r.preempt()
		// The first attempt's allocation names no decision, so it binds
		// the newest one it finds: decision d2 (another topic) must not be
		// published before that attempt is applied, or it could overtake
		// the events and be taken by the wrong attempt.
		r.applied()
		return r
	}
	t.Run("with_can_load_no_save", func(t *testing.T) {
		r := preempted(t)
		r.decide("d2", "store", 32, storeChild(32, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
		r.allocate(32, table(7, 3), "d2")
		r.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: table(7, 3)})
		l := r.waitLoads(1)
		r.settled()
		if len(r.saves()) != 0 || len(r.loads()) != 1 || !reflect.DeepEqual(l[0].BlockTable, table(7, 3)) {
			t.Fatalf("saves %+v loads %+v", r.saves(), r.loads())
		}
	})
	t.Run("without_can_load_save_48", func(t *testing.T) {
		r := preempted(t)
		r.decide("d2", "", 0, storeChild(0, nil))
		r.allocate(0, table(7, 3), "d2")
		r.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: table(7, 3)})
		s := r.waitSaves(1)
		r.settled()
		if len(r.loads()) != 0 || len(s) != 1 || s[0].Start != 0 || s[0].End != 48 {
			t.Fatalf("saves %+v loads %+v", s, r.loads())
		}
	})
	t.Run("replaces_stale_table", func(t *testing.T) {
		r := h.on(t).request("s13c")
		r.admit(48)
		r.allocate(0, table(0, 1), "")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 16, Table: table(0, 1)})
		r.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: table(4, 3)})
		// The resumed step is a preemption the tracker did not see: the
		// save [0,16) still in flight becomes stale (epoch 0), and epoch 1
		// saves from token 0 again with the new table (issue 14; it saved
		// on from 16 before).
		s := r.waitSaves(2)
		d := r.settled()
		if !reflect.DeepEqual(d.Tracker.Table, table(4, 3)) || s[1].Start != 0 || s[1].Epoch != 1 || !reflect.DeepEqual(s[1].BlockTable, table(4, 3)) {
			t.Fatalf("table %v, second save %+v", d.Tracker.Table, s[1])
		}
	})
}

// s20: a request that finishes while a save is in flight is reported
// finished_sending only after the save's result.
func s20(t *testing.T, h *mesh) {
	r := h.request("s20")
	r.admit(32)
	r.allocate(0, table(0, 2), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)})
	s := r.waitSaves(1)
	r.finish()
	d := r.settled()
	if d.State != string(requeststate.StateFinishing) || len(r.feedback()) != 0 || h.outboxCount(contract.TopicEngineFeedback, r.id) != 0 {
		t.Fatalf("finish with a save in flight: state %s, feedback %+v", d.State, r.feedback())
	}
	r.result(contract.TransferResult{Kind: contract.TransferSave, TaskID: s[0].TaskID, Status: string(kvcore.SaveStored),
		Groups: []contract.GroupOutcome{{Group: 0, Stored: 2}, {Group: 1, Stored: 1}}})
	f := r.waitFeedback(kvcore.FeedbackFinishedSending)
	eventually(t, "done", func() bool { d, _ = r.detail(); return d.State == string(requeststate.StateDone) })
	if f.Immediate || d.FinishedAt == nil || d.Coverage[0].SavedTokens != 32 || d.Coverage[1].SavedTokens != 32 {
		t.Fatalf("feedback %+v, detail %+v", f, d)
	}
}

// s21: [pd: 0, store: 32] → store chosen and loads; [pd: 32, store: 32] →
// pd chosen, the store child gets 0 (can_load false, nothing emitted for
// it) and the pd load goes to the decode engine's gpuworker with the
// prefill engine as its remote source.
func s21(t *testing.T, h *mesh) {
	spec := &kvcore.LoadSpec{KVPoolCachedTokens: 32}
	t.Run("store_chosen", func(t *testing.T) {
		h := h.on(t)
		r := h.request("s21a")
		r.admit(48)
		r.decide("d1", "store", 32, contract.ChildDecision{Name: "pd"}, storeChild(32, spec))
		r.allocate(32, table(0, 3), "d1")
		r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
		l := r.waitLoads(1)
		r.settled()
		checkLoad(t, h, r, l[0], 0, 32, table(0, 3))
	})
	t.Run("pd_chosen", func(t *testing.T) {
		h := h.on(t)
		r := h.request("s21b")
		r.admit(48)
		d := contract.LookupDecision{
			Schema: contract.SchemaLookupDecision, DecisionID: "d1", EngineID: r.engine, RequestID: r.id, Model: h.model.Name,
			NumTokens: 48, Chosen: "pd", ExternalTokens: 32, LoadAsync: true,
			Children: []contract.ChildDecision{{Name: "pd", Tokens: 32, Spec: &kvcore.LoadSpec{KVPoolCachedTokens: 32}}, storeChild(32, spec)},
			PD:       &contract.PDSource{EngineID: "prefill-7", BlockTable: table(40, 3), Tokens: 48},
		}
		h.produce(contract.TopicLookupDecisions, keyed{r.id, d})
		r.allocate(32, table(0, 3), "d1")
		r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
		l := r.waitLoads(1)
		det := r.settled()
		if s := det.Tracker.Load.Spec; s == nil || s.CanLoad {
			t.Fatalf("store child's load spec %+v, want can_load false", s)
		}
		if len(r.loads()) != 1 || len(r.saves()) != 0 {
			t.Fatalf("%d loads, %d saves; want only the pd load", len(r.loads()), len(r.saves()))
		}
		want := &kvcore.RemoteSource{EngineID: "prefill-7", BlockTable: table(40, 3)}
		if l[0].Connector != "pd" || !reflect.DeepEqual(l[0].Remote, want) || l[0].Start != 0 || l[0].End != 32 {
			t.Fatalf("pd load %+v", l[0])
		}
		if keys := h.out.keys(contract.TopicLoadTasks, r.id); len(keys) != 1 || keys[0] != r.engine {
			t.Fatalf("pd load keys %v, want engine id %s", keys, r.engine)
		}
		r.result(contract.TransferResult{Kind: contract.TransferLoad, TaskID: l[0].TaskID, Status: "done", LoadErrors: []kvcore.BlockID{1}})
		f := r.waitFeedback(kvcore.FeedbackFinishedRecving)
		if !reflect.DeepEqual(f.LoadErrors, []kvcore.BlockID{1}) {
			t.Fatalf("finished_recving %+v", f)
		}
		r.finish()
		r.waitFeedback(kvcore.FeedbackFinishedSending)
		r.settled()
		if n := h.outboxCount(contract.TopicEngineFeedback, r.id); n != 2 {
			t.Fatalf("%d feedback rows, want finished_recving and one finished_sending", n)
		}
	})
}

// TestScenarioS05 runs scenario 5 on its own scheduler: full (bs 32) +
// sliding window (bs 8, window 8). A hit of 32 loads the full group's
// chunk and only the sliding-window chunk the window reaches.
func TestScenarioS05(t *testing.T) {
	h := newMesh(t, meshOptions{spec: specFullSWA})
	t.Run("S05_sliding_window_loads_only_reachable_chunks", func(t *testing.T) {
		h := h.on(t)
		r := h.request("s05")
		r.admit(64)
		spec := kvcore.LoadSpec{KVPoolCachedTokens: 32}
		r.decide("d1", "store", 32, storeChild(32, &spec))
		tbl := kvcore.BlockTable{{0, 1}, {10, 11, 12, 13, 14, 15, 16, 17}}
		r.allocate(32, tbl, "d1")
		r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
		l := r.waitLoads(1)[0]
		want := []kvcore.GroupChunks{
			{Group: 0, Chunks: []kvcore.Chunk{{Start: 0, End: 32}}},
			{Group: 1, Chunks: []kvcore.Chunk{{Start: 24, End: 32}}},
		}
		if l.Start != 0 || l.End != 32 || !reflect.DeepEqual(l.Groups, want) {
			t.Fatalf("load %+v, want groups %+v", l, want)
		}
		if code := h.get("/v1/requests/"+r.engine+"/"+r.id, nil); code != http.StatusOK {
			t.Fatalf("detail: %d", code)
		}
	})
}
