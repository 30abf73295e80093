// Package ledger is the scheduler's PostgreSQL state: one row per request
// (table trackers, with its hash chain and block tables in the write-once
// segment tables tracker_hashes and tracker_blocks) and the ids of the
// records already applied (table processed_records). ApplyBatch runs a
// batch of records in one transaction — idempotency check, row locks,
// state updates and outbox rows together, set-based — so a crash at any
// point either applied the records with their tasks or not at all.
package ledger

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/scheduler/requeststate"
)

// Record kinds in processed_records.
const (
	KindStep     = "step"
	KindDecision = "decision"
	KindResult   = "result"
	// KindLoadExpiry is the scheduler's own unit that gives up on the
	// silent ranks of overdue multi-rank loads (Overdue.Record).
	KindLoadExpiry = "load_expiry"
)

// DefaultLoadRankTimeout is how long a multi-rank load waits for all its
// ranks' results unless WithLoadRankTimeout says otherwise.
const DefaultLoadRankTimeout = 30 * time.Second

// ErrNotFound reports a request the ledger has no row for.
var ErrNotFound = errors.New("ledger: request not found")

// Status says what Apply did with a record.
type Status string

// Apply outcomes.
const (
	// Applied: the change was committed.
	Applied Status = "applied"
	// Duplicate: the record id was applied before; nothing changed.
	Duplicate Status = "duplicate"
	// NoRequest: there is no row for the request and the record may not
	// create one; the record id was recorded, nothing else changed.
	NoRequest Status = "no_request"
)

// Record identifies one consumed record.
type Record struct {
	// Kind is KindStep, KindDecision or KindResult.
	Kind string
	// ID is the record's step, decision or result id (unique per engine
	// for a step, per request otherwise).
	ID string
	// EngineID names the engine; RequestID the request ("" for a step).
	EngineID, RequestID string
	// Create lets the record start a request that has no row yet.
	Create bool
}

// ApplyFunc changes a locked request and returns the messages to enqueue.
// An error rolls the transaction back and is returned by Apply.
type ApplyFunc func(req *requeststate.Request) ([]bus.Message, error)

// Ledger reads and writes the scheduler's tables.
type Ledger struct {
	pool        *pgxpool.Pool
	model       *kvcore.Model
	models      *kvcore.Models // nil: model only
	cache       *partsCache
	loadTimeout time.Duration
	// direct publishes the outbox rows of committed batches (nil: the
	// relays do).
	direct *database.Direct
	// fold reshapes a transaction's messages before they are enqueued
	// (WithFold; nil: as they are).
	fold func([]bus.Message) []bus.Message
	// fresh is the stored form of a new request's row (freshRow), the
	// same for every row created: encoded once.
	fresh struct {
		once                          sync.Once
		state, tracker, extras, parts string
		err                           error
	}
}

// freshRow returns the columns of a new request's row: its state, tracker,
// extras and parts.
func (l *Ledger) freshRow() (state, tracker, extras, parts string, err error) {
	f := &l.fresh
	f.once.Do(func() {
		req := requeststate.New(l.model, "", "")
		tb, xb, err := smallJSON(req, &PartsMeta{})
		if err != nil {
			f.err = err
			return
		}
		pb, err := jsonMarshal(PartsMeta{})
		if err != nil {
			f.err = err
			return
		}
		f.state, f.tracker, f.extras, f.parts = string(req.State()), string(tb), string(xb), string(pb)
	})
	return f.state, f.tracker, f.extras, f.parts, f.err
}

// Option configures a Ledger.
type Option func(*Ledger)

// WithLoadRankTimeout sets how long after a multi-rank load is first
// stored its ranks are given up on (its requeststate.LoadWait deadline); d <= 0
// keeps DefaultLoadRankTimeout.
func WithLoadRankTimeout(d time.Duration) Option {
	return func(l *Ledger) {
		if d > 0 {
			l.loadTimeout = d
		}
	}
}

// WithDirect has the ledger enqueue its messages for publish on commit
// through d (whose Run must run), instead of leaving them to the relays.
// Messages copied into the outbox (database.CopyThreshold) stay the
// relays'.
func WithDirect(d *database.Direct) Option {
	return func(l *Ledger) { l.direct = d }
}

// WithFold has the ledger pass all the messages of each transaction, in
// the order its changes emitted them, through fold before it enqueues
// them (the scheduler joins each engine's feedback into one record,
// intake.FoldFeedback). fold must keep the order of the messages of each
// (topic, key).
func WithFold(fold func([]bus.Message) []bus.Message) Option {
	return func(l *Ledger) { l.fold = fold }
}

// folded is msgs through the ledger's fold, if it has one.
func (l *Ledger) folded(msgs []bus.Message) []bus.Message {
	if l.fold == nil || len(msgs) == 0 {
		return msgs
	}
	return l.fold(msgs)
}

// New returns a ledger on pool for requests of model m (the default; see
// WithModels for more).
func New(pool *pgxpool.Pool, m *kvcore.Model, opts ...Option) *Ledger {
	l := &Ledger{pool: pool, model: m, cache: newPartsCache(DefaultPartsCacheEntries), loadTimeout: DefaultLoadRankTimeout}
	for _, o := range opts {
		o(l)
	}
	return l
}

// WithModels serves every model of models (its default the ledger's
// model): each request is driven with its own model's layout.
func WithModels(models *kvcore.Models) Option {
	return func(l *Ledger) { l.models = models }
}

// modelFor is the model to apply ev to req with. A fresh request (created
// with the default model before any event said which) is laid out for
// the served model its first engine event or decision names; otherwise
// the request's own model. A model not served (or no longer) gives the
// default, with which the state machine fails the request closed
// (another model than the event's or the tracker's).
func (l *Ledger) modelFor(req *requeststate.Request, ev requeststate.Event) *kvcore.Model {
	if l.models == nil {
		return l.model
	}
	if name := requeststate.ModelOf(ev); name != "" && name != req.Store.Model {
		if m, err := l.models.Get(name); err == nil && req.Relayout(m) {
			return m
		}
	}
	if m, err := l.models.Get(req.Store.Model); err == nil {
		return m
	}
	return l.model
}

// Apply applies one record changing one request (rec.RequestID, which
// rec.Create lets it create) in one transaction; see ApplyBatch.
func (l *Ledger) Apply(ctx context.Context, rec Record, fn ApplyFunc) (Status, error) {
	st, err := l.ApplyBatch(ctx, []Unit{{Record: rec, Changes: []Change{{RequestID: rec.RequestID, Create: rec.Create, Apply: fn}}}})
	if err != nil {
		return "", err
	}
	return st[0], nil
}

// decode rebuilds a request from its row.
func decode(tracker, extras []byte, lastSeq int64) (*requeststate.Request, error) {
	t, err := requeststate.UnmarshalTracker(tracker)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	req := &requeststate.Request{Store: t, LastSeq: lastSeq}
	x, err := requeststate.UnmarshalExtras(extras)
	if err != nil {
		return nil, fmt.Errorf("ledger: decode extras of %s/%s: %w", t.EngineID, t.RequestID, err)
	}
	req.Extras = x
	return req, nil
}

// interval renders d as microseconds for "$n * interval '1 microsecond'".
func interval(d time.Duration) int64 { return d.Microseconds() }
