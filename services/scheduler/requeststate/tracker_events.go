package requeststate

import (
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Step applies one engine step to the request.
func (t *Tracker) Step(m *kvcore.Model, s kvcore.Step) Effects {
	var eff Effects
	if err := t.checkModel(m); err != nil {
		eff.Err = err
		return eff
	}
	if !t.accepts(s.Kind, &eff) {
		return t.settle(&eff)
	}
	switch s.Kind {
	case kvcore.StepFinished:
		t.finish(&eff)
	case kvcore.StepPreempted:
		t.preempt()
	case kvcore.StepPendingLoad:
		t.pending(m, &eff)
	case kvcore.StepNew, kvcore.StepResumed:
		t.schedule(m, s, &eff)
	case kvcore.StepRunning, kvcore.StepDecode:
		t.advance(m, s, &eff)
	default:
		eff.Err = fmt.Errorf("request %s/%s: step kind %q: %w", t.EngineID, t.RequestID, s.Kind, kvcore.ErrUnknownStep)
	}
	return t.settle(&eff)
}

// accepts filters steps by lifecycle: a finished request takes only a
// (repeated, ignored) finish; an errored one only its finish.
func (t *Tracker) accepts(k kvcore.StepKind, eff *Effects) bool {
	if t.Finished() {
		if k != kvcore.StepFinished {
			eff.Err = fmt.Errorf("request %s/%s: %s step: %w", t.EngineID, t.RequestID, k, kvcore.ErrRequestFinished)
		}
		return false
	}
	return t.State != StateErrored || k == kvcore.StepFinished
}

// schedule handles a new or resumed request: the tracker is rebuilt from
// the scheduled tokens and the scheduled block table, as vLLM's
// build_connector_meta builds a RequestTracker for scheduled_new_reqs and
// for resumed_req_ids (scheduler.py): a resumed request saves from token 0
// (its saved offset was reset at the preemption, or is reset now for a
// preemption the tracker did not see) up to its new prefill end. An
// accepted load not yet issued is issued now, and then nothing is saved
// this step.
func (t *Tracker) schedule(m *kvcore.Model, s kvcore.Step, eff *Effects) {
	if s.Tokens < 0 || s.PrefillTokens < 0 {
		t.fail(eff, fmt.Errorf("%s step with %d tokens, %d prefill tokens: %w", s.Kind, s.Tokens, s.PrefillTokens, kvcore.ErrNegativeCount), s.Table)
		return
	}
	if err := checkGroups(m, s.Table, string(s.Kind)+" step block table"); err != nil {
		t.fail(eff, err, s.Table)
		return
	}
	resumed := s.Kind == kvcore.StepResumed || t.State == StatePreempted
	if s.Kind == kvcore.StepResumed && t.State == StateRunning {
		t.release()
	}
	t.State = StateRunning
	t.Table = s.Table.Clone()
	t.TokenLen = s.Tokens
	t.setPrefillEnd(s, resumed)
	t.extendHashes(s.Hashes)
	if t.Load.canIssue() {
		t.emitLoad(m, t.Table, eff)
		return
	}
	t.maybeSave(m, eff)
}

// setPrefillEnd takes a scheduled step's prefill range. vLLM snapshots
// prefill_end_tokens when it builds the tracker (scheduler.py
// build_connector_meta: len(prefill tokens) for a new request,
// len(all_token_ids) for a resumed one), so a resumed request keeps saving
// past its original prompt. Without PrefillTokens a resumed request's range
// is at least the tokens this step computed.
func (t *Tracker) setPrefillEnd(s kvcore.Step, resumed bool) {
	switch {
	case s.PrefillTokens > 0:
		t.PrefillEnd = s.PrefillTokens
	case resumed && t.PrefillEnd > 0:
		t.PrefillEnd = max(t.PrefillEnd, s.Tokens)
	}
}

// advance handles a running or decode step: new block ids are appended per
// group; a running step saves, a decode step does not.
func (t *Tracker) advance(m *kvcore.Model, s kvcore.Step, eff *Effects) {
	if t.State != StateRunning {
		t.fail(eff, fmt.Errorf("%s step for a %s request: %w", s.Kind, t.State, kvcore.ErrBadStep), nil)
		return
	}
	if s.Table != nil {
		if err := checkGroups(m, s.Table, string(s.Kind)+" step new block ids"); err != nil {
			t.fail(eff, err, nil)
			return
		}
		for g := range t.Table {
			t.Table[g] = append(t.Table[g], s.Table[g]...)
		}
	}
	if s.Tokens > t.TokenLen {
		t.TokenLen = s.Tokens
	}
	t.extendHashes(s.Hashes)
	if s.Kind == kvcore.StepRunning {
		t.maybeSave(m, eff)
	}
}

// pending handles a request allocated but not scheduled this step: the
// load is issued only if it was accepted (CanLoad). kvmesh fix: a rejected
// load emits nothing — in particular never a save.
func (t *Tracker) pending(m *kvcore.Model, eff *Effects) {
	if t.State == StateRunning {
		eff.Err = fmt.Errorf("request %s/%s: pending-load step for a running request: %w", t.EngineID, t.RequestID, kvcore.ErrBadStep)
		return
	}
	t.Load.PendingSeen = true
	if t.Load.canIssue() {
		t.emitLoad(m, t.Load.Table, eff)
	}
}

// preempt resets the tracker and drops its load state (vLLM's
// RequestTracker.reset at preempted_req_ids in build_connector_meta). The
// engine freed the request's blocks, so the allocation epoch advances: the
// outstanding tasks become stale, and the saved offset returns to 0
// (release). The prompt length stays until the resumed step names the new
// prefill range.
func (t *Tracker) preempt() {
	t.release()
	t.State = StatePreempted
	t.Table = nil
	t.TokenLen = 0
	t.Load = LoadState{}
}

// finish is vLLM's request_finished: with no scheduled tracker, the
// consumer role, or no save of the current epoch outstanding, the blocks
// are freed now (finished_sending, Immediate); otherwise the free waits for
// the last of them to be reported. Stale saves never hold the free: the
// blocks they read were released at their epoch's end.
func (t *Tracker) finish(eff *Effects) {
	t.Load.Table = nil
	scheduled := t.State == StateRunning || t.State == StateErrored
	if t.Consumer || !scheduled || len(t.PendingSaves) == 0 {
		t.State = StateDone
		eff.Feedback = append(eff.Feedback, t.finishedSending(true))
		return
	}
	t.State = StateFinishing
}

// finishedSending is the feedback that frees the request's blocks.
func (t *Tracker) finishedSending(immediate bool) kvcore.Feedback {
	return kvcore.Feedback{Kind: kvcore.FeedbackFinishedSending, EngineID: t.EngineID, RequestID: t.RequestID, Immediate: immediate, Epoch: t.Epoch}
}

// OnSaveResult records the sender's report for one save task by its status
// alone and without the model (OnSaveReport's rules, without key counts:
// skipped or failed mark the task's range unsaved). Without the model no
// re-save can be built: a range a later job would have covered again joins
// Unsaved, for the request's next save, instead.
func (t *Tracker) OnSaveResult(taskID string, status kvcore.SaveStatus) Effects {
	return t.onSaveReport(nil, taskID, kvcore.SaveReport{Status: status})
}

// OnSaveReport records the sender's report for one save task of model m.
// Every outcome counts as reported; when the last outstanding save of the
// current epoch of a finishing request is reported, finished_sending is
// emitted. A current save reported not persisted (SaveReport: keys skipped,
// failed or dead-lettered exists_failed) is not counted as saved, as vLLM's
// sending thread counts a job saved only on success (worker.py
// KVCacheStoreSendingThread._handle_request, _record_saved) and starts the
// next job at the persisted offset: the part of its range no later save
// covers again is saved again (resave) — at once by a re-save task when a
// later store job was already emitted (vLLM's next job, already queued,
// would cover it), else by the request's next save (Unsaved). A stale save
// (an earlier epoch's) is only settled and counted: its range belongs to
// blocks the engine released. Unknown or repeated task ids (redelivery)
// change nothing.
func (t *Tracker) OnSaveReport(m *kvcore.Model, taskID string, r kvcore.SaveReport) Effects {
	if err := t.checkModel(m); err != nil {
		return Effects{Err: err}
	}
	return t.onSaveReport(m, taskID, r)
}

// onSaveReport is OnSaveReport; m is nil for OnSaveResult.
func (t *Tracker) onSaveReport(m *kvcore.Model, taskID string, r kvcore.SaveReport) Effects {
	var eff Effects
	status := r.Status
	if !status.Valid() {
		eff.Err = fmt.Errorf("request %s/%s: save %s: status %q: %w", t.EngineID, t.RequestID, taskID, status, kvcore.ErrUnknownSaveStatus)
		return eff
	}
	var found bool
	if t.StaleSaves, found = removeID(t.StaleSaves, taskID); found {
		countReport(&t.Reports, status)
		return t.settle(&eff)
	}
	if t.PendingSaves, found = removeID(t.PendingSaves, taskID); !found {
		return t.settle(&eff)
	}
	countReport(&t.Reports, status)
	span := t.takeSpan(taskID)
	if unsaved(r) {
		t.resave(m, span, &eff)
	}
	if t.State == StateFinishing && len(t.PendingSaves) == 0 {
		t.State = StateDone
		eff.Feedback = append(eff.Feedback, t.finishedSending(false))
	}
	return t.settle(&eff)
}

// takeSpan removes and returns the range of a pending save. A save pending
// without a range (a tracker stored before ranges were kept) is taken to
// cover everything emitted, [0, NumSavedTokens), as the latest job: the
// request's next save covers it again.
func (t *Tracker) takeSpan(taskID string) SaveSpan {
	i := slices.IndexFunc(t.SaveSpans, func(s SaveSpan) bool { return s.TaskID == taskID })
	if i < 0 {
		return SaveSpan{TaskID: taskID, End: t.NumSavedTokens, Job: t.SaveJobs}
	}
	s := t.SaveSpans[i]
	t.SaveSpans = slices.Delete(t.SaveSpans, i, i+1)
	return s
}

// OnLoadResult records a gpuworker's report for one load task of a
// single-rank engine (OnRankLoadResult with no rank).
func (t *Tracker) OnLoadResult(taskID string, loadErrorBlocks []kvcore.BlockID) Effects {
	return t.OnRankLoadResult(taskID, nil, loadErrorBlocks)
}

// OnRankLoadResult records one rank's report for a load task and, once
// the task is finished, emits finished_recving, naming the task, with the
// blocks whose load failed (the engine recomputes them). A load issued to
// several ranks (LoadTask.Ranks) is finished when every one of them has
// reported, with the union of their load errors; a report from a rank the
// task does not wait for (a repeat, an unknown rank, or none) changes
// nothing. A stale load (an earlier epoch's) is only settled: its
// finished_recving could complete the current attempt's load. Unknown or
// repeated task ids change nothing.
func (t *Tracker) OnRankLoadResult(taskID string, rank *kvcore.Rank, loadErrorBlocks []kvcore.BlockID) Effects {
	var eff Effects
	if i := t.LoadWait(taskID); i >= 0 {
		w := &t.LoadWaits[i]
		j := -1
		if rank != nil {
			j = slices.Index(w.Waiting, *rank)
		}
		if j < 0 {
			return t.settle(&eff)
		}
		w.Waiting = slices.Delete(w.Waiting, j, j+1)
		w.Errors = unionBlocks(w.Errors, loadErrorBlocks)
		if len(w.Waiting) > 0 {
			return t.settle(&eff)
		}
		loadErrorBlocks = w.Errors
		t.LoadWaits = slices.Delete(t.LoadWaits, i, i+1)
	}
	t.finishLoad(&eff, taskID, loadErrorBlocks, nil)
	return t.settle(&eff)
}

// ExpireLoads finishes the multi-rank loads that expired says are overdue
// (nil: every one) — some of their ranks never reported, their gpuworkers
// gone or stuck — failing closed: every block of such a load is a load
// error, and finished_recving names the missing ranks. A stale load is only
// settled.
func (t *Tracker) ExpireLoads(expired func(LoadWait) bool) Effects {
	var eff Effects
	waits := t.LoadWaits
	t.LoadWaits = nil
	for _, w := range waits {
		if expired != nil && !expired(w) {
			t.LoadWaits = append(t.LoadWaits, w)
			continue
		}
		t.finishLoad(&eff, w.TaskID, unionBlocks(slices.Clone(w.Errors), w.Blocks), w.Waiting)
	}
	return t.settle(&eff)
}

// finishLoad retires a finished load: a stale one silently, a current one
// with finished_recving.
func (t *Tracker) finishLoad(eff *Effects, taskID string, loadErrorBlocks []kvcore.BlockID, missing []kvcore.Rank) {
	var found bool
	if t.StaleLoads, found = removeID(t.StaleLoads, taskID); found {
		return
	}
	if t.PendingLoads, found = removeID(t.PendingLoads, taskID); !found {
		return
	}
	eff.Feedback = append(eff.Feedback, kvcore.Feedback{
		Kind: kvcore.FeedbackFinishedRecving, EngineID: t.EngineID, RequestID: t.RequestID,
		LoadErrors: append([]kvcore.BlockID{}, loadErrorBlocks...), TaskID: taskID, Epoch: t.Epoch,
		MissingRanks: slices.Clone(missing),
	})
}

// LoadWait is the index of taskID's wait in LoadWaits, or -1 when the
// load waits for no rank.
func (t *Tracker) LoadWait(taskID string) int {
	return slices.IndexFunc(t.LoadWaits, func(w LoadWait) bool { return w.TaskID == taskID })
}

// unionBlocks appends the blocks of add not already in have, in order.
func unionBlocks(have, add []kvcore.BlockID) []kvcore.BlockID {
	for _, b := range add {
		if !slices.Contains(have, b) {
			have = append(have, b)
		}
	}
	return have
}
