package requeststate

import (
	"fmt"
	"slices"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// Result applies one transfer result. Every save outcome counts as
// reported (finished_sending follows the last one of a finished request);
// an unknown save status counts as failed so the request is still freed.
// A save of the current epoch with skipped or failed keys is not counted
// as saved: the request's next save covers its range again.
// A load result yields finished_recving with its load errors. A result for
// a task of an older allocation epoch (emitted before a preemption) only
// settles that task: it never advances the saved coverage, completes the
// current load or frees the request. Results for tasks not outstanding
// (repeats, unknown ids) change nothing.
//
// A load of a multi-rank engine (kvcore.LoadTask.Ranks) takes one result
// per rank (res.Rank): finished_recving follows the last rank's, with the
// union of every rank's load errors. A result from a rank that already
// reported ("repeat_rank") or that the load does not wait for, or with no
// rank ("unknown_rank"), changes nothing.
func (r *Request) Result(m *kvcore.Model, res contract.TransferResult) Outcome {
	var out Outcome
	src := "result " + res.ResultID
	switch res.Kind {
	case contract.TransferSave:
		r.saveResult(m, &out, src, res)
	case contract.TransferLoad:
		r.loadResult(m, &out, src, res)
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
	r.storeEffects(out, src, r.Store.OnSaveReport(m, res.TaskID, contract.SaveReportOf(status, res.Groups)))
}

// loadResult routes a load report, with its rank, to the tracker that
// issued the load. The task stays outstanding until its last rank reported.
func (r *Request) loadResult(m *kvcore.Model, out *Outcome, src string, res contract.TransferResult) {
	t, pd := r.loadTracker(res.TaskID)
	if t == nil {
		r.takeTask(res.TaskID)
		out.Ignored = "unknown_task"
		return
	}
	if why := rankIgnored(m, t, res); why != "" {
		out.Ignored = why
		if why == IgnoredUnknownRank {
			r.warn(out, src, fmt.Errorf("load %s: rank %s: %w", res.TaskID, rankName(res.Rank), ErrUnknownRank))
		}
		return
	}
	eff := t.OnRankLoadResult(res.TaskID, res.Rank, res.LoadErrors)
	if t.LoadWait(res.TaskID) < 0 {
		r.takeTask(res.TaskID)
	}
	if pd {
		r.pdEffects(out, src, eff, false)
		return
	}
	r.storeEffects(out, src, eff)
}

// loadTracker is the tracker with taskID pending or stale (nil when
// none), and whether it is the pd tracker.
func (r *Request) loadTracker(taskID string) (*Tracker, bool) {
	has := func(t *Tracker) bool {
		return slices.Contains(t.PendingLoads, taskID) || slices.Contains(t.StaleLoads, taskID)
	}
	switch {
	case has(r.Store):
		return r.Store, false
	case r.PD != nil && has(r.PD):
		return r.PD, true
	}
	return nil, false
}

// rankIgnored says why a load result's rank makes it change nothing ("":
// it does not): a multi-rank load takes one result from each of its
// waiting ranks.
func rankIgnored(m *kvcore.Model, t *Tracker, res contract.TransferResult) string {
	i := t.LoadWait(res.TaskID)
	switch {
	case i < 0:
		return ""
	case res.Rank == nil || !m.IsWorkerRank(*res.Rank):
		return IgnoredUnknownRank
	case !slices.Contains(t.LoadWaits[i].Waiting, *res.Rank):
		return IgnoredRepeatRank
	}
	return ""
}

// rankName names a result's rank ("none" when absent).
func rankName(r *kvcore.Rank) string {
	if r == nil {
		return "none"
	}
	return r.String()
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
