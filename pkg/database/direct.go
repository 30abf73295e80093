package database

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Direct defaults.
const (
	// DefaultDirectLease is how long after its insert only the process that
	// committed a row may publish it. A process that dies first leaves its
	// rows to the relays this long (and one relay poll) later.
	DefaultDirectLease = 10 * time.Second
	// directQueue bounds the committed transactions waiting for the lane;
	// a commit that finds it full leaves its rows to the relays.
	directQueue = 1024
	// maxHandoffs bounds the transactions one publish carries.
	maxHandoffs = 64
	// maxSentMarks is how many published rows are marked sent at once
	// without waiting for markDelay: it bounds how many of this process's
	// rows a key can hold unmarked, which the insert of each later row of
	// the key reads (DirectInsertSQL's check of the key's pending rows).
	maxSentMarks = 64
	// maxUnmarked bounds the published rows kept for a sent mark while
	// marking fails (the database is out of reach); beyond it they are let
	// go, and the relays publish them again once their leases end.
	maxUnmarked = 2048
	// stopTimeout bounds what Run does when it stops, and a release of a
	// commit handed over after that.
	stopTimeout = 5 * time.Second
	// markDelay is the longest a published row waits for its sent mark.
	// Until then relays hold later rows of its key that are theirs (rare:
	// the process publishes its own), and nothing else waits for it; it is
	// far inside the lease, so no relay publishes the row again meanwhile.
	// Waiting longer marks more rows per UPDATE: at 50 ms the seed run made
	// 353 mark transactions per 300 requests, at 500 ms 51; under a higher
	// rate maxSentMarks marks sooner.
	markDelay = 500 * time.Millisecond
)

// Direct outcomes, the label of kvmesh_outbox_direct_total.
const (
	// DirectPublished counts rows published on commit.
	DirectPublished = "published"
	// DirectReleased counts rows given back to the relays: the publish
	// failed, the transaction was too old, or an earlier release or
	// failure may have left an older row of its key to the relays.
	DirectReleased = "released"
	// DirectRelayed counts rows the insert already left to the relays: an
	// earlier row of their (topic, key) was still pending elsewhere.
	DirectRelayed = "relayed"
)

// releaseRows gives leased rows back to the relays.
const releaseRows = `UPDATE outbox SET publish_after = NULL WHERE id = ANY($1) AND sent_at IS NULL AND publish_after IS NOT NULL`

// DirectInsertSQL is the outbox insert of publish on commit, for a caller
// that embeds it in a statement of its own (a data-modifying CTE, say) as
// OutboxInsertSQL is embedded: the six parameters Direct.Prepare returns,
// numbered from $first, and rows kept only where cond (SQL; "" for
// always) holds. It inserts each row leased to the Direct where no
// pending row of its (topic, key) is another's or the relays' (see
// Direct), keeps its transaction's commit from waking relays
// (kvmesh.outbox_quiet), and returns each row's id and whether it is
// leased (id, leased), which the caller hands to DirectRows.Answer before
// Committed.
func DirectInsertSQL(first int, cond string) string {
	where := ""
	if cond != "" {
		where = " WHERE " + cond
	}
	owner, lease := first+4, first+5
	return fmt.Sprintf(`INSERT INTO outbox (topic, key, value, headers, publish_owner, publish_after)
	SELECT m.t, m.k, m.v, m.h::jsonb, $%[5]d,
	       CASE WHEN NOT EXISTS (
	           SELECT 1 FROM outbox b
	           WHERE b.topic = m.t AND b.key = m.k AND b.sent_at IS NULL AND b.failed_at IS NULL
	             AND (b.publish_owner IS DISTINCT FROM $%[5]d OR b.publish_after IS NULL
	                  OR b.publish_after <= clock_timestamp()))
	       THEN clock_timestamp() + $%[6]d * interval '1 microsecond' END
	FROM unnest($%[1]d::text[], $%[2]d::text[], $%[3]d::bytea[], $%[4]d::text[]) WITH ORDINALITY AS m(t, k, v, h, n),
	     (SELECT set_config('kvmesh.outbox_quiet', 'on', true)) AS quiet%[7]s
	ORDER BY m.n
	RETURNING id, publish_after IS NOT NULL AS leased`, first, first+1, first+2, first+3, owner, lease, where)
}

// insertDirect is EnqueueBatch's insert.
var insertDirect = DirectInsertSQL(1, "")

// Direct publishes the outbox rows of its process's transactions right
// after they commit ("publish on commit"), so that the common case skips
// the relay's hop: no notification, no claim, no second read of the rows.
// The relays stay the recovery path, and the guarantees are the relay's:
// a row is published if and only if its transaction committed, at least
// once, in order per (topic, key).
//
// How: EnqueueBatch inserts the rows leased to this Direct (publish_owner,
// publish_after: DefaultDirectLease from the insert), which no relay
// claims, and behind which relays hold later rows of the same key; the
// transaction's commit wakes no relay. After COMMIT the caller hands the
// rows to Committed, and Run publishes them, in commit order, then marks
// them sent (deferred, several transactions' rows in one UPDATE).
//
// Order per key holds because a row is leased only when no pending row of
// its key is anybody else's, or a released one: those are the relays' to
// publish first, so the new row is left to the relays too (DirectRelayed).
// A row Run cannot publish (the publish failed, or the transaction is too
// old to publish within its lease) is released: its lease is cleared and
// the relay, woken, publishes it with its classification, backoff and
// holds. Once a release is committed, every transaction whose insert came
// before it is released too (it may have leased a row behind a row just
// released), and so is every one while a release has not reached the
// database. A process that dies leaves its leased rows to the relays when
// their lease ends; Run releases what it still holds when it stops.
type Direct struct {
	pool  *pgxpool.Pool
	pub   Publisher
	relay *Relay
	owner string
	lease time.Duration
	log   *slog.Logger
	count func(outcome string, n int)
	queue chan *DirectRows
	// sent holds published rows whose sent mark is deferred (Run's alone).
	sent []int64

	mu sync.Mutex
	// releasedAt is when the last release committed: rows inserted before
	// it are released, never published here.
	releasedAt time.Time
	// unreleased holds rows to release that have not been (the release
	// failed, or the queue was full): while any, every handoff is released.
	unreleased []int64
	// stopped says Run is over: Committed releases rows itself.
	stopped bool
}

// DirectOption configures a Direct.
type DirectOption func(*Direct)

// WithDirectLease sets how long a row is only its committing process's to
// publish (default DefaultDirectLease). Run publishes a transaction's rows
// only within half of it, and gives one publish a quarter.
func WithDirectLease(d time.Duration) DirectOption {
	return func(x *Direct) {
		if d > 0 {
			x.lease = d
		}
	}
}

// WithDirectLogger sets the logger of failed publishes and database errors.
func WithDirectLogger(l *slog.Logger) DirectOption {
	return func(x *Direct) { x.log = l }
}

// WithDirectMetric registers kvmesh_outbox_direct_total{outcome} on reg
// (once per registry) and counts every row's outcome in it.
func WithDirectMetric(reg prometheus.Registerer) (DirectOption, error) {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvmesh_outbox_direct_total",
		Help: "Outbox rows of this process's transactions by what publish on commit did with them: published, released to the relays (publish failed, or too late), or relayed (an earlier row of the key was the relays').",
	}, []string{"outcome"})
	c, err := telemetry.RegisterOnce(reg, c)
	if err != nil {
		return nil, fmt.Errorf("outbox direct metric: %w", err)
	}
	for _, o := range []string{DirectPublished, DirectReleased, DirectRelayed} {
		c.WithLabelValues(o)
	}
	return func(x *Direct) { x.count = func(o string, n int) { c.WithLabelValues(o).Add(float64(n)) } }, nil
}

// NewDirect returns the publish-on-commit lane of pool's outbox, which
// publishes through pub and wakes relay (the process's own; nil for none)
// for the rows it leaves to the relays. Run must run for it to publish.
func NewDirect(pool *pgxpool.Pool, pub Publisher, relay *Relay, opts ...DirectOption) (*Direct, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("database: direct owner id: %w", err)
	}
	d := &Direct{
		pool: pool, pub: pub, relay: relay,
		owner: pool.Config().ConnConfig.RuntimeParams["application_name"] + "/" + hex.EncodeToString(b[:]),
		lease: DefaultDirectLease, log: slog.Default(), count: func(string, int) {},
		queue: make(chan *DirectRows, directQueue),
	}
	for _, o := range opts {
		o(d)
	}
	return d, nil
}

// NewServiceDirect is a service's Direct: it logs to log and counts its
// rows in kvmesh_outbox_direct_total on reg.
func NewServiceDirect(pool *pgxpool.Pool, pub Publisher, relay *Relay, reg prometheus.Registerer, log *slog.Logger) (*Direct, error) {
	metric, err := WithDirectMetric(reg)
	if err != nil {
		return nil, err
	}
	return NewDirect(pool, pub, relay, WithDirectLogger(log), metric)
}

// DirectRows are the outbox rows of one transaction, queued by
// EnqueueBatch: hand them to Committed once the transaction committed, or
// to Abandon when its COMMIT failed without saying whether it took effect.
type DirectRows struct {
	msgs     []bus.Message // as stored, headers included
	ids      []int64       // by position in msgs, from the insert's answer
	leased   []bool
	enqueued time.Time
}

// Prepare returns DirectInsertSQL's six parameters for msgs (OutboxArgs' four
// arrays, d's name and its lease) and the rows they insert, which take
// the insert's answer. No messages are no rows: four empty arrays.
func (d *Direct) Prepare(ctx context.Context, msgs []bus.Message) ([]any, *DirectRows, error) {
	args, stored, err := outboxRows(ctx, msgs)
	if err != nil {
		return nil, nil, err
	}
	return append(args, d.owner, d.lease.Microseconds()), &DirectRows{msgs: stored, enqueued: time.Now()}, nil
}

// EnqueueBatch queues on batch, inside the caller's transaction, the
// insert of msgs into the outbox (DirectInsertSQL) and returns the rows. The
// insert's answer is read when the caller closes the batch's results (pgx
// runs the queued callback then), so the statements the caller reads
// itself must be queued first. No messages queue nothing and return nil;
// a nil Direct queues the relays' insert (the package's EnqueueBatch) and
// returns nil.
func (d *Direct) EnqueueBatch(ctx context.Context, batch *pgx.Batch, msgs []bus.Message) (*DirectRows, error) {
	if d == nil {
		return nil, EnqueueBatch(ctx, batch, msgs)
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	args, rows, err := d.Prepare(ctx, msgs)
	if err != nil {
		return nil, err
	}
	batch.Queue(insertDirect, args...).Query(rows.scan)
	return rows, nil
}

// scan reads DirectInsertSQL's answer.
func (r *DirectRows) scan(rows pgx.Rows) error {
	var ids []int64
	var leased []bool
	var id int64
	var ok bool
	if _, err := pgx.ForEachRow(rows, []any{&id, &ok}, func() error {
		ids, leased = append(ids, id), append(leased, ok)
		return nil
	}); err != nil {
		return fmt.Errorf("database: enqueue %d messages: %w", len(r.msgs), err)
	}
	return r.Answer(ids, leased)
}

// Answer takes DirectInsertSQL's answer, in any order: each inserted row's id
// and whether it is leased. No rows (a cond that kept none) leave nothing
// to publish.
func (r *DirectRows) Answer(ids []int64, leased []bool) error {
	if len(ids) == 0 {
		r.msgs = nil
		r.ids, r.leased = []int64{}, []bool{}
		return nil
	}
	if len(ids) != len(r.msgs) || len(leased) != len(ids) {
		return fmt.Errorf("database: enqueue %d messages: %d rows inserted", len(r.msgs), len(ids))
	}
	order := make([]int, len(ids))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return cmp.Compare(ids[a], ids[b]) })
	r.ids, r.leased = make([]int64, len(ids)), make([]bool, len(ids))
	for j, i := range order { // ids ascend in the order of the messages
		r.ids[j], r.leased[j] = ids[i], leased[i]
	}
	return nil
}

// Committed hands the rows of a committed transaction to Run. It does not
// wait for Run: when Run is behind by directQueue transactions, the rows
// are left to be released, and once Run has stopped they are released at
// once (one UPDATE, on the caller's goroutine). A nil Direct or rows do
// nothing.
func (d *Direct) Committed(rows *DirectRows) {
	if d == nil || rows == nil {
		return
	}
	if rows.ids == nil { // the insert's answer was never read: nothing to publish here
		d.relay.Kick()
		return
	}
	d.mu.Lock()
	stopped := d.stopped
	if !stopped {
		select {
		case d.queue <- rows:
			d.mu.Unlock()
			return
		default:
		}
	}
	d.mu.Unlock()
	if stopped { // Run is over: give the rows to the relays at once
		ctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
		defer cancel()
		d.release(ctx, leasedIDs(rows))
		return
	}
	d.Abandon(rows)
}

// Settle hands rows to Committed when their transaction's COMMIT answered
// err == nil, else to Abandon (the COMMIT may still have taken effect).
func (d *Direct) Settle(rows *DirectRows, err error) {
	if err == nil {
		d.Committed(rows)
		return
	}
	d.Abandon(rows)
}

// Abandon gives rows back to the relays: for a transaction whose COMMIT
// failed without saying whether it took effect (its rows, if they exist,
// are released; a release of rows that do not exist does nothing). A nil
// Direct or rows, or rows whose insert never answered, do nothing.
func (d *Direct) Abandon(rows *DirectRows) {
	if d == nil || rows == nil || len(rows.ids) == 0 {
		return
	}
	d.mu.Lock()
	d.unreleased = append(d.unreleased, rows.ids...)
	d.mu.Unlock()
	d.relay.Kick()
}

// Run publishes committed rows until ctx is done, then marks what it
// published sent, releases what it did not, and returns nil. Sent marks
// wait up to markDelay, so that one UPDATE carries several transactions'
// rows.
func (d *Direct) Run(ctx context.Context) error {
	var flush <-chan time.Time
	for ctx.Err() == nil {
		select {
		case rows := <-d.queue:
			d.handle(ctx, d.drain(rows))
			switch {
			case len(d.sent) >= maxSentMarks:
				d.markSent(ctx)
			case len(d.sent) > 0 && flush == nil:
				flush = time.After(markDelay)
			}
		case <-flush:
			flush = nil
			d.markSent(ctx)
		case <-ctx.Done():
		}
	}
	d.stop()
	return nil
}

// drain returns first and the transactions queued behind it, up to
// maxHandoffs, in commit order: one publish carries them all.
func (d *Direct) drain(first *DirectRows) []*DirectRows {
	batch := []*DirectRows{first}
	for len(batch) < maxHandoffs {
		select {
		case rows := <-d.queue:
			batch = append(batch, rows)
		default:
			return batch
		}
	}
	return batch
}

// handle publishes the leased rows of batch (transactions in commit
// order) in one publish, or releases them: a transaction that may not be
// published is released with every later one of the batch, which may hold
// later rows of its keys.
func (d *Direct) handle(ctx context.Context, batch []*DirectRows) {
	var claimed []claimedRow
	var release []int64
	for _, rows := range batch {
		leased := leasedIDs(rows)
		if n := len(rows.ids) - len(leased); n > 0 {
			d.count(DirectRelayed, n)
			d.relay.Kick()
		}
		switch {
		case len(leased) == 0:
		case len(release) > 0 || !d.mayPublish(ctx, rows):
			release = append(release, leased...)
		default:
			for i, ok := range rows.leased {
				if ok {
					claimed = append(claimed, claimedRow{id: rows.ids[i], msg: rows.msgs[i], created: rows.enqueued})
				}
			}
		}
	}
	failed := d.publish(ctx, claimed)
	d.release(ctx, append(failed, release...))
}

// publish publishes claimed in one call, adds the published rows to the
// sent marks, and returns the ids of those it could not publish.
func (d *Direct) publish(ctx context.Context, claimed []claimedRow) (failed []int64) {
	if len(claimed) == 0 {
		return nil
	}
	msgs, spans := startPublishSpans(ctx, claimed)
	pctx, cancel := context.WithTimeout(ctx, d.lease/4)
	errs := perMessage(d.pub.Publish(pctx, msgs...), len(msgs))
	cancel()
	outcomes := make([]outcome, len(claimed))
	var first error
	for j, err := range errs {
		if err != nil {
			outcomes[j] = outcome{err: err, held: true} // the relay decides its fate
			failed = append(failed, claimed[j].id)
			first = cmp.Or(first, err)
			continue
		}
		d.sent = append(d.sent, claimed[j].id)
	}
	endPublishSpans(spans, outcomes)
	d.count(DirectPublished, len(claimed)-len(failed))
	if len(failed) > 0 {
		d.log.WarnContext(ctx, "outbox: publish on commit failed; rows left to the relays", "rows", len(failed), "first_id", failed[0], "err", first)
	}
	return failed
}

// mayPublish reports whether rows may be published here: every earlier
// release reached the database, none committed after rows' insert, and
// rows are young enough to be published within their lease.
func (d *Direct) mayPublish(ctx context.Context, rows *DirectRows) bool {
	d.mu.Lock()
	pending := slices.Clone(d.unreleased)
	d.mu.Unlock()
	if len(pending) > 0 && !d.releaseNow(ctx, pending) {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.unreleased) == 0 && !rows.enqueued.Before(d.releasedAt) && time.Since(rows.enqueued) < d.lease/2
}

// release gives ids back to the relays now, or, when the database cannot
// be reached, keeps them to release before anything else is published.
func (d *Direct) release(ctx context.Context, ids []int64) {
	if len(ids) == 0 {
		return
	}
	d.count(DirectReleased, len(ids))
	d.mu.Lock()
	d.unreleased = append(d.unreleased, ids...)
	pending := slices.Clone(d.unreleased)
	d.mu.Unlock()
	d.releaseNow(ctx, pending)
}

// releaseNow clears the lease of ids (the unreleased rows) and reports
// whether that committed; then every row inserted before now is released
// rather than published, and the relay is woken.
func (d *Direct) releaseNow(ctx context.Context, ids []int64) bool {
	if _, err := d.pool.Exec(ctx, releaseRows, ids); err != nil {
		d.log.WarnContext(ctx, "outbox: releasing rows to the relays failed; retried before the next publish", "rows", len(ids), "err", err)
		return false
	}
	d.mu.Lock()
	d.releasedAt = time.Now()
	d.unreleased = slices.DeleteFunc(d.unreleased, func(id int64) bool { return slices.Contains(ids, id) })
	d.mu.Unlock()
	d.relay.Kick()
	return true
}

// markSent marks the published rows sent, in one statement that does not
// wait for its WAL flush (losing the marks in a crash only publishes the
// rows again, which delivery at least once allows). A failed mark is
// retried with the next; rows whose mark never lands are published again
// by a relay once their lease ends.
func (d *Direct) markSent(ctx context.Context) {
	if len(d.sent) == 0 {
		return
	}
	batch := &pgx.Batch{}
	batch.Queue("BEGIN")
	batch.Queue("SET LOCAL synchronous_commit = off")
	batch.Queue(markSent, d.sent)
	batch.Queue("COMMIT")
	if err := d.pool.SendBatch(ctx, batch).Close(); err != nil {
		d.log.WarnContext(ctx, "outbox: marking published rows sent failed; retried with the next", "rows", len(d.sent), "err", err)
		if len(d.sent) > maxUnmarked {
			d.sent = d.sent[:0] // their leases end: the relays publish them again
		}
		return
	}
	d.sent = d.sent[:0]
}

// stop ends Run: it marks what was published and releases what is still
// queued or unreleased, with a short deadline of its own.
func (d *Direct) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), stopTimeout)
	defer cancel()
	d.markSent(ctx)
	d.mu.Lock()
	d.stopped = true // later commits release their rows themselves (Committed)
	d.mu.Unlock()
	var ids []int64
	for len(d.queue) > 0 {
		ids = append(ids, leasedIDs(<-d.queue)...)
	}
	d.count(DirectReleased, len(ids))
	d.mu.Lock()
	ids = append(ids, d.unreleased...)
	d.mu.Unlock()
	if len(ids) > 0 {
		d.releaseNow(ctx, ids)
	}
}

// leasedIDs returns the ids of rows' leased rows.
func leasedIDs(rows *DirectRows) []int64 {
	var ids []int64
	for i, ok := range rows.leased {
		if ok {
			ids = append(ids, rows.ids[i])
		}
	}
	return ids
}
