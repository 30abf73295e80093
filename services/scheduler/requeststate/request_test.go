package requeststate

import (
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// harness drives one request of the hybrid preset (MLA + Mamba, bs 16).
type harness struct {
	t   *testing.T
	m   *kvcore.Model
	r   *Request
	seq int64
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, m: m, r: New(m, "e1", "r1")}
	h.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(8)})
	return h
}

func hashes(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%064x", i+1)
	}
	return out
}

// table is a two-group table with n blocks per group from first.
func table(first, n int) kvcore.BlockTable {
	t := kvcore.BlockTable{{}, {}}
	for i := range n {
		t[0] = append(t[0], kvcore.BlockID(first+i))
		t[1] = append(t[1], kvcore.BlockID(100+first+i))
	}
	return t
}

func (h *harness) event(ev contract.RequestEvent) Outcome {
	h.t.Helper()
	h.seq++
	ev.Seq, ev.RequestID = h.seq, "r1"
	return h.r.Engine(h.m, h.m.Name, ev)
}

func (h *harness) alloc(external int, tbl kvcore.BlockTable, decisionID string) Outcome {
	return h.event(contract.RequestEvent{Kind: contract.EventAllocated, ExternalTokens: external, BlockTable: tbl, DecisionID: decisionID})
}

func (h *harness) step(s kvcore.Step) Outcome {
	return h.event(contract.RequestEvent{Kind: contract.EventScheduled, Step: &s})
}

func (h *harness) kind(k contract.EventKind) Outcome {
	return h.event(contract.RequestEvent{Kind: k})
}

// decision is a lookup decision over [pd?, store] choosing chosen.
func decision(id, chosen string, storeHit, pdTokens int) contract.LookupDecision {
	d := contract.LookupDecision{
		Schema: contract.SchemaLookupDecision, DecisionID: id, EngineID: "e1", RequestID: "r1",
		Model: "hybrid-mla-linear", NumTokens: 48, Chosen: chosen,
	}
	if pdTokens > 0 {
		d.Children = append(d.Children, contract.ChildDecision{Name: ConnectorPD, Tokens: pdTokens})
		d.PD = &contract.PDSource{EngineID: "prefill-1", BlockTable: table(40, 3), Tokens: pdTokens}
	}
	d.Children = append(d.Children, contract.ChildDecision{Name: ConnectorStore, Tokens: storeHit,
		Spec: &kvcore.LoadSpec{KVPoolCachedTokens: storeHit}})
	if chosen == ConnectorStore {
		d.ExternalTokens = storeHit
	} else if chosen == ConnectorPD {
		d.ExternalTokens = pdTokens
	}
	return d
}

func counts(o Outcome) [3]int { return [3]int{len(o.Saves), len(o.Loads), len(o.Feedback)} }

func want(t *testing.T, o Outcome, c [3]int, what string) {
	t.Helper()
	if counts(o) != c {
		t.Fatalf("%s: saves/loads/feedback %v, want %v (%+v)", what, counts(o), c, o)
	}
}

func TestDecisionThenAllocationIssuesLoad(t *testing.T) {
	h := newHarness(t)
	want(t, h.r.Decision(h.m, decision("d1", ConnectorStore, 32, 0)), [3]int{}, "decision")
	want(t, h.alloc(32, table(0, 3), "d1"), [3]int{}, "allocation")
	o := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	want(t, o, [3]int{0, 1, 0}, "pending step")
	if l := o.Loads[0]; l.Connector != ConnectorStore || l.Start != 0 || l.End != 32 || l.Remote != nil {
		t.Fatalf("load %+v", l)
	}
	if len(h.r.Tasks) != 1 || h.r.Tasks[0].ID != o.Loads[0].TaskID {
		t.Fatalf("outstanding %+v", h.r.Tasks)
	}
}

func TestAllocationHeldUntilDecision(t *testing.T) {
	h := newHarness(t)
	o := h.alloc(32, table(0, 3), "d1")
	if !o.Held || h.r.Held == nil {
		t.Fatalf("allocation before its decision not held: %+v", o)
	}
	if o := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad}); !o.Held || len(h.r.Held.Events) != 1 {
		t.Fatalf("pending step not held behind the allocation: %+v", o)
	}
	want(t, h.r.Decision(h.m, decision("other", ConnectorStore, 32, 0)), [3]int{}, "another attempt's decision")
	o = h.r.Decision(h.m, decision("d1", ConnectorStore, 32, 0))
	want(t, o, [3]int{0, 1, 0}, "decision releases the held events")
	if h.r.Held != nil || h.r.Store.Load.Spec == nil || !h.r.Store.Load.Spec.CanLoad {
		t.Fatalf("after release: held %+v load %+v", h.r.Held, h.r.Store.Load)
	}
}

// TestDecisionBeforePreemptionSurvives: the lookup of a resumed request
// arrives before the preemption event; binding by decision id keeps it.
func TestDecisionBeforePreemptionSurvives(t *testing.T) {
	h := newHarness(t)
	h.alloc(0, table(0, 3), "")
	want(t, h.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)}), [3]int{1, 0, 0}, "new")
	want(t, h.r.Decision(h.m, decision("d2", ConnectorStore, 32, 0)), [3]int{}, "resume lookup")
	h.kind(contract.EventPreempted)
	want(t, h.alloc(32, table(7, 3), "d2"), [3]int{}, "resume allocation")
	o := h.step(kvcore.Step{Kind: kvcore.StepResumed, Tokens: 48, Table: table(7, 3)})
	want(t, o, [3]int{0, 1, 0}, "resumed with can_load")
	if !reflect.DeepEqual(o.Loads[0].BlockTable, table(7, 3)) {
		t.Fatalf("load into %v", o.Loads[0].BlockTable)
	}
}

// TestPDChosen (scenario 21): pd chosen → store gets 0 and emits nothing;
// the pd tracker loads from the prefill engine; the finish frees once.
func TestPDChosen(t *testing.T) {
	h := newHarness(t)
	h.r.Decision(h.m, decision("d1", ConnectorPD, 32, 32))
	h.alloc(32, table(0, 2), "d1")
	if h.r.Store.Load.Spec == nil || h.r.Store.Load.Spec.CanLoad {
		t.Fatalf("store load spec %+v, want kept with can_load false", h.r.Store.Load.Spec)
	}
	if h.r.PD == nil || h.r.PD.Load.Spec == nil || !h.r.PD.Load.Spec.CanLoad {
		t.Fatalf("pd tracker %+v", h.r.PD)
	}
	o := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	want(t, o, [3]int{0, 1, 0}, "pd pending load")
	l := o.Loads[0]
	if l.Connector != ConnectorPD || l.Remote == nil || l.Remote.EngineID != "prefill-1" || l.TaskID != "e1/r1/pd-load/1" {
		t.Fatalf("pd load %+v", l)
	}
	o = h.r.Result(h.m, contract.TransferResult{ResultID: "x", Kind: contract.TransferLoad, TaskID: l.TaskID, LoadErrors: []kvcore.BlockID{1}})
	want(t, o, [3]int{0, 0, 1}, "pd load result")
	if f := o.Feedback[0]; f.Kind != kvcore.FeedbackFinishedRecving || !reflect.DeepEqual(f.LoadErrors, []kvcore.BlockID{1}) {
		t.Fatalf("feedback %+v", f)
	}
	o = h.kind(contract.EventFinished)
	want(t, o, [3]int{0, 0, 1}, "finish")
	if f := o.Feedback[0]; f.Kind != kvcore.FeedbackFinishedSending || !f.Immediate {
		t.Fatalf("finish feedback %+v", f)
	}
}

func TestUnservedConnectorAnsweredWithLoadErrors(t *testing.T) {
	h := newHarness(t)
	d := decision("d1", "nixl", 0, 0)
	d.Children = append(d.Children, contract.ChildDecision{Name: "nixl", Tokens: 32})
	h.r.Decision(h.m, d)
	o := h.alloc(32, table(0, 2), "d1")
	want(t, o, [3]int{0, 0, 1}, "unserved allocation")
	if f := o.Feedback[0]; f.Kind != kvcore.FeedbackFinishedRecving || len(f.LoadErrors) != 4 {
		t.Fatalf("feedback %+v", f)
	}
	if !errors.Is(o.Errors[0], ErrUnservedConnector) || len(h.r.Warnings) != 1 {
		t.Fatalf("errors %v warnings %+v", o.Errors, h.r.Warnings)
	}
}

func TestErroredRequests(t *testing.T) {
	cases := []struct {
		name  string
		drive func(h *harness) Outcome
		err   error
	}{
		{"group_count", func(h *harness) Outcome {
			return h.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: kvcore.BlockTable{{0, 1}}})
		}, kvcore.ErrGroupCount},
		// The seed's input on the allocation path: a 1-group table for
		// the 2-group model, after the store child's lookup decision.
		{"group_count_on_allocation", func(h *harness) Outcome {
			h.r.Decision(h.m, decision("d1", ConnectorStore, 32, 0))
			return h.alloc(32, kvcore.BlockTable{{0, 1, 2}}, "d1")
		}, kvcore.ErrGroupCount},
		{"wrong_model", func(h *harness) Outcome {
			h.seq++
			return h.r.Engine(h.m, "other", contract.RequestEvent{Seq: h.seq, Kind: contract.EventAdmitted})
		}, ErrWrongModel},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t)
			o := c.drive(h)
			if !o.Errored || h.r.State() != StateErrored || len(o.Saves) != 0 {
				t.Fatalf("outcome %+v state %s", o, h.r.State())
			}
			f := o.Feedback[len(o.Feedback)-1]
			if f.Kind != contract.FeedbackRequestError || f.Error == "" || !errors.Is(errors.Join(o.Errors...), c.err) {
				t.Fatalf("feedback %+v errors %v", f, o.Errors)
			}
			o = h.kind(contract.EventFinished)
			want(t, o, [3]int{0, 0, 1}, "finish of an errored request")
			if !h.r.Done() || o.Feedback[0].Kind != kvcore.FeedbackFinishedSending {
				t.Fatalf("errored request not freed: %+v", o)
			}
		})
	}
}

func TestStaleEventIgnored(t *testing.T) {
	h := newHarness(t)
	ev := contract.RequestEvent{Seq: 1, Kind: contract.EventFinished}
	if o := h.r.Engine(h.m, h.m.Name, ev); !o.Stale || h.r.Done() {
		t.Fatalf("stale finish applied: %+v", o)
	}
}

func TestFinishWhileHeldFreesNow(t *testing.T) {
	h := newHarness(t)
	h.alloc(32, table(0, 3), "d1")
	h.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	o := h.kind(contract.EventFinished)
	if h.r.Held != nil || !h.r.Done() || len(o.Feedback) != 1 || !o.Feedback[0].Immediate {
		t.Fatalf("finish while held: %+v held %+v", o, h.r.Held)
	}
	if o := h.r.Decision(h.m, decision("d1", ConnectorStore, 32, 0)); o.Ignored != "finished" || len(o.Loads) != 0 {
		t.Fatalf("decision after the finish: %+v", o)
	}
}

func TestSaveResultsCoverageAndFreeing(t *testing.T) {
	h := newHarness(t)
	h.alloc(0, table(0, 3), "")
	s1 := h.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 32, Table: table(0, 2)}).Saves[0]
	s2 := h.step(kvcore.Step{Kind: kvcore.StepRunning, Tokens: 48, Table: kvcore.BlockTable{{2}, {102}}}).Saves[0]
	want(t, h.kind(contract.EventFinished), [3]int{}, "finish with saves in flight (scenario 20)")
	o := h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferSave, TaskID: s1.TaskID, Status: "stored",
		Groups: []contract.GroupOutcome{{Group: 0, Stored: 2}, {Group: 1, Stored: 1}}})
	want(t, o, [3]int{}, "first save reported")
	o = h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferSave, TaskID: s2.TaskID, Status: "bogus",
		Groups: []contract.GroupOutcome{{Group: 0, Stored: 1}, {Group: 1, DeadLettered: 1, Reason: "block_out_of_range"}}})
	want(t, o, [3]int{0, 0, 1}, "last save reported")
	if f := o.Feedback[0]; f.Kind != kvcore.FeedbackFinishedSending || f.Immediate {
		t.Fatalf("feedback %+v", f)
	}
	if !errors.Is(o.Errors[0], kvcore.ErrUnknownSaveStatus) || h.r.Store.Reports.Failed != 1 {
		t.Fatalf("unknown status not counted as failed: %v %+v", o.Errors, h.r.Store.Reports)
	}
	c := h.r.Coverage
	if c[0].SavedTokens != 48 || c[1].SavedTokens != 32 || c[1].DeadLettered != 1 || c[1].LastReason != "block_out_of_range" {
		t.Fatalf("coverage %+v", c)
	}
	if o := h.r.Result(h.m, contract.TransferResult{Kind: contract.TransferSave, TaskID: s2.TaskID, Status: "stored"}); o.Ignored != "unknown_task" || len(o.Feedback) != 0 {
		t.Fatalf("repeated result %+v", o)
	}
}
