package sim

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/internal/testenv/meshtest"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvtier"
)

// tierMesh is a mesh over a Redis of its own and a capacity tier on a
// private S3 server (versitygw).
type tierMesh struct {
	cfg   Config
	mesh  *meshtest.Mesh
	s3    *testenv.S3Server
	redis *redis.Client
}

// newTierMesh starts the services of one decode engine of the
// hybrid-mla-linear model with the tier on.
func newTierMesh(t *testing.T, w Workload) *tierMesh {
	t.Helper()
	s3 := testenv.StartS3(t)
	rs := testenv.StartRedis(t)
	cfg, m := simMeshOf(t, meshOptions{model: "hybrid-mla-linear", connectors: "store", poolBlocks: 64, engines: 1,
		env: []string{"KVMESH_REDIS_URL=" + rs.URL(), "KVMESH_TIER_URL=" + s3.URL(), "KVMESH_TIER_ACCESS_KEY=" + s3.AccessKey(),
			"KVMESH_TIER_SECRET_KEY=" + s3.SecretKey(), "KVMESH_TIER_TIMEOUT=2s"}},
		w, EngineConfig{PoolBlocks: 48, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1})
	cfg.RedisURL = rs.URL()
	opts, err := redis.ParseURL(rs.URL())
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(opts)
	t.Cleanup(func() { _ = rc.Close() })
	return &tierMesh{cfg: cfg, mesh: m, s3: s3, redis: rc}
}

// tierWorkload is a small workload of shared system prompts: its replay
// on fresh engines hits every prompt's saved prefix.
func tierWorkload() Workload {
	return Workload{
		Requests: 8, Turns: Range{Min: 2, Max: 3}, SystemPrompts: 2,
		SystemTokens: Range{Min: 128, Max: 256}, UserTokens: Range{Min: 16, Max: 64},
		OutputTokens: Range{Min: 4, Max: 16}, Rate: 8, ThinkTime: 20 * time.Millisecond, Seed: 31, Vocab: 32000,
	}
}

// play runs cfg under a fresh run tag (fresh engines, the same salt, so
// the same prompts hash to the same blocks) and requires it clean.
func (tm *tierMesh) play(ctx context.Context, t *testing.T, name string) *Report {
	t.Helper()
	cfg := tm.cfg
	cfg.RunTag = NewRunTag()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	t.Logf("%s: hit rate %.1f%%, loaded %v tokens, %d blocks from the tier, %d load-error blocks, %d mismatched",
		name, 100*rep.PrefixHitRate, rep.Tokens.Loaded, rep.Ledger.LoadTierBlocks, rep.Verification.LoadErrorBlocks, rep.Verification.Mismatched)
	requireClean(t, rep)
	return rep
}

// drained waits until the gpuworker's write-behind queue is empty and at
// least one block was written behind; it returns the blocks written.
func (tm *tierMesh) drained(t *testing.T) float64 {
	t.Helper()
	var stored float64
	url := tm.mesh.Procs.Process(rankWorkerName("decode-0", 0)).URL()
	testenv.Eventually(t, 30*time.Second, "the gpuworker's write-behind queue drained", func() bool {
		queue, ok := testenv.MetricSum(url, kvtier.MetricQueueBytes, "", "")
		s, ok2 := testenv.MetricSum(url, kvtier.MetricWrites, "result", "stored")
		stored = s
		return ok && ok2 && queue == 0 && stored > 0
	})
	return stored
}

// flushRedis empties the mesh's Redis, as a restart without persistence
// or an operator's FLUSHALL would.
func (tm *tierMesh) flushRedis(t *testing.T) {
	t.Helper()
	if err := tm.redis.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
}

// objectFiles lists the files of the tier's objects.
func (tm *tierMesh) objectFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	root := filepath.Dir(tm.s3.ObjectFile("x"))
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files = append(files, path)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

// TestTierOnMesh plays a workload on a mesh with the capacity tier, then
// replays it on fresh engines: with Redis intact, after a Redis flush (the
// blocks load from the object tier, verified, and are promoted), after a
// flush with every object altered or truncated behind the server's back
// (every load from the tier fails its checks: load errors, recomputed,
// nothing wrong), and
// after a flush with the object store down (nothing counts present: the
// prompts are computed). Every run is clean: 0 mismatched bytes, the
// ledger balanced.
func TestTierOnMesh(t *testing.T) {
	tm := newTierMesh(t, tierWorkload())
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	first := tm.play(ctx, t, "first run")
	if first.Ledger.Stored == 0 {
		t.Fatal("the first run stored nothing")
	}
	stored := tm.drained(t)
	worker, lookup := tm.mesh.Procs.Process(rankWorkerName("decode-0", 0)).URL(), tm.mesh.Procs.Process("lookup").URL()
	testenv.Eventually(t, 30*time.Second, "every block written behind announced as BlockStored of medium STORAGE", func() bool {
		n, ok := testenv.MetricSum(worker, "kvmesh_gpuworker_tier_events_published_total", "medium", contract.MediumTier)
		return ok && n == stored
	})
	asked, _ := testenv.MetricSum(lookup, "kvmesh_store_keys_total", "op", "lookup_exists")
	confirms, _ := testenv.MetricSum(lookup, kvtier.MetricConfirms, "", "")
	t.Logf("first run: the lookups asked Redis about %v keys and the bucket about %v", asked, confirms)
	intact := tm.play(ctx, t, "replay, Redis intact")
	if intact.Tokens.Loaded["store"] == 0 || intact.Ledger.LoadTierBlocks != 0 {
		t.Fatalf("replay with Redis intact: loaded %v, %d blocks from the tier; want Redis's blocks only", intact.Tokens.Loaded, intact.Ledger.LoadTierBlocks)
	}

	tm.flushRedis(t)
	after := tm.play(ctx, t, "replay after a Redis flush")
	if after.Ledger.LoadTierBlocks == 0 || after.Verification.VerifiedBlocks == 0 {
		t.Fatalf("replay after the flush: %d blocks from the tier, %d verified; want the tier's blocks loaded", after.Ledger.LoadTierBlocks, after.Verification.VerifiedBlocks)
	}
	if after.PrefixHitRate < 0.9*intact.PrefixHitRate {
		t.Fatalf("hit rate after the flush %.3f, with Redis intact %.3f: want at least 90%%", after.PrefixHitRate, intact.PrefixHitRate)
	}
	t.Logf("%v blocks written behind; hit rate intact %.1f%%, after the flush %.1f%% (%d blocks from the tier)",
		stored, 100*intact.PrefixHitRate, 100*after.PrefixHitRate, after.Ledger.LoadTierBlocks)
	var inRedis float64 // the blocks promoted back into Redis, announced in Redis's medium again
	testenv.Eventually(t, 30*time.Second, "the promoted blocks announced as BlockStored of medium CPU", func() bool {
		inRedis, _ = testenv.MetricSum(worker, "kvmesh_gpuworker_tier_events_published_total", "medium", contract.MediumStore)
		return inRedis > 0
	})
	if inRedis > float64(after.Ledger.LoadTierBlocks) {
		t.Fatalf("%v blocks announced promoted into Redis, more than the %d loaded from the tier", inRedis, after.Ledger.LoadTierBlocks)
	}
	t.Logf("%v blocks promoted back into Redis announced as BlockStored of medium CPU", inRedis)
	promoted := tm.play(ctx, t, "replay after promotion")
	if promoted.Ledger.LoadTierBlocks != 0 || promoted.Tokens.Loaded["store"] == 0 {
		t.Fatalf("replay after the tier's hits were promoted: %d blocks from the tier, loaded %v; want Redis's", promoted.Ledger.LoadTierBlocks, promoted.Tokens.Loaded)
	}

	tm.drained(t)
	altered := 0
	for i, f := range tm.objectFiles(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			b[len(b)-1] ^= 0xff // a flipped byte
		} else {
			b = b[:len(b)/2] // truncated
		}
		if err := os.WriteFile(f, b, 0o644); err != nil {
			t.Fatal(err)
		}
		altered++
	}
	tm.flushRedis(t)
	spoilt := tm.play(ctx, t, fmt.Sprintf("replay after a flush, %d objects altered or truncated", altered))
	if spoilt.Ledger.LoadTierBlocks != 0 || spoilt.Verification.LoadErrorBlocks == 0 || spoilt.Tokens.Recomputed == 0 {
		t.Fatalf("replay over altered objects: %d blocks from the tier, %d load errors, %d tokens recomputed; want every tier load refused and recomputed",
			spoilt.Ledger.LoadTierBlocks, spoilt.Verification.LoadErrorBlocks, spoilt.Tokens.Recomputed)
	}

	tm.s3.Stop()
	tm.flushRedis(t)
	down := tm.play(ctx, t, "replay after a flush, object store down")
	if down.Ledger.LoadTierBlocks != 0 || down.Tokens.Loaded["store"] != 0 {
		t.Fatalf("replay with the tier down: %d blocks from the tier, loaded %v; want nothing counted present", down.Ledger.LoadTierBlocks, down.Tokens.Loaded)
	}
}
