package kvstore_test

import (
	"context"
	"testing"

	"github.com/kvmesh/kvmesh/internal/testenv"
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

// benchPut puts one value of size bytes per operation.
func benchPut(b *testing.B, s kvstore.Store, size int) {
	keys := testKeys(b, s, benchKeys)
	value := make([]byte, size)
	ctx := context.Background()
	b.SetBytes(int64(size))
	for i := 0; b.Loop(); i++ {
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
