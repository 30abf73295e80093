package kvcore

import (
	"reflect"
	"testing"
)

// The scenarios of issue 14's save rules: saves across preemption and
// resume, and store pressure, as vLLM's MooncakeStore connector does them
// (vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/:
// scheduler.py build_connector_meta, data.py RequestTracker and
// ReqMeta.from_request_tracker at a8f1d79812aa51e1036eba41286879eb09bd1635;
// worker.py KVCacheStoreSendingThread at
// 055e47c28003156421365af985d676fc921cb075). Numbered from S50 (see
// docs/architecture.md, "Saves across preemption and store pressure").
// Block size 16, hash block size 16, one full-attention group unless a
// case says otherwise.

// saveOp is one input of a save scenario and the saves it must emit.
type saveOp struct {
	// step is an engine step (nil: report instead).
	step *Step
	// report is the 1-based index, among the saves emitted so far, of the
	// save rep reports (used when step is nil).
	report int
	rep    SaveReport
	// want are the saves the op emits: [start, end) and epoch each.
	want []wantSave
	// wantFinished is the number of finished_sending feedbacks it emits.
	wantFinished int
}

type wantSave struct{ start, end, epoch int }

// stepOp is an engine step emitting want.
func stepOp(s Step, want ...wantSave) saveOp { return saveOp{step: &s, want: want} }

// reportOp reports the n-th emitted save with rep.
func reportOp(n int, rep SaveReport) saveOp { return saveOp{report: n, rep: rep} }

// finishOp finishes the request, emitting finished feedbacks.
func finishOp(finished int) saveOp {
	return saveOp{step: &Step{Kind: StepFinished}, wantFinished: finished}
}

// wantTracker is the tracker's state after the last op.
type wantTracker struct {
	saved, prefillEnd, epoch int
	unsaved                  []SaveSpan
	reports                  SaveCounts
}

func TestSaveScenarios(t *testing.T) {
	stored := SaveReport{Status: SaveStored}
	skipped := SaveReport{Status: SaveSkipped, Skipped: 2}
	failed := SaveReport{Status: SaveFailed, Failed: 1}
	deadLettered := SaveReport{Status: SaveDeadLettered}
	cases := []struct {
		name   string
		prompt int // admission's prompt length (0: unknown)
		ops    []saveOp
		want   wantTracker
	}{
		{
			// scheduler.py build_connector_meta, preempted_req_ids:
			// RequestTracker.reset (num_saved_tokens=0); worker.py
			// _close_ended_store_requests drops the resume offset.
			name: "S50_preempt_resets_saved_offset", prompt: 48,
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, stored),
				stepOp(Step{Kind: StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				stepOp(Step{Kind: StepPreempted}),
			},
			want: wantTracker{saved: 0, prefillEnd: 48, epoch: 1, reports: SaveCounts{Stored: 1}},
		},
		{
			// resumed_req_ids: a new RequestTracker, num_saved_tokens=0,
			// prefill_end_tokens=len(all_token_ids): prompt 40 + 24
			// generated are re-prefilled and saved from token 0.
			name: "S51_resumed_with_more_tokens_than_prompt_saves_from_0", prompt: 40,
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, stored),
				stepOp(Step{Kind: StepDecode, Tokens: 64, Table: tbl(ids(3, 1))}),
				stepOp(Step{Kind: StepPreempted}),
				stepOp(Step{Kind: StepResumed, Tokens: 64, PrefillTokens: 64, Table: tbl(ids(10, 4))}, wantSave{0, 64, 1}),
			},
			want: wantTracker{saved: 64, prefillEnd: 64, epoch: 1, reports: SaveCounts{Stored: 1}},
		},
		{
			// Without prefill_tokens a resumed step's range is at least the
			// tokens it computed: max(40, 64).
			name: "S52_resumed_without_prefill_tokens_takes_its_tokens", prompt: 40,
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(Step{Kind: StepPreempted}),
				stepOp(Step{Kind: StepResumed, Tokens: 64, Table: tbl(ids(10, 4))}, wantSave{0, 64, 1}),
			},
			want: wantTracker{saved: 64, prefillEnd: 64, epoch: 1},
		},
		{
			// A chunked re-prefill: the prefill end is the snapshot of the
			// resumed step (scheduler.py: "use the tracker's snapshot of the
			// prefill range so resumed requests keep saving past the
			// original prompt boundary"); decode steps do not save.
			name: "S53_chunked_resume_saves_past_the_prompt", prompt: 40,
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(Step{Kind: StepPreempted}),
				stepOp(Step{Kind: StepResumed, Tokens: 32, PrefillTokens: 70, Table: tbl(ids(10, 2))}, wantSave{0, 32, 1}),
				stepOp(Step{Kind: StepRunning, Tokens: 70, Table: tbl(ids(12, 3))}, wantSave{32, 64, 1}),
				stepOp(Step{Kind: StepDecode, Tokens: 81, Table: tbl(ids(15, 1))}),
			},
			want: wantTracker{saved: 64, prefillEnd: 70, epoch: 1},
		},
		{
			// Fail-closed fallback: a chunked resume without prefill_tokens
			// keeps the prompt as its range, never saving decode tokens.
			name: "S54_chunked_resume_without_prefill_tokens_keeps_the_prompt", prompt: 40,
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(Step{Kind: StepPreempted}),
				stepOp(Step{Kind: StepResumed, Tokens: 32, Table: tbl(ids(10, 2))}, wantSave{0, 32, 1}),
				stepOp(Step{Kind: StepRunning, Tokens: 64, Table: tbl(ids(12, 2))}),
			},
			want: wantTracker{saved: 32, prefillEnd: 40, epoch: 1},
		},
		{
			// vLLM's v2 model runner lists a resumed request in
			// scheduled_new_reqs with prefill_token_ids (_new_req_prefill_tokens).
			name: "S55_new_step_after_preemption_is_a_resume", prompt: 40,
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(Step{Kind: StepPreempted}),
				stepOp(Step{Kind: StepNew, Tokens: 56, PrefillTokens: 56, Table: tbl(ids(10, 4))}, wantSave{0, 48, 1}),
			},
			want: wantTracker{saved: 48, prefillEnd: 56, epoch: 1},
		},
		{
			// worker.py _handle_request: a skipped job does not move
			// _saved_offset, so the next job resumes from it.
			name: "S56_skipped_range_saved_again_by_the_next_save",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, skipped),
				stepOp(Step{Kind: StepRunning, Tokens: 48}, wantSave{0, 48, 0}),
				reportOp(2, stored),
			},
			want: wantTracker{saved: 48, reports: SaveCounts{Stored: 1, Skipped: 1}},
		},
		{
			// A failed put (an exception in vLLM's put) is retried the same way.
			name: "S57_failed_range_saved_again_by_the_next_save",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, failed),
				stepOp(Step{Kind: StepRunning, Tokens: 48}, wantSave{0, 48, 0}),
			},
			want: wantTracker{saved: 48, reports: SaveCounts{Failed: 1}},
		},
		{
			// A dead-lettered save is the dead letter's (its replay); the
			// tracker does not save it again.
			name: "S58_dead_lettered_range_not_saved_again",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, deadLettered),
				stepOp(Step{Kind: StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
			},
			want: wantTracker{saved: 48, reports: SaveCounts{DeadLettered: 1}},
		},
		{
			// One group dead-lettered sets the status, another's keys were
			// skipped: the skipped keys still make the range unsaved.
			name: "S59_skipped_keys_under_a_dead_lettered_status_saved_again",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, SaveReport{Status: SaveDeadLettered, Skipped: 1}),
				stepOp(Step{Kind: StepRunning, Tokens: 48}, wantSave{0, 48, 0}),
			},
			want: wantTracker{saved: 48, reports: SaveCounts{DeadLettered: 1}},
		},
		{
			// Saves in flight together: the earlier is skipped, the later
			// stored; the next save starts at the lowest unsaved token.
			name: "S60_pipelined_saves_next_covers_from_the_lowest_unsaved",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 4))}, wantSave{0, 32, 0}),
				stepOp(Step{Kind: StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				reportOp(2, stored),
				reportOp(1, skipped),
				stepOp(Step{Kind: StepRunning, Tokens: 64}, wantSave{0, 64, 0}),
			},
			want: wantTracker{saved: 64, reports: SaveCounts{Stored: 1, Skipped: 1}},
		},
		{
			// The re-save rides on the request's next save: no new full
			// block, no save (data.py: skip_save when num_tokens_to_save <
			// chunk_boundary); the range stays unsaved until then.
			name: "S61_resave_waits_for_a_new_full_block",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, skipped),
				stepOp(Step{Kind: StepRunning, Tokens: 40}),
			},
			want: wantTracker{saved: 32, unsaved: []SaveSpan{{TaskID: "e1/r1/save/1", Start: 0, End: 32}}, reports: SaveCounts{Skipped: 1}},
		},
		{
			// A save of an earlier epoch reported skipped only settles: it
			// read blocks the engine released (worker.py: a job of a retired
			// generation cannot rewind the resume offset).
			name: "S62_stale_skipped_save_not_marked_unsaved",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 2))}, wantSave{0, 32, 0}),
				stepOp(Step{Kind: StepPreempted}),
				stepOp(Step{Kind: StepResumed, Tokens: 48, Table: tbl(ids(8, 3))}, wantSave{0, 48, 1}),
				reportOp(1, skipped),
				reportOp(2, stored),
				stepOp(Step{Kind: StepRunning, Tokens: 64, Table: tbl(ids(11, 1))}, wantSave{48, 64, 1}),
			},
			want: wantTracker{saved: 64, epoch: 1, reports: SaveCounts{Stored: 1, Skipped: 1}},
		},
		{
			// A skipped last save is not saved again (no later save), but
			// is counted and still frees the request.
			name: "S63_finish_after_a_skipped_save_frees_and_counts",
			ops: []saveOp{
				stepOp(Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 2))}, wantSave{0, 32, 0}),
				finishOp(0),
				{report: 1, rep: skipped, wantFinished: 1},
			},
			want: wantTracker{saved: 32, reports: SaveCounts{Skipped: 1}},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := trkDense(t)
			tr := NewTracker(m, "e1", "r1")
			tr.OnAdmit(trkHashes(64), c.prompt)
			var emitted []SaveTask
			for i, op := range c.ops {
				var eff Effects
				if op.step != nil {
					eff = noErr(t, tr.Step(m, *op.step))
				} else {
					eff = noErr(t, tr.OnSaveReport(emitted[op.report-1].TaskID, op.rep))
				}
				var got []wantSave
				for _, s := range eff.Saves {
					got = append(got, wantSave{s.Start, s.End, s.Epoch})
					if !reflect.DeepEqual(s.Groups, m.SaveGroups(s.Start, s.End)) {
						t.Fatalf("op %d: save [%d,%d) lists %+v", i, s.Start, s.End, s.Groups)
					}
				}
				if !reflect.DeepEqual(got, op.want) {
					t.Fatalf("op %d: saves %v, want %v", i, got, op.want)
				}
				finished := 0
				for _, f := range eff.Feedback {
					if f.Kind == FeedbackFinishedSending {
						finished++
					}
				}
				if finished != op.wantFinished {
					t.Fatalf("op %d: %d finished_sending, want %d (%+v)", i, finished, op.wantFinished, eff.Feedback)
				}
				emitted = append(emitted, eff.Saves...)
			}
			got := wantTracker{saved: tr.NumSavedTokens, prefillEnd: tr.PrefillEnd, epoch: tr.Epoch, unsaved: tr.Unsaved, reports: tr.Reports}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("tracker %+v, want %+v", got, c.want)
			}
		})
	}
}

// TestSaveScenarioResumedTable (S64): a resumed request's save reads its
// new table only, and the old epoch's save cannot hold its finish.
func TestSaveScenarioResumedTable(t *testing.T) {
	m := trkHybrid(t)
	tr := newTrk(m)
	old := noErr(t, tr.Step(m, Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 2), ids(10, 2))})).Saves[0]
	noErr(t, tr.Step(m, Step{Kind: StepPreempted}))
	eff := noErr(t, tr.Step(m, Step{Kind: StepResumed, Tokens: 48, PrefillTokens: 48, Table: tbl(ids(20, 3), ids(30, 3))}))
	want := SaveTask{
		Schema: SchemaSaveTask, TaskID: "e1/r1/save/2", EngineID: "e1", RequestID: "r1", Model: m.Name, Epoch: 1,
		Start: 0, End: 48, BlockTable: tbl(ids(20, 3), ids(30, 3)), BlockHashes: trkHashes(3), Groups: m.SaveGroups(0, 48),
	}
	if len(eff.Saves) != 1 || !reflect.DeepEqual(eff.Saves[0], want) {
		t.Fatalf("resumed saves %+v, want %+v", eff.Saves, want)
	}
	if !reflect.DeepEqual(tr.SaveSpans, []SaveSpan{{TaskID: want.TaskID, Start: 0, End: 48}}) || !reflect.DeepEqual(tr.StaleSaves, []string{old.TaskID}) {
		t.Fatalf("spans %+v stale %v", tr.SaveSpans, tr.StaleSaves)
	}
	noErr(t, tr.Step(m, Step{Kind: StepFinished}))
	if eff := noErr(t, tr.OnSaveResult(old.TaskID, SaveFailed)); len(eff.Feedback) != 0 || len(tr.Unsaved) != 0 {
		t.Fatalf("stale failed save %+v unsaved %v", eff, tr.Unsaved)
	}
	fb := []Feedback{{Kind: FeedbackFinishedSending, EngineID: "e1", RequestID: "r1", Epoch: 1}}
	if eff := noErr(t, tr.OnSaveResult(want.TaskID, SaveStored)); !reflect.DeepEqual(eff.Feedback, fb) || !eff.Drop {
		t.Fatalf("epoch-1 result %+v, want %+v and drop", eff, fb)
	}
}

// TestSaveScenarioStoredTrackerUpgrade (S65): ranges survive the JSON
// round trip, and a tracker stored without ranges (before issue 14) whose
// pending save reports skipped saves again from token 0.
func TestSaveScenarioStoredTrackerUpgrade(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	a := noErr(t, tr.Step(m, Step{Kind: StepNew, Tokens: 32, Table: tbl(ids(0, 4))})).Saves[0]
	noErr(t, tr.Step(m, Step{Kind: StepRunning, Tokens: 48}))
	noErr(t, tr.OnSaveResult(a.TaskID, SaveSkipped))
	b, err := MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnmarshalTracker(b)
	if err != nil || !reflect.DeepEqual(back, tr) {
		t.Fatalf("round trip: %v\n%+v\n%+v", err, back, tr)
	}
	old := newTrk(m)
	s := noErr(t, old.Step(m, Step{Kind: StepNew, Tokens: 48, Table: tbl(ids(0, 4))})).Saves[0]
	old.SaveSpans = nil // as stored before ranges were kept
	noErr(t, old.OnSaveResult(s.TaskID, SaveSkipped))
	if want := []SaveSpan{{TaskID: s.TaskID, Start: 0, End: 48}}; !reflect.DeepEqual(old.Unsaved, want) {
		t.Fatalf("unsaved %+v, want %+v", old.Unsaved, want)
	}
	if eff := noErr(t, old.Step(m, Step{Kind: StepRunning, Tokens: 64})); len(eff.Saves) != 1 || eff.Saves[0].Start != 0 || eff.Saves[0].End != 64 {
		t.Fatalf("next save %+v, want [0,64)", eff.Saves)
	}
}
