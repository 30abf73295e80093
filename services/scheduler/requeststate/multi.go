package requeststate

import (
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// attempt applies one scheduling attempt: a lookup decision (nil when the
// allocation promised no external tokens and its decision is not here)
// with its allocation. As MultiConnector does, the chosen child receives
// the allocation's external tokens and every other child 0: when pd is
// chosen, the store tracker's LoadSpec ends with can_load = false and emits
// nothing for it (scenarios 9 and 21), and the pd tracker issues the load
// from the prefill engine.
//
// A decision of another tenant than the request's checked keys the request
// may not load: its store answer is dropped (warned as ErrTenantMismatch),
// so external tokens it promised are answered with every block in error.
func (r *Request) attempt(m *kvcore.Model, out *Outcome, d *contract.LookupDecision, alloc contract.RequestEvent) {
	src := source(alloc)
	d = r.ownTenant(out, src, d)
	chosen := chosenChild(d)
	if d == nil {
		r.Awaiting = alloc.DecisionID
		r.storeEffects(out, src, r.Store.OnAllocate(m, 0, alloc.BlockTable))
	} else {
		r.Awaiting = ""
		count := 0
		if chosen == ConnectorStore {
			count = alloc.ExternalTokens
		}
		r.storeEffects(out, src, r.Store.OnLookup(m, childSpec(d, ConnectorStore)))
		r.storeEffects(out, src, r.Store.OnAllocate(m, count, alloc.BlockTable))
	}
	served := r.allocatePD(m, out, src, d, chosen, alloc)
	if alloc.ExternalTokens > 0 && chosen != ConnectorStore && !served && !r.Store.Finished() {
		r.abandon(out, src, chosen, alloc)
	}
}

// chosenRefused stands for the chosen child of a decision whose choice
// was refused (ownTenant): no child of the scheduler serves it.
const chosenRefused = "refused"

// ownTenant returns d, or, when d names another tenant than the request's,
// a copy without the store child's answer: the store child then counts as
// not chosen.
func (r *Request) ownTenant(out *Outcome, src string, d *contract.LookupDecision) *contract.LookupDecision {
	if d == nil || d.Tenant == r.Store.Tenant {
		return d
	}
	r.warn(out, src, fmt.Errorf("decision %s is of tenant %q, the request's is %q: %w", d.DecisionID, d.Tenant, r.Store.Tenant, ErrTenantMismatch))
	cp := *d
	cp.Children = nil
	for _, c := range d.Children {
		if c.Name != ConnectorStore {
			cp.Children = append(cp.Children, c)
		}
	}
	if cp.Chosen == ConnectorStore {
		cp.Chosen = chosenRefused
	}
	return &cp
}

// allocatePD drives the pd tracker with the attempt, creating it the first
// time pd is chosen, and reports whether pd serves the external tokens.
func (r *Request) allocatePD(m *kvcore.Model, out *Outcome, src string, d *contract.LookupDecision, chosen string, alloc contract.RequestEvent) bool {
	serve := chosen == ConnectorPD && d != nil && d.PD != nil && alloc.ExternalTokens > 0
	if !serve && r.PD == nil {
		return false
	}
	if r.PD == nil {
		r.PD = newPD(m, r.Store)
	}
	count := 0
	var spec *kvcore.LoadSpec
	if serve {
		count = alloc.ExternalTokens
		r.PD.Remote = &kvcore.RemoteSource{EngineID: d.PD.EngineID, BlockTable: d.PD.BlockTable.Clone()}
		spec = pdSpec(d, count)
	}
	r.pdEffects(out, src, r.PD.OnLookup(m, spec), false)
	r.pdEffects(out, src, r.PD.OnAllocate(m, count, alloc.BlockTable), false)
	return serve
}

// newPD starts the pd child's tracker: it loads only (the consumer role
// never saves) and shares the store tracker's hash chain.
func newPD(m *kvcore.Model, store *Tracker) *Tracker {
	pd := NewTracker(m, store.EngineID, store.RequestID)
	pd.Connector = ConnectorPD
	pd.Consumer = true
	pd.Tenant = store.Tenant
	pd.OnAdmit(store.Hashes, store.PrefillEnd)
	return pd
}

// abandon answers external tokens nobody can load: the engine gets
// finished_recving with every allocated block as a load error, so it
// recomputes instead of waiting for a load that never comes.
func (r *Request) abandon(out *Outcome, src, chosen string, alloc contract.RequestEvent) {
	err := fmt.Errorf("%d external tokens from connector %q: %w", alloc.ExternalTokens, chosen, ErrUnservedConnector)
	if chosen == ConnectorPD {
		err = fmt.Errorf("%d external tokens from connector pd without a pd_source: %w", alloc.ExternalTokens, ErrUnservedConnector)
	}
	r.warn(out, src, err)
	out.Feedback = append(out.Feedback, feedback(kvcore.Feedback{
		Kind: kvcore.FeedbackFinishedRecving, EngineID: r.Store.EngineID, RequestID: r.Store.RequestID,
		LoadErrors: liveBlocks(alloc.BlockTable), Epoch: r.Store.Epoch,
	}))
}

// chosenChild names the decision's chosen child; a decision that names
// none is resolved as MultiConnector does (first child with a count).
func chosenChild(d *contract.LookupDecision) string {
	if d == nil {
		return ""
	}
	if d.Chosen != "" {
		return d.Chosen
	}
	answers := make([]kvcore.ChildAnswer, len(d.Children))
	for i, c := range d.Children {
		answers[i] = kvcore.ChildAnswer{Name: c.Name, Tokens: c.Tokens, Pending: c.Pending}
	}
	return kvcore.SelectChild(answers).Name(answers)
}

// childSpec returns a copy of the named child's LoadSpec, or nil.
func childSpec(d *contract.LookupDecision, name string) *kvcore.LoadSpec {
	for _, c := range d.Children {
		if c.Name == name && c.Spec != nil {
			s := *c.Spec
			return &s
		}
	}
	return nil
}

// pdSpec is the pd child's LoadSpec, derived from the decision when the
// lookup kept none: the engine has num_computed tokens and pd supplies the
// external ones after them.
func pdSpec(d *contract.LookupDecision, external int) *kvcore.LoadSpec {
	if s := childSpec(d, ConnectorPD); s != nil {
		return s
	}
	return &kvcore.LoadSpec{VLLMCachedTokens: d.NumComputedTokens, KVPoolCachedTokens: d.NumComputedTokens + external}
}

// liveBlocks lists the non-null block ids of a table, group by group.
func liveBlocks(table kvcore.BlockTable) []kvcore.BlockID {
	out := []kvcore.BlockID{}
	for _, g := range table {
		for _, b := range g {
			if b != kvcore.NullBlock {
				out = append(out, b)
			}
		}
	}
	return out
}
