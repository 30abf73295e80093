package kvstore_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// benchKeys is how many distinct keys the put and get benchmarks cycle over.
const benchKeys = 64

func BenchmarkMemoryPut1MiB(b *testing.B) { benchPut(b, benchMemory(b), 1<<20) }

func BenchmarkRedisPut1MiB(b *testing.B) { benchPut(b, benchRedis(b), 1<<20) }

func BenchmarkMemoryGet1MiB(b *testing.B) { benchGet(b, benchMemory(b), 1<<20) }

func BenchmarkRedisGet1MiB(b *testing.B) { benchGet(b, benchRedis(b), 1<<20) }

func BenchmarkMemoryExists1000(b *testing.B) { benchExists(b, benchMemory(b), 1000) }

func BenchmarkRedisExists1000(b *testing.B) { benchExists(b, benchRedis(b), 1000) }

func benchMemory(b *testing.B) kvstore.Store {
	m := kvstore.NewMemory(kvstore.MemoryOptions{})
	b.Cleanup(func() { _ = m.Close() }) // Memory.Close never fails
	return m
}

func benchRedis(b *testing.B) kvstore.Store {
	return newRedis(b, testenv.RedisURL(b), kvstore.RedisOptions{})
}

// benchPut puts one value of size bytes per operation, each under an
// absent key (values are written once): the keys are removed, untimed,
// each time the loop comes round to them again.
func benchPut(b *testing.B, s kvstore.Store, size int) {
	keys := testKeys(b, s, benchKeys)
	value := make([]byte, size)
	ctx := context.Background()
	b.SetBytes(int64(size))
	for i := 0; b.Loop(); i++ {
		if i > 0 && i%benchKeys == 0 {
			b.StopTimer()
			if _, err := s.Remove(ctx, keys); err != nil {
				b.Fatalf("Remove: %v", err)
			}
			b.StartTimer()
		}
		errs, err := s.Put(ctx, []kvstore.Item{{Key: keys[i%benchKeys], Value: value}})
		if err != nil || errs[0] != nil {
			b.Fatalf("Put: %v %v", err, errs)
		}
	}
}

// benchGet gets one value of size bytes per operation.
func benchGet(b *testing.B, s kvstore.Store, size int) {
	keys := testKeys(b, s, benchKeys)
	items := make([]kvstore.Item, benchKeys)
	for i, k := range keys {
		items[i] = kvstore.Item{Key: k, Value: make([]byte, size)}
	}
	if err := putAll(s, items...); err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.SetBytes(int64(size))
	for i := 0; b.Loop(); i++ {
		_, errs, err := s.Get(ctx, keys[i%benchKeys:i%benchKeys+1])
		if err != nil || errs[0] != nil {
			b.Fatalf("Get: %v %v", err, errs)
		}
	}
}

// benchExists checks n keys, half of them present, per operation; bytes/s
// counts key bytes and keys/s is reported separately.
func benchExists(b *testing.B, s kvstore.Store, n int) {
	keys := testKeys(b, s, n)
	items := make([]kvstore.Item, 0, n/2)
	keyBytes := 0
	for i, k := range keys {
		keyBytes += len(k)
		if i%2 == 0 {
			items = append(items, kvstore.Item{Key: k, Value: []byte("v")})
		}
	}
	if err := putAll(s, items...); err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	b.SetBytes(int64(keyBytes))
	for b.Loop() {
		if _, err := s.Exists(ctx, keys); err != nil {
			b.Fatalf("Exists: %v", err)
		}
	}
	b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "keys/s")
}

// Cluster benchmark sizes: 64 values of 1 MiB per operation, spread over
// every master of the cluster by their keys' slots.
const (
	clusterBenchValue = 1 << 20
	clusterBenchBatch = 64
)

// BenchmarkRedisExists4096 checks 4,096 keys of the lookup's shape (about
// 100 bytes), half of them present, with the store's Exists and with a raw
// go-redis pipeline of EXISTS, alternately; it reports
// each one's keys/s and store/raw.
func BenchmarkRedisExists4096(b *testing.B) {
	url := testenv.RedisURL(b)
	s := newRedis(b, url, kvstore.RedisOptions{})
	raw := rawClient(b, url)
	benchExistsVsRaw(b, s, raw, 4096)
}

// BenchmarkClusterExists4096 is BenchmarkRedisExists4096 on the shared
// Redis Cluster.
func BenchmarkClusterExists4096(b *testing.B) {
	url := testenv.RedisCluster(b).URL()
	s := newRedis(b, url, kvstore.RedisOptions{})
	benchExistsVsRaw(b, s, rawClusterClient(b, url), 4096)
}

// BenchmarkClusterPut puts 64 framed values of 1 MiB per operation into
// the shared Redis Cluster with the store's Put, and the same values under
// other keys with a raw go-redis ClusterClient pipeline of SET NX, in turns
// from one goroutine, every key removed (untimed) before each turn: both
// sides write absent keys. It reports MiB/s (the store), raw_MiB/s and
// ratio (store/raw).
func BenchmarkClusterPut(b *testing.B) {
	url := testenv.RedisCluster(b).URL()
	s := newRedis(b, url, kvstore.RedisOptions{})
	raw := rawClusterClient(b, url)
	keys := longKeys(b, s, 2*clusterBenchBatch)
	items := framedItems(keys[:clusterBenchBatch])
	rawKeys := keys[clusterBenchBatch:]
	ctx := context.Background()
	sides := inTurnsFresh(b, func() {
		if _, err := s.Remove(ctx, keys); err != nil {
			b.Fatalf("Remove: %v", err)
		}
	}, func() {
		if _, err := raw.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range rawKeys {
				p.SetNX(ctx, k, items[i].Value, 0)
			}
			return nil
		}); err != nil {
			b.Fatalf("raw SET NX: %v", err)
		}
	}, func() {
		if err := putAll(s, items...); err != nil {
			b.Fatalf("Put: %v", err)
		}
	})
	reportVsRaw(b, clusterBenchBatch*len(items[0].Value), sides.store, sides.raw)
}

// BenchmarkClusterGet gets 64 framed values of 1 MiB per operation from
// the shared Redis Cluster with the store's Get, and the same keys with a
// raw go-redis ClusterClient pipeline of GET, in turns from one goroutine.
// It reports MiB/s (the store), raw_MiB/s and ratio (store/raw).
func BenchmarkClusterGet(b *testing.B) {
	url := testenv.RedisCluster(b).URL()
	s := newRedis(b, url, kvstore.RedisOptions{})
	raw := rawClusterClient(b, url)
	keys := longKeys(b, s, clusterBenchBatch)
	items := framedItems(keys)
	if err := putAll(s, items...); err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	sides := inTurns(b, func() {
		cmds, err := raw.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, k := range keys {
				p.Get(ctx, k)
			}
			return nil
		})
		if err != nil || len(cmds[0].(*redis.StringCmd).Val()) != len(items[0].Value) {
			b.Fatalf("raw GET: %v", err)
		}
	}, func() {
		values, errs, err := s.Get(ctx, keys)
		if err != nil || errs[0] != nil || len(values[0]) != len(items[0].Value) {
			b.Fatalf("Get: %v %v", err, errs[0])
		}
	})
	reportVsRaw(b, clusterBenchBatch*len(items[0].Value), sides.store, sides.raw)
}

// benchExistsVsRaw checks n keys, half of them present, per operation with
// the store and with a raw pipeline of EXISTS, alternately.
func benchExistsVsRaw(b *testing.B, s kvstore.Store, raw redis.UniversalClient, n int) {
	keys := longKeys(b, s, n)
	items := make([]kvstore.Item, 0, n/2)
	for i := 0; i < n; i += 2 {
		items = append(items, kvstore.Item{Key: keys[i], Value: []byte("v")})
	}
	if err := putAll(s, items...); err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	sides := inTurns(b, func() {
		cmds, err := raw.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, k := range keys {
				p.Exists(ctx, k)
			}
			return nil
		})
		if err != nil || len(cmds) != n {
			b.Fatalf("raw EXISTS: %v", err)
		}
	}, func() {
		found, err := s.Exists(ctx, keys)
		if err != nil || !found[0] || found[1] {
			b.Fatalf("Exists: %v", err)
		}
	})
	store, baseline, ops := sides.store, sides.raw, float64(b.N)
	b.ReportMetric(ops*float64(n)/store.Seconds(), "keys/s")
	b.ReportMetric(ops*float64(n)/baseline.Seconds(), "raw_keys/s")
	b.ReportMetric(store.Seconds()*1e6/ops, "us/call")
	b.ReportMetric(baseline.Seconds()*1e6/ops, "raw_us/call")
}

// alternate times a raw baseline and the store's operation, in turns
// going first, so that neither side always finds warm connections and caches.
type alternate struct {
	turn       int
	store, raw time.Duration
}

// inTurns runs raw and store once each untimed (connections, server
// memory), then in turns for b.Loop, and returns the time each took.
func inTurns(b *testing.B, raw, store func()) *alternate {
	return inTurnsFresh(b, nil, raw, store)
}

// inTurnsFresh is inTurns with reset, when set, run untimed before each
// turn (and before the untimed first one): writes find their keys absent.
func inTurnsFresh(b *testing.B, reset, raw, store func()) *alternate {
	fresh := func() {
		if reset != nil {
			b.StopTimer()
			reset()
			b.StartTimer()
		}
	}
	fresh()
	raw()
	store()
	a := &alternate{}
	for b.Loop() {
		fresh()
		a.run(raw, store)
	}
	return a
}

func (a *alternate) run(raw, store func()) {
	timed := func(f func(), into *time.Duration) {
		start := time.Now()
		f()
		*into += time.Since(start)
	}
	if a.turn%2 == 0 {
		timed(raw, &a.raw)
		timed(store, &a.store)
	} else {
		timed(store, &a.store)
		timed(raw, &a.raw)
	}
	a.turn++
}

// reportVsRaw reports the store's and the raw client's throughput over
// size bytes per operation, and their ratio.
func reportVsRaw(b *testing.B, size int, store, baseline time.Duration) {
	mib := float64(b.N) * float64(size) / (1 << 20)
	b.ReportMetric(mib/store.Seconds(), "MiB/s")
	b.ReportMetric(mib/baseline.Seconds(), "raw_MiB/s")
	b.ReportMetric(baseline.Seconds()/store.Seconds(), "ratio")
}

// longKeys returns n keys of the lookup's shape and length (about 100
// bytes) under a random prefix, removed from s when the benchmark ends.
func longKeys(b *testing.B, s kvstore.Store, n int) []string {
	keys := testKeys(b, s, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s%024x", keys[i][:len(keys[i])-16], i)
	}
	return keys
}

// framedItems gives each key a framed 1 MiB value of its own.
func framedItems(keys []string) []kvstore.Item {
	items := make([]kvstore.Item, len(keys))
	for i, k := range keys {
		payload := make([]byte, clusterBenchValue)
		_, _ = rand.Read(payload) // crypto/rand.Read never fails
		items[i] = kvstore.Item{Key: k, Value: dataplane.EncodeValue("bench-fingerprint", payload)}
	}
	return items
}

// rawClusterClient is a go-redis ClusterClient of the cluster at url with
// the store's default options, for baselines.
func rawClusterClient(b *testing.B, url string) *redis.ClusterClient {
	co, err := kvstore.RedisClusterOptions(url, kvstore.RedisOptions{})
	if err != nil {
		b.Fatal(err)
	}
	c := redis.NewClusterClient(co)
	b.Cleanup(func() { _ = c.Close() })
	return c
}
