package requeststate

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// skip makes the harness's next event skip one seq (a dropped event).
func (h *harness) skip() { h.seq++ }

// requestError returns the request_error feedback of o, failing without one.
func requestError(t *testing.T, o Outcome) contract.EngineFeedback {
	t.Helper()
	for _, f := range o.Feedback {
		if f.Kind == contract.FeedbackRequestError {
			return f
		}
	}
	t.Fatalf("no request_error in %+v", o)
	return contract.EngineFeedback{}
}

// TestSeqGapFailsClosed: an event that skips a seq errors the request with
// request_error naming both seqs; nothing is emitted afterwards; its finish
// frees at once although a save is in flight.
func TestSeqGapFailsClosed(t *testing.T) {
	cases := []struct {
		name string
		// gap produces the event after the dropped one.
		gap func(h *harness) Outcome
		// finished is set when the gap event is itself the finish.
		finished bool
	}{
		{"running_step", func(h *harness) Outcome {
			return h.step(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: kvcore.BlockTable{{3}, {103}}})
		}, false},
		{"preempted", func(h *harness) Outcome { return h.kind(contract.EventPreempted) }, false},
		{"admitted", func(h *harness) Outcome {
			return h.event(contract.RequestEvent{Kind: contract.EventAdmitted, BlockHashes: hashes(8)})
		}, false},
		{"finished", func(h *harness) Outcome { return h.kind(contract.EventFinished) }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t) // event 1: admitted
			h.alloc(0, table(0, 3), "")
			s := h.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)}).Saves[0] // event 3
			h.skip()                                                                                // event 4 lost
			o := c.gap(h)                                                                           // event 5
			f := requestError(t, o)
			if !o.Errored || len(o.Saves)+len(o.Loads) != 0 || !errors.Is(errors.Join(o.Errors...), ErrSeqGap) ||
				!strings.Contains(f.Error, "expected seq 4, received 5") || h.r.State() == StateRunning {
				t.Fatalf("gap outcome %+v (error %q) state %s", o, f.Error, h.r.State())
			}
			if h.r.LastSeq != 5 || h.r.Store.Epoch != 1 || !reflect.DeepEqual(h.r.Store.StaleSaves, []string{s.TaskID}) {
				t.Fatalf("last seq %d epoch %d stale %v", h.r.LastSeq, h.r.Store.Epoch, h.r.Store.StaleSaves)
			}
			if !c.finished {
				o = h.step(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 64, Table: kvcore.BlockTable{{4}, {104}}})
				if o.Ignored != "errored" || counts(o) != [3]int{} {
					t.Fatalf("event after the gap: %+v", o)
				}
				if o := h.r.Decision(h.m, decision("d9", ConnectorStore, 32, 0)); o.Ignored != "errored" || counts(o) != [3]int{} {
					t.Fatalf("decision after the gap: %+v", o)
				}
				o = h.kind(contract.EventFinished)
			}
			var sending []contract.EngineFeedback
			for _, f := range o.Feedback {
				if f.Kind == kvcore.FeedbackFinishedSending {
					sending = append(sending, f)
				}
			}
			if len(sending) != 1 || !sending[0].Immediate || !h.r.Done() {
				t.Fatalf("finish after the gap: %+v done %v; want one immediate finished_sending", o, h.r.Done())
			}
			o = h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferSave, TaskID: s.TaskID, Status: "dead_lettered"})
			if counts(o) != [3]int{} || o.Ignored != "" || len(h.r.Store.StaleSaves) != 0 || h.r.Coverage[0].SavedTokens != 0 {
				t.Fatalf("stale save result %+v stale %v coverage %+v", o, h.r.Store.StaleSaves, h.r.Coverage)
			}
			if o := h.r.Engine(h.m, h.m.Name, contract.RequestEvent{Seq: 3, Kind: contract.EventScheduled}); !o.Stale {
				t.Fatalf("redelivered event 3 not stale: %+v", o)
			}
		})
	}
}

// TestSeqGapFirstEvent: a request's first event must have seq 1; a later
// one (lost events, or a tracker purged by retention and re-created) fails
// closed, and a first event that is the finish still frees.
func TestSeqGapFirstEvent(t *testing.T) {
	for _, k := range []contract.EventKind{contract.EventAdmitted, contract.EventFinished} {
		t.Run(string(k), func(t *testing.T) {
			h := newHarness(t)
			r := New(h.m, "e1", "r2")
			o := r.Engine(h.m, h.m.Name, contract.RequestEvent{Seq: 3, Kind: k})
			if f := requestError(t, o); !strings.Contains(f.Error, "expected seq 1, received 3") || r.LastSeq != 3 {
				t.Fatalf("first event seq 3: %+v last seq %d", o, r.LastSeq)
			}
			if done := r.Done(); done != (k == contract.EventFinished) {
				t.Fatalf("done %v after a first %s event", done, k)
			}
		})
	}
}

// TestSeqGapWhileHeld: a gap while an allocation waits for its decision
// answers the promised external tokens with every allocated block in error.
func TestSeqGapWhileHeld(t *testing.T) {
	h := newHarness(t)
	h.alloc(32, table(0, 2), "d1")
	h.skip()
	o := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	requestError(t, o)
	if h.r.Held != nil || len(o.Loads) != 0 || o.Feedback[0].Kind != kvcore.FeedbackFinishedRecving ||
		!reflect.DeepEqual(o.Feedback[0].LoadErrors, []kvcore.BlockID{0, 1, 100, 101}) {
		t.Fatalf("gap while held: %+v held %+v", o, h.r.Held)
	}
	if o := h.r.Decision(h.m, decision("d1", ConnectorStore, 32, 0)); o.Ignored != "errored" || len(o.Loads) != 0 {
		t.Fatalf("decision after the gap: %+v", o)
	}
}

// TestPreemptedSaveResultIsStale: a save in flight at the preemption is of
// epoch 0 and becomes stale; the resumed request saves from token 0 again
// (vLLM's rule; issue 14 changed it: the offset was kept and nothing was
// saved), so its finish waits for the epoch-1 save only. The old save's
// late result only settles it (and counts in the coverage: its blocks were
// proven).
func TestPreemptedSaveResultIsStale(t *testing.T) {
	h := newHarness(t)
	h.alloc(0, table(0, 3), "")
	old := h.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)}).Saves[0]
	h.kind(contract.EventPreempted)
	if h.r.Store.NumSavedTokens != 0 {
		t.Fatalf("preempted: saved %d, want 0", h.r.Store.NumSavedTokens)
	}
	h.alloc(0, table(7, 3), "")
	o := h.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 32, Table: table(7, 2)})
	want(t, o, [3]int{1, 0, 0}, "resumed")
	cur := o.Saves[0]
	if cur.Start != 0 || cur.End != 32 || cur.Epoch != 1 || !reflect.DeepEqual(cur.BlockTable, table(7, 2)) {
		t.Fatalf("resumed save %+v, want [0,32) of epoch 1 from the new table", cur)
	}
	if old.Epoch != 0 || h.r.Store.Epoch != 1 || h.r.Store.NumSavedTokens != 32 || len(h.r.Tasks) != 2 || h.r.Tasks[0].Epoch != 0 {
		t.Fatalf("old %+v epoch %d saved %d outstanding %+v", old, h.r.Store.Epoch, h.r.Store.NumSavedTokens, h.r.Tasks)
	}
	want(t, h.kind(contract.EventFinished), [3]int{}, "finish waits for the epoch-1 save")
	o = h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferSave, TaskID: old.TaskID, Status: "stored"})
	want(t, o, [3]int{}, "old-epoch result")
	if len(h.r.Tasks) != 1 || h.r.Coverage[0].SavedTokens != 32 {
		t.Fatalf("old-epoch result: outstanding %+v coverage %+v", h.r.Tasks, h.r.Coverage)
	}
	o = h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferSave, TaskID: cur.TaskID, Status: "stored"})
	want(t, o, [3]int{0, 0, 1}, "epoch-1 result frees")
	if f := o.Feedback[0]; f.Kind != kvcore.FeedbackFinishedSending || f.Immediate || f.Epoch != 1 {
		t.Fatalf("feedback %+v", f)
	}
}

// TestPreemptedLoadResultIsStale: a load in flight at a preemption (an
// engine breaking the contract) yields no finished_recving: it could
// complete the resumed attempt's load. The current load's names its task.
func TestPreemptedLoadResultIsStale(t *testing.T) {
	h := newHarness(t)
	h.r.Decision(h.m, decision("d1", ConnectorStore, 32, 0))
	h.alloc(32, table(0, 3), "d1")
	old := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad}).Loads[0]
	h.kind(contract.EventPreempted)
	h.r.Decision(h.m, decision("d2", ConnectorStore, 32, 0))
	h.alloc(32, table(5, 3), "d2")
	cur := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad}).Loads[0]
	o := h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferLoad, TaskID: old.TaskID})
	if counts(o) != [3]int{} || o.Ignored != "" {
		t.Fatalf("old-epoch load result %+v", o)
	}
	o = h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferLoad, TaskID: cur.TaskID})
	want(t, o, [3]int{0, 0, 1}, "current load result")
	if f := o.Feedback[0]; f.Kind != kvcore.FeedbackFinishedRecving || f.TaskID != cur.TaskID || f.Epoch != 1 {
		t.Fatalf("feedback %+v", f)
	}
}
