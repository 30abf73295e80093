package kvcore

import (
	"fmt"
	"slices"
)

// GroupVerdict is the validation result for one group of a save task.
type GroupVerdict struct {
	// Group is the KV-group index (for an out-of-range or duplicate entry,
	// the index the entry names).
	Group int `json:"group"`
	// Reason is ReasonOK for a valid group, else why it cannot be stored.
	Reason Reason `json:"reason,omitempty"`
	// Detail explains the reason for operators.
	Detail string `json:"detail,omitempty"`
}

// OK reports whether the group is valid.
func (v GroupVerdict) OK() bool { return v.Reason == ReasonOK }

// ValidateSave checks a save task against model m, group by group. It
// returns exactly one verdict per model group, in group order, followed by
// one verdict per task entry that names a group outside the model or
// repeats one. A group is never rejected because another group is bad; only
// task-wide faults (model_unknown, tenant_invalid, token_range_invalid,
// hash_count_mismatch, token_ids_invalid, a table with more groups than
// the model) reject every group. poolBlocks gives the number of blocks
// per group in the engine's pool; nil (or a missing entry) skips the
// upper-bound check. A nil model yields one
// model_unknown verdict per task entry; a nil task is an empty one.
func ValidateSave(m *Model, poolBlocks []int, t *SaveTask) []GroupVerdict {
	if t == nil {
		t = &SaveTask{}
	}
	if m == nil {
		return modelUnknown(m, t)
	}
	first, extra := indexEntries(len(m.Groups), t.Groups)
	if m.Validate() != nil || m.Name != t.Model {
		return append(modelUnknown(m, t), extra...)
	}
	taskFault := taskWideFault(m, t)
	out := make([]GroupVerdict, 0, len(m.Groups)+len(extra))
	for g := range m.Groups {
		v := GroupVerdict{Group: g}
		switch {
		case taskFault.Reason != ReasonOK:
			v.Reason, v.Detail = taskFault.Reason, taskFault.Detail
		case g >= len(t.BlockTable):
			v.Reason = ReasonTableGroupCount
			v.Detail = fmt.Sprintf("block table has %d group(s), model %q has %d: no block list for group %d", len(t.BlockTable), m.Name, len(m.Groups), g)
		case first[g] < 0:
			v.Reason, v.Detail = ReasonGroupMissing, fmt.Sprintf("the task lists no chunks for group %d", g)
		default:
			v.Reason, v.Detail = checkGroup(m, poolBlocks, t, t.Groups[first[g]])
		}
		out = append(out, v)
	}
	return append(out, extra...)
}

// modelUnknown rejects every group of a task whose model is unknown.
func modelUnknown(m *Model, t *SaveTask) []GroupVerdict {
	detail := fmt.Sprintf("model %q is not served here", t.Model)
	if m != nil {
		if err := m.Validate(); err != nil {
			detail = fmt.Sprintf("model %q is unusable: %v", m.Name, err)
		}
		out := make([]GroupVerdict, len(m.Groups))
		for g := range out {
			out[g] = GroupVerdict{Group: g, Reason: ReasonModelUnknown, Detail: detail}
		}
		return out
	}
	out := make([]GroupVerdict, 0, len(t.Groups))
	for _, e := range t.Groups {
		out = append(out, GroupVerdict{Group: e.Group, Reason: ReasonModelUnknown, Detail: detail})
	}
	return out
}

// indexEntries maps each model group to the index of the first task entry
// that lists it (-1: none), and gives a verdict for every entry that names a
// group outside the model or repeats one.
func indexEntries(groups int, entries []GroupChunks) (first []int, extra []GroupVerdict) {
	first = make([]int, groups)
	for g := range first {
		first[g] = -1
	}
	for i, e := range entries {
		switch {
		case e.Group < 0 || e.Group >= groups:
			extra = append(extra, GroupVerdict{Group: e.Group, Reason: ReasonGroupOutOfRange,
				Detail: fmt.Sprintf("entry %d names group %d of a %d-group model", i, e.Group, groups)})
		case first[e.Group] >= 0:
			extra = append(extra, GroupVerdict{Group: e.Group, Reason: ReasonGroupDuplicate,
				Detail: fmt.Sprintf("entry %d repeats group %d (first listed by entry %d)", i, e.Group, first[e.Group])})
		default:
			first[e.Group] = i
		}
	}
	return first, extra
}

// taskWideFault finds a fault of the whole task, checked before any group.
func taskWideFault(m *Model, t *SaveTask) GroupVerdict {
	sbs := m.SchedulerBlockSize()
	endOK := t.End%sbs == 0 || isPromptTail(m, t)
	if err := ValidateTenant(t.Tenant); err != nil {
		return GroupVerdict{Reason: ReasonTenantInvalid, Detail: err.Error()}
	}
	tokErr := CheckTokenIDs(m.HashBlockSize, len(t.TokenIDs), len(t.BlockHashes))
	switch {
	case t.Start < 0 || t.End <= t.Start || t.Start%sbs != 0 || !endOK:
		return GroupVerdict{Reason: ReasonTokenRangeInvalid,
			Detail: fmt.Sprintf("range [%d,%d) is not a non-empty range aligned to the scheduler block size %d (nor a sub-block prompt tail)", t.Start, t.End, sbs)}
	case t.End/m.HashBlockSize > len(t.BlockHashes):
		return GroupVerdict{Reason: ReasonHashCountMismatch,
			Detail: fmt.Sprintf("end %d needs %d block hashes, the task has %d", t.End, t.End/m.HashBlockSize, len(t.BlockHashes))}
	case tokErr != nil:
		return GroupVerdict{Reason: ReasonTokenIDsInvalid, Detail: tokErr.Error()}
	case len(t.BlockTable) > len(m.Groups):
		return GroupVerdict{Reason: ReasonTableGroupCount,
			Detail: fmt.Sprintf("block table has %d groups, model %q has %d", len(t.BlockTable), m.Name, len(m.Groups))}
	}
	return GroupVerdict{}
}

// isPromptTail reports whether a task is a sub-block prompt-tail save
// (Tracker.maybeSaveTail): under partial hash hits, End is a hash-block
// boundary inside a scheduler block (PromptTailEnd).
func isPromptTail(m *Model, t *SaveTask) bool {
	return t.End > 0 && PromptTailEnd(m, t.End) == t.End
}

// checkGroup validates one listed group whose block list exists. The range
// and hash count were checked task-wide, so the expected chunks are bounded
// by the task's own size. The entry must list exactly the chunks the
// tracker builds: those of Model.SaveChunks (Model.PromptTailChunks for a
// prompt tail) whose block the table holds (Model.SaveGroupsHeld,
// PromptTailGroupsHeld), as vLLM's sending thread skips unavailable source
// blocks (worker.py KVCacheStoreSendingThread._handle_request,
// _sub_block_tail_puts). It fails closed: a chunk the model does not
// store is a mismatch, a listed chunk on a null or out-of-range block is
// refused with that reason, and a held chunk left out is a mismatch.
func checkGroup(m *Model, poolBlocks []int, t *SaveTask, e GroupChunks) (Reason, string) {
	g := e.Group
	want := m.SaveChunks(g, t.Start, t.End)
	if isPromptTail(m, t) {
		want = m.PromptTailChunks(g, t.Start, t.End)
	}
	blocks := t.BlockTable[g]
	bs := m.Groups[g].BlockSize
	limit := -1
	if g < len(poolBlocks) {
		limit = poolBlocks[g]
	}
	held := make([]Chunk, 0, len(want))
	for _, c := range want {
		if m.Holds(g, blocks, c) {
			held = append(held, c)
		}
	}
	if !slices.Equal(held, e.Chunks) {
		if !isSubsequence(e.Chunks, want) {
			return ReasonChunksMismatch, fmt.Sprintf("group %d lists %d chunk(s) for [%d,%d), not a subset of the %d the model stores", g, len(e.Chunks), t.Start, t.End, len(want))
		}
		for _, c := range e.Chunks {
			if r, d := checkChunk(c, bs, blocks, limit); r != ReasonOK {
				return r, fmt.Sprintf("group %d chunk [%d,%d): %s", g, c.Start, c.End, d)
			}
		}
		return ReasonChunksMismatch, fmt.Sprintf("group %d lists %d chunk(s) for [%d,%d), the model stores %d whose block is held", g, len(e.Chunks), t.Start, t.End, len(held))
	}
	for _, c := range held {
		if r, d := checkChunk(c, bs, blocks, limit); r != ReasonOK {
			return r, fmt.Sprintf("group %d chunk [%d,%d): %s", g, c.Start, c.End, d)
		}
		if h := t.BlockHashes[c.HashIndex(m.HashBlockSize)]; !IsHashHex(h) {
			return ReasonHashInvalid, fmt.Sprintf("group %d chunk [%d,%d): hash %q is not lower-case hex", g, c.Start, c.End, h)
		}
	}
	return ReasonOK, ""
}

// isSubsequence reports whether every element of sub appears in seq, in
// order, each at most once.
func isSubsequence(sub, seq []Chunk) bool {
	i := 0
	for _, c := range seq {
		if i < len(sub) && sub[i] == c {
			i++
		}
	}
	return i == len(sub)
}

// checkChunk checks the block a chunk is stored from; limit < 0 means the
// pool size is unknown.
func checkChunk(c Chunk, bs int, blocks []BlockID, limit int) (Reason, string) {
	bi := c.BlockIndex(bs)
	switch {
	case bi >= len(blocks):
		return ReasonTableTooShort, fmt.Sprintf("needs block index %d, the block list has %d", bi, len(blocks))
	case blocks[bi] == NullBlock:
		return ReasonNullBlock, fmt.Sprintf("block index %d is null", bi)
	case blocks[bi] < 0 || (limit >= 0 && int64(blocks[bi]) >= int64(limit)):
		return ReasonBlockOutOfRange, fmt.Sprintf("block id %d is outside the pool of %d blocks", blocks[bi], limit)
	}
	return ReasonOK, ""
}
