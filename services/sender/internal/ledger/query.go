package ledger

import (
	"context"
	"fmt"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
)

// Get returns one of the sender's dead letters, or a
// deadletter.ErrNotFound error.
func (l *Ledger) Get(ctx context.Context, id int64) (deadletter.DeadLetter, error) {
	return l.dl.Get(ctx, id)
}

// RecordReplay records a replay attempt of the sender's dead letter id; see
// deadletter.Store.RecordReplay.
func (l *Ledger) RecordReplay(ctx context.Context, id int64, status string, result any, msgs ...bus.Message) (deadletter.DeadLetter, bool, error) {
	return l.dl.RecordReplay(ctx, id, status, result, msgs...)
}

// Stats sums the accounting.
type Stats = adminapi.Accounting

const statsSQL = `
SELECT count(*), COALESCE(sum(groups_stored), 0), COALESCE(sum(groups_existing), 0),
	COALESCE(sum(groups_skipped), 0), COALESCE(sum(groups_dead_lettered), 0), COALESCE(sum(groups_failed), 0),
	COALESCE(sum(keys_stored), 0), COALESCE(sum(keys_existing), 0), COALESCE(sum(keys_skipped), 0),
	COALESCE(sum(keys_dead_lettered), 0), COALESCE(sum(keys_failed), 0), COALESCE(sum(bytes), 0)
FROM save_outcomes`

// Stats returns the totals of save_outcomes and dead_letters.
func (l *Ledger) Stats(ctx context.Context) (Stats, error) {
	s := Stats{Tasks: map[string]int64{}, Groups: map[string]int64{}, Keys: map[string]int64{}, DeadLetters: map[string]int64{}}
	var total int64
	var g, k [5]int64
	err := l.pool.QueryRow(ctx, statsSQL).Scan(&total, &g[0], &g[1], &g[2], &g[3], &g[4],
		&k[0], &k[1], &k[2], &k[3], &k[4], &s.Bytes)
	if err != nil {
		return Stats{}, fmt.Errorf("ledger: stats: %w", err)
	}
	for i, name := range []string{"stored", "existing", "skipped", "dead_lettered", "failed"} {
		s.Groups[name], s.Keys[name] = g[i], k[i]
	}
	s.Tasks["total"] = total
	if err := l.countBy(ctx, "SELECT status, count(*) FROM save_outcomes GROUP BY status", s.Tasks); err != nil {
		return Stats{}, err
	}
	if err := l.dl.CountByReason(ctx, s.DeadLetters); err != nil {
		return Stats{}, fmt.Errorf("ledger: stats: %w", err)
	}
	var dlTotal int64
	for _, n := range s.DeadLetters {
		dlTotal += n
	}
	s.DeadLetters["total"] = dlTotal
	return s, nil
}

// countBy adds the (name, count) rows of q to into.
func (l *Ledger) countBy(ctx context.Context, q string, into map[string]int64) error {
	if err := database.CountInto(ctx, l.pool, into, q); err != nil {
		return fmt.Errorf("ledger: stats: %w", err)
	}
	return nil
}
