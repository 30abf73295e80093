// Package requeststate is the scheduler's request state machine, in one
// place: a Request per request (engine id, request id), driven by typed
// events (Request.Apply, or the named methods Admit, Allocate, Step,
// Preempt, Finish, Decision, Result, ExpireLoads) that enforce the
// engine-event sequence and the allocation epochs; the store connector's
// tracker core it drives (Tracker: saves, loads, re-saves, preemption),
// with what the MultiConnector level needs beside it — lookup decisions
// waiting to be bound to an allocation, engine events held until that
// decision arrives, the pd child's tracker, outstanding task ranges,
// per-group saved coverage and warnings; and its stored form (stored.go),
// separate from the admin API's (pkg/adminapi). It is pure: no I/O, no
// clock, no goroutines. docs/state_machine.md draws it.
package requeststate

import (
	"errors"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Connector names the scheduler serves as MultiConnector children.
const (
	// ConnectorStore is the store-pool connector: it loads and saves.
	ConnectorStore = DefaultTrackerConnector
	// ConnectorPD is the disaggregated-prefill connector: it only loads,
	// from the prefill engine's pool.
	ConnectorPD = "pd"
)

// Bounds on the lists a request keeps, so a misbehaving producer cannot
// grow a row without limit.
const (
	maxDecisions = 4
	maxHeld      = 64
	maxWarnings  = 16
)

// Sentinel errors of the request state machine.
var (
	// ErrUnservedConnector: an allocation promised external tokens to a
	// connector the scheduler cannot load from.
	ErrUnservedConnector = errors.New("external tokens promised by a connector the scheduler does not serve")
	// ErrWrongModel: an event names another model than the scheduler's.
	ErrWrongModel = errors.New("model not served by this scheduler")
	// ErrHeldOverflow: too many events arrived while an allocation waited
	// for its lookup decision.
	ErrHeldOverflow = errors.New("too many events held for a lookup decision")
	// ErrSeqGap: a request's engine event skipped a seq; the missing event
	// may have changed the request's block table, so nothing more is saved.
	ErrSeqGap = errors.New("engine event sequence gap: an event of the request is missing")
	// ErrUnknownRank: a load result of a multi-rank load names no rank, or
	// a rank the engine does not have.
	ErrUnknownRank = errors.New("load result from a rank the load does not wait for")
	// ErrLoadRanksMissing: some ranks of a multi-rank load did not report
	// before its deadline; the load was finished with every block in error.
	ErrLoadRanksMissing = errors.New("load ranks did not report before the deadline")
	// ErrTenantChanged: a request was admitted again with another tenant.
	ErrTenantChanged = errors.New("request admitted with another tenant")
	// ErrTenantMismatch: a lookup decision checked another tenant's keys
	// than the request's; its store answer is not used.
	ErrTenantMismatch = errors.New("lookup decision of another tenant")
)

// Reasons a load result changed nothing (Outcome.Ignored), beside
// "unknown_task" and "unknown_kind".
const (
	// IgnoredRepeatRank: the rank already reported this load (a
	// redelivered or repeated result).
	IgnoredRepeatRank = "repeat_rank"
	// IgnoredUnknownRank: the result names no rank, or one the engine
	// does not have, for a load that waits for its ranks' results.
	IgnoredUnknownRank = "unknown_rank"
)

// Request is the scheduler's state of one request.
type Request struct {
	// Store is the store connector's tracker (persisted on its own).
	Store *Tracker `json:"-"`
	// LastSeq is the highest engine-event sequence number applied.
	LastSeq int64 `json:"-"`
	// Extras is the state around the tracker (persisted on its own).
	Extras
}

// Extras is the service-level state kept beside the store tracker.
type Extras struct {
	// PD is the pd child's tracker, created the first time pd is chosen.
	PD *Tracker
	// Decisions are lookup decisions not bound to an allocation yet,
	// oldest first.
	Decisions []contract.LookupDecision
	// Held is an allocation waiting for its lookup decision, with the
	// engine events that came after it.
	Held *Held
	// Awaiting is the id of the decision of an allocation applied without
	// it (0 external tokens); when it arrives its LoadSpec is recorded.
	Awaiting string
	// Tasks are the emitted tasks not reported yet.
	Tasks []TaskRef
	// Coverage is the saved coverage of each group, as the sender reported it.
	Coverage []GroupCoverage
	// Warnings are the latest problems that did not stop the request.
	Warnings []Warning
	// Traceparent is the W3C trace context of the request's trace, taken
	// from the first record about the request that carried one: the
	// scheduler continues that trace for the request's records that carry
	// none (an engine that does not trace its requests, a load expiry).
	Traceparent string
}

// The shapes the scheduler keeps with a request's tracker (its extras).
// They are its own: the admin API shows them as pkg/adminapi's types of the
// same fields, converted at the API's edge (services/scheduler/internal/api),
// so a change here is no wire change and a wire change no schema change.

// Held is an allocation whose lookup decision has not arrived, and the
// engine events received after it, in order.
type Held struct {
	// Alloc is the allocated event.
	Alloc contract.RequestEvent `json:"allocation"`
	// Events are the later events, applied once the decision arrives.
	Events []contract.RequestEvent `json:"events,omitempty"`
}

// TaskRef is one emitted task awaiting its result.
type TaskRef struct {
	// ID is the task id.
	ID string `json:"task_id"`
	// Kind is "save" or "load".
	Kind string `json:"kind"`
	// Connector is the loading connector (loads only).
	Connector string `json:"connector,omitempty"`
	// Start and End are the task's token range.
	Start int `json:"start"`
	End   int `json:"end"`
	// Epoch is the allocation epoch the task was emitted in (absent: 0).
	Epoch int `json:"epoch,omitempty"`
}

// GroupCoverage is what the sender reported for one KV group.
type GroupCoverage struct {
	// Group is the group index.
	Group int `json:"group"`
	// SavedTokens is the prefix [0, SavedTokens) reported stored (or
	// already present) for this group.
	SavedTokens int `json:"saved_tokens"`
	// Stored, Existing, Skipped, DeadLettered and Failed count blocks.
	Stored       int `json:"stored"`
	Existing     int `json:"existing"`
	Skipped      int `json:"skipped"`
	DeadLettered int `json:"dead_lettered"`
	Failed       int `json:"failed"`
	// LastReason is the last reason code reported for the group.
	LastReason string `json:"last_reason,omitempty"`
}

// Warning is a problem with one record that did not stop the request.
type Warning struct {
	// Source names the record: "event 7", "decision d1", "result r1".
	Source string `json:"source"`
	// Error is the problem.
	Error string `json:"error"`
}

// Outcome is what applying one record asks the caller to do.
type Outcome struct {
	// Saves, Loads and Feedback are to be published.
	Saves    []kvcore.SaveTask
	Loads    []kvcore.LoadTask
	Feedback []contract.EngineFeedback
	// Errors are the problems the record caused (also kept as warnings or
	// as the request's error).
	Errors []error
	// Errored is set when this record stopped the request.
	Errored bool
	// Stale is set for an engine event whose seq was already applied.
	Stale bool
	// Held is set when the record was held for a lookup decision.
	Held bool
	// Ignored says why a record changed nothing ("" when it did).
	Ignored string
	// Expired are the multi-rank loads ExpireLoads gave up on.
	Expired []ExpiredLoad
}

// New starts the state of a request of model m.
func New(m *kvcore.Model, engineID, requestID string) *Request {
	r := &Request{Store: NewTracker(m, engineID, requestID)}
	r.Coverage = make([]GroupCoverage, len(m.Groups))
	for g := range r.Coverage {
		r.Coverage[g].Group = g
	}
	return r
}

// State is the request's lifecycle state: its store tracker's.
func (r *Request) State() TrackerState { return r.Store.State }

// Done reports whether the request finished and was freed.
func (r *Request) Done() bool { return r.Store.State == StateDone }

// takeTask removes and returns the outstanding task id, if any.
func (r *Request) takeTask(id string) (TaskRef, bool) {
	for i, t := range r.Tasks {
		if t.ID == id {
			r.Tasks = append(r.Tasks[:i], r.Tasks[i+1:]...)
			return t, true
		}
	}
	return TaskRef{}, false
}
