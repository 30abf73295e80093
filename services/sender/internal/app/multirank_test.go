package app_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/internal/servicetest"
	"github.com/kvmesh/kvmesh/internal/testenv"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
	"github.com/kvmesh/kvmesh/pkg/registry"
)

// tp2Spec is hybrid-mla-linear at TP2 with small blocks: the MLA group has
// one namespace (tp_rank:0) whose chunks the two ranks stripe, the Mamba
// group one namespace per rank.
const tp2Spec = `
name: hybrid-mla-linear-tp2-test
hash_block_size: 16
groups:
  - {kind: mla, block_size: 16, bytes_per_block: 4096}
  - {kind: mamba, block_size: 16, bytes_per_block: 2048}
parallel: {tp: 2}
`

// tp2Model writes tp2Spec to a file for KVMESH_MODEL.
func tp2Model(t testing.TB) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "tp2.yaml")
	if err := os.WriteFile(path, []byte(tp2Spec), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// startRankWorker runs the real gpuworker binary as rank r of engine and
// waits until that rank is registered and ready.
func (s *stack) startRankWorker(t testing.TB, engine string, r kvcore.Rank) *dataplane.Client {
	t.Helper()
	env := s.workerEnv(engine)
	env["KVMESH_RANK_TP"], env["KVMESH_RANK_PCP"], env["KVMESH_RANK_DCP"], env["KVMESH_RANK_PP"] = itoa(r.TP), itoa(r.PCP), itoa(r.DCP), itoa(r.PP)
	startProcess(t, testenv.BuildBinary(t, "./services/gpuworker"), env)
	var addr string
	poll(t, "gpuworker "+engine+" rank "+r.String()+" registered", func() bool {
		w, err := registry.FindRank(context.Background(), s.db, engine, r, time.Minute)
		addr = w.Addr
		return err == nil
	})
	servicetest.WaitReady(t, strings.TrimPrefix(addr, "http://"))
	hc := dataplane.DefaultHTTPClient()
	t.Cleanup(hc.CloseIdleConnections)
	return dataplane.NewClient(addr, hc)
}

// writeRankBlocks writes fresh random bytes, different on every rank, into
// every block of the task's table in each rank's pool, as the content of
// the chunk the block holds; it returns them by rank and "group/block".
func (s *stack) writeRankBlocks(t testing.TB, task *kvcore.SaveTask, workers map[kvcore.Rank]*dataplane.Client) map[kvcore.Rank]map[string][]byte {
	t.Helper()
	out := map[kvcore.Rank]map[string][]byte{}
	for r, w := range workers {
		out[r] = map[string][]byte{}
		var blocks []dataplane.Block
		for g, ids := range task.BlockTable {
			for i, b := range ids {
				data := make([]byte, s.model.Groups[g].BytesPerBlock)
				_, _ = rand.Read(data)
				blocks = append(blocks, dataplane.Block{BlockRef: dataplane.BlockRef{Group: g, Block: b},
					Identity: dataplane.Identity{Hash: s.blockHash(task, g, i), RequestID: task.RequestID}, Data: data})
				out[r][blockKey("", g, b)] = data
			}
		}
		if err := w.Write(context.Background(), blocks); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// rankItems lists what worker rank r writes of every group of task.
func (s *stack) rankItems(t testing.TB, task *kvcore.SaveTask, r kvcore.Rank) []kvcore.TransferItem {
	t.Helper()
	kb := kvcore.KeysOf(s.model).WithPrefix(s.prefix)
	var out []kvcore.TransferItem
	for _, gc := range task.Groups {
		items, err := kvcore.PlanSend(s.model, kb, task, gc.Group, r)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, items...)
	}
	return out
}

// storedFrom reports whether the store holds, under it.Key, exactly the
// bytes written into rank r's block of it (want); a missing key is false.
func (s *stack) storedFrom(t testing.TB, it kvcore.TransferItem, want []byte) bool {
	t.Helper()
	vals, errs, err := s.store.Get(context.Background(), []string{it.Key})
	if err != nil {
		t.Fatal(err)
	}
	if errs[0] != nil {
		return false
	}
	payload, err := dataplane.DecodeValue(s.model.Fingerprint(), vals[0])
	if err != nil {
		t.Fatalf("key %s: %v", it.Key, err)
	}
	return bytes.Equal(payload, want)
}

// TestTP2EveryKeyStoredOnceThroughItsRanksWorker runs both ranks of a TP2
// engine as real gpuworkers whose pools hold different bytes: a 64-token
// save stores the four MLA chunks into tp_rank:0, two from each rank, and
// each rank's Mamba state into its own namespace, every key with the bytes
// of the rank that writes it, once.
func TestTP2EveryKeyStoredOnceThroughItsRanksWorker(t *testing.T) {
	s := newStack(t, stackOptions{modelFile: tp2Model(t)})
	const engine = "tp2-engine"
	workers := map[kvcore.Rank]*dataplane.Client{}
	for _, r := range s.model.WorkerRanks() {
		workers[r] = s.startRankWorker(t, engine, r)
	}
	task := s.task(t, engine, "tp2", 0, 64, 1) // no worker under s.workers: writes nothing
	written := s.writeRankBlocks(t, task, workers)
	s.publish(t, task)

	res := s.got.result(t, task.TaskID)
	if res.Status != "stored" || groupOf(res, 0).Stored != 4 || groupOf(res, 1).Stored != 2 {
		t.Fatalf("result %+v, want 4 MLA chunks and 2 Mamba states stored", res)
	}
	seen := map[string]kvcore.Rank{}
	for _, r := range s.model.WorkerRanks() {
		items := s.rankItems(t, task, r)
		if len(items) != 3 {
			t.Fatalf("rank %s writes %d keys, want 2 MLA chunks and its Mamba state", r, len(items))
		}
		for _, it := range items {
			if prev, dup := seen[it.Key]; dup {
				t.Fatalf("key %s planned for ranks %s and %s", it.Key, prev, r)
			}
			seen[it.Key] = r
			if it.Group == 0 && !strings.Contains(it.Key, "@tp_rank:0@") {
				t.Errorf("MLA key %s outside tp_rank:0", it.Key)
			}
			if !s.storedFrom(t, it, written[r][blockKey("", it.Group, it.Block)]) {
				t.Errorf("key %s (group %d block %d) does not hold rank %s's bytes", it.Key, it.Group, it.Block, r)
			}
		}
	}
	for g, n := range map[int]int{0: 4, 1: 2} {
		if ev := s.got.blockStored(t, task.RequestID, g, n); len(ev.Keys) != n {
			t.Errorf("group %d BlockStored lists %d keys, want %d", g, len(ev.Keys), n)
		}
	}
}

// TestTP2RankWithoutWorkerIsDeadLetteredNamingIt runs only rank 0's
// gpuworker of a TP2 engine: rank 1's MLA chunks and Mamba state are
// dead-lettered put_failed (one per group, naming rank tp1), rank 0's keys
// are stored, and the task's result is published.
func TestTP2RankWithoutWorkerIsDeadLetteredNamingIt(t *testing.T) {
	s := newStack(t, stackOptions{modelFile: tp2Model(t)})
	const engine = "tp2-half"
	live, lost := kvcore.Rank{}, kvcore.Rank{TP: 1}
	workers := map[kvcore.Rank]*dataplane.Client{live: s.startRankWorker(t, engine, live)}
	task := s.task(t, engine, "half", 0, 64, 1)
	written := s.writeRankBlocks(t, task, workers)
	s.publish(t, task)

	res := s.got.result(t, task.TaskID)
	g0, g1 := groupOf(res, 0), groupOf(res, 1)
	if res.Status != "failed" || g0.Stored != 2 || g0.Failed != 2 || g1.Stored != 1 || g1.Failed != 1 || g0.Reason != "put_failed" {
		t.Fatalf("result %+v, want rank 0's keys stored and rank 1's failed", res)
	}
	dls := s.got.deadLetters(t, task.TaskID, 2)
	if len(dls) != 2 {
		t.Fatalf("%d dead letters, want one per group: %+v", len(dls), dls)
	}
	for _, d := range dls {
		if d.Reason != "put_failed" || d.Group == nil || !strings.HasPrefix(d.Detail, "rank tp1-pcp0-dcp0-pp0: ") ||
			!strings.Contains(d.Detail, "no live gpuworker") {
			t.Errorf("dead letter %+v, want put_failed naming rank %s", d, lost)
		}
	}
	for _, it := range s.rankItems(t, task, live) {
		if !s.storedFrom(t, it, written[live][blockKey("", it.Group, it.Block)]) {
			t.Errorf("rank 0's key %s is not stored", it.Key)
		}
	}
	var lostKeys []string
	for _, it := range s.rankItems(t, task, lost) {
		lostKeys = append(lostKeys, it.Key)
	}
	if n := s.missing(t, lostKeys); n != len(lostKeys) {
		t.Errorf("%d of rank 1's %d keys are in the store, want none", len(lostKeys)-n, len(lostKeys))
	}
}
