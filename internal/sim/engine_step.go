package sim

import (
	"context"
	"encoding/json"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// scheduled is one request's share of a step.
type scheduled struct {
	r     *request
	n     int // tokens computed this step
	kind  kvcore.StepKind
	table kvcore.BlockTable // the full table (new, resumed) or the new block ids
}

// step runs one engine step, as vLLM's scheduler does: running requests
// first (a prefill chunk or one decode token each, preempting the newest
// running request when blocks run out), then waiting requests in order
// (lookup, allocation, then either a pending load or their first chunk).
// Blocks whose content the step's allocations dropped are declared to the
// gpuworker (Evict) before anything is written. The step's KV is "computed"
// (written into every rank's gpuworker) before its events are published,
// since a save may read the blocks as soon as the scheduler sees the step.
// With a dead rank the step's requests are given up instead (the engine
// cannot compute without every rank). It reports whether anything
// happened.
func (e *engine) step(ctx context.Context) (bool, error) {
	out := newOutbox()
	budget := e.cfg.MaxBatchTokens
	sched, preempted := e.scheduleRunning(out, &budget)
	if !preempted {
		more, err := e.scheduleWaiting(ctx, out, &budget)
		if err != nil {
			return false, err
		}
		sched = append(sched, more...)
	}
	if len(sched) == 0 && out.empty() {
		return false, nil
	}
	e.evict(ctx)
	if err := e.compute(ctx, sched); err != nil {
		return false, err
	}
	if d := e.deadRank(); d != nil {
		for _, s := range sched {
			e.failDead(out, s.r, d) // no forward pass without every rank
		}
		return true, e.publish(ctx, out)
	}
	for _, s := range sched {
		e.advance(out, s)
	}
	return true, e.publish(ctx, out)
}

// scheduleRunning gives every running request its tokens for this step.
func (e *engine) scheduleRunning(out *outbox, budget *int) ([]scheduled, bool) {
	var sched []scheduled
	preempted := false
	for i := 0; i < len(e.running) && *budget > 0; {
		r := e.running[i]
		n := min(r.numTokens()-r.computed, *budget)
		if limit, held := e.tailHeld(r); held {
			n = min(n, limit-r.computed)
		}
		if n <= 0 {
			i++ // waits for its prompt-tail save (tailHeld)
			continue
		}
		added, ok := e.grow(r, r.computed+n)
		for !ok {
			victim := e.running[len(e.running)-1]
			e.preempt(out, victim)
			preempted = true
			if victim == r {
				break
			}
			added, ok = e.grow(r, r.computed+n)
		}
		if !ok {
			continue // r itself was preempted; it was the last one
		}
		kind := kvcore.StepRunning
		if r.decoding {
			kind = kvcore.StepDecode
		}
		sched = append(sched, scheduled{r: r, n: n, kind: kind, table: added})
		*budget -= n
		i++
	}
	return sched, preempted
}

// tailHeld reports whether a prompt-tail save of the request (a save
// whose span ends inside a scheduler block, requeststate Tracker.maybeSaveTail)
// is still in flight, and then the most tokens the request may compute
// meanwhile: one short of the end of the block holding the tail. The save
// reads that block under the tail's identity; completing the block would
// replace it with the whole block's (the gpuworker serves a block only
// under the identity it holds), and the save would be dead-lettered. vLLM
// has no such wait: its sending thread reads the tail's bytes, which later
// tokens do not change, or the Mamba state's copy-on-write block.
func (e *engine) tailHeld(r *request) (limit int, held bool) {
	for k, sets := range e.pins {
		if k.request != r.id || len(sets) == 0 || k.span.End%e.sbs == 0 {
			continue
		}
		l := ceilDiv(k.span.End, e.sbs)*e.sbs - 1
		if !held || l < limit {
			limit, held = l, true
		}
	}
	return limit, held
}

// scheduleWaiting admits waiting requests while blocks, budget and the
// running limit allow.
func (e *engine) scheduleWaiting(ctx context.Context, out *outbox, budget *int) ([]scheduled, error) {
	var sched []scheduled
	for len(e.waiting) > 0 && *budget > 0 && len(e.running) < e.cfg.MaxRunning {
		r := e.waiting[0]
		if r.phase == phaseWaiting {
			if !e.admit(ctx, out, r) {
				break
			}
			switch r.phase {
			case phaseLoading:
				e.waiting = e.waiting[1:]
				continue
			case phaseFinishing, phaseDone:
				continue // given up (and already off the queue)
			}
		}
		n := min(r.numTokens()-r.computed, *budget)
		kind := kvcore.StepNew
		if r.scheduled {
			kind = kvcore.StepResumed
		}
		r.scheduled = true
		e.waiting = e.waiting[1:]
		e.running = append(e.running, r)
		r.phase, r.since = phaseRunning, time.Now()
		sched = append(sched, scheduled{r: r, n: n, kind: kind, table: r.table.Clone()})
		*budget -= n
	}
	return sched, ctx.Err()
}

// advance books one scheduled request's step: its event (a decode step that
// added no block is not published, as it changes nothing for the
// connector), the shadow tracker, and a sampled token when the step
// computed every token so far.
func (e *engine) advance(out *outbox, s scheduled) {
	r := s.r
	r.computed += s.n
	e.stats.update(func(st *stats) { st.computedTokens += s.n; st.engineLocked(e.id).ComputedTokens += s.n })
	if s.kind != kvcore.StepDecode || s.table != nil {
		step := kvcore.Step{Kind: s.kind, Tokens: r.computed, Table: s.table}
		switch s.kind {
		case kvcore.StepNew: // vLLM's prefill_end_tokens: the prompt
			step.Hashes, step.PrefillTokens = r.hexes, len(r.prompt)
		case kvcore.StepResumed: // every token it had, all prefilled again
			step.Hashes, step.PrefillTokens = r.hexes, r.numTokens()
		}
		e.event(out, r, contract.RequestEvent{Kind: contract.EventScheduled, Step: &step})
		shadow := step // the scheduler's view: the null block normalised at intake
		shadow.Table = step.Table.NormalizeNull(nullBlockID)
		e.shadowEffects(r, r.shadow.Step(e.model, shadow))
	}
	if r.computed == r.numTokens() {
		e.sample(out, r)
	}
}

// sample generates the next token; a request that generated its last one
// finishes.
func (e *engine) sample(out *outbox, r *request) {
	if r.firstToken.IsZero() {
		r.firstToken = time.Now()
		if e.role != RolePrefill {
			e.stats.update(func(st *stats) { st.ttft = append(st.ttft, r.firstToken.Sub(r.turn.arrived)) })
		}
	}
	r.decoding = true
	r.generated++
	r.extendHashes(e.model.HashBlockSize)
	if r.generated >= r.maxOut {
		e.running = remove(e.running, r)
		e.finish(r, out)
		e.hooks.generated(r)
	}
}

// finish publishes the request's finish; its blocks wait for finished_sending.
func (e *engine) finish(r *request, out *outbox) {
	e.event(out, r, contract.RequestEvent{Kind: contract.EventFinished})
	e.shadowEffects(r, r.shadow.Step(e.model, kvcore.Step{Kind: kvcore.StepFinished}))
	r.phase, r.since = phaseFinishing, time.Now()
}

// preempt frees a running request's blocks (recompute preemption) and puts
// it back at the head of the queue. Blocks a save still reads stay pinned,
// unless the engine reuses preempted blocks at once (reusePreempted), as
// vLLM does: then the saves in flight lose their pins, and the mesh must
// fail them closed (dead-lettered block_not_held) or store them from the
// right bytes.
func (e *engine) preempt(out *outbox, r *request) {
	e.event(out, r, contract.RequestEvent{Kind: contract.EventPreempted})
	e.shadowEffects(r, r.shadow.Step(e.model, kvcore.Step{Kind: kvcore.StepPreempted}))
	inFlight := 0
	for k, sets := range e.pins {
		if k.request == r.id {
			inFlight += len(sets)
		}
	}
	if inFlight > 0 {
		e.ledger.preemptedInFlight(e.id, r.id)
	}
	if e.reusePreempted {
		e.dropPins(r)
	}
	e.free(r)
	r.computed, r.load, r.decoding = 0, nil, false
	r.phase, r.since = phaseWaiting, time.Now()
	e.running = remove(e.running, r)
	e.waiting = append([]*request{r}, e.waiting...)
	e.stats.update(func(st *stats) {
		st.preemptions++
		st.engineLocked(e.id).Preemptions++
		if inFlight > 0 {
			st.preemptedWithSaves++
			st.savesInFlightAtPreempt += inFlight
		}
	})
}

// grow extends the request's table to hold tokens tokens in every group,
// all or nothing. It returns the new block ids per group (nil when none
// were needed) and false when the pool is short.
func (e *engine) grow(r *request, tokens int) (kvcore.BlockTable, bool) {
	extra := make([]int, len(e.model.Groups))
	any := false
	for g, grp := range e.model.Groups {
		extra[g] = ceilDiv(tokens, grp.BlockSize) - len(r.table[g])
		if extra[g] > e.pool.available(g) {
			return nil, false
		}
		any = any || extra[g] > 0
	}
	if !any {
		return nil, true
	}
	added := make(kvcore.BlockTable, len(e.model.Groups))
	for g := range e.model.Groups {
		added[g] = []kvcore.BlockID{}
		for range extra[g] {
			b, _ := e.pool.alloc(g) // available was checked
			added[g] = append(added[g], b)
		}
		r.table[g] = append(r.table[g], added[g]...)
	}
	return added, true
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// mustJSON encodes a contract message, which always marshals (no channels,
// funcs or cyclic values).
func mustJSON(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}
