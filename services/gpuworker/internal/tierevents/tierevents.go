// Package tierevents announces the blocks the capacity tier (pkg/kvtier)
// has stored in its bucket: every key a tier writer confirms
// ((*kvtier.Tier).OnStored) becomes a vLLM BlockStored event of medium
// STORAGE and locality REMOTE on kvmesh.kv.events, published the way the
// sender's removal watcher (services/sender/internal/evictions) publishes
// its BlockRemoved events: per namespace, in batches, retried with backoff.
//
// The tier knows only the keys, not the tokens, parents or LoRA of the
// blocks, so each key becomes vLLM's own "placeholder" BlockStored, the
// event vLLM's offloading connector emits for a stored key it has no
// metadata for (vllm/distributed/kv_transfer/kv_connector/v1/offloading/
// events.py, _placeholder_stored): one event per block, block_hashes the
// block's one hash, parent_block_hash nil, token_ids empty, block_size 0,
// lora_id and lora_name nil, medium STORAGE, the block's group_idx,
// locality REMOTE. Each event stands alone (no parent), so the order in
// which the tier's writers confirm keys does not matter.
//
// A block a load promotes from the bucket back into Redis
// ((*kvtier.Tier).OnPromoted) is announced the same way in Redis's medium
// (CPU, contract.MediumStore), so a router that indexes media sees it in
// Redis again; the two media's keys are batched apart.
//
// Announcing is best effort and never slows the tier: OnStored only puts
// the key on a bounded queue; a key that finds it full is counted
// (kvmesh_gpuworker_tier_events_dropped_total{reason="queue_full"}) and
// not announced, and so is a key that is not a store key
// (reason="unparsable") and a batch that could not be published before
// shutdown (reason="publish_failed").
package tierevents

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/retry"
	"github.com/kvmesh/kvmesh/pkg/telemetry"
)

// Defaults of Options.
const (
	// DefaultMaxBatch bounds the keys of one namespace waiting to be
	// published, and the events of one record.
	DefaultMaxBatch = 256
	// DefaultFlushEvery is how long confirmed keys wait to be published
	// together.
	DefaultFlushEvery = 200 * time.Millisecond
	// DefaultQueue bounds the keys handed over by the tier and not yet
	// batched.
	DefaultQueue = 1 << 16
)

// DefaultBackoff spaces the retries of a failed publish: 100 ms doubling
// to 10 s, as the removal watcher's.
var DefaultBackoff = retry.Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second, Jitter: 0.2}

// finalFlushTimeout bounds publishing the last batches at shutdown.
const finalFlushTimeout = 5 * time.Second

// Reasons of kvmesh_gpuworker_tier_events_dropped_total.
const (
	// DropQueueFull is a key that found the queue full.
	DropQueueFull = "queue_full"
	// DropUnparsable is a key that is not a store key (kvcore.ParseKey).
	DropUnparsable = "unparsable"
	// DropPublishFailed is a block whose record could not be encoded or
	// published before shutdown.
	DropPublishFailed = "publish_failed"
)

// ErrOptions reports Options that cannot work.
var ErrOptions = errors.New("tierevents: invalid options")

// Publisher publishes records; *bus.Producer is one.
type Publisher interface {
	Publish(ctx context.Context, msgs ...bus.Message) error
}

// Options configures an Announcer.
type Options struct {
	// Publisher publishes the records (the gpuworker's producer); required.
	Publisher Publisher
	// Registry receives the announcer's counters (nil: not registered).
	Registry prometheus.Registerer
	// Form is the wire form of the records' batches (contract.KVEventForm;
	// "" is the map form, the only one that carries locality).
	Form contract.KVEventForm
	// MaxBatch is how many keys of one namespace are published at once,
	// and the most events of one record (default DefaultMaxBatch).
	MaxBatch int
	// FlushEvery is how long a key waits for others before the pending
	// keys are published (default DefaultFlushEvery).
	FlushEvery time.Duration
	// Queue bounds the keys handed over and not yet batched (default
	// DefaultQueue); a key past it is dropped and counted.
	Queue int
	// Backoff spaces the retries of a failed publish (default
	// DefaultBackoff).
	Backoff retry.Backoff
	// Logger receives publish failures (default slog.Default()).
	Logger *slog.Logger
	// Now is the clock of the batches' timestamps (default time.Now).
	Now func() time.Time
}

func (o Options) withDefaults() Options {
	if o.Form == "" {
		o.Form = contract.KVEventFormMap
	}
	if o.MaxBatch <= 0 {
		o.MaxBatch = DefaultMaxBatch
	}
	if o.FlushEvery <= 0 {
		o.FlushEvery = DefaultFlushEvery
	}
	if o.Queue <= 0 {
		o.Queue = DefaultQueue
	}
	if o.Backoff.Initial <= 0 {
		o.Backoff = DefaultBackoff
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return o
}

// Announcer turns the keys the tier confirms into BlockStored events.
// Stored may be called from any goroutine; Run it once.
type Announcer struct {
	opts      Options
	queue     chan item
	published *prometheus.CounterVec
	dropped   *prometheus.CounterVec
	// finalTimeout bounds the last flush (finalFlushTimeout; tests shorten it).
	finalTimeout time.Duration

	// The batches, owned by Run's goroutine.
	pending map[batchKey]*batch
	order   []batchKey // batches in the order their first key came
}

// item is one key handed over, with the medium it is announced in.
type item struct {
	key, medium string
}

// batchKey names a batch: the keys of one namespace in one medium.
type batchKey struct {
	ns, medium string
}

// batch is the pending keys of one namespace in one medium.
type batch struct {
	model, fingerprint, tenant string
	group                      int
	hashes                     []string // hex, as in the keys
	wire                       []uint64 // contract.WireHash of each
}

// New checks opts and makes an Announcer, registering its counters.
func New(opts Options) (*Announcer, error) {
	if opts.Publisher == nil {
		return nil, fmt.Errorf("publisher is required: %w", ErrOptions)
	}
	if err := opts.Form.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrOptions, err)
	}
	opts = opts.withDefaults()
	a := &Announcer{
		opts:  opts,
		queue: make(chan item, opts.Queue),
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_tier_events_published_total",
			Help: "Blocks announced as placeholder BlockStored events on " + contract.TopicKVEvents + ", by medium: STORAGE (stored in the capacity tier), CPU (promoted from it back into Redis).",
		}, []string{"medium"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvmesh_gpuworker_tier_events_dropped_total",
			Help: "Blocks of the capacity tier (stored in it, or promoted from it into Redis) that were not announced, by reason: queue_full (the announcer's queue was full), unparsable (not a store key), publish_failed (not published before shutdown, or not encodable).",
		}, []string{"reason"}),
		finalTimeout: finalFlushTimeout,
		pending:      map[batchKey]*batch{},
	}
	for _, r := range []string{DropQueueFull, DropUnparsable, DropPublishFailed} {
		a.dropped.WithLabelValues(r)
	}
	for _, m := range []string{contract.MediumTier, contract.MediumStore} {
		a.published.WithLabelValues(m)
	}
	if opts.Registry != nil {
		var err error
		if a.published, err = telemetry.RegisterOnce(opts.Registry, a.published); err != nil {
			return nil, err
		}
		if a.dropped, err = telemetry.RegisterOnce(opts.Registry, a.dropped); err != nil {
			return nil, err
		}
	}
	return a, nil
}

// Stored hands over one key the tier has stored: the callback for
// (*kvtier.Tier).OnStored. It never blocks: a key that finds the queue
// full is counted dropped (queue_full) and not announced.
func (a *Announcer) Stored(key string) { a.hand(item{key: key, medium: contract.MediumTier}) }

// Promoted hands over keys the tier has promoted from its bucket back into
// Redis: the callback for (*kvtier.Tier).OnPromoted. Each becomes a
// placeholder BlockStored of medium CPU (Redis's, contract.MediumStore),
// so a router that indexes media sees the block in Redis again. It never
// blocks, as Stored.
func (a *Announcer) Promoted(keys []string) {
	for _, k := range keys {
		a.hand(item{key: k, medium: contract.MediumStore})
	}
}

// hand queues it, or counts it dropped (queue_full) when the queue is full.
func (a *Announcer) hand(it item) {
	select {
	case a.queue <- it:
	default:
		a.dropped.WithLabelValues(DropQueueFull).Inc()
	}
}

// Run batches the handed-over keys and publishes them until ctx ends: when
// a namespace has MaxBatch keys pending, or FlushEvery after the first
// pending key. When ctx ends it publishes what is queued and pending, for
// up to 5 s, and returns nil. A publish that fails is retried with backoff
// while ctx lasts (keys handed over meanwhile wait in the queue, and are
// dropped once it is full); Run never stops the gpuworker.
func (a *Announcer) Run(ctx context.Context) error {
	timer := time.NewTimer(a.opts.FlushEvery)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			a.drain()
			final, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.finalTimeout)
			a.flush(final, true)
			cancel()
			return nil
		case it := <-a.queue:
			first := len(a.order) == 0
			full := a.add(it)
			if full {
				timer.Stop()
				a.flush(ctx, false)
			} else if first && len(a.order) > 0 {
				timer.Reset(a.opts.FlushEvery)
			}
		case <-timer.C:
			a.flush(ctx, false)
		}
	}
}

// drain batches every key queued now.
func (a *Announcer) drain() {
	for {
		select {
		case it := <-a.queue:
			a.add(it)
		default:
			return
		}
	}
}

// add puts it into the batch of its namespace and medium, or counts it
// unparsable. It reports whether that batch now holds MaxBatch keys.
func (a *Announcer) add(it item) bool {
	key := it.key
	ns, hx, ok := kvcore.SplitKey(key)
	if !ok {
		a.unparsable(key, errors.New("no '@' before a block hash"))
		return false
	}
	p, err := kvcore.ParseKey(key)
	if err != nil {
		a.unparsable(key, err)
		return false
	}
	bk := batchKey{ns: ns, medium: it.medium}
	b := a.pending[bk]
	if b == nil {
		b = &batch{model: p.Model, fingerprint: p.Fingerprint, tenant: p.Tenant, group: p.Group}
		a.pending[bk] = b
		a.order = append(a.order, bk)
	}
	b.hashes = append(b.hashes, hx)
	b.wire = append(b.wire, contract.WireHash(p.Hash))
	return len(b.hashes) >= a.opts.MaxBatch
}

func (a *Announcer) unparsable(key string, err error) {
	a.dropped.WithLabelValues(DropUnparsable).Inc()
	a.opts.Logger.Debug("object tier stored a key that is not a store key; not announced", "key", key, "err", err)
}

// flush publishes every pending batch, at most MaxBatch events a record,
// and empties the batches. A publish that fails because ctx ended keeps
// them for the final flush, unless this is it (final): then they are
// counted dropped (publish_failed).
func (a *Announcer) flush(ctx context.Context, final bool) {
	if len(a.order) == 0 {
		return
	}
	recs := a.records(a.opts.Now())
	msgs := make([]bus.Message, 0, len(recs))
	blocks, byMedium := 0, map[string]int{}
	for _, r := range recs {
		m, err := bus.KVEventMessage(r, a.opts.Form)
		if err != nil { // cannot happen for records built from parsed keys
			a.dropped.WithLabelValues(DropPublishFailed).Add(float64(len(r.Hashes)))
			a.opts.Logger.Error("cannot encode BlockStored events of the object tier; not announced", "namespace", r.Namespace, "err", err)
			continue
		}
		msgs = append(msgs, m)
		blocks += len(r.Hashes)
		byMedium[*r.Batch.Events[0].Medium] += len(r.Hashes)
	}
	if err := a.publish(ctx, msgs); err != nil {
		if !final {
			return // ctx ended: the final flush tries again
		}
		a.dropped.WithLabelValues(DropPublishFailed).Add(float64(blocks))
		a.opts.Logger.Warn("BlockStored events of the object tier not published before shutdown", "blocks", blocks, "err", err)
	} else {
		for medium, n := range byMedium {
			a.published.WithLabelValues(medium).Add(float64(n))
		}
	}
	clear(a.pending)
	a.order = a.order[:0]
}

// records are the pending batches as records, namespace by namespace in
// the order their first key came, each of at most MaxBatch blocks.
func (a *Announcer) records(now time.Time) []contract.KVEventRecord {
	ts := contract.UnixSeconds(now)
	var recs []contract.KVEventRecord
	for _, bk := range a.order {
		b := a.pending[bk]
		for start := 0; start < len(b.hashes); start += a.opts.MaxBatch {
			end := min(start+a.opts.MaxBatch, len(b.hashes))
			events := make([]contract.KVEvent, 0, end-start)
			for _, h := range b.wire[start:end] {
				events = append(events, placeholderStored(h, b.group, bk.medium))
			}
			recs = append(recs, contract.KVEventRecord{
				Batch: contract.KVEventBatch{TS: ts, DataParallelRank: new(int), Events: events},
				Model: b.model, Fingerprint: b.fingerprint, Namespace: bk.ns, Hashes: b.hashes[start:end:end],
				Tenant: b.tenant,
			})
		}
	}
	return recs
}

// placeholderStored is vLLM's placeholder BlockStored of one block of
// group (offloading/events.py, _placeholder_stored): the hash alone,
// no parent, no tokens, block size 0, no LoRA, in medium, REMOTE.
func placeholderStored(hash uint64, group int, medium string) contract.KVEvent {
	locality := contract.LocalityStore
	return contract.KVEvent{
		Kind: contract.BlockStored, BlockHashes: []uint64{hash}, ParentBlockHash: nil,
		TokenIDs: []uint32{}, BlockSize: 0, LoraID: nil, Medium: &medium, LoraName: nil,
		GroupIdx: &group, Locality: &locality,
	}
}

// publish publishes msgs, retrying with backoff until ctx ends.
func (a *Announcer) publish(ctx context.Context, msgs []bus.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	_, err := retry.Do(ctx, a.opts.Backoff, func() (struct{}, error) {
		return struct{}{}, a.opts.Publisher.Publish(ctx, msgs...)
	}, func(err error, d time.Duration) {
		a.opts.Logger.Warn("publishing BlockStored events of the object tier failed; retrying", "err", err, "delay", d)
	})
	if err != nil {
		return fmt.Errorf("publish kv events: %w", err)
	}
	return nil
}
