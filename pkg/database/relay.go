package database

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/retry"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/pkg/text"
)

// Relay defaults, overridable with RelayOptions.
const (
	DefaultBatchSize    = 500
	DefaultPollInterval = 500 * time.Millisecond
	DefaultBackoffMin   = 100 * time.Millisecond
	DefaultBackoffMax   = 10 * time.Second
	// DefaultMaxMessageBytes is the largest message the relay hands to the
	// publisher: kafka-go's Writer default BatchBytes (1 MiB), which
	// bus.Producer keeps, and about the broker's default message.max.bytes.
	DefaultMaxMessageBytes = 1 << 20
)

// relayLockKey is the transaction-scoped advisory lock that lets one relay
// batch run at a time across all processes ("kvmesh.out" in ASCII).
const relayLockKey int64 = 0x6b766d6573682e6f

// maxErrorText bounds the last_error text stored per row.
const maxErrorText = 2000

// Outbox row states, as the relay's queries see them:
//
//   - pending: sent_at IS NULL AND failed_at IS NULL; claimed in id order
//     unless the row, or an earlier pending row of the same (topic, key),
//     backs off (next_attempt_at in the future) or is leased to the
//     process that committed it (publish_after in the future: Direct);
//   - sent: sent_at set (and purged by PurgeSent later);
//   - failed: failed_at set, with fail_reason and last_error; skipped by
//     the relay until RetryFailed puts it back.
const (
	// claimWaiting and claimTrying take the batch lock — waiting for it,
	// or only if no other relay holds it — and, once held, lock the oldest
	// claimable rows (claimRows); the volatile CTE runs once, before the
	// rows are read.
	claimWaiting = `WITH batch_lock AS MATERIALIZED (
		    SELECT true AS held FROM (SELECT pg_advisory_xact_lock($2)) AS l)` + claimRows
	claimTrying = `WITH batch_lock AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($2) AS held)` + claimRows
	claimRows   = `
		SELECT o.id, o.topic, o.key, o.value, o.headers, o.created_at, o.attempts
		FROM outbox o, batch_lock
		WHERE batch_lock.held AND o.sent_at IS NULL AND o.failed_at IS NULL
		  AND (o.publish_after IS NULL OR o.publish_after <= now())
		  AND NOT EXISTS (
		      SELECT 1 FROM outbox b
		      WHERE b.topic = o.topic AND b.key = o.key AND b.id <= o.id
		        AND b.sent_at IS NULL AND b.failed_at IS NULL
		        AND (b.next_attempt_at > now() OR b.publish_after > now()))
		ORDER BY o.id LIMIT $1
		FOR UPDATE OF o SKIP LOCKED`
	markSent = `UPDATE outbox SET sent_at = now(), attempts = attempts + 1, next_attempt_at = NULL
		WHERE id = ANY($1)`
	markBackoff = `UPDATE outbox o SET attempts = o.attempts + 1, last_error = d.err,
		    next_attempt_at = now() + d.delay_us * interval '1 microsecond'
		FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS d(id, delay_us, err)
		WHERE o.id = d.id AND o.sent_at IS NULL`
	markHeld = `UPDATE outbox o SET attempts = o.attempts + 1, last_error = d.err
		FROM unnest($1::bigint[], $2::text[]) AS d(id, err)
		WHERE o.id = d.id AND o.sent_at IS NULL`
	markPermanent = `UPDATE outbox o SET attempts = o.attempts + 1, last_error = d.err,
		    failed_at = now(), fail_reason = d.reason, next_attempt_at = NULL
		FROM unnest($1::bigint[], $2::text[], $3::text[]) AS d(id, reason, err)
		WHERE o.id = d.id AND o.sent_at IS NULL`
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
//
// No message blocks the others. A row the broker can never accept (larger
// than the maximum message size, an invalid topic: see classify) is marked
// failed with a reason and leaves the relay path; later rows, of its key
// too, keep flowing, and the row waits for an operator (FailedRows,
// RetryFailed). A row whose publish failed transiently backs off on its own
// (next_attempt_at, doubling per attempt from the backoff minimum to its
// maximum); rows of the same topic and key behind it wait, so the order per
// key holds, while rows of other keys keep flowing. When a batch fails
// because of one message (kafka-go fails a whole partition batch, or the
// whole call, for one oversized message), the relay republishes the
// suspects one at a time, so good rows of the batch still go out.
type Relay struct {
	pool                   *pgxpool.Pool
	pub                    Publisher
	batchSize              int
	poll                   time.Duration
	backoffMin, backoffMax time.Duration
	maxMessageBytes        int64
	onFailure              func(reason FailReason)
	log                    *slog.Logger
	// kick wakes Run at once (Kick): a commit of this process's whose
	// rows are the relay's to publish, and which woke no listener.
	kick chan struct{}
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

// WithBackoff bounds the exponential delay between retries after a failure:
// of a whole batch after a database error, and of one row after a transient
// publish error.
func WithBackoff(minDelay, maxDelay time.Duration) RelayOption {
	return func(r *Relay) { r.backoffMin, r.backoffMax = minDelay, maxDelay }
}

// WithMaxMessageBytes sets the largest message (key, value and headers) the
// relay hands to the publisher (default DefaultMaxMessageBytes); a larger
// row is marked failed (ReasonMessageTooLarge) without asking the broker.
// Keep it at most the producer's batch bytes and the broker's
// message.max.bytes.
func WithMaxMessageBytes(n int64) RelayOption {
	return func(r *Relay) { r.maxMessageBytes = n }
}

// WithFailureHook calls fn once per row and failed publish attempt with the
// failure's reason: ReasonTransient, or the permanent reason the row is
// marked failed with. Services count them in a metric; fn must not block.
func WithFailureHook(fn func(reason FailReason)) RelayOption {
	return func(r *Relay) { r.onFailure = fn }
}

// WithLogger sets the logger for failures the relay retries.
func WithLogger(l *slog.Logger) RelayOption {
	return func(r *Relay) { r.log = l }
}

// NewRelay returns a relay that publishes pool's outbox through pub.
func NewRelay(pool *pgxpool.Pool, pub Publisher, opts ...RelayOption) *Relay {
	r := &Relay{
		pool:            pool,
		pub:             pub,
		batchSize:       DefaultBatchSize,
		poll:            DefaultPollInterval,
		backoffMin:      DefaultBackoffMin,
		backoffMax:      DefaultBackoffMax,
		maxMessageBytes: DefaultMaxMessageBytes,
		log:             slog.Default(),
		kick:            make(chan struct{}, 1),
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
	if r.maxMessageBytes <= 0 {
		r.maxMessageBytes = DefaultMaxMessageBytes
	}
	return r
}

// Run publishes outbox rows until ctx is done, then returns nil. Database
// failures are logged and retried with bounded exponential backoff; publish
// failures are recorded per row (see Relay). Neither ends Run.
func (r *Relay) Run(ctx context.Context) error {
	l := newListener(r.pool, r.log, r.backoffMin)
	defer l.close()
	woken := false // the next batch answers a commit of this service's: it waits for the batch lock
	for ctx.Err() == nil {
		failures := 0
		res, err := retry.Do(ctx, r.backoff(), func() (batchResult, error) {
			l.ensure(ctx)
			return r.relayBatch(ctx, woken)
		}, func(err error, delay time.Duration) {
			failures++
			r.log.WarnContext(ctx, "outbox relay: batch failed; retrying", "err", err, "failures", failures, "delay", delay)
		})
		switch {
		case err != nil: // only when ctx ended
		case res.claimed == r.batchSize: // more rows are likely waiting
			woken = true
		default:
			wait := r.poll
			if res.retryIn > 0 {
				wait = min(wait, res.retryIn)
			}
			woken = l.wait(ctx, wait, r.kick)
		}
	}
	return nil
}

// Kick wakes the relay for rows this process committed without waking
// it through PostgreSQL (Direct's released rows); it never blocks. A
// relay that is not running ignores it, and so does a nil one.
func (r *Relay) Kick() {
	if r == nil {
		return
	}
	select {
	case r.kick <- struct{}{}:
	default: // a wake is already pending
	}
}

// backoff is the relay's retry.Backoff: doubling from backoffMin up to
// backoffMax, with up to 20% jitter either way (never above backoffMax).
func (r *Relay) backoff() retry.Backoff {
	return retry.Backoff{Initial: r.backoffMin, Max: r.backoffMax, Jitter: 0.2}
}

// batchResult is what one relay batch did.
type batchResult struct {
	// claimed counts the rows the batch claimed, whatever became of them.
	claimed int
	// retryIn is the shortest backoff the batch gave a row (0: none).
	retryIn time.Duration
}

// claimedRow is one outbox row claimed for publishing.
type claimedRow struct {
	id       int64
	msg      bus.Message
	created  time.Time
	attempts int
}

// topicKey is the unit of ordering: rows of one topic and key.
type topicKey struct{ topic, key string }

// outcome is what became of one claimed row.
type outcome struct {
	err    error      // nil: published
	reason FailReason // for a failed row: the reason; ReasonTransient: back off
	// held: an earlier row of its key (heldBy) backs off, so this one stays
	// pending, published or not, to be published after that row.
	held   bool
	heldBy int64
}

// relayBatch publishes one batch of pending rows and records every row's
// outcome in the batch's transaction, in two round trips to PostgreSQL:
// one that opens the transaction, takes the batch lock and claims the rows
// (claim), and one that records the outcomes and commits (record). A batch
// that answers this service's commits (wait) waits for the batch lock, so
// that rows committed while another relay's batch ran go out right after
// it; a polling batch claims nothing, and returns no error, when another
// relay holds the lock.
func (r *Relay) relayBatch(ctx context.Context, wait bool) (batchResult, error) {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return batchResult{}, fmt.Errorf("acquire: %w", err)
	}
	defer pc.Release() // a connection left inside a transaction is closed, not reused
	conn := pc.Conn()
	rows, err := r.claim(ctx, conn, wait)
	if err != nil {
		Rollback(conn)
		return batchResult{}, err
	}
	if len(rows) == 0 {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "COMMIT"); err != nil {
			return batchResult{}, fmt.Errorf("end empty batch: %w", err)
		}
		return batchResult{}, nil
	}
	msgs, spans := startPublishSpans(ctx, rows)
	outcomes := r.publish(ctx, rows, msgs)
	endPublishSpans(spans, outcomes)
	res, err := r.record(ctx, conn, rows, outcomes)
	if err != nil {
		Rollback(conn) // the rows stay pending
		return batchResult{}, err
	}
	return res, nil
}

// publish sends msgs (the claimed rows' messages) and returns each row's
// outcome. Oversized messages are failed without being sent. A permanent
// error in a batch of several messages may be another message's (kafka-go
// reports one error for a whole partition batch), so such suspects, and
// every later message of their key in the batch to keep the key's order,
// are sent again one at a time before a verdict; a message that then fails
// transiently holds back the later messages of its key.
func (r *Relay) publish(ctx context.Context, rows []claimedRow, msgs []bus.Message) []outcome {
	out := make([]outcome, len(rows))
	var send []int // indexes of the messages to publish
	for i, m := range msgs {
		if n := messageSize(m); n > r.maxMessageBytes {
			out[i] = outcome{err: fmt.Errorf("message of %d bytes exceeds the relay's maximum of %d bytes: %w",
				n, r.maxMessageBytes, kafka.MessageSizeTooLarge), reason: ReasonMessageTooLarge}
			continue
		}
		send = append(send, i)
	}
	if len(send) == 0 {
		return out
	}
	batch := make([]bus.Message, len(send))
	for j, i := range send {
		batch[j] = msgs[i]
	}
	errs := perMessage(r.pub.Publish(ctx, batch...), len(batch))
	blocked := map[topicKey]int64{} // the row of the key that backs off
	alone := map[topicKey]bool{}    // an earlier message of the key was resent alone
	for j, i := range send {
		k := topicKey{msgs[i].Topic, msgs[i].Key}
		if by, ok := blocked[k]; ok {
			out[i] = outcome{err: errs[j], held: true, heldBy: by}
			continue
		}
		err := errs[j]
		if _, permanent := classify(err); alone[k] || (err != nil && permanent && len(batch) > 1) {
			alone[k] = true
			err = r.pub.Publish(ctx, msgs[i])
		}
		out[i] = outcome{err: err}
		if err != nil {
			out[i].reason, _ = classify(err)
			if out[i].reason == ReasonTransient {
				blocked[k] = rows[i].id
			}
		}
	}
	return out
}

// record stores the outcomes in tx: published rows are marked sent, rows
// with a permanent error failed, rows with a transient error backed off.
// Held rows count the attempt and say why they wait; they stay pending
// without a backoff of their own, so they follow the row that holds them as
// soon as it is published.
func (r *Relay) record(ctx context.Context, conn *pgx.Conn, rows []claimedRow, outcomes []outcome) (batchResult, error) {
	res := batchResult{claimed: len(rows)}
	var sent, backoffIDs, failedIDs, heldIDs []int64
	var delays []int64
	var backoffErrs, failedReasons, failedErrs, heldErrs []string
	for i, o := range outcomes {
		row := rows[i]
		switch {
		case o.held:
			why := fmt.Errorf("held behind outbox row %d of the same topic and key, which backs off", o.heldBy)
			if o.err != nil {
				why = fmt.Errorf("%w; %w", o.err, why)
			}
			heldIDs = append(heldIDs, row.id)
			heldErrs = append(heldErrs, errorText(why))
		case o.err == nil:
			sent = append(sent, row.id)
		case o.reason == ReasonTransient:
			d := r.backoff().Delay(row.attempts + 1)
			res.retryIn = min(cmp.Or(res.retryIn, d), d)
			backoffIDs = append(backoffIDs, row.id)
			delays = append(delays, d.Microseconds())
			backoffErrs = append(backoffErrs, errorText(o.err))
		default:
			failedIDs = append(failedIDs, row.id)
			failedReasons = append(failedReasons, string(o.reason))
			failedErrs = append(failedErrs, errorText(o.err))
			r.log.ErrorContext(ctx, "outbox relay: message can never be published; marked failed",
				"id", row.id, "topic", row.msg.Topic, "key", row.msg.Key, "reason", o.reason, "err", o.err)
		}
		if o.err != nil && !o.held && r.onFailure != nil {
			r.onFailure(o.reason)
		}
	}
	if len(backoffIDs) > 0 {
		r.log.WarnContext(ctx, "outbox relay: publish failed; rows back off", "rows", len(backoffIDs),
			"first_id", backoffIDs[0], "err", backoffErrs[0])
	}
	updates := []struct {
		what, sql string
		ids       []int64
		more      []any // the arguments after ids
	}{
		{"mark sent", markSent, sent, nil},
		{"mark backoff", markBackoff, backoffIDs, []any{delays, backoffErrs}},
		{"mark held", markHeld, heldIDs, []any{heldErrs}},
		{"mark failed", markPermanent, failedIDs, []any{failedReasons, failedErrs}},
	}
	batch := &pgx.Batch{}
	var whats []string
	for _, u := range updates {
		if len(u.ids) == 0 {
			continue
		}
		batch.Queue(u.sql, append([]any{u.ids}, u.more...)...)
		whats = append(whats, u.what)
	}
	batch.Queue("COMMIT")
	whats = append(whats, "commit outcomes")
	br := conn.SendBatch(ctx, batch)
	defer br.Close()
	for _, what := range whats {
		if _, err := br.Exec(); err != nil {
			return res, fmt.Errorf("%s: %w", what, err)
		}
	}
	return res, br.Close()
}

// errorText bounds err's text for last_error and makes it storable there.
func errorText(err error) string {
	return text.ForPostgres(text.Truncate(err.Error(), maxErrorText))
}

// claim opens the batch's transaction, takes the batch lock (waiting for
// it when wait, else only if no other relay holds it), and locks the
// oldest claimable rows, in one round trip. The transaction commits asynchronously (synchronous_commit
// off): losing its sent marks in a crash only publishes those rows again,
// which delivery at least once allows, and it spares every relayed batch a
// WAL flush. The caller ends the transaction.
func (r *Relay) claim(ctx context.Context, conn *pgx.Conn, wait bool) ([]claimedRow, error) {
	batch := &pgx.Batch{}
	batch.Queue("BEGIN")
	batch.Queue("SET LOCAL synchronous_commit = off")
	claim := claimTrying
	if wait {
		claim = claimWaiting
	}
	batch.Queue(claim, r.batchSize, relayLockKey)
	br := conn.SendBatch(ctx, batch)
	defer br.Close()
	for _, what := range []string{"begin", "relay transaction"} {
		if _, err := br.Exec(); err != nil {
			return nil, fmt.Errorf("%s: %w", what, err)
		}
	}
	rows, _ := br.Query()
	var out []claimedRow
	var c claimedRow
	_, err := pgx.ForEachRow(rows, []any{&c.id, &c.msg.Topic, &c.msg.Key, &c.msg.Value, &c.msg.Headers, &c.created, &c.attempts}, func() error {
		out = append(out, c)
		c = claimedRow{}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("claim rows: %w", err)
	}
	return out, br.Close()
}

// Backlog returns the number of pending outbox rows: neither sent nor
// failed (FailedCount counts those).
func (r *Relay) Backlog(ctx context.Context) (int64, error) {
	var n int64
	err := r.pool.QueryRow(ctx, "SELECT count(*) FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL").Scan(&n)
	if err != nil {
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

// WithFailureMetric registers kvmesh_outbox_publish_failures_total{reason}
// on reg (once per registry) and returns the option that counts every
// failed publish attempt of this relay into it, as WithFailureHook does.
func WithFailureMetric(reg prometheus.Registerer) (RelayOption, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_outbox_publish_failures_total",
		Help: "Failed publish attempts of outbox rows by this process's relay, by reason (transient, or the permanent reason the row was failed with).",
	}, []string{"reason"})
	c, err := telemetry.RegisterOnce(reg, c)
	if err != nil {
		return nil, fmt.Errorf("outbox relay metric: %w", err)
	}
	return WithFailureHook(func(reason FailReason) { c.WithLabelValues(string(reason)).Inc() }), nil
}
