package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TestSaveResultsFeedBack drives issue 14's save scenarios through Kafka
// against one running scheduler (two groups: full attention + Mamba, bs 16,
// hash 16): a save result with skipped or failed keys is not counted as
// saved, so the request's next save task covers the range again (S56, S59),
// and a request resumed with more tokens than its prompt saves from token 0
// up to its new prefill end (S51), as vLLM's MooncakeStore connector does.
func TestSaveResultsFeedBack(t *testing.T) {
	h := newMesh(t, meshOptions{})
	cases := []struct {
		name string
		// groups is the first save's result; status its status.
		status    kvcore.SaveStatus
		groups    []contract.GroupOutcome
		wantStart int // of the second save [wantStart, 48)
	}{
		{"S56_skipped_saved_again", kvcore.SaveSkipped,
			[]contract.GroupOutcome{{Group: 0, Skipped: 2, Reason: "store_pressure"}, {Group: 1, Skipped: 1, Reason: "store_pressure"}}, 0},
		{"S59_skipped_group_under_dead_lettered_status_saved_again", kvcore.SaveDeadLettered,
			[]contract.GroupOutcome{{Group: 0, Skipped: 2, Reason: "store_pressure"}, {Group: 1, DeadLettered: 1, Reason: "block_not_held"}}, 0},
		{"S58_dead_lettered_not_saved_again", kvcore.SaveDeadLettered,
			[]contract.GroupOutcome{{Group: 0, DeadLettered: 2, Reason: "block_not_held"}, {Group: 1, Stored: 1}}, 32},
		{"S57_failed_saved_again", kvcore.SaveFailed,
			[]contract.GroupOutcome{{Group: 0, Failed: 2, Reason: "put_failed"}, {Group: 1, Stored: 1}}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := h.on(t).request("s56")
			r.admit(64)
			r.allocate(0, table(0, 4), "")
			r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 4)})
			first := r.waitSaves(1)[0]
			if first.Start != 0 || first.End != 32 {
				t.Fatalf("first save %+v, want [0,32)", first)
			}
			r.result(contract.TransferResult{Kind: contract.TransferSave, TaskID: first.TaskID, Status: string(c.status), Groups: c.groups})
			eventually(t, "the first save's result applied", func() bool {
				d, ok := r.detail()
				return ok && len(d.Tasks) == 0
			})
			r.step(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48})
			second := r.waitSaves(2)[1]
			d := r.settled()
			if second.Start != c.wantStart || second.End != 48 || second.Epoch != 0 || len(d.Tracker.Unsaved) != 0 {
				t.Fatalf("second save [%d,%d) epoch %d, unsaved %+v; want [%d,48) of epoch 0, none", second.Start, second.End, second.Epoch, d.Tracker.Unsaved, c.wantStart)
			}
			r.saved(second)
			eventually(t, "the second save covered", func() bool {
				d, _ = r.detail()
				return len(d.Tasks) == 0 && len(d.Coverage) == 2 && d.Coverage[1].SavedTokens == 48
			})
		})
	}
	t.Run("S51_resumed_with_more_tokens_than_prompt", func(t *testing.T) {
		t.Parallel()
		r := h.on(t).request("s51")
		r.admit(40)
		r.allocate(0, table(0, 3), "")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 40, Table: table(0, 3)})
		first := r.waitSaves(1)[0]
		r.preempt()
		r.allocate(0, table(10, 4), "")
		r.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 64, PrefillTokens: 64, Table: table(10, 4)})
		s := r.waitSaves(2)[1]
		d := r.settled()
		if first.End != 32 || s.Start != 0 || s.End != 64 || s.Epoch != 1 || d.Tracker.PrefillEnd != 64 || d.Tracker.NumSavedTokens != 64 {
			t.Fatalf("first %+v, resumed save [%d,%d) epoch %d, prefill end %d saved %d; want [0,64) of epoch 1, 64, 64",
				first, s.Start, s.End, s.Epoch, d.Tracker.PrefillEnd, d.Tracker.NumSavedTokens)
		}
	})
}
