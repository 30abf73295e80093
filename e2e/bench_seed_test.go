package e2e

import (
	"bufio"
	"context"
	"crypto/rand"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

// seedBenchModel is the model of BenchmarkSeedSaturated: the seed preset's
// hybrid-mla-linear at TP1 rather than TP8. Two TP8 engines are sixteen
// gpuworker processes, which with the other services, Redis and the
// simulator do not fit a 2-core machine; the groups, block sizes, workload
// and connector chain are the seed's.
const seedBenchModel = "hybrid-mla-linear"

// seedRawStreams is how many raw SET pipelines run at once in the
// baseline: KVMESH_STORE_STREAMS' default, the concurrent store calls of
// one gpuworker put.
const seedRawStreams = 4

// seedRawPipelineBytes bounds the value bytes of one raw pipeline
// (KVMESH_STREAM_CHUNK_BYTES' default).
const seedRawPipelineBytes = 4 << 20

// BenchmarkSeedSaturated plays the seed preset's workload with every
// conversation started at once (kvmesh sim --rate 0) against the full
// mesh — lookup, scheduler, sender, a decode and a prefill gpuworker, pd,store
// chain — and measures the store bytes the gpuworkers moved (the growth of
// kvmesh_store_bytes_total, save_put plus load_get, over both workers)
// over the run's wall time, next to raw pipelined Redis SETs of the same
// number of bytes in values of the model's block sizes, seedRawStreams
// pipelines at once, in the same run. Metrics: store_MB/s, raw_set_MB/s,
// ratio_vs_raw_set. One operation is one whole run.
func BenchmarkSeedSaturated(b *testing.B) {
	p, ok := sim.LookupPreset("seed")
	if !ok {
		b.Fatal("no seed preset")
	}
	m, err := kvcore.Preset(seedBenchModel)
	if err != nil {
		b.Fatal(err)
	}
	mesh := startSeedMesh(b)
	workers := []string{mesh.Procs.Process("gpuworker").URL(), mesh.Procs.Process("gpuworker-prefill").URL()}
	rdb := redis.NewClient(mustParseRedis(b, mesh.RedisURL))
	b.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	var moved int64
	var busy, rawBusy time.Duration
	b.ResetTimer()
	for range b.N {
		before := storeBytes(b, workers)
		w := p.Workload
		w.Rate = 0
		tag := sim.NewRunTag()
		cfg := sim.Config{
			Model: m, Workload: w, PD: p.PD, Engine: p.Engine, ReusePreempted: p.ReusePreempted,
			Decode:     sim.Endpoint{WorkerURL: workers[0]},
			Prefill:    sim.Endpoint{WorkerURL: workers[1]},
			LookupURLs: []string{mesh.Procs.Process("lookup").URL()}, SchedulerURLs: []string{mesh.Procs.Process("scheduler").URL()},
			SenderURLs: []string{mesh.Procs.Process("sender").URL()},
			Brokers:    mesh.Brokers, RunTag: tag, Salt: tag, RedisURL: mesh.RedisURL,
			RequestTimeout: 2 * time.Minute, SettleTimeout: time.Minute,
			Credentials: &sim.Credentials{Engine: sim.MintEngineTokens(mesh.AuthKey), Operator: mesh.AdminToken},
		}
		start := time.Now()
		rep, err := sim.Run(ctx, cfg)
		took := time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if !rep.OK || rep.Requests.Failed != 0 {
			b.Fatalf("seed run not clean: %d of %d requests failed", rep.Requests.Failed, rep.Requests.Total)
		}
		n := storeBytes(b, workers) - before
		if n <= 0 {
			b.Fatal("the run moved no store bytes")
		}
		b.Logf("run of %d requests in %.1fs: %d store bytes moved; results: %d saved, %d loaded (pd and store); %d computed into the pools; tokens loaded %v",
			rep.Requests.Total, took.Seconds(), n, rep.Bytes.Saved, rep.Bytes.Loaded, rep.Bytes.Computed, rep.Tokens.Loaded)
		moved += n
		busy += took
		b.StopTimer()
		rawBusy += rawSetBytes(b, rdb, m, n)
		b.StartTimer()
	}
	b.StopTimer()
	mb := float64(moved) / 1e6
	b.ReportMetric(mb/busy.Seconds(), "store_MB/s")
	b.ReportMetric(mb/rawBusy.Seconds(), "raw_set_MB/s")
	b.ReportMetric(rawBusy.Seconds()/busy.Seconds(), "ratio_vs_raw_set")
}

// startSeedMesh starts the services of the seed's configuration at TP1,
// with env's settings added, and waits until each is ready.
func startSeedMesh(b *testing.B, env ...string) *meshtest.Mesh {
	b.Helper()
	mesh := meshtest.New(b, "bench-seed", append([]string{"KVMESH_MODEL=" + seedBenchModel, "KVMESH_LOG_LEVEL=info"}, env...)...)
	start := func(name, service string, env ...string) {
		if _, err := mesh.Start(name, service, env...); err != nil {
			b.Fatal(err)
		}
	}
	start("scheduler", "scheduler", "KVMESH_MIGRATE=true") // first: it migrates the database
	start("lookup", "lookup", "KVMESH_LOOKUP_CONNECTORS=pd,store")
	start("sender", "sender")
	start("gpuworker", "gpuworker", "KVMESH_ENGINE_ID="+decodeEngine)
	start("gpuworker-prefill", "gpuworker", "KVMESH_ENGINE_ID="+prefillEngine)
	return mesh
}

// storeBytes sums kvmesh_store_bytes_total (save_put and load_get) over
// the workers' /metrics.
func storeBytes(b *testing.B, workers []string) int64 {
	b.Helper()
	var sum float64
	for _, u := range workers {
		resp, err := http.Get(u + "/metrics")
		if err != nil {
			b.Fatal(err)
		}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line := sc.Text()
			for _, op := range []string{"save_put", "load_get"} {
				if v, ok := strings.CutPrefix(line, `kvmesh_store_bytes_total{op="`+op+`"} `); ok {
					f, err := strconv.ParseFloat(v, 64)
					if err != nil {
						b.Fatalf("%s: %q: %v", u, line, err)
					}
					sum += f
				}
			}
		}
		_ = resp.Body.Close()
		if err := sc.Err(); err != nil {
			b.Fatal(err)
		}
	}
	return int64(sum)
}

// rawSetBytes SETs at least n bytes of fresh keys, in values of the
// model's block sizes taken in turn, pipelines of up to
// seedRawPipelineBytes, seedRawStreams at once, unlinking each pipeline's
// keys as it completes; it returns the time taken.
func rawSetBytes(b *testing.B, rdb *redis.Client, m *kvcore.Model, n int64) time.Duration {
	b.Helper()
	ctx := context.Background()
	values := make([][]byte, len(m.Groups))
	for g := range values {
		values[g] = make([]byte, m.Groups[g].BytesPerBlock)
		_, _ = rand.Read(values[g])
	}
	prefix := "bench-seed-raw-" + sim.NewRunTag() + "-"
	var g errgroup.Group
	g.SetLimit(seedRawStreams)
	start := time.Now()
	next := 0
	for sent := int64(0); sent < n; {
		var batch [][]byte
		for size := 0; size < seedRawPipelineBytes && sent < n; next++ {
			v := values[next%len(values)]
			batch = append(batch, v)
			size += len(v)
			sent += int64(len(v))
		}
		first := next - len(batch)
		g.Go(func() error {
			keys := make([]string, len(batch))
			_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
				for i, v := range batch {
					keys[i] = prefix + strconv.Itoa(first+i)
					p.SetNX(ctx, keys[i], v, 0) // as the store writes: values once
				}
				return nil
			})
			if err != nil {
				return fmt.Errorf("raw set: %w", err)
			}
			return rdb.Unlink(ctx, keys...).Err()
		})
	}
	if err := g.Wait(); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// mustParseRedis parses a redis:// URL.
func mustParseRedis(b testing.TB, url string) *redis.Options {
	b.Helper()
	o, err := redis.ParseURL(url)
	if err != nil {
		b.Fatal(err)
	}
	return o
}
