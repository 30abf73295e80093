package sending

import (
	"maps"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// Group outcomes, as counted in save_outcomes and kvmesh_sender_groups_total.
const (
	groupStored       = "stored"
	groupExisting     = "existing"
	groupSkipped      = "skipped"
	groupDeadLettered = "dead_lettered"
	groupFailed       = "failed"
)

// run accumulates what happens to one save task (or one replayed group).
type run struct {
	task        *kvcore.SaveTask
	outcome     kvcore.SendOutcome
	deadLetters []ledger.DeadLetter
	stored      map[int][]string
	bytes       int64
}

func newRun(t *kvcore.SaveTask) *run {
	return &run{task: t, outcome: kvcore.NewSendOutcome(t), stored: map[int][]string{}}
}

// deadLetter dead-letters keys of group with reason: counted in the
// outcome and written as a dead letter of the task.
func (r *run) deadLetter(group int, reason kvcore.Reason, detail string, keys int) {
	r.outcome.Record(group, kvcore.OutcomeDeadLettered, keys, reason)
	r.addDeadLetter(&group, string(reason), detail)
}

// addDeadLetter adds a dead-letter row for group (nil: the whole task).
func (r *run) addDeadLetter(group *int, reason, detail string) {
	slot := len(r.deadLetters)
	if group == nil {
		slot = ledger.WholeRecord
	}
	r.deadLetters = append(r.deadLetters, ledger.DeadLetter{
		Reason: reason, Detail: detail, Group: group, Slot: slot,
		TaskID: r.task.TaskID, EngineID: r.task.EngineID, RequestID: r.task.RequestID,
	})
}

// groupCounts classifies each recorded group by its worst outcome.
func (r *run) groupCounts() map[string]int {
	out := map[string]int{}
	for _, g := range r.outcome.Groups {
		out[classify(g)]++
	}
	return out
}

func classify(g kvcore.GroupOutcome) string {
	switch {
	case g.Failed > 0:
		return groupFailed
	case g.DeadLettered > 0:
		return groupDeadLettered
	case g.Skipped > 0:
		return groupSkipped
	case g.Stored > 0:
		return groupStored
	}
	return groupExisting
}

// resultID is the TransferResult id of a task: stable across redelivery.
func resultID(taskID string) string { return "save/" + taskID }

// result is the task's TransferResult.
func (r *run) result() contract.TransferResult {
	groups := make([]contract.GroupOutcome, 0, len(r.outcome.Groups))
	for _, g := range r.outcome.Groups {
		groups = append(groups, contract.GroupOutcome{
			Group: g.Group, Stored: g.Stored, Existing: g.Existed, Skipped: g.Skipped,
			DeadLettered: g.DeadLettered, Failed: g.Failed, Reason: string(g.Reason),
		})
	}
	return contract.TransferResult{
		Schema: contract.SchemaTransferResult, ResultID: resultID(r.task.TaskID), Kind: contract.TransferSave,
		TaskID: r.task.TaskID, EngineID: r.task.EngineID, RequestID: r.task.RequestID,
		Status: string(r.outcome.Status()), Groups: groups, Bytes: r.bytes,
	}
}

// kvEvents are the BlockStored records of the keys put: one record per
// group and store namespace, keyed by the namespace (contract.KVEventRecord),
// whose vLLM batch has one BlockStored event per run of consecutive chunks
// of the group's chain, as vLLM announces a run of blocks after its parent
// (vllm/v1/core/block_pool.py, cache_full_blocks). kvmesh's save tasks
// carry hashes, not tokens, so token_ids is empty; the hashes are the
// store keys' own, on the wire as vLLM's maybe_convert_block_hash writes
// them (contract.WireHash).
func (r *run) kvEvents(m *kvcore.Model, now time.Time) []contract.KVEventRecord {
	groups := make([]int, 0, len(r.stored))
	for g := range r.stored {
		groups = append(groups, g)
	}
	slices.Sort(groups)
	chain := make(map[string]int, len(r.task.BlockHashes))
	for i, h := range r.task.BlockHashes {
		if _, dup := chain[h]; !dup {
			chain[h] = i
		}
	}
	var out []contract.KVEventRecord
	for _, g := range groups {
		byNS := map[string][]string{}
		for _, k := range r.stored[g] {
			if ns, h, ok := kvcore.SplitKey(k); ok && !slices.Contains(byNS[ns], h) {
				byNS[ns] = append(byNS[ns], h)
			}
		}
		for _, ns := range slices.Sorted(maps.Keys(byNS)) {
			out = append(out, r.storedRecord(m, g, ns, byNS[ns], chain, now))
		}
	}
	return out
}

// parentIndex is the chain index of the hash that ends the block before the
// chunk whose key is the hash at chain index pos, with step hash blocks per
// block, or −1 when the chunk is in the first block or not in the chain. A
// chunk that ends inside its block (a sub-block prompt tail under partial
// hash hits) has the same parent as the whole block.
func parentIndex(pos, step int) int {
	if pos < 0 {
		return -1
	}
	return pos/step*step - 1
}

// storedRecord is the BlockStored record of one namespace's hashes of
// group g: the hashes in chain order, one event per run of consecutive
// chunks, each with the wire hash of the chunk before it as its parent.
func (r *run) storedRecord(m *kvcore.Model, g int, ns string, hashes []string, chain map[string]int, now time.Time) contract.KVEventRecord {
	grp := m.Groups[g]
	step := max(1, grp.BlockSize/max(1, m.HashBlockSize))
	pos := func(h string) int {
		if i, ok := chain[h]; ok {
			return i
		}
		return -1 // not in the chain: a run of its own, with no parent
	}
	slices.SortStableFunc(hashes, func(a, b string) int { return pos(a) - pos(b) })
	rec := contract.KVEventRecord{
		Batch: contract.KVEventBatch{TS: contract.UnixSeconds(now), DataParallelRank: new(int)},
		Model: m.Name, Namespace: ns, EngineID: r.task.EngineID, RequestID: r.task.RequestID,
	}
	medium, group := contract.MediumStore, g
	var window *int
	if grp.Kind == kvcore.KindSlidingWindow {
		window = &grp.Window
	}
	for i, h := range hashes {
		rec.Hashes = append(rec.Hashes, h)
		b, _ := kvcore.ParseBlockHash(h) // the keys were built from the task's hex hashes
		wire := contract.WireHash(b)
		if i > 0 && pos(h) >= 0 && pos(h) == pos(hashes[i-1])+step {
			last := &rec.Batch.Events[len(rec.Batch.Events)-1]
			last.BlockHashes = append(last.BlockHashes, wire)
			continue
		}
		ev := contract.KVEvent{
			Kind: contract.BlockStored, BlockHashes: []uint64{wire}, TokenIDs: []uint32{},
			BlockSize: grp.BlockSize, Medium: &medium, GroupIdx: &group,
			SpecKind: contract.SpecKind(grp.Kind), SlidingWindow: window,
		}
		if p := parentIndex(pos(h), step); p >= 0 {
			if pb, err := kvcore.ParseBlockHash(r.task.BlockHashes[p]); err == nil {
				parent := contract.WireHash(pb)
				ev.ParentBlockHash = &parent
			}
		}
		rec.Batch.Events = append(rec.Batch.Events, ev)
	}
	return rec
}
