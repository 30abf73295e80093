package sending

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// What a dry run expects a replay to do now (DryRun.Expect).
const (
	// ExpectAlreadyReplayed: the entry was replayed before; a replay answers
	// the recorded result and saves nothing.
	ExpectAlreadyReplayed = "already_replayed"
	// ExpectInvalid: the payload is still invalid; a replay answers 422.
	ExpectInvalid = "invalid"
	// ExpectSave: the payload is valid, the store answers and every rank
	// holding a missing key has a live worker; a replay saves the group(s).
	ExpectSave = "save"
	// ExpectFail: the payload is valid but the save would not complete now
	// (Reason: exists_failed, put_failed, plan_failed, or block_not_held:
	// a block of a missing key no longer holds its chunk, so a replay
	// cannot prove its bytes); a replay answers 503 and may be retried
	// later (block_not_held: once the engine wrote the chunk again).
	ExpectFail = "fail"
)

// DryRun is what a replay of one dead letter would do now, found without
// saving, recording or publishing anything.
type DryRun struct {
	// DeadLetter is the entry as stored.
	DeadLetter deadletter.DeadLetter `json:"-"`
	adminapi.DryRun
}

// DryRunGroup is one group a replay would save.
type DryRunGroup = adminapi.DryRunGroup

// DryRunKey is one store key a replay would check and, when missing, put.
type DryRunKey = adminapi.DryRunKey

// DryRun answers what Replay(id) would do now: the entry's validity
// against the current model, the keys of the groups a replay would save,
// one existence check (not retried) and a look at the worker registry. It
// saves, records and publishes nothing. Errors: deadletter.ErrNotFound, or a
// failure reading the entry.
func (p *Processor) DryRun(ctx context.Context, id int64) (DryRun, error) {
	p.metrics.countReplay(ReplayDryRun)
	d, err := p.ledger.Get(ctx, id)
	if err != nil {
		return DryRun{}, err
	}
	out := DryRun{DeadLetter: d}
	if d.ReplayStatus == deadletter.ReplayDone {
		out.Expect, out.Reason = ExpectAlreadyReplayed, ExpectAlreadyReplayed
		return out, nil
	}
	task, groups, invalid := p.replayPlan(d)
	if invalid != nil {
		out.Expect, out.Reason, out.Detail, out.Group = ExpectInvalid, string(invalid.Reason), invalid.Detail, invalid.Group
		return out, nil
	}
	out.Replayable, out.Expect = true, ExpectSave
	s := p.newSave(task)
	items := p.plan(s, groups)
	for _, dl := range s.deadLetters {
		out.fail(string(kvcore.ReasonPlanFailed), dl.Detail)
	}
	if len(items) == 0 {
		return out, nil
	}
	exists, err := p.existsOnce(ctx, itemKeys(items))
	if err != nil {
		out.fail(string(kvcore.ReasonExistsFailed), fmt.Sprintf("existence check failed now: %v", err))
		exists = nil
	}
	out.Groups = dryRunGroups(items, exists)
	if exists != nil {
		if putters := p.checkWorkers(ctx, task.EngineID, items, exists, &out); putters != nil {
			checkHeld(ctx, putters, items, exists, &out)
		}
	}
	return out, nil
}

// heldReader is the part of a worker's data plane (dataplane.Client) that
// reads blocks by the hash they must hold; a dry run uses it, when the
// Putter has it, to tell whether a replay could prove its blocks.
type heldReader interface {
	Read(ctx context.Context, refs []dataplane.ReadRef) ([]dataplane.ReadBlock, error)
}

// checkHeld marks the dry run failing with block_not_held when a block of a
// missing key no longer holds its chunk (the worker restarted, the engine
// reused the block): a replay would be refused the same way. A worker that
// cannot be read is a put_failed.
func checkHeld(ctx context.Context, putters map[kvcore.Rank]Putter, items []item, exists []bool, out *DryRun) {
	var ranks []kvcore.Rank
	missing := map[kvcore.Rank][]int{}
	for i, it := range items {
		if exists[i] {
			continue
		}
		if _, ok := missing[it.rank]; !ok {
			ranks = append(ranks, it.rank)
		}
		missing[it.rank] = append(missing[it.rank], i)
	}
	for _, rk := range ranks {
		rd, ok := putters[rk].(heldReader)
		if !ok {
			continue
		}
		idx := missing[rk]
		refs := make([]dataplane.ReadRef, len(idx))
		for n, i := range idx {
			refs[n] = dataplane.ReadRef{BlockRef: dataplane.BlockRef{Group: items[i].Group, Block: items[i].Block}, Hash: items[i].Hash}
		}
		blocks, err := rd.Read(ctx, refs)
		if err != nil {
			out.fail(string(kvcore.ReasonPutFailed), fmt.Sprintf("could not read the blocks from rank %s's worker: %v", rk, err))
			return
		}
		for n, b := range blocks {
			if it := items[idx[n]]; b.NotHeld != "" {
				out.fail(string(kvcore.ReasonBlockNotHeld), fmt.Sprintf("block %d (group %d, key %s): %s", it.Block, it.Group, it.Key, b.NotHeld))
				return
			}
		}
	}
}

// fail marks the dry run as a save that would not complete; the first
// reason found is kept.
func (d *DryRun) fail(reason, detail string) {
	if d.Expect == ExpectFail {
		return
	}
	d.Expect, d.Reason, d.Detail = ExpectFail, reason, detail
}

// checkWorkers marks the dry run failing when a rank that holds a missing
// key has no live worker to put it; it returns the engine's workers when
// every such rank has one (nil otherwise, or when no key is missing).
func (p *Processor) checkWorkers(ctx context.Context, engineID string, items []item, exists []bool, out *DryRun) map[kvcore.Rank]Putter {
	var need []kvcore.Rank
	for i, it := range items {
		if !exists[i] && !slices.Contains(need, it.rank) {
			need = append(need, it.rank)
		}
	}
	if len(need) == 0 {
		return nil
	}
	putters, err := p.workers.Engine(ctx, engineID)
	if err != nil {
		out.fail(string(kvcore.ReasonPutFailed), fmt.Sprintf("no worker to put the missing keys: %v", err))
		return nil
	}
	for _, rk := range need {
		if _, ok := putters[rk]; !ok {
			out.fail(string(kvcore.ReasonPutFailed), fmt.Sprintf("engine %q has no live worker for rank %s", engineID, rk))
			return nil
		}
	}
	return putters
}

// dryRunGroups groups items with their existence (nil: unknown).
func dryRunGroups(items []item, exists []bool) []DryRunGroup {
	var out []DryRunGroup
	for i, it := range items {
		if len(out) == 0 || out[len(out)-1].Group != it.Group {
			out = append(out, DryRunGroup{Group: it.Group})
		}
		g := &out[len(out)-1]
		k := DryRunKey{Key: it.Key, Rank: it.rank.String(), Block: it.Block}
		if exists != nil {
			present := exists[i]
			k.Exists = &present
			if present {
				g.Existing++
			} else {
				g.Missing++
			}
		}
		g.Keys = append(g.Keys, k)
	}
	return out
}
