package requeststate

import (
	"fmt"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// TrackerState is the lifecycle state of a request tracker.
type TrackerState string

// The states of a request tracker.
const (
	// StateWaiting: known (looked up, allocated) but never scheduled.
	StateWaiting TrackerState = "waiting"
	// StateRunning: scheduled; the tracker holds the scheduled block table.
	StateRunning TrackerState = "running"
	// StatePreempted: preempted; the tracker was reset and holds no table.
	StatePreempted TrackerState = "preempted"
	// StateFinishing: finished; the free waits for outstanding saves.
	StateFinishing TrackerState = "finishing"
	// StateDone: finished and freed (finished_sending was reported).
	StateDone TrackerState = "done"
	// StateErrored: a malformed input (e.g. a block table whose group count
	// differs from the model's) stopped the request; it emits no more tasks.
	StateErrored TrackerState = "errored"
)

// DefaultTrackerConnector is the connector name a tracker puts on its load
// tasks unless Tracker.Connector says otherwise.
const DefaultTrackerConnector = "store"

// SaveSpan is the token range [Start, End) of one save task.
type SaveSpan struct {
	// TaskID is the save task.
	TaskID string
	// Start is the first token the task saves.
	Start int
	// End is the token the task saves up to (exclusive).
	End int
	// Job is, on a pending save, the store job of the current epoch the
	// task runs as (Tracker.SaveJobs): a step's save and its prompt-tail
	// save share one, and a re-save runs as the job after its failed
	// task's (0: a tracker stored before jobs were counted).
	Job int
	// CoveredLow and CoveredHigh count, on a pending save, the tokens at
	// the start and at the end of its range that a save emitted after it
	// covers again (Tracker.markCovered): if the task leaves its range
	// unsaved, only [Start+CoveredLow, End-CoveredHigh) is saved again.
	CoveredLow  int
	CoveredHigh int
}

// uncovered is the part of a pending save's range that no save emitted
// after it covers again (empty when lo >= hi).
func (s SaveSpan) uncovered() (lo, hi int) {
	return s.Start + s.CoveredLow, s.End - s.CoveredHigh
}

// Effects is what one tracker event asks the caller to do. The tracker does
// nothing itself; the caller persists the tracker and publishes the effects.
type Effects struct {
	// Saves are save tasks to publish.
	Saves []kvcore.SaveTask
	// Loads are load tasks to publish.
	Loads []kvcore.LoadTask
	// Feedback are messages to the engine.
	Feedback []kvcore.Feedback
	// Drop is set when the tracker has nothing left to do and may be deleted.
	Drop bool
	// Err reports a problem with the event, wrapping a sentinel error. When
	// the problem stopped the request, the tracker is in StateErrored.
	Err error
	// Failed is set when this call moved the request to StateErrored (Err
	// says why); a request errored before keeps it unset.
	Failed bool
}

// LoadState is the tracker's view of the store connector's LoadSpec for the
// current scheduling attempt (lookup, then allocation, in either order).
type LoadState struct {
	// LookedUp is set once the lookup decision arrived.
	LookedUp bool
	// Spec is the lookup's LoadSpec (nil: the lookup kept none).
	Spec *kvcore.LoadSpec
	// Allocated is set once the allocation arrived.
	Allocated bool
	// External is the external-token count the allocation gave this connector.
	External int
	// Table is the allocation's block table, kept only while an accepted
	// load may still be issued from it. It never feeds a save.
	Table kvcore.BlockTable
	// Resolved is set once lookup and allocation were matched: Spec.CanLoad
	// is then final.
	Resolved bool
	// Issued is set once the load was emitted (or abandoned and reported).
	Issued bool
	// PendingSeen is set once a step listed the request as a pending load.
	PendingSeen bool
}

// canIssue reports whether an accepted load is waiting to be issued.
func (l *LoadState) canIssue() bool {
	return l.Resolved && !l.Issued && l.Spec != nil && l.Spec.CanLoad
}

// expecting reports whether the allocation promised external tokens that no
// load has covered yet (blocks that must not be saved before they are loaded).
func (l *LoadState) expecting() bool {
	return l.Allocated && l.External > 0 && !l.Issued
}

// Tracker is the scheduler-side state of one request for the store
// connector: a plain value, persisted as JSON between events. Drive it with
// OnAdmit, OnLookup, OnAllocate, Step, OnSaveResult (or OnSaveReport) and
// OnLoadResult; each returns the Effects to carry out.
//
// Saved offset and re-saves, as vLLM's MooncakeStore connector moves them
// (vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/,
// data.py ReqMeta.from_request_tracker and worker.py
// KVCacheStoreSendingThread._handle_request): NumSavedTokens, vLLM's
// scheduler-side num_saved_tokens, advances when a save is emitted, and a
// save is emitted only when it reaches a new full block. vLLM's sending
// thread runs a request's jobs one after another and starts each job, when
// it runs, at the request's high-water mark of tokens actually persisted
// (_saved_offset, advanced by _record_saved only on success), so the job
// after a failed one covers the failed range again — even a job queued
// before the failure. A save reported not persisted (SaveReport: keys
// skipped under store pressure, failed puts, or dead-lettered
// exists_failed) is therefore not counted as saved. If a later step's save
// was already emitted (the failed task's Job is below SaveJobs: vLLM's next
// job was already queued), the part of its range that no save emitted after
// it covers again (SaveSpan.CoveredLow, CoveredHigh) is saved again at once
// by a re-save task running as the next job (OnSaveReport); a re-save that
// fails is saved again the same way while later jobs remain, so a range is
// tried at most once per job, as in vLLM. Otherwise (the failed task was
// the latest job) the range joins Unsaved and the request's next save
// starts at the lowest unsaved token instead of at NumSavedTokens. What the
// earlier saves did store is then found present and not put again.
//
// Preemption (scheduler.py build_connector_meta, RequestTracker.reset,
// worker.py _close_ended_store_requests): the engine freed the request's
// blocks, so the tracker is reset and the saved offset returns to 0; the
// resumed request saves from the start of its new table (the chunks earlier
// saves stored are found present). Its prefill range is the resumed step's
// (Step.PrefillTokens: the prompt plus the tokens generated before the
// preemption, all re-prefilled), so it saves past its original prompt.
//
// Allocation epoch: Epoch counts the times the engine released the
// request's blocks while the request lived on (a preemption; a resumed step
// the tracker did not see preempted; a sequence gap, FailClosed). Every task
// carries the epoch it was emitted in. At each advance the outstanding
// tasks move to StaleSaves and StaleLoads: their results only settle them —
// they are counted in Reports, but never emit finished_recving, never
// complete the current attempt's load, never hold finished_sending, never
// mark a range unsaved and never block a save of the new epoch.
type Tracker struct {
	// EngineID is the engine that owns the request.
	EngineID string
	// RequestID is the engine's request id.
	RequestID string
	// Model is the model name (Model.Name); events for another model are refused.
	Model string
	// Tenant is the request's tenant (ValidateTenant; absent: none), as
	// the engine admitted it: every task the tracker emits carries it, so
	// the request's keys are its tenant's. The caller sets it at admission.
	Tenant string
	// Connector names the connector on load tasks ("" means DefaultTrackerConnector).
	// A tracker of another connector prefixes its task ids' kind with the
	// connector's name ("pd-load"), so two trackers of one request never
	// emit the same task id.
	Connector string
	// Remote, when set, is copied into every load task the tracker emits:
	// the blocks come from another engine's pool (a disaggregated-prefill
	// source) instead of the store pool.
	Remote *kvcore.RemoteSource
	// Consumer is set for the kv_consumer role: the request never saves.
	Consumer bool
	// State is the lifecycle state.
	State TrackerState
	// Error says why the request is in StateErrored.
	Error string
	// TokenLen is the number of tokens computed once the last step ran.
	TokenLen int
	// PrefillEnd is the prompt length (0: unknown); tokens past it are
	// decode tokens and are not saved.
	PrefillEnd int
	// PromptTokens is the prompt length the engine admitted the request
	// with (0: unknown), vLLM's request.num_prompt_tokens: the sub-block
	// prompt tail is stored at its last hash boundary (maybeSaveTail). Unlike
	// PrefillEnd it does not grow when a resumed request re-prefills the
	// tokens it generated.
	PromptTokens int
	// TailSaved is set once the current epoch emitted the request's
	// sub-block prompt-tail save (or found it due past its block): it is
	// emitted at most once per epoch.
	TailSaved bool
	// Table is the scheduled block table, one list per group. It is only
	// ever set from a table whose group count equals the model's.
	Table kvcore.BlockTable
	// NumSavedTokens is the saved offset: tokens covered by the current
	// epoch's emitted saves (vLLM's num_saved_tokens).
	NumSavedTokens int
	// SaveSpans are the token ranges of the PendingSaves, so a report can
	// say which range was not persisted.
	SaveSpans []SaveSpan
	// Unsaved are the current epoch's save ranges reported not persisted
	// (SaveReport) that no save emitted since covers again; the next save
	// starts at the lowest of them.
	Unsaved []SaveSpan
	// SaveJobs counts the current epoch's store jobs: the steps that
	// emitted a save of full blocks (a prompt-tail save alone is no job:
	// vLLM's offload-only job saves no range, token_len_chunk 0). A save
	// reported not persisted whose Job is below it is saved again at once.
	SaveJobs int
	// Hashes is the request's hash chain (hex), one per hash block.
	Hashes []string
	// TokenIDs are the prompt's tokens of complete hash blocks, as the
	// engine admitted them (OnAdmitTokens; nil: none given, or the
	// operator dropped them): every save task carries those its chain
	// covers, for the token ids of its BlockStored events. Only grows.
	TokenIDs []uint32
	// LoraName is the LoRA adapter the engine serves the request with
	// ("": none), put on every save task (BlockStored lora_name).
	LoraName string
	// Load is the LoadSpec state of the current scheduling attempt.
	Load LoadState
	// Seq numbers the tasks the tracker emitted; task ids derive from it.
	Seq int
	// Epoch is the allocation epoch (see the type's documentation).
	Epoch int
	// PendingSaves are the ids of the current epoch's saves not yet reported.
	PendingSaves []string
	// PendingLoads are the ids of the current epoch's loads not yet reported.
	PendingLoads []string
	// StaleSaves are the ids of earlier epochs' saves not yet reported.
	StaleSaves []string
	// StaleLoads are the ids of earlier epochs' loads not yet reported.
	StaleLoads []string
	// LoadWaits are the loads of a multi-rank engine (pending or stale) that
	// not every rank has reported yet.
	LoadWaits []LoadWait
	// Reports counts the reported save outcomes.
	Reports kvcore.SaveCounts
}

// LoadWait is one load task of a multi-rank engine that some of its ranks
// have not reported: the load is finished when the last rank reports, with
// the union of every rank's load errors.
type LoadWait struct {
	// TaskID is the load task.
	TaskID string
	// Waiting are the ranks that have not reported.
	Waiting []kvcore.Rank
	// Errors is the union of the reported ranks' load errors.
	Errors []kvcore.BlockID
	// Blocks are every block the task loads into: the load errors of a rank
	// that never reports.
	Blocks []kvcore.BlockID
	// Deadline is when the caller gives up on the waiting ranks
	// (ExpireLoads). The tracker never reads a clock: the scheduler stamps
	// a zero Deadline when it persists the tracker.
	Deadline time.Time
}

// NewTracker starts the tracker of one request of model m.
func NewTracker(m *kvcore.Model, engineID, requestID string) *Tracker {
	return &Tracker{EngineID: engineID, RequestID: requestID, Model: m.Name, State: StateWaiting}
}

// Finished reports whether the request has finished (freed or waiting for
// its saves).
func (t *Tracker) Finished() bool { return t.State == StateFinishing || t.State == StateDone }

// extendHashes adopts a longer hash chain. The chain only grows: elements
// already held are never rewritten, so a task's copy stays consistent.
func (t *Tracker) extendHashes(h []string) {
	if len(h) > len(t.Hashes) {
		t.Hashes = append(t.Hashes, h[len(t.Hashes):]...)
	}
}

// checkModel refuses an event driven with another model than the tracker's.
func (t *Tracker) checkModel(m *kvcore.Model) error {
	if m == nil {
		return fmt.Errorf("request %s/%s: no model: %w", t.EngineID, t.RequestID, kvcore.ErrUnknownModel)
	}
	if t.Model != m.Name {
		return fmt.Errorf("request %s/%s: tracker of model %q driven with %q: %w", t.EngineID, t.RequestID, t.Model, m.Name, kvcore.ErrUnknownModel)
	}
	return nil
}

// fail moves the request to StateErrored. An allocation that promised
// external tokens is answered with finished_recving listing every block as
// a load error, so the engine recomputes instead of waiting forever.
func (t *Tracker) fail(eff *Effects, err error, table kvcore.BlockTable) {
	eff.Failed = t.State != StateErrored
	t.State = StateErrored
	t.Error = err.Error()
	eff.Err = fmt.Errorf("request %s/%s: %w", t.EngineID, t.RequestID, err)
	if t.Load.expecting() {
		t.abandonLoad(eff, table)
	}
}

// FailClosed stops the request for a problem the caller found outside the
// tracker's own inputs: an engine-event sequence gap, after which the
// tracker's block table may be wrong. The request moves to StateErrored and
// emits no more tasks; an expected load is answered with finished_recving
// listing every block in error; and the allocation epoch advances, so the
// saves in flight become stale: they no longer hold finished_sending (the
// engine may already have released the blocks they read, which the
// gpuworker's identity check then refuses to read). Loads in flight stay
// current: the engine still waits for their finished_recving. A request
// already errored or finished only gets Err.
func (t *Tracker) FailClosed(err error) Effects {
	var eff Effects
	if t.State == StateErrored || t.Finished() {
		eff.Err = fmt.Errorf("request %s/%s: %w", t.EngineID, t.RequestID, err)
		return t.settle(&eff)
	}
	t.fail(&eff, err, nil)
	t.retireSaves()
	t.Epoch++
	return t.settle(&eff)
}

// newEpoch advances the allocation epoch after the engine released the
// request's blocks: every outstanding task becomes stale. The saved offset
// is left to the caller: a preemption resets it (release), a sequence gap
// (FailClosed) stops the request.
func (t *Tracker) newEpoch() {
	t.retireSaves()
	t.StaleLoads = append(t.StaleLoads, t.PendingLoads...)
	t.PendingLoads = nil
	t.Epoch++
}

// release applies a preemption: the allocation epoch advances and the saved
// offset returns to 0, so the resumed request saves from the start of its
// new table, as vLLM's does (scheduler.py build_connector_meta builds a
// resumed request's tracker with num_saved_tokens=0; worker.py
// _close_ended_store_requests drops the preempted request's resume offset).
func (t *Tracker) release() {
	t.newEpoch()
	t.NumSavedTokens = 0
	t.TailSaved = false
}

// retireSaves moves the pending saves to the stale ones; their ranges and
// the unsaved ones belong to the old epoch's blocks and are dropped, and
// the new epoch counts its store jobs from 0.
func (t *Tracker) retireSaves() {
	t.StaleSaves = append(t.StaleSaves, t.PendingSaves...)
	t.PendingSaves = nil
	t.SaveSpans = nil
	t.Unsaved = nil
	t.SaveJobs = 0
}

// abandonLoad reports an expected load as finished with every block of
// table in error, and marks it issued so it is never emitted later.
func (t *Tracker) abandonLoad(eff *Effects, table kvcore.BlockTable) {
	t.Load.Issued = true
	if table == nil {
		table = t.Load.Table
	}
	t.Load.Table = nil
	eff.Feedback = append(eff.Feedback, kvcore.Feedback{
		Kind: kvcore.FeedbackFinishedRecving, EngineID: t.EngineID, RequestID: t.RequestID,
		LoadErrors: nonNegativeBlocks(table), Epoch: t.Epoch,
	})
}

// nonNegativeBlocks lists the block ids >= 0 of a table, group by group
// (the tracker core's own rule; liveBlocks drops only kvcore.NullBlock).
func nonNegativeBlocks(table kvcore.BlockTable) []kvcore.BlockID {
	out := []kvcore.BlockID{}
	for _, g := range table {
		for _, b := range g {
			if b >= 0 {
				out = append(out, b)
			}
		}
	}
	return out
}

// settle sets Drop when the tracker has nothing left to wait for, stale
// tasks included (their results are still counted).
func (t *Tracker) settle(eff *Effects) Effects {
	eff.Drop = t.State == StateDone && len(t.PendingSaves) == 0 && len(t.PendingLoads) == 0 &&
		len(t.StaleSaves) == 0 && len(t.StaleLoads) == 0 && len(t.LoadWaits) == 0
	return *eff
}

// removeID deletes id from ids, reporting whether it was there.
func removeID(ids []string, id string) ([]string, bool) {
	for i, v := range ids {
		if v == id {
			return append(ids[:i], ids[i+1:]...), true
		}
	}
	return ids, false
}

// unsaved reports whether some of the task's range was not persisted for a
// cause a later save can cure. A report without key counts says so by its
// status alone (skipped or failed; dead_lettered alone is a permanent cause).
func unsaved(r kvcore.SaveReport) bool {
	return r.Skipped > 0 || r.Failed > 0 || r.ExistsFailed > 0 || r.Status == kvcore.SaveSkipped || r.Status == kvcore.SaveFailed
}

// countReport counts one report in c.
func countReport(c *kvcore.SaveCounts, s kvcore.SaveStatus) {
	switch s {
	case kvcore.SaveStored:
		c.Stored++
	case kvcore.SaveSkipped:
		c.Skipped++
	case kvcore.SaveDeadLettered:
		c.DeadLettered++
	case kvcore.SaveFailed:
		c.Failed++
	}
}
