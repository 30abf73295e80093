// Package sending is the sender's sending thread as a Kafka handler: it
// validates each save task per group, dead-letters what cannot be stored,
// checks which keys the store already holds, has the owning gpuworker put
// only the missing ones, and records every outcome durably with the
// messages it publishes, in one transaction.
package sending

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/deadletter"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
	"github.com/kvmesh/kvmesh/pkg/text"
	"github.com/kvmesh/kvmesh/services/sender/internal/ledger"
	"github.com/kvmesh/kvmesh/services/sender/internal/sendpolicy"
)

// Defaults of Options.
const (
	// DefaultStoreTimeout bounds one existence check.
	DefaultStoreTimeout = 5 * time.Second
	// DefaultPutTimeout bounds one put request to a gpuworker.
	DefaultPutTimeout = 30 * time.Second
)

// Sentinel errors.
var (
	// ErrOptions reports Options that cannot work.
	ErrOptions = errors.New("sending: invalid options")
)

// Store is what a Processor asks of the KV store: which keys are present.
// The puts go through the owning gpuworkers (Workers, Putter).
type Store interface {
	// Exists reports, for each key in order, whether it is present.
	Exists(ctx context.Context, keys []string) ([]bool, error)
}

// Quotas keeps the tenants within their quotas in the store.
type Quotas interface {
	// Note records a save of tenant (its usage is shown) and reports
	// whether the tenant has a quota, so that a save of an unlimited
	// tenant costs no more.
	Note(tenant string) (limited bool)
	// Admit says how many of keys, new keys of one save of tenant in
	// order, may be put (the rest are skipped with reason quota), after
	// making room when the tenant's quota evicts; release ends their
	// reservation once their puts are answered.
	Admit(ctx context.Context, tenant string, keys []string) (admitted int, release func())
}

// Outcomes is what a save task's handling needs of the ledger: one
// transaction that records its outcome, its dead letters and the messages
// it publishes (through the outbox), or, for a task whose outcome is
// already recorded, nothing (ledger.Entry.DropIfDone).
type Outcomes interface {
	// Commit writes e in one transaction (ledger.Ledger.Commit).
	Commit(ctx context.Context, e ledger.Entry) (ledger.Committed, error)
}

// DeadLetters is what a replay needs of the ledger: one dead letter, and
// one transaction that records a replay attempt with its messages.
type DeadLetters interface {
	// Get returns dead letter id, or an error wrapping ledger.ErrNotFound.
	Get(ctx context.Context, id int64) (deadletter.DeadLetter, error)
	// RecordReplay records a replay attempt of dead letter id and enqueues
	// msgs, unless the entry was replayed before (applied false; the row as
	// it is).
	RecordReplay(ctx context.Context, id int64, status string, result any, msgs ...bus.Message) (deadletter.DeadLetter, bool, error)
}

// Ledger is the durable record a Processor writes: the save path's
// Outcomes and the replays' DeadLetters.
type Ledger interface {
	Outcomes
	DeadLetters
}

// The production parts satisfy the interfaces.
var (
	_ Ledger = (*ledger.Ledger)(nil)
	_ Store  = kvstore.Store(nil)
	_ Putter = (*dataplane.Client)(nil)
)

// Options configures a Processor.
type Options struct {
	// Model is the default served model; tasks for a model not served are
	// dead-lettered.
	Model *kvcore.Model
	// Keys builds the default model's store keys (deployment prefix, model
	// name and fingerprint).
	Keys kvcore.KeyBuilder
	// Models are every served model (Model first); nil serves Model only.
	// Each task is saved with its model's layout and keys.
	Models *kvcore.Models
	// Store answers the existence checks (a kvstore.Store does).
	Store Store
	// Workers finds the gpuworkers that put blocks.
	Workers Workers
	// Quotas keeps every tenant within its quota (*quotas.Enforcer does);
	// nil admits every save.
	Quotas Quotas
	// Ledger records outcomes, dead letters and outgoing messages, and
	// reads and marks the dead letters a replay handles (*ledger.Ledger
	// does; sendingtest.Ledger is one in memory).
	Ledger Ledger
	// Metrics receives the sender's counters.
	Metrics *Metrics
	// Retry bounds the retries of existence checks and puts.
	Retry sendpolicy.RetryPolicy
	// ProbeEvery and CoolDown tune the probes of a request under store
	// pressure (sendpolicy.PressureGate: pressure is scoped to the request
	// whose put the store answered "no space").
	ProbeEvery int
	CoolDown   time.Duration
	// StoreTimeout bounds one existence check (default DefaultStoreTimeout).
	StoreTimeout time.Duration
	// PutTimeout bounds one put request (default DefaultPutTimeout).
	PutTimeout time.Duration
	// Logger receives dead-letter notices.
	Logger *slog.Logger
	// Now is the clock of the pressure gate (default time.Now).
	Now func() time.Time
	// TracerProvider makes the sender's spans (default the global one).
	TracerProvider trace.TracerProvider
	// KVEventsForm is the wire form of the BlockStored events' batches
	// (contract.KVEventForm; "" is the map form).
	KVEventsForm contract.KVEventForm
	// RecentTasks is how many committed task ids the processor remembers,
	// to skip a task delivered to it again (default DefaultRecentTasks).
	RecentTasks int
}

// Processor handles save tasks. It is safe for concurrent use by several
// consumers of one process and by the lanes of each
// (KVMESH_SENDER_CONCURRENCY): every call keeps its task's state to itself,
// and what calls share (the pressure gate, the metrics, the worker
// registry's cache, the ledger's pool) is locked or safe for concurrent use.
// The consumer hands the tasks of one request (one record key) to one lane,
// so they are handled in order. A task this process committed recently is
// skipped before any work (recentTasks); any other redelivered task is
// saved again (its keys are mostly found present, and every put re-checks
// the block's identity) and recognised at commit by its save_outcomes row,
// keyed by task id, which drops everything it would have added.
type Processor struct {
	models       *kvcore.Models
	store        Store
	workers      Workers
	ledger       Ledger
	metrics      *Metrics
	retry        sendpolicy.RetryPolicy
	storeTimeout time.Duration
	putTimeout   time.Duration
	log          *slog.Logger
	now          func() time.Time
	tracer       trace.Tracer
	form         contract.KVEventForm
	gate         *gate
	quotas       Quotas
	recent       *recentTasks
	skippedKeys  atomic.Int64
	// replayMu serialises replays, so two concurrent replays of one entry
	// do not both save it.
	replayMu sync.Mutex
}

// New checks o and returns a Processor.
func New(o Options) (*Processor, error) {
	if o.Model == nil || o.Store == nil || o.Workers == nil || o.Ledger == nil || o.Metrics == nil {
		return nil, fmt.Errorf("%w: model, store, workers, ledger and metrics are required", ErrOptions)
	}
	if err := o.Model.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrOptions, err)
	}
	if err := o.Keys.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrOptions, err)
	}
	if err := o.KVEventsForm.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrOptions, err)
	}
	if o.Models == nil {
		var err error
		if o.Models, err = kvcore.NewModels(o.Keys.Prefix, o.Model); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrOptions, err)
		}
	}
	for _, name := range o.Models.Names() { // every served model's series exists from the start
		o.Metrics.bytes.WithLabelValues(name)
	}
	p := &Processor{
		models: o.Models, store: o.Store, workers: o.Workers, ledger: o.Ledger,
		metrics: o.Metrics, retry: o.Retry, storeTimeout: o.StoreTimeout, putTimeout: o.PutTimeout,
		log: o.Logger, now: o.Now, form: o.KVEventsForm, quotas: o.Quotas,
		gate: &gate{g: sendpolicy.PressureGate{ProbeEvery: o.ProbeEvery, CoolDown: o.CoolDown}, metrics: o.Metrics},
	}
	if p.storeTimeout <= 0 {
		p.storeTimeout = DefaultStoreTimeout
	}
	if p.putTimeout <= 0 {
		p.putTimeout = DefaultPutTimeout
	}
	if o.RecentTasks <= 0 {
		o.RecentTasks = DefaultRecentTasks
	}
	p.recent = newRecentTasks(o.RecentTasks)
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if p.now == nil {
		p.now = time.Now
	}
	tp := o.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	p.tracer = tp.Tracer("kvmesh/sender")
	return p, nil
}

// Pressure returns the pressure gate's state: Active while some request
// is under pressure.
func (p *Processor) Pressure() PressureState {
	g := p.gate.state()
	return PressureState{Active: g.Active(), Requests: g.UnderPressure(), SkippedTasks: g.Skipped, SkippedKeys: p.skippedKeys.Load(), Episodes: g.Episodes, Released: g.Released}
}

// Handle is the bus.Handler of kvmesh.save.tasks. It returns nil once the
// task's outcome, its dead letters and its messages are committed (or were
// already, for a redelivered task); a database failure is transient. A
// record that is not a save task fails permanently (undecodable): the
// consumer loop hands it to DeadLetter, retrying that until it is recorded.
//
// A task this process committed recently is a duplicate, skipped with no
// store call, put or commit. Any other task is saved and committed; if
// its outcome turns out to be recorded already (a redelivery from another
// process's time on the partition, or one older than the recent set), the
// commit leaves nothing and counts it a duplicate (commit). Asking
// PostgreSQL first would cost every task a round trip for the rare one.
func (p *Processor) Handle(ctx context.Context, m bus.Received) error {
	src := sourceOf(m)
	task, err := decodeTask(m.Value)
	if err != nil {
		return bus.Permanent(kvcore.ReasonUndecodable, err)
	}
	if p.recent.has(task.TaskID) {
		p.metrics.duplicates.Inc()
		return nil
	}
	s := p.newSave(task)
	valid := p.validate(ctx, s)       // the invalid groups are dead-lettered
	p.saveGroups(ctx, s, valid, true) // the pressure gate decides the puts
	if err := ctx.Err(); err != nil {
		return err // interrupted: the record is delivered again
	}
	return bus.Transient(p.commit(ctx, src, s))
}

// decodeTask decodes a save task and checks that its ids can be stored
// and published as they are.
func decodeTask(b []byte) (*kvcore.SaveTask, error) {
	t, err := kvcore.DecodeSaveTask(b)
	if err != nil {
		return nil, err
	}
	for _, f := range []struct{ name, v string }{{"task_id", t.TaskID}, {"engine_id", t.EngineID}, {"request_id", t.RequestID}, {"tenant", t.Tenant}} {
		if !text.PostgresSafe(f.v) {
			return nil, fmt.Errorf("save task: %w: %s %q is not storable text (it contains NUL)", kvcore.ErrInvalidSaveTask, f.name, f.v)
		}
	}
	return t, nil
}

// countDeadLetters counts and logs the dead letters just written, and
// records each as a span of its own ("sender.dead_letter", status error,
// with its reason code, group and id) under the current span, so a trace
// shows which group was dead-lettered and why.
func (p *Processor) countDeadLetters(ctx context.Context, dls []deadletter.DeadLetter) {
	for _, d := range dls {
		attrs := []attribute.KeyValue{
			attribute.String("kvmesh.reason", string(d.Reason)), attribute.String("kvmesh.detail", d.Detail),
			attribute.Int64("kvmesh.dead_letter_id", d.ID), attribute.String("kvmesh.task_id", d.TaskID),
			attribute.String(telemetry.AttrEngineID, d.EngineID), attribute.String(telemetry.AttrRequestID, d.RequestID),
		}
		if d.Group != nil {
			attrs = append(attrs, attribute.Int("kvmesh.group", *d.Group))
		}
		_, span := p.tracer.Start(ctx, "sender.dead_letter", trace.WithAttributes(attrs...))
		span.SetStatus(codes.Error, string(d.Reason))
		span.End()
		p.metrics.deadLetters.WithLabelValues(string(d.Reason)).Inc()
		p.log.Warn("save dead-lettered", "id", d.ID, "reason", d.Reason, "detail", d.Detail, "group", d.Group,
			"task_id", d.TaskID, "engine_id", d.EngineID, "request_id", d.RequestID)
	}
}

// sourceOf describes the record m for the ledger.
func sourceOf(m bus.Received) ledger.Source {
	return ledger.Source{Topic: m.Topic, Partition: m.Partition, Offset: m.Offset, Time: m.Time, Key: m.Key, Payload: m.Value}
}
