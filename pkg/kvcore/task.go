package kvcore

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"

	// segmentio's encoding/json decodes save tasks (their hash chains and
	// token ids) at a fraction of the standard library's cost, with the
	// same strictness: unknown fields and trailing data are refused.
	fastjson "github.com/segmentio/encoding/json"
)

// Schema names carried in the "schema" field of task payloads.
const (
	SchemaSaveTask = "kvmesh.save_task.v1"
	SchemaLoadTask = "kvmesh.load_task.v1"
)

// BlockID is the id of one block in an engine's paged KV pool. In JSON a
// null block (a slot the engine freed, e.g. outside a sliding window) is
// null; in Go it is NullBlock.
//
// An engine may instead use a block id of its own for the null block and
// declare it (contract.EngineStep.NullBlockID, the lookup's
// remote_null_block_id): vLLM's null block is block 0 — BlockPool.__init__
// (vllm/v1/core/block_pool.py) takes the first free block as null_block,
// and block tables carry NULL_BLOCK_ID = 0
// (vllm/v1/attention/backends/utils.py). The edges that receive an engine's
// tables turn its null id into NullBlock once (BlockTable.NormalizeNull),
// so everything past them knows one representation: NullBlock.
type BlockID int64

// NullBlock stands for a JSON null in a block table, and for an engine's
// declared null block id once normalised.
const NullBlock BlockID = -1

// EngineNullBlock returns the null block id an engine declared: NullBlock
// when it declared none (nil: its tables carry JSON null), else the id.
// The caller refuses a negative declaration.
func EngineNullBlock(declared *int64) BlockID {
	if declared == nil {
		return NullBlock
	}
	return BlockID(*declared)
}

// MarshalJSON writes NullBlock as null.
func (b BlockID) MarshalJSON() ([]byte, error) {
	if b == NullBlock {
		return []byte("null"), nil
	}
	return strconv.AppendInt(nil, int64(b), 10), nil
}

// UnmarshalJSON reads null as NullBlock.
func (b *BlockID) UnmarshalJSON(data []byte) error {
	if bytes.Equal(data, []byte("null")) {
		*b = NullBlock
		return nil
	}
	v, err := strconv.ParseInt(string(data), 10, 64)
	if err != nil {
		return err
	}
	*b = BlockID(v)
	return nil
}

// BlockTable is a request's block ids, one list per KV group:
// [[0,1,2],[7]] for a two-group model. An empty table has zero groups.
type BlockTable [][]BlockID

// NormalizeNull returns the table with every entry equal to engineNull,
// the null block id the engine declared, replaced by NullBlock; JSON nulls
// stay NullBlock. With engineNull NullBlock (the default convention) it
// returns t itself; otherwise a new table, leaving t untouched. Under a
// declared null id of 0, an entry 0 is null: such an engine cannot use
// block 0 as a real block (vLLM never does).
func (t BlockTable) NormalizeNull(engineNull BlockID) BlockTable {
	if engineNull == NullBlock || t == nil {
		return t
	}
	out := make(BlockTable, len(t))
	for g, ids := range t {
		if ids == nil {
			continue
		}
		out[g] = make([]BlockID, len(ids))
		for i, b := range ids {
			if b == engineNull {
				b = NullBlock
			}
			out[g][i] = b
		}
	}
	return out
}

// Clone returns a deep copy, so a task's snapshot never aliases a tracker.
func (t BlockTable) Clone() BlockTable {
	if t == nil {
		return nil
	}
	out := make(BlockTable, len(t))
	for i, g := range t {
		out[i] = append([]BlockID(nil), g...)
	}
	return out
}

// LoadSpec is what a connector's lookup found for a request.
type LoadSpec struct {
	// VLLMCachedTokens is the engine's own prefix-cache hit (num_computed_tokens).
	VLLMCachedTokens int `json:"vllm_cached_tokens"`
	// KVPoolCachedTokens is the hit in the store pool.
	KVPoolCachedTokens int `json:"kvpool_cached_tokens"`
	// CanLoad is set at allocation when the engine accepted the external tokens.
	CanLoad bool `json:"can_load"`
	// TailKeys name, per group, the boundary whose hash keys the group's
	// last loaded chunk (LookupPlan.TailKeys): the hit itself, or, under
	// partial hash hits, a later hash boundary of the hit's block where the
	// group stored that block (vLLM's TailKeyBoundary, worker.py
	// MooncakeStoreWorker._tail_key_boundaries). The load task's chunks
	// follow them (Model.LoadGroupsTail). Absent: every group's last chunk
	// is keyed by the hash at the hit.
	TailKeys []TailKey `json:"tail_keys,omitempty"`
}

// GroupChunks names the chunks of one group that a task covers.
type GroupChunks struct {
	// Group is the KV-group index.
	Group int `json:"group"`
	// Chunks are the blocks of the group the task moves.
	Chunks []Chunk `json:"chunks"`
}

// SaveTask asks the sender to store tokens [Start, End) of one request. It
// carries a snapshot of the block table taken when the task was emitted.
type SaveTask struct {
	// Schema is SchemaSaveTask.
	Schema string `json:"schema"`
	// TaskID is unique per task and stable across redelivery.
	TaskID string `json:"task_id"`
	// EngineID is the engine that owns the blocks.
	EngineID string `json:"engine_id"`
	// RequestID is the engine's request id.
	RequestID string `json:"request_id"`
	// Model is the model name (Model.Name).
	Model string `json:"model"`
	// Tenant is the request's tenant (ValidateTenant; absent: none): the
	// task's keys are built in its key space (PlanSend).
	Tenant string `json:"tenant,omitempty"`
	// Epoch is the request's allocation epoch when the task was emitted
	// (absent: 0); it advances each time the engine released the request's
	// blocks (a preemption). A result for a task of an older epoch only
	// settles that task.
	Epoch int `json:"epoch,omitempty"`
	// Start is the saved offset: tokens already stored before this task.
	Start int `json:"start"`
	// End is the token count stored once the task succeeds.
	End int `json:"end"`
	// BlockTable is the per-group block table snapshot.
	BlockTable BlockTable `json:"block_table"`
	// BlockHashes is the request's hash chain (hex), at least End/hash_block_size long.
	BlockHashes []string `json:"block_hashes"`
	// TokenIDs are the request's prompt tokens [0, N) of the chain prefix
	// BlockHashes covers, complete hash blocks only (CheckTokenIDs: N a
	// multiple of hash_block_size, at most len(BlockHashes) blocks; N may
	// be shorter, down to none, when the engine sent fewer or the operator
	// dropped them). The sender fills the token_ids of the BlockStored
	// events of the blocks they cover. Absent: none.
	TokenIDs []uint32 `json:"token_ids,omitempty"`
	// LoraName is the LoRA adapter the request is served with ("": none),
	// the BlockStored events' lora_name.
	LoraName string `json:"lora_name,omitempty"`
	// Groups lists, per group, exactly the chunks to store.
	Groups []GroupChunks `json:"groups"`
}

// LoadTask asks a gpuworker to load tokens [Start, End) of one request into
// the listed blocks.
type LoadTask struct {
	// Schema is SchemaLoadTask.
	Schema string `json:"schema"`
	// TaskID is unique per task and stable across redelivery.
	TaskID string `json:"task_id"`
	// EngineID is the engine whose pool receives the blocks.
	EngineID string `json:"engine_id"`
	// RequestID is the engine's request id.
	RequestID string `json:"request_id"`
	// Model is the model name (Model.Name).
	Model string `json:"model"`
	// Tenant is the request's tenant (ValidateTenant; absent: none): the
	// task's keys are built in its key space (PlanLoad).
	Tenant string `json:"tenant,omitempty"`
	// Connector is the chosen connector ("store" or "pd").
	Connector string `json:"connector"`
	// Epoch is the request's allocation epoch when the task was emitted
	// (absent: 0). A result for a load of an older epoch only settles that
	// task and never yields finished_recving.
	Epoch int `json:"epoch,omitempty"`
	// Start is floor(vllm_cached_tokens, scheduler block size).
	Start int `json:"start"`
	// End is the hit: kvpool_cached_tokens.
	End int `json:"end"`
	// BlockTable is the per-group block table snapshot.
	BlockTable BlockTable `json:"block_table"`
	// BlockHashes is the request's hash chain (hex), at least End/hash_block_size long.
	BlockHashes []string `json:"block_hashes"`
	// Groups lists, per group, exactly the chunks to load.
	Groups []GroupChunks `json:"groups"`
	// Remote is set for a pd load: the blocks come from another engine's
	// gpuworker instead of the store pool.
	Remote *RemoteSource `json:"remote,omitempty"`
	// Ranks are the engine's worker ranks that each load their share and
	// report a result of their own (Model.WorkerRanks); the load is
	// finished only when all of them reported. Absent for a single-rank
	// engine.
	Ranks []Rank `json:"ranks,omitempty"`
}

// RemoteSource is a disaggregated-prefill source: the engine whose pool
// holds the request's KV and that engine's block table for it.
type RemoteSource struct {
	// EngineID is the prefill engine.
	EngineID string `json:"engine_id"`
	// BlockTable is the prefill engine's per-group block table.
	BlockTable BlockTable `json:"block_table"`
}

// printable is a decoder's error text made printable: segmentio's quotes
// the input it failed on, which may hold NUL bytes or invalid UTF-8 that
// neither a log nor PostgreSQL text takes.
func printable(s string) string {
	return strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", `\x00`), "\uFFFD")
}

// DecodeSaveTask decodes a save task strictly: one JSON object, no unknown
// fields, the save-task schema, and every identifying field present.
// Content is checked by ValidateSave.
func DecodeSaveTask(b []byte) (*SaveTask, error) {
	var t SaveTask
	rest, err := fastjson.Parse(b, &t, fastjson.DisallowUnknownFields)
	if err != nil {
		return nil, fmt.Errorf("save task: %w: %s", ErrInvalidSaveTask, printable(err.Error()))
	}
	if len(rest) != 0 {
		return nil, fmt.Errorf("save task: %w: trailing data after the object", ErrInvalidSaveTask)
	}
	if t.Schema != SchemaSaveTask {
		return nil, fmt.Errorf("save task: %w: schema %q, want %q", ErrInvalidSaveTask, t.Schema, SchemaSaveTask)
	}
	for _, f := range []struct{ name, v string }{
		{"task_id", t.TaskID}, {"engine_id", t.EngineID}, {"request_id", t.RequestID}, {"model", t.Model},
	} {
		if f.v == "" {
			return nil, fmt.Errorf("save task: %w: %s is missing", ErrInvalidSaveTask, f.name)
		}
	}
	return &t, nil
}
