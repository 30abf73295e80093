// Package evictions turns the store's own removals into BlockRemoved
// events: it subscribes to Redis keyevent notifications for evicted,
// expired and del (notify-keyspace-events), maps every removed key of the
// deployment's key space to a vLLM BlockRemoved event
// (contract.KVEventRecord) and publishes it to kvmesh.kv.events.
//
// Redis pub/sub is at-most-once: a notification sent while the watcher is
// not subscribed (a reconnect, a failover between sender replicas, a slow
// consumer Redis disconnected) is lost, and so is the BlockRemoved it
// would have become. The watcher counts every such window as a gap
// (kvmesh_sender_evictions_gaps_total) and publishes nothing for it: an
// AllBlocksCleared would wipe a router's whole view of the store for a
// removal of a few keys. FLUSHALL and FLUSHDB send no keyspace event
// (checked on Redis 7.0); the watcher notices them through a marker key
// of its own that vanishes without a notification, and publishes
// AllBlocksCleared for the deployment then. docs/contract.md has the
// router's side of this.
//
// On a Redis Cluster (a redis+cluster:// store URL) notifications are
// node-local: the watcher subscribes on every master, finds the masters
// through the cluster's slot map every Options.TopologyEvery and follows
// topology changes (a promoted replica is subscribed, a master that is no
// more is let go); cluster.go has the details.
package evictions

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/pkg/retry"
)

// Causes of a removal: the Redis keyevent names the watcher subscribes to,
// CauseQuota for a del a tenant quota made, and CauseFlushed for a store
// found flushed. They label
// kvmesh_sender_block_removed_total and fill contract.HeaderKVCause.
const (
	CauseEvicted = "evicted"
	CauseExpired = "expired"
	CauseDeleted = "del"
	CauseFlushed = "flushed"
	// CauseQuota is a del a tenant quota made (the key's quota mark,
	// kvstore.QuotaIndexSuffix, tells it from an operator's).
	CauseQuota = "quota"
)

// causes are the keyevents the watcher subscribes to.
var causes = []string{CauseEvicted, CauseExpired, CauseDeleted}

// Defaults of Options.
const (
	// DefaultFlushEvery is how long removals of one namespace wait to be
	// published together.
	DefaultFlushEvery = 50 * time.Millisecond
	// DefaultMaxBatch bounds the keys of one BlockRemoved record.
	DefaultMaxBatch = 512
	// DefaultMarkerEvery is how often the watcher checks its marker key to
	// notice a flush.
	DefaultMarkerEvery = 2 * time.Second
	// DefaultTopologyEvery is how often the watcher of a Redis Cluster
	// reads the cluster's masters.
	DefaultTopologyEvery = time.Second
)

// DefaultBackoff is the reconnect backoff: 100 ms doubling to 10 s.
var DefaultBackoff = retry.Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second, Jitter: 0.2}

// requiredFlags are the notify-keyspace-events classes the watcher needs:
// E (keyevent channels), g (generic: del), x (expired), e (evicted).
const requiredFlags = "Egxe"

// Sentinel errors.
var (
	// ErrOptions reports Options that cannot work.
	ErrOptions = errors.New("evictions: invalid options")
	// ErrNotifyDisabled reports a Redis server whose notify-keyspace-events
	// lacks what the watcher needs and that the watcher may not or could
	// not change.
	ErrNotifyDisabled = errors.New("evictions: redis keyspace notifications are off")
)

// Recorder keeps the published removals (removals.Log does).
type Recorder interface {
	// Record writes the published records.
	Record(ctx context.Context, recs []contract.KVEventRecord) error
}

// Publisher publishes records; *bus.Producer is one.
type Publisher interface {
	Publish(ctx context.Context, msgs ...bus.Message) error
}

// Leader decides which of several sender replicas watches: Lead blocks
// until this replica leads (or ctx ends) and returns a context that ends
// when it stops leading. A nil Leader leads at once (one replica).
type Leader interface {
	Lead(ctx context.Context) (context.Context, context.CancelFunc, error)
}

// Options configures a Watcher.
type Options struct {
	// RedisURL locates the store pool: a single server
	// (redis://host:port/db), whose database's keyevent channels the
	// watcher listens on, or a Redis Cluster (redis+cluster://host:port,...,
	// see kvstore.IsClusterURL), on whose every master it listens.
	RedisURL string
	// RedisTLS are the CA bundle, client certificate and server name of a
	// rediss:// or rediss+cluster:// RedisURL (the store pool's, as the
	// services configure it).
	RedisTLS kvstore.RedisTLS
	// Keys is the deployment's key space, of its default model: removals
	// of other keys are counted as unmapped and not published, unless
	// Models serves them.
	Keys kvcore.KeyBuilder
	// Models are every model the deployment serves: a removal of a key of
	// any of them is published, with its model and fingerprint. Nil: Keys
	// alone.
	Models *kvcore.Models
	// Publisher publishes the records (the sender's producer).
	Publisher Publisher
	// Metrics receives the watcher's counters.
	Metrics *Metrics
	// Configure lets the watcher add the flags it needs to
	// notify-keyspace-events with CONFIG SET; without it, or when the
	// server refuses, the watcher fails unless they are already set.
	Configure bool
	// Leader picks the one replica that watches (nil: this one).
	Leader Leader
	// Backoff spaces reconnects (default DefaultBackoff).
	Backoff retry.Backoff
	// FlushEvery, MaxBatch, MarkerEvery and TopologyEvery default to
	// DefaultFlushEvery, DefaultMaxBatch, DefaultMarkerEvery and
	// DefaultTopologyEvery; TopologyEvery applies to a cluster only.
	FlushEvery    time.Duration
	MaxBatch      int
	MarkerEvery   time.Duration
	TopologyEvery time.Duration
	// Logger receives reconnects and gaps (default slog.Default()).
	Logger *slog.Logger
	// Now is the clock of the batches' timestamps (default time.Now).
	Now func() time.Time
	// Form is the wire form of the records' batches (contract.KVEventForm;
	// "" is the map form).
	Form contract.KVEventForm
	// Log records every BlockRemoved record published (the sender's
	// removals log, removals.Log), so an operator can ask what left and
	// why. Nil: not recorded. A failed record is logged and counted; the
	// removal is announced either way.
	Log Recorder
	// Times holds the store time of every key the gpuworkers stored
	// (kvstore.StoreTimes: the store pool's own index): each removal
	// takes its key's time from it and says the block's age. Nil: ages
	// are not known.
	Times kvstore.StoreTimes
	// Quotas holds the marks of the keys a tenant quota removed
	// (kvstore.Quotas): such a del is announced with CauseQuota and the
	// age its mark says. Nil: every del is CauseDeleted.
	Quotas QuotaMarks
}

// parseOwn parses key as a key of the deployment: of a served model
// (Options.Models) or of Options.Keys.
func (w *Watcher) parseOwn(key string) (kvcore.KeyParts, bool, error) {
	if w.opts.Models != nil {
		return w.opts.Models.ParseOwn(key)
	}
	return w.opts.Keys.ParseOwn(key)
}

// QuotaMarks tells the keys a tenant quota removed; kvstore.Quotas does.
type QuotaMarks interface {
	// TakeQuotaMarks returns each key's store time from its quota mark,
	// or the zero time for a key no quota removed, and takes the marks.
	TakeQuotaMarks(ctx context.Context, keys []string) ([]time.Time, error)
}

// Watcher publishes the store's removals as BlockRemoved events. Run it once.
type Watcher struct {
	opts Options
	// single is the one server of a single-server store; nil on a cluster.
	single *node
	// cluster is the client of a Redis Cluster store; nil on a single server.
	cluster   *redis.ClusterClient
	ready     chan struct{}
	readyOnce sync.Once
}

// node is one Redis server the watcher subscribes on: the single server,
// or one master of a cluster. Its sessions run one at a time.
type node struct {
	addr   string
	client *redis.Client
	db     int
	// marker is the node's marker key.
	marker string
	// pickMarker, on a cluster, finds the marker key at each session's
	// start: one whose slot the node serves (slots move).
	pickMarker func(ctx context.Context) (string, error)
	// onSubscribed is called each time a session's subscription is confirmed.
	onSubscribed func()
	st           state
}

// New checks opts and makes a Watcher; it connects nothing until Run.
func New(opts Options) (*Watcher, error) {
	if opts.Publisher == nil || opts.Metrics == nil {
		return nil, fmt.Errorf("publisher and metrics are required: %w", ErrOptions)
	}
	if err := opts.Keys.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrOptions, err)
	}
	if err := opts.Form.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrOptions, err)
	}
	opts = opts.withDefaults()
	w := &Watcher{opts: opts, ready: make(chan struct{})}
	if kvstore.IsClusterURL(opts.RedisURL) {
		co, err := kvstore.RedisClusterOptions(opts.RedisURL, kvstore.RedisOptions{TLS: opts.RedisTLS})
		if err != nil {
			return nil, fmt.Errorf("%w: %w", err, ErrOptions)
		}
		w.cluster = redis.NewClusterClient(co)
		return w, nil
	}
	ro, err := kvstore.RedisClientOptions(opts.RedisURL, kvstore.RedisOptions{TLS: opts.RedisTLS})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrOptions)
	}
	w.single = &node{
		addr: ro.Addr, client: redis.NewClient(ro), db: ro.DB, marker: markerKey(opts.Keys),
		onSubscribed: w.markReady,
	}
	return w, nil
}

// withDefaults fills the zero fields of o that have defaults.
func (opts Options) withDefaults() Options {
	if opts.Backoff.Initial <= 0 {
		opts.Backoff = DefaultBackoff
	}
	if opts.FlushEvery <= 0 {
		opts.FlushEvery = DefaultFlushEvery
	}
	if opts.MaxBatch <= 0 {
		opts.MaxBatch = DefaultMaxBatch
	}
	if opts.MarkerEvery <= 0 {
		opts.MarkerEvery = DefaultMarkerEvery
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.TopologyEvery <= 0 {
		opts.TopologyEvery = DefaultTopologyEvery
	}
	return opts
}

// markerKey is the watcher's marker: a key outside the deployment's key
// space, "kvmesh-evictions-marker@[prefix@]model", so that a scan of the
// deployment's keys (prefix@*, model@*) never meets it and it never parses
// as a store key (two or three '@'-separated fields, never seven or eight).
func markerKey(kb kvcore.KeyBuilder) string {
	if kb.Prefix == "" {
		return markerPrefix + kb.Model
	}
	return markerPrefix + kb.Prefix + "@" + kb.Model
}

// markerPrefix begins every watcher's marker key.
const markerPrefix = "kvmesh-evictions-marker@"

// scope is the deployment's scope "[prefix@]model", the namespace of an
// AllBlocksCleared record.
func (w *Watcher) scope() string {
	if w.opts.Keys.Prefix == "" {
		return w.opts.Keys.Model
	}
	return w.opts.Keys.Prefix + "@" + w.opts.Keys.Model
}

// Ready is closed once the watcher is first subscribed: on a cluster, on
// every master of the cluster it found.
func (w *Watcher) Ready() <-chan struct{} { return w.ready }

// markReady closes ready, once.
func (w *Watcher) markReady() { w.readyOnce.Do(func() { close(w.ready) }) }

// started reports whether Ready is closed: the watcher was subscribed (on
// a cluster, on every master it found).
func (w *Watcher) started() bool {
	select {
	case <-w.ready:
		return true
	default:
		return false
	}
}

// Run leads (see Options.Leader), watches and publishes until ctx ends,
// reconnecting with backoff after a lost connection; each reconnect after
// a subscription is a gap. It returns nil when ctx ends, and an error
// wrapping ErrNotifyDisabled when the server's notifications cannot be
// turned on before the first subscription; later, a server that comes back
// without them is retried (and counted as a gap), never a reason to stop
// the sender. An unreachable server is always retried. On a cluster each
// master is watched, retried and counted so on its own (see
// watchCluster), and a leadership handover is one gap.
func (w *Watcher) Run(ctx context.Context) error {
	defer w.close()
	for attempt := 1; ctx.Err() == nil; {
		lead, stop, err := w.lead(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		w.opts.Metrics.leader.Set(1)
		var subscribed bool
		if w.cluster != nil {
			subscribed, err = w.watchCluster(lead)
		} else {
			subscribed, err = w.session(lead, w.single)
		}
		w.opts.Metrics.leader.Set(0)
		stop()
		if ctx.Err() != nil {
			return nil
		}
		if err := w.ended(w.storeName(), subscribed, err); err != nil {
			return err
		}
		attempt = nextAttempt(attempt, subscribed)
		if err := retry.Sleep(ctx, w.opts.Backoff.Delay(attempt)); err != nil {
			return nil
		}
	}
	return nil
}

// close releases the watcher's clients.
func (w *Watcher) close() {
	if w.cluster != nil {
		_ = w.cluster.Close()
		return
	}
	_ = w.single.client.Close()
}

// storeName names the store in logs: the server's address, or "cluster".
func (w *Watcher) storeName() string {
	if w.cluster != nil {
		return "cluster"
	}
	return w.single.addr
}

// ended accounts for a session on the server addr that ended with err
// while the watcher goes on: a subscription lost is a gap, and so is a
// server that refuses the notifications once the watcher ran (restarted
// without them, CONFIG refused): the sender goes on saving and the watcher
// keeps trying. It returns err when the watcher must stop instead: the
// notifications cannot be turned on before it ever subscribed, a
// configuration the operator must fix before the sender runs.
func (w *Watcher) ended(addr string, subscribed bool, err error) error {
	if errors.Is(err, ErrNotifyDisabled) {
		if !w.started() {
			return err
		}
		w.opts.Metrics.gaps.Inc()
		w.opts.Logger.Error("store removal watcher cannot subscribe: removals are not announced until notifications are on", "node", addr, "err", err)
	}
	if subscribed {
		w.opts.Metrics.gaps.Inc()
		w.opts.Logger.Warn("store removal watcher lost its subscription: removals until it is back are not announced", "node", addr, "err", err)
	}
	return nil
}

// nextAttempt is the reconnect attempt after a session: the first again
// after one that subscribed, else the next.
func nextAttempt(attempt int, subscribed bool) int {
	if subscribed {
		return 1
	}
	return attempt + 1
}

func (w *Watcher) lead(ctx context.Context) (context.Context, context.CancelFunc, error) {
	if w.opts.Leader == nil {
		c, cancel := context.WithCancel(ctx)
		return c, cancel, nil
	}
	return w.opts.Leader.Lead(ctx)
}

// state is what the watcher keeps of a node across sessions.
type state struct {
	// markerSet: the watcher set its marker in an earlier session, so a
	// marker found missing at a new session's start was flushed (or went
	// unnoticed in the gap).
	markerSet bool
}

// EnsureNotifications makes the server's notify-keyspace-events include
// requiredFlags. With configure set it adds the missing flags with CONFIG
// SET and fails with ErrNotifyDisabled when the server refuses CONFIG GET
// or SET. Without it, it only checks: missing flags fail with
// ErrNotifyDisabled, and a server that refuses CONFIG GET (a managed Redis
// with CONFIG renamed) is taken at the operator's word, with a warning.
func EnsureNotifications(ctx context.Context, c *redis.Client, configure bool, log *slog.Logger) error {
	vals, err := c.ConfigGet(ctx, "notify-keyspace-events").Result()
	if err != nil && !isServerReply(err) {
		return fmt.Errorf("read notify-keyspace-events: %w", err) // the server is unreachable: retried, not a refusal
	}
	if err != nil {
		if !configure {
			log.Warn("cannot read notify-keyspace-events; assuming it includes "+requiredFlags+" as KVMESH_SENDER_EVICTIONS_CONFIGURE=false says", "err", err)
			return nil
		}
		return fmt.Errorf("%w: CONFIG GET notify-keyspace-events failed (%v); set it to include %q on the server and KVMESH_SENDER_EVICTIONS_CONFIGURE=false, or turn the watcher off (KVMESH_SENDER_EVICTIONS=false)", ErrNotifyDisabled, err, requiredFlags)
	}
	current := vals["notify-keyspace-events"]
	missing := missingFlags(current)
	if missing == "" {
		return nil
	}
	if !configure {
		return fmt.Errorf("%w: notify-keyspace-events is %q, lacking %q, and KVMESH_SENDER_EVICTIONS_CONFIGURE is false; set it on the server or turn the watcher off (KVMESH_SENDER_EVICTIONS=false)", ErrNotifyDisabled, current, missing)
	}
	if err := c.ConfigSet(ctx, "notify-keyspace-events", current+missing).Err(); err != nil {
		if !isServerReply(err) {
			return fmt.Errorf("set notify-keyspace-events: %w", err)
		}
		return fmt.Errorf("%w: notify-keyspace-events is %q, lacking %q, and CONFIG SET failed (%v); set it on the server or turn the watcher off (KVMESH_SENDER_EVICTIONS=false)", ErrNotifyDisabled, current, missing, err)
	}
	return nil
}

// isServerReply reports whether err is an error reply of the Redis server
// (a refused command), as opposed to a failure to reach it.
func isServerReply(err error) bool {
	var re redis.Error
	return errors.As(err, &re)
}

// missingFlags are the flags of requiredFlags that flags lacks; 'A' stands
// for every class (g$lshzxetd), so it covers g, x and e.
func missingFlags(flags string) string {
	var out []byte
	for _, f := range []byte(requiredFlags) {
		if strings.IndexByte(flags, f) >= 0 || f != 'E' && strings.IndexByte(flags, 'A') >= 0 {
			continue
		}
		out = append(out, f)
	}
	return string(out)
}

// session connects to n, subscribes and publishes until the connection or
// ctx ends. subscribed reports whether it got as far as a live
// subscription.
func (w *Watcher) session(ctx context.Context, n *node) (subscribed bool, err error) {
	if err := EnsureNotifications(ctx, n.client, w.opts.Configure, w.opts.Logger); err != nil {
		return false, err
	}
	if n.pickMarker != nil {
		marker, err := n.pickMarker(ctx)
		if err != nil {
			return false, err
		}
		if marker != n.marker {
			n.marker, n.st.markerSet = marker, false // a new marker is no flushed one
		}
	}
	channels := make([]string, len(causes))
	for i, c := range causes {
		channels[i] = fmt.Sprintf("__keyevent@%d__:%s", n.db, c)
	}
	ps := n.client.Subscribe(ctx, channels...)
	defer ps.Close()
	for confirmed := 0; confirmed < len(channels); {
		m, err := ps.Receive(ctx)
		if err != nil {
			return false, fmt.Errorf("subscribe: %w", err)
		}
		if _, ok := m.(*redis.Subscription); ok {
			confirmed++
		}
	}
	n.onSubscribed()
	w.opts.Logger.Debug("store removal watcher subscribed", "node", n.addr, "marker", n.marker)
	b := newBatcher(w, n.marker)
	if err := w.checkMarker(ctx, ps, n, b, true); err != nil {
		return true, err
	}
	nextMarker := time.Now().Add(w.opts.MarkerEvery)
	for ctx.Err() == nil {
		m, err := ps.ReceiveTimeout(ctx, w.opts.FlushEvery)
		switch {
		case err == nil:
			if msg, ok := m.(*redis.Message); ok {
				b.add(msg)
			}
		case isTimeout(err):
		default:
			return true, errors.Join(fmt.Errorf("receive: %w", err), b.flush(ctx))
		}
		if b.due() {
			if err := b.flush(ctx); err != nil {
				return true, err
			}
		}
		if time.Now().After(nextMarker) {
			nextMarker = time.Now().Add(w.opts.MarkerEvery)
			if err := w.checkMarker(ctx, ps, n, b, false); err != nil {
				return true, err
			}
		}
	}
	final, cancel := context.WithTimeout(context.WithoutCancel(ctx), finalFlushTimeout)
	defer cancel()
	return true, b.flush(final)
}

// finalFlushTimeout bounds publishing the last removals at shutdown.
const finalFlushTimeout = 5 * time.Second

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// checkMarker notices a flush: the marker set earlier is gone although no
// notification said it was removed. It then publishes AllBlocksCleared for
// the deployment, and (re)sets the marker. Before it decides, it reads
// every notification Redis sent before the marker was found gone: a PING
// on the subscription answers after them, in order. On a cluster each
// master has a marker of its own; one found gone (a FLUSHALL is per node)
// clears the whole deployment: the router then knows less than is stored,
// never more.
func (w *Watcher) checkMarker(ctx context.Context, ps *redis.PubSub, nd *node, b *batcher, first bool) error {
	st := &nd.st
	n, err := nd.client.Exists(ctx, nd.marker).Result()
	if err != nil {
		return fmt.Errorf("check marker: %w", err)
	}
	if n == 0 && st.markerSet && !b.markerRemoved && !first {
		if err := drainUntilPong(ctx, ps, b); err != nil {
			return err
		}
	}
	if n == 0 && st.markerSet && !b.markerRemoved {
		if err := b.flush(ctx); err != nil {
			return err
		}
		if err := w.publishCleared(ctx, first); err != nil {
			return err
		}
	}
	b.markerRemoved = false
	if n == 0 {
		if err := nd.client.Set(ctx, nd.marker, strconv.FormatInt(time.Now().UnixNano(), 10), 0).Err(); err != nil {
			return fmt.Errorf("set marker: %w", err)
		}
	}
	st.markerSet = true
	return nil
}

// drainTimeout bounds the wait for a PING's answer on the subscription.
const drainTimeout = 5 * time.Second

// drainUntilPong pings on the subscription and hands every notification
// read before the answer to b.
func drainUntilPong(ctx context.Context, ps *redis.PubSub, b *batcher) error {
	if err := ps.Ping(ctx, "kvmesh-marker-check"); err != nil {
		return fmt.Errorf("ping subscription: %w", err)
	}
	deadline := time.Now().Add(drainTimeout)
	for time.Now().Before(deadline) {
		m, err := ps.ReceiveTimeout(ctx, time.Until(deadline))
		if err != nil {
			return fmt.Errorf("drain subscription: %w", err)
		}
		switch m := m.(type) {
		case *redis.Pong:
			return nil
		case *redis.Message:
			b.add(m)
		}
	}
	return fmt.Errorf("drain subscription: no answer to PING in %s", drainTimeout)
}

// publishCleared publishes AllBlocksCleared for the deployment.
func (w *Watcher) publishCleared(ctx context.Context, afterGap bool) error {
	rec := contract.KVEventRecord{
		Batch: contract.KVEventBatch{
			TS: contract.UnixSeconds(w.opts.Now()), DataParallelRank: new(int),
			Events: []contract.KVEvent{{Kind: contract.AllBlocksCleared}},
		},
		Model: w.opts.Keys.Model, Namespace: w.scope(), Cause: CauseFlushed,
	}
	if err := w.publish(ctx, []contract.KVEventRecord{rec}); err != nil {
		return err
	}
	w.opts.Metrics.cleared.Inc()
	w.record(ctx, []contract.KVEventRecord{rec})
	w.opts.Logger.Warn("store found flushed (marker key gone unannounced): published AllBlocksCleared", "after_gap", afterGap)
	return nil
}

// publish encodes and publishes records, retrying with backoff until ctx
// ends (the Kafka side is at-least-once once the watcher holds a removal).
func (w *Watcher) publish(ctx context.Context, recs []contract.KVEventRecord) error {
	msgs := make([]bus.Message, 0, len(recs))
	for _, r := range recs {
		m, err := bus.KVEventMessage(r, w.opts.Form)
		if err != nil {
			return err
		}
		msgs = append(msgs, m)
	}
	_, err := retry.Do(ctx, w.opts.Backoff, func() (struct{}, error) {
		return struct{}{}, w.opts.Publisher.Publish(ctx, msgs...)
	}, func(err error, d time.Duration) {
		w.opts.Logger.Warn("publishing BlockRemoved events failed; retrying", "err", err, "delay", d)
	})
	if err != nil {
		return fmt.Errorf("publish kv events: %w", err)
	}
	return nil
}

// batcher gathers removals per (namespace, cause) until they are due.
type batcher struct {
	w             *Watcher
	marker        string // the node's marker key
	pending       map[batchKey]*pendingBatch
	order         []batchKey
	oldest        time.Time
	markerRemoved bool
}

type batchKey struct{ namespace, cause string }

type pendingBatch struct {
	group  int
	tenant string // the keys' tenant (part of the namespace, so one per batch)
	// model and fingerprint are the keys' (part of the namespace too).
	model, fingerprint string
	hashes             []string
	wire               []uint64
	// ages are the blocks' ages in seconds, one per hash (-1: unknown),
	// once taken (takeAges); nil before.
	ages []float64
	// checked counts the hashes of a del batch whose quota marks were
	// looked at (takeQuotaMarks).
	checked int
}

func newBatcher(w *Watcher, marker string) *batcher {
	return &batcher{w: w, marker: marker, pending: map[batchKey]*pendingBatch{}}
}

// add maps one notification to its batch, or counts it as unmapped.
func (b *batcher) add(msg *redis.Message) {
	cause := msg.Channel[strings.LastIndexByte(msg.Channel, ':')+1:]
	if !slices.Contains(causes, cause) {
		return
	}
	key := msg.Payload
	if key == b.marker {
		b.markerRemoved = true
		return
	}
	if strings.HasPrefix(key, markerPrefix) {
		return // another deployment's or cluster node's marker
	}
	if strings.HasSuffix(key, kvstore.StoredIndexSuffix) || strings.HasSuffix(key, kvstore.QuotaIndexSuffix) {
		return // a namespace's store-time index or quota marks, not a block
	}
	p, ok, err := b.w.parseOwn(key)
	switch {
	case err != nil:
		b.w.opts.Metrics.unmapped.WithLabelValues(unmappedMalformed).Inc()
		return
	case !ok:
		b.w.opts.Metrics.unmapped.WithLabelValues(unmappedForeign).Inc()
		return
	}
	ns, hx, _ := kvcore.SplitKey(key)
	k := batchKey{ns, cause}
	pb := b.pending[k]
	if pb == nil {
		pb = &pendingBatch{group: p.Group, tenant: p.Tenant, model: p.Model, fingerprint: p.Fingerprint}
		b.pending[k] = pb
		b.order = append(b.order, k)
	}
	if len(b.order) == 1 && len(pb.hashes) == 0 {
		b.oldest = time.Now()
	}
	pb.hashes = append(pb.hashes, hx)
	pb.wire = append(pb.wire, contract.WireHash(p.Hash))
}

// due reports whether the pending removals should be published now.
func (b *batcher) due() bool {
	if len(b.order) == 0 {
		return false
	}
	if time.Since(b.oldest) >= b.w.opts.FlushEvery {
		return true
	}
	for _, pb := range b.pending {
		if len(pb.hashes) >= b.w.opts.MaxBatch {
			return true
		}
	}
	return false
}

// flush publishes every pending batch, at most MaxBatch keys a record.
func (b *batcher) flush(ctx context.Context) error {
	if len(b.order) == 0 {
		return nil
	}
	now := b.w.opts.Now()
	b.takeQuotaMarks(ctx, now)
	b.takeAges(ctx, now)
	medium, locality := contract.MediumStore, contract.LocalityStore
	ts := contract.UnixSeconds(now)
	var recs []contract.KVEventRecord
	for _, k := range b.order {
		pb := b.pending[k]
		group := pb.group
		for start := 0; start < len(pb.hashes); start += b.w.opts.MaxBatch {
			end := min(start+b.w.opts.MaxBatch, len(pb.hashes))
			rec := contract.KVEventRecord{
				Batch: contract.KVEventBatch{TS: ts, DataParallelRank: new(int), Events: []contract.KVEvent{{
					Kind: contract.BlockRemoved, BlockHashes: pb.wire[start:end], Medium: &medium, GroupIdx: &group,
					Locality: &locality,
				}}},
				Model: pb.model, Fingerprint: pb.fingerprint, Namespace: k.namespace, Hashes: pb.hashes[start:end], Cause: k.cause,
				Tenant: pb.tenant,
			}
			if pb.ages != nil {
				rec.Ages = pb.ages[start:end]
			}
			recs = append(recs, rec)
		}
	}
	if err := b.w.publish(ctx, recs); err != nil {
		return err
	}
	for _, k := range b.order {
		b.w.opts.Metrics.countRemoved(k.cause, b.pending[k])
	}
	b.w.record(ctx, recs)
	b.pending, b.order = map[batchKey]*pendingBatch{}, nil
	return nil
}

// takeAges takes the store time of every pending key not taken yet from
// the store's index and gives each batch its blocks' ages at now, one per
// hash (-1 where the index has no time). Once taken a time is gone, so a
// batch keeps its ages across a failed publish and takes only those of
// keys added since. Without Times the batches go without ages; when the
// index cannot be read their new keys' ages are -1: a removal is
// announced either way.
func (b *batcher) takeAges(ctx context.Context, now time.Time) {
	if b.w.opts.Times == nil {
		return
	}
	var keys []string
	for _, k := range b.order {
		pb := b.pending[k]
		for _, h := range pb.hashes[len(pb.ages):] {
			keys = append(keys, k.namespace+"@"+h)
		}
	}
	if len(keys) == 0 {
		return
	}
	at, err := b.w.opts.Times.TakeStored(ctx, keys)
	if err != nil {
		b.w.opts.Logger.Warn("store times of removed blocks not read; their removals go without ages", "keys", len(keys), "err", err)
		at = make([]time.Time, len(keys))
	}
	i := 0
	for _, k := range b.order {
		pb := b.pending[k]
		for range pb.hashes[len(pb.ages):] {
			age := -1.0
			if !at[i].IsZero() {
				age = max(0, now.Sub(at[i]).Seconds())
			}
			pb.ages = append(pb.ages, age)
			i++
		}
	}
}

// takeQuotaMarks moves the dels a tenant quota made, among the del
// batches' keys not looked at yet, into a quota batch of their namespace,
// each with the age its mark says. Those keys have no age yet (marks are
// looked at before ages), and a key once looked at stays where it is, so
// a batch kept across a failed publish keeps its split. When the marks
// cannot be read the keys stay dels.
func (b *batcher) takeQuotaMarks(ctx context.Context, now time.Time) {
	if b.w.opts.Quotas == nil {
		return
	}
	var keys []string
	for _, k := range b.order {
		if pb := b.pending[k]; k.cause == CauseDeleted {
			for _, h := range pb.hashes[pb.checked:] {
				keys = append(keys, k.namespace+"@"+h)
			}
		}
	}
	if len(keys) == 0 {
		return
	}
	marks, err := b.w.opts.Quotas.TakeQuotaMarks(ctx, keys)
	if err != nil {
		b.w.opts.Logger.Warn("quota marks of deleted blocks not read; they are announced as deleted", "keys", len(keys), "err", err)
		marks = make([]time.Time, len(keys))
	}
	for _, k := range slices.Clone(b.order) {
		if k.cause != CauseDeleted {
			continue
		}
		pb := b.pending[k]
		n := len(pb.hashes) - pb.checked
		b.splitQuota(k, pb, marks[:n], now)
		marks = marks[n:]
	}
}

// splitQuota moves the keys of del batch pb (key k) past pb.checked whose
// marks are set into the quota batch of k's namespace.
func (b *batcher) splitQuota(k batchKey, pb *pendingBatch, marks []time.Time, now time.Time) {
	keep := pb.checked
	for i, at := range marks {
		j := pb.checked + i
		if at.IsZero() {
			pb.hashes[keep], pb.wire[keep] = pb.hashes[j], pb.wire[j]
			keep++
			continue
		}
		qk := batchKey{k.namespace, CauseQuota}
		q := b.pending[qk]
		if q == nil {
			q = &pendingBatch{group: pb.group, tenant: pb.tenant, model: pb.model, fingerprint: pb.fingerprint}
			b.pending[qk] = q
			b.order = append(b.order, qk)
		}
		q.hashes, q.wire = append(q.hashes, pb.hashes[j]), append(q.wire, pb.wire[j])
		q.ages = append(q.ages, max(0, now.Sub(at).Seconds()))
		q.checked = len(q.hashes)
	}
	pb.hashes, pb.wire, pb.checked = pb.hashes[:keep], pb.wire[:keep], keep
	if len(pb.hashes) == 0 {
		delete(b.pending, k)
		b.order = slices.DeleteFunc(b.order, func(o batchKey) bool { return o == k })
	}
}

// record writes the published records (removals and clears) to the
// removals log, if any; a
// failure is logged and counted, the removals are announced either way.
func (w *Watcher) record(ctx context.Context, recs []contract.KVEventRecord) {
	if w.opts.Log == nil {
		return
	}
	if err := w.opts.Log.Record(ctx, recs); err != nil {
		w.opts.Metrics.unlogged.Add(float64(len(recs)))
		w.opts.Logger.Warn("removals not logged; they were announced", "records", len(recs), "err", err)
	}
}
