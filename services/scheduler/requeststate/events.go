package requeststate

import (
	"fmt"
	"slices"
	"strconv"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Engine applies one engine event. A request's events are numbered 1, 2,
// 3, … with no gap. An event whose seq is not above the last one applied is
// stale (a redelivery) and changes nothing. An event whose seq skips one
// (above last + 1; a request's first event must have seq 1) fails the
// request closed: an event that may have changed its block table is
// missing (seqGap). An errored request takes only its finish. An allocation
// with external tokens whose lookup decision has not arrived is held, with
// the events after it, until the decision comes; a finish is never held.
//
// model is the model the engine's step record names: an event of another
// model than m fails the request.
func (r *Request) Engine(m *kvcore.Model, model string, ev contract.RequestEvent) Outcome {
	var out Outcome
	if ev.Seq <= r.LastSeq {
		out.Stale = true
		out.Ignored = "stale"
		return out
	}
	expected := r.LastSeq + 1
	r.LastSeq = ev.Seq
	if ev.Seq != expected {
		r.seqGap(m, &out, ev, expected)
		return out
	}
	if model != m.Name {
		r.fail(&out, fmt.Errorf("event %d names model %q, this scheduler serves %q: %w", ev.Seq, model, m.Name, ErrWrongModel))
		if ev.Kind == contract.EventFinished {
			r.release(m, &out, ev)
		}
		return out
	}
	r.dispatch(m, &out, ev)
	return out
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

// dispatch routes one in-order engine event.
func (r *Request) dispatch(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	switch {
	case r.Store.State == StateErrored && ev.Kind != contract.EventFinished:
		out.Ignored = "errored"
	case ev.Kind == contract.EventAdmitted:
		r.admit(m, out, ev)
	case r.Held != nil && ev.Kind == contract.EventFinished:
		r.warn(out, source(ev), fmt.Errorf("finished while its allocation waited for lookup decision %q", r.Held.Alloc.DecisionID))
		r.Held = nil
		r.release(m, out, ev)
	case r.Held != nil:
		r.hold(out, ev)
	case ev.Kind == contract.EventAllocated:
		r.allocate(m, out, ev)
	default:
		r.release(m, out, ev)
	}
}

// admit records the hash chain, prompt length, token ids, LoRA adapter,
// role and tenant (the pd tracker only loads: it takes the chain and
// prompt length, never the tokens). A tenant
// that cannot be a key segment, or one that differs from the tenant the
// request was admitted with before, stops the request (request_error):
// none of its tasks may be keyed in a tenant it was not admitted with.
func (r *Request) admit(m *kvcore.Model, out *Outcome, ev contract.RequestEvent) {
	if err := kvcore.ValidateTenant(ev.Tenant); err != nil {
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
