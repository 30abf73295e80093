package adminapi

import (
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// The API form of a request tracker, as GET /v1/requests/{engine_id}/{request_id}
// of the scheduler answers it. The scheduler's state machine
// (services/scheduler/requeststate) keeps its own in-memory and stored
// forms; services/scheduler/internal/api converts them to these at the edge,
// so an internal field change is not a wire change. The JSON is the stored
// tracker's, field for field.

// Tracker is the store connector's (or the pd child's) request tracker (API form).
type Tracker struct {
	EngineID       string               `json:"engine_id"`
	RequestID      string               `json:"request_id"`
	Model          string               `json:"model"`
	Tenant         string               `json:"tenant,omitempty"`
	Connector      string               `json:"connector,omitempty"`
	Remote         *kvcore.RemoteSource `json:"remote,omitempty"`
	Consumer       bool                 `json:"consumer,omitempty"`
	State          string               `json:"state"`
	Error          string               `json:"error,omitempty"`
	TokenLen       int                  `json:"token_len"`
	PrefillEnd     int                  `json:"prefill_end,omitempty"`
	PromptTokens   int                  `json:"prompt_tokens,omitempty"`
	TailSaved      bool                 `json:"tail_saved,omitempty"`
	Table          kvcore.BlockTable    `json:"block_table"`
	NumSavedTokens int                  `json:"num_saved_tokens"`
	SaveSpans      []SaveSpan           `json:"save_spans,omitempty"`
	Unsaved        []SaveSpan           `json:"unsaved,omitempty"`
	SaveJobs       int                  `json:"save_jobs,omitempty"`
	Hashes         []string             `json:"block_hashes,omitempty"`
	TokenIDs       []uint32             `json:"token_ids,omitempty"`
	LoraName       string               `json:"lora_name,omitempty"`
	Load           TrackerLoad          `json:"load"`
	Seq            int                  `json:"seq"`
	Epoch          int                  `json:"epoch,omitempty"`
	PendingSaves   []string             `json:"pending_saves,omitempty"`
	PendingLoads   []string             `json:"pending_loads,omitempty"`
	StaleSaves     []string             `json:"stale_saves,omitempty"`
	StaleLoads     []string             `json:"stale_loads,omitempty"`
	LoadWaits      []LoadWait           `json:"load_waits,omitempty"`
	Reports        kvcore.SaveCounts    `json:"save_reports"`
}

// TrackerLoad is a tracker's LoadSpec state of the current scheduling attempt (API form).
type TrackerLoad struct {
	LookedUp    bool              `json:"looked_up,omitempty"`
	Spec        *kvcore.LoadSpec  `json:"spec,omitempty"`
	Allocated   bool              `json:"allocated,omitempty"`
	External    int               `json:"external_tokens,omitempty"`
	Table       kvcore.BlockTable `json:"block_table,omitempty"`
	Resolved    bool              `json:"resolved,omitempty"`
	Issued      bool              `json:"issued,omitempty"`
	PendingSeen bool              `json:"pending_seen,omitempty"`
}

// SaveSpan is the token range of one save task (API form).
type SaveSpan struct {
	TaskID      string `json:"task_id"`
	Start       int    `json:"start"`
	End         int    `json:"end"`
	Job         int    `json:"job,omitempty"`
	CoveredLow  int    `json:"covered_low,omitempty"`
	CoveredHigh int    `json:"covered_high,omitempty"`
}

// LoadWait is one multi-rank load that some of its ranks have not reported (API form).
type LoadWait struct {
	TaskID   string           `json:"task_id"`
	Waiting  []kvcore.Rank    `json:"waiting"`
	Errors   []kvcore.BlockID `json:"errors,omitempty"`
	Blocks   []kvcore.BlockID `json:"blocks"`
	Deadline time.Time        `json:"deadline,omitzero"`
}
