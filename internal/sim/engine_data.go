package sim

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

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
}

// compute "computes" the step's KV: every block a scheduled request
// completes this step gets the bytes its hash implies, written into the
// gpuworker; then the blocks enter the prefix cache.
func (e *engine) compute(ctx context.Context, sched []scheduled) error {
	var todo []chunkBlock
	for _, s := range sched {
		todo = append(todo, e.completed(s.r, s.r.computed, s.r.computed+s.n)...)
	}
	return e.write(ctx, todo)
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
			out = append(out, chunkBlock{group: g, block: r.table[g][p], chunk: c, hash: r.hashes[hi], key: r.hexes[hi], req: r.id})
		}
	}
	return out
}

// write fills blocks with their contents and registers them in the cache.
func (e *engine) write(ctx context.Context, todo []chunkBlock) error {
	if len(todo) == 0 {
		return nil
	}
	blocks := make([]dataplane.Block, len(todo))
	parallel(len(todo), func(i int) {
		cb := todo[i]
		blocks[i] = dataplane.Block{BlockRef: dataplane.BlockRef{Group: cb.group, Block: cb.block},
			Identity: dataplane.Identity{Hash: cb.key, RequestID: cb.req}, Data: e.cont.block(cb.group, e.rank, cb.hash)}
	})
	var n int64
	for _, b := range blocks {
		n += int64(len(b.Data))
	}
	for _, cb := range todo {
		e.pool.hold(cb.group, cb.block) // even a failed write may have written some
	}
	if err := retryFor(ctx, e.timeout, func() error { return e.worker.Write(ctx, blocks) }); err != nil {
		return fmt.Errorf("engine %s: write %d blocks: %w", e.id, len(blocks), err)
	}
	for _, cb := range todo {
		e.pool.register(cb.group, cb.block, cb.key)
	}
	e.stats.update(func(st *stats) { st.bytesWritten += n })
	return nil
}

// loaded handles finished_recving: every loaded block is read back from the
// gpuworker and compared byte for byte with what its hash implies; blocks
// reported as load errors, blocks the worker no longer holds (lost KV: the
// worker restarted since the load), and any mismatch, are recomputed
// (rewritten), as vLLM recomputes failed loads. Then the request waits to be
// scheduled.
func (e *engine) loaded(ctx context.Context, r *request, loadErrors []kvcore.BlockID) error {
	var check, redo []chunkBlock
	for _, gc := range r.load.groups {
		bs := e.model.Groups[gc.Group].BlockSize
		for _, c := range gc.Chunks {
			hi := c.HashIndex(e.model.HashBlockSize)
			cb := chunkBlock{group: gc.Group, block: r.table[gc.Group][c.BlockIndex(bs)], chunk: c, hash: r.hashes[hi], key: r.hexes[hi], req: r.id}
			if slices.Contains(loadErrors, cb.block) {
				redo = append(redo, cb)
			} else {
				check = append(check, cb)
			}
		}
	}
	bad, lost, err := e.verify(ctx, r, check)
	if err != nil {
		return err
	}
	again := slices.Concat(redo, bad, lost)
	recomputed := 0
	for _, cb := range again {
		recomputed += cb.chunk.End - cb.chunk.Start
	}
	e.stats.update(func(st *stats) {
		st.loads++
		st.loadErrorBlocks += len(redo)
		st.lostBlocks += len(lost)
		st.recomputedTokens += recomputed
	})
	if err := e.write(ctx, again); err != nil {
		return err
	}
	for _, id := range slices.Clone(r.shadow.PendingLoads) {
		e.shadowEffects(r, r.shadow.OnLoadResult(id, nil))
	}
	if r.load.connector == "pd" {
		e.hooks.peerRead(r.id)
	}
	r.computed, r.load = r.load.end, nil
	r.phase, r.since = phaseAllocated, time.Now()
	e.waiting = append([]*request{r}, e.waiting...)
	return nil
}

// verify reads blocks back, each asked by the hash it must hold, and
// returns those whose bytes are wrong (each counted as a mismatch) and those
// the worker refuses as not holding that hash (lost KV: the pool lives in
// the worker process, so a restart loses it); the right ones enter the
// prefix cache.
func (e *engine) verify(ctx context.Context, r *request, check []chunkBlock) (bad, lost []chunkBlock, err error) {
	if len(check) == 0 {
		return nil, nil, nil
	}
	refs := make([]dataplane.ReadRef, len(check))
	for i, cb := range check {
		refs[i] = dataplane.ReadRef{BlockRef: dataplane.BlockRef{Group: cb.group, Block: cb.block}, Hash: cb.key}
	}
	var got []dataplane.ReadBlock
	err = retryFor(ctx, e.timeout, func() error {
		var err error
		got, err = e.worker.Read(ctx, refs)
		return err
	})
	if err == nil && len(got) != len(refs) {
		err = fmt.Errorf("%d blocks answered for %d asked: %w", len(got), len(refs), ErrHTTP)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("engine %s: read back %d loaded blocks of %s: %w", e.id, len(refs), r.id, err)
	}
	ok := make([]bool, len(check))
	parallel(len(check), func(i int) {
		ok[i] = got[i].NotHeld == "" && e.cont.matches(got[i].Data, check[i].group, e.rank, check[i].hash)
	})
	var n int64
	for i, cb := range check {
		n += int64(len(got[i].Data))
		if got[i].NotHeld != "" {
			lost = append(lost, cb)
			continue
		}
		if ok[i] {
			e.pool.register(cb.group, cb.block, cb.key)
			continue
		}
		bad = append(bad, cb)
		e.stats.mismatch(Mismatch{EngineID: e.id, RequestID: r.id, Group: cb.group, Block: int64(cb.block),
			Chunk: fmt.Sprintf("[%d,%d)", cb.chunk.Start, cb.chunk.End), Connector: r.load.connector})
	}
	e.stats.update(func(st *stats) { st.verifiedBlocks += len(check) - len(lost); st.bytesRead += n })
	return bad, lost, nil
}

// evict declares to the gpuworker, in one call, the blocks whose content the
// engine dropped to reuse them (the block-lifetime contract: no read may be
// served from them until they are rewritten). Blocks that a save in flight
// still reads (preempted with reusePreempted) are counted. A failed evict is
// counted and logged, not fatal: every write replaces a block's identity
// anyway.
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
	var held int
	err := retryFor(ctx, e.timeout, func() error {
		var err error
		held, err = e.worker.Evict(ctx, refs)
		return err
	})
	if err != nil && ctx.Err() == nil {
		e.log.Warn("evict failed", "engine", e.id, "blocks", len(refs), "err", err)
	}
	e.stats.update(func(st *stats) {
		st.evictCalls++
		st.evictedBlocks += len(refs)
		st.evictedHeld += held
		st.reusedWhileSaving += reused
		if err != nil {
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
