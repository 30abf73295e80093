package requeststate

import (
	"errors"
	"testing"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// newTenantHarness drives one request of the hybrid preset admitted with
// tenant.
func newTenantHarness(t *testing.T, tenant string) (*harness, Outcome) {
	t.Helper()
	m, err := kvcore.Preset("hybrid-mla-linear")
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, m: m, r: New(m, "e1", "r1")}
	o := h.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(8), Tenant: tenant})
	return h, o
}

// TestTenantFlowsToTasks: the tenant of the admitted event is kept by the
// tracker and put on the load and every save the request emits.
func TestTenantFlowsToTasks(t *testing.T) {
	h, o := newTenantHarness(t, "acme")
	if o.Errored || h.r.Store.Tenant != "acme" {
		t.Fatalf("admission: %+v, tracker tenant %q", o, h.r.Store.Tenant)
	}
	d := decision("d1", ConnectorStore, 32, 0)
	d.Tenant = "acme"
	want(t, h.r.Decision(h.m, d), [3]int{}, "decision")
	want(t, h.alloc(32, table(0, 3), "d1"), [3]int{}, "allocation")
	o = h.step(kvcore.Step{Kind: kvcore.StepPendingLoad})
	want(t, o, [3]int{0, 1, 0}, "pending step")
	if o.Loads[0].Tenant != "acme" {
		t.Fatalf("load tenant %q, want acme", o.Loads[0].Tenant)
	}
	res := contract.TransferResult{Schema: contract.SchemaTransferResult, ResultID: "x", Kind: contract.TransferLoad,
		TaskID: o.Loads[0].TaskID, EngineID: "e1", RequestID: "r1", Status: "done"}
	h.r.Result(h.m, res)
	o = h.step(kvcore.Step{Kind: kvcore.StepNew, Tokens: 48, Table: table(0, 3)})
	if len(o.Saves) == 0 {
		t.Fatalf("no save after the load: %+v", o)
	}
	for _, s := range o.Saves {
		if s.Tenant != "acme" {
			t.Fatalf("save %s tenant %q, want acme", s.TaskID, s.Tenant)
		}
	}
}

func TestBadTenantStopsTheRequest(t *testing.T) {
	h, o := newTenantHarness(t, "not a tenant")
	if !o.Errored || h.r.State() != StateErrored || len(o.Errors) == 0 || !errors.Is(o.Errors[0], kvcore.ErrBadTenant) {
		t.Fatalf("bad tenant: %+v, state %s", o, h.r.State())
	}
	if o.Feedback[0].Kind != contract.FeedbackRequestError {
		t.Fatalf("feedback %+v, want request_error", o.Feedback)
	}
}

func TestTenantChangeStopsTheRequest(t *testing.T) {
	h, _ := newTenantHarness(t, "acme")
	o := h.event(contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: 48, BlockHashes: hashes(8), Tenant: "other"})
	if !o.Errored || len(o.Errors) == 0 || !errors.Is(o.Errors[0], ErrTenantChanged) {
		t.Fatalf("changed tenant: %+v", o)
	}
}

// TestDecisionOfAnotherTenantIsNotLoaded: a store answer for another
// tenant's keys is never loaded; the external tokens it promised are
// answered with every block in error.
func TestDecisionOfAnotherTenantIsNotLoaded(t *testing.T) {
	h, _ := newTenantHarness(t, "acme")
	d := decision("d1", ConnectorStore, 32, 0)
	d.Tenant = "other"
	h.r.Decision(h.m, d)
	o := h.alloc(32, table(0, 3), "d1")
	if len(o.Loads) != 0 || len(o.Feedback) != 1 || o.Feedback[0].Kind != kvcore.FeedbackFinishedRecving || len(o.Feedback[0].LoadErrors) == 0 {
		t.Fatalf("decision of another tenant: %+v", o)
	}
	found := false
	for _, err := range o.Errors {
		found = found || errors.Is(err, ErrTenantMismatch)
	}
	if !found {
		t.Fatalf("errors %v, want ErrTenantMismatch", o.Errors)
	}
	if o := h.step(kvcore.Step{Kind: kvcore.StepPendingLoad}); len(o.Loads) != 0 {
		t.Fatalf("a load of another tenant's keys: %+v", o.Loads)
	}
}
