package evictions

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"

	"github.com/kvmesh/kvmesh/internal/dbtest"
	"github.com/kvmesh/kvmesh/internal/devbroker"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/adminapi"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
	"github.com/kvmesh/kvmesh/services/sender/internal/removals"
)

// rig is a watcher on a private redis-server publishing to the kfake
// broker over TCP, and a kafka-go reader of kvmesh.kv.events.
type rig struct {
	t       *testing.T
	redis   *testenv.RedisServer
	client  *redis.Client
	store   *kvstore.Redis
	brokers []string
	metrics *Metrics
	w       *Watcher
	done    chan error
	cancel  context.CancelFunc

	mu      sync.Mutex
	records []contract.KVEventRecord
	keys    []string // record keys, one per record
	values  [][]byte // record values, one per record
	offsets map[int]int64
}

func newRig(t *testing.T, redisArgs []string, tweak func(*Options)) *rig {
	t.Helper()
	r := &rig{t: t, redis: testenv.StartRedis(t, redisArgs...), offsets: map[int]int64{}}
	ro, _ := redis.ParseURL(r.redis.URL())
	r.client = redis.NewClient(ro)
	t.Cleanup(func() { _ = r.client.Close() })
	ctx := r.start(r.redis.URL(), tweak)
	var err error
	if r.store, err = kvstore.NewRedis(ctx, r.redis.URL(), kvstore.RedisOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.store.Close() })
	return r
}

// start starts the broker, a producer and the watcher of the store at
// url, with the rig's test options changed by tweak; it returns the
// rig's context, which ends with the test.
func (r *rig) start(url string, tweak func(*Options)) context.Context {
	t := r.t
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	r.cancel = cancel
	b, err := devbroker.Start(ctx, devbroker.Config{Addr: "127.0.0.1:0", Partitions: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	r.brokers = b.Addrs()
	p, err := bus.NewProducer(r.brokers)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	if r.metrics, err = NewMetrics(prometheus.NewRegistry()); err != nil {
		t.Fatal(err)
	}
	opts := Options{
		RedisURL: url, Keys: kvcore.KeyBuilder{Prefix: "dep", Model: "m"}, Publisher: p, Metrics: r.metrics,
		Configure: true, FlushEvery: 20 * time.Millisecond, MarkerEvery: time.Hour,
	}
	if tweak != nil {
		tweak(&opts)
	}
	if r.w, err = New(opts); err != nil {
		t.Fatal(err)
	}
	r.done = make(chan error, 1)
	go func() { r.done <- r.w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-r.done; err != nil {
			t.Errorf("watcher: %v", err)
		}
	})
	return ctx
}

// waitReady waits for the watcher's subscription.
func (r *rig) waitReady() {
	r.t.Helper()
	select {
	case <-r.w.Ready():
	case err := <-r.done:
		r.t.Fatalf("watcher ended before subscribing: %v", err)
	case <-time.After(15 * time.Second):
		r.t.Fatal("watcher did not subscribe in 15 s")
	}
}

// read fetches the records published since the last read, every partition.
func (r *rig) read() {
	r.t.Helper()
	for part := range 2 {
		func() {
			rd := kafka.NewReader(kafka.ReaderConfig{Brokers: r.brokers, Topic: contract.TopicKVEvents, Partition: part, MaxWait: 20 * time.Millisecond})
			defer rd.Close()
			if err := rd.SetOffset(r.offsets[part]); err != nil {
				r.t.Fatal(err)
			}
			for {
				ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
				m, err := rd.ReadMessage(ctx)
				cancel()
				if err != nil {
					return // nothing more for now
				}
				h := map[string]string{}
				for _, x := range m.Headers {
					h[x.Key] = string(x.Value)
				}
				rec, err := contract.DecodeKVEventRecord(m.Value, h)
				if err != nil {
					r.t.Fatalf("record %d/%d: %v", part, m.Offset, err)
				}
				r.mu.Lock()
				r.records = append(r.records, rec)
				r.keys = append(r.keys, string(m.Key))
				r.values = append(r.values, m.Value)
				r.mu.Unlock()
				r.offsets[part] = m.Offset + 1
			}
		}()
	}
}

// removed maps every store key named by a BlockRemoved record to its cause.
func (r *rig) removed() map[string]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]string{}
	for _, rec := range r.records {
		if rec.Kind() == contract.BlockRemoved {
			for _, k := range rec.Keys() {
				out[k] = rec.Cause
			}
		}
	}
	return out
}

// until polls the topic until cond holds or the deadline passes.
func (r *rig) until(what string, cond func() bool) {
	r.t.Helper()
	eventually(r.t, what, func() bool {
		r.read()
		return cond()
	})
}

// eventually polls cond until it holds, failing the test after 20 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, what, cond)
}

// TestEvictedKeysAreAnnounced fills a 2 MiB allkeys-lru Redis far past its
// maxmemory with the blocks of many requests and checks that every key
// Redis evicted got a BlockRemoved (cause evicted), that no key still
// present did, and that a lookup over the real store never answers a hit
// that needs a key the events say is gone.
func TestEvictedKeysAreAnnounced(t *testing.T) {
	m, err := kvcore.Preset("dense")
	if err != nil {
		t.Fatal(err)
	}
	kb := kvcore.KeysOf(m).WithPrefix("dep")
	r := newRig(t, []string{"--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru"}, func(o *Options) { o.Keys = kb })
	r.waitReady()
	const requests, blocks, valueBytes = 40, 8, 16 << 10
	type request struct {
		hashes []kvcore.BlockHash
		keys   []string
	}
	var reqs []request
	var all []string
	ctx := context.Background()
	for i := range requests {
		tokens := make([]uint32, blocks*m.HashBlockSize)
		for j := range tokens {
			tokens[j] = uint32(i*100000 + j)
		}
		rq := request{hashes: kvcore.HashChain(tokens, m.HashBlockSize, nil)}
		var items []kvstore.Item
		for _, h := range rq.hashes {
			k := kb.Key(kvcore.Rank{}, 0, h)
			rq.keys = append(rq.keys, k)
			items = append(items, kvstore.Item{Key: k, Value: make([]byte, valueBytes)})
		}
		if _, err := r.store.Put(ctx, items); err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, rq)
		all = append(all, rq.keys...)
	}
	found, err := r.store.Exists(ctx, all)
	if err != nil {
		t.Fatal(err)
	}
	present, evicted := map[string]bool{}, map[string]bool{}
	for i, k := range all {
		if found[i] {
			present[k] = true
		} else {
			evicted[k] = true
		}
	}
	t.Logf("%d of %d keys evicted, %d present", len(evicted), len(all), len(present))
	if len(evicted) == 0 || len(present) == 0 {
		t.Fatalf("%d keys evicted, %d present: the store did not fill past maxmemory as planned", len(evicted), len(present))
	}
	r.until(fmt.Sprintf("BlockRemoved for all %d evicted keys", len(evicted)), func() bool {
		got := r.removed()
		for k := range evicted {
			if got[k] == "" {
				return false
			}
		}
		return true
	})
	got := r.removed()
	// Any command may evict more while the store is at maxmemory, so a key
	// present at the count above may be gone since; none comes back.
	announced := slices.Collect(maps.Keys(got))
	stillThere, err := r.store.Exists(ctx, announced)
	if err != nil {
		t.Fatal(err)
	}
	for i, k := range announced {
		cause := got[k]
		if stillThere[i] {
			t.Errorf("key %s is still in the store but got a BlockRemoved (%s)", k, cause)
		}
		if cause != CauseEvicted {
			t.Errorf("key %s removed with cause %q, want evicted", k, cause)
		}
	}
	r.mu.Lock()
	for i, rec := range r.records {
		ev := rec.Batch.Events[0]
		if rec.Kind() != contract.BlockRemoved || r.keys[i] != kb.Namespace(kvcore.Rank{}, 0) || rec.Namespace != r.keys[i] ||
			ev.GroupIdx == nil || *ev.GroupIdx != 0 || ev.Medium == nil || *ev.Medium != contract.MediumStore ||
			ev.Locality == nil || *ev.Locality != contract.LocalityStore ||
			rec.Batch.DataParallelRank == nil || *rec.Batch.DataParallelRank != 0 {
			t.Errorf("record %d: key %q, %+v", i, r.keys[i], rec)
		}
		for j, h := range rec.Hashes {
			b, err := kvcore.ParseBlockHash(h)
			if err != nil || ev.BlockHashes[j] != contract.WireHash(b) {
				t.Errorf("record %d hash %d: wire %#x for %s (%v)", i, j, ev.BlockHashes[j], h, err)
			}
		}
	}
	r.mu.Unlock()
	if n := testutil.ToFloat64(r.metrics.removed.WithLabelValues(CauseEvicted)); int(n) != len(got) {
		t.Errorf("kvmesh_sender_block_removed_total{cause=evicted} = %v, want %d", n, len(got))
	}

	// The lookup over the real store never hits through an evicted key.
	hits := 0
	for _, rq := range reqs {
		plan, err := kvcore.PlanLookup(m, kb, rq.hashes, len(rq.hashes)*m.HashBlockSize)
		if err != nil {
			t.Fatal(err)
		}
		exists, err := r.store.Exists(ctx, plan.Keys())
		if err != nil {
			t.Fatal(err)
		}
		hit := plan.Hit(exists, plan.NumTokens())
		for i, k := range rq.keys {
			if (i+1)*m.HashBlockSize <= hit && got[k] != "" {
				t.Errorf("lookup hit %d tokens through %s, which was evicted", hit, k)
			}
		}
		if hit > 0 {
			hits++
		}
	}
	if hits == 0 {
		t.Error("no request hit at all: the check above checked nothing")
	}
}

// TestExpiredAndDeletedKeysAreAnnounced checks the other two causes and
// that keys outside the deployment's key space are counted, not published.
func TestExpiredAndDeletedKeysAreAnnounced(t *testing.T) {
	r := newRig(t, nil, nil)
	r.waitReady()
	ctx := context.Background()
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m"}
	expiring := kb.Key(kvcore.Rank{TP: 1}, 1, kvcore.BlockHash{1, 2, 3})
	deleted := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{4, 5, 6})
	foreign := kvcore.KeyBuilder{Prefix: "dep", Model: "other"}.Key(kvcore.Rank{}, 0, kvcore.BlockHash{7})
	tenants := kb.ForTenant("acme").Key(kvcore.Rank{}, 0, kvcore.BlockHash{8, 9})
	for _, k := range []string{deleted, foreign, "junk", tenants} {
		if err := r.client.Set(ctx, k, "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.client.Set(ctx, expiring, "v", 30*time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	if err := r.client.Del(ctx, deleted, foreign, "junk", tenants).Err(); err != nil {
		t.Fatal(err)
	}
	r.until("BlockRemoved for the expired, the deleted and the tenant's key", func() bool {
		got := r.removed()
		return got[expiring] == CauseExpired && got[deleted] == CauseDeleted && got[tenants] == CauseDeleted
	})
	if got := r.removed(); len(got) != 3 {
		t.Errorf("removed %v, want only the three keys of the deployment", got)
	}
	r.mu.Lock()
	for _, rec := range r.records {
		if rec.Kind() == contract.BlockRemoved && rec.Keys()[0] == expiring && *rec.Batch.Events[0].GroupIdx != 1 {
			t.Errorf("expired key's event has group %d, want 1", *rec.Batch.Events[0].GroupIdx)
		}
		if rec.Kind() == contract.BlockRemoved && (rec.Keys()[0] == tenants) != (rec.Tenant == "acme") {
			t.Errorf("BlockRemoved of %v names tenant %q; want acme for the tenant's key only", rec.Keys(), rec.Tenant)
		}
	}
	r.mu.Unlock()
	for reason, want := range map[string]float64{unmappedForeign: 1, unmappedMalformed: 1} {
		if n := testutil.ToFloat64(r.metrics.unmapped.WithLabelValues(reason)); n != want {
			t.Errorf("unmapped{reason=%s} = %v, want %v", reason, n, want)
		}
	}
}

// TestFlushIsAnnouncedAsAllBlocksCleared: FLUSHALL sends no keyspace event;
// the marker key going missing unannounced makes the watcher publish
// AllBlocksCleared for the deployment.
func TestFlushIsAnnouncedAsAllBlocksCleared(t *testing.T) {
	log := removals.New(dbtest.NewPool(t), 0)
	r := newRig(t, nil, func(o *Options) { o.MarkerEvery, o.Log = 50*time.Millisecond, log })
	r.waitReady()
	ctx := context.Background()
	key := kvcore.KeyBuilder{Prefix: "dep", Model: "m"}.Key(kvcore.Rank{}, 0, kvcore.BlockHash{9})
	if err := r.client.Set(ctx, key, "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	// The marker is there once the first check ran.
	eventually(t, "the marker key set", func() bool { return r.client.Exists(ctx, r.w.single.marker).Val() == 1 })
	if err := r.client.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	var cleared contract.KVEventRecord
	r.until("AllBlocksCleared after FLUSHALL", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for i, rec := range r.records {
			if rec.Kind() == contract.AllBlocksCleared {
				cleared = rec
				return r.keys[i] == "dep@m"
			}
		}
		return false
	})
	if cleared.Cause != CauseFlushed || cleared.Namespace != "dep@m" || len(cleared.Batch.Events) != 1 {
		t.Errorf("AllBlocksCleared record %+v", cleared)
	}
	if _, ok := r.removed()[key]; ok {
		t.Error("the flushed key got a BlockRemoved; FLUSHALL sends no keyspace event")
	}
	// The removals log has the flush: cause flushed, the deployment's scope.
	eventually(t, "the flush logged", func() bool {
		got, err := log.Query(ctx, removals.Filter{Cause: CauseFlushed, Since: time.Now().Add(-time.Hour), Until: time.Now().Add(time.Minute), Limit: 5})
		return err == nil && len(got.Recent) == 1 && got.Recent[0].Namespace == "dep@m" && got.Recent[0].Blocks == 0
	})
	// A marker removed with a notification is no flush.
	if err := r.client.Del(ctx, r.w.single.marker).Err(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the marker key set again", func() bool { return r.client.Exists(ctx, r.w.single.marker).Val() == 1 })
	r.read()
	if n := testutil.ToFloat64(r.metrics.cleared); n != 1 {
		t.Errorf("cleared = %v after a deleted marker, want still 1", n)
	}
}

// TestNotificationsMustBeOn: the watcher refuses to run when it cannot
// turn the notifications on and they are not on already.
func TestNotificationsMustBeOn(t *testing.T) {
	tests := []struct {
		name      string
		args      []string
		configure bool
		wantErr   bool
	}{
		{"off, CONFIG refused", []string{"--rename-command", "CONFIG", ""}, true, true},
		{"off, may not configure", nil, false, true},
		{"set on the server, CONFIG refused, not configuring", []string{"--notify-keyspace-events", "Egx", "--rename-command", "CONFIG", ""}, false, false},
		{"partly set, configuring", []string{"--notify-keyspace-events", "Kg"}, true, false},
		{"all classes", []string{"--notify-keyspace-events", "EA"}, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := testenv.StartRedis(t, tc.args...)
			ro, _ := redis.ParseURL(srv.URL())
			c := redis.NewClient(ro)
			defer c.Close()
			err := EnsureNotifications(context.Background(), c, tc.configure, slog.New(slog.DiscardHandler))
			if tc.wantErr != errors.Is(err, ErrNotifyDisabled) || (err != nil) != tc.wantErr {
				t.Fatalf("EnsureNotifications: %v, want error %v", err, tc.wantErr)
			}
			if !tc.wantErr && tc.configure {
				flags := c.ConfigGet(context.Background(), "notify-keyspace-events").Val()["notify-keyspace-events"]
				if missingFlags(flags) != "" {
					t.Fatalf("flags %q after configuring", flags)
				}
			}
		})
	}
	t.Run("run fails", func(t *testing.T) {
		srv := testenv.StartRedis(t, "--rename-command", "CONFIG", "")
		m, _ := NewMetrics(prometheus.NewRegistry())
		w, err := New(Options{RedisURL: srv.URL(), Keys: kvcore.KeyBuilder{Model: "m"}, Publisher: nopPublisher{}, Metrics: m, Configure: true})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := w.Run(ctx); !errors.Is(err, ErrNotifyDisabled) || !strings.Contains(err.Error(), "KVMESH_SENDER_EVICTIONS=false") {
			t.Fatalf("Run: %v, want ErrNotifyDisabled naming the switch", err)
		}
	})
}

// TestOneReplicaWatches: of two watchers of one deployment with the
// PostgreSQL leader, one subscribes; when it stops, the other takes over.
func TestOneReplicaWatches(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), testenv.DatabaseURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	srv := testenv.StartRedis(t)
	kb := kvcore.KeyBuilder{Prefix: fmt.Sprintf("lead%d", time.Now().UnixNano()), Model: "m"}
	start := func() (*Watcher, func() error) {
		m, _ := NewMetrics(prometheus.NewRegistry())
		l := NewPGLeader(pool, kb)
		l.Poll = 250 * time.Millisecond // also the leader's ping timeout: not so short that a loaded machine loses the lock
		w, err := New(Options{RedisURL: srv.URL(), Keys: kb, Publisher: nopPublisher{}, Metrics: m, Configure: true, Leader: l})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- w.Run(ctx) }()
		stop := sync.OnceValue(func() error { cancel(); return <-done })
		t.Cleanup(func() { _ = stop() })
		return w, stop
	}
	a, stopA := start()
	b, stopB := start()
	var leader, other *Watcher
	var stopLeader func() error
	select {
	case <-a.Ready():
		leader, other, stopLeader = a, b, stopA
	case <-b.Ready():
		leader, other, stopLeader = b, a, stopB
	case <-time.After(15 * time.Second):
		t.Fatal("no watcher subscribed")
	}
	select {
	case <-other.Ready():
		t.Fatal("both watchers subscribed")
	case <-time.After(500 * time.Millisecond): // the other keeps trying the lock meanwhile
	}
	if err := stopLeader(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-other.Ready():
	case <-time.After(15 * time.Second):
		t.Fatal("the other watcher did not take over")
	}
	if leader == other {
		t.Fatal("unreachable")
	}
}

type nopPublisher struct{}

func (nopPublisher) Publish(context.Context, ...bus.Message) error { return nil }

// TestStoreRestartsNeverStopTheWatcher: the store going away, coming back
// empty without notifications (the watcher turns them on again), and
// coming back with CONFIG refused and notifications off (the watcher can
// only wait) never ends the watcher — a store outage must not stop the
// sender — and each time removals are announced again once it can
// subscribe.
func TestStoreRestartsNeverStopTheWatcher(t *testing.T) {
	r := newRig(t, nil, func(o *Options) { o.Backoff.Initial, o.Backoff.Max = 20*time.Millisecond, 200*time.Millisecond })
	r.waitReady()
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m"}
	announced := func(phase string, h byte) {
		t.Helper()
		key := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{h})
		ctx := context.Background()
		r.until(phase+": BlockRemoved of a deleted key", func() bool {
			// set and delete again each poll: the first DEL may precede the
			// watcher's new subscription
			_ = r.client.Set(ctx, key, "v", 0).Err()
			_ = r.client.Del(ctx, key).Err()
			return r.removed()[key] == CauseDeleted
		})
	}
	running := func(phase string) {
		t.Helper()
		select {
		case err := <-r.done:
			t.Fatalf("%s: the watcher stopped: %v", phase, err)
		default:
		}
	}
	announced("before", 1)

	r.redis.Stop()
	r.redis = testenv.RestartRedis(t, r.redis) // empty, notify-keyspace-events ""
	announced("after a restart", 2)
	running("after a restart")

	gaps := testutil.ToFloat64(r.metrics.gaps)
	r.redis.Stop()
	r.redis = testenv.RestartRedis(t, r.redis, "--rename-command", "CONFIG", "")
	eventually(t, "two gaps while CONFIG is refused (the subscription lost, then refused)", func() bool {
		running("while CONFIG is refused")
		return testutil.ToFloat64(r.metrics.gaps) >= gaps+2
	})
	running("while CONFIG is refused")

	r.redis.Stop()
	r.redis = testenv.RestartRedis(t, r.redis)
	announced("once notifications can be turned on again", 3)
	running("at the end")
}

// TestRemovalsSayTheBlocksAge: with the store's index of store times
// (kvstore.StoreTimes, which the gpuworkers write), every BlockRemoved
// names each block's age when it went — the watcher's clock minus the
// time the block was stored — and -1 for a block stored without a time;
// the ages feed kvmesh_sender_removed_block_age_seconds by cause and
// tenant; the times are taken out of the index, and the index's own
// removal is neither announced nor counted as unmapped.
func TestRemovalsSayTheBlocksAge(t *testing.T) {
	now := time.Now().Truncate(time.Millisecond)
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m", Fingerprint: "00112233445566ff"}.ForTenant("acme")
	log := removals.New(dbtest.NewPool(t), 0)
	r := newRig(t, nil, func(o *Options) {
		o.Keys, o.Log = kb.ForTenant(""), log
		st, err := kvstore.NewRedis(context.Background(), o.RedisURL, kvstore.RedisOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		o.Times, o.Now = st, func() time.Time { return now }
	})
	r.waitReady()
	ctx := context.Background()
	old := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{1})
	young := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{2})
	unknown := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{3})
	for _, k := range []string{old, young, unknown} {
		if err := r.client.Set(ctx, k, "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.store.MarkStored(ctx, []string{old}, now.Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := r.store.MarkStored(ctx, []string{young}, now.Add(-90*time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := r.client.Del(ctx, old, young, unknown).Err(); err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{old: 3600, young: 90, unknown: -1}
	ages := map[string]float64{}
	r.until("BlockRemoved with ages for the three keys", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, rec := range r.records {
			for i, k := range rec.Keys() {
				if rec.Kind() == contract.BlockRemoved && len(rec.Ages) == len(rec.Hashes) {
					ages[k] = rec.Ages[i]
				}
			}
		}
		return len(ages) == 3
	})
	for k, w := range want {
		if ages[k] != w {
			t.Errorf("age of %s = %v, want %v", k, ages[k], w)
		}
	}
	if n := testutil.CollectAndCount(r.metrics.age); n != len(causes)+2 { // and quota
		t.Errorf("%d age series, want one per cause of no tenant (quota too) and (del, acme)", n)
	}
	var h dto.Metric
	if err := r.metrics.age.WithLabelValues(CauseDeleted, "acme").(prometheus.Metric).Write(&h); err != nil ||
		h.GetHistogram().GetSampleCount() != 2 || h.GetHistogram().GetSampleSum() != 3690 {
		t.Errorf("age histogram of (del, acme): %v, %v; want the 2 known ages, 3690 s", h.GetHistogram(), err)
	}
	if n := testutil.ToFloat64(r.metrics.ageless.WithLabelValues(CauseDeleted)); n != 1 {
		t.Errorf("removed without age{del} = %v, want 1", n)
	}
	if n := testutil.ToFloat64(r.metrics.unmapped.WithLabelValues(unmappedMalformed)); n != 0 {
		t.Errorf("unmapped{malformed} = %v, want 0: the index's removal is not a block's", n)
	}
	left, err := r.client.Exists(ctx, kb.Namespace(kvcore.Rank{}, 0)+kvstore.StoredIndexSuffix).Result()
	if err != nil || left != 0 {
		t.Errorf("the namespace's index is left (%d, %v): its times were taken", left, err)
	}
	// The removals log answers what of acme left in the last hour, and why.
	acme := "acme"
	var logged adminapi.Removals
	eventually(t, "the removals logged", func() bool {
		logged, err = log.Query(ctx, removals.Filter{Tenant: &acme, Since: now.Add(-time.Hour), Until: now.Add(time.Minute), Limit: 10})
		return err == nil && len(logged.ByCause) == 1 && logged.ByCause[0].Blocks == 3
	})
	c := logged.ByCause[0]
	if c.Cause != CauseDeleted || c.AgesKnown != 2 || *c.AgeMinS != 90 || *c.AgeMaxS != 3600 || logged.Recent[0].Fingerprint != kb.Fingerprint {
		t.Errorf("logged %+v, recent %+v; want del: 3 blocks, 2 ages 90..3600, the model's fingerprint", c, logged.Recent)
	}
}

// TestQuotaRemovalsSayQuota: a key a tenant quota removed
// (kvstore.Redis.RemoveForQuota: its mark, then UNLINK) is announced with
// cause quota and the age its mark holds, a key an operator deleted in
// the same moment and namespace stays a del, the quota cause is counted
// and the mark is taken.
func TestQuotaRemovalsSayQuota(t *testing.T) {
	now := time.Now().Truncate(time.Millisecond)
	kb := kvcore.KeyBuilder{Prefix: "dep", Model: "m", Fingerprint: "00112233445566ff"}.ForTenant("over")
	r := newRig(t, nil, func(o *Options) {
		o.Keys = kb.ForTenant("")
		st, err := kvstore.NewRedis(context.Background(), o.RedisURL, kvstore.RedisOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		o.Times, o.Quotas, o.Now = st, st, func() time.Time { return now }
		o.FlushEvery = 200 * time.Millisecond // both removals in one del batch
	})
	r.waitReady()
	ctx := context.Background()
	evicted := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{1})
	deleted := kb.Key(kvcore.Rank{}, 0, kvcore.BlockHash{2})
	for _, k := range []string{evicted, deleted} {
		if err := r.client.Set(ctx, k, "v", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.store.MarkStored(ctx, []string{evicted, deleted}, now.Add(-time.Hour)); err != nil {
		t.Fatal(err)
	}
	if err := r.client.Del(ctx, deleted).Err(); err != nil {
		t.Fatal(err)
	}
	if n, err := r.store.RemoveForQuota(ctx, []kvstore.StoredKey{{Key: evicted, StoredAt: now.Add(-2 * time.Hour)}}, now); err != nil || n != 1 {
		t.Fatalf("RemoveForQuota = %d, %v", n, err)
	}
	type removal struct {
		cause, tenant string
		age           float64
	}
	got := map[string]removal{}
	r.until("BlockRemoved of both keys", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, rec := range r.records {
			for i, k := range rec.Keys() {
				if rec.Kind() == contract.BlockRemoved && len(rec.Ages) == len(rec.Hashes) {
					got[k] = removal{rec.Cause, rec.Tenant, rec.Ages[i]}
				}
			}
		}
		return len(got) == 2
	})
	if want := (removal{CauseQuota, "over", 7200}); got[evicted] != want {
		t.Errorf("the quota's removal: %+v, want %+v (the mark's store time)", got[evicted], want)
	}
	if want := (removal{CauseDeleted, "over", 3600}); got[deleted] != want {
		t.Errorf("the operator's delete: %+v, want %+v", got[deleted], want)
	}
	if n := testutil.ToFloat64(r.metrics.removed.WithLabelValues(CauseQuota)); n != 1 {
		t.Errorf("removed{quota} = %v, want 1", n)
	}
	if marks, err := r.store.TakeQuotaMarks(ctx, []string{evicted}); err != nil || !marks[0].IsZero() {
		t.Errorf("the mark after the announcement: %v, %v; want it taken", marks, err)
	}
}
