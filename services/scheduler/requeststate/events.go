package requeststate

import (
	"fmt"
	"slices"
	"strconv"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Engine applies one engine event through the named method of its kind
// (Admit, Allocate, Step, Preempt, Finish). A request's events are
// numbered 1, 2, 3, … with no gap, and every one of those methods enforces
// it first (inOrder): an event whose seq is not above the last one applied
// is stale (a redelivery) and changes nothing; an event whose seq skips
// one (above last + 1; a request's first event must have seq 1) fails the
// request closed: an event that may have changed its block table is
// missing (seqGap). An errored request takes only its finish. An
// allocation with external tokens whose lookup decision has not arrived is
// held, with the events after it, until the decision comes; a finish is
// never held.
//
// model is the model the engine's step record names: an event of another
// model than m fails the request.
func (r *Request) Engine(m *kvcore.Model, model string, ev contract.RequestEvent) Outcome {
	switch ev.Kind {
	case contract.EventAdmitted:
		return r.Admit(m, model, ev)
	case contract.EventAllocated:
		return r.Allocate(m, model, ev)
	case contract.EventScheduled:
		return r.Step(m, model, ev)
	case contract.EventPreempted:
		return r.Preempt(m, model, ev)
	case contract.EventFinished:
		return r.Finish(m, model, ev)
	}
	return r.inOrderApply(m, model, ev, (*Request).dispatch)
}

// Admit applies an admitted event (Engine's rules): the request's hash
// chain, prompt length, token ids, LoRA adapter, role and tenant.
func (r *Request) Admit(m *kvcore.Model, model string, ev contract.RequestEvent) Outcome {
	return r.inOrderApply(m, model, ev, (*Request).applyAdmit)
}

// Allocate applies an allocated event (Engine's rules): the allocation is
// bound to its lookup decision, or held until the decision comes.
func (r *Request) Allocate(m *kvcore.Model, model string, ev contract.RequestEvent) Outcome {
	return r.inOrderApply(m, model, ev, (*Request).applyAllocate)
}

// Step applies a scheduled event, one engine step of the request
// (Engine's rules), to its trackers (Tracker.Step).
func (r *Request) Step(m *kvcore.Model, model string, ev contract.RequestEvent) Outcome {
	return r.inOrderApply(m, model, ev, (*Request).applyStep)
}

// Preempt applies a preempted event (Engine's rules): the allocation
// epoch advances and the tasks in flight become stale.
func (r *Request) Preempt(m *kvcore.Model, model string, ev contract.RequestEvent) Outcome {
	return r.inOrderApply(m, model, ev, (*Request).applyStep)
}

// Finish applies a finished event (Engine's rules): it frees the request
// now or once its saves are reported, even an errored one.
func (r *Request) Finish(m *kvcore.Model, model string, ev contract.RequestEvent) Outcome {
	return r.inOrderApply(m, model, ev, (*Request).applyFinish)
}

// inOrderApply applies ev to r with apply (a method expression, which
// binds nothing per call) when inOrder lets it through, and returns the
// outcome: the gate every engine event passes.
func (r *Request) inOrderApply(m *kvcore.Model, model string, ev contract.RequestEvent,
	apply func(*Request, *kvcore.Model, *Outcome, contract.RequestEvent)) Outcome {
	var out Outcome
	if r.inOrder(m, model, &out, ev) {
		apply(r, m, &out, ev)
	}
	return out
}

// inOrder reports whether ev is to be applied: its seq is the next one
// and it names the scheduler's model. A stale event changes nothing; a
// gap fails the request closed (seqGap); another model fails the request
// (a finish still frees it).
func (r *Request) inOrder(m *kvcore.Model, model string, out *Outcome, ev contract.RequestEvent) bool {
	if ev.Seq <= r.LastSeq {
		out.Stale = true
		out.Ignored = "stale"
		return false
	}
	expected := r.LastSeq + 1
	r.LastSeq = ev.Seq
	if ev.Seq != expected {
		r.seqGap(m, out, ev, expected)
		return false
	}
	if model != m.Name {
		r.fail(out, fmt.Errorf("event %d names model %q, this scheduler serves %q: %w", ev.Seq, model, m.Name, ErrWrongModel))
		if ev.Kind == contract.EventFinished {
			r.release(m, out, ev)
		}
		return false
	}
	return true
}

// seqGap fails the request closed for an event that skipped a seq: the
// request errors (request_error naming the expected and received seq), an
// allocation waiting for its decision and a load the allocation promised
// are answered with every block in error, the saves in flight stop holding
// finished_sending (kvcore.Tracker.FailClosed), and nothing more is emitted.
// The event itself is dropped, except a finish, which still frees the
// request. A request already errored or finished only records a warning.
func (r *Request) seqGap(m *kvcore.Model, out *Outcome, ev contract.RequestEvent, expected int64) {
	src := source(ev)
	err := fmt.Errorf("%s (%s): expected seq %d, received %d: %w", src, ev.Kind, expected, ev.Seq, ErrSeqGap)
	switch {
	case r.Store.Finished():
		r.warn(out, src, err)
		return
	case r.Store.State == StateErrored:
		r.warn(out, src, err)
	default:
		r.dropHeld(out)
		r.storeEffects(out, src, r.Store.FailClosed(err))
		if r.PD != nil {
			r.pdEffects(out, src, r.PD.FailClosed(err), true)
		}
	}
	if ev.Kind == contract.EventFinished {
		r.release(m, out, ev)
	}
}

// dropHeld discards a held allocation (and the events held behind it); the
// external tokens it promised are answered with every allocated block as a
// load error, so the engine recomputes instead of waiting for a load.
func (r *Request) dropHeld(out *Outcome) {
	if r.Held == nil {
		return
	}
	alloc := r.Held.Alloc
	r.Held = nil
	if alloc.ExternalTokens > 0 {
		out.Feedback = append(out.Feedback, feedback(kvcore.Feedback{
			Kind: kvcore.FeedbackFinishedRecving, EngineID: r.Store.EngineID, RequestID: r.Store.RequestID,
			LoadErrors: liveBlocks(alloc.BlockTable), Epoch: r.Store.Epoch,
		}))
	}
}

// source names an engine event in warnings.
func source(ev contract.RequestEvent) string { return "event " + strconv.FormatInt(ev.Seq, 10) }

// dispatch routes one in-order engine event by its kind (a held event
// replayed after its decision, or an event of no known kind, which is
// applied as a step).
func (r *Request) dispatch(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	switch ev.Kind {
	case contract.EventAdmitted:
		r.applyAdmit(m, out, ev)
	case contract.EventAllocated:
		r.applyAllocate(m, out, ev)
	case contract.EventFinished:
		r.applyFinish(m, out, ev)
	default:
		r.applyStep(m, out, ev)
	}
}

// applyAdmit admits the request, unless it errored.
func (r *Request) applyAdmit(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	if r.Store.State == StateErrored {
		out.Ignored = "errored"
		return
	}
	r.admit(m, out, ev)
}

// applyAllocate binds or holds the allocation, unless the request errored;
// behind a held allocation it is held too.
func (r *Request) applyAllocate(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	switch {
	case r.Store.State == StateErrored:
		out.Ignored = "errored"
	case r.Held != nil:
		r.hold(out, ev)
	default:
		r.allocate(m, out, ev)
	}
}

// applyStep drives the trackers with a step or a preemption, unless the
// request errored; behind a held allocation it is held.
func (r *Request) applyStep(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	switch {
	case r.Store.State == StateErrored:
		out.Ignored = "errored"
	case r.Held != nil:
		r.hold(out, ev)
	default:
		r.release(m, out, ev)
	}
}

// applyFinish frees the request; a finish is never held: an allocation
// still waiting for its decision is dropped with a warning.
func (r *Request) applyFinish(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	if r.Held != nil {
		r.warn(out, source(ev), fmt.Errorf("finished while its allocation waited for lookup decision %q", r.Held.Alloc.DecisionID))
		r.Held = nil
	}
	r.release(m, out, ev)
}

// admit records the hash chain, prompt length, token ids, LoRA adapter,
// role and tenant (the pd tracker only loads: it takes the chain and
// prompt length, never the tokens). A tenant
// that cannot be a key segment, or one that differs from the tenant the
// request was admitted with before, stops the request (request_error):
// none of its tasks may be keyed in a tenant it was not admitted with. So
// does an engine version other than the one the model pins
// (kvcore.Model.CheckEngineVersion): its blocks are not the pinned
// version's, whose keys every task would use.
func (r *Request) admit(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	if err := kvcore.ValidateTenant(ev.Tenant); err != nil {
		r.fail(out, fmt.Errorf("%s (admitted): %w", source(ev), err))
		return
	}
	if err := m.CheckEngineVersion(ev.EngineVersion); err != nil {
		r.fail(out, fmt.Errorf("%s (admitted): %w", source(ev), err))
		return
	}
	if (len(r.Store.Hashes) > 0 || r.Store.Tenant != "") && ev.Tenant != r.Store.Tenant {
		r.fail(out, fmt.Errorf("%s (admitted): tenant %q, the request was admitted with %q: %w", source(ev), ev.Tenant, r.Store.Tenant, ErrTenantChanged))
		return
	}
	r.Store.Tenant = ev.Tenant
	r.Store.OnAdmit(ev.BlockHashes, ev.PromptTokens)
	r.Store.OnAdmitTokens(m, ev.TokenIDs, ev.LoraName)
	if ev.Consumer {
		r.Store.Consumer = true
	}
	if r.PD != nil {
		r.PD.OnAdmit(ev.BlockHashes, ev.PromptTokens)
	}
}

// hold queues ev behind a held allocation.
func (r *Request) hold(out *Outcome, ev contract.RequestEvent) {
	out.Held = true
	if len(r.Held.Events) >= maxHeld {
		r.fail(out, fmt.Errorf("%s: %d events held for lookup decision %q: %w", source(ev), maxHeld, r.Held.Alloc.DecisionID, ErrHeldOverflow))
		r.Held = nil
		return
	}
	r.Held.Events = append(r.Held.Events, ev)
}

// release applies a step, a preemption or a finish to the trackers.
func (r *Request) release(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	var s kvcore.Step
	switch ev.Kind {
	case contract.EventScheduled:
		s = *ev.Step
	case contract.EventPreempted:
		s = kvcore.Step{Kind: kvcore.StepPreempted}
	case contract.EventFinished:
		s = kvcore.Step{Kind: kvcore.StepFinished}
	}
	r.step(m, out, source(ev), s)
}

// step drives both trackers with one step.
func (r *Request) step(m *kvcore.Model, out *Outcome, src string, s kvcore.Step) {
	effStore := r.Store.Step(m, s)
	r.storeEffects(out, src, effStore)
	if r.PD != nil {
		r.pdEffects(out, src, r.PD.Step(m, s), effStore.Err != nil)
	}
	switch s.Kind {
	case kvcore.StepPreempted:
		r.Awaiting = ""
	case kvcore.StepFinished:
		r.Awaiting = ""
		r.Decisions = nil
	}
}

// warn records a problem with source, keeping the latest maxWarnings.
func (r *Request) warn(out *Outcome, source string, err error) {
	out.Errors = append(out.Errors, err)
	r.Warnings = append(r.Warnings, Warning{Source: source, Error: err.Error()})
	if n := len(r.Warnings); n > maxWarnings {
		r.Warnings = append([]Warning(nil), r.Warnings[n-maxWarnings:]...)
	}
}

// fail stops the request with err (e.g. a wrong model) outside the tracker.
func (r *Request) fail(out *Outcome, err error) {
	if r.Store.State == StateErrored || r.Store.Finished() {
		out.Errors = append(out.Errors, err)
		return
	}
	r.Store.State = StateErrored
	r.Store.Error = err.Error()
	out.Errors = append(out.Errors, err)
	r.erroredFeedback(out)
}

// erroredFeedback tells the engine the request stopped, and why.
func (r *Request) erroredFeedback(out *Outcome) {
	out.Errored = true
	out.Feedback = append(out.Feedback, contract.EngineFeedback{
		Schema: contract.SchemaEngineFeedback,
		Feedback: kvcore.Feedback{
			Kind: contract.FeedbackRequestError, EngineID: r.Store.EngineID, RequestID: r.Store.RequestID,
		},
		Error: r.Store.Error,
	})
}

// feedback wraps a tracker's feedback for the engine.
func feedback(f kvcore.Feedback) contract.EngineFeedback {
	return contract.EngineFeedback{Schema: contract.SchemaEngineFeedback, Feedback: f}
}

// storeEffects collects the store tracker's effects of one call; the call
// that errored the request (eff.Failed) stops it with request_error.
func (r *Request) storeEffects(out *Outcome, source string, eff Effects) {
	r.taskEffects(out, eff)
	for _, f := range eff.Feedback {
		out.Feedback = append(out.Feedback, feedback(f))
	}
	if eff.Failed {
		out.Errors = append(out.Errors, eff.Err)
		r.erroredFeedback(out)
		return
	}
	if eff.Err != nil {
		r.warn(out, source, eff.Err)
	}
}

// pdEffects collects the pd tracker's effects: its loads and
// finished_recving, never its finished_sending (the pd child never saves;
// the store child decides when the blocks are freed).
func (r *Request) pdEffects(out *Outcome, source string, eff Effects, quiet bool) {
	r.taskEffects(out, eff)
	for _, f := range eff.Feedback {
		if f.Kind != kvcore.FeedbackFinishedSending {
			out.Feedback = append(out.Feedback, feedback(f))
		}
	}
	if eff.Err != nil && !quiet {
		r.warn(out, source, fmt.Errorf("pd: %w", eff.Err))
	}
}

// taskEffects records the emitted tasks as outstanding.
func (r *Request) taskEffects(out *Outcome, eff Effects) {
	for _, s := range eff.Saves {
		r.Tasks = append(r.Tasks, TaskRef{ID: s.TaskID, Kind: "save", Start: s.Start, End: s.End, Epoch: s.Epoch})
	}
	for _, l := range eff.Loads {
		r.Tasks = append(r.Tasks, TaskRef{ID: l.TaskID, Kind: "load", Connector: l.Connector, Start: l.Start, End: l.End, Epoch: l.Epoch})
	}
	out.Saves = append(out.Saves, eff.Saves...)
	out.Loads = append(out.Loads, eff.Loads...)
}

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

// allocate binds the allocation to its lookup decision and applies both,
// or holds it when the decision is missing and external tokens are
// promised (which child they belong to is not known yet).
func (r *Request) allocate(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	d := r.bind(ev.DecisionID)
	if d == nil && ev.ExternalTokens > 0 {
		r.Held = &Held{Alloc: ev}
		out.Held = true
		return
	}
	r.attempt(m, out, d, ev)
}

// bind takes the allocation's decision out of the unbound ones: the one
// named id, or the newest when id is empty. Older decisions are dropped:
// they belong to attempts the engine has moved past.
func (r *Request) bind(id string) *contract.LookupDecision {
	i := len(r.Decisions) - 1
	if id != "" {
		i = slices.IndexFunc(r.Decisions, func(d contract.LookupDecision) bool { return d.DecisionID == id })
	}
	if i < 0 {
		return nil
	}
	d := r.Decisions[i]
	r.Decisions = append([]contract.LookupDecision(nil), r.Decisions[i+1:]...)
	return &d
}

// Decision applies one lookup decision: it completes a held allocation
// waiting for it (and replays the events held behind it), records the
// LoadSpec of an allocation applied without it, or is kept until its
// allocation arrives. A pending ("not yet") decision changes nothing.
func (r *Request) Decision(m *kvcore.Model, d contract.LookupDecision) Outcome {
	var out Outcome
	switch {
	case d.Pending:
		out.Ignored = "pending"
	case d.Model != m.Name:
		out.Ignored = "wrong_model"
		r.warn(&out, "decision "+d.DecisionID, fmt.Errorf("decision names model %q, this scheduler serves %q: %w", d.Model, m.Name, ErrWrongModel))
	case r.Store.Finished():
		out.Ignored = "finished"
	case r.Store.State == StateErrored:
		out.Ignored = "errored"
	case r.Held != nil && (r.Held.Alloc.DecisionID == "" || r.Held.Alloc.DecisionID == d.DecisionID):
		held := r.Held
		r.Held = nil
		r.attempt(m, &out, &d, held.Alloc)
		for _, ev := range held.Events {
			r.dispatch(m, &out, ev)
		}
	case r.Awaiting != "" && r.Awaiting == d.DecisionID:
		r.Awaiting = ""
		r.storeEffects(&out, "decision "+d.DecisionID, r.Store.OnLookup(m, childSpec(&d, ConnectorStore)))
	default:
		r.Decisions = append(r.Decisions, d)
		if n := len(r.Decisions); n > maxDecisions {
			r.Decisions = append([]contract.LookupDecision(nil), r.Decisions[n-maxDecisions:]...)
		}
	}
	return out
}

// OnLookup records the store connector's lookup decision: its LoadSpec, or
// nil when the lookup kept none. CanLoad is only ever set by allocation. A
// lookup after a settled allocation starts a new scheduling attempt; one
// that arrives after its own allocation settles it.
func (t *Tracker) OnLookup(m *kvcore.Model, spec *kvcore.LoadSpec) Effects {
	var eff Effects
	if err := t.checkModel(m); err != nil {
		eff.Err = err
		return eff
	}
	if t.Finished() || t.State == StateErrored {
		return t.settle(&eff)
	}
	if !t.Load.Allocated || t.Load.Resolved {
		t.Load = LoadState{}
	}
	t.Load.LookedUp = true
	t.Load.Spec = nil
	if spec != nil {
		c := *spec
		c.CanLoad = false
		t.Load.Spec = &c
	}
	t.resolve(m, &eff)
	return t.settle(&eff)
}

// OnAllocate records the allocation (vLLM's update_state_after_alloc):
// externalTokens > 0 with a LoadSpec accepts the load (CanLoad = true; the
// count must equal hit − num_computed); 0 rejects it (CanLoad = false, and
// the table is not kept: a rejected load emits nothing). table is the
// request's block table after allocation.
func (t *Tracker) OnAllocate(m *kvcore.Model, externalTokens int, table kvcore.BlockTable) Effects {
	var eff Effects
	if err := t.checkModel(m); err != nil {
		eff.Err = err
		return eff
	}
	if t.Finished() || t.State == StateErrored {
		return t.settle(&eff)
	}
	switch {
	case externalTokens < 0:
		eff.Err = fmt.Errorf("request %s/%s: allocation of %d external tokens: %w", t.EngineID, t.RequestID, externalTokens, kvcore.ErrNegativeCount)
	case t.Load.Allocated:
		eff.Err = fmt.Errorf("request %s/%s: %w", t.EngineID, t.RequestID, kvcore.ErrAllocatedTwice)
	default:
		t.Load.Allocated = true
		t.Load.External = externalTokens
		if externalTokens > 0 {
			t.Load.Table = table.Clone()
		}
		t.resolve(m, &eff)
	}
	return t.settle(&eff)
}

// resolve matches lookup and allocation once both are known, settling
// Spec.CanLoad, and issues the accepted load if the request already waits
// for it.
func (t *Tracker) resolve(m *kvcore.Model, eff *Effects) {
	l := &t.Load
	if !l.LookedUp || !l.Allocated || l.Resolved {
		return
	}
	l.Resolved = true
	if l.External == 0 {
		if l.Spec != nil {
			l.Spec.CanLoad = false
		}
		l.Table = nil
		return
	}
	if err := t.checkExternal(); err != nil {
		t.abandonLoad(eff, nil)
		eff.Err = fmt.Errorf("request %s/%s: %w", t.EngineID, t.RequestID, err)
		return
	}
	if t.State != StateRunning {
		if err := checkGroups(m, l.Table, "allocation block table"); err != nil {
			t.fail(eff, err, nil)
			return
		}
	}
	l.Spec.CanLoad = true
	switch {
	case t.State == StateRunning:
		t.emitLoad(m, t.Table, eff)
	case l.PendingSeen:
		t.emitLoad(m, l.Table, eff)
	}
}

// checkExternal checks an accepting allocation against the LoadSpec.
func (t *Tracker) checkExternal() error {
	l := &t.Load
	if l.Spec == nil {
		return fmt.Errorf("%d external tokens without a load spec: %w", l.External, kvcore.ErrExternalTokens)
	}
	if need := l.Spec.KVPoolCachedTokens - l.Spec.VLLMCachedTokens; l.External != need {
		return fmt.Errorf("%d external tokens, load spec needs %d (hit %d - cached %d): %w",
			l.External, need, l.Spec.KVPoolCachedTokens, l.Spec.VLLMCachedTokens, kvcore.ErrExternalTokens)
	}
	return nil
}

// OnAdmit records what the engine tells at admission: the request's hash
// chain so far and its prompt length (0 if unknown).
func (t *Tracker) OnAdmit(hashes []string, promptTokens int) {
	t.extendHashes(hashes)
	if promptTokens > 0 {
		t.PrefillEnd = promptTokens
		t.PromptTokens = promptTokens
	}
}

// OnAdmitTokens records the prompt's token ids and LoRA adapter the engine
// admitted the request with (RequestEvent.TokenIDs, LoraName), which every
// save task carries for the KV events routers index; of a longer list it
// keeps the first MaxTokenIDs (TokenPrefix). Like the hash chain, the
// token list only grows: the tokens already held are never rewritten, so
// the ledger stores them once; a longer list appends its new tokens. An
// empty lora keeps the adapter recorded before.
func (t *Tracker) OnAdmitTokens(m *kvcore.Model, tokens []uint32, lora string) {
	tokens = kvcore.TokenPrefix(m.HashBlockSize, tokens)
	if len(tokens) > len(t.TokenIDs) {
		t.TokenIDs = append(t.TokenIDs, tokens[len(t.TokenIDs):]...)
	}
	if lora != "" {
		t.LoraName = lora
	}
}
