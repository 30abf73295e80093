// Package ledger is the sender's durable record in PostgreSQL: one
// save_outcomes row per completed save task (the accounting and the
// handler's idempotency key), its dead letters (the sender's rows of the
// shared dead_letters table, through pkg/deadletter's Store), and the
// outgoing messages, all written in one transaction through the outbox.
package ledger

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
)

// Source identifies the Kafka record a write comes from.
type Source struct {
	// Topic, Partition and Offset locate the record.
	Topic     string
	Partition int
	Offset    int64
	// Time is the record's timestamp; with the location it identifies one
	// record even across a broker that reuses offsets.
	Time time.Time
	// Key is the record's key.
	Key string
	// Payload is the record's value, kept with each dead letter.
	Payload []byte
}

// Outcome is one save task's row in save_outcomes.
type Outcome struct {
	// Result is the TransferResult reported for the task.
	Result contract.TransferResult
	// Groups counts the task's groups by outcome (stored, existing,
	// skipped, dead_lettered, failed).
	Groups map[string]int
}

// Entry is everything one handled record leaves behind.
type Entry struct {
	// Source is the record.
	Source Source
	// Outcome is the task's outcome; nil for a record with no usable task id.
	Outcome *Outcome
	// DropIfDone makes a task whose outcome already exists leave nothing at
	// all (a redelivered, decoded task). Without it the dead letters are
	// still written and only the messages are dropped.
	DropIfDone bool
	// DeadLetters are written with ON CONFLICT DO NOTHING on the record's
	// slot; ID, CreatedAt and the source fields are filled in.
	DeadLetters []deadletter.DeadLetter
	// Messages (transfer result, kv events) are enqueued when the outcome
	// is new (or there is no outcome).
	Messages []bus.Message
}

// Committed says what a Commit wrote.
type Committed struct {
	// Done is set when the task's outcome already existed.
	Done bool
	// DeadLetters are the rows inserted now (not those already present).
	DeadLetters []deadletter.DeadLetter
}

// Ledger reads and writes the sender's tables.
type Ledger struct {
	pool  *pgxpool.Pool
	dl    *deadletter.Store
	group group
	// direct publishes the messages of committed entries (nil: the
	// relays do).
	direct *database.Direct
}

// Option configures a Ledger.
type Option func(*Ledger)

// WithDirect has the ledger enqueue its messages for publish on commit
// through d (whose Run must run), instead of leaving them to the relays.
func WithDirect(d *database.Direct) Option {
	return func(l *Ledger) { l.direct = d }
}

// New returns a ledger over pool (migrated to 0013 or later).
func New(pool *pgxpool.Pool, opts ...Option) *Ledger {
	l := &Ledger{pool: pool, dl: deadletter.NewStore(pool, deadletter.ServiceSender)}
	for _, o := range opts {
		o(l)
	}
	return l
}

// DeadLetters is the store of the sender's dead letters, which the admin
// routes (pkg/deadletter/dlqhttp) serve.
// A nil ledger has no store (nil).
func (l *Ledger) DeadLetters() *deadletter.Store {
	if l == nil {
		return nil
	}
	return l.dl
}

// Commit writes e in one transaction: the outcome row, the dead letters and
// their DLQ messages, and e.Messages, all through the outbox.
//
// An entry with an outcome and no dead letters (every save that went
// well) is one statement, one round trip: a data-modifying CTE inserts the
// outcome and, only when that row is new, the messages (database's
// set-based outbox insert), and answers whether it was new. Any other
// entry is two pipelined round trips on one connection: BEGIN, the
// outcome insert and the dead-letter inserts; then the outbox insert of
// what is to be published and COMMIT (or ROLLBACK, for a task already done
// and dropped, which undoes the dead-letter inserts).
func (l *Ledger) Commit(ctx context.Context, e Entry) (Committed, error) {
	var out Committed
	var err error
	if e.Outcome != nil && len(e.DeadLetters) == 0 {
		out, err = l.commitOutcome(ctx, e)
	} else {
		out, err = l.commitTx(ctx, e)
	}
	if err != nil {
		return Committed{}, fmt.Errorf("ledger: commit %s/%d@%d: %w", e.Source.Topic, e.Source.Partition, e.Source.Offset, err)
	}
	return out, nil
}

const insertOutcomeSQL = `
INSERT INTO save_outcomes (task_id, result_id, engine_id, request_id, status,
	groups_stored, groups_existing, groups_skipped, groups_dead_lettered, groups_failed,
	keys_stored, keys_existing, keys_skipped, keys_dead_lettered, keys_failed,
	bytes, topic, partition, "offset", result)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20)
ON CONFLICT (task_id) DO NOTHING
RETURNING true`

// outcomeArgs is the number of insertOutcomeSQL's parameters.
const outcomeArgs = 20

// commitOutcomeSQL inserts the outcome and, only when it is new, the
// messages; it answers whether the outcome is new. The statement is its
// own transaction.
var commitOutcomeSQL = `WITH o AS (` + insertOutcomeSQL + `), q AS (` +
	database.OutboxInsertSQL(outcomeArgs+1, `EXISTS (SELECT 1 FROM o)`) + `)
SELECT EXISTS (SELECT 1 FROM o)`

// commitOutcomeDirectSQL is commitOutcomeSQL with the messages inserted for
// publish on commit; it also answers their rows' ids and leases.
var commitOutcomeDirectSQL = `WITH o AS (` + insertOutcomeSQL + `), q AS (` +
	database.DirectInsertSQL(outcomeArgs+1, `EXISTS (SELECT 1 FROM o)`) + `)
SELECT EXISTS (SELECT 1 FROM o), coalesce(array_agg(q.id), '{}'), coalesce(array_agg(q.leased), '{}') FROM q`

// commitOutcome writes an entry with an outcome and no dead letters in one
// statement, grouped with those of other lanes committing at the same
// time (see group).
func (l *Ledger) commitOutcome(ctx context.Context, e Entry) (Committed, error) {
	args, err := outcomeRow(e.Source, e.Outcome)
	if err != nil {
		return Committed{}, err
	}
	p := &pending{ctx: ctx, taskID: e.Outcome.Result.TaskID, wake: make(chan bool, 1)}
	var msgs []any
	if l.direct != nil {
		msgs, p.rows, err = l.direct.Prepare(ctx, e.Messages)
	} else {
		msgs, err = database.OutboxArgs(ctx, e.Messages)
	}
	if err != nil {
		return Committed{}, err
	}
	p.args = append(args, msgs...)
	if err := l.group.commit(p, l.commitGroup); err != nil {
		return Committed{}, err
	}
	l.direct.Committed(p.rows)
	return Committed{Done: !p.fresh}, nil
}

// pending is one entry waiting in the group.
type pending struct {
	ctx    context.Context
	taskID string
	args   []any
	// rows are the messages' outbox rows for publish on commit (nil
	// without a Direct), and ids and leased their statement's answer.
	rows   *database.DirectRows
	ids    []int64
	leased []bool
	// fresh and err are the entry's result, set before done is signalled.
	fresh bool
	err   error
	// wake says done (false) or lead the next group (true).
	wake chan bool
}

// group is an opportunistic group commit of one-statement entries: an
// entry that finds no commit in flight commits at once (alone: a group of
// one); entries arriving while one is in flight queue up and, when it
// ends, the first of them commits them all in one transaction. No entry
// waits for a timer, only for the commit in flight. Each caller gets its
// own entry's result.
type group struct {
	mu      sync.Mutex
	queue   []*pending
	running bool
}

// commit commits p, alone or with the entries queued with it, through run,
// and returns p's error.
func (g *group) commit(p *pending, run func([]*pending)) error {
	g.mu.Lock()
	g.queue = append(g.queue, p)
	lead := !g.running
	g.running = true
	g.mu.Unlock()
	if !lead {
		if lead = <-p.wake; !lead {
			return p.err
		}
	}
	g.mu.Lock()
	batch := g.queue
	g.queue = nil
	g.mu.Unlock()
	run(batch)
	g.mu.Lock()
	if len(g.queue) > 0 {
		g.queue[0].wake <- true // the next group's leader
	} else {
		g.running = false
	}
	g.mu.Unlock()
	for _, q := range batch {
		if q != p {
			q.wake <- false
		}
	}
	return p.err
}

// commitGroup commits the entries of one group: one entry in its own
// statement; several in one transaction of one round trip (BEGIN, each
// entry's statement, COMMIT, pipelined). When that transaction fails, each
// entry is committed on its own, so that one bad entry fails only itself.
func (l *Ledger) commitGroup(batch []*pending) {
	if len(batch) > 1 {
		err := l.commitTogether(batch)
		if err == nil {
			return
		}
		for _, p := range batch {
			l.direct.Abandon(p.rows) // should its COMMIT have taken effect after all
		}
	}
	for _, p := range batch {
		p.fresh, p.err = false, nil
		if err := l.pool.QueryRow(p.ctx, l.commitOutcomeSQL(), p.args...).Scan(p.dest()...); err != nil {
			p.err = fmt.Errorf("insert outcome of %s: %w", p.taskID, err)
			l.direct.Abandon(p.rows)
			continue
		}
		p.err = p.answer()
	}
}

// commitOutcomeSQL is the statement of a one-statement entry.
func (l *Ledger) commitOutcomeSQL() string {
	if l.direct != nil {
		return commitOutcomeDirectSQL
	}
	return commitOutcomeSQL
}

// dest is where the entry's statement answers: whether the outcome is
// new, and with publish on commit the outbox rows' ids and leases.
func (p *pending) dest() []any {
	if p.rows == nil {
		return []any{&p.fresh}
	}
	p.ids, p.leased = nil, nil
	return []any{&p.fresh, &p.ids, &p.leased}
}

// answer hands the statement's answer to the entry's outbox rows.
func (p *pending) answer() error {
	if p.rows == nil {
		return nil
	}
	return p.rows.Answer(p.ids, p.leased)
}

// commitTogether commits batch in one transaction, under the context of
// its first entry (the leader's).
func (l *Ledger) commitTogether(batch []*pending) (err error) {
	ctx := batch[0].ctx
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	for _, p := range batch {
		b.Queue(l.commitOutcomeSQL(), p.args...).QueryRow(func(row pgx.Row) error {
			if err := row.Scan(p.dest()...); err != nil {
				return err
			}
			return p.answer()
		})
	}
	b.Queue("COMMIT")
	if err := conn.SendBatch(ctx, b).Close(); err != nil {
		database.Rollback(conn.Conn())
		return err
	}
	return nil
}

// commitTx writes any entry in one transaction of two pipelined round
// trips on one connection.
func (l *Ledger) commitTx(ctx context.Context, e Entry) (_ Committed, err error) {
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return Committed{}, err
	}
	defer conn.Release()
	open := false // a transaction is (or may be) open on conn
	defer func() {
		if err != nil && open {
			database.Rollback(conn.Conn())
		}
	}()

	var out Committed
	fresh := true
	var msgs []bus.Message
	first := &pgx.Batch{}
	first.Queue("BEGIN")
	if e.Outcome != nil {
		args, err := outcomeRow(e.Source, e.Outcome)
		if err != nil {
			return Committed{}, err
		}
		first.Queue(insertOutcomeSQL, args...).QueryRow(func(row pgx.Row) error {
			err := row.Scan(&fresh)
			if errors.Is(err, pgx.ErrNoRows) {
				fresh, err = false, nil
			}
			if err != nil {
				return fmt.Errorf("insert outcome of %s: %w", e.Outcome.Result.TaskID, err)
			}
			return nil
		})
	}
	for _, d := range e.DeadLetters {
		src := e.Source
		d.Payload, d.Topic, d.Partition, d.Offset, d.RecordTime = src.Payload, src.Topic, src.Partition, src.Offset, src.Time
		err := l.dl.QueueInsert(first, d, func(d deadletter.DeadLetter, added bool) error {
			if !added {
				return nil // this record's slot is already recorded
			}
			m, err := deadletter.Message(d)
			if err != nil {
				return err
			}
			msgs = append(msgs, m)
			out.DeadLetters = append(out.DeadLetters, d)
			return nil
		})
		if err != nil {
			return Committed{}, err
		}
	}
	open = true
	if err := conn.SendBatch(ctx, first).Close(); err != nil {
		return Committed{}, err
	}

	second := &pgx.Batch{}
	end := "COMMIT"
	if e.Outcome != nil {
		out.Done = !fresh
		if !fresh && e.DropIfDone {
			out, end, msgs = Committed{Done: true}, "ROLLBACK", nil
		}
	}
	if fresh {
		msgs = append(msgs, e.Messages...)
	}
	rows, err := l.direct.EnqueueBatch(ctx, second, msgs)
	if err != nil {
		return Committed{}, err
	}
	second.Queue(end)
	err = conn.SendBatch(ctx, second).Close()
	l.direct.Settle(rows, err)
	if err != nil {
		return Committed{}, err
	}
	open = false
	return out, nil
}

// outcomeRow returns insertOutcomeSQL's arguments for o.
func outcomeRow(src Source, o *Outcome) ([]any, error) {
	r := o.Result
	body, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("encode result: %w", err)
	}
	var k [5]int
	for _, g := range r.Groups {
		k[0] += g.Stored
		k[1] += g.Existing
		k[2] += g.Skipped
		k[3] += g.DeadLettered
		k[4] += g.Failed
	}
	return []any{r.TaskID, r.ResultID, r.EngineID, r.RequestID, r.Status,
		o.Groups["stored"], o.Groups["existing"], o.Groups["skipped"], o.Groups["dead_lettered"], o.Groups["failed"],
		k[0], k[1], k[2], k[3], k[4], r.Bytes, src.Topic, src.Partition, src.Offset, body}, nil
}
