package app_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// The save benchmark's stream: benchInFlight tasks in flight at once, each
// of benchChunks blocks (tokens [0, 16×benchChunks) of a bs-16 group) in
// blocks of its own slot of the pool. The raw baseline runs as many
// pipelines at once, each of one task's values, so both move the same
// bytes with the same parallelism.
const (
	benchInFlight = 8
	benchChunks   = 16
)

// BenchmarkSaveThroughput measures the store throughput of a steady stream
// of save tasks end to end (task on Kafka → sender → gpuworker put → bytes
// in Redis → result reported) for one full-attention group of 256 KiB,
// 1 MiB and 2 MiB blocks: benchInFlight tasks are kept in flight (the next
// one is published as a result arrives) and the clock runs from the first
// publish to the last result. The baseline is a stream of raw pipelined
// Redis SETs of the same values with the same parallelism, measured in
// the same run. Stored keys are deleted (UNLINK) as each task or pipeline
// completes, on both sides, so the store never fills. Metrics: MB/s (the
// stream's), raw_set_MB/s and ratio_vs_raw_set.
//
// It also reports the CPU each side spends per GiB of block bytes stored,
// read from the kernel around every timed part (see saveMeter):
// cpu_s/GiB is the stream's — this test process (the sender, the embedded
// broker, and the test's own task producer and result consumer), the
// gpuworker subprocess, the PostgreSQL backends of the benchmark's own
// database and the benchmark's own Redis server — and raw_cpu_s/GiB the
// baseline's — this process (the go-redis client) and that Redis server;
// cpu/raw is their ratio. The parts are reported too (self_, gpuworker_,
// pg_, redis_cpu_s/GiB; raw_self_, raw_redis_cpu_s/GiB), and apart, not in
// cpu_s/GiB, the whole PostgreSQL server's during the stream
// (pg_server_cpu_s/GiB: with its WAL writer and checkpointer, and every
// other test's work on the shared server). machine_busy is the machine's
// busy fraction over the benchmark: on a busy shared machine every figure
// grows with contention (caches, scheduling).
func BenchmarkSaveThroughput(b *testing.B) {
	for _, size := range []int{256 << 10, 1 << 20, 2 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			s := benchStack(b, size) // once per size: a benchmark with sub-benchmarks runs once
			slots := s.benchSlots(b)
			b.Run("sender", func(b *testing.B) { benchSave(b, s, slots, size) })
		})
	}
}

// benchSlots writes the pool blocks of each in-flight slot once, as the
// chunks of tokens of its own: every task of a slot saves those chunks
// (under a request id of its own), so the engine's writes into the pool,
// which are not part of a save, stay out of the timed stream.
func (s *stack) benchSlots(b *testing.B) [][]uint32 {
	b.Helper()
	slots := make([][]uint32, benchInFlight)
	for i := range slots {
		slots[i] = tokensFor(s.prefix+"slot-"+strconv.Itoa(i), 16*benchChunks)
		s.writeBlocks(b, s.taskWithTokens(b, "e1", "slot-"+strconv.Itoa(i), slots[i], 0, 16*benchChunks, s.slotBase(i)))
	}
	s.noWrites = true
	return slots
}

// slotBase is the first pool block of slot i.
func (s *stack) slotBase(i int) kvcore.BlockID { return kvcore.BlockID(i * benchChunks) }

// saveRound is how many save tasks benchSave streams before the raw SETs
// of as many: rounds of both, so that both see the same load on a shared
// machine. Each round's stream starts full and drains at its end.
const saveRound = 8 * benchInFlight

// benchSave streams b.N save tasks and the same bytes as raw SETs, in
// rounds of saveRound.
func benchSave(b *testing.B, s *stack, slots [][]uint32, size int) {
	rdb := newRawClient(b, s.redis)
	run := randHex(4) // request ids differ between the framework's runs
	meter, server := s.saveMeter(b)
	cpu, rawCPU, serverCPU := testenv.CPUReading{}, testenv.CPUReading{}, testenv.CPUReading{}
	machine := testenv.WatchMachineBusy(b)
	b.SetBytes(int64(benchChunks * size))
	b.ResetTimer()
	var busy, rawBusy time.Duration
	for lo := 0; lo < b.N; lo += saveRound {
		n := min(saveRound, b.N-lo)
		server0 := testenv.ReadCPU(b, server)
		busy += s.saveStream(b, rdb, slots, run+"-"+strconv.Itoa(lo), n, meter, cpu)
		serverCPU.Add(server0, testenv.ReadCPU(b, server))
		b.StopTimer() // MB/s is the stream's alone
		rawBusy += rawSetStream(b, rdb, n, size, meter, rawCPU)
		b.StartTimer()
	}
	b.StopTimer()
	mb := float64(b.N*benchChunks*size) / 1e6
	b.ReportMetric(mb/rawBusy.Seconds(), "raw_set_MB/s")
	b.ReportMetric(rawBusy.Seconds()/busy.Seconds(), "ratio_vs_raw_set")
	// The baseline is the client and Redis: the mesh's idle processes are
	// not its cost.
	delete(rawCPU, "gpuworker")
	delete(rawCPU, "pg")
	testenv.ReportCPUPerGiB(b, float64(b.N*benchChunks*size), cpu, rawCPU, serverCPU)
	machine()
}

// saveMeter reads the CPU of every process a save uses: this process
// (self: the sender, the broker, the test's clients), the gpuworker
// subprocess, the PostgreSQL backends of the benchmark's database (pg)
// and the benchmark's own Redis server; and, apart (pg_server), the whole
// PostgreSQL server's, which other tests share.
func (s *stack) saveMeter(b *testing.B) (meter, server testenv.CPUMeter) {
	b.Helper()
	s.mu.Lock()
	worker := s.procs["e1"].cmd.Process.Pid
	s.mu.Unlock()
	meter, server = testenv.ServerMeters(b, s.env.DatabaseURL, s.redis)
	meter["gpuworker"] = testenv.ProcessCPUFunc(worker)
	return meter, server
}

// saveStream streams n tasks, benchInFlight at once: each in-flight slot
// runs in its own goroutine, as concurrent engines do, publishing its
// next task, waiting for its result and unlinking its keys, like each raw
// pipeline of rawSetStream. Tasks, records and keys are built before the
// clock starts. It returns the time from the first publish to the last
// result.
func (s *stack) saveStream(b *testing.B, rdb *redis.Client, slots [][]uint32, run string, n int, meter testenv.CPUMeter, cpu testenv.CPUReading) time.Duration {
	b.Helper()
	work := make([][]slotTask, benchInFlight) // each slot's tasks, in order
	for i := range n {
		slot := i % benchInFlight
		t := s.taskWithTokens(b, "e1", "bench-"+run+"-"+strconv.Itoa(i), slots[slot], 0, 16*benchChunks, s.slotBase(slot))
		work[slot] = append(work[slot], slotTask{task: t, msg: s.taskMessage(b, t), keys: s.keys(b, t, 0)})
	}
	ctx := context.Background()
	var g errgroup.Group
	before := testenv.ReadCPU(b, meter)
	start := time.Now()
	for _, tasks := range work {
		g.Go(func() error {
			for _, st := range tasks {
				if err := s.saveOne(ctx, rdb, st); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	took := time.Since(start)
	cpu.Add(before, testenv.ReadCPU(b, meter))
	return took
}

// saveOne publishes one task, waits for its result (stored, within
// waitFor) and unlinks its keys.
func (s *stack) saveOne(ctx context.Context, rdb *redis.Client, st slotTask) error {
	res := s.got.await(st.task.TaskID)
	if err := s.producer.Publish(ctx, st.msg); err != nil {
		return err
	}
	select {
	case r := <-res:
		if r.Status != "stored" {
			return fmt.Errorf("task %s: %+v", r.TaskID, r)
		}
	case <-time.After(waitFor):
		return fmt.Errorf("no save result for %s within %v", st.task.TaskID, waitFor)
	}
	return rdb.Unlink(ctx, st.keys...).Err()
}

// slotTask is one task of a slot: the task, its record and its keys.
type slotTask struct {
	task *kvcore.SaveTask
	msg  bus.Message
	keys []string
}

// rawSetStream SETs (NX) the values of n tasks (benchChunks values of size
// bytes each, one pipeline per task) benchInFlight pipelines at once, each
// pipeline's keys unlinked as it completes, and returns the time taken.
func rawSetStream(b *testing.B, rdb *redis.Client, n, size int, meter testenv.CPUMeter, cpu testenv.CPUReading) time.Duration {
	b.Helper()
	ctx := context.Background()
	value := make([]byte, size)
	_, _ = rand.Read(value)
	prefix := "bench-raw-" + randHex(4) + "-"
	var g errgroup.Group
	g.SetLimit(benchInFlight)
	before := testenv.ReadCPU(b, meter)
	start := time.Now()
	for i := range n {
		g.Go(func() error {
			keys := make([]string, benchChunks)
			_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				for j := range keys {
					keys[j] = prefix + strconv.Itoa(i*benchChunks+j)
					p.SetNX(ctx, keys[j], value, 0) // as the store writes: values once
				}
				return nil
			})
			if err != nil {
				return err
			}
			return rdb.Unlink(ctx, keys...).Err()
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	took := time.Since(start)
	cpu.Add(before, testenv.ReadCPU(b, meter))
	return took
}

// newRawClient is a go-redis client of url, closed when b ends.
func newRawClient(b *testing.B, url string) *redis.Client {
	b.Helper()
	opts, err := redis.ParseURL(url)
	if err != nil {
		b.Fatal(err)
	}
	c := redis.NewClient(opts)
	b.Cleanup(func() { _ = c.Close() })
	return c
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return fmt.Sprintf("%dMiB", n>>20)
	}
	return fmt.Sprintf("%dKiB", n>>10)
}

// benchStack runs the mesh part with a one-group model of the given block size.
func benchStack(b *testing.B, size int) *stack {
	b.Helper()
	spec := fmt.Sprintf("name: bench-%d\nhash_block_size: 16\ngroups:\n  - {kind: full_attention, block_size: 16, bytes_per_block: %d}\n", size, size)
	path := filepath.Join(b.TempDir(), "model.yaml")
	if err := os.WriteFile(path, []byte(spec), 0o644); err != nil {
		b.Fatal(err)
	}
	// The worker runs as in production (info logs, not the tests' debug)
	// with as many store streams as the raw baseline has pipelines: the
	// same parallelism on both sides.
	// A Redis server of its own: the shared one serves other tests, whose
	// work would count in the benchmark's CPU figures.
	return newStack(b, stackOptions{engines: []string{"e1"}, modelFile: path, poolBlocks: benchInFlight * benchChunks,
		workerRedis: testenv.StartRedis(b).URL(),
		config:      func(c *app.Config) { c.Consumers, c.Concurrency = 2, benchInFlight/2 },
		workerEnv:   map[string]string{"KVMESH_STORE_STREAMS": strconv.Itoa(benchInFlight), "KVMESH_LOG_LEVEL": "info"}})
}

// BenchmarkDeadLetterMalformedTask measures the end-to-end cost of one
// malformed task (a 1-group table for the 2-group model with group 0's
// table too short too, so both groups are dead-lettered): task on Kafka →
// two dead letters, outcome and messages committed → result reported.
func BenchmarkDeadLetterMalformedTask(b *testing.B) {
	s := newStack(b, stackOptions{engines: []string{"e1"}})
	s.noWrites = true
	b.Run("end-to-end", func(b *testing.B) {
		run := randHex(4)
		tasks := make([]*kvcore.SaveTask, b.N)
		for i := range b.N {
			tasks[i] = s.task(b, "e1", "bad-"+run+"-"+strconv.Itoa(i), 0, 32, 0)
			tasks[i].BlockTable = kvcore.BlockTable{{0}}
		}
		b.ResetTimer()
		s.publish(b, tasks...)
		for _, t := range tasks {
			if r := s.got.result(b, t.TaskID); r.Status != "dead_lettered" || len(r.Groups) != 2 {
				b.Fatalf("task %s: %+v", t.TaskID, r)
			}
		}
	})
}
