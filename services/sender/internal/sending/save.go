package sending

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/pkg/retry"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// Group outcomes, as counted in save_outcomes and kvmesh_sender_groups_total.
const (
	groupStored       = "stored"
	groupExisting     = "existing"
	groupSkipped      = "skipped"
	groupDeadLettered = "dead_lettered"
	groupFailed       = "failed"
)

// keyOutcome is what happened to some keys of one group.
type keyOutcome int

// Key outcomes, each a count of contract.GroupOutcome.
const (
	keysStored keyOutcome = iota
	keysExisting
	keysSkipped
	keysDeadLettered
	keysFailed
)

// save owns the whole outcome of one save task (or of the groups of one
// dead letter being replayed): per group the keys stored, already in the
// store, skipped (the request under store pressure, or answered "no
// space"), failed, and dead-lettered (invalid, not planned, existence check
// given up, block no longer holding its chunk), with the group's first
// reason; the dead-letter rows; the keys put, for the KV events; and the
// bytes stored and keys skipped, for the metrics. It produces the
// contract's TransferResult itself (result), with the save_outcomes group
// counts (outcome) and the ledger entry (entry): nothing else tallies a
// save. It is not safe for concurrent use: the ranks' puts run at once,
// but their answers are recorded on one goroutine.
type save struct {
	task *kvcore.SaveTask
	// m and kb are the task's model (the default for a model not served:
	// its validation dead-letters the task) and its keys.
	m           *kvcore.Model
	kb          kvcore.KeyBuilder
	groups      []contract.GroupOutcome // in group order
	deadLetters []deadletter.DeadLetter
	// stored are, per group, the keys the save put; present the keys it
	// found already in the store (kvEvents announces those a put key
	// hangs from).
	stored  map[int][]string
	present map[int][]string
	bytes   int64
	skipped int
}

// newSave starts the account of task t of model m with keys kb, with
// nothing recorded.
func newSave(t *kvcore.SaveTask, m *kvcore.Model, kb kvcore.KeyBuilder) *save {
	return &save{task: t, m: m, kb: kb, groups: []contract.GroupOutcome{}, stored: map[int][]string{}, present: map[int][]string{}}
}

// newSave starts the account of task t with its model: the served model
// the task names, else the default one, whose validation dead-letters the
// task (model_unknown).
func (p *Processor) newSave(t *kvcore.SaveTask) *save {
	m, err := p.models.Get(t.Model)
	if err != nil {
		m = p.models.Default()
	}
	kb, _ := p.models.Keys(m.Name) // every served model has keys
	return newSave(t, m, kb)
}

// item is one block of the task to move, on the rank whose worker puts it.
type item struct {
	kvcore.TransferItem
	rank kvcore.Rank
}

// taskAttrs are the span attributes naming a task.
func taskAttrs(t *kvcore.SaveTask) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String(telemetry.AttrEngineID, t.EngineID),
		attribute.String(telemetry.AttrRequestID, t.RequestID),
		attribute.String("kvmesh.task_id", t.TaskID),
	}
}

// validate dead-letters the task's invalid groups and returns the valid ones.
func (p *Processor) validate(ctx context.Context, s *save) []int {
	_, span := p.tracer.Start(ctx, "sender.validate", trace.WithAttributes(taskAttrs(s.task)...))
	defer span.End()
	var valid []int
	for _, v := range kvcore.ValidateSave(s.m, nil, s.task) {
		if v.OK() {
			valid = append(valid, v.Group)
			continue
		}
		span.AddEvent("group_invalid", trace.WithAttributes(
			attribute.Int("kvmesh.group", v.Group), attribute.String("kvmesh.reason", string(v.Reason))))
		s.deadLetter(v.Group, v.Reason, v.Detail, s.listedChunks(v.Group))
	}
	span.SetAttributes(attribute.Int("groups_valid", len(valid)))
	return valid
}

// saveGroups stores the valid groups of s's task: keys for every rank
// namespace, one batched existence check, then only the missing keys
// through the owning gpuworkers. With gated set the pressure gate may skip
// the puts. What the save did to the store is counted once it is over.
func (p *Processor) saveGroups(ctx context.Context, s *save, groups []int, gated bool) {
	defer p.countWork(s)
	items := p.plan(s, groups)
	if len(items) == 0 {
		return
	}
	exists, err := p.exists(ctx, s.task, items)
	if err != nil {
		if ctx.Err() == nil {
			s.deadLetterItems(items, kvcore.ReasonExistsFailed, fmt.Sprintf("existence check failed %d times: %v", p.retry.Attempts(), err))
		}
		return
	}
	missing := s.existing(items, exists)
	if len(missing) == 0 {
		return
	}
	if gated && p.gate.admit(s.task, p.now()) == sendpolicy.AdmitSkip {
		s.skip(missing, kvcore.ReasonStorePressure)
		return
	}
	missing, release := p.admitQuota(ctx, s, missing)
	defer release()
	if len(missing) == 0 {
		return
	}
	p.put(ctx, s, missing)
}

// admitQuota keeps the items that fit the task's tenant's quota (the
// earliest chunks first: a prefix is what a lookup can use) and skips the
// others with reason quota; release ends the admitted items' reservation
// once their puts are answered.
func (p *Processor) admitQuota(ctx context.Context, s *save, items []item) (admitted []item, release func()) {
	if p.quotas == nil || !p.quotas.Note(s.task.Tenant) {
		return items, func() {}
	}
	slices.SortStableFunc(items, func(a, b item) int { return a.Chunk.Start - b.Chunk.Start })
	n, release := p.quotas.Admit(ctx, s.task.Tenant, itemKeys(items))
	s.skip(items[n:], kvcore.ReasonQuota)
	return items[:n], release
}

// plan lists the blocks of each group that every worker rank of the engine
// writes: each chunk once in every store namespace (kvcore.Model.Writes).
func (p *Processor) plan(s *save, groups []int) []item {
	var out []item
	for _, g := range groups {
		s.record(g, keysStored, 0, kvcore.ReasonOK) // the group shows even with no keys
		var gItems []item
		for _, rank := range s.m.WorkerRanks() {
			tis, err := kvcore.PlanSend(s.m, s.kb, s.task, g, rank)
			if err != nil {
				gItems = nil
				s.deadLetter(g, kvcore.ReasonPlanFailed, err.Error(), 0)
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

// put sends the missing items to every rank's worker at once, records the
// answers and drives the pressure gate with them.
func (p *Processor) put(ctx context.Context, s *save, items []item) {
	batches := byRank(items)
	answers := p.putRanks(ctx, s.task, batches)
	switch t := s.answered(batches, answers, ctx.Err() != nil, p.retry.Attempts()); {
	case t.noSpace:
		p.gate.onNoSpace(s.task, p.now())
	case t.stored:
		p.gate.onPutOK()
	}
}

// countWork adds what s did to the store (bytes stored, keys skipped) to
// the process's counters, whether or not its outcome is committed.
func (p *Processor) countWork(s *save) {
	p.skippedKeys.Add(int64(s.skipped))
	p.metrics.skipped.Add(float64(s.skipped))
	p.metrics.bytes.WithLabelValues(s.m.Name).Add(float64(s.bytes))
}

// gate is sendpolicy.PressureGate shared by the consumers and replays of one
// process, with the pressure-mode gauge kept in step. Pressure is scoped
// to the request whose put the store answered "no space"
// (sendpolicy.PressureScopeOf): only that request's saves are skipped.
type gate struct {
	mu      sync.Mutex
	g       sendpolicy.PressureGate
	metrics *Metrics
}

// PressureState is the pressure gate as GET /v1/stats shows it.
type PressureState = adminapi.PressureState

// admit is the gate's answer for the next save task t.
func (g *gate) admit(t *kvcore.SaveTask, now time.Time) sendpolicy.Admission {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.g.Admit(sendpolicy.PressureScopeOf(t), now)
}

// onNoSpace puts t's request under pressure.
func (g *gate) onNoSpace(t *kvcore.SaveTask, now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.g.OnNoSpace(sendpolicy.PressureScopeOf(t), now)
	g.metrics.pressure.Set(1)
}

// onPutOK lets every request go: the store took a put.
func (g *gate) onPutOK() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.g.OnPutOK()
	g.metrics.pressure.Set(0)
}

// state is a copy of the gate that shares nothing with it.
func (g *gate) state() sendpolicy.PressureGate {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.g.Clone()
}

// record adds n keys of group with outcome k. A dead-lettered or failed
// record counts at least 1, so a fault is never counted as zero (a group
// rejected before any key was built still shows). The first non-empty
// reason of a group is kept.
func (s *save) record(group int, k keyOutcome, n int, reason kvcore.Reason) {
	n = max(n, 0)
	if k == keysDeadLettered || k == keysFailed {
		n = max(n, 1)
	}
	g := s.group(group)
	switch k {
	case keysStored:
		g.Stored += n
	case keysExisting:
		g.Existing += n
	case keysSkipped:
		g.Skipped += n
	case keysDeadLettered:
		g.DeadLettered += n
	case keysFailed:
		g.Failed += n
	}
	if g.Reason == string(kvcore.ReasonOK) {
		g.Reason = string(reason)
	}
}

// group finds or inserts the entry of group, keeping group order.
func (s *save) group(group int) *contract.GroupOutcome {
	i := sort.Search(len(s.groups), func(i int) bool { return s.groups[i].Group >= group })
	if i == len(s.groups) || s.groups[i].Group != group {
		s.groups = slices.Insert(s.groups, i, contract.GroupOutcome{Group: group})
	}
	return &s.groups[i]
}

// deadLetter dead-letters keys of group with reason: counted in the
// group and written as a dead letter of the task.
func (s *save) deadLetter(group int, reason kvcore.Reason, detail string, keys int) {
	s.record(group, keysDeadLettered, keys, reason)
	s.addDeadLetter(&group, reason, detail)
}

// addDeadLetter adds a dead-letter row for group (nil: the whole task).
func (s *save) addDeadLetter(group *int, reason kvcore.Reason, detail string) {
	slot := len(s.deadLetters)
	if group == nil {
		slot = deadletter.WholeRecord
	}
	s.deadLetters = append(s.deadLetters, deadletter.DeadLetter{
		Reason: reason, Detail: detail, Group: group, Slot: slot,
		TaskID: s.task.TaskID, EngineID: s.task.EngineID, RequestID: s.task.RequestID,
	})
}

// listedChunks counts the chunks the task lists for group.
func (s *save) listedChunks(group int) int {
	for _, gc := range s.task.Groups {
		if gc.Group == group {
			return len(gc.Chunks)
		}
	}
	return 0
}

// deadLetterItems dead-letters every group of items, counting its items.
func (s *save) deadLetterItems(items []item, reason kvcore.Reason, detail string) {
	for _, g := range itemGroups(items) {
		s.deadLetter(g.group, reason, detail, g.n)
	}
}

// existing records the items the store already holds and returns the
// missing ones, in order.
func (s *save) existing(items []item, exists []bool) []item {
	var missing []item
	for i, it := range items {
		if exists[i] {
			s.record(it.Group, keysExisting, 1, kvcore.ReasonOK)
			s.present[it.Group] = append(s.present[it.Group], it.Key)
		} else {
			missing = append(missing, it)
		}
	}
	return missing
}

// skip records items skipped for reason: under store pressure (or
// answered "no space"), or over their tenant's quota.
func (s *save) skip(items []item, reason kvcore.Reason) {
	for _, it := range items {
		s.record(it.Group, keysSkipped, 1, reason)
	}
	s.skipped += len(items)
}

// putTally is what the ranks' answers say to the pressure gate.
type putTally struct{ stored, noSpace bool }

// answered records every rank's answer to its batch, in the order of
// batches, then dead-letters the items whose blocks no longer hold their
// chunks. A rank whose request failed is recorded failed unless the save
// was interrupted; attempts is what the retry policy allowed it.
func (s *save) answered(batches [][]item, answers []rankAnswer, interrupted bool, attempts int) putTally {
	var t putTally
	var notHeld []notHeldItem
	for i, batch := range batches {
		a := answers[i]
		if a.err != nil {
			if !interrupted {
				s.putFailed(batch, a.err, attempts)
			}
			continue
		}
		s.bytes += a.bytes
		for j, res := range a.results {
			it := batch[j]
			switch res.Status {
			case dataplane.PutStored:
				t.stored = true
				s.record(it.Group, keysStored, 1, kvcore.ReasonOK)
				s.stored[it.Group] = append(s.stored[it.Group], it.Key)
			case dataplane.PutExisting: // another save stored the key first
				s.record(it.Group, keysExisting, 1, kvcore.ReasonOK)
				s.present[it.Group] = append(s.present[it.Group], it.Key)
			case dataplane.PutNoSpace:
				t.noSpace = true
				s.skip(batch[j:j+1], kvcore.ReasonStorePressure)
			case dataplane.PutNotHeld:
				notHeld = append(notHeld, notHeldItem{it, res.Error})
			default:
				s.record(it.Group, keysFailed, 1, kvcore.ReasonPutFailed)
			}
		}
	}
	s.notHeld(notHeld)
	return t
}

// notHeldItem is an item the worker refused to put because its block does
// not hold the item's chunk, with the worker's detail.
type notHeldItem struct {
	item
	detail string
}

// notHeld dead-letters, per group, the items whose blocks no longer hold
// their chunks (ReasonBlockNotHeld): their bytes cannot be proven, so
// nothing was stored from them, and a replay cannot help.
func (s *save) notHeld(items []notHeldItem) {
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
		s.deadLetter(g, kvcore.ReasonBlockNotHeld, fmt.Sprintf("%d block(s) no longer hold their chunk; first: block %d of rank %s (chunk [%d,%d), key %s): %s",
			len(list), list[0].Block, list[0].rank, list[0].Chunk.Start, list[0].Chunk.End, list[0].Key, list[0].detail), len(list))
	}
}

// putFailed records a rank's batch whose whole request failed. A rejected
// request (the worker refused it as invalid) is counted failed; a worker
// that stayed missing from the registry or unavailable through every retry
// is counted failed and dead-lettered with put_failed, one dead letter per
// group naming the rank, so the group can be replayed. The other ranks'
// items are recorded on their own.
func (s *save) putFailed(batch []item, err error, attempts int) {
	rank := batch[0].rank
	for _, g := range itemGroups(batch) {
		s.record(g.group, keysFailed, g.n, kvcore.ReasonPutFailed)
		if !errors.Is(err, dataplane.ErrRejected) {
			group := g.group
			s.addDeadLetter(&group, kvcore.ReasonPutFailed,
				fmt.Sprintf("rank %s: put of %d key(s) through the gpuworker failed %d times: %v", rank, g.n, attempts, err))
		}
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

// The save's calls to the store and the gpuworkers.

// exists asks the store which keys of task's items are present, in one
// batched call, retried per the retry policy (retry.Attempts with its
// Delays until ExistsFailed gives up or ctx ends); it returns the last
// call's error.
func (p *Processor) exists(ctx context.Context, task *kvcore.SaveTask, items []item) ([]bool, error) {
	ctx, span := p.startCall(ctx, "sender.exists", task, items)
	defer span.End()
	ctx = kvstore.WithVLLMLabels(ctx, kvstore.VLLMLabels{Engine: task.EngineID, ModelName: task.Model}) // vLLM's engine and model labels of save_exists
	keys := itemKeys(items)
	found, err := retry.Attempts(ctx, p.retry.Delays(), func(attempt int) ([]bool, error) {
		found, err := p.existsOnce(ctx, keys)
		if err == nil {
			return found, nil
		}
		span.RecordError(err)
		if ctx.Err() != nil || p.retry.ExistsFailed(attempt).Action != sendpolicy.RetryAgain {
			return nil, retry.Permanent(err)
		}
		return nil, err
	})
	if err != nil {
		span.SetStatus(codes.Error, string(kvcore.ReasonExistsFailed))
		span.SetAttributes(attribute.String("kvmesh.reason", string(kvcore.ReasonExistsFailed)))
		return nil, err
	}
	return found, nil
}

// existsOnce is one existence check of keys, bounded by the store timeout
// (a dry run makes only this one).
func (p *Processor) existsOnce(ctx context.Context, keys []string) ([]bool, error) {
	ctx, cancel := context.WithTimeout(ctx, p.storeTimeout)
	defer cancel()
	found, err := p.store.Exists(ctx, keys)
	if err == nil && len(found) != len(keys) {
		err = fmt.Errorf("store answered %d of %d keys", len(found), len(keys))
	}
	return found, err
}

// itemKeys lists the keys of items, in order.
func itemKeys(items []item) []string {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.Key
	}
	return keys
}

// rankAnswer is what one rank's worker answered to its batch.
type rankAnswer struct {
	results []dataplane.PutResult
	bytes   int64
	err     error
}

// putRanks puts every batch of task through its rank's worker, one
// goroutine per rank, and returns the answers in the order of batches.
func (p *Processor) putRanks(ctx context.Context, task *kvcore.SaveTask, batches [][]item) []rankAnswer {
	out := make([]rankAnswer, len(batches))
	if len(batches) == 1 {
		out[0] = p.putRank(ctx, task, batches[0])
		return out
	}
	var wg sync.WaitGroup
	for i, batch := range batches {
		wg.Go(func() { out[i] = p.putRank(ctx, task, batch) })
	}
	wg.Wait()
	return out
}

// putRank puts one rank's batch, retrying a missing or unreachable worker
// per the retry policy (retry.Attempts with its Delays until PutFailed
// gives up or ctx ends). A rejected request is not retried.
func (p *Processor) putRank(ctx context.Context, task *kvcore.SaveTask, batch []item) rankAnswer {
	rank := batch[0].rank
	ctx, span := p.startCall(ctx, "sender.put", task, batch, attribute.String("kvmesh.rank", fmt.Sprintf("%+v", rank)))
	defer span.End()
	req := make([]dataplane.PutItem, len(batch))
	for i, it := range batch {
		req[i] = dataplane.PutItem{BlockRef: dataplane.BlockRef{Group: it.Group, Block: it.Block}, Key: it.Key,
			Hash: it.Hash, RequestID: task.RequestID}
	}
	answer, err := retry.Attempts(ctx, p.retry.Delays(), func(attempt int) (rankAnswer, error) {
		results, n, err := p.putOnce(ctx, task.EngineID, rank, req)
		if err == nil {
			return rankAnswer{results: results, bytes: n}, nil
		}
		span.RecordError(err)
		p.workers.Forget(task.EngineID)
		if errors.Is(err, dataplane.ErrRejected) || ctx.Err() != nil || p.retry.PutFailed(attempt).Action != sendpolicy.RetryAgain {
			return rankAnswer{}, retry.Permanent(err)
		}
		return rankAnswer{}, err
	})
	if err != nil {
		span.SetStatus(codes.Error, string(kvcore.ReasonPutFailed))
		span.SetAttributes(attribute.String("kvmesh.reason", string(kvcore.ReasonPutFailed)))
		return rankAnswer{err: err}
	}
	return answer
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

// startCall starts the span of one store or worker call for items of
// task: the task's ids, the number of keys, their groups in order, and
// extra.
func (p *Processor) startCall(ctx context.Context, name string, task *kvcore.SaveTask, items []item, extra ...attribute.KeyValue) (context.Context, trace.Span) {
	var gs []int
	for _, g := range itemGroups(items) {
		gs = append(gs, g.group)
	}
	attrs := append(taskAttrs(task), attribute.Int("keys", len(items)), attribute.IntSlice("kvmesh.groups", gs))
	return p.tracer.Start(ctx, name, trace.WithAttributes(append(attrs, extra...)...))
}
