package requeststate

import (
	"fmt"
	"time"

	// segmentio's encoding/json: the same JSON as the standard library's
	// for these types (TestStoredFormUnchanged re-encodes a row with every
	// field set byte for byte), at a fraction of the cost; every applied
	// event encodes a tracker and its extras.
	"github.com/segmentio/encoding/json"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// The stored form of a tracker: the JSON the ledger keeps in trackers.tracker
// (and, for the pd child, in trackers.extras). Its field names and values
// are those every row was written with, so rows decode unchanged; the
// in-memory Tracker carries no JSON tags and converts through these
// (toStored, fromStored).

// storedTracker is the store connector's (or the pd child's) request tracker (stored form).
type storedTracker struct {
	EngineID       string               `json:"engine_id"`
	RequestID      string               `json:"request_id"`
	Model          string               `json:"model"`
	Tenant         string               `json:"tenant,omitempty"`
	Connector      string               `json:"connector,omitempty"`
	Remote         *kvcore.RemoteSource `json:"remote,omitempty"`
	Consumer       bool                 `json:"consumer,omitempty"`
	State          TrackerState         `json:"state"`
	Error          string               `json:"error,omitempty"`
	TokenLen       int                  `json:"token_len"`
	PrefillEnd     int                  `json:"prefill_end,omitempty"`
	PromptTokens   int                  `json:"prompt_tokens,omitempty"`
	TailSaved      bool                 `json:"tail_saved,omitempty"`
	Table          kvcore.BlockTable    `json:"block_table"`
	NumSavedTokens int                  `json:"num_saved_tokens"`
	SaveSpans      []storedSpan         `json:"save_spans,omitempty"`
	Unsaved        []storedSpan         `json:"unsaved,omitempty"`
	SaveJobs       int                  `json:"save_jobs,omitempty"`
	Hashes         []string             `json:"block_hashes,omitempty"`
	TokenIDs       []uint32             `json:"token_ids,omitempty"`
	LoraName       string               `json:"lora_name,omitempty"`
	Load           storedLoad           `json:"load"`
	Seq            int                  `json:"seq"`
	Epoch          int                  `json:"epoch,omitempty"`
	PendingSaves   []string             `json:"pending_saves,omitempty"`
	PendingLoads   []string             `json:"pending_loads,omitempty"`
	StaleSaves     []string             `json:"stale_saves,omitempty"`
	StaleLoads     []string             `json:"stale_loads,omitempty"`
	LoadWaits      []storedWait         `json:"load_waits,omitempty"`
	Reports        kvcore.SaveCounts    `json:"save_reports"`
}

// storedLoad is a tracker's LoadSpec state of the current scheduling attempt (stored form).
type storedLoad struct {
	LookedUp    bool              `json:"looked_up,omitempty"`
	Spec        *kvcore.LoadSpec  `json:"spec,omitempty"`
	Allocated   bool              `json:"allocated,omitempty"`
	External    int               `json:"external_tokens,omitempty"`
	Table       kvcore.BlockTable `json:"block_table,omitempty"`
	Resolved    bool              `json:"resolved,omitempty"`
	Issued      bool              `json:"issued,omitempty"`
	PendingSeen bool              `json:"pending_seen,omitempty"`
}

// storedSpan is the token range of one save task (stored form).
type storedSpan struct {
	TaskID      string `json:"task_id"`
	Start       int    `json:"start"`
	End         int    `json:"end"`
	Job         int    `json:"job,omitempty"`
	CoveredLow  int    `json:"covered_low,omitempty"`
	CoveredHigh int    `json:"covered_high,omitempty"`
}

// storedWait is one multi-rank load that some of its ranks have not reported (stored form).
type storedWait struct {
	TaskID  string           `json:"task_id"`
	Waiting []kvcore.Rank    `json:"waiting"`
	Errors  []kvcore.BlockID `json:"errors,omitempty"`
	Blocks  []kvcore.BlockID `json:"blocks"`
	// Deadline is a pointer, omitted when nil, rather than a time with
	// omitzero, which segmentio's encoder does not know: a zero deadline
	// is absent either way.
	Deadline *time.Time `json:"deadline,omitempty"`
}

// toStoredWait is w's stored form.
func toStoredWait(w LoadWait) storedWait {
	s := storedWait{TaskID: w.TaskID, Waiting: w.Waiting, Errors: w.Errors, Blocks: w.Blocks}
	if !w.Deadline.IsZero() {
		s.Deadline = &w.Deadline
	}
	return s
}

// fromStoredWait is the wait s stores.
func fromStoredWait(s storedWait) LoadWait {
	w := LoadWait{TaskID: s.TaskID, Waiting: s.Waiting, Errors: s.Errors, Blocks: s.Blocks}
	if s.Deadline != nil {
		w.Deadline = *s.Deadline
	}
	return w
}

// toStored is t's stored form (the slices it holds are shared, not copied:
// the result is encoded at once).
func toStored(t *Tracker) *storedTracker {
	return &storedTracker{
		EngineID:       t.EngineID,
		RequestID:      t.RequestID,
		Model:          t.Model,
		Tenant:         t.Tenant,
		Connector:      t.Connector,
		Remote:         t.Remote,
		Consumer:       t.Consumer,
		State:          t.State,
		Error:          t.Error,
		TokenLen:       t.TokenLen,
		PrefillEnd:     t.PrefillEnd,
		PromptTokens:   t.PromptTokens,
		TailSaved:      t.TailSaved,
		Table:          t.Table,
		NumSavedTokens: t.NumSavedTokens,
		SaveSpans:      convertSlice(t.SaveSpans, func(s SaveSpan) storedSpan { return storedSpan(s) }),
		Unsaved:        convertSlice(t.Unsaved, func(s SaveSpan) storedSpan { return storedSpan(s) }),
		SaveJobs:       t.SaveJobs,
		Hashes:         t.Hashes,
		TokenIDs:       t.TokenIDs,
		LoraName:       t.LoraName,
		Load:           storedLoad(t.Load),
		Seq:            t.Seq,
		Epoch:          t.Epoch,
		PendingSaves:   t.PendingSaves,
		PendingLoads:   t.PendingLoads,
		StaleSaves:     t.StaleSaves,
		StaleLoads:     t.StaleLoads,
		LoadWaits:      convertSlice(t.LoadWaits, toStoredWait),
		Reports:        t.Reports,
	}
}

// fromStored is the tracker a stored form describes.
func fromStored(s *storedTracker) *Tracker {
	return &Tracker{
		EngineID:       s.EngineID,
		RequestID:      s.RequestID,
		Model:          s.Model,
		Tenant:         s.Tenant,
		Connector:      s.Connector,
		Remote:         s.Remote,
		Consumer:       s.Consumer,
		State:          s.State,
		Error:          s.Error,
		TokenLen:       s.TokenLen,
		PrefillEnd:     s.PrefillEnd,
		PromptTokens:   s.PromptTokens,
		TailSaved:      s.TailSaved,
		Table:          s.Table,
		NumSavedTokens: s.NumSavedTokens,
		SaveSpans:      convertSlice(s.SaveSpans, func(s storedSpan) SaveSpan { return SaveSpan(s) }),
		Unsaved:        convertSlice(s.Unsaved, func(s storedSpan) SaveSpan { return SaveSpan(s) }),
		SaveJobs:       s.SaveJobs,
		Hashes:         s.Hashes,
		TokenIDs:       s.TokenIDs,
		LoraName:       s.LoraName,
		Load:           LoadState(s.Load),
		Seq:            s.Seq,
		Epoch:          s.Epoch,
		PendingSaves:   s.PendingSaves,
		PendingLoads:   s.PendingLoads,
		StaleSaves:     s.StaleSaves,
		StaleLoads:     s.StaleLoads,
		LoadWaits:      convertSlice(s.LoadWaits, fromStoredWait),
		Reports:        s.Reports,
	}
}

// convertSlice converts each element of in with f (nil for nil).
func convertSlice[A, B any](in []A, f func(A) B) []B {
	if in == nil {
		return nil
	}
	out := make([]B, len(in))
	for i, v := range in {
		out[i] = f(v)
	}
	return out
}

// MarshalTracker encodes a tracker for storage (its stored form).
func MarshalTracker(t *Tracker) ([]byte, error) {
	b, err := json.Marshal(toStored(t))
	if err != nil {
		return nil, fmt.Errorf("tracker %s/%s: encode: %w", t.EngineID, t.RequestID, err)
	}
	return b, nil
}

// UnmarshalTracker decodes a stored tracker.
func UnmarshalTracker(b []byte) (*Tracker, error) {
	var s storedTracker
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("tracker: decode: %w", err)
	}
	return fromStored(&s), nil
}

// storedExtras is the stored form of Extras (trackers.extras).
type storedExtras struct {
	// PD is the pd child's tracker, created the first time pd is chosen.
	PD *storedTracker `json:"pd,omitempty"`
	// Decisions are lookup decisions not bound to an allocation yet,
	// oldest first.
	Decisions []contract.LookupDecision `json:"decisions,omitempty"`
	// Held is an allocation waiting for its lookup decision, with the
	// engine events that came after it.
	Held *Held `json:"held,omitempty"`
	// Awaiting is the id of the decision of an allocation applied without
	// it (0 external tokens); when it arrives its LoadSpec is recorded.
	Awaiting string `json:"awaiting_decision,omitempty"`
	// Tasks are the emitted tasks not reported yet.
	Tasks []TaskRef `json:"tasks,omitempty"`
	// Coverage is the saved coverage of each group, as the sender reported it.
	Coverage []GroupCoverage `json:"coverage,omitempty"`
	// Warnings are the latest problems that did not stop the request.
	Warnings []Warning `json:"warnings,omitempty"`
	// Traceparent is the W3C trace context of the request's trace, taken
	// from the first record about the request that carried one: the
	// scheduler continues that trace for the request's records that carry
	// none (an engine that does not trace its requests, a load expiry).
	Traceparent string `json:"traceparent,omitempty"`
}

// MarshalExtras encodes a request's extras for storage (their stored form).
func MarshalExtras(x Extras) ([]byte, error) {
	s := storedExtras{Decisions: x.Decisions, Held: x.Held, Awaiting: x.Awaiting, Tasks: x.Tasks, Coverage: x.Coverage, Warnings: x.Warnings, Traceparent: x.Traceparent}
	if x.PD != nil {
		s.PD = toStored(x.PD)
	}
	b, err := json.Marshal(s)
	if err != nil {
		return nil, fmt.Errorf("extras: encode: %w", err)
	}
	return b, nil
}

// UnmarshalExtras decodes stored extras.
func UnmarshalExtras(b []byte) (Extras, error) {
	var s storedExtras
	if err := json.Unmarshal(b, &s); err != nil {
		return Extras{}, fmt.Errorf("extras: decode: %w", err)
	}
	x := Extras{Decisions: s.Decisions, Held: s.Held, Awaiting: s.Awaiting, Tasks: s.Tasks, Coverage: s.Coverage, Warnings: s.Warnings, Traceparent: s.Traceparent}
	if s.PD != nil {
		x.PD = fromStored(s.PD)
	}
	return x, nil
}

// MarshalLoadWaits encodes load waits in their stored form (the tracker's
// load_waits).
func MarshalLoadWaits(ws []LoadWait) ([]byte, error) {
	b, err := json.Marshal(convertSlice(ws, toStoredWait))
	if err != nil {
		return nil, fmt.Errorf("load waits: encode: %w", err)
	}
	return b, nil
}

// UnmarshalLoadWaits decodes stored load waits (the tracker's load_waits).
func UnmarshalLoadWaits(b []byte) ([]LoadWait, error) {
	var ws []storedWait
	if err := json.Unmarshal(b, &ws); err != nil {
		return nil, fmt.Errorf("load waits: decode: %w", err)
	}
	return convertSlice(ws, fromStoredWait), nil
}
