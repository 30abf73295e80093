package kvtier

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// Defaults for Options fields left at zero.
const (
	// DefaultQueueBytes bounds the values waiting to be written behind.
	DefaultQueueBytes = 256 << 20
	// DefaultWriters is how many objects are written at once.
	DefaultWriters = 8
	// DefaultReaders is how many objects one batch reads or confirms at once.
	DefaultReaders = 16
	// DefaultPromoteDelay bounds how long a promotion waits for loads.
	DefaultPromoteDelay = 2 * time.Second
)

// Options tune a Tier.
type Options struct {
	// QueueBytes bounds the value bytes waiting to be written behind
	// (default DefaultQueueBytes); a stored block that does not fit is not
	// copied (counted dropped; Redis still holds it).
	QueueBytes int64
	// Writers is how many objects are written at once (default DefaultWriters).
	Writers int
	// Readers is how many objects one batch reads or confirms at once
	// (default DefaultReaders).
	Readers int
	// NoPromote leaves blocks read from the bucket out of Redis.
	NoPromote bool
	// PromoteDelay bounds how long a promotion waits for the loads in
	// progress to end (default DefaultPromoteDelay).
	PromoteDelay time.Duration
	// Log receives the tier's warnings (default slog.Default()).
	Log *slog.Logger
}

func (o Options) withDefaults() Options {
	if o.QueueBytes <= 0 {
		o.QueueBytes = DefaultQueueBytes
	}
	if o.Writers <= 0 {
		o.Writers = DefaultWriters
	}
	if o.Readers <= 0 {
		o.Readers = DefaultReaders
	}
	if o.PromoteDelay <= 0 {
		o.PromoteDelay = DefaultPromoteDelay
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	return o
}

// Tier is a kvstore.Store of two tiers: hot (Redis) over the bucket.
//
//   - Put stores in hot, then queues a copy of every stored value to be
//     written behind into the bucket (the put returns at Redis's pace).
//   - Exists asks hot, then confirms each key hot does not hold in the
//     bucket (HEAD: the object is whole, because S3 shows an object only
//     once its PUT completes, and its metadata names the key). An object
//     that cannot be confirmed counts absent.
//   - GetEach reads each key hot does not hold from the bucket and hands it
//     to the caller's check; a value the check accepts is promoted into
//     hot (in the background), one it refuses is the key's error, never
//     served, and its object is removed.
//   - Remove removes from both.
//
// Close stops the write-behind (draining it for up to 10 s) and closes
// hot.
type Tier struct {
	hot  kvstore.Store
	obj  *Objects
	m    *Metrics
	opts Options

	mu      sync.Mutex
	closed  bool
	queued  map[string]int      // keys queued or being written, and how often
	removed map[string]struct{} // of those, keys removed since they were queued
	queue   chan job
	pending atomic.Int64 // bytes queued or being written
	// promoting is the bytes being promoted into hot, by pwg's goroutines.
	promoting atomic.Int64
	pwg       sync.WaitGroup
	promoteMu sync.Mutex
	// loads tracks the GetEach calls in progress: promotions wait until
	// none is (PromoteDelay at most), so a load keeps the CPU.
	loads  activity
	bufs   buffers
	wg     sync.WaitGroup
	stop   context.CancelFunc
	stored atomic.Pointer[func(key string)]
	// promoted is OnPromoted's callback.
	promoted atomic.Pointer[func(ctx context.Context, keys []string)]
}

// OnStored has every writer call fn with each key whose object it has
// just stored (the object store answered the PUT); fn must not block for
// long (a gpuworker batches the keys into BlockStored events of medium
// STORAGE).
func (t *Tier) OnStored(fn func(key string)) { t.stored.Store(&fn) }

// OnPromoted has each promotion call fn with the keys it has just stored
// in hot (not those hot already held), under the promotion's context; fn
// must not block for long (a gpuworker records their store times and
// announces them as BlockStored events of Redis's medium).
func (t *Tier) OnPromoted(fn func(ctx context.Context, keys []string)) { t.promoted.Store(&fn) }

// job is one value to write behind.
type job struct {
	key   string
	value []byte
}

// New returns a Tier over hot and obj, with its writers running.
func New(hot kvstore.Store, obj *Objects, m *Metrics, opts Options) *Tier {
	opts = opts.withDefaults()
	ctx, stop := context.WithCancel(context.Background())
	t := &Tier{hot: hot, obj: obj, m: m, opts: opts, queue: make(chan job, 1<<16), stop: stop,
		queued: map[string]int{}, removed: map[string]struct{}{}}
	for range opts.Writers {
		t.wg.Add(1)
		go t.write(ctx)
	}
	return t
}

// observe records one object call's latency.
func (t *Tier) observe(op string, start time.Time) {
	t.m.duration.WithLabelValues(op).Observe(time.Since(start).Seconds())
}

// write is one writer: it stores queued values until the queue closes.
func (t *Tier) write(ctx context.Context) {
	defer t.wg.Done()
	for j := range t.queue {
		t.writeOne(ctx, j)
	}
}

// writeOne stores one queued value, unless its key was removed since it
// was queued (then the object is not written, or removed again).
func (t *Tier) writeOne(ctx context.Context, j job) {
	defer t.done(j)
	if t.wasRemoved(j.key) {
		t.bufs.put(j.value)
		return
	}
	start := time.Now()
	err := t.obj.Put(ctx, j.key, j.value)
	t.observe("put", start)
	if err != nil {
		// The buffer is not reused: after a failed request the HTTP
		// transport may still be reading the body.
		t.m.writes.WithLabelValues("failed").Inc()
		t.opts.Log.Warn("object tier write failed; the block stays in Redis only", "key", j.key, "err", err)
		return
	}
	t.bufs.put(j.value)      // the store answered: it has read the whole body
	if t.wasRemoved(j.key) { // removed while it was being written
		_ = t.obj.Remove(ctx, j.key)
		return
	}
	t.m.writes.WithLabelValues("stored").Inc()
	t.m.writeBytes.Add(float64(len(j.value)))
	if fn := t.stored.Load(); fn != nil {
		(*fn)(j.key)
	}
}

// wasRemoved reports whether key was removed since it was queued.
func (t *Tier) wasRemoved(key string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.removed[key]
	return ok
}

// done accounts for a written (or abandoned) job.
func (t *Tier) done(j job) {
	t.mu.Lock()
	if t.queued[j.key]--; t.queued[j.key] <= 0 {
		delete(t.queued, j.key)
		delete(t.removed, j.key)
	}
	t.mu.Unlock()
	t.m.queue.Sub(float64(len(j.value)))
	t.pending.Add(-int64(len(j.value)))
}

// forget marks keys that are queued as removed, so no writer stores them.
func (t *Tier) forget(keys []string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, k := range keys {
		if t.queued[k] > 0 {
			t.removed[k] = struct{}{}
		}
	}
}

// enqueue queues a copy of value to be written behind, unless the queue
// is full or closed (counted dropped). The copy is made before the lock is
// taken: the writers take it too.
func (t *Tier) enqueue(key string, value []byte) {
	n := int64(len(value))
	if t.pending.Add(n) > t.opts.QueueBytes { // reserve the room first
		t.pending.Add(-n)
		t.m.writes.WithLabelValues("dropped").Inc()
		return
	}
	j := job{key: key, value: t.bufs.get(len(value))}
	copy(j.value, value)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		t.pending.Add(-n)
		t.m.writes.WithLabelValues("dropped").Inc()
		return
	}
	select {
	case t.queue <- j:
		t.queued[key]++
		delete(t.removed, key) // stored again after a removal
		t.m.queue.Add(float64(n))
	default:
		t.pending.Add(-n)
		t.m.writes.WithLabelValues("dropped").Inc()
	}
}

// Exists implements kvstore.Store: hot's answer, and for keys hot does not
// hold, the bucket's confirmation: of every such key, or, when ctx carries
// a Prober (WithProber), of those it chooses, round by round.
func (t *Tier) Exists(ctx context.Context, keys []string) ([]bool, error) {
	found, err := t.hot.Exists(ctx, keys)
	if err != nil {
		return nil, err
	}
	pr, _ := ctx.Value(proberKey{}).(Prober)
	if pr == nil {
		var missing []int
		for i, ok := range found {
			if !ok {
				missing = append(missing, i)
			}
		}
		t.confirm(ctx, keys, missing, found)
		return found, nil
	}
	tried := make([]bool, len(keys))
	for range len(keys) + 1 { // each round asks at least one key never asked
		next := pr.Probe(found, tried, DefaultProbeWindow)
		if len(next) == 0 {
			break
		}
		for _, i := range next {
			tried[i] = true
		}
		t.confirm(ctx, keys, next, found)
	}
	return found, nil
}

// confirm asks the bucket about keys[idx...], Readers at a time, and sets
// found for each object it confirms.
func (t *Tier) confirm(ctx context.Context, keys []string, idx []int, found []bool) {
	t.each(ctx, idx, func(ctx context.Context, i int) {
		if found[i] {
			return
		}
		start := time.Now()
		err := t.obj.Head(ctx, keys[i])
		t.observe("head", start)
		switch {
		case err == nil:
			found[i] = true
			t.m.confirms.WithLabelValues("present").Inc()
		case errors.Is(err, ErrNotFound):
			t.m.confirms.WithLabelValues("absent").Inc()
		default:
			t.m.confirms.WithLabelValues("error").Inc()
		}
	})
}

// DefaultProbeWindow is the first round's chunks per full-attention group
// a Prober asks about.
const DefaultProbeWindow = 8

// Prober chooses which keys the bucket is asked about (kvcore.LookupPlan
// is one): found[i] says key i is known present, tried[i] that the bucket
// was asked about it; Probe returns the next keys to ask about, none when
// done.
type Prober interface {
	Probe(found, tried []bool, window int) []int
}

type proberKey struct{}

// WithProber returns ctx carrying p: a Tier's Exists under it asks the
// bucket only about the keys p chooses (a lookup's plan knows which keys
// can still change its hit).
func WithProber(ctx context.Context, p Prober) context.Context {
	return context.WithValue(ctx, proberKey{}, p)
}

// each calls do for every index, Readers at a time.
func (t *Tier) each(ctx context.Context, idx []int, do func(ctx context.Context, i int)) {
	if len(idx) == 0 {
		return
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(t.opts.Readers)
	for _, i := range idx {
		g.Go(func() error { do(gctx, i); return nil })
	}
	_ = g.Wait() // do records its own outcome
}

// Put implements kvstore.Store: hot's put, then a write-behind copy of
// each value hot stored.
func (t *Tier) Put(ctx context.Context, items []kvstore.Item) ([]error, error) {
	errs, err := t.hot.Put(ctx, items)
	if err != nil {
		return nil, err
	}
	for i, e := range errs {
		if e == nil {
			t.enqueue(items[i].Key, items[i].Value)
		}
	}
	return errs, nil
}

// Get implements kvstore.Store: hot's values, and the bucket's for keys hot
// does not hold (not promoted: nothing has checked them).
func (t *Tier) Get(ctx context.Context, keys []string) ([][]byte, []error, error) {
	values, errs, err := t.hot.Get(ctx, keys)
	if err != nil {
		return nil, nil, err
	}
	t.fetch(ctx, keys, notFound(errs), newBuffer, func(i int, f fetched) {
		values[i], errs[i] = f.value, f.err
	})
	return values, errs, nil
}

// fetched is one value read from the bucket, or why not.
type fetched struct {
	value []byte
	err   error
}

// notFound lists the indices whose error is kvstore.ErrNotFound.
func notFound(errs []error) []int {
	var idx []int
	for i, e := range errs {
		if errors.Is(e, kvstore.ErrNotFound) {
			idx = append(idx, i)
		}
	}
	return idx
}

// fetch reads the objects of keys[idx...] from the bucket, Readers at a
// time, each into alloc's buffer, and hands each to visit in idx's order as
// soon as it and those before it are read (visit works on one value while
// the next are read). An absent object keeps the key's ErrNotFound.
func (t *Tier) fetch(ctx context.Context, keys []string, idx []int, alloc func(int) []byte, visit func(i int, f fetched)) {
	if len(idx) == 0 {
		return
	}
	res := make([]chan fetched, len(idx))
	for k := range res {
		res[k] = make(chan fetched, 1)
	}
	var g errgroup.Group
	g.SetLimit(t.opts.Readers)
	go func() { // g.Go waits for a free reader: start them beside the visits
		for k, i := range idx {
			g.Go(func() error { res[k] <- t.read(ctx, keys[i], alloc); return nil })
		}
	}()
	for k, i := range idx {
		visit(i, <-res[k])
	}
	_ = g.Wait() // every read has answered above; read records its own outcome
}

// read reads key's object into alloc's buffer, counting the outcome.
func (t *Tier) read(ctx context.Context, key string, alloc func(int) []byte) fetched {
	start := time.Now()
	v, err := t.obj.read(ctx, key, alloc)
	t.observe("get", start)
	switch {
	case err == nil:
		t.m.readBytes.Add(float64(len(v)))
	case errors.Is(err, ErrNotFound):
		t.m.reads.WithLabelValues("miss").Inc()
		err = fmt.Errorf("%w: %w", kvstore.ErrNotFound, err)
	default:
		t.m.reads.WithLabelValues("error").Inc()
	}
	return fetched{value: v, err: err}
}

// GetEach implements kvstore.ValueVisitor: hot's values through use, then
// the bucket's values of the keys hot does not hold, each through use in
// input order; those use accepts are promoted into hot.
func (t *Tier) GetEach(ctx context.Context, keys []string, use func(i int, value []byte) error) ([]error, error) {
	t.loads.begin()
	defer t.loads.end()
	errs, err := kvstore.GetEach(ctx, t.hot, keys, use)
	if err != nil {
		return nil, err
	}
	idx := notFound(errs)
	var promote []kvstore.Item
	var rejected []string
	// each value is valid only until use returns: its buffer is recycled
	t.fetch(ctx, keys, idx, t.bufs.get, func(i int, f fetched) {
		if f.err != nil {
			errs[i] = f.err
			return
		}
		if err := use(i, f.value); err != nil {
			t.bufs.put(f.value)
			t.m.reads.WithLabelValues("rejected").Inc()
			errs[i] = fmt.Errorf("object tier: %w", err)
			rejected = append(rejected, keys[i])
			return
		}
		t.m.reads.WithLabelValues("hit").Inc()
		countHit(ctx)
		errs[i] = nil
		promote = append(promote, kvstore.Item{Key: keys[i], Value: f.value})
	})
	t.promote(ctx, promote)
	t.quarantine(ctx, rejected)
	return errs, nil
}

// quarantine removes objects the reader's checks refused, so the block
// counts absent from now on and its next save stores a good copy (left in
// place, a bad object would count present and be refused at every load).
func (t *Tier) quarantine(ctx context.Context, keys []string) {
	for _, k := range keys {
		if err := t.obj.Remove(ctx, k); err != nil {
			t.opts.Log.Warn("removing an object the load refused failed", "key", k, "err", err)
			continue
		}
		t.opts.Log.Warn("object tier: removed an object the load refused", "key", k)
	}
}

// promote puts verified values back into hot (without writing them
// behind: the bucket holds them), in the background so the load does not
// wait on Redis, and after the loads in progress (PromoteDelay at most)
// so it does not take their CPU: at most QueueBytes of values are
// promoted at once, and a value that finds no room is not promoted
// (counted failed; the next load reads it from the bucket again). The
// values' buffers are recycled once hot has them.
func (t *Tier) promote(ctx context.Context, items []kvstore.Item) {
	if len(items) == 0 {
		return
	}
	var size int64
	for _, it := range items {
		size += int64(len(it.Value))
	}
	if t.opts.NoPromote {
		t.recycle(items)
		return
	}
	if t.promoting.Add(size) > t.opts.QueueBytes {
		t.promoting.Add(-size)
		t.m.promoted.WithLabelValues("failed").Add(float64(len(items)))
		t.recycle(items)
		return
	}
	t.pwg.Add(1)
	go func() {
		defer t.pwg.Done()
		defer t.promoting.Add(-size)
		defer t.recycle(items)
		t.loads.wait(t.opts.PromoteDelay)
		t.promoteMu.Lock() // one promotion at a time: loads keep the CPU
		defer t.promoteMu.Unlock()
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), t.obj.timeout)
		defer cancel()
		errs, err := t.hot.Put(pctx, items)
		var stored []string
		for i := range items {
			switch {
			case err == nil && errs[i] == nil:
				stored = append(stored, items[i].Key)
				t.m.promoted.WithLabelValues("stored").Inc()
			case err == nil && errors.Is(errs[i], kvstore.ErrExists):
				t.m.promoted.WithLabelValues("stored").Inc()
			default:
				t.m.promoted.WithLabelValues("failed").Inc()
			}
		}
		if fn := t.promoted.Load(); fn != nil && len(stored) > 0 {
			(*fn)(pctx, stored)
		}
	}()
}

// recycle hands the values of items back to the buffers.
func (t *Tier) recycle(items []kvstore.Item) {
	for _, it := range items {
		t.bufs.put(it.Value)
	}
}

// Remove implements kvstore.Store: removes from both tiers; a key either
// held is removed (nil), one neither held is ErrNotFound.
func (t *Tier) Remove(ctx context.Context, keys []string) ([]error, error) {
	t.forget(keys)
	errs, err := t.hot.Remove(ctx, keys)
	if err != nil {
		return nil, err
	}
	idx := make([]int, 0, len(keys))
	seen := make(map[string]bool, len(keys))
	for i, k := range keys {
		if !seen[k] { // a repeat keeps hot's answer: removed by the first
			seen[k] = true
			idx = append(idx, i)
		}
	}
	t.each(ctx, idx, func(ctx context.Context, i int) {
		if !errors.Is(errs[i], kvstore.ErrNotFound) {
			_ = t.obj.Remove(ctx, keys[i]) // removed from hot: the answer is hot's
			return
		}
		if t.obj.Head(ctx, keys[i]) == nil && t.obj.Remove(ctx, keys[i]) == nil {
			errs[i] = nil
		}
	})
	return errs, nil
}

// Ping implements kvstore.Store: hot's ping (the bucket has its own
// readiness check, Objects.Ping).
func (t *Tier) Ping(ctx context.Context) error { return t.hot.Ping(ctx) }

// Drain waits until every queued value is written and every promotion is
// done, or ctx ends.
func (t *Tier) Drain(ctx context.Context) error {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for t.pending.Load() > 0 || t.promoting.Load() > 0 {
		select {
		case <-ctx.Done():
			return fmt.Errorf("object tier: %d bytes not yet written, %d not yet promoted: %w", t.pending.Load(), t.promoting.Load(), ctx.Err())
		case <-tick.C:
		}
	}
	return nil
}

// Close stops taking copies, gives the queued ones up to 10 s to be
// written (those still queued then fail, counted failed: Redis holds
// them), and closes hot. Closing twice is not an error.
func (t *Tier) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return t.hot.Close()
	}
	t.closed = true
	close(t.queue)
	t.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := t.Drain(ctx); err != nil {
		t.opts.Log.Warn("closing the object tier with copies unwritten", "err", err)
		t.stop()
	}
	t.wg.Wait()
	t.pwg.Wait()
	t.stop()
	return t.hot.Close()
}

var (
	_ kvstore.Store        = (*Tier)(nil)
	_ kvstore.ValueVisitor = (*Tier)(nil)
)

// ReadCounts counts, for one caller, the blocks a Tier's GetEach served
// from the bucket (CountReads).
type ReadCounts struct {
	// FromTier is the blocks read from the bucket and accepted.
	FromTier atomic.Int64
}

type countsKey struct{}

// CountReads returns ctx carrying c: a Tier's GetEach under it adds the
// blocks it serves from the bucket to c (a store without a tier adds
// nothing).
func CountReads(ctx context.Context, c *ReadCounts) context.Context {
	return context.WithValue(ctx, countsKey{}, c)
}

// countHit adds one bucket hit to ctx's ReadCounts, if any.
func countHit(ctx context.Context) {
	if c, ok := ctx.Value(countsKey{}).(*ReadCounts); ok {
		c.FromTier.Add(1)
	}
}
