package app_test

import (
	"bytes"
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/bus"
	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/database"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
	"github.com/kvmesh/kvmesh/services/gpuworker/internal/load"
)

// store puts a raw value under key in the worker's store.
func (w *worker) store(t testing.TB, key string, value []byte) {
	t.Helper()
	if err := redisClient(t, w.cfg.RedisURL).Set(context.Background(), key, value, 0).Err(); err != nil {
		t.Fatal(err)
	}
}

// fill writes random bytes into the listed blocks of group g, each as the
// content of a random hash of its own, and returns them.
func (w *worker) fill(t *testing.T, g int, ids ...kvcore.BlockID) map[kvcore.BlockID]dataplane.Block {
	t.Helper()
	return w.fillAs(t, g, ids, nil)
}

// fillAs writes random bytes into the listed blocks of group g, block
// ids[i] as the content of hashes[i] (a random hash when hashes is nil),
// and returns them.
func (w *worker) fillAs(t *testing.T, g int, ids []kvcore.BlockID, hashes []string) map[kvcore.BlockID]dataplane.Block {
	t.Helper()
	out := map[kvcore.BlockID]dataplane.Block{}
	var blocks []dataplane.Block
	for i, b := range ids {
		h := randomHex(32)
		if hashes != nil {
			h = hashes[i]
		}
		blk := dataplane.Block{BlockRef: dataplane.BlockRef{Group: g, Block: b}, Identity: dataplane.Identity{Hash: h, RequestID: "req-fill"}, Data: w.randomBlock(g)}
		out[b] = blk
		blocks = append(blocks, blk)
	}
	if err := w.client.Write(context.Background(), blocks); err != nil {
		t.Fatal(err)
	}
	return out
}

// assertBlock fails unless block b of group g holds hash with bytes want.
func (w *worker) assertBlock(t *testing.T, g int, b kvcore.BlockID, hash string, want []byte, what string) {
	t.Helper()
	if got := w.readBlock(t, g, b, hash); !bytes.Equal(got, want) {
		t.Fatalf("group %d block %d: %s", g, b, what)
	}
}

func assertLoadResult(t *testing.T, got contract.TransferResult, w *worker, task *kvcore.LoadTask, errs []kvcore.BlockID, n int64) {
	t.Helper()
	if got.Schema != contract.SchemaTransferResult || got.Kind != contract.TransferLoad || got.Status != "done" ||
		got.EngineID != task.EngineID || got.RequestID != task.RequestID || got.ResultID != load.ResultID(task.TaskID, w.cfg.Rank()) {
		t.Fatalf("result %+v does not report task %s", got, task.TaskID)
	}
	if !slices.Equal(got.LoadErrors, errs) {
		t.Fatalf("load errors = %v, want %v", got.LoadErrors, errs)
	}
	if got.Bytes != n {
		t.Fatalf("bytes = %d, want %d", got.Bytes, n)
	}
}

// TestScenario19 is scenario 19 of docs/architecture.md: the store answers
// [ok, missing, missing] → the load finishes, blocks 1 and 2 of the load
// are load errors, and the first block holds exactly the stored bytes.
func TestScenario19LoadWithMissingKeys(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	cfg := testConfig(env, "engine-s19")
	cfg.Model, cfg.PoolBlocks = "dense", 8
	w := startWorker(t, cfg, nil)
	rs := watchResults(t, env)

	hashes := hexChain(w.model, tokens(48, 100))
	prev := w.fill(t, 0, 6, 7)
	payload := w.randomBlock(0)
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 0, hashes[0]), dataplane.EncodeValue(w.model.Fingerprint(), payload))
	task := w.loadTask(hashes, 48, kvcore.BlockTable{{5, 6, 7}})
	publishTask(t, publisher(t, env), task)

	assertLoadResult(t, rs.wait(t, task.TaskID), w, task, []kvcore.BlockID{6, 7}, int64(len(payload)))
	w.assertBlock(t, 0, 5, hashes[0], payload, "not the stored payload")
	w.assertBlock(t, 0, 6, prev[6].Hash, prev[6].Data, "a missing key changed the block")
	w.assertBlock(t, 0, 7, prev[7].Hash, prev[7].Data, "a missing key changed the block")
}

// TestLoadOfAlteredValuesLeavesPoolUntouched stores one good value and three
// bad ones (a flipped payload byte, another model's fingerprint, a wrong
// payload size): the bad ones are load errors and their blocks keep their
// previous bytes.
func TestLoadOfAlteredValuesLeavesPoolUntouched(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-alter"), nil)
	rs := watchResults(t, env)
	ctx := context.Background()
	fp := w.model.Fingerprint()
	hashes := hexChain(w.model, tokens(48, 200))
	table := kvcore.BlockTable{{1, 2, 3}, {kvcore.NullBlock, kvcore.NullBlock, 4}}
	prev := w.fill(t, 0, 1, 2, 3)
	prev[4] = w.fill(t, 1, 4)[4]

	good := w.randomBlock(0)
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 0, hashes[0]), dataplane.EncodeValue(fp, good))
	flipped := w.keys.KeyHex(kvcore.Rank{}, 0, hashes[1])
	w.store(t, flipped, dataplane.EncodeValue(fp, w.randomBlock(0)))
	rdb := redisClient(t, env.RedisURL)
	last, err := rdb.GetRange(ctx, flipped, -1, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := rdb.SetRange(ctx, flipped, int64(dataplane.ValueOverhead(len(fp))+len(good)-1), string([]byte{last[0] ^ 0x40})).Err(); err != nil {
		t.Fatal(err)
	}
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 0, hashes[2]), dataplane.EncodeValue("0000000000000000", w.randomBlock(0)))
	w.store(t, w.keys.KeyHex(kvcore.Rank{}, 1, hashes[2]), dataplane.EncodeValue(fp, []byte("too short for a block")))

	task := w.loadTask(hashes, 48, table)
	publishTask(t, publisher(t, env), task)
	assertLoadResult(t, rs.wait(t, task.TaskID), w, task, []kvcore.BlockID{2, 3, 4}, int64(len(good)))
	w.assertBlock(t, 0, 1, hashes[0], good, "not the stored payload")
	w.assertBlock(t, 0, 2, prev[2].Hash, prev[2].Data, "a value with a flipped byte reached the pool")
	w.assertBlock(t, 0, 3, prev[3].Hash, prev[3].Data, "another model's value reached the pool")
	w.assertBlock(t, 1, 4, prev[4].Hash, prev[4].Data, "a wrongly sized value reached the pool")
	m := metricsText(t, w)
	for _, reason := range []string{"checksum", "fingerprint", "size"} {
		if want := `kvmesh_gpuworker_rejected_values_total{reason="` + reason + `"} 1`; !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
}

// TestUnplannableLoadReportsEveryListedBlock sends a task whose hash chain
// is too short to key its chunks: the result still comes, with every block
// the task lists as a load error.
func TestUnplannableLoadReportsEveryListedBlock(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-unplanned"), nil)
	rs := watchResults(t, env)
	hashes := hexChain(w.model, tokens(48, 300))
	task := w.loadTask(hashes[:1], 48, kvcore.BlockTable{{1, 2, 3}, {kvcore.NullBlock, kvcore.NullBlock, 4}})
	wrongModel := w.loadTask(hashes, 48, kvcore.BlockTable{{5, 6, 7}, {kvcore.NullBlock, kvcore.NullBlock, 8}})
	wrongModel.Model = "another-model"
	p := publisher(t, env)
	publishTask(t, p, task)
	publishTask(t, p, wrongModel)
	assertLoadResult(t, rs.wait(t, task.TaskID), w, task, []kvcore.BlockID{1, 2, 3, 4}, 0)
	assertLoadResult(t, rs.wait(t, wrongModel.TaskID), w, wrongModel, []kvcore.BlockID{5, 6, 7, 8}, 0)
}

// TestOtherEnginesTasksAreIgnored publishes a task of another engine and one
// of this worker's: only this worker's is answered, and the other is counted
// as ignored.
func TestOtherEnginesTasksAreIgnored(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-mine"), nil)
	rs := watchResults(t, env)
	hashes := hexChain(w.model, tokens(16, 400))
	other := w.loadTask(hashes, 16, kvcore.BlockTable{{1}, {2}})
	other.EngineID = "engine-theirs"
	mine := w.loadTask(hashes, 16, kvcore.BlockTable{{1}, {2}})
	p := publisher(t, env)
	publishTask(t, p, other)
	publishTask(t, p, mine)
	rs.wait(t, mine.TaskID)
	waitMetric(t, w, `kvmesh_gpuworker_loads_total{outcome="ignored"} 1`)
	if got := rs.find(other.TaskID); len(got) != 0 {
		t.Fatalf("another engine's task was answered: %+v", got)
	}
}

// waitRegistered polls the registry until engine has a live worker.
func waitRegistered(t *testing.T, env *servicetest.Env, engine string) {
	t.Helper()
	pool, err := database.Connect(context.Background(), env.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	deadline := time.Now().Add(waitFor)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := registry.Find(context.Background(), pool, engine, time.Minute); err == nil {
			return
		} else if time.Now().After(deadline) {
			t.Fatalf("engine %s not registered: %v", engine, err)
		}
		<-tick.C
	}
}

// TestPDLoadReadsTheRemoteWorker loads a request's blocks from a prefill
// engine's worker (found in the registry) through the data plane.
func TestPDLoadReadsTheRemoteWorker(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	prefill := startWorker(t, testConfig(env, "engine-prefill"), nil)
	decode := startWorker(t, testConfig(env, "engine-decode"), nil)
	rs := watchResults(t, env)
	waitRegistered(t, env, "engine-prefill")

	hashes := hexChain(decode.model, tokens(48, 500))
	src := prefill.fillAs(t, 0, []kvcore.BlockID{10, 11, 12}, hashes)
	src[13] = prefill.fillAs(t, 1, []kvcore.BlockID{13}, hashes[2:])[13]
	prev := decode.fill(t, 1, 5)
	local := kvcore.BlockTable{{1, 2, 3}, {kvcore.NullBlock, kvcore.NullBlock, 4}}
	pd := func(remoteEngine string, remote kvcore.BlockTable, table kvcore.BlockTable) *kvcore.LoadTask {
		task := decode.loadTask(hashes, 48, table)
		task.Connector = "pd"
		task.Remote = &kvcore.RemoteSource{EngineID: remoteEngine, BlockTable: remote}
		return task
	}
	full := pd("engine-prefill", kvcore.BlockTable{{10, 11, 12}, {kvcore.NullBlock, kvcore.NullBlock, 13}}, local)
	partial := pd("engine-prefill", kvcore.BlockTable{{10, 11, 12}}, kvcore.BlockTable{{6, 7, 8}, {kvcore.NullBlock, kvcore.NullBlock, 5}})
	absent := pd("engine-gone", kvcore.BlockTable{{10, 11, 12}, {kvcore.NullBlock, kvcore.NullBlock, 13}}, kvcore.BlockTable{{1, 2, 3}, {kvcore.NullBlock, kvcore.NullBlock, 9}})
	p := publisher(t, env)
	for _, task := range []*kvcore.LoadTask{full, partial, absent} {
		publishTask(t, p, task)
	}

	g0, g1 := decode.model.Groups[0].BytesPerBlock, decode.model.Groups[1].BytesPerBlock
	assertLoadResult(t, rs.wait(t, full.TaskID), decode, full, nil, 3*g0+g1)
	for i, b := range []kvcore.BlockID{1, 2, 3} {
		decode.assertBlock(t, 0, b, hashes[i], src[kvcore.BlockID(10+i)].Data, "not the prefill worker's block")
	}
	decode.assertBlock(t, 1, 4, hashes[2], src[13].Data, "not the prefill worker's block")
	assertLoadResult(t, rs.wait(t, partial.TaskID), decode, partial, []kvcore.BlockID{5}, 3*g0)
	decode.assertBlock(t, 1, 5, prev[5].Hash, prev[5].Data, "a block without a remote source changed")
	assertLoadResult(t, rs.wait(t, absent.TaskID), decode, absent, []kvcore.BlockID{1, 2, 3, 9}, 0)
}

// TestLoadWithStoreDownReportsEveryBlock stops the store before a load: the
// whole batch fails, every block is a load error, and the result still comes.
func TestLoadWithStoreDownReportsEveryBlock(t *testing.T) {
	t.Parallel()
	rds := testenv.StartRedis(t)
	env := servicetest.NewEnv(t)
	cfg := testConfig(env, "engine-nostore")
	cfg.RedisURL = rds.URL()
	w := startWorker(t, cfg, nil)
	rs := watchResults(t, env)
	rds.Stop()
	task := w.loadTask(hexChain(w.model, tokens(48, 700)), 48, kvcore.BlockTable{{1, 2, 3}, {kvcore.NullBlock, kvcore.NullBlock, 4}})
	publishTask(t, publisher(t, env), task)
	assertLoadResult(t, rs.wait(t, task.TaskID), w, task, []kvcore.BlockID{1, 2, 3, 4}, 0)
	waitMetric(t, w, `kvmesh_store_failed_keys_total{op="load_get",status="unavailable"} 4`)
}

// TestUndecodableTaskIsDeadLetteredAndConsumingGoesOn sends garbage and a
// task without its schema keyed to this engine, then a valid task: the bad
// records are dead-lettered (counted) and the valid one is still answered.
func TestUndecodableTaskIsDeadLetteredAndConsumingGoesOn(t *testing.T) {
	t.Parallel()
	env := servicetest.NewEnv(t)
	w := startWorker(t, testConfig(env, "engine-garbage"), nil)
	rs := watchResults(t, env)
	p := publisher(t, env)
	noSchema := w.loadTask(hexChain(w.model, tokens(16, 800)), 16, kvcore.BlockTable{{1}, {2}})
	noSchema.Schema = ""
	for _, v := range [][]byte{[]byte("\x00not json"), mustJSON(t, noSchema)} {
		if err := p.Publish(context.Background(), bus.Message{Topic: contract.TopicLoadTasks, Key: w.cfg.EngineID, Value: v}); err != nil {
			t.Fatal(err)
		}
	}
	good := w.loadTask(hexChain(w.model, tokens(16, 800)), 16, kvcore.BlockTable{{1}, {2}})
	publishTask(t, p, good)
	assertLoadResult(t, rs.wait(t, good.TaskID), w, good, []kvcore.BlockID{1, 2}, 0)
	waitMetric(t, w, `kvmesh_gpuworker_loads_total{outcome="dead_lettered"} 2`)
	if got := rs.find(noSchema.TaskID); len(got) != 0 {
		t.Fatalf("an invalid task was answered: %+v", got)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
