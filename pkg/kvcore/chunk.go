package kvcore

// Chunk is one block of one group: the tokens [Start, End) it covers. With
// partial hash hits (Model.PartialHashHits) a chunk may end inside its
// block, on a hash-block boundary: a sub-block prompt tail or the tail of a
// sub-block hit. Its value is still the whole block's bytes, as vLLM's
// ChunkedTokenDatabase.prepare_values and prepare_value_for_block move a
// whole block for such a chunk (data.py); only its key, the hash at its
// end, differs from the whole block's.
type Chunk struct {
	// Start is the first token of the chunk.
	Start int `json:"start"`
	// End is one past the last token of the chunk.
	End int `json:"end"`
}

// HashIndex is the index, in the request's hash chain, of the chunk's last
// hash-block; the chunk's store key uses that hash (data.py process_tokens
// keys a chunk by block_hashes[end // hash_block_size − 1]).
func (c Chunk) HashIndex(hashBlockSize int) int { return c.End/hashBlockSize - 1 }

// BlockIndex is the position of the chunk in its group's block table.
func (c Chunk) BlockIndex(blockSize int) int { return c.Start / blockSize }

// Chunks returns the whole blocks of size bs inside the token range
// [start, end): from start rounded up to end rounded down.
func Chunks(start, end, bs int) []Chunk {
	if bs <= 0 || start < 0 {
		return nil
	}
	first := (start + bs - 1) / bs * bs
	last := end / bs * bs
	var out []Chunk
	for s := first; s+bs <= last; s += bs {
		out = append(out, Chunk{Start: s, End: s + bs})
	}
	return out
}

// WindowBlocks is the number of contiguous blocks a sliding-window group
// needs before a hit: ceil((window − 1) / block_size), since the token
// being computed is itself inside the window, and at least one. It follows
// vLLM's SlidingWindowManager._contiguous_blocks_for_hit
// (vllm/v1/core/single_type_kv_cache_manager.py, without EAGLE). It is 0
// for the other kinds.
func (g Group) WindowBlocks() int {
	if g.Kind != KindSlidingWindow || g.BlockSize <= 0 {
		return 0
	}
	return max(1, g.windowTail())
}

// windowTail is ceil((window − 1) / block_size) without the floor of one:
// the blocks vLLM's reachable_block_mask keeps per segment (none for a
// one-token window, which vLLM therefore never hits).
func (g Group) windowTail() int { return (g.Window - 1 + g.BlockSize - 1) / g.BlockSize }

// Reaches reports whether a group needs chunk c to resume computation at
// token h (a multiple of the group's block size), as vLLM's
// find_longest_cache_hit of each SingleTypeKVCacheManager has it: every
// chunk before h for full attention and MLA (FullAttentionManager); for a
// sliding window, the WindowBlocks chunks ending at or before h
// (SlidingWindowManager; all of them when h is shorter); for Mamba, only
// the chunk that ends exactly at h, the state at h (MambaManager).
func (g Group) Reaches(c Chunk, h int) bool {
	if c.End > h {
		return false
	}
	switch g.Kind {
	case KindSlidingWindow:
		return c.End > h-g.WindowBlocks()*g.BlockSize
	case KindMamba:
		return c.End == h
	default:
		return true
	}
}

// SaveChunks returns the chunks of group g that a save of tokens
// [saved, end) stores, following vLLM's MooncakeStoreCoordinator.store_mask
// (vllm/backends/distributed/kv_transfer/kv_connector/v1/mooncake/store/
// coordinator.py) and the reachable_block_mask it asks each manager for
// (with the default prefix_cache_retention_interval of None):
//
//   - full attention and MLA: every chunk;
//   - sliding window: in every scheduler-block-size segment, the last
//     ceil((window − 1) / block_size) chunks, which are those some later
//     hit at a multiple of the scheduler block size can need; every chunk
//     when they reach the whole segment;
//   - Mamba: only the state at end. vLLM's store_mask masks Mamba out and
//     persists the align-mode boundary state the engine hands off for the
//     step (worker.py _boundary_snapshot_puts), the state at the step's end.
//
// end is expected to be aligned to the scheduler block size.
func (m *Model) SaveChunks(g, saved, end int) []Chunk {
	grp := m.Groups[g]
	all := Chunks(saved, end, grp.BlockSize)
	switch grp.Kind {
	case KindSlidingWindow:
		per := m.SchedulerBlockSize() / grp.BlockSize
		need := grp.windowTail()
		if need >= per {
			return all
		}
		var out []Chunk
		for _, c := range all {
			if c.BlockIndex(grp.BlockSize)%per >= per-need {
				out = append(out, c)
			}
		}
		return out
	case KindMamba:
		var out []Chunk
		for _, c := range all {
			if c.End == end {
				out = append(out, c)
			}
		}
		return out
	default:
		return all
	}
}

// LoadChunks returns the chunks of group g in [start, end) that a load
// resuming at end reads: those the group reaches from end (Group.Reaches),
// as vLLM's MooncakeStoreCoordinator.load_mask has them (the managers'
// find_longest_cache_hit over a store holding everything).
//
// With partial hash hits end may fall inside a block (a multiple of the
// hash block size): the block holding it is then read as a chunk ending at
// end (data.py process_tokens: end_idx = min(start + block_size,
// token_len)), keyed by the hash at end; full attention and MLA read every
// block from start's up to it (FullAttentionManager keeps cdiv(hit,
// block_size) blocks), Mamba only that block (MambaManager's fine-grained
// branch: null blocks, then the state at the hit).
func (m *Model) LoadChunks(g, start, end int) []Chunk {
	grp := m.Groups[g]
	if m.PartialHashHits() {
		return partialLoadChunks(grp, start, end)
	}
	var out []Chunk
	for _, c := range Chunks(start, end, grp.BlockSize) {
		if grp.Reaches(c, end) {
			out = append(out, c)
		}
	}
	return out
}

// partialLoadChunks is LoadChunks under partial hash hits: the blocks from
// start's (rounded up) to the one holding end − 1, the last one cut at end.
func partialLoadChunks(grp Group, start, end int) []Chunk {
	bs := grp.BlockSize
	if bs <= 0 || start < 0 || end <= 0 {
		return nil
	}
	last := (end+bs-1)/bs - 1
	first := (start + bs - 1) / bs
	if grp.Kind == KindMamba {
		first = max(first, last)
	}
	var out []Chunk
	for i := first; i <= last; i++ {
		out = append(out, Chunk{Start: i * bs, End: min((i+1)*bs, end)})
	}
	return out
}

// PromptTailChunks returns the chunks of group g that vLLM stores for a
// request's sub-block prompt tail under partial hash hits (worker.py
// KVCacheStoreSendingThread._sub_block_tail_puts, fed by the Mamba
// align-mode hand-off of the state at the last prompt hash boundary):
// with P = numPromptTokens rounded down to the hash block size, and P
// inside a block, every non-Mamba group stores its blocks from saved's
// (the tokens the sender had already saved, rounded down to a block, at
// most P's block) up to P's, each full block keyed by its end and P's
// block as the chunk [start of block, P) keyed by P's hash; a Mamba group
// stores only that chunk, the state at P. Nothing without partial hash
// hits, for P on a block boundary (that state is a block-aligned snapshot,
// SaveChunks), or for P = 0.
func (m *Model) PromptTailChunks(g, saved, numPromptTokens int) []Chunk {
	p := PromptTailEnd(m, numPromptTokens)
	if p == 0 || saved < 0 {
		return nil
	}
	grp := m.Groups[g]
	bs := grp.BlockSize
	last := p / bs
	first := min(saved/bs, last)
	if grp.Kind == KindMamba {
		first = last
	}
	var out []Chunk
	for i := first; i <= last; i++ {
		out = append(out, Chunk{Start: i * bs, End: min((i+1)*bs, p)})
	}
	return out
}

// PromptTailEnd is where a prompt of promptTokens stores its sub-block
// tail under partial hash hits: the prompt rounded down to the hash block
// when that lies inside a block (worker.py _sub_block_tail_puts'
// boundary; single_type_kv_cache_manager.py _cache_partial_tail_block's
// boundary_tokens); 0 when there is none (no partial hash hits, a
// boundary on a scheduler block, or a prompt under one hash block).
func PromptTailEnd(m *Model, promptTokens int) int {
	if !m.PartialHashHits() || promptTokens <= 0 {
		return 0
	}
	p := promptTokens / m.HashBlockSize * m.HashBlockSize
	if p%m.SchedulerBlockSize() == 0 {
		return 0
	}
	return p
}
