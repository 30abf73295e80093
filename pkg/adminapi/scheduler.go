package adminapi

import (
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// RequestSummary is one request tracker in GET /v1/requests of the
// scheduler, and the head of GET /v1/requests/{engine_id}/{request_id}.
type RequestSummary struct {
	// EngineID and RequestID name the request.
	EngineID  string `json:"engine_id"`
	RequestID string `json:"request_id"`
	// Model is the model the request runs.
	Model string `json:"model"`
	// State is the tracker's state (waiting, running, …, errored).
	State string `json:"state"`
	// Error is why the request errored.
	Error string `json:"error,omitempty"`
	// LastSeq is the seq of the last engine event applied.
	LastSeq int64 `json:"last_seq"`
	// TokenLen and NumSavedTokens are the tracker's token counts.
	TokenLen       int `json:"token_len"`
	NumSavedTokens int `json:"num_saved_tokens"`
	// TasksPending counts the emitted tasks not reported yet.
	TasksPending int `json:"tasks_outstanding"`
	// CreatedAt, UpdatedAt and FinishedAt are the row's times.
	CreatedAt  time.Time  `json:"created_at"`
	UpdatedAt  time.Time  `json:"updated_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
}

// RequestDetail is GET /v1/requests/{engine_id}/{request_id}.
type RequestDetail struct {
	RequestSummary
	// Tracker is the store connector's tracker.
	Tracker *Tracker `json:"tracker"`
	// PDTracker is the pd child's tracker, once pd was chosen.
	PDTracker *Tracker `json:"pd_tracker,omitempty"`
	// Coverage is the saved coverage of each group.
	Coverage []Coverage `json:"coverage"`
	// Tasks are the emitted tasks not reported yet.
	Tasks []TaskRef `json:"tasks"`
	// Errors are the request's error (source "request") then its warnings.
	Errors []Warning `json:"errors"`
	// Held is an allocation waiting for its lookup decision.
	Held *Held `json:"held,omitempty"`
	// Decisions are lookup decisions not bound to an allocation yet.
	Decisions []contract.LookupDecision `json:"decisions,omitempty"`
	// AwaitingDecision is the decision id an applied allocation waits for.
	AwaitingDecision string `json:"awaiting_decision,omitempty"`
	// TraceID is the id of the request's trace (hex), once a record about
	// it carried one: search it in Grafana's Tempo data source or Jaeger.
	TraceID string `json:"trace_id,omitempty"`
}

// Coverage is one group's saved coverage in a RequestDetail.
type Coverage struct {
	GroupCoverage
	// Kind is the group's attention kind.
	Kind kvcore.Kind `json:"kind"`
	// EmittedTokens is the prefix covered by emitted saves (the tracker's
	// saved offset); SavedTokens is what the sender reported.
	EmittedTokens int `json:"emitted_tokens"`
}

// GroupCoverage is what the sender reported for one KV group (the
// scheduler also keeps it with the request's tracker).
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

// Warning is a problem with one record that did not stop the request.
type Warning struct {
	// Source names the record: "event 7", "decision d1", "result r1".
	Source string `json:"source"`
	// Error is the problem.
	Error string `json:"error"`
}

// Held is an allocation whose lookup decision has not arrived, and the
// engine events received after it, in order.
type Held struct {
	// Alloc is the allocated event.
	Alloc contract.RequestEvent `json:"allocation"`
	// Events are the later events, applied once the decision arrives.
	Events []contract.RequestEvent `json:"events,omitempty"`
}

// RetryAnswer is the answer of POST /v1/outbox/{id}/retry.
type RetryAnswer struct {
	// ID is the retried row's id.
	ID int64 `json:"id"`
	// Status is always "pending": the relay publishes the row next.
	Status string `json:"status"`
}
