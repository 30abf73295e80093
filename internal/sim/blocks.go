package sim

import (
	"container/list"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// nullBlockID is the engine's null block, as in vLLM: BlockPool.__init__
// (vllm/v1/core/block_pool.py) takes the first free block, block 0, as
// null_block, and block tables carry NULL_BLOCK_ID = 0
// (vllm/v1/attention/backends/utils.py) for slots that hold nothing (Mamba
// states before the hit, sliding-window blocks out of the window). Block 0
// is never handed out; real blocks are 1 … pool size − 1. The engine
// declares it in every step record (contract.EngineStep.NullBlockID) and
// in the kv_transfer_params it hands to its decode peer
// (contract.PDSource.NullBlockID), so that the mesh sees vLLM's
// convention end to end.
const nullBlockID kvcore.BlockID = 0

// declaredNullBlockID is nullBlockID as the contract declares it.
func declaredNullBlockID() *int64 {
	id := int64(nullBlockID)
	return &id
}

// blockPool is the engine's block manager for one rank: for every KV group a
// fixed number of blocks (the gpuworker's pool, or fewer; block 0 of them
// is the null block, never handed out), reference counts,
// a prefix cache of blocks whose bytes are known (keyed by the chunk's block
// hash), and pins that keep a block from being reused while a save task may
// still read it. Freed blocks with known contents stay cached, least recently
// freed evicted first, as in vLLM's prefix caching. A block the gpuworker
// may hold content in (written, loaded) that alloc hands out again is
// listed as evicted, for the engine to declare to the worker (takeEvicted).
type blockPool struct {
	groups  []*groupBlocks
	evicted []blockRef
}

type groupBlocks struct {
	ref   []int32
	pin   []int32
	key   []string        // cache key of the block's contents; "" when unknown
	index map[string]int  // cache key → block
	free  []int           // ref 0, no key (may be pinned)
	lru   *list.List      // ref 0 with a key, least recently freed first
	elem  []*list.Element // position in lru, nil when not there
	avail int             // blocks with ref 0 and pin 0
	held  []bool          // the worker may hold content in the block
}

// newBlockPool returns a pool of blocks ids per group, 0 … blocks − 1, of
// which block 0 is the null block: blocks − 1 of them can be handed out.
func newBlockPool(groups, blocks int) *blockPool {
	p := &blockPool{groups: make([]*groupBlocks, groups)}
	real := max(0, blocks-1)
	for g := range p.groups {
		gb := &groupBlocks{
			ref: make([]int32, blocks), pin: make([]int32, blocks), key: make([]string, blocks),
			index: map[string]int{}, lru: list.New(), elem: make([]*list.Element, blocks), avail: real,
			held: make([]bool, blocks),
		}
		for b := blocks - 1; b > int(nullBlockID); b-- {
			gb.free = append(gb.free, b)
		}
		p.groups[g] = gb
	}
	return p
}

// usableBlocks is the number of real blocks a pool of blocks ids holds:
// all but the null block.
func usableBlocks(blocks int) int { return max(0, blocks-1) }

// available is the number of blocks of group g that alloc can hand out.
func (p *blockPool) available(g int) int { return p.groups[g].avail }

// alloc hands out a block of group g with reference count 1 and unknown
// contents: a free block if there is one, else the least recently freed
// cached block (evicting its contents from the cache). Pinned blocks are
// never handed out.
func (p *blockPool) alloc(g int) (kvcore.BlockID, bool) {
	gb := p.groups[g]
	for i := len(gb.free) - 1; i >= 0; i-- {
		b := gb.free[i]
		if gb.pin[b] > 0 {
			continue
		}
		gb.free = append(gb.free[:i], gb.free[i+1:]...)
		p.reuse(g, b)
		return kvcore.BlockID(b), true
	}
	for e := gb.lru.Front(); e != nil; e = e.Next() {
		b := e.Value.(int)
		if gb.pin[b] > 0 {
			continue
		}
		gb.lru.Remove(e)
		gb.elem[b] = nil
		gb.forget(b)
		p.reuse(g, b)
		return kvcore.BlockID(b), true
	}
	return nullBlockID, false
}

// reuse gives an unreferenced, unpinned block its first reference for new
// contents, listing it as evicted when the worker may hold old content.
func (p *blockPool) reuse(g, b int) {
	gb := p.groups[g]
	gb.ref[b] = 1
	gb.avail--
	if gb.held[b] {
		gb.held[b] = false
		p.evicted = append(p.evicted, blockRef{g, kvcore.BlockID(b)})
	}
}

// hold records that the worker may now hold content in a block (the engine
// wrote it, or a load was asked to write it).
func (p *blockPool) hold(g int, id kvcore.BlockID) { p.groups[g].held[id] = true }

// takeEvicted returns the blocks evicted since the last call.
func (p *blockPool) takeEvicted() []blockRef {
	out := p.evicted
	p.evicted = nil
	return out
}

// cached returns the block of group g whose contents are key, if cached.
func (p *blockPool) cached(g int, key string) (kvcore.BlockID, bool) {
	b, ok := p.groups[g].index[key]
	return kvcore.BlockID(b), ok
}

// acquire adds a reference to a block (a prefix-cache hit).
func (p *blockPool) acquire(g int, id kvcore.BlockID) {
	gb := p.groups[g]
	b := int(id)
	if gb.ref[b] == 0 {
		if gb.elem[b] != nil {
			gb.lru.Remove(gb.elem[b])
			gb.elem[b] = nil
		} else {
			gb.dropFree(b)
		}
		if gb.pin[b] == 0 {
			gb.avail--
		}
	}
	gb.ref[b]++
}

// release drops a reference; an unreferenced block becomes reusable (kept in
// the prefix cache when its contents are known).
func (p *blockPool) release(g int, id kvcore.BlockID) {
	gb := p.groups[g]
	b := int(id)
	gb.ref[b]--
	if gb.ref[b] > 0 {
		return
	}
	if gb.key[b] != "" {
		gb.elem[b] = gb.lru.PushBack(b)
	} else {
		gb.free = append(gb.free, b)
	}
	if gb.pin[b] == 0 {
		gb.avail++
	}
}

// register records that a referenced block holds the contents named key,
// unless another block already holds them.
func (p *blockPool) register(g int, id kvcore.BlockID, key string) {
	gb := p.groups[g]
	b := int(id)
	if _, dup := gb.index[key]; dup || gb.key[b] == key {
		return
	}
	gb.forget(b)
	gb.key[b] = key
	gb.index[key] = b
}

func (gb *groupBlocks) forget(b int) {
	if k := gb.key[b]; k != "" {
		if gb.index[k] == b {
			delete(gb.index, k)
		}
		gb.key[b] = ""
	}
}

func (gb *groupBlocks) dropFree(b int) {
	for i, v := range gb.free {
		if v == b {
			gb.free = append(gb.free[:i], gb.free[i+1:]...)
			return
		}
	}
}

// pin keeps a block from being handed out until the matching unpin.
func (p *blockPool) pin(g int, id kvcore.BlockID) {
	gb := p.groups[g]
	b := int(id)
	if gb.pin[b] == 0 && gb.ref[b] == 0 {
		gb.avail--
	}
	gb.pin[b]++
}

// unpin drops one pin.
func (p *blockPool) unpin(g int, id kvcore.BlockID) {
	gb := p.groups[g]
	b := int(id)
	gb.pin[b]--
	if gb.pin[b] == 0 && gb.ref[b] == 0 {
		gb.avail++
	}
}

// inUse is the number of referenced blocks of group g.
func (p *blockPool) inUse(g int) int {
	n := 0
	for _, r := range p.groups[g].ref {
		if r > 0 {
			n++
		}
	}
	return n
}

// reusable reports whether a block is unreferenced and unpinned, so that
// taking it lowers what alloc can hand out.
func (p *blockPool) reusable(g int, id kvcore.BlockID) bool {
	gb := p.groups[g]
	return gb.ref[id] == 0 && gb.pin[id] == 0
}
