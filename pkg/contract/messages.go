package contract

import (
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Schema names: the "schema" field of every JSON value on a contract topic.
// Save and load tasks use kvcore.SchemaSaveTask and kvcore.SchemaLoadTask.
const (
	SchemaEngineEvent    = "kvmesh.engine_event.v1"
	SchemaLookupDecision = "kvmesh.lookup_decision.v1"
	SchemaTransferResult = "kvmesh.transfer_result.v1"
	SchemaEngineFeedback = "kvmesh.engine_feedback.v1"
	SchemaKVEvent        = "kvmesh.kv_event.v1"
	SchemaDeadLetter     = "kvmesh.dead_letter.v1"
)

// EventKind is the kind of an engine event.
type EventKind string

// Engine event kinds, in the order a request normally sees them.
const (
	// EventAdmitted: the engine took the request (prompt length, hash chain).
	EventAdmitted EventKind = "admitted"
	// EventAllocated: the engine allocated blocks, with its external-token count
	// (update_state_after_alloc).
	EventAllocated EventKind = "allocated"
	// EventScheduled: one engine step's view of the request (build_connector_meta).
	EventScheduled EventKind = "scheduled"
	// EventPreempted: the engine preempted the request and freed its blocks.
	EventPreempted EventKind = "preempted"
	// EventFinished: the request finished (request_finished).
	EventFinished EventKind = "finished"
)

// EngineEvent is one scheduler event of one request, on TopicEngineEvents,
// keyed by request id. EventID makes redelivery harmless; Seq orders a
// request's events (1, 2, 3, …) and lets the scheduler refuse stale ones.
type EngineEvent struct {
	Schema    string    `json:"schema"`
	EventID   string    `json:"event_id"`
	EngineID  string    `json:"engine_id"`
	RequestID string    `json:"request_id"`
	Seq       int64     `json:"seq"`
	Kind      EventKind `json:"kind"`
	Model     string    `json:"model"`
	// PromptTokens and BlockHashes (hex chain at hash_block_size) come with admitted.
	PromptTokens int      `json:"prompt_tokens,omitempty"`
	BlockHashes  []string `json:"block_hashes,omitempty"`
	// Consumer marks a kv_consumer request (never saves).
	Consumer bool `json:"consumer,omitempty"`
	// ExternalTokens and BlockTable come with allocated.
	ExternalTokens int               `json:"external_tokens,omitempty"`
	BlockTable     kvcore.BlockTable `json:"block_table,omitempty"`
	// DecisionID comes with allocated: the LookupDecision.DecisionID the
	// engine allocated for (the lookup answer it acted on). It binds the
	// allocation to its lookup even when the decision is consumed after a
	// later preemption; without it the scheduler uses the newest decision.
	DecisionID string `json:"decision_id,omitempty"`
	// Step comes with scheduled.
	Step *kvcore.Step `json:"step,omitempty"`
}

// ChildDecision is one MultiConnector child's lookup answer.
type ChildDecision struct {
	Name    string           `json:"name"`
	Tokens  int              `json:"tokens"`
	Pending bool             `json:"pending,omitempty"`
	Spec    *kvcore.LoadSpec `json:"load_spec,omitempty"`
}

// PDSource describes a disaggregated-prefill source: the engine whose
// gpuworker holds the prompt's KV, and its block table.
type PDSource struct {
	EngineID   string            `json:"remote_engine_id"`
	BlockTable kvcore.BlockTable `json:"remote_block_table"`
	Tokens     int               `json:"remote_tokens"`
}

// LookupDecision is the lookup service's answer for one request, on
// TopicLookupDecisions, keyed by request id.
type LookupDecision struct {
	Schema            string          `json:"schema"`
	DecisionID        string          `json:"decision_id"`
	EngineID          string          `json:"engine_id"`
	RequestID         string          `json:"request_id"`
	Model             string          `json:"model"`
	NumTokens         int             `json:"num_tokens"`
	NumComputedTokens int             `json:"num_computed_tokens"`
	Pending           bool            `json:"pending,omitempty"`
	Chosen            string          `json:"chosen,omitempty"`
	ExternalTokens    int             `json:"external_tokens"`
	LoadAsync         bool            `json:"load_async"`
	Children          []ChildDecision `json:"children"`
	PD                *PDSource       `json:"pd_source,omitempty"`
}

// TransferKind says whether a result reports a save or a load.
type TransferKind string

// Transfer kinds.
const (
	TransferSave TransferKind = "save"
	TransferLoad TransferKind = "load"
)

// GroupOutcome is what happened to one group of a save task.
type GroupOutcome struct {
	Group        int    `json:"group"`
	Stored       int    `json:"stored"`
	Existing     int    `json:"existing"`
	Skipped      int    `json:"skipped"`
	DeadLettered int    `json:"dead_lettered"`
	Failed       int    `json:"failed"`
	Reason       string `json:"reason,omitempty"`
}

// TransferResult reports one save or load task, on TopicTransferResults,
// keyed by request id. Every task gets exactly one result (redelivered
// duplicates carry the same ResultID).
type TransferResult struct {
	Schema    string       `json:"schema"`
	ResultID  string       `json:"result_id"`
	Kind      TransferKind `json:"kind"`
	TaskID    string       `json:"task_id"`
	EngineID  string       `json:"engine_id"`
	RequestID string       `json:"request_id"`
	// Status is a kvcore.SaveStatus for saves; "done" for loads.
	Status     string           `json:"status"`
	Groups     []GroupOutcome   `json:"groups,omitempty"`
	LoadErrors []kvcore.BlockID `json:"load_errors,omitempty"`
	Bytes      int64            `json:"bytes"`
}

// FeedbackRequestError is the EngineFeedback kind that tells an engine a
// request stopped with an error (EngineFeedback.Error says why): the
// scheduler emits no more tasks for it, and its finished_sending still
// follows the request's finish so its blocks are freed.
const FeedbackRequestError kvcore.FeedbackKind = "request_error"

// EngineFeedback tells an engine what finished, on TopicEngineFeedback,
// keyed by engine id.
type EngineFeedback struct {
	Schema string `json:"schema"`
	kvcore.Feedback
	// Error carries a request error (e.g. a group-count mismatch) when set.
	Error string `json:"error,omitempty"`
}

// KVEventKind is BlockStored or BlockRemoved.
type KVEventKind string

// KV event kinds.
const (
	BlockStored  KVEventKind = "BlockStored"
	BlockRemoved KVEventKind = "BlockRemoved"
)

// KVEvent announces store keys that appeared or went, on TopicKVEvents,
// keyed by request id.
type KVEvent struct {
	Schema    string      `json:"schema"`
	Kind      KVEventKind `json:"kind"`
	Model     string      `json:"model"`
	EngineID  string      `json:"engine_id"`
	RequestID string      `json:"request_id"`
	Group     int         `json:"group"`
	Keys      []string    `json:"keys"`
}

// DeadLetter is one dead-lettered save group or record, on TopicSaveDLQ,
// keyed by request id (or the original key). Payload is the original record value
// (base64 in JSON, since an undecodable record need not be JSON).
type DeadLetter struct {
	Schema    string `json:"schema"`
	ID        string `json:"id"`
	Reason    string `json:"reason"`
	Detail    string `json:"detail"`
	Group     *int   `json:"group,omitempty"`
	TaskID    string `json:"task_id,omitempty"`
	EngineID  string `json:"engine_id,omitempty"`
	RequestID string `json:"request_id,omitempty"`
	Topic     string `json:"topic"`
	Partition int    `json:"partition"`
	Offset    int64  `json:"offset"`
	Payload   []byte `json:"payload,omitempty"`
}
