package requeststate

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestTrackerScenarios runs the scenarios of docs/architecture.md owned by the
// tracker, validation and MultiConnector (bs 16, hash 16); the send
// policy's (S17, S18) run in services/sender/internal/sendpolicy.
func TestTrackerScenarios(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"S07_tracker_48_tokens_can_load_vs_not", scenario07},
		{"S08_pending_accepted_load_one_load_no_save", scenario08},
		{"S09_rejected_load_emits_nothing", scenario09},
		{"S10_decode_step_no_save", scenario10},
		{"S11_running_reaches_48_saves", scenario11},
		{"S12_preempted_resets_finish_frees_now", scenario12},
		{"S13_resumed", scenario13},
		{"S16_seed_one_group_table_two_group_model", scenario16},
		{"S17_exists_retry_dead_letter_put_failed_reported", scenario17},
		{"S20_finish_waits_for_inflight_save", scenario20},
		{"S21_multiconnector", scenario21},
		{"B1_seq_gap_fails_closed", scenarioSeqGap},
		{"B2_preempt_with_save_in_flight", scenarioPreemptSave},
		{"B3_preempt_with_load_in_flight", scenarioPreemptLoad},
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
}

// scenario07: tracker 48 tokens with can_load → no save, load kept, saved 0;
// with can_load false → save 48, no load.
func scenario07(t *testing.T) {
	m := trkDense(t)
	for _, accept := range []bool{true, false} {
		tr := newTrk(m)
		noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{VLLMCachedTokens: 0, KVPoolCachedTokens: 32}))
		external := 0
		if accept {
			external = 32
		}
		noErr(t, tr.OnAllocate(m, external, tbl(ids(0, 3))))
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 3))}))
		if accept {
			if len(eff.Saves) != 0 || len(eff.Loads) != 1 || tr.NumSavedTokens != 0 {
				t.Fatalf("can_load: %d saves, %d loads, saved %d; want 0, 1, 0", len(eff.Saves), len(eff.Loads), tr.NumSavedTokens)
			}
			if l := eff.Loads[0]; l.Start != 0 || l.End != 32 || l.Connector != "store" || !reflect.DeepEqual(l.Groups, m.LoadGroups(0, 32)) {
				t.Fatalf("load %+v", l)
			}
			continue
		}
		if len(eff.Saves) != 1 || len(eff.Loads) != 0 || tr.NumSavedTokens != 48 {
			t.Fatalf("no can_load: %d saves, %d loads, saved %d; want 1, 0, 48", len(eff.Saves), len(eff.Loads), tr.NumSavedTokens)
		}
		if s := eff.Saves[0]; s.Start != 0 || s.End != 48 {
			t.Fatalf("save %+v", s)
		}
	}
}

// scenario08: pending load, can_load true, not scheduled → one load, no save.
func scenario08(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{VLLMCachedTokens: 16, KVPoolCachedTokens: 48}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 4))))
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad}))
	if len(eff.Loads) != 1 || len(eff.Saves) != 0 {
		t.Fatalf("%d loads, %d saves; want 1, 0", len(eff.Loads), len(eff.Saves))
	}
	l := eff.Loads[0]
	if l.Start != 16 || l.End != 48 || !reflect.DeepEqual(l.BlockTable, tbl(ids(0, 4))) || len(l.BlockHashes) != 3 {
		t.Fatalf("load %+v", l)
	}
	if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})); effCounts(eff) != [3]int{} {
		t.Fatalf("second pending step emitted %+v", eff)
	}
}

// scenario09: pending load, can_load false, empty table, 2 groups → nothing
// emitted; the request's later finish frees at once.
func scenario09(t *testing.T) {
	m := trkHybrid(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{VLLMCachedTokens: 0, KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 0, kvcore.BlockTable{}))
	if tr.Load.Spec == nil || tr.Load.Spec.CanLoad {
		t.Fatalf("load spec %+v, want kept with can_load false", tr.Load.Spec)
	}
	assertRejectedThenFreed(t, m, tr)
}

// assertRejectedThenFreed drives a request whose load was rejected through
// pending steps and its finish: nothing is emitted, the finish frees at once.
func assertRejectedThenFreed(t *testing.T, m *kvcore.Model, tr *Tracker) {
	t.Helper()
	for range 3 {
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad}))
		if effCounts(eff) != [3]int{} || eff.Drop {
			t.Fatalf("rejected pending load emitted %+v", eff)
		}
	}
	if tr.NumSavedTokens != 0 || len(tr.PendingSaves) != 0 || tr.State == StateErrored {
		t.Fatalf("tracker after rejected load: %+v", tr)
	}
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	if len(eff.Saves)+len(eff.Loads) != 0 || len(eff.Feedback) != 1 {
		t.Fatalf("finish effects %+v", eff)
	}
	if f := eff.Feedback[0]; f.Kind != kvcore.FeedbackFinishedSending || !f.Immediate || !eff.Drop {
		t.Fatalf("finish feedback %+v drop %v; want immediate finished_sending and drop", f, eff.Drop)
	}
}

// scenario10: decode step, tracker 44 saved 32, new block [2] → no save,
// table becomes [0,1,2].
func scenario10(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 44, Table: tbl(ids(0, 2))}))
	if tr.TokenLen != 44 || tr.NumSavedTokens != 32 {
		t.Fatalf("tracker %d tokens saved %d, want 44 and 32", tr.TokenLen, tr.NumSavedTokens)
	}
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepDecode, Tokens: 45, Table: tbl([]kvcore.BlockID{2})}))
	if len(eff.Saves) != 0 || !reflect.DeepEqual(tr.Table, tbl(ids(0, 3))) {
		t.Fatalf("decode: %d saves, table %v", len(eff.Saves), tr.Table)
	}
	if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepDecode, Tokens: 49})); len(eff.Saves) != 0 || tr.NumSavedTokens != 32 {
		t.Fatalf("decode past a block boundary saved")
	}
}

// scenario11: a running request reaches 48 tokens → save chunk to 48, saved 48.
func scenario11(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))}))
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: tbl([]kvcore.BlockID{2})}))
	if len(eff.Saves) != 1 || tr.NumSavedTokens != 48 {
		t.Fatalf("%d saves, saved %d", len(eff.Saves), tr.NumSavedTokens)
	}
	s := eff.Saves[0]
	want := []kvcore.GroupChunks{{Group: 0, Chunks: []kvcore.Chunk{{Start: 32, End: 48}}}}
	if s.Start != 32 || s.End != 48 || !reflect.DeepEqual(s.Groups, want) || len(s.BlockHashes) != 3 {
		t.Fatalf("save %+v", s)
	}
}

// scenario12: preempted → tracker reset; finish → free now.
func scenario12(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 0, tbl(ids(0, 3))))
	s := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 3))})).Saves[0]
	noErr(t, tr.OnSaveResult(s.TaskID, kvcore.SaveStored))
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPreempted}))
	if tr.State != StatePreempted || tr.Table != nil || tr.TokenLen != 0 || !reflect.DeepEqual(tr.Load, LoadState{}) {
		t.Fatalf("tracker not reset: %+v", tr)
	}
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	if len(eff.Feedback) != 1 || !eff.Feedback[0].Immediate || !eff.Drop {
		t.Fatalf("finish %+v", eff)
	}
}

// scenario13: resumed with can_load → no save; resumed without → save 48;
// resumed replaces a stale table.
func scenario13(t *testing.T) {
	m := trkDense(t)
	preempted := func(t *testing.T) *Tracker {
		tr := newTrk(m)
		noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 10, Table: tbl(ids(0, 1))}))
		noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPreempted}))
		return tr
	}
	t.Run("with_can_load_no_save", func(t *testing.T) {
		tr := preempted(t)
		noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
		noErr(t, tr.OnAllocate(m, 32, tbl(ids(7, 3))))
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: tbl(ids(7, 3))}))
		if len(eff.Saves) != 0 || len(eff.Loads) != 1 || !reflect.DeepEqual(eff.Loads[0].BlockTable, tbl(ids(7, 3))) {
			t.Fatalf("effects %+v", eff)
		}
	})
	t.Run("without_can_load_save_48", func(t *testing.T) {
		tr := preempted(t)
		noErr(t, tr.OnLookup(m, nil))
		noErr(t, tr.OnAllocate(m, 0, tbl(ids(7, 3))))
		eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: tbl(ids(7, 3))}))
		if len(eff.Saves) != 1 || len(eff.Loads) != 0 || eff.Saves[0].Start != 0 || eff.Saves[0].End != 48 {
			t.Fatalf("effects %+v", eff)
		}
	})
	// A resumed step for a running request is a preemption the tracker did
	// not see: the epoch advances, a save still in flight becomes stale, and the
	// saved offset returns to 0 (vLLM: a resumed request saves from the start;
	// issue 14 changed the start from 16 to 0).
	for _, c := range []struct {
		name      string
		report    bool
		wantStart int
		wantStale []string
	}{
		{"replaces_stale_table", true, 0, nil},
		{"replaces_stale_table_save_in_flight", false, 0, []string{"e1/r1/save/1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			tr := newTrk(m)
			s := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 16, Table: tbl(ids(0, 1))})).Saves[0]
			if c.report {
				noErr(t, tr.OnSaveResult(s.TaskID, kvcore.SaveStored))
			}
			eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: tbl(ids(4, 3))}))
			if !reflect.DeepEqual(tr.Table, tbl(ids(4, 3))) || tr.Epoch != 1 || !reflect.DeepEqual(tr.StaleSaves, c.wantStale) {
				t.Fatalf("table %v epoch %d stale %v; want the resumed table, epoch 1, stale %v", tr.Table, tr.Epoch, tr.StaleSaves, c.wantStale)
			}
			if len(eff.Saves) != 1 || !reflect.DeepEqual(eff.Saves[0].BlockTable, tbl(ids(4, 3))) ||
				eff.Saves[0].Start != c.wantStart || eff.Saves[0].End != 48 || eff.Saves[0].Epoch != 1 {
				t.Fatalf("save %+v, want [%d,48) of epoch 1 from the resumed table", eff.Saves, c.wantStart)
			}
		})
	}
}

// scenario16: a save with a 1-group table on a 2-group model → group 1
// rejected with table_group_count and a detail, group 0 valid; the tracker
// itself cannot build such a save, and the request still frees. (The
// sender's account of such a task, dead_lettered: the sending package's
// TestSaveOutcomeScenarios.)
func scenario16(t *testing.T) {
	m := trkHybrid(t)
	task := kvcore.SaveTask{
		Schema: kvcore.SchemaSaveTask, TaskID: "e1/r1/save/1", EngineID: "e1", RequestID: "r1", Model: m.Name,
		Start: 0, End: 32, BlockTable: tbl(ids(0, 2)), BlockHashes: trkHashes(2), Groups: m.SaveGroups(0, 32),
	}
	vs := kvcore.ValidateSave(m, []int{64, 64}, &task)
	if len(vs) != 2 || !vs[0].OK() || vs[1].Reason != kvcore.ReasonTableGroupCount {
		t.Fatalf("verdicts %+v", vs)
	}
	if !strings.Contains(vs[1].Detail, "1 group") || !strings.Contains(vs[1].Detail, "group 1") {
		t.Fatalf("detail %q does not explain", vs[1].Detail)
	}
	tr := newTrk(m)
	eff := isErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))}), kvcore.ErrGroupCount)
	if len(eff.Saves) != 0 || tr.State != StateErrored {
		t.Fatalf("tracker built a save from a 1-group table: %+v", eff)
	}
	if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished})); len(eff.Feedback) != 1 || !eff.Drop {
		t.Fatalf("errored request not freed: %+v", eff)
	}
}

// scenario17: existence check fails → retried, then dead-lettered; put fails
// → counted, reported, not silent. The retries are the sender's policy
// (sendpolicy's TestS17ExistsRetriedThenDeadLettered) and its account of
// the task, failed, the sending package's TestSaveOutcomeScenarios; here the
// tracker hears the failed status and reports it.
func scenario17(t *testing.T) {
	m := trkHybrid(t)
	tr := newTrk(m)
	task := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2), ids(5, 2))})).Saves[0]
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	eff := noErr(t, tr.OnSaveResult(task.TaskID, kvcore.SaveFailed))
	if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedSending || tr.Reports.Failed != 1 {
		t.Fatalf("failed save not reported: %+v reports %+v", eff, tr.Reports)
	}
}

// scenario20: a request finishes while a save is in flight → finished_sending
// only after the save completes.
func scenario20(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	s := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))})).Saves[0]
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	if effCounts(eff) != [3]int{} || eff.Drop || tr.State != StateFinishing {
		t.Fatalf("finish with a save in flight: %+v state %s", eff, tr.State)
	}
	eff = noErr(t, tr.OnSaveResult(s.TaskID, kvcore.SaveStored))
	if len(eff.Feedback) != 1 || eff.Feedback[0].Kind != kvcore.FeedbackFinishedSending || eff.Feedback[0].Immediate || !eff.Drop {
		t.Fatalf("save result %+v", eff)
	}
	if eff := noErr(t, tr.OnSaveResult(s.TaskID, kvcore.SaveStored)); len(eff.Feedback) != 0 {
		t.Fatalf("finished_sending reported twice")
	}
}

// scenario21: [pd: 0, store: 32] → store chosen; [pd: 32, store: 32] → pd
// chosen, store gets 0 → store's LoadSpec can_load false → scenario 9.
func scenario21(t *testing.T) {
	spec := &kvcore.LoadSpec{VLLMCachedTokens: 0, KVPoolCachedTokens: 32}
	a := []kvcore.ChildAnswer{{Name: "pd", Tokens: 0}, {Name: "store", Tokens: 32, Spec: spec}}
	sel := kvcore.SelectChild(a)
	if sel.Pending || sel.Name(a) != "store" || sel.Tokens != 32 {
		t.Fatalf("selection %+v", sel)
	}
	if got := kvcore.AllocationCounts(sel.Chosen, a, 32); !reflect.DeepEqual(got, []int{0, 32}) {
		t.Fatalf("counts %v", got)
	}

	b := []kvcore.ChildAnswer{{Name: "pd", Tokens: 32}, {Name: "store", Tokens: 32, Spec: spec}}
	sel = kvcore.SelectChild(b)
	if sel.Name(b) != "pd" || sel.Tokens != 32 {
		t.Fatalf("selection %+v", sel)
	}
	alloc := kvcore.AllocationCounts(sel.Chosen, b, 32)
	if !reflect.DeepEqual(alloc, []int{32, 0}) {
		t.Fatalf("counts %v", alloc)
	}
	m := trkHybrid(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, b[1].Spec))
	noErr(t, tr.OnAllocate(m, alloc[1], kvcore.BlockTable{}))
	if tr.Load.Spec.CanLoad {
		t.Fatal("the losing store child's LoadSpec can load")
	}
	assertRejectedThenFreed(t, m, tr)
}

// scenarioSeqGap: a request the caller found with a sequence gap (events 1,
// 2, 4) fails closed: errored, epoch advanced, its save in flight stale,
// nothing more emitted, its finish frees at once; a load the allocation
// promised is answered with every block in error.
func scenarioSeqGap(t *testing.T) {
	m := trkDense(t)
	gap := errors.New("event 4: expected seq 3, received 4")
	t.Run("save_in_flight", func(t *testing.T) {
		tr := newTrk(m)
		s := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))})).Saves[0]
		eff := isErr(t, tr.FailClosed(gap), gap)
		if !eff.Failed || effCounts(eff) != [3]int{} || tr.State != StateErrored || tr.Error != gap.Error() {
			t.Fatalf("fail closed: %+v state %s error %q", eff, tr.State, tr.Error)
		}
		if tr.Epoch != 1 || len(tr.PendingSaves) != 0 || !reflect.DeepEqual(tr.StaleSaves, []string{s.TaskID}) {
			t.Fatalf("epoch %d pending %v stale %v; want 1, none, [%s]", tr.Epoch, tr.PendingSaves, tr.StaleSaves, s.TaskID)
		}
		if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: tbl(ids(2, 2))})); effCounts(eff) != [3]int{} {
			t.Fatalf("errored request emitted %+v", eff)
		}
		if eff := tr.FailClosed(gap); eff.Failed || effCounts(eff) != [3]int{} || tr.Epoch != 1 {
			t.Fatalf("second fail: %+v epoch %d", eff, tr.Epoch)
		}
		eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
		want := []kvcore.Feedback{{Kind: kvcore.FeedbackFinishedSending, EngineID: "e1", RequestID: "r1", Immediate: true, Epoch: 1}}
		if !reflect.DeepEqual(eff.Feedback, want) || len(eff.Saves) != 0 || eff.Drop {
			t.Fatalf("finish %+v; want %+v, the stale save keeping the tracker", eff, want)
		}
		eff = noErr(t, tr.OnSaveResult(s.TaskID, kvcore.SaveDeadLettered))
		if len(eff.Feedback) != 0 || !eff.Drop || tr.Reports.DeadLettered != 1 || tr.NumSavedTokens != 32 {
			t.Fatalf("stale result %+v reports %+v saved %d", eff, tr.Reports, tr.NumSavedTokens)
		}
	})
	t.Run("expected_load", func(t *testing.T) {
		tr := newTrk(m)
		noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
		noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 3))))
		eff := isErr(t, tr.FailClosed(gap), gap)
		want := []kvcore.Feedback{{Kind: kvcore.FeedbackFinishedRecving, EngineID: "e1", RequestID: "r1", LoadErrors: ids(0, 3)}}
		if !eff.Failed || !reflect.DeepEqual(eff.Feedback, want) || len(eff.Loads) != 0 {
			t.Fatalf("fail closed %+v; want %+v", eff, want)
		}
		if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})); effCounts(eff) != [3]int{} {
			t.Fatalf("errored request issued %+v", eff)
		}
	})
}

// scenarioPreemptSave: saves [0,32) (reported) and [32,48) (in flight) of
// epoch 0, then preempted: epoch 1, the saved offset back to 0, the
// in-flight save stale. Resumed on blocks 7,8,9 with the same 48 tokens:
// a save [0,48) of epoch 1 from the new table (vLLM saves a resumed request
// from the start; before issue 14 the offset stayed at 48 and nothing was
// saved). The old save's result, stored or dead-lettered (its reused blocks
// refused), settles it without advancing anything or freeing; the finish
// then waits for the epoch-1 save only.
func scenarioPreemptSave(t *testing.T) {
	m := trkDense(t)
	for _, old := range []kvcore.SaveStatus{kvcore.SaveStored, kvcore.SaveDeadLettered} {
		t.Run(string(old), func(t *testing.T) {
			tr := newTrk(m)
			a := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))})).Saves[0]
			b := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: tbl(ids(2, 1))})).Saves[0]
			if a.Epoch != 0 || b.Epoch != 0 || b.Start != 32 || b.End != 48 {
				t.Fatalf("epoch-0 saves %+v %+v", a, b)
			}
			noErr(t, tr.OnSaveResult(a.TaskID, kvcore.SaveStored))
			noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPreempted}))
			if tr.Epoch != 1 || tr.NumSavedTokens != 0 || len(tr.PendingSaves) != 0 || !reflect.DeepEqual(tr.StaleSaves, []string{b.TaskID}) {
				t.Fatalf("preempted: epoch %d saved %d pending %v stale %v; want 1, 0, none, [%s]",
					tr.Epoch, tr.NumSavedTokens, tr.PendingSaves, tr.StaleSaves, b.TaskID)
			}
			noErr(t, tr.OnLookup(m, nil))
			noErr(t, tr.OnAllocate(m, 0, tbl(ids(7, 3))))
			eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: tbl(ids(7, 3))}))
			if len(eff.Saves) != 1 || !reflect.DeepEqual(tr.Table, tbl(ids(7, 3))) {
				t.Fatalf("resumed: saves %+v table %v; want one and the new table", eff.Saves, tr.Table)
			}
			c := eff.Saves[0]
			if c.Start != 0 || c.End != 48 || c.Epoch != 1 || !reflect.DeepEqual(c.BlockTable, tbl(ids(7, 3))) {
				t.Fatalf("resumed save %+v, want [0,48) of epoch 1 from blocks 7,8,9", c)
			}
			eff = noErr(t, tr.OnSaveResult(b.TaskID, old))
			if effCounts(eff) != [3]int{} || tr.NumSavedTokens != 48 || !reflect.DeepEqual(tr.PendingSaves, []string{c.TaskID}) ||
				len(tr.StaleSaves) != 0 || len(tr.Unsaved) != 0 {
				t.Fatalf("old-epoch result: %+v saved %d pending %v stale %v unsaved %v", eff, tr.NumSavedTokens, tr.PendingSaves, tr.StaleSaves, tr.Unsaved)
			}
			if eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished})); len(eff.Feedback) != 0 || eff.Drop {
				t.Fatalf("finish with the epoch-1 save outstanding %+v", eff)
			}
			eff = noErr(t, tr.OnSaveResult(c.TaskID, kvcore.SaveStored))
			fb := []kvcore.Feedback{{Kind: kvcore.FeedbackFinishedSending, EngineID: "e1", RequestID: "r1", Epoch: 1}}
			if !reflect.DeepEqual(eff.Feedback, fb) || !eff.Drop || tr.Reports.Stored+tr.Reports.DeadLettered != 3 {
				t.Fatalf("last save %+v reports %+v; want %+v and drop", eff, tr.Reports, fb)
			}
		})
	}
}

// scenarioPreemptLoad: a load of epoch 0 still in flight when the request is
// preempted (an engine breaking the block-lifetime contract) becomes stale:
// the resumed attempt's load is of epoch 1, the old load's result yields no
// finished_recving, and it does not hold back the new epoch's saves.
func scenarioPreemptLoad(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(0, 3))))
	old := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPendingLoad})).Loads[0]
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPreempted}))
	if tr.Epoch != 1 || len(tr.PendingLoads) != 0 || !reflect.DeepEqual(tr.StaleLoads, []string{old.TaskID}) {
		t.Fatalf("preempted: epoch %d pending %v stale %v", tr.Epoch, tr.PendingLoads, tr.StaleLoads)
	}
	noErr(t, tr.OnLookup(m, &kvcore.LoadSpec{KVPoolCachedTokens: 32}))
	noErr(t, tr.OnAllocate(m, 32, tbl(ids(5, 3))))
	cur := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: tbl(ids(5, 3))})).Loads[0]
	if old.Epoch != 0 || cur.Epoch != 1 || cur.TaskID != "e1/r1/load/2" || !reflect.DeepEqual(cur.BlockTable, tbl(ids(5, 3))) {
		t.Fatalf("loads old %+v current %+v", old, cur)
	}
	eff := noErr(t, tr.OnLoadResult(cur.TaskID, []kvcore.BlockID{6}))
	want := []kvcore.Feedback{{Kind: kvcore.FeedbackFinishedRecving, EngineID: "e1", RequestID: "r1", LoadErrors: []kvcore.BlockID{6}, TaskID: cur.TaskID, Epoch: 1}}
	if !reflect.DeepEqual(eff.Feedback, want) {
		t.Fatalf("current load result %+v, want %+v", eff.Feedback, want)
	}
	eff = noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: tbl(ids(8, 1))}))
	if len(eff.Saves) != 1 || eff.Saves[0].Epoch != 1 || eff.Saves[0].End != 64 {
		t.Fatalf("save held back by the stale load: %+v", eff)
	}
	if eff := noErr(t, tr.OnLoadResult(old.TaskID, nil)); effCounts(eff) != [3]int{} || len(tr.StaleLoads) != 0 {
		t.Fatalf("stale load result emitted %+v (stale %v)", eff, tr.StaleLoads)
	}
}
