package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// BenchmarkSeedAfterFlush plays the seed preset (at TP1, as
// BenchmarkSeedSaturated) on the mesh with the capacity tier on a private
// versitygw and a private redis-server: a first run fills the store, a
// replay on fresh engines with Redis intact gives the baseline hit rate,
// then Redis is flushed (FLUSHALL) and a replay on fresh engines hits from
// the object tier. Metrics: after_flush_hit_% (the replay after the flush)
// and intact_hit_% (the replay with Redis intact), tier_blocks (blocks the
// replay after the flush read from the tier). Both replays must be clean
// (every request ok, 0 mismatched bytes).
func BenchmarkSeedAfterFlush(b *testing.B) {
	p, ok := sim.LookupPreset("seed")
	if !ok {
		b.Fatal("no seed preset")
	}
	m, err := kvcore.Preset(seedBenchModel)
	if err != nil {
		b.Fatal(err)
	}
	s3 := testenv.StartS3(b)
	rs := testenv.StartRedis(b)
	mesh := startSeedMesh(b, "KVMESH_REDIS_URL="+rs.URL(), "KVMESH_TIER_URL="+s3.URL(),
		"KVMESH_TIER_ACCESS_KEY="+s3.AccessKey(), "KVMESH_TIER_SECRET_KEY="+s3.SecretKey())
	workers := []string{mesh.Procs.Process("gpuworker").URL(), mesh.Procs.Process("gpuworker-prefill").URL()}
	rdb := redis.NewClient(mustParseRedis(b, rs.URL()))
	b.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	var intact, after, tierBlocks float64
	b.ResetTimer()
	for range b.N {
		salt := sim.NewRunTag()
		play := func(name string) *sim.Report {
			cfg := sim.Config{
				Model: m, Workload: p.Workload, PD: p.PD, Engine: p.Engine, ReusePreempted: p.ReusePreempted,
				Decode:     sim.Endpoint{WorkerURL: workers[0]},
				Prefill:    sim.Endpoint{WorkerURL: workers[1]},
				LookupURLs: []string{mesh.Procs.Process("lookup").URL()}, SchedulerURLs: []string{mesh.Procs.Process("scheduler").URL()},
				SenderURLs: []string{mesh.Procs.Process("sender").URL()},
				Brokers:    mesh.Brokers, RunTag: sim.NewRunTag(), Salt: salt, RedisURL: rs.URL(),
				RequestTimeout: 2 * time.Minute, SettleTimeout: time.Minute,
				Credentials: &sim.Credentials{Engine: sim.MintEngineTokens(mesh.AuthKey), Operator: mesh.AdminToken},
			}
			rep, err := sim.Run(ctx, cfg)
			if err != nil {
				b.Fatalf("%s: %v", name, err)
			}
			if !rep.OK || rep.Requests.Failed != 0 || rep.Verification.Mismatched != 0 {
				b.Fatalf("%s not clean: %d of %d requests failed, %d mismatched", name, rep.Requests.Failed, rep.Requests.Total, rep.Verification.Mismatched)
			}
			b.Logf("%s: %d requests, hit rate %.1f%%, loaded %v tokens, %d blocks from the tier, %d load-error blocks",
				name, rep.Requests.Total, 100*rep.PrefixHitRate, rep.Tokens.Loaded, rep.Ledger.LoadTierBlocks, rep.Verification.LoadErrorBlocks)
			return rep
		}
		play("first run")
		tierDrained(b, workers)
		i := play("replay, Redis intact")
		if err := rdb.FlushAll(ctx).Err(); err != nil {
			b.Fatal(err)
		}
		a := play("replay after FLUSHALL")
		intact += 100 * i.PrefixHitRate
		after += 100 * a.PrefixHitRate
		tierBlocks += float64(a.Ledger.LoadTierBlocks)
		tierDrained(b, workers) // the replays' own saves, before the next round
	}
	b.StopTimer()
	n := float64(b.N)
	b.ReportMetric(after/n, "after_flush_hit_%")
	b.ReportMetric(intact/n, "intact_hit_%")
	b.ReportMetric(tierBlocks/n, "tier_blocks")
}

// tierDrained waits until every worker's write-behind queue is empty.
func tierDrained(b *testing.B, workers []string) {
	b.Helper()
	for _, u := range workers {
		testenv.Eventually(b, time.Minute, u+"'s write-behind queue drained", func() bool {
			q, ok := testenv.MetricSum(u, kvtier.MetricQueueBytes, "", "")
			return ok && q == 0
		})
	}
}
