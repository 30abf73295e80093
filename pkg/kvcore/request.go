package kvcore

// The wire vocabulary of a request's state machine, shared by the engine's
// records (contract.RequestEvent, contract.EngineFeedback), the sender's
// save reports and the scheduler's state machine
// (services/scheduler/requeststate), which owns the rules that apply them.

// SaveStatus is the outcome of one save task, as the sender reports it.
type SaveStatus string

// Save outcomes. Every one of them counts as "reported" for the free.
const (
	// SaveStored: every group was stored (or already present).
	SaveStored SaveStatus = "stored"
	// SaveSkipped: the save was skipped (store pressure).
	SaveSkipped SaveStatus = "skipped"
	// SaveDeadLettered: at least one group was dead-lettered.
	SaveDeadLettered SaveStatus = "dead_lettered"
	// SaveFailed: at least one group failed (e.g. put_failed).
	SaveFailed SaveStatus = "failed"
)

// Valid reports whether s is one of the known save outcomes.
func (s SaveStatus) Valid() bool {
	switch s {
	case SaveStored, SaveSkipped, SaveDeadLettered, SaveFailed:
		return true
	}
	return false
}

// SaveCounts counts a request's reported save outcomes.
type SaveCounts struct {
	// Stored counts saves reported stored.
	Stored int `json:"stored"`
	// Skipped counts saves reported skipped.
	Skipped int `json:"skipped"`
	// DeadLettered counts saves reported dead-lettered.
	DeadLettered int `json:"dead_lettered"`
	// Failed counts saves reported failed.
	Failed int `json:"failed"`
}

// SaveReport is the sender's report of one save task, as the tracker reads
// it: the task's outcome and how many of its keys were neither stored nor
// found present for a cause a later save of the request can cure — skipped
// under store pressure (the store answered "no space", or the request was
// under pressure), failed puts, or dead-lettered exists_failed (the store's
// existence check kept failing: a transient store problem, which vLLM's
// next job retries, as it retries any job whose existence check raised).
// Keys dead-lettered for a permanent cause (an invalid group, a block that
// no longer holds its chunk) are not counted: their dead letter, and an
// operator's replay, is their second chance.
type SaveReport struct {
	// Status is the task's overall outcome.
	Status SaveStatus `json:"status"`
	// Skipped counts the task's keys skipped under store pressure.
	Skipped int `json:"skipped,omitempty"`
	// Failed counts the task's keys whose put failed.
	Failed int `json:"failed,omitempty"`
	// ExistsFailed counts the task's keys dead-lettered exists_failed
	// (ReasonExistsFailed): the sender gave up on the existence check of
	// their group, so it neither stored nor found them.
	ExistsFailed int `json:"exists_failed,omitempty"`
}

// FeedbackKind names a message the scheduler sends to an engine.
type FeedbackKind string

// Feedback kinds.
const (
	// FeedbackFinishedSending: the request's blocks may be freed.
	FeedbackFinishedSending FeedbackKind = "finished_sending"
	// FeedbackFinishedRecving: the request's load is over; LoadErrors lists
	// the blocks the engine must recompute.
	FeedbackFinishedRecving FeedbackKind = "finished_recving"
)

// Feedback is one message to the engine.
type Feedback struct {
	// Kind says what finished.
	Kind FeedbackKind `json:"kind"`
	// EngineID is the engine the message goes to.
	EngineID string `json:"engine_id"`
	// RequestID is the request it concerns.
	RequestID string `json:"request_id"`
	// Immediate is set on finished_sending when nothing had to be waited for
	// (vLLM's request_finished returning "do not delay the free").
	Immediate bool `json:"immediate,omitempty"`
	// LoadErrors lists, on finished_recving, the block ids whose load failed.
	LoadErrors []BlockID `json:"load_errors,omitempty"`
	// TaskID names, on finished_recving, the load task that finished ("" when
	// no load was issued: the load was abandoned before a task existed).
	TaskID string `json:"task_id,omitempty"`
	// Epoch is the request's allocation epoch the message belongs to (absent:
	// 0). On finished_recving it is the load task's epoch, which is always
	// the current one: a load of an older epoch never yields feedback.
	Epoch int `json:"epoch,omitempty"`
	// MissingRanks lists, on finished_recving of a multi-rank load, the
	// worker ranks that never reported (Tracker.ExpireLoads): every block of
	// the load is then in LoadErrors.
	MissingRanks []Rank `json:"missing_ranks,omitempty"`
}

// StepKind says how one engine step saw a request.
type StepKind string

// Step kinds.
const (
	// StepNew: newly scheduled; Tokens and the full scheduled Table.
	StepNew StepKind = "new"
	// StepRunning: already running; Table holds the new block ids per group
	// (nil: none) and Tokens the token count after the step.
	StepRunning StepKind = "running"
	// StepResumed: resumed after preemption; Table replaces the tracker's,
	// and the request saves again from token 0. For a running request (a
	// preemption the tracker did not see) it first applies the preemption:
	// the allocation epoch advances and the saved offset returns to 0.
	StepResumed StepKind = "resumed"
	// StepDecode: a running request in its decode phase; like StepRunning,
	// but a decode step never saves.
	StepDecode StepKind = "decode"
	// StepPendingLoad: allocated but not scheduled this step (waiting for
	// its external KV).
	StepPendingLoad StepKind = "pending_load"
	// StepPreempted: preempted; the tracker is reset (the saved offset to
	// 0), load state dropped, the allocation epoch advances and the
	// outstanding tasks become stale.
	StepPreempted StepKind = "preempted"
	// StepFinished: the request finished (vLLM's request_finished).
	StepFinished StepKind = "finished"
)

// Step is one engine step's input for one request.
type Step struct {
	// Kind says how the step saw the request.
	Kind StepKind `json:"kind"`
	// Tokens is the request's token count once the step has run
	// (computed plus scheduled tokens).
	Tokens int `json:"tokens,omitempty"`
	// Table is the scheduled block table (new, resumed) or the new block ids
	// per group (running, decode; nil when no block was added). Its group
	// count must equal the model's; an empty non-nil table has zero groups.
	Table BlockTable `json:"block_table"`
	// Hashes is the request's hash chain so far (hex); it may be omitted.
	Hashes []string `json:"block_hashes,omitempty"`
	// PrefillTokens is, on new and resumed steps, the end of the request's
	// prefill range: vLLM's prefill_end_tokens, the prompt for a fresh
	// request and, for one resumed after a preemption, every token it had
	// (prompt plus generated), since all of them are prefilled again
	// (0: not given — a new step keeps the admission's prompt length, a
	// resumed one takes max(prompt length, Tokens)). Tokens past it are
	// decode tokens and are not saved.
	PrefillTokens int `json:"prefill_tokens,omitempty"`
}
