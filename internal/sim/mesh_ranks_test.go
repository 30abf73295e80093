package sim

import (
	"context"
	"sync"
	"testing"
	"time"
)

// tp2Workload is a small 1P1D workload with shared system prompts, so that
// the decode engine loads over pd and the prefill engine from the store.
func tp2Workload(requests int) Workload {
	return Workload{
		Requests: requests, Turns: Range{Min: 2, Max: 3}, SystemPrompts: 2,
		SystemTokens: Range{Min: 64, Max: 192}, UserTokens: Range{Min: 16, Max: 64},
		OutputTokens: Range{Min: 4, Max: 16}, Rate: 8, ThinkTime: 20 * time.Millisecond, Seed: 7, Vocab: 32000,
	}
}

// TestTP2OnMesh plays 1P1D at TP2 against the services run with KVMESH_TP=2
// and two gpuworkers per engine (KVMESH_RANK_TP 0 and 1): the run is clean,
// every rank got its blocks written and its loads verified, each rank
// stored keys of its own, and the ledger balances per rank.
func TestTP2OnMesh(t *testing.T) {
	cfg := simMesh(t, meshOptions{model: "hybrid-mla-linear-tp8", tp: 2, connectors: "pd,store", poolBlocks: 96, engines: 1, pd: true},
		tp2Workload(20), EngineConfig{PoolBlocks: 64, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1})
	cfg.ReusePreempted = true
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireClean(t, rep)
	if rep.WorldSize != 2 || len(rep.Ranks) != 4 || !rep.Ledger.RanksBalanced || len(rep.DeadRanks) != 0 {
		t.Fatalf("world %d, %d ranks, per-rank ledger balanced %v, dead %+v", rep.WorldSize, len(rep.Ranks), rep.Ledger.RanksBalanced, rep.DeadRanks)
	}
	if rep.Bytes.ComputedHTTP != 0 {
		t.Fatalf("bytes %+v: local gpuworkers get the engine's KV in shared memory by default, nothing over HTTP", rep.Bytes)
	}
	stored := 0
	for _, s := range rep.Ranks {
		if s.KVMemory != KVMemoryShm {
			t.Fatalf("rank %s/%s wrote over %s, want shm", s.EngineID, s.Name, s.KVMemory)
		}
		if s.BlocksWritten == 0 || s.MetricsError != "" || s.ExpectedKeys == 0 {
			t.Fatalf("rank %s/%s: %+v", s.EngineID, s.Name, s)
		}
		if s.EngineID == "decode-0" && (s.VerifiedBlocks == 0 || s.LoadedBytes == 0) {
			t.Fatalf("decode rank %s verified %d blocks, loaded %d bytes: want its pd loads checked", s.Name, s.VerifiedBlocks, s.LoadedBytes)
		}
		if s.EngineID == "prefill-0" && (s.StoredKeys == 0 || s.SavedBytes == 0) {
			t.Fatalf("prefill rank %s stored %d keys (%d bytes): every rank writes keys of its own", s.Name, s.StoredKeys, s.SavedBytes)
		}
		stored += s.StoredKeys
	}
	if stored != rep.Stored.Keys || rep.Verification.VerifiedBlocks%2 != 0 {
		t.Fatalf("ranks stored %d keys, the store check found %d; %d block copies verified", stored, rep.Stored.Keys, rep.Verification.VerifiedBlocks)
	}
}

// TestDeadRankOnMesh SIGKILLs rank 1's gpuworker of the decode engine
// mid-run at TP2: the run ends without hanging, the report names the dead
// rank, every failed turn failed because of it and is counted so, nothing
// mismatched or was stored wrong, and the run is not OK.
func TestDeadRankOnMesh(t *testing.T) {
	cfg, m := simMeshOf(t, meshOptions{model: "hybrid-mla-linear-tp8", tp: 2, connectors: "pd,store", poolBlocks: 96, engines: 1, pd: true,
		env: []string{"KVMESH_LOAD_RANK_TIMEOUT=3s", "KVMESH_SENDER_RETRY_ATTEMPTS=2", "KVMESH_SENDER_RETRY_BASE=100ms"}},
		tp2Workload(30), EngineConfig{PoolBlocks: 64, MaxBatchTokens: 256, MaxRunning: 8, Watermark: 1})
	cfg.RankTimeout, cfg.RequestTimeout, cfg.ProgressEvery = 2*time.Second, 30*time.Second, 50*time.Millisecond
	victim := m.Procs.Process(rankWorkerName("decode-0", 1))
	var once sync.Once
	cfg.Progress = func(p Progress) {
		if p.Done >= 6 {
			once.Do(func() {
				if err := victim.Kill(); err != nil {
					t.Errorf("kill: %v", err)
				}
			})
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	start := time.Now()
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	logReport(t, rep)
	if rep.OK || len(rep.DeadRanks) != 1 {
		t.Fatalf("OK %v, dead ranks %+v: want one dead rank and a failed run", rep.OK, rep.DeadRanks)
	}
	d := rep.DeadRanks[0]
	if d.EngineID != "decode-0" || d.Name != "tp1-pcp0-dcp0-pp0" || d.URL != victim.URL() || d.FailedTurns == 0 || d.FailedRequests != d.FailedTurns {
		t.Fatalf("dead rank %+v", d)
	}
	r := rep.Requests
	if r.Failed == 0 || r.Failed != r.FailedDeadRank || r.FailedDeadRank != d.FailedTurns || r.OK+r.Failed != r.Total || r.OK < 6 {
		t.Fatalf("requests %+v: every failed turn must have failed because of the dead rank", r)
	}
	for _, f := range r.Failures {
		if f.DeadRank != "decode-0/tp1-pcp0-dcp0-pp0" {
			t.Fatalf("failure %+v not attributed to the dead rank", f)
		}
	}
	if rep.Verification.Mismatched != 0 || rep.Stored == nil || rep.Stored.Wrong != 0 {
		t.Fatalf("verification %+v, stored %+v: a dead rank must not make bytes wrong", rep.Verification, rep.Stored)
	}
	for _, s := range rep.Ranks {
		if s.Dead != (s.EngineID == "decode-0" && s.Name == d.Name) {
			t.Fatalf("rank %s/%s dead %v", s.EngineID, s.Name, s.Dead)
		}
	}
	t.Logf("run took %v", time.Since(start))
}
