package tracking

import (
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Result applies one transfer result. Every save outcome counts as
// reported (finished_sending follows the last one of a finished request);
// an unknown save status counts as failed so the request is still freed.
// A load result yields finished_recving with its load errors. A result for
// a task of an older allocation epoch (emitted before a preemption) only
// settles that task: it never advances the saved coverage, completes the
// current load or frees the request. Results for tasks not outstanding
// (repeats, unknown ids) change nothing.
func (r *Request) Result(m *kvcore.Model, res contract.TransferResult) Outcome {
	var out Outcome
	src := "result " + res.ResultID
	switch res.Kind {
	case contract.TransferSave:
		r.saveResult(m, &out, src, res)
	case contract.TransferLoad:
		r.loadResult(&out, src, res)
	default:
		out.Ignored = "unknown_kind"
	}
	return out
}

// saveResult records one save task's report.
func (r *Request) saveResult(m *kvcore.Model, out *Outcome, src string, res contract.TransferResult) {
	status := kvcore.SaveStatus(res.Status)
	if !status.Valid() {
		r.warn(out, src, fmt.Errorf("save %s: status %q counted as failed: %w", res.TaskID, res.Status, kvcore.ErrUnknownSaveStatus))
		status = kvcore.SaveFailed
	}
	stale := slices.Contains(r.Store.StaleSaves, res.TaskID)
	ref, ok := r.takeTask(res.TaskID)
	if !ok && !stale && !slices.Contains(r.Store.PendingSaves, res.TaskID) {
		out.Ignored = "unknown_task"
		return
	}
	if ok {
		r.cover(m, ref, status, res.Groups)
	}
	r.storeEffects(out, src, r.Store.OnSaveResult(res.TaskID, status))
}

// loadResult routes a load report to the tracker that issued the load.
func (r *Request) loadResult(out *Outcome, src string, res contract.TransferResult) {
	r.takeTask(res.TaskID)
	switch {
	case slices.Contains(r.Store.PendingLoads, res.TaskID), slices.Contains(r.Store.StaleLoads, res.TaskID):
		r.storeEffects(out, src, r.Store.OnLoadResult(res.TaskID, res.LoadErrors))
	case r.PD != nil && (slices.Contains(r.PD.PendingLoads, res.TaskID) || slices.Contains(r.PD.StaleLoads, res.TaskID)):
		r.pdEffects(out, src, r.PD.OnLoadResult(res.TaskID, res.LoadErrors), false)
	default:
		out.Ignored = "unknown_task"
	}
}

// cover adds a save report to the per-group coverage. A group reported
// without skips, dead letters or failures extends its saved prefix when the
// task starts inside it. A stored report without group detail covers every
// group.
func (r *Request) cover(m *kvcore.Model, ref TaskRef, status kvcore.SaveStatus, groups []contract.GroupOutcome) {
	if len(r.Coverage) != len(m.Groups) {
		r.Coverage = New(m, "", "").Coverage
	}
	if len(groups) == 0 && status == kvcore.SaveStored {
		for g := range r.Coverage {
			groups = append(groups, contract.GroupOutcome{Group: g})
		}
	}
	for _, g := range groups {
		if g.Group < 0 || g.Group >= len(r.Coverage) {
			continue
		}
		c := &r.Coverage[g.Group]
		c.Stored += g.Stored
		c.Existing += g.Existing
		c.Skipped += g.Skipped
		c.DeadLettered += g.DeadLettered
		c.Failed += g.Failed
		if g.Reason != "" {
			c.LastReason = g.Reason
		}
		clean := g.Skipped == 0 && g.DeadLettered == 0 && g.Failed == 0
		if clean && ref.Start <= c.SavedTokens && ref.End > c.SavedTokens {
			c.SavedTokens = ref.End
		}
	}
}
