package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// Role is what an engine does in the deployment.
type Role string

// Engine roles.
const (
	// RoleBoth is a standalone engine: it prefills and decodes.
	RoleBoth Role = "both"
	// RolePrefill computes prompts and hands them to a decode engine
	// (max_tokens 1), keeping their blocks until the decode engine read them.
	RolePrefill Role = "prefill"
	// RoleDecode gets prompts with kv_transfer_params naming the prefill
	// engine, pulls their KV through the pd connector, and decodes.
	RoleDecode Role = "decode"
)

// EngineConfig sizes one simulated engine.
type EngineConfig struct {
	// PoolBlocks is the number of KV blocks per group the engine's block
	// manager hands out; it must not exceed the gpuworker's pool.
	PoolBlocks int `json:"pool_blocks"`
	// MaxBatchTokens is the token budget of one step (chunked prefill).
	MaxBatchTokens int `json:"max_batch_tokens"`
	// MaxRunning is the most requests running at once.
	MaxRunning int `json:"max_running"`
	// Watermark is the number of free blocks per group that admission keeps
	// for running requests to grow into.
	Watermark int `json:"watermark"`
}

// engineDeps are the parts an engine talks to.
type engineDeps struct {
	model  *kvcore.Model
	runTag string // names the engine's step records (StepID)
	// ranks are the engine's worker ranks, each with its gpuworker, in
	// Model.WorkerRanks order.
	ranks []*rankWorker
	// hc asks the gpuworkers which KV memory they use (rankMemory.ensure).
	hc      *http.Client
	lookup  *lookupClient
	pub     *bus.Producer
	ledger  *ledger
	stats   *stats
	log     *slog.Logger
	timeout time.Duration // longest wait for a feedback message, and bound of every retried call
	// rankTimeout is how long a gpuworker call is retried before its rank
	// is dead.
	rankTimeout time.Duration
	// reusePreempted frees a preempted request's blocks at once, as vLLM
	// does, even while saves of them are in flight: the blocks are reused
	// for other content while the sender may still read them.
	reusePreempted bool
}

// engine is one simulated inference engine (all its ranks): vLLM's
// scheduler with its KV-cache manager and the kvmesh connector, driving the
// real mesh.
type engine struct {
	engineDeps
	id    string
	role  Role
	cfg   EngineConfig
	sbs   int
	cont  contents
	pool  *blockPool
	box   *mailbox
	hooks engineHooks
	// namespaces[g] are group g's store namespaces; nsIndex[g][k] is the
	// one worker rank k (Model.WorkerRanks) reads and writes.
	namespaces [][]kvcore.Rank
	nsIndex    [][]int

	live    map[string]*request
	waiting []*request
	running []*request
	// pins are the blocks each save in flight pinned, oldest save first
	// (one key may name several saves if an engine ever saves a span
	// again).
	pins map[pinKey][][]blockRef
	// orphans are the blocks of saves whose pins a preemption dropped
	// (reusePreempted), until the sender reports the save; orphaned counts
	// such saves per block.
	orphans  map[pinKey][][]blockRef
	orphaned map[blockRef]int
	// tailWritten lists the requests whose sub-block prompt tail (partial
	// hash hits: kvcore.PromptTailEnd) this allocation was written: the
	// KV up to the prompt's last hash boundary, in the block holding it,
	// under that boundary's identity (engine.promptTail).
	tailWritten map[string]bool

	head      *request // the head of the queue when it was last looked at
	headSince time.Time

	steps int64      // steps published (the EngineStep.Step counter)
	span  trace.Span // the engine's span while it runs; nil before
}

// engineHooks connect an engine to the driver and its peer engine.
type engineHooks struct {
	// generated is called when a request generated its last token.
	generated func(r *request)
	// abandoned is called when the engine gave up on a request before it
	// generated its last token.
	abandoned func(r *request)
	// finalized is called when a request is freed (or given up).
	finalized func(r *request)
	// peerRead tells a prefill engine that the decode engine no longer
	// needs a request's blocks (decode engine only).
	peerRead func(requestID string)
}

// blockRef is one block of one group.
type blockRef struct {
	group int
	block kvcore.BlockID
}

// pinKey names one save whose blocks are pinned until the sender reports it.
type pinKey struct {
	request string
	span    span
}

// Mailbox messages.
type (
	// peerReleased: the decode engine is done with a prefill request's blocks.
	peerReleased struct{ requestID string }
	// saveReported: the sender reported one of the engine's saves.
	saveReported struct {
		requestID string
		savedReport
	}
)

func newEngine(id string, role Role, cfg EngineConfig, deps engineDeps, hooks engineHooks) *engine {
	if deps.rankTimeout <= 0 {
		deps.rankTimeout = deps.timeout
	}
	e := &engine{
		engineDeps: deps, id: id, role: role, cfg: cfg, sbs: deps.model.SchedulerBlockSize(),
		cont: newContents(deps.model), pool: newBlockPool(len(deps.model.Groups), cfg.PoolBlocks),
		box: newMailbox(), hooks: hooks, live: map[string]*request{}, pins: map[pinKey][][]blockRef{},
		orphans: map[pinKey][][]blockRef{}, orphaned: map[blockRef]int{}, tailWritten: map[string]bool{},
	}
	m, ranks := deps.model, deps.model.WorkerRanks()
	for g := range m.Groups {
		ns := m.Namespaces(g)
		idx := make([]int, len(ranks))
		for k, r := range ranks {
			idx[k] = slices.Index(ns, m.StoreRank(g, r))
		}
		e.namespaces, e.nsIndex = append(e.namespaces, ns), append(e.nsIndex, idx)
	}
	return e
}

// submit hands a new request to the engine (safe from any goroutine).
func (e *engine) submit(r *request) { e.box.put(r) }

// run is the engine loop: apply what arrived, run a step, and wait when
// there is nothing to do, until ctx ends or a step fails for good.
func (e *engine) run(ctx context.Context) error {
	ctx = withEngine(ctx, e.id) // its calls carry its own token
	_, e.span = otel.Tracer(tracerName).Start(ctx, "sim.engine", trace.WithAttributes(
		attribute.String(telemetry.AttrEngineID, e.id), attribute.String("kvmesh.role", string(e.role))))
	defer e.span.End()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if err := e.applyMail(ctx); err != nil {
			return stopped(ctx, err)
		}
		if err := e.checkTimeouts(ctx, time.Now()); err != nil {
			return stopped(ctx, err)
		}
		worked, err := e.step(ctx)
		if err != nil {
			return stopped(ctx, err)
		}
		if worked {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-e.box.ready():
		case <-tick.C:
		}
	}
}

// stopped is nil when ctx ended (the run is over; an interrupted step is
// expected), else err.
func stopped(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// applyMail applies every message that arrived, and publishes what that
// gave up.
func (e *engine) applyMail(ctx context.Context) error {
	out := newOutbox()
	if err := e.applyEach(ctx, out); err != nil {
		return err
	}
	return e.publish(ctx, out)
}

// applyEach applies the messages of the mailbox.
func (e *engine) applyEach(ctx context.Context, out *outbox) error {
	for _, m := range e.box.take() {
		switch m := m.(type) {
		case *request:
			m.phase, m.arrived, m.since = phaseWaiting, time.Now(), time.Now()
			m.shadow = requeststate.NewTracker(e.model, e.id, m.id)
			e.live[m.id] = m
			e.waiting = append(e.waiting, m)
		case contract.EngineFeedback:
			if err := e.feedback(ctx, out, m); err != nil {
				return err
			}
		case peerReleased:
			if r := e.live[m.requestID]; r != nil && r.holdForPeer {
				r.holdForPeer = false
				e.maybeFinalize(r)
			}
		case saveReported:
			e.saveReported(pinKey{m.requestID, m.span})
			if r := e.live[m.requestID]; r != nil && m.status.Valid() {
				e.shadowEffects(r, r.shadow.OnSaveReport(e.model, m.taskID, m.report))
			}
		}
	}
	return nil
}

// feedback applies one message from the scheduler.
func (e *engine) feedback(ctx context.Context, out *outbox, f contract.EngineFeedback) error {
	r := e.live[f.RequestID]
	if r == nil {
		return nil // a redelivered message for a request already gone
	}
	switch f.Kind {
	case kvcore.FeedbackFinishedRecving:
		if r.phase != phaseLoading {
			return nil // redelivered
		}
		return e.loaded(ctx, out, r, f)
	case kvcore.FeedbackFinishedSending:
		if r.phase != phaseFinishing || r.sent {
			return nil
		}
		r.sent = true
		e.maybeFinalize(r)
	case contract.FeedbackRequestError:
		r.fail("scheduler reported a request error: " + f.Error)
	}
	return nil
}

// checkTimeouts gives up on requests whose feedback never came, and on a
// request that stayed at the head of the queue, unable to get blocks, for
// the whole timeout.
func (e *engine) checkTimeouts(ctx context.Context, now time.Time) error {
	out := newOutbox()
	for _, r := range e.live {
		if now.Sub(r.since) < e.timeout {
			continue
		}
		switch {
		case r.phase == phaseLoading:
			e.abandonLoad(out, r)
		case r.phase == phaseFinishing && !r.sent:
			r.fail(fmt.Sprintf("no finished_sending within %v (blocks left allocated)", e.timeout))
			r.sent, r.leak = true, true
			e.maybeFinalize(r)
		}
	}
	if len(e.waiting) > 0 && e.waiting[0] != e.head {
		e.head, e.headSince = e.waiting[0], now
	}
	if h := e.head; h != nil && len(e.waiting) > 0 && e.waiting[0] == h && h.phase == phaseWaiting && now.Sub(e.headSince) >= e.timeout {
		e.giveUp(out, h, fmt.Sprintf("not admitted within %v (%s)", e.timeout, e.poolState()))
	}
	return e.publish(ctx, out)
}

// abandonLoad gives up on a load that never reported: the request is
// finished (its blocks stay allocated, since the load may still write them)
// and its turn goes on.
func (e *engine) abandonLoad(out *outbox, r *request) {
	r.fail(fmt.Sprintf("no finished_recving within %v", e.timeout))
	if r.load.connector == "pd" {
		e.hooks.peerRead(r.id)
	}
	r.load, r.leak, r.holdForPeer = nil, true, false
	e.finish(r, out)
	e.hooks.abandoned(r)
}

// giveUp ends a request that cannot go on: one the scheduler knows is
// finished (so its tracker is released), the prefill engine's blocks it
// would have read are released, and its turn goes on.
func (e *engine) giveUp(out *outbox, r *request, reason string) {
	r.fail(reason)
	e.waiting = remove(e.waiting, r)
	e.running = remove(e.running, r)
	if r.pd != nil {
		e.hooks.peerRead(r.id)
		r.pd = nil
	}
	r.holdForPeer = false
	if r.admitted {
		e.finish(r, out)
	} else {
		e.free(r)
		r.phase, r.sent = phaseFinishing, true
	}
	e.hooks.abandoned(r)
	e.maybeFinalize(r)
}

// failDead gives up on a request that needs the engine's dead rank d: the
// engine cannot compute without every rank. The request is counted
// against d unless it had failed for another reason before.
func (e *engine) failDead(out *outbox, r *request, d *rankWorker) {
	if r.failure == "" {
		r.deadRank = e.id + "/" + d.label()
		d.failedRequests++
	}
	e.giveUp(out, r, e.deadReason(d))
}

// poolState describes the block pool for a diagnostic.
func (e *engine) poolState() string {
	var parts []string
	for g := range e.model.Groups {
		parts = append(parts, fmt.Sprintf("group %d: %d of %d blocks free", g, e.pool.available(g), usableBlocks(e.cfg.PoolBlocks)))
	}
	n := 0
	for _, sets := range e.pins {
		n += len(sets)
	}
	return fmt.Sprintf("%s; %d saves pin blocks", strings.Join(parts, ", "), n)
}

// maybeFinalize frees and retires a finishing request once finished_sending
// arrived and no peer still reads its blocks.
func (e *engine) maybeFinalize(r *request) {
	if r.phase != phaseFinishing || !r.sent || r.holdForPeer {
		return
	}
	if !r.leak {
		e.free(r)
	}
	r.phase = phaseDone
	delete(e.live, r.id)
	e.hooks.finalized(r)
}

// free releases a request's blocks (valid ones stay in the prefix cache).
func (e *engine) free(r *request) {
	delete(e.tailWritten, r.id)
	for g, ids := range r.table {
		for _, b := range ids {
			if b != nullBlockID {
				e.pool.release(g, b)
			}
		}
	}
	r.table = nil
}

// pinSave pins the blocks a save task will read until it is reported. A
// chunk on a null block (or outside the pool) has nothing to pin: the
// sender refuses such a save.
func (e *engine) pinSave(r *request, t kvcore.SaveTask) {
	refs := []blockRef{}
	for _, gc := range t.Groups {
		if gc.Group < 0 || gc.Group >= len(t.BlockTable) || gc.Group >= len(e.model.Groups) {
			continue
		}
		bs := e.model.Groups[gc.Group].BlockSize
		for _, c := range gc.Chunks {
			i := c.BlockIndex(bs)
			if i < 0 || i >= len(t.BlockTable[gc.Group]) {
				continue
			}
			b := t.BlockTable[gc.Group][i]
			if b < 0 || b == nullBlockID || int(b) >= e.cfg.PoolBlocks {
				continue
			}
			e.pool.pin(gc.Group, b)
			refs = append(refs, blockRef{gc.Group, b})
		}
	}
	k := pinKey{r.id, span{t.Start, t.End}}
	e.pins[k] = append(e.pins[k], refs)
	e.ledger.expectSave(e.id, r.id, k.span)
}

// saveReported releases what the oldest save of the key held: its orphaned
// blocks if a preemption dropped its pins, else its pins.
func (e *engine) saveReported(k pinKey) {
	if sets := e.orphans[k]; len(sets) > 0 {
		for _, ref := range sets[0] {
			if e.orphaned[ref]--; e.orphaned[ref] <= 0 {
				delete(e.orphaned, ref)
			}
		}
		popFront(e.orphans, k)
		return
	}
	if sets := e.pins[k]; len(sets) > 0 {
		for _, ref := range sets[0] {
			e.pool.unpin(ref.group, ref.block)
		}
		popFront(e.pins, k)
	}
}

// popFront drops the first set of a key's queue; the key goes when none
// is left.
func popFront(m map[pinKey][][]blockRef, k pinKey) {
	if len(m[k]) <= 1 {
		delete(m, k)
		return
	}
	m[k] = m[k][1:]
}

// dropPins unpins every save of a preempted request that is still in
// flight, so its blocks can be reused at once (reusePreempted), and
// remembers them as orphans until the sender reports each save. It returns
// the number of saves in flight.
func (e *engine) dropPins(r *request) int {
	n := 0
	for k, sets := range e.pins {
		if k.request != r.id {
			continue
		}
		for _, refs := range sets {
			n++
			for _, ref := range refs {
				e.pool.unpin(ref.group, ref.block)
				e.orphaned[ref]++
			}
			e.orphans[k] = append(e.orphans[k], refs)
		}
		delete(e.pins, k)
	}
	return n
}

// shadowEffects applies the shadow tracker's effects: its saves pin blocks
// and are expected in the ledger. A shadow error means the engine drove the
// connector in a way kvcore refuses: the request is marked failed.
func (e *engine) shadowEffects(r *request, eff requeststate.Effects) {
	for _, t := range eff.Saves {
		e.pinSave(r, t)
	}
	if eff.Err != nil {
		r.fail("engine-side tracker refused a step: " + eff.Err.Error())
	}
}

// retryBackoff is the backoff of the simulator's retried calls (the
// engine's calls to the mesh, its lookups, its topic readers): 50 ms
// doubled after every failure up to 1 s, without jitter.
var retryBackoff = retry.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}

// retryFor runs f until it succeeds, fails for good (a request the peer
// rejected as invalid: dataplane.ErrRejected or ErrIdentity), ctx ends or
// bound passed since the first attempt, waiting retryBackoff's delays
// between attempts; it returns f's last error. bound is the request
// timeout, so that an outage of the peer (a restart) shorter than it is
// ridden out.
func retryFor(ctx context.Context, bound time.Duration, f func() error) error {
	deadline := time.Now().Add(bound)
	for n := 1; ; n++ {
		err := f()
		if err == nil || ctx.Err() != nil || permanent(err) {
			return err
		}
		wait := min(retryBackoff.Delay(n), time.Until(deadline))
		if wait <= 0 || retry.Sleep(ctx, wait) != nil {
			return err
		}
	}
}

// permanent reports an error that retrying the same call cannot cure.
func permanent(err error) bool {
	return errors.Is(err, dataplane.ErrRejected) || errors.Is(err, dataplane.ErrIdentity) || errors.Is(err, errProtocol)
}

// mailbox is an unbounded queue with a wake-up signal.
type mailbox struct {
	mu     sync.Mutex
	items  []any
	signal chan struct{}
}

func newMailbox() *mailbox { return &mailbox{signal: make(chan struct{}, 1)} }

func (m *mailbox) put(v any) {
	m.mu.Lock()
	m.items = append(m.items, v)
	m.mu.Unlock()
	select {
	case m.signal <- struct{}{}:
	default:
	}
}

func (m *mailbox) take() []any {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := m.items
	m.items = nil
	return out
}

func (m *mailbox) ready() <-chan struct{} { return m.signal }

// remove deletes r from list.
func remove(list []*request, r *request) []*request {
	if i := slices.Index(list, r); i >= 0 {
		return slices.Delete(list, i, i+1)
	}
	return list
}
