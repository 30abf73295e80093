package requeststate

import (
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Event is one decoded record's change to one request: an EngineEvent, a
// DecisionEvent, a ResultEvent or an ExpiryEvent (the set is closed).
// Request.Apply applies it.
type Event interface {
	// event marks the event types.
	event()
}

// EngineEvent is one request event of an engine step record
// (kvmesh.engine.steps), applied by Request.Engine.
type EngineEvent struct {
	// Model is the model the step record names.
	Model string
	// Event is the request's event (admitted, allocated, scheduled,
	// preempted or finished) with its seq.
	Event contract.RequestEvent
}

// DecisionEvent is a lookup decision (kvmesh.lookup.decisions), applied by
// Request.Decision.
type DecisionEvent struct {
	// Decision is the lookup's decision.
	Decision contract.LookupDecision
}

// ResultEvent is a transfer result (kvmesh.transfer.results), applied by
// Request.Result.
type ResultEvent struct {
	// Result is the sender's or a gpuworker's report of one task.
	Result contract.TransferResult
}

// ExpiryEvent gives up on the silent ranks of overdue multi-rank loads,
// applied by Request.ExpireLoads.
type ExpiryEvent struct {
	// Now is the caller's clock.
	Now time.Time
	// TaskIDs are the loads found overdue.
	TaskIDs []string
}

func (EngineEvent) event()   {}
func (DecisionEvent) event() {}
func (ResultEvent) event()   {}
func (ExpiryEvent) event()   {}

// Apply applies one event to the request of model m and returns what the
// caller must publish: the one entry the ledger calls for every record.
// Each kind goes to its named method (Engine, Decision, Result,
// ExpireLoads), which holds that kind's rules.
func (r *Request) Apply(m *kvcore.Model, ev Event) Outcome {
	switch e := ev.(type) {
	case EngineEvent:
		return r.Engine(m, e.Model, e.Event)
	case DecisionEvent:
		return r.Decision(m, e.Decision)
	case ResultEvent:
		return r.Result(m, e.Result)
	case ExpiryEvent:
		return r.ExpireLoads(e.Now, e.TaskIDs)
	}
	return Outcome{Ignored: "no_event"}
}

// ModelOf names the model ev is about, when it names one: an engine
// event's step record's, a lookup decision's; "" for the others.
func ModelOf(ev Event) string {
	switch e := ev.(type) {
	case EngineEvent:
		return e.Model
	case DecisionEvent:
		return e.Decision.Model
	}
	return ""
}

// Fresh reports whether the request has taken no event that shaped it:
// no engine event, no lookup decision, no task. Only a fresh request may
// be laid out again for another model (Relayout).
func (r *Request) Fresh() bool {
	return r.LastSeq == 0 && len(r.Decisions) == 0 && len(r.Tasks) == 0 && r.PD == nil && r.Held == nil &&
		r.Store.State == StateWaiting && len(r.Store.Hashes) == 0
}

// Relayout lays a fresh request out for model m (its tracker of m, its
// coverage of m's groups), keeping its ids, trace context and warnings: a
// mesh serving many models creates a request's row before its first
// event says which model it is of. It reports whether r was fresh.
func (r *Request) Relayout(m *kvcore.Model) bool {
	if !r.Fresh() {
		return false
	}
	n := New(m, r.Store.EngineID, r.Store.RequestID)
	n.Traceparent, n.Warnings = r.Traceparent, r.Warnings
	*r = *n
	return true
}
