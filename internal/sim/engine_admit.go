package sim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// admit tries to start one waiting request: its local prefix-cache hit, a
// check that its blocks fit, the lookup, the allocation and its events. It
// reports false when the request must wait (no room, lookup pending or
// unavailable); the request then stays at the head of the queue. With a
// dead rank the engine cannot serve it: it is given up at once.
func (e *engine) admit(ctx context.Context, out *outbox, r *request) bool {
	if d := e.deadRank(); d != nil {
		e.failDead(out, r, d)
		return true
	}
	r.extendHashes(e.model.HashBlockSize)
	num := r.numTokens()
	if g, need, ok := e.everFits(num); !ok {
		e.giveUp(out, r, fmt.Sprintf("%d tokens need %d blocks of group %d, the pool has %d (watermark %d)", num, need, g, usableBlocks(e.cfg.PoolBlocks), e.cfg.Watermark))
		return true
	}
	local := e.localHit(r, num)
	if !e.fits(r, num, local) {
		return false
	}
	dec, ok := e.ask(ctx, r, num, local)
	if !ok {
		return false
	}
	ext, hit, conn := e.interpret(r, dec, num, local)
	if !e.allocate(r, num, local, hit) {
		return false // cannot happen after fits; the next step retries
	}
	r.computed = local
	e.stats.update(func(st *stats) {
		st.promptTokens += num
		st.localHitTokens += local
		if ext > 0 {
			st.loadedTokens[conn] += ext
		}
		if r.tenant != "" {
			st.tenantLocked(r.tenant, r.turn != nil && r.turn.index == 0, num, local, ext, conn)
		}
		c := st.engineLocked(e.id)
		c.PromptTokens += num
		c.LocalHitTokens += local
		c.LoadedTokens += ext
	})
	e.allocated(out, r, dec, ext, conn)
	if ext > 0 {
		// What the load task reads: each group's chunks to resume at the
		// hit, the last one keyed by the decision's tail key (kvcore's
		// Model.LoadGroupsTail, as the scheduler's tracker builds it).
		var tails []kvcore.TailKey
		if c := child(dec, conn); c != nil && c.Spec != nil {
			tails = c.Spec.TailKeys
		}
		r.load = &expectedLoad{connector: conn, start: local, end: hit, groups: e.model.LoadGroupsTail(local, hit, tails)}
		for _, gc := range r.load.groups {
			bs := e.model.Groups[gc.Group].BlockSize
			for _, c := range gc.Chunks {
				e.pool.hold(gc.Group, r.table[gc.Group][c.BlockIndex(bs)])
			}
		}
		step := kvcore.Step{Kind: kvcore.StepPendingLoad}
		e.event(out, r, contract.RequestEvent{Kind: contract.EventScheduled, Step: &step})
		e.shadowEffects(r, r.shadow.Step(e.model, step))
		r.phase, r.since = phaseLoading, time.Now()
	} else {
		r.phase, r.since = phaseAllocated, time.Now()
	}
	if r.pd != nil {
		if ext == 0 || conn != "pd" {
			e.hooks.peerRead(r.id)
		}
		r.pd = nil // a later attempt (after preemption) cannot use the prefill engine's blocks
	}
	return true
}

// allocated publishes admitted (first attempt) and allocated, and feeds the
// shadow tracker what the scheduler's store tracker receives: the store
// child's LoadSpec, and the external tokens only when store was chosen.
func (e *engine) allocated(out *outbox, r *request, dec *contract.LookupDecision, ext int, conn string) {
	if !r.admitted {
		r.admitted = true
		tokens := r.admittedTokens(e.model.HashBlockSize)
		e.event(out, r, contract.RequestEvent{Kind: contract.EventAdmitted, PromptTokens: len(r.prompt), BlockHashes: r.hexes,
			TokenIDs: tokens, Tenant: r.tenant})
		r.shadow.Tenant = r.tenant
		r.shadow.OnAdmit(r.hexes, len(r.prompt))
		r.shadow.OnAdmitTokens(e.model, tokens, "")
	}
	ev := contract.RequestEvent{Kind: contract.EventAllocated, ExternalTokens: ext, BlockTable: r.table.Clone()}
	var storeSpec *kvcore.LoadSpec
	if dec != nil {
		ev.DecisionID = dec.DecisionID
		if c := child(dec, "store"); c != nil && c.Spec != nil {
			s := *c.Spec
			storeSpec = &s
		}
	}
	e.event(out, r, ev)
	storeExt := 0
	if conn == "store" {
		storeExt = ext
	}
	e.shadowEffects(r, r.shadow.OnLookup(e.model, storeSpec))
	e.shadowEffects(r, r.shadow.OnAllocate(e.model, storeExt, r.table.NormalizeNull(nullBlockID)))
}

// ask calls the lookup. It reports false when the request must wait for a
// later step: the lookup is pending, or it is unavailable (503, 5xx, no
// answer) and the request's timeout since the first failure allows another
// try, which comes after a backoff (50 ms doubling to 1 s), so that a lookup
// outage shorter than the request timeout (a restart) is ridden out. After
// the timeout, or when the lookup refuses the request, the request goes on
// without external tokens (dec nil) and is marked failed.
func (e *engine) ask(ctx context.Context, r *request, num, local int) (*contract.LookupDecision, bool) {
	now := time.Now()
	if now.Before(r.lookupRetryAt) {
		return nil, false
	}
	req := lookupRequest{
		EngineID: e.id, RequestID: r.id, Model: e.model.Name, Tenant: r.tenant, BlockHashes: r.hexes,
		NumTokens: num, NumComputedTokens: local, KVTransferParams: r.pd,
	}
	dec, err := e.lookup.lookup(withEngine(r.ctx, e.id), req)
	took := time.Since(now)
	if err == nil || !errors.Is(err, ErrLookupUnavailable) {
		r.lookupFailingSince, r.lookupRetryAt, r.lookupFailures = time.Time{}, time.Time{}, 0
	}
	switch {
	case err == nil && !dec.Pending:
		e.stats.update(func(st *stats) { st.lookups++; st.lookupLatency = append(st.lookupLatency, took) })
		return dec, true
	case err == nil:
		e.stats.update(func(st *stats) { st.lookupPending++ })
		return nil, false
	case ctx.Err() != nil:
		return nil, false
	case errors.Is(err, ErrLookupUnavailable) && r.lookupRetry(time.Now(), e.timeout):
		e.stats.update(func(st *stats) { st.lookupRetries++ })
		e.log.Warn("lookup failed; retrying", "engine", e.id, "request", r.id, "in", time.Until(r.lookupRetryAt), "err", err)
		return nil, false
	case errors.Is(err, ErrLookupUnavailable):
		r.fail(fmt.Sprintf("lookup unavailable for %v: %v", e.timeout, err))
		return nil, true
	default:
		r.fail(fmt.Sprintf("lookup: %v", err))
		return nil, true
	}
}

// interpret checks the decision and returns the external tokens the engine
// accepts, the hit (where the request resumes) and the chosen connector. A
// decision that does not fit the engine's own state is counted as an
// anomaly, marks the request failed, and is not acted on.
func (e *engine) interpret(r *request, dec *contract.LookupDecision, num, local int) (ext, hit int, conn string) {
	if dec == nil || dec.ExternalTokens <= 0 || dec.Chosen == "" {
		return 0, local, ""
	}
	c := child(dec, dec.Chosen)
	var problem string
	switch {
	case c == nil || c.Spec == nil:
		problem = "chosen child has no load spec"
	case c.Spec.VLLMCachedTokens != local:
		problem = fmt.Sprintf("load spec cached %d, engine computed %d", c.Spec.VLLMCachedTokens, local)
	case c.Spec.KVPoolCachedTokens-local != dec.ExternalTokens:
		problem = fmt.Sprintf("external tokens %d, load spec hit %d - cached %d", dec.ExternalTokens, c.Spec.KVPoolCachedTokens, local)
	case c.Spec.KVPoolCachedTokens%e.model.HitAlignment() != 0 || c.Spec.KVPoolCachedTokens >= num:
		problem = fmt.Sprintf("hit %d is unaligned or not below the %d tokens", c.Spec.KVPoolCachedTokens, num)
	}
	if problem != "" {
		e.stats.update(func(st *stats) { st.lookupAnomalies++ })
		r.fail("lookup decision " + dec.DecisionID + ": " + problem)
		return 0, local, ""
	}
	return dec.ExternalTokens, c.Spec.KVPoolCachedTokens, dec.Chosen
}

func child(dec *contract.LookupDecision, name string) *contract.ChildDecision {
	for i := range dec.Children {
		if dec.Children[i].Name == name {
			return &dec.Children[i]
		}
	}
	return nil
}

// chunkKey is the prefix-cache key of a chunk's contents.
func (e *engine) chunkKey(r *request, c kvcore.Chunk) string {
	return cacheKey(r.tenant, r.hexes[c.HashIndex(e.model.HashBlockSize)])
}

// cacheKey is the prefix-cache key of a block of hash hashHex of tenant:
// the hash alone for no tenant, else the tenant and the hash, so that, as
// a vLLM engine whose requests carry a cache_salt, an engine never serves
// one tenant's blocks to another.
func cacheKey(tenant, hashHex string) string {
	if tenant == "" {
		return hashHex
	}
	return tenant + "@" + hashHex
}

// localHit is the engine's own prefix-cache hit: the longest h, a multiple
// of the scheduler block size below num (the engine computes at least one
// token), at which every group finds in the cache every chunk it needs to
// resume (kvcore's Model.LoadChunks, what a resume at h reads: all earlier
// chunks for full attention, the window for sliding window, the state at h
// for Mamba — vLLM's find_longest_cache_hit of each manager). The local
// cache is not probed inside a block: a sub-block prefix (partial hash
// hits) is only found in the store.
func (e *engine) localHit(r *request, num int) int {
	for h := (num - 1) / e.sbs * e.sbs; h >= e.sbs; h -= e.sbs {
		if e.cachedAt(r, h) {
			return h
		}
	}
	return 0
}

func (e *engine) cachedAt(r *request, h int) bool {
	for g := range e.model.Groups {
		for _, c := range e.model.LoadChunks(g, 0, h) {
			if _, ok := e.pool.cached(g, e.chunkKey(r, c)); !ok {
				return false
			}
		}
	}
	return true
}

// everFits reports whether a request of num tokens (and one more block to
// grow into) fits the pool at all; if not, the group and its need.
func (e *engine) everFits(num int) (group, need int, ok bool) {
	for g, grp := range e.model.Groups {
		if need := ceilDiv(num, grp.BlockSize) + 1; need > usableBlocks(e.cfg.PoolBlocks)-e.cfg.Watermark {
			return g, need, false
		}
	}
	return 0, 0, true
}

// fits reports whether the request's blocks fit, keeping the watermark free:
// fresh blocks for everything past the local hit, plus cached hits that are
// currently unreferenced (taking them makes them unavailable).
func (e *engine) fits(r *request, num, local int) bool {
	for g, grp := range e.model.Groups {
		need := ceilDiv(num, grp.BlockSize) - local/grp.BlockSize
		for _, c := range e.model.LoadChunks(g, 0, local) {
			b, _ := e.pool.cached(g, e.chunkKey(r, c))
			if e.pool.reusable(g, b) {
				need++
			}
		}
		if need+e.cfg.Watermark > e.pool.available(g) {
			return false
		}
	}
	return true
}

// allocate builds the request's block table for num tokens resuming at hit
// (local ≤ hit): chunks the local hit needs share their cached blocks; chunks
// at or below the hit that no group needs to resume are null (e.g. Mamba
// states before the hit, sliding-window blocks out of the window); every
// other chunk gets a fresh block (loaded when it ends at or below the hit,
// computed otherwise). Cached hits are taken first so that fresh
// allocations cannot evict them.
func (e *engine) allocate(r *request, num, local, hit int) bool {
	table := make(kvcore.BlockTable, len(e.model.Groups))
	for g, grp := range e.model.Groups {
		table[g] = make([]kvcore.BlockID, ceilDiv(num, grp.BlockSize))
		for p := range table[g] {
			c := kvcore.Chunk{Start: p * grp.BlockSize, End: (p + 1) * grp.BlockSize}
			table[g][p] = nullBlockID
			if c.End <= local && grp.Reaches(c, local) {
				b, _ := e.pool.cached(g, e.chunkKey(r, c))
				e.pool.acquire(g, b)
				table[g][p] = b
			}
		}
	}
	r.table = table
	for g, grp := range e.model.Groups {
		for p := range table[g] {
			c := kvcore.Chunk{Start: p * grp.BlockSize, End: (p + 1) * grp.BlockSize}
			if c.End <= local || (c.End <= hit && !grp.Reaches(c, hit)) {
				continue
			}
			b, ok := e.pool.alloc(g)
			if !ok {
				e.free(r)
				return false
			}
			table[g][p] = b
		}
	}
	return true
}
