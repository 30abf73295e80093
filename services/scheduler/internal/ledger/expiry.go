package ledger

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// selectOverdue lists the requests with a multi-rank load whose deadline
// passed (the partial index trackers_load_deadline_idx), earliest first,
// with the load waits of both trackers.
const selectOverdue = `SELECT engine_id, request_id, load_deadline, tracker->'load_waits', extras->'pd'->'load_waits'
	FROM trackers WHERE load_deadline <= $1 ORDER BY load_deadline LIMIT $2`

// Overdue is one request with multi-rank loads whose deadline passed.
type Overdue struct {
	// Key names the request.
	Key
	// Deadline is the request's earliest load deadline.
	Deadline time.Time
	// TaskIDs are the overdue loads, store tracker's first.
	TaskIDs []string
}

// Record is the ledger identity of the unit expiring o's loads: kind
// KindLoadExpiry, the task ids and the deadline, so the same expiry
// applied twice is a Duplicate.
func (o Overdue) Record() Record {
	id := strings.Join(o.TaskIDs, " ") + "@" + o.Deadline.UTC().Format(time.RFC3339Nano)
	return Record{Kind: KindLoadExpiry, ID: id, EngineID: o.EngineID, RequestID: o.RequestID}
}

// stampTime is the deadline of a load wait stored now: now plus the rank
// timeout, in UTC and whole microseconds (what timestamptz holds), so the
// load_deadline column and the tracker JSON agree exactly.
func (l *Ledger) stampTime() time.Time {
	return time.Now().Add(l.loadTimeout).UTC().Truncate(time.Microsecond)
}

// OverdueLoads returns up to limit requests, earliest deadline first,
// with a multi-rank load whose deadline is at or before now (trackers'
// load_deadline), naming the loads that are overdue.
func (l *Ledger) OverdueLoads(ctx context.Context, now time.Time, limit int) ([]Overdue, error) {
	rows, err := l.pool.Query(ctx, selectOverdue, now, max(limit, 1))
	if err != nil {
		return nil, fmt.Errorf("ledger: overdue loads: %w", err)
	}
	var out []Overdue
	var o Overdue
	var store, pd []byte
	_, err = pgx.ForEachRow(rows, []any{&o.EngineID, &o.RequestID, &o.Deadline, &store, &pd}, func() error {
		ids, err := overdueTasks(store, pd, now)
		if err != nil {
			return fmt.Errorf("%s/%s: %w", o.EngineID, o.RequestID, err)
		}
		// A row listing no overdue wait still gets its unit: storing the
		// request again rewrites a load_deadline that disagrees with it.
		out = append(out, Overdue{Key: o.Key, Deadline: o.Deadline, TaskIDs: ids})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("ledger: overdue loads: %w", err)
	}
	return out, nil
}

// overdueTasks decodes the load waits of a row's store and pd trackers
// (JSON arrays, nil when absent) and lists the overdue ones.
func overdueTasks(store, pd []byte, now time.Time) ([]string, error) {
	req := &requeststate.Request{Store: &requeststate.Tracker{}}
	req.PD = &requeststate.Tracker{}
	for _, part := range []struct {
		b []byte
		t *requeststate.Tracker
	}{{store, req.Store}, {pd, req.PD}} {
		if part.b == nil {
			continue
		}
		waits, err := requeststate.UnmarshalLoadWaits(part.b)
		if err != nil {
			return nil, fmt.Errorf("decode load waits: %w", err)
		}
		part.t.LoadWaits = waits
	}
	return req.OverdueLoads(now), nil
}
