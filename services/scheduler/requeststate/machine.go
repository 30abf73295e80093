package requeststate

import (
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Event is one decoded record's change to one request: an EngineEvent, a
// DecisionEvent, a ResultEvent or an ExpiryEvent. Request.Apply applies
// it; the set is closed (the method is unexported).
type Event interface {
	// applyTo applies the event to r through r's named method.
	applyTo(r *Request, m *kvcore.Model) Outcome
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

func (e EngineEvent) applyTo(r *Request, m *kvcore.Model) Outcome {
	return r.Engine(m, e.Model, e.Event)
}

func (e DecisionEvent) applyTo(r *Request, m *kvcore.Model) Outcome {
	return r.Decision(m, e.Decision)
}

func (e ResultEvent) applyTo(r *Request, m *kvcore.Model) Outcome { return r.Result(m, e.Result) }

func (e ExpiryEvent) applyTo(r *Request, m *kvcore.Model) Outcome {
	return r.ExpireLoads(e.Now, e.TaskIDs)
}

// Apply applies one event to the request of model m and returns what the
// caller must publish: the one entry the ledger calls for every record.
// Each kind goes to its named method (Engine, Decision, Result,
// ExpireLoads), which holds that kind's rules; a nil event changes
// nothing.
func (r *Request) Apply(m *kvcore.Model, ev Event) Outcome {
	if ev == nil {
		return Outcome{Ignored: "no_event"}
	}
	return ev.applyTo(r, m)
}
