package kvcore

// Reason is the one reason-code type of kvmesh: a stable, machine-readable
// code saying why a record, a task or a save group was dead-lettered (or,
// for a save group, skipped or failed). It is the reason column of the
// dead_letters table (pkg/deadletter), the kvmesh-reason header of a DLQ
// record, the reason of a bus.PermanentError and of a contract.GroupOutcome.
// docs/operations.md tables them.
type Reason string

// Reason codes, every one of them. ReasonOK (the empty code) means valid.
const (
	// Save-group reasons (ValidateSave and the sender's save).

	// ReasonOK: the group is valid.
	ReasonOK Reason = ""
	// ReasonModelUnknown: the task names a model the sender does not serve
	// (or the model spec is unusable). Task-wide.
	ReasonModelUnknown Reason = "model_unknown"
	// ReasonTenantInvalid: the task's tenant cannot be a store-key segment
	// (ValidateTenant). Task-wide.
	ReasonTenantInvalid Reason = "tenant_invalid"
	// ReasonTokenRangeInvalid: Start/End are negative, empty, reversed or
	// not aligned to the scheduler block size (End may instead be a
	// sub-block prompt tail's end under partial hash hits). Task-wide.
	ReasonTokenRangeInvalid Reason = "token_range_invalid"
	// ReasonTokenIDsInvalid: the task's token ids are not whole hash
	// blocks, or more than its block hashes cover (CheckTokenIDs).
	// Task-wide.
	ReasonTokenIDsInvalid Reason = "token_ids_invalid"
	// ReasonTableGroupCount: the block table lacks this group, or has more
	// groups than the model (then every group gets it).
	ReasonTableGroupCount Reason = "table_group_count"
	// ReasonGroupOutOfRange: a task entry names a group the model lacks.
	ReasonGroupOutOfRange Reason = "group_out_of_range"
	// ReasonGroupMissing: the task does not list a model group.
	ReasonGroupMissing Reason = "group_missing"
	// ReasonGroupDuplicate: a task entry repeats a group listed before.
	ReasonGroupDuplicate Reason = "group_duplicate"
	// ReasonHashCountMismatch: the hash chain is shorter than End needs.
	ReasonHashCountMismatch Reason = "hash_count_mismatch"
	// ReasonHashInvalid: a hash the group's chunks use is not lower-case hex.
	ReasonHashInvalid Reason = "hash_invalid"
	// ReasonChunksMismatch: the entry's chunks differ from those of
	// Model.SaveChunks (Model.PromptTailChunks for a prompt tail) for the
	// task's range whose block the table holds.
	ReasonChunksMismatch Reason = "chunks_mismatch"
	// ReasonTableTooShort: the group's block list ends before a chunk.
	ReasonTableTooShort Reason = "table_too_short"
	// ReasonNullBlock: a chunk's block is null: JSON null, or the null
	// block id its engine declared (normalised to NullBlock where the
	// engine's table entered the mesh; BlockTable.NormalizeNull).
	ReasonNullBlock Reason = "null_block"
	// ReasonBlockOutOfRange: a chunk's block id is negative or beyond the pool.
	ReasonBlockOutOfRange Reason = "block_out_of_range"
	// ReasonExistsFailed: the store's existence check kept failing.
	ReasonExistsFailed Reason = "exists_failed"
	// ReasonPutFailed: the store refused or failed a put.
	ReasonPutFailed Reason = "put_failed"
	// ReasonStorePressure: the save was skipped in pressure mode (store full).
	ReasonStorePressure Reason = "store_pressure"
	// ReasonQuota: the save's blocks did not fit its tenant's quota in the
	// store (with on_full skip, or when the tenant's own blocks could not
	// make room) and were skipped.
	ReasonQuota Reason = "quota"
	// ReasonBlockNotHeld: the engine block no longer holds the chunk the
	// task names (its gpuworker restarted, the engine evicted or reused the
	// block, or its write never completed), so its bytes cannot be proven
	// and are not stored.
	ReasonBlockNotHeld Reason = "block_not_held"

	// Whole-record reasons the bus consumer writes (pkg/bus) for every
	// consumer.

	// ReasonUndecodable: the record's value could not be decoded.
	ReasonUndecodable Reason = "undecodable"
	// ReasonHandlerPanic: the record's handler panicked.
	ReasonHandlerPanic Reason = "handler_panic"
	// ReasonRetriesExhausted: the handler kept failing with transient
	// errors until the retry policy gave up.
	ReasonRetriesExhausted Reason = "retries_exhausted"
	// ReasonUnspecified replaces an empty reason given to bus.Permanent.
	ReasonUnspecified Reason = "unspecified"

	// Sender (services/sender/internal/sending).

	// ReasonPlanFailed: a group passed validation but could not be planned
	// (a disagreement between ValidateSave and PlanSend); it should never
	// appear.
	ReasonPlanFailed Reason = "plan_failed"

	// Scheduler (services/scheduler/internal/intake).

	// ReasonInvalidRecord: a record decodes but misses a required field or
	// carries an impossible value.
	ReasonInvalidRecord Reason = "invalid_record"
	// ReasonUnknownTopic: a record from a topic the scheduler does not
	// consume.
	ReasonUnknownTopic Reason = "unknown_topic"
	// ReasonDatabaseRejected: PostgreSQL refuses the record for its data
	// (SQLSTATE class 22 or 23) every time it is applied alone.
	ReasonDatabaseRejected Reason = "database_rejected"
	// ReasonPartsCorrupt: the record changes a request whose stored hash or
	// block segments disagree with its row (ledger.ErrPartsCorrupt).
	ReasonPartsCorrupt Reason = "tracker_parts_corrupt"

	// Lookup (services/lookup/internal/engines).

	// ReasonBadEngineID: the kvmesh-engine-id header is over
	// engines.MaxEngineIDBytes.
	ReasonBadEngineID Reason = "bad_engine_id"
	// ReasonUnknownGroup: a KV event names a group the model does not have
	// (the rest of its batch was applied).
	ReasonUnknownGroup Reason = "unknown_group"
)
