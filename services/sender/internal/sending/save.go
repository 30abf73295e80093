package sending

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

// ReasonPlanFailed marks a group that passed validation but could not be
// planned (a disagreement between kvcore.ValidateSave and kvcore.PlanSend);
// it should never appear.
const ReasonPlanFailed kvcore.Reason = "plan_failed"

// item is one block of the task to move, on the rank whose worker puts it.
type item struct {
	kvcore.TransferItem
	rank kvcore.Rank
}

// save stores the valid groups of r's task: keys for every rank namespace,
// one batched existence check, then only the missing keys through the
// owning gpuworkers. With gated set the pressure gate may skip the puts.
func (p *Processor) save(ctx context.Context, r *run, groups []int, gated bool) {
	items := p.plan(r, groups)
	if len(items) == 0 {
		return
	}
	exists, err := p.exists(ctx, r, items)
	if err != nil {
		if ctx.Err() == nil {
			p.deadLetterItems(r, items, kvcore.ReasonExistsFailed, fmt.Sprintf("existence check failed %d times: %v", p.attempts(), err))
		}
		return
	}
	var missing []item
	for i, it := range items {
		if exists[i] {
			r.outcome.Record(it.Group, kvcore.OutcomeExisted, 1, kvcore.ReasonOK)
		} else {
			missing = append(missing, it)
		}
	}
	if len(missing) == 0 {
		return
	}
	if gated && p.gate.admit(r.task, p.now()) == kvcore.AdmitSkip {
		p.skipItems(r, missing)
		return
	}
	p.put(ctx, r, missing)
}

// plan lists the blocks of each group that every worker rank of the engine
// writes: each chunk once in every store namespace (kvcore.Model.Writes).
func (p *Processor) plan(r *run, groups []int) []item {
	var out []item
	for _, g := range groups {
		r.outcome.Record(g, kvcore.OutcomeStored, 0, kvcore.ReasonOK) // the group shows even with no keys
		var gItems []item
		for _, rank := range p.model.WorkerRanks() {
			tis, err := kvcore.PlanSend(p.model, p.keys, r.task, g, rank)
			if err != nil {
				gItems = nil
				r.deadLetter(g, ReasonPlanFailed, err.Error(), 0)
				break
			}
			for _, ti := range tis {
				gItems = append(gItems, item{TransferItem: ti, rank: rank})
			}
		}
		out = append(out, gItems...)
	}
	return out
}

// exists asks the store which keys are present, in one batched call,
// retried per the retry policy.
func (p *Processor) exists(ctx context.Context, r *run, items []item) ([]bool, error) {
	ctx, span := p.tracer.Start(ctx, "sender.exists", trace.WithAttributes(taskAttrs(r.task)...),
		trace.WithAttributes(attribute.Int("keys", len(items)), groupsAttr(items)))
	defer span.End()
	ctx = kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: r.task.EngineID}) // vLLM's engine label of save_exists
	keys := itemKeys(items)
	for attempt := 1; ; attempt++ {
		found, err := p.existsOnce(ctx, keys)
		if err == nil {
			return found, nil
		}
		span.RecordError(err)
		d := p.retry.ExistsFailed(attempt)
		if ctx.Err() != nil || d.Action != kvcore.RetryAgain || !sleep(ctx, d.Delay) {
			span.SetStatus(codes.Error, string(kvcore.ReasonExistsFailed))
			span.SetAttributes(attribute.String("kvmesh.reason", string(kvcore.ReasonExistsFailed)))
			return nil, err
		}
	}
}

func (p *Processor) existsOnce(ctx context.Context, keys []string) ([]bool, error) {
	ctx, cancel := context.WithTimeout(ctx, p.storeTimeout)
	defer cancel()
	found, err := p.store.Exists(ctx, keys)
	if err == nil && len(found) != len(keys) {
		err = fmt.Errorf("store answered %d of %d keys", len(found), len(keys))
	}
	return found, err
}

// skipItems records items skipped in pressure mode.
func (p *Processor) skipItems(r *run, items []item) {
	for _, it := range items {
		r.outcome.Record(it.Group, kvcore.OutcomeSkipped, 1, kvcore.ReasonStorePressure)
	}
	p.skippedKeys.Add(int64(len(items)))
	p.metrics.skipped.Add(float64(len(items)))
}

// deadLetterItems dead-letters every group of items, counting its items.
func (p *Processor) deadLetterItems(r *run, items []item, reason kvcore.Reason, detail string) {
	for _, g := range itemGroups(items) {
		r.deadLetter(g.group, reason, detail, g.n)
	}
}

type groupCount struct{ group, n int }

// itemGroups counts items per group, in group order.
func itemGroups(items []item) []groupCount {
	var out []groupCount
	for _, it := range items {
		i := slices.IndexFunc(out, func(c groupCount) bool { return c.group == it.Group })
		if i < 0 {
			out = append(out, groupCount{group: it.Group})
			i = len(out) - 1
		}
		out[i].n++
	}
	slices.SortFunc(out, func(a, b groupCount) int { return a.group - b.group })
	return out
}

// put sends the missing items to every rank's worker at once and then
// records the per-item answers rank by rank, in the order of byRank, on
// this goroutine (a run is not safe for concurrent use); it drives the
// pressure gate.
func (p *Processor) put(ctx context.Context, r *run, items []item) {
	batches := byRank(items)
	answers := p.putRanks(ctx, r, batches)
	var t putTally
	for i, batch := range batches {
		a := answers[i]
		if a.err != nil {
			if ctx.Err() == nil {
				p.putFailed(r, batch, a.err)
			}
			continue
		}
		r.bytes += a.bytes
		p.metrics.bytes.Add(float64(a.bytes))
		p.recordAnswers(r, batch, a.results, &t)
	}
	deadLetterNotHeld(r, t.notHeld)
	switch {
	case t.noSpace:
		p.gate.onNoSpace(r.task, p.now())
	case t.stored:
		p.gate.onPutOK()
	}
}

// rankAnswer is what one rank's worker answered to its batch.
type rankAnswer struct {
	results []dataplane.PutResult
	bytes   int64
	err     error
}

// putTally gathers, over every rank's answers, what drives the pressure
// gate and the items to dead-letter as not held.
type putTally struct {
	stored, noSpace bool
	notHeld         []notHeldItem
}

// putRanks puts every batch through its rank's worker, one goroutine per
// rank, and returns the answers in the order of batches. putRank only
// reads the run, so the goroutines share it safely.
func (p *Processor) putRanks(ctx context.Context, r *run, batches [][]item) []rankAnswer {
	out := make([]rankAnswer, len(batches))
	if len(batches) == 1 {
		out[0].results, out[0].bytes, out[0].err = p.putRank(ctx, r, batches[0])
		return out
	}
	var wg sync.WaitGroup
	for i, batch := range batches {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i].results, out[i].bytes, out[i].err = p.putRank(ctx, r, batch)
		}()
	}
	wg.Wait()
	return out
}

// recordAnswers records one rank's per-item answers into r and t.
func (p *Processor) recordAnswers(r *run, batch []item, results []dataplane.PutResult, t *putTally) {
	for i, res := range results {
		it := batch[i]
		switch res.Status {
		case dataplane.PutStored:
			t.stored = true
			r.outcome.Record(it.Group, kvcore.OutcomeStored, 1, kvcore.ReasonOK)
			r.stored[it.Group] = append(r.stored[it.Group], it.Key)
		case dataplane.PutNoSpace:
			t.noSpace = true
			p.skipItems(r, batch[i:i+1])
		case dataplane.PutNotHeld:
			t.notHeld = append(t.notHeld, notHeldItem{it, res.Error})
		default:
			r.outcome.Record(it.Group, kvcore.OutcomeFailed, 1, kvcore.ReasonPutFailed)
		}
	}
}

// notHeldItem is an item the worker refused to put because its block does
// not hold the item's chunk, with the worker's detail.
type notHeldItem struct {
	item
	detail string
}

// deadLetterNotHeld dead-letters, per group, the items whose blocks no
// longer hold their chunks (ReasonBlockNotHeld): their bytes cannot be
// proven, so nothing was stored from them, and a replay cannot help.
func deadLetterNotHeld(r *run, items []notHeldItem) {
	byGroup := map[int][]notHeldItem{}
	var groups []int
	for _, it := range items {
		if _, ok := byGroup[it.Group]; !ok {
			groups = append(groups, it.Group)
		}
		byGroup[it.Group] = append(byGroup[it.Group], it)
	}
	slices.Sort(groups)
	for _, g := range groups {
		list := byGroup[g]
		r.deadLetter(g, kvcore.ReasonBlockNotHeld, fmt.Sprintf("%d block(s) no longer hold their chunk; first: block %d of rank %s (chunk [%d,%d), key %s): %s",
			len(list), list[0].Block, list[0].rank, list[0].Chunk.Start, list[0].Chunk.End, list[0].Key, list[0].detail), len(list))
	}
}

// putFailed records a rank's batch whose whole request failed. A rejected
// request (the worker refused it as invalid) is counted failed; a worker
// that stayed missing from the registry or unavailable through every retry
// is counted failed and dead-lettered with put_failed, one dead letter per
// group naming the rank, so the group can be replayed. The other ranks'
// items are recorded on their own.
func (p *Processor) putFailed(r *run, batch []item, err error) {
	rank := batch[0].rank
	for _, g := range itemGroups(batch) {
		r.outcome.Record(g.group, kvcore.OutcomeFailed, g.n, kvcore.ReasonPutFailed)
		if !errors.Is(err, dataplane.ErrRejected) {
			group := g.group
			r.addDeadLetter(&group, string(kvcore.ReasonPutFailed),
				fmt.Sprintf("rank %s: put of %d key(s) through the gpuworker failed %d times: %v", rank, g.n, p.attempts(), err))
		}
	}
}

// byRank splits items by rank, keeping their order within each rank.
func byRank(items []item) [][]item {
	var ranks []kvcore.Rank
	batches := map[kvcore.Rank][]item{}
	for _, it := range items {
		if _, ok := batches[it.rank]; !ok {
			ranks = append(ranks, it.rank)
		}
		batches[it.rank] = append(batches[it.rank], it)
	}
	out := make([][]item, 0, len(ranks))
	for _, rk := range ranks {
		out = append(out, batches[rk])
	}
	return out
}

// putRank puts one rank's batch, retrying a missing or unreachable worker
// per the retry policy. A rejected request is not retried.
func (p *Processor) putRank(ctx context.Context, r *run, batch []item) ([]dataplane.PutResult, int64, error) {
	rank := batch[0].rank
	ctx, span := p.tracer.Start(ctx, "sender.put", trace.WithAttributes(taskAttrs(r.task)...),
		trace.WithAttributes(attribute.Int("keys", len(batch)), groupsAttr(batch), attribute.String("kvmesh.rank", fmt.Sprintf("%+v", rank))))
	defer span.End()
	req := make([]dataplane.PutItem, len(batch))
	for i, it := range batch {
		req[i] = dataplane.PutItem{BlockRef: dataplane.BlockRef{Group: it.Group, Block: it.Block}, Key: it.Key,
			Hash: it.Hash, RequestID: r.task.RequestID}
	}
	for attempt := 1; ; attempt++ {
		results, n, err := p.putOnce(ctx, r.task.EngineID, rank, req)
		if err == nil {
			return results, n, nil
		}
		span.RecordError(err)
		p.workers.Forget(r.task.EngineID)
		d := p.retry.PutFailed(attempt)
		if errors.Is(err, dataplane.ErrRejected) || ctx.Err() != nil || d.Action != kvcore.RetryAgain || !sleep(ctx, d.Delay) {
			span.SetStatus(codes.Error, string(kvcore.ReasonPutFailed))
			span.SetAttributes(attribute.String("kvmesh.reason", string(kvcore.ReasonPutFailed)))
			return nil, 0, err
		}
	}
}

func (p *Processor) putOnce(ctx context.Context, engineID string, rank kvcore.Rank, req []dataplane.PutItem) ([]dataplane.PutResult, int64, error) {
	ctx, cancel := context.WithTimeout(ctx, p.putTimeout) // the registry look-up too: a stuck one is retried
	defer cancel()
	putters, err := p.workers.Engine(ctx, engineID)
	if err != nil {
		return nil, 0, err
	}
	putter, ok := putters[rank]
	if !ok {
		return nil, 0, fmt.Errorf("engine %q rank %s: %w", engineID, rank, registry.ErrNoWorker)
	}
	results, n, err := putter.Put(ctx, req)
	if err == nil && len(results) != len(req) {
		err = fmt.Errorf("worker answered %d of %d items: %w", len(results), len(req), dataplane.ErrFrame)
	}
	return results, n, err
}

// attempts is the number of attempts the retry policy allows.
func (p *Processor) attempts() int {
	if p.retry.MaxAttempts > 0 {
		return p.retry.MaxAttempts
	}
	return kvcore.DefaultRetryAttempts
}

// sleep waits d or until ctx ends, and reports whether d elapsed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// groupsAttr names the groups of items, in order.
func groupsAttr(items []item) attribute.KeyValue {
	var gs []int
	for _, g := range itemGroups(items) {
		gs = append(gs, g.group)
	}
	return attribute.IntSlice("kvmesh.groups", gs)
}

// taskAttrs are the span attributes naming a task.
func taskAttrs(t *kvcore.SaveTask) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String("kvmesh.engine_id", t.EngineID),
		attribute.String("kvmesh.request_id", t.RequestID),
		attribute.String("kvmesh.task_id", t.TaskID),
	}
}
