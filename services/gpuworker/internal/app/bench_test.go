package app_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/dataplaneapi"
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
	cfg.StoreStreams, cfg.StreamChunkBytes = benchStreams, benchChunkBytes
	cfg.Common.LogLevel = "warn"
	return startWorker(b, cfg, nil)
}

// The benchmark worker's streaming settings, which the raw baselines copy:
// as many concurrent pipelines, each of at most as many value bytes. They
// are the defaults unless KVMESH_STORE_STREAMS or KVMESH_STREAM_CHUNK_BYTES
// is set (KVMESH_STORE_STREAMS=1 KVMESH_STREAM_CHUNK_BYTES=67108864 plays
// the unstreamed data plane: one whole-batch frame, one pipeline).
var (
	benchStreams    = benchSetting("KVMESH_STORE_STREAMS", dataplaneapi.DefaultStoreStreams)
	benchChunkBytes = benchSetting("KVMESH_STREAM_CHUNK_BYTES", dataplaneapi.DefaultStreamChunkBytes)
)

// benchSetting is the positive integer in environment variable name, else def.
func benchSetting(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// rawParallel cuts n values of size bytes into sub-batches of at most
// benchChunkBytes (at least one value each) and runs do on each, at most
// benchStreams at once: the same parallelism as the worker's puts and loads.
func rawParallel(n, size int, do func(lo, hi int) error) error {
	var g errgroup.Group
	g.SetLimit(benchStreams)
	per := max(1, benchChunkBytes/size)
	for lo := 0; lo < n; lo += per {
		hi := min(n, lo+per)
		g.Go(func() error { return do(lo, hi) })
	}
	return g.Wait()
}

// rawGet fetches keys with go-redis pipelines of GETs, benchStreams at once.
func rawGet(ctx context.Context, c *redis.Client, keys []string, size int) error {
	return rawParallel(len(keys), size, func(lo, hi int) error {
		_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, k := range keys[lo:hi] {
				p.Get(ctx, k)
			}
			return nil
		})
		return err
	})
}

// rawSet stores values with go-redis pipelines of SET NX (as the store
// writes, values once), benchStreams at once.
func rawSet(ctx context.Context, c *redis.Client, keys []string, values [][]byte) error {
	return rawParallel(len(keys), len(values[0]), func(lo, hi int) error {
		_, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i := lo; i < hi; i++ {
				p.SetNX(ctx, keys[i], values[i], 0)
			}
			return nil
		})
		return err
	})
}

// loadSlots is how many load tasks BenchmarkLoad keeps in flight, each
// into blocks of its own: benchBatchBytes/loadSlots per task.
const loadSlots = 2

// loadSlot is one in-flight slot of BenchmarkLoad: its stored keys, and the
// hash chain and block table of its tasks.
type loadSlot struct {
	keys   []string
	hashes []string
	table  kvcore.BlockTable
}

// BenchmarkLoad measures load throughput as a steady stream: loadSlots
// load tasks in flight (the next published as a result arrives), each of
// benchBatchBytes/loadSlots into blocks of its own, timed from the first
// publish to the last result, next to raw pipelined Redis GETs of the same
// keys at the same parallelism (the worker loads one task at a time, in
// benchStreams sub-batches of at most benchChunkBytes at once; so do the
// raw GETs) in the same run; load/raw is the load's throughput as a
// fraction of raw.
//
// It also reports the CPU each side spends per GiB of block bytes loaded,
// read from the kernel around every timed part: cpu_s/GiB is the load's —
// this test process (the gpuworker, the embedded broker, and the test's own
// task producer and result consumer), the PostgreSQL backends of the
// benchmark's own database and the benchmark's own Redis server — and
// raw_cpu_s/GiB the baseline's — this process (the go-redis client) and
// that Redis server; cpu/raw is their ratio. The parts are reported too
// (self_, pg_, redis_cpu_s/GiB; raw_self_, raw_redis_cpu_s/GiB), and apart,
// not in cpu_s/GiB, the whole PostgreSQL server's during the load
// (pg_server_cpu_s/GiB, every other test's work on it included).
// machine_busy is the machine's busy fraction over the benchmark: on a busy
// shared machine every figure grows with contention.
func BenchmarkLoad(b *testing.B) {
	env := servicetest.NewEnv(b)
	// A Redis server of its own: the shared one serves other tests, whose
	// work would count in the CPU figures.
	env.RedisURL = testenv.StartRedis(b).URL()
	rs := watchResults(b, env)
	p := publisher(b, env)
	rdb := redisClient(b, env.RedisURL)
	ctx := context.Background()
	meter, server := loadMeter(b, env)
	for _, bs := range benchSizes {
		// Set up once per size: b.Run calls its function once per b.N tried.
		w := benchWorker(b, env, bs.size)
		per := benchBatchBytes / bs.size / loadSlots
		slots := make([]loadSlot, loadSlots)
		for s := range slots {
			sl := &slots[s]
			sl.hashes = hexChain(w.model, tokens(16*per, uint32(bs.size+s)))
			sl.table = kvcore.BlockTable{make([]kvcore.BlockID, per)}
			for i := range per {
				sl.keys = append(sl.keys, w.keys.KeyHex(kvcore.Rank{}, 0, sl.hashes[i]))
				sl.table[0][i] = kvcore.BlockID(s*per + i)
				w.store(b, sl.keys[i], dataplane.EncodeValue(w.model.Fingerprint(), w.randomBlock(0)))
			}
		}
		valueSize := bs.size + dataplane.ValueOverhead(len(w.model.Fingerprint()))
		b.Run(bs.name, func(b *testing.B) {
			cpu, rawCPU, serverCPU := testenv.CPUReading{}, testenv.CPUReading{}, testenv.CPUReading{}
			machine := testenv.WatchMachineBusy(b)
			b.SetBytes(benchBatchBytes / loadSlots)
			b.ResetTimer()
			var loaded, raw time.Duration
			for lo := 0; lo < b.N; lo += loadRound {
				ops := min(loadRound, b.N-lo)
				server0, before := testenv.ReadCPU(b, server), testenv.ReadCPU(b, meter)
				loaded += loadStream(b, w, p, rs, slots, per, ops)
				cpu.Add(before, testenv.ReadCPU(b, meter))
				serverCPU.Add(server0, testenv.ReadCPU(b, server))
				b.StopTimer() // MB/s is the load's alone
				before = testenv.ReadCPU(b, meter)
				start := time.Now()
				for i := range ops {
					if err := rawGet(ctx, rdb, slots[i%loadSlots].keys, valueSize); err != nil {
						b.Fatal(err)
					}
				}
				raw += time.Since(start)
				rawCPU.Add(before, testenv.ReadCPU(b, meter))
				b.StartTimer()
			}
			b.StopTimer()
			reportRatio(b, "load", benchBatchBytes/loadSlots, loaded, raw)
			delete(rawCPU, "pg") // the baseline is the client and Redis
			testenv.ReportCPUPerGiB(b, float64(b.N)*benchBatchBytes/loadSlots, cpu, rawCPU, serverCPU)
			machine()
		})
	}
}

// loadRound is how many load tasks BenchmarkLoad streams before the raw
// GETs of as many: rounds of both, so that both see the same load on a
// shared machine. Each round's stream starts full and drains at its end.
const loadRound = 8

// loadStream streams ops load tasks over the slots, loadSlots in flight,
// and returns the time from the first publish to the last result.
func loadStream(b *testing.B, w *worker, p *bus.Producer, rs *results, slots []loadSlot, per, ops int) time.Duration {
	b.Helper()
	start := time.Now()
	var inFlight []string // task ids, oldest first: one worker loads them in order
	for i := range ops {
		if len(inFlight) == loadSlots {
			waitLoad(b, rs, inFlight[0])
			inFlight = inFlight[1:]
		}
		sl := slots[i%loadSlots]
		task := w.loadTask(sl.hashes, 16*per, sl.table)
		publishTask(b, p, task)
		inFlight = append(inFlight, task.TaskID)
	}
	for _, id := range inFlight {
		waitLoad(b, rs, id)
	}
	return time.Since(start)
}

// waitLoad waits for the result of load task id and fails on load errors.
func waitLoad(b *testing.B, rs *results, id string) {
	b.Helper()
	if res := rs.wait(b, id); len(res.LoadErrors) != 0 {
		b.Fatalf("load errors %v", res.LoadErrors)
	}
}

// BenchmarkPut measures the data plane's put (pool → framed values in
// Redis) next to raw pipelined Redis SET NXs of the same framed values at
// the same parallelism, both into absent keys. Its CPU figures are as
// BenchmarkLoad's: this process (the worker, and the test's data-plane
// client) and Redis (and PostgreSQL, idle here) for the put; this process
// (the go-redis client) and Redis for the raw SETs.
func BenchmarkPut(b *testing.B) {
	env := servicetest.NewEnv(b)
	env.RedisURL = testenv.StartRedis(b).URL() // as BenchmarkLoad's
	rdb := redisClient(b, env.RedisURL)
	ctx := context.Background()
	meter, server := loadMeter(b, env)
	for _, bs := range benchSizes {
		// Set up once per size: b.Run calls its function once per b.N tried.
		w := benchWorker(b, env, bs.size)
		n := benchBatchBytes / bs.size
		hashes := hexChain(w.model, tokens(16*n, uint32(bs.size)+1))
		items := make([]dataplane.PutItem, n)
		putKeys := make([]string, n)
		rawKeys := make([]string, n)
		values := make([][]byte, n)
		var blocks []dataplane.Block
		for i := range n {
			ref := dataplane.BlockRef{Group: 0, Block: kvcore.BlockID(i)}
			data := w.randomBlock(0)
			blocks = append(blocks, dataplane.Block{BlockRef: ref, Identity: dataplane.Identity{Hash: hashes[i]}, Data: data})
			items[i] = dataplane.PutItem{BlockRef: ref, Key: w.keys.KeyHex(kvcore.Rank{}, 0, hashes[i]), Hash: hashes[i]}
			putKeys[i] = items[i].Key
			rawKeys[i] = items[i].Key + "-raw"
			values[i] = dataplane.EncodeValue(w.model.Fingerprint(), data)
		}
		if err := w.client.Write(ctx, blocks); err != nil {
			b.Fatal(err)
		}
		b.Run(bs.name, func(b *testing.B) {
			var raw, put time.Duration
			cpu, rawCPU, serverCPU := testenv.CPUReading{}, testenv.CPUReading{}, testenv.CPUReading{}
			b.SetBytes(benchBatchBytes)
			b.ResetTimer()
			for range b.N {
				// Values are written once: both sides write absent keys
				// (removed outside the timed parts).
				if err := rdb.Del(ctx, append(slices.Clone(rawKeys), putKeys...)...).Err(); err != nil {
					b.Fatal(err)
				}
				before := testenv.ReadCPU(b, meter)
				start := time.Now()
				if err := rawSet(ctx, rdb, rawKeys, values); err != nil {
					b.Fatal(err)
				}
				raw += time.Since(start)
				mid := testenv.ReadCPU(b, meter)
				rawCPU.Add(before, mid)
				server0 := testenv.ReadCPU(b, server)
				start = time.Now()
				res, _, err := w.client.Put(ctx, items)
				if err != nil || res[n-1].Status != dataplane.PutStored {
					b.Fatalf("put: %v %+v", err, res[n-1])
				}
				put += time.Since(start)
				cpu.Add(mid, testenv.ReadCPU(b, meter))
				serverCPU.Add(server0, testenv.ReadCPU(b, server))
			}
			b.StopTimer()
			reportRatio(b, "put", benchBatchBytes, put, raw)
			delete(rawCPU, "pg")
			testenv.ReportCPUPerGiB(b, float64(b.N)*benchBatchBytes, cpu, rawCPU, serverCPU)
		})
	}
}

// reportRatio reports both throughputs of b.N operations of perOp bytes
// and their ratio.
func reportRatio(b *testing.B, what string, perOp int, kvmesh, raw time.Duration) {
	mb := float64(b.N) * float64(perOp) / (1 << 20)
	b.ReportMetric(mb/kvmesh.Seconds(), what+"_MiB/s")
	b.ReportMetric(mb/raw.Seconds(), "raw_MiB/s")
	b.ReportMetric(raw.Seconds()/kvmesh.Seconds(), what+"/raw")
}

// loadMeter reads the CPU of every process a load uses: this process
// (self: the gpuworker, the broker, the test's clients), the PostgreSQL
// backends of the benchmark's database (pg) and the benchmark's own Redis
// server; and, apart (pg_server), the whole PostgreSQL server's, which
// other tests share.
func loadMeter(b *testing.B, env *servicetest.Env) (meter, server testenv.CPUMeter) {
	b.Helper()
	return testenv.ServerMeters(b, env.DatabaseURL, env.RedisURL)
}
