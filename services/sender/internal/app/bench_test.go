package app_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/services/sender/internal/app"
)

// benchWindow is how many tasks are in flight at once; their keys are
// deleted between windows (outside the timer), which bounds the store's
// memory at benchWindow × benchChunks × block size.
const (
	benchWindow = 8
	benchChunks = 4 // blocks per task: tokens [0, 64) of a bs-16 group
)

// BenchmarkSaveThroughput measures save tasks end to end (task on Kafka →
// sender → gpuworker put → bytes in Redis → result reported) for one
// full-attention group of 256 KiB, 1 MiB and 2 MiB blocks, next to raw
// pipelined Redis SETs of the same values measured in the same run.
// Metrics: MB/s (the sender's), raw_set_MB/s and ratio_vs_raw_set.
func BenchmarkSaveThroughput(b *testing.B) {
	for _, size := range []int{256 << 10, 1 << 20, 2 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			s := benchStack(b, size) // once per size: a benchmark with sub-benchmarks runs once
			s.noWrites = true        // benchSave writes each window's blocks, untimed
			b.Run("sender", func(b *testing.B) { benchSave(b, s, size) })
		})
	}
}

// benchSave saves b.N tasks of benchChunks blocks in windows of
// benchWindow. Before each window the same number of values is SET raw, so
// both see the same load on a shared machine, and (untimed) each task's
// blocks are written into the pool as its chunks: the tasks of a window
// have blocks of their own, since a block holds one chunk at a time.
func benchSave(b *testing.B, s *stack, size int) {
	run := randHex(4) // task ids differ between the framework's runs
	tasks := make([]*kvcore.SaveTask, 0, b.N)
	for i := range b.N {
		id := "bench-" + run + "-" + strconv.Itoa(i)
		tasks = append(tasks, s.task(b, "e1", id, 0, 16*benchChunks, kvcore.BlockID(i%benchWindow*benchChunks)))
	}
	raw := newRawSetter(b, s.redis, size)
	b.SetBytes(int64(benchChunks * size))
	b.ResetTimer()
	var busy, rawBusy time.Duration
	for w := 0; w < len(tasks); w += benchWindow {
		window := tasks[w:min(w+benchWindow, len(tasks))]
		b.StopTimer()
		rawBusy += raw.set(b, len(window)*benchChunks)
		for _, t := range window {
			s.writeBlocks(b, t)
		}
		b.StartTimer()
		start := time.Now()
		s.publish(b, window...)
		for _, t := range window {
			if r := s.got.result(b, t.TaskID); r.Status != "stored" {
				b.Fatalf("task %s: %+v", t.TaskID, r)
			}
		}
		busy += time.Since(start)
		b.StopTimer()
		s.dropKeys(b, window)
		b.StartTimer()
	}
	mb := float64(b.N*benchChunks*size) / 1e6
	b.ReportMetric(mb/rawBusy.Seconds(), "raw_set_MB/s")
	b.ReportMetric(rawBusy.Seconds()/busy.Seconds(), "ratio_vs_raw_set")
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
	return newStack(b, stackOptions{engines: []string{"e1"}, modelFile: path,
		config: func(c *app.Config) { c.Consumers = 2 }})
}

// rawSetter SETs values of one size to Redis in one pipeline, as a
// baseline for the sender's throughput.
type rawSetter struct {
	c     *redis.Client
	value []byte
	n     int
}

func newRawSetter(b *testing.B, url string, size int) *rawSetter {
	b.Helper()
	opts, err := redis.ParseURL(url)
	if err != nil {
		b.Fatal(err)
	}
	r := &rawSetter{c: redis.NewClient(opts), value: make([]byte, size)}
	b.Cleanup(func() { _ = r.c.Close() })
	return r
}

// set times n pipelined SETs of fresh keys, then deletes them untimed.
func (r *rawSetter) set(b *testing.B, n int) time.Duration {
	b.Helper()
	ctx := context.Background()
	keys := make([]string, n)
	for i := range keys {
		r.n++
		keys[i] = "bench-raw-" + strconv.Itoa(r.n)
	}
	start := time.Now()
	_, err := r.c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, k := range keys {
			p.Set(ctx, k, r.value, 0)
		}
		return nil
	})
	took := time.Since(start)
	if err != nil {
		b.Fatal(err)
	}
	if err := r.c.Unlink(ctx, keys...).Err(); err != nil {
		b.Fatal(err)
	}
	return took
}

// dropKeys deletes the tasks' store keys.
func (s *stack) dropKeys(t testing.TB, tasks []*kvcore.SaveTask) {
	t.Helper()
	var keys []string
	for _, task := range tasks {
		for g := range s.model.Groups {
			keys = append(keys, s.keys(t, task, g)...)
		}
	}
	if _, err := s.store.Remove(context.Background(), keys); err != nil {
		t.Fatal(err)
	}
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
