package sending

import (
	"context"
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
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
	// (Reason: exists_failed, put_failed or plan_failed); a replay answers
	// 503 and may be retried later.
	ExpectFail = "fail"
)

// DryRun is what a replay of one dead letter would do now, found without
// saving, recording or publishing anything.
type DryRun struct {
	// DeadLetter is the entry as stored.
	DeadLetter ledger.DeadLetter `json:"-"`
	adminapi.DryRun
}

// DryRunGroup is one group a replay would save.
type DryRunGroup = adminapi.DryRunGroup

// DryRunKey is one store key a replay would check and, when missing, put.
type DryRunKey = adminapi.DryRunKey

// DryRun answers what Replay(id) would do now: the entry's validity
// against the current model, the keys of the groups a replay would save,
// one existence check (not retried) and a look at the worker registry. It
// saves, records and publishes nothing. Errors: ledger.ErrNotFound, or a
// failure reading the entry.
func (p *Processor) DryRun(ctx context.Context, id int64) (DryRun, error) {
	p.metrics.countReplay(ReplayDryRun)
	d, err := p.ledger.Get(ctx, id)
	if err != nil {
		return DryRun{}, err
	}
	out := DryRun{DeadLetter: d}
	if d.ReplayStatus == ledger.ReplayDone {
		out.Expect, out.Reason = ExpectAlreadyReplayed, ExpectAlreadyReplayed
		return out, nil
	}
	task, groups, invalid := p.replayPlan(d)
	if invalid != nil {
		out.Expect, out.Reason, out.Detail, out.Group = ExpectInvalid, invalid.Reason, invalid.Detail, invalid.Group
		return out, nil
	}
	out.Replayable, out.Expect = true, ExpectSave
	r := newRun(task)
	items := p.plan(r, groups)
	for _, dl := range r.deadLetters {
		out.fail(string(ReasonPlanFailed), dl.Detail)
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
		p.checkWorkers(ctx, task.EngineID, items, exists, &out)
	}
	return out, nil
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
// key has no live worker to put it.
func (p *Processor) checkWorkers(ctx context.Context, engineID string, items []item, exists []bool, out *DryRun) {
	var need []kvcore.Rank
	for i, it := range items {
		if !exists[i] && !slices.Contains(need, it.rank) {
			need = append(need, it.rank)
		}
	}
	if len(need) == 0 {
		return
	}
	putters, err := p.workers.Engine(ctx, engineID)
	if err != nil {
		out.fail(string(kvcore.ReasonPutFailed), fmt.Sprintf("no worker to put the missing keys: %v", err))
		return
	}
	for _, rk := range need {
		if _, ok := putters[rk]; !ok {
			out.fail(string(kvcore.ReasonPutFailed), fmt.Sprintf("engine %q has no live worker for rank %s", engineID, rk))
			return
		}
	}
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

// itemKeys lists the keys of items, in order.
func itemKeys(items []item) []string {
	keys := make([]string, len(items))
	for i, it := range items {
		keys[i] = it.Key
	}
	return keys
}
