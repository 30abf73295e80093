package requeststate

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// ExpiredLoad is one multi-rank load that ExpireLoads finished because
// some of its ranks never reported.
type ExpiredLoad struct {
	// Connector is the child that issued the load (ConnectorStore or
	// ConnectorPD).
	Connector string
	// TaskID is the load task.
	TaskID string
	// Missing are the ranks that never reported.
	Missing []kvcore.Rank
	// Deadline is when the ranks were given up on.
	Deadline time.Time
}

// StampLoadDeadlines gives every multi-rank load wait of the store and pd
// trackers that has no deadline yet the given one, and returns the
// earliest deadline over all waits (ok false when there is none). The
// ledger calls it each time it stores the request, with now plus the
// rank timeout, so a wait's deadline is fixed when its load is issued.
func (r *Request) StampLoadDeadlines(deadline time.Time) (earliest time.Time, ok bool) {
	for _, t := range r.trackers() {
		for i := range t.LoadWaits {
			w := &t.LoadWaits[i]
			if w.Deadline.IsZero() {
				w.Deadline = deadline
			}
			if !ok || w.Deadline.Before(earliest) {
				earliest, ok = w.Deadline, true
			}
		}
	}
	return earliest, ok
}

// OverdueLoads lists the task ids of the load waits of both trackers
// whose deadline is at or before now.
func (r *Request) OverdueLoads(now time.Time) []string {
	var ids []string
	for _, t := range r.trackers() {
		for _, w := range t.LoadWaits {
			if overdue(w, now) {
				ids = append(ids, w.TaskID)
			}
		}
	}
	return ids
}

// ExpireLoads gives up on the waiting ranks of the multi-rank loads named
// by taskIDs whose deadline is at or before now (the caller's clock; a
// wait without a deadline never expires). Each such load fails closed as
// kvcore.Tracker.ExpireLoads says: finished_recving with every block of
// the load in load_errors and missing_ranks naming the silent ranks (a
// stale load is only settled). The loads are listed in Outcome.Expired and
// kept as warnings. Loads already finished, or not overdue, are left
// alone, so applying the same expiry twice changes nothing the second time.
func (r *Request) ExpireLoads(now time.Time, taskIDs []string) Outcome {
	var out Outcome
	expired := func(w LoadWait) bool { return overdue(w, now) && slices.Contains(taskIDs, w.TaskID) }
	src := "load expiry"
	r.noteExpired(&out, src, ConnectorStore, r.Store, expired)
	r.storeEffects(&out, src, r.Store.ExpireLoads(expired))
	if r.PD != nil {
		r.noteExpired(&out, src, ConnectorPD, r.PD, expired)
		r.pdEffects(&out, src, r.PD.ExpireLoads(expired), false)
	}
	return out
}

// noteExpired records the waits of t that expired says are overdue: in
// out.Expired and the warnings, and no longer outstanding.
func (r *Request) noteExpired(out *Outcome, src, connector string, t *Tracker, expired func(LoadWait) bool) {
	for _, w := range t.LoadWaits {
		if !expired(w) {
			continue
		}
		out.Expired = append(out.Expired, ExpiredLoad{Connector: connector, TaskID: w.TaskID,
			Missing: slices.Clone(w.Waiting), Deadline: w.Deadline})
		r.takeTask(w.TaskID)
		r.warn(out, src, fmt.Errorf("load %s: ranks %v: %w", w.TaskID, w.Waiting, ErrLoadRanksMissing))
	}
}

// trackers are the request's trackers that issue loads.
func (r *Request) trackers() []*Tracker {
	if r.PD == nil {
		return []*Tracker{r.Store}
	}
	return []*Tracker{r.Store, r.PD}
}

// overdue reports whether w has a deadline at or before now.
func overdue(w LoadWait, now time.Time) bool {
	return !w.Deadline.IsZero() && !w.Deadline.After(now)
}
