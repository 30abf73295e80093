package app_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// benchBatchBytes is the data one benchmark operation moves.
const benchBatchBytes = 64 << 20

var benchSizes = []struct {
	name string
	size int
}{{"256KiB", 256 << 10}, {"1MiB", 1 << 20}, {"2MiB", 2 << 20}}

// benchWorker starts a worker serving a one-group model with blocks of size
// bytes and a pool of exactly the blocks one operation moves.
func benchWorker(b *testing.B, env *servicetest.Env, size int) *worker {
	b.Helper()
	spec := fmt.Sprintf("name: bench-%d\nhash_block_size: 16\ngroups:\n  - {kind: full_attention, block_size: 16, bytes_per_block: %d}\n", size, size)
	path := filepath.Join(b.TempDir(), "model.yaml")
	if err := os.WriteFile(path, []byte(spec), 0o600); err != nil {
		b.Fatal(err)
	}
	cfg := testConfig(env, fmt.Sprintf("engine-bench-%d", size))
	cfg.Model, cfg.PoolBlocks, cfg.MaxBatchBytes = path, benchBatchBytes/size, benchBatchBytes
	cfg.Common.LogLevel = "warn"
	return startWorker(b, cfg, nil)
}

// rawGet fetches keys with one go-redis pipeline of GETs.
func rawGet(ctx context.Context, c *redis.Client, keys []string) error {
	_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, k := range keys {
			p.Get(ctx, k)
		}
		return nil
	})
	return err
}

// rawSet stores values with one go-redis pipeline of SETs.
func rawSet(ctx context.Context, c *redis.Client, keys []string, values [][]byte) error {
	_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			p.Set(ctx, k, values[i], 0)
		}
		return nil
	})
	return err
}

// BenchmarkLoad measures load throughput, task published → bytes in the
// pool → result received, next to a raw pipelined Redis GET of the same keys
// in the same run; load/raw is the load's throughput as a fraction of raw.
func BenchmarkLoad(b *testing.B) {
	env := servicetest.NewEnv(b)
	rs := watchResults(b, env)
	p := publisher(b, env)
	rdb := redisClient(b, env.RedisURL)
	ctx := context.Background()
	for _, bs := range benchSizes {
		// Set up once per size: b.Run calls its function once per b.N tried.
		w := benchWorker(b, env, bs.size)
		n := benchBatchBytes / bs.size
		hashes := hexChain(w.model, tokens(16*n, uint32(bs.size)))
		keys := make([]string, n)
		table := kvcore.BlockTable{make([]kvcore.BlockID, n)}
		for i := range n {
			keys[i] = w.keys.KeyHex(kvcore.Rank{}, 0, hashes[i])
			table[0][i] = kvcore.BlockID(i)
			w.store(b, keys[i], dataplane.EncodeValue(w.model.Fingerprint(), w.randomBlock(0)))
		}
		b.Run(bs.name, func(b *testing.B) {
			var raw, loaded time.Duration
			b.SetBytes(benchBatchBytes)
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				if err := rawGet(ctx, rdb, keys); err != nil {
					b.Fatal(err)
				}
				raw += time.Since(start)
				task := w.loadTask(hashes, 16*n, table)
				start = time.Now()
				publishTask(b, p, task)
				if res := rs.wait(b, task.TaskID); len(res.LoadErrors) != 0 {
					b.Fatalf("load errors %v", res.LoadErrors)
				}
				loaded += time.Since(start)
			}
			reportRatio(b, "load", loaded, raw)
		})
	}
}

// BenchmarkPut measures the data plane's put (pool → framed values in
// Redis) next to a raw pipelined Redis SET of the same framed values.
func BenchmarkPut(b *testing.B) {
	env := servicetest.NewEnv(b)
	rdb := redisClient(b, env.RedisURL)
	ctx := context.Background()
	for _, bs := range benchSizes {
		// Set up once per size: b.Run calls its function once per b.N tried.
		w := benchWorker(b, env, bs.size)
		n := benchBatchBytes / bs.size
		hashes := hexChain(w.model, tokens(16*n, uint32(bs.size)+1))
		items := make([]dataplane.PutItem, n)
		rawKeys := make([]string, n)
		values := make([][]byte, n)
		var blocks []dataplane.Block
		for i := range n {
			ref := dataplane.BlockRef{Group: 0, Block: kvcore.BlockID(i)}
			data := w.randomBlock(0)
			blocks = append(blocks, dataplane.Block{BlockRef: ref, Identity: dataplane.Identity{Hash: hashes[i]}, Data: data})
			items[i] = dataplane.PutItem{BlockRef: ref, Key: w.keys.KeyHex(kvcore.Rank{}, 0, hashes[i]), Hash: hashes[i]}
			rawKeys[i] = items[i].Key + "-raw"
			values[i] = dataplane.EncodeValue(w.model.Fingerprint(), data)
		}
		if err := w.client.Write(ctx, blocks); err != nil {
			b.Fatal(err)
		}
		b.Run(bs.name, func(b *testing.B) {
			var raw, put time.Duration
			b.SetBytes(benchBatchBytes)
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				if err := rawSet(ctx, rdb, rawKeys, values); err != nil {
					b.Fatal(err)
				}
				raw += time.Since(start)
				start = time.Now()
				res, _, err := w.client.Put(ctx, items)
				if err != nil || res[n-1].Status != dataplane.PutStored {
					b.Fatalf("put: %v %+v", err, res[n-1])
				}
				put += time.Since(start)
			}
			reportRatio(b, "put", put, raw)
		})
	}
}

// reportRatio reports both throughputs and their ratio.
func reportRatio(b *testing.B, what string, kvmesh, raw time.Duration) {
	mb := float64(b.N) * benchBatchBytes / (1 << 20)
	b.ReportMetric(mb/kvmesh.Seconds(), what+"_MiB/s")
	b.ReportMetric(mb/raw.Seconds(), "raw_MiB/s")
	b.ReportMetric(raw.Seconds()/kvmesh.Seconds(), what+"/raw")
}
