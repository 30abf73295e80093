package sim

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvmesh/kvmesh/pkg/contract"
	"github.com/kvmesh/kvmesh/pkg/dataplane"
	"github.com/kvmesh/kvmesh/pkg/kvcore"
)

func blockKey(group int, b kvcore.BlockID) dataplane.BlockRef {
	return dataplane.BlockRef{Group: group, Block: b}
}

// loadingRequest is an admitted request of 40 tokens whose load of [0,32)
// every rank's worker already holds (the right bytes of its namespace).
func loadingRequest(t *testing.T, e *engine, ws []*memWorker) *request {
	t.Helper()
	r := testRequest(e, "run-1", 40, 0)
	if !e.allocate(r, 40, 0, 32) {
		t.Fatal("allocate failed")
	}
	r.admitted = true
	r.load = &expectedLoad{connector: "store", start: 0, end: 32, groups: e.model.LoadGroups(0, 32)}
	r.phase = phaseLoading
	for _, gc := range r.load.groups {
		for _, c := range gc.Chunks {
			hi := c.HashIndex(e.model.HashBlockSize)
			b := r.table[gc.Group][c.BlockIndex(e.model.Groups[gc.Group].BlockSize)]
			for _, w := range ws {
				w.blocks[blockKey(gc.Group, b)] = memBlock{hash: r.hexes[hi], data: BlockContent(e.model, gc.Group, w.rank, r.hashes[hi])}
			}
		}
	}
	return r
}

// loadedBlocks counts the chunks of a request's load.
func loadedBlocks(r *request) int {
	n := 0
	for _, gc := range r.load.groups {
		n += len(gc.Chunks)
	}
	return n
}

// TestRanksWriteTheirOwnBytes: at TP2 a computed block is written to both
// ranks' gpuworkers, each with the bytes of its own namespace: the MLA
// group's are the same on both ranks, the linear-attention state's differ.
func TestRanksWriteTheirOwnBytes(t *testing.T) {
	m := tpModel(t, 2)
	ws := startMemWorkers(t, m, "e")
	e := rankEngine(t, m, ws, time.Second)
	r := testRequest(e, "run-1", 40, 0)
	if !e.allocate(r, 40, 0, 0) {
		t.Fatal("allocate failed")
	}
	todo := e.completed(r, 0, 32)
	if err := e.write(context.Background(), todo); err != nil {
		t.Fatal(err)
	}
	for _, cb := range todo {
		a, b := ws[0].held(cb.group, cb.block), ws[1].held(cb.group, cb.block)
		if !bytes.Equal(a, BlockContent(m, cb.group, ws[0].rank, cb.hash)) || !bytes.Equal(b, BlockContent(m, cb.group, ws[1].rank, cb.hash)) {
			t.Fatalf("group %d block %d: a rank holds other bytes than its namespace's", cb.group, cb.block)
		}
		if same := bytes.Equal(a, b); same != (m.Groups[cb.group].Kind == kvcore.KindMLA) {
			t.Fatalf("group %d (%s): ranks hold the same bytes: %v", cb.group, m.Groups[cb.group].Kind, same)
		}
		if _, ok := e.pool.cached(cb.group, cb.key); !ok {
			t.Fatalf("group %d block %d not in the prefix cache after the write", cb.group, cb.block)
		}
	}
	for _, rw := range e.ranks {
		if rw.blocksWritten != len(todo) || rw.bytesWritten == 0 {
			t.Fatalf("rank %s: %d blocks written, want %d", rw.label(), rw.blocksWritten, len(todo))
		}
	}
}

// TestRanksVerifyEveryCopy: a loaded block is read back from every rank;
// a copy wrong on one rank is a mismatch of that rank, and the block is
// recomputed on every rank.
func TestRanksVerifyEveryCopy(t *testing.T) {
	m := tpModel(t, 2)
	ws := startMemWorkers(t, m, "e")
	e := rankEngine(t, m, ws, time.Second)
	r := loadingRequest(t, e, ws)
	bad := blockKey(1, r.table[1][1]) // the linear-attention state at 32
	ws[1].corrupt[bad] = 1
	if err := e.loaded(context.Background(), newOutbox(), r, contract.EngineFeedback{}); err != nil {
		t.Fatal(err)
	}
	n := loadedBlocks(&request{load: &expectedLoad{groups: m.LoadGroups(0, 32)}})
	st := e.stats
	if st.mismatchedBlocks != 1 || st.verifiedBlocks != 2*n || r.failure != "" || r.phase != phaseAllocated {
		t.Fatalf("mismatched %d, verified %d (want 1, %d), failure %q, phase %v", st.mismatchedBlocks, st.verifiedBlocks, 2*n, r.failure, r.phase)
	}
	if st.mismatches[0].Rank != ws[1].rank.String() || e.ranks[0].mismatched != 0 || e.ranks[1].mismatched != 1 {
		t.Fatalf("mismatch %+v; per rank %d, %d", st.mismatches[0], e.ranks[0].mismatched, e.ranks[1].mismatched)
	}
	for _, w := range ws {
		if w.writes != 1 || !bytes.Equal(w.held(1, r.table[1][1]), BlockContent(m, 1, w.rank, r.hashes[1])) {
			t.Fatalf("rank %s: %d writes; the mismatched block must be recomputed on every rank", w.rank, w.writes)
		}
	}
}

// TestDeadRankFailsItsRequests: a rank whose gpuworker answers nothing for
// the rank timeout is dead: the loaded blocks are not verified on it (never
// counted right), the loading request fails naming the rank, and the
// engine's next request fails at once, without waiting again.
func TestDeadRankFailsItsRequests(t *testing.T) {
	m := tpModel(t, 2)
	ws := startMemWorkers(t, m, "e")
	e := rankEngine(t, m, ws, 300*time.Millisecond)
	r := loadingRequest(t, e, ws)
	ws[1].down.Store(true)
	out := newOutbox()
	if err := e.loaded(context.Background(), out, r, contract.EngineFeedback{}); err != nil {
		t.Fatal(err)
	}
	n := loadedBlocks(&request{load: &expectedLoad{groups: m.LoadGroups(0, 32)}})
	dead, st := e.ranks[1], e.stats
	if e.deadRank() != dead || dead.unverified != n || st.unverifiedBlocks != n || st.verifiedBlocks != n || e.ranks[0].verified != n {
		t.Fatalf("dead %v, unverified %d/%d, verified %d: want rank 1 dead, %d unverified, %d verified on rank 0", e.deadRank(), dead.unverified, st.unverifiedBlocks, st.verifiedBlocks, n, n)
	}
	if !strings.Contains(r.failure, "rank tp1-pcp0-dcp0-pp0 of engine e is dead") || r.deadRank != "e/tp1-pcp0-dcp0-pp0" || dead.failedRequests != 1 {
		t.Fatalf("failure %q, dead rank %q, failed %d", r.failure, r.deadRank, dead.failedRequests)
	}
	if evs := out.of(r); r.phase != phaseFinishing || len(evs) != 1 || evs[0].Kind != contract.EventFinished {
		t.Fatalf("phase %v, events %+v: the request is finished so its blocks are freed", r.phase, evs)
	}
	for _, gc := range m.LoadGroups(0, 32) {
		for _, c := range gc.Chunks {
			if _, ok := e.pool.cached(gc.Group, e.chunkKey(r, c)); ok {
				t.Fatalf("group %d chunk %v entered the prefix cache unverified", gc.Group, c)
			}
		}
	}
	next := testRequest(e, "run-2", 40, 100)
	start := time.Now()
	if !e.admit(context.Background(), newOutbox(), next) || next.deadRank == "" || time.Since(start) > 100*time.Millisecond {
		t.Fatalf("next request: failure %q after %v; want it failed at once", next.failure, time.Since(start))
	}
	if dead.failedRequests != 2 {
		t.Fatalf("%d requests counted against the dead rank, want 2", dead.failedRequests)
	}
}

// TestDeadRankStopsWrites: a write a rank never answers makes it dead and
// registers nothing; later writes skip the dead rank at once.
func TestDeadRankStopsWrites(t *testing.T) {
	m := tpModel(t, 2)
	ws := startMemWorkers(t, m, "e")
	e := rankEngine(t, m, ws, 200*time.Millisecond)
	ws[0].down.Store(true)
	r := testRequest(e, "run-1", 40, 0)
	if !e.allocate(r, 40, 0, 0) {
		t.Fatal("allocate failed")
	}
	todo := e.completed(r, 0, 32)
	if err := e.write(context.Background(), todo); err != nil {
		t.Fatal(err)
	}
	if e.deadRank() != e.ranks[0] || e.ranks[0].dead == nil || e.ranks[1].blocksWritten != len(todo) {
		t.Fatalf("dead %v, rank 1 wrote %d", e.deadRank(), e.ranks[1].blocksWritten)
	}
	if _, ok := e.pool.cached(todo[0].group, todo[0].key); ok {
		t.Fatal("a block a dead rank did not get entered the prefix cache")
	}
	start := time.Now()
	if err := e.write(context.Background(), todo); err != nil || time.Since(start) > 100*time.Millisecond || ws[1].writes != 1 {
		t.Fatalf("write with a dead rank: %v after %v, %d writes on the live rank", err, time.Since(start), ws[1].writes)
	}
}

// TestWorkersCheckRanks: every engine names one gpuworker per rank, in
// worker-rank order, all of one engine id and of the simulator's layout;
// anything else is a config error naming the worker and what is wrong. The
// pool is the smallest of every rank's.
func TestWorkersCheckRanks(t *testing.T) {
	m := tpModel(t, 2)
	ws := startMemWorkers(t, m, "decode-0")
	other := startMemWorkers(t, m, "decode-1")
	tp1 := startMemWorkers(t, tpModel(t, 1), "decode-0")
	cfg := func(urls ...string) Config {
		return Config{Model: m, Workload: testWorkload(), Brokers: []string{"127.0.0.1:1"}, LookupURL: "http://127.0.0.1:1",
			Engine: EngineConfig{MaxBatchTokens: 64, MaxRunning: 2, Watermark: 1}, Decode: Endpoint{WorkerURLs: urls}}
	}
	c := cfg(workerURLs(ws)...)
	if err := c.defaults(); err != nil {
		t.Fatal(err)
	}
	if err := c.workers(context.Background()); err != nil || c.Fleet[0].Decode.EngineID != "decode-0" || c.Engine.PoolBlocks != 48 {
		t.Fatalf("workers: %v, engine %q, pool %d", err, c.Fleet[0].Decode.EngineID, c.Engine.PoolBlocks)
	}
	for name, tc := range map[string]struct {
		urls []string
		want string
	}{
		"ranks swapped":    {[]string{ws[1].url, ws[0].url}, "is rank tp1-pcp0-dcp0-pp0, expected tp0-pcp0-dcp0-pp0 of engine decode-0"},
		"two engines":      {[]string{ws[0].url, other[1].url}, `holds engine "decode-1", not "decode-0"`},
		"another TP":       {[]string{tp1[0].url, ws[1].url}, "KVMESH_TP"},
		"one URL, 2 ranks": {[]string{ws[0].url}, "1 gpuworker URLs for the model's 2 worker ranks"},
	} {
		c := cfg(tc.urls...)
		err := c.defaults()
		if err == nil {
			err = c.workers(context.Background())
		}
		if !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) || (name != "one URL, 2 ranks" && !strings.Contains(err.Error(), "gpuworker http://")) {
			t.Errorf("%s: %v; want ErrConfig saying %q", name, err, tc.want)
		}
	}
}

// TestScrapeWorkerMetrics: the report's counters are read from a worker's
// /metrics, the load-time histogram only when the worker has it.
func TestScrapeWorkerMetrics(t *testing.T) {
	text := `# TYPE kvmesh_store_bytes_total counter
kvmesh_store_bytes_total{op="load_get"} 5
kvmesh_store_bytes_total{op="save_put"} 1234
# TYPE kvmesh_gpuworker_load_bytes_total counter
kvmesh_gpuworker_load_bytes_total 4096
# TYPE kvmesh_gpuworker_load_duration_seconds histogram
kvmesh_gpuworker_load_duration_seconds_bucket{connector="store",le="+Inf"} 3
kvmesh_gpuworker_load_duration_seconds_sum{connector="store"} 1.5
kvmesh_gpuworker_load_duration_seconds_count{connector="store"} 3
kvmesh_gpuworker_load_duration_seconds_bucket{connector="pd",le="+Inf"} 1
kvmesh_gpuworker_load_duration_seconds_sum{connector="pd"} 0.25
kvmesh_gpuworker_load_duration_seconds_count{connector="pd"} 1
`
	w, err := parseWorkerMetrics([]byte(text))
	if err != nil {
		t.Fatal(err)
	}
	if w != (workerMetrics{savePutBytes: 1234, loadBytes: 4096, loadSeconds: 1.75, hasLoadSeconds: true}) {
		t.Fatalf("metrics %+v", w)
	}
	w, err = parseWorkerMetrics([]byte("kvmesh_gpuworker_load_bytes_total 7\n"))
	if err != nil || w != (workerMetrics{loadBytes: 7}) {
		t.Fatalf("without the histogram: %+v, %v", w, err)
	}
	ws := startMemWorkers(t, tpModel(t, 1), "e")
	ws[0].saved = 99
	if w, err := scrapeWorker(context.Background(), http.DefaultClient, ws[0].url); err != nil || w.savePutBytes != 99 || w.hasLoadSeconds {
		t.Fatalf("scrape: %+v, %v", w, err)
	}
}

// TestRejectedWriteIsAnError: a write a rank refuses as invalid (4xx) is a
// simulator bug: an error, not a dead rank.
func TestRejectedWriteIsAnError(t *testing.T) {
	m := tpModel(t, 2)
	ws := startMemWorkers(t, m, "e")
	e := rankEngine(t, m, ws, time.Second)
	r := testRequest(e, "run-1", 40, 0)
	if !e.allocate(r, 40, 0, 0) {
		t.Fatal("allocate failed")
	}
	todo := e.completed(r, 0, 32)
	todo[0].key = "" // a block without an identity: refused before anything is sent
	err := e.write(context.Background(), todo)
	if err == nil || e.deadRank() != nil || !strings.Contains(err.Error(), "engine e rank tp0-pcp0-dcp0-pp0: write") {
		t.Fatalf("write: %v, dead %v; want an error naming the rank and no dead rank", err, e.deadRank())
	}
}
