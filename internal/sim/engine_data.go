package sim

import (
	"bytes"
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// chunkBlock is one chunk of one group held in one pool block.
type chunkBlock struct {
	group int
	block kvcore.BlockID
	chunk kvcore.Chunk
	hash  kvcore.BlockHash
	key   string // the hash in hex: the block's identity
	req   string // the request that computes or loads it
	// tenant is the request's tenant: the prefix cache keeps its blocks
	// apart from other tenants' (cacheKey).
	tenant string
}

// compute "computes" the step's KV: every block a scheduled request
// completes this step gets the bytes its hash implies, written into every
// rank's gpuworker; then the blocks enter the prefix cache.
func (e *engine) compute(ctx context.Context, sched []scheduled) error {
	if e.deadRank() != nil {
		return nil
	}
	var todo []chunkBlock
	for _, s := range sched {
		todo = append(todo, e.completed(s.r, s.r.computed, s.r.computed+s.n)...)
		todo = append(todo, e.promptTail(s.r, s.r.computed+s.n)...)
	}
	return e.write(ctx, todo)
}

// promptTail lists, under partial hash hits, the sub-block prompt tail a
// step that computed the request up to `to` makes available: once the
// request's computed tokens reach P (kvcore.PromptTailEnd: the prompt
// rounded down to the hash block, inside a block) while P's block is still
// incomplete, every group's block holding P gets the content of the chunk
// [block start, P), identified by P's hash — what vLLM's engine hands the
// connector for _sub_block_tail_puts (the full-attention block's prefix up
// to P, the Mamba state at P copied on write), and what the tracker's
// prompt-tail save reads (requeststate Tracker.maybeSaveTail, the same rule). It
// is written once per allocation; completing the block later replaces it
// with the whole block's content.
func (e *engine) promptTail(r *request, to int) []chunkBlock {
	p := kvcore.PromptTailEnd(e.model, len(r.prompt))
	if p == 0 || to < p || to >= ceilDiv(p, e.sbs)*e.sbs || e.tailWritten[r.id] {
		return nil
	}
	e.tailWritten[r.id] = true
	r.extendHashes(e.model.HashBlockSize)
	hi := p/e.model.HashBlockSize - 1
	var out []chunkBlock
	for g, grp := range e.model.Groups {
		bi := p / grp.BlockSize
		if bi >= len(r.table[g]) || r.table[g][bi] == nullBlockID {
			continue
		}
		c := kvcore.Chunk{Start: bi * grp.BlockSize, End: p}
		out = append(out, chunkBlock{group: g, block: r.table[g][bi], chunk: c, hash: r.hashes[hi], key: r.hexes[hi], req: r.id, tenant: r.tenant})
	}
	return out
}

// completed lists the chunks whose last token lies in (from, to].
func (e *engine) completed(r *request, from, to int) []chunkBlock {
	r.extendHashes(e.model.HashBlockSize)
	var out []chunkBlock
	for g, grp := range e.model.Groups {
		for p := from / grp.BlockSize; (p+1)*grp.BlockSize <= to; p++ {
			c := kvcore.Chunk{Start: p * grp.BlockSize, End: (p + 1) * grp.BlockSize}
			if c.End <= from {
				continue
			}
			hi := c.HashIndex(e.model.HashBlockSize)
			out = append(out, chunkBlock{group: g, block: r.table[g][p], chunk: c, hash: r.hashes[hi], key: r.hexes[hi], req: r.id, tenant: r.tenant})
		}
	}
	return out
}

// write fills blocks with their contents on every rank, in parallel (each
// rank the bytes of its own namespace), and registers them in the cache.
// When a rank is dead, or dies on this write, nothing is registered: the
// caller fails the requests that needed the blocks (engine.deadRank). An
// error is a write refused for good.
func (e *engine) write(ctx context.Context, todo []chunkBlock) error {
	if len(todo) == 0 {
		return nil
	}
	for _, cb := range todo {
		e.pool.hold(cb.group, cb.block) // even a failed write may have written some
	}
	if e.deadRank() != nil {
		return nil
	}
	content := e.contentOf(todo, e.buffered())
	perRank := make([][]dataplane.Block, len(e.ranks))
	for _, rw := range e.ranks {
		perRank[rw.index] = e.rankBlocks(todo, content, rw)
	}
	var perRankBytes int64
	for _, cb := range todo {
		perRankBytes += e.model.Groups[cb.group].BytesPerBlock
	}
	err := e.onRanks(ctx, fmt.Sprintf("write %d blocks", len(todo)), func(ctx context.Context, rw *rankWorker) error {
		if err := e.writeRank(ctx, rw, todo, perRank[rw.index]); err != nil {
			return err
		}
		rw.blocksWritten += len(todo)
		rw.bytesWritten += perRankBytes
		return nil
	})
	if err != nil || e.deadRank() != nil {
		return err
	}
	var total, overHTTP int64
	for _, rw := range e.ranks {
		total += perRankBytes
		if rw.mem == nil {
			overHTTP += perRankBytes
		}
	}
	for _, cb := range todo {
		e.pool.register(cb.group, cb.block, cacheKey(cb.tenant, cb.key))
	}
	e.stats.update(func(st *stats) { st.bytesWritten += total; st.bytesWrittenHTTP += overHTTP })
	return nil
}

// readRank reads one rank's loaded blocks back: from the KV memory the
// engine registered with the rank's gpuworker (where the worker's loads
// land; the worker is asked first whether the memory is still registered,
// so an unreachable worker is found dead as before), or over the data
// plane's read route.
func (e *engine) readRank(ctx context.Context, rw *rankWorker, refs []dataplane.ReadRef) ([]dataplane.ReadBlock, error) {
	if rw.mem == nil {
		return rw.client.Read(ctx, refs)
	}
	if err := rw.mem.ensure(ctx, e.hc, rw.url); err != nil {
		return nil, err
	}
	return rw.mem.read(refs), nil
}

// writeRank writes one rank's blocks: straight into the KV memory the
// engine registered with its gpuworker (registering it again first when
// the worker restarted), or over the data plane's write route.
func (e *engine) writeRank(ctx context.Context, rw *rankWorker, todo []chunkBlock, blocks []dataplane.Block) error {
	if rw.mem == nil {
		return rw.client.Write(ctx, blocks)
	}
	if err := rw.mem.ensure(ctx, e.hc, rw.url); err != nil {
		return err
	}
	return rw.mem.write(blocks, func(i int, segs [][]byte) {
		cb := todo[i]
		e.cont.nsFill(segs, cb.group, e.namespaces[cb.group][e.nsIndex[cb.group][rw.index]], cb.hash)
	})
}

// buffered says which namespaces' content is computed into buffers of its
// own (contentOf): buffered[g][n] is set when namespace n of group g is
// shared by several ranks (computed once, copied to each) or one of its
// ranks is written over HTTP. The content of the others is computed
// straight into the one rank's KV memory (rankMemory.write).
func (e *engine) buffered() [][]bool {
	out := make([][]bool, len(e.namespaces))
	for g := range e.namespaces {
		out[g] = make([]bool, len(e.namespaces[g]))
		ranks := make([]int, len(e.namespaces[g]))
		for _, rw := range e.ranks {
			n := e.nsIndex[g][rw.index]
			ranks[n]++
			if rw.mem == nil || ranks[n] > 1 {
				out[g][n] = true
			}
		}
	}
	return out
}

// contentOf computes the content of every block in every buffered
// namespace of its group (every namespace with buffered nil), in parallel:
// out[i][n] is block i's bytes in namespace n of its group
// (engine.namespaces), nil where the namespace is not buffered. Ranks that share a namespace share the bytes.
func (e *engine) contentOf(blocks []chunkBlock, buffered [][]bool) [][][]byte {
	type job struct{ block, ns int }
	var jobs []job
	out := make([][][]byte, len(blocks))
	for i, cb := range blocks {
		out[i] = make([][]byte, len(e.namespaces[cb.group]))
		for n := range out[i] {
			if buffered == nil || buffered[cb.group][n] {
				jobs = append(jobs, job{i, n})
			}
		}
	}
	parallel(len(jobs), func(j int) {
		jb := jobs[j]
		cb := blocks[jb.block]
		out[jb.block][jb.ns] = e.cont.nsBlock(cb.group, e.namespaces[cb.group][jb.ns], cb.hash)
	})
	return out
}

// rankBlocks are the frames rank rw gets for the blocks.
func (e *engine) rankBlocks(todo []chunkBlock, content [][][]byte, rw *rankWorker) []dataplane.Block {
	out := make([]dataplane.Block, len(todo))
	for i, cb := range todo {
		out[i] = dataplane.Block{BlockRef: dataplane.BlockRef{Group: cb.group, Block: cb.block},
			Identity: dataplane.Identity{Hash: cb.key, RequestID: cb.req}, Data: content[i][e.nsIndex[cb.group][rw.index]]}
	}
	return out
}

// loaded handles finished_recving: every loaded block is read back from
// every rank's gpuworker and compared byte for byte with what its hash
// implies on that rank; blocks reported as load errors, blocks a worker no
// longer holds (lost KV: the worker restarted since the load), and any
// mismatch, are recomputed (rewritten on every rank), as vLLM recomputes
// failed loads. Then the request waits to be scheduled. With a dead rank
// the request cannot go on: it is given up (out gets its finish).
func (e *engine) loaded(ctx context.Context, out *outbox, r *request, f contract.EngineFeedback) error {
	var check, redo []chunkBlock
	for _, gc := range r.load.groups {
		bs := e.model.Groups[gc.Group].BlockSize
		for _, c := range gc.Chunks {
			hi := c.HashIndex(e.model.HashBlockSize)
			cb := chunkBlock{group: gc.Group, block: r.table[gc.Group][c.BlockIndex(bs)], chunk: c, hash: r.hashes[hi], key: r.hexes[hi], req: r.id, tenant: r.tenant}
			if slices.Contains(f.LoadErrors, cb.block) {
				redo = append(redo, cb)
			} else {
				check = append(check, cb)
			}
		}
	}
	e.missingRanks(f.MissingRanks)
	bad, lost, err := e.verify(ctx, r, check)
	if err != nil {
		return err
	}
	again := slices.Concat(redo, bad, lost)
	if err := e.write(ctx, again); err != nil {
		return err
	}
	recomputed := 0
	for _, cb := range again {
		recomputed += cb.chunk.End - cb.chunk.Start
	}
	dead := e.deadRank()
	e.stats.update(func(st *stats) {
		st.loads++
		st.loadErrorBlocks += len(redo)
		st.lostBlocks += len(lost)
		if dead == nil {
			st.recomputedTokens += recomputed
		}
	})
	e.shadowLoaded(r)
	if r.load.connector == "pd" {
		e.hooks.peerRead(r.id)
	}
	r.computed, r.load = r.load.end, nil
	if dead != nil {
		e.failDead(out, r, dead)
		return nil
	}
	r.phase, r.since = phaseAllocated, time.Now()
	e.waiting = append([]*request{r}, e.waiting...)
	return nil
}

// missingRanks counts, per rank, the loads the scheduler finished without
// that rank's report (KVMESH_LOAD_RANK_TIMEOUT).
func (e *engine) missingRanks(missing []kvcore.Rank) {
	for _, m := range missing {
		for _, rw := range e.ranks {
			if rw.rank == m {
				rw.loadsMissing++
			}
		}
	}
}

// shadowLoaded reports the request's loads finished to its shadow tracker:
// on every rank of a multi-rank engine (requeststate.Tracker.OnRankLoadResult),
// as the scheduler's tracker saw them.
func (e *engine) shadowLoaded(r *request) {
	for _, id := range slices.Clone(r.shadow.PendingLoads) {
		if e.model.WorldSize() == 1 {
			e.shadowEffects(r, r.shadow.OnLoadResult(id, nil))
			continue
		}
		for _, rk := range e.model.WorkerRanks() {
			e.shadowEffects(r, r.shadow.OnRankLoadResult(id, &rk, nil))
		}
	}
}

// verify reads blocks back from every live rank, each asked by the hash it
// must hold, and returns those whose bytes are wrong on some rank (each
// rank's copy counted as a mismatch) and those a rank refuses as not
// holding that hash (lost KV: with KVMemoryHTTP the pool lives in the
// worker process, so a restart loses it; with KVMemoryShm the blocks are
// read from the engine's own segment, where the worker's loads land); blocks right on every rank enter the prefix cache. A
// dead rank's copies are not verified (counted as unverified, never as
// right), and nothing enters the cache then.
func (e *engine) verify(ctx context.Context, r *request, check []chunkBlock) (bad, lost []chunkBlock, err error) {
	if len(check) == 0 {
		return nil, nil, nil
	}
	refs := make([]dataplane.ReadRef, len(check))
	for i, cb := range check {
		refs[i] = dataplane.ReadRef{BlockRef: dataplane.BlockRef{Group: cb.group, Block: cb.block}, Hash: cb.key}
	}
	got := make([][]dataplane.ReadBlock, len(e.ranks))
	err = e.onRanks(ctx, fmt.Sprintf("read back %d loaded blocks of %s", len(refs), r.id), func(ctx context.Context, rw *rankWorker) error {
		blocks, err := e.readRank(ctx, rw, refs)
		if err == nil && len(blocks) != len(refs) {
			err = fmt.Errorf("%d blocks answered for %d asked: %w", len(blocks), len(refs), errProtocol)
		}
		got[rw.index] = blocks
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	ok := e.compare(check, got)
	var t verifyTally
	for i, cb := range check {
		switch t.block(e, r, cb, i, got, ok) {
		case copyBad:
			bad = append(bad, cb)
		case copyLost:
			lost = append(lost, cb)
		case copyRight:
			e.pool.register(cb.group, cb.block, cacheKey(cb.tenant, cb.key))
		}
	}
	e.stats.update(func(st *stats) {
		st.verifiedBlocks += t.copies
		st.bytesRead += t.bytes
		st.unverifiedBlocks += t.unavailable
	})
	return bad, lost, nil
}

// copyState is what a loaded block's copies on the ranks came to, the
// worst rank's: a later state is worse.
type copyState int

const (
	copyRight      copyState = iota // right on every rank
	copyUnverified                  // right where verified, but a rank was dead
	copyLost                        // not held on some rank
	copyBad                         // wrong on some rank
)

// verifyTally counts one verification's block copies.
type verifyTally struct {
	copies, unavailable int
	bytes               int64
}

// block checks loaded block i's copy on every rank, counting each rank's
// outcome on the rank and each mismatch in the stats.
func (t *verifyTally) block(e *engine, r *request, cb chunkBlock, i int, got [][]dataplane.ReadBlock, ok [][]bool) copyState {
	state := copyRight
	worse := func(s copyState) { state = max(state, s) }
	for _, rw := range e.ranks {
		if rw.dead != nil {
			rw.unverified++
			t.unavailable++
			worse(copyUnverified)
			continue
		}
		b := got[rw.index][i]
		t.bytes += int64(len(b.Data))
		switch {
		case b.NotHeld != "":
			rw.lost++
			worse(copyLost)
		case ok[rw.index][i]:
			rw.verified++
			t.copies++
		default:
			rw.verified++
			rw.mismatched++
			t.copies++
			worse(copyBad)
			e.stats.mismatch(Mismatch{EngineID: e.id, RequestID: r.id, Group: cb.group, Block: int64(cb.block),
				Chunk: fmt.Sprintf("[%d,%d)", cb.chunk.Start, cb.chunk.End), Connector: r.load.connector, Rank: rw.label()})
		}
	}
	return state
}

// compare checks every live rank's served copies against the content of
// their namespace: ok[k][i] is rank k's copy of block i.
func (e *engine) compare(check []chunkBlock, got [][]dataplane.ReadBlock) [][]bool {
	content := e.contentOf(check, nil)
	ok := make([][]bool, len(e.ranks))
	type job struct{ rank, block int }
	var jobs []job
	for _, rw := range e.ranks {
		ok[rw.index] = make([]bool, len(check))
		if rw.dead != nil {
			continue
		}
		for i := range check {
			jobs = append(jobs, job{rw.index, i})
		}
	}
	parallel(len(jobs), func(j int) {
		jb := jobs[j]
		cb, b := check[jb.block], got[jb.rank][jb.block]
		want := content[jb.block][e.nsIndex[cb.group][jb.rank]]
		ok[jb.rank][jb.block] = b.NotHeld == "" && bytes.Equal(b.Data, want)
	})
	return ok
}

// evict declares to every rank's gpuworker, in one call each, the blocks
// whose content the engine dropped to reuse them (the block-lifetime
// contract: no read may be served from them until they are rewritten).
// Blocks that a save in flight still reads (preempted with reusePreempted)
// are counted. A failed evict is counted and logged, not fatal: every
// write replaces a block's identity anyway. Dead ranks are skipped.
func (e *engine) evict(ctx context.Context) {
	evicted := e.pool.takeEvicted()
	if len(evicted) == 0 {
		return
	}
	refs := make([]dataplane.BlockRef, len(evicted))
	reused := 0
	for i, ref := range evicted {
		refs[i] = dataplane.BlockRef{Group: ref.group, Block: ref.block}
		if e.orphaned[ref] > 0 {
			reused++
		}
	}
	alive := e.deadRank() == nil
	held := make([]int, len(e.ranks))
	err := e.onRanks(ctx, fmt.Sprintf("evict %d blocks", len(refs)), func(ctx context.Context, rw *rankWorker) error {
		evict := rw.client.Evict
		if rw.mem != nil {
			evict = func(context.Context, []dataplane.BlockRef) (int, error) { return rw.mem.evict(refs) }
		}
		n, err := evict(ctx, refs)
		held[rw.index] = n
		return err
	})
	failed := err != nil || alive && e.deadRank() != nil
	if err != nil && ctx.Err() == nil {
		e.log.Warn("evict failed", "engine", e.id, "blocks", len(refs), "err", err)
	}
	e.stats.update(func(st *stats) {
		st.evictCalls++
		st.evictedBlocks += len(refs)
		st.evictedHeld += slices.Max(append(held, 0))
		st.reusedWhileSaving += reused
		if failed {
			st.evictFailures++
		}
	})
}

// parallel runs f(0..n-1) on up to GOMAXPROCS goroutines.
func parallel(n int, f func(i int)) {
	workers := min(n, runtime.GOMAXPROCS(0))
	if workers <= 1 {
		for i := range n {
			f(i)
		}
		return
	}
	var wg sync.WaitGroup
	next := make(chan int)
	for range workers {
		wg.Go(func() {
			for i := range next {
				f(i)
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
}
