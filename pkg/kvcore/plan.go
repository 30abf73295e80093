package kvcore

import "fmt"

// TransferItem is one block a sender puts or a gpuworker gets: its store key
// and the engine block that holds (or receives) its KV.
type TransferItem struct {
	// Key is the store key.
	Key string
	// Block is the engine block id.
	Block BlockID
	// Chunk is the token range of the block.
	Chunk Chunk
	// Group is the KV-group index.
	Group int
	// Hash is the chunk's block hash (lower-case hex): the content the
	// engine block must hold, checked by the gpuworker on every read.
	Hash string
}

// SaveGroups lists, for every group in index order, the chunks a save of
// tokens [saved, end) stores (Model.SaveChunks). A group with nothing to
// store has an empty chunk list.
func (m *Model) SaveGroups(saved, end int) []GroupChunks {
	return m.groupChunks(saved, end, m.SaveChunks)
}

// SaveGroupsHeld is SaveGroups without the chunks whose block table has
// no block for them (past the group's list, or NullBlock): vLLM's sending
// thread skips such "unavailable source blocks" (worker.py
// KVCacheStoreSendingThread._handle_request), which with the dense
// sliding-window store mask of SaveChunks are the window blocks the engine
// already freed below an earlier hit. A table with fewer groups than the
// model keeps the missing groups' chunk lists empty.
func (m *Model) SaveGroupsHeld(table BlockTable, saved, end int) []GroupChunks {
	return m.keepHeld(table, m.SaveGroups(saved, end))
}

// PromptTailGroupsHeld is PromptTailGroups without the chunks whose block
// table has no block for them, as vLLM's _sub_block_tail_puts skips an
// "unavailable partial-tail source block" (worker.py).
func (m *Model) PromptTailGroupsHeld(table BlockTable, saved, numPromptTokens int) []GroupChunks {
	return m.keepHeld(table, m.PromptTailGroups(saved, numPromptTokens))
}

// keepHeld drops, in place, the chunks of groups whose block table entry is
// missing or NullBlock (Model.Holds).
func (m *Model) keepHeld(table BlockTable, groups []GroupChunks) []GroupChunks {
	for g := range groups {
		var blocks []BlockID
		if g < len(table) {
			blocks = table[g]
		}
		held := groups[g].Chunks[:0]
		for _, c := range groups[g].Chunks {
			if m.Holds(g, blocks, c) {
				held = append(held, c)
			}
		}
		groups[g].Chunks = held
	}
	return groups
}

// Holds reports whether a group's block list has a block for chunk c: an
// entry at its block index that is not NullBlock.
func (m *Model) Holds(g int, blocks []BlockID, c Chunk) bool {
	bi := c.BlockIndex(m.Groups[g].BlockSize)
	return bi >= 0 && bi < len(blocks) && blocks[bi] != NullBlock
}

// LoadGroups lists, for every group in index order, the chunks a load of
// tokens [start, end) reads: start is floored to the scheduler block size,
// and each group gets the chunks it needs to resume at end
// (Model.LoadChunks).
func (m *Model) LoadGroups(start, end int) []GroupChunks {
	sbs := m.SchedulerBlockSize()
	return m.groupChunks(start/sbs*sbs, end, m.LoadChunks)
}

// LoadGroupsTail is LoadGroups keyed by the lookup's tail keys
// (LookupPlan.TailKeys), as vLLM's KVCacheStoreRecvingThread._handle_request
// keys the chunk ending at token_len by its TailKeyBoundary (worker.py):
// each group's last chunk, when it ends at end and its tail key names a
// later boundary of the same block, ends at that boundary instead, so its
// key is the hash there. The stored block holds the same prefix's KV up to
// that boundary; the engine uses it up to end. A group without a tail key
// keeps the chunk ending at end.
func (m *Model) LoadGroupsTail(start, end int, tails []TailKey) []GroupChunks {
	out := m.LoadGroups(start, end)
	for _, tk := range tails {
		if tk.Group < 0 || tk.Group >= len(out) || tk.Tokens <= end {
			continue
		}
		cs := out[tk.Group].Chunks
		if n := len(cs); n > 0 && cs[n-1].End == end && tk.Tokens <= cs[n-1].Start+m.Groups[tk.Group].BlockSize {
			cs[n-1].End = tk.Tokens
		}
	}
	return out
}

// PromptTailGroups lists, for every group in index order, the chunks of a
// request's sub-block prompt tail (Model.PromptTailChunks): empty lists
// without partial hash hits or when the prompt's last hash boundary is on
// a block boundary.
func (m *Model) PromptTailGroups(saved, numPromptTokens int) []GroupChunks {
	return m.groupChunks(saved, numPromptTokens, m.PromptTailChunks)
}

// LoadRange is the token range a load for spec covers:
// [floor(VLLMCachedTokens, scheduler block size), KVPoolCachedTokens).
func (m *Model) LoadRange(spec LoadSpec) (start, end int) {
	sbs := m.SchedulerBlockSize()
	return spec.VLLMCachedTokens / sbs * sbs, spec.KVPoolCachedTokens
}

func (m *Model) groupChunks(start, end int, pick func(g, start, end int) []Chunk) []GroupChunks {
	out := make([]GroupChunks, len(m.Groups))
	for g := range m.Groups {
		chunks := pick(g, start, end)
		if chunks == nil {
			chunks = []Chunk{}
		}
		out[g] = GroupChunks{Group: g, Chunks: chunks}
	}
	return out
}

// PlanSend lists the blocks of one group of a save task that worker rank r
// puts: the chunks the task lists for that group that r writes
// (Model.Writes: the ranks sharing a namespace write its chunks in turn),
// keyed by each chunk's hash in task.BlockHashes under the group's store
// namespace for r (Model.StoreRank), in the task's tenant's key space:
// kb's tenant is replaced by task.Tenant, so a save never writes another
// tenant's keys. A group the task does not list has nothing to put.
// Validation of the task is the caller's; a chunk that would index outside
// the task is an ErrChunkOutOfRange error and a bad tenant an ErrBadTenant
// error, never a panic.
func PlanSend(m *Model, kb KeyBuilder, task *SaveTask, group int, r Rank) ([]TransferItem, error) {
	if err := ValidateTenant(task.Tenant); err != nil {
		return nil, err
	}
	kb = kb.ForTenant(task.Tenant)
	for _, gc := range task.Groups {
		if gc.Group == group {
			return planGroupItems(m, kb, gc, task.BlockTable, task.BlockHashes, r, true)
		}
	}
	return nil, nil
}

// MissingOnly keeps the items whose key the store reported absent:
// exists[i] answers items[i]. An item without an answer is kept, since
// putting a present key again is harmless and skipping a missing one is not.
func MissingOnly(items []TransferItem, exists []bool) []TransferItem {
	var out []TransferItem
	for i, it := range items {
		if i >= len(exists) || !exists[i] {
			out = append(out, it)
		}
	}
	return out
}

// PlanLoad lists the blocks worker rank r gets for a load task, group by
// group in the order the task lists them: every chunk, from r's namespace
// (each rank fills its own memory) in the task's tenant's key space (kb's
// tenant is replaced by task.Tenant, so a load never reads another
// tenant's keys). A bad tenant is an ErrBadTenant error.
func PlanLoad(m *Model, kb KeyBuilder, task *LoadTask, r Rank) ([]TransferItem, error) {
	if err := ValidateTenant(task.Tenant); err != nil {
		return nil, err
	}
	kb = kb.ForTenant(task.Tenant)
	var out []TransferItem
	for _, gc := range task.Groups {
		items, err := planGroupItems(m, kb, gc, task.BlockTable, task.BlockHashes, r, false)
		if err != nil {
			return nil, err
		}
		out = append(out, items...)
	}
	return out, nil
}

// LoadErrors lists the block ids whose load failed, each once, in item
// order: every block when the whole batch failed (batchErr != nil),
// otherwise those whose perKeyErr[i] is set or whose answer is missing.
func LoadErrors(items []TransferItem, perKeyErr []error, batchErr error) []BlockID {
	var out []BlockID
	var seen map[BlockID]bool
	for i, it := range items {
		failed := batchErr != nil || i >= len(perKeyErr) || perKeyErr[i] != nil
		if !failed || seen[it.Block] {
			continue
		}
		if seen == nil {
			seen = make(map[BlockID]bool)
		}
		seen[it.Block] = true
		out = append(out, it.Block)
	}
	return out
}

// planGroupItems keys one group's chunks for worker rank r; with writes
// set, only the chunks r writes.
func planGroupItems(m *Model, kb KeyBuilder, gc GroupChunks, table BlockTable, hashes []string, r Rank, writes bool) ([]TransferItem, error) {
	g := gc.Group
	if g < 0 || g >= len(m.Groups) {
		return nil, fmt.Errorf("group %d of a %d-group model: %w", g, len(m.Groups), ErrChunkOutOfRange)
	}
	if g >= len(table) {
		return nil, fmt.Errorf("group %d of a %d-group block table: %w", g, len(table), ErrChunkOutOfRange)
	}
	sr := m.StoreRank(g, r)
	out := make([]TransferItem, 0, len(gc.Chunks))
	bs := m.Groups[g].BlockSize
	for _, c := range gc.Chunks {
		if writes && c.Start%bs == 0 && !m.Writes(g, r, c.Start/bs) {
			continue
		}
		block, hashHex, err := chunkSource(m, g, c, table[g], hashes)
		if err != nil {
			return nil, fmt.Errorf("group %d chunk [%d,%d): %w", g, c.Start, c.End, err)
		}
		out = append(out, TransferItem{Key: kb.KeyHex(sr, g, hashHex), Block: block, Chunk: c, Group: g, Hash: hashHex})
	}
	return out, nil
}

// chunkSource finds chunk c's block id and hash, checking every index.
func chunkSource(m *Model, g int, c Chunk, blocks []BlockID, hashes []string) (BlockID, string, error) {
	bs := m.Groups[g].BlockSize
	if err := checkChunkShape(m, bs, c); err != nil {
		return 0, "", err
	}
	bi, hi := c.BlockIndex(bs), c.HashIndex(m.HashBlockSize)
	if bi >= len(blocks) {
		return 0, "", fmt.Errorf("block index %d of %d: %w", bi, len(blocks), ErrChunkOutOfRange)
	}
	if blocks[bi] < 0 {
		return 0, "", fmt.Errorf("block index %d is null: %w", bi, ErrChunkOutOfRange)
	}
	if hi >= len(hashes) {
		return 0, "", fmt.Errorf("hash index %d of %d: %w", hi, len(hashes), ErrChunkOutOfRange)
	}
	if !IsHashHex(hashes[hi]) {
		return 0, "", fmt.Errorf("hash %d %q is not lower-case hex: %w", hi, hashes[hi], ErrChunkOutOfRange)
	}
	return blocks[bi], hashes[hi], nil
}

// IsHashHex reports whether s is the non-empty lower-case hex of a hash, the
// only form that keeps a store key unambiguous.
func IsHashHex(s string) bool {
	if s == "" || len(s)%2 != 0 {
		return false
	}
	// One table load per byte, or-ed over eight at a time: no branch per
	// byte (intake checks every hash of every admitted chain).
	var bad byte
	i := 0
	for ; i+8 <= len(s); i += 8 {
		bad |= notHex[s[i]] | notHex[s[i+1]] | notHex[s[i+2]] | notHex[s[i+3]] |
			notHex[s[i+4]] | notHex[s[i+5]] | notHex[s[i+6]] | notHex[s[i+7]]
	}
	for ; i < len(s); i++ {
		bad |= notHex[s[i]]
	}
	return bad == 0
}

// notHex is 1 for every byte that is not a lower-case hex digit.
var notHex = func() (t [256]byte) {
	for c := range t {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			t[c] = 1
		}
	}
	return t
}()

// ListedBlocks is every block a task names for the chunks it loads, each
// once: the block of each chunk where the table has it, and every non-null
// block of a group whose chunks cannot be mapped. It is the load-error list
// of a load that cannot be planned or that failed as a whole (a rank that
// never reported, a stale task), so the engine recomputes them all.
func ListedBlocks(m *Model, task *LoadTask) []BlockID {
	var out []BlockID
	seen := map[BlockID]bool{}
	add := func(b BlockID) {
		if b != NullBlock && !seen[b] {
			seen[b] = true
			out = append(out, b)
		}
	}
	for _, gc := range task.Groups {
		g := gc.Group
		if g < 0 || g >= len(task.BlockTable) {
			continue
		}
		blocks := task.BlockTable[g]
		mapped := g < len(m.Groups)
		var picked []BlockID
		for _, c := range gc.Chunks {
			if !mapped {
				break
			}
			bi := c.BlockIndex(m.Groups[g].BlockSize)
			if c.Start < 0 || bi < 0 || bi >= len(blocks) {
				mapped = false
				break
			}
			picked = append(picked, blocks[bi])
		}
		if !mapped {
			picked = blocks
		}
		for _, b := range picked {
			add(b)
		}
	}
	return out
}

// checkChunkShape accepts a whole block of size bs and, with partial hash
// hits, a chunk from a block's start to a hash-block boundary inside it.
func checkChunkShape(m *Model, bs int, c Chunk) error {
	if c.Start < 0 || c.Start%bs != 0 {
		return fmt.Errorf("chunk [%d,%d) does not start a block of size %d: %w", c.Start, c.End, bs, ErrChunkOutOfRange)
	}
	whole := c.End == c.Start+bs
	sub := m.PartialHashHits() && c.End > c.Start && c.End < c.Start+bs && c.End%m.HashBlockSize == 0
	if !whole && !sub {
		return fmt.Errorf("chunk [%d,%d) is not a block of size %d: %w", c.Start, c.End, bs, ErrChunkOutOfRange)
	}
	return nil
}
