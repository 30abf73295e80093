package requeststate

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
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
	step *kvcore.Step
	// report is the 1-based index, among the saves emitted so far, of the
	// save rep reports (used when step is nil).
	report int
	rep    kvcore.SaveReport
	// want are the saves the op emits: [start, end) and epoch each.
	want []wantSave
	// wantFinished is the number of finished_sending feedbacks it emits.
	wantFinished int
}

type wantSave struct{ start, end, epoch int }

// stepOp is an engine step emitting want.
func stepOp(s kvcore.Step, want ...wantSave) saveOp { return saveOp{step: &s, want: want} }

// reportOp reports the n-th emitted save with rep, emitting want.
func reportOp(n int, rep kvcore.SaveReport, want ...wantSave) saveOp {
	return saveOp{report: n, rep: rep, want: want}
}

// finishOp finishes the request, emitting finished feedbacks.
func finishOp(finished int) saveOp {
	return saveOp{step: &kvcore.Step{Kind: kvcore.StepFinished}, wantFinished: finished}
}

// wantTracker is the tracker's state after the last op.
type wantTracker struct {
	saved, prefillEnd, epoch int
	unsaved                  []SaveSpan
	reports                  kvcore.SaveCounts
}

func TestSaveScenarios(t *testing.T) {
	stored := kvcore.SaveReport{Status: kvcore.SaveStored}
	skipped := kvcore.SaveReport{Status: kvcore.SaveSkipped, Skipped: 2}
	failed := kvcore.SaveReport{Status: kvcore.SaveFailed, Failed: 1}
	deadLettered := kvcore.SaveReport{Status: kvcore.SaveDeadLettered}
	existsFailed := kvcore.SaveReport{Status: kvcore.SaveDeadLettered, ExistsFailed: 2}
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
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, stored),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepPreempted}),
			},
			want: wantTracker{saved: 0, prefillEnd: 48, epoch: 1, reports: kvcore.SaveCounts{Stored: 1}},
		},
		{
			// resumed_req_ids: a new RequestTracker, num_saved_tokens=0,
			// prefill_end_tokens=len(all_token_ids): prompt 40 + 24
			// generated are re-prefilled and saved from token 0.
			name: "S51_resumed_with_more_tokens_than_prompt_saves_from_0", prompt: 40,
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, stored),
				stepOp(kvcore.Step{Kind: kvcore.StepDecode, Tokens: 64, Table: tbl(ids(3, 1))}),
				stepOp(kvcore.Step{Kind: kvcore.StepPreempted}),
				stepOp(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 64, PrefillTokens: 64, Table: tbl(ids(10, 4))}, wantSave{0, 64, 1}),
			},
			want: wantTracker{saved: 64, prefillEnd: 64, epoch: 1, reports: kvcore.SaveCounts{Stored: 1}},
		},
		{
			// Without prefill_tokens a resumed step's range is at least the
			// tokens it computed: max(40, 64).
			name: "S52_resumed_without_prefill_tokens_takes_its_tokens", prompt: 40,
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepPreempted}),
				stepOp(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 64, Table: tbl(ids(10, 4))}, wantSave{0, 64, 1}),
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
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepPreempted}),
				stepOp(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 32, PrefillTokens: 70, Table: tbl(ids(10, 2))}, wantSave{0, 32, 1}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 70, Table: tbl(ids(12, 3))}, wantSave{32, 64, 1}),
				stepOp(kvcore.Step{Kind: kvcore.StepDecode, Tokens: 81, Table: tbl(ids(15, 1))}),
			},
			want: wantTracker{saved: 64, prefillEnd: 70, epoch: 1},
		},
		{
			// Fail-closed fallback: a chunked resume without prefill_tokens
			// keeps the prompt as its range, never saving decode tokens.
			name: "S54_chunked_resume_without_prefill_tokens_keeps_the_prompt", prompt: 40,
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepPreempted}),
				stepOp(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 32, Table: tbl(ids(10, 2))}, wantSave{0, 32, 1}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: tbl(ids(12, 2))}),
			},
			want: wantTracker{saved: 32, prefillEnd: 40, epoch: 1},
		},
		{
			// vLLM's v2 model runner lists a resumed request in
			// scheduled_new_reqs with prefill_token_ids (_new_req_prefill_tokens).
			name: "S55_new_step_after_preemption_is_a_resume", prompt: 40,
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepPreempted}),
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 56, PrefillTokens: 56, Table: tbl(ids(10, 4))}, wantSave{0, 48, 1}),
			},
			want: wantTracker{saved: 48, prefillEnd: 56, epoch: 1},
		},
		{
			// worker.py _handle_request: a skipped job does not move
			// _saved_offset, so the next job resumes from it.
			name: "S56_skipped_range_saved_again_by_the_next_save",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, skipped),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{0, 48, 0}),
				reportOp(2, stored),
			},
			want: wantTracker{saved: 48, reports: kvcore.SaveCounts{Stored: 1, Skipped: 1}},
		},
		{
			// A failed put (an exception in vLLM's put) is retried the same way.
			name: "S57_failed_range_saved_again_by_the_next_save",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, failed),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{0, 48, 0}),
			},
			want: wantTracker{saved: 48, reports: kvcore.SaveCounts{Failed: 1}},
		},
		{
			// A dead-lettered save is the dead letter's (its replay); the
			// tracker does not save it again.
			name: "S58_dead_lettered_range_not_saved_again",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, deadLettered),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
			},
			want: wantTracker{saved: 48, reports: kvcore.SaveCounts{DeadLettered: 1}},
		},
		{
			// One group dead-lettered sets the status, another's keys were
			// skipped: the skipped keys still make the range unsaved.
			name: "S59_skipped_keys_under_a_dead_lettered_status_saved_again",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, kvcore.SaveReport{Status: kvcore.SaveDeadLettered, Skipped: 1}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{0, 48, 0}),
			},
			want: wantTracker{saved: 48, reports: kvcore.SaveCounts{DeadLettered: 1}},
		},
		{
			// Saves in flight together: the earlier is skipped, the later
			// stored. vLLM's second job ran after the first and started at
			// the persisted offset 0, covering [0,32) again: the skipped
			// range is saved again at once, as that job, and the next step
			// saves from the saved offset only.
			name: "S60_pipelined_saves_skipped_earlier_saved_again_at_once",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 4))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				reportOp(2, stored),
				{report: 1, rep: skipped, want: []wantSave{{0, 32, 0}}},
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64}, wantSave{48, 64, 0}),
			},
			want: wantTracker{saved: 64, reports: kvcore.SaveCounts{Stored: 1, Skipped: 1}},
		},
		{
			// The re-save rides on the request's next save: no new full
			// block, no save (data.py: skip_save when num_tokens_to_save <
			// chunk_boundary); the range stays unsaved until then.
			name: "S61_resave_waits_for_a_new_full_block",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, skipped),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 40}),
			},
			want: wantTracker{saved: 32, unsaved: []SaveSpan{{TaskID: "e1/r1/save/1", Start: 0, End: 32}}, reports: kvcore.SaveCounts{Skipped: 1}},
		},
		{
			// A save of an earlier epoch reported skipped only settles: it
			// read blocks the engine released (worker.py: a job of a retired
			// generation cannot rewind the resume offset).
			name: "S62_stale_skipped_save_not_marked_unsaved",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepPreempted}),
				stepOp(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: tbl(ids(8, 3))}, wantSave{0, 48, 1}),
				reportOp(1, skipped),
				reportOp(2, stored),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: tbl(ids(11, 1))}, wantSave{48, 64, 1}),
			},
			want: wantTracker{saved: 64, epoch: 1, reports: kvcore.SaveCounts{Stored: 1, Skipped: 1}},
		},
		{
			// A skipped last save is not saved again (no later save), but
			// is counted and still frees the request.
			name: "S63_finish_after_a_skipped_save_frees_and_counts",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2))}, wantSave{0, 32, 0}),
				finishOp(0),
				{report: 1, rep: skipped, wantFinished: 1},
			},
			want: wantTracker{saved: 32, reports: kvcore.SaveCounts{Skipped: 1}},
		},
		{
			// Issue 25: vLLM starts each job at the persisted offset when it
			// runs (worker.py _saved_offset), so the job queued after a
			// failed one covers the failed range again. Here the prompt is
			// saved by the second job and decode steps never save: without
			// the re-save at the report, [0,48) would never be saved again.
			name: "S67_queued_later_save_covers_the_failed_range_again", prompt: 96,
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 6))}, wantSave{0, 48, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 96}, wantSave{48, 96, 0}),
				reportOp(1, failed, wantSave{0, 48, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepDecode, Tokens: 97, Table: tbl(ids(6, 1))}),
				reportOp(2, stored),
				reportOp(3, stored),
				finishOp(1),
			},
			want: wantTracker{saved: 96, prefillEnd: 96, reports: kvcore.SaveCounts{Stored: 2, Failed: 1}},
		},
		{
			// A finished request's queued jobs still run with its resume
			// offset (worker.py _close_ended_store_requests keeps it until
			// they drained): the re-save is emitted and holds the free.
			name: "S68_finishing_request_saves_the_failed_range_again_before_the_free", prompt: 96,
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 6))}, wantSave{0, 48, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 96}, wantSave{48, 96, 0}),
				finishOp(0),
				reportOp(2, stored),
				reportOp(1, skipped, wantSave{0, 48, 0}),
				{report: 3, rep: stored, wantFinished: 1},
			},
			want: wantTracker{saved: 96, prefillEnd: 96, reports: kvcore.SaveCounts{Stored: 2, Skipped: 1}},
		},
		{
			// Every later job tries the range once more: two jobs were
			// queued after the failed one, so it is saved again twice, then
			// left to the request's next save.
			name: "S69_failed_range_tried_once_per_later_job",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 5))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64}, wantSave{48, 64, 0}),
				reportOp(1, failed, wantSave{0, 32, 0}),
				reportOp(4, failed, wantSave{0, 32, 0}),
				reportOp(5, failed),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 80}, wantSave{0, 80, 0}),
			},
			want: wantTracker{saved: 80, reports: kvcore.SaveCounts{Failed: 3}},
		},
		{
			// A range that a save emitted after it covers again is not saved
			// again for it: [32,48) fails after [0,64) was emitted, so the
			// next step saves from the saved offset only.
			name: "S70_failed_range_a_later_save_covers_not_saved_twice",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 5))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				reportOp(1, failed, wantSave{0, 32, 0}),
				reportOp(3, failed),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64}, wantSave{0, 64, 0}),
				reportOp(2, failed),
				reportOp(4, stored),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 80}, wantSave{64, 80, 0}),
			},
			want: wantTracker{saved: 80, reports: kvcore.SaveCounts{Stored: 1, Failed: 3}},
		},
		{
			// Issue 25: an existence check that kept failing is a transient
			// store problem; vLLM's next job retries the range (the raised
			// batch_is_exist leaves _saved_offset where it was).
			name: "S71_exists_failed_range_saved_again_by_the_next_save",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 3))}, wantSave{0, 32, 0}),
				reportOp(1, existsFailed),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{0, 48, 0}),
			},
			want: wantTracker{saved: 48, reports: kvcore.SaveCounts{DeadLettered: 1}},
		},
		{
			name: "S72_exists_failed_with_a_queued_later_save_saved_again_at_once",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 4))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				reportOp(1, existsFailed, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64}, wantSave{48, 64, 0}),
			},
			want: wantTracker{saved: 64, reports: kvcore.SaveCounts{DeadLettered: 1}},
		},
		{
			// A dead letter for a permanent cause is not saved again, with
			// or without a later job queued.
			name: "S73_permanent_dead_letter_with_a_queued_later_save_not_saved_again",
			ops: []saveOp{
				stepOp(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 4))}, wantSave{0, 32, 0}),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}, wantSave{32, 48, 0}),
				reportOp(1, deadLettered),
				stepOp(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64}, wantSave{48, 64, 0}),
			},
			want: wantTracker{saved: 64, reports: kvcore.SaveCounts{DeadLettered: 1}},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := trkDense(t)
			tr := NewTracker(m, "e1", "r1")
			tr.OnAdmit(trkHashes(64), c.prompt)
			var emitted []kvcore.SaveTask
			for i, op := range c.ops {
				var eff Effects
				if op.step != nil {
					eff = noErr(t, tr.Step(m, *op.step))
				} else {
					eff = noErr(t, tr.OnSaveReport(m, emitted[op.report-1].TaskID, op.rep))
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
					if f.Kind == kvcore.FeedbackFinishedSending {
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
	old := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 2), ids(10, 2))})).Saves[0]
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepPreempted}))
	eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, PrefillTokens: 48, Table: tbl(ids(20, 3), ids(30, 3))}))
	want := kvcore.SaveTask{
		Schema: kvcore.SchemaSaveTask, TaskID: "e1/r1/save/2", EngineID: "e1", RequestID: "r1", Model: m.Name, Epoch: 1,
		Start: 0, End: 48, BlockTable: tbl(ids(20, 3), ids(30, 3)), BlockHashes: trkHashes(3), Groups: m.SaveGroups(0, 48),
	}
	if len(eff.Saves) != 1 || !reflect.DeepEqual(eff.Saves[0], want) {
		t.Fatalf("resumed saves %+v, want %+v", eff.Saves, want)
	}
	if !reflect.DeepEqual(tr.SaveSpans, []SaveSpan{{TaskID: want.TaskID, Start: 0, End: 48, Job: 1}}) || !reflect.DeepEqual(tr.StaleSaves, []string{old.TaskID}) {
		t.Fatalf("spans %+v stale %v", tr.SaveSpans, tr.StaleSaves)
	}
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepFinished}))
	if eff := noErr(t, tr.OnSaveResult(old.TaskID, kvcore.SaveFailed)); len(eff.Feedback) != 0 || len(tr.Unsaved) != 0 {
		t.Fatalf("stale failed save %+v unsaved %v", eff, tr.Unsaved)
	}
	fb := []kvcore.Feedback{{Kind: kvcore.FeedbackFinishedSending, EngineID: "e1", RequestID: "r1", Epoch: 1}}
	if eff := noErr(t, tr.OnSaveResult(want.TaskID, kvcore.SaveStored)); !reflect.DeepEqual(eff.Feedback, fb) || !eff.Drop {
		t.Fatalf("epoch-1 result %+v, want %+v and drop", eff, fb)
	}
}

// TestSaveScenarioStoredTrackerUpgrade (S65): ranges survive the JSON
// round trip, and a tracker stored without ranges (before issue 14) whose
// pending save reports skipped saves again from token 0.
func TestSaveScenarioStoredTrackerUpgrade(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	a := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 4))})).Saves[0]
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}))
	noErr(t, tr.OnSaveResult(a.TaskID, kvcore.SaveSkipped))
	b, err := MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnmarshalTracker(b)
	if err != nil || !reflect.DeepEqual(back, tr) {
		t.Fatalf("round trip: %v\n%+v\n%+v", err, back, tr)
	}
	old := newTrk(m)
	s := noErr(t, old.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: tbl(ids(0, 4))})).Saves[0]
	old.SaveSpans = nil // as stored before ranges were kept
	noErr(t, old.OnSaveResult(s.TaskID, kvcore.SaveSkipped))
	if want := []SaveSpan{{TaskID: s.TaskID, Start: 0, End: 48}}; !reflect.DeepEqual(old.Unsaved, want) {
		t.Fatalf("unsaved %+v, want %+v", old.Unsaved, want)
	}
	if eff := noErr(t, old.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64})); len(eff.Saves) != 1 || eff.Saves[0].Start != 0 || eff.Saves[0].End != 64 {
		t.Fatalf("next save %+v, want [0,64)", eff.Saves)
	}
}

// TestSaveScenarioResaveHybrid (S74): the re-save of a range a queued later
// job covers is the save of that range a step would emit on the current
// table (every group's held chunks, the Mamba state at its end: what the
// sender's ValidateSave accepts), running as the job after the failed
// task's. A prompt-tail save alone is no job (vLLM's offload-only job has
// token_len_chunk 0 and saves no range), so it does not make a failed save
// be saved again at once.
func TestSaveScenarioResaveHybrid(t *testing.T) {
	m := trkHybrid(t)
	tr := newTrk(m)
	table := tbl(ids(0, 4), ids(10, 4))
	first := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table})).Saves[0]
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}))
	eff := noErr(t, tr.OnSaveReport(m, first.TaskID, kvcore.SaveReport{Status: kvcore.SaveFailed, Failed: 1}))
	want := kvcore.SaveTask{
		Schema: kvcore.SchemaSaveTask, TaskID: "e1/r1/save/3", EngineID: "e1", RequestID: "r1", Model: m.Name,
		Start: 0, End: 32, BlockTable: table, BlockHashes: trkHashes(2),
		Groups: []kvcore.GroupChunks{{Group: 0, Chunks: []kvcore.Chunk{{Start: 0, End: 16}, {Start: 16, End: 32}}}, {Group: 1, Chunks: []kvcore.Chunk{{Start: 16, End: 32}}}},
	}
	if len(eff.Saves) != 1 || !reflect.DeepEqual(eff.Saves[0], want) {
		t.Fatalf("re-save %+v, want %+v", eff.Saves, want)
	}
	if s := tr.SaveSpans[len(tr.SaveSpans)-1]; s.TaskID != want.TaskID || s.Job != 2 || tr.SaveJobs != 2 {
		t.Fatalf("re-save span %+v, jobs %d; want job 2 of 2", s, tr.SaveJobs)
	}
	for _, v := range kvcore.ValidateSave(m, nil, &eff.Saves[0]) {
		if !v.OK() {
			t.Fatalf("re-save refused: %+v", v)
		}
	}

	p := partialModel()
	pt := NewTracker(p, "e1", "r2")
	pt.OnAdmit(hexes(promptHashes(p, 100, 46)), 100)
	steps := noErr(t, pt.Step(p, kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: tbl([]kvcore.BlockID{1, 2}, []kvcore.BlockID{3, 4})})).Saves[0]
	if tail := noErr(t, pt.Step(p, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 100})).Saves; len(tail) != 1 || tail[0].Start != 64 || pt.SaveJobs != 1 {
		t.Fatalf("prompt tail %+v, jobs %d; want the tail [64,96) and still one job", tail, pt.SaveJobs)
	}
	if eff := noErr(t, pt.OnSaveReport(p, steps.TaskID, kvcore.SaveReport{Status: kvcore.SaveSkipped, Skipped: 2})); len(eff.Saves) != 0 ||
		!reflect.DeepEqual(pt.Unsaved, []SaveSpan{{TaskID: steps.TaskID, Start: 0, End: 64}}) {
		t.Fatalf("skipped steps save after a tail-only job: saves %+v, unsaved %+v; want none and [0,64)", eff.Saves, pt.Unsaved)
	}
}

// TestSaveScenarioResaveFallbacks (S75): where no re-save can be emitted at
// the report, the range joins Unsaved for the request's next save: a status
// reported without the model (OnSaveResult), and a load of the request
// outstanding (its blocks may not be read). A report for another model (or
// none) is refused and changes nothing.
func TestSaveScenarioResaveFallbacks(t *testing.T) {
	m := trkDense(t)
	tr := newTrk(m)
	first := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 5))})).Saves[0]
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}))
	for _, bad := range []*kvcore.Model{nil, trkModel(t, kvcore.Group{Kind: kvcore.KindMLA, BlockSize: 16})} {
		if bad != nil {
			bad.Name = "other"
		}
		isErr(t, tr.OnSaveReport(bad, first.TaskID, kvcore.SaveReport{Status: kvcore.SaveFailed}), kvcore.ErrUnknownModel)
	}
	if len(tr.PendingSaves) != 2 || tr.Reports != (kvcore.SaveCounts{}) {
		t.Fatalf("refused reports changed the tracker: pending %v reports %+v", tr.PendingSaves, tr.Reports)
	}
	if eff := noErr(t, tr.OnSaveResult(first.TaskID, kvcore.SaveFailed)); len(eff.Saves) != 0 ||
		!reflect.DeepEqual(tr.Unsaved, []SaveSpan{{TaskID: first.TaskID, Start: 0, End: 32}}) {
		t.Fatalf("status without the model: saves %+v unsaved %+v; want none and [0,32)", eff.Saves, tr.Unsaved)
	}
	if eff := noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64})); len(eff.Saves) != 1 || eff.Saves[0].Start != 0 || eff.Saves[0].End != 64 {
		t.Fatalf("next save %+v, want [0,64)", eff.Saves)
	}

	lt := newTrk(m)
	a := noErr(t, lt.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 5))})).Saves[0]
	noErr(t, lt.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}))
	noErr(t, lt.OnLookup(m, &kvcore.LoadSpec{VLLMCachedTokens: 48, KVPoolCachedTokens: 64}))
	if eff := noErr(t, lt.OnAllocate(m, 16, tbl(ids(0, 5)))); len(eff.Loads) != 1 {
		t.Fatalf("load while running: %+v", eff)
	}
	if eff := noErr(t, lt.OnSaveReport(m, a.TaskID, kvcore.SaveReport{Status: kvcore.SaveFailed, Failed: 1})); len(eff.Saves) != 0 ||
		!reflect.DeepEqual(lt.Unsaved, []SaveSpan{{TaskID: a.TaskID, Start: 0, End: 32}}) {
		t.Fatalf("failed save with a load outstanding: saves %+v unsaved %+v; want none and [0,32)", eff.Saves, lt.Unsaved)
	}
}

// TestTrackerMarkCovered: a save emitted later covers the start, the end,
// all or only the middle of a pending save's uncovered range; only a
// cover of either end is kept, and a range's end inside a scheduler block
// (a prompt tail) counts from that block's start.
func TestTrackerMarkCovered(t *testing.T) {
	m := trkDense(t)
	cases := []struct {
		name           string
		span           SaveSpan
		start, end     int
		wantLo, wantHi int
	}{
		{"wholly", SaveSpan{Start: 16, End: 48}, 0, 64, 48, 48},
		{"exactly", SaveSpan{Start: 16, End: 48}, 16, 48, 48, 48},
		{"start", SaveSpan{Start: 16, End: 64}, 0, 32, 32, 64},
		{"end", SaveSpan{Start: 16, End: 64}, 32, 96, 16, 32},
		{"middle_not_kept", SaveSpan{Start: 0, End: 64}, 16, 32, 0, 64},
		{"disjoint", SaveSpan{Start: 0, End: 32}, 32, 64, 0, 32},
		{"already_covered_start", SaveSpan{Start: 0, End: 64, CoveredLow: 32}, 0, 48, 48, 64},
		{"already_covered_end", SaveSpan{Start: 0, End: 64, CoveredHigh: 32}, 16, 48, 0, 16},
		{"tail_end_inside_a_block", SaveSpan{Start: 16, End: 40}, 0, 32, 40, 40},
		{"tail_sub_block_only", SaveSpan{Start: 32, End: 40}, 0, 48, 32, 40},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tr := &Tracker{SaveSpans: []SaveSpan{c.span}}
			tr.markCovered(m, c.start, c.end)
			if lo, hi := tr.SaveSpans[0].uncovered(); max(lo, hi) != c.wantHi || min(lo, hi) != min(c.wantLo, c.wantHi) {
				t.Fatalf("uncovered [%d,%d) (%+v), want [%d,%d)", lo, hi, tr.SaveSpans[0], c.wantLo, c.wantHi)
			}
		})
	}
}

// TestSaveReportJSON: SaveReport's exists_failed count and the tracker's
// job fields are omitted when zero, so reports and trackers stored before
// them decode unchanged, and they survive a round trip.
func TestSaveReportJSON(t *testing.T) {
	b, err := json.Marshal(kvcore.SaveReport{Status: kvcore.SaveSkipped, Skipped: 2})
	if err != nil || string(b) != `{"status":"skipped","skipped":2}` {
		t.Fatalf("report encodes as %s (%v)", b, err)
	}
	var r kvcore.SaveReport
	if err := json.Unmarshal([]byte(`{"status":"dead_lettered","exists_failed":3}`), &r); err != nil || r != (kvcore.SaveReport{Status: kvcore.SaveDeadLettered, ExistsFailed: 3}) || !unsaved(r) {
		t.Fatalf("report decodes as %+v (%v), want 3 exists_failed keys, unsaved", r, err)
	}
	m := trkDense(t)
	tr := newTrk(m)
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 4))}))
	noErr(t, tr.Step(m, kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48}))
	tr.SaveSpans[0].CoveredLow, tr.SaveSpans[0].CoveredHigh = 16, 8
	b, err = MarshalTracker(tr)
	if err != nil {
		t.Fatal(err)
	}
	back, err := UnmarshalTracker(b)
	if err != nil || !reflect.DeepEqual(back, tr) {
		t.Fatalf("round trip: %v\n%+v\n%+v", err, back, tr)
	}
	old := newTrk(m)
	noErr(t, old.Step(m, kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: tbl(ids(0, 4))}))
	old.SaveJobs, old.SaveSpans[0].Job = 0, 0 // as stored before jobs were counted
	b, _ = MarshalTracker(old)
	if strings.Contains(string(b), "job") || strings.Contains(string(b), "covered") {
		t.Fatalf("zero job fields encoded: %s", b)
	}
}
