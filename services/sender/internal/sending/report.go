package sending

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
)

// What a save reports, all read from its own account: the contract's
// TransferResult (for the scheduler, whose tracker learns the skipped and
// failed keys from its groups), the save_outcomes row, the ledger entry
// with the outbox messages, and the BlockStored KV events of the keys put;
// commit records them through the ledger (Outcomes) in one transaction.

// totals sums every group (Group is -1, Reason the first group's reason).
func (s *save) totals() contract.GroupOutcome {
	t := contract.GroupOutcome{Group: -1}
	for _, g := range s.groups {
		t.Stored += g.Stored
		t.Existing += g.Existing
		t.Skipped += g.Skipped
		t.DeadLettered += g.DeadLettered
		t.Failed += g.Failed
		if t.Reason == string(kvcore.ReasonOK) {
			t.Reason = g.Reason
		}
	}
	return t
}

// status is the task's overall outcome for the tracker: failed if any key
// failed, else dead_lettered if any group was, else skipped if any key was
// skipped, else stored.
func (s *save) status() kvcore.SaveStatus {
	t := s.totals()
	switch {
	case t.Failed > 0:
		return kvcore.SaveFailed
	case t.DeadLettered > 0:
		return kvcore.SaveDeadLettered
	case t.Skipped > 0:
		return kvcore.SaveSkipped
	}
	return kvcore.SaveStored
}

// classify names a group by its worst outcome.
func classify(g contract.GroupOutcome) string {
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
func (s *save) result() contract.TransferResult {
	return contract.TransferResult{
		Schema: contract.SchemaTransferResult, ResultID: resultID(s.task.TaskID), Kind: contract.TransferSave,
		TaskID: s.task.TaskID, EngineID: s.task.EngineID, RequestID: s.task.RequestID,
		Status: string(s.status()), Groups: slices.Clone(s.groups), Bytes: s.bytes,
	}
}

// outcome is the task's save_outcomes row: its result, and its groups
// counted by their worst outcome.
func (s *save) outcome() *ledger.Outcome {
	counts := map[string]int{}
	for _, g := range s.groups {
		counts[classify(g)]++
	}
	return &ledger.Outcome{Result: s.result(), Groups: counts}
}

// entry is what the save leaves in the ledger: its outcome, its dead
// letters and its messages (the result, then the BlockStored records of
// the keys put, stamped now).
func (s *save) entry(src ledger.Source, now time.Time, form contract.KVEventForm) (ledger.Entry, error) {
	o := s.outcome()
	msgs, err := resultMessages(o.Result, s.kvEvents(now), form)
	if err != nil {
		return ledger.Entry{}, err
	}
	return ledger.Entry{Source: src, Outcome: o, DeadLetters: s.deadLetters, Messages: msgs}, nil
}

// commit writes the save's ledger entry (outcome, dead letters and
// messages) in one transaction, unless another delivery of the task got
// there first (then nothing is written: no second result or KV event, no
// dead letter, the first outcome kept; it is counted a duplicate), counts
// it once committed, and remembers the task as done either way.
func (p *Processor) commit(ctx context.Context, src ledger.Source, s *save) error {
	e, err := s.entry(src, p.now(), p.form)
	if err != nil {
		return err
	}
	e.DropIfDone = true
	c, err := p.ledger.Commit(ctx, e)
	if err != nil {
		return err
	}
	p.recent.add(s.task.TaskID)
	p.countDeadLetters(ctx, c.DeadLetters)
	if c.Done {
		p.metrics.duplicates.Inc()
		return nil
	}
	p.metrics.countOutcome(e.Outcome)
	return nil
}

// resultMessages encodes the TransferResult and the KV-event records
// (contract.EncodeKVEventRecord: vLLM's KVEventBatch as the value,
// kvmesh's fields in headers, keyed by store namespace; the batch's events
// in form, KVMESH_KV_EVENTS_FORM), which the ledger writes to the
// outbox in the transaction that records the outcome.
func resultMessages(res contract.TransferResult, events []contract.KVEventRecord, form contract.KVEventForm) ([]bus.Message, error) {
	v, err := json.Marshal(res)
	if err != nil {
		return nil, fmt.Errorf("encode transfer result: %w", err)
	}
	msgs := []bus.Message{{Topic: contract.TopicTransferResults, Key: res.RequestID, Value: v}}
	for _, e := range events {
		m, err := bus.KVEventMessage(e, form)
		if err != nil {
			return nil, fmt.Errorf("encode kv event: %w", err)
		}
		msgs = append(msgs, m)
	}
	return msgs, nil
}

// kvEvents are the BlockStored records of the keys the save put, and of
// the keys it found present that a put one hangs from (announced), so
// that a router that keys a block by its parent (llm-d) can index each
// record's runs without waiting for another save's record: a block a
// concurrent save stored first is announced by that save's record too, in
// an order no one controls, and announcing a block twice is harmless. One record per
// group and store namespace, keyed by the namespace (contract.KVEventRecord),
// whose vLLM batch has one BlockStored event per run of consecutive chunks
// of the group's chain, as vLLM announces a run of blocks after its parent
// (vllm/v1/core/block_pool.py, cache_full_blocks). The hashes are the
// store keys' own, on the wire as vLLM's maybe_convert_block_hash writes
// them (contract.WireHash). An event's token_ids are the tokens of exactly
// its blocks, from the task's TokenIDs (eventTokens): len(block_hashes) ×
// the group's block size, as vLLM's BlockStored has them, which
// token-keyed routers (llm-d's indexer) chunk into their own keys. An
// event with a block whose whole tokens the task does not carry keeps
// token_ids [] (a task without tokens; a sub-block prompt tail under
// partial hash hits, whose block holds more tokens than its key covers):
// a router chunking a partial block's tokens would key it wrongly. Every
// event names the group (group_idx), its kv_cache_spec_kind and, for a
// sliding-window group, its window (kv_cache_spec_sliding_window), as
// vLLM's KVCacheManager annotates its own, the store's tier
// (contract.MediumStore, contract.LocalityStore) and the task's LoRA
// adapter as lora_name (nil without one); lora_id is nil and extra_keys
// absent: the save task carries neither the adapter's id nor the hash's
// extra keys, only the hashes they went into.
func (s *save) kvEvents(now time.Time) []contract.KVEventRecord {
	groups := make([]int, 0, len(s.stored))
	for g := range s.stored {
		groups = append(groups, g)
	}
	slices.Sort(groups)
	chain := make(map[string]int, len(s.task.BlockHashes))
	for i, h := range s.task.BlockHashes {
		if _, dup := chain[h]; !dup {
			chain[h] = i
		}
	}
	var out []contract.KVEventRecord
	for _, g := range groups {
		byNS := s.announced(g, chain)
		for _, ns := range slices.Sorted(maps.Keys(byNS)) {
			out = append(out, s.storedRecord(g, ns, byNS[ns], chain, now))
		}
	}
	return out
}

// announced are the hashes group g's records announce, by namespace: every
// key the save put, and every key it found present that lies before one
// it put in the chain (a block a stored one hangs from; trailing present
// keys, which nothing of the record hangs from, are left out, so a record
// announces no more than its blocks need).
func (s *save) announced(g int, chain map[string]int) map[string][]string {
	byNS := map[string][]string{}
	seen := map[string]bool{} // keys added, each namespace@hash once
	add := func(k, ns, h string) {
		if !seen[k] {
			seen[k] = true
			byNS[ns] = append(byNS[ns], h)
		}
	}
	end := map[string]int{} // namespace → one past the last chain index put
	for _, k := range s.stored[g] {
		if ns, h, ok := kvcore.SplitKey(k); ok {
			add(k, ns, h)
			if i, in := chain[h]; in {
				end[ns] = max(end[ns], i+1)
			}
		}
	}
	for _, k := range s.present[g] {
		if ns, h, ok := kvcore.SplitKey(k); ok {
			if i, in := chain[h]; in && i+1 < end[ns] {
				add(k, ns, h)
			}
		}
	}
	return byNS
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
// chunks, each with the wire hash of the chunk before it as its parent. A
// run whose later blocks the task's tokens do not cover whole is two
// events: the covered blocks with their token ids, then the rest with
// none, so that a token-keyed router (llm-d) still keys every block it
// can — one block the tokens end before must not take its run's tokens
// with it.
func (s *save) storedRecord(g int, ns string, hashes []string, chain map[string]int, now time.Time) contract.KVEventRecord {
	m := s.m
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
		Model: m.Name, Fingerprint: s.kb.Fingerprint, Namespace: ns, EngineID: s.task.EngineID, RequestID: s.task.RequestID, Tenant: s.task.Tenant,
		Hashes: hashes,
	}
	start := 0 // the first hash of the run being gathered
	for i := 1; i <= len(hashes); i++ {
		if i < len(hashes) && pos(hashes[i]) >= 0 && pos(hashes[i]) == pos(hashes[i-1])+step {
			continue // the next chunk of the run
		}
		run := hashes[start:i]
		start = i
		n := 0 // the covered blocks, a prefix of the run
		for n < len(run) && blockCovered(len(s.task.TokenIDs), m.HashBlockSize, grp.BlockSize, pos(run[n])) {
			n++
		}
		for _, part := range [][]string{run[:n], run[n:]} {
			if len(part) > 0 {
				rec.Batch.Events = append(rec.Batch.Events, s.storedEvent(m, g, part, pos, step))
			}
		}
	}
	return rec
}

// storedEvent is the BlockStored event of group g's consecutive chunks
// whose keys are hashes (pos gives each one's chain position): parent the
// chunk before the first, token ids the blocks' own (eventTokens).
func (s *save) storedEvent(m *kvcore.Model, g int, hashes []string, pos func(string) int, step int) contract.KVEvent {
	grp := m.Groups[g]
	medium, locality, group := contract.MediumStore, contract.LocalityStore, g
	ev := contract.KVEvent{
		Kind: contract.BlockStored, BlockSize: grp.BlockSize, Medium: &medium, GroupIdx: &group, LoraName: s.loraName(),
		SpecKind: contract.SpecKind(grp.Kind), Locality: &locality,
	}
	if grp.Kind == kvcore.KindSlidingWindow {
		ev.SlidingWindow = &grp.Window
	}
	run := make([]int, len(hashes))
	for i, h := range hashes {
		b, _ := kvcore.ParseBlockHash(h) // the keys were built from the task's hex hashes
		ev.BlockHashes = append(ev.BlockHashes, contract.WireHash(b))
		run[i] = pos(h)
	}
	ev.TokenIDs = eventTokens(s.task.TokenIDs, m.HashBlockSize, grp.BlockSize, run)
	if p := parentIndex(run[0], step); p >= 0 {
		if pb, err := kvcore.ParseBlockHash(s.task.BlockHashes[p]); err == nil {
			parent := contract.WireHash(pb)
			ev.ParentBlockHash = &parent
		}
	}
	return ev
}

// loraName is the task's LoRA adapter for BlockStored's lora_name (nil:
// none).
func (s *save) loraName() *string {
	if s.task.LoraName == "" {
		return nil
	}
	return &s.task.LoraName
}

// eventTokens are the token ids of one BlockStored event whose blocks'
// keys are the hashes at chain positions run (consecutive blocks of a
// group of block size bs): the tokens of each block, [end − bs, end) where
// end = (pos + 1) × hashBlockSize, in order. If one of the blocks is not a
// whole block of the group the task's tokens cover (blockCovered) the
// event gets none ([]): a router that chunks an event's tokens by the
// block size would key a partial block wrongly. The result is a slice of
// tokens, read only (the event is encoded at once).
func eventTokens(tokens []uint32, hashBlockSize, bs int, run []int) []uint32 {
	none := []uint32{}
	if len(run) == 0 {
		return none
	}
	for _, p := range run {
		if !blockCovered(len(tokens), hashBlockSize, bs, p) {
			return none
		}
	}
	first, last := (run[0]+1)*hashBlockSize-bs, (run[len(run)-1]+1)*hashBlockSize
	if last-first != len(run)*bs {
		return none
	}
	return tokens[first:last:last]
}

// blockCovered reports whether the chunk at chain position p is a whole
// block of a group of block size bs within the first n tokens: its key is
// on a block boundary (not a sub-block prompt tail or hit under partial
// hash hits), it is in the chain (p ≥ 0), and the tokens do not end
// before it.
func blockCovered(n, hashBlockSize, bs, p int) bool {
	if hashBlockSize <= 0 || bs <= 0 || bs%hashBlockSize != 0 || p < 0 {
		return false
	}
	end := (p + 1) * hashBlockSize
	return end%bs == 0 && end <= n
}
