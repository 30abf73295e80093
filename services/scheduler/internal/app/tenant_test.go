package app_test

import (
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// TestTenantFlowsIntoTasks: the tenant of a request's admitted event is
// kept in its tracker (the row in PostgreSQL) and put on the load and on
// every save task the scheduler emits; a decision of another tenant is
// never loaded, and a bad tenant stops its request with request_error.
func TestTenantFlowsIntoTasks(t *testing.T) {
	h := newMesh(t, meshOptions{})
	t.Run("load_and_saves", func(t *testing.T) {
		h := h.on(t)
		r := h.request("tenant")
		r.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 64, BlockHashes: hashes(16), Tenant: "acme"})
		spec := kvcore.LoadSpec{KVPoolCachedTokens: 32}
		d := r.decision("d1", "store", 32, storeChild(32, &spec))
		d.Tenant = "acme"
		h.produce(contract.TopicLookupDecisions, keyed{r.id, d})
		r.allocate(32, table(0, 4), "d1")
		r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
		load := r.waitLoads(1)[0]
		if load.Tenant != "acme" {
			t.Fatalf("load tenant %q, want acme", load.Tenant)
		}
		if det := r.settled(); det.Tracker == nil || det.Tracker.Tenant != "acme" {
			t.Fatalf("stored tracker %+v: want tenant acme", det.Tracker)
		}
		r.result(contract.TransferResult{Kind: contract.TransferLoad, TaskID: load.TaskID, Status: "done"})
		// As an engine does: the step that computes the rest of the prompt
		// follows the load's finished_recving (results and steps are on
		// different topics, so producing both at once races).
		r.waitFeedback(kvcore.FeedbackFinishedRecving)
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 64, Table: table(0, 4)})
		saves := r.waitSaves(1)
		for _, s := range saves {
			if s.Tenant != "acme" {
				t.Fatalf("save %s tenant %q, want acme", s.TaskID, s.Tenant)
			}
		}
	})
	t.Run("decision_of_another_tenant", func(t *testing.T) {
		h := h.on(t)
		r := h.request("tenant-x")
		r.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(16), Tenant: "acme"})
		spec := kvcore.LoadSpec{KVPoolCachedTokens: 32}
		d := r.decision("d1", "store", 32, storeChild(32, &spec))
		d.Tenant = "other"
		h.produce(contract.TopicLookupDecisions, keyed{r.id, d})
		r.allocate(32, table(0, 3), "d1")
		f := r.waitFeedback(kvcore.FeedbackFinishedRecving)
		if len(f.LoadErrors) == 0 {
			t.Fatalf("finished_recving %+v: want every block in error", f)
		}
		r.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
		r.settled()
		if loads := r.loads(); len(loads) != 0 {
			t.Fatalf("loads %+v from another tenant's decision", loads)
		}
	})
	t.Run("bad_tenant", func(t *testing.T) {
		h := h.on(t)
		r := h.request("tenant-bad")
		r.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(16), Tenant: "no/such tenant"})
		f := r.waitFeedback(contract.FeedbackRequestError)
		if f.Error == "" {
			t.Fatalf("request_error %+v without a reason", f)
		}
		r.allocate(0, table(0, 3), "")
		r.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
		if d := r.settled(); d.Tracker.State != string(requeststate.StateErrored) || len(r.saves()) != 0 {
			t.Fatalf("state %s, %d saves; want errored, none", d.Tracker.State, len(r.saves()))
		}
	})
}
