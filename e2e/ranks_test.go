package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvmesh/kvmesh/internal/sim"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/kvstore"
)

// tp8Model is the seed's deployment: MLA + linear attention at TP8.
const tp8Model = "hybrid-mla-linear-tp8"

// rankConfig points the simulator at every rank of the stack's engines.
func rankConfig(t testing.TB, s *stack, w sim.Workload) sim.Config {
	t.Helper()
	cfg := simConfig(t, s, true, w)
	cfg.Model = parallelModel(t, s)
	cfg.Decode = sim.Endpoint{WorkerURLs: s.workerURLs("gpuworker")}
	cfg.Prefill = sim.Endpoint{WorkerURLs: s.workerURLs("gpuworker-prefill")}
	return cfg
}

// seedConfig is the seed preset's run of n requests on the stack (its
// workload and engine; every worker rank of both engines).
func seedConfig(t testing.TB, s *stack, n int) sim.Config {
	t.Helper()
	seed, ok := sim.LookupPreset("seed")
	if !ok {
		t.Fatal("no seed preset")
	}
	w := seed.Workload
	w.Requests = n
	cfg := rankConfig(t, s, w)
	cfg.Engine, cfg.ReusePreempted = seed.Engine, seed.ReusePreempted
	return cfg
}

// parallelModel is the stack's model with its parallel overrides.
func parallelModel(t testing.TB, s *stack) *kvcore.Model {
	t.Helper()
	m, err := kvcore.Preset(s.model)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.ranks) > 1 && m.WorldSize() != len(s.ranks) {
		m.Parallel.TP = len(s.ranks) // the stacks here vary TP alone
	}
	return m
}

// TestTP8OneP1D plays the seed's deployment end to end: the MLA +
// linear-attention model at TP8, 1P1D with the pd,store chain, a small
// pool, 16 gpuworkers. The run must be clean, every rank of both engines
// must have its loaded bytes verified with no mismatch and its share of the
// save ledger balanced; every load task must list the 8 ranks and be
// answered once by each; and every key the run stored must belong to one
// namespace of its group and have been written once.
func TestTP8OneP1D(t *testing.T) {
	s := newStack(t, stackOptions{model: tp8Model, connectors: "pd,store", poolBlocks: 64})
	if len(s.ranks) != 8 {
		t.Fatalf("%d worker ranks, want 8", len(s.ranks))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cfg := rankConfig(t, s, smallWorkload(24, 6))
	rep, err := sim.Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	requireOK(t, rep)
	if rep.WorldSize != 8 || len(rep.Ranks) != 16 {
		t.Fatalf("world size %d, %d rank rows: want 8 and 16", rep.WorldSize, len(rep.Ranks))
	}
	for _, r := range rep.Ranks {
		if r.MismatchedBlocks != 0 || r.Dead || r.MetricsError != "" {
			t.Errorf("rank %s/%s: %+v", r.EngineID, r.Name, r)
		}
		if r.EngineID == decodeEngine && r.VerifiedBlocks == 0 {
			t.Errorf("decode rank %s verified no loaded block", r.Name)
		}
	}
	if !rep.Ledger.RanksBalanced || len(rep.Ledger.Ranks) != 16 {
		t.Fatalf("ledger per rank: balanced %v, %d rows", rep.Ledger.RanksBalanced, len(rep.Ledger.Ranks))
	}
	for _, r := range rep.Ledger.Ranks {
		if !r.Balanced {
			t.Errorf("rank %s/%s ledger: %+v", r.EngineID, r.Name, r)
		}
	}
	if rep.SlowestRank == nil || rep.SlowestRank.SharePercent <= 0 {
		t.Errorf("slowest rank %+v: want the share of the slowest rank's load time", rep.SlowestRank)
	}
	m := parallelModel(t, s)
	checkRankLoads(ctx, t, s, m)
	checkKeysWrittenOnce(t, s, m, rep)
	checkAllSaveTables(ctx, t, s, rep)
}

// checkRankLoads reads every load task and load result ever published:
// each task lists every worker rank, and each rank answered it exactly once.
func checkRankLoads(ctx context.Context, t *testing.T, s *stack, m *kvcore.Model) {
	t.Helper()
	tasks, err := sim.ReadAll(ctx, s.brokers, contract.TopicLoadTasks)
	if err != nil {
		t.Fatal(err)
	}
	results, err := sim.ReadAll(ctx, s.brokers, contract.TopicTransferResults)
	if err != nil {
		t.Fatal(err)
	}
	answered := map[string]map[kvcore.Rank]int{}
	for _, rec := range results {
		var res contract.TransferResult
		if err := json.Unmarshal(rec.Value, &res); err != nil {
			t.Fatal(err)
		}
		if res.Kind != contract.TransferLoad {
			continue
		}
		if res.Rank == nil {
			t.Fatalf("load result %s names no rank", res.ResultID)
		}
		if answered[res.TaskID] == nil {
			answered[res.TaskID] = map[kvcore.Rank]int{}
		}
		answered[res.TaskID][*res.Rank]++
	}
	if len(tasks) == 0 {
		t.Fatal("the run issued no load task")
	}
	for _, rec := range tasks {
		var task kvcore.LoadTask
		if err := json.Unmarshal(rec.Value, &task); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(task.Ranks, m.WorkerRanks()) {
			t.Fatalf("load %s lists ranks %v, want the 8 worker ranks", task.TaskID, task.Ranks)
		}
		for _, r := range task.Ranks {
			// A redelivered task is answered again under the same result
			// id; the topic may hold the repeat.
			if n := answered[task.TaskID][r]; n < 1 {
				t.Fatalf("load %s: rank %s answered %d times", task.TaskID, r, n)
			}
		}
	}
}

// checkKeysWrittenOnce scans the stack's keys: each parses, belongs to one
// of its group's namespaces, and the keys stored number exactly the puts
// the sender reported (no key was put twice).
func checkKeysWrittenOnce(t *testing.T, s *stack, m *kvcore.Model, rep *sim.Report) {
	t.Helper()
	namespaces := make([][]kvcore.Rank, len(m.Groups))
	for g := range m.Groups {
		namespaces[g] = m.Namespaces(g)
	}
	perGroup := make([]int, len(m.Groups))
	total, timed := 0, int64(0)
	err := testenv.EachKeyBatch(s.redisURL, s.prefix, func(ctx context.Context, c *redis.Client, keys []string) error {
		for _, k := range keys {
			if strings.HasSuffix(k, kvstore.StoredIndexSuffix) { // a namespace's store times
				n, err := c.ZCard(ctx, k).Result()
				if err != nil {
					return err
				}
				timed += n
				continue
			}
			p, err := kvcore.ParseKey(k)
			if err != nil {
				t.Errorf("key %q: %v", k, err)
				continue
			}
			if p.Group < 0 || p.Group >= len(m.Groups) || !slices.Contains(namespaces[p.Group], p.Rank) {
				t.Errorf("key %q is in no namespace of group %d (%v)", k, p.Group, namespaces[max(0, min(p.Group, len(m.Groups)-1))])
				continue
			}
			perGroup[p.Group]++
			total++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if total == 0 || total != rep.Ledger.Stored {
		t.Fatalf("%d keys in the store (%v per group), the sender stored %d: a key written twice or lost", total, perGroup, rep.Ledger.Stored)
	}
	if timed != int64(total) {
		t.Errorf("%d store times in the namespaces' indexes for %d keys: every stored key has one", timed, total)
	}
	// Each MLA chunk is one key, each linear-attention state eight.
	if perGroup[1]%8 != 0 {
		t.Errorf("%d linear-attention keys: not 8 per chunk", perGroup[1])
	}
}

// TestRankWorkerKilledMidRun SIGKILLs one rank's gpuworker of the decode
// engine of a TP2 1P1D mesh mid-run, never restarting it. The run must end
// (no request hangs), every failed request must be one the dead rank cost,
// no byte may be wrong, the loads that rank never answered must end as
// load errors naming it (missing_ranks), its saves must be dead-lettered
// with a reason naming it, and the other ranks must stay alive.
func TestRankWorkerKilledMidRun(t *testing.T) {
	s := newStack(t, stackOptions{model: model, connectors: "pd,store", poolBlocks: 64,
		env: []string{"KVMESH_TP=2", "KVMESH_LOAD_RANK_TIMEOUT=2s", "KVMESH_SENDER_RETRY_ATTEMPTS=2", "KVMESH_SENDER_RETRY_BASE=100ms"}})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cfg := rankConfig(t, s, smallWorkload(36, 6))
	cfg.RankTimeout = 2 * time.Second
	victim := rankName("gpuworker", 1)
	progress, done := startRun(ctx, cfg)
	p := waitDone(t, progress, done, 8)
	s.kill(victim)
	t.Logf("killed %s at %d requests done", victim, p.Done)
	var r runResult
	select {
	case r = <-done:
	case <-ctx.Done():
		t.Fatal("the run did not end after a rank's gpuworker was killed: a request hangs")
	}
	if r.err != nil {
		t.Fatal(r.err)
	}
	rep := r.rep
	var b strings.Builder
	_ = rep.WriteText(&b)
	t.Logf("report:\n%s", b.String())
	if rep.OK || len(rep.DeadRanks) != 1 {
		t.Fatalf("OK %v, dead ranks %+v: want the one killed rank and a failed run", rep.OK, rep.DeadRanks)
	}
	d := rep.DeadRanks[0]
	if d.EngineID != decodeEngine || d.Name != "tp1-pcp0-dcp0-pp0" {
		t.Fatalf("dead rank %+v, want decode-0 tp1", d)
	}
	q := rep.Requests
	if q.Failed == 0 || q.Failed != q.FailedDeadRank || q.OK+q.Failed != q.Total || q.OK < 8 {
		t.Fatalf("requests %+v: every failure must be the dead rank's", q)
	}
	if rep.Verification.Mismatched != 0 || rep.Stored == nil || rep.Stored.Wrong != 0 {
		t.Fatalf("verification %+v, stored %+v: a dead rank must not make any byte wrong", rep.Verification, rep.Stored)
	}
	for _, name := range slices.Concat(s.workerNames("gpuworker"), s.workerNames("gpuworker-prefill"), []string{"scheduler", "sender", "lookup"}) {
		if name == victim {
			continue
		}
		if err := s.alive(name); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	checkRankFailuresNamed(ctx, t, s, d)
}

// checkRankFailuresNamed looks for what the dead rank cost in the mesh's
// own records: finished_recving with missing_ranks naming it, or the
// sender's put_failed dead letters — at least one of them — and any
// put_failed dead letter names the rank.
func checkRankFailuresNamed(ctx context.Context, t *testing.T, s *stack, d sim.DeadRank) {
	t.Helper()
	feedback, err := sim.ReadAll(ctx, s.brokers, contract.TopicEngineFeedback)
	if err != nil {
		t.Fatal(err)
	}
	missing := 0
	var all []contract.EngineFeedback
	for _, rec := range feedback {
		fs, err := contract.DecodeEngineFeedback(rec.Value)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, fs...)
	}
	for _, fb := range all {
		if len(fb.MissingRanks) == 0 {
			continue
		}
		if fb.EngineID != d.EngineID || !slices.ContainsFunc(fb.MissingRanks, func(r kvcore.Rank) bool { return r.String() == d.Name }) {
			t.Fatalf("feedback %+v names missing ranks other than the dead one", fb)
		}
		if len(fb.LoadErrors) == 0 {
			t.Fatalf("feedback %+v: a load with a missing rank must report its blocks as load errors", fb)
		}
		missing++
	}
	deadLetters := 0
	for _, e := range dlq(t, s, url.Values{"reason": {string(kvcore.ReasonPutFailed)}}) {
		if !strings.Contains(e.Detail, d.Name) {
			t.Fatalf("put_failed dead letter %+v does not name rank %s", e, d.Name)
		}
		deadLetters++
	}
	t.Logf("loads expired with the dead rank missing: %d; saves dead-lettered naming it: %d", missing, deadLetters)
	if missing+deadLetters == 0 {
		// The kill fell where the engine had no load or save in flight on
		// that rank (the run then fails its requests before issuing any):
		// give the mesh one, a save of the engine's with keys the store
		// does not hold, which the sender must put through the dead rank.
		t.Log("the kill found no load or save in flight on the rank; publishing a save it must put")
		provokeRankSave(ctx, t, s, d)
		eventually(t, "a put_failed dead letter naming "+d.Name, func() bool {
			for _, e := range dlq(t, s, url.Values{"reason": {string(kvcore.ReasonPutFailed)}}) {
				if strings.Contains(e.Detail, d.Name) {
					return true
				}
			}
			return false
		})
		return
	}
}

// provokeRankSave republishes one of the dead rank's engine's save tasks
// under a new task id with fresh random block hashes, so that none of its
// keys exists and every rank, the dead one included, must put its share.
func provokeRankSave(ctx context.Context, t *testing.T, s *stack, d sim.DeadRank) {
	t.Helper()
	recs, err := sim.ReadAll(ctx, s.brokers, contract.TopicSaveTasks)
	if err != nil {
		t.Fatal(err)
	}
	for _, rec := range recs {
		var task kvcore.SaveTask
		if err := json.Unmarshal(rec.Value, &task); err != nil || task.EngineID != d.EngineID || len(task.BlockHashes) == 0 {
			continue
		}
		task.TaskID += "/provoked"
		for i := range task.BlockHashes {
			h := make([]byte, 32)
			_, _ = rand.Read(h) // crypto/rand never fails on Linux
			task.BlockHashes[i] = hex.EncodeToString(h)
		}
		body, err := json.Marshal(task)
		if err != nil {
			t.Fatal(err)
		}
		publishSaveTasks(ctx, t, s, bus.Message{Key: task.RequestID, Value: body})
		return
	}
	t.Fatalf("no save task of engine %s to republish", d.EngineID)
}
