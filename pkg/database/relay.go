package database

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/bus"
)

// Relay defaults, overridable with RelayOptions.
const (
	DefaultBatchSize    = 500
	DefaultPollInterval = 500 * time.Millisecond
	DefaultBackoffMin   = 100 * time.Millisecond
	DefaultBackoffMax   = 10 * time.Second
)

// relayLockKey is the transaction-scoped advisory lock that lets one relay
// batch run at a time across all processes ("kvmesh.out" in ASCII).
const relayLockKey int64 = 0x6b766d6573682e6f

// maxErrorText bounds the last_error text stored per row.
const maxErrorText = 2000

const (
	claimBatch = `SELECT id, topic, key, value, headers, created_at FROM outbox
		WHERE sent_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`
	markSent   = `UPDATE outbox SET sent_at = now(), attempts = attempts + 1 WHERE id = ANY($1)`
	markFailed = `UPDATE outbox SET attempts = attempts + 1, last_error = $2
		WHERE id = ANY($1) AND sent_at IS NULL`
)

// Relay moves committed outbox rows to the bus. Run it in every service that
// enqueues; any number of relays may run against one database.
//
// Delivery is at least once: a relay that crashes (or loses its database
// connection) after Publish succeeded but before its transaction commits
// leaves the rows unsent, and they are published again. Consumers must be
// idempotent. Without such failures a row is published exactly once, and
// rows sharing a key are published in the order they were enqueued: batches
// are serialised across relays by a transaction-scoped advisory lock, so a
// standby relay never overtakes an active one.
type Relay struct {
	pool                   *pgxpool.Pool
	pub                    Publisher
	batchSize              int
	poll                   time.Duration
	backoffMin, backoffMax time.Duration
	log                    *slog.Logger
}

// RelayOption configures a Relay.
type RelayOption func(*Relay)

// WithBatchSize sets how many rows one Publish call carries at most.
func WithBatchSize(n int) RelayOption {
	return func(r *Relay) { r.batchSize = n }
}

// WithPollInterval sets how often the relay looks for rows when no
// notification arrives (a fallback: notifications normally wake it at once).
func WithPollInterval(d time.Duration) RelayOption {
	return func(r *Relay) { r.poll = d }
}

// WithBackoff bounds the exponential delay between retries after a failure.
func WithBackoff(minDelay, maxDelay time.Duration) RelayOption {
	return func(r *Relay) { r.backoffMin, r.backoffMax = minDelay, maxDelay }
}

// WithLogger sets the logger for failures the relay retries.
func WithLogger(l *slog.Logger) RelayOption {
	return func(r *Relay) { r.log = l }
}

// NewRelay returns a relay that publishes pool's outbox through pub.
func NewRelay(pool *pgxpool.Pool, pub Publisher, opts ...RelayOption) *Relay {
	r := &Relay{
		pool:       pool,
		pub:        pub,
		batchSize:  DefaultBatchSize,
		poll:       DefaultPollInterval,
		backoffMin: DefaultBackoffMin,
		backoffMax: DefaultBackoffMax,
		log:        slog.Default(),
	}
	for _, opt := range opts {
		opt(r)
	}
	r.batchSize = max(r.batchSize, 1)
	r.backoffMin = max(r.backoffMin, time.Millisecond)
	r.backoffMax = max(r.backoffMax, r.backoffMin)
	if r.poll <= 0 {
		r.poll = DefaultPollInterval
	}
	return r
}

// Run publishes outbox rows until ctx is done, then returns nil. Failures
// (database or publisher) are logged and retried with bounded exponential
// backoff; they never end Run.
func (r *Relay) Run(ctx context.Context) error {
	l := &listener{pool: r.pool, log: r.log, retry: r.backoffMin}
	defer l.close()
	failures := 0
	for ctx.Err() == nil {
		l.ensure(ctx)
		n, err := r.relayBatch(ctx)
		switch {
		case ctx.Err() != nil:
		case err != nil:
			failures++
			r.log.WarnContext(ctx, "outbox relay: batch failed; retrying", "err", err, "failures", failures)
			sleepCtx(ctx, r.backoff(failures))
		case n == r.batchSize:
			failures = 0 // more rows are likely waiting
		default:
			failures = 0
			l.wait(ctx, r.poll)
		}
	}
	return nil
}

// backoff returns the delay before retry number failures (1-based), doubled
// each time from backoffMin up to backoffMax, with up to 20% jitter.
func (r *Relay) backoff(failures int) time.Duration {
	d := r.backoffMin
	for i := 1; i < failures && d < r.backoffMax; i++ {
		d *= 2
	}
	d = min(d, r.backoffMax)
	return d - time.Duration(rand.Int64N(int64(d)/5+1))
}

// relayBatch publishes one batch of unsent rows and returns how many it
// published. It returns 0 and no error when another relay holds the batch
// lock.
func (r *Relay) relayBatch(ctx context.Context) (int, error) {
	tx, err := r.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }() // no-op after commit
	ids, rows, err := r.claim(ctx, tx)
	if err != nil || len(ids) == 0 {
		return 0, err
	}
	msgs, spans := startPublishSpans(ctx, ids, rows)
	err = r.pub.Publish(ctx, msgs...)
	endPublishSpans(spans, err)
	if err != nil {
		_ = tx.Rollback(ctx) // release the rows before recording the failure
		return 0, r.recordFailure(ctx, ids, fmt.Errorf("publish %d messages: %w", len(msgs), err))
	}
	if _, err := tx.Exec(ctx, markSent, ids); err != nil {
		return 0, fmt.Errorf("mark sent: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit sent: %w", err)
	}
	return len(ids), nil
}

// claimedRow is one outbox row claimed for publishing.
type claimedRow struct {
	msg     bus.Message
	created time.Time
}

// claim takes the batch lock and locks the oldest unsent rows in tx.
func (r *Relay) claim(ctx context.Context, tx pgx.Tx) ([]int64, []claimedRow, error) {
	var locked bool
	if err := tx.QueryRow(ctx, "SELECT pg_try_advisory_xact_lock($1)", relayLockKey).Scan(&locked); err != nil {
		return nil, nil, fmt.Errorf("take relay lock: %w", err)
	}
	if !locked {
		return nil, nil, nil
	}
	rows, _ := tx.Query(ctx, claimBatch, r.batchSize)
	var ids []int64
	var out []claimedRow
	var id int64
	var c claimedRow
	_, err := pgx.ForEachRow(rows, []any{&id, &c.msg.Topic, &c.msg.Key, &c.msg.Value, &c.msg.Headers, &c.created}, func() error {
		ids = append(ids, id)
		out = append(out, c)
		c = claimedRow{}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("claim rows: %w", err)
	}
	return ids, out, nil
}

// recordFailure stores cause on the rows in a short transaction of its own
// and returns cause (joined with any error recording it).
func (r *Relay) recordFailure(ctx context.Context, ids []int64, cause error) error {
	text := cause.Error()
	if len(text) > maxErrorText {
		text = text[:maxErrorText]
	}
	if _, err := r.pool.Exec(ctx, markFailed, ids, text); err != nil {
		return errors.Join(cause, fmt.Errorf("record failure: %w", err))
	}
	return cause
}

// Backlog returns the number of unsent outbox rows.
func (r *Relay) Backlog(ctx context.Context) (int64, error) {
	var n int64
	if err := r.pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE sent_at IS NULL").Scan(&n); err != nil {
		return 0, fmt.Errorf("database: outbox backlog: %w", err)
	}
	return n, nil
}

// PurgeSent deletes rows sent more than olderThan ago (by the database clock)
// and returns how many it deleted. Unsent rows are never deleted.
func (r *Relay) PurgeSent(ctx context.Context, olderThan time.Duration) (int64, error) {
	tag, err := r.pool.Exec(ctx,
		"DELETE FROM outbox WHERE sent_at < now() - $1 * interval '1 microsecond'", olderThan.Microseconds())
	if err != nil {
		return 0, fmt.Errorf("database: purge sent outbox rows: %w", err)
	}
	return tag.RowsAffected(), nil
}

// sleepCtx waits for d or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
