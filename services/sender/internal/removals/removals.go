// Package removals is the sender's log of the store's removals, the
// block_removals table: the removal watcher records each BlockRemoved
// record it published (Log.Record), and the API answers what of a tenant
// left the store, when, why and how old it was (Log.Query). It is the
// table's only reader and writer; rows are written once and deleted after
// the retention.
package removals

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/contract"
)

// Defaults of a Log.
const (
	// DefaultRetention is how long a removal is kept.
	DefaultRetention = 7 * 24 * time.Hour
	// pruneEvery is how often Record deletes the rows past the retention.
	pruneEvery = time.Hour
	// MaxLimit bounds Filter.Limit.
	MaxLimit = 1000
)

// ErrFilter reports a Filter that cannot be answered.
var ErrFilter = errors.New("removals: invalid filter")

// Log reads and writes block_removals.
type Log struct {
	pool      *pgxpool.Pool
	retention time.Duration
	now       func() time.Time

	mu        sync.Mutex
	lastPrune time.Time
}

// New returns the log on pool, keeping rows for retention (zero:
// DefaultRetention).
func New(pool *pgxpool.Pool, retention time.Duration) *Log {
	if retention <= 0 {
		retention = DefaultRetention
	}
	return &Log{pool: pool, retention: retention, now: time.Now}
}

// Retention is how long the log keeps a removal.
func (l *Log) Retention() time.Duration { return l.retention }

const insertSQL = `
INSERT INTO block_removals (removed_at, model, fingerprint, tenant, namespace, cause,
	blocks, ages_known, age_min_s, age_max_s, age_sum_s)
SELECT * FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
	$7::integer[], $8::integer[], $9::float8[], $10::float8[], $11::float8[])`

const pruneSQL = `DELETE FROM block_removals WHERE removed_at < $1`

// Record writes one row per BlockRemoved record of recs, and per
// AllBlocksCleared (cause flushed, 0 blocks: how many left is not known),
// in one statement (others are skipped), and, once an hour, deletes the
// rows past the retention.
func (l *Log) Record(ctx context.Context, recs []contract.KVEventRecord) error {
	var c columns
	for _, r := range recs {
		if r.Kind() == contract.BlockRemoved && len(r.Hashes) > 0 || r.Kind() == contract.AllBlocksCleared {
			c.add(r)
		}
	}
	if len(c.at) == 0 {
		return nil
	}
	if _, err := l.pool.Exec(ctx, insertSQL, c.at, c.model, c.fp, c.tenant, c.ns, c.cause,
		c.blocks, c.known, c.min, c.max, c.sum); err != nil {
		return fmt.Errorf("removals: record %d: %w", len(c.at), err)
	}
	return l.prune(ctx)
}

// prune deletes the rows past the retention, at most once per pruneEvery.
func (l *Log) prune(ctx context.Context) error {
	now := l.now()
	l.mu.Lock()
	due := now.Sub(l.lastPrune) >= pruneEvery
	if due {
		l.lastPrune = now
	}
	l.mu.Unlock()
	if !due {
		return nil
	}
	if _, err := l.pool.Exec(ctx, pruneSQL, now.Add(-l.retention)); err != nil {
		return fmt.Errorf("removals: prune: %w", err)
	}
	return nil
}

// columns are the rows of one Record, column by column (unnest's input).
type columns struct {
	at                           []time.Time
	model, fp, tenant, ns, cause []string
	blocks, known                []int32
	min, max, sum                []*float64
}

// add appends the row of one BlockRemoved record: its blocks and the
// summary of their known ages (-1 is unknown).
func (c *columns) add(r contract.KVEventRecord) {
	var known int32
	var lo, hi, sum float64
	for _, a := range r.Ages {
		if a < 0 {
			continue
		}
		if known == 0 || a < lo {
			lo = a
		}
		if known == 0 || a > hi {
			hi = a
		}
		sum += a
		known++
	}
	c.at = append(c.at, time.UnixMilli(int64(r.Batch.TS*1e3)).UTC())
	c.model, c.fp, c.tenant = append(c.model, r.Model), append(c.fp, r.Fingerprint), append(c.tenant, r.Tenant)
	c.ns, c.cause = append(c.ns, r.Namespace), append(c.cause, r.Cause)
	c.blocks, c.known = append(c.blocks, int32(len(r.Hashes))), append(c.known, known)
	if known == 0 {
		c.min, c.max, c.sum = append(c.min, nil), append(c.max, nil), append(c.sum, nil)
		return
	}
	c.min, c.max, c.sum = append(c.min, &lo), append(c.max, &hi), append(c.sum, &sum)
}

// Filter is what Query answers about.
type Filter struct {
	// Tenant, when set, keeps one tenant's removals ("" is the tenant-less
	// key space); nil keeps every tenant's.
	Tenant *string
	// Cause, when set, keeps one cause.
	Cause string
	// Since and Until bound removed_at: [Since, Until).
	Since, Until time.Time
	// Limit is how many of the newest records to list, 0 to MaxLimit.
	Limit int
}

const byCauseSQL = `
SELECT cause, sum(blocks), sum(ages_known), min(age_min_s), max(age_max_s), sum(age_sum_s)
FROM block_removals
WHERE removed_at >= $1 AND removed_at < $2 AND ($3::text IS NULL OR tenant = $3) AND ($4 = '' OR cause = $4)
GROUP BY cause ORDER BY cause`

const recentSQL = `
SELECT id, removed_at, model, fingerprint, tenant, namespace, cause, blocks, ages_known, age_min_s, age_max_s
FROM block_removals
WHERE removed_at >= $1 AND removed_at < $2 AND ($3::text IS NULL OR tenant = $3) AND ($4 = '' OR cause = $4)
ORDER BY removed_at DESC, id DESC LIMIT $5`

// Query answers f: the window's removals summed per cause, and its
// newest records.
func (l *Log) Query(ctx context.Context, f Filter) (adminapi.Removals, error) {
	if f.Limit < 0 || f.Limit > MaxLimit || !f.Since.Before(f.Until) {
		return adminapi.Removals{}, fmt.Errorf("%w: limit %d (0 to %d), window [%s, %s)", ErrFilter, f.Limit, MaxLimit, f.Since, f.Until)
	}
	out := adminapi.Removals{Tenant: f.Tenant, Cause: f.Cause, Since: f.Since.UTC(), Until: f.Until.UTC(),
		ByCause: []adminapi.RemovalCause{}, Recent: []adminapi.Removal{}}
	rows, err := l.pool.Query(ctx, byCauseSQL, f.Since, f.Until, f.Tenant, f.Cause)
	if err != nil {
		return adminapi.Removals{}, fmt.Errorf("removals: by cause: %w", err)
	}
	out.ByCause, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (adminapi.RemovalCause, error) {
		var c adminapi.RemovalCause
		var sum *float64
		err := row.Scan(&c.Cause, &c.Blocks, &c.AgesKnown, &c.AgeMinS, &c.AgeMaxS, &sum)
		if sum != nil && c.AgesKnown > 0 {
			avg := *sum / float64(c.AgesKnown)
			c.AgeAvgS = &avg
		}
		return c, err
	})
	if err != nil {
		return adminapi.Removals{}, fmt.Errorf("removals: by cause: %w", err)
	}
	if f.Limit == 0 {
		return out, nil
	}
	rows, err = l.pool.Query(ctx, recentSQL, f.Since, f.Until, f.Tenant, f.Cause, f.Limit)
	if err != nil {
		return adminapi.Removals{}, fmt.Errorf("removals: recent: %w", err)
	}
	out.Recent, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (adminapi.Removal, error) {
		var r adminapi.Removal
		err := row.Scan(&r.ID, &r.RemovedAt, &r.Model, &r.Fingerprint, &r.Tenant, &r.Namespace, &r.Cause,
			&r.Blocks, &r.AgesKnown, &r.AgeMinS, &r.AgeMaxS)
		r.RemovedAt = r.RemovedAt.UTC()
		return r, err
	})
	if err != nil {
		return adminapi.Removals{}, fmt.Errorf("removals: recent: %w", err)
	}
	return out, nil
}
