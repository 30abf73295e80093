package contract

import (
	"encoding/json"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Schema names: the "schema" field of every JSON value on a contract topic.
// Save and load tasks use kvcore.SchemaSaveTask and kvcore.SchemaLoadTask.
const (
	SchemaEngineStep     = "kvmesh.engine_step.v1"
	SchemaLookupDecision = "kvmesh.lookup_decision.v1"
	SchemaTransferResult = "kvmesh.transfer_result.v1"
	SchemaEngineFeedback = "kvmesh.engine_feedback.v1"
	// SchemaEngineFeedbackBatch is the schema of EngineFeedbackBatch, the
	// record the scheduler publishes on TopicEngineFeedback.
	SchemaEngineFeedbackBatch = "kvmesh.engine_feedback_batch.v1"
	SchemaKVEvent             = "kvmesh.kv_event.v2"
	SchemaDeadLetter          = "kvmesh.dead_letter.v1"
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
	// EventPreempted: the engine preempted the request and freed its blocks,
	// which it may reuse at once; the scheduler advances the request's
	// allocation epoch, so a result of a task emitted before it only settles
	// that task.
	EventPreempted EventKind = "preempted"
	// EventFinished: the request finished (request_finished).
	EventFinished EventKind = "finished"
)

// MaxStepRequests bounds the request events one engine step record
// carries; an engine with more changed requests in one step splits them
// over several records (each with its own StepID, in order).
const MaxStepRequests = 4096

// EngineStep is one engine scheduler step, on TopicEngineSteps, keyed by
// engine id: what vLLM's build_connector_meta sees in one step — requests
// admitted, allocated, newly scheduled, resumed, running with new blocks or
// tokens, preempted and finished — one RequestEvent each, in the order the
// engine produced them. Keying by engine id keeps every request's events
// in order (a request lives on one engine). StepID makes redelivery of the
// whole record harmless; each request event also carries its own Seq.
type EngineStep struct {
	Schema string `json:"schema"`
	// StepID identifies the record; unique per engine.
	StepID   string `json:"step_id"`
	EngineID string `json:"engine_id"`
	Model    string `json:"model"`
	// Step is the engine's step counter (informational; it only grows).
	Step int64 `json:"step"`
	// NullBlockID is the block id the engine's block tables use for the
	// null block, when it uses one (vLLM: 0, the null_block BlockPool
	// reserves, NULL_BLOCK_ID in vllm/v1/attention/backends/utils.py).
	// Every table entry equal to it, in every event of the record
	// (allocated's BlockTable, scheduled's Step.Table), is a null block:
	// never loaded, never saved; such an engine cannot use that id as a
	// real block. Absent (or null): the engine writes null blocks as JSON
	// null, and every integer is a real block. JSON null is null either
	// way. Non-negative. The scheduler's intake normalises it to
	// kvcore.NullBlock (kvcore.BlockTable.NormalizeNull) as it decodes
	// the record.
	NullBlockID *int64 `json:"null_block_id,omitempty"`
	// Requests are the request events of the step, at most MaxStepRequests.
	Requests []RequestEvent `json:"requests"`
}

// RequestEvent is one request's event inside an EngineStep. Seq numbers a
// request's events 1, 2, 3, … with no gap: an event with a seq at or below
// the last one applied is stale and ignored, and one that skips a seq fails
// the request closed (request_error; no more tasks; only its finish is
// applied), since the missing event may have changed its block table.
//
// Block lifetime (services/scheduler/API.md, docs/contract.md): a block an
// allocated or scheduled event names holds, when the step is published,
// the bytes of the chunk the table says, written through the rank's
// gpuworker, which records the block's identity. The engine may reuse a
// preempted request's blocks at once and a finished one's at its
// finished_sending, but never a load's destination blocks before that
// load's finished_recving.
type RequestEvent struct {
	RequestID string    `json:"request_id"`
	Seq       int64     `json:"seq"`
	Kind      EventKind `json:"kind"`
	// PromptTokens and BlockHashes (hex chain at hash_block_size) come with admitted.
	PromptTokens int      `json:"prompt_tokens,omitempty"`
	BlockHashes  []string `json:"block_hashes,omitempty"`
	// Tenant comes with admitted: the request's tenant
	// (kvcore.ValidateTenant; absent: none), the one its lookup named. The
	// scheduler keeps it with the request and puts it on every task, so
	// the request only saves and loads its tenant's keys.
	Tenant string `json:"tenant,omitempty"`
	// EngineVersion comes with admitted (optional): the engine's version
	// (vLLM's __version__; kvcore.ValidateEngineVersion). When the model's
	// spec pins an engine version (its fingerprint covers it) and the
	// engine states another, the scheduler stops the request
	// (request_error): none of its blocks may be saved or loaded under the
	// pinned version's keys. Absent: not stated, taken at the spec's word.
	EngineVersion string `json:"engine_version,omitempty"`
	// TokenIDs come with admitted (optional): the prompt's tokens of
	// complete hash blocks only — the first n prompt tokens, n a multiple
	// of hash_block_size, at most len(BlockHashes)*hash_block_size and at
	// most PromptTokens (kvcore.CheckTokenIDs). The scheduler keeps the
	// first kvcore.MaxTokenIDs of them (whole hash blocks; an engine need
	// send no more) with the request and puts those each save task's chain
	// covers on the task, so the BlockStored KV events of its blocks carry their
	// token_ids, which token-keyed routers (llm-d's indexer) index.
	// Absent, or dropped by the scheduler (KVMESH_KV_EVENTS_TOKEN_IDS=false):
	// the events carry token_ids []. A list that breaks these rules
	// dead-letters the step record (invalid_record), as a malformed hash
	// chain does.
	TokenIDs []uint32 `json:"token_ids,omitempty"`
	// LoraName comes with admitted (optional): the LoRA adapter the
	// engine serves the request with (vLLM's BlockStored lora_name);
	// absent: none.
	LoraName string `json:"lora_name,omitempty"`
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
	// Traceparent is the W3C trace context of the request (optional): the
	// scheduler's span for this event continues the request's trace.
	Traceparent string `json:"traceparent,omitempty"`
}

// ChildDecision is one MultiConnector child's lookup answer.
type ChildDecision struct {
	Name    string           `json:"name"`
	Tokens  int              `json:"tokens"`
	Pending bool             `json:"pending,omitempty"`
	Spec    *kvcore.LoadSpec `json:"load_spec,omitempty"`
	// Failed is set when the child could not check its source (the
	// store's existence check failed): the child answered 0 and the chain
	// went on (fail open, as vLLM's store child answers 0). It names the
	// failure: a kvstore status such as "unavailable" or "timeout".
	Failed string `json:"failed,omitempty"`
}

// PDSource describes a disaggregated-prefill source: the engine whose
// gpuworker holds the prompt's KV, and its block table.
type PDSource struct {
	EngineID   string            `json:"remote_engine_id"`
	BlockTable kvcore.BlockTable `json:"remote_block_table"`
	Tokens     int               `json:"remote_tokens"`
	// NullBlockID is the null block id of the remote (prefill) engine's
	// table, as EngineStep.NullBlockID: entries equal to it are null.
	// The lookup normalises them to JSON null (kvcore.NullBlock) when it
	// validates the request, so a decision never carries it.
	NullBlockID *int64 `json:"remote_null_block_id,omitempty"`
}

// LookupDecision is the lookup service's answer for one request, on
// TopicLookupDecisions, keyed by request id.
type LookupDecision struct {
	Schema     string `json:"schema"`
	DecisionID string `json:"decision_id"`
	EngineID   string `json:"engine_id"`
	RequestID  string `json:"request_id"`
	Model      string `json:"model"`
	// Tenant is the tenant the lookup checked the keys of (absent: none).
	Tenant            string          `json:"tenant,omitempty"`
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
	// TierBlocks counts, of a load, the blocks read from the capacity
	// tier (an S3-compatible bucket below Redis) rather than from Redis.
	TierBlocks int `json:"tier_blocks,omitempty"`
	// Rank is the worker rank whose load this reports (loads of a
	// multi-rank engine: one result per rank of the task's Ranks).
	Rank *kvcore.Rank `json:"rank,omitempty"`
}

// SaveReportOf is what a save result (status and per-group outcomes) tells
// the request's tracker: the keys skipped under store pressure, whose put
// failed, or dead-lettered exists_failed (the store's existence check kept
// failing: a transient problem vLLM's next job retries), summed over the
// groups. Any such key marks the task's range unsaved, so it is saved again
// (the scheduler's services/scheduler/requeststate Tracker.OnSaveReport),
// even when a dead-lettered group set the status; keys dead-lettered for a
// permanent cause do not. Negative counts are ignored. The scheduler's trackers and the simulator's engine-side
// shadow both read results through it, so they agree on every re-save.
func SaveReportOf(status kvcore.SaveStatus, groups []GroupOutcome) kvcore.SaveReport {
	rep := kvcore.SaveReport{Status: status}
	for _, g := range groups {
		rep.Skipped += max(g.Skipped, 0)
		rep.Failed += max(g.Failed, 0)
		if g.Reason == string(kvcore.ReasonExistsFailed) {
			rep.ExistsFailed += max(g.DeadLettered, 0)
		}
	}
	return rep
}

// FeedbackRequestError is the EngineFeedback kind that tells an engine a
// request stopped with an error (EngineFeedback.Error says why): the
// scheduler emits no more tasks for it, and its finished_sending still
// follows the request's finish so its blocks are freed.
const FeedbackRequestError kvcore.FeedbackKind = "request_error"

// EngineFeedback tells an engine what finished: one message of an
// EngineFeedbackBatch on TopicEngineFeedback.
type EngineFeedback struct {
	Schema string `json:"schema"`
	kvcore.Feedback
	// Error carries a request error (e.g. a group-count mismatch) when set.
	Error string `json:"error,omitempty"`
}

// MaxFeedbackBatch bounds the messages one EngineFeedbackBatch carries; a
// transaction with more for one engine publishes several records, in
// order.
const MaxFeedbackBatch = 512

// EngineFeedbackBatch is the record on TopicEngineFeedback, keyed by
// engine id: the feedback messages one scheduler transaction produced for
// the engine, in the order it produced them (at most MaxFeedbackBatch;
// never empty). Each message is a whole EngineFeedback, schema included.
// One record per engine and transaction, rather than one per message,
// saves the broker, the outbox and the engine's consumer a record per
// message. Read it with DecodeEngineFeedback.
type EngineFeedbackBatch struct {
	Schema   string           `json:"schema"`
	EngineID string           `json:"engine_id"`
	Feedback []EngineFeedback `json:"feedback"`
}

// DecodeEngineFeedback decodes one TopicEngineFeedback record's value
// into its messages, in order: an EngineFeedbackBatch, or a lone
// EngineFeedback (what a scheduler before the batch published, which an
// engine may still read during an upgrade). Any other schema is an error.
func DecodeEngineFeedback(value []byte) ([]EngineFeedback, error) {
	// One pass reads either form: a batch's fields do not overlap a
	// message's but for schema and engine_id, which both forms share.
	var v struct {
		EngineFeedback
		Feedback []EngineFeedback `json:"feedback"`
	}
	if err := json.Unmarshal(value, &v); err != nil {
		return nil, fmt.Errorf("engine feedback: %w", err)
	}
	switch v.Schema {
	case SchemaEngineFeedbackBatch:
		return v.Feedback, nil
	case SchemaEngineFeedback:
		return []EngineFeedback{v.EngineFeedback}, nil
	}
	return nil, fmt.Errorf("engine feedback: schema %q, want %s", v.Schema, SchemaEngineFeedbackBatch)
}

// KVEventKind is the tag of a vLLM KV-cache event: BlockStored,
// BlockRemoved or AllBlocksCleared (vllm/distributed/kv_events.py, the
// KVCacheEvent subclasses).
type KVEventKind string

// KV event kinds, spelled as vLLM tags them.
const (
	BlockStored      KVEventKind = "BlockStored"
	BlockRemoved     KVEventKind = "BlockRemoved"
	AllBlocksCleared KVEventKind = "AllBlocksCleared"
)

// KVEvent is one vLLM KV-cache event, with the fields of vLLM's
// BlockStored / BlockRemoved / AllBlocksCleared structs
// (vllm/distributed/kv_events.py) in their order; docs/contract.md gives
// the wire form (EncodeKVEventBatch). A field that an event kind does not
// have is left at its zero value.
type KVEvent struct {
	// Kind is the event's tag.
	Kind KVEventKind
	// BlockHashes are the blocks' hashes as vLLM puts them on the wire
	// (WireHash: the low 64 bits of the hash, big-endian), in chain order.
	BlockHashes []uint64
	// ParentBlockHash is the wire hash of the block before the first one
	// (BlockStored); nil when the first block starts the chain.
	ParentBlockHash *uint64
	// TokenIDs are the blocks' tokens (BlockStored): len(BlockHashes) ×
	// BlockSize tokens. kvmesh fills them from the save task's tokens (the
	// prompt tokens the engine sent with admitted) when the task covers
	// every block of the event whole, and sends an empty list otherwise.
	TokenIDs []uint32
	// BlockSize is the tokens per block of the group (BlockStored).
	BlockSize int
	// LoraID and LoraName are vLLM's LoRA fields (BlockStored). kvmesh
	// sends LoraName from the save task (the adapter the engine admitted
	// the request with; nil without one) and LoraID nil (the adapter's id
	// is only folded into the block hashes).
	LoraID   *int
	LoraName *string
	// Medium names the tier holding the blocks; kvmesh sends MediumStore.
	Medium *string
	// ExtraKeys is vLLM's extra_keys (BlockStored): per block, the extra
	// keys its hash was computed with (a tuple, or nil). Decoded as the
	// msgpack values they are; nil in kvmesh, which does not know them.
	ExtraKeys []any
	// GroupIdx is the KV-cache group (vLLM's group_idx).
	GroupIdx *int
	// SpecKind is the group's kv_cache_spec_kind (BlockStored): full_attention,
	// mla_attention, sliding_window or mamba.
	SpecKind string
	// SlidingWindow is kv_cache_spec_sliding_window (BlockStored of a
	// sliding-window group).
	SlidingWindow *int
	// Locality is vLLM's locality of the tier, LOCAL or REMOTE relative to
	// the publisher; kvmesh sends LocalityStore.
	Locality *string
}

// KVEventBatch is vLLM's KVEventBatch: a timestamp, the events in order,
// and the data-parallel rank of the publisher.
type KVEventBatch struct {
	// TS is the batch time in seconds since the Unix epoch.
	TS float64
	// Events are the batch's events, in order.
	Events []KVEvent
	// DataParallelRank is vLLM's data_parallel_rank; kvmesh sends 0, as a
	// vLLM engine without data parallelism does.
	DataParallelRank *int
}

// KVEventRecord is one record of TopicKVEvents: the vLLM KVEventBatch that
// is the record value, and kvmesh's own fields that routers do not need,
// carried in record headers (EncodeKVEventRecord). The record key is the
// store namespace: every event about the keys of one namespace goes to one
// partition, in the order it was published.
type KVEventRecord struct {
	// Batch is the record value.
	Batch KVEventBatch
	// Model is the model name of the keys (HeaderKVModel).
	Model string
	// Fingerprint is the model's compatibility fingerprint, the keys' "fp:"
	// segment (HeaderKVFingerprint); empty for a flush of the whole
	// deployment, which removes the keys of every fingerprint.
	Fingerprint string
	// Namespace is the store namespace of every block of the record
	// (KeyBuilder.Namespace, HeaderKVNamespace); for AllBlocksCleared the
	// deployment scope "[prefix@]model".
	Namespace string
	// Hashes are the blocks' full hashes in hex (HeaderKVBlockHashes), one
	// per wire hash of the events, in the same order: Namespace + "@" + hash
	// is the store key.
	Hashes []string
	// EngineID and RequestID name the save that stored the blocks
	// (BlockStored; empty for events observed in the store).
	EngineID  string
	RequestID string
	// Ages are, for a removal, each block's age when it was removed, in
	// seconds, one per hash of Hashes, -1 where it is not known
	// (HeaderKVBlockAges); nil when no age is known.
	Ages []float64
	// Cause is why blocks were removed: the Redis event (evicted, expired,
	// del) or "flushed" (HeaderKVCause); empty for BlockStored.
	Cause string
	// Tenant is the tenant whose keys the record is about
	// (HeaderKVTenant); empty for the empty tenant. The tenant is also
	// part of Namespace.
	Tenant string
}

// MaxDeadLetterPayload bounds the original record bytes a dead-letter
// message carries (64 KiB): in DeadLetterNotice.Payload on TopicSaveDLQ (about
// 88 KiB once base64-encoded) and as the record value of a bus-level dead
// letter (bus.DeadLetterMessage). A dead letter must stay publishable
// whatever record caused it, far below the broker's 1 MiB message limit; a
// longer original is cut to its first MaxDeadLetterPayload bytes and the
// message says so (DeadLetterNotice.PayloadTruncated, HeaderPayloadTruncated),
// gives the original size (DeadLetterNotice.PayloadBytes, HeaderPayloadBytes) and
// where the full original is kept.
const MaxDeadLetterPayload = 64 << 10

// Headers of a bus-level dead letter (bus.DeadLetterMessage) about its
// payload, the record value.
const (
	// HeaderPayloadBytes is the size in bytes of the original record
	// value, in decimal; always set.
	HeaderPayloadBytes = "kvmesh-payload-bytes"
	// HeaderPayloadTruncated is "true" when the dead letter's value is the
	// first MaxDeadLetterPayload bytes of a longer original; absent
	// otherwise. The full original is the record named by
	// HeaderOrigTopic, HeaderOrigPart and HeaderOrigOffset (while the topic
	// retains it) and whatever the consumer's dead-letter hook stored.
	HeaderPayloadTruncated = "kvmesh-payload-truncated"
)

// DeadLetterNotice is the wire form of a deadletter.DeadLetter (the one
// dead-letter type, pkg/deadletter) on TopicSaveDLQ: one dead-lettered
// save group or record, keyed by request id (or the original key). The sender keeps the full
// original record in PostgreSQL (its dead_letters row, numbered ID) and
// serves it at GET /v1/dlq/{ID} of its admin API; the message carries at
// most MaxDeadLetterPayload bytes of it.
type DeadLetterNotice struct {
	Schema string `json:"schema"`
	// ID is the sender's dead-letter id (the dead_letters row), the
	// reference to the full original.
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
	// Payload is the original record value (base64 in JSON, since an
	// undecodable record need not be JSON), cut to its first
	// MaxDeadLetterPayload bytes when longer.
	Payload []byte `json:"payload,omitempty"`
	// PayloadBytes is the size of the original record value.
	PayloadBytes int `json:"payload_bytes"`
	// PayloadTruncated is set when Payload is shorter than the original.
	PayloadTruncated bool `json:"payload_truncated,omitempty"`
	// PayloadRef locates the full original: the sender's admin path
	// /v1/dlq/{ID}.
	PayloadRef string `json:"payload_ref,omitempty"`
}

// BoundDeadLetterPayload returns payload cut to MaxDeadLetterPayload bytes
// (sharing its storage) and whether it was cut.
func BoundDeadLetterPayload(payload []byte) ([]byte, bool) {
	if len(payload) <= MaxDeadLetterPayload {
		return payload, false
	}
	return payload[:MaxDeadLetterPayload], true
}
