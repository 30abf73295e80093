package app_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// TestBlockLifetime drives the block-lifetime contract (API.md) through
// Kafka and PostgreSQL: a request whose events skip a seq fails closed, and
// a save in flight at a preemption never stands in for the resumed
// request's own save.
func TestBlockLifetime(t *testing.T) {
	h := newMesh(t, meshOptions{})
	cases := []struct {
		name string
		run  func(t *testing.T, h *mesh)
	}{
		{"dropped_event_fails_closed", droppedEvent},
		{"preempted_save_in_flight_is_stale", preemptedSaveInFlight},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.run(t, h.on(t))
		})
	}
}

// feedbackKinds lists the kinds of the request's feedback, in order.
func feedbackKinds(r *request) []kvcore.FeedbackKind {
	var out []kvcore.FeedbackKind
	for _, f := range r.feedback() {
		out = append(out, f.Kind)
	}
	return out
}

// droppedEvent: events 1, 2, 3, 5, 6, 7 of one request (event 4, the step
// that appended blocks 2 and 102, is lost). Event 5 appends blocks 3 and
// 103: applied, the table would read [0 1 3] and the save of [32,48) would
// store block 3's bytes under chunk 2's key. Instead the request gets
// request_error naming seqs 4 and 5, no save after the gap, and its finish
// is answered with finished_sending at once although the save emitted
// before the gap was never reported.
func droppedEvent(t *testing.T, h *mesh) {
	r := h.request("gap")
	r.admit(48)
	r.allocate(0, table(0, 3), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)})
	before := r.waitSaves(1)[0]
	if before.Start != 0 || before.End != 32 || !reflect.DeepEqual(before.BlockTable, table(0, 2)) {
		t.Fatalf("save before the gap %+v", before)
	}
	r.seq++ // event 4 is dropped
	r.step(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: kvcore.BlockTable{{3}, {103}}})
	f := r.waitFeedback(contract.FeedbackRequestError)
	if !strings.Contains(f.Error, "expected seq 4, received 5") || f.EngineID != r.engine {
		t.Fatalf("request_error %+v", f)
	}
	r.step(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: kvcore.BlockTable{{4}, {104}}})
	d := r.settled()
	if d.State != string(requeststate.StateErrored) || !strings.Contains(d.Error, "sequence gap") || d.LastSeq != 6 {
		t.Fatalf("after the gap: state %s error %q last seq %d", d.State, d.Error, d.LastSeq)
	}
	r.finish()
	sending := r.waitFeedback(kvcore.FeedbackFinishedSending)
	d = r.settled()
	if !sending.Immediate || d.State != string(requeststate.StateDone) {
		t.Fatalf("finish: %+v state %s; want immediate finished_sending and done", sending, d.State)
	}
	if n := len(r.saves()); n != 1 || h.outboxCount(contract.TopicSaveTasks, r.id) != 1 {
		t.Fatalf("%d save tasks (%d in the outbox), want only the one before the gap", n, h.outboxCount(contract.TopicSaveTasks, r.id))
	}
	if got, want := feedbackKinds(r), []kvcore.FeedbackKind{contract.FeedbackRequestError, kvcore.FeedbackFinishedSending}; !reflect.DeepEqual(got, want) {
		t.Fatalf("feedback %v, want %v", got, want)
	}
	// The old save's late result settles it and changes nothing else.
	r.result(contract.TransferResult{Kind: contract.TransferSave, TaskID: before.TaskID, Status: string(kvcore.SaveDeadLettered),
		Groups: []contract.GroupOutcome{{Group: 0, DeadLettered: 2, Reason: "block_not_held"}, {Group: 1, DeadLettered: 1, Reason: "block_not_held"}}})
	eventually(t, "the old save settled", func() bool { d, _ = r.detail(); return len(d.Tasks) == 0 })
	r.settled()
	if len(r.feedback()) != 2 || d.Tracker.Reports.DeadLettered != 1 {
		t.Fatalf("late result: feedback %v reports %+v", feedbackKinds(r), d.Tracker.Reports)
	}
}

// preemptedSaveInFlight: save [0,32) of epoch 0 is in flight when the
// request is preempted; the resumed request (epoch 1, new blocks) saves
// from token 0 again, [0,48), as vLLM's does (before issue 14 it kept its
// saved offset and saved only [32,48)). The old save's result (stored)
// settles it without freeing the finished request; the new save's frees it.
func preemptedSaveInFlight(t *testing.T, h *mesh) {
	r := h.request("epoch")
	r.admit(48)
	r.allocate(0, table(0, 3), "")
	r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)})
	old := r.waitSaves(1)[0]
	r.preempt()
	r.allocate(0, table(7, 3), "")
	r.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: table(7, 3)})
	cur := r.waitSaves(2)[1]
	if old.Epoch != 0 || cur.Epoch != 1 || cur.Start != 0 || cur.End != 48 || !reflect.DeepEqual(cur.BlockTable, table(7, 3)) {
		t.Fatalf("old save %+v, resumed save %+v; want [0,48) of epoch 1 on blocks 7-9", old, cur)
	}
	r.finish()
	r.saved(old)
	d := r.settled()
	eventually(t, "the old save settled", func() bool { d, _ = r.detail(); return len(d.Tasks) == 1 })
	r.settled()
	if d.State != string(requeststate.StateFinishing) || len(r.feedback()) != 0 || d.Tasks[0].ID != cur.TaskID {
		t.Fatalf("after the old-epoch result: state %s feedback %v tasks %+v", d.State, feedbackKinds(r), d.Tasks)
	}
	r.saved(cur)
	f := r.waitFeedback(kvcore.FeedbackFinishedSending)
	eventually(t, "done", func() bool { d, _ = r.detail(); return d.State == string(requeststate.StateDone) })
	if f.Immediate || f.Epoch != 1 || d.Coverage[0].SavedTokens != 48 || d.Coverage[1].SavedTokens != 48 {
		t.Fatalf("finished_sending %+v coverage %+v", f, d.Coverage)
	}
}
