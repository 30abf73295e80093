package requeststate

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// checkGroups refuses a block table whose group count is not the model's.
// Every table a task is built from passes through it.
func checkGroups(m *kvcore.Model, table kvcore.BlockTable, what string) error {
	if len(table) != len(m.Groups) {
		return fmt.Errorf("%s has %d group(s), model %q has %d: %w", what, len(table), m.Name, len(m.Groups), kvcore.ErrGroupCount)
	}
	return nil
}

// chunksFit checks that every chunk of groups lies inside table and hashes.
func chunksFit(m *kvcore.Model, table kvcore.BlockTable, hashes []string, groups []kvcore.GroupChunks) error {
	for _, gc := range groups {
		bs := m.Groups[gc.Group].BlockSize
		for _, c := range gc.Chunks {
			if bi := c.BlockIndex(bs); bi >= len(table[gc.Group]) {
				return fmt.Errorf("group %d chunk [%d,%d) needs block %d of %d: %w", gc.Group, c.Start, c.End, bi, len(table[gc.Group]), kvcore.ErrChunkOutOfRange)
			}
			if hi := c.HashIndex(m.HashBlockSize); hi >= len(hashes) {
				return fmt.Errorf("group %d chunk [%d,%d) needs hash %d of %d: %w", gc.Group, c.Start, c.End, hi, len(hashes), kvcore.ErrChunkOutOfRange)
			}
		}
	}
	return nil
}

// maybeSave emits the save of full scheduler blocks up to the aligned end
// when the end passed the saved offset (a new full block; vLLM's
// ReqMeta.from_request_tracker skips the save otherwise), then the
// request's sub-block prompt tail when it is due (maybeSaveTail). The save
// starts at the saved offset, or at the lowest range reported unsaved,
// which it covers again (saveStart). It never saves for the consumer role,
// for a request not running, or while a load of the request is expected or
// outstanding (its blocks are not filled yet: canSave).
func (t *Tracker) maybeSave(m *kvcore.Model, eff *Effects) {
	if t.State != StateRunning || !t.canSave() {
		return
	}
	t.maybeSaveSteps(m, eff)
	if t.State == StateRunning {
		t.maybeSaveTail(m, eff)
	}
}

// canSave reports whether the request's blocks may be read for a save now:
// never for the consumer role, nor while a load of the request is expected
// or outstanding.
func (t *Tracker) canSave() bool {
	return !t.Consumer && !t.Load.expecting() && len(t.PendingLoads) == 0
}

// maybeSaveSteps emits the save of full scheduler blocks (maybeSave): a
// new store job of the epoch (SaveJobs).
func (t *Tracker) maybeSaveSteps(m *kvcore.Model, eff *Effects) {
	end, hashLimited := t.saveEnd(m)
	if hashLimited {
		eff.Err = fmt.Errorf("request %s/%s: %d tokens, %d block hashes: save held back: %w", t.EngineID, t.RequestID, t.TokenLen, len(t.Hashes), kvcore.ErrShortHashChain)
	}
	if end <= t.NumSavedTokens {
		return
	}
	start := t.saveStart()
	task, err := t.newSaveTask(m, start, end, m.SaveGroupsHeld(t.Table, start, end))
	if err != nil {
		t.fail(eff, err, nil)
		return
	}
	t.NumSavedTokens = end
	t.Unsaved = nil
	t.SaveJobs++
	t.emitSave(m, task, t.SaveJobs, true, eff)
}

// emitSave records a save task as pending, running as store job job, and
// hands it to the caller. A save of full blocks (covers: a step's save or a
// re-save, not a prompt tail) first marks what it covers of the pending
// saves' ranges (markCovered).
func (t *Tracker) emitSave(m *kvcore.Model, task kvcore.SaveTask, job int, covers bool, eff *Effects) {
	if covers {
		t.markCovered(m, task.Start, task.End)
	}
	t.PendingSaves = append(t.PendingSaves, task.TaskID)
	t.SaveSpans = append(t.SaveSpans, SaveSpan{TaskID: task.TaskID, Start: task.Start, End: task.End, Job: job})
	eff.Saves = append(eff.Saves, task)
}

// markCovered records that a save of full blocks [start, end), emitted now,
// covers again the start or the end of pending saves' ranges: if one of
// them is reported unsaved, that part is not saved again for it (the new
// save's own report decides). Only a cover of either end of a range's
// uncovered part is kept (a range keeps one uncovered interval), so a save
// covering only its middle is not recorded — the middle may then be saved
// twice, and is found present the second time. A range's end inside a
// scheduler block (a prompt tail) counts from that block's start: its
// sub-block key is saved only once, as vLLM's offload of the tail is.
func (t *Tracker) markCovered(m *kvcore.Model, start, end int) {
	sbs := m.SchedulerBlockSize()
	for i := range t.SaveSpans {
		s := &t.SaveSpans[i]
		lo, hi := s.uncovered()
		hi = hi / sbs * sbs
		if lo >= hi {
			continue
		}
		switch {
		case start <= lo && end >= hi:
			s.CoveredLow, s.CoveredHigh = s.End-s.Start, 0 // wholly covered
		case start <= lo && end > lo:
			s.CoveredLow = end - s.Start
		case end >= hi && start < hi:
			s.CoveredHigh = s.End - start
		}
	}
}

// resave handles a pending save of the current epoch reported not
// persisted (SaveReport.unsaved): what saves emitted after it do not cover
// again ([lo, hi), SaveSpan.uncovered) is saved again. When a store job
// after the task's was already emitted (span.Job < SaveJobs), vLLM's next
// job, already queued, would start at the persisted offset and cover the
// range again: a re-save task of that range, running as that next job, is
// emitted now (retrySave), for a running request and for a finishing one
// alike (vLLM keeps a finished request's resume offset until its queued
// jobs drained; the re-save holds finished_sending like any save).
// Otherwise, for a running request, the range joins Unsaved and the
// request's next save covers it (saveStart); a finishing request has no
// next save, as in vLLM. Without the model (OnSaveResult) no task can be
// built, and the range joins Unsaved.
func (t *Tracker) resave(m *kvcore.Model, span SaveSpan, eff *Effects) {
	lo, hi := span.uncovered()
	if lo >= hi || (t.State != StateRunning && t.State != StateFinishing) {
		return
	}
	if m != nil && span.Job < t.SaveJobs && t.canSave() {
		t.retrySave(m, span.TaskID, span.Job+1, lo, hi, eff)
		return
	}
	if t.State == StateRunning {
		t.Unsaved = append(t.Unsaved, SaveSpan{TaskID: span.TaskID, Start: lo, End: hi})
	}
}

// retrySave emits the re-save of [start, end) — its full scheduler blocks
// (a prompt tail's sub-block key is not saved again) — running as store
// job job: the save of that range a step would emit (Model.SaveGroupsHeld,
// which the sender's ValidateSave expects of every save of full blocks),
// the failed task's own chunks on the current table. For full attention,
// MLA and sliding window that is what vLLM's next job stores again of the
// range; a Mamba group's state at end is what the failed task meant to
// store (vLLM's next job stores the state only at its own end). A range
// with nothing to save emits nothing. A task that cannot be built leaves
// the range to the request's next save.
func (t *Tracker) retrySave(m *kvcore.Model, taskID string, job, start, end int, eff *Effects) {
	sbs := m.SchedulerBlockSize()
	end = end / sbs * sbs
	if end <= start {
		return
	}
	groups := m.SaveGroupsHeld(t.Table, start, end)
	if !anyChunk(groups) {
		return
	}
	task, err := t.newSaveTask(m, start, end, groups)
	if err != nil {
		eff.Err = fmt.Errorf("request %s/%s: re-save of [%d,%d) reported unsaved by %s: %w", t.EngineID, t.RequestID, start, end, taskID, err)
		if t.State == StateRunning {
			t.Unsaved = append(t.Unsaved, SaveSpan{TaskID: taskID, Start: start, End: end})
		}
		return
	}
	t.emitSave(m, task, job, true, eff)
}

// maybeSaveTail emits, under partial hash hits, the save of the request's
// sub-block prompt tail (Model.PromptTailGroups) once per allocation
// epoch: at the step whose computed tokens first reach P, the prompt
// (PromptTokens, vLLM's request.num_prompt_tokens) rounded down to the
// hash block, when P lies inside a block. It follows vLLM's hand-off of
// the prompt tail: the managers' cache_blocks → _cache_partial_tail_block
// registers the tail once num_tokens ≥ P, and the sending thread stores it
// with the step's save job (worker.py KVCacheStoreSendingThread
// ._maybe_offload_boundary_states → _sub_block_tail_puts), every group's
// blocks from the saved offset's block to P's, P's block keyed by P's hash
// and a Mamba group only that one. The task covers [start, P) with start
// the saved offset after this step's save (its full blocks are that save's
// keys, so nothing is stored twice), at most P's block; chunks whose block
// the table does not hold are left out, as _sub_block_tail_puts skips an
// "unavailable partial-tail source block".
//
// kvmesh stores the tail only while P's block is still incomplete (always
// so at a fresh prompt's last step): once the engine computed the whole
// block, its block holds the whole block's KV under the whole block's
// identity, and a worker serves a block only under the identity it holds.
func (t *Tracker) maybeSaveTail(m *kvcore.Model, eff *Effects) {
	if t.TailSaved || !m.PartialHashHits() {
		return
	}
	p := kvcore.PromptTailEnd(m, cmp.Or(t.PromptTokens, t.PrefillEnd))
	if p == 0 || t.TokenLen < p {
		return
	}
	sbs := m.SchedulerBlockSize()
	if t.TokenLen >= ceilTo(p, sbs) {
		t.TailSaved = true // the block is complete: the step saves cover it
		return
	}
	if len(t.Hashes) < p/m.HashBlockSize {
		return // a later step's hash chain may reach P
	}
	start := min(t.NumSavedTokens, p/sbs*sbs)
	groups := m.PromptTailGroupsHeld(t.Table, start, p)
	t.TailSaved = true
	if !anyChunk(groups) {
		return
	}
	task, err := t.newSaveTask(m, start, p, groups)
	if err != nil {
		t.fail(eff, err, nil)
		return
	}
	t.emitSave(m, task, t.SaveJobs, false, eff)
}

// anyChunk reports whether some group lists a chunk.
func anyChunk(groups []kvcore.GroupChunks) bool {
	for _, gc := range groups {
		if len(gc.Chunks) > 0 {
			return true
		}
	}
	return false
}

// saveStart is where the next save starts: the saved offset, or the start
// of the lowest range of the current epoch reported unsaved (Unsaved), as
// vLLM's sending thread resumes a request's next job from its last
// persisted offset (worker.py KVCacheStoreSendingThread._saved_offset).
func (t *Tracker) saveStart() int {
	start := t.NumSavedTokens
	for _, u := range t.Unsaved {
		start = min(start, u.Start)
	}
	return max(start, 0)
}

// saveEnd is where a save would end: floor(token_len, sbs), not past the
// prompt (decode tokens are not saved), nor past what the hash chain and
// every group's block table cover. hashLimited reports that the hash chain
// alone held back tokens that could otherwise be saved now.
func (t *Tracker) saveEnd(m *kvcore.Model) (end int, hashLimited bool) {
	if len(t.Table) != len(m.Groups) {
		return 0, false
	}
	sbs := m.SchedulerBlockSize()
	limit := t.TokenLen
	if t.PrefillEnd > 0 && t.PrefillEnd < limit {
		limit = t.PrefillEnd
	}
	end = limit / sbs * sbs
	for g, grp := range m.Groups {
		end = min(end, len(t.Table[g])*grp.BlockSize/sbs*sbs)
	}
	hashEnd := len(t.Hashes) * m.HashBlockSize / sbs * sbs
	if hashEnd < end {
		return hashEnd, end > t.NumSavedTokens
	}
	return end, false
}

// newSaveTask builds the save of [start, end) from the tracker's scheduled
// table, listing groups (Model.SaveGroupsHeld for a step's save,
// Model.PromptTailGroupsHeld for the prompt tail). It is the only place a
// SaveTask is built, and it refuses a table whose group count is not the
// model's: the seed crash (a save with an empty table on a hybrid model)
// cannot be built.
func (t *Tracker) newSaveTask(m *kvcore.Model, start, end int, groups []kvcore.GroupChunks) (kvcore.SaveTask, error) {
	if err := checkGroups(m, t.Table, "tracker block table"); err != nil {
		return kvcore.SaveTask{}, err
	}
	if err := chunksFit(m, t.Table, t.Hashes, groups); err != nil {
		return kvcore.SaveTask{}, err
	}
	t.Seq++
	return kvcore.SaveTask{
		Schema:      kvcore.SchemaSaveTask,
		TaskID:      t.taskID("save"),
		EngineID:    t.EngineID,
		RequestID:   t.RequestID,
		Model:       m.Name,
		Tenant:      t.Tenant,
		Epoch:       t.Epoch,
		Start:       start,
		End:         end,
		BlockTable:  t.Table.Clone(),
		BlockHashes: append([]string(nil), t.Hashes[:end/m.HashBlockSize]...),
		TokenIDs:    t.taskTokens(m, end/m.HashBlockSize),
		LoraName:    t.LoraName,
		Groups:      groups,
	}, nil
}

// emitLoad issues the accepted load into table's blocks. A load that cannot
// be built is reported finished at once with every block in error.
func (t *Tracker) emitLoad(m *kvcore.Model, table kvcore.BlockTable, eff *Effects) {
	task, err := t.newLoadTask(m, table)
	if err != nil {
		t.abandonLoad(eff, table)
		eff.Err = fmt.Errorf("request %s/%s: load: %w", t.EngineID, t.RequestID, err)
		return
	}
	t.Load.Issued = true
	t.Load.Table = nil
	t.PendingLoads = append(t.PendingLoads, task.TaskID)
	if len(task.Ranks) > 0 {
		t.LoadWaits = append(t.LoadWaits, LoadWait{TaskID: task.TaskID, Waiting: slices.Clone(task.Ranks), Blocks: kvcore.ListedBlocks(m, &task)})
	}
	eff.Loads = append(eff.Loads, task)
}

// newLoadTask builds the load of [floor(vllm_cached, sbs), hit) into table:
// the hit is aligned to Model.HitAlignment (the hash block under partial
// hash hits), and each group's last chunk is keyed by the LoadSpec's tail
// key (Model.LoadGroupsTail), as vLLM's KVCacheStoreRecvingThread
// ._handle_request keys it by its TailKeyBoundary (worker.py).
func (t *Tracker) newLoadTask(m *kvcore.Model, table kvcore.BlockTable) (kvcore.LoadTask, error) {
	if err := checkGroups(m, table, "load block table"); err != nil {
		return kvcore.LoadTask{}, err
	}
	start, end := m.LoadRange(*t.Load.Spec)
	if align := m.HitAlignment(); start < 0 || end <= start || end%align != 0 {
		return kvcore.LoadTask{}, fmt.Errorf("load range [%d,%d) with hit alignment %d: %w", start, end, align, kvcore.ErrChunkOutOfRange)
	}
	groups := m.LoadGroupsTail(start, end, t.Load.Spec.TailKeys)
	keyed := end // the hash chain must reach every chunk's key, tail keys past the hit included
	for _, gc := range groups {
		for _, c := range gc.Chunks {
			keyed = max(keyed, c.End)
		}
	}
	if n := keyed / m.HashBlockSize; n > len(t.Hashes) {
		return kvcore.LoadTask{}, fmt.Errorf("load to %d (keys to %d) needs %d block hashes, have %d: %w", end, keyed, n, len(t.Hashes), kvcore.ErrShortHashChain)
	}
	if err := chunksFit(m, table, t.Hashes, groups); err != nil {
		return kvcore.LoadTask{}, err
	}
	t.Seq++
	conn := t.Connector
	if conn == "" {
		conn = DefaultTrackerConnector
	}
	return kvcore.LoadTask{
		Schema:      kvcore.SchemaLoadTask,
		TaskID:      t.taskID("load"),
		EngineID:    t.EngineID,
		RequestID:   t.RequestID,
		Model:       m.Name,
		Tenant:      t.Tenant,
		Connector:   conn,
		Epoch:       t.Epoch,
		Start:       start,
		End:         end,
		BlockTable:  table.Clone(),
		BlockHashes: append([]string(nil), t.Hashes[:keyed/m.HashBlockSize]...),
		Groups:      groups,
		Remote:      cloneRemote(t.Remote),
		Ranks:       loadRanks(m),
	}, nil
}

// loadRanks are the ranks that must each report a load: every worker rank
// of a multi-rank engine (each loads its own memory); none for one rank.
func loadRanks(m *kvcore.Model) []kvcore.Rank {
	if m.WorldSize() == 1 {
		return nil
	}
	return m.WorkerRanks()
}

// cloneRemote returns a deep copy of r (nil for nil), so a task's snapshot
// never aliases a tracker.
func cloneRemote(r *kvcore.RemoteSource) *kvcore.RemoteSource {
	if r == nil {
		return nil
	}
	return &kvcore.RemoteSource{EngineID: r.EngineID, BlockTable: r.BlockTable.Clone()}
}

// taskID is engine/request/kind/seq (kind prefixed by a non-default
// connector's name, e.g. "pd-load"): unique per task, stable across
// redelivery of the event that emitted it (the tracker is persisted with
// its Seq before the task is published).
func (t *Tracker) taskID(kind string) string {
	if t.Connector != "" && t.Connector != DefaultTrackerConnector {
		kind = t.Connector + "-" + kind
	}
	return t.EngineID + "/" + t.RequestID + "/" + kind + "/" + strconv.Itoa(t.Seq)
}

// ceilTo rounds x up to a multiple of m.
func ceilTo(x, m int) int { return (x + m - 1) / m * m }
